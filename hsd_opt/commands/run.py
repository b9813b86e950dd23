"""`hsd run`: generate with a plan's hierarchy (or its plans per task), lossless, streaming; stats overall and per
task."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Iterator, Optional

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
    warn_sampling,
)
from hsd_opt.console import INTERRUPTED, console, err_console, error
from hsd_opt.jsonio import atomic_write_bytes, json_problem
from hsd_opt.prompts import JSON_TASK


def _items(prompt: Optional[str], prompts: Optional[Path], task: Optional[str], limit_per_task: Optional[int],
           by: str):
    from hsd_opt.errors import HsdError
    from hsd_opt.prompts import PromptItem, check_utf8, load_prompts, select_items

    if (prompt is None) == (prompts is None):
        raise HsdError("give exactly one of --prompt TEXT or --prompts FILE.jsonl")
    if prompt is not None:
        if not prompt.strip():
            raise HsdError("--prompt: empty prompt")
        check_utf8(prompt, "--prompt")
        if limit_per_task is not None:
            raise HsdError("--limit-per-task applies to --prompts FILE")
        if task is not None:                 # as a prompt file's "task" is checked
            if not task.strip():
                raise HsdError("--task: empty; name the prompt's task (e.g. code), or leave the flag out")
            check_utf8(task, "--task")
        return [PromptItem(0, prompt, task or "other")]
    if task is not None:
        raise HsdError("--task applies to --prompt TEXT (the lines of --prompts name their own task)")
    return select_items(load_prompts(prompts).items, None, limit_per_task, by)


def stats_table(stats: dict, predicted: float | None, title: str = "hsd run", at: float | None = None):
    """Rich table of one generation's (or a summed run's) stats (``levels`` may be absent: several
    hierarchies, plans per task); ``at``: the context (tokens) the prediction was taken at."""
    from rich.table import Table

    t = Table(title=title)
    t.add_column("")
    t.add_column("value", justify="right")
    t.add_row("tokens", str(stats["tokens"]))
    if stats.get("prefill_tokens") is not None:   # prompt positions computed (those taken: not again)
        rate = stats.get("prefill_tokens_per_s")
        t.add_row("prefill: tokens, seconds", f"{stats['prefill_tokens']}, {fmt(stats['prefill_seconds'], '.3f')}"
                  + (f" ({rate:.1f} tok/s)" if rate else ""))
    t.add_row("seconds (prefill included)", fmt(stats["seconds"], ".3f"))
    t.add_row("tokens/s", fmt(stats["tokens_per_s"], ".2f"))
    t.add_row("target calls", str(stats["target_calls"]))
    t.add_row("tokens per target call", fmt(stats["tokens_per_target_call"], ".2f"))
    spt = stats.get("seconds_per_token")
    t.add_row("ms/token decode (measured)", fmt(spt and spt * 1e3, ".2f"))
    t.add_row("ms/token (plan's prediction)" + ("" if at is None else f" at context {at:.0f}"),
              fmt(predicted and predicted * 1e3, ".2f"))
    if spt and predicted:
        t.add_row("measured / predicted", f"{spt / predicted:.2f}")
    levels = stats.get("levels")
    if levels is None:
        t.add_row("levels", "per task below (each task ran its own hierarchy)")
    for i, lv in enumerate(levels or []):
        if len(levels) == 1:  # the target alone (a plan where no drafter pays): plain decode steps
            row = f"steps {lv['calls']}, generated {lv['drafted']} tokens"
        elif i == 0:  # the bottom drafter: it proposes, nothing is verified at its level
            row = f"draft calls {lv['calls']}, proposed {lv['drafted']} tokens"
            if "draft_rate" in lv:
                row += f" (in {lv['draft_rate']:.0%} of calls)"
        else:  # a verifying level: its passes over the drafts of the level below
            a = lv.get("acceptance_rate")
            row = (f"passes {lv['calls']}, checked {lv['drafted']} drafts, accepted {lv['accepted']}"
                   + (f", a={a:.3f}" if a is not None else ""))
        t.add_row(f"level {lv['name']}", row)
    return t


def _chain(hierarchy: list[str], budgets: list[int]) -> str:
    return " <- ".join(reversed(hierarchy)) + (f" (T={budgets})" if budgets else "")


def tasks_table(per: dict, by: str, plans: dict[str, tuple[list[str], list[int]]]):
    """Rich table of ``hsd run``'s figures per task (``per``: task -> :meth:`Totals.to_dict`), and the lines
    naming the hierarchy each plan that ran is."""
    from rich import box
    from rich.table import Table

    t = Table(title=f"per {'category' if by == 'category' else 'task'}", box=box.SIMPLE_HEAD, pad_edge=False)
    for c in ("task", "n", "turns", "tokens", "tok/s", "tok/call", "accept", "pred", "meas"):
        t.add_column(c, justify="left" if c == "task" else "right", no_wrap=c == "task")
    ran: dict[str, list[str]] = {}
    for task, d in per.items():
        pr, me = d.get("predicted_seconds_per_token"), d.get("seconds_per_token")
        t.add_row(task, str(d["prompts"]), str(d["generations"]), str(d["tokens"]), fmt(d["tokens_per_s"], ".2f"),
                  fmt(d.get("tokens_per_target_call"), ".2f"), level_acceptance(d), fmt(pr and pr * 1e3, ".1f"),
                  fmt(me and me * 1e3, ".1f"))
        for w in d.get("plans", []):
            ran.setdefault(w, []).append(task)
    notes = ["n: prompts; tok/call: tokens per target call; accept: acceptance of each verifying level, bottom "
             "up; pred, meas: decode ms/token, the plan's prediction and measured"]
    notes += [f"{w} ran {', '.join(ran.get(w, []))}: {_chain(*plans[w])}" for w in sorted(plans)]
    return t, notes


FREQUENCY_HELP = "-2 .. 2: subtracted from a token's logit per time it was generated."
PRESENCE_HELP = "-2 .. 2: subtracted from the logit of every token generated so far."
LOGIT_BIAS_HELP = "A JSON object from token ids to offsets in -100 .. 100 added to their logits, e.g. '{\"28\": -100}'."
REPETITION_HELP = ("0.1 .. 10: the logit of every token of the context (prompt and output) divided by it where "
                   "positive, multiplied by it elsewhere, as Hugging Face and llama.cpp do; 1: off.")
REPEAT_LAST_N_HELP = "With --repetition-penalty: only the context's last N tokens (0: all of it)."


@cli_command
def run_cmd(
    plan: Path = typer.Option(..., "--plan", help="hsd-plan/1 JSON from `hsd solve`."),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="The prompt text."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="JSON lines, ours {\"prompt\", \"task\"} or "
                                                                    "Spec-Bench questions (one run each)."),
    task: Optional[str] = typer.Option(None, "--task", help="The task of --prompt: runs the plan's plan for it "
                                                            "when the plan has plans per task (by_task)."),
    turns: str = typer.Option("first", "--turns", help="first | all: every turn of a multi-turn prompt, each "
                                                       "after the model's own answer to the previous one."),
    limit_per_task: Optional[int] = typer.Option(None, "--limit-per-task", help="Use the first N prompts of "
                                                                                "each task of --prompts (of each "
                                                                                "category with --by category), in "
                                                                                "file order."),
    by: str = typer.Option("group", "--by", help="Report per group (the task) or per category (Spec-Bench)."),
    per_task: bool = typer.Option(True, "--per-task/--no-per-task", help="Run a prompt of a known task with the "
                                                                         "plan's plan for that task (by_task), "
                                                                         "when it has one."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Most tokens generated per prompt (per turn)."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy; > 0 samples (lossless)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass in (0, 1]."),
    top_k: int = typer.Option(0, "--top-k", help=TOP_K_HELP),
    min_p: float = typer.Option(0.0, "--min-p", help=MIN_P_HELP),
    seed: int = typer.Option(0, "--seed", help="Random seed for sampling."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write one JSON line per prompt (per turn) here."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Default: the plan's provenance dtype."),
    target_precision: Optional[str] = typer.Option(None, "--target-precision", help=TARGET_PRECISION_HELP),
    model: Optional[str] = typer.Option(None, "--model", help="Override the plan's model (must match it)."),
    mode: str = typer.Option("exact", "--mode", help="exact: levels hand up exactly T_i tokens per call "
                                                     "(the latency model); eager: every verified token."),
    quiet: bool = typer.Option(False, "--quiet", help="Do not stream the text."),
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", help=JSON_SCHEMA_HELP),
    grammar: Optional[Path] = typer.Option(None, "--grammar", help=GRAMMAR_HELP),
    logprobs: Optional[int] = typer.Option(None, "--logprobs", help="With --json: each generated token's "
                                                                    "log-probability under the target and its N "
                                                                    "most likely alternatives (0 .. 20)."),
    frequency_penalty: float = typer.Option(0.0, "--frequency-penalty", help=FREQUENCY_HELP),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty", help=PRESENCE_HELP),
    logit_bias: Optional[str] = typer.Option(None, "--logit-bias", help=LOGIT_BIAS_HELP),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty", help=REPETITION_HELP),
    repeat_last_n: int = typer.Option(0, "--repeat-last-n", help=REPEAT_LAST_N_HELP),
):
    """Generate with the plan's hierarchy (lossless HSD), streaming text, then print stats (overall, per task).
    With --json-schema or --grammar the output follows it (every level reads the masked model; lossless against
    masked decoding of the target alone)."""
    penalty_kw = sampling_options(max_new_tokens, temperature, top_p, seed, top_k, min_p, frequency_penalty,
                                  presence_penalty, logit_bias, repetition_penalty, repeat_last_n)
    _check_flags(logprobs, json_out, mode, turns, by, [("--plan", plan), ("--prompts", prompts),
                                                        ("--json-schema", json_schema), ("--grammar", grammar)])
    spec = grammar_spec(json_schema, grammar)
    if spec is not None and prompt is not None and task is None:
        task = JSON_TASK                      # an answer under a grammar runs the plan for JSON, if it has one
    items = _items(prompt, prompts, task, limit_per_task, by)
    p, loaded = load_plan_and_model(plan, model, device, dtype, target_precision, engines_only=True,
                                    outputs=[("--json", json_out)])
    # the runtime's modules import torch (seconds): after the flags are checked
    from hsd_opt.prompts import check_room
    from hsd_opt.runtime.penalties import penalties_or_none
    from hsd_opt.runtime.runner import model_context, plan_for_prompt

    warn_sampling(plan, p, temperature, top_p, top_k, min_p)
    penalties = penalties_or_none(**penalty_kw)
    if penalties is not None:
        penalties.check_vocab(len(loaded.tokenizer), "--logit-bias")
    check_room(items, loaded.tokenizer, raw, max_new_tokens, model_context(loaded),
               f"--prompts {prompts}" if prompts is not None else "--prompt", turns)
    runners, plans = _plan_runners(p, loaded, items, per_task, mode, str(plan))
    grammars = item_grammars(items, compile_grammar(spec, loaded), loaded, str(prompts))
    lines, gens = [], []
    with _keeping_finished(json_out, lines, quiet):
        for it in items:
            which = plan_for_prompt(p, it.task, per_task)[3]
            for line, gen in _run_prompt(runners[which], p, loaded.tokenizer, it, which, turns, per_task, raw,
                                         max_new_tokens, temperature, top_p, seed, quiet, grammars.get(it.index),
                                         logprobs, penalties, top_k, min_p):
                lines.append(line)
                gens.append(gen)
        _print_run(gens, by, plans, mode)
    _write_lines(json_out, lines)


@contextlib.contextmanager
def _keeping_finished(json_out: Path | None, lines: list[dict], quiet: bool) -> Iterator[None]:
    """A run, or the report after it, stopped part-way: the ``--json`` lines of the prompts finished (``lines``,
    as they grow) are written and said. Ctrl-C: exit 130 (143 for SIGTERM: ``cli.main``), the streamed line it cut
    ended (by a :class:`~hsd_opt.errors.GrammarStopped` too); an error raised on; stdout closed (``| head``: rich
    exits 1) or full: its error raised on."""
    from hsd_opt.errors import GrammarStopped, HsdError

    try:
        yield
    except (KeyboardInterrupt, HsdError) as e:      # the grammar engine's limit too stops an answer being streamed
        _stopped(json_out, lines, cut_stream=not quiet and isinstance(e, (KeyboardInterrupt, GrammarStopped)),
                 interrupted=isinstance(e, KeyboardInterrupt))
        if isinstance(e, KeyboardInterrupt):     # said: exit 130 without a second line
            raise typer.Exit(130) from None
        raise
    except (OSError, SystemExit):
        _write_lines(json_out, lines, partial=True)
        raise


def _write_lines(json_out: Path | None, lines: list[dict], partial: bool = False) -> None:
    """Write ``lines`` (one JSON object per turn) to ``--json`` atomically, saying so; ``partial``: the run stopped
    before its end, or its output to the terminal could not be written, and the lines are those of the prompts it
    finished (said on stderr; nothing written where it finished none)."""
    if json_out is None or (partial and not lines):
        return
    atomic_write_bytes(json_out, "".join(json.dumps(x) + "\n" for x in lines).encode())
    if partial:
        err_console.print(f"stopped: the {len(lines)} turns of the prompts finished are in {json_out}", markup=False)
    else:
        console.print(f"wrote {json_out}")


def _check_flags(logprobs: int | None, json_out: Path | None, mode: str, turns: str, by: str, inputs) -> None:
    """``hsd run``'s flags checked before anything loads: ``--logprobs``, ``--mode``, ``--turns``, ``--by``, and
    ``--json`` against the files the run reads (``inputs``: ``(flag, path)``)."""
    from hsd_opt.prompts import check_report_key, check_turn_mode
    from hsd_opt.runtime.modes import check_mode

    _check_logprobs(logprobs, json_out)
    check_mode(mode)
    check_outputs(("--json", json_out), inputs=inputs)
    check_turn_mode(turns)
    check_report_key(by)


def _check_logprobs(logprobs: int | None, json_out: Path | None) -> None:
    """Refuse a ``--logprobs`` out of range, or one without ``--json`` (where the log-probabilities go)."""
    from hsd_opt.errors import HsdError
    from hsd_opt.runtime.arguments import check_logprobs

    check_logprobs(logprobs)
    if logprobs is not None and json_out is None:
        raise HsdError("--logprobs: the log-probabilities go to the --json file; give --json FILE")


def _stopped(json_out: Optional[Path], lines: list[dict], cut_stream: bool, interrupted: bool = False) -> None:
    """A run stopped part-way: end the streamed line it cut (``cut_stream``), then write and say the finished
    prompts' ``--json`` lines; ``interrupted`` (Ctrl-C, SIGTERM) with none to write, say that in one line (it
    exited silently)."""
    if cut_stream:
        sys.stdout.write("\n")
        sys.stdout.flush()
    _write_lines(json_out, lines, partial=True)
    if interrupted and not lines:
        error(INTERRUPTED)
    elif interrupted and json_out is None:
        err_console.print(f"stopped: the {len(lines)} turns of the prompts finished are printed above", markup=False)


def sampling_options(max_new_tokens: int, temperature: float, top_p: float, seed: int, top_k: int, min_p: float,
                     frequency: float, presence: float, logit_bias: str | None, repetition: float = 1.0,
                     last_n: int = 0) -> dict[str, object]:
    """Check the generation flags (an :class:`HsdError` naming the flag; a filter at temperature 0 is refused, as
    ``hsd bench`` and ``hsd profile`` refuse it) and return :func:`penalty_options`', without importing torch."""
    from hsd_opt.runtime.arguments import check_sampling_flags

    check_sampling_flags(max_new_tokens, temperature, top_p, top_k, min_p, seed)
    return penalty_options(frequency, presence, logit_bias, repetition, last_n)


