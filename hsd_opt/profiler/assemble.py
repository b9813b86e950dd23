"""Turning the measured sums into an ``hsd-profile/1`` :class:`~hsd_opt.formats.Profile`, and merging
profiles of the same model exactly (see ``docs/design.md#the-profiler`` and ``docs/design.md#hsd-profile1``)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

from hsd_opt.errors import HsdError, InputFileError
from hsd_opt.formats import (
    PROFILE_RECORDS,
    BatchCosts,
    ContextCosts,
    ModelEntry,
    Profile,
    check_has_rates,
    provenance_from_dict,
)
from hsd_opt.profiler.checkpoint import differs, setting
from hsd_opt.profiler.pool import NeuralDrafter
from hsd_opt.profiler.stats import PairStats

#: Settings profiles must share to be merged.
MERGE_FIELDS = ("model", "revision", "tokenizer_sha256", "heads_sha256", "temperature", "top_p", "top_k", "min_p",
                "max_new_tokens", "tmax", "raw", "dtype", "target_precision", "layers", "draft_models",
                "draft_revisions", "draft_layers", "quantized", "token_drafters")


def draft_rate(stats: PairStats, token: str, task: str | None = None) -> float | None:
    """Share of the positions where token drafter ``token`` proposed, over all tasks or in ``task`` (1 for a
    drafter that never abstains; a floor of 1e-6 for one that never proposed, whose acceptance is then not
    measured). A token drafter is called once per generated position, so its calls in a task are the task's
    generated tokens; None for a task whose count was not recorded (profiles made before it was)."""
    if task is None:
        calls = stats.counters.get(f"propose_calls.{token}", 0.0)
        if calls <= 0:
            return 1.0
    else:
        calls = stats.counters.get(f"generated_tokens.{task}", 0.0)
        if calls <= 0:
            return None
    return min(1.0, max(1e-6, stats.proposals(token, task) / calls))


def walk_key(count: str, token: str, budget: int, task: str) -> str:
    """The counter of an abstaining drafter's ``count`` (``"rounds"``, or ``"blocks"``: the rounds it proposed
    in) with blocks of ``budget`` tokens on ``task``'s prompts (:func:`~hsd_opt.profiler.measure.walk_rounds`)."""
    return f"walk_{count}.{token}.{budget}.{task}"


def draft_rates_by_budget(stats: PairStats, token: str, task: str | None = None) -> list[float]:
    """An abstaining drafter's share of rounds with a block, ``[f(1), ..., f(n)]`` for budgets 1..n, over all
    tasks or in ``task``: blocks over rounds of its walks (a floor of 1e-6 where it never proposed). ``n`` is
    the largest budget with counted rounds. Empty where its rounds were not walked on every prompt (a grammar's
    prompts, profiles made before the walks), so the solver keeps the share of positions (:func:`draft_rate`)."""
    tasks = stats.tasks if task is None else [task]
    walked = sum(stats.counters.get(f"walked_prompts.{t}", 0.0) for t in tasks)
    if walked <= 0 or any(stats.counters.get(f"walked_prompts.{t}", 0.0) != stats.counters.get(f"prompts.{t}")
                          for t in tasks):
        return []
    out: list[float] = []
    T = 1
    while walk_key("rounds", token, T, tasks[0]) in stats.counters:
        rounds = sum(stats.counters.get(walk_key("rounds", token, T, t), 0.0) for t in tasks)
        if rounds <= 0:
            break
        blocks = sum(stats.counters.get(walk_key("blocks", token, T, t), 0.0) for t in tasks)
        out.append(min(1.0, max(1e-6, blocks / rounds)))
        T += 1
    return out


def prompts_by_task(stats: PairStats) -> tuple[dict[str, int], dict[str, int]]:
    """``(prompts, prompt tokens)`` per task, from the counters ``prompts.<task>`` and ``prompt_tokens.<task>``;
    a task whose counters were not recorded (profiles made before they were) is left out of both."""
    n, p = {}, {}
    for t in stats.tasks:
        a, b = stats.counters.get(f"prompts.{t}"), stats.counters.get(f"prompt_tokens.{t}")
        if a is not None and b is not None:
            n[t], p[t] = int(a), int(b)
    return n, p


def positions_by_task(stats: PairStats) -> dict[str, int]:
    """Generated positions per task: the recorded count, else the largest pair count of the task (profiles made
    before the count was recorded)."""
    out = {}
    for k, t in enumerate(stats.tasks):
        c = stats.counters.get(f"generated_tokens.{t}")
        out[t] = int(c) if c is not None else (int(stats.nn[3, k].max()) if stats.nn.size else 0)
    return out


