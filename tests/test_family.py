"""A model family as a hierarchy, on two tiny Qwen2 models of one tokenizer ("big" target, "small" draft model):
quantized copies of the draft model in profile -> solve -> run (lossless), a quantized copy of the target as the
target itself (HSD equals its own autoregressive loop), provenance refusals, ``hf_assisted`` in bench, the cost
budget and the memory the engines hold."""

from __future__ import annotations

import json

import pytest
import torch

from hsd_opt.engine.layered import LayeredLM, is_released, release_float_weights
from hsd_opt.engine.quantized import QuantizedLM
from hsd_opt.errors import HsdError
from hsd_opt.runtime.decode import HSD, Level
from tests.helpers import cli_output, make_tiny_llama, make_tiny_qwen2_family, run_cli, save_tiny_family, write_prompts

FAST = ["--tmax", "3", "--cost-repeats", "1", "--quiet", "--threads", "1", "--max-new-tokens", "6",
        "--device", "cpu", "--cost-contexts", "16", "--token-drafters", "lookup"]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("family")
    big, small = save_tiny_family(root)
    return {"big": big, "small": small, "prompts": write_prompts(root / "prompts.jsonl", n=3), "root": root}


@pytest.fixture(autouse=True)
def _isolate(isolated_cache):
    """A test cache and one torch thread (restored after, ``conftest.isolated_cache``): the kernels' threads wait
    for each other, which on a busy machine makes the many tiny passes here slow."""
    torch.set_num_threads(1)
    yield


def _load(path):
    from hsd_opt.models.loading import load_model

    return load_model(str(path), device="cpu", dtype="float32")


def _prompts(n=4, length=7):
    return [torch.randint(4, 64, (length + s,), generator=torch.Generator().manual_seed(s)).tolist()
            for s in range(n)]


def _profile(family, out, *extra):
    r = run_cli("profile", "--model", family["big"], "--prompts", family["prompts"], "--out", out, *FAST, *extra)
    assert r.exit_code == 0, cli_output(r)
    return json.loads(out.read_text())


def _plan(prof_path, plan_path, hierarchy, budgets):
    """Solve, then run the given hierarchy (whatever won on these tiny models)."""
    r = run_cli("solve", "--profile", prof_path, "--tmax", "3", "--out", plan_path)
    assert r.exit_code == 0, cli_output(r)
    plan = json.loads(plan_path.read_text())
    plan["hierarchy"], plan["budgets"] = hierarchy, budgets
    plan_path.write_text(json.dumps(plan))
    return plan


def _run_json(plan_path, out, *extra):
    r = run_cli("run", "--plan", plan_path, "--prompt", "w1 w2 w3 w1 w2", "--raw", "--max-new-tokens", "10",
                "--json", out, "--quiet", *extra)
    assert r.exit_code == 0, cli_output(r)
    return json.loads(out.read_text().splitlines()[0])


def _ar(plan_path, prompt="w1 w2 w3 w1 w2", n=10):
    """The plan's target alone: its own greedy loop (the reference)."""
    from hsd_opt.formats import load_plan
    from hsd_opt.prompts import encode_prompt
    from hsd_opt.runtime.runner import hsd_for_plan

    plan = load_plan(plan_path)
    loaded = _load(plan.provenance.model)
    h = hsd_for_plan(plan, loaded, hierarchy=[plan.hierarchy[-1]], budgets=[])
    return h.generate(encode_prompt(loaded.tokenizer, prompt, raw=True), n).token_ids


# ------------------------------------------------------------------------------------------- the pool


