"""A layer-by-layer decoder over a Llama-family model's weights, with one static KV cache per layer.

This is the engine every early exit of one model shares (``docs/design.md#layered-forward-and-shared-caches``). A
:class:`DecodeState` holds the token sequence, a K/V cache per decoder layer, and ``lens[l]``: how many positions
layer ``l`` has processed. Because layer ``l + 1`` can only process what layer ``l`` has, ``lens`` is non-increasing
in ``l``.

- ``advance(state, b)`` runs layers ``0 .. b-1`` over every position each has not processed yet, starting each
  layer from where it stopped. An early exit after ``b`` layers that verifies drafts made by an exit after
  ``a < b`` layers therefore runs only layers ``a .. b-1`` on them, from the saved residual stream at boundary
  ``a``: no layer is computed twice for a position that is kept.
- ``crop(state, n)`` cuts the sequence and every layer's cache back to ``n`` positions (after a rejection).
- ``logits(state, b, start, end)`` applies the exit head of boundary ``b`` to the saved residual stream.

Boundaries count layers: boundary ``b`` is the residual stream after ``b`` decoder layers (0 = embeddings,
``n_layers`` = the last layer, whose head is the model's own final norm + LM head).

Shapes: batch size 1. Hidden states ``[m, d]`` for ``m`` positions, logits ``[m, V]`` (float32).
Supported architectures: Llama, Mistral, Qwen2, Qwen3, SmolLM (pre-norm decoder layers with ``self_attn``
q/k/v/o projections and an ``mlp``), which covers LayerSkip's Llama-2/3 checkpoints.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.nn.functional as F

from hsd_opt.engine import kernels
from hsd_opt.engine.ops import causal_attention, norm_eps, rms_norm_reference, rotate_half
from hsd_opt.engine.screen import HeadScreen
from hsd_opt.errors import HsdError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

#: An exit head: hidden ``[m, d]`` at its boundary -> logits ``[m, V]`` over the full vocabulary.
ExitHead = Callable[[torch.Tensor], torch.Tensor]


class _LayerWeights:
    """Direct references to one decoder layer's parameters (no copies)."""

    def __init__(self, layer):
        a, mlp = layer.self_attn, layer.mlp
        self.ln1, self.eps1 = layer.input_layernorm.weight, norm_eps(layer.input_layernorm)
        self.ln2, self.eps2 = layer.post_attention_layernorm.weight, norm_eps(layer.post_attention_layernorm)
        self.q, self.bq = a.q_proj.weight, a.q_proj.bias
        self.k, self.bk = a.k_proj.weight, a.k_proj.bias
        self.v, self.bv = a.v_proj.weight, a.v_proj.bias
        self.o, self.bo = a.o_proj.weight, a.o_proj.bias
        self.gate, self.bgate = mlp.gate_proj.weight, mlp.gate_proj.bias
        self.up, self.bup = mlp.up_proj.weight, mlp.up_proj.bias
        self.down, self.bdown = mlp.down_proj.weight, mlp.down_proj.bias
        act = mlp.act_fn
        self.act = F.silu if type(act).__name__ in ("SiLU", "SiLUActivation") else act
        self.qk_norm = hasattr(a, "q_norm")


#: Set on a ``transformers`` model whose float decoder weights were released (:func:`release_float_weights`).
RELEASED_MARK = "_hsd_float_weights_released"


#: model -> the live float engines (:class:`LayeredLM` over its own weights), kept off the model itself (which
#: may be deep-copied).
_FLOAT_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def float_engines(model) -> list:
    """The float engines (:class:`LayeredLM` over the model's own weights) still alive over ``model``."""
    ws = _FLOAT_ENGINES.get(model)
    return list(ws) if ws is not None else []


def is_released(model) -> bool:
    """True when :func:`release_float_weights` emptied ``model``'s float decoder weights."""
    return bool(getattr(model, RELEASED_MARK, False))


