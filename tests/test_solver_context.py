"""Costs that depend on the context length: interpolation, dp == LP == brute force at any context, the
simulator at a context, the default context, plans per task at their own context, and old single-context
profiles solving exactly as before (docs/design.md#costs-that-depend-on-the-context)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from hsd_opt.errors import HsdError, InputFileError
from hsd_opt.formats import load_profile, plan_from_dict, profile_from_dict, provenance_from_dict
from hsd_opt.solver import hierarchy_latency, latency
from hsd_opt.solver.api import evaluate, optimum, simulate, solve
from hsd_opt.solver.brute import brute_ranked
from hsd_opt.solver.context import interpolate, latency_at, latency_table, profile_at_context, typical_context
from hsd_opt.solver.dp import dp_ranked
from hsd_opt.solver.instance import build_instance
from hsd_opt.solver.tasks import solve_tasks
from tests.helpers import random_profile
from tests.test_solver import REL, _admissible

REPO = Path(__file__).resolve().parents[1]


def _contexts_to_try(rng, prof):
    """Below the first measured context, at a knot, between knots, and beyond the last."""
    xs = prof.contexts
    return [float(rng.uniform(1, xs[0])), float(xs[1]), float(rng.uniform(xs[0], xs[-1])),
            float(xs[-1] * rng.uniform(1.0, 2.0))]


@pytest.mark.parametrize("seed", range(50))
def test_dp_lp_brute_agree_at_any_context(seed):
    """On random profiles with costs at several contexts (cost order changing with the context, curves and pair
    costs included), the three solvers find the same optimum at any context, and it is the optimum of the
    profile resolved at that context: they all see the same interpolated costs."""
    rng = np.random.default_rng(31000 + seed)
    prof = random_profile(rng, int(rng.integers(1, 5)), non_verifying=seed % 3 == 1, abstaining=seed % 3 == 2,
                          verify_cost=seed % 2 == 0, cost_curve=seed % 4 < 2, contexts=True)
    tmax = int(rng.integers(1, 6))
    for ctx in _contexts_to_try(rng, prof):
        at = profile_at_context(prof, ctx)
        sols = {s: optimum(prof, tmax, s, context=ctx) for s in ("dp", "lp", "brute")}
        best = min(brute_ranked(at, tmax), key=lambda s: s.latency, default=None)
        want = min(best.latency, at.entry(at.target).cost) if best else at.entry(at.target).cost
        for s, sol in sols.items():
            _admissible(at, sol, tmax)
            assert math.isclose(sol.latency, want, rel_tol=REL), (s, ctx, sol)
            assert math.isclose(hierarchy_latency(at, sol.hierarchy, sol.budgets), want, rel_tol=REL)
        got = dp_ranked(build_instance(at, tmax), 3)
        assert [g.latency for g in got] == pytest.approx([w.latency for w in brute_ranked(at, tmax)[:3]], rel=REL)


@pytest.mark.parametrize("seed", range(30))
def test_latency_is_piecewise_linear_in_the_context(seed):
    """For a fixed hierarchy the latency is linear in the costs, so the table at the measured contexts gives it
    exactly at any context (what ``hsd run`` predicts from a plan); beyond the last context too when no cost
    falls with the context (profiles the profiler writes)."""
    rng = np.random.default_rng(32000 + seed)
    prof = random_profile(rng, int(rng.integers(1, 5)), verify_cost=True, cost_curve=True, abstaining=seed % 2 == 0,
                          contexts=True, growing=seed % 3 != 0)
    growing = seed % 3 != 0
    plan = solve(prof, 4, context=float(prof.contexts[0]))
    entries = [plan.to_dict()] + list(plan.baselines.values()) + [a.to_dict() for a in plan.alternatives]
    for e in entries:
        table = e["latency_by_context"]
        assert [c for c, _ in table] == prof.contexts
        for ctx in _contexts_to_try(rng, prof)[: 4 if growing else 3]:
            exact = hierarchy_latency(profile_at_context(prof, ctx), e["hierarchy"], e["budgets"])
            assert latency_at(table, ctx) == pytest.approx(exact, rel=1e-9), (e["hierarchy"], ctx)


def test_interpolation_rule():
    xs, ys = [10, 20, 40], [1.0, 3.0, 2.0]
    assert interpolate(xs, ys, 5) == 1.0 and interpolate(xs, ys, 10) == 1.0      # flat below the first point
    assert interpolate(xs, ys, 15) == pytest.approx(2.0) and interpolate(xs, ys, 30) == pytest.approx(2.5)
    assert interpolate(xs, ys, 80) == 2.0                                        # a falling tail is held flat
    assert interpolate([10, 20], [1.0, 3.0], 30) == pytest.approx(5.0)           # a rising one extends linearly
    assert interpolate([7], [4.0], 1000) == 4.0
    d = {"format": "hsd-profile/1", "target": "t",
         "models": [{"name": "d", "cost": 0.1, "can_verify": False}, {"name": "t", "cost": 1.0},
                    {"name": "e", "cost": 0.5}],
         "acceptance": {"d": {"t": 0.5, "e": 0.6}, "e": {"t": 0.7}}, "cost_curve": {"t": [1.0, 1.5]},
         "context_costs": [{"context": 100, "cost": {"t": 1.0, "e": 0.4}, "cost_curve": {"t": [1.0, 1.2]},
                            "verify_cost": {"t": {"e": 0.9}}},
                           {"context": 300, "cost": {"t": 2.0, "e": 0.8}, "cost_curve": {"t": [2.0, 2.2, 2.6]},
                            "verify_cost": {"t": {"e": [1.5, 1.9]}}}]}
    prof = profile_from_dict(d)[0]
    at = profile_at_context(prof, 200)
    assert at.entry("t").cost == pytest.approx(1.5) and at.entry("e").cost == pytest.approx(0.6)
    assert at.entry("d").cost == 0.1                                     # not listed: context-independent
    assert at.cost_curve["t"] == pytest.approx([1.5, 1.7, 2.0])           # t = 3 from 1.2 + 0.2 (extrapolated)
    assert at.verify_cost["t"]["e"] == pytest.approx([1.2, 1.4])          # scalar 0.9 against a curve
    assert at.context_costs == [] and profile_at_context(at, 5) is at
    assert profile_at_context(prof, 100).entry("t").cost == 1.0 and profile_at_context(prof, 20).entry("e").cost == 0.4
    assert evaluate(prof, ["t"], [], context=250) == pytest.approx(1.75)
    with pytest.raises(HsdError, match="--context"):
        profile_at_context(prof, 0)


def test_simulator_agrees_with_the_prediction_at_a_context():
    """The paper's example with every cost doubling from a context of 100 to 1,100 tokens: the Monte-Carlo at a
    context of 600 agrees with the prediction there (1.5x the costs), not with the one at 100."""
    d = json.loads((REPO / "data" / "example_profile.json").read_text())
    costs = {m["name"]: m["cost"] for m in d["models"]}
    d["context_costs"] = [{"context": 100, "cost": dict(costs)},
                          {"context": 1100, "cost": {k: 2 * v for k, v in costs.items()}}]
    prof = profile_from_dict(d)[0]
    h, b = ["m3", "m4", "m5", "m6"], [6, 7, 8]
    r = simulate(prof, h, b, rounds=40000, seed=3, context=600)
    assert r.predicted == pytest.approx(1.5 * hierarchy_latency(profile_at_context(prof, 100), h, b), rel=1e-12)
    assert r.predicted == pytest.approx(evaluate(prof, h, b, context=600), rel=1e-12)
    assert abs(r.latency - r.predicted) < 4 * r.stderr
    low = simulate(prof, h, b, rounds=40000, seed=3, context=100)
    assert abs(low.latency - r.predicted) > 20 * r.stderr
    plan = solve(prof, 10, context=600)
    assert simulate(prof, plan, rounds=1000).predicted == pytest.approx(plan.expected_latency, rel=1e-12)


def _prof_with_prompts(rng, **prov):
    prof = random_profile(rng, 3, contexts=True, growing=True, verify_cost=True)
    prof.provenance = provenance_from_dict(prov)
    return prof


def test_default_context_is_the_mean_prompt_plus_half_the_generation():
    rng = np.random.default_rng(7)
    prof = _prof_with_prompts(rng, prompt_count=4, prompt_tokens=3600, generated_tokens=96,
                              prompts_by_task={"rag": 1, "chat": 3}, prompt_tokens_by_task={"rag": 3000, "chat": 600},
                              positions_by_task={"rag": 24, "chat": 72})
    assert typical_context(prof) == (912, "profile_prompts")                # 900 + 24 / 2
    assert typical_context(prof, "rag") == (3012, "task_prompts")
    assert typical_context(prof, "chat") == (212, "task_prompts")
    assert typical_context(prof, "qa") == (912, "profile_prompts")          # not recorded: the overall one
    plan = solve(prof, 4)
    assert plan.context == 912 and plan.context_from == "profile_prompts"
    assert plan.expected_latency == pytest.approx(solve(profile_at_context(prof, 912), 4).expected_latency, rel=1e-12)
    assert solve(prof, 4, context=50).context_from == "given"
    bare = _prof_with_prompts(rng)
    assert typical_context(bare) == (bare.contexts[0], "first_measured_context")
    old = random_profile(rng, 3)
    assert typical_context(old) == (None, None)


def test_plans_per_task_use_each_tasks_context():
    rng = np.random.default_rng(11)
    prof = _prof_with_prompts(rng, prompt_count=2, prompt_tokens=1100, generated_tokens=40,
                              prompts_by_task={"rag": 1, "chat": 1}, prompt_tokens_by_task={"rag": 1000, "chat": 100},
                              positions_by_task={"rag": 20, "chat": 20})
    prof.acceptance_by_task = {"rag": prof.acceptance, "chat": prof.acceptance}
    plan = solve(prof, 4)
    by_task, _ = solve_tasks(prof, plan, 4)
    for task, ctx in (("rag", 1010), ("chat", 110)):
        e = by_task[task]
        assert e["context"] == ctx and e["context_from"] == "task_prompts"
        assert e["expected_latency"] == pytest.approx(solve(prof, 4, context=ctx).expected_latency, rel=1e-12)
        here = profile_at_context(prof, ctx)
        assert e["overall_hierarchies"]["plan"] == pytest.approx(
            hierarchy_latency(here, plan.hierarchy, plan.budgets), rel=1e-12)
        assert e["overall_hierarchies_by_context"]["plan"] == latency_table(prof, plan.hierarchy, plan.budgets)
    plan = plan_from_dict({**plan.to_dict(), "by_task": by_task})        # the written plan validates
    fixed, _ = solve_tasks(prof, plan, 4, context=500)
    assert {e["context"] for e in fixed.values()} == {500}


def test_old_single_context_profiles_solve_exactly_as_before(monkeypatch):
    """Profiles without context_costs: the plan the solver made before costs could depend on the context (which
    did not price the catch-up after an accepted block: that term set to 0 here), each figure checked against an
    independent computation (brute force over hierarchies of up to three levels, the latency formula of each
    alternative and baseline), and no context fields in the plan. With the catch-up the plan stays and its latency
    grows by exactly the target's rounds per token x a^T x the int4 copy's pass over 2 tokens less its step."""
    prof, _ = load_profile(REPO / "tests" / "data" / "profile_lookup.json")
    assert prof.context_costs == []
    with monkeypatch.context() as m:
        m.setattr(latency, "catch_up_cost", lambda *args: 0.0)
        d = solve(prof, 15, min_gain=0.03).to_dict()
        assert solve(prof, 15, min_gain=0.03, context=900).to_dict() == d  # a context changes nothing here
        brute = solve(prof, 15, solver="brute", max_depth=3, min_gain=0.03)
        assert (d["hierarchy"], d["budgets"]) == (brute.hierarchy, brute.budgets) == (["lookup", "int4", "layer30"],
                                                                                    [2, 15])
        assert d["expected_latency"] == pytest.approx(brute.expected_latency, rel=1e-12)
        for alt in d["alternatives"]:
            assert alt["expected_latency"] == pytest.approx(hierarchy_latency(prof, alt["hierarchy"], alt["budgets"]),
                                                            rel=1e-12)
        assert [(a["hierarchy"], a["budgets"]) for a in d["alternatives"][:2]] == [
            (["ngram", "int4", "layer30"], [1, 15]), (["aded", "int4", "layer30"], [1, 15])]
        single = min((hierarchy_latency(prof, [x, "layer30"], [t]), x, t) for x in prof.names if x != "layer30"
                     and prof.accept(x, "layer30") is not None for t in range(1, 16))
        exits = min((hierarchy_latency(prof, [x, "layer30"], [t]), x, t) for x in prof.names
                    if prof.entry(x).kind == "early_exit" for t in range(1, 16))
    for got, (lat, x, t) in ((d["baselines"]["best_single_draft"], single), (d["baselines"]["best_early_exit"], exits)):
        assert (got["hierarchy"], got["budgets"]) == ([x, "layer30"], [t])
        assert got["expected_latency"] == pytest.approx(lat, rel=1e-12)
    ex = solve(REPO / "data" / "example_profile.json", 15, min_gain=0.03).to_dict()   # scalar costs: no catch-up
    assert (ex["hierarchy"], ex["budgets"]) == (["m3", "m4", "m5", "m6"], [6, 7, 8])     # the HSD paper's example
    assert ex["expected_latency"] == pytest.approx(10.6565, abs=1e-4)                   # (as test_solver_paper)
    for plan in (d, ex):
        assert not {"context", "context_from", "latency_by_context"} & _keys(plan)
    now = solve(prof, 15, min_gain=0.03)
    a, curve = prof.accept("int4", "layer30"), prof.cost_curve["int4"]
    assert (now.hierarchy, now.budgets) == (d["hierarchy"], d["budgets"])
    assert now.expected_latency == pytest.approx(
        d["expected_latency"] + a ** 15 * (curve[1] - curve[0]) / sum(a ** k for k in range(16)), rel=1e-12)


def _keys(x) -> set[str]:
    """Every key of nested dicts and lists."""
    if isinstance(x, dict):
        return set(x) | {k for v in x.values() for k in _keys(v)}
    return {k for v in x for k in _keys(v)} if isinstance(x, list) else set()


@pytest.mark.parametrize("mutate,field,needle", [
    (lambda cc: cc[1].update(context=cc[0]["context"]), "context_costs[1].context", "contexts must increase"),
    (lambda cc: cc[0].update(context=0), "context_costs[0].context", "integer >= 1"),
    (lambda cc: cc[0].update(context=True), "context_costs[0].context", "integer >= 1"),
    (lambda cc: cc[1]["cost"].update(t=-1.0), "context_costs[1].cost.t", "seconds > 0"),
    (lambda cc: cc[1]["cost"].update(zz=1.0), "context_costs[1].cost.zz", "unknown model"),
    (lambda cc: cc[1]["cost"].pop("t"), "context_costs[1].cost", "every context must list the same models"),
    (lambda cc: cc[0]["cost_curve"].update(t=[0.1, 0.0]), "context_costs[0].cost_curve.t[1]", "seconds > 0"),
    (lambda cc: cc[1]["verify_cost"].update(t={"d0": "x"}), "context_costs[1].verify_cost.t.d0", "seconds"),
    (lambda cc: cc[1].update(costs={}), "context_costs[1].costs", "unknown field"),
    (lambda cc: cc.clear(), "context_costs", "non-empty list"),
])
def test_bad_context_costs_name_the_field(mutate, field, needle):
    d = {"format": "hsd-profile/1", "target": "t",
         "models": [{"name": "d0", "cost": 0.1}, {"name": "t", "cost": 1.0}], "acceptance": {"d0": {"t": 0.5}},
         "context_costs": [{"context": 64, "cost": {"t": 1.0, "d0": 0.1}, "cost_curve": {"t": [1.0, 1.1]},
                            "verify_cost": {"t": {"d0": 0.9}}},
                           {"context": 512, "cost": {"t": 1.2, "d0": 0.1}, "cost_curve": {"t": [1.2, 1.3]},
                            "verify_cost": {"t": {"d0": 1.0}}}]}
    profile_from_dict(d)                                                 # valid as it is
    mutate(d["context_costs"])
    with pytest.raises(InputFileError) as e:
        profile_from_dict(d, "p.json")
    assert str(e.value).startswith(f"p.json: {field}: ") and needle in str(e.value)


@pytest.mark.parametrize("key,value", [("prompt_tokens", float("nan")), ("generated_tokens", float("inf")),
                                       ("prompt_count", -1), ("prompt_tokens", "many"),
                                       ("positions_by_task", {"chat": float("nan")})])
def test_the_counts_a_context_is_read_from_are_finite_counts(key, value):
    """The provenance's counts that the solved context is read from: a NaN, an infinity, a negative count or a
    string is refused naming the field (NaN was a ValueError deep in the solver)."""
    d = {"format": "hsd-profile/1", "target": "t", "models": [{"name": "d0", "cost": 0.1}, {"name": "t", "cost": 1.0}],
         "acceptance": {"d0": {"t": 0.5}},
         "provenance": {"prompt_count": 2, "prompt_tokens": 100, "generated_tokens": 60}}
    profile_from_dict(d)
    d["provenance"][key] = value
    with pytest.raises(InputFileError, match=f"^p.json: provenance.{key}"):
        profile_from_dict(d, "p.json")


@pytest.mark.parametrize("path,value,needle", [
    ("context", 0, "context length"),
    ("latency_by_context", [[64, 0.1], [64, 0.2]], "contexts must increase"),
    ("latency_by_context", [[64, -0.1]], "seconds per token > 0"),
    ("baselines.target_only.latency_by_context", [[64]], "context tokens"),
])
def test_bad_plan_context_fields_name_the_field(path, value, needle):
    d = {"format": "hsd-plan/1", "tmax": 4, "hierarchy": ["d", "t"], "budgets": [2], "expected_latency": 0.5,
         "expected_speedup": 2.0, "baselines": {"target_only": {"hierarchy": ["t"], "budgets": [],
                                                                "expected_latency": 1.0}}}
    node, *rest = path.split(".")
    tgt = d
    for k in path.split(".")[:-1]:
        tgt = tgt[k]
    tgt[path.split(".")[-1]] = value
    with pytest.raises(InputFileError) as e:
        plan_from_dict(d, "plan.json")
    assert f"plan.json: {path}" in str(e.value) and needle in str(e.value)
