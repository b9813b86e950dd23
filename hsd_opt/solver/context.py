"""Costs that depend on the context length: a profile's costs at one context, and the context to solve for
(`docs/design.md#costs-that-depend-on-the-context`).

A profile may hold its costs at several context lengths (``context_costs``: tokens already in the KV cache when a
pass runs). Attention reads every cached key, so a pass costs more at a longer context, about linearly.
:func:`profile_at_context` turns such a profile into an ordinary one whose ``cost``, ``cost_curve`` and
``verify_cost`` are the measured figures interpolated linearly in the context (:func:`interpolate`). Every solver
(dp, the GSP LP, brute force) and the Monte-Carlo simulator work on that one resolved profile, so they see the
same numbers. A profile without ``context_costs`` is returned unchanged.

For a fixed hierarchy and budgets the latency is a linear function of the costs with coefficients that depend
on acceptance rates and budgets only, so it is itself piecewise linear in the context with the same knots:
:func:`latency_table` lists it at the measured contexts, and :func:`interpolate` over that table gives the exact
latency at any context (:func:`latency_at`), which is what ``hsd run`` needs without the profile. Exact where the
cost curves grow with the positions of a pass, as measured ones do: a curve that falls somewhere is clamped (a
catch-up pass costs at least nothing, a curve is extended by a slope of at least 0), and a clamp that holds at one
measured context and not at the next bends the latency between them, where the table is then an approximation.

Units: contexts in tokens, costs and latencies in seconds.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import replace
from typing import Sequence

from hsd_opt.errors import HsdError
from hsd_opt.formats import CONTEXT_FIRST, CONTEXT_GIVEN, CONTEXT_PROMPTS, CONTEXT_TASK_PROMPTS, Profile
from hsd_opt.solver.latency import curve_at, hierarchy_latency

__all__ = ["CONTEXT_FIRST", "CONTEXT_GIVEN", "CONTEXT_PROMPTS", "CONTEXT_TASK_PROMPTS"]


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """The value at ``x`` of the points ``(xs[i], ys[i])`` (``xs`` increasing): linear between two points; below
    the first point its value (a context shorter than any measured one costs what the shortest did); beyond the
    last, linear from the last two points with the slope clamped at 0 (as :func:`curve_at` extends a curve over
    t). One point: its value everywhere."""
    n = len(xs)
    if n == 0 or n != len(ys):
        raise ValueError("interpolate: expected as many values as points, at least one")
    if n == 1 or x <= xs[0]:
        return float(ys[0])
    if x >= xs[-1]:
        slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
        return float(ys[-1]) + slope * (x - xs[-1])
    i = bisect_right(xs, x) - 1
    w = (x - xs[i]) / (xs[i + 1] - xs[i])
    return float(ys[i]) + w * (float(ys[i + 1]) - float(ys[i]))


def check_context(context: float, what: str = "--context") -> float:
    """``context`` as a number of tokens >= 1, or :class:`HsdError` naming ``what``."""
    ok = isinstance(context, (int, float)) and not isinstance(context, bool)
    if not ok or not 1 <= context < float("inf"):
        raise HsdError(f"{what}: expected a context length in tokens (>= 1), got {context!r}")
    return float(context)


def _curve_at_context(xs: list[int], curves: list[list[float]], context: float) -> list[float]:
    """Curves over t (one per context, maybe of different lengths) interpolated at ``context``, point by point."""
    n = max(len(c) for c in curves)
    return [interpolate(xs, [curve_at(c, t) for c in curves], context) for t in range(1, n + 1)]


def profile_at_context(profile: Profile, context: float) -> Profile:
    """``profile`` with the costs of ``context_costs`` interpolated at ``context`` tokens in place of the
    top-level ones, and no ``context_costs`` (an ordinary single-context profile). Models and pairs that
    ``context_costs`` does not list keep their top-level costs. A profile without ``context_costs`` is returned
    as it is."""
    if not profile.context_costs:
        return profile
    context = check_context(context)
    cc = profile.context_costs
    xs = [e.context for e in cc]
    first = cc[0]
    costs = {m: interpolate(xs, [e.cost[m] for e in cc], context) for m in first.cost}
    models = [replace(m, cost=costs[m.name]) if m.name in costs else m for m in profile.models]
    cost_curve = dict(profile.cost_curve)
    for m in first.cost_curve:
        cost_curve[m] = _curve_at_context(xs, [e.cost_curve[m] for e in cc], context)
    verify_cost = {v: dict(row) for v, row in profile.verify_cost.items()}
    for v, row in first.verify_cost.items():
        for d in row:
            vals = [e.verify_cost[v][d] for e in cc]
            if all(not isinstance(x, list) for x in vals):
                verify_cost.setdefault(v, {})[d] = interpolate(xs, vals, context)
            else:
                verify_cost.setdefault(v, {})[d] = _curve_at_context(
                    xs, [x if isinstance(x, list) else [x] for x in vals], context)
    return replace(profile, models=models, verify_cost=verify_cost, cost_curve=cost_curve, context_costs=[])


def _mean(total, count) -> float | None:
    ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (total, count))
    return float(total) / float(count) if ok and count > 0 else None


def typical_context(profile: Profile, task: str | None = None) -> tuple[int | None, str | None]:
    """The context to solve ``profile`` for when none is given, and where it came from: ``(tokens, source)``.

    The mean prompt length plus half the mean number of generated tokens of the profiled prompts (of ``task``'s
    prompts when given and recorded; ``provenance.prompt_tokens_by_task`` etc.). A generation of ``G`` tokens
    after a prompt of ``P`` decodes at contexts ``P .. P + G - 1``; costs are linear in the context, so its
    mean cost per token is the cost at ``P + G / 2``. These are also the positions the acceptance rates were
    measured on. Without recorded prompt lengths: the first measured context. ``(None, None)`` for a profile
    whose costs do not depend on the context (no ``context_costs``). ``task`` defaults to the task of a task's
    view (``Profile.task``, :func:`~hsd_opt.solver.task_view.task_profile`)."""
    if not profile.context_costs:
        return None, None
    prov = profile.provenance
    if task is None:
        task = profile.task
    if task is not None:
        n = (prov.get("prompts_by_task") or {}).get(task)
        p = _mean((prov.get("prompt_tokens_by_task") or {}).get(task), n)
        g = _mean((prov.get("positions_by_task") or {}).get(task), n)
        if p is not None and g is not None:
            return max(1, round(p + g / 2)), CONTEXT_TASK_PROMPTS
    n = prov.get("prompt_count")
    p, g = _mean(prov.get("prompt_tokens"), n), _mean(prov.get("generated_tokens"), n)
    if p is not None and g is not None:
        return max(1, round(p + g / 2)), CONTEXT_PROMPTS
    return profile.context_costs[0].context, CONTEXT_FIRST


def latency_table(profile: Profile, hierarchy: Sequence[str], budgets: Sequence[int],
                  resolved: dict[int, Profile] | None = None) -> list[list[float]]:
    """``[[context, seconds per token], ...]``: the latency of ``hierarchy``/``budgets`` at every measured context
    of ``profile`` (empty without ``context_costs``). ``resolved`` caches :func:`profile_at_context` by context."""
    resolved = {} if resolved is None else resolved
    out = []
    for c in profile.contexts:
        if c not in resolved:
            resolved[c] = profile_at_context(profile, c)
        out.append([c, hierarchy_latency(resolved[c], hierarchy, budgets)])
    return out


def latency_at(table: Sequence[Sequence[float]], context: float) -> float:
    """Seconds per token at ``context`` from a :func:`latency_table` (the same rule as the costs: exact inside the
    measured contexts, and beyond them whenever no cost falls with the context)."""
    return interpolate([float(c) for c, _ in table], [float(v) for _, v in table], context)
