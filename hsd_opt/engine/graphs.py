"""Passes of the torch path replayed from CUDA graphs: every layer's kernels launched by the host at once.

On a GPU a decode step of a 7B model is a few milliseconds of weight reads, and the torch path launches some
thirty kernels per layer, each costing the host microseconds, so a step launched op by op can be bound by the
host rather than by memory. A CUDA graph records the kernels of a run of layers once and replays them with one
launch. A graph fixes every address and shape it was recorded with, and the passes it records are the
fixed-shape passes of :mod:`hsd_opt.engine.fixed` (every decode step and verify pass of one sequence computed over
:data:`~hsd_opt.engine.fixed.ROWS` rows, each query attending over a length that depends on its position alone), so
one recording serves every pass of a sequence with the same attention lengths, whatever its number of positions:
a recording is keyed by the decode state whose caches it writes, its run of layers ``l0 .. l1-1`` and those
lengths, and takes its inputs in buffers of its own (the hidden ``[ROWS, d]``, the positions ``[ROWS]`` and the
rotary tables ``[1, ROWS, head_dim]``), copied in before each replay. A replayed pass computes what the same pass
computes op by op, bit for bit. A state keeps its :data:`KEPT` most recently used recordings, and they are dropped
with the state. Where a pass cannot be recorded (an operation the device cannot capture), the engine says so once
and computes its passes op by op: the same numbers.

Where the path's attention is Triton's (:mod:`hsd_opt.engine.triton_attention`), where each row reads and writes
is data (the pass's tables), so one recording per run of layers, with the tables among its buffers (padded to their
largest shapes), replays every pass of every sequence and every batch's pass of several sequences
(:meth:`GraphedPasses.many`); it holds no state's caches.

Only the fixed-shape passes (:func:`~hsd_opt.engine.fixed.takes`: after the prompt, at most
:data:`~hsd_opt.engine.fixed.ROWS` positions) are replayed; a prompt's passes run op by op. Whether an engine replays is
:data:`~hsd_opt.engine.layered.CUDA_GRAPHS` (off unless set; ``HSD_CUDA_GRAPHS=1``). How a pass is recorded is a
function (:func:`cuda_graph`; :func:`calls_again` on a CPU, where the tests run it).
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from hsd_opt.engine import fixed, triton_attention
from hsd_opt.engine.state import DecodeState, Rows
from hsd_opt.engine.torch_path import TorchPath

#: Recordings a decode state keeps (the most recently used; a sequence needs those of its runs of layers at its
#: current attention length, and a pass straddling the next).
KEPT = 16

#: ``record(fn) -> (replay, out)``: ``fn`` recorded so that ``replay()`` computes it again into ``out``.
Recorder = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def cuda_graph(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """``fn`` recorded as a CUDA graph (after two runs on a side stream, which make its allocations before the
    recording, as recording requires): ``(graph.replay, fn's output tensor)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def calls_again(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """``fn`` "recorded" by calling it again at each replay, into the tensor its first call returned: the same
    buffers and operations as a CUDA graph replays, on any device (what the tests run on a CPU)."""
    out = fn()
    return (lambda: out.copy_(fn())), out


@dataclass
class _Recorded:
    """One recorded pass and its input buffers."""

    x: torch.Tensor          # [ROWS, d] hidden in (the pass's rows first)
    pos: torch.Tensor        # [ROWS] positions (int64; the padding rows repeat the last; with Triton, tables.pos)
    cos: torch.Tensor        # [1, ROWS, head_dim]
    sin: torch.Tensor
    replay: Callable[[], None]
    out: torch.Tensor        # [ROWS, d] hidden out, rewritten by each replay
    tables: triton_attention.Tables | None = None    # the Triton attention's tables (padded), refilled per pass


class GraphedPasses:
    """Runs of layers of ``path`` replayed from recordings of fixed-shape passes (see the module doc).

    Args:
        path: the torch path whose layers are recorded.
        record: how a pass is recorded (:func:`cuda_graph` on a GPU).
    """

    def __init__(self, path: TorchPath, record: Recorder = cuda_graph):
        self._path, self._record = path, record
        self._by_state: dict[int, OrderedDict[tuple[int, int, int, int], _Recorded]] = {}
        self._shared: dict[tuple[int, int], _Recorded] = {}     # (l0, l1) -> a recording of every pass (Triton)
        self.recorded = 0          #: passes recorded so far (each once per state, run of layers and lengths)
        #: why recording failed (the engine then computes its passes op by op: the same numbers), or None
        self.failed: str | None = None

    def layers(self, l0: int, l1: int, x: torch.Tensor, st: DecodeState, start: int, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor | None:
        """Layers ``l0 .. l1-1`` on hidden ``x`` ``[m, d]`` at positions ``start .. start+m-1`` of ``st`` (each
        layer's cache written; ``m`` at most :data:`~hsd_opt.engine.fixed.ROWS`), replayed from the recording of
        this state, run and attention lengths (recorded on first use; a state keeps its :data:`KEPT` most recently
        used); the result is a tensor of its own. None, having computed nothing, where a recording failed (now or
        before: :attr:`failed`, said once as a warning): the caller computes the pass op by op."""
        if self._path.triton_attention:
            out = self.many(l0, l1, [Rows(x, st, start, cos, sin)])
            return None if out is None else out[0]
        if self.failed is not None:
            return None
        m = x.shape[0]
        key = (l0, l1, fixed.attended(start), fixed.attended(start + m - 1))
        mine = self._by_state.get(id(st))
        if mine is None:
            mine = self._by_state[id(st)] = OrderedDict()
            weakref.finalize(st, self._by_state.pop, id(st), None)   # its recordings go with it
        rec = mine.get(key)
        if rec is None:
            try:
                rec = self._new(key, x, st, start, cos, sin)
            except RuntimeError as e:    # a kernel that cannot be recorded; the pass is computed op by op
                self._fail(e)
                return None
            mine[key] = rec
            if len(mine) > KEPT:
                mine.popitem(last=False)
        else:
            mine.move_to_end(key)
            rec.x[:m].copy_(x)
            fixed.positions(start, m, rec.pos.device, out=rec.pos)
            rec.cos[:, :m].copy_(cos)
            rec.sin[:, :m].copy_(sin)
            rec.replay()
        return rec.out[:m].clone()

    def _fail(self, e: Exception) -> None:
        """Recording failed: say so once; every pass is then computed op by op."""
        self.failed = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        self._by_state.clear()
        self._shared.clear()
        warnings.warn(f"CUDA graphs: recording a pass failed ({self.failed}); this engine computes its passes op "
                      "by op (the same numbers, slower)", RuntimeWarning, stacklevel=3)

    def many(self, l0: int, l1: int, parts: list[Rows]) -> list[torch.Tensor] | None:
        """Layers ``l0 .. l1-1`` over the rows of several sequences (at most :data:`~hsd_opt.engine.fixed.ROWS` in
        all, each after its prompt) in one fixed-shape pass, where the path's attention is Triton's
        (:attr:`~hsd_opt.engine.torch_path.TorchPath.triton_attention`): the pass's composition is then data (its
        tables, padded to their largest shapes), so one recording of the run of layers replays every pass of every
        sequence and batch, its inputs and tables copied in. Each sequence's new hidden states, or None, having
        computed nothing, where a recording failed (the caller computes the pass op by op)."""
        if self.failed is not None:
            return None
        sizes = [p.x.shape[0] for p in parts]
        path = self._path
        tables = triton_attention.of_rows(parts, l0, l1, padded=True)
        x, cos, sin = (t.to(path.dtype) for t in fixed.stacked(parts))
        rec = self._shared.get((l0, l1))
        if rec is None:
            buf = tables.buffers()                 # a copy of this pass's tables, refilled by later passes
            bufs = _Recorded(x.clone(), buf.pos, cos.clone(), sin.clone(), lambda: None, x, buf)

            def run() -> torch.Tensor:     # no parts: the tables (buffers) say where each row goes
                return path.fixed_layers(l0, l1, bufs.x, bufs.pos, bufs.cos, bufs.sin, [], bufs.tables)

            try:
                bufs.replay, bufs.out = self._record(run)
            except RuntimeError as e:
                self._fail(e)
                return None
            self.recorded += 1
            rec = self._shared[(l0, l1)] = bufs
        else:
            for buf, new in ((rec.x, x), (rec.cos, cos), (rec.sin, sin)):
                buf.copy_(new)
            rec.tables.copy_(tables)          # the positions with them
        rec.replay()
        return list(rec.out[:sum(sizes)].clone().split(sizes))

    def _new(self, key: tuple[int, int, int, int], x: torch.Tensor, st: DecodeState, start: int,
             cos: torch.Tensor, sin: torch.Tensor) -> _Recorded:
        """Record layers ``l0 .. l1-1`` (``key``: those and the two attention lengths) over ``x``'s positions of
        ``st`` and replay the recording once (this pass's output). The recording holds the state's caches, not the
        state, which may then be dropped."""
        l0, l1, lo, hi = key
        path, m = self._path, x.shape[0]
        xs = fixed.pad(x.to(path.dtype), 0).clone()
        pos = fixed.positions(start, m, x.device)
        cs, sn = (fixed.pad(t.to(path.dtype), 1).clone() for t in (cos, sin))
        k, v = st.k[l0:l1], st.v[l0:l1]

        def run() -> torch.Tensor:
            return path.fixed_layers(l0, l1, xs, pos, cs, sn, [fixed.one_sequence(k, v, pos, lo, hi)])

        replay, out = self._record(run)
        replay()
        self.recorded += 1
        return _Recorded(xs, pos, cs, sn, replay, out)
