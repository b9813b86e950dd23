"""Plans per task: the profile as the prompts of one task see it, and the best hierarchy for each task.

A profile measured on a mix of tasks keeps, next to the overall figures, each task's acceptance
(``acceptance_by_task[task][drafter][verifier]``) and each abstaining token drafter's share of proposals in the
task (``draft_rate_by_task[task][drafter]``). Costs do not depend on the task. :func:`task_profile` is the
profile with the task's figures in place of the overall ones; a pair without data for the task keeps the overall
value, and is named so the caller can say so. :func:`solve_tasks` solves every task's view: the ``by_task``
section of a plan (``docs/design.md#plans-per-task``). With costs at several contexts, each task is solved at its
own typical context (its prompts' mean length plus half their mean generation,
:func:`~hsd_opt.solver.context.typical_context`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from hsd_opt.errors import HsdError
from hsd_opt.formats import Plan, Profile
from hsd_opt.solver.api import resolve_context, solve
from hsd_opt.solver.context import latency_table
from hsd_opt.solver.latency import hierarchy_latency, target_only


def profile_tasks(profile: Profile) -> list[str]:
    """The tasks with per-task acceptance in ``profile`` (sorted; empty for a profile without them)."""
    return sorted(profile.acceptance_by_task)


def task_positions(profile: Profile, task: str) -> int | None:
    """Generated positions the profile measured for ``task`` (None when not recorded)."""
    n = (profile.provenance.get("positions_by_task") or {}).get(task)
    return int(n) if isinstance(n, (int, float)) and not isinstance(n, bool) else None


def forced_share(profile: Profile, task: str) -> float | None:
    """The share of ``task``'s generated tokens its grammar forced (None: the task had no grammar, or the profile
    did not record it): decoding takes those without a pass."""
    forced = (profile.provenance.get("forced_by_task") or {}).get(task)
    measured = task_positions(profile, task)
    if not isinstance(forced, (int, float)) or isinstance(forced, bool) or forced <= 0 or measured is None:
        return None
    return float(forced) / (float(forced) + measured)


def task_profile(profile: Profile, task: str) -> tuple[Profile, list[str]]:
    """``profile`` as the prompts of ``task`` see it, and the pairs that fell back to the overall value.

    Every measured pair takes the task's acceptance where the task has data for it; an abstaining token drafter
    takes the task's ``draft_rate`` and its shares of rounds per budget (none where the task's were not walked).
    Returns ``(view, fallbacks)``: ``fallbacks`` names each pair (``"drafter->verifier"``) and draft rate
    (``"draft_rate of drafter"``) kept at the overall value.

    Raises:
        HsdError: the profile has no per-task statistics, or none for ``task`` (naming the tasks it has).
    """
    tasks = profile_tasks(profile)
    if not tasks:
        raise HsdError("--task: the profile has no per-task statistics (acceptance_by_task); profile a prompt file "
                       "whose lines name their task (or Spec-Bench questions) to get them")
    if task not in tasks:
        raise HsdError(f"--task: the profile has no statistics for task {task!r}; it has {', '.join(tasks)}")
    acc_t = profile.acceptance_by_task[task] or {}
    rates_t = profile.draft_rate_by_task.get(task) or {}
    fallbacks: list[str] = []
    acceptance: dict[str, dict[str, float]] = {}
    for d, row in profile.acceptance.items():
        for v, a in row.items():
            at = (acc_t.get(d) or {}).get(v)
            if at is None:
                fallbacks.append(f"{d}->{v}")
                at = a
            acceptance.setdefault(d, {})[v] = float(at)
    by_budget_t = profile.draft_rate_by_budget_by_task.get(task) or {}
    models = []
    for m in profile.models:
        if m.draft_rate < 1.0:
            r = rates_t.get(m.name)
            if r is None:
                fallbacks.append(f"draft_rate of {m.name}")
            else:
                m = replace(m, draft_rate=min(1.0, max(1e-6, float(r))),
                            draft_rate_by_budget=tuple(by_budget_t.get(m.name) or ()))
        models.append(m)
    return replace(profile, models=models, acceptance=acceptance, stats=None, task=task), fallbacks


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
