"""The engine: a layer-by-layer decoder over a model's weights, with one static KV cache per layer.

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

One engine class computes every weight type (:mod:`hsd_opt.engine.weights`: float32/bfloat16 in place, int8/int4
copies) on two backends: the C kernels (:mod:`hsd_opt.engine.kernels`, CPUs where they build) and the plain torch
path (:mod:`hsd_opt.engine.torch_path`, any device). :class:`~hsd_opt.engine.quantized.QuantizedLM` is the same
engine over quantized weights. Shapes: batch size 1. Hidden states ``[m, d]`` for ``m`` positions, logits ``[m, V]``
(float32). Supported architectures: Llama, Mistral, Qwen2, Qwen3, SmolLM (pre-norm decoder layers with
``self_attn`` q/k/v/o projections and an ``mlp``), which covers LayerSkip's Llama-2/3 checkpoints.
"""

from __future__ import annotations

from typing import Callable, Generator, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F

from hsd_opt.engine import fixed, graphs, kernels, screen, stored_copies, triton_attention
from hsd_opt.engine.interface import ExitHead, Picks, Window, WindowLogits
from hsd_opt.engine.picks import LogitPicks, ScreenPicks
from hsd_opt.engine.screen import HeadScreen
from hsd_opt.engine.state import DecodeState, KeptHead, Rows
from hsd_opt.engine.torch_path import TorchPath
from hsd_opt.engine.weights import (
    F32,
    GROUP,
    Mat,
    ModelWeights,
    check_supported,
    exact_int8,
    is_released,
    linears,
    model_weights,
    release_float_weights,
    weight_readers,
)
from hsd_opt.errors import HsdError, SettingError
from hsd_opt.models.memory import complete_residency
from hsd_opt.values import env_switch

__all__ = ["DecodeState", "LayeredLM", "is_released", "pass_output", "release_float_weights"]

#: Whether the kernels read a float32 model's projections in an exact int4 form where its int4 copy gives every
#: weight exactly (:func:`~hsd_opt.engine.weights.exact_int4`; the same numbers from fewer bytes). None: the
#: environment decides when an engine is built (``HSD_EXACT_INT4=0`` turns it off, to measure what it saves); a
#: bool overrides it (tests, benchmarks).
EXACT_INT4: bool | None = None
#: The same for the LM head in an exact int8 form (:func:`~hsd_opt.engine.weights.exact_int8`: GGUF Q8_0's
#: de-quantized values, as the embedded model's head is); ``HSD_EXACT_INT8=0`` turns it off.
EXACT_INT8: bool | None = None
#: Whether an engine on CUDA replays its decode steps and verify passes from CUDA graphs
#: (:mod:`hsd_opt.engine.graphs`). None: the environment decides when an engine is built (``HSD_CUDA_GRAPHS=1``
#: turns it on: off until measured on a GPU at scale, ``benchmarks/gpu_scale.py``); a bool overrides it.
CUDA_GRAPHS: bool | None = None
#: Whether a quantized copy on the torch path (a GPU; a CPU without the kernels) reads its matrices as codes with
#: torch's weight-only kernels (:mod:`hsd_opt.engine.weight_only`) instead of de-quantized. None: the environment
#: decides when an engine is built (``HSD_WEIGHT_ONLY=1`` turns it on: off until measured on a GPU at scale); a bool
#: overrides it.
WEIGHT_ONLY: bool | None = None
#: Whether an engine on CUDA computes its decode steps and verify passes as fixed-shape passes
#: (:mod:`hsd_opt.engine.fixed`: a step then computes, bit for bit, what a verify pass computes, so greedy
#: speculative decoding gives the target's own greedy tokens, not only up to near-ties). None: the environment
#: decides when an engine is built (on CUDA on unless ``HSD_FIXED_SHAPES=0``; on a CPU's torch path off unless
#: ``HSD_FIXED_SHAPES=1``: its arithmetic bounds a step); a bool overrides it.
FIXED_SHAPES: bool | None = None
#: Whether an engine on CUDA compiles the layers' arithmetic of its fixed-shape passes with ``torch.compile``
#: (:meth:`LayeredLM.compile_layers`: the small kernels between the products fused). None: the environment decides
#: when an engine is built (``HSD_COMPILE=1`` turns it on: off until measured on a GPU at scale); a bool overrides it.
COMPILE: bool | None = None
#: Whether an engine on CUDA computes the attention of its fixed-shape passes in two Triton kernels per layer,
#: whatever number of sequences shares a pass (:mod:`hsd_opt.engine.triton_attention`; op by op each sequence makes
#: its own calls). None: the environment decides when an engine is built (``HSD_TRITON_ATTENTION=1`` turns it on:
#: off until measured on a GPU at scale); a bool overrides it.
TRITON_ATTENTION: bool | None = None


def _setting(setting: bool | None, variable: str, default: bool = True) -> bool:
    """``setting``, or where it is None the environment ``variable`` (:func:`~hsd_opt.values.env_switch`: 1 or 0,
    on or off, ...; ``default`` where it is not set), read now."""
    return setting if setting is not None else env_switch(variable, default)


def _make_resident(model, exact: Sequence[Mapping[str, Mat]] | None) -> int:
    """Make resident the weights of a model loaded for the engines alone that its float engine reads on every step
    (:func:`~hsd_opt.models.memory.complete_residency`): all of them but the projections the kernels read in an
    exact int4 form (``exact``, per layer), which stay in the file's pages (the torch path reads them only for
    prompt passes past the kernels' reach). Returns the bytes moved."""
    kept = [linears(layer)[name].weight for layer, forms in zip(model.model.layers, exact or ()) for name in forms]
    return complete_residency(model, keep_in_place=kept)


