"""`hsd bench`: every decoding method side by side on the same prompts, overall and per task."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import typer

from hsd_opt.commands.common import (
    GRAMMAR_HELP,
    JSON_SCHEMA_HELP,
    MIN_P_HELP,
    TARGET_PRECISION_HELP,
    TOP_K_HELP,
    check_outputs,
    cli_command,
    compile_grammar,
    fmt,
    grammar_spec,
    item_grammars,
    level_acceptance,
    load_plan_and_model,
    plan_check_for_retime,
    read_retime_profile,
    retime_text,
    retimed_levels,
    warn_sampling,
)
from hsd_opt.console import console, err_console
from hsd_opt.errors import HsdError
from hsd_opt.formats import sampling_words
from hsd_opt.prompts import JSON_TASK


def _progress(line: str) -> None:
    """A progress line: on stderr, apart from the report (stdout)."""
    err_console.print(line, style="dim", markup=False)


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
        if "error" in d:                    # its reason is printed under the tables
            t.add_row(m, "not run" if d["error"].endswith("not run") else "error", *[""] * (len(cols) - 2), "-")
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


_ASSISTANT_HELP = ("The draft model of hf_assisted (HF assisted generation, assistant_model); default: the plan's "
                   "draft model.")
_RETIME_HELP = ("The profile the plan was solved from: time each engine's step before every prompt and also report "
                "the prediction with the profile's costs scaled to that speed (the machine's drift since profiling, "
                "taken out).")
_METHODS_HELP = ("The methods to run, comma-separated, named as the report names them: hf_ar, hf_prompt_lookup, "
                 "hf_early_exit, hf_assisted, ar, single_draft, hsd, hsd_task. Default: all but hf_early_exit (slow: "
                 "only when named); hf_assisted with a draft model, hsd_task when the plan has plans per task. With "
                 "--concurrency: hsd, hsd_batch1, hsd_plain (default all three).")
_SEED_HELP = ("Sampling seed (default 0): prompt i uses seed + i with every method. Not with --concurrency (its "
              "requests carry none).")
_CONCURRENCY_HELP = ("Serving under load instead: this many concurrent clients at each level, e.g. 1,2,4,8,16 "
                     "(in one process, the scheduler of `hsd serve` without HTTP; greedy, or sampled with "
                     "--temperature and the filters, each request unseeded as an API client's; see docs/cli.md).")


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
    top_k: int = typer.Option(0, "--top-k", help=TOP_K_HELP + " Every method."),
    min_p: float = typer.Option(0.0, "--min-p", help=MIN_P_HELP + " Every method."),
    seed: Optional[int] = typer.Option(None, "--seed", help=_SEED_HELP),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the JSON report here."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG plot here."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Default: the plan's provenance dtype."),
    target_precision: Optional[str] = typer.Option(None, "--target-precision", help=TARGET_PRECISION_HELP),
    assistant: Optional[str] = typer.Option(None, "--assistant", help=_ASSISTANT_HELP),
    retime: Optional[Path] = typer.Option(None, "--retime", help=_RETIME_HELP),
    model: Optional[str] = typer.Option(None, "--model", help="Override the plan's model (must match it)."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    mode: str = typer.Option("exact", "--mode", help="exact | eager (see hsd run)."),
    methods: Optional[str] = typer.Option(None, "--methods", help=_METHODS_HELP),
    concurrency: Optional[str] = typer.Option(None, "--concurrency", help=_CONCURRENCY_HELP),
    requests: Optional[int] = typer.Option(None, "--requests", help="With --concurrency: requests per client, one "
                                                                    "after the other (default 2)."),
    max_batch: Optional[int] = typer.Option(None, "--max-batch", help="With --concurrency: sequences decoded "
                                                                      "together by hsd and hsd_plain (default: "
                                                                      "the largest concurrency)."),
    rounds: Optional[int] = typer.Option(None, "--rounds", help="With --concurrency: rounds at each level, the "
                                                                "methods in rotating order; the report holds the "
                                                                "medians (default 1)."),
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", help=JSON_SCHEMA_HELP + " Our methods only "
                                                                           "(HF generate does not follow it)."),
    grammar: Optional[Path] = typer.Option(None, "--grammar", help=GRAMMAR_HELP),
):
    """Benchmark on the same prompts: HF generate (AR, prompt lookup, assisted by the draft model, and with
    --methods its early-exit self-speculation), our AR loop, the plan's best single draft, the HSD plan (and its
    plans per task), overall and per task."""
    _check_flags(mode, max_new_tokens, (("--json", json_out), ("--plot", plot)),
                 [("--plan", plan), ("--prompts", prompts), ("--retime", retime), ("--json-schema", json_schema),
                  ("--grammar", grammar)])
    if concurrency is None:
        _no_load_options(requests=requests, max_batch=max_batch, rounds=rounds)
        _check_assistant(assistant)
    else:
        return bench_load(plan, prompts, limit, limit_per_task, by, max_new_tokens, json_out, plot, device, dtype,
                          target_precision, model, raw, mode, methods, concurrency,
                          2 if requests is None else requests, max_batch, 1 if rounds is None else rounds, retime,
                          (temperature, top_p, top_k, min_p),
                          others={"--seed": seed is not None, "--turns": turns != "first",
                                          "--assistant": assistant is not None,
                                          "--json-schema": json_schema is not None, "--grammar": grammar is not None})
    sampling, ms, items = _bench_inputs(prompts, limit, limit_per_task, turns, by, methods, temperature, top_p,
                                        0 if seed is None else seed, top_k, min_p)
    spec = grammar_spec(json_schema, grammar)
    retime_profile = read_retime_profile(retime)
    p, loaded = load_plan_and_model(plan, model, device, dtype, target_precision,
                                    outputs=[("--json", json_out), ("--plot", plot)])
    from hsd_opt.measure.bench import plot_report, run_bench  # (torch, loaded with the model by now)

    items, sampling = _prepared(items, sampling, spec, loaded, raw, max_new_tokens, prompts, turns)
    warn_sampling(plan, p, temperature, top_p, top_k, min_p)
    rep = run_bench(p, loaded, items, max_new_tokens, raw=raw, mode=mode, methods=ms, turns=turns,
                    sampling=sampling, by=by, log=_progress, source=str(plan), assistant=assistant,
                    retime=retime_profile, retime_source=str(retime))
    _add_machine(rep, loaded)
    if spec is not None:
        rep["grammar"] = {"kind": spec.kind, "source": spec.source}
    _print_bench(rep, _bench_title(rep, loaded, rep["prompts"], turns, max_new_tokens, sampling))
    write_outputs(rep, json_out, plot, plot_report)
    _exit_if_stopped(rep)


def _exit_if_stopped(rep: dict) -> None:
    """After a report of the prompts finished before Ctrl-C: say so and exit 130, as an interrupt does (1 where a
    request failed: the load bench's levels finished before it)."""
    stopped = rep.get("stopped")
    if stopped:
        err_console.print(f"stopped: {stopped['said']}", markup=False)
        raise typer.Exit(1 if stopped.get("failed") else 130)


def _prepared(items, sampling, spec, loaded, raw: bool, max_new_tokens: int, prompts: Optional[Path], turns: str):
    """``(items, sampling)`` ready for the model: with a grammar flag (``spec``) every prompt of task ``json`` (it
    runs the plan for JSON), each one's room in the context checked (every turn run), and their grammars
    compiled."""
    from hsd_opt.prompts import check_room
    from hsd_opt.runtime.runner import model_context

    if spec is not None:
        items = [dataclasses.replace(it, task=JSON_TASK) for it in items]
    check_room(items, loaded.tokenizer, raw, max_new_tokens, model_context(loaded), _prompts_source(prompts), turns)
    grammars = item_grammars(items, compile_grammar(spec, loaded), loaded, str(prompts))
    return items, dataclasses.replace(sampling, grammars=grammars)


def _check_flags(mode: str, max_new_tokens: int, outputs, inputs) -> None:
    """``hsd bench``'s flags every run checks before any work: ``--mode``, ``--max-new-tokens``, and the outputs
    (``(flag, path)``) against each other and the ``inputs`` (:func:`check_outputs`)."""
    from hsd_opt.runtime.modes import check_mode

    check_mode(mode)
    check_outputs(*outputs, inputs=inputs)
    if max_new_tokens < 1:
        raise HsdError(f"--max-new-tokens: expected >= 1, got {max_new_tokens}")


def _check_assistant(assistant: Optional[str]) -> None:
    """Refuse an empty ``--assistant`` (None: not given, the plan's draft model), or a name no model has
    (:func:`~hsd_opt.models.loading.check_model_name`: before the target loads)."""
    from hsd_opt.models.loading import check_model_name

    if assistant is not None and not assistant.strip():
        raise HsdError("--assistant: the name is empty (a draft model: an alias, hub id, directory or .gguf file; "
                       "leave the flag out for the plan's draft model)")
    if assistant is not None:
        check_model_name(assistant, "--assistant")


def _no_load_options(**given: Optional[int]) -> None:
    """Refuse the load bench's options (``--requests``, ``--max-batch``, ``--rounds``: None where not given) in a
    single-stream bench, which would ignore them."""
    flags = [f"--{name.replace('_', '-')}" for name, v in given.items() if v is not None]
    if flags:
        raise HsdError(f"{', '.join(flags)}: only with --concurrency (the load bench); the single-stream bench runs "
                       "each prompt once per method")


def _prompts_source(prompts: Optional[Path]) -> str:
    """What errors call the prompts: ``--prompts FILE``, or the shipped suite."""
    return f"--prompts {prompts}" if prompts is not None else "the suite"


def _bench_inputs(prompts: Optional[Path], limit: Optional[int], limit_per_task: Optional[int], turns: str, by: str,
                  methods: Optional[str], temperature: float, top_p: float, seed: int, top_k: int = 0,
                  min_p: float = 0.0):
    """The single-stream bench's options checked, each refused in one line naming its flag, and its prompts:
    ``(Sampling, the methods named by --methods or None for the default, the selected prompt items)``."""
    from hsd_opt.measure.methods import METHODS, Sampling, check_sampling, check_seeds
    from hsd_opt.prompts import check_report_key, check_turn_mode, load_prompts, select_items

    sampling = Sampling(temperature, top_p, seed, top_k=top_k, min_p=min_p)
    check_sampling(sampling)
    check_turn_mode(turns)
    check_report_key(by)
    ms = None if methods is None else method_names(methods, METHODS)
    items = select_items(load_prompts(prompts).items, limit, limit_per_task, by)
    check_seeds(sampling, items, turns)
    return sampling, ms, items


def _add_machine(rep: dict, loaded) -> None:
    """Record in the report the model loaded, the decode kernels that ran and the machine (``model``, ``kernels``,
    ``host``: :func:`~hsd_opt.engine.variants.host`), and on CUDA
    how its engines ran the torch path (``torch_path``: fixed shapes, compiled layers, CUDA graphs, copies reading
    their codes, Triton attention, as :func:`~hsd_opt.engine.layered.torch_path_settings` says)."""
    import torch

    from hsd_opt.engine import kernels, variants
    from hsd_opt.engine.layered import torch_path_settings

    rep["model"] = loaded.provenance()
    rep["kernels"] = kernels.provenance(loaded.device)
    rep["host"] = variants.host()
    if torch.device(loaded.device).type == "cuda":
        rep["torch_path"] = torch_path_settings()


def _bench_title(rep: dict, loaded, n_items: int, turns: str, max_new_tokens: int, sampling) -> str:
    """The title of the single-stream bench's first table: prompts, generations, tokens, sampling, the machine."""
    n_gen = max((d.get("generations", 0) for d in rep["methods"].values()), default=0)
    how = sampling_words(sampling.temperature, **sampling.filters) + ("" if sampling.greedy else
                                                                       f", seed {sampling.seed}")
    return (f"hsd bench: {n_items} prompts ({n_gen} generations, turns: {turns}) x {max_new_tokens} tokens, "
            f"{how} ({loaded.model_id}, {loaded.device}, {rep['torch_threads']} threads{_variant(rep)})")


def _print_bench(rep: dict, title: str) -> None:
    """Print the single-stream bench's tables (:func:`bench_tables`), their legend and the reference notes."""
    tables, notes = bench_tables(rep, title)
    for table in tables:
        console.print(table)
    for line in notes:
        console.print(line, style="dim")
    for m, d in rep["methods"].items():
        if "error" in d:
            console.print(f"{m}: {d['error']}", style="dim")
    if rep.get("reference_note"):
        console.print(f"=ref: {rep['reference_note']}")
    if rep.get("matches_reference_note"):
        console.print(f"=ref: {rep['matches_reference_note']}")


#: How a report's title names each torch-path setting that is on (:func:`_variant`).
TORCH_PATH_WORDS = {"fixed_shapes": "fixed shapes", "compiled": "compiled layers", "cuda_graphs": "CUDA graphs",
                    "weight_only": "copies read as codes", "triton_attention": "Triton attention"}


def _variant(rep: dict) -> str:
    """``, <variant> kernels`` for a report's title (nothing where the kernels did not run); on CUDA the torch
    path's settings that are on (``, torch path: fixed shapes, CUDA graphs``)."""
    k, tp = rep.get("kernels"), rep.get("torch_path")
    on = [w for key, w in TORCH_PATH_WORDS.items() if tp and tp.get(key)]
    return (f", {k['variant']} kernels" if k else "") + (f", torch path: {', '.join(on) or 'op by op'}" if tp else "")


def write_outputs(rep: dict, json_out: Optional[Path], plot: Optional[Path], draw) -> None:
    """The report as JSON at ``json_out`` and ``draw(rep, plot)`` at ``plot``, each when asked, each said."""
    from hsd_opt.jsonio import write_json

    if json_out is not None:
        write_json(json_out, rep)
        console.print(f"wrote {json_out}")
    if plot is not None:
        draw(rep, plot)
        console.print(f"wrote {plot}")


def method_names(text: str, known: tuple[str, ...], where: str = "") -> list[str]:
    """The methods ``--methods`` names (comma-separated), each one of ``known``; else :class:`HsdError` naming the
    flag and the known ones (``where``: when they apply, as " with --concurrency")."""
    names = [m.strip() for m in text.split(",")]
    if len(names) > 1 and "" in names:
        raise HsdError(f"--methods {text!r}: an empty item (two commas, or one at an end)")
    names = [m for m in names if m]
    twice = sorted({m for m in names if names.count(m) > 1})
    if twice:
        raise HsdError(f"--methods: {', '.join(twice)} given twice")
    bad = [m for m in names if m not in known]
    if bad or not names:
        raise HsdError(f"--methods: unknown method {', '.join(map(repr, bad)) or '(none given)'}; known{where}: "
                       f"{', '.join(known)}")
    return names


LOAD_LEGEND = ("agg: aggregate tokens/s (every token over the wall seconds of the level); x batch1, x plain: hsd's "
               "aggregate over hsd_batch1's and hsd_plain's; ttft: seconds to the first tokens (p50 / p95, "
               "waiting included); stream: tokens/s of one request after its first tokens (p50); pred: the "
               "plan's predicted aggregate at this load level (by_load, decoding only); pred run (--retime): "
               "the whole level predicted, prompts and ramps included, at the speed timed right before and "
               "after it, and the measured aggregate over it; =target: every answer equals the target's greedy "
               "answer alone (sampled: not compared, -)")


def bench_load(plan: Path, prompts: Optional[Path], limit: Optional[int], limit_per_task: Optional[int], by: str,
               max_new_tokens: int, json_out: Optional[Path], plot: Optional[Path], device: str,
               dtype: Optional[str], target_precision: Optional[str], model: Optional[str], raw: bool, mode: str,
               methods: Optional[str], concurrency: str, requests: int, max_batch: Optional[int], rounds: int,
               retime: Optional[Path], how: tuple[float, float, int, float], others: dict[str, bool]) -> None:
    """``hsd bench --concurrency``: :mod:`hsd_opt.measure.load_bench` on the plan, a table per run, and the JSON
    report and plot when asked; with ``retime`` (a profile) the load levels of ``hsd`` and ``hsd_batch1`` chosen
    again at the speed of the moment, as ``hsd serve --retime`` does. ``how``: ``(temperature, top_p, top_k,
    min_p)`` of every request (checked as the single-stream bench checks them). ``others``: flags of the
    single-stream bench that do not apply (set: refused)."""
    from datetime import datetime, timezone

    from hsd_opt.measure.methods import Sampling, check_sampling
    from hsd_opt.prompts import check_report_key, check_room, encode_prompt, load_prompts, select_items

    temperature, top_p, top_k, min_p = how
    sampling = Sampling(temperature, top_p, 0, top_k=top_k, min_p=min_p)
    check_sampling(sampling)
    levels_c, mb, names = _load_options(concurrency, requests, rounds, max_batch, methods, others)
    check_report_key(by)
    items = select_items(load_prompts(prompts).items, limit, limit_per_task, by)
    if any(it.schema is not None for it in items):
        raise HsdError(f"--concurrency: {prompts}: the load bench does not follow the prompts' schemas; run the "
                       "single-stream bench (without --concurrency), or serve and send response_format")
    retime_profile = read_retime_profile(retime)          # its file and its fit to the plan, before the model loads
    p, loaded = load_plan_and_model(plan, model, device, dtype, target_precision,
                                    check_plan=plan_check_for_retime(retime_profile, plan, retime),
                                    outputs=[("--json", json_out), ("--plot", plot)])
    # the measurement's and the runtime's modules import torch (seconds): after the flags are checked
    from hsd_opt.measure.load_bench import plot_load, run_load_bench
    from hsd_opt.runtime.runner import model_context

    warn_sampling(plan, p, temperature, top_p, top_k, min_p)
    by_load, target, retimed, predictor = _load_runners(p, loaded, mode, str(plan), _progress, retime_profile)
    table = {"hsd": (by_load, mb), "hsd_batch1": (by_load, 1), "hsd_plain": (target, mb)}
    check_room(items, loaded.tokenizer, raw, max_new_tokens, model_context(loaded), _prompts_source(prompts))
    ids = [encode_prompt(loaded.tokenizer, it.prompt, raw=raw) for it in items]
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    rep = run_load_bench(p, {m: table[m] for m in names}, target, ids, levels_c, requests, max_new_tokens, rounds,
                         log=_progress, predictor=predictor, sampling=sampling)
    if retimed is not None:
        rep["retime"] = retimed
    _add_load_machine(rep, started, plan, loaded)
    console.print(load_table(rep, f"hsd bench --concurrency: {len(ids)} prompts, {requests} requests per client x "
                                  f"{max_new_tokens} tokens, {sampling_words(temperature, top_p, top_k, min_p)}"
                                  f"{'' if sampling.greedy else ' (unseeded)'}, {rounds} round{'s' * (rounds != 1)} "
                                  f"({loaded.model_id}, {loaded.device}, {rep['torch_threads']} "
                                  f"threads{_variant(rep)})", predicted_run=predictor is not None))
    console.print(LOAD_LEGEND, style="dim")
    write_outputs(rep, json_out, plot, plot_load)
    _exit_if_stopped(rep)


def _load_options(concurrency: str, requests: int, rounds: int, max_batch: Optional[int], methods: Optional[str],
                  others: dict[str, bool]) -> tuple[list[int], int, list[str]]:
    """``hsd bench --concurrency``'s options checked, each refused in one line naming its flag: ``(the numbers of
    clients, the largest batch, the methods to run)``; ``others`` as :func:`bench_load` takes them."""
    from hsd_opt.measure.methods import LOAD_METHODS, parse_concurrency

    given = [flag for flag, on in others.items() if on]
    if given:
        raise HsdError(f"{', '.join(given)}: not with --concurrency (unseeded requests, one turn each)")
    levels_c = parse_concurrency(concurrency)
    if requests < 1:
        raise HsdError(f"--requests: expected >= 1, got {requests}")
    if rounds < 1:
        raise HsdError(f"--rounds: expected >= 1, got {rounds}")
    mb = max(levels_c) if max_batch is None else max_batch
    if mb < 1:
        raise HsdError(f"--max-batch: expected >= 1, got {mb}")
    names = list(LOAD_METHODS) if methods is None else method_names(methods, LOAD_METHODS, " with --concurrency")
    return levels_c, mb, names


def _load_runners(p, loaded, mode: str, source: str, say, profile=None):
    """The runners ``hsd bench --concurrency`` compares, built once over shared models: ``(hsd's runner by load
    level, the target alone, the re-timing record or None, the load predictor or None)``; with ``profile``
    (``--retime``'s, checked against the plan) the load levels chosen again at the speed of the moment
    (:func:`retimed_levels`)."""
    from hsd_opt.runtime.runner import PlanModels, hsd_by_load, hsd_for_plan

    say(f"building the plan's hierarchies on {loaded.device} ...")
    models = PlanModels(loaded)
    runner = hsd_for_plan(p, loaded, mode=mode, source=source, models=models)
    by_load = hsd_by_load(p, loaded, models, mode=mode, source=source, log=say, plan_runner=runner) or runner
    target = hsd_for_plan(p, loaded, mode=mode, source=source, hierarchy=[p.hierarchy[-1]], budgets=[],
                          models=models)
    if profile is None:
        return by_load, target, None, None
    from hsd_opt.measure.load_predictor import LoadPredictor

    by_load, retimed = retimed_levels(p, loaded, models, runner, by_load, profile, mode, source, say)
    predictor = LoadPredictor(profile, retime_text(loaded.tokenizer), head=target.levels[-1].engine.prompt_head)
    return by_load, target, retimed, predictor


def _add_load_machine(rep: dict, started: str, plan: Path, loaded) -> None:
    """Record in the load report when it started and ended (ISO UTC, seconds), the plan, the model, the device,
    torch's threads and the decode kernels that ran."""
    from datetime import datetime, timezone

    import torch

    rep.update({"started": started, "ended": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "plan": str(plan), "device": str(loaded.device), "torch_threads": torch.get_num_threads()})
    _add_machine(rep, loaded)


def load_table(rep: dict, title: str, predicted_run: bool):
    """Rich table of a load report: one row per number of clients and method (``predicted_run``: with the columns
    of the whole level's prediction, ``--retime``)."""
    from rich import box
    from rich.table import Table

    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
    cols = ["clients", "method", "agg", "x batch1", "x plain", "ttft p50", "ttft p95", "stream", "pred"]
    cols += ["pred run", "agg/pred run"] if predicted_run else []
    for col in cols + ["=target"]:
        t.add_column(col, justify="left" if col == "method" else "right")
    for lv in rep["levels"]:
        for m, d in lv["methods"].items():
            hsd = m == "hsd"
            t.add_row(str(lv["clients"]), m, fmt(d["aggregate_tokens_per_s"], ".1f"),
                      fmt(lv.get("hsd_over_batch1") if hsd else None, ".2f"),
                      fmt(lv.get("hsd_over_plain") if hsd else None, ".2f"), fmt(d["ttft_p50_s"], ".2f"),
                      fmt(d["ttft_p95_s"], ".2f"), fmt(d["stream_tokens_per_s_p50"], ".1f"),
                      fmt(d.get("predicted_tokens_per_s"), ".1f"),
                      *([fmt(d.get("predicted_run_tokens_per_s"), ".1f"),
                         fmt(d.get("measured_over_predicted"), ".2f")] if predicted_run else []),
                      {True: "yes", False: "NO", None: "-"}[d["equal_to_target"]])
    return t
