"""Timing an engine's passes as the runtime runs them: the one loop every cost measurement uses (the profiler's
costs and batch costs, re-timing at the speed of the moment, the load predictor's prompt passes).

A pass appends tokens to one or several decode states (untimed), advances them together to a boundary, reads the
last positions as the runtime reads them (greedy ids, or logits when sampling: :func:`pass_output`), and crops the
states back (untimed), so that the next pass starts from the same context. Times are wall seconds, the device's
queued work waited for (CUDA).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

from hsd_opt.engine.layered import pass_output
from hsd_opt.engine.state import DecodeState


def now() -> float:
    """``time.perf_counter()`` once the device's queued work is done (CUDA; nothing to wait for on a CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def time_pass(eng, work: Sequence[tuple[DecodeState, torch.Tensor]], boundary: int, read: int | None = None,
              greedy: bool = True, many: bool | None = None) -> float:
    """Seconds of one pass of ``eng`` over the states of ``work``, each ``(state, token ids to append)``: the
    advance to ``boundary`` and the read of each state's last ``read`` positions (default: all it was given; the
    greedy ids, or the logits with ``greedy=False``), the appends and the crop back not timed. ``many``: advance
    and read the states together (``advance_many``, ``greedy_ids_many``/``logits_many``); None: together when
    there are several, alone (``advance``) for one, as the runtime does."""
    starts = [st.n for st, _ in work]
    for st, ids in work:
        eng.append(st, ids)
    reads = [(st, boundary, st.n - (read or len(ids)), st.n) for st, ids in work]
    together = len(work) > 1 if many is None else many
    t0 = now()
    if together:
        eng.advance_many([(st, boundary) for st, _ in work])
        (eng.greedy_ids_many if greedy else eng.logits_many)(reads)
    else:
        eng.advance(work[0][0], boundary)
        pass_output(eng, greedy)(*reads[0])
    dt = now() - t0
    for (st, _), n in zip(work, starts):
        eng.crop(st, n)
    return dt


def median_pass(eng, work: Sequence[tuple[DecodeState, torch.Tensor]], boundary: int, repeats: int,
                warmup: int = 1, read: int | None = None, greedy: bool = True, many: bool | None = None,
                between: Callable[[], None] | None = None) -> float:
    """The median of ``repeats`` :func:`time_pass` timings after ``warmup`` untimed ones (``between`` called after
    each pass, e.g. to report progress)."""
    times = []
    for r in range(warmup + repeats):
        dt = time_pass(eng, work, boundary, read, greedy, many)
        if r >= warmup:
            times.append(dt)
        if between is not None:
            between()
    return statistics.median(times)