def forced_by_task(stats: PairStats) -> dict[str, int]:
    """Positions per task where the grammar allowed one token only (prompts with a JSON schema), counted apart
    from the generated positions measured; tasks without a grammar are left out."""
    return {t: int(c) for t in stats.tasks if (c := stats.counters.get(f"forced_tokens.{t}"))}


def results_from_stats(stats: PairStats, order: Sequence[str], can_verify: dict[str, bool],
                       target: str) -> dict[str, Any]:
    """acceptance / greedy_agreement / counts / ci95 / acceptance_by_task for ``drafter`` before ``verifier`` in
    ``order`` (cheapest first) where the verifier can verify, and ``draft_rate_by_task[task][drafter]`` for the
    token drafters that abstain somewhere (the solver's per-task view, ``docs/design.md#plans-per-task``).

    The target verifies every drafter and drafts for none, wherever its measured cost puts it in ``order``: on a
    tiny or loaded machine a drafter can time dearer than the target, and its pair with the target must still be
    recorded (the solver then leaves that drafter out by cost)."""
    order = [n for n in order if n != target] + [target]
    acc: dict[str, dict[str, float]] = {}
    agr: dict[str, dict[str, float]] = {}
    cnt: dict[str, dict[str, int]] = {}
    ci: dict[str, dict[str, list[float]]] = {}
    by_task: dict[str, dict[str, dict[str, float]]] = {t: {} for t in stats.tasks}
    for i, d in enumerate(order):
        for v in order[i + 1:]:
            if not can_verify.get(v, False):
                continue
            a = stats.acceptance(d, v)
            if a is None:
                continue
            acc.setdefault(d, {})[v] = a
            agr.setdefault(d, {})[v] = stats.agreement(d, v)
            cnt.setdefault(d, {})[v] = stats.n(d, v)
            ci.setdefault(d, {})[v] = stats.ci95(d, v)
            for t in stats.tasks:
                at = stats.acceptance(d, v, t)
                if at is not None:
                    by_task[t].setdefault(d, {})[v] = at
    rates: dict[str, dict[str, float]] = {}
    by_budget: dict[str, dict[str, list[float]]] = {}
    for tok in stats.token:
        if draft_rate(stats, tok) >= 1.0:
            continue
        for t in stats.tasks:
            r = draft_rate(stats, tok, t)
            if r is not None:
                rates.setdefault(t, {})[tok] = r
            if rb := draft_rates_by_budget(stats, tok, t):
                by_budget.setdefault(t, {})[tok] = rb
    out = {"acceptance": acc, "greedy_agreement": agr, "counts": cnt, "ci95": ci,
           "acceptance_by_task": {t: v for t, v in by_task.items() if v}}
    if rates:
        out["draft_rate_by_task"] = rates
    if by_budget:
        out["draft_rate_by_budget_by_task"] = by_budget
    return out


def quantization_entry(qeng) -> dict[str, Any]:
    """The ``quantization`` field of a quantized drafter's profile entry (what the runtime rebuilds it from)."""
    return {"bits": qeng.bits, "group_size": qeng.group_size, "head_bits": qeng.head_bits,
            "kernels": qeng.uses_kernels, "activation_dtype": str(qeng.dtype).replace("torch.", ""),
            "weight_bytes": qeng.weight_bytes()}


def batch_costs_entries(prof: Profile, neural: Sequence[NeuralDrafter], batch: dict[int, dict],
                        context: int) -> list[BatchCosts]:
    """The profile's ``batch_costs`` from the timings of each engine (``batch[id(engine)][B] = (ratio over t,
    seconds over t)``): every drafter of an engine (its exits, a copy, the target) takes the engine's ratios,
    every other entry (a token drafter) the batch size; ``pass_seconds`` names each engine by its deepest
    drafter."""
    if not batch:
        return []
    sizes = sorted({b for per in batch.values() for b in per})
    by_name = {nd.name: nd for nd in neural}
    deepest: dict[int, NeuralDrafter] = {}
    for nd in neural:
        if id(nd.engine) not in deepest or nd.boundary > deepest[id(nd.engine)].boundary:
            deepest[id(nd.engine)] = nd
    out = []
    for b in sizes:
        ratio: dict[str, float | list[float]] = {}
        for m in prof.models:
            nd = by_name.get(m.name)
            ratio[m.name] = [round(r, 4) for r in batch[id(nd.engine)][b][0]] if nd is not None else float(b)
        secs = {deepest[k].name: per[b][1] for k, per in batch.items() if k in deepest}
        out.append(BatchCosts(b, ratio, context, secs))
    return out


