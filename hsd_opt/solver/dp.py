"""The default solver: exact Bellman recursion over the GSP DAG, vectorised with numpy
(`docs/design.md#the-three-solvers`).

Without the sink loops the GSP graph (`docs/design.md#the-graph`) is a DAG (verify edges go to cheaper
drafters), and for a path the GSP cost is ``V(v) = min_e [c(e) + mu(e) V(head(e))]``; the sink edge gives
``V(i, j) = j c_i`` at the bottom. Processing drafters cheapest first makes every ``V(k, .)`` ready before
``V(i, .)`` needs it. Per drafter the relaxation is one ``(n_below, tmax, tmax)`` array operation:
O(D^2 tmax^2) numbers per sweep.

``max_depth`` (models including the target) adds a layer index: layer ``d`` uses at most ``d + 1`` drafters and
reads layer ``d - 1`` (`docs/design.md#depth-and-min-gain`). :func:`dp_by_depth` keeps the optimum of every
depth from one layered pass, for the min-gain rule. :func:`dp_ranked` keeps, per vertex, the best ``top``
*distinct* sub-hierarchies (exact: if ``i + H`` is among the ``top`` best at ``(i, j)``, then ``H`` is among the
``top`` best at the ``(k, l)`` it uses).
"""

from __future__ import annotations

import numpy as np

from hsd_opt.solver.hierarchy import Solution, drafter_limit
from hsd_opt.solver.instance import Instance

__all__ = ["Solution", "dp", "dp_by_depth", "dp_ranked", "dp_values"]


def _upper_mask(tmax: int) -> np.ndarray:
    """``mask[l-1, j-1]`` True where l > j (the budget rule forbids those edges)."""
    r = np.arange(tmax)
    return r[:, None] > r[None, :]


