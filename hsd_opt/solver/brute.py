"""Brute force: every admissible chain and every non-decreasing budget vector, for tests on small instances
(`docs/design.md#the-three-solvers`).

Uses :func:`~hsd_opt.solver.latency.hierarchy_latency` (the scalar formula), independent of the dp/LP code.
"""

from __future__ import annotations

from itertools import combinations, combinations_with_replacement
from math import comb

from hsd_opt.errors import HsdError
from hsd_opt.formats import Profile
from hsd_opt.solver.hierarchy import Solution, cost_order, drafter_limit
from hsd_opt.solver.latency import hierarchy_latency, target_only

MAX_EVALUATIONS = 2_000_000


def admissible_chains(profile: Profile, max_depth: int | None = None):
    """Yield every hierarchy (cheapest first, target last) allowed by the rules of :mod:`.instance`
    (`docs/design.md#the-graph`), with at most ``max_depth`` models."""
    order = cost_order(profile)
    K = profile.target
    drafters = order[: order.index(K)]
    nmax = drafter_limit(len(drafters), max_depth)
    for n in range(1, nmax + 1):
        for sub in combinations(drafters, n):        # combinations keep cost order
            chain = list(sub) + [K]
            ok = all(profile.accept(lo, hi) is not None for lo, hi in zip(chain[:-1], chain[1:]))
            ok = ok and all(profile.entry(m).can_verify for m in sub[1:])
            if ok:
                yield chain


def brute_ranked(profile: Profile, tmax: int, max_depth: int | None = None) -> list[Solution]:
    """Every admissible drafting hierarchy with its best budgets, best first (ties: fewer levels first).

    Refuses (:class:`HsdError`) instances with more than :data:`MAX_EVALUATIONS` (chain, budgets) pairs.
    """
    order = cost_order(profile)
    D = order.index(profile.target)
    nmax = drafter_limit(D, max_depth)
    work = sum(comb(D, n) * comb(tmax + n - 1, n) for n in range(1, nmax + 1))
    if work > MAX_EVALUATIONS:
        raise HsdError(f"--solver brute: {work:.3g} candidate (hierarchy, budgets) pairs is too many "
                       f"(limit {MAX_EVALUATIONS:.0e}); use dp or lower --tmax / --max-depth")
    out = []
    for chain in admissible_chains(profile, max_depth):
        best = None
        for T in combinations_with_replacement(range(1, tmax + 1), len(chain) - 1):
            L = hierarchy_latency(profile, chain, T)
            if best is None or L < best.latency:
                best = Solution(L, chain, list(T))
        out.append(best)
    out.sort(key=lambda s: (s.latency, len(s.hierarchy)))
    return out


def brute(profile: Profile, tmax: int, max_depth: int | None = None) -> Solution:
    """The optimum by enumeration; the target alone when nothing beats it."""
    ranked = brute_ranked(profile, tmax, max_depth)
    cK = target_only(profile)
    if ranked and ranked[0].latency < cK:
        return ranked[0]
    return Solution(cK, [profile.target], [])