def context_costs(neural: Sequence[NeuralDrafter], lcs: dict, tmax: int,
                  token_costs: dict[str, list[float]] | None = None,
                  sampling: Sequence[float] | None = None, draw_saving: Sequence[float] | None = None,
                  target_name: str | None = None, window_saving: Sequence[float] | None = None) -> list[ContextCosts]:
    """Every model's step cost, cost curve and verify curves at each measured context, non-decreasing in t and
    in the context (:func:`~hsd_opt.profiler.costs.monotone_in_context`). ``lcs[id(engine)]`` is the list of
    :class:`~hsd_opt.profiler.costs.LayerCosts` of an engine, one per context (the same contexts for every
    engine); ``token_costs[name]`` a token drafter's seconds per ``propose`` at each context; ``sampling[t - 1]``
    (profiles made with a temperature, :func:`~hsd_opt.profiler.costs.time_sampling`) the seconds spent on the
    distributions of a model's pass over t tokens, added to every model's pass (a token drafter's drafts are
    one-hot: nothing to process). ``draw_saving[t - 1]`` (:func:`~hsd_opt.profiler.costs.time_draw_saving`; a
    target that samples by draws through its screen) what the target's pass saves when it ends in draws: taken off
    its ``cost`` (the target alone draws each step) and off its curve for ``verify_cost[target][d]`` of every
    token drafter ``d`` (one-hot drafts, verified by draws), non-decreasing again; its ``cost_curve`` (a model
    drafter below reads its distributions) keeps the pass with them. ``window_saving[t - 1]``
    (:func:`~hsd_opt.profiler.costs.time_window_saving`; sampled with top-k or min-p through the target's screen)
    what a pass over t tokens of the target's engine saves by reading the filters' window: taken off every curve of
    each level on that engine that reads the model's own head (its ``cost``, ``cost_curve`` and ``verify_cost``),
    non-decreasing again."""
    from hsd_opt.profiler.costs import isotonic, monotone_in_context

    tmax1 = tmax + 1
    per = next(iter(lcs.values()))
    contexts = [lc.context for lc in per]
    curves = {nd.name: monotone_in_context([lc.curve(nd.boundary, tmax1) for lc in lcs[id(nd.engine)]])
              for nd in neural}
    verify = {(nv.name, nd.name): monotone_in_context([lc.verify_curve(nd.boundary, nv.boundary, tmax1)
                                                       for lc in lcs[id(nv.engine)]])
              for nv in neural for nd in neural if nd.engine is nv.engine and nd.boundary < nv.boundary}
    tok = {n: isotonic(v) for n, v in (token_costs or {}).items()}
    if sampling is not None:
        extra = _per_pass_size(sampling, tmax1)
        curves = {n: [[x + e for x, e in zip(row, extra)] for row in cv] for n, cv in curves.items()}
        verify = {k: [[x + e for x, e in zip(row, extra)] for row in cv] for k, cv in verify.items()}
    if window_saving is not None and target_name in curves:
        eng = next(nd.engine for nd in neural if nd.name == target_name)
        on = {nd.name for nd in neural if nd.engine is eng and nd.boundary not in getattr(eng, "exit_heads", ())}
        curves = {n: _less(cv, window_saving) if n in on else cv for n, cv in curves.items()}
        verify = {k: _less(cv, window_saving) if k[0] in on else cv for k, cv in verify.items()}
    drawn = None
    if draw_saving is not None and target_name in curves:
        drawn = _less(curves[target_name], draw_saving)
    out = []
    for k, c in enumerate(contexts):
        cost = {n: max(cv[k][0], 1e-9) for n, cv in curves.items()}
        cost.update({n: max(v[k], 1e-9) for n, v in tok.items()})
        vc: dict[str, dict[str, float | list[float]]] = {}
        for (v, d), cv in verify.items():
            vc.setdefault(v, {})[d] = [max(x, 1e-9) for x in cv[k]]
        if drawn is not None:
            cost[target_name] = drawn[k][0]
            for d in tok:
                vc.setdefault(target_name, {})[d] = list(drawn[k])
        out.append(ContextCosts(c, cost, {n: [max(x, 1e-9) for x in cv[k]] for n, cv in curves.items()}, vc))
    return out


def _per_pass_size(values: Sequence[float], tmax1: int) -> list[float]:
    """``values`` per pass size ``t = 1 ..``, cut or padded with its last to ``tmax1`` of them."""
    out = list(values)[:tmax1]
    return out + [out[-1]] * (tmax1 - len(out))


