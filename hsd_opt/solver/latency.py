"""The exact latency model of HSD (`docs/design.md#the-latency-model`), after the HSD paper ("Fast Inference via
Hierarchical Speculative Decoding", arXiv 2510.19705), Section 2.4 and Corollary 3.1.

Units: costs and latencies are seconds (latency is seconds per generated token); budgets and ``t`` are tokens.

Hierarchy ``m_0, ..., m_{n-1}, K`` (cheapest first, target last), budgets ``1 <= T_0 <= ... <= T_{n-1}``
(`docs/design.md#latency-of-a-hierarchy`)::

    B_0 = T_0 * c[m_0]                                                # bottom drafts T_0 tokens, one at a time
    B_i = gamma(a[m_{i-1}][m_i], T_{i-1}, T_i) * (v_i + B_{i-1})      # level i produces a block of T_i tokens
    L   = (v_K + B_{n-1}) / (1 + a + ... + a^T_{n-1}),  a = a[m_{n-1}][K]

where ``v_i`` is the cost of one round of ``m_i`` over a block of ``T_{i-1}`` drafts: its verify pass over
``t = T_{i-1} + 1`` tokens (:func:`verify_cost`, `docs/design.md#costs-of-a-pass-over-t-tokens`) plus, when the
whole block is accepted (probability ``a^T_{i-1}``), the one more position the level below then computes
(:func:`round_cost`, `docs/design.md#catch-up-after-an-accepted-block`); ``gamma`` is the expected number of
rounds, :func:`gamma` (`docs/design.md#rounds-and-gamma`). With only scalar costs ``v_i = c[m_i]``: the paper's
model exactly.

A bottom drafter with ``draft_rate f < 1`` (a token drafter that abstains where it has no confident guess,
`docs/design.md#abstaining-drafters`) proposes its block in a share ``f`` of the rounds of the level above and
nothing in the others, which are then one plain step of that level (one token, a pass over ``t = 1``). ``a`` is
its acceptance where it proposes. A round yields ``N = 1`` with probability ``(1 - f) + f (1 - a)``, else
``1 + min(G, t)`` as before, and the level above (``m_1``) pays, exactly (:func:`round_counts`)::

    B_1 = M * (v_1(T_0 + 1) + B_0) + U * (v_1(1) + c[m_0])

with ``M`` / ``U`` the expected rounds with / without a block until ``T_1`` tokens are accumulated; directly
under the target, ``L = (f (v_K + B_0) + (1 - f) (v_K(1) + c[m_0])) / (f (1 + a + ... + a^T_0) + 1 - f)``.
``f = 1`` gives ``M = gamma``, ``U = 0``: the model above.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Sequence

import numpy as np

from hsd_opt.errors import HsdError
from hsd_opt.formats import ModelEntry, Profile
from hsd_opt.solver.hierarchy import source_candidates
from hsd_opt.values import is_integer, is_real

# ------------------------------------------------------------------------------------------------ gamma


def gamma(a: float, t: int, T: int) -> float:
    """Expected number of draft/verify rounds until at least ``T`` tokens are accumulated (exact).

    One round yields ``N = 1 + min(G, t)`` tokens with ``P(G >= m) = a^m`` (``G`` accepted drafts out of a block
    of ``t``, plus the corrected or bonus token). Renewal recursion (`docs/design.md#rounds-and-gamma`):
    ``f(n) = 1 + sum_k P(N = k) f(n - k)``, ``f(n <= 0) = 0``, ``gamma = f(T)``. Direct O(T * t) evaluation,
    cached; :func:`gamma_table` is the vectorised version used by the solvers.

    Args:
        a: acceptance rate in [0, 1].
        t: drafts per round (tokens), >= 1.
        T: tokens needed, >= 0.
    """
    if not (is_real(a) and 0.0 <= a <= 1.0):
        raise HsdError(f"gamma: the acceptance rate a must be in [0, 1], got {a!r}")
    if not (is_integer(t) and t >= 1) or not (is_integer(T) and T >= 0):
        raise HsdError(f"gamma: t must be an integer >= 1 and T an integer >= 0, got t={t!r}, T={T!r}")
    return _gamma(float(a), int(t), int(T))


@lru_cache(maxsize=65536)
def _gamma(a: float, t: int, T: int) -> float:
    """:func:`gamma` of checked arguments (cached: the arguments must be hashable, which the checks ensure)."""
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
    ``S(n+1) = f(n) + a S(n) - a^t f(n-t)`` (the recursion of `docs/design.md#rounds-and-gamma`).
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


def _round_sizes(a: float, f: float, t: int) -> list[float]:
    """``P(N = k)``, k = 1..t+1, for a round over a bottom drafter proposing ``t`` tokens with probability ``f``
    (`docs/design.md#abstaining-drafters`)."""
    p = [f * a ** (k - 1) * (1.0 - a) for k in range(1, t + 1)] + [f * a ** t]
    p[0] += 1.0 - f
    return p


@lru_cache(maxsize=65536)
def round_counts(a: float, f: float, t: int, T: int) -> tuple[float, float]:
    """``(M, U)``: expected rounds with a block of ``t`` drafts (``M``) and without one (``U``, the drafter
    abstained) until at least ``T`` tokens are accumulated, for a bottom drafter that proposes with probability
    ``f`` and whose drafts are accepted at rate ``a``. Exact renewal recursion
    (`docs/design.md#abstaining-drafters`): ``M(n) = f + sum_k P(N = k) M(n - k)``,
    ``U(n) = (1 - f) + sum_k P(N = k) U(n - k)``. ``f = 1``: ``(gamma(a, t, T), 0)``.
    """
    a, f, t, T = float(a), float(f), int(t), int(T)
    if f >= 1.0:
        return gamma(a, t, T), 0.0
    if t < 1:
        raise ValueError("round_counts: t must be >= 1")
    p = _round_sizes(a, f, t)
    M = [0.0] * (T + 1)
    U = [0.0] * (T + 1)
    for n in range(1, T + 1):
        m, u = f, 1.0 - f
        for k in range(1, min(t + 1, n - 1) + 1):
            m += p[k - 1] * M[n - k]
            u += p[k - 1] * U[n - k]
        M[n], U[n] = m, u
    return M[T], U[T]


def round_tables(a: np.ndarray, f: np.ndarray, tmax: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`round_counts` for every pair ``(a[p], f[p])`` and t, n in 1..tmax: two arrays of shape
    ``(P, tmax, tmax)`` indexed ``[p, t - 1, n - 1]`` (``M``, ``U``). ``f`` is ``(P,)``, or ``(P, tmax)`` with
    the drafter's rate for blocks of t drafts at ``[p, t - 1]`` (:meth:`~hsd_opt.formats.ModelEntry.rate_at`).
    O(P tmax^3): meant for the few pairs with an abstaining drafter (:func:`gamma_table` covers ``f = 1`` in
    O(P tmax^2)); `docs/design.md#abstaining-drafters`."""
    a = np.asarray(a, dtype=float).reshape(-1)
    P = a.shape[0]
    fs = np.asarray(f, dtype=float).reshape(P, -1)
    fs = np.broadcast_to(fs, (P, tmax)) if fs.shape[1] == 1 else fs
    M = np.zeros((P, tmax, tmax + 1))           # [p, t-1, n], n = 0 column is 0
    U = np.zeros((P, tmax, tmax + 1))
    for t in range(1, tmax + 1):
        f = fs[:, t - 1]
        k = np.arange(1, t + 2)
        pk = f[:, None] * a[:, None] ** (k - 1)[None, :] * np.where(k <= t, 1.0 - a[:, None], 1.0)   # (P, t+1)
        pk[:, 0] += 1.0 - f
        for n in range(1, tmax + 1):
            kk = min(t + 1, n - 1)
            back = n - np.arange(1, kk + 1)                                                        # n - k
            M[:, t - 1, n] = f + (pk[:, :kk] * M[:, t - 1, back]).sum(-1)
            U[:, t - 1, n] = (1.0 - f) + (pk[:, :kk] * U[:, t - 1, back]).sum(-1)
    return M[:, :, 1:], U[:, :, 1:]


