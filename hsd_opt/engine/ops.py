"""Small tensor operations of the torch path (plain functions).

Shapes: hidden ``[m, d]`` for ``m`` positions; heads ``[..., head_dim]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm op for op as ``LlamaRMSNorm.forward`` (float32 statistics, result in ``x``'s dtype), so
    a forward built on it is bit-identical to the Hugging Face modules."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def norm_eps(norm) -> float:
    """The epsilon of a Hugging Face RMSNorm module (``variance_epsilon`` or ``eps``; 1e-6 if it has none)."""
    for attr in ("variance_epsilon", "eps"):
        v = getattr(norm, attr, None)
        if isinstance(v, float):
            return v
    return 1e-6


def causal_mask(start: int, end: int, device: torch.device) -> torch.Tensor:
    """``[end - start, end]`` boolean mask: query position ``start + i`` may attend to key positions
    ``<= start + i`` (new positions over a KV cache that holds positions ``0 .. start - 1``)."""
    return torch.arange(end, device=device).unsqueeze(0) <= torch.arange(start, end, device=device).unsqueeze(1)


def causal_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of new positions ``start .. start+m-1`` over a KV cache that holds ``0 .. start+m-1``.

    ``q`` ``[1, n_heads, m, head_dim]``; ``keys``/``vals`` ``[1, n_kv, start + m, head_dim]`` (grouped-query heads
    shared in order) -> ``[1, n_heads, m, head_dim]``. A single position needs no mask; a pass from position 0
    (a prefill) uses the kernel's own causal mode, which skips the masked blocks (half the work at long prompts)
    and gives the same values as the explicit mask (checked in the tests); a pass over a filled cache uses the
    mask of :func:`causal_mask`."""
    m = q.shape[2]
    gqa = keys.shape[1] != q.shape[1]
    if m == 1 or start == 0:
        return F.scaled_dot_product_attention(q, keys, vals, is_causal=m > 1, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, keys, vals, attn_mask=causal_mask(start, start + m, q.device),
                                          enable_gqa=gqa)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension (the rotary embedding's pairing)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