def _less(curve: list[list[float]], saving: Sequence[float]) -> list[list[float]]:
    """Each context's row of ``curve`` (seconds per pass size) less ``saving`` at that size, at least 1e-9 and
    non-decreasing again."""
    from hsd_opt.profiler.costs import isotonic

    return [isotonic([max(x - s, 1e-9) for x, s in zip(row, _per_pass_size(saving, len(row)))]) for row in curve]


def _neural_entries(neural: Sequence[NeuralDrafter], lcs: dict, first: ContextCosts) -> list[ModelEntry]:
    """The model entries of the neural drafters: each its step cost at the first context (``first``), its draft
    model's id, a quantized copy's ``quantization`` and the directly timed step (``step_measured``) where there
    is one."""
    entries: list[ModelEntry] = []
    for nd in neural:
        lc = lcs[id(nd.engine)][0]
        extra: dict[str, Any] = {}
        if nd.model_id:
            extra["model"] = nd.model_id          # a draft model, or the draft model an exit or a copy is of
        if nd.kind == "quantized" or (nd.kind == "target" and nd.engine.is_copy):
            extra["quantization"] = quantization_entry(nd.engine)
        if nd.boundary in lc.step:
            extra["step_measured"] = lc.step[nd.boundary]
        entries.append(ModelEntry(nd.name, nd.kind, first.cost[nd.name], True,
                                  nd.boundary if nd.kind not in ("model", "quantized") else None, extra))
    return entries


def _cost_order(entries: list[ModelEntry], neural: Sequence[NeuralDrafter], target_name: str) -> None:
    """Sort ``entries`` in place: cheapest first, exits of equal cost by layer, the target last."""
    rank = {nd.name: (0, nd.boundary) for nd in neural}
    entries.sort(key=lambda e: (e.name == target_name, e.cost, rank.get(e.name, (0, 0))))


def build_profile(neural: Sequence[NeuralDrafter], tds: Sequence, stats: PairStats, lcs: dict, tmax: int,
                  target_name: str, token_costs: dict[str, list[float]] | None = None,
                  sampling: Sequence[float] | None = None, draw_saving: Sequence[float] | None = None,
                  window_saving: Sequence[float] | None = None) -> Profile:
    """The profile from the sums and the costs (:func:`context_costs`; ``sampling``: the per-pass cost of the
    sampled distributions, in every model's costs; ``draw_saving``: what the target's pass saves by draws;
    ``window_saving``: what a pass of the target's engine saves by reading the filters' window). The
    top-level costs are those of the first (shortest) context, a token drafter's its mean ``propose`` time over
    the profiled positions; the costs at every context are in ``context_costs``
    (`docs/design.md#hsd-profile1`)."""
    cc = context_costs(neural, lcs, tmax, token_costs, sampling, draw_saving, target_name, window_saving)
    first = cc[0]
    entries = _neural_entries(neural, lcs, first)
    for d in tds:
        calls = stats.counters.get(f"propose_calls.{d.name}", 0.0)
        secs = stats.counters.get(f"propose_seconds.{d.name}", 0.0)
        c = secs / calls if calls > 0 else 1e-6
        entries.append(_rates_of(ModelEntry(d.name, d.kind, max(c, 1e-9), False, None, {"config": d.config()}),
                                 stats))
    _cost_order(entries, neural, target_name)
    order = [e.name for e in entries]
    res = results_from_stats(stats, order, {e.name: e.can_verify for e in entries}, target_name)
    return Profile(target_name, entries, res["acceptance"], first.verify_cost, first.cost_curve, context_costs=cc,
                   stats=stats.to_dict(), **_records(res))


def costs_profile(neural: Sequence[NeuralDrafter], tds: Sequence, lcs: dict, tmax: int, target_name: str,
                  token_costs: dict[str, list[float]], sampling: Sequence[float] | None = None,
                  draw_saving: Sequence[float] | None = None, window_saving: Sequence[float] | None = None
                  ) -> Profile:
    """A profile of costs alone (``hsd profile --costs-only``): the entries and costs :func:`build_profile` makes
    from the same timings, with no acceptance rates and no statistics. A token drafter's top-level cost is its
    ``propose`` seconds at the first context (there are no profiled positions to average over) and its draft
    rate 1 (``hsd profile merge-costs`` keeps the rates profile's)."""
    cc = context_costs(neural, lcs, tmax, token_costs, sampling, draw_saving, target_name, window_saving)
    first = cc[0]
    entries = _neural_entries(neural, lcs, first)
    entries += [ModelEntry(d.name, d.kind, first.cost[d.name], False, None, {"config": d.config()}) for d in tds]
    _cost_order(entries, neural, target_name)
    return Profile(target_name, entries, {}, first.verify_cost, first.cost_curve, context_costs=cc)


