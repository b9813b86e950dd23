"""Costs of passes over several sequences (``hsd profile --batch-sizes``; `docs/design.md#serving-under-load`).

For each engine and batch size ``B`` the profile records the ratio ``r_B(t)`` of the seconds of one pass over ``B``
sequences of ``t`` new tokens each to the seconds of a pass over one sequence of ``t`` tokens, timed as the batch
scheduler runs passes (:meth:`~hsd_opt.engine.interface.Engine.advance_many` to the engine's last layer, then the
reads the runtime makes: ``greedy_ids_many``, or ``logits_many`` when sampling). ``B`` states are prefilled with
``context`` tokens of real text once; rounds then go over every ``t`` of the grid (1, 2, 4, ... tmax + 1) and, for
each, every ``B`` (1 among them) back to back, appending ``t`` tokens to each state, timing the pass and cropping
back, so the two timings of a ratio are a moment apart and a slow spell of a shared machine hits both alike.
Medians per ``(B, t)``, made non-decreasing in ``t``, interpolated linearly between grid points; the ratios follow.
An engine's exits take its ratios, a token drafter's ratio is ``B`` (it proposes for one sequence at a time).
Units: seconds; ratios are plain numbers.
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch

from hsd_opt.engine.interface import Engine
from hsd_opt.engine.timing import time_pass
from hsd_opt.profiler.costs import isotonic, t_grid
from hsd_opt.prompts import text_of_length


def _interpolate(grid: Sequence[int], values: Sequence[float], n: int) -> list[float]:
    """Values on ``grid`` (increasing pass sizes) linearly interpolated at t = 1..n."""
    out = []
    for t in range(1, n + 1):
        j = next((i for i, g in enumerate(grid) if g >= t), len(grid) - 1)
        if grid[j] == t or j == 0:
            out.append(values[j])
        else:
            g0, g1 = grid[j - 1], grid[j]
            out.append(values[j - 1] + (values[j] - values[j - 1]) * (t - g0) / (g1 - g0))
    return out


def measure_batch_costs(eng: Engine, batch_sizes: Sequence[int], tmax: int, text: Sequence[int],
                        context: int = 64, repeats: int = 5, warmup: int = 1, greedy: bool = True,
                        on_step: Callable[[str], None] | None = None) -> dict[int, tuple[list[float], list[float]]]:
    """``{B: (ratio over t = 1..tmax+1, seconds of the batched pass over t = 1..tmax+1)}`` for every ``B > 1`` of
    ``batch_sizes``, timed on ``eng`` (see the module doc)."""
    sizes = sorted(set(int(b) for b in batch_sizes) | {1})
    tmax1 = tmax + 1
    grid = t_grid(tmax1)
    n = context + tmax1 + 1
    most = max(sizes)
    states = []
    for i in range(most):          # each sequence its own stretch of text
        ids = torch.tensor(text_of_length(list(text[i * 7:]) + list(text[:i * 7]), n))
        st = eng.new_state(n + 1)
        eng.append(st, ids[:context])
        eng.advance(st, eng.n_layers)
        states.append((st, ids))
    times: dict[tuple[int, int], list[float]] = {}
    for r in range(warmup + repeats):
        for t in grid:            # every batch size of one t back to back: a ratio's two timings a moment apart
            for b in sizes:
                work = [(st, ids[context:context + t]) for st, ids in states[:b]]
                dt = time_pass(eng, work, eng.n_layers, greedy=greedy, many=True)
                if r >= warmup:
                    times.setdefault((b, t), []).append(dt)
        if on_step:
            on_step(f"round {r + 1} of {warmup + repeats}")
    secs = {b: _interpolate(grid, isotonic([statistics.median(times[b, t]) for t in grid]), tmax1) for b in sizes}
    return {b: ([s / s1 for s, s1 in zip(secs[b], secs[1])], secs[b]) for b in sizes if b > 1}
