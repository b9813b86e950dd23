"""Plans for a load level: the latency model when ``B`` sequences are decoded together.

At ``B`` sequences in flight every pass a hierarchy makes is a batched pass over ``B`` sequences (the scheduler
serves the passes of one engine together, :mod:`hsd_opt.runtime.batch`), so each sequence's round costs what the
batched passes cost, and the acceptance of each sequence is unchanged. :func:`at_batch` gives the profile whose
costs are those of the batched passes: every cost of a model times the model's measured ratio at the same pass
size t (``batch_costs``: the seconds of a pass over ``B`` sequences of t tokens over the seconds of a pass over one
sequence of t tokens; a token drafter's ratio is ``B``: it proposes for one sequence at a time). Solving that
profile minimises each sequence's seconds per token at load ``B``, which maximises the aggregate throughput
``B / latency`` (the goodput; ``B`` is fixed). Plain batched decoding without speculation is the target alone,
always a candidate of the solver, so speculation is chosen only where it pays at that load.

Assumptions (``docs/design.md#serving-under-load``): the ``B`` sequences run the same hierarchy and make their
passes together; their contexts are alike (the ratios were timed at one context, applied at every one); a
sequence's acceptance does not depend on the others. Units: seconds per token; tokens per second.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from hsd_opt.errors import HsdError
from hsd_opt.formats import BatchCosts, ContextCosts, LoadPlan, Profile
from hsd_opt.solver.api import evaluate, resolve_context, solve
from hsd_opt.solver.latency import curve_at, target_only


def _ratio_at(r: float | list[float], t: int) -> float:
    """A ratio (a number, or a curve over t = 1..n) at pass size ``t`` (the curve's last value past its end)."""
    if isinstance(r, (int, float)):
        return float(r)
    return float(r[min(t, len(r)) - 1])


def _scaled(v: float | list[float], r: float | list[float]) -> float | list[float]:
    """A cost (a number: the seconds of a pass over any t, or a curve over t = 1..n, extended past its end as
    :func:`~hsd_opt.solver.latency.curve_at` extends it) times its ratio at the same t. A number where both are
    numbers; else a curve long enough that past its end :func:`~hsd_opt.solver.latency.curve_at` extends it as the
    cost's extension times the ratio's last value (one point past the ratio curve's end, where its value holds)."""
    if not isinstance(r, list):
        return float(v) * float(r) if not isinstance(v, list) else [float(x) * float(r) for x in v]
    n = max(len(v) if isinstance(v, list) else 1, len(r) + 1)
    return [(curve_at(v, t) if isinstance(v, list) else float(v)) * _ratio_at(r, t) for t in range(1, n + 1)]


def _curves_of_scalar_costs(costs: dict[str, float], curves: dict[str, list[float]], r: dict) -> dict:
    """The curves a batch size gives models priced by one number (``costs``) and by no curve (``curves``: those
    that price them where they are given), where their ratio is a curve: the batched pass over t costs the number
    times the ratio at t."""
    return {m: _scaled(c, r[m]) for m, c in costs.items() if m not in curves and isinstance(r[m], list)}


#: What a batch size's costs lacking a drafter's ratio means, and what to do.
LACKING_RATIO = "a drafter the profile's batch timings did not cover: profile again, or solve with --batch-sizes 1"


def lacking_ratios(profile: Profile, bc: BatchCosts) -> list[str]:
    """The models of ``profile`` that its batch costs ``bc`` give no ratio for (it cannot be priced there)."""
    return [m.name for m in profile.models if m.name not in bc.ratio]


def at_batch(profile: Profile, batch: int) -> Profile:
    """``profile`` with every cost that of the batched pass at ``batch`` sequences (batch 1: the profile itself).

    Raises :class:`HsdError` naming ``--batch-sizes`` when the profile has no costs at that batch size, and its
    ``batch_costs`` when a model lacks a ratio there."""
    if batch == 1:
        return profile
    bc: BatchCosts | None = next((b for b in profile.batch_costs if b.batch == batch), None)
    if bc is None:
        raise HsdError(f"--batch-sizes: the profile has no costs at batch {batch} (it has "
                       f"{', '.join(map(str, profile.batch_sizes))}; profile with --batch-sizes)")
    missing = lacking_ratios(profile, bc)
    if missing:
        raise HsdError(f"the profile's batch_costs at batch {batch} has no ratio for {', '.join(missing)} "
                       f"({LACKING_RATIO})")
    r = bc.ratio
    models = [replace(m, cost=m.cost * _ratio_at(r[m.name], 1)) for m in profile.models]
    curves = {name: _scaled(v, r[name]) for name, v in profile.cost_curve.items()}
    curves.update(_curves_of_scalar_costs({m.name: m.cost for m in profile.models}, profile.cost_curve, r))
    verify = {v: {d: _scaled(c, r[v]) for d, c in row.items()} for v, row in profile.verify_cost.items()}
    contexts = [ContextCosts(c.context, {n: x * _ratio_at(r[n], 1) for n, x in c.cost.items()},
                             {**{n: _scaled(x, r[n]) for n, x in c.cost_curve.items()},
                              **_curves_of_scalar_costs(c.cost, {**profile.cost_curve, **c.cost_curve}, r)},
                             {v: {d: _scaled(x, r[v]) for d, x in row.items()} for v, row in c.verify_cost.items()})
                for c in profile.context_costs]
    return replace(profile, models=models, verify_cost=verify, cost_curve=curves, context_costs=contexts,
                   batch_costs=[])


#: The default of ``hsd solve --load-min-gain``: above one sequence, speculation is taken only when predicted
#: at least this fraction faster than plain batched decoding: the latency model at a batch size is less exact
#: than alone, and a served load also pays what the model leaves out (the server's own threads on the same
#: cores, sequences out of step, a request's first-token round and its last short one, prompts computed apart
#: from the others' rows), so a smaller predicted gain is noise. Predicted gains of 13% and 18% have run at 0.71-0.93x
#: plain batching, one of 44% at 1.06-1.15x (docs/results.md, "Figures behind the design").
LOAD_MIN_GAIN = 0.25


def solve_loads(profile: Profile, tmax: int, batch_sizes: Sequence[int], min_gain: float = 0.0,
                load_min_gain: float | None = None, **solve_args) -> dict[int, LoadPlan]:
    """The plan of each load level in ``batch_sizes`` (sequences decoded together): the solver's optimum on
    :func:`at_batch`, with its predicted aggregate tokens per second and the latency of plain batched decoding
    (the target alone) at the same load. Above one sequence, speculation predicted less than ``load_min_gain``
    (a fraction; None: ``min_gain``) faster than plain batched decoding is not taken: the batch costs are
    noisier than a step's, and a hierarchy that wins by less may well lose when run. ``min_gain`` and
    ``solve_args`` go to :func:`~hsd_opt.solver.api.solve`."""
    floor = min_gain if load_min_gain is None else load_min_gain
    out: dict[int, LoadPlan] = {}
    for b in sorted(set(int(x) for x in batch_sizes)):
        if b < 1:
            raise HsdError(f"--batch-sizes: expected sizes >= 1, got {b}")
        prof = at_batch(profile, b)
        plan = solve(prof, tmax, **{**solve_args, "top": 1, "min_gain": min_gain})
        alone = float(target_only(resolve_context(prof, solve_args.get("context"))[0]))
        hierarchy, budgets, latency = list(plan.hierarchy), list(plan.budgets), float(plan.expected_latency)
        if b > 1 and latency > (1.0 - floor) * alone:    # speculation within the noise of plain batching
            hierarchy, budgets, latency = [profile.target], [], alone
        out[b] = LoadPlan(hierarchy, budgets, latency, b / latency, alone)
    return out


def choose_loads(profile: Profile, loads: Sequence[int], candidates: Sequence[tuple[Sequence[str], Sequence[int]]],
                 load_min_gain: float = LOAD_MIN_GAIN, context: float | None = None) -> dict[int, LoadPlan]:
    """The plan of each load level in ``loads``, chosen among ``candidates`` (hierarchies with their budgets, each
    ending with the profile's target) and plain batched decoding the way :func:`solve_loads` chooses on the
    solver's optimum: the least predicted seconds per token on :func:`at_batch` at ``context``, and above one
    sequence plain batched decoding unless a candidate is predicted at least ``load_min_gain`` faster. For a
    server whose hierarchies are built: the profile re-timed to the machine's speed of the moment picks the
    hierarchy of each load among those it has."""
    for h, _ in candidates:
        if not h or h[-1] != profile.target:
            raise HsdError(f"a candidate hierarchy must end with the target {profile.target!r}, got {list(h)}")
    out: dict[int, LoadPlan] = {}
    for b in sorted(set(int(x) for x in loads)):
        if b < 1:
            raise HsdError(f"load levels are >= 1 sequences, got {b}")
        prof = at_batch(profile, b)
        alone = float(target_only(resolve_context(prof, context)[0]))
        hierarchy, budgets, latency = [profile.target], [], alone
        for h, t in candidates:
            lat = float(evaluate(prof, list(h), list(t), context=context))
            if lat < latency:
                hierarchy, budgets, latency = list(h), list(t), lat
        if b > 1 and latency > (1.0 - load_min_gain) * alone:
            hierarchy, budgets, latency = [profile.target], [], alone
        out[b] = LoadPlan(hierarchy, budgets, latency, b / latency, alone)
    return out
