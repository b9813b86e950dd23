"""Predictions re-timed during a benchmark (``hsd bench --retime``): a profile's costs scaled engine by engine,
the step clock that measures the factors, and the report's re-timed figures."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hsd_opt.engine.layered import LayeredLM
from hsd_opt.errors import HsdError
from hsd_opt.formats import Plan, Provenance, load_profile, profile_from_dict
from hsd_opt.measure.retime import StepClock, check_profile_for_plan, retimed_latency, scale_costs
from hsd_opt.runtime.decode import HSD, Level
from hsd_opt.solver import solve
from hsd_opt.solver.context import profile_at_context
from hsd_opt.solver.latency import hierarchy_latency
from tests.helpers import cli_output, make_tiny_llama, random_profile, run_cli, save_tiny


def _latency(p, h, b, ctx):
    return hierarchy_latency(profile_at_context(p, ctx) if p.context_costs else p, h, b)


@pytest.mark.parametrize("seed", range(6))
def test_scaling_every_cost_scales_the_latency_and_each_cost_belongs_to_one_model(seed):
    """Latency is linear in the costs: scaling every model by 2 doubles it, and scaling each model of the
    hierarchy by 2 in turn adds the latency once more in total (each cost is scaled by exactly one factor)."""
    rng = np.random.default_rng(seed)
    p = random_profile(rng, 6, verify_cost=True, cost_curve=True, abstaining=True, contexts=True, growing=True)
    plan = solve(p, tmax=6)
    h, b = plan.hierarchy, plan.budgets
    ctx = float(rng.uniform(1, 3000))
    base = _latency(p, h, b, ctx)
    assert retimed_latency(p, h, b, {}, ctx) == pytest.approx(base, rel=1e-12)
    assert retimed_latency(p, h, b, {m.name: 2.0 for m in p.models}, ctx) == pytest.approx(2 * base, rel=1e-9)
    each = sum(retimed_latency(p, h, b, {m: 2.0}, ctx) for m in h)
    assert each == pytest.approx((len(h) + 1) * base, rel=1e-9)
    assert retimed_latency(p, h, b, {"not-in-the-hierarchy": 5.0}, ctx) == pytest.approx(base, rel=1e-12)


def test_a_verify_pass_is_scaled_by_the_verifier_not_the_drafter():
    d = {"format": "hsd-profile/1", "target": "t",
         "models": [{"name": "d", "kind": "ngram", "cost": 1e-9, "can_verify": False},
                    {"name": "t", "kind": "target", "cost": 1.0}],
         "acceptance": {"d": {"t": 0.6}}, "verify_cost": {"t": {"d": [1.0, 1.2, 1.4, 1.6]}}}
    p = profile_from_dict(d, "<test>")[0]
    base = hierarchy_latency(p, ["d", "t"], [3])
    assert retimed_latency(p, ["d", "t"], [3], {"t": 2.0}) == pytest.approx(2 * base, rel=1e-6)
    assert retimed_latency(p, ["d", "t"], [3], {"d": 2.0}) == pytest.approx(base, rel=1e-6)
    s = scale_costs(p, {"t": 3.0})
    assert s.verify_cost["t"]["d"] == pytest.approx([3.0, 3.6, 4.2, 4.8]) and s.entry("t").cost == 3.0
    assert s.acceptance == p.acceptance and p.entry("t").cost == 1.0          # the original is unchanged


def test_the_clock_gives_every_level_of_one_engine_the_same_factor():
    lm = LayeredLM(make_tiny_llama())
    h = HSD([Level("layer1", lm, 1), Level("layer2", lm, 2), Level("layer4", lm, 4)], [2, 3])
    prof = profile_from_dict({"format": "hsd-profile/1", "target": "layer4",
                              "models": [{"name": f"layer{b}", "kind": "early_exit", "cost": 0.001 * b}
                                         for b in (1, 2, 4)],
                              "acceptance": {"layer1": {"layer2": 0.5, "layer4": 0.4}, "layer2": {"layer4": 0.6}}},
                             "<test>")[0]
    clock = StepClock(prof, [h], repeats=3)
    assert len(clock.engines) == 1 and clock.engines[0]["name"] == "layer4"
    f1, f2 = clock.measure(), clock.measure()
    assert set(f1) == {"layer1", "layer2", "layer4"} and len(set(f1.values())) == 1 and f1["layer4"] > 0
    s = clock.summary()["layer4"]
    assert s["levels"] == ["layer1", "layer2", "layer4"] and s["profiled_step"] == 0.004
    assert s["factor_median"] == pytest.approx(clock.factors()["layer4"])
    assert s["factor_min"] == pytest.approx(min(f1["layer4"], f2["layer4"]))


def test_a_sampled_profiles_step_is_compared_without_its_sampling_and_with_the_draws_saving():
    """A profile made with a temperature holds every model's step with its sampling work, and a target that draws
    by noise its step less what the draws save; the clock times steps that end in logits, so it compares the
    target's with ``cost - sampling_seconds[0] + draw_saving_seconds[0]`` (sampled with top-k or min-p, ``+
    window_saving_seconds[0]``, what reading the filters' window saves) and an exit's with ``cost -
    sampling_seconds[0]``."""
    lm = LayeredLM(make_tiny_llama())
    h = HSD([Level("layer2", lm, 2), Level("layer4", lm, 4)], [3])
    models = [{"name": f"layer{b}", "kind": "early_exit", "cost": 0.01 * b} for b in (2, 4)]
    for saving, window, want in ((None, None, 0.04 - 0.003), ([0.002, 0.004], None, 0.04 - 0.003 + 0.002),
                                 (None, [0.0015, 0.003], 0.04 - 0.003 + 0.0015)):
        prof = profile_from_dict({"format": "hsd-profile/1", "target": "layer4", "models": models,
                                  "acceptance": {"layer2": {"layer4": 0.5}},
                                  "provenance": {"sampling_seconds": [0.003, 0.005], "draw_saving_seconds": saving,
                                                 "window_saving_seconds": window}}, "<test>")[0]
        clock = StepClock(prof, [h], repeats=1, greedy=False)
        assert [e["profiled"] for e in clock.engines] == [pytest.approx(want)]
    h2 = HSD([Level("layer2", lm, 2)], [])                      # the exit's own step: no draws taken back
    clock = StepClock(prof, [h2], repeats=1, greedy=False)
    assert [e["profiled"] for e in clock.engines] == [pytest.approx(0.02 - 0.003)]


def test_a_batch_clock_times_the_batched_pass_against_the_profiles_batched_cost(monkeypatch):
    """At batch 4 the clock times one batched pass of 4 sequences (one ``advance_many`` and one batched head, no
    single steps) and divides by the profile's cost of that pass (the step times the batch ratio at t = 1)."""
    lm = LayeredLM(make_tiny_llama())
    h = HSD([Level("layer2", lm, 2), Level("layer4", lm, 4)], [3])
    prof = profile_from_dict({"format": "hsd-profile/1", "target": "layer4",
                              "models": [{"name": f"layer{b}", "kind": "early_exit", "cost": 0.001 * b}
                                         for b in (2, 4)],
                              "acceptance": {"layer2": {"layer4": 0.5}},
                              "batch_costs": [{"batch": 4, "ratio": {"layer2": 2.5, "layer4": [3.0, 4.0]}}]},
                             "<test>")[0]
    calls = {"one": 0, "many": []}
    many, one = lm.advance_many, lm.advance
    monkeypatch.setattr(lm, "advance_many", lambda work: calls["many"].append(len(work)) or many(work))
    monkeypatch.setattr(lm, "advance", lambda st, b: calls.__setitem__("one", calls["one"] + 1) or one(st, b))
    clock = StepClock(prof, [h], repeats=2, batch=4)
    f = clock.measure()
    assert calls["many"] == [4] * 3           # a warm-up and two timed batched passes
    assert calls["one"] == 1                  # the context computed once (the other sequences copy it), no steps
    s = clock.summary()["layer4"]
    assert s["batch"] == 4 and s["profiled_step"] == pytest.approx(0.004 * 3.0)
    assert f["layer4"] == pytest.approx(s["measured_step_median"] / (0.004 * 3.0))
    with pytest.raises(HsdError, match="no costs at batch 8"):
        StepClock(prof, [h], batch=8)