def penalty_options(frequency: float, presence: float, logit_bias: str | None, repetition: float = 1.0,
                    last_n: int = 0) -> dict[str, object]:
    """The keyword arguments of :func:`~hsd_opt.runtime.penalties.penalties_or_none` that ``--frequency-penalty``,
    ``--presence-penalty``, ``--logit-bias`` (a JSON object from token ids to numbers), ``--repetition-penalty``
    and ``--repeat-last-n`` (0: the whole context) give, checked; a bad value is an :class:`HsdError` naming its
    flag."""
    from hsd_opt.errors import HsdError
    from hsd_opt.runtime.arguments import bias_from_json, check_penalties

    bias: dict[int, float] = {}
    if logit_bias is not None:
        try:
            raw = json.loads(logit_bias)
        except (ValueError, RecursionError) as e:
            raise HsdError(f"--logit-bias: not JSON that can be read ({json_problem(e)}); give an object such as "
                           f"'{{\"28\": -100}}'") from None
        bias = bias_from_json(raw, "--logit-bias")
    if last_n < 0:
        raise HsdError(f"--repeat-last-n: a number of tokens >= 0 expected (0: the whole context), got {last_n}")
    for flag, kw in (("--frequency-penalty", {"frequency": frequency}), ("--presence-penalty", {"presence": presence}),
                     ("--logit-bias", {"bias": bias}), ("--repetition-penalty", {"repetition": repetition})):
        try:
            check_penalties(**kw)
        except HsdError as e:
            raise HsdError(f"{flag}: {e}") from None
    return {"frequency": frequency, "presence": presence, "bias": bias, "repetition": repetition,
            "repetition_last": last_n or None}


