"""The attention of a fixed-shape pass in two Triton kernels per layer, whatever number of sequences shares the pass.

A fixed-shape pass (:mod:`hsd_opt.engine.fixed`) may hold the rows of many sequences: a batch's decode step of 32
sequences is one pass of 32 real rows. The layers' matrix products read each weight once for all of them, but op by
op every sequence writes its keys and values and calls the attention over its own cache: over a dozen operators
per sequence and layer (counted in ``docs/results.md``), each a kernel the host launches, so such a step is bound by
launches long before it is bound by the weights. Here a layer's attention is two kernels for the whole pass:

- the rows of the pass come in blocks of up to :data:`BLOCK_M` consecutive rows of one sequence (:func:`tables`;
  the caches' addresses come from a table, each sequence keeping its own cache tensors);
- one kernel writes every block's keys and values at its rows' positions of its sequence's caches;
- the other, one program per block and query head, reads that sequence's keys and values in blocks of
  :data:`BLOCK_N` positions from position 0 (an online softmax in float32) up to the block of the block's last
  position, each row masked to keys at or before its own position.

A row's output depends on its own query, its own position and its sequence's cache alone: a block of keys past a
row's position adds exactly nothing to it (its weights are exactly zero and its running maximum and scale are
unchanged), and the products of a block compute each row apart from the others. So a row gets, bit for bit, the
same output alone, in a verify pass among its sequence's other rows, and among other sequences' rows: the
fixed-shape passes' property, now with two launches per layer. The numbers are not those of
``scaled_dot_product_attention`` (another order of the sums); an engine computes every fixed-shape pass one way.

Triton compiles for a GPU; on a CPU the kernels run in Triton's interpreter (NumPy, slow), which is what the tests
run. Whether an engine uses them is :data:`~hsd_opt.engine.layered.TRITON_ATTENTION` (``HSD_TRITON_ATTENTION=1``;
off until measured on a GPU at scale).

Shapes: queries ``[heads, ROWS, head_dim]``; new keys and values ``[kv_heads, ROWS, head_dim]``; caches ``[1,
kv_heads, capacity, head_dim]`` (contiguous); the output ``[1, heads, ROWS, head_dim]``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from hsd_opt.engine.fixed import ROWS
from hsd_opt.engine.kernels import cache_ptrs
from hsd_opt.engine.state import Rows
from hsd_opt.errors import HsdError

#: Rows of one sequence per attention program (the least a Triton matrix product takes).
BLOCK_M = 16
#: Cache positions per step of an attention program's loop.
BLOCK_N = 64


def unavailable(device: torch.device) -> str | None:
    """Why the kernels cannot run on ``device`` (Triton not installed, or a device that is neither CUDA nor a CPU),
    or None."""
    if device.type not in ("cuda", "cpu"):
        return f"Triton attention runs on CUDA (or a CPU, interpreted), not {device.type}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (pip install triton; CUDA builds of torch bring it)"
    return None


@lru_cache(maxsize=None)
def _kernels(interpreted: bool):
    """The two kernels (:mod:`hsd_opt.engine.triton_kernels`), compiled by Triton, or where ``interpreted`` (a CPU)
    run by its interpreter, which Triton only allows when ``TRITON_INTERPRET=1`` was set before it was imported."""
    if interpreted and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise HsdError("Triton attention on a CPU runs in Triton's interpreter: start with TRITON_INTERPRET=1 "
                       "(it is for tests; on a CPU the torch path's own attention is faster)")
    from hsd_opt.engine import triton_kernels

    return triton_kernels.write_rows, triton_kernels.attend_rows


@dataclass
class Tables:
    """Where each row of a fixed-shape pass writes and reads, for its run of layers: views of one int64 device
    tensor (``packed``), made by one copy from the host per pass (a recording keeps its own, refilled by one copy).

    Attributes:
        blocks: ``[n, 4]``: the programs' blocks of rows, ``(sequence, first row, rows, the sequence's first
            row)``: up to :data:`BLOCK_M` consecutive rows of one sequence each (a row in no block writes nothing
            and its attention is zero). A row writes the keys and values of the sequence's row that holds its
            position (consecutive from the sequence's first row): itself, but for a one-sequence pass's padding
            rows, which repeat the last position and write the last real row's.
        k, v: ``[layers, sequences]``: the addresses of each sequence's key and value caches per layer.
        head_stride: ``[sequences]``: elements from one key-value head to the next in a sequence's cache (its
            capacity times the head size).
        pos: ``[ROWS]``: each row's position (the padding rows repeating the last).
        packed: the tensor all of them view.
    """

    blocks: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    head_stride: torch.Tensor
    pos: torch.Tensor
    packed: torch.Tensor

    @staticmethod
    def of(packed: torch.Tensor, blocks: int, layers: int, seqs: int) -> "Tables":
        """The tables viewing ``packed`` (``blocks * 4 + 2 * layers * seqs + seqs + ROWS`` entries, in that
        order)."""
        parts = packed.split([blocks * 4, layers * seqs, layers * seqs, seqs, ROWS])
        return Tables(parts[0].view(blocks, 4), parts[1].view(layers, seqs), parts[2].view(layers, seqs), parts[3],
                      parts[4], packed)

    def buffers(self) -> "Tables":
        """A copy of these tables (a recording's buffers, refilled by :meth:`copy_`)."""
        return Tables.of(self.packed.clone(), self.blocks.shape[0], self.k.shape[0], self.k.shape[1])

    def copy_(self, other: "Tables") -> None:
        """Fill these tables (a recording's buffers) with ``other``'s, of the same shapes (both padded)."""
        self.packed.copy_(other.packed)


def of_rows(parts: Sequence[Rows], l0: int, l1: int, padded: bool = False) -> Tables:
    """The tables of a fixed-shape pass over layers ``l0 .. l1-1`` of several sequences' rows, one after the other
    (:func:`~hsd_opt.engine.fixed.stacked`): each row of a sequence at its position from ``start``. The caches'
    addresses are a state's own, checked and taken once (:attr:`~hsd_opt.engine.state.DecodeState.cache_ptrs`, as
    the CPU kernels take them, and as one array, ``cache_table``)."""
    for p in parts:
        if p.st.cache_table is None:
            if p.st.cache_ptrs is None:
                _check(p.st.k + p.st.v)
                p.st.cache_ptrs = (cache_ptrs(p.st.k), cache_ptrs(p.st.v))
            p.st.cache_table = np.stack([np.frombuffer(a, dtype=np.int64) for a in p.st.cache_ptrs])
    addrs = np.stack([p.st.cache_table for p in parts], 2)[:, l0:l1]        # [2, layers, sequences]
    positions = [q for p in parts for q in range(p.start, p.start + p.x.shape[0])]
    return _packed(addrs, [p.st.k[0].stride(1) for p in parts], [p.x.shape[0] for p in parts], positions, padded,
                   parts[0].st.k[0].device)


def tables(caches: Sequence[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]], rows: Sequence[int],
           positions: Sequence[int], padded: bool = False) -> Tables:
    """The tables of a pass whose sequences, in order, have caches ``(k, v)`` (one tensor per layer of the run,
    ``[1, kv_heads, capacity, head_dim]`` contiguous) and ``rows`` consecutive rows each (a one-sequence pass:
    all :data:`~hsd_opt.engine.fixed.ROWS`, its padding rows repeating its last position); the rows after theirs
    belong to no sequence. ``positions``: the rows' positions (the last repeated up to
    :data:`~hsd_opt.engine.fixed.ROWS`). ``padded``: at their largest shapes (:data:`~hsd_opt.engine.fixed.ROWS`
    blocks and sequences, the unused ones empty), whatever the pass holds: one recording then replays every pass."""
    _check([t for k, v in caches for t in (*k, *v)])
    addrs = np.array([[[t.data_ptr() for t in kv[side]] for kv in caches] for side in (0, 1)],
                     dtype=np.int64).transpose(0, 2, 1)                       # [2, layers, sequences]
    return _packed(addrs, [k[0].stride(1) for k, _ in caches], rows, positions, padded, caches[0][0][0].device)