def _rates_of(entry: ModelEntry, stats: PairStats) -> ModelEntry:
    """A token drafter's entry with its draft rates from ``stats``: the share of positions, and where it abstains
    and its rounds were walked, the share of rounds per budget."""
    rate = draft_rate(stats, entry.name)
    by_budget = tuple(draft_rates_by_budget(stats, entry.name)) if rate < 1.0 else ()
    return replace(entry, draft_rate=rate, draft_rate_by_budget=by_budget)


def _records(res: dict) -> dict:
    """The profile's records (:data:`~hsd_opt.formats.PROFILE_RECORDS`) of :func:`results_from_stats`' result."""
    return {k: res.get(k) or {} for k in PROFILE_RECORDS}


def _shards(prov: dict, path: Path | str = "profile") -> list[tuple[int, int]] | None:
    """The shards of its prompt set a profile's statistics cover (``(i, n)``: shard ``i`` of ``n``), None for the
    whole set; :class:`InputFileError` naming ``path`` and the field where one is not a pair ``0 <= i < n``."""
    field = "provenance.shards" if prov.get("shards") else "provenance.shard"
    given = prov["shards"] if prov.get("shards") else [prov["shard"]] if prov.get("shard") else None
    if given is None:
        return None
    if not isinstance(given, list) or not all(
            isinstance(s, list) and len(s) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in s)
            and 0 <= s[0] < s[1] for s in given):
        raise InputFileError(str(path), f"expected shards as [i, n] with 0 <= i < n, got {json.dumps(given)}", field)
    return [tuple(s) for s in given]


def _prompt_set(prov: dict, path: Path | str) -> str | None:
    """The SHA-256 of the prompt set a profile was measured on (None where not recorded); an
    :class:`InputFileError` naming ``path`` and the field where it is not a string."""
    sha = prov.get("prompts_sha256")
    if sha is not None and not isinstance(sha, str):
        raise InputFileError(str(path), f"expected the prompt set's SHA-256 as a string, got {json.dumps(sha)}",
                             "provenance.prompts_sha256")
    return sha


def _prompt_keys(prov: dict, path: Path | str) -> list[str] | None:
    """The keys of the prompts a profile measured (``provenance.prompt_keys``:
    :func:`~hsd_opt.profiler.run.prompt_keys`; None where not recorded); an :class:`InputFileError` naming
    ``path`` and the field where they are not a list of strings."""
    keys = prov.get("prompt_keys")
    if keys is not None and not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise InputFileError(str(path), "expected a list of prompt keys (strings)", "provenance.prompt_keys")
    return keys


class _Coverage:
    """The prompts the profiles of a merge measured, added one file at a time: :meth:`add` warns of those counted
    twice (by prompt keys, :func:`_prompt_keys`; by prompt set and shards where a file has none) and refuses a
    file of a prompt set merged with another ``--max-prompts``; :meth:`record` is what the merged provenance says
    it covers."""

    def __init__(self, path: Path, prov: dict, warn: Callable[[str], None]):
        self.warn = warn
        self.covered: dict = {}     # prompt set -> [(path, shards, seed, max_prompts)]
        self.kept: list = []        # each file's prompt keys (None: not recorded)
        self.measured: dict = {}    # prompt key -> the first file that measured it
        self._keep(path, prov, _prompt_keys(prov, path))

    def _keep(self, path: Path, prov: dict, keys: list[str] | None) -> None:
        self.kept.append(keys)
        for k in keys or []:
            self.measured.setdefault(k, path)
        self.covered.setdefault(_prompt_set(prov, path), []).append(
            (path, _shards(prov, path), prov.get("seed"), prov.get("max_prompts")))

    def add(self, path: Path, prov: dict) -> None:
        same_set = self.covered.get(_prompt_set(prov, path), [])
        _check_prompt_limit(path, prov, same_set)
        keys = _prompt_keys(prov, path)
        if keys is not None and all(k is not None for k in self.kept):
            twice = [k for k in keys if k in self.measured]
            if twice:
                self.warn(f"{path}: its prompts overlap {self.measured[twice[0]]}'s ({len(twice)} of them the same "
                          f"prompt{' and draw' if '@' in twice[0] else ''}): their positions are counted twice")
        else:                       # files made before prompt keys were recorded: by their sets and shards
            sampled = (setting(prov, "temperature") or 0) > 0
            shards = _shards(prov, path)
            clash = next((q for q, other, seed, _ in same_set if _overlap(shards, other)
                          and not (sampled and prov.get("seed") != seed)), None)
            if clash is not None:   # (sampled with another seed: other samples, not counted twice)
                self.warn(f"{path}: its prompts overlap {clash}'s (the same prompt set, and shards that are not "
                          f"disjoint): their positions are counted twice")
        self._keep(path, prov, keys)

    def record(self) -> dict:
        """The merged provenance's ``prompt_keys`` (where every file has them) and ``shards`` (where its files are
        shards of one prompt set that do not make the whole set)."""
        out: dict = {}
        if all(k is not None for k in self.kept):
            out["prompt_keys"] = [k for keys in self.kept for k in keys]
        shards = _merged_shards(self.covered)
        if shards is not None:
            out["shards"] = shards
        return out


