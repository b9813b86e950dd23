"""Quantized copies stored on disk: read back instead of quantized again, the same copy bit for bit, keyed by the
weights and the setting, damaged or stale files replaced, nothing stored for a model without a weights key. And
in memory: two copies of one model at the same bits share their layers' matrices, never a changed weight's."""

from __future__ import annotations

import gc

import pytest
import torch

from hsd_opt.engine import kernels, stored_copies
from hsd_opt.engine import weights as wq
from hsd_opt.engine.quantized import QuantizedLM
from tests.helpers import make_tiny_llama

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="no C compiler here: the kernels cannot be built")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory; copies are not shared in memory, so each one is read from disk or quantized."""
    monkeypatch.setenv("HSD_CACHE", str(tmp_path))
    monkeypatch.setattr(stored_copies, "_remember", lambda *a: None)
    return tmp_path / "quantized"


@pytest.fixture
def no_disk(tmp_path, monkeypatch):
    """No stored copies (an empty cache, a model without a weights key): what is shared is shared in memory."""
    monkeypatch.setenv("HSD_CACHE", str(tmp_path))
    monkeypatch.setattr(stored_copies, "_IN_MEMORY", {})


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
    monkeypatch.setattr(wq, "quantize", lambda *a, **k: pytest.fail("quantized again"))
    again = QuantizedLM(model, bits=4, kernels=True)
    assert torch.equal(_logits(first), _logits(again))
    assert all(torch.equal(a, b) for x, y in zip(first.weights.layers, again.weights.layers)
               for m, n in zip(x.mats(), y.mats()) for a, b in zip(m.tensors, n.tensors))


def test_a_copy_read_back_holds_its_matrices_in_memory_not_in_the_file(cache):
    """The file is mapped, not read whole; what a copy takes from it is copied out, so the copy does not change
    (or fault) when the file is later rewritten in place."""
    model = make_tiny_llama(seed=5)
    model.hsd_weights_key = "gguf|sha256:abc|float32"
    want = _logits(QuantizedLM(model, bits=4, kernels=True))
    again = QuantizedLM(model, bits=4, kernels=True)
    path = next(cache.glob("*.pt"))
    with open(path, "r+b") as f:                                       # zeros over the file, in place
        f.write(bytes(path.stat().st_size))
    assert torch.equal(_logits(again), want)


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


def test_a_copy_changed_in_place_on_disk_is_quantized_again_not_used(cache):
    """Bytes of a stored matrix flipped in place (same size: the file reads and its shapes fit): the checksum
    refuses it, said once, the copy is quantized again (the same logits as a fresh one) and stored anew (it was
    used as it was: an int4 target became another model)."""
    model = make_tiny_llama(seed=5)
    model.hsd_weights_key = "gguf|sha256:abc|float32"
    want = _logits(QuantizedLM(model, bits=4, kernels=True))
    path = next(cache.glob("*.pt"))
    codes = torch.load(path, weights_only=True)["layers.0.q"][0]
    raw = bytearray(path.read_bytes())
    for name in ("layers.0.q", "layers.1.down"):                        # two matrices' codes in the archive
        at = raw.find(torch.load(path, weights_only=True)[name][0].contiguous().numpy().tobytes()[:64])
        assert at > 0
        raw[at:at + 16] = bytes(b ^ 0xFF for b in raw[at:at + 16])
    path.write_bytes(bytes(raw))
    with pytest.warns(UserWarning, match="changed on disk") as said:
        assert torch.equal(_logits(QuantizedLM(model, bits=4, kernels=True)), want)
    assert len(said) == 1
    assert torch.equal(torch.load(path, weights_only=True)["layers.0.q"][0], codes)     # stored anew
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(_logits(QuantizedLM(model, bits=4, kernels=True)), want)


def test_a_stale_quantizer_version_is_removed_when_the_copy_is_stored_again(cache, monkeypatch):
    model = make_tiny_llama(seed=5)
    model.hsd_weights_key = "gguf|sha256:abc|float32"
    QuantizedLM(model, bits=4, kernels=True)
    old = next(cache.glob("*.pt"))
    monkeypatch.setattr(stored_copies, "FORMAT", stored_copies.FORMAT + 1)
    QuantizedLM(model, bits=4, kernels=True)
    names = [p.name for p in cache.glob("*.pt")]
    assert len(names) == 1 and names[0] != old.name


def test_a_copy_a_killed_process_left_half_written_is_removed_when_one_is_stored(cache, monkeypatch):
    """A copy streamed to disk by a process killed outright (SIGKILL, out of memory) stays as a hidden ``.partial``
    of up to a few GB: removed once an hour old when the next copy of that model is stored; a fresh one (another
    process writing it now) kept."""
    import os
    import time

    from hsd_opt.jsonio import STALE_SECONDS

    model = make_tiny_llama(seed=5)
    model.hsd_weights_key = "gguf|sha256:abc|float32"
    QuantizedLM(model, bits=4, kernels=True)
    name = next(cache.glob("*.pt")).name
    dead, live = cache / f".{name}.dead.partial", cache / f".{name}.live.partial"
    for p in (dead, live):
        p.write_bytes(b"half a copy")
    old = time.time() - 2 * STALE_SECONDS
    os.utime(dead, (old, old))
    monkeypatch.setattr(stored_copies, "FORMAT", stored_copies.FORMAT + 1)   # stored again under a new name
    QuantizedLM(model, bits=4, kernels=True)
    assert not dead.exists() and live.exists()


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


def _layer_tensors(eng) -> list[torch.Tensor]:
    return [t for lw in eng.weights.layers for m in lw.mats() for t in m.tensors]


def test_copies_at_the_same_bits_share_their_layers_and_compute_as_if_alone(no_disk, monkeypatch):
    model = make_tiny_llama(seed=5)
    plain = QuantizedLM(model, bits=4, head_bits=8, kernels=True)
    head4 = QuantizedLM(model, bits=4, head_bits=4, kernels=True)
    assert all(a is b for a, b in zip(_layer_tensors(plain), _layer_tensors(head4)))
    assert head4.weights.head.kind == wq.Q4 and plain.weights.head.kind == wq.Q8
    int8 = QuantizedLM(model, bits=8, kernels=True)                     # other bits: its own matrices
    assert not {t.data_ptr() for t in _layer_tensors(int8)} & {t.data_ptr() for t in _layer_tensors(plain)}
    monkeypatch.setattr(stored_copies, "_made", lambda *a: None)
    alone = QuantizedLM(model, bits=4, head_bits=4, kernels=True)
    assert not any(a is b for a, b in zip(_layer_tensors(alone), _layer_tensors(head4)))
    assert torch.equal(_logits(alone), _logits(head4))


def test_copies_share_their_layers_across_the_weights_moving_into_memory(no_disk):
    """A model loaded for the engines alone has its matrices moved into memory of their own when a float engine is
    built over it, values unchanged: a copy made before that is still the one a later copy shares."""
    from hsd_opt.models.memory import resident_weights

    model = make_tiny_llama(seed=5)
    q = model.model.layers[0].self_attn.q_proj.weight
    before = QuantizedLM(model, bits=4, head_bits=8, kernels=True)
    at = q.data_ptr()
    assert resident_weights(model) > 0 and q.data_ptr() != at
    after = QuantizedLM(model, bits=4, head_bits=4, kernels=True)
    assert all(a is b for a, b in zip(_layer_tensors(before), _layer_tensors(after)))


def test_a_weight_changed_in_place_is_quantized_again(no_disk):
    model = make_tiny_llama(seed=5)
    first = QuantizedLM(model, bits=4, kernels=True)
    q = model.model.layers[0].self_attn.q_proj.weight
    q.data[-1] += 1.0                                  # through .data: no version bump, only the values tell
    second = QuantizedLM(model, bits=4, kernels=True)
    shared = [a is b for a, b in zip(_layer_tensors(first), _layer_tensors(second))]
    assert not any(shared[:3]) and all(shared[3:])    # layer 0's q matrix (codes, scales, minima) made again
    assert torch.equal(second.weights.layers[0].q.dequantized(), wq.quantize(q, 4, None).dequantized())


def test_nothing_is_kept_once_no_engine_uses_a_matrix(no_disk, monkeypatch):
    model = make_tiny_llama(seed=5)
    eng = QuantizedLM(model, bits=4, kernels=True)
    del eng
    gc.collect()
    made = []
    real = wq.quantize
    monkeypatch.setattr(wq, "quantize", lambda *a, **k: made.append(1) or real(*a, **k))
    QuantizedLM(model, bits=4, kernels=True)
    assert len(made) == 7 * model.config.num_hidden_layers + 1


def test_the_embedded_models_forms_made_by_the_kernels_are_those_torch_makes(embedded):
    """On the embedded SmolLM2 (every projection Q4_1's, the head Q8_0's): every form the kernels make is, byte for
    byte, the one the torch path makes from the model's int4 copy, and the head's the one exact_int8 makes. (Here,
    not among the kernel tests each variant runs before the model is installed.)"""
    lib = kernels.load()
    if lib is None or not lib.hsd_simd():
        pytest.skip("no kernels, or the portable variant (it reads float32 weights)")
    weights = wq.model_weights(embedded.model)
    by_kernels = stored_copies.exact_int4_layers(embedded.model, weights, lib)
    by_torch = stored_copies.exact_int4_layers(embedded.model, weights)
    assert sum(len(d) for d in by_kernels) == 7 * len(weights.layers)
    for a, b in zip(by_kernels, by_torch):
        assert a.keys() == b.keys()
        for name in a:
            assert all(torch.equal(x, y) for x, y in zip(a[name].tensors, b[name].tensors))
    got, want = kernels.exact_q8f(lib, weights.head), wq.exact_int8(weights.head)
    assert all(torch.equal(x, y) for x, y in zip(got.tensors, want.tensors))
