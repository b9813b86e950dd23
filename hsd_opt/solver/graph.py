"""The GSP graph of the HSD problem as a networkx DiGraph (`docs/design.md#the-graph`; HSD paper
(arXiv 2510.19705), Section 3.3 and Table 2).

Vertices: the source ``(target,)``; ``(name, j)`` for every usable drafter and budget j in 1..tmax; a sink
``(name, "L")`` per drafter. Edge attributes ``mu`` (flow multiplier), ``cost`` (seconds) and ``kind``:

=========================  ==================================  ===============================
edge                       mu                                  cost
=========================  ==================================  ===============================
(K) -> (i, j)              R = (1-a[i][K]) / (1-a[i][K]^(j+1))  R * v_K(i, j)
(i, j) -> (k, l), l <= j   gamma(a[k][i], l, j)                 gamma * v_i(k, l)
(i, j) -> (i, L)           1                                    j * c_i
(i, L) -> (i, L)           1/2                                  0
=========================  ==================================  ===============================

``v_i(k, l)`` is the round cost of :func:`hsd_opt.solver.latency.round_cost`: the verify pass over ``l + 1``
tokens (``c_i`` with scalar costs) plus k's expected catch-up after a fully accepted block.
Into a drafter ``k`` that abstains (:attr:`~hsd_opt.formats.ModelEntry.abstains`): ``mu = M`` and the cost adds
``U (v_i(1) + c_k)`` for the rounds without a block; the source edge adds ``src_add`` (:mod:`hsd_opt.solver.instance`).
With ``max_depth`` the drafter vertices carry a third element, the number of drafters still allowed including
this one: ``(name, j, r)``; verify edges go from ``r`` to ``r - 1`` (`docs/design.md#depth-and-min-gain`). Only
vertices reachable from the source are kept. Building is O(D^2 tmax^2) Python objects: use it for inspection and
the LP on small instances (`docs/design.md#the-three-solvers`); the ``dp`` solver works on the same numbers
without networkx.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hsd_opt.errors import HsdError
from hsd_opt.formats import Profile, check_profile
from hsd_opt.solver.hierarchy import drafter_limit
from hsd_opt.solver.instance import Instance, build_instance

if TYPE_CHECKING:
    import networkx as nx


def build_gsp_graph(profile: Profile | Instance, tmax: int | None = None, max_depth: int | None = None) -> nx.DiGraph:
    """Build the GSP DiGraph. ``graph.graph`` holds ``source``, ``target``, ``tmax``, ``max_depth``."""
    import networkx as nx  # imported here: the dp solver and the CLI's start-up do without it

    if not isinstance(profile, (Profile, Instance)):
        raise HsdError(f"profile: expected a Profile (hsd_opt.load_profile(path)[0]) or an Instance, got "
                       f"{type(profile).__name__}")
    if isinstance(profile, Profile):
        check_profile(profile)          # built in Python: checked as a file is
    inst = profile if isinstance(profile, Instance) else build_instance(profile, tmax)
    D, T = len(inst.names), inst.tmax
    dmax = drafter_limit(D, max_depth)
    layered = dmax < D
    src = (inst.target,)
    G = nx.DiGraph(source=src, target=inst.target, tmax=T, max_depth=max_depth)
    G.add_node(src)
    if dmax == 0:
        return G

    def node(i: int, j: int, r: int):
        return (inst.names[i], j, r) if layered else (inst.names[i], j)

    top_r = dmax if layered else 0
    stack = []
    for s, i in enumerate(inst.src):
        for j in range(1, T + 1):
            R = float(inst.src_rate[s, j - 1])
            v = node(i, j, top_r)
            G.add_edge(src, v, mu=R, cost=R * float(inst.src_cost[s, j - 1]) + float(inst.src_add[s, j - 1]),
                       kind="source")
            stack.append((int(i), j, top_r))
    seen = set()
    while stack:
        i, j, r = stack.pop()
        if (i, j, r) in seen:
            continue
        seen.add((i, j, r))
        u = node(i, j, r)
        name = inst.names[i]
        G.add_edge(u, (name, "L"), mu=1.0, cost=j * float(inst.cost[i]), kind="sink")
        G.add_edge((name, "L"), (name, "L"), mu=0.5, cost=0.0, kind="loop")
        if layered and r <= 1:
            continue
        abst = {int(kk): x for x, kk in enumerate(inst.abst[i])}
        for kk, k in enumerate(inst.below[i]):
            for l in range(1, j + 1):
                g = float(inst.gam[i][kk, l - 1, j - 1])
                c = g * float(inst.vcost[i][kk, l - 1])
                if kk in abst:
                    x = abst[kk]
                    c += float(inst.gam_u[i][x, l - 1, j - 1]) * float(inst.v_abst[i][x])
                r2 = r - 1 if layered else r
                G.add_edge(u, node(k, l, r2), mu=g, cost=c, kind="verify")
                stack.append((int(k), l, r2))
    return G
