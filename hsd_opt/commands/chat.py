"""`hsd chat`: a conversation with a plan's hierarchy in the terminal. Each line read from stdin is a user message;
the answer streams to stdout; each turn takes the keys and values of the conversation before it from the previous
turn's decoding (``docs/design.md#decode-kernels``, "A conversation's earlier turns taken"), so it computes only its
new tokens. Lossless as ``hsd run``: every answer is the one the plan gives the whole conversation computed afresh."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import typer

from hsd_opt.commands.common import (
    MIN_P_HELP,
    TARGET_PRECISION_HELP,
    TOP_K_HELP,
    cli_command,
    load_plan_and_model,
    warn_sampling,
)
from hsd_opt.console import err_console
from hsd_opt.seeds import offset_seed

#: A line that forgets the conversation (the system message stays).
RESET = "/reset"


@cli_command
def chat_cmd(
    plan: Path = typer.Option(..., "--plan", help="hsd-plan/1 JSON from `hsd solve`."),
    system: Optional[str] = typer.Option(None, "--system", help="A system message before the conversation."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Most tokens of an answer."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy; > 0 samples (lossless)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass in (0, 1]."),
    top_k: int = typer.Option(0, "--top-k", help=TOP_K_HELP),
    min_p: float = typer.Option(0.0, "--min-p", help=MIN_P_HELP),
    seed: int = typer.Option(0, "--seed", help="Random seed for sampling (turn k uses seed + k)."),
    stats: bool = typer.Option(True, "--stats/--no-stats", help="After each answer, a line on stderr: its tokens, "
                                                                "tokens/s and the prompt's tokens computed."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Default: the plan's provenance dtype."),
    target_precision: Optional[str] = typer.Option(None, "--target-precision", help=TARGET_PRECISION_HELP),
    model: Optional[str] = typer.Option(None, "--model", help="Override the plan's model (must match it)."),
    mode: str = typer.Option("exact", "--mode", help="exact | eager (as `hsd run --mode`)."),
):
    """Chat with the plan's hierarchy: one message per line on stdin, each answer streamed; a turn computes only its
    new tokens. /reset starts over; an empty line is skipped; end of input (Ctrl-D) ends; Ctrl-C stops an answer
    (the turn is dropped) or, at the prompt, ends."""
    from hsd_opt.commands.run import sampling_options
    from hsd_opt.errors import HsdError
    from hsd_opt.prompts import check_utf8
    from hsd_opt.runtime.modes import check_mode

    sampling_options(max_new_tokens, temperature, top_p, seed, top_k, min_p, 0.0, 0.0, None)
    check_mode(mode)
    if system is not None and not system.strip():
        raise HsdError("--system: empty message")
    if system is not None:
        check_utf8(system, "--system")
    p, loaded = load_plan_and_model(plan, model, device, dtype, target_precision, engines_only=True)
    # the runtime's modules import torch (seconds): after the flags are checked
    from hsd_opt.runtime.runner import PlanModels, hsd_for_plan
    from hsd_opt.runtime.state_pool import StatePool

    warn_sampling(plan, p, temperature, top_p, top_k, min_p)
    models = PlanModels(loaded)
    models.pool = StatePool(reuse=True)        # each turn takes the conversation before it
    runner = hsd_for_plan(p, loaded, mode=mode, source=str(plan), models=models)
    start = [{"role": "system", "content": system}] if system else []
    _check_start(loaded, start, max_new_tokens)
    err_console.print(f"ready: {' -> '.join(p.hierarchy)}; one message per line, {RESET} starts over, "
                      f"end of input ends")
    messages = list(start)
    turn = 0
    for number, text in enumerate(_lines(), 1):
        if text is None:
            err_console.print(f"error: line {number} of the input is not UTF-8 text: the turn is dropped",
                              markup=False)
            continue
        if text.strip() == RESET:
            messages = list(start)
            continue
        if not text.strip():
            continue
        answer = _answer(runner, loaded.tokenizer, messages + [{"role": "user", "content": text}], max_new_tokens,
                         temperature, top_p, top_k, min_p, offset_seed(seed, turn), stats)
        if answer is not None:
            messages += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
            turn += 1


def _check_start(loaded, start: list[dict[str, str]], max_new_tokens: int) -> None:
    """Refuse, before the first message, what would fail every turn: ``--max-new-tokens`` that leaves no room for
    a message in the model's context, a ``--system`` message the chat template refuses, or a shortest turn (the
    system message and a one-word message) that with ``--max-new-tokens`` passes the context, naming ``--system``
    where the rest would fit without it."""
    from hsd_opt.errors import HsdError
    from hsd_opt.prompts import chat_ids
    from hsd_opt.runtime.runner import model_context

    context = model_context(loaded)
    if context is not None and max_new_tokens >= context:
        raise HsdError(f"--max-new-tokens {max_new_tokens}: the model's context is {context} positions, which "
                       f"leaves no room for a message")
    try:
        least = len(chat_ids(loaded.tokenizer, start + [{"role": "user", "content": "x"}]))   # the shortest turn
    except HsdError as e:
        if not start:
            raise
        raise HsdError(f"--system: {e}") from None
    if context is not None and least + max_new_tokens > context:
        without = len(chat_ids(loaded.tokenizer, [{"role": "user", "content": "x"}])) if start else least
        flag = "--system" if start and without + max_new_tokens <= context else f"--max-new-tokens {max_new_tokens}"
        raise HsdError(f"{flag}: a one-word message makes a prompt of {least} tokens"
                       f"{' with the system message' if start else ''}, and with --max-new-tokens {max_new_tokens} "
                       f"that exceeds the model's context of {context} positions: no turn could be answered")


def _fits_alone(runner, tok, messages: list[dict], max_new_tokens: int) -> bool:
    """Whether the last of ``messages``, after the system message where there is one but without the turns between,
    fits the model's context with ``max_new_tokens`` (False where there are no turns between)."""
    from hsd_opt.prompts import chat_ids

    alone = [m for m in messages[:1] if m["role"] == "system"] + messages[-1:]
    limit = runner.max_positions
    return len(alone) < len(messages) and (limit is None or len(chat_ids(tok, alone)) + max_new_tokens <= limit)


