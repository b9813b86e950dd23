"""What an engine can do, as the runtime, the profiler and the server use it (a typed interface, no ``Any``).

:class:`Engine` is what a model level of a hierarchy runs on (:class:`~hsd_opt.engine.layered.LayeredLM`
implements it, over float or quantized weights); :class:`Backend` is what the engine runs its passes on (the
torch path and the C kernels). Units: positions and token counts; shapes in the method docs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Protocol, Sequence

import torch

from hsd_opt.engine.state import DecodeState, Rows
from hsd_opt.formats import EXACT_PASS  # noqa: F401  (the engines' name for it)

#: An exit head: hidden ``[m, d]`` at its boundary -> logits ``[m, V]`` over the full vocabulary.
ExitHead = Callable[[torch.Tensor], torch.Tensor]



@dataclass(frozen=True)
class Window:
    """Which logits of a read the sampler needs (top-k, min-p: the filters drop every other token whatever its
    logit): those that may be among the ``top_k`` largest (``top_k`` > 0) and no more than ``below`` (logit units;
    ``inf``: no such limit) under the largest, of the logits plus ``offsets`` (``[m, V]`` float32, finite, or None:
    zero; the penalties' rows). At row ``i``'s tokens ``pinned[i]`` (int64 ids) the offset also gains
    ``reoffset(l)`` of their logits ``l`` (float32 ``[n] -> [n]``: the repetition penalty's ``r(l) - l``), added
    as ``l + (offsets + reoffset(l))``. The others may be ``-inf``."""

    top_k: int
    below: float
    offsets: torch.Tensor | None = None
    pinned: tuple[torch.Tensor, ...] = ()
    reoffset: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True)
class WindowLogits:
    """A read through a :class:`Window`: ``logits`` ``[m, V]`` float32 (every logit in the window as
    :meth:`Engine.logits` gives it, the others ``-inf`` or their values) and ``cols``, the columns some row's window
    holds (int64, ascending; every other column ``-inf`` in every row), or None where every logit was computed."""

    logits: torch.Tensor
    cols: torch.Tensor | None = None


class Picks(Protocol):
    """The rows of one read ready for draws (:mod:`hsd_opt.engine.picks`): ``rows`` of them."""

    rows: int

    def pick(self, i: int, offsets: torch.Tensor) -> int:
        """``argmax(logits[i] + offsets)`` (first index on ties, each sum rounded to float32): ``offsets`` ``[V]``
        float32, finite."""

    def values(self, i: int, ids: torch.Tensor) -> torch.Tensor:
        """Row ``i``'s logits at token ``ids`` (int64 ``[n]``), as the read's logits hold them: ``[n]`` float32 on
        the CPU."""


class Backend(Protocol):
    """Runs decoder layers and the LM head of one model's weights."""

    def layers(self, l0: int, l1: int, x: torch.Tensor, st: DecodeState, start: int, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """Layers ``l0 .. l1-1`` on hidden ``x`` ``[m, d]`` at positions ``start .. start+m-1`` of ``st``, writing
        their keys and values into ``st``'s caches; ``cos``/``sin`` ``[1, m, head_dim]``. Returns ``[m, d]``."""

    def layers_many(self, l0: int, l1: int, parts: Sequence[Rows]) -> list[torch.Tensor]:
        """:meth:`layers` for several sequences (each part its own state and positions), each part's result bit for
        bit what :meth:`layers` gives it alone."""

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden ``[m, d]`` -> float32 logits ``[m, V]``."""


class Engine(Protocol):
    """A model's decoder with one KV cache per layer that every exit of the model shares.

    Attributes:
        name: what profiles and plans call the engine's model level (None: ``layer<b>`` by boundary).
        n_layers: decoder layers; boundary ``b`` is the residual stream after ``b`` of them.
        vocab_size: rows of the LM head (``V``).
        device: where states and logits live.
        is_copy: a quantized copy of another engine's model (it may take that engine's prompt keys and values).
        exit_heads: boundary -> trained exit head (boundaries without one use the model's own head).
        prompt_head: the tokens every chat prompt of the model starts with (empty: none); a prompt that starts with
            them computes them in a pass of its own, whose keys and values the engine keeps for the next.
    """

    name: str | None
    n_layers: int
    vocab_size: int
    device: torch.device
    is_copy: bool
    exit_heads: Mapping[int, ExitHead]
    prompt_head: tuple[int, ...]

    def new_state(self, max_len: int, save_boundaries: Iterable[int] = ()) -> DecodeState:
        """An empty state with room for ``max_len`` tokens, keeping residual streams at ``save_boundaries``."""

    def append(self, st: DecodeState, token_ids) -> None:
        """Append token ids (a list or a 1-D tensor) to the sequence; nothing is computed yet."""

    def advance(self, st: DecodeState, upto: int) -> int:
        """Run layers ``0 .. upto-1`` over every position each has not processed (a step over 1 new position, a
        pass over ``t``: verification); returns positions x layers computed."""

    def advance_many(self, work: Sequence[tuple[DecodeState, int]]) -> list[int]:
        """:meth:`advance` of several states (one per sequence), batched where it can be; each state gets what
        :meth:`advance` gives it alone."""

    def crop(self, st: DecodeState, n: int) -> None:
        """Keep the first ``n`` tokens (after a rejection); every layer forgets the rest."""

    def logits(self, st: DecodeState, boundary: int, start: int, end: int) -> torch.Tensor:
        """Float32 logits ``[end - start, V]`` of the exit at ``boundary``, at positions ``start .. end-1``."""

    def greedy_ids(self, st: DecodeState, boundary: int, start: int, end: int) -> torch.Tensor:
        """``logits(...).argmax(-1)`` (int64 ``[end - start]``), possibly without computing every logit."""

    def logits_many(self, reads: Sequence[tuple[DecodeState, int, int, int]]) -> list[torch.Tensor]:
        """:meth:`logits` of several ``(state, boundary, start, end)`` reads, each as it is alone."""

    def greedy_ids_many(self, reads: Sequence[tuple[DecodeState, int, int, int]]) -> list[torch.Tensor]:
        """:meth:`greedy_ids` of several reads, each as it is alone."""

    @property
    def picks_cheaply(self) -> bool:
        """Whether :meth:`picks_many` reads less than every logit (a float32 head's int8 screen)."""

    def picks_many(self, reads: Sequence[tuple[DecodeState, int, int, int]]) -> list[Picks]:
        """The rows of several reads ready for draws by offsets (:class:`Picks`), each row's picks those of its
        :meth:`logits` row."""

    def window_logits_many(self, reads: Sequence[tuple[DecodeState, int, int, int]],
                           windows: Sequence[Window]) -> list[WindowLogits]:
        """:meth:`logits_many` where each read's sampler needs only its :class:`Window`: every logit in it as
        :meth:`logits` gives it, the others ``-inf`` or their values (through a float32 head's int8 screen where
        :attr:`picks_cheaply`, with the window's columns; else every logit)."""

    def head(self, hidden: torch.Tensor, boundary: int) -> torch.Tensor:
        """The exit head of ``boundary`` on hidden ``[m, d]`` -> float32 logits ``[m, V]``."""

    def hidden_states(self, input_ids, boundaries: Iterable[int]) -> dict[int, torch.Tensor]:
        """A teacher-forced pass over ``input_ids`` (1-D): boundary -> hidden ``[L, d]``, as decoding computes
        them."""

    def take_head(self, st: DecodeState, upto: int) -> bool:
        """Fill ``st`` (holding exactly :attr:`prompt_head`'s tokens) with the keys and values kept of an earlier
        prompt's head, computed to layer ``upto``; False when none are kept for it."""

    def keep_head(self, st: DecodeState, upto: int) -> None:
        """Keep ``st``'s keys and values of :attr:`prompt_head` (just computed to layer ``upto``) for
        :meth:`take_head`."""

    def stepwise(self, start: int, m: int, prompt: int = 0) -> bool:
        """Whether a pass over ``m`` positions from ``start`` (the first ``prompt`` positions being the prompt)
        computes bit for bit what ``m`` one-position steps compute (:attr:`DecodeState.stepwise` records whether
        every pass over a state did)."""

    def can_share_prompt(self, src: "Engine") -> bool:
        """True when ``src``'s keys and values of a prompt can stand in for this engine's own."""

    def share_prompt(self, st: DecodeState, src: "Engine", src_st: DecodeState, upto: int) -> int:
        """Take ``src``'s keys and values of all but the last prompt position, layers ``0 .. upto-1``; returns the
        positions taken."""
