"""The decoding state of one sequence in one engine (its tokens, a K/V cache per layer, how far each layer got), and
the rows one sequence brings to a pass.

Shapes: caches ``[1, n_kv, max_len, head_dim]`` per layer; residual streams ``[max_len, hidden]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


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
        cache_ptrs: the caches' addresses as the kernels take them (filled on first use).
        cache_table: the same addresses as one int64 array ``[2, layers]`` (keys', values'), as the Triton
            attention's tables take them (filled on first use).
        prompt: positions ``0 .. prompt-1`` are the prompt (set by the decoding before its prefill): a pass
            within them is a prompt pass, which a float32 model may compute on the torch path.
        off_steps: how the positions held were computed where that was not as one-position steps compute them
            (:class:`OffSteps`): a later prompt starting with the same tokens may take positions only where its
            own passes would compute the same numbers.
    """

    tokens: torch.Tensor
    n: int
    lens: list[int]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    resid: dict[int, torch.Tensor] = field(default_factory=dict)
    cache_ptrs: tuple | None = None
    cache_table: np.ndarray | None = None
    prompt: int = 0
    off_steps: "OffSteps" = field(default_factory=lambda: OffSteps())

    @property
    def stepwise(self) -> bool:
        """Every position held was computed as one-position steps compute it (on the decode kernels, whose passes are
        batch-invariant), so its keys and values are a function of the tokens up to it alone."""
        return self.off_steps.none

    @property
    def max_len(self) -> int:
        return self.tokens.shape[0]

    def token_list(self) -> list[int]:
        return self.tokens[: self.n].tolist()

    def copy(self) -> "DecodeState":
        """Another sequence with this one's tokens, caches and residual streams (its own tensors; the kernels'
        cache addresses are taken anew on first use)."""
        return DecodeState(self.tokens.clone(), self.n, list(self.lens), [k.clone() for k in self.k],
                           [v.clone() for v in self.v], {b: r.clone() for b, r in self.resid.items()},
                           prompt=self.prompt, off_steps=self.off_steps.below(self.n))


@dataclass
class OffSteps:
    """The positions of a state not computed as one-position steps compute them.

    Attributes:
        passes: its prompt's passes ``(start, end)`` (positions ``start .. end-1``) that ran on another path than the
            kernels (the torch path's GEMMs: their numbers depend on the pass), in order. The same pass of another
            prompt over the same tokens computes the same numbers.
        unmatched_from: the first position computed otherwise and matched by no prompt's pass (a decode-time pass
            off the kernels, layers catching up over positions the layers below computed before, keys and values
            taken from another model), None: none.
    """

    passes: list[tuple[int, int]] = field(default_factory=list)
    unmatched_from: int | None = None

    @property
    def none(self) -> bool:
        return not self.passes and self.unmatched_from is None

    def note(self, start: int, end: int, prompt_pass: bool) -> None:
        """A pass over positions ``start .. end-1`` ran off the kernels (a prompt's pass, or another)."""
        if prompt_pass:
            if (start, end) not in self.passes:
                self.passes.append((start, end))
        else:
            self.unmatched(start)

    def unmatched(self, start: int) -> None:
        """Positions from ``start`` on hold numbers no prompt's own pass gives."""
        self.unmatched_from = start if self.unmatched_from is None else min(self.unmatched_from, start)

    def below(self, n: int) -> "OffSteps":
        """The record of positions ``0 .. n-1`` alone (a state cropped or copied to ``n`` positions): a pass that
        ran past ``n`` matches no prompt's pass any more (positions from ``n`` on will be computed anew)."""
        out = OffSteps([(a, b) for a, b in self.passes if b <= n],
                       self.unmatched_from if self.unmatched_from is not None and self.unmatched_from < n else None)
        for a, b in self.passes:
            if a < n < b:
                out.unmatched(a)
        return out

    def first_within(self, start: int, end: int) -> int | None:
        """The first position of ``start .. end-1`` computed off the steps, None: every one as steps compute it."""
        hits = [max(a, start) for a, b in self.passes if a < end and b > start]
        if self.unmatched_from is not None and self.unmatched_from < end:
            hits.append(max(self.unmatched_from, start))
        return min(hits) if hits else None

    def computed_by(self, start: int, end: int) -> bool:
        """Whether positions ``start .. end-1`` were computed by one pass over exactly them off the kernels (and
        by nothing else since)."""
        return ((start, end) in self.passes and (self.unmatched_from is None or self.unmatched_from >= end)
                and not any(a < end and b > start and (a, b) != (start, end) for a, b in self.passes))


@dataclass
class Rows:
    """One sequence's rows of a pass: hidden ``x`` ``[m, d]`` at positions ``start .. start+m-1`` of ``st``, with
    their rotary tables ``cos``/``sin`` ``[1, m, head_dim]``."""

    x: torch.Tensor
    st: DecodeState
    start: int
    cos: torch.Tensor
    sin: torch.Tensor


@dataclass
class KeptHead:
    """An engine's keys, values and residual streams of a prompt head (the positions ``0 .. n-1`` of its tokens),
    computed by layers ``0 .. upto-1``: ``k``/``v`` per layer ``[1, n_kv, n, head_dim]``, ``resid`` boundary ->
    ``[n, d]``; ``off_steps``: that of the state they were kept of (:attr:`DecodeState.off_steps`)."""

    tokens: torch.Tensor
    upto: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    resid: dict[int, torch.Tensor]
    off_steps: "OffSteps" = field(default_factory=lambda: OffSteps())
