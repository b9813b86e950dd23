"""The solver's public functions: :func:`solve`, :func:`evaluate`, :func:`simulate` (plain data in and out).

Each takes an optional ``context`` (tokens): a profile with costs at several context lengths is first resolved at
that context (:func:`~hsd_opt.solver.context.profile_at_context`; by default at the profile's typical context,
:func:`~hsd_opt.solver.context.typical_context`), and everything after works on the resolved profile
(`docs/design.md#costs-that-depend-on-the-context`)."""

from __future__ import annotations

import os
from typing import Any, Sequence

from hsd_opt.errors import HsdError
from hsd_opt.formats import (
    EXACT_PASS,
    PLAN_FORMAT,
    Plan,
    Profile,
    check_has_rates,
    check_profile,
    load_profile,
    plan_from_dict,
)
from hsd_opt.solver.brute import brute, brute_ranked
from hsd_opt.solver.context import CONTEXT_GIVEN, check_context, latency_table, profile_at_context, typical_context
from hsd_opt.solver.dp import dp, dp_by_depth, dp_ranked
from hsd_opt.solver.graph import build_gsp_graph
from hsd_opt.solver.hierarchy import Solution, check_max_depth, pick_by_min_gain
from hsd_opt.solver.instance import Instance, build_instance
from hsd_opt.solver.latency import best_single_draft, hierarchy_latency, target_only
from hsd_opt.solver.lp import solve_lp
from hsd_opt.solver.simulate import SimResult
from hsd_opt.solver.simulate import simulate as _simulate
from hsd_opt.solver.task_view import task_profile
from hsd_opt.values import is_integer, is_real

SOLVERS = ("dp", "lp", "lp-cvxpy", "brute")


def _as_profile(profile: Profile | str | os.PathLike) -> Profile:
    """``profile``, or the profile read from that path; :class:`HsdError` for anything else (a dict:
    :func:`~hsd_opt.formats.profile_from_dict` reads one). A :class:`Profile` built or changed in Python is checked
    as :func:`~hsd_opt.formats.load_profile` checks a file (an :class:`InputFileError` naming ``profile`` and the
    field: a rate outside [0, 1] or NaN, a cost that is not a number > 0, a target the models lack), so that no
    plan or latency is computed from values a file could not hold."""
    if isinstance(profile, Profile):
        check_profile(profile)
        return profile
    if not isinstance(profile, (str, os.PathLike)):
        raise HsdError(f"profile: expected a Profile or the path of a profile file, got {type(profile).__name__} "
                       f"(a dict: profile_from_dict(d)[0])")
    return load_profile(profile)[0]


def resolve_context(profile: Profile, context: float | None = None) -> tuple[Profile, float | None, str | None]:
    """``(profile at the context, the context in tokens, where it came from)``: ``context`` when given, else the
    profile's :func:`~hsd_opt.solver.context.typical_context`. A profile without ``context_costs`` is returned as
    it is with ``(None, None)``: its costs do not depend on the context."""
    if not profile.context_costs:
        if context is not None:
            check_context(context)
        return profile, None, None
    if context is not None:
        ctx, source = check_context(context), CONTEXT_GIVEN
        ctx = int(ctx) if ctx == int(ctx) else ctx
    else:
        ctx, source = typical_context(profile)
    return profile_at_context(profile, ctx), ctx, source


def check_plan_tmax(tmax: int) -> None:
    """Refuse a plan's largest budget outside 1 .. ``EXACT_PASS - 1`` (tokens): a verification over more positions
    would not be computed as the target's steps, and a plan that asks for one is refused when run."""
    if not (is_integer(tmax) and 1 <= tmax < EXACT_PASS):
        raise HsdError(f"--tmax: expected an integer in 1..{EXACT_PASS - 1} (a verification over more positions "
                       f"would not be computed as the target's steps), got {tmax!r}")


def _checked_instance(profile: Profile, tmax: int, solver: str, max_depth: int | None) -> Instance:
    if solver not in SOLVERS:
        raise HsdError(f"--solver: expected one of {', '.join(SOLVERS)}, got {solver!r}")
    inst = build_instance(profile, tmax)
    check_max_depth(max_depth)
    return inst


def _optimum_of(profile: Profile, inst: Instance, solver: str, max_depth: int | None) -> Solution:
    if solver == "dp":
        return dp(inst, max_depth)
    if solver == "brute":
        return brute(profile, inst.tmax, max_depth)
    sol = solve_lp(build_gsp_graph(inst, max_depth=max_depth), "highs" if solver == "lp" else "cvxpy")
    if sol is None or not sol.latency < inst.cK:
        return Solution(inst.cK, [profile.target], [], sol.info if sol else {})
    sol.latency = hierarchy_latency(profile, sol.hierarchy, sol.budgets)
    return sol


