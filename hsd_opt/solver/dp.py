"""The default solver: exact Bellman recursion over the GSP DAG (DESIGN.md section 4), vectorised with numpy.

Without the sink loops the GSP graph is a DAG (verify edges go to cheaper drafters), and for a path the GSP
cost is ``V(v) = min_e [c(e) + mu(e) V(head(e))]``; the sink edge gives ``V(i, j) = j c_i`` at the bottom.
Processing drafters cheapest first makes every ``V(k, .)`` ready before ``V(i, .)`` needs it. Per drafter the
relaxation is one ``(n_below, tmax, tmax)`` array operation: O(D^2 tmax^2) numbers in total.

``max_depth`` (models including the target) adds a layer index: ``V_d`` uses at most ``d`` drafters.
:func:`dp_ranked` keeps, per vertex, the best ``top`` *distinct* sub-hierarchies (exact: if ``i + H`` is among
the ``top`` best at ``(i, j)``, then ``H`` is among the ``top`` best at the ``(k, l)`` it uses).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hsd_opt.errors import HsdError
from hsd_opt.solver.instance import Instance


@dataclass
class Solution:
    """A hierarchy (cheapest first, target last), its budgets (tokens) and latency (seconds per token)."""

    latency: float
    hierarchy: list[str]
    budgets: list[int]
    info: dict = field(default_factory=dict)


def _drafter_limit(inst: Instance, max_depth: int | None) -> int:
    """Max number of drafters below the target; ``len(names)`` means unlimited."""
    D = len(inst.names)
    if max_depth is None:
        return D
    if int(max_depth) != max_depth or max_depth < 1:
        raise HsdError(f"--max-depth: expected an integer >= 1 (models including the target), got {max_depth!r}")
    return min(D, int(max_depth) - 1)


def _upper_mask(tmax: int) -> np.ndarray:
    """``mask[l-1, j-1]`` True where l > j (the budget rule forbids those edges)."""
    r = np.arange(tmax)
    return r[:, None] > r[None, :]


def _relax(inst: Instance, i: int, Vsrc: np.ndarray, mask: np.ndarray):
    """Best verify edge out of every ``(i, j)``: returns ``(value (tmax,), k (tmax,), l (tmax,))`` or None."""
    ks = inst.below[i]
    if len(ks) == 0:
        return None
    tmax = inst.tmax
    val = inst.gam[i] * (inst.vcost[i][:, :, None] + Vsrc[ks][:, :, None])      # (nk, l, j)
    ab = inst.abst[i]
    if len(ab):                                                                   # rounds the drafter abstained
        val[ab] += inst.gam_u[i] * inst.v_abst[i][:, None, None]
    val[:, mask] = np.inf
    flat = val.reshape(-1, tmax)
    arg = flat.argmin(axis=0)
    return flat[arg, np.arange(tmax)], ks[arg // tmax], arg % tmax + 1


def dp_values(inst: Instance, max_depth: int | None = None):
    """Bellman values. Returns ``(V, bk, bl)`` with shapes ``(L, D, tmax)``: ``V[d, i, j-1]`` the least expected
    seconds for drafter ``i`` to hand up ``j`` tokens using at most ``d+1`` drafters (only ``L = 1`` layer,
    unlimited, when ``max_depth`` is None); ``bk/bl`` the next drafter and its budget (-1: ``i`` is the bottom).
    """
    D, tmax = len(inst.names), inst.tmax
    dmax = _drafter_limit(inst, max_depth)
    js = np.arange(1, tmax + 1)
    mask = _upper_mask(tmax)
    layered = dmax < D
    nl = max(dmax, 1) if layered else 1
    V = np.full((nl, D, tmax), np.inf)
    bk = np.full((nl, D, tmax), -1, dtype=int)
    bl = np.full((nl, D, tmax), -1, dtype=int)
    for d in range(nl):
        src = V[d - 1] if (layered and d > 0) else V[d]
        for i in range(D):
            V[d, i] = js * inst.cost[i]
            if layered and d == 0:
                continue
            r = _relax(inst, i, src, mask)
            if r is None:
                continue
            best, k, l = r
            better = best < V[d, i]
            V[d, i] = np.where(better, best, V[d, i])
            bk[d, i] = np.where(better, k, -1)
            bl[d, i] = np.where(better, l, -1)
    return V, bk, bl


def _backtrack(inst: Instance, bk, bl, d: int, i: int, j: int, layered: bool) -> Solution:
    chain = [(i, j)]
    while bk[d, i, j - 1] >= 0:
        i, j = int(bk[d, i, j - 1]), int(bl[d, i, j - 1])
        if layered:
            d -= 1
        chain.append((i, j))
    chain.reverse()
    return Solution(0.0, [inst.names[i] for i, _ in chain] + [inst.target], [j for _, j in chain])


def dp(inst: Instance, max_depth: int | None = None) -> Solution:
    """Optimal hierarchy and budgets by the Bellman recursion; the target alone when nothing beats it.

    ``latency`` is seconds per token. Ties keep the target alone, then the fewer levels, then cheaper drafters
    and smaller budgets.
    """
    dmax = _drafter_limit(inst, max_depth)
    if dmax == 0 or len(inst.src) == 0:
        return Solution(inst.cK, [inst.target], [])
    V, bk, bl = dp_values(inst, max_depth)
    d = V.shape[0] - 1
    vals = inst.src_rate * (inst.src_cost + V[d, inst.src]) + inst.src_add         # (ns, tmax)
    a = int(np.argmin(vals))
    s, j = divmod(a, inst.tmax)
    L = float(vals[s, j])
    if not L < inst.cK:
        return Solution(inst.cK, [inst.target], [])
    sol = _backtrack(inst, bk, bl, d, int(inst.src[s]), j + 1, V.shape[0] > 1)
    sol.latency = L
    return sol


# ------------------------------------------------------------------------------------------- ranked (top-n)


def dp_ranked(inst: Instance, top: int, max_depth: int | None = None) -> list[Solution]:
    """The ``top`` best *distinct* drafting hierarchies (each with its best budgets), best first.

    The target alone is not in the list. Cost: about ``top`` times :func:`dp` plus a sort per vertex.
    """
    D, tmax = len(inst.names), inst.tmax
    dmax = _drafter_limit(inst, max_depth)
    if top < 1 or dmax == 0 or len(inst.src) == 0:
        return []
    js = np.arange(1, tmax + 1)
    mask = _upper_mask(tmax)
    layered = dmax < D
    nl = dmax if layered else 1
    chains: list[tuple[int, ...]] = []
    chain_id: dict[tuple[int, ...], int] = {}

    def intern(c: tuple[int, ...]) -> int:
        if c not in chain_id:
            chain_id[c] = len(chains)
            chains.append(c)
        return chain_id[c]

    Vt = np.full((nl, D, tmax, top), np.inf)
    Cid = np.full((nl, D, tmax, top), -1, dtype=int)
    back = np.full((nl, D, tmax, top, 3), -1, dtype=int)       # (k, l, m) of the next level, -1 = bottom
    for d in range(nl):
        src_layer = d - 1 if layered else d
        for i in range(D):
            sink_cid = intern((i,))
            ks = inst.below[i]
            use_edges = len(ks) > 0 and not (layered and d == 0)
            if use_edges:
                val = inst.gam[i][:, :, None, :] * (inst.vcost[i][:, :, None, None]
                                                    + Vt[src_layer, ks][:, :, :, None])      # (nk, l, m, j)
                ab = inst.abst[i]
                if len(ab):
                    val[ab] += (inst.gam_u[i] * inst.v_abst[i][:, None, None])[:, :, None, :]
                val = np.where(mask[None, :, None, :], np.inf, val)
                cids = Cid[src_layer, ks].reshape(-1)                                        # (nk*l*m,)
                flat = val.reshape(-1, tmax)
            for j in range(tmax):
                entries = [(float(js[j] * inst.cost[i]), sink_cid, (-1, -1, -1))]
                if use_edges:
                    v = flat[:, j]
                    order = np.argsort(v, kind="stable")
                    seen: set[int] = set()
                    for o in order:
                        if not np.isfinite(v[o]) or len(seen) >= top:
                            break
                        c = int(cids[o])
                        if c < 0 or c in seen:
                            continue
                        seen.add(c)
                        kk, rem = divmod(int(o), tmax * top)
                        l, m = divmod(rem, top)
                        entries.append((float(v[o]), intern((i,) + chains[c]), (int(ks[kk]), l + 1, m)))
                entries.sort(key=lambda e: e[0])
                for m, (val_m, c, b) in enumerate(entries[:top]):
                    Vt[d, i, j, m], Cid[d, i, j, m], back[d, i, j, m] = val_m, c, b
    d = nl - 1
    vals = (inst.src_rate[:, :, None] * (inst.src_cost[:, :, None] + Vt[d, inst.src])
            + inst.src_add[:, :, None])                                                     # (ns, tmax, m)
    cids = Cid[d, inst.src]
    v = vals.reshape(-1)
    order = np.argsort(v, kind="stable")
    out: list[Solution] = []
    seen: set[int] = set()
    for o in order:
        if not np.isfinite(v[o]) or len(out) >= top:
            break
        s, rem = divmod(int(o), tmax * top)
        j, m = divmod(rem, top)
        c = int(cids[s, j, m])
        if c < 0 or c in seen:
            continue
        seen.add(c)
        i, j, dd = int(inst.src[s]), j + 1, d
        path = [(i, j)]
        while True:
            k, l, m2 = back[dd, i, j - 1, m]
            if k < 0:
                break
            i, j, m = int(k), int(l), int(m2)
            if layered:
                dd -= 1
            path.append((i, j))
        path.reverse()
        out.append(Solution(float(v[o]), [inst.names[p] for p, _ in path] + [inst.target], [q for _, q in path]))
    return out
