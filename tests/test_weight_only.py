"""Quantized copies on the torch path reading their codes with torch's weight-only kernels
(:mod:`hsd_opt.engine.weight_only`), on a CPU (``..._for_cpu`` for int4; the GPU's int4 kernel packs the same codes
two to a byte, measured by ``benchmarks/gpu_scale.py``).

Properties: every matrix of an int8, int4 and int4-head4 copy is read as codes, giving the de-quantized copy's
logits to float32 rounding here; a copy read so drafts for the target without changing its greedy output; a kernel
missing on the device leaves the matrix de-quantized, with the same logits as before.
"""

from __future__ import annotations

import pytest
import torch

from hsd_opt.engine import layered, weight_only
from hsd_opt.engine.layered import LayeredLM
from hsd_opt.engine.quantized import QuantizedLM
from hsd_opt.runtime.decode import HSD, Level
from tests.helpers import make_tiny_llama


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(vocab_size=64, hidden=64)


def _logits(eng, ids):
    st = eng.new_state(len(ids) + 4)
    eng.append(st, ids)
    eng.advance(st, eng.n_layers)
    return eng.logits(st, eng.n_layers, 0, len(ids))


@pytest.mark.parametrize("bits,head_bits", [(8, 8), (4, 8), (4, 4)], ids=["int8", "int4", "int4-head4"])
def test_a_copy_reading_its_codes_computes_the_de_quantized_copy(model, bits, head_bits):
    ref = QuantizedLM(model, bits=bits, head_bits=head_bits, kernels=False)
    codes = QuantizedLM(model, bits=bits, head_bits=head_bits, kernels=False)
    codes.read_codes()
    ids = list(range(3, 24))
    want, got = _logits(ref, ids), _logits(codes, ids)
    packed = codes._torch._packed
    assert len(packed) == 7 * codes.n_layers + 1 and all(p is not None for p in packed.values())
    assert {p.bits for p in packed.values()} == {bits, head_bits}
    assert torch.allclose(got, want, atol=1e-5 * float(want.abs().max()))
    assert not ref._torch._packed                                   # off unless asked for


def test_a_copy_reading_its_codes_drafts_without_changing_the_target_s_output(model, monkeypatch):
    monkeypatch.setattr(layered, "WEIGHT_ONLY", True)               # as HSD_WEIGHT_ONLY=1 asks
    target = LayeredLM(model, kernels=False)
    copy = QuantizedLM(model, bits=4, kernels=False)
    assert copy._torch.weight_only and not target._torch.weight_only   # a float model has no codes to read
    for p in ([3, 9, 4, 17], list(range(5, 19))):
        want = HSD([Level("t", target, 4)], []).generate(p, 30).token_ids
        got = HSD([Level("int4", copy, 4), Level("t", target, 4)], [4]).generate(p, 30)
        assert got.token_ids == want and got.stats["levels"][1]["accepted"] > 0


def test_a_kernel_missing_here_leaves_the_matrix_de_quantized(model, monkeypatch):
    def missing(*args, **kw):
        raise NotImplementedError("no kernel for this device")

    monkeypatch.setattr(torch, "_weight_int8pack_mm", missing)
    ref = QuantizedLM(model, bits=8, kernels=False)
    codes = QuantizedLM(model, bits=8, kernels=False)
    codes.read_codes()
    ids = list(range(3, 15))
    assert torch.equal(_logits(codes, ids), _logits(ref, ids))
    assert set(codes._torch._packed.values()) == {None}


def test_codes_packed_wrongly_are_caught_by_the_check_and_not_used(model, monkeypatch):
    """``pack`` multiplies once against the de-quantized matrix: a form that disagrees (here, its codes' nibbles
    swapped) is refused."""
    mat = QuantizedLM(model, bits=4, kernels=False).weights.layers[0].q
    assert weight_only.pack(mat, torch.float32) is not None
    real = weight_only.q4_codes
    monkeypatch.setattr(weight_only, "q4_codes", lambda m: 15 - real(m))
    assert weight_only.pack(mat, torch.float32) is None