def optimum(profile: Profile, tmax: int, solver: str = "dp", max_depth: int | None = None,
            context: float | None = None) -> Solution:
    """The optimal hierarchy by one solver, as a :class:`Solution` (latency in seconds per token), at ``context``
    tokens (default: the profile's typical context; ignored without ``context_costs``).

    ``lp``/``lp-cvxpy`` report the exact latency of the decoded hierarchy (the LP objective is in ``info``).
    ``profile`` is checked as :func:`solve` checks it.
    """
    if not isinstance(profile, Profile):
        raise HsdError(f"profile: expected a Profile (hsd_opt.load_profile(path)[0]), got {type(profile).__name__}")
    profile, _, _ = resolve_context(_as_profile(profile), context)
    return _optimum_of(profile, _checked_instance(profile, tmax, solver, max_depth), solver, max_depth)


def _optima_by_depth(profile: Profile, inst: Instance, solver: str, depth: int) -> list[Solution]:
    """The optimum with at most ``n`` models for n = 2..``depth``: one layered pass with ``dp``
    (:func:`~hsd_opt.solver.dp.dp_by_depth`), one solve per depth with the other solvers."""
    if solver == "dp":
        return dp_by_depth(inst, depth)[1:]
    return [_optimum_of(profile, inst, solver, n) for n in range(2, depth + 1)]


def _entry(profile: Profile, hierarchy: list[str], budgets: list[int], latency: float,
           full: Profile | None = None, resolved: dict | None = None) -> dict:
    """A plan entry; with ``full`` (the profile before resolving its context) holding ``context_costs``, also the
    entry's ``latency_by_context`` (:func:`~hsd_opt.solver.context.latency_table`)."""
    e = {"hierarchy": list(hierarchy), "budgets": list(budgets), "expected_latency": latency,
         "expected_speedup": target_only(profile) / latency}
    if full is not None and full.context_costs:
        e["latency_by_context"] = latency_table(full, hierarchy, budgets, resolved)
    return e


def solve(profile: Profile | str | os.PathLike, tmax: int, solver: str = "dp", max_depth: int | None = None,
          top: int = 5, min_gain: float = 0.0, context: float | None = None) -> Plan:
    """Latency-optimal hierarchy and budgets for ``profile`` with budgets in 1..``tmax`` tokens, at ``context``.

    Args:
        profile: a :class:`Profile` or a path to ``hsd-profile/1``.
        tmax: largest budget (tokens), 1 .. ``EXACT_PASS - 1`` (63).
        solver: ``dp`` (default, exact Bellman recursion), ``lp`` (GSP LP, scipy HiGHS), ``lp-cvxpy``,
            ``brute`` (enumeration; small pools only).
        max_depth: most models in the hierarchy, target included (2 = one drafter + target); None: no limit.
        top: how many hierarchies to rank; ``alternatives`` holds the next-best ``top - 1`` distinct ones
            (computed by the ranked dp, or by enumeration with ``brute``).
        min_gain: 0 (default) = the exact optimum. ``g > 0``: a hierarchy of three or more models is chosen only
            when it is predicted at least a fraction ``g`` faster than the plan it replaces, the one chosen with
            fewer models (measured costs and acceptance rates are noisy; a deeper plan that wins by less than their
            error may well lose when run). A single draft is always weighed against the target alone without this margin
            (:func:`~hsd_opt.solver.hierarchy.pick_by_min_gain`, `docs/design.md#depth-and-min-gain`).
            The exact optimum is then kept in ``exact_optimum`` when it differs.
        context: tokens in the KV cache the costs are taken at, for a profile with ``context_costs``
            (`docs/design.md#costs-that-depend-on-the-context`); None: the profile's typical context (its mean
            prompt plus half its mean generation; a task's view: that task's). Ignored for a profile measured at
            one context.

    Raises:
        InputFileError: a costs-only profile (:func:`~hsd_opt.formats.check_has_rates`).

    Returns:
        a :class:`Plan` (``hsd-plan/1``): latencies in seconds per token, speed-up vs the target alone. With
        ``context_costs``: ``context`` and ``context_from`` (where the context came from), and a
        ``latency_by_context`` table next to every latency (the plan, its baselines and alternatives).
    """
    full = _as_profile(profile)
    check_has_rates(full, "<profile>" if isinstance(profile, Profile) else str(profile))
    check_plan_tmax(tmax)
    profile, ctx, ctx_from = resolve_context(full, context)
    resolved: dict = {}
    if not (is_real(min_gain) and 0.0 <= min_gain < 1.0):
        raise HsdError(f"--min-gain: expected a fraction in [0, 1), got {min_gain!r}")
    if not is_integer(top) or top < 1:
        raise HsdError(f"--top: expected an integer >= 1, got {top!r}")
    inst = _checked_instance(profile, tmax, solver, max_depth)
    sol = _optimum_of(profile, inst, solver, max_depth)
    exact = sol
    if min_gain > 0 and len(sol.hierarchy) > 2:
        sol = pick_by_min_gain(_optima_by_depth(profile, inst, solver, len(sol.hierarchy)), float(min_gain))
    cK = target_only(profile)
    bsd = best_single_draft(profile, tmax)
    baselines = {"target_only": _entry(profile, [profile.target], [], cK, full, resolved)}
    if bsd is not None:
        baselines["best_single_draft"] = _entry(profile, *bsd, full, resolved)
    bee = best_single_draft(profile, tmax, kinds=("early_exit",))
    if bee is not None:
        baselines["best_early_exit"] = _entry(profile, *bee, full, resolved)
    if top > 1:
        ranked = (brute_ranked(profile, tmax, max_depth) if solver == "brute"
                  else dp_ranked(inst, top, max_depth))
    else:
        ranked = []
    alts = [_entry(profile, s.hierarchy, s.budgets, s.latency, full, resolved)
            for s in ranked if s.hierarchy != sol.hierarchy][: max(0, top - 1)]
    fields = {"target": profile.target, "solver": solver, "max_depth": max_depth, "min_gain": float(min_gain),
              "profile_sha256": full.fingerprint(), "latency_unit": "seconds/token",
              "alternatives": alts}
    if ctx is not None:
        fields["context"] = ctx
        fields["context_from"] = ctx_from
        fields["latency_by_context"] = latency_table(full, sol.hierarchy, sol.budgets, resolved)
    if exact.hierarchy != sol.hierarchy:
        fields["exact_optimum"] = _entry(profile, exact.hierarchy, exact.budgets, exact.latency, full, resolved)
    prov = full.provenance.to_dict()
    if prov:
        fields["provenance"] = prov
    # Every model entry of the pool, so `hsd run`/`hsd bench` can rebuild the hierarchy and the baselines
    # (kind, layer, token-drafter config) from the plan alone.
    fields["models"] = [m.to_dict() for m in full.models]
    return plan_from_dict({"format": PLAN_FORMAT, "tmax": int(tmax), "hierarchy": sol.hierarchy,
                           "budgets": sol.budgets, "expected_latency": float(sol.latency),
                           "expected_speedup": cK / sol.latency, "baselines": baselines, **fields}, "<hsd solve>")