def _plan_runners(p, loaded, items, per_task: bool, mode: str, source: str):
    """One runner per hierarchy the prompts need (the plan's, or its plans per task), all over one set of models:
    ``({plan name: runner}, {plan name: (hierarchy, budgets)})``. Every hierarchy is built first, so that the float
    weights none of them reads can then be released."""
    from hsd_opt.runtime.runner import PlanModels, hsd_for_plan, plan_for_prompt
    from hsd_opt.runtime.state_pool import StatePool

    models = PlanModels(loaded)           # the plans per task share the target's engine, draft models and copies
    models.pool = StatePool(reuse=True)   # a turn takes the keys and values of the conversation before it
    runners: dict[str, object] = {}
    plans: dict[str, tuple[list[str], list[int]]] = {}
    for it in items:
        hh, bb, _, which = plan_for_prompt(p, it.task, per_task)
        if which not in runners:
            runners[which] = hsd_for_plan(p, loaded, mode=mode, source=source, hierarchy=hh, budgets=bb,
                                          models=models)
            plans[which] = (hh, bb)
    models.release_unused_floats(p, [hh for hh, _ in plans.values()])
    return runners, plans


def text_streamer(tok, quiet: bool):
    """The ``on_tokens`` callback of one generation: it gathers the blocks of token ids and, unless ``quiet``,
    writes to stdout the text decoded so far that it has not written yet, but for a trailing incomplete UTF-8
    sequence (decoded as U+FFFD), which waits for the next block. ``stream.finish(answer)`` writes what is left of
    the whole ``answer`` at the end, so stdout holds the answer's text. Where a decode of more tokens rewrites text
    already written (a byte-fallback decoder reads an invalid run of byte tokens as U+FFFD, the valid character
    it printed included), what was written stays and the text past its length goes on (it stopped for good)."""
    got: list[int] = []
    shown = [""]

    def write(s: str) -> None:
        if not quiet and len(s) > len(shown[0]):
            sys.stdout.write(s[len(shown[0]):])
            sys.stdout.flush()
            shown[0] = s

    def stream(block):
        got.extend(block)
        if not quiet:
            write(tok.decode(got, skip_special_tokens=True).rstrip("\ufffd"))

    stream.finish = write
    return stream


