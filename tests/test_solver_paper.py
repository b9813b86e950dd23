"""The numbers of the HSD paper ("Fast Inference via Hierarchical Speculative Decoding", arXiv 2510.19705): the
check values of App. B.3, Table 8, Table 9 (App. B.4); and the Monte-Carlo check of the latency model."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

from hsd_opt import load_profile
from hsd_opt.formats import profile_from_dict
from hsd_opt.solver import hierarchy_latency, simulate, solve
from hsd_opt.solver.api import optimum
from hsd_opt.solver.latency import catch_up_cost, curve_at

DATA = Path(__file__).resolve().parent.parent / "data"


def restrict(p, keep):
    q = copy.deepcopy(p)
    q.models = [m for m in q.models if m.name in keep]
    q.acceptance = {d: {v: a for v, a in r.items() if v in keep} for d, r in q.acceptance.items() if d in keep}
    return q


@pytest.fixture(scope="module")
def b3():
    p, warnings = load_profile(DATA / "example_profile.json")
    assert warnings == []          # Table 6 respects the triangle bound
    return p


@pytest.mark.parametrize("keep,latency,budgets", [
    (["m5", "m6"], 14.3659, [5]),
    (["m4", "m5", "m6"], 11.2106, [4, 8]),
    (["m3", "m4", "m5", "m6"], 10.6565, [6, 7, 8]),
])
@pytest.mark.parametrize("solver", ["dp", "lp", "brute"])
def test_design_check_values(b3, keep, latency, budgets, solver):
    sol = optimum(restrict(b3, keep), 10, solver)
    assert sol.hierarchy == keep
    assert sol.budgets == budgets
    assert round(sol.latency, 4) == latency


def test_adding_models_never_hurts_b3(b3):
    """App. B.3: each new (smaller) model can only lower the optimal latency."""
    names = ["m6", "m5", "m4", "m3", "m2", "m1"]
    lat = [optimum(restrict(b3, names[: n + 1]), 10).latency for n in range(6)]
    assert lat[0] == 33.0
    assert all(b <= a + 1e-12 for a, b in zip(lat, lat[1:]))


def test_table8_second_example():
    """Table 8 (paper): 33.00, 19.31, 15.45, 14.61, 14.46, 14.40 for 1..6 models. The 1- and 2-model values
    involve no gamma and must match to the printed digits. With 3+ models the paper's *empirically estimated*
    gamma (its Algorithm 1 hands up every accepted token, possibly more than T) gives lower latencies than the
    exact gamma of docs/design.md#rounds-and-gamma (ours: 17.10, 15.58, 15.52, 15.52), as in Table 1 (10.89 vs
    11.21); we only require that ours is never below the paper's and still improves with more models."""
    p, _ = load_profile(DATA / "example_profile_table7.json")
    names = ["m6", "m5", "m4", "m3", "m2", "m1"]
    paper = [33.00, 19.31, 15.45, 14.61, 14.46, 14.40]
    got = [optimum(restrict(p, names[: n + 1]), 10).latency for n in range(6)]
    assert round(got[0], 2) == paper[0] and round(got[1], 2) == paper[1]
    assert all(g >= w - 0.005 for g, w in zip(got, paper))
    assert all(b <= a + 1e-12 for a, b in zip(got, got[1:])) and got[3] < got[2] < got[1]


def test_simulate_matches_prediction_b3(b3):
    plan = solve(b3, 10)
    r = simulate(b3, plan, rounds=100_000, seed=1)
    assert r.predicted == pytest.approx(plan.expected_latency, rel=1e-12)
    assert abs(r.rel_diff) < 0.01
    assert abs(r.latency - r.predicted) < 4 * r.stderr


def test_simulate_uses_verify_costs():
    d = {"format": "hsd-profile/1", "target": "t",
         "models": [{"name": "a", "cost": 0.05, "can_verify": False}, {"name": "b", "cost": 0.3},
                    {"name": "t", "cost": 1.0}],
         "acceptance": {"a": {"b": 0.7, "t": 0.5}, "b": {"t": 0.75}},
         "verify_cost": {"b": {"a": [0.3, 0.32, 0.35]}}, "cost_curve": {"t": [1.0, 1.05, 1.1, 1.2]}}
    p = profile_from_dict(d)[0]
    for h, b in ((["a", "b", "t"], [3, 6]), (["b", "t"], [5]), (["a", "t"], [2])):
        r = simulate(p, h, b, rounds=60_000, seed=3)
        assert abs(r.latency - r.predicted) < 4 * r.stderr, (h, r)


