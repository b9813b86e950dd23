"""Plans per load level: the profile at a batch size is the profile with every cost times its measured ratio,
and the plan of a load level is the solver's optimum there, never predicted slower than plain batched decoding."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hsd_opt.errors import HsdError
from hsd_opt.formats import BatchCosts, ContextCosts, profile_from_dict
from hsd_opt.solver.api import evaluate, solve
from hsd_opt.solver.batch import at_batch, choose_loads, solve_loads
from hsd_opt.solver.context import profile_at_context
from hsd_opt.solver.latency import target_only, verify_cost
from tests.helpers import random_profile


def _profile():
    """A target whose batched passes are nearly free at one token and grow with the tokens of a pass (memory
    bound, then arithmetic), a copy whose batched passes cost nearly their batch size (arithmetic bound), and an
    n-gram drafter."""
    d = {"format": "hsd-profile/1", "target": "t",
         "models": [{"name": "ngram", "kind": "ngram_context", "cost": 2e-4, "can_verify": False},
                    {"name": "q", "kind": "quantized", "cost": 0.009},
                    {"name": "t", "kind": "target", "cost": 0.025}],
         "acceptance": {"ngram": {"q": 0.4, "t": 0.4}, "q": {"t": 0.9}},
         "cost_curve": {"t": [0.025 + 0.004 * k for k in range(8)], "q": [0.009 + 0.004 * k for k in range(8)]},
         "verify_cost": {"t": {"q": [0.025 + 0.004 * k for k in range(8)]}},
         "batch_costs": [{"batch": b, "ratio": {"ngram": float(b),
                                                 "q": [min(b * t, 1 + 0.6 * (b * t - 1)) / t for t in range(1, 9)],
                                                 "t": [1 + 0.18 * (b * t - 1) / t for t in range(1, 9)]}}
                         for b in (2, 4, 8)]}
    return profile_from_dict(d)[0]


def test_batch_one_is_the_profile_itself():
    prof = _profile()
    assert at_batch(prof, 1) is prof


def _ratio(r, t):
    return r if isinstance(r, float) else r[min(t, len(r)) - 1]


def _priced_as_the_design_says(prof, b, r, models=("q", "t")):
    """Every pass the latency model prices on ``b`` (a step, a pass over t of a model's curve, a verify pass of
    every pair) costs what it costs on ``prof`` times the model's ratio at the same t, within the curves and past
    their ends."""
    for m in models:
        assert b.entry(m).cost == pytest.approx(prof.entry(m).cost * _ratio(r[m], 1))
        for t in range(1, 25):
            assert verify_cost(b, m, "x", t) == pytest.approx(verify_cost(prof, m, "x", t) * _ratio(r[m], t)), (m, t)
            for d in prof.verify_cost.get(m, {}):
                assert verify_cost(b, m, d, t) == pytest.approx(verify_cost(prof, m, d, t) * _ratio(r[m], t))


def test_every_cost_is_times_its_ratio_at_the_same_pass_size():
    prof = _profile()
    b = at_batch(prof, 4)
    r = prof.batch_costs[1].ratio
    _priced_as_the_design_says(prof, b, r)
    assert b.entry("ngram").cost == pytest.approx(prof.entry("ngram").cost * 4)
    assert b.acceptance == prof.acceptance and not b.batch_costs
    with pytest.raises(HsdError, match="--batch-sizes: the profile has no costs at batch 3"):
        at_batch(prof, 3)
    partial = dataclasses.replace(prof, batch_costs=[BatchCosts(2, {"t": 1.0})])
    with pytest.raises(HsdError, match="no ratio for ngram, q"):
        at_batch(partial, 2)


@pytest.mark.parametrize("costs", ["scalar", "scalar verify", "short curves"])
def test_a_cost_given_as_one_number_or_a_short_curve_is_scaled_at_the_pass_size_it_prices(costs):
    """A model priced by one number (every pass the same seconds), a pair's verify cost given as one number, and a
    curve shorter than the passes a plan makes were scaled by the ratio of a one-token pass, or point by point and
    then extended from the scaled points: a batch-2 verify pass over 4 tokens priced 1.0 s or 3.7 s where its
    measured ratio makes it 1.9 s, and the load plans' latencies under- or over-stated."""
    prof = _profile()
    if costs == "scalar":
        prof = dataclasses.replace(prof, cost_curve={}, verify_cost={})
    elif costs == "scalar verify":
        prof = dataclasses.replace(prof, cost_curve={}, verify_cost={"t": {"q": 0.03}})
    else:
        prof = dataclasses.replace(prof, cost_curve={m: c[:2] for m, c in prof.cost_curve.items()},
                                   verify_cost={"t": {"q": prof.verify_cost["t"]["q"][:3]}})
    for bc in prof.batch_costs:
        _priced_as_the_design_says(prof, at_batch(prof, bc.batch), bc.ratio)


