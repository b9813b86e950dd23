"""Quantized projections on the torch path read as codes by torch's weight-only kernels, not de-quantized.

On the torch path (a GPU; a CPU without a C compiler) a quantized copy's matrices are otherwise de-quantized once
into the compute dtype (:meth:`~hsd_opt.engine.weights.Mat.dense`), so a step reads as many bytes as the model
in that dtype and costs what it costs: the copy can never pay there. torch ships weight-only kernels that read
the codes themselves: ``_weight_int8pack_mm`` (int8 codes, one scale per output row: an ``int8`` copy's form) and
``_weight_int4pack_mm`` (int4 codes in groups of columns with a scale and a zero per group, ``w = (code - 8) *
scale + zero``: an ``int4`` copy's form, ``zero = minimum + 8 * scale``; on a CPU ``..._for_cpu``). Their scales
are kept in the activations' dtype (bfloat16 on a GPU), so a weight may differ from the copy's by that rounding
(a few parts in a thousand): a copy read so is a drafter of its own, its agreement measured as it runs.

:func:`pack` makes a matrix's packed form (None where the kernels take no such shape or are missing on this
device and torch version, then the matrix is de-quantized as before); :func:`linear` multiplies by it. Whether an
engine reads its copies so is :data:`~hsd_opt.engine.layered.WEIGHT_ONLY` (off unless set; ``HSD_WEIGHT_ONLY=1``).
Shapes: ``x`` ``[m, cols]`` -> ``[m, rows]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hsd_opt.engine.weights import GROUP, Q4, Q8, Mat, q4_codes, q4_factors


@dataclass
class Packed:
    """A matrix in a weight-only kernel's form: ``bits`` 8 (``codes`` int8 ``[rows, cols]``, ``scales``
    ``[rows]``) or 4 (``codes`` as the int4 kernel packs them, ``scales`` ``[cols / 32, rows, 2]``: scale and
    zero per group); ``dtype`` the activations' (and scales') dtype."""

    bits: int
    codes: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype
    bias: torch.Tensor | None


def _inner_k_tiles(cols: int) -> int | None:
    """The int4 kernel's tiling of ``cols`` input columns (8, 4 or 2 tiles of 16 columns), or None."""
    return next((t for t in (8, 4, 2) if cols % (t * 16) == 0), None)


def pack(mat: Mat, dtype: torch.dtype) -> Packed | None:
    """``mat`` (an int8 or int4 copy's matrix) in its weight-only kernel's form for activations in ``dtype``, checked
    by one product against the de-quantized matrix; None where no kernel takes it here."""
    dev = mat.tensors[0].device
    bias = None if mat.bias is None else mat.bias.to(dtype)
    try:
        if mat.kind == Q8:
            p = Packed(8, mat.tensors[0].contiguous(), mat.tensors[1].to(dtype).contiguous(), dtype, bias)
        elif mat.kind == Q4 and (tiles := _inner_k_tiles(mat.cols)) is not None:
            codes = q4_codes(mat).reshape(mat.rows, mat.cols).to(torch.int32)
            scale, minimum = (t.float() for t in q4_factors(mat))                   # [rows, groups]
            sz = torch.stack([scale, minimum + 8 * scale], -1).transpose(0, 1).contiguous()
            act = dtype if dev.type == "cpu" else torch.bfloat16                     # the GPU kernel's only one
            if dev.type == "cpu":
                packed = torch._convert_weight_to_int4pack_for_cpu(codes, tiles)
            else:          # two codes per byte, the first in the high nibble
                packed = torch._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8),
                                                           tiles)
            p = Packed(4, packed, sz.to(act), act, bias)
        else:
            return None
        x = torch.randn(2, mat.cols, generator=torch.Generator().manual_seed(0)).to(device=dev, dtype=dtype)
        want = x.float() @ mat.dense(torch.float32).t()
        got = linear(x, p).float() - (0 if bias is None else bias.float())
        if not torch.allclose(got, want, rtol=0.02, atol=0.02 * float(want.abs().max())):
            return None
        return p
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def linear(x: torch.Tensor, p: Packed) -> torch.Tensor:
    """``x`` ``[m, cols]`` times the packed matrix (plus its bias), in ``x``'s dtype."""
    if p.bits == 8:
        y = torch._weight_int8pack_mm(x.to(p.dtype), p.codes, p.scales)
    elif p.codes.device.type == "cpu":
        y = torch._weight_int4pack_mm_for_cpu(x.to(p.dtype), p.codes, GROUP, p.scales)
    else:
        y = torch._weight_int4pack_mm(x.to(p.dtype), p.codes, GROUP, p.scales)
    y = y.to(x.dtype)
    return y if p.bias is None else y + p.bias
