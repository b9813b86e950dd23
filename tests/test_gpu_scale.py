"""`benchmarks/gpu_scale.py`'s dry run on the CPU: a model built from a configuration with random weights, our
engine timed against the floor and HF `generate`, with the greedy tokens of both equal (the device run is the same
command with a real configuration on CUDA)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu_scale
from hsd_opt.errors import HsdError


@pytest.mark.slow
def test_the_dry_run_times_every_figure_and_our_tokens_equal_hf_generate(tmp_path):
    out = tmp_path / "gpu_scale.json"
    rep = gpu_scale.main(["--config", "tiny", "--device", "cpu", "--dtype", "float32", "--t", "1,2,4",
                          "--batches", "1,3", "--new", "12", "--repeats", "2", "--copy-mb", "16", "--no-compile",
                          "--no-triton", "--out", str(out)])
    assert json.loads(out.read_text())["config"] == "tiny"
    assert rep["hf_eager_equal"] is True and rep["ours_tokens"] == 12
    assert set(rep["pass_ms"]) == {1, 2, 4} and set(rep["batch_ms"]) == {1, 3}
    assert rep["step_ms"] > 0 and rep["read_bytes"] == rep["weight_bytes"] > 0
    assert rep["floor_ms"] == pytest.approx(rep["read_bytes"] / (rep["bandwidth_gb_s"] * 1e9) * 1e3)
    assert list(rep["section_seconds"])[:3] == ["engine", "generations", "exactness"]    # the headline figures first
    assert set(rep["ops_ms"]) == {1, 2, 4} and rep["graph_ms"] == "CUDA graphs need a CUDA device"
    rp = rep["replayed"]                    # the engine replaying its passes (on a CPU: called again)
    assert set(rp["pass_ms"]) == {1, 2, 4} and set(rp["batch_ms"]) == {1, 3} and rp["step_ms"] > 0
    assert rep["ours_replayed_equal"] is True and rep["ours_replayed_hsd_equal"] is True
    assert rep["fixed_shapes"] is False                     # a CPU engine on the kernels; CUDA's fixes them
    for name in ("fixed", "replayed", "compiled"):   # a verify pass is its steps, a batch's step each one's own
        ex = rep["exactness"][name]
        assert ex["pass_equal_steps"] and ex["batch_equal_alone"] and ex["pass_max_difference"] == 0, (name, ex)
    assert rep["exactness"]["replayed_equal_fixed"] is True
    kern = rep["kernels"]                   # a step's operators by kind (on a CPU), each layer's products among them
    assert kern["matmul"]["count"] >= 7 * 4 and kern["other"]["count"] > 0 and kern["matmul"]["ms"] > 0
    many = rep["kernels_batch"]             # 3 sequences' step: the same products, each sequence's own attention
    assert many["batch"] == 3 and many["matmul"]["count"] == kern["matmul"]["count"]
    assert many["attention"]["count"] == 3 * kern["attention"]["count"] and "kernels_batch_triton" not in rep
    assert rep["compiled"]["step_ms"] > 0 and set(rep["compiled"]["batch_ms"]) == {1, 3}
    own = rep["own_shapes"]
    assert set(own["pass_ms"]) == {1, 2, 4} and set(own["batch_ms"]) == {1, 3} and own["step_ms"] > 0
    for kind in ("int8", "int4"):            # each copy de-quantized and reading its codes, every matrix packed
        dq, codes = rep["copies"][kind]["dequantized"], rep["copies"][kind]["codes"]
        assert dq["1_ms"] > 0 and codes["4_ms"] > 0 and codes["packed"] == codes["matrices"] == 4 * 7 + 1
    mm = rep["matmul"]
    for kind, bits in (("float32", 32), ("int8", 8), ("int4", 4)):
        e = mm[kind]                        # every kernel ran, read about its bits per weight, and agreed
        assert e["ms"] > 0 and e["max_error"] <= 0.01 * e["max_value"], (kind, e)
        assert bits / 8 <= e["bytes"] / sum(n * k for n, k in mm["shapes"]) <= bits / 8 + 0.125  # + scales


@pytest.mark.slow
def test_the_triton_attention_s_figures_and_exactness():
    """The figures with the attention in Triton kernels (on a CPU, its interpreter: slow, so apart from the dry
    run above): a step, passes and batches timed, and a verify pass its steps, a batch each one alone, bit for bit,
    op by op and replayed."""
    pytest.importorskip("triton")
    model = gpu_scale.build(gpu_scale.config_of("tiny"), "cpu", torch.bfloat16, 1.0)
    figs = gpu_scale.engine_figures(model, "cpu", 16, [1, 3], [1, 3], 1, triton=True)
    assert figs["step_ms"] > 0 and set(figs["pass_ms"]) == {1, 3} and set(figs["batch_ms"]) == {1, 3}
    ex = gpu_scale.exactness(model, 16, t=3, batch=3)
    for name in ("triton", "triton_replayed"):
        assert ex[name]["pass_equal_steps"] and ex[name]["batch_equal_alone"], (name, ex[name])
    assert "triton" not in gpu_scale.exactness(model, 16, t=2, batch=2, triton=False)
    plain, tri = (gpu_scale.kernel_figures(model, 16, steps=1, batch=3, triton=t) for t in (False, True))
    assert tri["triton_attention"] and not plain["triton_attention"]
    assert tri["attention"]["count"] == 0 < plain["attention"]["count"]     # on a CPU Triton's are no operators
    assert sum(tri[k]["count"] for k in ("matmul", "other")) < sum(plain[k]["count"] for k in ("matmul", "other"))


def test_every_timed_hf_generate_follows_one_of_its_own_length():
    """A static cache is sized by ``max_new_tokens``: a compiled ``generate`` first timed at a new length timed the
    compiler (0.5 tok/s for what runs at hundreds). Each timed call is the second of its length."""
    from types import SimpleNamespace

    calls = []

    def generate(ids, max_new_tokens, **kw):
        calls.append(max_new_tokens)
        return torch.cat([ids, torch.full((1, max_new_tokens), 5)], 1)

    model = SimpleNamespace(generate=generate, generation_config=SimpleNamespace(), forward=lambda *a: None)
    for compiled in (False, True):
        calls.clear()
        rep = gpu_scale.hf_generations(model, "cpu", [1, 2, 3], 6, [5] * 6, compiled=compiled)
        assert calls == [1, 1, 6, 6], (compiled, calls)
        assert rep["hf_compiled_equal" if compiled else "hf_eager_equal"] is True


def test_a_pass_s_operations_called_directly_are_the_engine_s_pass():
    """What ``graph_ms`` captures (the torch path's operations with static inputs) computes the greedy tokens the
    engine's own pass computes over the same positions."""
    import torch

    from hsd_opt.engine.layered import LayeredLM

    eng = LayeredLM(gpu_scale.build(gpu_scale.config_of("tiny"), "cpu", torch.float32, 8.0), kernels=False)
    st = eng.new_state(40)
    eng.append(st, torch.arange(3, 23))
    eng.advance(st, eng.n_layers)
    got = gpu_scale.pass_ops(eng, st, 20, 3, seed=7)()
    ids = torch.randint(3, eng.vocab_size, (3,), generator=torch.Generator().manual_seed(7))
    eng.append(st, ids)
    eng.advance(st, eng.n_layers)
    assert torch.equal(got, eng.logits(st, eng.n_layers, 20, 23).argmax(-1))


def test_the_shipped_configurations_are_the_models_they_name():
    seven = gpu_scale.config_of("layerskip-llama2-7b")
    assert (seven["hidden_size"], seven["intermediate_size"], seven["num_hidden_layers"]) == (4096, 11008, 32)
    one = gpu_scale.config_of("tinyllama-1.1b")
    assert (one["hidden_size"], one["num_hidden_layers"], one["num_key_value_heads"]) == (2048, 22, 4)
    with pytest.raises(HsdError, match="no configuration"):
        gpu_scale.config_of("no-such-model")