def test_catch_up_after_an_accepted_block():
    """A drafter with its own cache pays one more position after a fully accepted block: the model adds
    ``a^T (s_2 - s_1)`` of its cost curve to every round (the hand formula for two levels), nothing for a pair
    that shares a cache (its own verify_cost) or a drafter without a curve; the Monte-Carlo, which pays it
    only in the rounds that accepted everything, agrees at depth 2 and 3."""
    d = {"format": "hsd-profile/1", "target": "t",
         "models": [{"name": "a", "cost": 0.1}, {"name": "b", "cost": 0.3}, {"name": "t", "cost": 1.0}],
         "acceptance": {"a": {"b": 0.8, "t": 0.7}, "b": {"t": 0.9}},
         "cost_curve": {"a": [0.1, 0.16, 0.2], "b": [0.3, 0.33, 0.4, 0.45], "t": [1.0, 1.1, 1.25, 1.4, 1.5]}}
    p = profile_from_dict(d)[0]
    assert catch_up_cost(p, "a", "t") == pytest.approx(0.06) and catch_up_cost(p, "b", "t") == pytest.approx(0.03)
    for T in (1, 2, 4):
        S = sum(0.7 ** k for k in range(T + 1))
        want = (curve_at([1.0, 1.1, 1.25, 1.4, 1.5], T + 1) + T * 0.1 + 0.7 ** T * 0.06) / S
        assert hierarchy_latency(p, ["a", "t"], [T]) == pytest.approx(want, rel=1e-12)
    shared = profile_from_dict({**d, "verify_cost": {"b": {"a": [0.3, 0.35, 0.4]}}})[0]
    assert catch_up_cost(shared, "a", "b") == 0.0 and catch_up_cost(shared, "a", "t") == pytest.approx(0.06)
    flat = profile_from_dict({**d, "cost_curve": {"t": d["cost_curve"]["t"]}})[0]
    assert catch_up_cost(flat, "a", "t") == 0.0
    for prof in (p, shared):
        for h, b in ((["a", "t"], [3]), (["a", "b", "t"], [2, 5]), (["b", "t"], [6])):
            r = simulate(prof, h, b, rounds=60_000, seed=7)
            assert abs(r.latency - r.predicted) < 4 * r.stderr, (h, r)


@pytest.mark.parametrize("rate", [0.3, 0.75])
def test_simulate_matches_prediction_with_an_abstaining_bottom(rate):
    """A bottom drafter proposing in a share ``rate`` of its calls: the Monte-Carlo of the rounds (its own
    code) agrees with the exact model at depth 2 and 3, and abstaining where the drafter is bad pays."""
    d = {"format": "hsd-profile/1", "target": "t",
         "models": [{"name": "a", "cost": 0.001, "can_verify": False, "draft_rate": rate},
                    {"name": "b", "cost": 0.3}, {"name": "t", "cost": 1.0}],
         "acceptance": {"a": {"b": 0.7, "t": 0.65}, "b": {"t": 0.95}},
         "cost_curve": {"b": [0.3, 0.4, 0.45, 0.5, 0.6], "t": [1.0, 1.1, 1.3, 1.5, 1.6, 1.8, 2.0]}}
    p = profile_from_dict(d)[0]
    for h, b in ((["a", "b", "t"], [3, 6]), (["a", "t"], [2]), (["a", "b", "t"], [1, 1])):
        r = simulate(p, h, b, rounds=60_000, seed=5)
        assert abs(r.latency - r.predicted) < 4 * r.stderr, (h, r)
    # the same acceptance where it proposes, but proposing always with acceptance rate * 0.7 on average:
    always = profile_from_dict({**d, "models": [{**d["models"][0], "draft_rate": 1.0}] + d["models"][1:],
                                "acceptance": {"a": {"b": 0.7 * rate, "t": 0.65 * rate}, "b": {"t": 0.95}}})[0]
    assert hierarchy_latency(p, ["a", "b", "t"], [3, 6]) < hierarchy_latency(always, ["a", "b", "t"], [3, 6])


def test_a_drafters_share_of_rounds_is_taken_at_its_budget():
    """A bottom drafter whose share of rounds with a block depends on its budget (``draft_rate_by_budget``):
    the latency of a hierarchy with budget T is that of the same drafter proposing at the one rate f(T) (past
    the list's end: its last figure), at depth 2 and 3; the Monte-Carlo agrees; the best block is shorter than
    with the share of positions alone, and the solvers find the optimum."""
    by_budget = [0.5, 0.3, 0.2, 0.1]
    d = {"format": "hsd-profile/1", "target": "t",
         "models": [{"name": "a", "cost": 0.001, "can_verify": False, "draft_rate": 0.6,
                     "draft_rate_by_budget": by_budget},
                    {"name": "b", "cost": 0.3}, {"name": "t", "cost": 1.0}],
         "acceptance": {"a": {"b": 0.9, "t": 0.85}, "b": {"t": 0.95}},
         "cost_curve": {"b": [0.3, 0.32, 0.34, 0.36, 0.38, 0.4], "t": [1.0, 1.02, 1.04, 1.06, 1.08, 1.1, 1.12]}}
    p = profile_from_dict(d)[0]
    assert profile_from_dict(p.to_dict())[0].entry("a").draft_rate_by_budget == tuple(by_budget)
    for T in range(1, 7):
        f = by_budget[min(T, len(by_budget)) - 1]
        flat = profile_from_dict({**d, "models": [{**d["models"][0], "draft_rate": f, "draft_rate_by_budget": None}]
                                  + d["models"][1:]})[0]
        for h, b in ((["a", "t"], [T]), (["a", "b", "t"], [T, 6])):
            assert hierarchy_latency(p, h, b) == pytest.approx(hierarchy_latency(flat, h, b), rel=1e-12)
    r = simulate(p, ["a", "t"], [3], rounds=60_000, seed=5)
    assert abs(r.latency - r.predicted) < 4 * r.stderr, r
    per_position = profile_from_dict({**d, "models": [{**d["models"][0], "draft_rate_by_budget": None}]
                                      + d["models"][1:]})[0]
    def best_budget(prof):
        return min(range(1, 7), key=lambda T: hierarchy_latency(prof, ["a", "t"], [T]))

    assert best_budget(p) < best_budget(per_position)
    sol = optimum(p, 6, "dp", 3)
    assert sol.latency == pytest.approx(optimum(p, 6, "brute", 3).latency, rel=1e-9)


