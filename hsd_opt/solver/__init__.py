"""The hierarchy solver: exact latency model, GSP graph, dp / LP / brute-force solvers, Monte-Carlo check
(`docs/design.md#the-gsp-reduction-and-the-solvers`).

Modules, each importing only those listed before it: :mod:`.hierarchy` (the ``Solution`` record and the rules
every solver shares: cost order, depth limit, min-gain choice), :mod:`.latency` (gamma, latency of a hierarchy,
baselines), :mod:`.instance` (shared arrays and the edge rules), :mod:`.dp`, :mod:`.graph` (networkx GSP graph),
:mod:`.lp`, :mod:`.brute`, :mod:`.simulate`, :mod:`.task_view` (a profile as one task sees it), :mod:`.api`
(``solve``, ``evaluate``, ``simulate``), :mod:`.tasks` (the plans per task).
"""

from hsd_opt.solver.api import SOLVERS, evaluate, optimum, simulate, solve
from hsd_opt.solver.graph import build_gsp_graph
from hsd_opt.solver.latency import best_single_draft, gamma, gamma_table, hierarchy_latency, target_only
from hsd_opt.solver.simulate import SimResult
from hsd_opt.solver.task_view import profile_tasks, task_profile
from hsd_opt.solver.tasks import solve_tasks

__all__ = ["SOLVERS", "SimResult", "best_single_draft", "build_gsp_graph", "evaluate", "gamma", "gamma_table",
           "hierarchy_latency", "optimum", "profile_tasks", "simulate", "solve", "solve_tasks", "target_only",
           "task_profile"]
