"""Adding up generations into the figures ``hsd bench`` and ``hsd run`` report, overall and per task.

A :class:`Generation` is one call of a method on one turn of one prompt. :class:`Totals` holds sums only (tokens,
seconds, decode seconds, target calls, per-level counters, predicted seconds and contexts weighted by tokens), so
the totals of the tasks add up exactly to the overall ones; every rate (tokens/s, ms/token, tokens per target call,
acceptance per level, predicted ms/token, the mean context and the context predicted at) is derived from the sums
by :meth:`Totals.to_dict`.

Units: seconds (wall time), tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from hsd_opt.jsonio import atomic_write
from hsd_opt.runtime.decode import LevelStats, add_levels


@dataclass
class Generation:
    """One generation: ``item`` (index of the prompt in its file), ``turn`` (0-based), the prompt's ``task`` and
    ``category``, the generated ``token_ids``, wall ``seconds`` (prefill included), our runtime's ``stats``
    (None for Hugging Face methods), the plan it ran (``"plan"``, ``"by_task.<task>"``; None when not a plan),
    the plan's ``predicted`` seconds per token for it (None when unknown), its ``context`` (tokens: the prompt
    plus half the generated tokens) and the context the prediction was taken at (``predicted_at``: the
    generation's own for a plan with costs at several contexts, else the plan's; None when unknown);
    ``retimed``: the same prediction with the profile's costs scaled to the engines' speed measured while the
    benchmark ran (:mod:`hsd_opt.measure.retime`; None when not asked for)."""

    item: int
    turn: int
    task: str
    category: str
    token_ids: list[int]
    seconds: float
    stats: dict[str, Any] | None = None
    plan: str | None = None
    predicted: float | None = None
    context: float | None = None
    predicted_at: float | None = None
    retimed: float | None = None

    def key(self, by: str = "group") -> str:
        return self.category if by == "category" else self.task


@dataclass
class Totals:
    """Sums over generations (see the module doc). ``levels`` are summed while every generation ran the same
    hierarchy; with several hierarchies (plans per task) they are dropped (``mixed``)."""

    items: set = field(default_factory=set)
    generations: int = 0
    tokens: int = 0
    seconds: float = 0.0
    decode_seconds: float = 0.0
    target_calls: int = 0
    ours: bool = False
    hierarchy: tuple | None = None
    levels: list[LevelStats] | None = None
    mixed: bool = False
    plans: set = field(default_factory=set)
    predicted_seconds: float = 0.0        # sum of predicted seconds/token x tokens
    unpredicted: int = 0                  # generations without a prediction
    context_tokens: float = 0.0           # sum of context x tokens (generations with a context)
    context_weight: int = 0               # tokens of the generations with a context
    predicted_at_tokens: float = 0.0      # sum of the prediction's context x tokens
    predicted_at_unknown: int = 0         # generations with a prediction but no context for it
    retimed_seconds: float = 0.0          # sum of re-timed predicted seconds/token x tokens
    retimed_count: int = 0                # generations with a re-timed prediction
    prefill_tokens: int = 0               # prompt positions computed by the prefills (ours; stats' prefill_tokens)
    prefill_seconds: float = 0.0          # those prefills' seconds
    prefilled: int = 0                    # generations counted in the two above

    def add(self, g: Generation) -> "Totals":
        self.items.add(g.item)
        self.generations += 1
        n = len(g.token_ids)
        self.tokens += n
        self.seconds += g.seconds
        if g.plan is not None:
            self.plans.add(g.plan)
        if g.predicted is None:
            self.unpredicted += 1
        else:
            self.predicted_seconds += g.predicted * n
            if g.predicted_at is None:
                self.predicted_at_unknown += 1
            else:
                self.predicted_at_tokens += g.predicted_at * n
        if g.retimed is not None:
            self.retimed_seconds += g.retimed * n
            self.retimed_count += 1
        if g.context is not None:
            self.context_tokens += g.context * n
            self.context_weight += n
        if g.stats is not None:
            self.ours = True
            self.decode_seconds += g.stats["decode_seconds"]
            self.target_calls += g.stats["target_calls"]
            self._add_levels(tuple(lv["name"] for lv in g.stats["levels"]), g.stats["levels"])
            if "prefill_tokens" in g.stats and "prefill_seconds" in g.stats:
                self.prefill_tokens += g.stats["prefill_tokens"]
                self.prefill_seconds += g.stats["prefill_seconds"]
                self.prefilled += 1
        return self

    def _add_levels(self, hierarchy: tuple, levels: list[dict]) -> None:
        if self.mixed:
            return
        if self.hierarchy is None:
            self.hierarchy = hierarchy
        if hierarchy != self.hierarchy:
            self.mixed, self.levels = True, None
            return
        self.levels = add_levels(self.levels, levels)

    def merge(self, other: "Totals") -> "Totals":
        """Add ``other``'s sums into these (what the overall figures are: the sum of the tasks')."""
        self.items |= other.items
        for k in ("generations", "tokens", "seconds", "decode_seconds", "target_calls", "predicted_seconds",
                  "unpredicted", "context_tokens", "context_weight", "predicted_at_tokens", "predicted_at_unknown",
                  "retimed_seconds", "retimed_count", "prefill_tokens", "prefill_seconds", "prefilled"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.ours |= other.ours
        self.plans |= other.plans
        if other.mixed:
            self.mixed, self.levels = True, None
        elif other.hierarchy is not None:
            self._add_levels(other.hierarchy, [lv.to_dict() for lv in other.levels or []])
        return self

    def to_dict(self) -> dict[str, Any]:
        """The reported fields: sums, then the rates derived from them (None where undefined)."""
        n, s = self.tokens, self.seconds
        d: dict[str, Any] = {"prompts": len(self.items), "generations": self.generations, "tokens": n,
                             "seconds": s, "tokens_per_s": n / s if s else None}
        if self.context_weight:
            d["mean_context"] = self.context_tokens / self.context_weight
        if self.ours:
            d["decode_seconds"] = self.decode_seconds
            d["seconds_per_token"] = self.decode_seconds / n if n else None
            d["target_calls"] = self.target_calls
            d["tokens_per_target_call"] = n / self.target_calls if self.target_calls else None
            if self.levels is not None:
                d["levels"] = [lv.to_dict() for lv in self.levels]
            if self.prefilled and self.prefilled == self.generations:
                p, ps = self.prefill_tokens, self.prefill_seconds
                d.update(prefill_tokens=p, prefill_seconds=ps, prefill_tokens_per_s=p / ps if ps else None)
            pr = self.predicted_seconds / n if n and not self.unpredicted else None
            d["predicted_seconds_per_token"] = pr
            d["predicted_at_context"] = (self.predicted_at_tokens / n if pr is not None and not
                                         self.predicted_at_unknown else None)
            if pr and d["seconds_per_token"]:
                d["measured_over_predicted"] = d["seconds_per_token"] / pr
            if self.retimed_count and self.retimed_count == self.generations and n:
                rt = self.retimed_seconds / n
                d["retimed_predicted_seconds_per_token"] = rt
                if d["seconds_per_token"]:
                    d["measured_over_retimed"] = d["seconds_per_token"] / rt
        if self.plans:
            d["plans"] = sorted(self.plans)
        return d


def totals_by(gens: Iterable[Generation], by: str = "group") -> tuple[Totals, dict[str, Totals]]:
    """``(overall, {task: totals})`` of ``gens``: tasks (or categories, ``by="category"``) sorted; the overall
    totals are the tasks' added in that order."""
    per: dict[str, Totals] = {}
    for g in gens:
        per.setdefault(g.key(by), Totals()).add(g)
    per = dict(sorted(per.items()))
    overall = Totals()
    for t in per.values():
        overall.merge(t)
    return overall, per


