"""The two file formats that are the contract between the commands: ``hsd-profile/1`` and ``hsd-plan/1``.

Plain dataclasses, plain functions. ``load_profile``/``load_plan`` validate and raise
:class:`~hsd_opt.errors.InputFileError` naming the file and the field; ``profile_from_dict``/``plan_from_dict``
do the same for in-memory dicts (``source`` names them in messages).

Units: every cost is in seconds (wall time); acceptance rates are probabilities in [0, 1]; budgets are tokens.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from hsd_opt.errors import InputFileError
from hsd_opt.jsonio import read_json, write_json

PROFILE_FORMAT = "hsd-profile/1"
PLAN_FORMAT = "hsd-plan/1"

#: Drafter kinds the project knows. Unknown kinds are accepted (other tools may add their own).
KNOWN_KINDS = ("target", "early_exit", "model", "quantized", "ngram_context", "bigram_model", "aded", "mixed_ngram")


@dataclass
class ModelEntry:
    """One drafter (or the target) in a profile.

    Attributes:
        name: unique name used as key everywhere (``"layer8"``, ``"ngram"``, ``"layer30"``).
        kind: one of :data:`KNOWN_KINDS` (others allowed).
        cost: seconds for one forward step of one token with a warm cache.
        can_verify: whether it yields next-token distributions for given positions (n-gram drafters cannot;
            they may only be the bottom level of a hierarchy).
        layer: for ``early_exit``/``target`` of a layered model, the number of decoder layers run (1-based).
        extra: any other fields of the entry, kept on round-trip.
        draft_rate: share of the calls in which it proposes a block, in (0, 1]; below 1 only for a drafter that
            cannot verify and abstains where it has no confident guess (its ``acceptance`` is then measured over
            the positions where it proposes). Written only when below 1.
    """

    name: str
    kind: str
    cost: float
    can_verify: bool
    layer: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    draft_rate: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "kind": self.kind, "cost": self.cost, "can_verify": self.can_verify}
        if self.layer is not None:
            d["layer"] = self.layer
        if self.draft_rate < 1.0:
            d["draft_rate"] = self.draft_rate
        d.update(self.extra)
        return d


@dataclass
class ContextCosts:
    """Costs measured with ``context`` tokens already in the KV cache (one entry of ``context_costs``).

    Attributes:
        context: tokens in the cache before the timed pass (>= 1).
        cost: model -> seconds of one decode step (one token) at that context.
        cost_curve: model -> ``[s_1, ..., s_n]`` seconds of a pass over t = 1..n tokens at that context.
        verify_cost: verifier -> drafter -> seconds (or a curve over t) of a verify pass at that context.

    A model (or pair) listed here takes its cost from here, interpolated in the context
    (``docs/design.md#costs-that-depend-on-the-context``); the top-level figures are then only what a reader
    that ignores ``context_costs`` uses.
    """

    context: int
    cost: dict[str, float] = field(default_factory=dict)
    cost_curve: dict[str, list[float]] = field(default_factory=dict)
    verify_cost: dict[str, dict[str, float | list[float]]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"context": self.context, "cost": self.cost}
        if self.cost_curve:
            d["cost_curve"] = self.cost_curve
        if self.verify_cost:
            d["verify_cost"] = self.verify_cost
        return d


@dataclass
class Profile:
    """Measured acceptance rates and costs of a drafter pool for one target (``hsd-profile/1``).

    Attributes:
        target: name of the target entry in ``models``.
        models: the pool, cheapest first by convention (the solver orders by ``cost`` itself).
        acceptance: ``acceptance[drafter][verifier]`` in [0, 1]; a missing pair means "not measured" and the
            solver then never puts ``drafter`` directly under ``verifier``.
        verify_cost: optional ``verify_cost[verifier][drafter]``: seconds for ``verifier`` to verify a block
            drafted by ``drafter`` (a number), or a list ``[s_1, ..., s_n]`` of seconds for a verify pass over
            t = 1..n tokens (a block of l drafts is a pass over t = l + 1 tokens). Used in place of
            ``cost[verifier]`` on that edge (activation reuse between exits of one model).
        cost_curve: optional ``cost_curve[verifier] = [s_1, ..., s_n]``: seconds for one forward pass over
            t = 1..n tokens at once (verifying t tokens is not always as cheap as one step;
            ``docs/design.md#costs-of-a-pass-over-t-tokens``).
        extra: every other top-level field (provenance, greedy agreement, counts, confidence intervals, ...),
            kept on round-trip.
        context_costs: optional costs measured at several context lengths, in increasing context order
            (:class:`ContextCosts`); empty for a profile measured at one context. The solver interpolates them
            linearly in the context (``docs/design.md#costs-that-depend-on-the-context``).
    """

    target: str
    models: list[ModelEntry]
    acceptance: dict[str, dict[str, float]]
    verify_cost: dict[str, dict[str, float | list[float]]] = field(default_factory=dict)
    cost_curve: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    context_costs: list[ContextCosts] = field(default_factory=list)

    @property
    def contexts(self) -> list[int]:
        """The context lengths (tokens) of ``context_costs``, increasing; empty for a single-context profile."""
        return [c.context for c in self.context_costs]

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.models]

    def entry(self, name: str) -> ModelEntry:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def accept(self, drafter: str, verifier: str) -> float | None:
        """``acceptance[drafter][verifier]`` or ``None`` when not measured. A model always accepts itself (1.0)."""
        if drafter == verifier:
            return 1.0
        return self.acceptance.get(drafter, {}).get(verifier)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"format": PROFILE_FORMAT, "target": self.target,
                             "models": [m.to_dict() for m in self.models],
                             "acceptance": self.acceptance}
        if self.verify_cost:
            d["verify_cost"] = self.verify_cost
        if self.cost_curve:
            d["cost_curve"] = self.cost_curve
        if self.context_costs:
            d["context_costs"] = [c.to_dict() for c in self.context_costs]
        for k, v in self.extra.items():
            if k not in d:
                d[k] = v
        return d

    def fingerprint(self) -> str:
        """SHA-256 of the canonical JSON of the profile (for plans to record which profile they came from)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


@dataclass
class Plan:
    """A solved hierarchy (``hsd-plan/1``).

    Attributes:
        tmax: the largest budget allowed when solving (tokens).
        hierarchy: model names, cheapest (bottom, drafts autoregressively) first, target last.
        budgets: ``budgets[i]`` = T_i, tokens level i hands upward per call; ``len(budgets) == len(hierarchy) - 1``;
            non-decreasing, each in 1..tmax.
        expected_latency: predicted seconds per generated token.
        expected_speedup: target cost / expected_latency.
        baselines: ``{"target_only": {...}, "best_single_draft": {...}, "best_early_exit": {...}}`` each with
            ``expected_latency`` (best_early_exit: the best two-level plan whose drafter is an early exit).
        extra: every other field (target, solver, alternatives, profile provenance, the optional ``by_task``
            section of plans per task), kept on round-trip.
    """

    tmax: int
    hierarchy: list[str]
    budgets: list[int]
    expected_latency: float
    expected_speedup: float
    baselines: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def target(self) -> str:
        return self.hierarchy[-1]

    @property
    def tasks(self) -> list[str]:
        """Tasks with their own plan in the ``by_task`` section (sorted; empty without one)."""
        return sorted(self.extra.get("by_task") or {})

    def for_task(self, task: str | None) -> tuple[list[str], list[int], float, str]:
        """``(hierarchy, budgets, expected_latency, which)`` to run a prompt of ``task`` with: the ``by_task``
        entry of the task when the plan has one (``which = "by_task.<task>"``), else the plan itself
        (``which = "plan"``; also for ``task=None``, an unknown task)."""
        e = (self.extra.get("by_task") or {}).get(task) if task is not None else None
        if e:
            return list(e["hierarchy"]), list(e["budgets"]), float(e["expected_latency"]), f"by_task.{task}"
        return list(self.hierarchy), list(self.budgets), self.expected_latency, "plan"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"format": PLAN_FORMAT, "tmax": self.tmax, "hierarchy": list(self.hierarchy),
                             "budgets": list(self.budgets), "expected_latency": self.expected_latency,
                             "expected_speedup": self.expected_speedup, "baselines": self.baselines}
        for k, v in self.extra.items():
            if k not in d:
                d[k] = v
        return d


# ----------------------------------------------------------------------------------------------- validation


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _positive_curve(source: str, fieldname: str, v: Any) -> list[float]:
    if not isinstance(v, list) or not v:
        raise InputFileError(source, "expected a non-empty list of seconds for t = 1..n tokens", fieldname)
    out = []
    for i, s in enumerate(v):
        if not _is_number(s) or s <= 0:
            raise InputFileError(source, f"expected a cost in seconds > 0, got {s!r}", f"{fieldname}[{i}]")
        out.append(float(s))
    return out


def profile_from_dict(d: Any, source: str = "<profile>") -> tuple[Profile, list[str]]:
    """Validate a parsed ``hsd-profile/1`` object. Returns the profile and a list of warnings.

    Refused (``InputFileError`` naming ``source`` and the field): wrong ``format``, no or duplicate models,
    a missing target, a cost that is not a number > 0, an acceptance outside [0, 1] or naming an unknown
    model, a target that cannot verify. Warned, not refused: an acceptance triple that breaks the
    triangle bound a[i][j] + a[j][k] <= a[i][k] + 1 (HSD paper, arXiv 2510.19705, App. B.3), beyond a 0.02
    tolerance for noise.
    """
    if not isinstance(d, dict):
        raise InputFileError(source, "expected a JSON object")
    fmt = d.get("format")
    if fmt != PROFILE_FORMAT:
        raise InputFileError(source, f"expected {PROFILE_FORMAT!r}, got {fmt!r}", "format")
    models_raw = d.get("models")
    if not isinstance(models_raw, list) or not models_raw:
        raise InputFileError(source, "expected a non-empty list of models", "models")
    models: list[ModelEntry] = []
    seen: set[str] = set()
    for i, m in enumerate(models_raw):
        f = f"models[{i}]"
        if not isinstance(m, dict):
            raise InputFileError(source, "expected an object", f)
        name = m.get("name")
        if not isinstance(name, str) or not name:
            raise InputFileError(source, "expected a non-empty string", f + ".name")
        if name in seen:
            raise InputFileError(source, f"duplicate model name {name!r}", f + ".name")
        seen.add(name)
        kind = m.get("kind", "model")
        if not isinstance(kind, str):
            raise InputFileError(source, "expected a string", f + ".kind")
        cost = m.get("cost")
        if not _is_number(cost) or cost <= 0:
            raise InputFileError(source, f"expected a cost in seconds > 0, got {cost!r}", f + ".cost")
        can_verify = m.get("can_verify", True)
        if not isinstance(can_verify, bool):
            raise InputFileError(source, f"expected true or false, got {can_verify!r}", f + ".can_verify")
        layer = m.get("layer")
        if layer is not None and (not isinstance(layer, int) or isinstance(layer, bool) or layer < 0):
            raise InputFileError(source, f"expected a layer index >= 0, got {layer!r}", f + ".layer")
        rate = m.get("draft_rate", 1.0)
        if not _is_number(rate) or not 0.0 < rate <= 1.0:
            raise InputFileError(source, f"expected a share of calls in (0, 1], got {rate!r}", f + ".draft_rate")
        if rate < 1.0 and can_verify:
            raise InputFileError(source, "below 1 only for a drafter that cannot verify (can_verify: false)",
                                 f + ".draft_rate")
        extra = {k: v for k, v in m.items() if k not in ("name", "kind", "cost", "can_verify", "layer", "draft_rate")}
        models.append(ModelEntry(name, kind, float(cost), can_verify, layer, extra, float(rate)))
    target = d.get("target")
    if not isinstance(target, str) or not target:
        raise InputFileError(source, "missing: expected the name of the target model", "target")
    if target not in seen:
        raise InputFileError(source, f"{target!r} is not among models ({', '.join(sorted(seen))})", "target")
    if not next(m for m in models if m.name == target).can_verify:
        raise InputFileError(source, "the target must be able to verify (can_verify: true)", "target")

    acc_raw = d.get("acceptance", {})
    if not isinstance(acc_raw, dict):
        raise InputFileError(source, "expected an object acceptance[drafter][verifier]", "acceptance")
    acceptance: dict[str, dict[str, float]] = {}
    for dr, row in acc_raw.items():
        if dr not in seen:
            raise InputFileError(source, f"unknown drafter {dr!r}", f"acceptance.{dr}")
        if not isinstance(row, dict):
            raise InputFileError(source, "expected an object {verifier: rate}", f"acceptance.{dr}")
        acceptance[dr] = {}
        for ve, a in row.items():
            f = f"acceptance.{dr}.{ve}"
            if ve not in seen:
                raise InputFileError(source, f"unknown verifier {ve!r}", f)
            if not _is_number(a) or not 0.0 <= a <= 1.0:
                raise InputFileError(source, f"expected an acceptance rate in [0, 1], got {a!r}", f)
            acceptance[dr][ve] = float(a)

    verify_cost = _verify_costs(source, d.get("verify_cost", {}) or {}, seen, "verify_cost")
    cost_curve = _cost_curves(source, d.get("cost_curve", {}) or {}, seen, "cost_curve")
    context_costs = _context_costs(source, d.get("context_costs"), seen)

    known = {"format", "target", "models", "acceptance", "verify_cost", "cost_curve", "context_costs"}
    extra = {k: v for k, v in d.items() if k not in known}
    prof = Profile(target, models, acceptance, verify_cost, cost_curve, extra, context_costs)
    return prof, triangle_warnings(prof, source)


def _verify_costs(source: str, raw: Any, seen: set[str], at: str) -> dict[str, dict[str, float | list[float]]]:
    """``verify_cost[verifier][drafter]`` (seconds > 0, or a curve of them) at field ``at``, names known."""
    if not isinstance(raw, dict):
        raise InputFileError(source, "expected an object verify_cost[verifier][drafter]", at)
    out: dict[str, dict[str, float | list[float]]] = {}
    for ve, row in raw.items():
        if ve not in seen:
            raise InputFileError(source, f"unknown verifier {ve!r}", f"{at}.{ve}")
        if not isinstance(row, dict):
            raise InputFileError(source, "expected an object {drafter: seconds}", f"{at}.{ve}")
        out[ve] = {}
        for dr, c in row.items():
            f = f"{at}.{ve}.{dr}"
            if dr not in seen:
                raise InputFileError(source, f"unknown drafter {dr!r}", f)
            if isinstance(c, list):
                out[ve][dr] = _positive_curve(source, f, c)
            elif _is_number(c) and c > 0:
                out[ve][dr] = float(c)
            else:
                raise InputFileError(source, f"expected seconds > 0 or a list of them, got {c!r}", f)
    return out


def _cost_curves(source: str, raw: Any, seen: set[str], at: str) -> dict[str, list[float]]:
    """``cost_curve[model]`` (a non-empty list of seconds > 0) at field ``at``, names known."""
    if not isinstance(raw, dict):
        raise InputFileError(source, "expected an object cost_curve[model] = [seconds for t=1..n]", at)
    out: dict[str, list[float]] = {}
    for name, curve in raw.items():
        if name not in seen:
            raise InputFileError(source, f"unknown model {name!r}", f"{at}.{name}")
        out[name] = _positive_curve(source, f"{at}.{name}", curve)
    return out


def _context_costs(source: str, raw: Any, seen: set[str]) -> list[ContextCosts]:
    """The optional ``context_costs`` list: entries in increasing ``context`` order, each naming the same models
    (and pairs) as the first, so that every figure is interpolated between like figures."""
    if raw is None:
        return []
    if not isinstance(raw, list) or not raw:
        raise InputFileError(source, "expected a non-empty list of {context, cost, cost_curve, verify_cost}",
                             "context_costs")
    out: list[ContextCosts] = []
    for i, e in enumerate(raw):
        at = f"context_costs[{i}]"
        if not isinstance(e, dict):
            raise InputFileError(source, "expected an object {context, cost, cost_curve, verify_cost}", at)
        unknown = sorted(set(e) - {"context", "cost", "cost_curve", "verify_cost"})
        if unknown:
            raise InputFileError(source, f"unknown field {unknown[0]!r} (known: context, cost, cost_curve, "
                                         f"verify_cost)", f"{at}.{unknown[0]}")
        c = e.get("context")
        if not isinstance(c, int) or isinstance(c, bool) or c < 1:
            raise InputFileError(source, f"expected a context length in tokens (an integer >= 1), got {c!r}",
                                 f"{at}.context")
        if out and c <= out[-1].context:
            raise InputFileError(source, f"contexts must increase: {c} after {out[-1].context}", f"{at}.context")
        cost_raw = e.get("cost", {})
        if not isinstance(cost_raw, dict):
            raise InputFileError(source, "expected an object {model: seconds}", f"{at}.cost")
        cost: dict[str, float] = {}
        for name, v in cost_raw.items():
            if name not in seen:
                raise InputFileError(source, f"unknown model {name!r}", f"{at}.cost.{name}")
            if not _is_number(v) or v <= 0:
                raise InputFileError(source, f"expected a cost in seconds > 0, got {v!r}", f"{at}.cost.{name}")
            cost[name] = float(v)
        entry = ContextCosts(c, cost, _cost_curves(source, e.get("cost_curve", {}) or {}, seen, f"{at}.cost_curve"),
                             _verify_costs(source, e.get("verify_cost", {}) or {}, seen, f"{at}.verify_cost"))
        if out:
            _same_keys(source, at, entry, out[0])
        out.append(entry)
    return out


def _same_keys(source: str, at: str, entry: ContextCosts, first: ContextCosts) -> None:
    """Refuse an entry of ``context_costs`` that names other models (or pairs) than the first one."""
    pairs = (("cost", set(entry.cost), set(first.cost)),
             ("cost_curve", set(entry.cost_curve), set(first.cost_curve)),
             ("verify_cost", {f"{v}.{d}" for v, r in entry.verify_cost.items() for d in r},
              {f"{v}.{d}" for v, r in first.verify_cost.items() for d in r}))
    for name, mine, theirs in pairs:
        if mine != theirs:
            diff = sorted(mine ^ theirs)
            raise InputFileError(source, f"{diff[0]} is in one context but not in context_costs[0]: every context "
                                         f"must list the same models", f"{at}.{name}")


def triangle_warnings(profile: Profile, source: str = "<profile>", tol: float = 0.02) -> list[str]:
    """Acceptance triples ``(i, j, k)`` of distinct models that break a[i][j] + a[j][k] <= a[i][k] + 1 by more
    than ``tol`` (one line each, in the order of ``profile.names``)."""
    import numpy as np

    names = profile.names
    n = len(names)
    idx = {m: p for p, m in enumerate(names)}
    a = np.full((n, n), np.nan)
    for d, row in profile.acceptance.items():
        for v, x in row.items():
            a[idx[d], idx[v]] = x
    np.fill_diagonal(a, np.nan)             # triples of distinct models only
    with np.errstate(invalid="ignore"):
        bad = a[:, :, None] + a[None, :, :] > a[:, None, :] + 1 + tol    # [i, j, k]: a_ij + a_jk > a_ik + 1 + tol
    out = []
    for i, j, k in np.argwhere(bad):
        if i == k:
            continue
        out.append(f"{source}: acceptance: {names[i]}->{names[j]} ({a[i, j]:.3f}) + {names[j]}->{names[k]} "
                   f"({a[j, k]:.3f}) exceeds {names[i]}->{names[k]} ({a[i, k]:.3f}) + 1: breaks the triangle bound "
                   f"(HSD paper, App. B.3)")
    return out


def load_profile(path: str | os.PathLike) -> tuple[Profile, list[str]]:
    """Read and validate ``hsd-profile/1`` from ``path``. Returns ``(profile, warnings)``."""
    return profile_from_dict(read_json(path), str(path))


def save_profile(profile: Profile, path: str | os.PathLike) -> None:
    """Write ``profile`` atomically."""
    write_json(path, profile.to_dict())


def _check_levels(d: dict, source: str, tmax: int, at: str = "") -> tuple[list[str], list[int]]:
    """``hierarchy`` and ``budgets`` of a plan (or of its ``by_task`` entry at ``at``), validated."""
    h = d.get("hierarchy")
    if not isinstance(h, list) or not h or not all(isinstance(x, str) and x for x in h):
        raise InputFileError(source, "expected a non-empty list of model names, target last", at + "hierarchy")
    if len(set(h)) != len(h):
        raise InputFileError(source, f"a model appears twice in {h}", at + "hierarchy")
    b = d.get("budgets")
    if not isinstance(b, list) or len(b) != len(h) - 1:
        raise InputFileError(source, f"expected {len(h) - 1} budgets (one per level below the target)",
                             at + "budgets")
    for i, t in enumerate(b):
        if not isinstance(t, int) or isinstance(t, bool) or not 1 <= t <= tmax:
            raise InputFileError(source, f"expected an integer in 1..tmax={tmax}, got {t!r}", f"{at}budgets[{i}]")
        if i and t < b[i - 1]:
            raise InputFileError(source, f"budgets must be non-decreasing (T_0 <= T_1 <= ...), got {b}",
                                 at + "budgets")
    return list(h), list(b)


def _check_latency_table(v: Any, source: str, at: str) -> None:
    """An optional ``latency_by_context``: ``[[context tokens >= 1, seconds > 0], ...]``, contexts increasing."""
    if v is None:
        return
    if not isinstance(v, list) or not v:
        raise InputFileError(source, "expected a non-empty list of [context, seconds per token] pairs", at)
    last = None
    for i, pt in enumerate(v):
        if (not isinstance(pt, list) or len(pt) != 2 or not _is_number(pt[0]) or pt[0] < 1
                or not _is_number(pt[1]) or pt[1] <= 0):
            raise InputFileError(source, f"expected [context tokens >= 1, seconds per token > 0], got {pt!r}",
                                 f"{at}[{i}]")
        if last is not None and pt[0] <= last:
            raise InputFileError(source, f"contexts must increase: {pt[0]!r} after {last!r}", f"{at}[{i}]")
        last = pt[0]


def _check_context_fields(d: dict, source: str, at: str = "") -> None:
    """The optional ``context`` (tokens >= 1) and ``latency_by_context`` of a plan or of one of its entries."""
    c = d.get("context")
    if c is not None and (not _is_number(c) or c < 1):
        raise InputFileError(source, f"expected a context length in tokens (>= 1), got {c!r}", at + "context")
    _check_latency_table(d.get("latency_by_context"), source, at + "latency_by_context")


def _check_by_task(by_task: Any, source: str, tmax: int, target: str) -> None:
    """The optional ``by_task`` section: ``{task: {hierarchy, budgets, expected_latency, ...}}``, each entry a
    valid hierarchy ending with the plan's target."""
    if not isinstance(by_task, dict):
        raise InputFileError(source, "expected an object {task: {hierarchy, budgets, expected_latency}}", "by_task")
    for task, e in by_task.items():
        at = f"by_task.{task}."
        if not isinstance(e, dict):
            raise InputFileError(source, "expected an object {hierarchy, budgets, expected_latency}", at[:-1])
        h, _ = _check_levels(e, source, tmax, at)
        if h[-1] != target:
            raise InputFileError(source, f"ends with {h[-1]!r}, but the plan's target is {target!r}",
                                 at + "hierarchy")
        v = e.get("expected_latency")
        if not _is_number(v) or v <= 0:
            raise InputFileError(source, f"expected a number > 0, got {v!r}", at + "expected_latency")
        _check_context_fields(e, source, at)
        tables = e.get("overall_hierarchies_by_context")
        if tables is not None:
            if not isinstance(tables, dict):
                raise InputFileError(source, "expected an object {key: latency_by_context}",
                                     at + "overall_hierarchies_by_context")
            for key, tb in tables.items():
                _check_latency_table(tb, source, f"{at}overall_hierarchies_by_context.{key}")


def plan_from_dict(d: Any, source: str = "<plan>") -> Plan:
    """Validate a parsed ``hsd-plan/1`` object; errors name ``source`` and the field."""
    if not isinstance(d, dict):
        raise InputFileError(source, "expected a JSON object")
    if d.get("format") != PLAN_FORMAT:
        raise InputFileError(source, f"expected {PLAN_FORMAT!r}, got {d.get('format')!r}", "format")
    tmax = d.get("tmax")
    if not isinstance(tmax, int) or isinstance(tmax, bool) or tmax < 1:
        raise InputFileError(source, f"expected an integer >= 1, got {tmax!r}", "tmax")
    h, b = _check_levels(d, source, tmax)
    for key in ("expected_latency", "expected_speedup"):
        v = d.get(key)
        if not _is_number(v) or v <= 0:
            raise InputFileError(source, f"expected a number > 0, got {v!r}", key)
    baselines = d.get("baselines", {})
    if not isinstance(baselines, dict):
        raise InputFileError(source, "expected an object", "baselines")
    _check_context_fields(d, source)
    for key, entry in baselines.items():
        if isinstance(entry, dict):
            _check_latency_table(entry.get("latency_by_context"), source, f"baselines.{key}.latency_by_context")
    alts = d.get("alternatives")
    for i, a in enumerate(alts if isinstance(alts, list) else []):
        if isinstance(a, dict):
            _check_latency_table(a.get("latency_by_context"), source, f"alternatives[{i}].latency_by_context")
    if d.get("by_task") is not None:
        _check_by_task(d["by_task"], source, tmax, h[-1])
    known = {"format", "tmax", "hierarchy", "budgets", "expected_latency", "expected_speedup", "baselines"}
    extra = {k: v for k, v in d.items() if k not in known}
    return Plan(tmax, h, b, float(d["expected_latency"]), float(d["expected_speedup"]), baselines, extra)


def load_plan(path: str | os.PathLike) -> Plan:
    """Read and validate ``hsd-plan/1`` from ``path``."""
    return plan_from_dict(read_json(path), str(path))


def save_plan(plan: Plan, path: str | os.PathLike) -> None:
    """Write ``plan`` atomically."""
    write_json(path, plan.to_dict())
