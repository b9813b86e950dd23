"""A profile as the prompts of one task see it: each task's acceptance (``acceptance_by_task[task][drafter]
[verifier]``) and each abstaining token drafter's share of proposals in the task (``draft_rate_by_task``) in place
of the overall figures (:func:`task_profile`); a pair without data for the task keeps the overall value, and is
named so the caller can say so. Costs do not depend on the task. Plans per task are solved from these views
(:mod:`hsd_opt.solver.tasks`); a plan for one task is simulated under its view (:func:`~hsd_opt.solver.api.simulate`).
"""

from __future__ import annotations

from dataclasses import replace

from hsd_opt.errors import HsdError
from hsd_opt.formats import Profile
from hsd_opt.values import is_real


def profile_tasks(profile: Profile) -> list[str]:
    """The tasks with per-task acceptance in ``profile`` (sorted; empty for a profile without them)."""
    return sorted(profile.acceptance_by_task)


def task_positions(profile: Profile, task: str) -> int | None:
    """Generated positions the profile measured for ``task`` (None when not recorded)."""
    n = (profile.provenance.get("positions_by_task") or {}).get(task)
    return int(n) if is_real(n) else None


def forced_share(profile: Profile, task: str) -> float | None:
    """The share of ``task``'s generated tokens its grammar forced (None: the task had no grammar, or the profile
    did not record it, or measured none of its positions): decoding takes those without a pass."""
    forced = (profile.provenance.get("forced_by_task") or {}).get(task)
    measured = task_positions(profile, task)
    if not is_real(forced) or forced <= 0 or not measured:
        return None
    return float(forced) / (float(forced) + measured)


def task_profile(profile: Profile, task: str, asker: str = "--task") -> tuple[Profile, list[str]]:
    """``profile`` as the prompts of ``task`` see it, and the pairs that fell back to the overall value.

    Every measured pair takes the task's acceptance where the task has data for it; an abstaining token drafter
    takes the task's ``draft_rate`` and its shares of rounds per budget (none where the task's were not walked).
    Returns ``(view, fallbacks)``: ``fallbacks`` names each pair (``"drafter->verifier"``) and draft rate
    (``"draft_rate of drafter"``) kept at the overall value.

    Raises:
        HsdError: the profile has no per-task statistics, or none for ``task`` (naming the tasks it has), the
        message led by ``asker`` (what asked for the task: the flag, or a plan solved for it).
    """
    tasks = profile_tasks(profile)
    if not tasks:
        raise HsdError(f"{asker}: the profile has no per-task statistics (acceptance_by_task); profile a prompt file "
                       "whose lines name their task (or Spec-Bench questions) to get them")
    if task not in tasks:
        raise HsdError(f"{asker}: the profile has no statistics for task {task!r}; it has {', '.join(tasks)}")
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
        if m.abstains:
            r = rates_t.get(m.name)
            if r is None:
                fallbacks.append(f"draft_rate of {m.name}")
            else:
                m = replace(m, draft_rate=min(1.0, max(1e-6, float(r))),
                            draft_rate_by_budget=tuple(by_budget_t.get(m.name) or ()))
        models.append(m)
    return replace(profile, models=models, acceptance=acceptance, stats=None, task=task), fallbacks
