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
        stepwise: every position held was computed as one-position steps compute it (on the decode kernels, whose
            passes are batch-invariant), so its keys and values are a function of the tokens up to it alone and a
            later sequence starting with those tokens may take them (False once a pass of another path, or keys
            and values taken from another model, touched it; True again when cropped to nothing).
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
    stepwise: bool = True

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
                           prompt=self.prompt, stepwise=self.stepwise)


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
    ``[n, d]``; ``stepwise``: that of the state they were kept of (:attr:`DecodeState.stepwise`)."""

    tokens: torch.Tensor
    upto: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    resid: dict[int, torch.Tensor]
    stepwise: bool = True
