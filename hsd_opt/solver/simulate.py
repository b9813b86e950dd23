"""Monte-Carlo of HSD under IID acceptance (HSD paper (arXiv 2510.19705), Algorithm 1): validates the latency
model (`docs/design.md#monte-carlo-check`).

Semantics (the runtime the model of `docs/design.md#the-latency-model` describes): the bottom level drafts
exactly ``T_0`` tokens per call (``T_0`` autoregressive steps); an intermediate level ``i`` calls the level below,
verifies the block of ``T_{i-1}`` drafts in one pass (``1 + min(G, T_{i-1})`` tokens kept, ``P(G >= m) = a^m``,
the corrected or bonus token included), repeats until it holds at least ``T_i`` tokens and hands up exactly
``T_i`` (the excess is dropped, each call starts afresh); the target verifies one block per round and keeps
``1 + min(G, T_{n-1})`` tokens. Costs are those of :func:`~hsd_opt.solver.latency.verify_cost`; a round that
accepted the whole block also pays the level below's catch-up (:func:`~hsd_opt.solver.latency.catch_up_cost`).
A bottom drafter with ``draft_rate f < 1`` (at its budget: :meth:`~hsd_opt.formats.ModelEntry.rate_at`) proposes
its block in each round of the level above with probability ``f``; otherwise that round is one pass of the level
above over one token (one token kept) plus the drafter's failed call (its ``cost``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hsd_opt.formats import Profile
from hsd_opt.solver.latency import catch_up_cost, hierarchy_latency, verify_cost


@dataclass
class SimResult:
    """Simulated seconds per token ``latency`` with standard error ``stderr`` (ratio estimator over target
    rounds), the model's ``predicted`` seconds per token, ``rel_diff = latency / predicted - 1``, and the
    number of target ``rounds`` and generated ``tokens``."""

    latency: float
    stderr: float
    predicted: float
    rel_diff: float
    rounds: int
    tokens: int


def _tokens_per_round(rng: np.random.Generator, a: float, t: int, size: int) -> np.ndarray:
    """``1 + min(G, t)`` with ``P(G >= m) = a^m``, shape ``(size,)``."""
    if a >= 1.0:
        return np.full(size, t + 1)
    g = rng.geometric(1.0 - a, size) - 1
    return 1 + np.minimum(g, t)


def _rounds_over(rng, level: int, M: int, T, acc, vcost, c0, f, v_step, catch) -> tuple[np.ndarray, np.ndarray]:
    """``M`` rounds of ``level`` (1..n) over the level below: ``(tokens kept (M,), seconds (M,))``."""
    t, a = T[level - 1], acc[level - 1]
    toks = _tokens_per_round(rng, a, t, M)
    secs = vcost[level - 1] + _block_times(rng, level - 1, M, T, acc, vcost, c0, f, v_step, catch)
    secs = secs + np.where(toks == t + 1, catch[level - 1], 0.0)     # the whole block accepted
    if level == 1 and f < 1.0:   # the bottom abstained: a plain step of this level and the drafter's call
        off = rng.random(M) >= f
        toks[off] = 1
        secs[off] = v_step + c0
    return toks, secs


def _block_times(rng, level: int, M: int, T, acc, vcost, c0, f, v_step, catch) -> np.ndarray:
    """Seconds for ``M`` independent calls of ``level`` to hand up a block of ``T[level]`` tokens, shape (M,)."""
    if level == 0:
        return np.full(M, T[0] * c0)
    need = T[level]
    have = np.zeros(M, dtype=np.int64)
    secs = np.zeros(M)
    active = np.arange(M)
    while active.size:
        k, c = _rounds_over(rng, level, active.size, T, acc, vcost, c0, f, v_step, catch)
        have[active] += k
        secs[active] += c
        active = active[have[active] < need]
    return secs


def simulate(profile: Profile, hierarchy: Sequence[str], budgets: Sequence[int], rounds: int = 20000,
             seed: int = 0, chunk: int = 2000) -> SimResult:
    """Simulate ``rounds`` target verify rounds of HSD with ``hierarchy``/``budgets`` (numpy RNG ``seed``).

    ``chunk`` target rounds are simulated at once (memory grows with chunk times the rounds per round).
    """
    predicted = hierarchy_latency(profile, hierarchy, budgets)    # also validates the hierarchy (a list of names)
    hierarchy, budgets = list(hierarchy), list(budgets)
    budgets = [int(b) for b in budgets]
    rng = np.random.default_rng(seed)
    n = len(hierarchy) - 1
    if n == 0:
        return SimResult(predicted, 0.0, predicted, 0.0, rounds, rounds)
    acc = [profile.accept(lo, hi) for lo, hi in zip(hierarchy[:-1], hierarchy[1:])]
    # vcost[i-1]: level i (1..n, n = target) verifying a block of budgets[i-1] drafts of level i-1
    vcost = [verify_cost(profile, hierarchy[i], hierarchy[i - 1], budgets[i - 1] + 1) for i in range(1, n + 1)]
    c0 = profile.entry(hierarchy[0]).cost
    f = profile.entry(hierarchy[0]).rate_at(budgets[0])
    v_step = verify_cost(profile, hierarchy[1], hierarchy[0], 1)      # level 1's pass when the bottom abstains
    catch = [catch_up_cost(profile, hierarchy[i - 1], hierarchy[i]) for i in range(1, n + 1)]
    times, toks = [], []
    done = 0
    while done < rounds:
        M = min(chunk, rounds - done)
        k, c = _rounds_over(rng, n, M, budgets, acc, vcost, c0, f, v_step, catch)
        times.append(c)
        toks.append(k)
        done += M
    t = np.concatenate(times)
    k = np.concatenate(toks).astype(float)
    L = t.sum() / k.sum()
    se = float(np.std(t - L * k, ddof=1) / np.sqrt(len(t)) / k.mean()) if len(t) > 1 else float("nan")
    return SimResult(float(L), se, predicted, float(L / predicted - 1.0), int(rounds), int(k.sum()))