def _check(caches: Sequence[torch.Tensor]) -> None:
    """Refuse caches the kernels cannot address: each ``[1, kv_heads, capacity, head_dim]``, contiguous, of one
    dtype."""
    for t in caches:
        if not t.is_contiguous() or t.dim() != 4 or t.shape[0] != 1 or t.dtype != caches[0].dtype:
            raise ValueError("Triton attention reads caches [1, kv_heads, capacity, head_dim], contiguous, "
                             "of one dtype")


def _packed(addrs: np.ndarray, head_strides: Sequence[int], rows: Sequence[int], positions: Sequence[int],
            padded: bool, device: torch.device) -> Tables:
    """:func:`tables` from the sequences' key and value cache addresses (int64 ``[2, layers, sequences]``), head
    strides and rows, and the rows' positions (at most :data:`~hsd_opt.engine.fixed.ROWS`). Filled on the host by
    whole slices in NumPy (a pass's tables hold thousands of addresses at a 7B's shape; no torch operator runs),
    then copied to the device in one."""
    blocks: list[int] = []
    o = 0
    for s, n in enumerate(rows):
        for r in range(o, o + n, BLOCK_M):
            blocks += (s, r, min(BLOCK_M, o + n - r), o)
        o += n
    if o > ROWS:
        raise ValueError(f"a fixed-shape pass holds at most {ROWS} rows, not {o}")
    _, layers, n = addrs.shape
    n_blocks, n_seqs = (ROWS, ROWS) if padded else (len(blocks) // 4, n)
    cuda = device.type == "cuda"
    packed = torch.zeros(n_blocks * 4 + 2 * layers * n_seqs + n_seqs + ROWS, dtype=torch.int64, pin_memory=cuda)
    host = packed.numpy()
    a = n_blocks * 4
    host[:len(blocks)] = blocks
    host[a:a + layers * n_seqs].reshape(layers, n_seqs)[:, :n] = addrs[0]
    a += layers * n_seqs
    host[a:a + layers * n_seqs].reshape(layers, n_seqs)[:, :n] = addrs[1]
    a += layers * n_seqs
    host[a:a + n] = head_strides
    host[a + n_seqs:a + n_seqs + len(positions)] = positions
    host[a + n_seqs + len(positions):] = positions[-1]
    if cuda:     # one copy, not waiting for the device's queue
        packed = packed.to(device, non_blocking=True)
    return Tables.of(packed, n_blocks, layers, n_seqs)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tab: Tables, layer: int) -> torch.Tensor:
    """Layer ``layer`` (of the tables' run) of a fixed-shape pass: writes keys ``k`` and values ``v`` ``[kv_heads,
    ROWS, head_dim]`` of each row at its position (``tab.pos``) of its sequence's caches, then gives the attention
    of queries ``q`` ``[heads, ROWS, head_dim]`` over them: ``[1, heads, ROWS, head_dim]`` (zero where a row has no
    sequence)."""
    heads, rows, hd = q.shape
    kv = k.shape[0]
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    write_rows, attend_rows = _kernels(q.device.type == "cpu")
    hd_p = max(16, 1 << (hd - 1).bit_length())
    grid = (tab.blocks.shape[0],)
    if q.device.type == "cpu":   # the interpreter runs each program in Python: only the blocks with rows (a prefix)
        grid = (int(torch.count_nonzero(tab.blocks[:, 2])),)
    write_rows[grid](k, v, tab.k[layer], tab.v[layer], tab.head_stride, tab.pos, tab.blocks,
                     k.stride(0), k.stride(1), v.stride(0), v.stride(1), KV=kv, HD=hd, HD_P=hd_p, BM=BLOCK_M)
    out = torch.zeros(rows, heads, hd, dtype=q.dtype, device=q.device)
    attend_rows[(grid[0], heads)](q, out, tab.k[layer], tab.v[layer], tab.head_stride, tab.pos, tab.blocks,
                                  q.stride(0), q.stride(1), out.stride(1), out.stride(0), 1.0 / math.sqrt(hd),
                                  heads // kv, HD=hd, HD_P=hd_p, BM=BLOCK_M, BN=BLOCK_N,
                                  F32=q.device.type == "cpu" or q.dtype == torch.float32)
    return out.permute(1, 0, 2).unsqueeze(0)
