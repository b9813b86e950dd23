"""A profile turned into the arrays the solvers share: the data of the GSP graph (`docs/design.md#the-graph`).

Rules (the same for every solver):

- drafters are every model but the target, ordered by ``(cost, list index)``
  (:func:`~hsd_opt.solver.hierarchy.cost_order`); only drafters before the target in that order (cheaper, ties
  by list order) may be used, so every hierarchy is strictly cheaper going down;
- ``i`` verifies ``k`` (edge ``(i, j) -> (k, l)``) only if ``k`` comes before ``i`` in that order,
  ``acceptance[k][i]`` is measured and ``i`` can verify; the target verifies ``i`` if ``acceptance[i][target]``
  is measured. A drafter with ``can_verify: false`` therefore only appears at the bottom;
- budgets: ``l <= j`` on every verify edge, i.e. ``1 <= T_0 <= ... <= T_{n-1} <= tmax``;
- a drafter with ``draft_rate f < 1`` (it abstains in a share ``1 - f`` of its calls; only a drafter that cannot
  verify, so only at the bottom; ``f`` at its budget ``l``, :meth:`~hsd_opt.formats.ModelEntry.rate_at`) makes the
  edges into it cost ``M v_i(l + 1) + U (v_i(1) + c_k)`` with
  multiplier ``M`` (:func:`~hsd_opt.solver.latency.round_counts`), and the source edge into it
  ``rate * (v_K + V) + add`` (:func:`~hsd_opt.solver.latency.top_rate`; `docs/design.md#abstaining-drafters`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hsd_opt.errors import HsdError
from hsd_opt.formats import Profile
from hsd_opt.solver.hierarchy import cost_order
from hsd_opt.solver.latency import gamma_table, rates_by_budget, round_cost, round_tables, top_rate, verify_cost


@dataclass
class Instance:
    """Arrays of one (profile, tmax) problem. ``D`` drafters (``names``, cheapest first), budgets 1..tmax.

    Attributes:
        names: drafter names in cost order (index = drafter id); the target is not among them.
        target: the target's name; ``cK`` its scalar cost (seconds).
        cost: ``(D,)`` seconds per autoregressive step (the bottom level pays ``T_0 * cost``).
        can_verify: ``(D,)`` bool.
        below: ``below[i]`` = int array of the drafters ``i`` may verify (ascending).
        gam: ``gam[i]`` = ``(len(below[i]), tmax, tmax)``, ``gamma(a[k][i], l, j)`` at ``[kk, l-1, j-1]``
            (for a drafter k that abstains: ``M``, the expected rounds in which k proposes).
        vcost: ``vcost[i]`` = ``(len(below[i]), tmax)`` seconds of a round of ``i`` over a block of ``l`` drafts
            of k: its verify pass plus k's expected catch-up (:func:`~hsd_opt.solver.latency.round_cost`).
        abst: ``abst[i]`` = int array of the rows ``kk`` of ``below[i]`` whose drafter abstains
            (:attr:`~hsd_opt.formats.ModelEntry.abstains`).
        gam_u: ``gam_u[i]`` = ``(len(abst[i]), tmax, tmax)``: ``U``, expected rounds in which it abstains.
        v_abst: ``v_abst[i]`` = ``(len(abst[i]),)`` seconds of such a round: ``i``'s pass over one token plus the
            drafter's call.
        src: int array of drafters the target may verify.
        src_rate: ``(len(src), tmax)``: ``R = (1-a)/(1-a^(j+1))``, target passes per token with budget j
            (for an abstaining drafter: the passes over its blocks per token).
        src_cost: ``(len(src), tmax)`` seconds of one target round over a block of j drafts (its pass plus the
            drafter's expected catch-up).
        src_add: ``(len(src), tmax)`` seconds per token of the rounds an abstaining drafter leaves to the target
            (0 for the others). The latency over ``src[s]`` is ``src_rate * (src_cost + V) + src_add``.
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
    abst: list[np.ndarray]
    gam_u: list[np.ndarray]
    v_abst: list[np.ndarray]
    src: np.ndarray
    src_rate: np.ndarray
    src_cost: np.ndarray
    src_add: np.ndarray


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
    abstains = [e.abstains for e in entries]
    rate_t = np.array([rates_by_budget(e, tmax) for e in entries], dtype=float).reshape(D, tmax)   # [k, l - 1]
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
    gam, vcost, abst, gam_u, v_abst = [], [], [], [], []
    ls = np.arange(1, tmax + 1)
    p = 0
    for i in range(D):
        n = len(below[i])
        g = table[p: p + n]
        ab = np.array([kk for kk, k in enumerate(below[i]) if abstains[k]], dtype=int)
        if len(ab):
            M, U = round_tables(np.array(pairs_a[p: p + n])[ab], rate_t[below[i][ab]], tmax)
            g = g.copy()
            g[ab] = M
        else:
            U = np.zeros((0, tmax, tmax))
        p += n
        gam.append(g)
        abst.append(ab)
        gam_u.append(U)
        v_abst.append(np.array([verify_cost(profile, names[i], names[below[i][kk]], 1) + cost[below[i][kk]]
                                for kk in ab]))
        vcost.append(np.array([round_cost(profile, names[i], names[k], ls) for k in below[i]]).reshape(n, tmax))
    src = np.array([i for i, n in enumerate(names) if profile.accept(n, K) is not None], dtype=int)
    js = np.arange(1, tmax + 1)
    src_rate = np.zeros((len(src), tmax))
    src_add = np.zeros((len(src), tmax))
    for s_, i in enumerate(src):
        src_rate[s_], src_add[s_] = top_rate(profile.accept(names[i], K), rate_t[i], js,
                                             verify_cost(profile, K, names[i], 1), cost[i])
    src_cost = np.array([round_cost(profile, K, names[i], js) for i in src]).reshape(len(src), tmax)
    return Instance(names, K, profile.entry(K).cost, tmax, cost, can_verify, below, gam, vcost, abst, gam_u,
                    v_abst, src, src_rate, src_cost, src_add)