def torch_path_settings() -> dict[str, bool]:
    """What an engine built now on CUDA does on its torch path: ``fixed_shapes`` (its decode steps and verify passes
    at one shape, :data:`FIXED_SHAPES`), ``compiled`` (their layers compiled, :data:`COMPILE`), ``cuda_graphs``
    (replays them, :data:`CUDA_GRAPHS`), ``weight_only`` (a quantized copy reads its codes, :data:`WEIGHT_ONLY`) and
    ``triton_attention`` (their attention in Triton kernels, :data:`TRITON_ATTENTION`)."""
    return {"fixed_shapes": _setting(FIXED_SHAPES, "HSD_FIXED_SHAPES", True),
            "compiled": _setting(COMPILE, "HSD_COMPILE", False),
            "cuda_graphs": _setting(CUDA_GRAPHS, "HSD_CUDA_GRAPHS", False),
            "weight_only": _setting(WEIGHT_ONLY, "HSD_WEIGHT_ONLY", False),
            "triton_attention": _setting(TRITON_ATTENTION, "HSD_TRITON_ATTENTION", False)}


def _check_computed(st: DecodeState, boundary: int, end: int) -> None:
    """Refuse to read a boundary's hidden states at positions ``advance`` has not computed yet."""
    if boundary > 0 and st.lens[boundary - 1] < end:
        raise RuntimeError(f"positions up to {end} not computed at boundary {boundary}; advance first")


def pass_output(eng: "LayeredLM", greedy: bool) -> Callable:
    """What a decode pass of ``eng`` ends with, as the runtime computes it: ``(state, boundary, start, end) ->``
    the greedy tokens (``greedy_ids``: greedy decoding reads no more of the head than it needs) or the logits
    (sampling)."""
    return eng.greedy_ids if greedy else eng.logits


def _prompt_pass(start: int, end: int, prompt: int) -> bool:
    """Whether a pass over positions ``start .. end-1`` is a prompt's pass: from position 0, or within the first
    ``prompt`` positions (:attr:`DecodeState.prompt`)."""
    return start == 0 or end <= prompt


