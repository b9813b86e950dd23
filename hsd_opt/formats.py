"""The two file formats that are the contract between the commands: ``hsd-profile/1`` and ``hsd-plan/1``.

Plain dataclasses, plain functions. ``load_profile``/``load_plan`` validate and raise
:class:`~hsd_opt.errors.InputFileError` naming the file and the field; ``profile_from_dict``/``plan_from_dict``
do the same for in-memory dicts (``source`` names them in messages). A plan's sections are typed on load
(:class:`PlanModel` with its :class:`Quantization`, :class:`Provenance`, :class:`Alternative`, :class:`TaskPlan`);
``Plan.extra`` keeps only the fields the format does not name, and no other module reads it.

Units: every cost is in seconds (wall time); acceptance rates are probabilities in [0, 1]; budgets are tokens.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

from hsd_opt.errors import HsdError, InputFileError
from hsd_opt.jsonio import read_json, write_json
from hsd_opt.values import is_finite

PROFILE_FORMAT = "hsd-profile/1"
PLAN_FORMAT = "hsd-plan/1"

#: Drafter kinds the project knows. Unknown kinds are accepted (other tools may add their own).
KNOWN_KINDS = ("target", "early_exit", "model", "quantized", "ngram_context", "bigram_model", "aded", "mixed_ngram")


#: Positions of the longest pass after a prompt that an engine computes as its one-position steps compute them
#: (the kernels' pass): a hierarchy's budgets keep every verification within it, so the target's tokens are its
#: greedy steps' at any budget. Here, below the engines, so that ``hsd solve`` checks ``--tmax`` without torch.
EXACT_PASS = 64


@dataclass
class ModelEntry:
    """One drafter (or the target) in a profile.

    Attributes:
        name: unique name used as key everywhere (``"layer8"``, ``"ngram"``, ``"layer30"``).
        kind: one of :data:`KNOWN_KINDS` (others allowed).
        cost: seconds for one forward step of one token with a warm cache.
        can_verify: whether it yields next-token distributions for given positions (n-gram drafters cannot;
            they may only be the bottom level of a hierarchy); true only for a kind of :data:`VERIFIER_KINDS`
            (its default there, false elsewhere).
        layer: for ``early_exit``/``target`` of a layered model, the number of decoder layers run (1-based).
        extra: any other fields of the entry, kept on round-trip.
        draft_rate: share of the calls in which it proposes a block, in (0, 1]; below 1 only for a drafter that
            cannot verify and abstains where it has no confident guess (its ``acceptance`` is then measured over
            the positions where it proposes). Written only when below 1.
        draft_rate_by_budget: for such a drafter, the share of decoding's rounds in which it proposes a block,
            ``[f(1), ..., f(n)]`` for budgets of 1..n tokens (empty: not measured; the solver then takes
            ``draft_rate``). Rounds skip the positions an accepted block covers, so where proposals come in runs
            this is below ``draft_rate`` (`docs/design.md#abstaining-drafters`).
    """

    name: str
    kind: str
    cost: float
    can_verify: bool
    layer: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    draft_rate: float = 1.0
    draft_rate_by_budget: tuple[float, ...] = ()

    @property
    def abstains(self) -> bool:
        """Whether it proposes in fewer than every round at some budget: ``draft_rate`` below 1, or a share of
        rounds per budget below 1 (a task's view of a drafter that proposed at every position of the task's
        prompts, but not a block of every budget in every round: :func:`~hsd_opt.solver.task_view.task_profile`)."""
        return self.draft_rate < 1.0 or any(r < 1.0 for r in self.draft_rate_by_budget)

    def rate_at(self, budget: int) -> float:
        """The share of rounds in which it proposes a block of ``budget`` tokens: ``draft_rate_by_budget`` at
        ``budget`` (its last figure past its end), else ``draft_rate``."""
        rates = self.draft_rate_by_budget
        if not rates:
            return self.draft_rate
        return float(rates[max(1, min(int(budget), len(rates))) - 1])

    def with_costs_of(self, other: "ModelEntry") -> "ModelEntry":
        """This drafter as ``other`` (the same drafter profiled elsewhere) measured it: ``other``'s cost and its
        measured fields (``step_measured``, ``quantization``: the copy's bytes and kernels there); everything else
        this entry's own."""
        measured = ("step_measured", "quantization")
        extra = {k: v for k, v in self.extra.items() if k not in measured}
        extra.update({k: v for k, v in other.extra.items() if k in measured})
        return replace(self, cost=other.cost, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "kind": self.kind, "cost": self.cost, "can_verify": self.can_verify}
        if self.layer is not None:
            d["layer"] = self.layer
        if self.abstains or self.draft_rate != 1.0:     # one above 1 or NaN set in Python: written, so refused
            d["draft_rate"] = self.draft_rate
        by_budget = self.draft_rate_by_budget           # likewise
        if by_budget and (self.abstains or any(r != 1.0 for r in by_budget)):
            d["draft_rate_by_budget"] = list(by_budget)
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
class BatchCosts:
    """What a pass over ``batch`` sequences costs against a pass over one (one entry of ``batch_costs``).

    Attributes:
        batch: sequences decoded together (>= 2).
        ratio: model -> ``[r_1, ..., r_n]``: seconds of one pass over ``batch`` sequences of t new tokens each,
            over seconds of a pass over one sequence of t tokens, t = 1..n (an exit takes its model's ratios); a
            number for a token drafter (it proposes for one sequence at a time: ``batch``).
        context: tokens in each sequence's cache when timed.
        pass_seconds: model -> ``[s_1, ..., s_n]`` seconds of the batched pass, for the models timed (reports).

    At ``batch`` sequences in flight every cost of a model is its single-sequence cost times its ratio at the
    same t (``docs/design.md#serving-under-load``).
    """

    batch: int
    ratio: dict[str, float | list[float]]
    context: int | None = None
    pass_seconds: dict[str, list[float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"batch": self.batch, "ratio": self.ratio}
        if self.context is not None:
            d["context"] = self.context
        if self.pass_seconds:
            d["pass_seconds"] = self.pass_seconds
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
        batch_costs: optional costs of passes over several sequences, in increasing ``batch`` order
            (:class:`BatchCosts`); empty for a profile of one sequence at a time (batch 1).
        provenance: where and how it was measured (:class:`Provenance`: the model, device, dtype, sampling, and
            the profiler's own records, read with :meth:`Provenance.get`).
        greedy_agreement: ``[drafter][verifier]``: how often their argmax agree.
        counts: ``[drafter][verifier]``: positions each acceptance rate was measured on.
        ci95: ``[drafter][verifier]``: the rate's 95% confidence interval ``[low, high]``.
        acceptance_by_task: ``[task][drafter][verifier]``: acceptance on each task's prompts alone.
        draft_rate_by_task: ``[task][drafter]``: an abstaining drafter's draft rate on each task's prompts.
        draft_rate_by_budget_by_task: ``[task][drafter]``: its share of rounds per budget on each task's prompts
            (:attr:`ModelEntry.draft_rate_by_budget`).
        stats: the additive statistics the rates come from (``PairStats`` as JSON), for exact merges; None
            where a profile was made another way (or is a task's view).
        task: the task whose view this is (:func:`~hsd_opt.solver.task_view.task_profile`); None for the profile
            itself. Never written to a file.
    """

    target: str
    models: list[ModelEntry]
    acceptance: dict[str, dict[str, float]]
    verify_cost: dict[str, dict[str, float | list[float]]] = field(default_factory=dict)
    cost_curve: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    context_costs: list[ContextCosts] = field(default_factory=list)
    batch_costs: list[BatchCosts] = field(default_factory=list)
    provenance: "Provenance" = field(default_factory=lambda: Provenance())
    greedy_agreement: dict[str, dict[str, float]] = field(default_factory=dict)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    ci95: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    acceptance_by_task: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    draft_rate_by_task: dict[str, dict[str, float]] = field(default_factory=dict)
    draft_rate_by_budget_by_task: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    stats: dict[str, Any] | None = None
    task: str | None = None

    @property
    def batch_sizes(self) -> list[int]:
        """The batch sizes the profile has costs for: 1 and those of ``batch_costs``, increasing."""
        return [1] + [b.batch for b in self.batch_costs]

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
        """``acceptance[drafter][verifier]`` or ``None`` when not measured. A model always accepts itself (1.0).

        Between two models that both verify, the rate is one figure of the pair (the expected overlap of their
        distributions, ``sum min(p, q)``, or how often their argmax agree: the same either way round), kept once,
        the cheaper first in the cost order of the run that measured it; so a pair stored the other way round is
        read too, as costs of another device or context may order the two the other way
        (``hsd profile merge-costs``, ``hsd solve --context``)."""
        if drafter == verifier:
            return 1.0
        a = self.acceptance.get(drafter, {}).get(verifier)
        if a is None and all(self._verifies(n) for n in (drafter, verifier)):
            a = self.acceptance.get(verifier, {}).get(drafter)
        return a

    def _verifies(self, name: str) -> bool:
        """Whether ``name`` is a model of the pool that verifies (False for a name not in it)."""
        return any(m.name == name and m.can_verify for m in self.models)

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
        if self.batch_costs:
            d["batch_costs"] = [b.to_dict() for b in self.batch_costs]
        for k in PROFILE_RECORDS:
            v = getattr(self, k)
            if v:
                d[k] = v
        if self.stats is not None:
            d["stats"] = self.stats
        prov = self.provenance.to_dict()
        if prov or self.provenance.key_order:
            d["provenance"] = prov
        for k, v in self.extra.items():
            if k not in d:
                d[k] = v
        return d

    def fingerprint(self) -> str:
        """SHA-256 of the canonical JSON of the profile (for plans to record which profile they came from)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


#: Kinds of model entry that give next-token distributions, so may verify (a level above the bottom of a
#: hierarchy must be one of them). Every other kind is a token drafter: only ever the bottom level.
VERIFIER_KINDS = ("target", "early_exit", "model", "quantized")


def _json_object(fields: dict[str, Any], defaults: dict[str, Any], extra: dict[str, Any],
                 key_order: Sequence[str]) -> dict[str, Any]:
    """One object of a file as JSON, the inverse of its parsing: the typed ``fields`` (as JSON values), but not
    a field at its value in ``defaults`` unless the object read had it; then the ``extra`` fields. Keys come in
    ``key_order`` (the keys of the object read), any others after them in the order given here."""
    d = {k: v for k, v in fields.items() if k not in defaults or v != defaults[k] or k in key_order}
    for k, v in extra.items():
        d.setdefault(k, v)
    rank = {k: i for i, k in enumerate(key_order)}
    return {k: d[k] for k in sorted(d, key=lambda k: rank.get(k, len(rank)))}


@dataclass
class Quantization:
    """How a weight-quantized copy is made (the ``quantization`` field of a model entry).

    Attributes:
        bits: bits per weight of the decoder layers, 4 or 8.
        group_size: weights sharing one scale (4-bit weights: >= 1; recorded but unused for 8-bit ones).
        head_bits: bits per weight of the LM head, 4 or 8.
        extra: every other field (``weight_bytes``, ``packed_kernels``, ``activation_dtype``, ...), kept on
            round-trip.
        key_order: the keys of the object read, in order (empty when built in memory); ``to_dict`` keeps it.
    """

    bits: int
    group_size: int = 32
    head_bits: int = 8
    extra: dict[str, Any] = field(default_factory=dict)
    key_order: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return _json_object({"bits": self.bits, "group_size": self.group_size, "head_bits": self.head_bits},
                            {"group_size": 32, "head_bits": 8}, self.extra, self.key_order)


@dataclass
class PlanModel:
    """One entry of a plan's ``models``: the profile's entry of a model, copied, with what it takes to rebuild
    it at run time. Unlike a profile's :class:`ModelEntry`, only ``name`` is required (a field that is absent
    is None and stays absent on save).

    Attributes:
        name: the name the plan's hierarchies use.
        kind: one of :data:`KNOWN_KINDS` (others allowed); ``model`` when absent.
        cost: seconds of one decode step (informative at run time).
        can_verify: whether it gives next-token distributions (informative at run time: ``kind`` decides).
        layer: decoder layers run (1-based) by an exit (``early_exit``/``target``) or a quantized copy.
        draft_rate: share of the calls a token drafter proposes in, in (0, 1].
        model: the draft model (alias, id or path) a ``model`` entry runs, or that an ``early_exit`` or
            ``quantized`` entry is an exit or copy of; None for the target's own.
        quantization: the settings of a ``quantized`` entry, or of a target that is a quantized copy.
        config: the settings a token drafter is rebuilt from (``hsd_opt.drafters.make_token_drafter``).
        extra: every other field (``step_measured``, ...), kept on round-trip.
        key_order: the keys of the object read, in order (empty when built in memory); ``to_dict`` keeps it.
    """

    name: str
    kind: str = "model"
    cost: float | None = None
    can_verify: bool | None = None
    layer: int | None = None
    draft_rate: float | None = None
    model: str | None = None
    quantization: Quantization | None = None
    config: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    key_order: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        fields = {"name": self.name, "kind": self.kind, "cost": self.cost, "can_verify": self.can_verify,
                  "layer": self.layer, "draft_rate": self.draft_rate, "model": self.model,
                  "quantization": None if self.quantization is None else self.quantization.to_dict(),
                  "config": self.config}
        defaults = {k: None for k in fields if k not in ("name", "kind")} | {"kind": "model"}
        return _json_object(fields, defaults, self.extra, self.key_order)


@dataclass
class Provenance:
    """Where a plan's profile was measured: the ``provenance`` section (the profile's, copied into the plan).
    Every field may be absent (None).

    Attributes:
        model: the target model (alias, id or path) the profile was measured on.
        revision: the revision of its weights.
        heads: the trained exit heads file (``hsd-heads/1``) the exits used; None for the shared final head.
        device: the device it was profiled on.
        dtype: the dtype the target was loaded in (``float32``, ``bfloat16``, ...).
        target_precision: the target the plan is for: ``float32``, ``bfloat16``, ``int8`` or ``int4`` (a plan
            without it is for its ``dtype``).
        temperature: the sampling temperature of the profiled generations (0: greedy).
        top_p: their nucleus share, in (0, 1].
        top_k: their top-k (0: none), an integer >= 0.
        min_p: their min-p (0: none), in [0, 1].
        costs_only: True for a profile of costs alone (``hsd profile --costs-only``: random weights, no
            acceptance rates), which ``hsd solve`` refuses until ``hsd profile merge-costs`` has given it rates.
        extra: every other field (prompts, timings, versions, ...), kept on round-trip.
        key_order: the keys of the object read, in order (empty when built in memory); ``to_dict`` keeps it.
    """

    model: str | None = None
    revision: str | None = None
    heads: str | None = None
    device: str | None = None
    dtype: str | None = None
    target_precision: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    costs_only: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    key_order: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def get(self, key: str, default: Any = None) -> Any:
        """The field ``key``: a typed one, or one of the others kept as read (a profile's ``prompt_count``,
        ``positions_by_task``, ``sampling_seconds``, ...); ``default`` when absent or null."""
        v = getattr(self, key) if key in PROVENANCE_FIELDS else self.extra.get(key)
        return default if v is None else v

    @property
    def sampling(self) -> str | None:
        """The sampling the profile was made with, in words (:func:`sampling_words`; one without top-p, top-k or
        min-p recorded sampled without them), or None where it does not say."""
        if self.temperature is None:
            return None
        return sampling_words(self.temperature, self.get("top_p", 1.0), self.get("top_k", 0), self.get("min_p", 0.0))

    @property
    def threads(self) -> int | None:
        """The torch threads the profile's costs were measured with (None: not recorded)."""
        v = self.extra.get("torch_threads")
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    @property
    def kernel_variant(self) -> str | None:
        """The CPU kernel variant the profile's costs were measured on (None: not recorded, or no kernels)."""
        v = self.extra.get("kernels")
        return v.get("variant") if isinstance(v, dict) and isinstance(v.get("variant"), str) else None

    @property
    def kernel_openmp(self) -> bool | None:
        """Whether the CPU kernels the profile's costs were measured on had OpenMP threads (None: not recorded, or
        no kernels)."""
        v = self.extra.get("kernels")
        return v.get("openmp") if isinstance(v, dict) and isinstance(v.get("openmp"), bool) else None

    def to_dict(self) -> dict[str, Any]:
        fields = {"model": self.model, "revision": self.revision, "heads": self.heads, "device": self.device,
                  "dtype": self.dtype, "target_precision": self.target_precision, "temperature": self.temperature,
                  "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p, "costs_only": self.costs_only}
        return _json_object(fields, dict.fromkeys(fields), self.extra, self.key_order)


@dataclass
class Alternative:
    """A ranked hierarchy of a plan other than its own: an entry of ``alternatives``, or ``exact_optimum``.

    Attributes:
        hierarchy: model names, bottom first, the target last.
        budgets: tokens each level below the target hands up per call (``len(hierarchy) - 1`` of them).
        expected_latency: predicted seconds per generated token (at the plan's ``context``).
        expected_speedup: the target's cost / ``expected_latency``, or None when absent.
        latency_by_context: ``[[context tokens, seconds per token], ...]``, contexts increasing, or None (a plan
            solved at one context).
        extra: every other field, kept on round-trip.
        key_order: the keys of the object read, in order (empty when built in memory); ``to_dict`` keeps it.
    """

    hierarchy: list[str]
    budgets: list[int]
    expected_latency: float
    expected_speedup: float | None = None
    latency_by_context: list[list[float]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    key_order: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        fields = {"hierarchy": list(self.hierarchy), "budgets": list(self.budgets),
                  "expected_latency": self.expected_latency, "expected_speedup": self.expected_speedup,
                  "latency_by_context": self.latency_by_context}
        return _json_object(fields, {"expected_speedup": None, "latency_by_context": None}, self.extra,
                            self.key_order)


@dataclass
class TaskPlan:
    """The plan of one task: an entry of a plan's ``by_task`` section (``hsd solve --per-task``).

    Attributes:
        hierarchy: model names, bottom first, ending with the plan's target.
        budgets: tokens each level below the target hands up per call.
        expected_latency: predicted seconds per token on the task's prompts (at ``context``).
        expected_speedup: the target's cost / ``expected_latency``, or None when absent.
        positions: generated positions the task was profiled on, or None.
        fallback_pairs: pairs and draft rates kept at the overall value for want of the task's own, or None.
        overall_hierarchies: seconds per token on the task's prompts of the plan's own hierarchy (``plan``) and
            of its baselines (by key); empty when absent.
        context: the task's typical context (tokens), or None.
        context_from: where ``context`` came from (``given``, ``task_prompts``, ...), or None.
        forced_share: the share of the task's generated tokens its grammar forced (prompts with a JSON schema):
            decoding takes them without a pass, and ``expected_latency`` covers the others; None without one.
        latency_by_context: ``[[context tokens, seconds per token], ...]`` of ``hierarchy``, or None.
        overall_hierarchies_by_context: ``{key: latency_by_context}`` for the keys of ``overall_hierarchies``;
            empty when absent.
        extra: every other field, kept on round-trip.
        key_order: the keys of the object read, in order (empty when built in memory); ``to_dict`` keeps it.
    """

    hierarchy: list[str]
    budgets: list[int]
    expected_latency: float
    expected_speedup: float | None = None
    positions: int | None = None
    fallback_pairs: int | None = None
    overall_hierarchies: dict[str, float] = field(default_factory=dict)
    context: float | None = None
    context_from: str | None = None
    latency_by_context: list[list[float]] | None = None
    overall_hierarchies_by_context: dict[str, list[list[float]]] = field(default_factory=dict)
    forced_share: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    key_order: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        fields = {"hierarchy": list(self.hierarchy), "budgets": list(self.budgets),
                  "expected_latency": self.expected_latency, "expected_speedup": self.expected_speedup,
                  "positions": self.positions, "fallback_pairs": self.fallback_pairs,
                  "overall_hierarchies": self.overall_hierarchies, "context": self.context,
                  "context_from": self.context_from, "latency_by_context": self.latency_by_context,
                  "overall_hierarchies_by_context": self.overall_hierarchies_by_context,
                  "forced_share": self.forced_share}
        defaults = {k: None for k in fields if k not in ("hierarchy", "budgets", "expected_latency")}
        defaults.update(overall_hierarchies={}, overall_hierarchies_by_context={})
        return _json_object(fields, defaults, self.extra, self.key_order)


@dataclass
class LoadPlan:
    """The plan of one load level: an entry of a plan's ``by_load`` section (``hsd solve --batch-sizes``).

    Attributes:
        hierarchy: model names, bottom first, ending with the plan's target (the target alone: plain batched
            decoding, chosen where no speculation pays at this load).
        budgets: tokens each level below the target hands up per call.
        expected_latency: predicted seconds per token of each sequence, with ``load`` sequences decoded together.
        tokens_per_s: predicted aggregate tokens per second (``load / expected_latency``).
        batched_target_latency: the same for the target alone (plain batched decoding), seconds per token.
        extra: every other field, kept on round-trip.
        key_order: the keys of the object read, in order (empty when built in memory); ``to_dict`` keeps it.
    """

    hierarchy: list[str]
    budgets: list[int]
    expected_latency: float
    tokens_per_s: float | None = None
    batched_target_latency: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    key_order: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        fields = {"hierarchy": list(self.hierarchy), "budgets": list(self.budgets),
                  "expected_latency": self.expected_latency, "tokens_per_s": self.tokens_per_s,
                  "batched_target_latency": self.batched_target_latency}
        return _json_object(fields, {"tokens_per_s": None, "batched_target_latency": None}, self.extra,
                            self.key_order)


def nearest_level(levels: Iterable[int], n: int) -> int:
    """The load level (of a plan's ``by_load``) whose hierarchy runs at ``n`` sequences in flight: the level
    nearest ``n`` on a log scale (between levels ``a < n < b``: ``b`` from ``n >= sqrt(a * b)`` on; below the
    smallest level, the smallest; above the largest, the largest). With levels 1, 2, 4, 8: 3 -> 4, 5 -> 4, 6 and
    7 -> 8. The nearest, not the largest below: between two levels the load is as often just under the upper one (a
    client between two requests) as just over the lower one."""
    levels = sorted(levels)
    if not levels:
        raise ValueError("no load levels")
    if n <= levels[0]:
        return levels[0]
    for lo, hi in zip(levels, levels[1:]):
        if n < hi:
            return hi if n * n >= lo * hi else lo
    return levels[-1]


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
        extra: every field the format does not type (``target``, ``latency_unit``, fields of other tools), kept
            on round-trip.
        models: the profile's model entries (every one, not only the hierarchy's); empty in a plan without them.
        provenance: the profile's provenance; empty (every field None) in a plan without one.
        alternatives: the next-best distinct hierarchies, best first.
        exact_optimum: the exact optimum when ``min_gain`` kept a shallower plan, else None.
        by_task: task -> its own plan (``hsd solve --per-task``); empty without.
        context: tokens in the cache the costs were taken at (a profile with costs at several contexts), or None.
        context_from: where ``context`` came from (``given``, ``profile_prompts``, ...), or None.
        latency_by_context: ``[[context tokens, seconds per token], ...]`` of the plan's hierarchy, contexts
            increasing, or None (its ``expected_latency`` holds everywhere).
        solver: the solver that made it (``dp``, ``lp``, ``brute``, ...), or None.
        max_depth: the most models a hierarchy could have, or None (no limit, or not recorded).
        min_gain: the least gain a deeper plan needed (a fraction), or None.
        profile_sha256: SHA-256 of the profile it was solved from (:meth:`Profile.fingerprint`), or None.
        task: the task whose acceptance it was solved with (``hsd solve --task``), or None.
        by_load: sequences in flight -> the plan of that load level (``hsd solve --batch-sizes``; the server
            runs the level's hierarchy); empty without.
        load_min_gain: the least time a load level's speculation had to save against plain batching (a
            fraction; ``hsd solve --load-min-gain``), or None (no load levels, or not recorded): ``--retime``
            chooses the levels again with it.
        key_order: the keys of the object read, in order (empty when built in memory); ``to_dict`` keeps it.

    ``plan_from_dict`` fills every typed field from the file and validates it; ``to_dict`` writes back the same
    object (a section the file lacked stays absent).
    """

    tmax: int
    hierarchy: list[str]
    budgets: list[int]
    expected_latency: float
    expected_speedup: float
    baselines: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    models: list[PlanModel] = field(default_factory=list)
    provenance: Provenance = field(default_factory=Provenance)
    alternatives: list[Alternative] = field(default_factory=list)
    exact_optimum: Alternative | None = None
    by_task: dict[str, TaskPlan] = field(default_factory=dict)
    context: float | None = None
    context_from: str | None = None
    latency_by_context: list[list[float]] | None = None
    solver: str | None = None
    max_depth: int | None = None
    min_gain: float | None = None
    profile_sha256: str | None = None
    task: str | None = None
    by_load: dict[int, LoadPlan] = field(default_factory=dict)
    load_min_gain: float | None = None
    key_order: tuple[str, ...] = field(default=(), repr=False, compare=False)

    @property
    def target(self) -> str:
        return self.hierarchy[-1]

    @property
    def tasks(self) -> list[str]:
        """Tasks with their own plan in the ``by_task`` section (sorted; empty without one)."""
        return sorted(self.by_task)

    def model_entry(self, name: str) -> PlanModel | None:
        """The entry of ``models`` named ``name``, or None when the plan does not describe it."""
        return next((m for m in self.models if m.name == name), None)

    def level_entry(self, name: str, is_target: bool) -> PlanModel | None:
        """The model entry of the level ``name`` of a hierarchy: its entry in ``models``, else, for a name
        ``layer<N>`` (the profiler's naming of the target's exits), one inferred from the name (kind ``target``
        for the top level, ``is_target``, else ``early_exit``; ``layer`` N); None for any other name."""
        e = self.model_entry(name)
        if e is None:
            m = re.fullmatch(r"layer(\d+)", name)
            if m:
                e = PlanModel(name, "target" if is_target else "early_exit", layer=int(m.group(1)))
        return e

    def for_task(self, task: str | None) -> tuple[list[str], list[int], float, str]:
        """``(hierarchy, budgets, expected_latency, which)`` to run a prompt of ``task`` with: the ``by_task``
        entry of the task when the plan has one (``which = "by_task.<task>"``), else the plan itself
        (``which = "plan"``; also for ``task=None``, an unknown task)."""
        e = self.by_task.get(task) if task is not None else None
        if e:
            return list(e.hierarchy), list(e.budgets), float(e.expected_latency), f"by_task.{task}"
        return list(self.hierarchy), list(self.budgets), self.expected_latency, "plan"

    def to_dict(self) -> dict[str, Any]:
        fields = {"format": PLAN_FORMAT, "tmax": self.tmax, "hierarchy": list(self.hierarchy),
                  "budgets": list(self.budgets), "expected_latency": self.expected_latency,
                  "expected_speedup": self.expected_speedup, "baselines": self.baselines,
                  "solver": self.solver, "max_depth": self.max_depth, "min_gain": self.min_gain,
                  "profile_sha256": self.profile_sha256,
                  "alternatives": [a.to_dict() for a in self.alternatives], "context": self.context,
                  "context_from": self.context_from, "latency_by_context": self.latency_by_context,
                  "exact_optimum": None if self.exact_optimum is None else self.exact_optimum.to_dict(),
                  "provenance": self.provenance.to_dict(), "models": [m.to_dict() for m in self.models],
                  "task": self.task, "by_task": {t: e.to_dict() for t, e in self.by_task.items()},
                  "by_load": {str(n): e.to_dict() for n, e in sorted(self.by_load.items())},
                  "load_min_gain": self.load_min_gain}
        defaults = {"solver": None, "max_depth": None, "min_gain": None, "profile_sha256": None, "alternatives": [],
                    "context": None, "context_from": None, "latency_by_context": None, "exact_optimum": None,
                    "provenance": {}, "models": [], "task": None, "by_task": {}, "by_load": {},
                    "load_min_gain": None}
        return _json_object(fields, defaults, self.extra, self.key_order)


# ----------------------------------------------------------------------------------------------- validation


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and is_finite(x)


def _positive_curve(source: str, fieldname: str, v: Any, unit: str = "seconds") -> list[float]:
    """A list of numbers > 0 for t = 1..n tokens: seconds, or (``unit`` "ratios") a batch's ratios."""
    item = "a cost in seconds" if unit == "seconds" else "a ratio"
    if not isinstance(v, list) or not v:
        raise InputFileError(source, f"expected a non-empty list of {unit} for t = 1..n tokens", fieldname)
    out = []
    for i, s in enumerate(v):
        if not _is_number(s) or s <= 0:
            raise InputFileError(source, f"expected {item} > 0, got {s!r}", f"{fieldname}[{i}]")
        out.append(float(s))
    return out


def profile_from_dict(d: Any, source: str = "<profile>") -> tuple[Profile, list[str]]:
    """Validate a parsed ``hsd-profile/1`` object. Returns the profile and a list of warnings.

    Refused (``InputFileError`` naming ``source`` and the field): wrong ``format``, no or duplicate models,
    a missing target, a cost that is not a number > 0, a bad ``model``, ``config`` or ``quantization`` field of an
    entry (checked as in a plan; kept in the entry's ``extra``), an acceptance outside [0, 1] or naming an unknown
    model, a target that cannot verify. Warned, not refused: an acceptance triple that breaks the
    triangle bound a[i][j] + a[j][k] <= a[i][k] + 1 (HSD paper, arXiv 2510.19705, App. B.3), beyond a 0.02
    tolerance for noise, and a model whose step was timed twice with results too far apart
    (:func:`drift_warnings`).
    """
    if not isinstance(d, dict):
        raise InputFileError(source, "expected a JSON object")
    fmt = d.get("format")
    if fmt != PROFILE_FORMAT:
        raise InputFileError(source, f"expected {PROFILE_FORMAT!r}, got {fmt!r}", "format")
    models = _model_entries(source, d.get("models"))
    seen = {m.name for m in models}
    target = _profile_target(source, d.get("target"), models)
    acceptance = _acceptance(source, d.get("acceptance", {}), seen)
    verify_cost = _verify_costs(source, d.get("verify_cost", {}) or {}, seen, "verify_cost")
    cost_curve = _cost_curves(source, d.get("cost_curve", {}) or {}, seen, "cost_curve")
    context_costs = _context_costs(source, d.get("context_costs"), seen)
    batch_costs = _batch_costs(source, d.get("batch_costs"), seen)

    known = {"format", "target", "models", "acceptance", "verify_cost", "cost_curve", "context_costs", "batch_costs",
             "provenance", "stats", *PROFILE_RECORDS}
    extra = {k: v for k, v in d.items() if k not in known}
    records = _profile_records(source, d, seen)
    stats = d.get("stats")
    if stats is not None and not isinstance(stats, dict):
        raise InputFileError(source, "expected an object (the profiler's statistics)", "stats")
    prof = Profile(target, models, acceptance, verify_cost, cost_curve, extra, context_costs, batch_costs,
                   provenance=_provenance(d.get("provenance"), source), stats=stats, **records)
    return prof, triangle_warnings(prof, source) + drift_warnings(prof, source)


def _model_entries(source: str, raw: Any) -> list[ModelEntry]:
    """A profile's ``models``: a non-empty list of entries (:func:`_model_entry`) with distinct names."""
    if not isinstance(raw, list) or not raw:
        raise InputFileError(source, "expected a non-empty list of models", "models")
    models: list[ModelEntry] = []
    seen: set[str] = set()
    for i, m in enumerate(raw):
        models.append(_model_entry(source, m, f"models[{i}]", seen))
        seen.add(models[-1].name)
    return models


def _model_entry(source: str, m: Any, f: str, seen: set[str]) -> ModelEntry:
    """One entry of a profile's ``models`` at field ``f``: a name not in ``seen``, a kind, a cost in seconds > 0,
    can_verify, the exit's layer (index >= 0 or absent), the share of calls it drafts at (below 1 only where it
    cannot verify); its ``model``, ``config`` and ``quantization`` fields checked as in a plan, kept in ``extra``."""
    if not isinstance(m, dict):
        raise InputFileError(source, "expected an object", f)
    name = m.get("name")
    if not isinstance(name, str) or not name:
        raise InputFileError(source, "expected a non-empty string", f + ".name")
    if name in seen:
        raise InputFileError(source, f"duplicate model name {name!r}", f + ".name")
    kind = m.get("kind", "model")
    if not isinstance(kind, str):
        raise InputFileError(source, "expected a string", f + ".kind")
    cost = m.get("cost")
    if not _is_number(cost) or cost <= 0:
        raise InputFileError(source, f"expected a cost in seconds > 0, got {cost!r}", f + ".cost")
    can_verify = m.get("can_verify", kind in VERIFIER_KINDS)
    if not isinstance(can_verify, bool):
        raise InputFileError(source, f"expected true or false, got {can_verify!r}", f + ".can_verify")
    if can_verify and kind not in VERIFIER_KINDS:   # a plan's check decides by kind: the solver must too
        raise InputFileError(source, f"a {kind!r} gives no next-token distributions, so it cannot verify (only "
                                     f"{', '.join(VERIFIER_KINDS)} can): can_verify must be false", f + ".can_verify")
    layer = m.get("layer")
    if layer is not None and (not isinstance(layer, int) or isinstance(layer, bool) or layer < 0):
        raise InputFileError(source, f"expected a layer index >= 0, got {layer!r}", f + ".layer")
    rate = m.get("draft_rate", 1.0)
    if not _is_number(rate) or not 0.0 < rate <= 1.0:
        raise InputFileError(source, f"expected a share of calls in (0, 1], got {rate!r}", f + ".draft_rate")
    if rate < 1.0 and can_verify:
        raise InputFileError(source, "below 1 only for a drafter that cannot verify (can_verify: false)",
                             f + ".draft_rate")
    by_budget = _rates_by_budget(source, m.get("draft_rate_by_budget"), f + ".draft_rate_by_budget")
    if by_budget and rate >= 1.0 and min(by_budget) >= 1.0:
        raise InputFileError(source, "only for a drafter that abstains (draft_rate or a share below 1)",
                             f + ".draft_rate_by_budget")
    if by_budget and can_verify:
        raise InputFileError(source, "only for a drafter that cannot verify (can_verify: false)",
                             f + ".draft_rate_by_budget")
    _rebuild_fields(m, source, f + ".")
    extra = {k: v for k, v in m.items()
             if k not in ("name", "kind", "cost", "can_verify", "layer", "draft_rate", "draft_rate_by_budget")}
    return ModelEntry(name, kind, float(cost), can_verify, layer, extra, float(rate), by_budget)


def _rates_by_budget(source: str, raw: Any, f: str) -> tuple[float, ...]:
    """Shares of rounds per budget 1..n at field ``f``: absent, or a non-empty list of numbers in (0, 1]."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw:
        raise InputFileError(source, "expected a non-empty list of shares of rounds in (0, 1], one per budget", f)
    for i, r in enumerate(raw):
        if not _is_number(r) or not 0.0 < r <= 1.0:
            raise InputFileError(source, f"expected a share of rounds in (0, 1], got {r!r}", f"{f}[{i}]")
    return tuple(float(r) for r in raw)


def _profile_target(source: str, target: Any, models: list[ModelEntry]) -> str:
    """A profile's ``target``: the name of one of its models, one that can verify."""
    seen = {m.name for m in models}
    if not isinstance(target, str) or not target:
        raise InputFileError(source, "missing: expected the name of the target model", "target")
    if target not in seen:
        raise InputFileError(source, f"{target!r} is not among models ({', '.join(sorted(seen))})", "target")
    if not next(m for m in models if m.name == target).can_verify:
        raise InputFileError(source, "the target must be able to verify (can_verify: true)", "target")
    return target


def _pair_table(source: str, raw: Any, seen: set[str], at: str, names: tuple[str, str], unit: str,
                value: Callable[[Any, str], Any]) -> dict[str, dict[str, Any]]:
    """A table ``raw[a][b]`` at field ``at``, ``names`` naming what ``a`` and ``b`` are (both among the profile's
    models, ``seen``), each entry read by ``value(entry, its field)``; ``unit`` names an entry in messages."""
    outer, inner = names
    if not isinstance(raw, dict):
        raise InputFileError(source, f"expected an object {at.rsplit('.', 1)[-1]}[{outer}][{inner}]", at)
    out: dict[str, dict[str, Any]] = {}
    for a, row in raw.items():
        if a not in seen:
            raise InputFileError(source, f"unknown {outer} {a!r}", f"{at}.{a}")
        if not isinstance(row, dict):
            raise InputFileError(source, f"expected an object {{{inner}: {unit}}}", f"{at}.{a}")
        out[a] = {}
        for b, v in row.items():
            f = f"{at}.{a}.{b}"
            if b not in seen:
                raise InputFileError(source, f"unknown {inner} {b!r}", f)
            out[a][b] = value(v, f)
    return out


def _rate(source: str, a: Any, f: str, what: str = "an acceptance rate") -> float:
    """``a`` as a float when it is a number in [0, 1], else refused naming field ``f`` (``what`` it should be)."""
    if not _is_number(a) or not 0.0 <= a <= 1.0:
        raise InputFileError(source, f"expected {what} in [0, 1], got {a!r}", f)
    return float(a)


def _acceptance(source: str, raw: Any, seen: set[str]) -> dict[str, dict[str, float]]:
    """``acceptance[drafter][verifier]``: rates in [0, 1], both names among the profile's models (``seen``)."""
    return _pair_table(source, raw, seen, "acceptance", ("drafter", "verifier"), "rate",
                       lambda a, f: _rate(source, a, f))


def _profile_records(source: str, d: dict, seen: set[str]) -> dict[str, dict]:
    """The profile's :data:`PROFILE_RECORDS`, each an object (empty where absent); the drafters and verifiers of
    their rates among the profile's models (``seen``: a rate of another name was left unread)."""
    records = {}
    for k in PROFILE_RECORDS:
        v = d.get(k)
        if v is not None and not isinstance(v, dict):
            raise InputFileError(source, "expected an object", k)
        records[k] = v or {}
    # greedy_agreement: the share of positions whose argmaxes agree, null for a pair without a counted position
    tables = [("greedy_agreement", records["greedy_agreement"], "a share of positions", True)]
    tables += [(f"acceptance_by_task.{task}", rows, "an acceptance rate", False)
               for task, rows in records["acceptance_by_task"].items()]
    for at, rows, what, nullable in tables:
        if not isinstance(rows, dict) or not all(isinstance(r, dict) for r in rows.values()):
            raise InputFileError(source, "expected an object {drafter: {verifier: rate}}", at)
        for d, row in rows.items():
            for v, a in row.items():
                unknown = next((x for x in (d, v) if x not in seen), None)
                if unknown is not None:
                    raise InputFileError(source, f"unknown model {unknown!r} (not in models)", f"{at}.{d}.{v}")
                if a is not None or not nullable:
                    _rate(source, a, f"{at}.{d}.{v}", what)
    for task, row in records["draft_rate_by_task"].items():
        at = f"draft_rate_by_task.{task}"
        if not isinstance(row, dict):
            raise InputFileError(source, "expected an object {drafter: rate}", at)
        for d, r in row.items():
            if d not in seen:
                raise InputFileError(source, f"unknown model {d!r} (not in models)", f"{at}.{d}")
            _rate(source, r, f"{at}.{d}", "a draft rate")
    k = "draft_rate_by_budget_by_task"
    for task, row in records[k].items():
        if not isinstance(row, dict):
            raise InputFileError(source, "expected an object {drafter: [share of rounds per budget]}", f"{k}.{task}")
        records[k][task] = {name: list(_rates_by_budget(source, rates, f"{k}.{task}.{name}"))
                            for name, rates in row.items()}
    return records


#: A profile's records of its measurement beside the rates, each an object keyed by drafter (and verifier, or task).
PROFILE_RECORDS = ("greedy_agreement", "counts", "ci95", "acceptance_by_task", "draft_rate_by_task",
                   "draft_rate_by_budget_by_task")


def _verify_costs(source: str, raw: Any, seen: set[str], at: str) -> dict[str, dict[str, float | list[float]]]:
    """``verify_cost[verifier][drafter]`` (seconds > 0, or a curve of them) at field ``at``, names known."""
    def seconds(c: Any, f: str) -> float | list[float]:
        if isinstance(c, list):
            return _positive_curve(source, f, c)
        if _is_number(c) and c > 0:
            return float(c)
        raise InputFileError(source, f"expected seconds > 0 or a list of them, got {c!r}", f)

    return _pair_table(source, raw, seen, at, ("verifier", "drafter"), "seconds", seconds)


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


def _batch_costs(source: str, raw: Any, seen: set[str]) -> list[BatchCosts]:
    """The optional ``batch_costs`` list: entries in increasing ``batch`` order (each >= 2), ratios (> 0, a number
    or a curve over t) and pass seconds (curves) of known models."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise InputFileError(source, "expected a list of {batch, ratio}", "batch_costs")
    out: list[BatchCosts] = []
    for i, e in enumerate(raw):
        at = f"batch_costs[{i}]"
        if not isinstance(e, dict):
            raise InputFileError(source, "expected an object {batch, ratio}", at)
        b = e.get("batch")
        if not _is_int(b) or b < 2:
            raise InputFileError(source, f"expected a batch size >= 2, got {b!r}", at + ".batch")
        if out and b <= out[-1].batch:
            raise InputFileError(source, f"batch sizes must increase, got {b} after {out[-1].batch}", at + ".batch")
        ratio_raw = e.get("ratio")
        if not isinstance(ratio_raw, dict):
            raise InputFileError(source, "expected an object {model: ratio or [ratio per t]}", at + ".ratio")
        ratio: dict[str, float | list[float]] = {}
        for name, r in ratio_raw.items():
            if name not in seen:
                raise InputFileError(source, f"unknown model {name!r}", f"{at}.ratio.{name}")
            if isinstance(r, list):
                ratio[name] = _positive_curve(source, f"{at}.ratio.{name}", r, "ratios")
            elif _is_number(r) and r > 0:
                ratio[name] = float(r)
            else:
                raise InputFileError(source, f"expected a ratio > 0 or a list of ratios per t, got {r!r}",
                                     f"{at}.ratio.{name}")
        context = _optional(e, "context", lambda v: _is_int(v) and v >= 1, "an integer >= 1", source, at + ".")
        secs = _cost_curves(source, e.get("pass_seconds", {}) or {}, seen, at + ".pass_seconds")
        out.append(BatchCosts(int(b), ratio, context, secs))
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


def drift_warnings(profile: Profile, source: str = "<profile>", tol: float = 0.10) -> list[str]:
    """One line where the target's ``cost`` (its step timed in the rounds over every pass size) and its
    ``step_measured`` (its step timed alone, earlier in the same profile) differ by more than ``tol`` (a share of
    the smaller): the machine's speed moved while the costs were measured (other work, a CPU settling after heavy
    work), so the costs may describe neither speed and a plan solved from them may not fit the machine. The
    target's step is what autoregressive decoding costs, against which every plan's gain is priced. (A quantized
    copy's two timings differ by up to a fifth on a quiet machine: not a sign of drift.)"""
    out = []
    for m in profile.models:
        step = m.extra.get("step_measured")
        if m.kind != "target" or not isinstance(step, (int, float)) or not step > 0 or not m.cost > 0:
            continue
        hi, lo = max(m.cost, step), min(m.cost, step)
        if hi > lo * (1 + tol):
            out.append(f"{source}: models.{m.name}: its step was timed at {step * 1e3:.2f} ms and then at "
                       f"{m.cost * 1e3:.2f} ms in this profile ({hi / lo - 1:.0%} apart): the machine's speed moved "
                       f"while costs were measured, and a plan solved from them may not fit it; profile again on a "
                       f"quiet machine (hsd bench --retime prices a run at the speed of the moment)")
    return out


def check_has_rates(profile: Profile, source: str) -> None:
    """Refuse a costs-only profile (``provenance.costs_only``) where acceptance rates are needed (a plan, a merge
    of rates): :class:`InputFileError` naming ``source`` and saying how to give it rates."""
    if profile.provenance.costs_only:
        raise InputFileError(source, f"a costs-only profile (hsd profile --costs-only) has no acceptance rates: "
                                     f"combine it with a profile's rates first: hsd profile merge-costs --rates "
                                     f"RATES.json --costs {source} -o merged.json", "provenance.costs_only")


def load_profile(path: str | os.PathLike) -> tuple[Profile, list[str]]:
    """Read and validate ``hsd-profile/1`` from ``path``. Returns ``(profile, warnings)``."""
    return profile_from_dict(read_json(path), str(path))


def check_profile(profile: Profile, source: str = "profile") -> dict[str, Any]:
    """Refuse a :class:`Profile` built or changed in Python that :func:`load_profile` would refuse in a file (an
    :class:`InputFileError` naming ``source`` and the field: a rate outside [0, 1] or NaN, a cost that is not a
    number > 0, a target the models lack); its ``to_dict()`` where it passes."""
    d = profile.to_dict()
    profile_from_dict(d, source)
    return d


def save_profile(profile: Profile, path: str | os.PathLike) -> None:
    """Write ``profile`` atomically (:class:`HsdError` for anything but a :class:`Profile`: a plan written as a
    profile was refused only when read; an :class:`InputFileError` naming the path, not written, and the field for
    one that :func:`load_profile` would refuse, as a rate outside [0, 1] set in Python: :func:`check_profile`)."""
    if not isinstance(profile, Profile):
        raise HsdError(f"save_profile: expected a Profile, got {type(profile).__name__}")
    write_json(path, check_profile(profile, f"{path} (not written)"))


def _check_levels(d: dict, source: str, tmax: int, at: str = "",
                  target: str | None = None) -> tuple[list[str], list[int]]:
    """``hierarchy`` and ``budgets`` of a plan (or of its entry at ``at``: ending with the plan's ``target`` where
    given), validated."""
    h = d.get("hierarchy")
    if not isinstance(h, list) or not h or not all(isinstance(x, str) and x for x in h):
        raise InputFileError(source, "expected a non-empty list of model names, target last", at + "hierarchy")
    if len(set(h)) != len(h):
        raise InputFileError(source, f"a model appears twice in {h}", at + "hierarchy")
    if target is not None and h[-1] != target:
        raise InputFileError(source, f"ends with {h[-1]!r}, but the plan's target is {target!r}", at + "hierarchy")
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


#: Where the context a plan is solved for came from (a plan's ``context_from``).
CONTEXT_GIVEN = "given"
CONTEXT_PROMPTS = "profile_prompts"
CONTEXT_TASK_PROMPTS = "task_prompts"
CONTEXT_FIRST = "first_measured_context"
CONTEXT_SOURCES = (CONTEXT_GIVEN, CONTEXT_PROMPTS, CONTEXT_TASK_PROMPTS, CONTEXT_FIRST)


def _check_context_fields(d: dict, source: str, at: str = "") -> tuple[float | None, str | None]:
    """The optional ``context`` (tokens >= 1), ``context_from`` (one of :data:`CONTEXT_SOURCES`) and
    ``latency_by_context`` of a plan or of one of its entries (``at``: the prefix of the fields' names). Returns
    ``(context, context_from)``."""
    c = d.get("context")
    if c is not None and (not _is_number(c) or c < 1):
        raise InputFileError(source, f"expected a context length in tokens (>= 1), got {c!r}", at + "context")
    source_of = _optional(d, "context_from", lambda v: v in CONTEXT_SOURCES, f"one of {', '.join(CONTEXT_SOURCES)}",
                          source, at)
    _check_latency_table(d.get("latency_by_context"), source, at + "latency_by_context")
    return c, source_of


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _optional(d: dict, key: str, ok: Callable[[Any], bool], expected: str, source: str, at: str) -> Any:
    """``d[key]``, None when absent or null; refused, naming the field ``at + key``, unless ``ok(value)``."""
    v = d.get(key)
    if v is not None and not ok(v):
        raise InputFileError(source, f"expected {expected}, got {v!r}", at + key)
    return v


def _positive_latency(d: dict, source: str, at: str) -> float:
    """``d["expected_latency"]``: seconds per token, a number > 0 (``at``: the prefix of the field's name)."""
    v = d.get("expected_latency")
    if not _is_number(v) or v <= 0:
        raise InputFileError(source, f"expected a number > 0, got {v!r}", at + "expected_latency")
    return v


def _quantization(q: Any, source: str, at: str) -> Quantization:
    """A ``quantization`` field (at ``at``): ``bits`` 4 or 8, ``head_bits`` 4 or 8 (default 8), an integer
    ``group_size`` (default 32; >= 1 for 4-bit weights)."""
    if not isinstance(q, dict):
        raise InputFileError(source, f"expected an object {{bits, group_size, head_bits}}, got {q!r}", at)
    bits = q.get("bits")
    if not _is_int(bits) or bits not in (4, 8):
        raise InputFileError(source, f"expected 4 or 8 (bits per weight), got {bits!r}", at + ".bits")
    head_bits = q.get("head_bits", 8)
    if not _is_int(head_bits) or head_bits not in (4, 8):
        raise InputFileError(source, f"expected 4 or 8 (bits per weight of the LM head), got {head_bits!r}",
                             at + ".head_bits")
    group = q.get("group_size", 32)
    if not _is_int(group) or (bits == 4 and group < 1):
        raise InputFileError(source, f"expected an integer (weights per scale, >= 1 for 4 bits), got {group!r}",
                             at + ".group_size")
    extra = {k: v for k, v in q.items() if k not in ("bits", "group_size", "head_bits")}
    return Quantization(bits, group, head_bits, extra, tuple(q))


def _rebuild_fields(m: dict, source: str, at: str) -> tuple[str | None, Quantization | None, dict | None]:
    """The fields of a model entry (at ``at``) that say how to rebuild it at run time, validated when present:
    ``model`` (a non-empty string), ``quantization`` (:func:`_quantization`) and ``config`` (an object)."""
    ref = _optional(m, "model", lambda v: isinstance(v, str) and bool(v), "a model id or path", source, at)
    q = m.get("quantization")
    quant = None if q is None else _quantization(q, source, at + "quantization")
    config = _optional(m, "config", lambda v: isinstance(v, dict), "an object of the drafter's settings", source,
                       at)
    return ref, quant, config


PLAN_MODEL_FIELDS = ("name", "kind", "cost", "can_verify", "layer", "draft_rate", "model", "quantization", "config")


def _plan_models(raw: Any, source: str) -> list[PlanModel]:
    """A plan's ``models`` (absent or null: none): a list of entries with distinct names."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise InputFileError(source, "expected a list of model entries", "models")
    out: list[PlanModel] = []
    seen: set[str] = set()
    for i, m in enumerate(raw):
        at = f"models[{i}]."
        if not isinstance(m, dict):
            raise InputFileError(source, "expected an object", at[:-1])
        name = m.get("name")
        if not isinstance(name, str) or not name:
            raise InputFileError(source, "expected a non-empty string", at + "name")
        if name in seen:
            raise InputFileError(source, f"duplicate model name {name!r}", at + "name")
        seen.add(name)
        kind = m.get("kind", "model")
        if not isinstance(kind, str) or not kind:
            raise InputFileError(source, f"expected a string, got {kind!r}", at + "kind")
        cost = _optional(m, "cost", lambda v: _is_number(v) and v > 0, "a cost in seconds > 0", source, at)
        can_verify = _optional(m, "can_verify", lambda v: isinstance(v, bool), "true or false", source, at)
        layer = _optional(m, "layer", lambda v: _is_int(v) and v >= 0, "a layer index >= 0", source, at)
        rate = _optional(m, "draft_rate", lambda v: _is_number(v) and 0.0 < v <= 1.0, "a share of calls in (0, 1]",
                         source, at)
        ref, quant, config = _rebuild_fields(m, source, at)
        extra = {k: v for k, v in m.items() if k not in PLAN_MODEL_FIELDS}
        out.append(PlanModel(name, kind, cost, can_verify, layer, rate, ref, quant, config, extra, tuple(m)))
    return out


def sampling_words(temperature: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> str:
    """``greedy``, or ``sampling at temperature T`` and its filters, in words."""
    if temperature == 0:
        return "greedy"
    filters = [f"top-k {top_k}" if top_k else "", f"top-p {top_p:g}" if top_p < 1.0 else "",
               f"min-p {min_p:g}" if min_p else ""]
    return f"sampling at temperature {temperature:g}" + "".join(f", {f}" for f in filters if f)


PROVENANCE_FIELDS = ("model", "revision", "heads", "device", "dtype", "target_precision", "temperature", "top_p",
                     "top_k", "min_p", "costs_only")


def provenance_from_dict(raw: dict[str, Any], source: str = "<profile>") -> Provenance:
    """A ``provenance`` object as written to a profile or a plan, validated (:class:`Provenance`)."""
    return _provenance(raw, source)


#: A profile's counts per task in its provenance (prompts, their tokens, the positions measured, the tokens a grammar
#: forced): the contexts and rates of a task's plan are read from them.
TASK_COUNTS = ("prompts_by_task", "prompt_tokens_by_task", "positions_by_task", "forced_by_task")
#: The same over all tasks: the context a plan is solved for is read from them.
TOTAL_COUNTS = ("prompt_count", "prompt_tokens", "generated_tokens")


def _provenance(raw: Any, source: str) -> Provenance:
    """A plan's ``provenance`` (absent or null: empty): the typed fields strings (``temperature`` a number >= 0,
    ``top_p`` one in (0, 1], ``top_k`` an integer >= 0, ``min_p`` one in [0, 1], ``costs_only`` true or false,
    the :data:`TOTAL_COUNTS` and :data:`TASK_COUNTS` finite counts >= 0) or null."""
    if raw is None:
        return Provenance()
    if not isinstance(raw, dict):
        raise InputFileError(source, "expected an object", "provenance")
    at = "provenance."
    text = {k: _optional(raw, k, lambda v: isinstance(v, str), "a string", source, at)
            for k in ("model", "revision", "heads", "device", "dtype", "target_precision")}
    temperature = _optional(raw, "temperature", lambda v: _is_number(v) and v >= 0, "a temperature >= 0", source,
                            at)
    top_p = _optional(raw, "top_p", lambda v: _is_number(v) and 0 < v <= 1, "a share in (0, 1]", source, at)
    top_k = _optional(raw, "top_k", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                      "an integer >= 0", source, at)
    min_p = _optional(raw, "min_p", lambda v: _is_number(v) and 0 <= v <= 1, "a share in [0, 1]", source, at)
    costs_only = _optional(raw, "costs_only", lambda v: isinstance(v, bool), "true or false", source, at)
    for k in TOTAL_COUNTS:
        _optional(raw, k, lambda v: _is_number(v) and v >= 0, "a count >= 0", source, at)
    for k in TASK_COUNTS:
        counts = _optional(raw, k, lambda v: isinstance(v, dict), "an object {task: count}", source, at)
        for task, v in (counts or {}).items():
            if not _is_number(v) or v < 0:
                raise InputFileError(source, f"expected a count >= 0, got {v!r}", f"{at}{k}.{task}")
    extra = {k: v for k, v in raw.items() if k not in PROVENANCE_FIELDS}
    return Provenance(**text, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, costs_only=costs_only,
                      extra=extra, key_order=tuple(raw))


def _alternative(a: Any, source: str, tmax: int, at: str, target: str) -> Alternative:
    """An entry of ``alternatives``, ``exact_optimum`` or ``baselines`` (``at``: the prefix of its fields' names),
    ending with the plan's ``target``."""
    if not isinstance(a, dict):
        raise InputFileError(source, "expected an object {hierarchy, budgets, expected_latency}", at[:-1])
    h, b = _check_levels(a, source, tmax, at, target)
    latency = _positive_latency(a, source, at)
    speedup = _optional(a, "expected_speedup", lambda v: _is_number(v) and v > 0, "a number > 0", source, at)
    _check_latency_table(a.get("latency_by_context"), source, at + "latency_by_context")
    known = ("hierarchy", "budgets", "expected_latency", "expected_speedup", "latency_by_context")
    extra = {k: v for k, v in a.items() if k not in known}
    return Alternative(h, b, latency, speedup, a.get("latency_by_context"), extra, tuple(a))


def _alternatives(raw: Any, source: str, tmax: int, target: str) -> list[Alternative]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise InputFileError(source, "expected a list of {hierarchy, budgets, expected_latency}", "alternatives")
    return [_alternative(a, source, tmax, f"alternatives[{i}].", target) for i, a in enumerate(raw)]


def _is_latency(v: Any) -> bool:
    """Seconds per token: a number > 0 (infinite for a hierarchy that cannot run)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


TASK_PLAN_FIELDS = ("hierarchy", "budgets", "expected_latency", "expected_speedup", "positions", "fallback_pairs",
                    "overall_hierarchies", "context", "context_from", "latency_by_context",
                    "overall_hierarchies_by_context", "forced_share")


def _task_plan(e: Any, source: str, tmax: int, target: str, at: str) -> TaskPlan:
    """An entry of ``by_task``: a valid hierarchy ending with the plan's target (``at``: its fields' prefix)."""
    if not isinstance(e, dict):
        raise InputFileError(source, "expected an object {hierarchy, budgets, expected_latency}", at[:-1])
    h, b = _check_levels(e, source, tmax, at, target)
    latency = _positive_latency(e, source, at)
    speedup = _optional(e, "expected_speedup", lambda v: _is_number(v) and v > 0, "a number > 0", source, at)
    positions = _optional(e, "positions", lambda v: _is_int(v) and v >= 0, "a count of positions", source, at)
    fallbacks = _optional(e, "fallback_pairs", lambda v: _is_int(v) and v >= 0, "a count of pairs", source, at)
    overall = _optional(e, "overall_hierarchies", lambda v: isinstance(v, dict), "an object {key: seconds per "
                        "token}", source, at) or {}
    for key, v in overall.items():
        if not _is_latency(v):
            raise InputFileError(source, f"expected seconds per token > 0, got {v!r}", f"{at}overall_hierarchies.{key}")
    context, context_from = _check_context_fields(e, source, at)
    tables = _optional(e, "overall_hierarchies_by_context", lambda v: isinstance(v, dict),
                       "an object {key: latency_by_context}", source, at) or {}
    for key, tb in tables.items():
        _check_latency_table(tb, source, f"{at}overall_hierarchies_by_context.{key}")
    forced = _optional(e, "forced_share", lambda v: _is_number(v) and 0 <= v < 1, "a share in [0, 1)", source, at)
    extra = {k: v for k, v in e.items() if k not in TASK_PLAN_FIELDS}
    return TaskPlan(h, b, latency, speedup, positions, fallbacks, overall, context, context_from,
                    e.get("latency_by_context"), tables, forced, extra, tuple(e))


def _by_task(raw: Any, source: str, tmax: int, target: str) -> dict[str, TaskPlan]:
    """The optional ``by_task`` section (absent or null: empty): ``{task: entry}`` (:func:`_task_plan`)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InputFileError(source, "expected an object {task: {hierarchy, budgets, expected_latency}}", "by_task")
    return {task: _task_plan(e, source, tmax, target, f"by_task.{task}.") for task, e in raw.items()}


def _by_load(raw: Any, source: str, tmax: int, target: str) -> dict[int, LoadPlan]:
    """The optional ``by_load`` section (absent or null: empty): ``{"n": {hierarchy, budgets, expected_latency,
    tokens_per_s, batched_target_latency}}`` for load levels n >= 1, each hierarchy ending with the target."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InputFileError(source, "expected an object {sequences: {hierarchy, budgets, expected_latency}}",
                             "by_load")
    out: dict[int, LoadPlan] = {}
    for key, e in raw.items():
        at = f"by_load.{key}."
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and key[0] != "0" and len(key) <= 9):
            raise InputFileError(source, f"expected a number of sequences >= 1 as the key (decimal digits, no leading "
                                         f"zero), got {key!r}", at[:-1])
        if not isinstance(e, dict):
            raise InputFileError(source, "expected an object {hierarchy, budgets, expected_latency}", at[:-1])
        h, b = _check_levels(e, source, tmax, at, target)
        latency = _positive_latency(e, source, at)
        tps = _optional(e, "tokens_per_s", lambda v: _is_number(v) and v > 0, "a number > 0", source, at)
        base = _optional(e, "batched_target_latency", _is_latency, "seconds per token > 0", source, at)
        extra = {k: v for k, v in e.items() if k not in ("hierarchy", "budgets", "expected_latency", "tokens_per_s",
                                                         "batched_target_latency")}
        out[int(key)] = LoadPlan(h, b, latency, tps, base, extra, tuple(e))
    return dict(sorted(out.items()))


def _check_level_entries(plan: Plan, hierarchy: list[str], source: str, at: str) -> None:
    """With a ``models`` section, every level of ``hierarchy`` (at ``at + "hierarchy"``) is described (or named
    ``layer<N>``), every level above the bottom can verify (its kind is one of :data:`VERIFIER_KINDS`), and the
    levels that read one model (the target's exits and the target; a draft model's exits and the whole model)
    read it deeper and deeper up the hierarchy (cheapest first, target last: the runtime refuses any other
    order)."""
    if not plan.models:
        return
    deepest: dict[str | None, tuple[str, float]] = {}     # model (None: the target's) -> its level read so far
    for i, name in enumerate(hierarchy):
        e = plan.level_entry(name, i == len(hierarchy) - 1)
        if e is None:
            raise InputFileError(source, f"{name!r} is not described in the plan's models (and is not a "
                                         f"'layer<N>' exit)", f"{at}hierarchy[{i}]")
        if i > 0 and e.kind not in VERIFIER_KINDS:
            raise InputFileError(source, f"{name!r} ({e.kind}) cannot verify: a token drafter may only be the "
                                         f"bottom level", f"{at}hierarchy[{i}]")
        depth = _depth_read(e)
        if depth is None:
            continue
        below = deepest.get(e.model)
        if below is not None and depth <= below[1]:
            raise InputFileError(source, f"{name!r} ({_layers(depth)}) verifies {below[0]!r} ({_layers(below[1])}) "
                                         f"of the same model: each level must read deeper than those below it "
                                         f"(cheapest first, target last)", f"{at}hierarchy[{i}]")
        deepest[e.model] = (name, depth)


def _depth_read(e: PlanModel) -> float | None:
    """How deep a level reads its model: an exit's (or the target's) layer, every layer (infinity) for a whole
    draft model; None where the entry does not say (a quantized copy; an exit without its layer)."""
    if e.kind in ("early_exit", "target") and _is_int(e.layer):
        return float(e.layer)
    if e.kind == "model" and e.model is not None:
        return math.inf
    return None


def _layers(depth: float) -> str:
    return "every layer" if math.isinf(depth) else f"layer {int(depth)}"


PLAN_CORE_FIELDS = ("format", "tmax", "hierarchy", "budgets", "expected_latency", "expected_speedup", "baselines")
PLAN_SECTIONS = ("models", "provenance", "alternatives", "exact_optimum", "by_task", "context", "context_from",
                 "latency_by_context", "solver", "max_depth", "min_gain", "profile_sha256", "task", "by_load",
                 "load_min_gain")


def plan_from_dict(d: Any, source: str = "<plan>") -> Plan:
    """Validate a parsed ``hsd-plan/1`` object into a :class:`Plan`; errors name ``source`` and the field.

    Refused: a wrong ``format``; a bad ``tmax``, ``hierarchy`` or ``budgets``; a latency or speed-up that is not
    a number > 0; a bad entry of ``models`` (no name, a duplicate name, a bad ``cost``, ``layer``, ``model``,
    ``config`` or ``quantization`` field); with ``models``, a level of the hierarchy (or of a ``by_task`` entry)
    that it does not describe or that cannot verify above the bottom; a ``provenance`` field of the wrong type;
    an entry of ``alternatives``, ``exact_optimum`` or ``by_task`` that is not a valid hierarchy; a bad
    ``context`` or ``latency_by_context`` table. A null section reads as an absent one.
    """
    if not isinstance(d, dict):
        raise InputFileError(source, "expected a JSON object")
    if d.get("format") != PLAN_FORMAT:
        raise InputFileError(source, f"expected {PLAN_FORMAT!r}, got {d.get('format')!r}", "format")
    tmax = d.get("tmax")
    if not _is_int(tmax) or not 1 <= tmax < EXACT_PASS:
        raise InputFileError(source, f"expected an integer in 1..{EXACT_PASS - 1} (a verification over more "
                                     f"positions would not be computed as the target's steps), got {tmax!r}", "tmax")
    named = d.get("target")                 # written by the solver; the hierarchy's last level is the target
    if named is not None and not (isinstance(named, str) and named):
        raise InputFileError(source, f"expected the target's name, got {named!r}", "target")
    h, b = _check_levels(d, source, tmax, target=named)
    for key in ("expected_latency", "expected_speedup"):
        v = d.get(key)
        if not _is_number(v) or v <= 0:
            raise InputFileError(source, f"expected a number > 0, got {v!r}", key)
    baselines = d.get("baselines")
    baselines = {} if baselines is None else baselines
    if not isinstance(baselines, dict):
        raise InputFileError(source, "expected an object", "baselines")
    context, context_from = _check_context_fields(d, source)
    for key, entry in baselines.items():                # as alternatives are: kept as they were read
        _alternative(entry, source, tmax, f"baselines.{key}.", h[-1])
    exact = d.get("exact_optimum")
    text = {k: _optional(d, k, lambda v: isinstance(v, str), "a string", source, "")
            for k in ("solver", "profile_sha256", "task")}
    plan = Plan(tmax, h, b, float(d["expected_latency"]), float(d["expected_speedup"]), baselines,
                {k: v for k, v in d.items() if k not in PLAN_CORE_FIELDS + PLAN_SECTIONS},
                models=_plan_models(d.get("models"), source), provenance=_provenance(d.get("provenance"), source),
                alternatives=_alternatives(d.get("alternatives"), source, tmax, h[-1]),
                exact_optimum=None if exact is None else _alternative(exact, source, tmax, "exact_optimum.", h[-1]),
                by_task=_by_task(d.get("by_task"), source, tmax, h[-1]), context=context, context_from=context_from,
                by_load=_by_load(d.get("by_load"), source, tmax, h[-1]),
                latency_by_context=d.get("latency_by_context"),
                max_depth=_optional(d, "max_depth", lambda v: _is_int(v) and v >= 1, "an integer >= 1", source, ""),
                min_gain=_optional(d, "min_gain", lambda v: _is_number(v) and 0 <= v < 1, "a fraction in [0, 1)",
                                   source, ""),
                load_min_gain=_optional(d, "load_min_gain", lambda v: _is_number(v) and 0 <= v < 1,
                                        "a fraction in [0, 1)", source, ""),
                key_order=tuple(d), **text)
    runs = [("", plan.hierarchy)] + [(f"baselines.{key}.", e["hierarchy"]) for key, e in baselines.items()]
    runs += [(f"alternatives[{i}].", a.hierarchy) for i, a in enumerate(plan.alternatives)]
    runs += [("exact_optimum.", plan.exact_optimum.hierarchy)] if plan.exact_optimum is not None else []
    runs += [(f"by_task.{task}.", e.hierarchy) for task, e in plan.by_task.items()]
    runs += [(f"by_load.{n}.", e.hierarchy) for n, e in plan.by_load.items()]
    for at, hierarchy in runs:               # every hierarchy a command may run: its levels described
        _check_level_entries(plan, hierarchy, source, at)
    return plan


def load_plan(path: str | os.PathLike) -> Plan:
    """Read and validate ``hsd-plan/1`` from ``path``."""
    return plan_from_dict(read_json(path), str(path))


def save_plan(plan: Plan, path: str | os.PathLike) -> None:
    """Write ``plan`` atomically (:class:`HsdError` for anything but a :class:`Plan`; an :class:`InputFileError`
    naming the path, not written, and the field for one that :func:`load_plan` would refuse, as budgets changed
    in Python to decrease)."""
    if not isinstance(plan, Plan):
        raise HsdError(f"save_plan: expected a Plan, got {type(plan).__name__}")
    d = plan.to_dict()
    plan_from_dict(d, f"{path} (not written)")
    write_json(path, d)
