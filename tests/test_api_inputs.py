"""The Python API refuses arguments of another form or range with an :class:`HsdError` naming the argument (they
were raw TypeErrors and AttributeErrors from deep inside, or were taken and gave a wrong result silently), and never
writes a profile or plan that would not load again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hsd_opt import (
    ModelEntry,
    Profile,
    evaluate,
    gamma,
    load_plan,
    load_profile,
    save_plan,
    save_profile,
    simulate,
    solve,
)
from hsd_opt.errors import HsdError, InputFileError
from hsd_opt.prompts import encode_prompt
from hsd_opt.runtime.penalties import Penalties
from hsd_opt.runtime.sampling import process_logits
from hsd_opt.runtime.state_pool import StatePool
from hsd_opt.solver.graph import build_gsp_graph
from tests.helpers import make_tiny_llama, save_tiny, write_plan

EXAMPLE = Path(__file__).resolve().parents[1] / "data" / "example_profile.json"


@pytest.fixture(scope="module")
def example():
    return load_profile(EXAMPLE)[0]


def test_the_solvers_refuse_hierarchies_budgets_and_profiles_of_another_form(example):
    cases = ((lambda: simulate(example, ["m5", "m6"], 5), "budgets: expected a list of budgets in tokens, got int"),
             (lambda: simulate(example, "m6", []), "hierarchy: expected a list, got str"),    # not its letters
             (lambda: evaluate(example, [["m5"], "m6"], [1]), "hierarchy[0]: expected a model's name, got list"),
             (lambda: build_gsp_graph(str(EXAMPLE), 5), "profile: expected a Profile"),
             (lambda: build_gsp_graph(solve(example, 5), 5), "profile: expected a Profile"),
             (lambda: gamma(0.5, 4, -3), "T an integer >= 0"))                          # was 0.0
    for call, said in cases:
        with pytest.raises(HsdError) as e:
            call()
        assert said in str(e.value), str(e.value)
    assert gamma(0.5, 4, 0) == 0.0


def test_a_profile_or_plan_load_would_refuse_is_not_written(example, tmp_path):
    """A rate set out of range, or budgets changed to decrease, in Python: ``save_*`` wrote a file that
    ``load_*`` refuses; now the save is refused, naming the path and the field, and nothing is written."""
    bad = Profile(target="K", models=[ModelEntry("a", "model", 0.1, True), ModelEntry("K", "target", 1.0, True)],
                  acceptance={"a": {"K": 1.5}})
    with pytest.raises(InputFileError, match=r"b\.json \(not written\): acceptance\.a\.K: .*\[0, 1\], got 1\.5"):
        save_profile(bad, tmp_path / "b.json")
    plan = solve(example, 10)
    save_plan(plan, tmp_path / "ok.json")
    assert load_plan(tmp_path / "ok.json").budgets == plan.budgets
    plan.budgets = [5, 3, 2, 9][:len(plan.budgets)]
    with pytest.raises(InputFileError, match=r"p\.json \(not written\): budgets: "):
        save_plan(plan, tmp_path / "p.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.json"]


def test_the_solvers_refuse_a_profile_built_in_python_that_a_file_could_not_hold(example, tmp_path):
    """A Profile built or changed in Python went to the solvers unchecked: a rate of 1.5 gave a plan predicting
    115x, one NaN rate the target alone, a NaN cost a NaN latency, a cost of 0 a ZeroDivisionError, an unknown target
    a bare ValueError; ``save_profile`` dropped a draft rate above 1 (or NaN) and wrote the file. Each is refused
    now, naming the field, as ``load_profile`` refuses it in a file; ``hierarchy_latency`` (the solvers' inner
    formula) refuses the values it reads."""
    from dataclasses import replace

    from hsd_opt import hierarchy_latency
    from hsd_opt.solver import optimum

    def rate(a):
        table = {d: dict(row) for d, row in example.acceptance.items()}
        table["m5"]["m6"] = a
        return replace(example, acceptance=table)

    def model(i, **kw):
        models = list(example.models)
        models[i] = replace(models[i], **kw)
        return replace(example, models=models)

    cases = ((lambda: solve(rate(1.5), 10), r"profile: acceptance\.m5\.m6: .*\[0, 1\], got 1\.5"),
             (lambda: solve(rate(float("nan")), 10), r"acceptance\.m5\.m6: .*got nan"),
             (lambda: simulate(rate(-0.2), ["m5", "m6"], [4]), r"acceptance\.m5\.m6: .*got -0\.2"),
             (lambda: evaluate(model(5, cost=float("nan")), ["m5", "m6"], [4]), r"models\[5\]\.cost: .*got nan"),
             (lambda: solve(model(5, cost=0.0), 10), r"models\[5\]\.cost: .*> 0, got 0\.0"),
             (lambda: solve(model(0, draft_rate=2.0), 10), r"models\[0\]\.draft_rate: .*got 2\.0"),
             (lambda: solve(replace(example, target="zz"), 10), r"profile: target: 'zz' is not among models"),
             (lambda: save_profile(model(0, draft_rate=float("nan")), tmp_path / "p.json"),
              r"p\.json \(not written\): models\[0\]\.draft_rate"),
             (lambda: simulate(example, ["m5", "m6"], [100]), r"budgets\[0\]: expected a budget in 1\.\.63"),
             (lambda: solve(model(0, draft_rate_by_budget=(float("nan"),) * 4), 10),
              r"models\[0\]\.draft_rate_by_budget\[0\]: .*got nan"),
             (lambda: optimum(rate(1.5), 10), r"profile: acceptance\.m5\.m6: .*got 1\.5"),
             (lambda: build_gsp_graph(model(5, cost=0.0), 10), r"models\[5\]\.cost"),
             (lambda: hierarchy_latency(rate(1.5), ["m5", "m6"], [4]), r"acceptance\.m5\.m6: .*got 1\.5"),
             (lambda: hierarchy_latency(model(5, cost=float("nan")), ["m5", "m6"], [4]), r"m6: expected a cost"),
             (lambda: hierarchy_latency(model(0, draft_rate_by_budget=(float("nan"),)),
                                        ["m1", "m6"], [2]), r"m1: expected a share of rounds"))
    for call, said in cases:
        with pytest.raises(HsdError, match=said):
            call()
    assert not (tmp_path / "p.json").exists()
    assert solve(rate(0.5), 10).expected_latency > 0 and evaluate(example, ["m4", "m5", "m6"], [8, 4]) > 0


@pytest.mark.parametrize("kw, said", [
    ({"temperature": -1.0}, "temperature: expected a finite value >= 0"),      # reversed the distribution
    ({"temperature": float("nan")}, "temperature: expected a finite value >= 0"),     # was greedy
    ({"top_p": 0.0}, "top_p: expected a value in (0, 1]"),
    ({"top_k": 2.5}, "top_k: expected an integer >= 0"),
    ({"min_p": 2.0}, "min_p: expected a value in [0, 1]"),                   # every probability NaN
])
def test_process_logits_refuses_filters_out_of_range(kw, said):
    x = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    args = {"temperature": 1.0, "top_p": 1.0, **kw}
    with pytest.raises(HsdError) as e:
        process_logits(x, **args)
    assert str(e.value).startswith(said)


def test_penalties_prompts_and_models_refuse_values_of_another_form():
    from hsd_opt.engine.layered import LayeredLM
    from hsd_opt.models.loading import load_model
    from hsd_opt.runtime.decode import HSD, Level

    for kw, said in (({"bias": None}, "logit_bias: expected a dict"), ({"bias": [1, 2]}, "logit_bias: expected a dict"),
                     ({"frequency": True}, "frequency_penalty must be a number")):
        with pytest.raises(HsdError, match=said):
            Penalties(**kw)
    def tok(text, **kw):                            # a tokenizer: a text's UTF-8 bytes are its ids
        return {"input_ids": list(text.encode())}

    assert encode_prompt(tok, "hi", raw=True) == list(b"hi")
    for prompt in (5, b"hi", ["hi"]):               # said "empty prompt"
        with pytest.raises(HsdError, match="the prompt must be text"):
            encode_prompt(tok, prompt)
    with pytest.raises(HsdError, match="tokenizer: expected the model's tokenizer"):
        encode_prompt(None, "hi")
    with pytest.raises(HsdError, match="--model: expected a model alias, .* as a str, got int"):
        load_model(5)
    eng = LayeredLM(make_tiny_llama(seed=0, vocab_size=32, layers=2, hidden=32, heads=2, kv_heads=1))
    runner = HSD([Level("t", eng, eng.n_layers)], [])
    for prompt in ({1: 2}, {1, 2}):                  # a dict's keys were decoded
        with pytest.raises(HsdError, match="the prompt must be a sequence of token ids"):
            runner.generate(prompt, 4)
    with pytest.raises(HsdError, match="pool: a StatePool, not int"):   # an AttributeError at the next generate
        runner.pool = 5
    with pytest.raises(HsdError, match="pool: a StatePool, not dict"):
        HSD([Level("t", eng, eng.n_layers)], [], pool={})
    runner.pool = StatePool(reuse=True)
    alone = HSD([Level("t", eng, eng.n_layers)], [])
    assert runner.generate([1, 2, 3], 4).token_ids == alone.generate([1, 2, 3], 4).token_ids


def test_a_plans_runner_refuses_a_hierarchy_given_as_a_string(tmp_path):
    """``hsd_for_plan(..., hierarchy="layer4")`` took the string's letters as levels ("hierarchy[0]: 'l' is not
    described")."""
    from hsd_opt.models.loading import load_model
    from hsd_opt.runtime.runner import hsd_for_plan

    model_dir = save_tiny(tmp_path / "m")
    plan, loaded = load_plan(write_plan(tmp_path / "plan.json", model_dir)), load_model(str(model_dir), device="cpu")
    for kw, said in (({"hierarchy": "layer4", "budgets": []}, "hierarchy: expected a list, got str"),
                     ({"hierarchy": [], "budgets": []}, "hierarchy: empty"),       # an IndexError
                     ({"hierarchy": ["layer2", "layer4"], "budgets": 3}, "budgets: expected a list, got int")):
        with pytest.raises(HsdError, match=said):
            hsd_for_plan(plan, loaded, **kw)
    assert hsd_for_plan(plan, loaded, hierarchy=("layer2", "layer4"), budgets=(3,)).budgets == [3]
    from hsd_opt.heads import load_heads, save_heads, train_heads

    for call, said in ((lambda: load_heads(None, loaded), "path: expected the path of a heads file, got NoneType"),
                       (lambda: save_heads(tmp_path / "h.safetensors", {1: 5}, loaded), r"heads\[1\]: expected"),
                       (lambda: train_heads(loaded, [1], None), "token_sequences: expected a list"),
                       (lambda: train_heads(loaded, [1], [{4: 5}]), r"token_sequences\[0\]: expected a sequence")):
        with pytest.raises(HsdError, match=said):
            call()
    assert not (tmp_path / "h.safetensors").exists()
