"""dp == lp (scipy HiGHS) == brute force on random small instances; gamma; graph; costs; ranking; optima per
depth and the min-gain choice; the solver's import structure."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest

from hsd_opt.errors import HsdError
from hsd_opt.solver import build_gsp_graph, gamma, gamma_table, hierarchy_latency
from hsd_opt.solver.api import optimum, solve
from hsd_opt.solver.brute import brute_ranked
from hsd_opt.solver.dp import dp, dp_by_depth, dp_ranked
from hsd_opt.solver.hierarchy import cost_order
from hsd_opt.solver.instance import build_instance
from hsd_opt.solver.latency import curve_at, round_counts, round_tables, verify_cost
from tests.helpers import random_profile

REL = 1e-9


def _admissible(profile, sol, tmax, max_depth=None):
    """The rules every solver must respect."""
    h, b = sol.hierarchy, sol.budgets
    assert h[-1] == profile.target and len(b) == len(h) - 1
    assert all(1 <= x <= tmax for x in b) and b == sorted(b)
    order = cost_order(profile)
    assert [order.index(m) for m in h] == sorted(order.index(m) for m in h)
    for lo, hi in zip(h[:-1], h[1:]):
        assert profile.accept(lo, hi) is not None and profile.entry(hi).can_verify
    if max_depth is not None:
        assert len(h) <= max_depth


def _check_agree(profile, tmax, max_depth=None, solvers=("dp", "lp", "brute")):
    sols = {s: optimum(profile, tmax, s, max_depth) for s in solvers}
    best = sols["brute"].latency
    for s, sol in sols.items():
        _admissible(profile, sol, tmax, max_depth)
        assert math.isclose(sol.latency, best, rel_tol=REL), (s, sol, sols["brute"])
        # the hierarchy is the same up to ties: its exact latency is the optimum
        assert math.isclose(hierarchy_latency(profile, sol.hierarchy, sol.budgets), best, rel_tol=REL)
        if "lp_objective" in sol.info and len(sol.hierarchy) > 1:
            assert math.isclose(sol.info["lp_objective"], best, rel_tol=1e-7)
    return sols


CASES = [(seed, nv, vc, cc) for seed in range(60) for nv, vc, cc in
         [(False, False, False), (True, False, False), (False, True, True), (True, True, False), (True, False, True)]]


@pytest.mark.parametrize("seed,non_verifying,vcost,ccurve", CASES)
def test_dp_lp_brute_agree(seed, non_verifying, vcost, ccurve):
    rng = np.random.default_rng(1000 + seed)
    prof = random_profile(rng, int(rng.integers(1, 5)), non_verifying=non_verifying, verify_cost=vcost,
                          cost_curve=ccurve)
    tmax = int(rng.integers(1, 6))
    _check_agree(prof, tmax)


@pytest.mark.parametrize("seed", range(80))
def test_dp_lp_brute_agree_with_abstaining_drafters(seed):
    """Bottom drafters that propose in only a share of their calls (draft_rate < 1): the three solvers agree,
    with and without a depth limit, and the ranked dp equals the enumeration."""
    rng = np.random.default_rng(11000 + seed)
    prof = random_profile(rng, int(rng.integers(2, 6)), abstaining=True, verify_cost=seed % 3 == 0,
                          cost_curve=seed % 4 == 1, missing=0.1)
    assert any(m.draft_rate < 1 for m in prof.models) or seed % 10   # most instances have one
    tmax = int(rng.integers(1, 6))
    _check_agree(prof, tmax)
    _check_agree(prof, tmax, max_depth=2 + seed % 2)
    got = dp_ranked(build_instance(prof, tmax), 5)
    want = brute_ranked(prof, tmax)[:5]
    assert [g.latency for g in got] == pytest.approx([w.latency for w in want], rel=REL)


@pytest.mark.parametrize("seed", range(20))
def test_max_depth_agree(seed):
    rng = np.random.default_rng(5000 + seed)
    prof = random_profile(rng, 4, non_verifying=seed % 2 == 0, verify_cost=seed % 3 == 0)
    tmax = int(rng.integers(2, 5))
    for md in (1, 2, 3, 4):
        sols = _check_agree(prof, tmax, max_depth=md)
        if md == 1:
            assert sols["dp"].hierarchy == ["t"]


@pytest.mark.parametrize("seed", range(4))
def test_cvxpy_backend_agrees(seed):
    rng = np.random.default_rng(7000 + seed)
    prof = random_profile(rng, 3, non_verifying=seed % 2 == 1, verify_cost=seed >= 2)
    sol = optimum(prof, 4, "lp-cvxpy")
    ref = optimum(prof, 4, "dp")
    assert math.isclose(sol.latency, ref.latency, rel_tol=1e-7)


@pytest.mark.parametrize("seed", range(25))
def test_ranked_dp_matches_enumeration(seed):
    rng = np.random.default_rng(9000 + seed)
    prof = random_profile(rng, 4, non_verifying=seed % 2 == 0, verify_cost=seed % 3 == 0, missing=0.1)
    tmax = int(rng.integers(1, 5))
    md = None if seed % 4 else 3
    _ranked_equals_enumeration(prof, tmax, 6, md)


def _ranked_equals_enumeration(prof, tmax, top, md):
    """dp_ranked's ``top`` best distinct hierarchies have the latencies of the ``top`` best found by enumeration,
    and each its own exact latency."""
    got = dp_ranked(build_instance(prof, tmax), top, md)
    want = brute_ranked(prof, tmax, md)[:top]
    assert [g.latency for g in got] == pytest.approx([w.latency for w in want], rel=REL)
    assert len({tuple(g.hierarchy) for g in got}) == len(got)
    for g in got:
        assert math.isclose(hierarchy_latency(prof, g.hierarchy, g.budgets), g.latency, rel_tol=REL)


def _gamma_reference(a, t, T):
    """Independent: expected rounds by the first-step recursion written with explicit probabilities."""
    memo = {}

    def f(n):
        if n <= 0:
            return 0.0
        if n not in memo:
            s = 1.0
            for g in range(t + 1):            # G = g accepted drafts (g = t: all accepted)
                p = a ** g * (1 - a) if g < t else a ** t
                s += p * f(n - 1 - g)
            memo[n] = s
        return memo[n]

    return f(T)


def test_gamma_exact_values():
    for a in (0.0, 0.2, 0.5, 0.77, 0.95, 1.0):
        for t in range(1, 9):
            for T in range(1, 12):
                assert math.isclose(gamma(a, t, T), _gamma_reference(a, t, T), rel_tol=1e-12)
    assert gamma(0.0, 4, 7) == 7.0                    # one token per round
    assert gamma(1.0, 3, 9) == 3.0                    # t + 1 = 4 tokens per round: ceil(9 / 4)
    tab = gamma_table(np.array([0.0, 0.31, 0.9, 1.0]), 10)
    for p, a in enumerate((0.0, 0.31, 0.9, 1.0)):
        for t in range(1, 11):
            for T in range(1, 11):
                assert math.isclose(tab[p, t - 1, T - 1], gamma(a, t, T), rel_tol=1e-12)
    for args in (([0.5], 2, 3), (0.5, [2], 3), (1.5, 2, 3), (0.5, 2, 3.5)):    # one line, not lru_cache's TypeError
        with pytest.raises(HsdError, match="^gamma: "):
            gamma(*args)


def _round_counts_reference(a, f, t, T):
    """Independent: (matched, unmatched) expected rounds by the first-step recursion over the two kinds."""
    memo = {}

    def mu(n):
        if n <= 0:
            return 0.0, 0.0
        if n not in memo:
            m, u = f, 1.0 - f
            um, uu = mu(n - 1)                 # the drafter abstained: one token
            m, u = m + (1 - f) * um, u + (1 - f) * uu
            for g in range(t + 1):             # it proposed and g drafts were accepted
                p = f * (a ** g * (1 - a) if g < t else a ** t)
                gm, gu = mu(n - 1 - g)
                m, u = m + p * gm, u + p * gu
            memo[n] = (m, u)
        return memo[n]

    return mu(T)


def test_round_counts_exact_values_and_table():
    for a in (0.0, 0.4, 0.71, 1.0):
        for f in (0.05, 0.32, 0.9, 1.0):
            for t in range(1, 7):
                for T in range(1, 10):
                    M, U = round_counts(a, f, t, T)
                    rm, ru = _round_counts_reference(a, f, t, T)
                    assert math.isclose(M, rm, rel_tol=1e-12) and math.isclose(U, ru, rel_tol=1e-12, abs_tol=1e-15)
    assert round_counts(0.6, 1.0, 3, 7) == (gamma(0.6, 3, 7), 0.0)
    assert round_counts(0.9, 0.5, 4, 1) == (0.5, 0.5)              # one round of either kind makes 1 token
    a, f = np.array([0.0, 0.31, 0.9, 1.0, 0.5]), np.array([0.2, 0.5, 0.95, 0.7, 1.0])
    M, U = round_tables(a, f, 8)
    for p in range(len(a)):
        for t in range(1, 9):
            for T in range(1, 9):
                m, u = round_counts(a[p], f[p], t, T)
                assert math.isclose(M[p, t - 1, T - 1], m, rel_tol=1e-12)
                assert math.isclose(U[p, t - 1, T - 1], u, rel_tol=1e-12, abs_tol=1e-15)


@pytest.mark.parametrize("a,f,t,T", [(0.71, 0.32, 3, 15), (0.5, 0.8, 2, 6), (0.9, 0.1, 4, 9)])
def test_round_counts_against_simulation(a, f, t, T):
    rng = np.random.default_rng(7)
    n = 100_000
    have = np.zeros(n, dtype=int)
    matched = np.zeros(n, dtype=int)
    unmatched = np.zeros(n, dtype=int)
    active = np.arange(n)
    while active.size:
        proposes = rng.random(active.size) < f
        acc = rng.random((active.size, t)) < a
        g = np.where(acc.all(axis=1), t, np.argmin(acc, axis=1))
        have[active] += np.where(proposes, 1 + g, 1)
        matched[active] += proposes
        unmatched[active] += ~proposes
        active = active[have[active] < T]
    M, U = round_counts(a, f, t, T)
    assert abs(matched.mean() - M) < 4 * matched.std() / np.sqrt(n) + 1e-12
    assert abs(unmatched.mean() - U) < 4 * unmatched.std() / np.sqrt(n) + 1e-12


@pytest.mark.parametrize("a,t,T", [(0.3, 2, 5), (0.7, 4, 9), (0.9, 3, 12), (0.5, 6, 4)])
def test_gamma_against_simulation(a, t, T):
    rng = np.random.default_rng(42)
    n = 200_000
    have = np.zeros(n, dtype=int)
    rounds = np.zeros(n, dtype=int)
    active = np.arange(n)
    while active.size:
        acc = rng.random((active.size, t)) < a                  # IID acceptance of each draft in the block
        g = np.where(acc.all(axis=1), t, np.argmin(acc, axis=1))   # accepted prefix length
        have[active] += 1 + g
        rounds[active] += 1
        active = active[have[active] < T]
    se = rounds.std() / np.sqrt(n)
    assert abs(rounds.mean() - gamma(a, t, T)) < 4 * se + 1e-12


def test_graph_matches_table2():
    rng = np.random.default_rng(3)
    prof = random_profile(rng, 3, missing=0.0)
    tmax = 3
    G = build_gsp_graph(prof, tmax)
    inst = build_instance(prof, tmax)
    K = prof.target
    cK = prof.entry(K).cost
    for u, v, d in G.edges(data=True):
        if d["kind"] == "source":
            a = prof.accept(v[0], K)
            R = (1 - a) / (1 - a ** (v[1] + 1))
            assert math.isclose(d["mu"], R) and math.isclose(d["cost"], R * cK)
        elif d["kind"] == "verify":
            (i, j), (k, l) = u, v
            g = gamma(prof.accept(k, i), l, j)
            assert l <= j and math.isclose(d["mu"], g) and math.isclose(d["cost"], g * prof.entry(i).cost)
        elif d["kind"] == "sink":
            assert v == (u[0], "L") and d["mu"] == 1 and math.isclose(d["cost"], u[1] * prof.entry(u[0]).cost)
        else:
            assert u == v and d["mu"] == 0.5 and d["cost"] == 0
    assert G.graph["source"] == (K,)
    assert nx_is_dag_without_loops(G)
    assert len(inst.names) == 3


def nx_is_dag_without_loops(G):
    import networkx as nx

    H = G.copy()
    H.remove_edges_from([(u, v) for u, v, d in G.edges(data=True) if d["kind"] == "loop"])
    return nx.is_directed_acyclic_graph(H)


def test_curve_extrapolation_and_cost_precedence():
    assert curve_at([1.0, 2.0, 4.0], 2) == 2.0
    assert curve_at([1.0, 2.0, 4.0], 6) == 4.0 + 2.0 * 3       # linear from the last two points
    assert curve_at([3.0, 2.0], 5) == 2.0                      # a decreasing tail is held flat
    assert curve_at([0.5], 9) == 0.5
    from hsd_opt.formats import profile_from_dict
    d = {"format": "hsd-profile/1", "target": "t",
         "models": [{"name": "a", "cost": 0.1}, {"name": "b", "cost": 0.3}, {"name": "t", "cost": 1.0}],
         "acceptance": {"a": {"b": 0.8, "t": 0.5}, "b": {"t": 0.7}},
         "verify_cost": {"t": {"b": 0.4}, "b": {"a": [0.2, 0.25, 0.3]}},
         "cost_curve": {"t": [1.0, 1.1, 1.3]}}
    p = profile_from_dict(d)[0]
    assert verify_cost(p, "t", "b", 7) == 0.4                  # pair scalar wins
    assert verify_cost(p, "b", "a", 5) == pytest.approx(0.3 + 0.05 * 2)
    assert verify_cost(p, "t", "a", 3) == 1.3                  # cost curve at t = l + 1
    assert verify_cost(p, "t", "a", 4) == pytest.approx(1.5)
    # hand-computed latency of a <- b <- t with budgets [2, 3]
    B0 = 2 * 0.1
    B1 = gamma(0.8, 2, 3) * (verify_cost(p, "b", "a", 3) + B0)
    L = (0.4 + B1) * (1 - 0.7) / (1 - 0.7 ** 4)
    assert hierarchy_latency(p, ["a", "b", "t"], [2, 3]) == pytest.approx(L, rel=1e-12)


def test_constant_cost_curve_changes_nothing():
    rng = np.random.default_rng(11)
    prof = random_profile(rng, 4, missing=0.0)
    base = optimum(prof, 6)
    prof.cost_curve = {m.name: [m.cost] * 3 for m in prof.models}
    same = optimum(prof, 6)
    assert same.hierarchy == base.hierarchy and same.budgets == base.budgets
    assert same.latency == pytest.approx(base.latency, rel=1e-12)


def test_verify_cost_can_make_a_deeper_hierarchy_pay():
    """Cheap verification between exits of one model (activation reuse) turns a 2-level plan into 3 levels."""
    from hsd_opt.formats import profile_from_dict
    d = {"format": "hsd-profile/1", "target": "l30",
         "models": [{"name": "l4", "cost": 0.15}, {"name": "l12", "cost": 0.4}, {"name": "l30", "cost": 1.0}],
         "acceptance": {"l4": {"l12": 0.55, "l30": 0.45}, "l12": {"l30": 0.7}}}
    p = profile_from_dict(d)[0]
    plain = optimum(p, 10)
    p.verify_cost = {"l12": {"l4": 0.4 * 8 / 12}, "l30": {"l12": 18 / 30}}
    reuse = optimum(p, 10)
    assert reuse.latency < plain.latency
    assert len(reuse.hierarchy) >= len(plain.hierarchy)
    assert math.isclose(reuse.latency, optimum(p, 10, "brute").latency, rel_tol=REL)


def test_bad_arguments():
    rng = np.random.default_rng(0)
    prof = random_profile(rng, 2)
    with pytest.raises(HsdError, match="--tmax"):
        optimum(prof, 0)
    with pytest.raises(HsdError, match="--solver"):
        optimum(prof, 3, "magic")
    with pytest.raises(HsdError, match="--max-depth"):
        optimum(prof, 3, "dp", 0)
    with pytest.raises(HsdError, match="not in the profile"):
        hierarchy_latency(prof, ["nope", "t"], [2])
    with pytest.raises(HsdError, match="budgets"):
        hierarchy_latency(prof, ["d0", "t"], [])
    for budgets in ([4.5], ["4"], [True]):                  # refused, not cut to an integer
        with pytest.raises(HsdError, match=r"budgets\[0\]: expected an integer >= 1"):
            hierarchy_latency(prof, ["d0", "t"], budgets)
    for a, t in ((1.5, 4), (-0.1, 4), ("0.5", 4), (0.5, 0), (0.5, 2.5)):
        with pytest.raises(HsdError, match="gamma"):
            gamma(a, t, 8)
    with pytest.raises(HsdError, match="--top"):
        solve(prof, 3, top=2.5)
    with pytest.raises(HsdError, match="--min-gain"):
        solve(prof, 3, min_gain="a")
    for tmax in (64, 0, 2.5):                  # a plan of budget 64 verifies over 65 positions: refused when run
        with pytest.raises(HsdError, match=r"--tmax: expected an integer in 1\.\.63"):
            solve(prof, tmax)
    from hsd_opt.solver.api import simulate
    for kwargs, flag in (({"seed": -1}, "--seed"), ({"seed": None}, "--seed"), ({"rounds": "a"}, "--rounds")):
        with pytest.raises(HsdError, match=flag):
            simulate(prof, ["d0", "t"], [2], **kwargs)


def test_target_alone_when_drafters_do_not_pay():
    from hsd_opt.formats import plan_from_dict, profile_from_dict
    from hsd_opt.solver import solve
    d = {"format": "hsd-profile/1", "target": "t",
         "models": [{"name": "a", "cost": 0.6}, {"name": "t", "cost": 1.0}], "acceptance": {"a": {"t": 0.05}}}
    p = profile_from_dict(d)[0]
    for s in ("dp", "lp", "brute"):
        plan = solve(p, 8, solver=s)
        assert plan.hierarchy == ["t"] and plan.budgets == [] and plan.expected_speedup == 1.0
        assert plan_from_dict(plan.to_dict()).hierarchy == ["t"]


def test_best_early_exit_baseline_is_the_best_exit_pair():
    """``baselines.best_early_exit`` is the best [exit, target] pair by enumeration, and absent without exits."""
    from hsd_opt.formats import profile_from_dict
    from hsd_opt.solver import evaluate

    d = {"format": "hsd-profile/1", "target": "layer8",
         "models": [{"name": "ngram", "kind": "ngram_context", "cost": 1e-4, "can_verify": False},
                    {"name": "layer2", "kind": "early_exit", "cost": 0.25, "layer": 2, "can_verify": True},
                    {"name": "layer4", "kind": "early_exit", "cost": 0.5, "layer": 4, "can_verify": True},
                    {"name": "int4", "kind": "quantized", "cost": 0.4, "can_verify": True},
                    {"name": "layer8", "kind": "target", "cost": 1.0, "layer": 8, "can_verify": True}],
         "acceptance": {"ngram": {"layer8": 0.3}, "layer2": {"layer8": 0.4}, "layer4": {"layer8": 0.8},
                        "int4": {"layer8": 0.97}}}
    prof = profile_from_dict(d, "<t>")[0]
    plan = solve(prof, 6)
    bee = plan.baselines["best_early_exit"]
    best = min((evaluate(prof, [e, "layer8"], [t]), e, t) for e in ("layer2", "layer4") for t in range(1, 7))
    assert bee["hierarchy"] == [best[1], "layer8"] and bee["budgets"] == [best[2]]
    assert bee["expected_latency"] == pytest.approx(best[0])
    assert plan.baselines["best_single_draft"]["hierarchy"] == ["int4", "layer8"]
    d["models"] = [m for m in d["models"] if m["kind"] != "early_exit"]
    d["acceptance"] = {k: v for k, v in d["acceptance"].items() if not k.startswith("layer")}
    assert "best_early_exit" not in solve(profile_from_dict(d, "<t>")[0], 6).baselines


# ------------------------------------------------------------------------------ optima per depth and min-gain


def _same_plan(a, b):
    return (a.hierarchy, a.budgets, a.latency) == (b.hierarchy, b.budgets, b.latency)


def _depth_cases():
    for seed in range(120):
        rng = np.random.default_rng(21000 + seed)
        prof = random_profile(rng, int(rng.integers(1, 8)), abstaining=seed % 3 == 1, non_verifying=seed % 3 == 2,
                              verify_cost=seed % 2 == 0, cost_curve=seed % 5 == 0,
                              missing=float(rng.uniform(0.0, 0.4)))
        yield seed, prof, int(rng.integers(1, 9))


@pytest.mark.slow
def test_optima_by_depth_equal_the_depth_limited_optimum():
    """One layered pass gives, for every depth d, exactly the plan of ``optimum(..., max_depth=d)``: same
    hierarchy, budgets and latency (ties broken the same way), with and without a depth limit."""
    for seed, prof, tmax in _depth_cases():
        inst = build_instance(prof, tmax)
        D = len(inst.names)
        for max_depth in (None, 1, 2, 3, D + 3):
            by_depth = dp_by_depth(inst, max_depth)
            assert len(by_depth) == (D + 1 if max_depth is None else min(max_depth, D + 1)), (seed, max_depth)
            for d, sol in enumerate(by_depth, start=1):
                want = optimum(prof, tmax, "dp", max_depth=d)
                assert _same_plan(sol, want), (seed, max_depth, d, sol, want)
                assert len(sol.hierarchy) <= d
        assert _same_plan(dp_by_depth(inst)[-1], dp(inst))


def _min_gain_by_one_solve_per_depth(prof, tmax, solver, max_depth, min_gain):
    """Reference for the min-gain rule: one solve per depth. A deeper optimum replaces the plan chosen so far
    only if it is at least a fraction ``min_gain`` faster; the best single draft stands against the target
    alone without the margin; depths up to that of the exact optimum."""
    exact = optimum(prof, tmax, solver, max_depth)
    if min_gain == 0 or len(exact.hierarchy) <= 2:
        return exact, exact
    chosen = optimum(prof, tmax, solver, 2)
    for d in range(3, len(exact.hierarchy) + 1):
        s = optimum(prof, tmax, solver, d)
        if s.latency <= chosen.latency * (1.0 - min_gain):
            chosen = s
    return chosen, exact


@pytest.mark.slow
def test_min_gain_choice_matches_one_solve_per_depth():
    shallower = 0
    for seed, prof, tmax in _depth_cases():
        for max_depth in (None, 3):
            for g in (0.0, 0.005, 0.03, 0.1, 0.3):
                want, exact = _min_gain_by_one_solve_per_depth(prof, tmax, "dp", max_depth, g)
                plan = solve(prof, tmax, max_depth=max_depth, top=1, min_gain=g)
                assert (plan.hierarchy, plan.budgets, plan.expected_latency) == \
                    (want.hierarchy, want.budgets, want.latency), (seed, max_depth, g)
                if exact.hierarchy != want.hierarchy:
                    shallower += 1
                    ex = plan.exact_optimum
                    assert (ex.hierarchy, ex.budgets, ex.expected_latency) == \
                        (exact.hierarchy, exact.budgets, exact.latency)
                else:
                    assert plan.exact_optimum is None
    assert shallower > 20          # the rule did choose a shallower plan in many of these instances


@pytest.mark.parametrize("seed", range(6))
def test_min_gain_with_brute_matches_one_solve_per_depth(seed):
    rng = np.random.default_rng(23000 + seed)
    prof = random_profile(rng, 4, abstaining=seed % 2 == 1, missing=0.05)
    for g in (0.01, 0.05):
        want, _ = _min_gain_by_one_solve_per_depth(prof, 4, "brute", None, g)
        plan = solve(prof, 4, solver="brute", top=1, min_gain=g)
        assert (plan.hierarchy, plan.budgets, plan.expected_latency) == (want.hierarchy, want.budgets, want.latency)


@pytest.mark.parametrize("seed", range(12))
def test_ranked_dp_matches_enumeration_on_larger_pools(seed):
    """Six or seven drafters and long budgets: many candidate chains per vertex, the top 8 still exact."""
    rng = np.random.default_rng(25000 + seed)
    prof = random_profile(rng, 6 + seed % 2, abstaining=seed % 3 == 0, verify_cost=seed % 2 == 0, missing=0.05)
    tmax = 5 if seed % 2 else 6
    md = None if seed % 4 else 4
    _ranked_equals_enumeration(prof, tmax, 8, md)


# ----------------------------------------------------------------------------------------- import structure


def test_solver_imports_flow_one_way():
    """Inside hsd_opt.solver: no import cycle (module level or in a function) and no module imports another
    module's private (underscore) names."""
    pkg = Path(__file__).resolve().parent.parent / "hsd_opt" / "solver"
    deps: dict[str, set[str]] = {}
    for path in pkg.glob("*.py"):
        mod = path.stem
        deps[mod] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hsd_opt.solver."):
                other = node.module.split(".")[2]
                deps[mod].add(other)
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{mod} imports private {private} from {other}"
    state: dict[str, int] = {}

    def visit(m, stack):
        assert state.get(m) != 1, f"import cycle: {' -> '.join(stack + [m])}"
        if state.get(m) == 2:
            return
        state[m] = 1
        for o in deps.get(m, ()):
            visit(o, stack + [m])
        state[m] = 2

    for m in deps:
        visit(m, [])
    assert "hierarchy" in deps["latency"] and not deps["hierarchy"]