def test_a_profile_that_cannot_price_the_plan_is_refused():
    prof = profile_from_dict({"format": "hsd-profile/1", "target": "layer4",
                              "models": [{"name": "layer4", "kind": "target", "cost": 0.01}], "acceptance": {}},
                             "<test>")[0]

    plan = Plan(8, ["layer2", "layer4"], [3], 0.01, 1.0)
    with pytest.raises(HsdError, match="--retime p.json: the profile does not describe layer2"):
        check_profile_for_plan(prof, plan, "p.json")
    prof.provenance = Provenance(model="m-a")
    plan = Plan(8, ["layer4"], [], 0.01, 1.0, provenance=Provenance(model="m-b"))
    with pytest.raises(HsdError, match="the profile is of model 'm-a', the plan of 'm-b'"):
        check_profile_for_plan(prof, plan, "p.json")
    prof.provenance = Provenance(model="m-a", target_precision="int4")      # the int4 copy's costs
    for plan_precision, refused in (("float32", True), ("int4", False), (None, False)):
        plan = Plan(8, ["layer4"], [], 0.01, 1.0, provenance=Provenance(model="m-a", target_precision=plan_precision))
        if refused:
            with pytest.raises(HsdError, match="the profile is of target precision 'int4', the plan of 'float32'"):
                check_profile_for_plan(prof, plan, "p.json")
        else:
            check_profile_for_plan(prof, plan, "p.json")
    prof.provenance = Provenance(model="m-a", temperature=1.0, top_k=40)    # a sampled profile's costs
    for kw, refused in (({"temperature": 0.0}, "temperature 1.0, the plan of 0.0"),
                        ({"temperature": 1.0, "top_k": 0}, "top-k 40, the plan of 0"),
                        ({"temperature": 1.0}, "top-k 40, the plan of 0"),     # not recorded with a temperature: off
                        ({"temperature": 1.0, "top_k": 40}, None), ({}, None)):
        plan = Plan(8, ["layer4"], [], 0.01, 1.0, provenance=Provenance(model="m-a", **kw))
        if refused:
            with pytest.raises(HsdError, match=f"the profile is of {refused}"):
                check_profile_for_plan(prof, plan, "p.json")
        else:
            check_profile_for_plan(prof, plan, "p.json")