def test_context_costs_are_scaled_too():
    prof = _profile()
    prof.context_costs = [ContextCosts(64, {"t": 0.025, "q": 0.009, "ngram": 2e-4}, dict(prof.cost_curve)),
                          ContextCosts(512, {"t": 0.03, "q": 0.011, "ngram": 3e-4},
                                       {k: [x * 1.2 for x in v] for k, v in prof.cost_curve.items()})]
    b = at_batch(prof, 8)
    r = prof.batch_costs[2].ratio
    for ctx in (64, 300, 512, 2048):
        _priced_as_the_design_says(profile_at_context(prof, ctx), profile_at_context(b, ctx), r)
    only_numbers = dataclasses.replace(prof, cost_curve={}, verify_cost={}, context_costs=[
        ContextCosts(c.context, c.cost, {}) for c in prof.context_costs])
    b = at_batch(only_numbers, 8)
    for ctx in (64, 300, 2048):
        _priced_as_the_design_says(profile_at_context(only_numbers, ctx), profile_at_context(b, ctx), r)


def test_load_levels_speculate_alone_and_decode_plainly_under_load():
    """One sequence: the speculative plan the solver picks anyway, with the copy. Eight: the copy's passes cost
    about eight times one, the target's little more than one, so the copy no longer pays; without the n-gram
    drafter (almost free at any load) plain batched decoding wins (speculation is not chosen where it does not
    pay)."""
    prof = _profile()
    loads = solve_loads(prof, 7, [1, 2, 4, 8], min_gain=0.0)
    alone = solve(prof, 7, min_gain=0.0)
    assert loads[1].hierarchy == alone.hierarchy and loads[1].expected_latency == pytest.approx(alone.expected_latency)
    assert "q" in loads[1].hierarchy and "q" not in loads[8].hierarchy
    no_ngram = dataclasses.replace(prof, acceptance={"q": {"t": 0.9}})
    assert solve_loads(no_ngram, 7, [8])[8].hierarchy == ["t"]
    for n, e in loads.items():
        assert e.tokens_per_s == pytest.approx(n / e.expected_latency)
        assert e.batched_target_latency == pytest.approx(target_only(at_batch(prof, n)))
        assert e.expected_latency == pytest.approx(evaluate(at_batch(prof, n), e.hierarchy, e.budgets))


def test_a_load_level_is_never_predicted_slower_than_plain_batched_decoding():
    rng = np.random.default_rng(5)
    for _ in range(40):
        prof = random_profile(rng, int(rng.integers(1, 5)), cost_curve=True, verify_cost=True)
        curves = {}
        for b in (2, 4):
            curves[b] = {m.name: [float(x) for x in np.maximum(1.0, rng.uniform(0.8, b, 6))] for m in prof.models}
        prof.batch_costs = [BatchCosts(b, curves[b]) for b in (2, 4)]
        for n, e in solve_loads(prof, 5, [1, 2, 4]).items():
            assert e.expected_latency <= e.batched_target_latency * (1 + 1e-9)