@pytest.mark.parametrize("seed", range(80))
def test_ranked_dp_any_top_matches_enumeration(seed):
    """Every list length: the ``top`` best distinct hierarchies are the first ``top`` of the enumeration."""
    rng = np.random.default_rng(27000 + seed)
    prof = random_profile(rng, int(rng.integers(2, 7)), non_verifying=seed % 3 == 0, abstaining=seed % 3 == 1,
                          verify_cost=seed % 2 == 0, missing=float(rng.uniform(0.0, 0.4)))
    tmax = int(rng.integers(1, 7))
    inst = build_instance(prof, tmax)
    for md in (None, 3):
        want = brute_ranked(prof, tmax, md)
        for top in (1, 2, 3, 5):
            got = dp_ranked(inst, top, md)
            assert [g.latency for g in got] == pytest.approx([w.latency for w in want[:top]], rel=REL), (md, top)


def test_hierarchy_latency_refuses_what_is_not_a_profile_or_a_list_naming_it():
    """A path for the profile (``evaluate`` takes one) and None for a list were AttributeError and TypeError deep
    inside; :func:`evaluate` gets the list checks too."""
    from hsd_opt.solver.api import evaluate

    prof = random_profile(np.random.default_rng(0), 3)
    chain = [prof.names[0], prof.target]
    for args, said in (((str(Path("profile.json")), chain, [2]), "profile: expected a Profile"),
                       ((prof, None, [2]), "hierarchy: expected a list, got NoneType"),
                       ((prof, chain, None), "budgets: expected a list, got NoneType"),
                       ((prof, prof.target, []), "hierarchy: expected a list, got str")):
        with pytest.raises(HsdError, match=said):
            hierarchy_latency(*args)
    with pytest.raises(HsdError, match="budgets: expected a list"):
        evaluate(prof, chain, None)