def evaluate(profile: Profile | str | os.PathLike, hierarchy: Sequence[str], budgets: Sequence[int],
             context: float | None = None) -> float:
    """Expected seconds per token of ``hierarchy`` (cheapest first, target last) with ``budgets`` (tokens), at
    ``context`` tokens (default: the profile's typical context; ignored without ``context_costs``). Budgets are
    1 .. ``EXACT_PASS - 1`` tokens, as a plan's, in any order (a plan's, as the solvers', are non-decreasing)."""
    _check_budgets(budgets)
    return hierarchy_latency(resolve_context(_as_profile(profile), context)[0], hierarchy, budgets)


def _check_budgets(budgets: Any) -> None:
    """Refuse ``budgets`` that are not a list of integers in 1 .. ``EXACT_PASS - 1`` (tokens), naming the item."""
    if not isinstance(budgets, Sequence) or isinstance(budgets, str):
        raise HsdError(f"budgets: expected a list of budgets in tokens, got {type(budgets).__name__}")
    for i, t in enumerate(budgets):
        if not (is_integer(t) and 1 <= t < EXACT_PASS):
            raise HsdError(f"budgets[{i}]: expected a budget in 1..{EXACT_PASS - 1} tokens, got {t!r}")


def simulate(profile: Profile | str | os.PathLike, hierarchy: Sequence[str] | Plan,
             budgets: Sequence[int] | None = None, rounds: int = 20000, seed: int = 0,
             context: float | None = None) -> SimResult:
    """Monte-Carlo seconds per token of a hierarchy (or a :class:`Plan`) under IID acceptance, with its
    standard error and the predicted value, at ``context`` tokens (default: a plan's own ``context``, else the
    profile's typical context; ignored without ``context_costs``); a plan for one task (``hsd solve --task``) under
    that task's acceptance (:func:`~hsd_opt.solver.task_view.task_profile`), as it was solved; see
    :mod:`hsd_opt.solver.simulate`. Budgets as :func:`evaluate` takes them."""
    if isinstance(hierarchy, Plan):
        plan = hierarchy
        if context is None:
            context = plan.context
        hierarchy, budgets = plan.hierarchy, plan.budgets
        if plan.task is not None:
            profile = task_profile(_as_profile(profile), plan.task, f"the plan (solved for task {plan.task!r})")[0]
    if budgets is None:
        raise HsdError("simulate: budgets are required with a hierarchy")
    _check_budgets(budgets)
    if not is_integer(rounds) or rounds < 1:
        raise HsdError(f"--rounds: expected an integer >= 1, got {rounds!r}")
    if not is_integer(seed) or seed < 0:
        raise HsdError(f"--seed: expected an integer >= 0, got {seed!r}")
    return _simulate(resolve_context(_as_profile(profile), context)[0], hierarchy, budgets, int(rounds), int(seed))
