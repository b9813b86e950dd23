"""Plans per task: the best hierarchy for each task of a profile.

A profile measured on a mix of tasks keeps, next to the overall figures, each task's acceptance and each
abstaining token drafter's share of proposals in the task; :func:`~hsd_opt.solver.task_view.task_profile` is the
profile as the prompts of one task see it. :func:`solve_tasks` solves every task's view: the ``by_task`` section of
a plan (``docs/design.md#plans-per-task``). With costs at several contexts, each task is solved at its own typical
context (its prompts' mean length plus half their mean generation, :func:`~hsd_opt.solver.context.typical_context`).
"""

from __future__ import annotations

from typing import Any, Sequence

from hsd_opt.formats import Plan, Profile
from hsd_opt.solver.api import resolve_context, solve
from hsd_opt.solver.context import latency_table
from hsd_opt.solver.latency import hierarchy_latency, target_only
from hsd_opt.solver.task_view import forced_share, profile_tasks, task_positions, task_profile


def solve_tasks(profile: Profile, plan: Plan, tmax: int, solver: str = "dp", max_depth: int | None = None,
                min_gain: float = 0.0, tasks: Sequence[str] | None = None,
                context: float | None = None) -> tuple[dict[str, Any], dict[str, list]]:
    """The ``by_task`` section of ``plan`` (solved from ``profile``): for each task (default: every task of the
    profile) the best hierarchy under the task's view, with the same settings as the plan, at ``context`` tokens
    (default: each task's typical context; ignored without ``context_costs``).

    Returns ``(by_task, fallbacks)``. ``by_task[task]`` is ``{hierarchy, budgets, expected_latency,
    expected_speedup, positions, fallback_pairs, overall_hierarchies}``, where ``overall_hierarchies`` holds the
    expected latency (seconds per token) on this task of the plan's own hierarchy (``plan``) and of its
    baselines: what running the overall plan on the task's prompts predicts. With ``context_costs`` also
    ``context``, ``context_from``, ``latency_by_context`` and ``overall_hierarchies_by_context`` (a
    :func:`~hsd_opt.solver.context.latency_table` per key). ``fallbacks[task]`` lists the pairs kept at the
    overall value (:func:`task_profile`).
    """
    out: dict[str, Any] = {}
    notes: dict[str, list] = {}
    for task in (tasks if tasks is not None else profile_tasks(profile)):
        view, fallbacks = task_profile(profile, task)
        here, ctx, ctx_from = resolve_context(view, context)
        p = solve(view, tmax, solver=solver, max_depth=max_depth, top=1, min_gain=min_gain, context=ctx)
        keyed = {"plan": (plan.hierarchy, plan.budgets)}
        for key, b in plan.baselines.items():
            if isinstance(b, dict) and b.get("hierarchy"):
                keyed[key] = (b["hierarchy"], b.get("budgets") or [])
        overall = {k: hierarchy_latency(here, h, b) for k, (h, b) in keyed.items()}
        e = {"hierarchy": p.hierarchy, "budgets": p.budgets, "expected_latency": p.expected_latency,
             "expected_speedup": target_only(here) / p.expected_latency,
             "positions": task_positions(profile, task), "fallback_pairs": len(fallbacks),
             "overall_hierarchies": overall}
        if (f := forced_share(profile, task)) is not None:
            e["forced_share"] = f
        if ctx is not None:
            resolved: dict = {}
            e.update({"context": ctx, "context_from": ctx_from,
                      "latency_by_context": p.latency_by_context,
                      "overall_hierarchies_by_context": {k: latency_table(view, h, b, resolved)
                                                         for k, (h, b) in keyed.items()}})
        out[task] = e
        notes[task] = fallbacks
    return out, notes
