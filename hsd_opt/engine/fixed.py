"""Fixed-shape passes of the torch path: a decode step computes, bit for bit, what a verify pass computes.

A matrix product over ``m`` rows rounds each row by a blocking that the library chooses from ``m`` (cuBLAS and MKL
pick other kernels, tiles and splits of the sum for one row than for eight), and so do the reductions of a norm
and the attention's sums over the keys, whose length grows with the sequence. So on the torch path a position
verified inside a pass of ``m`` drafts gets other logits than the same position computed by a step, and greedy
speculative decoding equals the target's own greedy decoding only up to near-ties. The kernels avoid this by
computing every row with the same operations (``docs/design.md#decode-kernels``); the torch path cannot choose
its kernels' blocking, but it can give every pass the same shapes:

- every pass after the prompt over at most :data:`ROWS` positions (decode steps, verify passes, and the rows of
  several sequences together) is computed over exactly :data:`ROWS` rows, the positions' rows first and finite
  padding after: every matrix product, norm and activation sees one shape, and a row's result does not depend on
  the other rows' values nor on its place among them (a matrix product, a norm and an attention at a fixed shape
  compute each row apart from the others, with the same operations: tested);
- a query at position ``p`` attends over the cache's first :func:`attended` ``(p)`` positions (``p + 1`` rounded
  up to a multiple of :data:`BLOCK`) under the causal mask, whichever pass computes it: a pass whose positions
  straddle a multiple of :data:`BLOCK` makes one attention call per length; keys past ``p`` weigh exactly
  zero, so whatever the cache holds beyond the sequence adds nothing;
- the LM head (and an exit's head) reads :data:`ROWS` rows too.

A state's capacity is then rounded up to a multiple of :data:`BLOCK` (:func:`capacity`). A prompt's passes (long,
run once, the same in every method) are computed as they are. The cost: a step's products compute :data:`ROWS`
rows instead of one, arithmetic that a GPU, bound by reading a large model's weights, has to spare
(``benchmarks/gpu_scale.py`` measures it) and a CPU has not (``benchmarks/fixed_shapes.py``): the torch path there
keeps each pass's own shapes, and the kernels are exact anyway.

Shapes: hidden ``[ROWS, d]``; positions ``[ROWS]`` (int64); caches ``[1, n_kv, max_len, head_dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from hsd_opt.engine.state import Rows
from hsd_opt.formats import EXACT_PASS

#: The rows of every fixed-shape pass: the most positions a verify pass has (:data:`~hsd_opt.formats.EXACT_PASS`).
ROWS = EXACT_PASS
#: Attention lengths are multiples of this many positions (:func:`attended`).
BLOCK = 256


def takes(start: int, m: int, prompt: int = 0) -> bool:
    """Whether a pass over ``m`` positions from ``start`` has a fixed shape: it continues a sequence past its prompt
    (the first ``prompt`` positions, :attr:`~hsd_opt.engine.state.DecodeState.prompt`) and has at most
    :data:`ROWS` positions."""
    return start > 0 and start >= prompt and 0 < m <= ROWS


def attended(p: int) -> int:
    """How many cache positions a query at position ``p`` attends over: ``p + 1`` rounded up to a multiple of
    :data:`BLOCK` (those past ``p`` masked)."""
    return (p // BLOCK + 1) * BLOCK


def capacity(max_len: int) -> int:
    """A state's capacity for ``max_len`` tokens with fixed-shape passes: rounded up to a multiple of
    :data:`BLOCK`, so that every :func:`attended` length fits."""
    return -(-max_len // BLOCK) * BLOCK


@dataclass
class Part:
    """One sequence's share of a fixed-shape pass.

    Attributes:
        k, v: its caches of the pass's layers, in order (``[1, n_kv, max_len, head_dim]`` each).
        src, dst: ``[w]`` int64: the keys and values of rows ``src`` of the pass are written at positions ``dst``
            (a row may repeat when its values are the same: padding rows copy the last position's).
        groups: ``(length, rows)`` attention calls in order: the rows' queries attend over the cache's first
            ``length`` positions; ``rows`` ``[ROWS, 1]`` bool says which rows take this call's output (None: all,
            the first call of the only part).
    """

    k: Sequence[torch.Tensor]
    v: Sequence[torch.Tensor]
    src: torch.Tensor
    dst: torch.Tensor
    groups: list[tuple[int, torch.Tensor | None]]


def fill(items: Sequence[int], sizes: Sequence[int], most: int = ROWS) -> list[list[int]]:
    """``items`` in order, in consecutive groups whose ``sizes`` (rows) sum to at most ``most`` each (an item
    larger than ``most`` alone): the fixed-shape passes a batch's rows take."""
    out: list[list[int]] = []
    total = most + 1
    for it, n in zip(items, sizes):
        if total + n > most:
            out.append([])
            total = 0
        out[-1].append(it)
        total += n
    return out