def release_float_weights(model) -> int:
    """Free ``model``'s float decoder matrices (q/k/v/o/gate/up/down of every layer, and an LM head not tied to
    the embeddings) once every quantized copy needed is built from them; return the bytes released. The
    embeddings, norms, biases and rotary tables stay (quantized copies read them in place).

    Each weight becomes an empty tensor, so nothing can compute with it by mistake: a later float engine over
    the model is refused (:class:`LayeredLM`), and so is a new quantized copy; a Hugging Face forward fails on
    the shapes. Weights that are views into one buffer (:func:`~hsd_opt.models.memory.resident_weights`) give
    their pages back to the OS. Refused (:class:`HsdError`) while a float engine over the model is alive: it
    reads those weights in place."""
    import gc

    from hsd_opt.models.memory import drop_pages

    gc.collect()
    if float_engines(model):
        raise HsdError("release_float_weights: a float engine over the model still reads its weights")
    freed = 0
    base = model.model
    linears = [getattr(layer.self_attn, n) for layer in base.layers for n in ("q_proj", "k_proj", "v_proj",
                                                                               "o_proj")]
    linears += [getattr(layer.mlp, n) for layer in base.layers for n in ("gate_proj", "up_proj", "down_proj")]
    if model.lm_head.weight is not base.embed_tokens.weight:
        linears.append(model.lm_head)
    with torch.no_grad():
        for lin in linears:
            w = lin.weight
            freed += w.numel() * w.element_size()
            lin.weight = torch.nn.Parameter(w.new_empty(0), requires_grad=False)
            drop_pages(w)
            del w
    setattr(model, RELEASED_MARK, True)
    return freed


def _lean_weights(model, layers) -> list[_LayerWeights] | None:
    """Per-layer weight references for the direct path, or None when the model has accelerate hooks (offloaded
    or dispatched weights must go through the modules) or a layer lacks the expected projections/norms.
    :meth:`LayeredLM._check_direct_path` then checks the direct path against the modules, bit for bit."""
    if any(hasattr(mod, "_hf_hook") for mod in model.modules()):
        return None
    try:
        out = [_LayerWeights(layer) for layer in layers]
    except AttributeError:
        return None
    return out


@dataclass
class DecodeState:
    """Per-sequence decoding state of one :class:`LayeredLM`.

    Attributes:
        tokens: ``[max_len]`` token ids; the first ``n`` are the sequence.
        n: number of tokens in the sequence.
        lens: ``lens[l]`` positions processed by layer ``l`` (non-increasing in ``l``).
        k, v: per layer ``[1, n_kv_heads, max_len, head_dim]`` caches.
        resid: boundary -> ``[max_len, d]`` residual stream saved at that boundary (only for boundaries asked
            for: exits, and frontiers where a pass stopped).
        cache_ptrs: the caches' addresses as the decode kernels take them (filled on first use).
    """

    tokens: torch.Tensor
    n: int
    lens: list[int]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    resid: dict[int, torch.Tensor] = field(default_factory=dict)
    cache_ptrs: Any = None

    @property
    def max_len(self) -> int:
        return self.tokens.shape[0]

    def token_list(self) -> list[int]:
        return self.tokens[: self.n].tolist()


def _check_computed(st: DecodeState, boundary: int, end: int) -> None:
    """Refuse to read a boundary's hidden states at positions ``advance`` has not computed yet."""
    if boundary > 0 and st.lens[boundary - 1] < end:
        raise RuntimeError(f"positions up to {end} not computed at boundary {boundary}; advance first")


def pass_output(eng, greedy: bool) -> Callable:
    """What a decode pass of ``eng`` ends with, as the runtime computes it: ``(state, boundary, start, end) ->``
    the greedy tokens (``greedy_ids``: greedy decoding reads no more of the head than it needs) or the logits
    (sampling)."""
    return eng.greedy_ids if greedy else eng.logits


