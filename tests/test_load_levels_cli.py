"""From batch costs to a plan per load level to a server that runs it (tiny models): ``hsd profile --batch-sizes``
records the ratios of every drafter, ``hsd solve`` adds ``by_load``, ``hsd serve`` builds every level's
hierarchy over shared engines; bad values are refused naming the flag."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hsd_opt.commands.serve import prepare_server
from tests.helpers import cli_output, run_cli, save_tiny, write_prompts


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("loads")
    model = save_tiny(root / "m", layers=2)
    prompts = write_prompts(root / "p.jsonl", n=3)
    prof = root / "prof.json"
    r = run_cli("profile", "--model", model, "--prompts", prompts, "--out", prof, "--quantized", "int8",
                "--token-drafters", "ngram", "--max-new-tokens", "6", "--tmax", "3", "--cost-repeats", "1",
                "--cost-contexts", "16", "--batch-sizes", "1,2,4", "--quiet", "--device", "cpu")
    assert r.exit_code == 0, cli_output(r)
    return root, prof


def test_the_profile_records_each_drafters_ratio_at_each_batch_size(profiled):
    _, prof = profiled
    d = json.loads(prof.read_text())
    names = [m["name"] for m in d["models"]]
    assert [b["batch"] for b in d["batch_costs"]] == [2, 4]
    for b in d["batch_costs"]:
        assert set(b["ratio"]) == set(names) and b["context"] == 16
        assert b["ratio"]["ngram"] == b["batch"]                       # proposals are made one sequence at a time
        assert all(len(b["ratio"][n]) == 4 and min(b["ratio"][n]) > 0 for n in names if n != "ngram")
        assert b["ratio"]["layer1"] == b["ratio"]["layer2"]            # exits take their engine's ratios
        assert set(b["pass_seconds"]) == {"layer2", "int8"}


def test_solve_plans_every_load_level_and_serve_runs_them(profiled):
    root, prof = profiled
    plan = root / "plan.json"
    r = run_cli("solve", "--profile", prof, "--tmax", "3", "--out", plan)
    assert r.exit_code == 0, cli_output(r)
    assert "plans per load level" in cli_output(r)
    d = json.loads(plan.read_text())
    assert sorted(d["by_load"]) == ["1", "2", "4"]
    assert d["load_min_gain"] == 0.25                 # the default, recorded: --retime chooses again with it
    assert d["by_load"]["1"]["hierarchy"] == d["hierarchy"] or len(d["hierarchy"]) > 2   # min-gain may keep more
    for n, e in d["by_load"].items():
        assert e["tokens_per_s"] == pytest.approx(int(n) / e["expected_latency"])
        assert e["expected_latency"] <= e["batched_target_latency"] * (1 + 1e-9)
    said: list[str] = []
    app, jobs = prepare_server(plan, device="cpu", max_batch=4, say=said.append)
    assert any("(profiled greedy)" in m for m in said), said    # what the plan's rates are for
    assert sorted(jobs.batch.levels) == [1, 2, 4]
    assert len({id(h.target) for h in jobs.batch.levels.values()}) == 1
    one = run_cli("solve", "--profile", prof, "--tmax", "3", "--batch-sizes", "1", "--out", root / "one.json")
    assert one.exit_code == 0 and not {"by_load", "load_min_gain"} & set(json.loads((root / "one.json").read_text()))


def test_levels_that_run_one_hierarchy_share_one_runner(profiled):
    """``hsd_by_load``: a runner per distinct hierarchy, the plan's own runner for the levels that run the plan's
    hierarchy (the server builds nothing twice), every one over the same engines."""
    from hsd_opt.formats import load_plan
    from hsd_opt.models.loading import load_model
    from hsd_opt.runtime.runner import PlanModels, hsd_by_load, hsd_for_plan

    root, prof = profiled
    path = root / "plan_shared.json"
    assert run_cli("solve", "--profile", prof, "--tmax", "3", "--out", path).exit_code == 0
    plan = load_plan(path)
    plan = replace(plan, hierarchy=["int8", plan.hierarchy[-1]], budgets=[2])   # whatever the solver chose here
    alone = replace(plan.by_load[4], hierarchy=[plan.hierarchy[-1]], budgets=[])
    plan.by_load.update({1: replace(plan.by_load[1], hierarchy=list(plan.hierarchy), budgets=list(plan.budgets)),
                         8: alone, 16: replace(alone)})      # two levels with one hierarchy, not the plan's
    loaded = load_model(str(root / "m"), device="cpu")
    models = PlanModels(loaded)
    own = hsd_for_plan(plan, loaded, models=models)
    levels = hsd_by_load(plan, loaded, models, plan_runner=own)
    assert levels[1] is own and levels[8] is levels[16] is not own
    for n, e in plan.by_load.items():
        same = (list(e.hierarchy), list(e.budgets)) == (list(plan.hierarchy), list(plan.budgets))
        assert (levels[n] is own) == same
    assert len({id(h.target) for h in levels.values()} | {id(own.target)}) == 1


def test_serve_retime_chooses_each_level_again_among_the_plans_hierarchies(profiled, monkeypatch):
    """``hsd serve --retime PROFILE``: each engine's step timed at start, every load level served by one of the
    plan's hierarchies (its own, its levels', the target alone) over the same engines, the choice reported in
    ``/health``'s ``retime``; a plan without load levels, or a profile of another model, is refused naming the
    flag."""
    from hsd_opt.errors import HsdError
    from hsd_opt.formats import load_plan

    root, prof = profiled
    path = root / "plan_rt.json"
    assert run_cli("solve", "--profile", prof, "--tmax", "3", "--out", path).exit_code == 0
    plan = load_plan(path)
    app, jobs = prepare_server(path, device="cpu", max_batch=4, retime=prof)
    levels = jobs.batch.levels
    assert sorted(levels) == [1, 2, 4] and len({id(h.target) for h in levels.values()}) == 1
    about = app.state.service.about
    rt = about["retime"]
    assert set(rt["factors"]) >= set(plan.hierarchy) - {"ngram"} and all(f > 0 for f in rt["factors"].values())
    known = {(tuple(plan.hierarchy), tuple(plan.budgets)), ((plan.hierarchy[-1],), ())}
    known |= {(tuple(e.hierarchy), tuple(e.budgets)) for e in plan.by_load.values()}
    for n, h in levels.items():
        e = rt["levels"][str(n)]
        assert (tuple(e["chosen"]), tuple(e["budgets"])) in known
        assert [lv.name for lv in h.levels] == e["chosen"] == about["load_levels"][str(n)]
        assert e["plan"] == list(plan.by_load[n].hierarchy)
    one = root / "one_rt.json"
    assert run_cli("solve", "--profile", prof, "--tmax", "3", "--batch-sizes", "1", "--out", one).exit_code == 0
    with pytest.raises(HsdError, match="--retime: .* no plans per load level"):
        prepare_server(one, device="cpu", retime=prof)
    other = json.loads(prof.read_text())
    other["provenance"]["model"] = "someone/else"
    (root / "other.json").write_text(json.dumps(other))
    with pytest.raises(HsdError, match="--retime .*other.json: the profile is of model"):
        prepare_server(path, device="cpu", retime=root / "other.json")
    import hsd_opt.models.loading as loading

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the profile was checked against the plan")

    monkeypatch.setattr(loading, "load_model", no_load)        # the docs: "exits 2 before the model loads"
    other["provenance"]["model"] = json.loads(prof.read_text())["provenance"]["model"]
    other["batch_costs"] = []
    (root / "other.json").write_text(json.dumps(other))
    with pytest.raises(HsdError, match="--retime .*other.json: the profile has no costs at the plan's load"):
        prepare_server(path, device="cpu", retime=root / "other.json")


def test_bench_under_load_with_retime_reports_the_levels_it_ran(profiled):
    root, prof = profiled
    path, out = root / "plan_bench_rt.json", root / "load_rt.json"
    assert run_cli("solve", "--profile", prof, "--tmax", "3", "--out", path).exit_code == 0
    r = run_cli("bench", "--plan", path, "--concurrency", "1,2", "--retime", prof, "--max-new-tokens", "4",
                "--prompts", root / "p.jsonl", "--json", out, "--device", "cpu")
    assert r.exit_code == 0, cli_output(r)
    rep = json.loads(out.read_text())
    assert set(rep["retime"]["levels"]) == {"1", "2", "4"} and rep["retime"]["factors"]
    assert rep["levels"][1]["methods"]["hsd"]["load_level"] == 2
    assert all(f["equal_to_target"] for lv in rep["levels"] for f in lv["methods"].values())
    for lv in rep["levels"]:                   # every method's run of a level predicted whole, re-timed before it
        for m in lv["methods"].values():
            one = m["rounds"][0]
            assert one["predicted_run_tokens_per_s"] > 0 and one["predicted_wall_seconds"] > 0
            assert one["measured_over_predicted"] == pytest.approx(one["aggregate_tokens_per_s"]
                                                                   / one["predicted_run_tokens_per_s"])
            assert "1" in one["factors"]["batch"] and one["factors"]["prompt_seconds"]
            assert m["predicted_run_tokens_per_s"] == one["predicted_run_tokens_per_s"]
    # two clients decoded one at a time (--max-batch 1) run level 1's plan, and the report says so (it said 2)
    r = run_cli("bench", "--plan", path, "--concurrency", "2", "--max-batch", "1", "--methods", "hsd",
                "--requests", "1", "--max-new-tokens", "4", "--prompts", root / "p.jsonl", "--json", out,
                "--device", "cpu")
    assert r.exit_code == 0, cli_output(r)
    assert json.loads(out.read_text())["levels"][0]["methods"]["hsd"]["load_level"] == 1
    # a --retime file that cannot serve is refused before any hierarchy is built
    r = run_cli("bench", "--plan", path, "--concurrency", "2", "--retime", root / "nowhere.json", "--device", "cpu")
    assert r.exit_code == 2 and "nowhere.json" in cli_output(r) and "building" not in cli_output(r)


@pytest.mark.parametrize("args,flag", [(("solve", "--batch-sizes", "1,3"), "--batch-sizes"),
                                       (("solve", "--batch-sizes", "0"), "--batch-sizes"),
                                       (("profile", "--batch-sizes", "two"), "--batch-sizes"),
                                       (("serve", "--max-batch", "0"), "--max-batch"),
                                       (("serve", "--max-body", "0"), "--max-body")])
def test_bad_load_flags_exit_2_naming_the_flag(profiled, args, flag):
    root, prof = profiled
    cmd, *rest = args
    where = {"solve": ["--profile", prof], "profile": ["--model", root / "m", "--out", root / "x.json"],
             "serve": ["--plan", root / "plan.json"]}[cmd]
    r = run_cli(cmd, *where, *rest)
    assert r.exit_code == 2 and flag in cli_output(r) and "Traceback" not in cli_output(r)
