"""A model read directly for the engines (``hsd_opt.models.direct``) is the model ``from_pretrained`` gives: the
same tensors under the same names (ties included), the same rotary tables and norms bit for bit, and engines over
it compute the same logits; what it does not reproduce exactly it leaves to transformers (None). ``hsd run`` and
``hsd serve`` load through it; a tokenizer class recorded for a converted GGUF directory is the one
``AutoTokenizer`` chose."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hsd_opt.engine import kernels
from hsd_opt.engine.layered import LayeredLM
from hsd_opt.errors import HsdError
from hsd_opt.models.direct import DirectCausalLM, load_direct
from hsd_opt.models.loading import eos_token_ids, load_model, transformers_tokenizer
from tests.helpers import engine_logits, make_tiny_qwen2_family, qwen2_tokenizer, save_tiny

HAVE_KERNELS = kernels.load() is not None


def _qwen(path: Path, tied: bool) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    make_tiny_qwen2_family(seed=3, vocab_size=128, tied=tied).save_pretrained(str(path))
    qwen2_tokenizer().save_pretrained(str(path))
    return path


def _qwen3(path: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(5)
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
            layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    return path


def _mistral(path: Path) -> Path:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(6)
    cfg = MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, sliding_window=64,
                        tie_word_embeddings=False, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    path.mkdir(parents=True, exist_ok=True)
    MistralForCausalLM(cfg).eval().save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("direct")
    return {"llama": save_tiny(root / "llama", seed=2), "qwen2": _qwen(root / "qwen2", tied=True),
            "qwen2-untied": _qwen(root / "qwen2u", tied=False), "qwen3": _qwen3(root / "qwen3"),
            "mistral": _mistral(root / "mistral")}


def _pair(path: Path, dtype=torch.float32):
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    got = load_direct(path, dtype)
    assert isinstance(got, DirectCausalLM)
    return ref, got


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen2-untied", "qwen3", "mistral"])
def test_the_same_tensors_under_the_same_names_as_from_pretrained(dirs, kind):
    ref, got = _pair(dirs[kind])
    want = dict(ref.named_parameters())
    have = dict(got.named_parameters())
    assert set(have) == set(want)
    for name, p in want.items():
        assert have[name].dtype == p.dtype and torch.equal(have[name], p), name
    assert (got.lm_head.weight is got.model.embed_tokens.weight) == \
        (ref.lm_head.weight is ref.model.embed_tokens.weight)
    for attr in ("model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                 "vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(got.config, attr) == getattr(ref.config, attr), attr
    assert (getattr(got.config, "head_dim", None) or 0) in (getattr(ref.config, "head_dim", None) or 0,
                                                             ref.config.hidden_size // ref.config.num_attention_heads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_rotary_tables_and_norms_bit_for_bit(dirs, kind, dtype):
    ref, got = _pair(dirs[kind], dtype)
    pos = torch.arange(0, 5000).unsqueeze(0)
    x = torch.empty(1, dtype=dtype)
    for a, b in zip(ref.model.rotary_emb(x, pos), got.model.rotary_emb(x, pos)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    h = torch.randn(7, ref.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype) * 3
    assert torch.equal(ref.model.norm(h), got.model.norm(h))
    assert torch.equal(ref.model.layers[1].input_layernorm(h), got.model.layers[1].input_layernorm(h))


ON_KERNELS = pytest.mark.skipif(not HAVE_KERNELS, reason="no decode kernels on this machine")


@pytest.mark.parametrize("kind, use_kernels", [
    ("llama", False), pytest.param("llama", True, marks=ON_KERNELS), ("qwen2-untied", False),
    pytest.param("qwen2-untied", True, marks=ON_KERNELS), ("qwen3", False)])   # Qwen3 runs on the torch path
def test_engines_over_it_compute_the_same_logits(dirs, kind, use_kernels):
    ref, got = _pair(dirs[kind])
    ids = torch.randint(4, ref.config.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    a = engine_logits(LayeredLM(ref, kernels=use_kernels), ids, 9)
    b = engine_logits(LayeredLM(got, kernels=use_kernels), ids, 9)
    assert torch.equal(a, b)


def test_its_forward_is_refused_with_a_clear_error(dirs):
    got = load_direct(dirs["llama"], torch.float32)
    with pytest.raises(HsdError, match="decode engines only"):
        got(input_ids=torch.tensor([[1, 2]]))


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_what_it_does_not_reproduce_is_left_to_transformers(dirs, tmp_path):
    src = dirs["llama"]
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert load_direct(_edit_config(src, tmp_path / "rope", rope_parameters=llama3), torch.float32) is None
    assert load_direct(_edit_config(src, tmp_path / "gelu", hidden_act="gelu"), torch.float32) is None
    assert load_direct(_edit_config(src, tmp_path / "noeps", rms_norm_eps=None), torch.float32) is None
    assert load_direct(_edit_config(src, tmp_path / "gpt2", model_type="gpt2"), torch.float32) is None
    # a tied config over a file that holds its own LM head: not what the modules would hold
    assert load_direct(_edit_config(src, tmp_path / "tied", tie_word_embeddings=True), torch.float32) is None
    no_weights = _edit_config(src, tmp_path / "bin")
    (no_weights / "model.safetensors").unlink()
    assert load_direct(no_weights, torch.float32) is None
    # transformers takes rope_scaling over rope_parameters
    linear = {"rope_type": "linear", "factor": 2.0}
    assert load_direct(_edit_config(src, tmp_path / "scaled", rope_scaling=linear), torch.float32) is None
    quant = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    assert load_direct(_edit_config(src, tmp_path / "quant", quantization_config=quant), torch.float32) is None
    # a config whose shapes are not the file's (transformers refuses the checkpoint)
    assert load_direct(_edit_config(src, tmp_path / "kv", num_key_value_heads=4), torch.float32) is None
    assert load_direct(_edit_config(src, tmp_path / "vocab", vocab_size=65), torch.float32) is None
    # a field whose default for the type is not the one filled in here: Qwen3's head_dim (128), its kv heads (32)
    for field in ("head_dim", "num_key_value_heads"):
        assert load_direct(_edit_config(dirs["qwen3"], tmp_path / f"qwen3-{field}", **{field: None}),
                           torch.float32) is None
    assert load_direct(_edit_config(src, tmp_path / "control"), torch.float32) is not None   # the copy itself loads


def test_load_model_reads_directly_for_the_engines_only(dirs):
    fast = load_model(str(dirs["llama"]), device="cpu", dtype="float32", engines_only=True)
    full = load_model(str(dirs["llama"]), device="cpu", dtype="float32")
    assert isinstance(fast.model, DirectCausalLM) and fast.engines_only
    assert not isinstance(full.model, DirectCausalLM) and not full.engines_only
    assert eos_token_ids(fast) == eos_token_ids(full)
    assert fast.model.hsd_weights_key == full.model.hsd_weights_key
    assert fast.model.get_output_embeddings().weight.shape == full.model.get_output_embeddings().weight.shape


def test_a_converted_directory_records_the_tokenizer_class_autotokenizer_chose(dirs, tmp_path):
    import shutil

    import transformers
    from transformers import AutoTokenizer

    d = tmp_path / "converted"
    shutil.copytree(dirs["qwen2"], d)
    (d / "hsd_source.json").write_text(json.dumps({"gguf": "x.gguf", "revision": "sha256:0"}))
    auto = AutoTokenizer.from_pretrained(str(d))
    first = transformers_tokenizer(str(d), "gguf")
    meta = json.loads((d / "hsd_source.json").read_text())
    assert meta["revision"] == "sha256:0" and meta["tokenizer_class"] == type(auto).__name__
    assert meta["tokenizer_transformers"] == transformers.__version__
    second = transformers_tokenizer(str(d), "gguf")                  # made from the recorded class
    text = "<|im_start|>user\nw1 w22, x=3!<|im_end|>\n"
    for tok in (first, second):
        assert type(tok) is type(auto)
        assert tok(text)["input_ids"] == auto(text)["input_ids"]
        assert tok.get_vocab() == auto.get_vocab() and tok.all_special_ids == auto.all_special_ids
        assert tok.apply_chat_template([{"role": "user", "content": "w1 w2"}], add_generation_prompt=True) == \
            auto.apply_chat_template([{"role": "user", "content": "w1 w2"}], add_generation_prompt=True)
    # a recorded name that is no tokenizer class of transformers: asked of AutoTokenizer
    (d / "hsd_source.json").write_text(json.dumps({**meta, "tokenizer_class": "AutoModelForCausalLM"}))
    assert type(transformers_tokenizer(str(d), "gguf")) is type(auto)
    # recorded under another transformers version: asked of AutoTokenizer again, and recorded anew
    (d / "hsd_source.json").write_text(json.dumps({**meta, "tokenizer_class": "NoSuchTokenizer",
                                                   "tokenizer_transformers": "0.0"}))
    assert type(transformers_tokenizer(str(d), "gguf")) is type(auto)
    assert json.loads((d / "hsd_source.json").read_text())["tokenizer_class"] == type(auto).__name__
    # a directory not of ours is never written to
    local = tmp_path / "local"
    shutil.copytree(dirs["qwen2"], local)
    transformers_tokenizer(str(local), "local")
    assert not (local / "hsd_source.json").exists()


def test_the_embedded_model_read_directly_generates_what_transformers_loading_does(embedded):
    from hsd_opt.runtime.runner import PlanModels

    fast = load_model("smollm2-135m", device="cpu", dtype="float32", engines_only=True)
    assert isinstance(fast.model, DirectCausalLM)
    assert type(fast.tokenizer) is type(embedded.tokenizer)
    assert fast.tokenizer.get_vocab() == embedded.tokenizer.get_vocab()
    for a, b in zip(fast.model.parameters(), embedded.model.parameters()):
        assert torch.equal(a, b)
    ids = torch.tensor(embedded.tokenizer.encode("The capital of France is a city that"))
    a = engine_logits(LayeredLM(embedded.model), ids, 5)
    b = engine_logits(LayeredLM(fast.model), ids, 5)
    assert torch.equal(a, b)
    assert PlanModels(fast).loaded.engines_only