def positions(start: int, m: int, device: torch.device | str, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[ROWS]`` positions of a pass over ``start .. start+m-1``: the padding rows repeat the last (written into
    ``out`` where given: a recording's buffer)."""
    return torch.arange(start, start + ROWS, device=device, out=out).clamp_(max=start + m - 1)


def one_sequence(k: Sequence[torch.Tensor], v: Sequence[torch.Tensor], pos: torch.Tensor, lo: int, hi: int) -> Part:
    """The only part of a pass of one sequence whose caches of the pass's layers are ``k``/``v``, over positions
    ``pos`` (:func:`positions`: consecutive, then the last repeated): every row writes its keys and values (the
    padding rows the last position's again), and the queries attend over the first ``lo`` positions (:func:`attended`
    of the first position), then over ``hi`` (of the last) for the rows at ``lo`` or past it where the pass
    straddles that length. Built from ``pos`` by tensor operations alone, so a recording that rewrites ``pos``
    replays it for any pass with the same two lengths."""
    groups: list[tuple[int, torch.Tensor | None]] = [(lo, None)]
    if hi != lo:
        groups.append((hi, (pos >= lo).unsqueeze(1)))
    return Part(k, v, pos - pos[:1], pos, groups)


def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with its last entry along ``dim`` repeated up to :data:`ROWS` entries (finite padding)."""
    n = t.shape[dim]
    if n == ROWS:
        return t
    last = t.narrow(dim, n - 1, 1)
    return torch.cat([t, last.expand(*[ROWS - n if d == dim else -1 for d in range(t.dim())])], dim=dim)


def stacked(parts: Sequence[Rows]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hidden states ``[ROWS, d]`` and rotary tables ``[1, ROWS, head_dim]`` of a fixed-shape pass of several
    sequences' rows (at most :data:`ROWS` in all), one after the other, finite padding after."""
    total = sum(p.x.shape[0] for p in parts)
    if not 0 < total <= ROWS:
        raise ValueError(f"a fixed-shape pass holds 1..{ROWS} rows, not {total}")
    return (pad(torch.cat([p.x for p in parts]), 0), pad(torch.cat([p.cos for p in parts], dim=1), 1),
            pad(torch.cat([p.sin for p in parts], dim=1), 1))


def several(parts: Sequence[Rows], l0: int, l1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                 torch.Tensor, list[Part]]:
    """The fixed-shape pass of several sequences' rows (at most :data:`ROWS` in all), one after the other:
    ``(x [ROWS, d], pos [ROWS], cos, sin [1, ROWS, head_dim], parts)``; each sequence writes and reads its own
    cache, and each row takes the attention of its own sequence at its own length."""
    device = parts[0].x.device
    total = sum(p.x.shape[0] for p in parts)
    x, cos, sin = stacked(parts)
    if len(parts) == 1:                      # as a recording computes it
        p = parts[0]
        pos = positions(p.start, total, device)
        lo, hi = attended(p.start), attended(p.start + total - 1)
        return x, pos, cos, sin, [one_sequence(p.st.k[l0:l1], p.st.v[l0:l1], pos, lo, hi)]
    pos = pad(torch.cat([torch.arange(p.start, p.start + p.x.shape[0], device=device) for p in parts]), 0)
    row = torch.arange(ROWS, device=device).unsqueeze(1)
    out, o = [], 0
    for p in parts:
        m = p.x.shape[0]
        lo, hi = attended(p.start), attended(p.start + m - 1)
        mine = (row >= o) & (row < o + m)
        groups: list[tuple[int, torch.Tensor | None]] = [(lo, mine)]
        if hi != lo:                         # the rows past the first length take the second
            groups.append((hi, mine & (pos >= lo).unsqueeze(1)))
        out.append(Part(p.st.k[l0:l1], p.st.v[l0:l1], torch.arange(o, o + m, device=device),
                        torch.arange(p.start, p.start + m, device=device), groups))
        o += m
    return x, pos, cos, sin, out


def masks(pos: torch.Tensor, parts: Sequence[Part]) -> dict[int, torch.Tensor]:
    """The causal masks ``[ROWS, length]`` of positions ``pos`` for every attention length of ``parts`` (computed
    once per pass, shared by its layers): row ``i`` may attend to key positions ``<= pos[i]``."""
    lengths = sorted({n for p in parts for n, _ in p.groups})
    return {n: torch.arange(n, device=pos.device).unsqueeze(0) <= pos.unsqueeze(1) for n in lengths}