def _check_prompt_limit(path: Path, prov: dict, same_set: list) -> None:
    """Refuse (naming ``provenance.max_prompts``) a profile of a prompt set already merged from a profile with
    another ``--max-prompts`` (``same_set``: ``(path, shards, seed, max_prompts)`` of those): the shards of one run
    share it, and a merge of others would say it covers the set's shards where it holds only some of their
    prompts."""
    for q, _, _, theirs in same_set[:1]:
        if prov.get("max_prompts") != theirs:
            raise InputFileError(str(path), f"cannot merge: max_prompts = {prov.get('max_prompts')!r} but {q} (the "
                                            f"same prompt set) has {theirs!r}", "provenance.max_prompts")


def _overlap(a: list | None, b: list | None) -> bool:
    """Whether two coverages of one prompt set may share prompts: either is the whole set, they share a shard, or
    they cut the set into a different number of shards."""
    return a is None or b is None or any(x == y or x[1] != y[1] for x in a for y in b)


def _merged_shards(covered: dict) -> list[list[int]] | None:
    """The ``shards`` a merged profile records: those of its one prompt set, where its profiles were shards that do
    not make the whole set together; None where they do, where one covered the whole set, or for several sets."""
    if len(covered) != 1:
        return None
    parts = [s for _, shards, *_ in next(iter(covered.values())) for s in (shards or [None])]
    if None in parts or len({n for _, n in parts}) != 1:
        return None
    union = sorted(set(parts))
    return None if len(union) == union[0][1] else [list(s) for s in union]


def _raw_stats(path: Path, prof: Profile) -> PairStats:
    """``prof``'s raw statistics, read; a damaged ``stats`` is an :class:`InputFileError` naming ``path``."""
    try:
        return PairStats.from_dict(prof.stats)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        what = f"missing {e}" if isinstance(e, KeyError) else str(e)
        raise InputFileError(str(path), f"its raw statistics cannot be read ({what})", "stats") from None


def merge_profiles(paths: Sequence[Path], warn: Callable[[str], None] | None = None) -> Profile:
    """Combine profiles of the same model and settings exactly: the raw sums (``stats``) are added and every
    rate is recomputed. Costs, cost curves and verify costs are the FIRST profile's (costs are measurements of
    one machine, not sums; profile costs on the machine you will run on)."""
    from hsd_opt.formats import load_profile

    warn = warn or (lambda s: None)
    if isinstance(paths, (str, os.PathLike)):
        raise HsdError(f"hsd profile merge: give a list of profiles, got one path {str(paths)!r}")
    if len(paths) < 2:
        raise HsdError("hsd profile merge: give at least two profiles")
    profs = []
    for p in paths:
        prof, _ = load_profile(p)
        check_has_rates(prof, str(p))
        if prof.stats is None:
            raise InputFileError(str(p), "has no raw statistics (made by another tool?); cannot merge exactly",
                                 "stats")
        profs.append((Path(p), prof))
    p0, first = profs[0]
    prov0 = first.provenance.to_dict()
    stats = _raw_stats(p0, first)
    read = [stats]                                  # each file's own statistics, read once
    coverage = _Coverage(p0, prov0, warn)
    prompt_sets = [prov0.get("prompts_sha256")]
    for p, prof in profs[1:]:
        prov = prof.provenance.to_dict()
        for f in MERGE_FIELDS:
            if differs(prov, prov0, f):
                raise InputFileError(str(p), f"cannot merge: {f} = {setting(prov, f)!r} but {p0} has "
                                             f"{setting(prov0, f)!r}", f"provenance.{f}")
        if prof.target != first.target:
            raise InputFileError(str(p), f"cannot merge: target {prof.target!r} but {p0} has {first.target!r}",
                                 "target")
        s = _raw_stats(p, prof)
        read.append(s)
        if s.neural + s.token != stats.neural + stats.token:
            raise InputFileError(str(p), f"cannot merge: drafters {s.neural + s.token} differ from {p0}'s "
                                         f"{stats.neural + stats.token}", "stats")
        coverage.add(p, prov)
        prompt_sets.append(prov.get("prompts_sha256"))
        try:
            stats = stats.merge(s)
        except (KeyError, TypeError, ValueError) as e:
            raise InputFileError(str(p), f"cannot merge its statistics with {p0}'s ({e})", "stats") from None
    entries = [_rates_of(e, stats) if e.name in stats.token else e for e in first.models]
    order = [e.name for e in entries]
    res = results_from_stats(stats, order, {e.name: e.can_verify for e in entries}, first.target)
    prov = dict(prov0)
    prov.update({"merged_from": [str(p) for p, _ in profs], "prompts_sha256_list": prompt_sets,
                 "prompt_count": int(stats.counters.get("prompts", 0)),
                 "prompt_tokens": int(stats.counters.get("prompt_tokens", 0)),
                 "generated_tokens": int(stats.counters.get("generated_tokens", 0)),
                 "positions_by_task": positions_by_task(stats), "forced_by_task": forced_by_task(stats),
                 "costs_from": str(p0)})
    for key in ("shard", "prompt_keys"):
        prov.pop(key, None)
    prov.update(coverage.record())
    # per-task prompt lengths only when every merged file counted them (else the sums would cover some files only)
    complete = all(set(prompts_by_task(one)[0]) == set(one.tasks) for one in read)
    for key, v in zip(("prompts_by_task", "prompt_tokens_by_task"), prompts_by_task(stats)):
        prov.pop(key, None)
        if v and complete:
            prov[key] = v
    return replace(first, models=entries, acceptance=res["acceptance"], provenance=provenance_from_dict(prov, str(p0)),
                   stats=stats.to_dict(), **_records(res))