def test_the_load_levels_are_checked_against_the_profile_and_a_sampled_profile_is_clocked_in_logits(monkeypatch):
    """A level's drafter the profile lacks, or a load level it has no batch costs at, failed only after the model
    loaded, naming no --retime; a sampled profile's steps were timed as greedy ones (about 18% cheaper here), and
    the load levels chosen again with 0.25 whatever the plan was solved with."""
    from hsd_opt.formats import LoadPlan
    from hsd_opt.measure import retime

    models = [{"name": n, "kind": k, "cost": c} for n, k, c in (("layer2", "early_exit", 0.004),
                                                                ("layer4", "target", 0.01))]
    prof = profile_from_dict({"format": "hsd-profile/1", "target": "layer4", "models": models,
                              "acceptance": {"layer2": {"layer4": 0.5}},
                              "batch_costs": [{"batch": 2, "ratio": {"layer2": 1.5, "layer4": 1.5}}]}, "<test>")[0]
    level = LoadPlan(["lookup", "layer4"], [2], 0.01, 100.0)
    plan = Plan(8, ["layer4"], [], 0.01, 1.0, by_load={1: level})
    with pytest.raises(HsdError, match="--retime p.json: the profile does not describe lookup"):
        check_profile_for_plan(prof, plan, "p.json")
    plan = Plan(8, ["layer4"], [], 0.01, 1.0, by_load={2: LoadPlan(["layer2", "layer4"], [2], 0.01, 100.0),
                                                       4: LoadPlan(["layer4"], [], 0.01, 100.0)})
    with pytest.raises(HsdError, match="no costs at the plan's load levels 4"):
        check_profile_for_plan(prof, plan, "p.json")
    assert retime.greedy_costs(prof)
    prof.provenance = Provenance(temperature=0.7)
    assert not retime.greedy_costs(prof)
    seen = {}

    class Clock:
        def __init__(self, profile, runs, **kw):
            seen["greedy"] = kw.get("greedy")

        def measure(self):
            pass

        def factors(self):
            return {}

    def choose(profile, loads, built, gain, context=None):
        seen["gain"] = gain
        return {}

    monkeypatch.setattr(retime, "StepClock", Clock)
    monkeypatch.setattr(retime, "choose_loads", choose)
    plan.load_min_gain = 0.0
    retime.retime_load_levels(plan, prof, {(("layer4",), ()): None})
    assert seen == {"greedy": False, "gain": 0.0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("retime")
    model = save_tiny(root / "model")
    plan = {"format": "hsd-plan/1", "tmax": 8, "hierarchy": ["layer1", "layer2", "layer4"], "budgets": [2, 3],
            "expected_latency": 0.01, "expected_speedup": 1.5,
            "baselines": {"target_only": {"hierarchy": ["layer4"], "budgets": [], "expected_latency": 0.015},
                          "best_single_draft": {"hierarchy": ["layer2", "layer4"], "budgets": [3],
                                                "expected_latency": 0.012, "expected_speedup": 1.25}},
            "models": [{"name": f"layer{b}", "kind": "target" if b == 4 else "early_exit", "layer": b}
                       for b in (1, 2, 4)],
            "provenance": {"model": str(model), "device": "cpu", "dtype": "float32", "temperature": 0.0}}
    profile = {"format": "hsd-profile/1", "target": "layer4",
               "models": [{"name": "layer1", "kind": "early_exit", "cost": 0.004},
                          {"name": "layer2", "kind": "early_exit", "cost": 0.006},
                          {"name": "layer4", "kind": "target", "cost": 0.015}],
               "acceptance": {"layer1": {"layer2": 0.7, "layer4": 0.6}, "layer2": {"layer4": 0.8}},
               "verify_cost": {"layer4": {"layer2": [0.012, 0.013, 0.014, 0.015]}}}
    (root / "plan.json").write_text(json.dumps(plan))
    (root / "profile.json").write_text(json.dumps(profile))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1} w{i + 2}", "task": "chat"}) + "\n"
                               for i in range(2)))
    return {"root": root, "plan": root / "plan.json", "profile": root / "profile.json", "prompts": prompts}


