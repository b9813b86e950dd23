"""Quantized copies stored on disk: read back instead of quantized again, the same copy bit for bit, keyed by the
weights and the setting, damaged or stale files replaced, nothing stored for a model without a weights key."""

from __future__ import annotations

import pytest
import torch

from hsd_opt.engine import kernels, stored_copies
from hsd_opt.engine.quantized import QuantizedLM
from tests.helpers import make_tiny_llama

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="no C compiler here: the kernels cannot be built")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HSD_CACHE", str(tmp_path))
    return tmp_path / "quantized"


def _logits(eng) -> torch.Tensor:
    st = eng.new_state(12)
    eng.append(st, torch.arange(3, 13))
    eng.advance(st, eng.n_layers)
    return eng.logits(st, eng.n_layers, 0, 10)


def test_a_stored_copy_is_read_back_instead_of_quantized_again(cache, monkeypatch):
    model = make_tiny_llama(seed=5)
    model.hsd_weights_key = "gguf|sha256:abc|float32"
    first = QuantizedLM(model, bits=4, kernels=True)
    files = sorted(cache.glob("*.pt"))
    assert len(files) == 1 and "-int4-head8-" in files[0].name
    monkeypatch.setattr(kernels, "quantize", lambda *a, **k: pytest.fail("quantized again"))
    again = QuantizedLM(model, bits=4, kernels=True)
    assert torch.equal(_logits(first), _logits(again))
    assert all(torch.equal(a, b) for x, y in zip(first._kstack.layers, again._kstack.layers)
               for m, n in zip(x.mats, y.mats) for a, b in zip(m.tensors, n.tensors))


def test_settings_and_weights_have_their_own_files(cache):
    model = make_tiny_llama(seed=5)
    model.hsd_weights_key = "gguf|sha256:abc|float32"
    QuantizedLM(model, bits=4, kernels=True)
    QuantizedLM(model, bits=8, kernels=True)
    other = make_tiny_llama(seed=6)
    other.hsd_weights_key = "gguf|sha256:def|float32"
    QuantizedLM(other, bits=4, kernels=True)
    assert len(list(cache.glob("*.pt"))) == 3


def test_damaged_and_mismatched_files_are_replaced(cache, monkeypatch):
    model = make_tiny_llama(seed=5)
    model.hsd_weights_key = "gguf|sha256:abc|float32"
    want = _logits(QuantizedLM(model, bits=4, kernels=True))
    path = next(cache.glob("*.pt"))
    path.write_bytes(path.read_bytes()[:100])                          # truncated
    assert torch.equal(_logits(QuantizedLM(model, bits=4, kernels=True)), want)
    data = torch.load(path, weights_only=True)                         # rewritten whole
    data["lm_head"] = [data["lm_head"][0][:3], data["lm_head"][1][:3]]   # a head of the wrong shape
    torch.save(data, path)
    assert torch.equal(_logits(QuantizedLM(model, bits=4, kernels=True)), want)
    assert torch.load(path, weights_only=True)["lm_head"][0].shape[0] == model.lm_head.weight.shape[0]


def test_a_stale_quantizer_version_is_removed_when_the_copy_is_stored_again(cache, monkeypatch):
    model = make_tiny_llama(seed=5)
    model.hsd_weights_key = "gguf|sha256:abc|float32"
    QuantizedLM(model, bits=4, kernels=True)
    old = next(cache.glob("*.pt"))
    monkeypatch.setattr(stored_copies, "FORMAT", stored_copies.FORMAT + 1)
    QuantizedLM(model, bits=4, kernels=True)
    names = [p.name for p in cache.glob("*.pt")]
    assert len(names) == 1 and names[0] != old.name


def test_a_model_changed_after_loading_does_not_get_the_copy_of_its_old_weights(cache):
    model = make_tiny_llama(seed=5)
    model.hsd_weights_key = "gguf|sha256:abc|float32"
    QuantizedLM(model, bits=4, kernels=True)
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1.0
    QuantizedLM(model, bits=4, kernels=True)
    assert len(list(cache.glob("*.pt"))) == 2


def test_nothing_is_stored_for_a_model_without_a_weights_key(cache):
    QuantizedLM(make_tiny_llama(seed=5), bits=4, kernels=True)
    assert not cache.exists() or not list(cache.glob("*"))


@pytest.mark.embedded
def test_a_loaded_model_names_its_weights():
    from hsd_opt.models.loading import load_model

    loaded = load_model("smollm2-135m", device="cpu", dtype="float32")
    assert loaded.model.hsd_weights_key == f"embedded|{loaded.revision}|float32"
    assert loaded.revision.startswith("sha256:")
