"""Predictions at the machine's speed of the moment: a profile's costs scaled by step times measured now.

A plan predicts with the costs timed when its profile was made. On a machine whose speed drifts (a shared VM, a
laptop that throttles) the engines may run 10-30% faster or slower during a benchmark, and not all by the same
factor (on the project's VM the integer kernels and the float32 stream drift independently, within minutes).
``hsd bench --retime PROFILE`` times one decode step of every engine the benchmarked hierarchies run, once per
prompt, interleaved with the methods (:class:`StepClock`), and prices each of our generations again with the
profile's costs scaled engine by engine by the ratio of that step to the profile's step at the same context
(:func:`scale_costs`, :func:`retimed_latency`). The latency model (acceptance, expected rounds, budgets) is
unchanged; only the costs are brought to the moment. So the gap between the re-timed prediction and the measured
time is the model's error, and the gap between the two predictions the machine's drift.

One ratio scales all of an engine's costs (steps, passes over t tokens, verify passes, at every context): the
drift is taken to be a uniform change of speed. Token drafters keep their costs (microseconds).

Units: seconds; contexts in tokens.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any, Mapping, Sequence

import torch

from hsd_opt.engine.state import DecodeState
from hsd_opt.engine.timing import median_pass
from hsd_opt.errors import HsdError
from hsd_opt.formats import ContextCosts, Profile
from hsd_opt.models.loading import same_model
from hsd_opt.profiler.checkpoint import setting
from hsd_opt.prompts import text_of_length
from hsd_opt.runtime.decode import HSD
from hsd_opt.solver.batch import LOAD_MIN_GAIN, at_batch, choose_loads
from hsd_opt.solver.context import profile_at_context
from hsd_opt.solver.latency import hierarchy_latency
from hsd_opt.solver.task_view import profile_tasks, task_profile


def _scaled(v, f: float):
    return [x * f for x in v] if isinstance(v, list) else v * f


def scale_costs(profile: Profile, factor: Mapping[str, float]) -> Profile:
    """``profile`` with every cost of model ``m`` multiplied by ``factor[m]`` (1 for models not named): its step
    ``cost``, its ``cost_curve``, the verify passes it runs (``verify_cost[m]``), at the top level and in every
    ``context_costs`` entry. Acceptance and everything else are kept."""
    def f(name: str) -> float:
        return float(factor.get(name, 1.0))

    def verify(vc: Mapping[str, Mapping[str, Any]]) -> dict:
        return {v: {d: _scaled(x, f(v)) for d, x in row.items()} for v, row in vc.items()}

    def curves(cc: Mapping[str, list]) -> dict:
        return {m: _scaled(c, f(m)) for m, c in cc.items()}

    models = [replace(m, cost=m.cost * f(m.name)) for m in profile.models]
    ctx = [ContextCosts(e.context, {m: c * f(m) for m, c in e.cost.items()}, curves(e.cost_curve),
                        verify(e.verify_cost)) for e in profile.context_costs]
    return replace(profile, models=models, verify_cost=verify(profile.verify_cost),
                   cost_curve=curves(profile.cost_curve), context_costs=ctx)


def retimed_latency(profile: Profile, hierarchy: Sequence[str], budgets: Sequence[int],
                    factor: Mapping[str, float], context: float | None = None, task: str | None = None) -> float:
    """Predicted seconds per token of ``hierarchy``/``budgets`` with ``profile``'s costs scaled by ``factor``
    (:func:`scale_costs`), under ``task``'s acceptance when given (:func:`~hsd_opt.solver.task_view.task_profile`),
    at ``context`` tokens when given and the profile has costs at several contexts."""
    p = scale_costs(profile, factor)
    if task is not None:
        p = task_profile(p, task)[0]
    if context is not None and p.context_costs:
        p = profile_at_context(p, context)
    return hierarchy_latency(p, hierarchy, budgets)


def check_profile_for_plan(profile: Profile, plan, source: str) -> None:
    """Refuse a profile that cannot price ``plan``: of another model, revision, dtype or target precision (its
    costs are another engine's), made with other sampling settings (the target's work differs), or missing a level
    of the plan (``source`` names the profile in the error)."""
    pm, qm = profile.provenance.model, plan.provenance.model
    if pm and qm and not same_model(pm, qm):           # one local model however its path is written
        raise HsdError(f"--retime {source}: the profile is of model {pm!r}, the plan of {qm!r} (provenance.model; "
                       f"give the profile the plan was solved from)")
    for key, what in (("revision", "revision"), ("dtype", "dtype"), ("target_precision", "target precision"),
                      ("temperature", "temperature"), ("top_p", "top-p"), ("top_k", "top-k"), ("min_p", "min-p")):
        pv, qv = getattr(profile.provenance, key), getattr(plan.provenance, key)
        if key in FILTERS and profile.provenance.temperature is not None and plan.provenance.temperature is not None:
            pv, qv = setting(profile.provenance.to_dict(), key), setting(plan.provenance.to_dict(), key)  # absent: off
        if pv is not None and qv is not None and pv != qv:      # sampling settings: the target's work differs
            raise HsdError(f"--retime {source}: the profile is of {what} {pv!r}, the plan of {qv!r} (provenance."
                           f"{key}; give the profile the plan was solved from)")
    names = {m.name for m in profile.models}
    levels = [plan.hierarchy] + [e.hierarchy for e in plan.by_load.values()]
    missing = sorted({n for h in levels for n in h if n not in names})
    if missing:
        raise HsdError(f"--retime {source}: the profile does not describe {', '.join(missing)} (give the profile "
                       f"the plan was solved from)")
    sizes = {b.batch for b in profile.batch_costs} | {1}
    lacking = sorted(n for n in plan.by_load if n not in sizes)
    if lacking:
        raise HsdError(f"--retime {source}: the profile has no costs at the plan's load levels "
                       f"{', '.join(map(str, lacking))} (batch_costs; give the profile the plan was solved from)")


#: The sampling filters: a file of a temperature that does not record one sampled without it (its
#: :data:`~hsd_opt.profiler.checkpoint.SETTING_DEFAULTS` value).
FILTERS = ("top_p", "top_k", "min_p")


def greedy_costs(profile: Profile) -> bool:
    """Whether ``profile``'s step costs were timed as greedy decoding's passes (temperature 0 or not recorded: the
    greedy token) rather than sampling's (the logits): how a clock must time a step to compare with them."""
    t = profile.provenance.temperature
    return t is None or t == 0


