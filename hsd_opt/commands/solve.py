"""`hsd solve` (latency-optimal hierarchy and budgets) and `hsd simulate` (Monte-Carlo check of a plan)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table
from rich.text import Text

from hsd_opt.commands.common import check_outputs, cli_command
from hsd_opt.console import console, warn, warn_some
from hsd_opt.errors import HsdError, InputFileError
from hsd_opt.formats import check_has_rates, load_plan, load_profile, plan_from_dict, save_plan
from hsd_opt.solver.batch import LOAD_MIN_GAIN
from hsd_opt.solver.task_view import profile_tasks


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.5g}"


def _chain(h: list[str], b: list[int]) -> str:
    if len(h) == 1:
        return h[0]
    return " <- ".join(f"{m}" + (f" (T={b[i]})" if i < len(b) else "") for i, m in reversed(list(enumerate(h))))


CONTEXT_FROM = {"given": "--context", "profile_prompts": "the profiled prompts", "task_prompts": "the task's prompts",
                "first_measured_context": "the first measured context"}


def _context_note(plan) -> str:
    c = plan.context
    if c is None:
        return ""
    src = CONTEXT_FROM.get(plan.context_from, plan.context_from)
    return f", costs at a context of {c:g} tokens" + (f" from {src}" if src else "")


def plan_table(plan) -> Table:
    """Rich table: the plan, best single draft, best early exit, target alone, next-best alternatives."""
    how = plan.provenance.sampling
    t = Table(title=f"hsd plan (tmax={plan.tmax}, solver={plan.solver or '?'}{_context_note(plan)}"
                    f"{f'; for {how}' if how else ''})")
    t.add_column("")
    t.add_column("hierarchy (target <- ... <- bottom, budgets in tokens)")
    t.add_column("ms/token", justify="right")
    t.add_column("speed-up", justify="right")
    t.add_row(Text("plan", style="bold"), _chain(plan.hierarchy, plan.budgets), _ms(plan.expected_latency),
              f"{plan.expected_speedup:.3f}x")
    for key, label in (("best_single_draft", "best single draft"), ("best_early_exit", "best early exit")):
        b = plan.baselines.get(key)
        if b:
            t.add_row(label, _chain(b["hierarchy"], b["budgets"]), _ms(b["expected_latency"]),
                      f"{b['expected_speedup']:.3f}x")
    tgt = plan.baselines["target_only"]
    t.add_row("target alone", tgt["hierarchy"][0], _ms(tgt["expected_latency"]), "1.000x")
    for n, alt in enumerate(plan.alternatives, 2):
        t.add_row(f"#{n}", _chain(alt.hierarchy, alt.budgets), _ms(alt.expected_latency),
                  "-" if alt.expected_speedup is None else f"{alt.expected_speedup:.3f}x")
    return t


def tasks_table(plan) -> Table:
    """Rich table of a plan's ``by_task`` section: each task's best hierarchy next to the overall plan there."""
    contexts = any(e.context is not None for e in plan.by_task.values())
    t = Table(title="plans per task (acceptance of each task's prompts; costs shared"
                    + (", at each task's context)" if contexts else ")"))
    cols = [("task", "left"), ("positions", "right")] + ([("context", "right")] if contexts else [])
    cols += [("hierarchy (budgets in tokens)", "left"), ("ms/token", "right"), ("speed-up", "right"),
             ("plan's ms/token", "right"), ("gain", "right")]
    for c, j in cols:
        t.add_column(c, justify=j)
    for task, e in plan.by_task.items():
        here = e.overall_hierarchies.get("plan")
        ctx = [f"{e.context:g}" if e.context is not None else "-"] if contexts else []
        t.add_row(task, "-" if e.positions is None else str(e.positions), *ctx,
                  _chain(e.hierarchy, e.budgets), _ms(e.expected_latency),
                  "-" if e.expected_speedup is None else f"{e.expected_speedup:.3f}x",
                  "-" if here is None else _ms(here), "-" if here is None else f"{here / e.expected_latency - 1:+.1%}")
    forced = [f"{task}: {e.forced_share:.1%} of its tokens forced by its grammar" for task, e in plan.by_task.items()
              if e.forced_share is not None]
    if forced:
        t.caption = "; ".join(forced) + " (taken without a pass; ms/token covers the other tokens)"
    return t


def loads_table(plan) -> Table:
    """Rich table of a plan's ``by_load`` section: each load level's hierarchy, its predicted latency per
    sequence and aggregate throughput, against plain batched decoding (the target alone) at that load."""
    t = Table(title="plans per load level (sequences decoded together; decoding only: a served load also "
                    "computes prompts, which hsd bench --concurrency --retime predicts)")
    for c, j in (("sequences", "right"), ("hierarchy (budgets in tokens)", "left"), ("ms/token each", "right"),
                 ("tokens/s in all", "right"), ("batched target alone", "right"), ("speed-up", "right")):
        t.add_column(c, justify=j)
    for n, e in plan.by_load.items():
        base = e.batched_target_latency
        t.add_row(str(n), _chain(e.hierarchy, e.budgets), _ms(e.expected_latency), f"{n / e.expected_latency:.1f}",
                  "-" if base is None else f"{n / base:.1f}", "-" if base is None else
                  f"{base / e.expected_latency - 1:+.1%}")
    return t


def _warn_fallbacks(fallbacks: dict[str, list[str]]) -> None:
    for task, pairs in fallbacks.items():
        if pairs:
            more = f", ... ({len(pairs)} in all)" if len(pairs) > 4 else ""
            warn(f"task {task}: no per-task figure for {', '.join(pairs[:4])}{more}: the overall value is used")


def _check_plan_against_profile(plan, plan_path: str, profile) -> None:
    """Refuse (naming the plan's field) a plan that is not of ``profile``'s models: another target model, revision
    or target precision where both files record it, a task the profile has no statistics for, a level the
    profile lacks, another target, a pair without an acceptance rate, a verifier that cannot verify."""
    for field in ("model", "revision", "target_precision"):
        mine, theirs = plan.provenance.get(field), profile.provenance.get(field)
        if mine is not None and theirs is not None and mine != theirs:
            raise InputFileError(plan_path, f"the plan is for {field} {mine!r}, the profile for {theirs!r}",
                                 f"provenance.{field}")
    tasks = profile_tasks(profile)
    if plan.task is not None and plan.task not in tasks:
        has = f"it has {', '.join(tasks)}" if tasks else "it has no per-task statistics (acceptance_by_task)"
        raise InputFileError(plan_path, f"the plan was solved for task {plan.task!r}, which the profile has no "
                                        f"statistics for; {has}", "task")
    names = set(profile.names)
    for i, m in enumerate(plan.hierarchy):
        if m not in names:
            raise InputFileError(plan_path, f"model {m!r} is not in the profile ({', '.join(profile.names)})",
                                 f"hierarchy[{i}]")
    if plan.hierarchy[-1] != profile.target:
        raise InputFileError(plan_path, f"ends with {plan.hierarchy[-1]!r} but the profile's target is "
                                        f"{profile.target!r}", "hierarchy")
    for lo, hi in zip(plan.hierarchy[:-1], plan.hierarchy[1:]):
        if profile.accept(lo, hi) is None:
            raise InputFileError(plan_path, f"{hi!r} verifies {lo!r} but the profile has no acceptance.{lo}.{hi}",
                                 "hierarchy")
        if not profile.entry(hi).can_verify:
            raise InputFileError(plan_path, f"{hi!r} cannot verify (can_verify: false in the profile)", "hierarchy")


@cli_command
def solve_cmd(
    profile: Path = typer.Option(..., "--profile", help="hsd-profile/1 JSON (acceptance rates, costs)."),
    tmax: int = typer.Option(15, "--tmax", help="Largest budget T (tokens) any level may hand up (1..63)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the hsd-plan/1 JSON here (atomically)."),
    solver: str = typer.Option("dp", "--solver", help="dp (default, exact DP) | lp (GSP LP, HiGHS) | "
                                                      "lp-cvxpy | brute (enumeration, small pools)."),
    max_depth: Optional[int] = typer.Option(None, "--max-depth",
                                            help="Most models in the hierarchy, target included."),
    top: int = typer.Option(5, "--top", help="Show this many ranked hierarchies (plan + alternatives)."),
    min_gain: float = typer.Option(0.03, "--min-gain",
                                   help="Add a second drafter level (or more) only if it is predicted to take "
                                        "at least this fraction less time per token than the plan it replaces "
                                        "(the one chosen with fewer levels: measurement noise); 0 = the exact "
                                        "optimum."),
    load_min_gain: float = typer.Option(LOAD_MIN_GAIN, "--load-min-gain",
                                        help="At a load level above one sequence (--batch-sizes), speculate "
                                             "only if it is predicted to take at least this fraction less time "
                                             "per token than plain batched decoding (0.25: 1.33x its speed); 0 = "
                                             "the model's optimum."),
    task: Optional[str] = typer.Option(None, "--task", help="Solve for the prompts of one task: the profile's "
                                                            "acceptance for that task (acceptance_by_task)."),
    per_task: bool = typer.Option(False, "--per-task", help="Also solve every task of the profile and add the "
                                                            "plans per task (by_task) to the plan; hsd run and "
                                                            "hsd bench use them for prompts of a known task."),
    context: Optional[int] = typer.Option(None, "--context", help="Tokens in the KV cache to take the costs at "
                                                                 "(a profile with costs at several contexts). "
                                                                 "Default: the profile's mean prompt length plus "
                                                                 "half its mean generation (per task: the "
                                                                 "task's)."),
    batch_sizes: Optional[str] = typer.Option(None, "--batch-sizes", help="Also solve for these numbers of "
                                              "sequences decoded together (e.g. 1,2,4,8; the profile's "
                                              "batch_costs) and add a plan per load level (by_load) to the plan: "
                                              "hsd serve runs the level's hierarchy. Default: every batch size "
                                              "the profile has costs for (none: 1 only)."),
):
    """Find the latency-optimal hierarchy of drafters and budgets for a profile (or for one task of it)."""
    _check_solve_options(tmax, solver, max_depth, top, min_gain, load_min_gain, task, per_task, context)
    check_outputs(("--out", out), inputs=[("--profile", profile)])
    full, sizes = _load_solve_profile(profile, batch_sizes, context)
    prof = _profile_to_solve(full, task, per_task)
    plan = _solve_plan(prof, full, task, per_task, sizes, tmax, solver, max_depth, top, min_gain, load_min_gain,
                       context)
    _print_plan(plan, per_task, min_gain)
    _warn_past_measured(plan, full, profile)
    if out is not None:
        save_plan(plan, out)
        console.print(f"wrote {out}")


#: The most alternatives ``--top`` keeps (the solvers hold every one per state: more is memory, not insight).
MAX_TOP = 1000


def _check_solve_options(tmax: int, solver: str, max_depth: Optional[int], top: int, min_gain: float,
                         load_min_gain: float, task: Optional[str], per_task: bool, context: Optional[int]) -> None:
    """Refuse, in one line naming the flag, a value of ``hsd solve`` out of its range (before any file is read)."""
    from hsd_opt.solver.api import SOLVERS, check_plan_tmax

    check_plan_tmax(tmax)
    if solver not in SOLVERS:
        raise HsdError(f"--solver: expected one of {', '.join(SOLVERS)}, got {solver!r}")
    if max_depth is not None and max_depth < 1:
        raise HsdError(f"--max-depth: expected an integer >= 1 (models including the target), got {max_depth}")
    if not 1 <= top <= MAX_TOP:
        raise HsdError(f"--top: expected an integer in 1..{MAX_TOP} (alternatives kept), got {top}")
    if not 0.0 <= min_gain < 1.0:
        raise HsdError(f"--min-gain: expected a fraction in [0, 1), got {min_gain}")
    if not 0.0 <= load_min_gain < 1.0:
        raise HsdError(f"--load-min-gain: expected a fraction in [0, 1), got {load_min_gain}")
    if task is not None and per_task:
        raise HsdError("give one of --task TASK (a plan for one task) or --per-task (a plan with a section per task)")
    if context is not None and context < 1:
        raise HsdError(f"--context: expected a context length in tokens (>= 1), got {context}")


def _load_solve_profile(profile: Path, batch_sizes: Optional[str], context: Optional[int]):
    """The profile (its load warnings printed; a costs-only one refused) and the batch sizes to solve for:
    ``--batch-sizes`` (each one the
    profile has costs at), else every one it has. Warns where ``--context`` has only one context's costs to use."""
    from hsd_opt.commands.options import batch_sizes as parse_batch_sizes
    from hsd_opt.solver.batch import LACKING_RATIO, lacking_ratios

    sizes = parse_batch_sizes(batch_sizes) if batch_sizes is not None else None
    prof, warnings = load_profile(profile)
    check_has_rates(prof, str(profile))
    warn_some(warnings)
    if len(prof.models) > 1 and not any(prof.acceptance.values()):
        warn(f"{profile}: acceptance: no rates between its drafters: the plan can only be the target alone")
    if sizes is None:
        sizes = prof.batch_sizes
    elif set(sizes) - set(prof.batch_sizes):
        raise HsdError(f"--batch-sizes: {profile} has costs at batch sizes {', '.join(map(str, prof.batch_sizes))} "
                       f"only (profile with --batch-sizes {','.join(map(str, sizes))})")
    for i, bc in enumerate(prof.batch_costs):
        missing = lacking_ratios(prof, bc) if bc.batch in sizes else []
        if missing:          # named here, with the file (the solver's own refusal knows no file)
            raise InputFileError(str(profile), f"no ratio at batch {bc.batch} for {', '.join(missing)} "
                                               f"({LACKING_RATIO})", f"batch_costs[{i}].ratio")
    if context is not None and len(prof.context_costs) < 2:
        warn(f"--context {context}: {profile} has its costs at one context only; they are used as they are")
    elif context is not None and context > 2 * prof.contexts[-1]:
        warn(f"--context {context}: {profile} measured costs up to {prof.contexts[-1]} tokens; they are extended "
             f"linearly past it, further than it measured (profile with --cost-contexts up to the context you run)")
    return prof, sizes


def _profile_to_solve(full, task: Optional[str], per_task: bool):
    """The profile the main plan is solved from: ``full``, or its statistics for ``task`` (the drafters without
    them warned about); ``--per-task`` needs a profile with statistics per task."""
    from hsd_opt.solver.task_view import profile_tasks, task_profile

    if task is not None:
        prof, fallbacks = task_profile(full, task)
        _warn_fallbacks({task: fallbacks})
        return prof
    if per_task and not profile_tasks(full):
        raise HsdError("--per-task: the profile has no per-task statistics (acceptance_by_task); profile a prompt "
                       "file whose lines name their task (or Spec-Bench questions) to get them")
    return full


def _solve_plan(prof, full, task: Optional[str], per_task: bool, sizes: list[int], tmax: int, solver: str,
                max_depth: Optional[int], top: int, min_gain: float, load_min_gain: float, context: Optional[int]):
    """The plan for ``prof`` (tagged with ``task``, said, and the full profile's fingerprint when it is one task's),
    with its plans per task (``per_task``) and per load level (more than one batch size in ``sizes``)."""
    from hsd_opt.solver.api import solve
    from hsd_opt.solver.batch import solve_loads
    from hsd_opt.solver.task_view import task_positions
    from hsd_opt.solver.tasks import solve_tasks

    plan = solve(prof, tmax, solver=solver, max_depth=max_depth, top=top, min_gain=min_gain, context=context)
    if task is not None:
        plan.task, plan.profile_sha256 = task, full.fingerprint()
        n = task_positions(full, task)
        console.print(f"the plan for the prompts of task {task!r}" + (f" ({n} positions profiled)" if n else ""))
    if per_task:
        by_task, fallbacks = solve_tasks(full, plan, tmax, solver=solver, max_depth=max_depth, min_gain=min_gain,
                                         context=context)
        _warn_fallbacks(fallbacks)
        plan = plan_from_dict({**plan.to_dict(), "by_task": by_task}, "<hsd solve>")
    if len(sizes) > 1:
        plan.by_load = solve_loads(prof, tmax, sizes, solver=solver, max_depth=max_depth, min_gain=min_gain,
                                   load_min_gain=load_min_gain, context=context)
        plan.load_min_gain = load_min_gain          # what --retime chooses the levels again with
    return plan


def _warn_past_measured(plan, prof, profile: Path) -> None:
    """Say where the plan (or one of its plans per task or load level) hands up more tokens than the profile
    measured passes for (its ``--tmax``): those budgets are priced by extending its cost curves (and an abstaining
    drafter's share of rounds) past their ends."""
    from hsd_opt.values import is_integer

    measured = prof.provenance.get("tmax")
    entries = [plan, *plan.by_task.values(), *plan.by_load.values()]
    used = max((t for e in entries for t in e.budgets), default=0)
    if is_integer(measured) and used > measured:
        warn(f"{profile} measured budgets up to {measured} (hsd profile --tmax {measured}); the plan's budget of "
             f"{used} is priced by extending its cost curves past what it measured: profile with --tmax {used} or "
             f"more to measure it, or solve with --tmax {measured}")


def _print_plan(plan, per_task: bool, min_gain: float) -> None:
    """Print the plan's table, its tables per task and per load level, and the exact optimum it passed over."""
    console.print(plan_table(plan))
    if per_task:
        console.print(tasks_table(plan))
    if plan.by_load:
        console.print(loads_table(plan))
    ex = plan.exact_optimum
    if ex:
        console.print(f"the exact optimum {_chain(ex.hierarchy, ex.budgets)} "
                      f"({ex.expected_latency * 1e3:.3f} ms/token) gains less than --min-gain {min_gain:g} over "
                      f"the plan; pass --min-gain 0 to choose it")


@cli_command
def simulate_cmd(
    plan: Path = typer.Option(..., "--plan", help="hsd-plan/1 JSON written by `hsd solve`."),
    profile: Path = typer.Option(..., "--profile", help="hsd-profile/1 JSON the plan is checked against."),
    rounds: int = typer.Option(20000, "--rounds", help="Target verify rounds to simulate."),
    seed: int = typer.Option(0, "--seed", help="Random seed (numpy; >= 0)."),
    context: Optional[int] = typer.Option(None, "--context", help="Tokens in the KV cache to take the costs at; "
                                                                 "default: the context the plan was solved for."),
):
    """Monte-Carlo of Algorithm 1 under IID acceptance: simulated vs predicted latency of a plan."""
    from hsd_opt.solver.api import simulate

    if rounds < 1:
        raise HsdError(f"--rounds: expected an integer >= 1, got {rounds}")
    if seed < 0:
        raise HsdError(f"--seed: expected an integer >= 0 (numpy's generator takes no negative seed), got {seed}")
    if context is not None and context < 1:
        raise HsdError(f"--context: expected a context length in tokens (>= 1), got {context}")
    prof, warnings = load_profile(profile)
    check_has_rates(prof, str(profile))
    warn_some(warnings)
    pl = load_plan(plan)
    _check_plan_against_profile(pl, str(plan), prof)
    r = simulate(prof, pl, rounds=rounds, seed=seed, context=context)
    at = context if context is not None else pl.context
    at = f", context {at:g} tokens" if at is not None and prof.context_costs else ""
    t = Table(title=f"hsd simulate ({r.rounds} target rounds, {r.tokens} tokens, seed {seed}{at})")
    t.add_column("hierarchy")
    t.add_column("predicted ms/token", justify="right")
    t.add_column("simulated ms/token", justify="right")
    t.add_column("std. error", justify="right")
    t.add_column("rel. diff", justify="right")
    t.add_row(_chain(pl.hierarchy, pl.budgets), _ms(r.predicted), _ms(r.latency), _ms(r.stderr),
              f"{100 * r.rel_diff:+.2f}%")
    console.print(t)
    if context is None and abs(pl.expected_latency / r.predicted - 1) > 1e-6:
        warn(f"{plan}: expected_latency {pl.expected_latency:.6g} differs from the profile's model "
             f"{r.predicted:.6g} (plan solved from another profile?)")