def _edge_values(inst: Instance, i: int, Vbelow: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Seconds of the verify edge ``(i, j) -> (k, l)`` plus ``mu`` times ``Vbelow[kk, l-1]`` (the value of the
    sub-hierarchy under ``k = below[i][kk]``): shape ``(nk, l, j)``, inf where the budget rule forbids l > j."""
    val = inst.gam[i] * (inst.vcost[i][:, :, None] + Vbelow[:, :, None])         # (nk, l, j)
    ab = inst.abst[i]
    if len(ab):                                                                   # rounds the drafter abstained
        val[ab] += inst.gam_u[i] * inst.v_abst[i][:, None, None]
    val[:, mask] = np.inf
    return val


def _relax(inst: Instance, i: int, Vsrc: np.ndarray, mask: np.ndarray):
    """Best verify edge out of every ``(i, j)``: returns ``(value (tmax,), k (tmax,), l (tmax,))`` or None."""
    ks = inst.below[i]
    if len(ks) == 0:
        return None
    tmax = inst.tmax
    flat = _edge_values(inst, i, Vsrc[ks], mask).reshape(-1, tmax)
    arg = flat.argmin(axis=0)
    return flat[arg, np.arange(tmax)], ks[arg // tmax], arg % tmax + 1


def _sweep(inst: Instance, src: np.ndarray | None, mask: np.ndarray, edges: bool = True):
    """One Bellman sweep over the drafters, cheapest first: ``(V, bk, bl)``, each ``(D, tmax)``.

    The verify edges read ``src`` (the layer below), or the values being filled when ``src`` is None (no depth
    limit); ``edges=False``: the sink edges only (layer 0, every drafter at the bottom).
    """
    D, tmax = len(inst.names), inst.tmax
    js = np.arange(1, tmax + 1)
    V = np.empty((D, tmax))
    bk = np.full((D, tmax), -1, dtype=int)
    bl = np.full((D, tmax), -1, dtype=int)
    for i in range(D):
        V[i] = js * inst.cost[i]
        if not edges:
            continue
        r = _relax(inst, i, V if src is None else src, mask)
        if r is None:
            continue
        best, k, l = r
        better = best < V[i]
        V[i] = np.where(better, best, V[i])
        bk[i] = np.where(better, k, -1)
        bl[i] = np.where(better, l, -1)
    return V, bk, bl


def dp_values(inst: Instance, max_depth: int | None = None):
    """Bellman values. Returns ``(V, bk, bl)`` with shapes ``(L, D, tmax)``: ``V[d, i, j-1]`` the least expected
    seconds for drafter ``i`` to hand up ``j`` tokens using at most ``d+1`` drafters (only ``L = 1`` layer,
    unlimited, when ``max_depth`` allows every drafter); ``bk/bl`` the next drafter and its budget (-1: ``i`` is
    the bottom).
    """
    D = len(inst.names)
    dmax = drafter_limit(D, max_depth)
    mask = _upper_mask(inst.tmax)
    if dmax >= D:
        layers = [_sweep(inst, None, mask)]
    else:
        layers = [_sweep(inst, None, mask, edges=False)]
        for _ in range(1, dmax):
            layers.append(_sweep(inst, layers[-1][0], mask))
    return tuple(np.stack([layer[x] for layer in layers]) for x in range(3))


def _backtrack(inst: Instance, bk, bl, d: int, i: int, j: int) -> Solution:
    """The chain from ``(i, j)`` at layer ``d``, each step reading the layer below. ``bk``/``bl`` are indexed by
    layer; layers past the last read the last (a converged pass, or the single layer without a depth limit)."""
    last = len(bk) - 1
    chain = [(i, j)]
    while bk[min(d, last)][i, j - 1] >= 0:
        x = min(d, last)
        i, j = int(bk[x][i, j - 1]), int(bl[x][i, j - 1])
        d = max(d - 1, 0)
        chain.append((i, j))
    chain.reverse()
    return Solution(0.0, [inst.names[i] for i, _ in chain] + [inst.target], [j for _, j in chain])


def _at_source(inst: Instance, V: np.ndarray) -> tuple[float, int, int]:
    """Best source edge over the values ``V`` (D, tmax): ``(seconds per token, drafter, budget)``."""
    vals = inst.src_rate * (inst.src_cost + V[inst.src]) + inst.src_add         # (ns, tmax)
    a = int(np.argmin(vals))
    s, j = divmod(a, inst.tmax)
    return float(vals[s, j]), int(inst.src[s]), j + 1


def _target_alone(inst: Instance) -> Solution:
    return Solution(inst.cK, [inst.target], [])


def dp(inst: Instance, max_depth: int | None = None) -> Solution:
    """Optimal hierarchy and budgets by the Bellman recursion; the target alone when nothing beats it.

    ``latency`` is seconds per token. Ties keep the target alone, then the fewer levels, then cheaper drafters
    and smaller budgets.
    """
    dmax = drafter_limit(len(inst.names), max_depth)
    if dmax == 0 or len(inst.src) == 0:
        return _target_alone(inst)
    V, bk, bl = dp_values(inst, max_depth)
    d = V.shape[0] - 1
    L, i, j = _at_source(inst, V[d])
    if not L < inst.cK:
        return _target_alone(inst)
    sol = _backtrack(inst, bk, bl, d, i, j)
    sol.latency = L
    return sol


def dp_by_depth(inst: Instance, max_depth: int | None = None) -> list[Solution]:
    """The optimum of every depth from one layered pass: ``out[n - 1]`` is the optimal plan with at most ``n``
    models (target included), for n = 1 .. ``D + 1`` with ``D`` drafters, or up to ``max_depth`` if lower.

    ``out[n - 1]`` equals ``dp(inst, max_depth=n)``: the same hierarchy, budgets and latency, ties included.
    Layer ``d`` of the recursion holds the values with at most ``d + 1`` drafters; the pass stops when a layer
    equals the one below (values are non-increasing in ``d``, and a layer that repeats the one below repeats
    forever after), so its cost is about one :func:`dp` per layer computed, not per depth.
    """
    D = len(inst.names)
    dmax = drafter_limit(D, max_depth)
    if dmax == 0 or len(inst.src) == 0:
        return [_target_alone(inst) for _ in range(dmax + 1)]
    mask = _upper_mask(inst.tmax)
    layers = [_sweep(inst, None, mask, edges=False)]
    while len(layers) < dmax:
        nxt = _sweep(inst, layers[-1][0], mask)
        if np.array_equal(nxt[0], layers[-1][0]):
            layers.append(nxt)            # the fixed point: every deeper layer is this one (values and choices)
            break
        layers.append(nxt)
    bk = [layer[1] for layer in layers]
    bl = [layer[2] for layer in layers]
    at_source = [_at_source(inst, layer[0]) for layer in layers]
    out = [_target_alone(inst)]
    for d in range(dmax):                 # n = d + 2 models: the source reads layer d
        L, i, j = at_source[min(d, len(layers) - 1)]
        if not L < inst.cK:
            out.append(_target_alone(inst))
            continue
        sol = _backtrack(inst, bk, bl, d, i, j)
        sol.latency = L
        out.append(sol)
    return out


# ------------------------------------------------------------------------------------------- ranked (top-n)


def _ranked_candidates(inst: Instance, i: int, Vbelow: np.ndarray, mask: np.ndarray):
    """The verify edges out of drafter ``i`` that can lead to one of the ``top`` best chains at some ``(i, j)``.

    ``Vbelow[kk, l-1, m]`` (nk, tmax, top): the value of the ``m``-th best chain under ``k = below[i][kk]`` with
    budget ``l`` (ascending in ``m``, inf where there is none). A candidate is ``(kk, l, m)`` into budget ``j``
    with value ``mu * Vbelow + cost``. The ``top`` chains at one ``(k, l)`` are distinct, so the ``top``-th
    distinct chain at ``(i, j)`` is no worse than the worst of them at the best such ``(k, l)``: ``bound[j]``.
    Every finite candidate up to the bound is returned (a few more may be), as arrays ``(j, value, kk, l - 1, m)``
    sorted by ``j``, then value, then the flat index ``(kk, l, m)``: for each ``j`` the start of the stable sort
    of all candidates, long enough to hold the ``top`` best distinct chains.
    """
    top = Vbelow.shape[2]
    best = _edge_values(inst, i, Vbelow[:, :, 0], mask)                        # m = 0 is the least per (k, l)
    bound = _edge_values(inst, i, Vbelow[:, :, top - 1], mask).reshape(-1, inst.tmax).min(axis=0)
    kk, l, j = np.nonzero((best <= bound[None, None, :]) & np.isfinite(best))
    val = inst.gam[i][kk, l, j][:, None] * (inst.vcost[i][kk, l][:, None] + Vbelow[kk, l, :])   # (n, top)
    ab = inst.abst[i]
    if len(ab):
        pos = np.full(len(inst.below[i]), -1)
        pos[ab] = np.arange(len(ab))
        p = pos[kk]
        hit = p >= 0
        val[hit] += (inst.gam_u[i][p[hit], l[hit], j[hit]] * inst.v_abst[i][p[hit]])[:, None]
    m = np.broadcast_to(np.arange(top), val.shape).reshape(-1)
    kk, l, j = (np.repeat(x, top) for x in (kk, l, j))
    val = val.reshape(-1)
    keep = np.isfinite(val)
    kk, l, j, m, val = kk[keep], l[keep], j[keep], m[keep], val[keep]
    order = np.lexsort(((kk * inst.tmax + l) * top + m, val, j))
    return j[order], val[order], kk[order], l[order], m[order]


def dp_ranked(inst: Instance, top: int, max_depth: int | None = None) -> list[Solution]:
    """The ``top`` best *distinct* drafting hierarchies (each with its best budgets), best first.

    The target alone is not in the list. Cost: about ``top`` times :func:`dp` plus a sort per vertex over the
    candidates that can still be among its ``top``.
    """
    D, tmax = len(inst.names), inst.tmax
    dmax = drafter_limit(D, max_depth)
    if top < 1 or dmax == 0 or len(inst.src) == 0:
        return []
    js = np.arange(1, tmax + 1)
    mask = _upper_mask(tmax)
    layered = dmax < D
    nl = dmax if layered else 1
    chains: list[tuple[int, ...]] = []
    chain_id: dict[tuple[int, ...], int] = {}
    Vt = np.full((nl, D, tmax, top), np.inf)
    Cid = np.full((nl, D, tmax, top), -1, dtype=int)
    back = np.full((nl, D, tmax, top, 3), -1, dtype=int)       # (k, l, m) of the next level, -1 = bottom
    for d in range(nl):
        src_layer = d - 1 if layered else d
        for i in range(D):
            _rank_vertex(inst, i, js, mask, chains, chain_id, Vt[d], Cid[d], back[d], Vt[src_layer], Cid[src_layer],
                         len(inst.below[i]) > 0 and not (layered and d == 0))
    return _ranked_at_source(inst, top, Vt[nl - 1], Cid[nl - 1], back, chains, layered)


def _intern(chains: list[tuple[int, ...]], chain_id: dict[tuple[int, ...], int], c: tuple[int, ...]) -> int:
    """The id of chain ``c`` (drafter indices, top first): its index in ``chains``, appended the first time."""
    if c not in chain_id:
        chain_id[c] = len(chains)
        chains.append(c)
    return chain_id[c]


def _rank_vertex(inst: Instance, i: int, js: np.ndarray, mask: np.ndarray, chains: list, chain_id: dict,
                 V: np.ndarray, C: np.ndarray, B: np.ndarray, Vsrc: np.ndarray, Csrc: np.ndarray,
                 use_edges: bool) -> None:
    """Fill drafter ``i``'s ``top`` best distinct chains at every budget ``j``, ascending: ``V[i, j-1, m]`` (the
    value), ``C[i, j-1, m]`` (the chain's id, :func:`_intern`) and ``B[i, j-1, m]`` (``(k, l, m)`` of the chain
    below, -1 at the bottom), of one layer (each ``(D, tmax, top)``, ``B`` with a last axis of 3). The candidates:
    ``i`` drafting alone (``j * cost``) and, with ``use_edges``, ``i`` over each distinct chain of the layer read
    (``Vsrc``, ``Csrc``)."""
    tmax, top = inst.tmax, V.shape[2]
    sink_cid = _intern(chains, chain_id, (i,))
    if use_edges:
        ks = inst.below[i]
        cj, cv, ckk, cl, cm = _ranked_candidates(inst, i, Vsrc[ks], mask)
        cc = Csrc[ks][ckk, cl, cm].tolist()
        ck, cl, cm, cv = ks[ckk].tolist(), cl.tolist(), cm.tolist(), cv.tolist()
        cuts = np.searchsorted(cj, np.arange(tmax + 1)).tolist()
    for j in range(tmax):
        entries = [(float(js[j] * inst.cost[i]), sink_cid, (-1, -1, -1))]
        if use_edges:
            seen: set[int] = set()
            for q in range(cuts[j], cuts[j + 1]):
                if len(seen) >= top:
                    break
                c = cc[q]
                if c < 0 or c in seen:
                    continue
                seen.add(c)
                entries.append((cv[q], _intern(chains, chain_id, (i,) + chains[c]), (ck[q], cl[q] + 1, cm[q])))
        entries.sort(key=lambda e: e[0])
        for m, (val_m, c, b) in enumerate(entries[:top]):
            V[i, j, m], C[i, j, m], B[i, j, m] = val_m, c, b


def _ranked_at_source(inst: Instance, top: int, V: np.ndarray, C: np.ndarray, back: np.ndarray, chains: list,
                      layered: bool) -> list[Solution]:
    """The ``top`` best distinct hierarchies from the source's edges into the last layer's chains (``V``, ``C``:
    ``(D, tmax, top)``), best first, each followed down ``back`` (:func:`_ranked_path`)."""
    tmax, d = inst.tmax, back.shape[0] - 1
    vals = (inst.src_rate[:, :, None] * (inst.src_cost[:, :, None] + V[inst.src])
            + inst.src_add[:, :, None])                                                     # (ns, tmax, m)
    cids = C[inst.src]
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
        path = _ranked_path(back, layered, d, int(inst.src[s]), j + 1, m)
        out.append(Solution(float(v[o]), [inst.names[p] for p, _ in path] + [inst.target], [q for _, q in path]))
    return out


def _ranked_path(back: np.ndarray, layered: bool, d: int, i: int, j: int, m: int) -> list[tuple[int, int]]:
    """The ``(drafter, budget)`` levels of the ``m``-th chain at ``(i, j)`` of layer ``d``, bottom first, followed
    down the back-pointers (a layered table descends one layer per level)."""
    path = [(i, j)]
    while True:
        k, l, m2 = back[d, i, j - 1, m]
        if k < 0:
            break
        i, j, m = int(k), int(l), int(m2)
        if layered:
            d -= 1
        path.append((i, j))
    path.reverse()
    return path
