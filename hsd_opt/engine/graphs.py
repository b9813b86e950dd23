"""Passes of the torch path replayed from CUDA graphs: every layer's kernels launched by the host at once.

On a GPU a decode step of a 7B model is a few milliseconds of weight reads, and the torch path launches some
thirty kernels per layer, each costing the host microseconds, so a step launched op by op can be bound by the
host rather than by memory. A CUDA graph records the kernels of a run of layers once and replays them with one
launch. A graph fixes every address and shape it was recorded with, so a recorded pass is keyed by its run of
layers ``l0 .. l1-1``, its number of positions ``m`` and the decode state whose caches it writes, and takes its
inputs in buffers of its own: the hidden ``x`` ``[m, d]``, the positions ``[m]`` and the rotary tables
``[1, m, head_dim]``, copied in before each replay. Inside, the layers are
:meth:`~hsd_opt.engine.torch_path.TorchPath.layer_static`: keys and values written at the positions, the
attention over the whole cache under the causal mask of the positions, so one recording serves every place in the
sequence. A state's recordings are dropped with the state.

Only passes that continue a sequence past its prompt, of at most :data:`MAX_POSITIONS` positions, are replayed
(decode steps, verify passes); a prompt's passes run op by op. Whether an engine replays is
:data:`~hsd_opt.engine.layered.CUDA_GRAPHS` (off unless set; ``HSD_CUDA_GRAPHS=1``). How a pass is recorded is a
function (:func:`cuda_graph`; :func:`calls_again` on a CPU, where the tests run it).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from hsd_opt.engine.ops import static_mask
from hsd_opt.engine.state import DecodeState
from hsd_opt.engine.torch_path import TorchPath

#: The most positions a replayed pass has (decode steps of one sequence, verify passes of up to 63 drafts).
MAX_POSITIONS = 64

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

    x: torch.Tensor          # [m, d] hidden in
    pos: torch.Tensor        # [m] positions (int64)
    steps: torch.Tensor      # [m] 0 .. m-1 (positions = start + steps)
    cos: torch.Tensor        # [1, m, head_dim]
    sin: torch.Tensor
    replay: Callable[[], None]
    out: torch.Tensor        # [m, d] hidden out, rewritten by each replay


class GraphedPasses:
    """Runs of layers of ``path`` replayed from recordings (see the module doc).

    Args:
        path: the torch path whose layers are recorded.
        record: how a pass is recorded (:func:`cuda_graph` on a GPU).
    """

    def __init__(self, path: TorchPath, record: Recorder = cuda_graph):
        self._path, self._record = path, record
        self._by_state: dict[int, dict[tuple[int, int, int], _Recorded]] = {}
        self.recorded = 0          #: passes recorded so far (each once per state, run of layers and size)

    @staticmethod
    def takes(start: int, m: int, prompt: int = 0) -> bool:
        """Whether a pass over ``m`` positions from ``start`` is replayed: it continues a sequence past its prompt
        (the first ``prompt`` positions, :attr:`DecodeState.prompt`: a prompt's passes vary in size and run once)
        and has at most :data:`MAX_POSITIONS` positions."""
        return start > 0 and start >= prompt and 0 < m <= MAX_POSITIONS

    def layers(self, l0: int, l1: int, x: torch.Tensor, st: DecodeState, start: int, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """Layers ``l0 .. l1-1`` on hidden ``x`` ``[m, d]`` at positions ``start .. start+m-1`` of ``st`` (each
        layer's cache written), replayed from the recording of this state, run and size (recorded on first use);
        the result is a tensor of its own."""
        m = x.shape[0]
        mine = self._by_state.get(id(st))
        if mine is None:
            mine = self._by_state[id(st)] = {}
            weakref.finalize(st, self._by_state.pop, id(st), None)   # its recordings go with it
        rec = mine.get((l0, l1, m))
        if rec is None:
            rec = mine[(l0, l1, m)] = self._new(l0, l1, x, st, start, cos, sin)
        else:
            rec.x.copy_(x)
            torch.add(rec.steps, start, out=rec.pos)
            rec.cos.copy_(cos)
            rec.sin.copy_(sin)
            rec.replay()
        return rec.out.clone()

    def _new(self, l0: int, l1: int, x: torch.Tensor, st: DecodeState, start: int, cos: torch.Tensor,
             sin: torch.Tensor) -> _Recorded:
        """Record layers ``l0 .. l1-1`` over ``x``'s positions of ``st`` and replay the recording once (this pass's
        output). The recording holds the state's caches, not the state, which may then be dropped."""
        path = self._path
        xs = x.to(path.dtype).clone()
        steps = torch.arange(x.shape[0], device=x.device)
        pos = steps + start
        cs, sn = cos.to(path.dtype).clone(), sin.to(path.dtype).clone()
        caches = [(st.k[l], st.v[l]) for l in range(l0, l1)]

        def run() -> torch.Tensor:
            h, mask = xs, static_mask(pos, caches[0][0].shape[2])
            for l, (k, v) in zip(range(l0, l1), caches):
                h = path.layer_static(l, h, k, v, pos, mask, cs, sn)
            return h

        replay, out = self._record(run)
        replay()
        self.recorded += 1
        return _Recorded(xs, pos, steps, cs, sn, replay, out)