# ------------------------------------------------------------------------------------------- Table 9 (App. B.4)

# Speed-ups of the optimal hierarchy, rows a(C, B) = 0.0 .. 0.9, columns cost of C = 1, 2, 4, ..., 256
# (the OCR header lists 1..128 but every row has nine values; the ninth, all 1.20, is read as cost 256).
TABLE9 = """1.20 1.20 1.20 1.20 1.20 1.20 1.20 1.20 1.20
1.20 1.20 1.20 1.20 1.20 1.20 1.20 1.20 1.20
1.21 1.21 1.20 1.20 1.20 1.20 1.20 1.20 1.20
1.23 1.23 1.22 1.22 1.21 1.20 1.20 1.20 1.20
1.25 1.25 1.24 1.24 1.23 1.21 1.20 1.20 1.20
1.27 1.27 1.27 1.26 1.25 1.23 1.20 1.20 1.20
1.30 1.29 1.29 1.28 1.27 1.25 1.22 1.20 1.20
1.34 1.33 1.33 1.32 1.30 1.28 1.24 1.20 1.20
1.42 1.41 1.40 1.38 1.35 1.31 1.27 1.21 1.20
1.65 1.64 1.63 1.60 1.55 1.48 1.39 1.25 1.20"""
C_COSTS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
A_CB = [round(0.1 * r, 1) for r in range(10)]


def table9_profile(cost_c: float, a_cb: float):
    """App. B.4: target A (cost 1024), B (256), a(B, A) = 0.5; C with a(C, A) the triangle lower bound."""
    a_ca = max(0.0, a_cb + 0.5 - 1.0)
    return profile_from_dict({"format": "hsd-profile/1", "target": "A",
                              "models": [{"name": "C", "cost": cost_c}, {"name": "B", "cost": 256.0},
                                         {"name": "A", "cost": 1024.0}],
                              "acceptance": {"B": {"A": 0.5}, "C": {"B": a_cb, "A": a_ca}}})[0]


@pytest.fixture(scope="module")
def table9():
    speed = np.zeros((10, 9))
    hier = {}
    for r, acb in enumerate(A_CB):
        for c, cc in enumerate(C_COSTS):
            sol = optimum(table9_profile(cc, acb), 32)
            speed[r, c] = 1024.0 / sol.latency
            hier[acb, cc] = "-".join(reversed(sol.hierarchy))
    return speed, hier


def test_table9_speedups(table9):
    """The paper prints two decimals (rounding error <= 0.005) and estimated gamma empirically, we use the
    exact gamma; we allow 0.01 in absolute speed-up (observed max 0.006, at a(C,B)=0.2, cost 2)."""
    speed, _ = table9
    paper = np.array([[float(x) for x in line.split()] for line in TABLE9.splitlines()])
    assert np.abs(speed - paper).max() < 0.01


def test_table9_hierarchy_pattern(table9):
    _, hier = table9
    # C useless (accepts nothing) or as expensive as B: A-B
    for cc in C_COSTS:
        assert hier[0.0, cc] == "A-B"
    for acb in A_CB:
        assert hier[acb, 256] == "A-B"
    # cheap and accurate C: C is used, directly under A or under B
    for cc in (1, 2, 4):
        assert hier[0.9, cc] in ("A-C", "A-B-C")
    # cheap C with a fair acceptance to B: the full hierarchy A-B-C
    for acb in (0.3, 0.4, 0.5, 0.6, 0.7):
        assert hier[acb, 1] == "A-B-C"
    # expensive C with mediocre acceptance: A-B
    for acb in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5):
        assert hier[acb, 128] == "A-B"
    # the paper: "when C has both a low cost and high acceptance rate to A, it becomes optimal only to use C"
    assert hier[0.9, 1] == "A-C"
