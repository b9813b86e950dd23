"""The GSP linear program over :func:`~hsd_opt.solver.graph.build_gsp_graph` (`docs/design.md#the-three-solvers`;
HSD paper (arXiv 2510.19705), Definition 3.3).

minimise ``sum_e f(e) cost(e)`` s.t. ``out(v) - sum_in mu(e) f(e) = [v == source]``, ``f >= 0``.
Backends: scipy HiGHS (``linprog(method="highs")``, default) and cvxpy. The optimal flow is an augmented path
(Oldham, "Combinatorial approximation algorithms for generalized flow problems", J. Algorithms
2001, Lemma 3.6); the hierarchy is decoded by following, from the source, the out-edge carrying the
most flow until a sink edge. A convex combination of equally good paths decodes to one of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hsd_opt.errors import HsdError
from hsd_opt.packages import need
from hsd_opt.solver.hierarchy import Solution

if TYPE_CHECKING:
    import networkx as nx


def lp_matrices(G: nx.DiGraph):
    """``(edges, c, A_eq, b_eq)`` of the GSP LP: one column per edge, one row per vertex."""
    import scipy.sparse as sp  # imported here, like scipy.optimize below: only the LP solvers need it

    nodes = list(G.nodes)
    nidx = {v: n for n, v in enumerate(nodes)}
    edges = list(G.edges(data=True))
    rows, cols, vals = [], [], []
    for e, (u, v, d) in enumerate(edges):
        rows.append(nidx[u]); cols.append(e); vals.append(1.0)          # noqa: E702
        rows.append(nidx[v]); cols.append(e); vals.append(-d["mu"])     # noqa: E702 (self-loops add up)
    A = sp.csr_matrix((vals, (rows, cols)), shape=(len(nodes), len(edges)))
    b = np.zeros(len(nodes))
    b[nidx[G.graph["source"]]] = 1.0
    c = np.array([d["cost"] for _, _, d in edges])
    return edges, c, A, b


def _decode(G: nx.DiGraph, edges, flow: np.ndarray, objective: float, backend: str) -> Solution:
    out: dict = {}
    for (u, v, d), f in zip(edges, flow):
        if f > 1e-9 and d["kind"] != "loop":
            if u not in out or f > out[u][1]:
                out[u] = (v, f, d["kind"])
    u = G.graph["source"]
    path = []
    while u in out:
        v, _, kind = out[u]
        if kind == "sink":
            break
        path.append(v)
        u = v
    if not path:
        raise HsdError(f"lp ({backend}): no augmented path in the optimal flow")
    path.reverse()
    hierarchy = [p[0] for p in path] + [G.graph["target"]]
    budgets = [int(p[1]) for p in path]
    return Solution(float(objective), hierarchy, budgets, {"lp_objective": float(objective), "backend": backend})


def solve_lp(G: nx.DiGraph, backend: str = "highs") -> Solution | None:
    """Solve the GSP LP on ``G``. Returns the decoded drafting hierarchy (``latency`` = LP objective), or None
    when the graph has no drafter (only the target alone is possible)."""
    if G.number_of_edges() == 0:
        return None
    edges, c, A, b = lp_matrices(G)
    if backend == "highs":
        from scipy.optimize import linprog

        res = linprog(c, A_eq=A, b_eq=b, bounds=(0, None), method="highs")
        if res.status != 0:
            raise HsdError(f"lp (highs): {res.message}")
        return _decode(G, edges, res.x, res.fun, "highs")
    if backend == "cvxpy":
        need("cvxpy", what="the lp-cvxpy solver")
        import cvxpy as cp

        x = cp.Variable(len(edges), nonneg=True)
        prob = cp.Problem(cp.Minimize(c @ x), [A @ x == b])
        solver = "HIGHS" if "HIGHS" in cp.installed_solvers() else None
        prob.solve(solver=solver) if solver else prob.solve()
        if prob.status not in ("optimal", "optimal_inaccurate"):
            raise HsdError(f"lp (cvxpy): status {prob.status}")
        return _decode(G, edges, np.asarray(x.value), prob.value, "cvxpy")
    raise HsdError(f"--solver: unknown LP backend {backend!r} (highs, cvxpy)")