@pytest.mark.slow
def test_profile_solve_run_with_copies_of_the_draft_model(family, tmp_path, monkeypatch):
    """The small model, its int4 copy and an int8 copy of the target in one profile; the int4 copy of the small
    model under the target, and under its own float model, runs lossless and takes the prompt cache of the
    small model's engine when that engine is a level. The draft model, named relative to the working folder, is
    recorded by its absolute path: the plan runs from another folder."""
    prof_path = tmp_path / "prof.json"
    monkeypatch.chdir(family["small"].parent)
    small = family["small"].name
    prof = _profile(family, prof_path, "--draft-model", small, "--layers", "2", "--draft-layers", "1",
                    "--quantized", f"int8,{small}:int4")
    monkeypatch.chdir(tmp_path)
    e = {m["name"]: m for m in prof["models"]}
    assert set(e) == {"layer2", "layer4", "small-layer1", "small", "small-int4", "int8", "lookup"}
    assert e["small-layer1"]["kind"] == "early_exit" and e["small-layer1"]["layer"] == 1
    assert e["small-layer1"]["model"] == str(family["small"]) and "model" not in e["layer2"]
    assert "small-layer1" in prof["verify_cost"]["small"]          # exits of one model: activation reuse
    assert e["small-int4"]["kind"] == "quantized" and e["small-int4"]["model"] == str(family["small"])
    assert e["small-int4"]["quantization"]["bits"] == 4 and "model" not in e["int8"]
    assert e["small"]["kind"] == "model" and e["small"]["model"] == str(family["small"])
    assert prof["provenance"]["quantized"] == ["int8", "small-int4"]
    assert prof["provenance"]["target_precision"] == "float32"
    acc = prof["acceptance"]
    assert 0.0 < acc.get("small-int4", {}).get("layer4", acc.get("layer4", {}).get("small-int4", -1)) <= 1.0
    plan_path = tmp_path / "plan.json"
    for hierarchy, budgets in ((["small-int4", "layer4"], [3]), (["lookup", "small-int4", "small", "layer4"],
                                                                  [1, 2, 3]),
                               (["small-layer1", "small", "layer4"], [2, 3])):
        _plan(prof_path, plan_path, hierarchy, budgets)
        row = _run_json(plan_path, tmp_path / "run.jsonl")
        assert row["token_ids"] == _ar(plan_path) and len(row["token_ids"]) == 10
        assert [lv["name"] for lv in row["stats"]["levels"]] == hierarchy


@pytest.mark.slow
def test_a_copy_with_an_int4_head_drafts_and_runs_lossless(family, tmp_path):
    """``MODEL:int4-head4``: an int4 copy of the small model whose LM head is int4 too (half the head's bytes)
    enters the pool next to the plain int4 copy, records its head in the profile, is rebuilt with it by the
    runner, and drafts losslessly; its head is not the plain copy's (other logits)."""
    prof_path = tmp_path / "prof.json"
    prof = _profile(family, prof_path, "--draft-model", family["small"], "--layers", "4",
                    "--quantized", f"{family['small']}:int4,{family['small']}:int4-head4")
    e = {m["name"]: m for m in prof["models"]}
    assert e["small-int4"]["quantization"]["head_bits"] == 8
    assert e["small-int4-head4"]["quantization"]["head_bits"] == 4
    assert e["small-int4-head4"]["quantization"]["bits"] == 4 and e["small-int4-head4"]["kind"] == "quantized"
    assert prof["provenance"]["quantized"] == ["small-int4", "small-int4-head4"]
    plan_path = tmp_path / "plan.json"
    _plan(prof_path, plan_path, ["small-int4-head4", "layer4"], [3])
    row = _run_json(plan_path, tmp_path / "run.jsonl")
    assert row["token_ids"] == _ar(plan_path) and len(row["token_ids"]) == 10
    assert [lv["name"] for lv in row["stats"]["levels"]] == ["small-int4-head4", "layer4"]
    small = _load(family["small"])
    h8, h4 = QuantizedLM(small.model, bits=4), QuantizedLM(small.model, bits=4, head_bits=4)
    hidden = torch.randn(3, small.model.config.hidden_size)
    assert not torch.equal(h8.head(hidden, h8.n_layers), h4.head(hidden, h4.n_layers))


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("width", [56, 72])
def test_match_width_keeps_the_drafts_rows_and_zeros_or_drops_the_rest(tied, width):
    """A draft model given the target's width keeps its own rows of embeddings and head (tied or not, as they
    were), gets rows of zeros beyond them or loses its last ones, computes the same logits for its own tokens,
    says its new width to the engines, and is stored under another weights key."""
    from types import SimpleNamespace

    from hsd_opt.models.loading import match_width

    model = make_tiny_qwen2_family(seed=2, vocab_size=64, layers=1, tied=tied)
    model.hsd_weights_key = "local|abc|float32"
    embed, head = model.get_input_embeddings().weight.clone(), model.get_output_embeddings().weight.clone()
    ids = torch.tensor([[3, 9, 27, 50]])
    before = model(ids).logits[0]
    target = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(vocab_size=width)))
    assert match_width(target, SimpleNamespace(model=model)) == width - 64
    assert match_width(target, SimpleNamespace(model=model)) == 0
    keep = min(width, 64)
    new_embed, new_head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert new_embed.shape == (width, 64) and new_head.shape == (width, 64) and (new_head is new_embed) == tied
    assert torch.equal(new_embed[:keep], embed[:keep]) and torch.equal(new_head[:keep], head[:keep])
    assert not new_embed[keep:].any() and not new_head[keep:].any()
    assert model.config.vocab_size == width and model.hsd_weights_key == f"local|abc|float32|rows{width}"
    after = model(ids).logits[0]
    assert after.shape == (4, width) and torch.allclose(after[:, :keep], before[:, :keep], atol=1e-5)
    assert not after[:, keep:].any()
    assert LayeredLM(model).vocab_size == width