def test_bench_reports_predictions_retimed_at_the_measured_speed(tiny):
    out, png = tiny["root"] / "bench.json", tiny["root"] / "bench.png"
    r = run_cli("bench", "--plan", tiny["plan"], "--prompts", tiny["prompts"], "--limit", 1, "--max-new-tokens", 6,
                "--methods", "ar,single_draft,hsd", "--retime", tiny["profile"], "--json", out, "--plot", png,
                "--device", "cpu")
    assert r.exit_code == 0, cli_output(r)
    assert "retimed" in cli_output(r) and "retime layer4 (layer1, layer2, layer4)" in " ".join(cli_output(r).split())
    assert "prompt 1/1 done" in r.stderr and "prompt 1/1" not in r.stdout     # progress apart from the report
    rep = json.loads(out.read_text())
    assert png.stat().st_size > 1000
    e = rep["retime"]["engines"]["layer4"]
    f = e["factor_median"]                                   # one prompt: one measurement
    assert e["factor_min"] == e["factor_max"] == f > 0 and e["profiled_step"] == 0.015
    prof = load_profile(tiny["profile"])[0]
    ms = rep["methods"]
    assert ms["ar"]["retimed_predicted_seconds_per_token"] == pytest.approx(0.015 * f, rel=1e-9)
    assert ms["hsd"]["retimed_predicted_seconds_per_token"] == pytest.approx(
        f * hierarchy_latency(prof, ["layer1", "layer2", "layer4"], [2, 3]), rel=1e-9)
    for m, d in ms.items():
        assert d["measured_over_retimed"] == pytest.approx(
            d["seconds_per_token"] / d["retimed_predicted_seconds_per_token"]), m
        assert rep["by_task"]["chat"][m]["retimed_predicted_seconds_per_token"] == pytest.approx(
            d["retimed_predicted_seconds_per_token"])
    # without --retime nothing of it is reported
    r = run_cli("bench", "--plan", tiny["plan"], "--prompts", tiny["prompts"], "--limit", 1, "--max-new-tokens", 3,
                "--methods", "ar", "--json", out, "--device", "cpu")
    rep = json.loads(out.read_text())
    assert r.exit_code == 0 and "retime" not in rep
    assert "retimed_predicted_seconds_per_token" not in rep["methods"]["ar"]


def test_bench_retime_bad_profile_is_a_usage_error(tiny):
    other = tiny["root"] / "other.json"
    other.write_text(json.dumps({"format": "hsd-profile/1", "target": "layer4",
                                 "models": [{"name": "layer4", "kind": "target", "cost": 0.01}], "acceptance": {}}))
    for path, needle in ((other, "does not describe layer1, layer2"), (tiny["root"] / "missing.json", "missing.json")):
        r = run_cli("bench", "--plan", tiny["plan"], "--prompts", tiny["prompts"], "--limit", 1, "--methods", "ar",
                    "--retime", path, "--device", "cpu")
        assert r.exit_code == 2, cli_output(r)
        assert needle in cli_output(r) and "Traceback" not in cli_output(r)


def test_bench_clocks_steps_as_the_profile_timed_them_whatever_the_run_samples(tiny, monkeypatch):
    """The clock compares a step with the profile's: sampling a run of a greedy profile, its steps were timed as
    sampling's (ending in logits) against the profile's greedy ones, which the factor then took for drift."""
    from hsd_opt.measure import retime

    seen = []
    real = retime.StepClock.__init__

    def init(self, profile, hierarchies, **kw):
        seen.append(kw.get("greedy"))
        real(self, profile, hierarchies, **kw)

    monkeypatch.setattr(retime.StepClock, "__init__", init)
    r = run_cli("bench", "--plan", tiny["plan"], "--prompts", tiny["prompts"], "--limit", 1, "--max-new-tokens", 3,
                "--methods", "ar", "--retime", tiny["profile"], "--temperature", 1, "--device", "cpu")
    assert r.exit_code == 0, cli_output(r)
    assert seen == [True]
