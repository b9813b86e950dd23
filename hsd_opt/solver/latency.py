"""The exact latency model of HSD (DESIGN.md section 3; seed 003 Sec. 2.4, Corollary 3.1).

Units: costs and latencies are seconds (latency is seconds per generated token); budgets and ``t`` are tokens.

Hierarchy ``m_0, ..., m_{n-1}, K`` (cheapest first, target last), budgets ``1 <= T_0 <= ... <= T_{n-1}``::

    B_0 = T_0 * c[m_0]                                                # bottom drafts T_0 tokens, one at a time
    B_i = gamma(a[m_{i-1}][m_i], T_{i-1}, T_i) * (v_i + B_{i-1})      # level i produces a block of T_i tokens
    L   = (v_K + B_{n-1}) / (1 + a + ... + a^T_{n-1}),  a = a[m_{n-1}][K]

where ``v_i`` is the cost of one verify pass of ``m_i`` over a block of ``T_{i-1}`` drafts (t = T_{i-1} + 1
tokens), see :func:`verify_cost`. With only scalar costs ``v_i = c[m_i]``: the paper's model exactly.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import numpy as np

from hsd_opt.errors import HsdError
from hsd_opt.formats import Profile

# ------------------------------------------------------------------------------------------------ gamma


@lru_cache(maxsize=65536)
def gamma(a: float, t: int, T: int) -> float:
    """Expected number of draft/verify rounds until at least ``T`` tokens are accumulated (exact).

    One round yields ``N = 1 + min(G, t)`` tokens with ``P(G >= m) = a^m`` (``G`` accepted drafts out of a block
    of ``t``, plus the corrected or bonus token). Renewal recursion: ``f(n) = 1 + sum_k P(N = k) f(n - k)``,
    ``f(n <= 0) = 0``, ``gamma = f(T)``. Direct O(T * t) evaluation, cached; :func:`gamma_table` is the
    vectorised version used by the solvers.

    Args:
        a: acceptance rate in [0, 1].
        t: drafts per round (tokens), >= 1.
        T: tokens needed, >= 0.
    """
    a, t, T = float(a), int(t), int(T)
    if t < 1:
        raise ValueError("gamma: t must be >= 1")
    if T <= 0:
        return 0.0
    p = [a ** (k - 1) * (1.0 - a) for k in range(1, t + 1)] + [a ** t]   # P(N = k), k = 1..t+1
    f = [0.0] * (T + 1)
    for n in range(1, T + 1):
        s = 1.0
        for k in range(1, min(t + 1, n - 1) + 1):
            s += p[k - 1] * f[n - k]
        f[n] = s
    return f[T]


def gamma_table(a: np.ndarray, tmax: int) -> np.ndarray:
    """``gamma(a[p], t, n)`` for every acceptance rate ``a[p]`` and t, n in 1..tmax.

    Returns an array of shape ``(P, tmax, tmax)`` indexed ``[p, t - 1, n - 1]``. O(P * tmax^2) with the
    running sum ``S(n) = sum_{m=1..t} a^(m-1) f(n-m)``: ``f(n) = 1 + (1-a) S(n) + a^t f(n-t-1)`` and
    ``S(n+1) = f(n) + a S(n) - a^t f(n-t)``.
    """
    a = np.asarray(a, dtype=float).reshape(-1)
    P = a.shape[0]
    ts = np.arange(1, tmax + 1)
    tix = np.arange(tmax)
    A = a[None, :]                                   # (1, P)
    At = A ** ts[:, None]                            # (tmax, P): a^t  (t >= 1, so no 0**0)
    f = np.zeros((tmax + 1, tmax, P))                # f[n, t-1, p], f[0] = 0; p last for contiguous gathers
    S = np.zeros((tmax, P))
    for n in range(1, tmax + 1):
        f_back1 = f[np.clip(n - ts - 1, 0, None), tix]     # f(n - t - 1), 0 when the index is <= 0
        f_back0 = f[np.clip(n - ts, 0, None), tix]         # f(n - t)
        fn = 1.0 + (1.0 - A) * S + At * f_back1
        f[n] = fn
        S = fn + A * S - At * f_back0
    return np.ascontiguousarray(f[1:].transpose(2, 1, 0))


def target_rate(a: float | np.ndarray, T: int | np.ndarray) -> float | np.ndarray:
    """``R = (1 - a) / (1 - a^(T+1)) = 1 / (1 + a + ... + a^T)``: target verify passes per generated token.

    Written as the reciprocal of the geometric sum so ``a == 1`` gives ``1 / (T + 1)`` without a 0/0.
    """
    a = np.asarray(a, dtype=float)
    T = np.asarray(T)
    with np.errstate(divide="ignore", invalid="ignore"):
        geo = np.where(a == 1.0, T + 1.0, (1.0 - a ** (T + 1)) / np.where(a == 1.0, 0.5, 1.0 - a))
    r = 1.0 / geo
    return float(r) if r.ndim == 0 else r


# ------------------------------------------------------------------------------------------------ costs


def curve_at(curve: Sequence[float], t: int) -> float:
    """Seconds of a pass over ``t`` tokens from ``curve = [s_1, ..., s_n]`` (``s_t`` for t = 1..n).

    Beyond the end, extrapolate linearly from the last two points; a decreasing tail is held flat (a pass over
    more tokens is never cheaper than the last measured one) and a one-point curve is flat.
    """
    n = len(curve)
    if 1 <= t <= n:
        return float(curve[t - 1])
    if t < 1:
        raise ValueError("curve_at: t must be >= 1")
    if n == 1:
        return float(curve[0])
    slope = max(0.0, float(curve[-1]) - float(curve[-2]))
    return float(curve[-1]) + slope * (t - n)


def verify_cost(profile: Profile, verifier: str, drafter: str, t: int) -> float:
    """Seconds for ``verifier`` to verify a block drafted by ``drafter`` in one pass over ``t`` tokens.

    A block of ``l`` drafts is a pass over ``t = l + 1`` tokens. Precedence: ``verify_cost[verifier][drafter]``
    (a number, or a curve evaluated at ``t``), else ``cost_curve[verifier]`` at ``t``, else ``cost[verifier]``.
    """
    vc = profile.verify_cost.get(verifier, {}).get(drafter)
    if vc is not None:
        return curve_at(vc, t) if isinstance(vc, list) else float(vc)
    cc = profile.cost_curve.get(verifier)
    if cc is not None:
        return curve_at(cc, t)
    return profile.entry(verifier).cost


def verify_cost_row(profile: Profile, verifier: str, drafter: str, tmax: int) -> np.ndarray:
    """``verify_cost(profile, verifier, drafter, l + 1)`` for blocks l = 1..tmax, shape ``(tmax,)`` seconds."""
    vc = profile.verify_cost.get(verifier, {}).get(drafter)
    if vc is None:
        vc = profile.cost_curve.get(verifier)
    if vc is None:
        return np.full(tmax, profile.entry(verifier).cost)
    if not isinstance(vc, list):
        return np.full(tmax, float(vc))
    return np.array([curve_at(vc, l + 1) for l in range(1, tmax + 1)])


# ------------------------------------------------------------------------------------------------ latency


def _check_hierarchy(profile: Profile, hierarchy: Sequence[str], budgets: Sequence[int]) -> None:
    names = set(profile.names)
    if not hierarchy:
        raise HsdError("hierarchy: empty; expected model names, target last")
    for m in hierarchy:
        if m not in names:
            raise HsdError(f"hierarchy: model {m!r} is not in the profile ({', '.join(profile.names)})")
    if hierarchy[-1] != profile.target:
        raise HsdError(f"hierarchy: must end with the profile's target {profile.target!r}, got {hierarchy[-1]!r}")
    if len(set(hierarchy)) != len(hierarchy):
        raise HsdError(f"hierarchy: a model appears twice in {list(hierarchy)}")
    if len(budgets) != len(hierarchy) - 1:
        raise HsdError(f"budgets: expected {len(hierarchy) - 1} budgets, got {len(budgets)}")
    for i, t in enumerate(budgets):
        if int(t) != t or t < 1:
            raise HsdError(f"budgets[{i}]: expected an integer >= 1, got {t!r}")
    for lo, hi in zip(hierarchy[:-1], hierarchy[1:]):
        if profile.accept(lo, hi) is None:
            raise HsdError(f"acceptance.{lo}.{hi}: not measured, so {hi!r} cannot verify {lo!r}")
        if not profile.entry(hi).can_verify:
            raise HsdError(f"hierarchy: {hi!r} cannot verify (can_verify: false); it may only be the bottom level")


def hierarchy_latency(profile: Profile, hierarchy: Sequence[str], budgets: Sequence[int]) -> float:
    """Expected seconds per generated token of HSD with ``hierarchy`` (cheapest first, target last) and
    ``budgets`` (``budgets[i]`` = T_i tokens, one per level below the target). ``[target]`` alone: its cost.

    Raises :class:`HsdError` for unknown models, a wrong target, a pair without a measured acceptance or a
    verifier that cannot verify. Does not require budgets to be non-decreasing (the solvers do).
    """
    hierarchy, budgets = list(hierarchy), [int(b) for b in budgets]
    _check_hierarchy(profile, hierarchy, budgets)
    if len(hierarchy) == 1:
        return profile.entry(hierarchy[0]).cost
    B = budgets[0] * profile.entry(hierarchy[0]).cost
    for i in range(1, len(hierarchy) - 1):
        lo, hi = hierarchy[i - 1], hierarchy[i]
        g = gamma(profile.accept(lo, hi), budgets[i - 1], budgets[i])
        B = g * (verify_cost(profile, hi, lo, budgets[i - 1] + 1) + B)
    lo, K = hierarchy[-2], hierarchy[-1]
    vK = verify_cost(profile, K, lo, budgets[-1] + 1)
    return (vK + B) * target_rate(profile.accept(lo, K), budgets[-1])


def target_only(profile: Profile) -> float:
    """Seconds per token of the target alone: its ``cost``."""
    return profile.entry(profile.target).cost


def best_single_draft(profile: Profile, tmax: int,
                      kinds: Sequence[str] | None = None) -> tuple[list[str], list[int], float] | None:
    """The best hierarchy ``[drafter, target]`` with ``T`` in 1..tmax: ``(hierarchy, budgets, seconds/token)``.

    Candidates are the drafters the solvers may put under the target (acceptance to the target measured and
    cheaper than the target, see :mod:`hsd_opt.solver.instance`), restricted to entries of ``kinds`` when given.
    ``None`` when there is no candidate.
    """
    from hsd_opt.solver.instance import source_candidates

    best = None
    K = profile.target
    js = np.arange(1, tmax + 1)
    for d in source_candidates(profile):
        if kinds is not None and profile.entry(d).kind not in kinds:
            continue
        L = target_rate(profile.accept(d, K), js) * (verify_cost_row(profile, K, d, tmax) + js * profile.entry(d).cost)
        j = int(np.argmin(L))
        if best is None or L[j] < best[2]:
            best = ([d, K], [j + 1], float(L[j]))
    return best