class LayeredLM:
    """Our own forward pass over a Hugging Face causal LM's modules, one layer range at a time.

    Two compute paths share the state, ``advance`` and ``crop``:

    - the **torch path** (:meth:`_layer`): the Hugging Face modules' operations in their order, called directly
      on the weights, bit for bit the modules' output (checked when built); any device;
    - the **kernel path** (:mod:`hsd_opt.engine.kernels`, on CPUs where they build): one call per run of layers
      over the weights in place, batch-invariant, float32 activations and caches. Passes over at most
      :data:`~hsd_opt.engine.kernels.MAX_PASS` positions (decode steps, verify passes) take it; longer passes
      (prefill) take the torch path (a blocked GEMM is faster there): the exact one for a float32 model, and
      for bfloat16 weights the same operations in float32 over each layer's weights converted for the pass.
      Engines with :attr:`long_passes_on_kernels` (quantized copies) run long passes on the kernels too, in
      passes of ``MAX_PASS`` positions.

    Args:
        model: a loaded ``transformers`` causal LM of a supported architecture (weights are used, not copied).
        exit_heads: optional boundary -> :data:`ExitHead` for trained early-exit heads; boundaries without one
            use the model's final norm and LM head (the "logit lens").
        kernels: use the kernel path: None (default) where available (CPU, a C compiler, a float32 or bfloat16
            model of a supported layout, ``HSD_KERNELS`` not 0); False never; True requires it.
    """

    #: Call the float layers' weights directly (checked against the modules when built). Subclasses with their
    #: own :meth:`_layer` set it False and skip that set-up.
    direct_path = True
    #: A copy of another engine's model (a quantized copy): it may take that engine's prompt keys and values
    #: (:meth:`share_prompt`). An engine over the model's own weights never takes another's.
    is_copy = False
    #: Long passes (prefill) on the kernels in passes of ``MAX_PASS`` positions instead of a float32 GEMM over
    #: weights converted for the pass: set by engines whose weights would have to be de-quantized for every such
    #: pass (:class:`~hsd_opt.engine.quantized.QuantizedLM`), where converting costs more than the kernels'
    #: arithmetic (docs/design.md#decode-kernels, "Long passes"). Every position is then computed as a decode
    #: step computes it.
    long_passes_on_kernels = False

    def __init__(self, model, exit_heads: Mapping[int, ExitHead] | None = None, kernels: bool | None = None):
        cfg = model.config
        if getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
            raise HsdError(f"model type {getattr(cfg, 'model_type', None)!r} is not supported by the layered "
                           f"engine (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        if self.direct_path and is_released(model):
            raise HsdError("the model's float weights were released after quantizing it; a float engine over it "
                           "needs the model loaded anew")
        if self.direct_path:                 # reads the weights in place: they may not be released under it
            _FLOAT_ENGINES.setdefault(model, weakref.WeakSet()).add(self)
        self.model = model
        base = model.model
        self.embed = base.embed_tokens
        self.layers = list(base.layers)
        self.norm = base.norm
        self.lm_head = model.lm_head
        self.rotary = base.rotary_emb
        self.n_layers = len(self.layers)
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.hidden_size = cfg.hidden_size
        self.vocab_size = getattr(self.lm_head, "out_features", None) or self.lm_head.weight.shape[0]
        self.exit_heads: dict[int, ExitHead] = dict(exit_heads or {})
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        #: rotary (cos, sin) for positions 0..n-1, sliced by :meth:`rope`; None until first used, and always for
        #: dynamic rotary types (their frequencies depend on the sequence length)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rope_tabled = "dynamic" not in str(getattr(self.rotary, "rope_type", "default"))
        self._weights = _lean_weights(model, self.layers) if self.direct_path else None
        if self._weights is not None and not self._check_direct_path():
            self._weights = None
        #: the kernel path: a :class:`~hsd_opt.engine.kernels.LayerStack`, the LM head and final norm weight
        self._kstack: kernels.LayerStack | None = None
        self._khead: kernels.Mat | None = None
        self._knorm: torch.Tensor | None = None
        #: greedy tokens of the float32 kernel head without computing all its logits (None: no screen)
        self._screen: HeadScreen | None = None
        #: long passes (prefill) take the torch path: true for float32 models, whose torch path is exact
        self._torch_long_passes = True
        if kernels is not False:
            self._setup_kernels(required=bool(kernels))

    # ------------------------------------------------------------------------------------------ kernels

    def _kernel_layout_problem(self) -> str | None:
        """Why the kernels cannot run this model's layers (None when they can)."""
        if self.device.type != "cpu":
            return f"the model is on {self.device}"
        if self._weights is None:
            return "the model's layers are not plain weights (hooks or an unexpected layout)"
        if self.dtype not in (torch.float32, torch.bfloat16):
            return f"dtype {self.dtype} (expected float32 or bfloat16)"
        w0 = self._weights[0]
        if w0.qk_norm:
            return "per-head q/k norms (Qwen3)"
        if any(w.act is not F.silu for w in self._weights):
            return "an activation other than SiLU"
        if len({(w.eps1, w.eps2) for w in self._weights}) != 1:
            return "norm epsilons that differ between layers"
        if any(b is not None for w in self._weights for b in (w.bo, w.bgate, w.bup, w.bdown)):
            return "biases outside q/k/v"
        if self.head_dim % 2:
            return "an odd head size"
        return None

    def _setup_kernels(self, required: bool) -> None:
        """Build the kernel path when the kernels load and the model's layout fits (see :class:`LayeredLM`);
        ``required``: raise :class:`HsdError` instead of keeping the torch path."""
        lib = kernels.load_for_model(self._kernel_layout_problem(), required)
        if lib is None:
            return
        wl = self._weights
        mats = [kernels.LayerMats(*(kernels.Mat.dense(w, b) for w, b in (
            (x.q, x.bq), (x.k, x.bk), (x.v, x.bv), (x.o, None), (x.gate, None), (x.up, None), (x.down, None))),
            x.ln1, x.ln2) for x in wl]
        inter = wl[0].gate.shape[0]
        self._kstack = kernels.LayerStack(lib, mats, self.n_heads, self.n_kv, self.head_dim, self.hidden_size, inter,
                                          wl[0].eps1, wl[0].eps2)
        self._khead = kernels.Mat.dense(self.lm_head.weight, getattr(self.lm_head, "bias", None))
        self._knorm = self.norm.weight.detach().float().contiguous()
        self._knorm_eps = norm_eps(self.norm)
        if self._khead.kind == kernels.F32 and self._khead.bias is None and self.hidden_size % kernels.GROUP == 0:
            self._screen = HeadScreen(lib, self._khead)
        if self.dtype != torch.float32:  # bfloat16 weights: float32 activations and caches, no torch path
            self._torch_long_passes = False
            self.dtype = torch.float32

    @property
    def uses_kernels(self) -> bool:
        """True when decode passes run on the CPU kernels (:mod:`hsd_opt.engine.kernels`)."""
        return self._kstack is not None

    def _dense_layers(self, l0: int, l1: int, x: torch.Tensor, st: DecodeState, start: int, cos, sin):
        """A long pass of a kernel engine without an exact torch path (bfloat16 weights): the torch path's
        operations in float32 over each layer's weights converted to float32 for the pass (a blocked GEMM).
        Quantized copies do not take it (:attr:`long_passes_on_kernels`)."""
        x = x.float()
        for l in range(l0, l1):
            x = self._layer_with(self._kstack.dense_layer(l), l, x, st, start, cos, sin)
        return x

    def _kernel_layers(self, l0: int, l1: int, x: torch.Tensor, st: DecodeState, start: int, cos, sin):
        if st.cache_ptrs is None:
            st.cache_ptrs = (kernels.cache_ptrs(st.k), kernels.cache_ptrs(st.v))
        kp, vp = st.cache_ptrs
        x = x.to(torch.float32).clone()  # updated in place; the caller's tensor may be a saved residual
        c, s = cos[0].float(), sin[0].float()
        step = kernels.MAX_PASS
        for i in range(0, x.shape[0], step):
            self._kstack.run(l0, l1, x[i:i + step], start + i, c[i:i + step], s[i:i + step], kp, vp, st.max_len)
        return x

    def _kernel_head(self, hidden: torch.Tensor) -> torch.Tensor:
        lib = self._kstack.lib
        h = kernels.rms_norm(lib, hidden, self._knorm, self._knorm_eps)
        return kernels.linear(lib, self._khead, h)

    # ------------------------------------------------------------------------------------------ state

    def new_state(self, max_len: int, save_boundaries: Iterable[int] = ()) -> DecodeState:
        """An empty state with room for ``max_len`` tokens; residuals are kept at ``save_boundaries``."""
        shape = (1, self.n_kv, max_len, self.head_dim)
        st = DecodeState(
            tokens=torch.zeros(max_len, dtype=torch.long, device=self.device), n=0,
            lens=[0] * self.n_layers,
            k=[torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)],
            v=[torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)],
        )
        for b in save_boundaries:
            self._resid(st, b)
        return st

    def _resid(self, st: DecodeState, b: int) -> torch.Tensor:
        if not 0 <= b <= self.n_layers:
            raise HsdError(f"layer {b} is out of range: the model has layers 1..{self.n_layers}")
        if b not in st.resid:
            st.resid[b] = torch.zeros(st.max_len, self.hidden_size, dtype=self.dtype, device=self.device)
        return st.resid[b]

    def append(self, st: DecodeState, token_ids) -> None:
        """Append tokens (list or 1-D tensor) to the sequence; nothing is computed until :meth:`advance`."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(-1)
        m = ids.numel()
        if st.n + m > st.max_len:
            raise HsdError(f"sequence of {st.n + m} tokens exceeds the decoding state's max_len {st.max_len}")
        st.tokens[st.n: st.n + m] = ids
        st.n += m

    def crop(self, st: DecodeState, n: int) -> None:
        """Keep the first ``n`` tokens; every layer forgets positions ``>= n`` (its cache is overwritten later)."""
        if n < 0 or n > st.n:
            raise ValueError(f"crop to {n} outside 0..{st.n}")
        st.n = n
        st.lens = [min(x, n) for x in st.lens]

    def can_share_prompt(self, src: "LayeredLM") -> bool:
        """True when this engine is a copy (:attr:`is_copy`, e.g. a :class:`~hsd_opt.engine.quantized.QuantizedLM`)
        of the model ``src`` runs over its own weights, with caches of the same shape, so ``src``'s keys and values
        can stand in for this engine's (:meth:`share_prompt`). The model may be the target or a draft model."""
        return (self.is_copy and not src.is_copy and src is not self and src.model is self.model
                and src.n_layers == self.n_layers and src.n_kv == self.n_kv and src.head_dim == self.head_dim)

    @torch.no_grad()
    def share_prompt(self, st: DecodeState, src: "LayeredLM", src_st: DecodeState, upto: int) -> int:
        """Fill layers ``0 .. upto-1`` of ``st`` for positions ``0 .. n-2`` with ``src``'s keys and values (cast
        to this engine's dtype) instead of computing them; return the positions copied per layer.

        For a quantized copy of the target this skips its own prefill: the target has computed the prompt
        anyway, and the copy's later drafts attend to the target's keys and values of the prompt (close to its
        own; drafts are verified, so the output is unchanged). The last position is left for :meth:`advance`,
        which computes it (and the residual stream the first draft reads). Residuals at inner boundaries are not
        filled for the copied positions: call :meth:`advance` with ``upto`` at least as high as any later call.
        """
        if not self.can_share_prompt(src):
            raise HsdError("share_prompt: the source engine computes a different model")
        m = st.n - 1
        if m <= 0 or not 0 < upto <= self.n_layers or any(x != 0 for x in st.lens):
            return 0
        if src_st.n < st.n or not torch.equal(src_st.tokens[:st.n].to(st.tokens.device), st.tokens[:st.n]):
            raise HsdError("share_prompt: the source state holds a different sequence")
        if any(src_st.lens[l] < m for l in range(upto)):
            raise HsdError(f"share_prompt: the source has not computed the first {m} positions up to layer {upto}")
        for l in range(upto):
            st.k[l][:, :, :m] = src_st.k[l][:, :, :m].to(device=self.device, dtype=self.dtype)
            st.v[l][:, :, :m] = src_st.v[l][:, :, :m].to(device=self.device, dtype=self.dtype)
            st.lens[l] = m
        return m

    # ------------------------------------------------------------------------------------------ compute

    def _layer(self, l: int, x: torch.Tensor, st: DecodeState, start: int, cos, sin) -> torch.Tensor:
        """Run decoder layer ``l`` on hidden ``x`` ``[m, d]`` for positions ``start .. start+m-1``.

        The same tensor operations, in the same order, as the Hugging Face modules (so the logits are bit-identical
        to theirs), called directly on the weights, which skips ``nn.Module.__call__``'s overhead per module.
        Models with accelerate hooks (offloading) go through the modules."""
        w = self._weights[l] if self._weights is not None else None
        if w is None:
            return self._layer_modules(l, x, st, start, cos, sin)
        return self._layer_with(w, l, x, st, start, cos, sin)

    def _layer_with(self, w, l: int, x: torch.Tensor, st: DecodeState, start: int, cos, sin) -> torch.Tensor:
        """:meth:`_layer`'s operations over the weights ``w`` (a :class:`_LayerWeights` or the same fields)."""
        attn = self.layers[l].self_attn
        m = x.shape[0]
        end = start + m
        h = rms_norm_reference(x, w.ln1, w.eps1)
        q = F.linear(h, w.q, w.bq).view(m, self.n_heads, self.head_dim).transpose(0, 1)
        k = F.linear(h, w.k, w.bk).view(m, self.n_kv, self.head_dim).transpose(0, 1)
        v = F.linear(h, w.v, w.bv).view(m, self.n_kv, self.head_dim).transpose(0, 1)
        if w.qk_norm:  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = self._attend(l, q, k, v, st, start, end)
        x = x + F.linear(o, w.o, w.bo)
        h = rms_norm_reference(x, w.ln2, w.eps2)
        return x + F.linear(w.act(F.linear(h, w.gate, w.bgate)) * F.linear(h, w.up, w.bup), w.down, w.bdown)

    def _attend(self, l: int, q, k, v, st: DecodeState, start: int, end: int) -> torch.Tensor:
        """Write k/v ``[n_kv, m, hd]`` at positions start..end-1 of layer l's cache; causal attention of q
        ``[n_heads, m, hd]`` over positions 0..end-1 -> ``[m, n_heads * hd]``."""
        m = end - start
        st.k[l][0, :, start:end] = k
        st.v[l][0, :, start:end] = v
        keys = st.k[l][:, :, :end]
        vals = st.v[l][:, :, :end]
        o = causal_attention(q.unsqueeze(0), keys, vals, start)
        return o[0].transpose(0, 1).reshape(m, self.n_heads * self.head_dim)

    @torch.no_grad()
    def _check_direct_path(self) -> bool:
        """True when :meth:`_layer`'s direct path gives bit-identical hidden states to the modules on every layer
        (random input, 3 positions); otherwise the engine uses the modules."""
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(3, self.hidden_size, generator=g).to(device=self.device, dtype=self.dtype)
        cos, sin = self.rope(0, 3)
        a, b = self.new_state(3), self.new_state(3)  # layer l writes only its own cache slot
        for l in range(self.n_layers):
            ya = LayeredLM._layer(self, l, x, a, 0, cos, sin)
            yb = self._layer_modules(l, x, b, 0, cos, sin)
            if not torch.equal(ya, yb):
                return False
        return True

    def _layer_modules(self, l: int, x: torch.Tensor, st: DecodeState, start: int, cos, sin) -> torch.Tensor:
        """:meth:`_layer` through the Hugging Face modules (their hooks run)."""
        layer = self.layers[l]
        attn = layer.self_attn
        m = x.shape[0]
        end = start + m
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(m, self.n_heads, self.head_dim).transpose(0, 1)
        k = attn.k_proj(h).view(m, self.n_kv, self.head_dim).transpose(0, 1)
        v = attn.v_proj(h).view(m, self.n_kv, self.head_dim).transpose(0, 1)
        if hasattr(attn, "q_norm"):  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = self._attend(l, q, k, v, st, start, end)
        x = x + attn.o_proj(o)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def run_layers(self, l0: int, l1: int, x: torch.Tensor, st: DecodeState, start: int, cos, sin) -> torch.Tensor:
        """Layers ``l0 .. l1-1`` on hidden ``x`` ``[m, d]`` at positions ``start .. start+m-1`` (each layer's cache
        written as it goes): on the kernels when this pass takes them (see :class:`LayeredLM`), else layer by
        layer with :meth:`_layer`. Subclasses may run the whole range at once (:class:`QuantizedLM` does)."""
        if self._kstack is not None and (x.shape[0] <= kernels.MAX_PASS or self.long_passes_on_kernels):
            return self._kernel_layers(l0, l1, x, st, start, cos, sin)
        if self._kstack is not None and not self._torch_long_passes:
            return self._dense_layers(l0, l1, x, st, start, cos, sin)
        for l in range(l0, l1):
            x = self._layer(l, x, st, start, cos, sin)
        return x

    def rope(self, start: int, end: int):
        """Rotary tables ``(cos, sin)``, each ``[1, end - start, head_dim]``, for positions ``start .. end-1``.

        Static rotary embeddings (every type but the dynamic ones, whose frequencies depend on the sequence
        length) are computed once for positions ``0 .. n-1`` (``n`` doubling as needed) and sliced: the model's
        rotary module gives each position the same values whichever other positions it computes with, and a
        decode step then spends no time on them.
        """
        if not self._rope_tabled:
            return self._rope_direct(start, end)
        table = self._rope_table
        if table is None or table[0].shape[1] < end or table[0].dtype != self.dtype or table[0].device != self.device:
            n = max(end, 2 * (table[0].shape[1] if table is not None else 0), 1024)
            table = self._rope_table = self._rope_direct(0, n)
        return table[0][:, start:end], table[1][:, start:end]

    def _rope_direct(self, start: int, end: int):
        """:meth:`rope` computed by the model's rotary module for just these positions."""
        pos = torch.arange(start, end, device=self.device).unsqueeze(0)
        dummy = torch.empty(1, dtype=self.dtype, device=self.device)
        cos, sin = self.rotary(dummy, pos)
        return cos[0].unsqueeze(0), sin[0].unsqueeze(0)  # [1, m, head_dim] broadcast over heads

    @torch.no_grad()
    def advance(self, st: DecodeState, upto: int) -> int:
        """Run layers ``0 .. upto-1`` over every position each has not processed; return positions computed.

        The residual stream after ``upto`` layers is saved for the new positions, as it is at every boundary
        in ``st.resid``. The return value (sum over layers of positions processed) is what the pass cost.
        """
        if not 0 <= upto <= self.n_layers:
            raise HsdError(f"layer {upto} is out of range: the model has layers 1..{self.n_layers}")
        n = st.n
        if upto == 0 or (st.lens[upto - 1] >= n):
            return 0
        lo = st.lens[upto - 1]
        cos_all, sin_all = self.rope(lo, n)
        x: torch.Tensor | None = None
        x_start = n
        work = 0
        l = 0
        while l < upto:
            start = st.lens[l]
            if start >= n:
                l += 1
                continue
            if l == 0:
                x = self.embed(st.tokens[start:n])
                x_start = start
            elif start < x_start:  # a frontier: positions this layer lacks but the one below had done before
                old = st.resid[l][start:x_start]
                x = old if x is None else torch.cat([old, x], dim=0)
                x_start = start
            # a run of layers l..r-1 that all lack exactly positions x_start..n-1, with no boundary to save inside
            r = l + 1
            while r < upto and st.lens[r] == x_start and r not in st.resid:
                r += 1
            off = x_start - lo
            x = self.run_layers(l, r, x, st, x_start, cos_all[:, off:], sin_all[:, off:])
            work += x.shape[0] * (r - l)
            for j in range(l, r):
                st.lens[j] = n
            if r in st.resid and r != upto:
                st.resid[r][x_start:n] = x
            l = r
        self._resid(st, upto)[x_start:n] = x
        return work

    def head(self, hidden: torch.Tensor, boundary: int) -> torch.Tensor:
        """Exit head of ``boundary`` on hidden ``[m, d]`` -> float32 logits ``[m, V]``."""
        fn = self.exit_heads.get(boundary)
        if fn is not None:
            return fn(hidden).float()
        if self._khead is not None and hidden.shape[0] <= kernels.MAX_PASS:
            return self._kernel_head(hidden)
        if self._khead is not None and self.long_passes_on_kernels:
            step = kernels.MAX_PASS
            return torch.cat([self._kernel_head(hidden[i:i + step]) for i in range(0, hidden.shape[0], step)])
        if self._khead is not None and not self._torch_long_passes:   # many rows: float32 GEMM over the head
            h = rms_norm_reference(hidden.float(), self._knorm, self._knorm_eps)
            return F.linear(h, self._khead.dequantized(), self._khead.bias)
        return self.lm_head(self.norm(hidden)).float()

    @torch.no_grad()
    def logits(self, st: DecodeState, boundary: int, start: int, end: int) -> torch.Tensor:
        """Logits ``[end-start, V]`` of the exit after ``boundary`` layers at positions ``start .. end-1``
        (the distribution of the token at position ``p + 1`` given tokens ``0..p``). Call :meth:`advance` first."""
        _check_computed(st, boundary, end)
        return self.head(st.resid[boundary][start:end], boundary)

    @torch.no_grad()
    def greedy_ids(self, st: DecodeState, boundary: int, start: int, end: int) -> torch.Tensor:
        """Greedy tokens ``[end-start]`` (int64) at positions ``start .. end-1``: ``logits(...).argmax(-1)``,
        through the head's int8 screen where the engine has one (:mod:`hsd_opt.engine.screen`: the same ids
        from about a quarter of the head's bytes). Call :meth:`advance` first."""
        if self._screen is not None and boundary not in self.exit_heads:
            _check_computed(st, boundary, end)
            h = kernels.rms_norm(self._kstack.lib, st.resid[boundary][start:end], self._knorm, self._knorm_eps)
            ids = self._screen.argmax(h)
            if ids is not None:
                return ids
        return self.logits(st, boundary, start, end).argmax(-1)

    @torch.no_grad()
    def hidden_states(self, input_ids, boundaries: Iterable[int]) -> dict[int, torch.Tensor]:
        """Teacher-forced pass over ``input_ids`` (1-D); returns boundary -> hidden ``[L, d]`` (for profiling).

        The numbers are those of decoding: an engine whose long passes may take another path than its decode
        steps (bfloat16 weights on the kernels: float32 GEMMs over converted weights; a quantized copy, whose
        decode steps quantize the activations to int8) runs the sequence in passes of
        :data:`~hsd_opt.engine.kernels.MAX_PASS` positions on the kernels, which give bit for bit what one-token
        steps give. Otherwise the profile would measure how well a more exact model than the runtime's agrees
        with the target (the int4 copy of the embedded model: 0.98 profiled against 0.95–0.96 run)."""
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).reshape(-1)
        bs = sorted(set(boundaries))
        st = self.new_state(ids.numel(), save_boundaries=bs)
        step = kernels.MAX_PASS if self._kstack is not None and not self._torch_long_passes else ids.numel()
        for i in range(0, ids.numel(), max(step, 1)):
            self.append(st, ids[i:i + step])
            self.advance(st, max(bs) if bs else 0)
        return {b: st.resid[b][: ids.numel()].clone() for b in bs}