def target_rate(a: float | np.ndarray, T: int | np.ndarray) -> float | np.ndarray:
    """``R = (1 - a) / (1 - a^(T+1)) = 1 / (1 + a + ... + a^T)``: target verify passes per generated token.

    Written as the reciprocal of the geometric sum so ``a == 1`` gives ``1 / (T + 1)`` without a 0/0.
    `docs/design.md#latency-of-a-hierarchy`.
    """
    a = np.asarray(a, dtype=float)
    T = np.asarray(T)
    with np.errstate(divide="ignore", invalid="ignore"):
        geo = np.where(a == 1.0, T + 1.0, (1.0 - a ** (T + 1)) / np.where(a == 1.0, 0.5, 1.0 - a))
    r = 1.0 / geo
    return float(r) if r.ndim == 0 else r


def top_latency(a: float, f: float, T: int | np.ndarray, v_block: float | np.ndarray, v_step: float,
                c_draft: float) -> float | np.ndarray:
    """Seconds per token of the target over a level that hands up blocks of ``T`` tokens at ``c_draft`` seconds
    per token with acceptance ``a`` (``T`` may be an array of budgets, with ``v_block`` the target's round over
    each: its pass over ``T + 1`` tokens plus the drafter's expected catch-up, :func:`round_cost`). ``f < 1``:
    that level is a bottom drafter proposing with probability ``f``; the other rounds are one target step
    (``v_step``, the pass over one token) plus the drafter's failed call.
    `docs/design.md#latency-of-a-hierarchy`, `docs/design.md#abstaining-drafters`."""
    T = np.asarray(T)
    rate, add = top_rate(a, f, T, v_step, c_draft)
    out = rate * (v_block + T * c_draft) + add
    return float(out) if np.ndim(out) == 0 else out