def _run_prompt(h, p, tok, it, which: str, turns: str, per_task: bool, raw: bool, max_new_tokens: int,
                temperature: float, top_p: float, seed: int, quiet: bool,
                grammar=None, logprobs: int | None = None, penalties=None, top_k: int = 0,
                min_p: float = 0.0) -> list[tuple[dict, object]]:
    """Generate every turn of the prompt ``it`` (``turns``) with the runner ``h`` of plan ``which``, each turn after
    the model's own answers to the previous ones, streaming the text unless ``quiet``: one ``(JSON line,
    Generation)`` per turn (:func:`_turn_record`). ``grammar``: what every turn's output follows (None: none);
    ``logprobs``: the alternatives listed with each token's log-probability in the line (None: none);
    ``penalties``: the :class:`~hsd_opt.runtime.penalties.Penalties` of every turn (None: none); ``top_k``,
    ``min_p``: sampling's filters (0: off)."""
    from hsd_opt.grammar.constraint import Constraint
    from hsd_opt.prompts import conversation_ids, user_turns
    from hsd_opt.seeds import SEED_STRIDE, offset_seed

    out: list[tuple[dict, object]] = []
    answers: list[str] = []
    for k, text in enumerate(user_turns(it, turns)):
        ids = conversation_ids(tok, it.turns, answers, raw)
        stream = text_streamer(tok, quiet)
        constraint = Constraint(grammar) if grammar is not None else None
        res = h.generate(ids, max_new_tokens, temperature=temperature, top_p=top_p,
                         seed=offset_seed(seed, it.index + SEED_STRIDE * k), on_tokens=stream,
                         constraint=constraint, logprobs=logprobs, penalties=penalties, top_k=top_k, min_p=min_p)
        answer = tok.decode(res.token_ids, skip_special_tokens=True)
        stream.finish(answer)
        if not quiet:
            sys.stdout.write("\n")
        if (constraint is not None and res.stats.get("stopped") == "max_new_tokens"
                and not constraint.accepting(res.token_ids)):       # its matcher already stands at their end
            sys.stdout.flush()
            err_console.print(f"(cut at --max-new-tokens {max_new_tokens}: the answer does not yet complete what "
                              f"{grammar.spec.source} asks)", markup=False)
        answers.append(answer)
        line, gen = _turn_record(p, it, k, text, which, per_task, len(ids), res, answer)
        if res.logprobs is not None:
            line["logprobs"] = _logprobs_line(tok, res.logprobs)
        out.append((line, gen))
    return out