def outputs_by_item(gens: Iterable[Generation]) -> dict[int, list[list[int]]]:
    """``{item: [token ids of turn 0, turn 1, ...]}``."""
    out: dict[int, list[list[int]]] = {}
    for g in sorted(gens, key=lambda g: (g.item, g.turn)):
        out.setdefault(g.item, []).append(g.token_ids)
    return out


def add_matches(d: dict[str, Any], items: Iterable[int], outs: dict[int, list], ref: dict[int, list]) -> None:
    """Set ``matches_reference`` / ``prompts_matching`` in ``d`` over ``items``: a prompt matches when every
    turn's output equals the reference's."""
    same = [outs.get(i) == ref.get(i) for i in sorted(items)]
    d["matches_reference"] = all(same)
    d["prompts_matching"] = sum(same)


def add_speedups(methods: dict[str, dict[str, Any]]) -> None:
    """``speedup_vs_hf_ar`` and ``speedup_vs_ar`` (tokens/s ratios) of every method in ``methods``."""
    for d in methods.values():
        for base in ("hf_ar", "ar"):
            b = methods.get(base, {}).get("tokens_per_s")
            d[f"speedup_vs_{base}"] = d["tokens_per_s"] / b if b and d.get("tokens_per_s") else None


def plot_report(report: dict[str, Any], path) -> None:
    """PNG: tokens/s per method (left), predicted (and re-timed, ``--retime``) vs measured ms/token for our methods
    (middle), and per task the speed-up over ``hf_ar`` of every method (right; tokens/s when ``hf_ar`` was not
    run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = {m: d for m, d in report["methods"].items() if d.get("tokens_per_s")}
    by_task = report.get("by_task") or {}
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 4.2), gridspec_kw={"width_ratios": [1, 1, 1.4]})
    names = list(ms)
    how = "greedy" if not report.get("sampling") else (f"T={report['sampling']['temperature']:g}, "
                                                        f"top-p {report['sampling']['top_p']:g}")
    a.bar(names, [ms[m]["tokens_per_s"] for m in names], color="tab:blue")
    a.set_ylabel("tokens / s")
    a.set_title(f"throughput ({how}, same prompts)")
    a.tick_params(axis="x", rotation=30)
    ours = [m for m in names if ms[m].get("seconds_per_token")]
    x = range(len(ours))
    bars = [("predicted_seconds_per_token", "predicted (plan)")]
    if any(ms[m].get("retimed_predicted_seconds_per_token") for m in ours):
        bars.append(("retimed_predicted_seconds_per_token", "predicted, costs re-timed"))
    bars.append(("seconds_per_token", "measured"))
    w = 0.8 / len(bars)
    for k, (key, label) in enumerate(bars):
        b.bar([i - 0.4 + w * (k + 0.5) for i in x], [1e3 * (ms[m].get(key) or 0) for m in ours], w, label=label)
    b.set_xticks(list(x), ours)
    b.tick_params(axis="x", rotation=30)
    b.set_ylabel("ms / token (decode)")
    b.set_title("latency: predicted vs measured")
    b.legend()
    tasks = list(by_task)
    field_ = "speedup_vs_hf_ar" if "hf_ar" in ms else "tokens_per_s"
    shown = [m for m in names if m != "hf_ar" or field_ == "tokens_per_s"]
    w = 0.8 / max(1, len(shown))
    for k, m in enumerate(shown):
        c.bar([i - 0.4 + w * (k + 0.5) for i in range(len(tasks))],
              [(by_task[t].get(m) or {}).get(field_) or 0 for t in tasks], w, label=m)
    if field_ == "speedup_vs_hf_ar":
        c.axhline(1.0, color="grey", lw=0.8)
    c.set_xticks(list(range(len(tasks))), tasks)
    c.tick_params(axis="x", rotation=30)
    c.set_ylabel("speed-up vs hf_ar" if field_ == "speedup_vs_hf_ar" else "tokens / s")
    c.set_title(f"per {report.get('by', 'group') if report.get('by') == 'category' else 'task'}")
    c.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, dpi=100, format="png"))
    plt.close(fig)
