"""`hsd bench`: every decoding method side by side on the same prompts, overall and per task."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from hsd_opt.commands.common import TARGET_PRECISION_HELP, cli_command, fmt, level_acceptance, load_plan_and_model
from hsd_opt.console import console, warn


def _row(d: dict, retimed: bool = False) -> list[str]:
    pr, me = d.get("predicted_seconds_per_token"), d.get("seconds_per_token")
    rt = d.get("retimed_predicted_seconds_per_token")
    return [fmt(d.get("tokens_per_s"), ".2f"), fmt(d.get("speedup_vs_hf_ar"), ".2f"),
            fmt(d.get("speedup_vs_ar"), ".2f"), fmt(d.get("tokens_per_target_call"), ".2f"), level_acceptance(d),
            fmt(pr and pr * 1e3, ".1f"), *([fmt(rt and rt * 1e3, ".1f")] if retimed else []),
            fmt(me and me * 1e3, ".1f"), {True: "yes", False: "NO", None: "-"}[d.get("matches_reference")]]


COLUMNS = ("tok/s", "xhf_ar", "xar", "tok/call", "accept", "pred", "meas", "=ref")
LEGEND = ("xhf_ar, xar: speed-up in tokens/s over hf_ar, ar; tok/call: tokens per target call; accept: "
          "acceptance of each verifying level, bottom up; pred, meas: decode ms/token, the plan's prediction and "
          "measured; =ref: the output equals our AR's")
RETIME_LEGEND = ("retimed: the prediction with the profile's costs scaled to the engines' step times measured "
                 "during this run (--retime)")


def methods_table(methods: dict, title: str, retimed: bool = False):
    """Rich table of methods (a bench report's ``methods``, or one task's); ``retimed``: with the column of
    predictions re-timed during the run (``hsd bench --retime``)."""
    from rich import box
    from rich.table import Table

    cols = COLUMNS[:6] + ("retimed",) + COLUMNS[6:] if retimed else COLUMNS
    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("method", no_wrap=True)
    for c in cols:
        t.add_column(c, justify="right")
    for m, d in methods.items():
        if "error" in d:
            t.add_row(m, "error", *[""] * (len(cols) - 2), "-")
            continue
        t.add_row(m, *_row(d, retimed))
    return t


def bench_tables(rep: dict, title: str):
    """Rich tables of a bench report: the methods overall, then one per task (or category); and the lines that
    read the columns and say which plan ``hsd_task`` ran for each task."""
    rt = "retime" in rep
    tables = [methods_table(rep["methods"], title, rt)]
    kind = "category" if rep.get("by") == "category" else "task"
    ran = []
    for task, ms in rep.get("by_task", {}).items():
        n = max((d.get("prompts", 0) for d in ms.values()), default=0)
        g = max((d.get("generations", 0) for d in ms.values()), default=0)
        tables.append(methods_table(ms, f"{kind} {task}: {n} prompt{'s' * (n != 1)}"
                                        + (f", {g} turns" if g != n else ""), rt))
        if (ms.get("hsd_task") or {}).get("plans"):
            ran.append(f"{task}: {', '.join(ms['hsd_task']['plans'])}")
    notes = [LEGEND] + ([RETIME_LEGEND] + retime_lines(rep["retime"]) if rt else [])
    return tables, notes + (["hsd_task ran " + "; ".join(ran)] if ran else [])


def retime_lines(retime: dict) -> list[str]:
    """One line per engine timed by ``hsd bench --retime``: profiled and measured step, and the factor."""
    out = []
    for name, e in (retime.get("engines") or {}).items():
        out.append(f"retime {name} ({', '.join(e['levels'])}): step at context {e['context']} "
                   f"{e['profiled_step'] * 1e3:.2f} ms profiled, {e['measured_step_median'] * 1e3:.2f} ms measured "
                   f"(x{e['factor_median']:.2f}, {e['factor_min']:.2f}-{e['factor_max']:.2f} over the prompts)")
    return out


@cli_command
def bench_cmd(
    plan: Path = typer.Option(..., "--plan", help="hsd-plan/1 JSON from `hsd solve`."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="JSON lines prompt file (ours or Spec-Bench's "
                                                                   "question format); default: the suite shipped "
                                                                   "with hsd-opt."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Use the first N prompts."),
    limit_per_task: Optional[int] = typer.Option(None, "--limit-per-task",
                                                 help="Use the first N prompts of each task (of each category "
                                                      "with --by category), in file order."),
    turns: str = typer.Option("first", "--turns", help="first: the first turn of each prompt; all: every turn, "
                                                       "each after the method's own answer to the previous one."),
    by: str = typer.Option("group", "--by", help="Report per group (the task; Spec-Bench's category group) or per "
                                                 "category (Spec-Bench's raw category)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens generated per prompt (per turn)."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy (outputs compared with our AR); "
                                                                 "> 0 samples with every method."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus mass in (0, 1] (sampling)."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed: prompt i uses seed + i with every method."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the JSON report here."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG plot here."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Default: the plan's provenance dtype."),
    target_precision: Optional[str] = typer.Option(None, "--target-precision", help=TARGET_PRECISION_HELP),
    assistant: Optional[str] = typer.Option(None, "--assistant", help="The draft model of hf_assisted (HF "
                                                                      "assisted generation, assistant_model); "
                                                                      "default: the plan's draft model."),
    retime: Optional[Path] = typer.Option(None, "--retime", help="The profile the plan was solved from: time "
                                                                "each engine's step before every prompt and "
                                                                "also report the prediction with the profile's "
                                                                "costs scaled to that speed (the machine's drift "
                                                                "since profiling, taken out)."),
    model: Optional[str] = typer.Option(None, "--model", help="Override the plan's model (must match it)."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    mode: str = typer.Option("exact", "--mode", help="exact | eager (see hsd run)."),
    methods: Optional[str] = typer.Option(None, "--methods", help="The methods to run, comma-separated, named as "
                                                                  "the report names them: hf_ar, "
                                                                  "hf_prompt_lookup, hf_early_exit, hf_assisted, "
                                                                  "ar, single_draft, hsd, hsd_task. Default: all "
                                                                  "but hf_early_exit (slow: only when named); "
                                                                  "hf_assisted with a draft model, hsd_task when "
                                                                  "the plan has plans per task."),
):
    """Benchmark on the same prompts: HF generate (AR, prompt lookup, assisted by the draft model, and with
    --methods its early-exit self-speculation), our AR loop, the plan's best single draft, the HSD plan (and its
    plans per task), overall and per task."""
    from hsd_opt.errors import HsdError
    from hsd_opt.jsonio import write_json
    from hsd_opt.prompts import check_report_key, check_turn_mode, load_prompts, select_items
    from hsd_opt.runtime.bench import METHODS, Sampling, check_sampling, plot_report, run_bench

    if max_new_tokens < 1:
        raise HsdError(f"--max-new-tokens: expected >= 1, got {max_new_tokens}")
    sampling = Sampling(temperature, top_p, seed)
    check_sampling(sampling)
    check_turn_mode(turns)
    check_report_key(by)
    ms = None
    if methods is not None:
        ms = [m.strip() for m in methods.split(",") if m.strip()]
        bad = [m for m in ms if m not in METHODS]
        if bad or not ms:
            raise HsdError(f"--methods: unknown method {', '.join(map(repr, bad)) or '(none given)'}; known: "
                           f"{', '.join(METHODS)}")
    items = select_items(load_prompts(prompts).items, limit, limit_per_task, by)
    retime_profile = None
    if retime is not None:
        from hsd_opt.console import warn_some
        from hsd_opt.formats import load_profile

        retime_profile, warnings = load_profile(retime)
        warn_some(warnings)
    p, loaded = load_plan_and_model(plan, model, device, dtype, target_precision)
    prof_t = p.provenance.temperature
    if prof_t is not None and (prof_t > 0) != (temperature > 0):
        warn(f"{plan}: the plan was profiled {'greedy' if not prof_t else f'at temperature {prof_t:g}'}; its "
             f"predictions are for that setting, not for this run's")
    rep = run_bench(p, loaded, items, max_new_tokens, raw=raw, mode=mode, methods=ms, turns=turns,
                    sampling=sampling, by=by, log=lambda s: console.print(s, style="dim"), source=str(plan),
                    assistant=assistant, retime=retime_profile, retime_source=str(retime))
    rep["model"] = loaded.provenance()
    n_gen = max((d.get("generations", 0) for d in rep["methods"].values()), default=0)
    how = "greedy" if sampling.greedy else f"sampling T={temperature:g}, top-p {top_p:g}, seed {seed}"
    title = (f"hsd bench: {len(items)} prompts ({n_gen} generations, turns: {turns}) x {max_new_tokens} tokens, "
             f"{how} ({loaded.model_id}, {loaded.device}, {rep['torch_threads']} threads)")
    tables, notes = bench_tables(rep, title)
    for table in tables:
        console.print(table)
    for line in notes:
        console.print(line, style="dim")
    if rep.get("reference_note"):
        console.print(f"=ref: {rep['reference_note']}")
    if rep.get("matches_reference_note"):
        console.print(f"=ref: {rep['matches_reference_note']}")
    if json_out is not None:
        write_json(json_out, rep)
        console.print(f"wrote {json_out}")
    if plot is not None:
        plot_report(rep, plot)
        console.print(f"wrote {plot}")