def _logprobs_line(tok, entries) -> list[dict]:
    """The ``logprobs`` of a ``--json`` line: per generated token ``token_id``, ``token`` (its text),
    ``logprob`` and ``top`` (``[[id, logprob], ...]``, most likely first)."""
    from hsd_opt.server.text import token_text

    return [{"token_id": e.token, "token": token_text(tok, e.token),
             "logprob": e.logprob, "top": [[t, v] for t, v in e.top]} for e in entries]


def _turn_record(p, it, k: int, text: str, which: str, per_task: bool, prompt_tokens: int, res, answer: str):
    """The JSON line and the :class:`~hsd_opt.measure.report.Generation` of turn ``k`` of ``it``: its tokens and
    stats, the run's context in tokens (prompt + generated) and the plan's predicted seconds per token there."""
    from hsd_opt.measure.report import Generation
    from hsd_opt.runtime.runner import plan_for_prompt, prediction_context, run_context

    ctx = run_context(prompt_tokens, len(res.token_ids))
    pred = plan_for_prompt(p, it.task, per_task, context=ctx)[2]
    at = prediction_context(p, ctx)
    gen = Generation(it.index, k, it.task, it.category, res.token_ids, res.stats["seconds"], res.stats, which, pred,
                     ctx, at)
    line = {"prompt": text, "task": it.task, "category": it.category, "turn": k, "plan": which,
            "token_ids": res.token_ids, "text": answer, "stats": res.stats, "context": ctx,
            "predicted_seconds_per_token": pred, "predicted_at_context": at}
    if it.question_id is not None:
        line["question_id"] = it.question_id
    return line, gen


def _print_run(gens: list, by: str, plans: dict, mode: str) -> None:
    """Print the run's stats overall and, with several tasks (or plans), per task (or category: ``by``)."""
    from hsd_opt.measure.report import totals_by

    overall, per = totals_by(gens, by)
    total = overall.to_dict()
    if len(plans) == 1:
        (w, hb), = plans.items()
        title = f"hsd run: {_chain(*hb)}{'' if w == 'plan' else f' ({w})'}, {mode}"
    else:
        title = f"hsd run: {len(plans)} hierarchies (plans per task), {mode}"
    console.print(stats_table(total, total.get("predicted_seconds_per_token"), title,
                              total.get("predicted_at_context")))
    if len(per) > 1 or len(plans) > 1:
        table, notes = tasks_table({t: x.to_dict() for t, x in per.items()}, by, plans)
        console.print(table)
        for line in notes:
            console.print(line, style="dim")