class LayeredLM:
    """Our own forward pass over a Hugging Face causal LM's weights, one layer range at a time.

    Two backends share the state, ``advance`` and ``crop``:

    - the **torch path** (:class:`~hsd_opt.engine.torch_path.TorchPath`): the Hugging Face modules' operations in
      their order, called on the weights; over a float model's own weights, bit for bit the modules' output. Any
      device.
    - the **kernels** (:class:`~hsd_opt.engine.kernels.KernelPath`, on CPUs where they build): one call per run
      of layers over the weights in place, batch-invariant, float32 activations and caches. Passes over at most
      :data:`~hsd_opt.engine.kernels.MAX_PASS` positions (decode steps, verify passes) take them, but for a
      float32 model's prompt of the kernels' ``prefill_on_torch_from`` positions or more; longer
      passes (prefill) take the torch path in float32 (exact for a float32 model; a bfloat16 model's weights
      converted for the pass), except for engines with :attr:`long_passes_on_kernels` (quantized copies), which
      run them on the kernels (:meth:`_on_kernels`; in calls of at most
      :data:`~hsd_opt.engine.kernels.BATCH_ROWS` positions).

    Args:
        model: a loaded ``transformers`` causal LM of a supported architecture (weights are used, not copied).
        exit_heads: optional boundary -> :data:`ExitHead` for trained early-exit heads; boundaries without one
            use the model's final norm and LM head (the "logit lens").
        kernels: use the kernels: None (default) where available (CPU, a C compiler, a supported layout,
            ``HSD_KERNELS`` not 0); False never; True requires them.
    """

    #: A copy of another engine's model (a quantized copy): it may take that engine's prompt keys and values
    #: (:meth:`share_prompt`). An engine over the model's own weights never takes another's.
    is_copy = False
    #: Long passes (prefill) on the kernels instead of the torch path: set for
    #: quantized copies, whose torch path would de-quantize every weight (docs/design.md#decode-kernels, "Long
    #: passes"). Every position is then computed as a decode step computes it.
    long_passes_on_kernels = False
    #: What profiles and plans call this engine's model level (None: named by its boundaries, ``layer<b>``).
    name: str | None = None
    #: The tokens every chat prompt of the model starts with (:func:`~hsd_opt.prompts.template_head`; empty:
    #: none). A decoding computes a prompt that starts with them in a pass of its own, the head first, whose keys
    #: and values the engine keeps (:meth:`keep_head`) and gives to the next such prompt (:meth:`take_head`).
    prompt_head: tuple[int, ...] = ()
    _kept_head: KeptHead | None = None

    def __init__(self, model, exit_heads: Mapping[int, ExitHead] | None = None, kernels: bool | None = None):
        check_supported(model)
        if is_released(model):
            raise HsdError("the model's float weights were released after quantizing it; an engine over it "
                           "needs the model loaded anew")
        self._build(model, model_weights(model), exit_heads, kernels, resident=True)
        weight_readers(model).engines.add(self)        # reads the weights in place: they stay while it lives

    def _build(self, model, weights: ModelWeights, exit_heads: Mapping[int, ExitHead] | None,
               use_kernels: bool | None, resident: bool = False) -> None:
        cfg = model.config
        self.rotary = model.model.rotary_emb
        self.n_layers = len(weights.layers)
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.hidden_size = cfg.hidden_size
        self.vocab_size = weights.head.rows
        self.exit_heads: dict[int, ExitHead] = dict(exit_heads or {})
        self.device = weights.embed.device
        lib = None
        if use_kernels is not False:
            problem = kernels.layout_problem(weights, self.device, self.head_dim)
            lib = kernels.load_for_model(problem, required=bool(use_kernels))
        exact, exact_head = self._exact_forms(model, weights, lib)
        if resident and _make_resident(model, exact):
            weights = model_weights(model)         # the moved weights: views into the resident buffer
        self.model, self.weights = model, weights
        #: activations and caches: float32 on the kernels; else the model's dtype (a quantized copy: float32 on a
        #: CPU, bfloat16 elsewhere)
        if lib is not None:
            self.dtype = torch.float32
        elif weights.head.quantized:
            self.dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        else:
            self.dtype = weights.head.tensors[0].dtype
        self._torch = TorchPath(weights, self.dtype, self.n_heads, self.n_kv, self.head_dim)
        self._kernels = None if lib is None else kernels.KernelPath(lib, weights, self.n_heads, self.n_kv,
                                                                     self.head_dim, exact, exact_head)
        #: greedy tokens of a float32 kernel head without computing all its logits (None: no screen)
        head = weights.head
        self._screen = HeadScreen(lib, head) if (lib is not None and head.kind == F32 and head.bias is None
                                                 and head.cols % GROUP == 0) else None
        #: a float32 model on the kernels: its long passes on the torch path are exact (the modules' own numbers)
        self._exact_long_passes = weights.head.tensors[0].dtype == torch.float32 and not weights.head.quantized
        #: rotary (cos, sin) for positions 0..n-1, sliced by :meth:`rope`; None until first used, and always for
        #: dynamic rotary types (their frequencies depend on the sequence length)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rope_tabled = "dynamic" not in str(getattr(self.rotary, "rope_type", "default"))
        wanted = torch_path_settings()
        if lib is None and weights.head.quantized and wanted["weight_only"]:
            self.read_codes()
        self._fixed = False
        self._graphs: graphs.GraphedPasses | None = None
        cuda = self.device.type == "cuda"
        if lib is None and _setting(FIXED_SHAPES, "HSD_FIXED_SHAPES", cuda):   # a CPU: when asked
            self.fix_shapes()
        if lib is None and cuda:
            if wanted["compiled"]:
                self.compile_layers()
            if wanted["triton_attention"]:
                self.attend_in_triton()
            if wanted["cuda_graphs"]:
                self.replay_passes()

    @staticmethod
    def _exact_forms(model, weights: ModelWeights, lib) -> tuple[list | None, Mat | None]:
        """``(exact int4 forms of the layers' projections, exact int8 form of the head)`` the kernels ``lib`` read
        instead of a float32 model's weights (None where they do not, or the settings turn them off), made by the
        kernels and checked by them against every float32 weight (each build)."""
        if lib is None or lib.hsd_simd() < 1 or weights.head.quantized:
            return None, None
        exact = stored_copies.exact_int4_layers(model, weights, lib) if _setting(EXACT_INT4, "HSD_EXACT_INT4") \
            else None
        exact_head = None
        if _setting(EXACT_INT8, "HSD_EXACT_INT8"):
            exact_head = kernels.exact_q8f(lib, weights.head) if kernels.has(lib, "hsd_exact_q8f") \
                else exact_int8(weights.head)
        return exact, exact_head

    def read_codes(self) -> None:
        """Read this engine's quantized matrices on the torch path as codes with torch's weight-only kernels
        (:mod:`hsd_opt.engine.weight_only`; a matrix no kernel takes here stays de-quantized). On by itself where
        :data:`WEIGHT_ONLY` says so."""
        self._torch.weight_only = True

    def fix_shapes(self) -> None:
        """Compute this engine's torch-path decode steps and verify passes as fixed-shape passes
        (:mod:`hsd_opt.engine.fixed`), the rows of several sequences in one such pass, and read its heads over
        :data:`~hsd_opt.engine.fixed.ROWS` rows: every position's numbers then the same whichever pass computes
        it. Its states' capacities are rounded up (:func:`~hsd_opt.engine.fixed.capacity`): call it before making
        states. On by itself on CUDA where :data:`FIXED_SHAPES` says so; an engine on the kernels is exact
        without it and ignores it."""
        self._fixed = self._kernels is None

    def compile_layers(self) -> bool:
        """Compile the layers' arithmetic of this engine's fixed-shape passes with ``torch.compile``, once for every
        layer (:meth:`~hsd_opt.engine.torch_path.TorchPath.compile_layers`): every fixed-shape pass then computes
        with the compiled code, so a step still computes, bit for bit, what a verify pass computes (the numbers
        differ from op by op by the fused kernels' rounding). Fixes the shapes too (:meth:`fix_shapes`). False
        where it does not apply: an engine on the kernels, layers with different activations, copies reading their
        codes. On by itself on CUDA where :data:`COMPILE` says so."""
        self.fix_shapes()
        return self._fixed and self._torch.compile_layers()

    @property
    def compiled(self) -> bool:
        """True when this engine's fixed-shape passes run compiled (:meth:`compile_layers`)."""
        return self._torch.compiled

    def attend_in_triton(self) -> None:
        """Compute the attention of this engine's fixed-shape passes in two Triton kernels per layer for all the
        sequences of a pass (:mod:`~hsd_opt.engine.triton_attention`; every pass then takes them, so a step still
        computes, bit for bit, what a verify pass computes). Fixes the shapes too (:meth:`fix_shapes`); on a CPU
        the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``: the tests). On by itself on CUDA where
        :data:`TRITON_ATTENTION` says so.

        Raises:
            HsdError: Triton is not installed, or the device is neither CUDA nor a CPU.
        """
        why = triton_attention.unavailable(self.device)
        if why is not None:
            raise SettingError(f"HSD_TRITON_ATTENTION: {why}")
        self.fix_shapes()
        self._torch.triton_attention = self._fixed

    @property
    def attends_in_triton(self) -> bool:
        """True when this engine's fixed-shape passes compute their attention in Triton (:meth:`attend_in_triton`)."""
        return self._torch.triton_attention

    def replay_passes(self, record: graphs.Recorder = graphs.cuda_graph) -> None:
        """Replay this engine's torch-path decode steps and verify passes from recordings made by ``record``
        (:class:`~hsd_opt.engine.graphs.GraphedPasses`: CUDA graphs by default; on by itself on CUDA where
        :data:`CUDA_GRAPHS` says so). The recordings are of fixed-shape passes, so this fixes the shapes too
        (:meth:`fix_shapes`)."""
        self.fix_shapes()
        self._graphs = graphs.GraphedPasses(self._torch, record)

    @property
    def fixed_shapes(self) -> bool:
        """True when this engine computes its torch-path passes at fixed shapes (:meth:`fix_shapes`)."""
        return self._fixed

    @property
    def torch_path(self) -> dict[str, bool]:
        """How this engine runs its torch path, under :func:`torch_path_settings`'s keys: ``fixed_shapes``,
        ``compiled``, ``cuda_graphs`` (:attr:`replays`), ``weight_only`` (:attr:`reads_codes`),
        ``triton_attention`` (:attr:`attends_in_triton`)."""
        return {"fixed_shapes": self.fixed_shapes, "compiled": self.compiled, "cuda_graphs": self.replays,
                "weight_only": self.reads_codes, "triton_attention": self.attends_in_triton}

    @property
    def uses_kernels(self) -> bool:
        """True when decode passes run on the C kernels (:mod:`hsd_opt.engine.kernels`)."""
        return self._kernels is not None

    @property
    def replays(self) -> bool:
        """True when this engine replays its torch-path passes from recordings (:meth:`replay_passes`)."""
        return self._graphs is not None

    @property
    def reads_codes(self) -> bool:
        """True when this engine's torch path reads quantized matrices as codes (:meth:`read_codes`)."""
        return self._torch.weight_only

    def weight_bytes(self) -> int:
        """Bytes of weights one full decode step reads (layers + LM head)."""
        return self.weights.nbytes()

    # ------------------------------------------------------------------------------------------ state

    def new_state(self, max_len: int, save_boundaries: Iterable[int] = ()) -> DecodeState:
        """An empty state with room for ``max_len`` tokens (rounded up with :meth:`fix_shapes`); residuals are kept
        at ``save_boundaries``."""
        if self._fixed:
            max_len = fixed.capacity(max_len)
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
        if not 1 <= b <= self.n_layers:     # boundary 0, the embeddings, is not kept: nothing writes it
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
        st.prompt = min(st.prompt, n)
        st.off_steps = st.off_steps.below(n)

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
        st.off_steps.unmatched(0)   # another model's keys and values, not this one's steps
        return m

    def take_head(self, st: DecodeState, upto: int) -> bool:
        """Fill layers ``0 .. upto-1`` of ``st``, which holds exactly :attr:`prompt_head`'s tokens and nothing
        computed, with the keys, values and residual streams :meth:`keep_head` kept of an earlier prompt's head
        computed to the same layer: bit for bit what :meth:`advance` would compute (a pass over the same tokens at
        the same positions). False, and nothing changed, when none is kept for this state."""
        kept, n = self._kept_head, len(self.prompt_head)
        if (kept is None or n == 0 or st.n != n or kept.upto != upto or any(x != 0 for x in st.lens)
                or not set(st.resid) <= set(kept.resid) or not torch.equal(st.tokens[:n], kept.tokens)):
            return False
        for l in range(upto):
            st.k[l][:, :, :n] = kept.k[l]
            st.v[l][:, :, :n] = kept.v[l]
            st.lens[l] = n
        for b, rows in kept.resid.items():
            self._resid(st, b)[:n] = rows
        st.off_steps = kept.off_steps.below(n)
        return True

    def keep_head(self, st: DecodeState, upto: int) -> None:
        """Keep ``st``'s keys, values and residual streams of :attr:`prompt_head`, which layers ``0 .. upto-1``
        have just computed (its only positions), for :meth:`take_head`."""
        n = len(self.prompt_head)
        if n == 0 or st.n != n or any(st.lens[l] != n for l in range(upto)):
            raise HsdError(f"keep_head: the state holds {st.n} tokens, not the prompt head's {n} computed")
        self._kept_head = KeptHead(st.tokens[:n].clone(), upto, [st.k[l][:, :, :n].clone() for l in range(upto)],
                                    [st.v[l][:, :, :n].clone() for l in range(upto)],
                                    {b: r[:n].clone() for b, r in st.resid.items()}, st.off_steps.below(n))

    # ------------------------------------------------------------------------------------------ compute

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[m, d]`` of token ids ``[m]``, in the compute dtype."""
        return F.embedding(ids, self.weights.embed).to(self.dtype)

    def run_layers(self, l0: int, l1: int, x: torch.Tensor, st: DecodeState, start: int, cos, sin) -> torch.Tensor:
        """Layers ``l0 .. l1-1`` on hidden ``x`` ``[m, d]`` at positions ``start .. start+m-1`` (each layer's cache
        written as it goes): on the kernels when this pass takes them (see :class:`LayeredLM`), else on the torch
        path, as a fixed-shape pass where this engine fixes them (:meth:`fix_shapes`) and the pass has one
        (:func:`~hsd_opt.engine.fixed.takes`), replayed from a recording where it replays passes
        (:meth:`replay_passes`)."""
        if self._on_kernels(start, x.shape[0], st.prompt):
            return self._kernels.layers(l0, l1, x, st, start, cos, sin)
        if self._takes_fixed(st, start, x.shape[0]):
            out = None if self._graphs is None else self._graphs.layers(l0, l1, x, st, start, cos, sin)
            return out if out is not None else self._fixed_pass(l0, l1, [Rows(x, st, start, cos, sin)])[0]
        return self._torch.layers(l0, l1, x, st, start, cos, sin)

    def _takes_fixed(self, st: DecodeState, start: int, m: int) -> bool:
        """Whether a pass over ``m`` positions of ``st`` from ``start`` is a fixed-shape pass: this engine fixes
        shapes, the pass has one (:func:`~hsd_opt.engine.fixed.takes`), and the state was made with a capacity that
        holds every attention length (:func:`~hsd_opt.engine.fixed.capacity`; one made before :meth:`fix_shapes`
        computes at its passes' own shapes)."""
        return self._fixed and fixed.takes(start, m, st.prompt) and st.max_len % fixed.BLOCK == 0

    def _fixed_pass(self, l0: int, l1: int, parts: Sequence[Rows]) -> list[torch.Tensor]:
        """Layers ``l0 .. l1-1`` over several sequences' rows (at most :data:`~hsd_opt.engine.fixed.ROWS` in
        all) in one fixed-shape pass, op by op (with the Triton attention, replayed from the run's one recording
        where this engine replays its passes): each sequence's new hidden states."""
        sizes = [p.x.shape[0] for p in parts]
        if self._torch.triton_attention:      # where rows go is data: one recording replays any pass and batch
            out = None if self._graphs is None else self._graphs.many(l0, l1, list(parts))
            if out is not None:
                return out
            x, cos, sin = fixed.stacked(parts)
            tables = triton_attention.of_rows(parts, l0, l1)
            out = self._torch.fixed_layers(l0, l1, x, tables.pos, cos.to(self.dtype), sin.to(self.dtype), [],
                                           tables)
        else:
            x, pos, cos, sin, ps = fixed.several(parts, l0, l1)
            out = self._torch.fixed_layers(l0, l1, x, pos, cos.to(self.dtype), sin.to(self.dtype), ps)
        return list(out[:sum(sizes)].split(sizes))

    def _on_kernels(self, start: int, m: int, prompt: int = 0) -> bool:
        """Whether a pass over ``m`` positions from position ``start`` runs on the kernels: every pass of an engine
        with :attr:`long_passes_on_kernels`; else passes over at most :data:`~hsd_opt.engine.kernels.MAX_PASS`
        positions (decode steps and verify passes: computed as the steps compute them); on a float32 model, a
        prompt's pass (from position 0, or within the first ``prompt`` positions, :attr:`DecodeState.prompt`) runs
        there when it is shorter than the kernels' ``prefill_on_torch_from`` positions and ends within
        the kernels' ``prefill_within()`` positions (:data:`~hsd_opt.engine.kernels.PREFILL_ON_KERNELS_WITHIN`,
        ``_WIDE`` for 16-lane ones), else on the torch path (its
        blocked GEMMs are faster there: :data:`~hsd_opt.engine.kernels.PREFILL_ON_TORCH_FROM`, ``_WIDE`` for
        16-lane kernels, ``_EXACT`` for kernels of either width reading the exact int4 form; every method prefills a
        prompt in the same passes)."""
        if self._kernels is None:
            return False
        if self.long_passes_on_kernels:
            return True
        if _prompt_pass(start, start + m, prompt) and self._exact_long_passes:
            return m < self._kernels.prefill_on_torch_from and start + m <= self._kernels.prefill_within()
        return m <= kernels.MAX_PASS

    def stepwise(self, start: int, m: int, prompt: int = 0) -> bool:
        """Whether a pass over ``m`` positions from ``start`` (of a state whose first ``prompt`` positions are the
        prompt) computes bit for bit what ``m`` one-position steps compute: where it runs on the kernels
        (:meth:`_on_kernels`: their passes are batch-invariant)."""
        return self._on_kernels(start, m, prompt)

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
        if table is None or table[0].shape[1] < end:
            n = max(end, 2 * (table[0].shape[1] if table is not None else 0), 1024)
            table = self._rope_table = self._rope_direct(0, n)
        return table[0][:, start:end], table[1][:, start:end]

    def _rope_direct(self, start: int, end: int):
        """:meth:`rope` computed by the model's rotary module for just these positions."""
        pos = torch.arange(start, end, device=self.device).unsqueeze(0)
        dummy = torch.empty(1, dtype=self.dtype, device=self.device)
        cos, sin = self.rotary(dummy, pos)
        return cos[0].unsqueeze(0), sin[0].unsqueeze(0)  # [1, m, head_dim] broadcast over heads

    def _runs(self, st: DecodeState, upto: int,
              embedded: torch.Tensor | None = None) -> Generator[Rows, torch.Tensor, int]:
        """:meth:`advance` as the runs of layers it computes: yields ``(l0, l1, rows)`` for each run of layers
        ``l0 .. l1-1`` over some positions of ``st`` and receives their new hidden states; returns the positions
        computed (summed over layers). ``embedded``: the embeddings of the tokens the first layer lacks, where the
        caller has them (:meth:`_embedded`)."""
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
        whole = False       # the rows came in at the first layer (a pass over the layers, not a frontier's catch-up)
        l = 0
        while l < upto:
            start = st.lens[l]
            if start >= n:
                l += 1
                continue
            if l == 0:
                x = self.embed(st.tokens[start:n]) if embedded is None else embedded
                x_start, whole = start, True
            elif start < x_start:  # a frontier: positions this layer lacks but the one below had done before
                old = st.resid[l][start:x_start]
                x = old if x is None else torch.cat([old, x], dim=0)
                x_start, whole = start, False
            # a run of layers l..r-1 that all lack exactly positions x_start..n-1, with no boundary to save inside
            r = l + 1
            while r < upto and st.lens[r] == x_start and r not in st.resid:
                r += 1
            off = x_start - lo
            if not self._on_kernels(x_start, x.shape[0], st.prompt):
                st.off_steps.note(x_start, n, whole and _prompt_pass(x_start, n, st.prompt))
            x = yield l, r, Rows(x, st, x_start, cos_all[:, off:], sin_all[:, off:])
            work += x.shape[0] * (r - l)
            for j in range(l, r):
                st.lens[j] = n
            if r in st.resid and r != upto:
                st.resid[r][x_start:n] = x
            l = r
        self._resid(st, upto)[x_start:n] = x
        return work

    @torch.no_grad()
    def advance(self, st: DecodeState, upto: int) -> int:
        """Run layers ``0 .. upto-1`` over every position each has not processed; return positions computed.

        The residual stream after ``upto`` layers is saved for the new positions, as it is at every boundary
        in ``st.resid``. The return value (sum over layers of positions processed) is what the pass cost.
        """
        runs = self._runs(st, upto)
        try:
            l0, l1, rows = next(runs)
            while True:
                l0, l1, rows = runs.send(self.run_layers(l0, l1, rows.x, rows.st, rows.start, rows.cos, rows.sin))
        except StopIteration as done:
            return done.value

    @torch.no_grad()
    def advance_many(self, work: Sequence[tuple[DecodeState, int]]) -> list[int]:
        """:meth:`advance` of several states (sequences), each to its own boundary: the runs of layers they have in
        common are computed in one pass over all their rows where the kernels take each sequence's rows alone
        (a prompt's pass too; each weight read once for every sequence) or, on the torch path with fixed shapes
        (:meth:`fix_shapes`), in fixed-shape passes of up to :data:`~hsd_opt.engine.fixed.ROWS` rows; the others
        one sequence at a time. Each state gets bit for bit what :meth:`advance` gives it alone. Returns the
        positions computed per state."""
        embedded = self._embedded(work) if self._fixed else {}
        runs = [self._runs(st, upto, embedded.get(i)) for i, (st, upto) in enumerate(work)]
        done: list[int] = [0] * len(runs)
        pending: dict[int, tuple[int, int, Rows]] = {}

        def step(i: int, value: torch.Tensor | None) -> None:
            try:
                pending[i] = next(runs[i]) if value is None else runs[i].send(value)
            except StopIteration as stop:
                done[i] = stop.value
                pending.pop(i, None)

        for i in range(len(runs)):
            step(i, None)
        while pending:
            groups: dict[tuple[int, int], list[int]] = {}
            for i, (l0, l1, rows) in pending.items():
                m = rows.x.shape[0]
                together = self._on_kernels(rows.start, m, rows.st.prompt) or self._takes_fixed(rows.st, rows.start, m)
                groups.setdefault((l0, l1) if together else (l0, l1, i), []).append(i)
            for key, idx in groups.items():
                l0, l1 = key[0], key[1]
                if len(idx) == 1:
                    rows = pending[idx[0]][2]
                    outs = [self.run_layers(l0, l1, rows.x, rows.st, rows.start, rows.cos, rows.sin)]
                elif self._kernels is not None:
                    outs = self._kernels.layers_many(l0, l1, [pending[i][2] for i in idx])
                else:   # fixed shapes: consecutive groups of at most ROWS rows (the order of idx kept)
                    chunks = fixed.fill(idx, [pending[i][2].x.shape[0] for i in idx])
                    outs = [o for c in chunks for o in self._fixed_pass(l0, l1, [pending[i][2] for i in c])]
                for i, out in zip(idx, outs):
                    step(i, out)
        return done

    def _embedded(self, work: Sequence[tuple[DecodeState, int]]) -> dict[int, torch.Tensor]:
        """The embeddings ``[m, d]`` of the tokens the first layer lacks, by index in ``work``, of every state that
        :meth:`advance_many` takes through the first layer: in one call for all of them (one kernel on a GPU, not
        one per sequence; a lookup, so each the same as alone)."""
        fresh = [i for i, (st, upto) in enumerate(work) if upto > 0 and st.lens[0] < st.n]
        if len(fresh) < 2:
            return {}
        ids = [work[i][0].tokens[work[i][0].lens[0]:work[i][0].n] for i in fresh]
        return dict(zip(fresh, self.embed(torch.cat(ids)).split([t.shape[0] for t in ids])))

    def head(self, hidden: torch.Tensor, boundary: int) -> torch.Tensor:
        """Exit head of ``boundary`` on hidden ``[m, d]`` -> float32 logits ``[m, V]``."""
        m = hidden.shape[0]
        if self._fixed and 0 < m <= fixed.ROWS:   # every row read at one shape (:meth:`fix_shapes`)
            return self._head(fixed.pad(hidden, 0), boundary)[:m]
        return self._head(hidden, boundary)

    def _head(self, hidden: torch.Tensor, boundary: int) -> torch.Tensor:
        fn = self.exit_heads.get(boundary)
        if fn is not None:
            return fn(hidden).float()
        if self._kernels is not None and (hidden.shape[0] <= kernels.MAX_PASS or self.long_passes_on_kernels):
            return self._kernels.head(hidden)
        return self._torch.head(hidden)

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
        ids = self._screened_ids([(st, boundary, start, end)])
        return ids[0] if ids is not None else self.logits(st, boundary, start, end).argmax(-1)

    def _screen_hidden(self, reads: Sequence[tuple[DecodeState, int, int, int]]) -> torch.Tensor | None:
        """The hidden rows ``[sum of sizes, d]`` of ``reads``, in order, where the head's int8 screen can take them
        in one call; None where it cannot: no screen, no reads, an exit's own head, or more than
        :data:`~hsd_opt.engine.screen.MAX_POSITIONS` rows in all."""
        if (self._screen is None or not reads or sum(s1 - s0 for _, _, s0, s1 in reads) > screen.MAX_POSITIONS
                or any(b in self.exit_heads for _, b, _, _ in reads)):
            return None
        for st, b, _, s1 in reads:
            _check_computed(st, b, s1)
        return torch.cat([st.resid[b][s0:s1] for st, b, s0, s1 in reads])

    def _screened_ids(self, reads: Sequence[tuple[DecodeState, int, int, int]]) -> list[torch.Tensor] | None:
        """The greedy ids of ``reads`` through the head's int8 screen in one call (each row's argmax found on its
        own), or None where the screen does not apply (:meth:`_screen_hidden`) or steps aside."""
        hidden = self._screen_hidden(reads)
        if hidden is None:
            return None
        ids = self._screen.argmax(self._kernels.normed(hidden))
        return None if ids is None else list(ids.split([s1 - s0 for _, _, s0, s1 in reads]))

    @property
    def picks_cheaply(self) -> bool:
        """Whether :meth:`picks_many` reads the model's own head through its int8 screen (a float32 head on the
        kernels) rather than computing every logit."""
        return self._screen is not None

    @torch.no_grad()
    def picks_many(self, reads: Sequence[tuple[DecodeState, int, int, int]]) -> list[Picks]:
        """The rows of several ``(state, boundary, start, end)`` reads ready for draws
        (:mod:`hsd_opt.engine.picks`): ``pick(i, offsets)`` is ``argmax(logits[i] + offsets)`` of row ``i``, bit
        for bit what :meth:`logits` gives it. Through the head's int8 screen where it takes the reads
        (:meth:`_screen_hidden`; the screen logits of every row in one call); else over the logits
        (:meth:`logits_many`)."""
        screened = self._screened_rows(reads)
        if screened is not None:
            return [ScreenPicks(self._screen, n, ra, lambda i, h=h: self._kernels.head(h[i:i + 1])[0])
                    for h, n, ra in screened]
        return [LogitPicks(lg) for lg in self.logits_many(reads)]

    def _screened_rows(self, reads: Sequence[tuple[DecodeState, int, int, int]]
                       ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
        """Per read, its hidden rows ``[m, d]``, their normed rows and their screen logits ``[m, V]``, the screen
        logits of every row in one int16 read; None where the screen does not take the reads
        (:meth:`_screen_hidden`) or their values are not finite."""
        hidden = self._screen_hidden(reads)
        if hidden is None:
            return None
        normed = self._kernels.normed(hidden)
        a = self._screen.logits(normed)
        if a is None:
            return None
        sizes = [s1 - s0 for _, _, s0, s1 in reads]
        return list(zip(hidden.split(sizes), normed.split(sizes), a.split(sizes)))

    @torch.no_grad()
    def window_logits_many(self, reads: Sequence[tuple[DecodeState, int, int, int]],
                           windows: Sequence[Window]) -> list[WindowLogits]:
        """:meth:`logits_many` of ``reads`` where each read's sampler needs only its ``window`` (top-k, min-p):
        through the head's int8 screen where it takes the reads (:meth:`_screen_hidden`; the screen logits of
        every row in one call, :meth:`~hsd_opt.engine.screen.HeadScreen.window` per read): the window's logits
        bit for bit what :meth:`logits` gives, the others ``-inf``, and its columns; reads of more rows in all
        than it takes together each through it alone, so that a read gets what it gets alone; else (or where the
        screen steps aside for a read) every logit (``cols`` None)."""
        out: list[WindowLogits | None] = [None] * len(reads)
        screened = self._screened_rows(reads)
        if screened is None and len(reads) > 1:     # too many rows together: each read as it is read alone
            screened = [(got or [None])[0] for got in (self._screened_rows([r]) for r in reads)]
        for i, (rows, w) in enumerate(zip(screened or [], windows)):
            if rows is not None:
                got = self._screen.window(rows[1], rows[2], w.top_k, w.below, w.offsets, w.pinned, w.reoffset)
                out[i] = None if got is None else WindowLogits(*got)
        rest = [i for i, o in enumerate(out) if o is None]
        for i, lg in zip(rest, self.logits_many([reads[i] for i in rest]) if rest else []):
            out[i] = WindowLogits(lg)
        return out

    @torch.no_grad()
    def logits_many(self, reads: Sequence[tuple[DecodeState, int, int, int]]) -> list[torch.Tensor]:
        """:meth:`logits` of several ``(state, boundary, start, end)`` reads: the rows through the model's own head
        in one kernel call where the kernels take them (each row as it is computed alone), else one read at a
        time. Each read gets bit for bit what :meth:`logits` gives it."""
        if self._fixed:
            return self._fixed_logits(reads)
        out: list[torch.Tensor | None] = [None] * len(reads)
        shared = [i for i, (st, b, s0, s1) in enumerate(reads)
                  if self._kernels is not None and b not in self.exit_heads and s1 - s0 <= kernels.MAX_PASS]
        if len(shared) > 1:
            for i in shared:
                _check_computed(reads[i][0], reads[i][1], reads[i][3])
            hidden = torch.cat([reads[i][0].resid[reads[i][1]][reads[i][2]:reads[i][3]] for i in shared])
            rows = self._kernels.head(hidden).split([reads[i][3] - reads[i][2] for i in shared])
            for i, r in zip(shared, rows):
                out[i] = r
        for i, (st, b, s0, s1) in enumerate(reads):
            if out[i] is None:
                out[i] = self.logits(st, b, s0, s1)
        return out

    def _fixed_logits(self, reads: Sequence[tuple[DecodeState, int, int, int]],
                      greedy: bool = False) -> list[torch.Tensor]:
        """:meth:`logits_many` with fixed shapes (:meth:`fix_shapes`): the rows of the reads through one head
        together, in heads over :data:`~hsd_opt.engine.fixed.ROWS` rows (each row as it is read alone; the weights
        read once for all of them). ``greedy``: each read's greedy ids instead, one argmax per head call (one
        kernel for a batch's step, not one per sequence)."""
        out: list[torch.Tensor | None] = [None] * len(reads)
        by_head: dict[int | None, list[int]] = {}   # an exit's own head, or None: the model's
        for i, (st, b, s0, s1) in enumerate(reads):
            _check_computed(st, b, s1)
            if 0 < s1 - s0 <= fixed.ROWS:
                by_head.setdefault(b if b in self.exit_heads else None, []).append(i)
            else:
                lg = self.logits(st, b, s0, s1)
                out[i] = lg.argmax(-1) if greedy else lg
        for idx in by_head.values():
            sizes = [reads[i][3] - reads[i][2] for i in idx]
            for chunk in fixed.fill(idx, sizes):
                hidden = torch.cat([reads[i][0].resid[reads[i][1]][reads[i][2]:reads[i][3]] for i in chunk])
                rows = self.head(hidden, reads[chunk[0]][1])
                rows = (rows.argmax(-1) if greedy else rows).split([reads[i][3] - reads[i][2] for i in chunk])
                for i, r in zip(chunk, rows):
                    out[i] = r
        return out

    @torch.no_grad()
    def greedy_ids_many(self, reads: Sequence[tuple[DecodeState, int, int, int]]) -> list[torch.Tensor]:
        """:meth:`greedy_ids` of several ``(state, boundary, start, end)`` reads: reads of the model's own head with
        at most :data:`~hsd_opt.engine.screen.MAX_POSITIONS` rows in all go through its int8 screen together
        (:meth:`_screened_ids`), more share one pass over the full head (:meth:`logits_many`). The same ids either
        way (the screen's argmax is exact)."""
        ids = self._screened_ids(reads)
        if ids is not None:
            return ids
        if self._fixed:                    # one argmax per head call
            return self._fixed_logits(reads, greedy=True)
        return [lg.argmax(-1) for lg in self.logits_many(reads)]

    @torch.no_grad()
    def hidden_states(self, input_ids, boundaries: Iterable[int]) -> dict[int, torch.Tensor]:
        """Teacher-forced pass over ``input_ids`` (1-D); returns boundary -> hidden ``[L, d]`` (for profiling).

        The numbers are those of decoding: an engine whose long passes take another path than its decode steps
        (bfloat16 weights on the kernels: float32 operations over converted weights) runs the sequence in passes
        of :data:`~hsd_opt.engine.kernels.MAX_PASS` positions, which give bit for bit what one-token steps give.
        Otherwise the profile would measure how well a more exact model than the runtime's agrees with the target
        (the int4 copy of the embedded model: 0.98 profiled against 0.95–0.96 run)."""
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).reshape(-1)
        bs = sorted(set(boundaries))
        st = self.new_state(ids.numel(), save_boundaries=bs)
        chunked = self._kernels is not None and not self._exact_long_passes
        step = kernels.MAX_PASS if chunked else ids.numel()
        for i in range(0, ids.numel(), max(step, 1)):
            self.append(st, ids[i:i + step])
            self.advance(st, max(bs) if bs else 0)
        return {b: st.resid[b][: ids.numel()].clone() for b in bs}