def _with_width(src, dst, width: int, extra_scale: float = 0.0):
    """The model in ``src`` saved in ``dst`` with its tokenizer and ``width`` rows of embeddings and head (the
    first rows its own; rows beyond them ``extra_scale`` times normal noise)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    have = model.config.vocab_size
    model.resize_token_embeddings(width, mean_resizing=False)
    with torch.no_grad():
        if width > have:
            extra = torch.randn(width - have, model.config.hidden_size)
            model.get_input_embeddings().weight[have:] = extra_scale * extra
    model.save_pretrained(str(dst))
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(dst))
    return dst


@pytest.mark.slow
def test_a_draft_model_padded_to_another_width_takes_the_targets_and_drafts_losslessly(family, tmp_path):
    """A draft model of the target's tokenizer whose head has another number of rows (as Qwen2.5-7B's 152,064
    against the 0.5B's 151,936: padding beyond the tokenizer's tokens) was refused; it now takes the target's
    width (rows of zeros, or its last rows dropped; the profile says so) and profiles, solves and runs losslessly,
    greedy and sampled.
    The drafts are copies of the target: a narrower one drafts right where the target's choice has a row in it;
    a wider one, whose extra rows would win every argmax, drafts exactly the target's tokens once they are
    dropped (every draft accepted)."""
    prof_path, plan_path = tmp_path / "prof.json", tmp_path / "plan.json"
    for name, width, scale in (("narrow", 120, 0.0), ("wide", 136, 50.0)):
        draft = _with_width(family["big"], tmp_path / name, width, scale)
        r = run_cli("profile", "--model", family["big"], "--prompts", family["prompts"], "--out", prof_path,
                    *[f for f in FAST if f != "--quiet"], "--draft-model", draft, "--layers", "none")
        said = "8 rows of zeros added" if name == "narrow" else "its last 8 rows dropped"
        assert r.exit_code == 0 and f"its head has {width:,} rows, the target's 128: {said}" in cli_output(r)
        assert {m["name"] for m in json.loads(prof_path.read_text())["models"]} >= {name, "layer4"}
        _plan(prof_path, plan_path, [name, "layer4"], [3])
        row = _run_json(plan_path, tmp_path / "run.jsonl")
        assert row["token_ids"] == _ar(plan_path) and len(row["token_ids"]) == 10
        draft_level, target_level = row["stats"]["levels"]
        assert target_level["accepted"] > 0 and draft_level["drafted"] == target_level["drafted"]
        if name == "wide":
            assert target_level["accepted"] == target_level["drafted"]
        sampled = _run_json(plan_path, tmp_path / "sampled.jsonl", "--temperature", "1", "--seed", "3")
        assert 1 <= len(sampled["token_ids"]) <= 10 and all(0 <= t < 128 for t in sampled["token_ids"])


def test_a_copy_shares_the_prompt_of_its_own_model(family, monkeypatch):
    """In a hierarchy with the small model and its int4 copy, the copy takes the small model's keys and values
    (every prompt position but the last); with only the copy, it prefills on its own. Either way lossless."""
    big, small = _load(family["big"]), _load(family["small"])
    target, draft = LayeredLM(big.model), LayeredLM(small.model)
    copy = QuantizedLM(small.model, bits=4)
    assert copy.can_share_prompt(draft) and not copy.can_share_prompt(target) and not draft.can_share_prompt(copy)
    calls = []
    real = QuantizedLM.share_prompt

    def spy(self, st, src, src_st, upto):
        calls.append(src)
        return real(self, st, src, src_st, upto)

    monkeypatch.setattr(QuantizedLM, "share_prompt", spy)
    ar = HSD([Level("big", target, 4)], [], eos_ids=[2])
    both = HSD([Level("small-int4", copy, 2), Level("small", draft, 2), Level("big", target, 4)], [2, 3],
               eos_ids=[2])
    alone = HSD([Level("small-int4", copy, 2), Level("big", target, 4)], [3], eos_ids=[2])
    for p in _prompts():
        ref = ar.generate(p, 16).token_ids
        assert both.generate(p, 16).token_ids == ref
        assert alone.generate(p, 16).token_ids == ref
    assert calls == [draft] * 4                       # shared in ``both`` only, from the small model's engine


# ------------------------------------------------------------------------------------------- the int4 target


@pytest.mark.parametrize("chain,budgets", [
    (["t2"], [3]), (["s4"], [4]),                                       # depth 2
    (["s4", "t2"], [2, 4]), (["lookup", "s4"], [1, 3]),                 # depth 3
    (["lookup", "s4", "t2"], [1, 2, 4]), (["lookup", "s", "s4"], [1, 2, 3])])   # depth 4
def test_int4_target_hsd_equals_its_own_ar(family, chain, budgets):
    """The int4 copy of the big model is the target: greedy HSD over it, with its own exit, the small model, the
    small model's int4 copy and a token drafter below, equals that copy's own autoregressive loop token for
    token (the kernels are batch-invariant), and sampling runs."""
    from hsd_opt.drafters import make_token_drafter

    big, small = _load(family["big"]), _load(family["small"])
    t4 = QuantizedLM(big.model, bits=4, kernels=True)
    s, s4 = LayeredLM(small.model), QuantizedLM(small.model, bits=4)
    lv = {"t2": Level("t2", t4, 2), "s4": Level("s4", s4, 2), "s": Level("s", s, 2),
          "lookup": Level("lookup", drafter=make_token_drafter("ngram_context", name="lookup", q=2, w=4))}
    h = HSD([lv[n] for n in chain] + [Level("t4", t4, 4)], budgets, eos_ids=[2])
    ar = HSD([Level("t4", t4, 4)], [], eos_ids=[2])
    float_ar = HSD([Level("big", LayeredLM(big.model), 4)], [], eos_ids=[2])
    accepted, differs = 0, 0
    for p in _prompts(5):
        ref = ar.generate(p, 20).token_ids
        res = h.generate(p, 20)
        assert res.token_ids == ref
        accepted += res.stats["levels"][-1]["accepted"]
        differs += float_ar.generate(p, 20).token_ids != ref
        assert 1 <= len(h.generate(p, 6, temperature=0.8, seed=1).token_ids) <= 6
    assert accepted > 0
    assert differs > 0          # a target of its own: its greedy output is not the float model's


@pytest.mark.slow
def test_profile_run_an_int4_target_and_refuse_another_precision(family, tmp_path):
    prof_path = tmp_path / "prof.json"
    prof = _profile(family, prof_path, "--target-precision", "int4", "--layers", "2",
                    "--quantized", f"{family['small']}:int4")
    e = {m["name"]: m for m in prof["models"]}
    assert set(e) == {"layer2", "layer4", "small-int4", "lookup"}
    assert e["layer4"]["kind"] == "target" and e["layer4"]["quantization"]["bits"] == 4
    pv = prof["provenance"]
    assert pv["target_precision"] == "int4" and pv["dtype"] == "float32"
    plan_path = tmp_path / "plan.json"
    _plan(prof_path, plan_path, ["small-int4", "layer2", "layer4"], [2, 3])
    row = _run_json(plan_path, tmp_path / "run.jsonl")
    ref = _ar(plan_path)
    assert row["token_ids"] == ref
    # the reference is the int4 target's own loop
    from hsd_opt.prompts import encode_prompt

    big = _load(family["big"])
    t4 = QuantizedLM(big.model, bits=4, kernels=True)
    assert HSD([Level("t", t4, 4)], [], eos_ids=[2]).generate(
        encode_prompt(big.tokenizer, "w1 w2 w3 w1 w2", raw=True), 10).token_ids == ref
    # another target precision is refused, naming the field, on run, bench and serve
    for cmd in (["run", "--prompt", "w1"], ["bench", "--limit", "1"], ["serve", "--port", "0"]):
        r = run_cli(*cmd, "--plan", plan_path, "--target-precision", "float32")
        out = cli_output(r)
        assert r.exit_code == 2 and "provenance.target_precision" in out and "int4" in out, (cmd, out)
        assert "Traceback" not in out
    r = run_cli("run", "--plan", plan_path, "--prompt", "w1", "--target-precision", "int4", "--raw",
                "--max-new-tokens", "2", "--quiet")
    assert r.exit_code == 0, cli_output(r)
    # a float plan refuses an int4 run
    fplan = json.loads(plan_path.read_text())
    fplan["provenance"]["target_precision"] = "float32"
    fplan["hierarchy"], fplan["budgets"] = ["layer4"], []
    (tmp_path / "float.json").write_text(json.dumps(fplan))
    r = run_cli("run", "--plan", tmp_path / "float.json", "--prompt", "w1", "--target-precision", "int4")
    assert r.exit_code == 2 and "provenance.target_precision" in cli_output(r)


@pytest.mark.parametrize("args,needle", [
    (["--target-precision", "int3"], "--target-precision"),
    (["--target-precision", "int4", "--quantized", "int4"], "--quantized int4"),
    (["--target-precision", "bfloat16", "--dtype", "float32"], "disagree"),
    (["--target-precision", "int4", "--heads", "h.safetensors"], "--heads"),
    (["--quantized", "small:int3"], "--quantized"),
    (["--draft-layers", "1"], "--draft-model"),
    (["--draft-model", "./no-such-model", "--draft-layers", "nope"], "--draft-layers: expected 'all', 'none'"),
    (["--layers", "4,x"], "--layers: expected 'all', 'none'"),
    (["--layers", ""], "--layers: empty"),
    (["--layers", ",,"], "--layers: empty"),
    (["--quantized", "./no-such-model:int4"], "--quantized"),
    (["--cost-budget", "soon"], "--cost-budget"),
    (["--cost-budget", "-3"], "--cost-budget")])
def test_bad_family_flags_exit_2(family, tmp_path, args, needle):
    r = run_cli("profile", "--model", family["big"], "--prompts", family["prompts"], "--out", tmp_path / "p.json",
                *FAST, *args)
    out = cli_output(r)
    assert r.exit_code == 2 and needle in out and "Traceback" not in out, out


# ------------------------------------------------------------------------------------------- bench


@pytest.mark.slow
def test_bench_hf_assisted_equals_the_reference(family, tmp_path):
    from hsd_opt.formats import load_plan
    from hsd_opt.measure.bench import run_bench
    from tests.helpers import write_plan

    models = [{"name": "small", "kind": "model", "model": str(family["small"])},
              {"name": "layer2", "kind": "early_exit", "layer": 2},
              {"name": "layer4", "kind": "target", "layer": 4}]
    path = write_plan(tmp_path / "plan.json", family["big"], hierarchy=["small", "layer4"], budgets=[3],
                      models=models)
    plan, loaded = load_plan(path), _load(family["big"])
    prompts = ["w1 w2 w3 w4 w1 w2", "w5 w6 w5 w6 w5", "w9 w3 w7"]
    rep = run_bench(plan, loaded, prompts, 8, raw=True, methods=["hf_ar", "hf_assisted", "ar", "hsd"])
    m = rep["methods"]
    assert m["hf_assisted"]["assistant_model"] == str(family["small"])
    for k in ("hf_ar", "hf_assisted", "hsd"):
        assert m[k]["matches_reference"] is True and m[k]["tokens"] > 0, k
    assert rep["target_precision"] == "float32" and "reference_note" not in rep
    # without a draft model in the plan, hf_assisted is left out of the default methods, or needs --assistant
    bare = write_plan(tmp_path / "bare.json", family["big"])
    rep = run_bench(load_plan(bare), loaded, prompts[:1], 4, raw=True, methods=["hf_assisted", "ar"])
    assert "--assistant" in rep["methods"]["hf_assisted"]["error"]
    rep = run_bench(load_plan(bare), loaded, prompts[:1], 4, raw=True, methods=["hf_assisted", "ar"],
                    assistant=str(family["small"]))
    assert rep["methods"]["hf_assisted"]["matches_reference"] is True
    # a plan made for the int4 target: ar is that copy's loop, the HF methods run the float model (noted)
    d = json.loads(path.read_text())
    d["provenance"]["target_precision"] = "int4"
    (tmp_path / "int4.json").write_text(json.dumps(d))
    rep = run_bench(load_plan(tmp_path / "int4.json"), loaded, prompts, 8, raw=True,
                    methods=["hf_ar", "hf_assisted", "ar", "hsd"])
    assert rep["target_precision"] == "int4" and "float32 model" in rep["reference_note"]
    assert rep["methods"]["hsd"]["matches_reference"] is True


# ------------------------------------------------------------------------------------------- the cost budget


def test_choose_plan_takes_the_most_thorough_plan_that_fits():
    from hsd_opt.profiler.costs import Calibration, choose_plan, cost_plan, estimate_seconds

    big = Calibration(prefill_token=0.03, step=0.35, pass_max=0.7, t_max=16)
    small = Calibration(prefill_token=0.01, step=0.05, pass_max=0.1, t_max=16)
    engines = [(big, 4, False), (small, 1, True), (small, 1, False)]
    ctxs = [64, 512, 2048]
    est = {lv: sum(estimate_seconds(cost_plan(lv, 5, 2, 2), c, ctxs, nb, 15, sh) for c, nb, sh in engines)
           for lv in ("full", "grid", "coarse")}
    assert est["full"] > est["grid"] > est["coarse"] > 2048 * 0.04      # prefills of the two unshared engines
    assert choose_plan(None, engines, ctxs, 15, 5, 2, 2)[0].level == "full"
    assert choose_plan(est["full"] + 1, engines, ctxs, 15, 5, 2, 2)[0].level == "full"
    assert choose_plan(est["full"] - 1, engines, ctxs, 15, 5, 2, 2)[0].level == "grid"
    assert choose_plan(est["grid"] - 1, engines, ctxs, 15, 5, 2, 2) == (cost_plan("coarse", 5, 2, 2),
                                                                        pytest.approx(est["coarse"]))
    assert choose_plan(1.0, engines, ctxs, 15, 5, 2, 2)[0].level == "coarse"    # over even so: the coarsest


def test_refinement_times_directly_where_the_scale_moves():
    from hsd_opt.profiler.costs import refine_sizes

    assert refine_sizes({1: 1.0, 2: 1.01, 4: 1.02, 8: 1.3, 16: 1.31}, 0.05) == [5, 6, 7]
    assert refine_sizes({1: 1.0, 2: 1.5, 4: 1.52}, 0.05) == []           # neighbours: nothing in between
    assert refine_sizes({1: 1.0, 4: 1.0, 8: 1.049}, 0.05) == []
    # within an allowance: the largest change first, as long as its sizes fit (each size costs t seconds here)
    scale = {1: 1.0, 2: 1.0, 4: 1.1, 8: 1.4, 16: 1.4}
    assert refine_sizes(scale, 0.05) == [3, 5, 6, 7]
    assert refine_sizes(scale, 0.05, cost=float, allowance=18.0) == [5, 6, 7]
    assert refine_sizes(scale, 0.05, cost=float, allowance=17.9) == [3]
    assert refine_sizes(scale, 0.05, cost=float, allowance=0.0) == []


@pytest.mark.parametrize("level", ["full", "grid", "coarse"])
def test_cost_plans_bound_the_timing_calls(level):
    """Every plan times what it promises: the progress callback fires ``timing_calls`` times plus at most
    ``refinement_bound`` refinements (announced through ``on_extend``), the engine's passes are bounded by the
    plan's pass count, and every curve still covers t = 1..tmax+1."""
    from hsd_opt.profiler.costs import calibrate, cost_plan, measure_costs, plan_passes
    from tests.helpers import refinement_bound, timing_calls

    eng = LayeredLM(make_tiny_llama(seed=3))
    plan = cost_plan(level, repeats=3, warmup=1, curve_repeats=2)
    calib = calibrate(eng, 7, tokens=8)
    advances = []
    real = eng.advance
    eng.advance = lambda st, b: advances.append(b) or real(st, b)
    steps, extended = [], []
    lcs = measure_costs(eng, [1, 2, 4], tmax=7, contexts=[8, 40], on_step=lambda m, s: steps.append((m, s)),
                        plan=plan, calib=calib, on_extend=lambda n, s: extended.append(n), chunk=16)
    n = timing_calls([8, 40], 3, tmax=7, plan=plan, chunk=16)
    assert len(steps) == n + sum(extended) and sum(extended) <= refinement_bound(plan, 7)
    assert all(s > 0 for _, s in steps)
    passes = plan_passes(plan, [8, 40], 3, 7)
    direct = sum(passes["direct"].values()) + 2 * sum(extended)
    whole = sum(passes["steps"].values()) + direct                      # one advance each (steps, direct)
    segments = 3 * sum(passes["segments"].values())                     # an advance per boundary
    assert len(advances) == -(-40 // 16) + whole + segments
    if level != "full":               # no allowance left over the plan: exactly the promised timings
        steps2 = []
        measure_costs(eng, [1, 2, 4], tmax=7, contexts=[8, 40], on_step=lambda m, s: steps2.append(m), plan=plan,
                      calib=calib, on_extend=lambda n, s: pytest.fail("refined without an allowance"), chunk=16,
                      refine_seconds=0.0)
        assert len(steps2) == n
    timed = lcs[0].check["timed_t"]
    assert timed == (list(range(1, 9)) if level == "full" else sorted({1, 2, 4, 8} | set(timed)))
    for lc in lcs:
        assert len(lc.full) == 8 and lc.full == sorted(lc.full)
        for b in (1, 2, 4):
            assert len(lc.seg[b]) == 8 and all(x > 0 for x in lc.seg[b])


def test_profile_records_its_cost_plan_and_warns_over_the_budget(family, tmp_path):
    r = run_cli("profile", "--model", family["big"], "--prompts", family["prompts"], "--out", tmp_path / "p.json",
                *[a for a in FAST if a != "--quiet"], "--quantized", "none", "--cost-budget", "0.001")
    out = cli_output(r)
    assert r.exit_code == 0, out
    assert "even the coarsest plan is over the budget" in out
    cp = json.loads((tmp_path / "p.json").read_text())["provenance"]["cost_plan"]
    assert cp["level"] == "coarse" and cp["budget_seconds"] == 0.001 and cp["estimated_seconds"] >= 0
    assert set(cp["calibration"]) == {"layer4"}


# ------------------------------------------------------------------------------------------- memory


def _float_tensors(obj, seen=None):
    """Every float32 tensor reachable from ``obj`` through attributes, lists, tuples and dicts, not entering
    ``transformers`` modules (the model itself)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, torch.nn.Module):
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.dtype == torch.float32 else []
    items = []
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") or hasattr(type(obj), "__slots__"):
        items = list(getattr(obj, "__dict__", {}).values())
        items += [getattr(obj, k) for k in getattr(type(obj), "__slots__", ()) if hasattr(obj, k)]
    out = []
    for x in items:
        out += _float_tensors(x, seen)
    return out


def test_engines_hold_no_float_copy_of_the_weights(family):
    """The float engine reads the model's matrices in place and the quantized copies keep no float32 matrix of
    their own (only the model's embeddings and norms, in place); caches and work buffers are small here."""
    big = _load(family["big"])
    params = {p.untyped_storage().data_ptr() for p in big.model.parameters()}
    d = big.model.config.hidden_size
    f, q = LayeredLM(big.model), QuantizedLM(big.model, bits=4)
    assert f.uses_kernels and q.uses_kernels
    for eng in (f, q):
        rotary = {id(t) for t in eng._rope_table or ()}   # positions x head_dim: not a weight
        big_ones = [t for t in _float_tensors(eng) if t.numel() >= d * d and id(t) not in rotary]
        assert big_ones and all(t.untyped_storage().data_ptr() in params for t in big_ones), type(eng).__name__
    mats = [m for lw in f.weights.layers for m in lw.mats()]
    assert all(m.tensors[0].data_ptr() in {p.data_ptr() for p in big.model.parameters()} for m in mats)


def test_released_float_weights_leave_the_copy_working(family):
    small = _load(family["small"])
    target = LayeredLM(_load(family["big"]).model)
    copy = QuantizedLM(small.model, bits=4)
    h = HSD([Level("s4", copy, 2), Level("big", target, 4)], [3], eos_ids=[2])
    before = [h.generate(p, 12).token_ids for p in _prompts(2)]
    n = sum(p.numel() for p in small.model.parameters())
    reader = LayeredLM(small.model)
    with pytest.raises(HsdError, match="float engine"):          # it reads the weights in place: kept
        release_float_weights(small.model)
    del reader
    freed = release_float_weights(small.model)
    assert is_released(small.model) and freed > 0
    assert sum(p.numel() for p in small.model.parameters()) * 4 == n * 4 - freed
    assert small.model.model.embed_tokens.weight.numel() > 0                  # the copy reads it in place
    assert [h.generate(p, 12).token_ids for p in _prompts(2)] == before
    with pytest.raises(HsdError, match="released"):
        LayeredLM(small.model)
    with pytest.raises(HsdError, match="released"):
        QuantizedLM(small.model, bits=8)


def test_the_runtime_loads_each_draft_model_once(family, tmp_path, monkeypatch):
    """Hierarchies of one plan share one load of the draft model, one float engine over it and one int4 copy;
    ``hsd run``'s release frees the float weights of a draft model only its copy uses."""
    import hsd_opt.models.loading as loading
    from hsd_opt.formats import load_plan
    from hsd_opt.runtime.runner import PlanModels, hsd_for_plan
    from tests.helpers import write_plan

    loaded = _load(family["big"])
    loads = []
    real = loading.load_model
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: loads.append(a[0]) or real(*a, **k))
    models = [{"name": "small", "kind": "model", "model": str(family["small"])},
              {"name": "small-int4", "kind": "quantized", "model": str(family["small"]),
               "quantization": {"bits": 4, "group_size": 32, "head_bits": 8}},
              {"name": "layer4", "kind": "target", "layer": 4}]
    path = write_plan(tmp_path / "plan.json", family["big"], hierarchy=["small-int4", "small", "layer4"],
                      budgets=[2, 3], models=models)
    plan = load_plan(path)
    models = PlanModels(loaded)
    a = hsd_for_plan(plan, loaded, models=models)
    b = hsd_for_plan(plan, loaded, hierarchy=["small-int4", "layer4"], budgets=[3], models=models)
    c = hsd_for_plan(plan, loaded, hierarchy=["small", "layer4"], budgets=[3], models=models)
    assert loads == [str(family["small"])]
    assert a.levels[0].engine is b.levels[0].engine and a.levels[1].engine is c.levels[0].engine
    assert a.levels[-1].engine is b.levels[-1].engine is c.levels[-1].engine           # one target engine
    small_model = a.levels[1].engine.model
    assert models.release_unused_floats(plan, [["small", "layer4"]]) == 0     # the float one runs: kept
    assert not is_released(small_model)
    held = a.levels[1].engine                      # a float engine over the small model, alive outside the set
    assert models.release_unused_floats(plan, [["small-int4", "layer4"]]) == 0   # its engine is alive: kept
    assert not is_released(small_model)
    del held, a, c
    # a run of the copy alone (another set of models: its own draft load): the small model's floats go
    fresh = _load(family["big"])
    alone = PlanModels(fresh)
    only = hsd_for_plan(plan, fresh, hierarchy=["small-int4", "layer4"], budgets=[3], models=alone)
    p = _prompts(1)[0]
    want = hsd_for_plan(plan, fresh, hierarchy=["layer4"], budgets=[], models=alone).generate(p, 12).token_ids
    assert alone.release_unused_floats(plan, [["small-int4", "layer4"]]) > 0
    assert is_released(only.levels[0].engine.model) and not is_released(fresh.model)
    assert only.generate(p, 12).token_ids == want