def top_rate(a: float, f: float | np.ndarray, T: int | np.ndarray, v_step: float, c_draft: float):
    """``(rate, add)`` with :func:`top_latency` ``= rate * (v_block + T c_draft) + add``: the target's passes over
    a block per token, and the seconds per token of the rounds an abstaining drafter (``f < 1``; an array of
    rates, one per budget of ``T``, for a drafter whose rate depends on its budget) leaves to the target as
    plain steps. ``f = 1``: ``(target_rate(a, T), 0)``. The GSP source edge uses the two apart
    (`docs/design.md#abstaining-drafters`, `docs/design.md#the-graph`)."""
    rate = target_rate(a, T)
    f = np.asarray(f, dtype=float)
    if np.all(f >= 1.0):
        return rate, 0.0 * rate
    per_round = f / rate + 1.0 - f                                  # E[tokens per round]
    out = f / per_round, (1.0 - f) * (v_step + c_draft) / per_round
    return tuple(float(x) for x in out) if np.ndim(out[0]) == 0 else out


# ------------------------------------------------------------------------------------------------ costs


def curve_at(curve: Sequence[float], t: int) -> float:
    """Seconds of a pass over ``t`` tokens from ``curve = [s_1, ..., s_n]`` (``s_t`` for t = 1..n).

    Beyond the end, extrapolate linearly from the last two points; a decreasing tail is held flat (a pass over
    more tokens is never cheaper than the last measured one) and a one-point curve is flat
    (`docs/design.md#costs-of-a-pass-over-t-tokens`).
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
    (a number, or a curve evaluated at ``t``), else ``cost_curve[verifier]`` at ``t``, else ``cost[verifier]``
    (`docs/design.md#costs-of-a-pass-over-t-tokens`).
    """
    vc = profile.verify_cost.get(verifier, {}).get(drafter)
    if vc is not None:
        return curve_at(vc, t) if isinstance(vc, list) else float(vc)
    cc = profile.cost_curve.get(verifier)
    if cc is not None:
        return curve_at(cc, t)
    return profile.entry(verifier).cost


