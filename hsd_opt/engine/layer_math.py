"""A decoder layer's arithmetic on the torch path as pure functions of tensors: called op by op, or compiled once for
every layer (the same shapes, the weights passed in) where an engine's fixed-shape passes are compiled
(:meth:`~hsd_opt.engine.layered.LayeredLM.compile_layers`).

An operand is ``(weight, bias)``: a weight ``[rows, cols]`` in the compute dtype (or a matrix packed for torch's
weight-only kernels, :class:`~hsd_opt.engine.weight_only.Packed`, which holds its own bias) and a bias ``[rows]``
or None. Shapes: hidden ``[m, d]``; queries ``[heads, m, head_dim]``; keys and values ``[kv_heads, m, head_dim]``;
rotary tables ``[1, m, head_dim]``; the attention's output ``[1, heads, m, head_dim]``.
"""

from __future__ import annotations

from typing import Callable, Union

import torch
import torch.nn.functional as F

from hsd_opt.engine import weight_only
from hsd_opt.engine.ops import rms_norm_reference, rotate_half

#: ``(weight or packed matrix, bias or None)``
Operand = tuple[Union[torch.Tensor, weight_only.Packed], Union[torch.Tensor, None]]


def project(h: torch.Tensor, op: Operand) -> torch.Tensor:
    """``h`` ``[m, cols]`` times the operand's weight (plus its bias): ``[m, rows]``."""
    w, b = op
    if isinstance(w, weight_only.Packed):
        return weight_only.linear(h, w)
    return F.linear(h, w, b)


def attention_inputs(x: torch.Tensor, ln1: torch.Tensor, eps1: float, q: Operand, k: Operand, v: Operand,
                     q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, qk_eps: float, cos: torch.Tensor,
                     sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int):
    """The queries, keys and values of hidden ``x``: the input norm, the three projections, the per-head norms
    where the model has them (Qwen3), the rotary embedding."""
    m = x.shape[0]
    h = rms_norm_reference(x, ln1, eps1)
    qs = project(h, q).view(m, heads, head_dim).transpose(0, 1)
    ks = project(h, k).view(m, kv_heads, head_dim).transpose(0, 1)
    vs = project(h, v).view(m, kv_heads, head_dim).transpose(0, 1)
    if q_norm is not None:
        qs = rms_norm_reference(qs, q_norm, qk_eps)
        ks = rms_norm_reference(ks, k_norm, qk_eps)
    return qs * cos + rotate_half(qs) * sin, ks * cos + rotate_half(ks) * sin, vs


def after_attention(x: torch.Tensor, o: torch.Tensor, out: Operand, ln2: torch.Tensor, eps2: float, gate: Operand,
                    up: Operand, down: Operand, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The rest of a layer after the attention's output ``o``: the output projection and its residual, the post-
    attention norm, the gated MLP and its residual."""
    m = x.shape[0]
    x = x + project(o[0].transpose(0, 1).reshape(m, -1), out)
    h = rms_norm_reference(x, ln2, eps2)
    return x + project(act(project(h, gate)) * project(h, up), down)
