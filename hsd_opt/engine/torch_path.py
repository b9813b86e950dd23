"""The plain torch backend: a run of decoder layers and the LM head as the Hugging Face modules compute them.

The same tensor operations in the same order as the modules (RMSNorm in float32 statistics, ``F.linear``, the
rotary embedding by ``rotate_half``, ``scaled_dot_product_attention`` over the cache), called directly on the
weights of a :class:`~hsd_opt.engine.weights.ModelWeights` in the engine's compute dtype. Over a float model's own
weights in its own dtype that is bit for bit the modules' output (tested against ``generate``); it runs on any
device (CUDA; CPUs where the C kernels cannot be built) and is the reference the kernels are tested against.

Weights enter through :meth:`~hsd_opt.engine.weights.Mat.dense`: a float weight in the compute dtype is used in
place; one in another dtype is converted for each pass (a bfloat16 model's long passes in float32: its memory
stays half); a quantized matrix is de-quantized once and kept (de-quantizing for every pass would cost more than
the pass), or read as codes by torch's weight-only kernels where :attr:`TorchPath.weight_only` is set. Shapes:
hidden ``[m, d]`` for ``m`` positions; caches ``[1, n_kv, max_len, head_dim]``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from hsd_opt.engine import fixed, layer_math, triton_attention, weight_only
from hsd_opt.engine.ops import causal_attention, rms_norm_reference
from hsd_opt.engine.state import DecodeState, Rows
from hsd_opt.engine.weights import Mat, ModelWeights


class TorchPath:
    """Decoder layers and the head of ``weights`` with torch operations in ``dtype`` (activations and caches).

    Args:
        weights: the model's weights (float in place, or quantized).
        dtype: the compute dtype (the caches' too).
        n_heads, n_kv, head_dim: attention shapes.
    """

    def __init__(self, weights: ModelWeights, dtype: torch.dtype, n_heads: int, n_kv: int, head_dim: int):
        self.weights, self.dtype = weights, dtype
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self._kept: dict[int, torch.Tensor] = {}     # id(quantized Mat) -> its de-quantized weight
        #: read quantized matrices as codes with torch's weight-only kernels (:mod:`hsd_opt.engine.weight_only`)
        self.weight_only = False
        self._packed: dict[int, weight_only.Packed | None] = {}    # id(quantized Mat) -> its packed form, or None
        self._norms = [(lw.ln1.to(dtype), lw.ln2.to(dtype)) for lw in weights.layers]
        self._final_norm = weights.norm.to(dtype)
        #: the compiled forms of the layers' arithmetic for fixed-shape passes (:meth:`compile_layers`), or None
        self._compiled: tuple[Callable, Callable] | None = None
        #: compute the attention of fixed-shape passes in Triton kernels (:mod:`hsd_opt.engine.triton_attention`)
        self.triton_attention = False

    def _w(self, mat: Mat) -> torch.Tensor:
        if not mat.quantized:
            return mat.dense(self.dtype)
        t = self._kept.get(id(mat))
        if t is None:
            t = self._kept[id(mat)] = mat.dense(self.dtype)
        return t

    def _operand(self, mat: Mat) -> layer_math.Operand:
        """``mat`` as :mod:`~hsd_opt.engine.layer_math` multiplies it: packed for torch's weight-only kernels where
        :attr:`weight_only` is set and a kernel takes it, else its weight in the compute dtype and its bias."""
        if mat.quantized and self.weight_only:
            if id(mat) not in self._packed:
                self._packed[id(mat)] = weight_only.pack(mat, self.dtype)
            packed = self._packed[id(mat)]
            if packed is not None:
                return packed, None
        return self._w(mat), None if mat.bias is None else mat.bias.to(self.dtype)

    def _linear(self, x: torch.Tensor, mat: Mat) -> torch.Tensor:
        return layer_math.project(x, self._operand(mat))

    def compile_layers(self) -> bool:
        """Compile the layers' arithmetic of the fixed-shape passes (:meth:`fixed_layers`) with ``torch.compile``,
        once for every layer (the weights are its arguments): their small kernels (norms, rotary, activations,
        residuals) fused. Refused (False) where the layers' activations differ (a compile per layer) or quantized
        matrices are read as codes (:attr:`weight_only`)."""
        acts = {id(w.act) for w in self.weights.layers}
        if len(acts) != 1 or self.weight_only:
            return False
        self._compiled = (torch.compile(layer_math.attention_inputs, dynamic=False),
                          torch.compile(layer_math.after_attention, dynamic=False))
        return True

    @property
    def compiled(self) -> bool:
        """True when the fixed-shape passes run compiled (:meth:`compile_layers`)."""
        return self._compiled is not None

    def layer(self, l: int, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
              cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Decoder layer ``l`` on hidden ``x`` ``[m, d]`` at positions ``start .. start+m-1``: writes their keys and
        values into the layer's caches; ``cos``/``sin`` ``[1, m, head_dim]``."""
        q, k, v = self._qkv(l, x, cos, sin)
        end = start + x.shape[0]
        k_cache[0, :, start:end] = k
        v_cache[0, :, start:end] = v
        return self._after_attention(l, x, causal_attention(q.unsqueeze(0), k_cache[:, :, :end],
                                                             v_cache[:, :, :end], start))

    def fixed_layers(self, l0: int, l1: int, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, parts: Sequence[fixed.Part],
                     tables: triton_attention.Tables | None = None) -> torch.Tensor:
        """Layers ``l0 .. l1-1`` of a fixed-shape pass (:mod:`hsd_opt.engine.fixed`): hidden ``x`` ``[ROWS, d]`` at
        positions ``pos`` ``[ROWS]`` with rotary tables ``cos``/``sin`` ``[1, ROWS, head_dim]``; each part writes
        its rows' keys and values into its caches and gives its rows' attention over them (op by op; or where
        :attr:`triton_attention` is set, in Triton kernels for all the pass's sequences at once, as ``tables`` say:
        :func:`~hsd_opt.engine.triton_attention.of_rows`, ``parts`` unused). Every operation sees the same shapes
        whatever the pass holds, so each real row gets what it gets in any other pass."""
        x = x.to(self.dtype)
        pre, post = self._compiled or (layer_math.attention_inputs, layer_math.after_attention)
        if self.triton_attention:
            if tables is None:
                raise ValueError("a fixed-shape pass with the Triton attention needs its tables")
            for i, l in enumerate(range(l0, l1)):
                q, k, v = self._qkv(l, x, cos, sin, pre)
                x = self._after_attention(l, x, triton_attention.attention(q, k, v, tables, i), post)
            return x
        gqa = self.n_kv != self.n_heads
        mask = fixed.masks(pos, parts)
        for i, l in enumerate(range(l0, l1)):
            q, k, v = self._qkv(l, x, cos, sin, pre)
            q = q.unsqueeze(0)
            o: torch.Tensor | None = None
            for p in parts:
                kc, vc = p.k[i], p.v[i]
                kc[0].index_copy_(1, p.dst, k.index_select(1, p.src))
                vc[0].index_copy_(1, p.dst, v.index_select(1, p.src))
                for n, rows in p.groups:
                    og = F.scaled_dot_product_attention(q, kc[:, :, :n], vc[:, :, :n], attn_mask=mask[n],
                                                        enable_gqa=gqa)
                    if rows is None:
                        o = og
                    else:
                        o = torch.where(rows, og, torch.zeros_like(og) if o is None else o)
            x = self._after_attention(l, x, o, post)
        return x

    def _qkv(self, l: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             fn: Callable = layer_math.attention_inputs):
        """Layer ``l``'s queries ``[H, m, hd]`` and keys and values ``[KV, m, hd]`` of hidden ``x`` ``[m, d]``, the
        rotary embedding applied (by ``fn``: :func:`~hsd_opt.engine.layer_math.attention_inputs`, or its compiled
        form)."""
        w = self.weights.layers[l]
        qn = kn = None
        if w.q_norm is not None:  # Qwen3: per-head norms before the rotation
            qn, kn = w.q_norm.to(self.dtype), w.k_norm.to(self.dtype)
        return fn(x, self._norms[l][0], w.eps1, self._operand(w.q), self._operand(w.k), self._operand(w.v), qn, kn,
                  w.qk_eps, cos, sin, self.n_heads, self.n_kv, self.head_dim)

    def _after_attention(self, l: int, x: torch.Tensor, o: torch.Tensor,
                         fn: Callable = layer_math.after_attention) -> torch.Tensor:
        """The rest of layer ``l`` after attention output ``o`` ``[1, H, m, hd]``: the output projection, the
        residual, the MLP and its residual (by ``fn``: :func:`~hsd_opt.engine.layer_math.after_attention`, or its
        compiled form)."""
        w = self.weights.layers[l]
        return fn(x, o, self._operand(w.o), self._norms[l][1], w.eps2, self._operand(w.gate), self._operand(w.up),
                  self._operand(w.down), w.act)

    def layers(self, l0: int, l1: int, x: torch.Tensor, st: DecodeState, start: int, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """Layers ``l0 .. l1-1`` on hidden ``x`` ``[m, d]`` at positions ``start .. start+m-1`` of ``st`` (each
        layer's cache written as it goes); ``cos``/``sin`` ``[1, m, head_dim]``."""
        x = x.to(self.dtype)
        for l in range(l0, l1):
            x = self.layer(l, x, st.k[l], st.v[l], start, cos, sin)
        return x

    def layers_many(self, l0: int, l1: int, parts: Sequence[Rows]) -> list[torch.Tensor]:
        """:meth:`layers` for several sequences, one after the other: a matrix product over the rows of several
        sequences would round differently from one over each sequence's rows alone (the blocking of a GEMM
        depends on the row count), so each sequence gets exactly what it gets alone."""
        return [self.layers(l0, l1, p.x, p.st, p.start, p.cos, p.sin) for p in parts]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on hidden ``[m, d]`` -> float32 logits ``[m, V]``."""
        h = rms_norm_reference(hidden.to(self.dtype), self._final_norm, self.weights.norm_eps)
        return self._linear(h, self.weights.head).float()