def _lines():
    """The lines of stdin without their line ends (None for one that is not UTF-8 text), a ``> `` prompt on stderr
    before each where stdin is a terminal."""
    if sys.stdin is None:                       # no standard input at all (closed): nothing to read
        return
    raw = getattr(sys.stdin, "buffer", None)     # bytes where there are, whatever the locale's decoding
    while True:
        if sys.stdin.isatty():
            err_console.print("> ", end="")
        try:
            line = raw.readline() if raw is not None else sys.stdin.readline()
        except KeyboardInterrupt:              # Ctrl-C at the prompt ends, as end of input does
            return
        if not line:
            return
        try:
            text = line.decode("utf-8") if isinstance(line, bytes) else line
            text.encode("utf-8")               # a text stream's undecodable bytes read as lone surrogates
        except UnicodeError:
            text = None
        yield None if text is None else text.rstrip("\r\n")


def _answer(runner, tok, messages: list[dict], max_new_tokens: int, temperature: float, top_p: float, top_k: int,
            min_p: float, seed: int, stats: bool) -> str | None:
    """Generate and stream the answer to ``messages``; its text, or None where the conversation cannot go on (its
    error printed: the turn is dropped, the conversation kept)."""
    from hsd_opt.commands.run import text_streamer
    from hsd_opt.errors import ContextFull, HsdError, Terminated
    from hsd_opt.prompts import chat_ids

    t0 = time.perf_counter()
    stream = text_streamer(tok, False)
    try:
        ids = chat_ids(tok, messages)
        res = runner.generate(ids, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                              on_tokens=stream, top_k=top_k, min_p=min_p)
    except HsdError as e:
        hint = ""
        if isinstance(e, ContextFull):      # the earlier turns filled the context (every later turn would fail as
            hint = ("; /reset starts the conversation over" if _fits_alone(runner, tok, messages, max_new_tokens)
                    else "; the message is too long even alone")    # this one did), or the message alone does
        err_console.print(f"error: {e}{hint}", markup=False)
        return None
    except Terminated:                         # SIGTERM ends the conversation
        raise
    except KeyboardInterrupt:                  # Ctrl-C stops this answer, not the conversation
        sys.stdout.write("\n")
        err_console.print("(stopped: the turn is dropped)", markup=False)
        return None
    answer = tok.decode(res.token_ids, skip_special_tokens=True)
    stream.finish(answer)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if stats:
        s, wall = res.stats, time.perf_counter() - t0
        err_console.print(f"[{len(res.token_ids)} tokens, {len(res.token_ids) / wall:.1f} tok/s; prompt "
                          f"{len(ids)} tokens, {s.get('prefill_tokens', len(ids))} computed]", markup=False)
    return answer
