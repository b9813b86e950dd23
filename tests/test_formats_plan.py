"""The typed plan (``hsd-plan/1``): its sections parsed into dataclasses on load, refused with the file and the
field named when malformed, and written back as the same JSON."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from hsd_opt.errors import InputFileError
from hsd_opt.formats import (
    Alternative,
    Plan,
    PlanModel,
    Provenance,
    Quantization,
    TaskPlan,
    load_plan,
    plan_from_dict,
    profile_from_dict,
    save_plan,
)
from tests.helpers import cli_output, run_cli

REPO = Path(__file__).resolve().parents[1]


def _stored_plans() -> list[Path]:
    """Plans `hsd solve` wrote for measured runs: the fixtures in ``tests/data`` (one per kind of plan: the embedded
    model's, with trained heads, per load level, per task and sampled, an int4 target's, the family's) and any that
    ``benchmarks/results`` keeps for the docs."""
    out = []
    for root in (REPO / "tests" / "data", REPO / "benchmarks" / "results"):
        for p in sorted(root.rglob("*.json")):
            if '"hsd-plan/1"' in p.read_text()[:300]:
                out.append(p)
    return out


def test_every_stored_plan_loads_and_saves_to_the_same_json():
    plans = _stored_plans()
    fields = set().union(*(json.loads(p.read_text()) for p in plans))
    assert {"by_load", "by_task", "exact_optimum", "latency_by_context"} <= fields   # every optional section
    for path in plans:
        d = json.loads(path.read_text())
        plan = load_plan(path)
        assert json.dumps(plan.to_dict()) == json.dumps(d), path          # same values, same key order
        assert plan.extra.keys() <= {"target", "latency_unit"}, path      # every other field is typed


def _profile_dict() -> dict:
    """A target, an exit, a 4-bit copy of a draft model and an abstaining lookup, with costs at two contexts,
    two tasks and a provenance (the fields a profiler writes, in its order)."""
    names = ("k", "e", "q", "t")
    return {"format": "hsd-profile/1", "target": "t",
            "models": [{"name": "k", "kind": "ngram_context", "cost": 0.0005, "can_verify": False,
                        "draft_rate": 0.4, "config": {"kind": "ngram_context", "q": 2, "w": 4}},
                       {"name": "e", "kind": "early_exit", "cost": 0.3, "can_verify": True, "layer": 2,
                        "step_measured": 0.29},
                       {"name": "q", "kind": "quantized", "cost": 0.35, "can_verify": True, "model": "draft-m",
                        "quantization": {"bits": 4, "group_size": 32, "head_bits": 8, "packed_kernels": True,
                                         "weight_bytes": 1234}},
                       {"name": "t", "kind": "target", "cost": 1.0, "can_verify": True, "layer": 8}],
            "acceptance": {"k": {"e": 0.5, "q": 0.6, "t": 0.6}, "e": {"q": 0.5, "t": 0.45}, "q": {"t": 0.8}},
            "context_costs": [{"context": 64, "cost": {n: c for n, c in zip(names, (0.0005, 0.3, 0.35, 1.0))}},
                              {"context": 2048, "cost": {n: c for n, c in zip(names, (0.0005, 0.4, 0.45, 1.3))}}],
            "acceptance_by_task": {
                "summarization": {"k": {"e": 0.8, "q": 0.9, "t": 0.9}, "e": {"q": 0.6, "t": 0.55}, "q": {"t": 0.85}},
                "qa": {"k": {"q": 0.2, "t": 0.2}, "e": {"q": 0.3, "t": 0.25}, "q": {"t": 0.75}}},
            "provenance": {"model": "m", "revision": None, "heads": None, "temperature": 0.0, "top_p": 1.0,
                           "seed": 0, "dtype": "float32", "target_precision": "float32", "device": "cpu",
                           "prompt_count": 2, "prompt_tokens": 600, "generated_tokens": 80,
                           "prompts_by_task": {"summarization": 1, "qa": 1},
                           "prompt_tokens_by_task": {"summarization": 500, "qa": 100},
                           "positions_by_task": {"summarization": 120, "qa": 80}}}


@pytest.fixture
def solved(tmp_path) -> tuple[Path, dict]:
    """A plan written by ``hsd solve --per-task`` (contexts, alternatives, every kind of model entry)."""
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(_profile_dict()))
    out = tmp_path / "plan.json"
    r = run_cli("solve", "--profile", prof, "--tmax", 6, "--per-task", "--top", 3, "--min-gain", 0, "--out", out)
    assert r.exit_code == 0, cli_output(r)
    return out, json.loads(out.read_text())


def test_a_solved_plan_is_typed_and_round_trips(solved, tmp_path):
    path, d = solved
    plan = load_plan(path)
    assert json.dumps(plan.to_dict()) == json.dumps(d)
    again = tmp_path / "again.json"
    save_plan(plan, again)
    assert again.read_text() == path.read_text()
    q = plan.model_entry("q")
    assert q == PlanModel("q", "quantized", 0.35, True, None, None, "draft-m",
                          Quantization(4, 32, 8, {"packed_kernels": True, "weight_bytes": 1234}), None,
                          {}) and q.quantization.bits == 4
    assert plan.model_entry("k").config == {"kind": "ngram_context", "q": 2, "w": 4}
    assert plan.model_entry("k").draft_rate == 0.4 and plan.model_entry("e").extra == {"step_measured": 0.29}
    assert plan.model_entry("nope") is None and [m.name for m in plan.models] == ["k", "e", "q", "t"]
    prov = plan.provenance
    assert (prov.model, prov.revision, prov.dtype, prov.target_precision, prov.temperature) == \
        ("m", None, "float32", "float32", 0.0)
    assert prov.extra["positions_by_task"] == {"summarization": 120, "qa": 80}
    assert plan.alternatives and all(isinstance(a, Alternative) and a.latency_by_context for a in plan.alternatives)
    assert [a.hierarchy for a in plan.alternatives] == [a["hierarchy"] for a in d["alternatives"]]
    assert plan.context == 320 and plan.context_from == "profile_prompts"           # 600 / 2 + 80 / 2 / 2
    assert plan.latency_by_context == d["latency_by_context"] and plan.solver == "dp" and plan.min_gain == 0
    assert plan.tasks == ["qa", "summarization"] and isinstance(plan.by_task["qa"], TaskPlan)
    qa = plan.by_task["qa"]
    assert (qa.hierarchy, qa.positions, qa.context, qa.context_from) == \
        (d["by_task"]["qa"]["hierarchy"], 80, 140, "task_prompts")                     # 100 + 80 / 2
    assert qa.overall_hierarchies["plan"] == d["by_task"]["qa"]["overall_hierarchies"]["plan"]


def test_a_hand_written_plan_round_trips_without_gaining_fields():
    d = {"format": "hsd-plan/1", "tmax": 8, "hierarchy": ["ngram", "layer2", "layer4"], "budgets": [2, 3],
         "expected_latency": 0.01, "expected_speedup": 1.5, "baselines": {}, "note": "by hand",
         "models": [{"name": "layer2", "kind": "early_exit", "layer": 2},
                    {"name": "ngram", "kind": "ngram_context", "config": {"q": 2}},
                    {"name": "q8", "kind": "quantized", "quantization": {"bits": 8}, "layer": None}],
         "provenance": {"heads": None, "model": "x", "custom": [1, 2]}, "alternatives": [], "max_depth": None}
    plan = plan_from_dict(copy.deepcopy(d))
    assert json.dumps(plan.to_dict()) == json.dumps(d)
    assert plan.model_entry("q8").quantization == Quantization(8)            # defaults: group 32, head bits 8
    assert plan.model_entry("q8").layer is None and plan.model_entry("layer2").cost is None
    assert plan.extra == {"note": "by hand"} and plan.provenance.extra == {"custom": [1, 2]}
    plan.task = "qa"                                                           # a field set later goes last
    assert list(plan.to_dict())[-1] == "task"


def test_a_plan_built_in_memory_writes_only_what_it_has():
    plan = Plan(8, ["e", "t"], [3], 0.5, 2.0)
    assert plan.to_dict() == {"format": "hsd-plan/1", "tmax": 8, "hierarchy": ["e", "t"], "budgets": [3],
                              "expected_latency": 0.5, "expected_speedup": 2.0, "baselines": {}}
    plan.provenance = Provenance(model="m")
    plan.alternatives = [Alternative(["t"], [], 1.0)]
    d = plan.to_dict()
    assert d["provenance"] == {"model": "m"} and d["alternatives"] == [{"hierarchy": ["t"], "budgets": [],
                                                                         "expected_latency": 1.0}]
    assert plan_from_dict(d).to_dict() == d


def test_levels_take_their_entry_or_one_inferred_from_the_name():
    plan = plan_from_dict({"format": "hsd-plan/1", "tmax": 4, "hierarchy": ["layer1", "layer4"], "budgets": [2],
                           "expected_latency": 1.0, "expected_speedup": 1.0})
    assert plan.level_entry("layer1", False) == PlanModel("layer1", "early_exit", layer=1)
    assert plan.level_entry("layer4", True) == PlanModel("layer4", "target", layer=4)
    assert plan.level_entry("ngram", False) is None


def _base() -> dict:
    """A valid plan with every section, for the malformed variants below."""
    return {"format": "hsd-plan/1", "tmax": 8, "hierarchy": ["ngram", "layer2", "layer4"], "budgets": [2, 3],
            "expected_latency": 0.01, "expected_speedup": 1.5, "target": "layer4",
            "baselines": {"target_only": {"hierarchy": ["layer4"], "budgets": [], "expected_latency": 0.015}},
            "solver": "dp", "max_depth": None, "min_gain": 0.03,
            "alternatives": [{"hierarchy": ["layer2", "layer4"], "budgets": [3], "expected_latency": 0.012,
                              "expected_speedup": 1.25}],
            "provenance": {"model": "m", "revision": None, "dtype": "float32", "temperature": 0.0},
            "models": [{"name": "ngram", "kind": "ngram_context", "config": {"q": 2}},
                       {"name": "layer2", "kind": "early_exit", "layer": 2},
                       {"name": "q4", "kind": "quantized", "quantization": {"bits": 4, "group_size": 32}},
                       {"name": "layer4", "kind": "target", "layer": 4}],
            "by_task": {"qa": {"hierarchy": ["ngram", "layer4"], "budgets": [3], "expected_latency": 0.009,
                               "overall_hierarchies": {"plan": 0.011}}},
            "by_load": {"1": {"hierarchy": ["ngram", "layer2", "layer4"], "budgets": [2, 3],
                              "expected_latency": 0.01, "tokens_per_s": 100.0, "batched_target_latency": 0.015},
                        "8": {"hierarchy": ["layer4"], "budgets": [], "expected_latency": 0.004,
                              "tokens_per_s": 2000.0, "batched_target_latency": 0.004}}}


def _set(path: str, value):
    """A change to :func:`_base` at ``path`` (keys and list indices separated by dots)."""
    def change(d):
        *head, last = path.split(".")
        for k in head:
            d = d[int(k)] if isinstance(d, list) else d[k]
        if isinstance(d, list):
            d[int(last)] = value
        else:
            d[last] = value
    return change


BAD = [
    # a wrong level was blamed on the first baseline ("baselines.target_only.hierarchy: ... the plan's target is
    # 'nope'"), one in by_load on its budgets, and the plan's own "target" was never read
    (_set("hierarchy", ["ngram", "nope"]), "hierarchy", "ends with 'nope', but the plan's target is 'layer4'"),
    (_set("target", "layer2"), "hierarchy", "ends with 'layer4', but the plan's target is 'layer2'"),
    (_set("target", 4), "target", "the target's name"),
    (_set("by_load.1.hierarchy", ["nope"]), "by_load.1.hierarchy", "ends with 'nope'"),
    (_set("models", {"name": "x"}), "models", "a list of model entries"),
    (_set("models.1", "layer2"), "models[1]", "an object"),
    (_set("models.2.name", ""), "models[2].name", "non-empty string"),
    (_set("models.2.name", "layer2"), "models[2].name", "duplicate"),
    (_set("models.1.kind", 3), "models[1].kind", "a string"),
    (_set("models.1.cost", 0), "models[1].cost", "seconds > 0"),
    (_set("models.1.layer", "2"), "models[1].layer", "layer index"),
    (_set("models.1.model", 5), "models[1].model", "model id or path"),
    (_set("models.0.config", "q=2"), "models[0].config", "drafter's settings"),
    (_set("models.2.quantization", 4), "models[2].quantization", "{bits, group_size, head_bits}"),
    (_set("models.2.quantization.bits", 3), "models[2].quantization.bits", "4 or 8"),
    (_set("models.2.quantization.head_bits", 16), "models[2].quantization.head_bits", "4 or 8"),
    (_set("models.2.quantization.group_size", 0), "models[2].quantization.group_size", ">= 1 for 4 bits"),
    (_set("hierarchy", ["mystery", "layer2", "layer4"]), "hierarchy[0]", "not described in the plan's models"),
    (_set("hierarchy", ["layer2", "ngram", "layer4"]), "hierarchy[1]", "may only be the bottom level"),
    (_set("by_task.qa", {"hierarchy": ["layer2", "ngram", "layer4"], "budgets": [2, 3], "expected_latency": 0.01}),
     "by_task.qa.hierarchy[1]", "bottom level"),
    (_set("by_task.qa.overall_hierarchies.plan", "fast"), "by_task.qa.overall_hierarchies.plan", "seconds"),
    (_set("provenance", ["m"]), "provenance", "an object"),
    (_set("provenance.model", 7), "provenance.model", "a string"),
    (_set("provenance.target_precision", 8), "provenance.target_precision", "a string"),
    (_set("provenance.temperature", -1), "provenance.temperature", "temperature >= 0"),
    (_set("provenance.top_k", 1.5), "provenance.top_k", "an integer >= 0"),
    (_set("provenance.top_k", True), "provenance.top_k", "an integer >= 0"),
    (_set("provenance.min_p", 2), "provenance.min_p", "a share in [0, 1]"),
    (_set("alternatives", {}), "alternatives", "a list"),
    (_set("alternatives.0", []), "alternatives[0]", "an object"),
    (_set("alternatives.0.hierarchy", []), "alternatives[0].hierarchy", "non-empty list"),
    (_set("alternatives.0.budgets", [9]), "alternatives[0].budgets[0]", "1..tmax=8"),
    (_set("alternatives.0.expected_latency", 0), "alternatives[0].expected_latency", "> 0"),
    (_set("alternatives.0.latency_by_context", [[64, -1]]), "alternatives[0].latency_by_context[0]", "seconds"),
    (_set("exact_optimum", {"hierarchy": ["layer4"], "budgets": []}), "exact_optimum.expected_latency", "> 0"),
    (_set("baselines.target_only.expected_latency", float("nan")), "baselines.target_only.expected_latency", "> 0"),
    (_set("baselines.best_single_draft", {"hierarchy": "zz"}), "baselines.best_single_draft.hierarchy",
     "non-empty list"),
    (_set("baselines.target_only", 3), "baselines.target_only", "an object"),
    (_set("expected_latency", 10 ** 400), "expected_latency", "> 0"),
    (_set("solver", 1), "solver", "a string"),
    (_set("tmax", 64), "tmax", "an integer in 1..63"),
    (_set("max_depth", 0), "max_depth", "integer >= 1"),
    (_set("min_gain", 1.5), "min_gain", "[0, 1)"),
    (_set("context_from", 3), "context_from", "one of given, profile_prompts"),
    (_set("context_from", "nope"), "context_from", "one of given, profile_prompts"),
    (_set("baselines.best_single_draft", {"hierarchy": ["zz", "layer4"], "budgets": [2], "expected_latency": 0.01}),
     "baselines.best_single_draft.hierarchy[0]", "not described in the plan's models"),
    (_set("alternatives.0.hierarchy", ["ngram", "layer2"]), "alternatives[0].hierarchy", "the plan's target"),
    (_set("exact_optimum", {"hierarchy": ["layer2", "ngram", "layer4"], "budgets": [2, 3], "expected_latency": 0.01}),
     "exact_optimum.hierarchy[1]", "may only be the bottom level"),
    (_set("by_load", [1]), "by_load", "an object"),
    (_set("by_load.0", {"hierarchy": ["layer4"], "budgets": [], "expected_latency": 0.01}), "by_load.0",
     "sequences >= 1"),
    (_set("by_load.8.hierarchy", ["layer2"]), "by_load.8.hierarchy", "plan's target"),
    (_set("by_load.8.hierarchy", ["layer2", "ngram", "layer4"]), "by_load.8.budgets", "2 budgets"),
    (_set("by_load.8.tokens_per_s", 0), "by_load.8.tokens_per_s", "a number > 0"),
    (_set("by_load.8.expected_latency", -1), "by_load.8.expected_latency", "> 0"),
    # keys int() cannot read (a traceback), or that name a level another key names (one entry overwrote the other)
    (_set("by_load.\u00b2", {"hierarchy": ["layer4"], "budgets": [], "expected_latency": 0.01}), "by_load.\u00b2",
     "sequences >= 1"),
    (_set("by_load." + "9" * 30, {"hierarchy": ["layer4"], "budgets": [], "expected_latency": 0.01}),
     "by_load." + "9" * 30, "sequences >= 1"),
    (_set("by_load.01", {"hierarchy": ["layer4"], "budgets": [], "expected_latency": 0.01}), "by_load.01",
     "no leading zero"),
    (_set("baselines", []), "baselines", "an object"),
    # exits of one model in an order the runtime refuses (a run found it after loading the model, naming no file;
    # simulate predicted a latency for it): each level reads deeper than those below it
    (_set("by_task.qa", {"hierarchy": ["layer3", "layer2", "layer4"], "budgets": [2, 3], "expected_latency": 0.01}),
     "by_task.qa.hierarchy[1]", "'layer2' (layer 2) verifies 'layer3' (layer 3) of the same model"),
    (_set("by_load.8", {"hierarchy": ["ngram", "layer3", "layer2", "layer4"], "budgets": [2, 3, 4],
                        "expected_latency": 0.01}), "by_load.8.hierarchy[2]", "must read deeper"),
    (lambda d: (d["models"].extend([{"name": "d", "kind": "model", "model": "small"},
                                    {"name": "d3", "kind": "early_exit", "model": "small", "layer": 3}]),
                d.update(hierarchy=["d", "d3", "layer4"], budgets=[2, 3])),
     "hierarchy[1]", "'d3' (layer 3) verifies 'd' (every layer) of the same model"),
]


@pytest.mark.parametrize("change,field,words", BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_a_malformed_section_is_refused_at_load_with_the_file_and_field(tmp_path, change, field, words):
    d = _base()
    plan_from_dict(copy.deepcopy(d))                                            # the base is valid
    change(d)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    with pytest.raises(InputFileError) as err:
        load_plan(path)
    assert str(err.value).startswith(f"{path}: {field}: ") and words in str(err.value)
    assert err.value.field == field


def test_a_null_section_reads_as_absent():
    d = _base()
    d.update(models=None, provenance=None, alternatives=None, by_task=None, exact_optimum=None, baselines=None)
    plan = plan_from_dict(d)
    assert (plan.models, plan.provenance, plan.alternatives, plan.by_task, plan.baselines) == \
        ([], Provenance(), [], {}, {})


def test_a_bad_quantization_is_refused_by_every_command_that_loads_the_plan(tmp_path):
    d = _base()
    d["models"][2]["quantization"]["bits"] = 3
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    for args in (["run", "--plan", path, "--prompt", "hi"], ["bench", "--plan", path],
                 ["simulate", "--plan", path, "--profile", REPO / "data" / "example_profile.json"]):
        r = run_cli(*args)
        out = cli_output(r)
        assert r.exit_code == 2, out
        assert f"{path}: models[2].quantization.bits: expected 4 or 8" in " ".join(out.split())
        assert "Traceback" not in out


def test_a_profile_with_a_bad_quantization_is_refused_at_load():
    d = _profile_dict()
    d["models"][2]["quantization"]["group_size"] = "32"
    with pytest.raises(InputFileError, match=r"^p.json: models\[2\].quantization.group_size: "):
        profile_from_dict(d, "p.json")


def test_a_per_task_rate_of_a_model_the_profile_lacks_is_refused_at_load():
    """A per-task rate names its drafter and verifier among the profile's models, as ``acceptance`` does: one of
    another name was left unread, and the task's plan silently took the overall rate in its place."""
    for record, change, field in (
            ("acceptance_by_task", lambda r: r["qa"]["k"].update(tx=0.5), "acceptance_by_task.qa.k.tx"),
            ("acceptance_by_task", lambda r: r["qa"].update(nosuch={"t": 0.9}), "acceptance_by_task.qa.nosuch.t"),
            ("greedy_agreement", lambda r: r.update(zz={"t": 0.5}), "greedy_agreement.zz.t"),
            ("draft_rate_by_task", lambda r: r.update(qa={"kk": 0.5}), "draft_rate_by_task.qa.kk")):
        d = _profile_dict()
        d.setdefault(record, {})
        change(d[record])
        with pytest.raises(InputFileError, match=rf"^p.json: {re.escape(field)}: unknown model"):
            profile_from_dict(d, "p.json")


def test_only_a_kind_that_gives_distributions_verifies_and_that_is_can_verifys_default():
    """The solver picks verifiers by ``can_verify``, a plan's check by kind: a token drafter (or an unknown kind)
    marked able to verify made ``hsd solve`` refuse its own plan; it is refused at load, naming the field."""
    from hsd_opt import solve

    d = _profile_dict()
    for m in d["models"]:
        del m["can_verify"]
    prof, _ = profile_from_dict(copy.deepcopy(d), "p.json")
    assert [m.can_verify for m in prof.models] == [False, True, True, True]
    for kind in ("ngram_context", "my_drafter"):
        d["models"][0].update(kind=kind, can_verify=True)
        with pytest.raises(InputFileError, match=r"^p.json: models\[0\].can_verify: a '" + kind + "' gives no"):
            profile_from_dict(copy.deepcopy(d), "p.json")
    d["models"][0] = {"name": "k", "kind": "my_drafter", "cost": 0.0005}    # unknown kind: a token drafter
    assert solve(profile_from_dict(d, "p.json")[0], 4).hierarchy[-1] == "t"


@pytest.mark.parametrize("where,value,message", [
    ("k", [0.3, 0.0], r"models\[0\].draft_rate_by_budget\[1\]: expected a share of rounds in \(0, 1\]"),
    ("k", [], r"models\[0\].draft_rate_by_budget: expected a non-empty list"),
    ("k", 0.3, r"models\[0\].draft_rate_by_budget: expected a non-empty list"),
    ("e", [1.0, 1.0], r"models\[1\].draft_rate_by_budget: only for a drafter that abstains"),
    ("e", [0.3], r"models\[1\].draft_rate_by_budget: only for a drafter that cannot verify"),
    ("task", [1.5], r"draft_rate_by_budget_by_task.qa.k\[0\]: expected a share of rounds"),
])
def test_a_drafters_shares_of_rounds_per_budget_are_checked_at_load(where, value, message):
    d = _profile_dict()
    d["models"][0]["draft_rate_by_budget"] = [0.3, 0.2]
    prof, _ = profile_from_dict(copy.deepcopy(d), "p.json")
    again, _ = profile_from_dict(prof.to_dict(), "p.json")
    assert again.entry("k").draft_rate_by_budget == (0.3, 0.2) and again.entry("k").rate_at(7) == 0.2
    if where == "task":
        d["draft_rate_by_budget_by_task"] = {"qa": {"k": value}}
    else:
        d["models"][["k", "e"].index(where)]["draft_rate_by_budget"] = value
    with pytest.raises(InputFileError, match=r"^p.json: " + message):
        profile_from_dict(d, "p.json")


def test_the_bench_baselines_read_the_typed_models():
    from hsd_opt.measure.bench import _best_exit, assistant_ref

    d = _base()
    d["baselines"]["best_early_exit"] = {"hierarchy": ["layer2", "layer4"], "budgets": [3], "expected_latency": 0.1}
    assert _best_exit(plan_from_dict(d)) == 2
    d["baselines"].pop("best_early_exit")
    d["hierarchy"], d["budgets"], d["alternatives"] = ["ngram", "layer4"], [3], []
    assert _best_exit(plan_from_dict(d)) is None                               # no exit of the target anywhere
    d["alternatives"] = [{"hierarchy": ["layer3", "layer4"], "budgets": [2], "expected_latency": 0.1}]
    assert _best_exit(plan_from_dict(d)) == 3                                  # an undescribed layer<N> exit
    d["models"][1]["model"] = "draft-m"                                        # an exit of a draft model
    d["alternatives"] = [{"hierarchy": ["layer2", "layer4"], "budgets": [2], "expected_latency": 0.1}]
    assert _best_exit(plan_from_dict(d)) is None
    assert assistant_ref(plan_from_dict(d)) is None                            # only a model or a copy counts
    d["models"][2]["model"] = "copy-of"
    assert assistant_ref(plan_from_dict(d)) == "copy-of"
    d["models"].append({"name": "dm", "kind": "model", "model": "draft-m2"})
    assert assistant_ref(plan_from_dict(d)) == "draft-m2"                      # a draft model comes first


def test_the_plans_per_load_level_are_typed_and_round_trip():
    plan = plan_from_dict(_base())
    assert sorted(plan.by_load) == [1, 8]
    high = plan.by_load[8]
    assert high.hierarchy == ["layer4"] and high.tokens_per_s == 2000.0 and high.batched_target_latency == 0.004
    assert plan.to_dict()["by_load"] == _base()["by_load"]
    assert "by_load" not in plan_from_dict({k: v for k, v in _base().items() if k != "by_load"}).to_dict()
    d = _base()
    d["by_load"]["2"] = {"hierarchy": ["mystery", "layer4"], "budgets": [2], "expected_latency": 0.01}
    with pytest.raises(InputFileError, match=r"by_load\.2\.hierarchy\[0\]: 'mystery' is not described"):
        plan_from_dict(d)


def _profile(batch_costs) -> dict:
    return {"format": "hsd-profile/1", "target": "t",
            "models": [{"name": "ngram", "kind": "ngram_context", "cost": 1e-4, "can_verify": False},
                       {"name": "d", "cost": 0.01}, {"name": "t", "cost": 0.05}],
            "acceptance": {"ngram": {"t": 0.3, "d": 0.4}, "d": {"t": 0.8}},
            "cost_curve": {"t": [0.05, 0.06, 0.07], "d": [0.01, 0.012, 0.014]}, "batch_costs": batch_costs}


def test_batch_costs_are_typed_checked_and_round_trip():
    good = [{"batch": 2, "ratio": {"ngram": 2.0, "d": [1.2, 1.5, 1.8], "t": [1.1, 1.3, 1.6]}, "context": 64,
             "pass_seconds": {"t": [0.055, 0.078, 0.11]}},
            {"batch": 4, "ratio": {"ngram": 4.0, "d": [1.6, 2.5, 3.3], "t": [1.3, 1.9, 2.6]}}]
    prof, _ = profile_from_dict(_profile(good))
    assert prof.batch_sizes == [1, 2, 4] and prof.batch_costs[0].ratio["d"] == [1.2, 1.5, 1.8]
    assert prof.to_dict()["batch_costs"] == good
    assert profile_from_dict(_profile(None))[0].batch_sizes == [1]
    for bad, field, words in (([{"batch": 1, "ratio": {}}], "batch_costs[0].batch", "batch size"),
                              ([good[1], good[0]], "batch_costs[1].batch", "increase"),
                              ([{"batch": 2, "ratio": {"x": 2.0}}], "batch_costs[0].ratio.x", "unknown model"),
                              ([{"batch": 2, "ratio": {"d": [1.0, -1.0]}}], "batch_costs[0].ratio.d[1]",
                               "expected a ratio > 0, got -1.0"),
                              # a ratio was said to be a list of seconds
                              ([{"batch": 2, "ratio": {"d": -2}}], "batch_costs[0].ratio.d",
                               "expected a ratio > 0 or a list of ratios per t, got -2"),
                              ([{"batch": 2, "ratio": []}], "batch_costs[0].ratio", "an object")):
        with pytest.raises(InputFileError) as err:
            profile_from_dict(_profile(bad), "p.json")
        assert err.value.field == field and words in str(err.value), err.value
