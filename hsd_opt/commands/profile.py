"""`hsd profile` (measure acceptance rates and costs of a drafter pool, or its costs alone: `--costs-only`),
`hsd profile merge` and `hsd profile merge-costs`."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table
from rich.text import Text

from hsd_opt.commands import options
from hsd_opt.commands.common import (
    MIN_P_HELP,
    TOP_K_HELP,
    check_outputs,
    cli_command,
    local_model,
    prepare_kernels,
)
from hsd_opt.console import console, err_console, warn


def acceptance_table(prof, max_rows: int = 64) -> Table:
    """Rich table: per drafter, its cost, acceptance / greedy agreement against the target, and the 95% CI."""
    pv = prof.provenance
    how = pv.sampling or "greedy"
    t = Table(title=f"acceptance against the target {prof.target}, {how} (cost = one warm decode step)")
    for c, j in (("drafter", "left"), ("kind", "left"), ("cost ms", "right"), ("accept", "right"),
                 ("95% CI", "right"), ("greedy agree", "right"), ("n", "right")):
        t.add_column(c, justify=j)
    agr, ci, cnt = prof.greedy_agreement, prof.ci95, prof.counts
    rows = [m for m in prof.models if m.name != prof.target]
    rows.sort(key=lambda m: (m.layer is None, m.layer or 0, m.cost))
    for m in rows[:max_rows]:
        a = prof.acceptance.get(m.name, {}).get(prof.target)
        c = ci.get(m.name, {}).get(prof.target)
        g = agr.get(m.name, {}).get(prof.target)
        t.add_row(m.name, m.kind, f"{m.cost * 1e3:.4g}", "-" if a is None else f"{a:.3f}",
                  "-" if not c else f"{c[0]:.3f}-{c[1]:.3f}", "-" if g is None else f"{g:.3f}",
                  str(cnt.get(m.name, {}).get(prof.target, "")))
    tg = prof.entry(prof.target)
    t.add_row(Text(tg.name, style="bold"), tg.kind, f"{tg.cost * 1e3:.4g}", "1", "", "1", "")
    return t


def parse_cost_budget(spec: str) -> float | None:
    """``--cost-budget``: ``auto`` -> the default seconds, ``none`` -> None (no budget), else seconds > 0."""
    from hsd_opt.errors import HsdError
    from hsd_opt.profiler.config import DEFAULT_COST_BUDGET

    s = spec.strip().lower()
    if s == "auto":
        return DEFAULT_COST_BUDGET
    if s in ("none", "off"):
        return None
    try:
        v = float(s)
    except ValueError:
        v = -1.0
    if not v > 0 or v != v or v == float("inf"):
        raise HsdError(f"--cost-budget: expected seconds > 0, auto or none, got {spec!r}")
    return v


app = typer.Typer(
    help="Measure acceptance rates a(i, j) and costs of a drafter pool for one target (hsd-profile/1).\n\n"
         "hsd profile --model smollm2-135m --out profile.json   |   hsd profile merge a.json b.json -o c.json",
    invoke_without_command=True, no_args_is_help=False)

_DRAFT_LAYERS_HELP = ("Early exits of every draft model too (its own layers, e.g. 12,18, or all; none: the default), "
                      "named <draft>-layer12.")
_MODEL_HELP = ("Required. Target: alias (hsd models list), hub id, local directory or .gguf file (with --costs-only "
               "also a configuration).")
_PROMPTS_HELP = "JSON lines {\"prompt\", \"task\"[, \"schema\"]} or Spec-Bench questions; default: the built-in suite."
_QUANTIZED_HELP = ("Quantized copies as drafters, comma list: int8, int4, int4-head4 (int4 with an int4 LM head) of "
                   "the target, MODEL:int8, MODEL:int4, MODEL:int4-head4 (of a draft model, named <name>-int4), or "
                   "'none'. Default: int8,int4 of a float target on a CPU, else "
                   "none.")
_HEADS_HELP = "Trained exit heads (safetensors) for the early exits; default: the model's own final norm + LM head."
_TOKEN_DRAFTERS_HELP = ("Comma list of ngram,lookup,bigram,aded, or 'none'. Default: ngram, lookup and aded, plus "
                        "bigram when its table is cached.")
_TARGET_PRECISION_HELP = ("The target: auto (the loaded dtype), float32, bfloat16, float16, or int8 / int4: a "
                          "quantized copy of the model on the CPU kernels is the target itself (its own greedy output "
                          "is the reference).")
_COST_CONTEXTS_HELP = ("Context lengths (tokens in the KV cache) to measure the costs at, comma-separated; longer "
                       "ones than the model holds are lowered to the longest that fits. The solver interpolates "
                       "between them.")
_BATCH_SIZES_HELP = ("Numbers of sequences decoded together to time passes at (batch_costs: what hsd solve "
                     "--batch-sizes plans each load level of hsd serve with); 1 = one sequence at a time only.")
_COST_BUDGET_HELP = ("Seconds the cost phase may take: the most thorough cost plan whose estimate fits is used "
                     "(docs/design.md#the-cost-budget). auto = 480; none = always the full plan.")
_COSTS_ONLY_HELP = ("Measure the pool's costs alone, on random weights built from --model's configuration (which "
                    "may also be a shipped one: layerskip-llama2-7b, tinyllama-1.1b, tiny; or a config.json): no "
                    "weights read, no acceptance. Combine with rates: hsd profile merge-costs.")
_THREADS_HELP = ("CPU threads for torch. 0 = auto: torch's default, or 1 when the machine is already "
                 "oversubscribed. Costs are measured with this setting.")


@app.callback(invoke_without_command=True)
@cli_command
def profile_cmd(
    ctx: typer.Context,
    model: Optional[str] = typer.Option(None, "--model", help=_MODEL_HELP),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Required. Write the hsd-profile/1 JSON here."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help=_PROMPTS_HELP),
    layers: str = typer.Option("all", "--layers", help="Early exits: all, none, or a list like 4,8,12 or "
                                                        "2-10 (the last layer, the target, is always included)."),
    draft_model: List[str] = typer.Option([], "--draft-model", help="Another model with the target's "
                                                                    "tokenizer (repeatable)."),
    draft_layers: Optional[str] = typer.Option(None, "--draft-layers", help=_DRAFT_LAYERS_HELP),
    quantized: Optional[str] = typer.Option(None, "--quantized", help=_QUANTIZED_HELP),
    heads: Optional[Path] = typer.Option(None, "--heads", help=_HEADS_HELP),
    token_drafters: Optional[str] = typer.Option(None, "--token-drafters", help=_TOKEN_DRAFTERS_HELP),
    no_ngram: bool = typer.Option(False, "--no-ngram", help="Leave the context n-gram drafter out."),
    no_lookup: bool = typer.Option(False, "--no-lookup", help="Leave the abstaining n-gram lookup out."),
    no_bigram: bool = typer.Option(False, "--no-bigram", help="Leave the model-bigram drafter out."),
    no_aded: bool = typer.Option(False, "--no-aded", help="Leave the ADED drafter out."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy continuations (acceptance "
                                                                 "then uses softmax(logits)); > 0 samples."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus mass in (0, 1] after the temperature, as `hsd run "
                                                     "--top-p` samples (needs --temperature > 0)."),
    top_k: int = typer.Option(0, "--top-k", help=TOP_K_HELP + " Needs --temperature > 0."),
    min_p: float = typer.Option(0.0, "--min-p", help=MIN_P_HELP + " Needs --temperature > 0."),
    max_new_tokens: int = typer.Option(24, "--max-new-tokens", help="Tokens the target generates per "
                                                                    "prompt (fewer at EOS)."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N"),
    dtype: str = typer.Option("auto", "--dtype", help="auto | float32 | float16 | bfloat16"),
    target_precision: str = typer.Option("auto", "--target-precision", help=_TARGET_PRECISION_HELP),
    seed: int = typer.Option(0, "--seed", help="Sampling seed (temperature > 0)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from <out>.partial.json."),
    tmax: int = typer.Option(15, "--tmax", help="Cost curves cover t = 1..tmax+1 tokens."),
    cost_repeats: int = typer.Option(5, "--cost-repeats", help="Timed repeats per cost (median)."),
    cost_contexts: str = typer.Option("64,512,2048", "--cost-contexts", help=_COST_CONTEXTS_HELP),
    batch_sizes: str = typer.Option("1,2,4,8", "--batch-sizes", help=_BATCH_SIZES_HELP),
    cost_budget: str = typer.Option("auto", "--cost-budget", help=_COST_BUDGET_HELP),
    shard: Optional[str] = typer.Option(None, "--shard", help="K/N: profile only prompts i with i % N == K "
                                                              "(merge the shards with hsd profile merge)."),
    max_prompts: Optional[int] = typer.Option(None, "--max-prompts", help="Use only the first N prompts."),
    json_tasks: int = typer.Option(0, "--json-tasks", min=0, help="Add the first N of the shipped JSON-schema "
                                   "tasks (task 'json', 60 in all) to the prompts: their answers are generated "
                                   "and measured under their schemas, for a plan of JSON requests (hsd solve "
                                   "--per-task)."),
    threads: int = typer.Option(0, "--threads", help=_THREADS_HELP),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar or table."),
    costs_only: bool = typer.Option(False, "--costs-only", help=_COSTS_ONLY_HELP),
):
    """Measure acceptance rates a(i, j) and costs of early exits, draft models and token drafters."""
    if ctx.invoked_subcommand is not None:
        return
    from hsd_opt.profiler.config import ProfileConfig, check_config
    from hsd_opt.profiler.dist import dist_info

    _check_required(model, out)
    check_outputs(("--out", out), inputs=[("--prompts", prompts), ("--heads", heads), *local_model("--model", model),
                                         *(m for d in draft_model for m in local_model("--draft-model", d))])
    _check_inputs(cost_repeats, max_prompts, threads, heads)
    contexts = tuple(options.cost_contexts(cost_contexts))
    batches = options.batch_sizes(batch_sizes)
    explicit, left_out = _token_drafter_names(token_drafters, {"ngram": no_ngram, "lookup": no_lookup,
                                                               "bigram": no_bigram, "aded": no_aded})
    copies = options.quantized_copies(quantized)      # the names, checked before loading anything
    _, precision = options.resolve_target_precision(target_precision, dtype)
    budget = parse_cost_budget(cost_budget)
    exits, draft_exits = _exit_layers(layers, draft_layers, draft_model)
    rank, _ = dist_info()
    cfg = ProfileConfig(model=model, out=out, prompts=prompts, layers=exits, draft_models=list(draft_model),
                        draft_layers=draft_exits, quantized=copies, token_drafters=explicit,
                        token_drafters_left_out=left_out, heads=heads,
                        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                        max_new_tokens=max_new_tokens, raw=raw, device=device, dtype=dtype,
                        target_precision=precision, seed=seed, cost_budget=budget,
                        resume=resume, tmax=tmax, cost_repeats=cost_repeats, cost_contexts=contexts,
                        batch_sizes=tuple(batches), shard=options.shard(shard),
                        max_prompts=max_prompts, json_tasks=json_tasks, progress=not quiet, threads=threads,
                        costs_only=costs_only)
    check_config(cfg)                     # before the profiler's modules (torch) load
    if (prof := _run_profile(cfg, quiet)) is None or rank != 0:
        return
    (_report_costs if costs_only else _report_profile)(prof, out, quiet)


def _check_required(model: Optional[str], out: Optional[Path]) -> None:
    """Refuse a missing ``--model`` or ``--out`` (optional flags so that ``hsd profile merge`` runs without them)."""
    from hsd_opt.errors import HsdError

    if not model:
        raise HsdError("--model is required (e.g. hsd profile --model smollm2-135m --out profile.json)")
    if out is None:
        raise HsdError("--out is required: where to write the profile JSON")


def _check_inputs(cost_repeats: int, max_prompts: Optional[int], threads: int, heads: Optional[Path]) -> None:
    """Refuse, naming the flag, a count of ``hsd profile`` out of its range or a heads file that cannot be read
    (before anything is loaded)."""
    from hsd_opt.errors import HsdError

    if heads is not None:
        from hsd_opt.heads import read_heads_file  # (torch: only where a heads file is given)

        try:
            read_heads_file(heads)
        except HsdError as e:
            raise HsdError(f"--heads {e}") from None

    if cost_repeats < 1:
        raise HsdError(f"--cost-repeats: expected >= 1 (timings per cost), got {cost_repeats}")
    if max_prompts is not None and max_prompts < 1:
        raise HsdError(f"--max-prompts: expected >= 1, got {max_prompts}")
    if not 0 <= threads <= options.MAX_THREADS:
        raise HsdError(f"--threads: expected an integer in 0..{options.MAX_THREADS} (0: auto), got {threads}")


def _token_drafter_names(spec: Optional[str], left_out: dict[str, bool]) -> tuple[list[str] | None, tuple[str, ...]]:
    """``(names, left out)``: ``--token-drafters`` (a comma list, or ``none``) less the drafters the ``--no-*``
    flags leave out (``left_out``: name -> flag given), and nothing left out; or, without ``--token-drafters``,
    None (the profiler's default pool, whose drafters are skipped where unavailable, a bigram table not yet cached
    included) and the names the flags leave out of it. :class:`HsdError` naming the flag for an unknown drafter."""
    from hsd_opt.errors import HsdError
    from hsd_opt.profiler.pool import KNOWN_TOKEN_DRAFTERS

    dropped = tuple(n for n, flag in left_out.items() if flag)
    if spec is None:
        return None, dropped
    names = [] if spec.strip().lower() == "none" else [x.strip() for x in spec.split(",") if x.strip()]
    for n in names:
        if n not in KNOWN_TOKEN_DRAFTERS:
            raise HsdError(f"--token-drafters: unknown token drafter {n!r}; known: "
                           f"{', '.join(KNOWN_TOKEN_DRAFTERS)} (or none)")
    return [n for n in names if n not in dropped], ()


def _exit_layers(layers: str, draft_layers: Optional[str], draft_model: List[str]):
    """``(--layers, --draft-layers)`` as layer numbers (None: every layer): the syntax only, before anything is
    loaded (the ranges are checked once the models are); ``--draft-layers`` needs a ``--draft-model``."""
    from hsd_opt.errors import HsdError

    if draft_layers is not None and not draft_model:
        raise HsdError("--draft-layers: exits of draft models need --draft-model")
    exits = options.layer_numbers(layers, "--layers")
    return exits, options.layer_numbers(draft_layers, "--draft-layers") if draft_layers is not None else []


def _run_profile(cfg, quiet: bool):
    """Run the profiler on ``cfg`` (the kernels loaded first, said on stderr, unless ``quiet``): the profile, or
    None where this process writes none. Ctrl-C says where the finished prompts are (or that none were kept) and
    exits with code 130."""
    from hsd_opt.profiler.checkpoint import partial_path
    from hsd_opt.profiler.dist import dist_info
    from hsd_opt.profiler.run import run_profile

    if not quiet:
        prepare_kernels(cfg.device)
    try:
        return run_profile(cfg, log=(lambda s: None) if quiet else (lambda s: console.print(s)), warn=warn)
    except KeyboardInterrupt:
        partial = partial_path(Path(cfg.out), *dist_info())
        if not cfg.costs_only and partial.is_file():
            err_console.print(f"interrupted: the statistics of every finished prompt are in {partial}; rerun with "
                              f"--resume to continue", markup=False)
        else:
            kept = " (--costs-only keeps none)" if cfg.costs_only else ""
            err_console.print(f"interrupted before any prompt's statistics were kept{kept}: run it again",
                              markup=False)
        raise typer.Exit(130)


def draft_rate_lines(prof) -> list[str]:
    """One line per token drafter that abstains: its share of positions with a proposal, and of decoding's rounds
    with a block at budgets 1, 2, 4, 8 (as far as the profile walked them)."""
    out = []
    for m in prof.models:
        if m.draft_rate >= 1.0:
            continue
        line = f"{m.name} proposes at {m.draft_rate:.0%} of positions"
        n = len(m.draft_rate_by_budget)
        if n:
            ts = [t for t in (1, 2, 4, 8) if t <= n]
            line += (f"; in decoding's rounds with blocks of {' / '.join(map(str, ts))} tokens: "
                     f"{' / '.join(f'{m.rate_at(t):.0%}' for t in ts)} (the solver's draft rate at each budget)")
        out.append(line)
    return out


def _report_profile(prof, out: Path, quiet: bool) -> None:
    """Print the acceptance table, the abstaining drafters' draft rates and the target's step by context (unless
    ``quiet``), then what was written."""
    if not quiet:
        console.print(acceptance_table(prof))
        for line in draft_rate_lines(prof):
            console.print(line)
        steps = [f"{e.context} tokens {e.cost[prof.target] * 1e3:.4g} ms" for e in prof.context_costs
                 if prof.target in e.cost]
        if steps:
            console.print(f"target step by context: {', '.join(steps)} (context_costs; hsd solve interpolates)")
    pv = prof.provenance
    console.print(f"wrote {out}: {len(prof.models)} drafters, {pv.get('prompt_count')} prompts, "
                  f"{pv.get('generated_tokens')} generated tokens, {pv.get('timings')['total_seconds']:.1f} s")


def costs_table(prof) -> Table:
    """Rich table: per drafter, its kind and its step cost (ms) at each measured context, cheapest first."""
    contexts = prof.context_costs
    t = Table(title=f"costs of the pool of {prof.provenance.model} on {prof.provenance.device} (random weights; "
                    f"one warm decode step, ms)")
    t.add_column("drafter")
    t.add_column("kind")
    for e in contexts:
        t.add_column(f"context {e.context}", justify="right")
    for m in prof.models:
        t.add_row(m.name, m.kind, *[f"{e.cost[m.name] * 1e3:.4g}" if m.name in e.cost else "-" for e in contexts])
    return t


def _report_costs(prof, out: Path, quiet: bool) -> None:
    """Print the costs table (unless ``quiet``), then what was written and what to do with it."""
    if not quiet:
        console.print(costs_table(prof))
    console.print(f"wrote {out}: the costs of {len(prof.models)} drafters, no acceptance rates "
                  f"({prof.provenance.get('timings')['total_seconds']:.1f} s); plan with them after hsd profile "
                  f"merge-costs --rates RATES.json --costs {out} -o merged.json")


@app.command("merge")
@cli_command
def merge_cmd(
    profiles: List[Path] = typer.Argument(..., help="Profiles of the same model and settings."),
    out: Path = typer.Option(..., "--out", "-o", help="Write the merged hsd-profile/1 JSON here."),
):
    """Combine profiles of the same model exactly (sums of the statistics; costs of the first)."""
    from hsd_opt.formats import save_profile
    from hsd_opt.profiler.assemble import merge_profiles

    check_outputs(("--out", out), inputs=[("PROFILES", p) for p in profiles])
    prof = merge_profiles(profiles, warn=warn)
    save_profile(prof, out)
    pv = prof.provenance
    console.print(f"wrote {out}: merged {len(profiles)} profiles, {pv.get('prompt_count')} prompts, "
                  f"{pv.get('generated_tokens')} generated tokens (costs from {profiles[0]})")


@app.command("merge-costs")
@cli_command
def merge_costs_cmd(
    rates: Path = typer.Option(..., "--rates", help="The profile whose acceptance rates, statistics and draft "
                               "rates to keep (made anywhere, e.g. on a CPU; not a costs-only one)."),
    costs: Path = typer.Option(..., "--costs", help="A profile of the same pool on the hardware to plan for (a "
                               "costs-only one, hsd profile --costs-only, or a full one): its costs are taken."),
    out: Path = typer.Option(..., "--out", "-o", help="Write the combined hsd-profile/1 JSON here."),
):
    """Combine one profile's acceptance rates with another's costs, to plan for hardware the rates were not
    measured on (`hsd solve` the result there)."""
    from hsd_opt.formats import load_profile, save_profile
    from hsd_opt.profiler.assemble import merge_costs

    check_outputs(("--out", out), inputs=[("--rates", rates), ("--costs", costs)])
    r, _ = load_profile(rates)
    c, _ = load_profile(costs)
    prof = merge_costs(r, c, str(rates), str(costs))
    save_profile(prof, out)
    console.print(f"wrote {out}: the rates of {rates}, the costs of {costs} ({c.provenance.device or 'device?'}, "
                  f"{len(prof.models)} drafters)")