#: The settings that change what a cost measures (the target's sampling work, the target's own precision): the
#: costs merged with rates must have been measured with the rates' (the device and its dtype may differ, so may
#: one float precision from another: a plan for a GPU's bfloat16 target from rates measured in float32 on a CPU).
COST_FIELDS = ("temperature", "top_p", "top_k", "min_p", "target_precision")
#: The targets that compute the model's own numbers, up to rounding (int8 and int4 targets are other models).
FLOAT_PRECISIONS = ("float32", "bfloat16", "float16")


def _same_costed_work(rates: Profile, costs: Profile, rates_source: str, costs_source: str) -> None:
    """Refuse ``costs`` measured under other :data:`COST_FIELDS` than ``rates`` (naming the field); a
    ``target_precision`` is compared only where both files record one, and two of :data:`FLOAT_PRECISIONS` are
    the same model's; refuse ``costs`` of a smaller ``tmax`` (its cost curves stop short of the rates')."""
    a, b = rates.provenance.to_dict(), costs.provenance.to_dict()
    ta, tb = a.get("tmax"), b.get("tmax")
    if isinstance(ta, int) and isinstance(tb, int) and tb < ta:
        raise InputFileError(costs_source, f"its costs were measured up to tmax {tb}, {rates_source}'s rates up to "
                                           f"{ta}: measure the costs with --tmax {ta} or more", "provenance.tmax")
    for f in COST_FIELDS:
        if f == "target_precision" and (a.get(f) is None or b.get(f) is None
                                        or {a[f], b[f]} <= set(FLOAT_PRECISIONS)):
            continue
        if setting(a, f) != setting(b, f):
            raise InputFileError(costs_source, f"its costs were measured with {f} = {setting(b, f)!r}, "
                                               f"{rates_source}'s rates with {setting(a, f)!r}: measure the costs "
                                               f"with the same setting", f"provenance.{f}")


#: The provenance fields that say where and how costs were timed: a merged profile takes them from the costs' file
#: (what ``hsd run`` compares with the machine it runs on, the sampling time ``hsd bench --retime`` takes out of
#: each cost), the rates' own kept in ``rates_measured_with``.
MACHINE_FIELDS = ("device", "torch_threads", "threads_note", "kernels", "torch_path", "torch", "cpu_count", "host",
                  "load_average", "cost_contexts", "cost_plan", "cost_model", "cost_model_check", "sampling_seconds",
                  "draw_saving_seconds", "window_saving_seconds")