def profile_task(profile: Profile, plan, task: str | None) -> str | None:
    """The task whose acceptance prices a prompt of ``task``: the task itself when the plan predicts per task
    (it has ``by_task``) and the profile has statistics for it, else None (the overall acceptance), as the
    plan's own predictions do."""
    if task is None or task not in plan.by_task:
        return None
    return task if task in profile_tasks(profile) else None


class StepClock:
    """Times one decode step of each engine of ``hierarchies`` (built :class:`~hsd_opt.runtime.decode.HSD` s) at
    the profile's first context, and turns it into cost factors against ``profile`` (:meth:`factors`).

    For each distinct engine the level with the most layers is timed (append a token, ``advance`` to its
    boundary, end the pass as the runtime does: :func:`~hsd_opt.engine.layered.pass_output`, greedy tokens when
    ``greedy``, else the logits; crop back), on ``text`` (token ids, repeated to the context; default random ids),
    and its profiled step is that level's ``cost`` at the first measured context; every level on that engine gets
    the same factor.

    ``batch`` > 1 times the batched step of ``batch`` sequences at that context instead (one token each, one
    ``advance_many`` and the batched end of the pass, as a batch of that many serves them) against the profile's
    cost of that pass (:func:`~hsd_opt.solver.batch.at_batch`): the factors of a load level, whose passes drift
    apart from a single step's (a pass over many rows is bound by arithmetic, a step by memory)."""

    def __init__(self, profile: Profile, hierarchies: Sequence[HSD], repeats: int = 5,
                 text: Sequence[int] | None = None, greedy: bool = True, batch: int = 1):
        if batch < 1:
            raise HsdError(f"a step clock times batches of 1 or more sequences, not {batch}")
        self.batch = batch
        if batch > 1:
            profile = at_batch(profile, batch)
        self.repeats = repeats
        self.text = list(text or [])   # token ids the steps read (real text, as the profile's timings do)
        self.greedy = greedy
        self.context = profile.contexts[0] if profile.context_costs else 64
        costs = profile.context_costs[0].cost if profile.context_costs else {m.name: m.cost for m in profile.models}
        sampling = profile.provenance.get("sampling_seconds") or [0.0]
        saving = profile.provenance.get("draw_saving_seconds") or [0.0]   # the target's step by draws
        window = profile.provenance.get("window_saving_seconds") or [0.0]  # its engine's steps by the filters' window
        engines: dict[int, dict[str, Any]] = {}
        for h in hierarchies:
            for lv in h.levels:
                if not lv.is_model:
                    continue
                e = engines.setdefault(id(lv.engine), {"engine": lv.engine, "names": set(), "top": None})
                e["names"].add(lv.name)
                if e["top"] is None or lv.boundary > e["top"].boundary:
                    e["top"] = lv
        self.engines = []
        for e in engines.values():
            top = e["top"]
            if top.name not in costs:
                raise HsdError(f"--retime: the profile has no cost for {top.name!r}")
            # the profiled cost includes the sampled distributions' processing (profiles made with a temperature)
            step = costs[top.name] - float(sampling[0])
            if top.name == profile.target:      # its profiled step ends in draws or a window: timed here in logits
                step += float(saving[0]) + float(window[0])
            step = max(step, 1e-9)
            self.engines.append({"engine": e["engine"], "names": sorted(e["names"]), "name": top.name,
                                 "boundary": top.boundary, "profiled": step, "measured": []})
        self._states: dict[int, tuple[list[DecodeState], torch.Tensor]] = {}  # engine -> (states, next token)

    def _state(self, eng):
        """``(states holding the context, one per sequence of the batch; the token a timed step appends)`` of
        engine ``eng``, made once (the first computed, the others copies of it)."""
        if id(eng) not in self._states:
            if self.text:
                ids = torch.tensor(text_of_length(self.text, self.context + 1))
            else:
                g = torch.Generator().manual_seed(0)
                ids = torch.randint(3, max(4, eng.vocab_size - 1), (self.context + 1,), generator=g)
            st = eng.new_state(self.context + 2)
            eng.append(st, ids[:-1].to(eng.device))
            eng.advance(st, eng.n_layers)
            self._states[id(eng)] = ([st] + [st.copy() for _ in range(self.batch - 1)], ids[-1:].to(eng.device))
        return self._states[id(eng)]

    @torch.no_grad()
    def measure(self) -> dict[str, float]:
        """Time every engine now (one warm-up step, then the median of ``repeats``) and return the factors."""
        for e in self.engines:
            eng, b = e["engine"], e["boundary"]
            sts, tok = self._state(eng)
            e["measured"].append(median_pass(eng, [(st, tok) for st in sts], b, self.repeats, greedy=self.greedy))
        return self.factors(-1)

    def factors(self, i: int | None = None) -> dict[str, float]:
        """Model name -> measured / profiled step: of measurement ``i`` (None: the median of all so far)."""
        out = {}
        for e in self.engines:
            if not e["measured"]:
                continue
            m = e["measured"][i] if i is not None else statistics.median(e["measured"])
            for n in e["names"]:
                out[n] = m / e["profiled"]
        return out

    def summary(self) -> dict[str, Any]:
        """For the report: per engine, the profiled step, the median measured step and their ratio (seconds)."""
        out = {}
        for e in self.engines:
            if e["measured"]:
                m = statistics.median(e["measured"])
                out[e["name"]] = {"levels": e["names"], "context": self.context, "batch": self.batch,
                                  "profiled_step": e["profiled"],
                                  "measured_step_median": m, "factor_median": m / e["profiled"],
                                  "factor_min": min(e["measured"]) / e["profiled"],
                                  "factor_max": max(e["measured"]) / e["profiled"]}
        return out