def test_a_load_level_speculates_only_when_it_gains_min_gain_over_plain_batching():
    rng = np.random.default_rng(6)
    for _ in range(30):
        prof = random_profile(rng, int(rng.integers(1, 4)), cost_curve=True)
        prof.batch_costs = [BatchCosts(4, {m.name: [float(x) for x in rng.uniform(1.0, 4.0, 6)]
                                           for m in prof.models})]
        for g in (0.0, 0.05, 0.2):
            e = solve_loads(prof, 5, [4], min_gain=g)[4]
            assert e.hierarchy == ["t"] or e.expected_latency <= (1 - g) * e.batched_target_latency * (1 + 1e-12)


def test_load_min_gain_is_its_own_threshold_above_one_sequence():
    """``load_min_gain`` decides at loads above one (``min_gain`` there only when it is not given); one sequence
    keeps the solver's plan whatever it is."""
    prof = _profile()
    free = solve_loads(prof, 7, [1, 2, 4, 8], min_gain=0.0, load_min_gain=0.0)
    gains = {n: 1 - e.expected_latency / e.batched_target_latency for n, e in free.items()}
    some = [n for n in (2, 4, 8) if gains[n] > 0.001]
    assert some                                        # the fixture speculates above one sequence somewhere
    cut = min(gains[n] for n in some) + 1e-6
    strict = solve_loads(prof, 7, [1, 2, 4, 8], min_gain=0.0, load_min_gain=cut)
    assert strict[1].hierarchy == free[1].hierarchy
    for n in some:
        want = ["t"] if gains[n] < cut else free[n].hierarchy
        assert strict[n].hierarchy == want
    assert solve_loads(prof, 7, [2], min_gain=cut)[2].hierarchy == strict[2].hierarchy


def test_choosing_among_built_hierarchies_keeps_the_optimum_and_follows_a_drift():
    """``choose_loads`` among the hierarchies the solver chose at each load gives the same plans (each is the
    optimum of its load). Among the copy's hierarchies alone, the copy pays at 1 and 2 sequences; with the
    target's costs halved (a drift toward a faster target) plain decoding wins there, and no level is ever
    predicted slower than plain batching."""
    from hsd_opt.measure.retime import scale_costs

    prof = _profile()
    loads = solve_loads(prof, 7, [1, 2, 4, 8], min_gain=0.0, load_min_gain=0.0)
    cands = list({(tuple(e.hierarchy), tuple(e.budgets)) for e in loads.values()})
    chosen = choose_loads(prof, [1, 2, 4, 8], cands, load_min_gain=0.0)
    for n in (1, 2, 4, 8):
        assert (chosen[n].hierarchy, chosen[n].budgets) == (loads[n].hierarchy, loads[n].budgets)
        assert chosen[n].expected_latency == pytest.approx(loads[n].expected_latency)
    copy = [(("q", "t"), (3,)), (("q", "t"), (2,))]
    before = choose_loads(prof, [1, 2, 4, 8], copy, load_min_gain=0.0)
    assert before[1].hierarchy == before[2].hierarchy == ["q", "t"]
    fast = scale_costs(prof, {"t": 0.5})
    after = choose_loads(fast, [1, 2, 4, 8], copy, load_min_gain=0.0)
    assert after[1].hierarchy == after[2].hierarchy == ["t"]
    for plans, p in ((before, prof), (after, fast)):
        for n, e in plans.items():
            assert e.expected_latency <= e.batched_target_latency * (1 + 1e-12)
            assert e.batched_target_latency == pytest.approx(target_only(at_batch(p, n)))
            assert e.tokens_per_s == pytest.approx(n / e.expected_latency)
    with pytest.raises(HsdError, match="must end with the target"):
        choose_loads(prof, [2], [(("q",), ())])