def _same_model(rates: Profile, costs: Profile, rates_source: str, costs_source: str) -> None:
    """Refuse ``costs`` of a model of another shape (``model_shape``) or tokenizer (``tokenizer_sha256``) than
    ``rates``', each compared where both files record it (their ids differ rightly: a GGUF's rates and its shipped
    configuration's costs)."""
    a, b = rates.provenance, costs.provenance
    sa, sb = a.get("model_shape"), b.get("model_shape")
    if isinstance(sa, dict) and isinstance(sb, dict):
        differ = [f"{k} {sb.get(k)} against {sa.get(k)}" for k in sorted(set(sa) | set(sb))
                  if sa.get(k) is not None and sb.get(k) is not None and sa.get(k) != sb.get(k)]
        if differ:
            raise InputFileError(costs_source, f"its costs are of another model than {rates_source}'s rates "
                                               f"({', '.join(differ)})", "provenance.model_shape")
    ta, tb = a.get("tokenizer_sha256"), b.get("tokenizer_sha256")
    if ta and tb and ta != tb:
        raise InputFileError(costs_source, f"its model's tokenizer differs from {rates_source}'s (tokenizer_sha256 "
                                           f"{tb} against {ta})", "provenance.tokenizer_sha256")


def merge_costs(rates: Profile, costs: Profile, rates_source: str, costs_source: str) -> Profile:
    """A profile with ``rates``' acceptance rates, statistics, draft rates and provenance and ``costs``' costs:
    its drafters' step costs, cost curves, verify costs, context and batch costs, and each model entry's
    ``step_measured`` and ``quantization``. For a plan on hardware the rates were not measured on: the rates are
    the models' own (any device computes the same numbers up to rounding), the costs the device's. The pool is
    ``rates``'; ``costs`` must hold each of its drafters under the same name and kind (a drafter only in
    ``costs`` is left out; a costs-only profile, ``hsd profile --costs-only``, is one). The provenance records
    where the costs came from (``costs_from``) and takes their :data:`MACHINE_FIELDS`.

    Raises:
        InputFileError: ``rates`` is a costs-only profile; ``costs`` lacks a drafter of ``rates``, has it as
            another kind, has another target, is of a model of another shape or tokenizer, or was measured with
            other :data:`COST_FIELDS` (naming the file and the drafter or field).
    """
    if rates.provenance.costs_only:
        raise InputFileError(rates_source, "a costs-only profile has no acceptance rates to keep: give it as "
                                           "--costs, and as --rates a profile measured with them",
                             "provenance.costs_only")
    if costs.target != rates.target:
        raise InputFileError(costs_source, f"its target is {costs.target!r}, {rates_source}'s {rates.target!r}",
                             "target")
    _same_costed_work(rates, costs, rates_source, costs_source)
    _same_model(rates, costs, rates_source, costs_source)
    names = set(rates.names)
    missing = [n for n in rates.names if n not in costs.names]
    if missing:
        raise InputFileError(costs_source, f"has no costs for {', '.join(missing)} (drafters of {rates_source})",
                             "models")
    models = []
    for m in rates.models:
        c = costs.entry(m.name)
        if c.kind != m.kind:
            raise InputFileError(costs_source, f"{m.name!r} is a {c.kind} here, a {m.kind} in {rates_source}",
                                 f"models.{m.name}.kind")
        models.append(m.with_costs_of(c))

    def pairs(vc: dict) -> dict:
        return {v: {d: x for d, x in row.items() if d in names} for v, row in vc.items() if v in names}

    def only(d: dict) -> dict:
        return {k: v for k, v in d.items() if k in names}

    contexts = [ContextCosts(e.context, only(e.cost), only(e.cost_curve), pairs(e.verify_cost))
                for e in costs.context_costs]
    batches = [BatchCosts(b.batch, only(b.ratio), b.context, only(b.pass_seconds)) for b in costs.batch_costs]
    prov = rates.provenance.to_dict()
    cp = costs.provenance
    prov["costs_from"] = {"file": costs_source, "model": cp.model, "device": cp.device, "dtype": cp.dtype,
                          "target_precision": cp.target_precision, "kernels": cp.get("kernels"),
                          "torch_path": cp.get("torch_path"),
                          "torch_threads": cp.threads, "date": cp.get("date"), "costs_only": bool(cp.costs_only)}
    # the plan is for the target the costs timed: runs load it in their dtype (the rates' differed by rounding)
    for f in ("dtype", "target_precision"):
        if cp.get(f) is not None and prov.get(f) is not None and cp.get(f) != prov.get(f):
            prov.setdefault("rates_measured_with", {})[f] = prov[f]
            prov[f] = cp.get(f)
    for f in MACHINE_FIELDS:           # and for the machine they were timed on
        if prov.get(f) != cp.get(f):
            if prov.get(f) is not None:
                prov.setdefault("rates_measured_with", {})[f] = prov.pop(f)
            if cp.get(f) is not None:
                prov[f] = cp.get(f)
    return replace(rates, models=models, verify_cost=pairs(costs.verify_cost), cost_curve=only(costs.cost_curve),
                   context_costs=contexts, batch_costs=batches, provenance=provenance_from_dict(prov, rates_source))
