"""A profile turned into the arrays the solvers share (the data of the GSP graph, DESIGN.md section 4).

Rules (the same for every solver):

- drafters are every model but the target, ordered by ``(cost, list index)``; only drafters before the target
  in that order (cheaper, ties by list order) may be used, so every hierarchy is strictly cheaper going down;
- ``i`` verifies ``k`` (edge ``(i, j) -> (k, l)``) only if ``k`` comes before ``i`` in that order,
  ``acceptance[k][i]`` is measured and ``i`` can verify; the target verifies ``i`` if ``acceptance[i][target]``
  is measured. A drafter with ``can_verify: false`` therefore only appears at the bottom;
- budgets: ``l <= j`` on every verify edge, i.e. ``1 <= T_0 <= ... <= T_{n-1} <= tmax``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hsd_opt.errors import HsdError
from hsd_opt.formats import Profile
from hsd_opt.solver.latency import gamma_table, target_rate, verify_cost_row


def cost_order(profile: Profile) -> list[str]:
    """All model names ordered by ``(cost, list index)``: cheapest first."""
    idx = {m.name: i for i, m in enumerate(profile.models)}
    return sorted(profile.names, key=lambda n: (profile.entry(n).cost, idx[n]))


def source_candidates(profile: Profile) -> list[str]:
    """Drafters the target may verify directly: before the target in :func:`cost_order`, acceptance measured."""
    order = cost_order(profile)
    K = profile.target
    return [n for n in order[: order.index(K)] if profile.accept(n, K) is not None]


@dataclass
class Instance:
    """Arrays of one (profile, tmax) problem. ``D`` drafters (``names``, cheapest first), budgets 1..tmax.

    Attributes:
        names: drafter names in cost order (index = drafter id); the target is not among them.
        target: the target's name; ``cK`` its scalar cost (seconds).
        cost: ``(D,)`` seconds per autoregressive step (the bottom level pays ``T_0 * cost``).
        can_verify: ``(D,)`` bool.
        below: ``below[i]`` = int array of the drafters ``i`` may verify (ascending).
        gam: ``gam[i]`` = ``(len(below[i]), tmax, tmax)``, ``gamma(a[k][i], l, j)`` at ``[kk, l-1, j-1]``.
        vcost: ``vcost[i]`` = ``(len(below[i]), tmax)`` seconds for ``i`` to verify a block of ``l`` drafts of k.
        src: int array of drafters the target may verify.
        src_rate: ``(len(src), tmax)``: ``R = (1-a)/(1-a^(j+1))``, target passes per token with budget j.
        src_cost: ``(len(src), tmax)`` seconds of one target pass over a block of j drafts.
    """

    names: list[str]
    target: str
    cK: float
    tmax: int
    cost: np.ndarray
    can_verify: np.ndarray
    below: list[np.ndarray]
    gam: list[np.ndarray]
    vcost: list[np.ndarray]
    src: np.ndarray
    src_rate: np.ndarray
    src_cost: np.ndarray


def build_instance(profile: Profile, tmax: int) -> Instance:
    """Precompute gamma tables and edge costs. O(D^2 tmax^2) numbers; raises :class:`HsdError` if tmax < 1."""
    if not isinstance(tmax, (int, np.integer)) or isinstance(tmax, bool) or tmax < 1:
        raise HsdError(f"--tmax: expected an integer >= 1, got {tmax!r}")
    tmax = int(tmax)
    order = cost_order(profile)
    K = profile.target
    names = order[: order.index(K)]
    D = len(names)
    entries = [profile.entry(n) for n in names]
    cost = np.array([e.cost for e in entries], dtype=float)
    can_verify = np.array([e.can_verify for e in entries], dtype=bool)
    below: list[np.ndarray] = []
    pairs_a: list[float] = []
    for i in range(D):
        ks = []
        if can_verify[i]:
            for k in range(i):
                a = profile.accept(names[k], names[i])
                if a is not None:
                    ks.append(k)
                    pairs_a.append(a)
        below.append(np.array(ks, dtype=int))
    table = gamma_table(np.array(pairs_a), tmax) if pairs_a else np.zeros((0, tmax, tmax))
    gam, vcost = [], []
    p = 0
    for i in range(D):
        n = len(below[i])
        gam.append(table[p: p + n])
        p += n
        vc = np.full((n, tmax), cost[i])                      # scalar cost unless a curve or pair cost says
        if names[i] in profile.verify_cost or names[i] in profile.cost_curve:
            for kk, k in enumerate(below[i]):
                vc[kk] = verify_cost_row(profile, names[i], names[k], tmax)
        vcost.append(vc)
    src = np.array([i for i, n in enumerate(names) if profile.accept(n, K) is not None], dtype=int)
    js = np.arange(1, tmax + 1)
    src_rate = np.array([target_rate(profile.accept(names[i], K), js) for i in src]).reshape(len(src), tmax)
    src_cost = np.array([verify_cost_row(profile, K, names[i], tmax) for i in src]).reshape(len(src), tmax)
    return Instance(names, K, profile.entry(K).cost, tmax, cost, can_verify, below, gam, vcost,
                    src, src_rate, src_cost)
