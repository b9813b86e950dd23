"""A model's weights as the engine computes with them: one type for a projection, one quantizer per bit width.

- :class:`Mat` is one projection ``y = x W^T (+ b)`` with ``W`` ``[rows, cols]`` stored as float32 or bfloat16 (the
  model's own tensor, read in place), int8 per output row, or int4 in groups of :data:`GROUP` input columns.
- :func:`quantize_q8` and :func:`quantize_q4` are the quantizers: every quantized copy (drafters, a quantized
  target, stored copies, LM heads, the greedy screen's int8 head) is made by one of them.
- :class:`LayerWeights` and :class:`ModelWeights` hold a decoder's projections, norms and embedding table, built
  from a Hugging Face model by :func:`model_weights` (in place, or quantized).

Both backends read these: the C kernels (:mod:`hsd_opt.engine.kernels`) take the stored bytes, the torch path
(:mod:`hsd_opt.engine.torch_path`) the matrix as a dense tensor (:meth:`Mat.dense`). Shapes in elements.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from hsd_opt.engine.ops import norm_eps
from hsd_opt.engine.precisions import GROUP
from hsd_opt.errors import HsdError

#: Matrix kinds: float32 and bfloat16 (a model's own weights), int8 per output row, int4 in groups of 32 columns,
#: and float32 weights held as int4 codes (:func:`exact_int4`) or int8 codes (:func:`exact_int8`) that give them
#: exactly.
F32, BF16, Q8, Q4, Q4F, Q8F = 0, 1, 2, 3, 4, 5
#: Rows handled at a time where a whole matrix would need a float32 temporary (quantizing a 49,152-row head).
ROW_BLOCK = 4096
#: Architectures the engine computes (pre-norm decoder layers with q/k/v/o projections and a gated MLP).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class Mat:
    """One projection's weight ``[rows, cols]`` (and bias ``[rows]`` or None), as stored.

    ``tensors``: float32/bfloat16 ``[w]`` (the model's tensor, not a copy); int8 ``[codes int8 [rows, cols],
    scale float32 [rows]]`` (``w = code * scale``); int4 ``[codes, scale, minimum]`` in blocks of 16 rows
    (:func:`block_q4`; ``w = code * scale + minimum`` per group of 32 columns; read back with :func:`q4_codes` and
    :func:`q4_factors`); the exact forms of float32 weights: int4 ``[codes uint8 (:func:`pair_codes`), scale
    float16 [rows, G], minimum float16 [rows, G]]`` (``G = cols / 32``) and int8
    ``[codes int8 (:func:`pair_rows_int8`), scale float16 [rows, G]]`` (``w = code * scale``).
    Build with :meth:`in_place`, :func:`quantize_q8`, :func:`quantize_q4`, :func:`exact_int4` or :func:`exact_int8`
    (the engine makes the exact forms with the kernels: :func:`~hsd_opt.engine.kernels.exact_q4f`, the same tensors)."""

    def __init__(self, kind: int, rows: int, cols: int, tensors: Sequence[torch.Tensor], bias: torch.Tensor | None):
        self.kind, self.rows, self.cols = kind, rows, cols
        self.tensors = list(tensors)
        self.bias = None if bias is None else bias.detach()
        #: the C kernels' description of this matrix, made by :mod:`hsd_opt.engine.kernels` on first use
        self.c: object | None = None
        #: the matrix whose tensors this one holds too (an exact int4 form's int4 copy), or None
        self.shares: Mat | None = None
        #: an int8 LM head's codes in the layout of the kernels' int16 read (made on first use by
        #: :mod:`hsd_opt.engine.kernels`), or None
        self.i16_codes: torch.Tensor | None = None

    @classmethod
    def in_place(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Mat":
        """A float weight read in place (no copy)."""
        w = weight.detach()
        return cls(BF16 if w.dtype == torch.bfloat16 else F32, w.shape[0], w.shape[1], [w], bias)

    @property
    def quantized(self) -> bool:
        return self.kind in (Q8, Q4)

    def nbytes(self) -> int:
        """Bytes a pass reads for this matrix."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """``[rows, cols]`` in ``dtype``: the stored tensor itself when it has that dtype, else converted or
        de-quantized (the values the kernels multiply, rounded to ``dtype``)."""
        w = self.tensors[0]
        if self.kind in (F32, BF16):
            return w.to(dtype)
        if self.kind == Q8:
            return (w.float() * self.tensors[1][:, None]).to(dtype)
        if self.kind == Q8F:
            codes = unpair_rows_int8(w, self.rows).float().reshape(self.rows, -1, GROUP)
            return (codes * self.tensors[1].float()[..., None]).reshape(self.rows, self.cols).to(dtype)
        if self.kind == Q4F:
            codes, (scale, minimum) = unpair_codes(w, self.rows, self.cols // GROUP), self.tensors[1:3]
        else:
            codes, (scale, minimum) = q4_codes(self), q4_factors(self)
        g = codes.float() * scale.float()[..., None] + minimum.float()[..., None]
        return g.reshape(self.rows, self.cols).to(dtype)

    def dequantized(self) -> torch.Tensor:
        """The matrix as float32 ``[rows, cols]``."""
        return self.dense(torch.float32)


def quantize_q8(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Mat:
    """Symmetric int8 per output row: ``w ~ code * scale[r]``, ``scale = max|w[r]| / 127``."""
    w = weight.detach().float()
    scale = (w.abs().amax(1) / 127.0).clamp_min(1e-12)
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    for a in range(0, w.shape[0], ROW_BLOCK):        # a block of rows at a time (the same values, in cache)
        b = a + ROW_BLOCK
        q[a:b] = torch.round(w[a:b] / scale[a:b, None]).clamp_(-127, 127)
    return Mat(Q8, w.shape[0], w.shape[1], [q, scale.contiguous()], bias)


def quantize_q4(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Mat:
    """Asymmetric int4 in groups of 32 input columns: ``w ~ code * scale + minimum`` per group (``scale = (max -
    min) / 15``, scale and minimum stored as float16), the scheme of GGUF's Q4_1, whose codes, scales and minimums
    it recovers exactly from de-quantized Q4_1 weights. Stored in blocks of :data:`Q4_BLOCK` rows
    (:func:`block_q4`)."""
    w = weight.detach().float()
    N, K = w.shape
    if K % GROUP:
        raise HsdError(f"int4 quantization needs input width divisible by {GROUP}, got {K}")
    wg = w.reshape(N, K // GROUP, GROUP)
    lo, hi = wg.amin(-1), wg.amax(-1)
    # scale and minimum in float16 (as Q4_1 stores them); the codes are rounded against those stored values
    step = ((hi - lo) / 15.0).clamp_min(6.1e-5).half()
    lo = lo.half()
    sf, lf = step.float(), lo.float()
    q = torch.round((wg - lf[..., None]) / sf[..., None]).clamp_(0, 15).to(torch.uint8)
    return Mat(Q4, N, K, block_q4(q, step, lo), bias)


#: Rows of an int4 matrix stored together (:func:`block_q4`): one 16-lane register holds a column of each.
Q4_BLOCK = 16


def block_q4(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> list[torch.Tensor]:
    """int4 codes uint8 ``[rows, groups, 32]`` (0..15, column order) and their float16 scales and minimums ``[rows,
    groups]`` in the int4 kind's layout, blocks of :data:`Q4_BLOCK` rows (the last padded with zeros): codes uint8
    ``[blocks, ceil(groups / 2), 512]``, per block and pair of groups 64 bytes for each 4 columns ``4q .. 4q + 3``
    of the group (4 bytes per row, row ``i``'s at ``4i``), each byte the code of the first group (low nibble) and
    of the second (high nibble); scales and minimums float16 ``[blocks, groups, 16]``. The kernels multiply one
    such 64-byte load by the same 4 input bytes in every lane: each lane sums one row, with no horizontal sum."""
    rows, groups, _ = codes.shape
    R, P = -(-rows // Q4_BLOCK) * Q4_BLOCK, -(-groups // 2)
    c = torch.zeros(R, 2 * P, GROUP, dtype=torch.uint8, device=codes.device)
    c[:rows, :groups] = codes
    c = c.reshape(R // Q4_BLOCK, Q4_BLOCK, P, 2, 8, 4).permute(0, 2, 4, 1, 5, 3)   # [blk, pair, q, i, b, parity]
    packed = (c[..., 0] | (c[..., 1] << 4)).reshape(R // Q4_BLOCK, P, 512).contiguous()

    def blocked(t: torch.Tensor) -> torch.Tensor:
        z = torch.zeros(R, groups, dtype=torch.float16, device=t.device)
        z[:rows] = t
        return z.reshape(R // Q4_BLOCK, Q4_BLOCK, groups).transpose(1, 2).contiguous()

    return [packed, blocked(scale), blocked(minimum)]


def q4_codes(mat: Mat) -> torch.Tensor:
    """The codes of an int4 :class:`Mat` as uint8 ``[rows, groups, 32]`` in column order (0..15)."""
    p = mat.tensors[0]
    B, P, _ = p.shape
    c = torch.stack([p & 15, p >> 4], -1).reshape(B, P, 8, Q4_BLOCK, 4, 2)          # [blk, pair, q, i, b, parity]
    c = c.permute(0, 3, 1, 5, 2, 4)                                                 # [blk, i, pair, parity, q, b]
    return c.reshape(B * Q4_BLOCK, 2 * P, GROUP)[: mat.rows, : mat.cols // GROUP]


def q4_factors(mat: Mat) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales and minimums of an int4 :class:`Mat` as float16 ``[rows, groups]``."""
    G = mat.cols // GROUP
    return tuple(t.transpose(1, 2).reshape(-1, G)[: mat.rows] for t in mat.tensors[1:3])


def exact_int4(weight: Mat, q4: Mat) -> Mat | None:
    """``weight`` (float32) held as the int4 copy ``q4`` of it when ``q4`` gives every weight exactly, bit for bit
    (de-quantized as ``fma(code, scale, minimum)``, the value the kernels compute): a float32 model de-quantized
    from GGUF's Q4_1, like the embedded SmolLM2, is such a model, and :func:`quantize_q4` recovers its codes. The
    kernels then multiply the same float32 values as the float32 matrix gives, reading an eighth of its bytes
    (kind :data:`Q4F`: ``q4``'s codes re-paired, its scales and minimums by row). None when some weight differs
    (or ``weight`` is not float32)."""
    w = weight.tensors[0]
    if weight.kind != F32 or w.dtype != torch.float32 or q4.kind != Q4 or (q4.rows, q4.cols) != tuple(w.shape):
        return None
    codes, (scale, minimum) = q4_codes(q4), q4_factors(q4)
    for a in range(0, q4.rows, ROW_BLOCK):                  # a block of rows at a time (no whole float copy)
        b = min(a + ROW_BLOCK, q4.rows)
        part = codes[a:b].float() * scale[a:b].float()[..., None] + minimum[a:b].float()[..., None]
        if not torch.equal(part.reshape(b - a, q4.cols), w[a:b]):
            return None
    exact = Mat(Q4F, q4.rows, q4.cols, [pair_codes(codes), scale.contiguous(), minimum.contiguous()], weight.bias)
    exact.shares = q4                # kept alive with it (another copy of the model may take it in this process)
    return exact


def pair_codes(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes ``[rows, groups, 32]`` (0..15, column order) in the exact form's layout, uint8 ``[ceil(rows /
    4), ceil(groups / 2), 128]``: per block of 4 rows and pair of groups, 64 bytes for each pair of rows (the
    block's first two rows, then its last two), in them 16 bytes per 8 columns (``k`` = 0..3 of the group): 8 of the
    first row, then the same 8 columns of the second, each byte the code of the first group (low nibble) and of the
    second (high nibble). The kernels widen 16 such codes into one 16-lane register: the 8-lane accumulators of two
    rows side by side; a block of 4 rows (the kernels' tile) reads one run of bytes. A short last block repeats its
    last row and an odd last group is repeated (the copies never read back)."""
    rows, groups, _ = codes.shape
    if rows % 4:
        codes = torch.cat([codes, codes[-1:].expand(4 - rows % 4, -1, -1)], 0)
    if groups % 2:
        codes = torch.cat([codes, codes[:, -1:]], 1)
    c = codes.reshape(codes.shape[0] // 4, 2, 2, codes.shape[1] // 2, 2, 4, 8)  # [blk, pair, h, gp, parity, k, j]
    c = c.permute(0, 3, 1, 5, 2, 6, 4)                                         # [blk, gp, pair, k, h, j, parity]
    return (c[..., 0] | (c[..., 1] << 4)).reshape(c.shape[0], c.shape[1], 128).contiguous()


def unpair_codes(packed: torch.Tensor, rows: int, groups: int) -> torch.Tensor:
    """:func:`pair_codes` undone: uint8 ``[rows, groups, 32]``."""
    c = torch.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], packed.shape[1], 2, 4, 2, 8, 2)
    c = c.permute(0, 2, 4, 1, 6, 3, 5)                                         # [blk, pair, h, gp, parity, k, j]
    return c.reshape(packed.shape[0] * 4, packed.shape[1] * 2, 32)[:rows, :groups]


def exact_int8(weight: Mat) -> Mat | None:
    """``weight`` (float32) held as int8 codes in groups of 32 columns with a float16 scale per group (GGUF's Q8_0)
    when those give every weight exactly, bit for bit (``code * scale``, a product exact in float32): a float32
    matrix de-quantized from Q8_0, like the embedded SmolLM2's LM head, is one. A group's scale is its largest
    magnitude / 127 (Q8_0's quantizer gives that weight the code 127). The kernels then multiply the same float32
    values, reading a quarter of the bytes (kind :data:`Q8F`). None when some weight differs (or ``weight`` is not
    float32, or its width not a multiple of 32)."""
    w = weight.tensors[0]
    if weight.kind != F32 or w.dtype != torch.float32 or weight.cols % GROUP or w.device.type != "cpu":
        return None
    rows, cols, G = weight.rows, weight.cols, weight.cols // GROUP
    codes = torch.empty(rows, cols, dtype=torch.int8)
    scale = torch.empty(rows, G, dtype=torch.float16)
    for a in range(0, rows, ROW_BLOCK):                  # a block of rows at a time (no whole float copy)
        b = min(a + ROW_BLOCK, rows)
        g = w[a:b].reshape(b - a, G, GROUP)
        d = (g.abs().amax(-1) / 127.0).half()
        df = d.float()[..., None]
        q = torch.round(g / torch.where(df > 0, df, torch.ones_like(df))).clamp_(-127, 127)
        if not torch.equal(q * df, g):
            return None
        codes[a:b] = q.reshape(b - a, cols).to(torch.int8)
        scale[a:b] = d
    return Mat(Q8F, rows, cols, [pair_rows_int8(codes), scale], weight.bias)


def pair_rows_int8(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes ``[rows, cols]`` (``cols`` a multiple of 8) in the int8 exact form's layout ``[ceil(rows / 2),
    cols / 8, 16]``: per pair of rows, 16 bytes per 8 columns, 8 of the first row, then the same 8 of the second,
    which the kernels widen into one 16-lane register (two rows' 8-lane accumulators side by side, as
    :func:`pair_codes`). An odd last row is repeated (its copy never read back)."""
    rows, cols = codes.shape
    if rows % 2:
        codes = torch.cat([codes, codes[-1:]], 0)
    c = codes.reshape(-1, 2, cols // 8, 8).permute(0, 2, 1, 3)                 # [pair, c8, h, j]
    return c.reshape(c.shape[0], cols // 8, 16).contiguous()


def unpair_rows_int8(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """:func:`pair_rows_int8` undone: int8 ``[rows, cols]``."""
    c = packed.reshape(packed.shape[0], packed.shape[1], 2, 8).permute(0, 2, 1, 3)   # [pair, h, c8, j]
    return c.reshape(packed.shape[0] * 2, packed.shape[1] * 8)[:rows]


def quantize(weight: torch.Tensor, bits: int, bias: torch.Tensor | None = None) -> Mat:
    """:func:`quantize_q8` (``bits=8``) or :func:`quantize_q4` (``bits=4``)."""
    if bits == 8:
        return quantize_q8(weight, bias)
    if bits == 4:
        return quantize_q4(weight, bias)
    raise HsdError(f"unsupported bit width {bits} (expected 8 or 4)")


# ------------------------------------------------------------------------------------------------ a model

#: The projections of a decoder layer, in the order the kernels' layer struct holds them.
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass
class LayerWeights:
    """One decoder layer: its projections, norm weights ``[hidden]`` and epsilons, the MLP's activation, and
    for Qwen3 the per-head q/k norm weights ``[head_dim]`` (None otherwise)."""

    q: Mat
    k: Mat
    v: Mat
    o: Mat
    gate: Mat
    up: Mat
    down: Mat
    ln1: torch.Tensor
    ln2: torch.Tensor
    eps1: float
    eps2: float
    act: Callable[[torch.Tensor], torch.Tensor]
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qk_eps: float = 1e-6

    def mats(self) -> list[Mat]:
        return [getattr(self, n) for n in PROJECTIONS]


@dataclass
class ModelWeights:
    """A decoder's weights: embedding table ``[V, hidden]``, layers, final norm ``[hidden]`` and LM head."""

    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    norm_eps: float
    head: Mat

    def nbytes(self) -> int:
        """Bytes of the layers' and the head's matrices (what one full decode step reads)."""
        return sum(m.nbytes() for lw in self.layers for m in lw.mats()) + self.head.nbytes()


def check_supported(model) -> None:
    """Refuse (:class:`HsdError`) a model the engine cannot compute: another architecture, or weights behind
    accelerate hooks (offloaded or dispatched over devices: the engine reads weights directly)."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        raise HsdError(f"model type {getattr(cfg, 'model_type', None)!r} is not supported by the layered engine "
                       f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if any(hasattr(mod, "_hf_hook") for mod in model.modules()):
        raise HsdError("the model's weights are offloaded or dispatched by accelerate hooks; the engine reads "
                       "weights directly: load the model onto one device")


def _activation(mlp) -> Callable[[torch.Tensor], torch.Tensor]:
    act = mlp.act_fn
    return F.silu if type(act).__name__ in ("SiLU", "SiLUActivation") else act


def linears(layer) -> dict:
    """A Hugging Face decoder layer's projection modules by name (``q`` .. ``down``)."""
    a, mlp = layer.self_attn, layer.mlp
    return {"q": a.q_proj, "k": a.k_proj, "v": a.v_proj, "o": a.o_proj, "gate": mlp.gate_proj, "up": mlp.up_proj,
            "down": mlp.down_proj}


def model_weights(model, make: Callable[[str, torch.nn.Module], Mat] | None = None,
                  head: Callable[[torch.nn.Module], Mat] | None = None) -> ModelWeights:
    """The weights of a Hugging Face model of a supported architecture. ``make(name, linear)`` gives each
    layer projection's :class:`Mat` (``name`` like ``layers.3.gate``; default: the model's weight in place) and
    ``head(lm_head)`` the LM head's (default: in place)."""
    make = make or (lambda name, lin: Mat.in_place(lin.weight, lin.bias))
    head = head or (lambda lin: Mat.in_place(lin.weight, getattr(lin, "bias", None)))
    base = model.model
    layers = []
    for i, layer in enumerate(base.layers):
        a = layer.self_attn
        mats = {n: make(f"layers.{i}.{n}", lin) for n, lin in linears(layer).items()}
        qn = getattr(a, "q_norm", None)
        layers.append(LayerWeights(
            **mats, ln1=layer.input_layernorm.weight.detach(), ln2=layer.post_attention_layernorm.weight.detach(),
            eps1=norm_eps(layer.input_layernorm), eps2=norm_eps(layer.post_attention_layernorm),
            act=_activation(layer.mlp), q_norm=None if qn is None else qn.weight.detach(),
            k_norm=None if qn is None else a.k_norm.weight.detach(), qk_eps=norm_eps(qn) if qn is not None else 1e-6))
    return ModelWeights(base.embed_tokens.weight.detach(), layers, base.norm.weight.detach(), norm_eps(base.norm),
                        head(model.lm_head))


# ------------------------------------------------------------------------------------------------ releasing


class WeightReaders:
    """What reads a model's float weights in place: the live float engines over it (held weakly), and whether the
    weights were released."""

    def __init__(self):
        self.engines: weakref.WeakSet = weakref.WeakSet()
        self.released = False


#: Each model's :class:`WeightReaders`, held beside the model rather than on it (the model is not ours to add
#: attributes to), keyed weakly: an entry goes with its model, and a copy of a model is another key, with none.
_READERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def weight_readers(model) -> WeightReaders:
    """The :class:`WeightReaders` of ``model`` (made on first use)."""
    readers = _READERS.get(model)
    if readers is None:
        readers = _READERS[model] = WeightReaders()
    return readers


def is_released(model) -> bool:
    """True when :func:`release_float_weights` emptied ``model``'s float decoder weights."""
    readers = _READERS.get(model)
    return bool(readers is not None and readers.released)


def release_float_weights(model) -> int:
    """Free ``model``'s float decoder matrices (q/k/v/o/gate/up/down of every layer, and an LM head not tied to
    the embeddings) once every quantized copy needed is built from them; return the bytes released. The
    embeddings, norms, biases and rotary tables stay (quantized copies read them in place).

    Each weight becomes an empty tensor, so nothing can compute with it by mistake: a later float engine over
    the model is refused, and so is a new quantized copy; a Hugging Face forward fails on the shapes. Weights
    that are views into one buffer (:func:`~hsd_opt.models.memory.resident_weights`) give their pages back to
    the OS. Refused (:class:`HsdError`) while a float engine over the model is alive: it reads those weights in
    place."""
    import gc

    from hsd_opt.models.memory import drop_pages

    gc.collect()
    readers = weight_readers(model)
    if list(readers.engines):
        raise HsdError("release_float_weights: a float engine over the model still reads its weights")
    freed = 0
    base = model.model
    modules = [lin for layer in base.layers for lin in linears(layer).values()]
    if model.lm_head.weight is not base.embed_tokens.weight:
        modules.append(model.lm_head)
    with torch.no_grad():
        for lin in modules:
            w = lin.weight
            freed += w.numel() * w.element_size()
            lin.weight = torch.nn.Parameter(w.new_empty(0), requires_grad=False)
            drop_pages(w)
            del w
    readers.released = True
    return freed