def retime_load_levels(plan, profile: Profile, built: Mapping[tuple[tuple[str, ...], tuple[int, ...]], HSD],
                       text: Sequence[int] | None = None, measurements: int = 3, repeats: int = 5,
                       load_min_gain: float | None = None) -> tuple[dict[int, HSD], dict[str, Any]]:
    """The hierarchy of each of ``plan``'s load levels chosen again at the machine's speed of the moment: one step
    of every engine of the ``built`` hierarchies ((names, budgets) -> built runner; the target alone among them)
    timed ``measurements`` times (:class:`StepClock`, on ``text``), the profile's costs scaled by the median
    factors (:func:`scale_costs`), and each level's hierarchy picked among ``built`` as
    :func:`~hsd_opt.solver.batch.choose_loads` picks (``load_min_gain``: default its own). Returns the level ->
    runner map and a report: ``factors`` (model -> measured / profiled step), per level the plan's hierarchy and
    the chosen one with its predicted aggregate tokens/s."""
    if not plan.by_load:
        raise HsdError("the plan has no load levels to choose again (solve with --batch-sizes)")
    target = ((profile.target,), ())
    if target not in built:
        raise HsdError("re-timing the load levels needs the target alone among the built hierarchies")
    clock = StepClock(profile, list(built.values()), repeats=repeats, text=text, greedy=greedy_costs(profile))
    for _ in range(max(1, measurements)):
        clock.measure()
    factors = clock.factors()
    gain = load_min_gain if load_min_gain is not None else (
        plan.load_min_gain if plan.load_min_gain is not None else LOAD_MIN_GAIN)
    chosen = choose_loads(scale_costs(profile, factors), list(plan.by_load), list(built), gain,
                          context=plan.context)
    levels = {n: built[(tuple(e.hierarchy), tuple(e.budgets))] for n, e in chosen.items()}
    report = {"factors": factors, "load_min_gain": gain,
              "levels": {str(n): {"plan": list(plan.by_load[n].hierarchy),
                                  "plan_budgets": list(plan.by_load[n].budgets), "chosen": e.hierarchy,
                                  "budgets": e.budgets, "tokens_per_s": e.tokens_per_s}
                         for n, e in chosen.items()}}
    return levels, report