def catch_up_cost(profile: Profile, drafter: str, verifier: str) -> float:
    """Seconds ``drafter`` spends on one more position after ``verifier`` accepted the whole block it drafted.

    A drafter never feeds its own last draft back in, so after a fully accepted block two tokens are new to it
    (that last draft and the verifier's bonus token) where a rejection leaves one (the corrected token): its next
    pass is one position longer, a pass over 2 tokens instead of a step for a bottom drafter. Priced at
    ``cost_curve[drafter]`` over 2 tokens minus over 1 (:func:`curve_at`); 0 without a curve (scalar costs: the
    paper's model) and 0 for a pair with its own ``verify_cost[verifier][drafter]``, the exits of one model,
    whose verify pass already runs the drafter's layers on its last draft (activation reuse).
    `docs/design.md#catch-up-after-an-accepted-block`.
    """
    if drafter in profile.verify_cost.get(verifier, {}):
        return 0.0
    cc = profile.cost_curve.get(drafter)
    if not cc:
        return 0.0
    return max(0.0, curve_at(cc, 2) - curve_at(cc, 1))


def round_cost(profile: Profile, verifier: str, drafter: str, l: int | np.ndarray) -> float | np.ndarray:
    """Seconds of one round of ``verifier`` over a block of ``l`` drafts, beyond the drafting: its pass over
    ``l + 1`` tokens plus, with probability ``a^l`` (the whole block accepted), the drafter's catch-up
    (:func:`catch_up_cost`). ``l`` may be an array of block sizes. `docs/design.md#catch-up-after-an-accepted-block`.
    """
    ls = np.atleast_1d(np.asarray(l, dtype=int))
    v = np.array([verify_cost(profile, verifier, drafter, int(x) + 1) for x in ls])
    extra = catch_up_cost(profile, drafter, verifier)
    if extra:
        v = v + float(profile.accept(drafter, verifier)) ** ls * extra
    return float(v[0]) if np.ndim(l) == 0 else v


# ------------------------------------------------------------------------------------------------ latency


def _check_hierarchy(profile: Profile, hierarchy: Sequence[str], budgets: Sequence[int]) -> None:
    names = set(profile.names)
    if not hierarchy:
        raise HsdError("hierarchy: empty; expected model names, target last")
    for i, m in enumerate(hierarchy):
        if not isinstance(m, str):
            raise HsdError(f"hierarchy[{i}]: expected a model's name, got {type(m).__name__} {m!r}")
        if m not in names:
            raise HsdError(f"hierarchy: model {m!r} is not in the profile ({', '.join(profile.names)})")
    if hierarchy[-1] != profile.target:
        raise HsdError(f"hierarchy: must end with the profile's target {profile.target!r}, got {hierarchy[-1]!r}")
    if len(set(hierarchy)) != len(hierarchy):
        raise HsdError(f"hierarchy: a model appears twice in {list(hierarchy)}")
    if len(budgets) != len(hierarchy) - 1:
        raise HsdError(f"budgets: expected {len(hierarchy) - 1} budgets, got {len(budgets)}")
    for i, t in enumerate(budgets):
        if not is_integer(t) or t < 1:
            raise HsdError(f"budgets[{i}]: expected an integer >= 1, got {t!r}")
    for lo, hi in zip(hierarchy[:-1], hierarchy[1:]):
        a = profile.accept(lo, hi)
        if a is None:
            raise HsdError(f"acceptance.{lo}.{hi}: not measured, so {hi!r} cannot verify {lo!r}")
        if not (is_real(a) and 0.0 <= a <= 1.0):       # the values the formula reads (a Profile built in Python)
            raise HsdError(f"acceptance.{lo}.{hi}: expected an acceptance rate in [0, 1], got {a!r}")
        if not profile.entry(hi).can_verify:
            raise HsdError(f"hierarchy: {hi!r} cannot verify (can_verify: false); it may only be the bottom level")
    for m in hierarchy:
        cost = profile.entry(m).cost
        if not (is_real(cost) and 0.0 < cost < math.inf):
            raise HsdError(f"{m}: expected a cost in seconds > 0, got {cost!r}")
    if budgets:
        f = profile.entry(hierarchy[0]).rate_at(int(budgets[0]))
        if not (is_real(f) and 0.0 < f <= 1.0):
            raise HsdError(f"{hierarchy[0]}: expected a share of rounds with a block in (0, 1], got {f!r}")


def hierarchy_latency(profile: Profile, hierarchy: Sequence[str], budgets: Sequence[int]) -> float:
    """Expected seconds per generated token of HSD with ``hierarchy`` (cheapest first, target last) and
    ``budgets`` (``budgets[i]`` = T_i tokens, one per level below the target), on the costs ``profile`` holds at
    its top level (with ``context_costs``, its first context's: :func:`hsd_opt.evaluate` takes the profile at a
    context first, as the solvers do). ``[target]`` alone: its cost.
    The formulas of the module docstring (`docs/design.md#latency-of-a-hierarchy`,
    `docs/design.md#abstaining-drafters`).

    Raises :class:`HsdError` for unknown models, a wrong target, a pair without a measured acceptance or a
    verifier that cannot verify. Does not require budgets to be non-decreasing (the solvers do).
    """
    if not isinstance(profile, Profile):
        raise HsdError(f"profile: expected a Profile (hsd_opt.load_profile(path)[0]; hsd_opt.evaluate takes a path "
                       f"too), got {type(profile).__name__}")
    for name, value in (("hierarchy", hierarchy), ("budgets", budgets)):
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise HsdError(f"{name}: expected a list, got {type(value).__name__}")
    hierarchy, budgets = list(hierarchy), list(budgets)
    _check_hierarchy(profile, hierarchy, budgets)
    budgets = [int(b) for b in budgets]
    if len(hierarchy) == 1:
        return profile.entry(hierarchy[0]).cost
    bottom = profile.entry(hierarchy[0])
    f = bottom.rate_at(budgets[0])
    B = budgets[0] * bottom.cost
    for i in range(1, len(hierarchy) - 1):
        lo, hi = hierarchy[i - 1], hierarchy[i]
        M, U = round_counts(profile.accept(lo, hi), f if i == 1 else 1.0, budgets[i - 1], budgets[i])
        B = M * (round_cost(profile, hi, lo, budgets[i - 1]) + B)
        if U:
            B += U * (verify_cost(profile, hi, lo, 1) + bottom.cost)
    lo, K = hierarchy[-2], hierarchy[-1]
    if len(hierarchy) > 2 or f >= 1.0:
        vK = round_cost(profile, K, lo, budgets[-1])
        return (vK + B) * target_rate(profile.accept(lo, K), budgets[-1])
    return top_latency(profile.accept(lo, K), f, budgets[0], round_cost(profile, K, lo, budgets[0]),
                       verify_cost(profile, K, lo, 1), bottom.cost)


def rates_by_budget(entry: ModelEntry, tmax: int) -> np.ndarray:
    """``(tmax,)``: a drafter's share of rounds with a block at budgets 1..tmax (all 1 for one that never
    abstains; :meth:`~hsd_opt.formats.ModelEntry.rate_at`)."""
    return np.array([entry.rate_at(t) for t in range(1, tmax + 1)], dtype=float)


def target_only(profile: Profile) -> float:
    """Seconds per token of the target alone: its ``cost`` (`docs/design.md#latency-of-a-hierarchy`)."""
    return profile.entry(profile.target).cost


def best_single_draft(profile: Profile, tmax: int,
                      kinds: Sequence[str] | None = None) -> tuple[list[str], list[int], float] | None:
    """The best hierarchy ``[drafter, target]`` with ``T`` in 1..tmax: ``(hierarchy, budgets, seconds/token)``.

    Candidates are the drafters the solvers may put under the target
    (:func:`~hsd_opt.solver.hierarchy.source_candidates`: acceptance to the target measured and cheaper than the
    target), restricted to entries of ``kinds`` when given. ``None`` when there is no candidate. The latency is
    :func:`top_latency` for every ``T`` (`docs/design.md#latency-of-a-hierarchy`).
    """
    best = None
    K = profile.target
    js = np.arange(1, tmax + 1)
    for d in source_candidates(profile):
        if kinds is not None and profile.entry(d).kind not in kinds:
            continue
        e = profile.entry(d)
        L = top_latency(profile.accept(d, K), rates_by_budget(e, tmax), js, round_cost(profile, K, d, js),
                        verify_cost(profile, K, d, 1), e.cost)
        j = int(np.argmin(L))
        if best is None or L[j] < best[2]:
            best = ([d, K], [j + 1], float(L[j]))
    return best
