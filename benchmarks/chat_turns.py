"""Conversations served: each client walks its two-turn conversations (Spec-Bench's MT-bench questions), sending the
second turn with the server's own answer to the first, as a chat client does; `hsd serve` with its prompt cache (the
second turn takes the first's keys and values), `hsd serve --prompt-cache 0` (computes every prompt whole), and
`llama-server` (its slots keep their prompts: `cache_prompt`, on by default), in one interleaved run.

    .venv/bin/python -m benchmarks.chat_turns --plan out/plan.json --questions QUESTIONS.jsonl \\
        [--llama-server PATH --gguf FILE] [--concurrency 1,4] [--limit 16] [--max-tokens 128] [--rounds 2] \\
        [--methods hsd,hsd_nocache,llama] [--out benchmarks/results/chat_turns.json]
    .venv/bin/python -m benchmarks.chat_turns --plan out/plan.json --questions QUESTIONS.jsonl --in-process \
        [--limit 16] [--max-tokens 128] [--out ...]

At each number of clients ``c`` (levels in order, the methods' order shifted by one from round to round) ``c``
threads start together and take the conversations in turn (``--limit`` of them, the first that have two turns),
greedy, streamed, ``--max-tokens`` each turn. Reported per method, level and round: aggregate completion tokens/s
(every turn's tokens over the wall time), time to the first token of first and of second turns (p50, seconds), the
mean seconds of a second turn, the prompt tokens the server reported cached (``usage.prompt_tokens_details``), and
whether the ``hsd*`` methods' answers are the same turn for turn at each round and level (the cache changes no
token: ``hsd_answers_equal``).

``--in-process``: no servers; the plan in this process, each conversation's second turn generated after its first
with a pool that takes the first turn's positions and with one that does not (the order alternating by
conversation): decode ms/token and the second turns' prefill seconds of each, every answer compared."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.entry import count, counts, run, seconds, whole
from benchmarks.serve_sweep import free_port
from benchmarks.server_load import pct, run_clients, start, stop_server
from hsd_opt.engine.variants import host
from hsd_opt.errors import HsdError
from hsd_opt.jsonio import write_json

METHODS = ("hsd", "hsd_nocache", "llama")


def conversations(path: str, limit: int) -> list[list[str]]:
    """The first two user turns of the first ``limit`` questions of ``path`` (a prompt file, checked line by line
    as ``hsd profile --prompts`` checks it) with two turns or more."""
    from hsd_opt.prompts import load_prompts

    out = [list(it.turns[:2]) for it in load_prompts(path).items if len(it.turns) >= 2]
    if not out:
        raise HsdError(f"{path}: no question with two turns")
    return out[:limit]


def turn(client, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy chat turn: its text, token ids (``hsd`` servers), tokens, cached prompt tokens and the
    client's times in seconds (``ttft``: the first text; ``total``: the last event)."""
    t0 = time.perf_counter()
    ttft, parts, usage, ids = None, [], None, None
    for ch in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True}):
        if ch.usage is not None:
            usage = ch.usage
        if not ch.choices:
            continue
        text = ch.choices[0].delta.content
        if text:
            ttft = time.perf_counter() - t0 if ttft is None else ttft
            parts.append(text)
        if ch.choices[0].finish_reason:
            ids = ((ch.model_extra or {}).get("hsd") or {}).get("token_ids")
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return {"text": "".join(parts), "ttft": ttft, "total": time.perf_counter() - t0, "token_ids": ids,
            "tokens": usage.completion_tokens if usage else None,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached": getattr(details, "cached_tokens", None) if details else None}


def level(url: str, convs: list[list[str]], clients: int, max_tokens: int, timeout: float) -> dict:
    """``clients`` threads walking the conversations (client ``i`` takes ``i, i + clients, ...``), started
    together; the level's figures and every turn's record."""
    from openai import OpenAI

    model = OpenAI(base_url=url, api_key="none").models.list().data[0].id
    done: dict[int, list[dict]] = {}
    errors: list[str] = []

    def worker(i: int, c):
        for j in range(i, len(convs), clients):
            try:
                msgs = [{"role": "user", "content": convs[j][0]}]
                first = turn(c, model, msgs, max_tokens)
                msgs += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": convs[j][1]}]
                done[j] = [first, turn(c, model, msgs, max_tokens)]
            except Exception as e:  # noqa: BLE001 - reported
                errors.append(repr(e)[:300])

    wall, _ = run_clients(clients, lambda i: OpenAI(base_url=url, api_key="none", max_retries=0, timeout=timeout),
                          worker, timeout)
    turns = [done[j] for j in sorted(done)]
    firsts, seconds = [t[0] for t in turns], [t[1] for t in turns]
    tokens = sum((r["tokens"] or 0) for t in turns for r in t)
    return {"clients": clients, "conversations": len(turns), "errors": errors, "wall_seconds": wall,
            "aggregate_tokens_per_s": tokens / wall if wall > 0 else None, "tokens": tokens,
            "ttft_first_p50": pct([r["ttft"] for r in firsts], 50),
            "ttft_second_p50": pct([r["ttft"] for r in seconds], 50),
            "second_turn_seconds_mean": sum(r["total"] for r in seconds) / len(seconds) if seconds else None,
            "second_prompt_tokens": sum((r["prompt_tokens"] or 0) for r in seconds),
            "second_cached_tokens": sum((r["cached"] or 0) for r in seconds),
            "answers": [[r["token_ids"] for r in t] for t in turns]}


def in_process(plan: str, convs: list[list[str]], max_tokens: int) -> dict:
    """The second turns with and without the prompt cache in this process (see the module's ``--in-process``)."""
    from hsd_opt.commands.common import load_plan_and_model
    from hsd_opt.prompts import chat_ids
    from hsd_opt.runtime.runner import hsd_for_plan
    from hsd_opt.runtime.state_pool import StatePool

    p, loaded = load_plan_and_model(plan, None, "cpu", None, None, engines_only=True)
    h, tok = hsd_for_plan(p, loaded), loaded.tokenizer
    decode, prefill, tokens, equal = {True: 0.0, False: 0.0}, {True: 0.0, False: 0.0}, 0, True
    for i, (first, second) in enumerate(convs):
        m1 = [{"role": "user", "content": first}]
        answer = tok.decode(h.generate(chat_ids(tok, m1), max_tokens).token_ids, skip_special_tokens=True)
        ids = chat_ids(tok, m1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": second}])
        outs = {}
        for reuse in ((True, False) if i % 2 == 0 else (False, True)):
            h.pool = StatePool(reuse=reuse)
            h.generate(chat_ids(tok, m1), max_tokens)          # the first turn's state in this pool
            r = h.generate(ids, max_tokens)
            outs[reuse] = r.token_ids
            decode[reuse] += r.stats["decode_seconds"]
            prefill[reuse] += r.stats["prefill_seconds"]
        equal &= outs[True] == outs[False]
        tokens += len(outs[True])
    return {"conversations": len(convs), "second_turn_tokens": tokens, "answers_equal": equal,
            "decode_ms_per_token": {"cache": 1000 * decode[True] / tokens, "no_cache": 1000 * decode[False] / tokens},
            "second_turns_prefill_seconds": {"cache": prefill[True], "no_cache": prefill[False]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", required=True)
    ap.add_argument("--questions", required=True, help="Spec-Bench questions (JSON lines with 'turns')")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--gguf", default=None, help="the model file llama-server serves")
    ap.add_argument("--methods", default="hsd,hsd_nocache,llama")
    ap.add_argument("--concurrency", type=counts, default="1,4")
    ap.add_argument("--limit", type=count, default=16, help="conversations per level")
    ap.add_argument("--max-tokens", type=count, default=128)
    ap.add_argument("--rounds", type=count, default=2)
    ap.add_argument("--threads", type=count, default=2)
    ap.add_argument("--ctx", type=whole, default=16384)
    ap.add_argument("--timeout", type=seconds, default=600)
    ap.add_argument("--in-process", action="store_true", help="no servers: the cache's effect in this process")
    ap.add_argument("--out", default="benchmarks/results/chat_turns.json")
    a = ap.parse_args()
    if a.in_process:
        report = {"host": host(), "plan": a.plan, "max_tokens": a.max_tokens,
                  **in_process(a.plan, conversations(a.questions, a.limit), a.max_tokens)}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        write_json(a.out, report, indent=2)
        print(json.dumps({k: v for k, v in report.items() if k != "host"}), flush=True)
        return
    methods = [m for m in a.methods.split(",") if m]
    if any(m not in METHODS for m in methods):
        raise HsdError(f"--methods: expected some of {', '.join(METHODS)}, got {a.methods}")
    if "llama" in methods and not (a.llama_server and a.gguf):
        raise HsdError("--methods llama: give --llama-server and --gguf")
    convs = conversations(a.questions, a.limit)
    env = {"PYTHONUNBUFFERED": "1", "COLUMNS": "200", "OMP_NUM_THREADS": str(a.threads)}  # llama-server's -t
    servers = {}
    for m, cache in (("hsd", []), ("hsd_nocache", ["--prompt-cache", "0"])):
        if m in methods:
            cmd = [sys.executable, "-m", "hsd_opt", "serve", "--plan", a.plan, "--host", "127.0.0.1", "--port", "0",
                   "--max-queue", "64", "--device", "cpu", *cache]
            servers[m] = start(cmd, r"^ready: .* at (http://\S+/v1)", a.timeout, env)
    report = {"host": host(), "plan": a.plan, "gguf": a.gguf, "max_tokens": a.max_tokens,
              "conversations": len(convs), "runs": []}
    try:
        for rnd in range(a.rounds):
            for li, c in enumerate(a.concurrency):
                k = (rnd + li) % len(methods)
                for m in methods[k:] + methods[:k]:
                    proc = None
                    if m in servers:
                        url = servers[m][1]
                    else:
                        port = free_port()
                        proc, _, _ = start([a.llama_server, "-m", a.gguf, "--host", "127.0.0.1", "--port", str(port),
                                            "--parallel", str(c), "-t", str(a.threads), "-c", str(a.ctx),
                                            "--no-webui"], r"(listening on http|server is listening)", a.timeout)
                        url = f"http://127.0.0.1:{port}/v1"
                    try:
                        level(url, convs[:1], 1, 8, a.timeout)          # warm-up, not measured
                        r = level(url, convs, c, a.max_tokens, a.timeout)
                    finally:
                        if proc is not None:
                            stop_server(proc)
                    r.update(method=m, round=rnd)
                    report["runs"].append(r)
                    print(f"round {rnd} {c} clients {m}: {r['aggregate_tokens_per_s']:.1f} tok/s, ttft 1st/2nd "
                          f"{r['ttft_first_p50']:.3f}/{r['ttft_second_p50']:.3f} s, 2nd turn "
                          f"{r['second_turn_seconds_mean']:.3f} s, cached {r['second_cached_tokens']}/"
                          f"{r['second_prompt_tokens']}, errors {len(r['errors'])}", flush=True)
                same = [r for r in report["runs"] if r["round"] == rnd and r["clients"] == c
                        and r["method"] in ("hsd", "hsd_nocache")]
                if len(same) == 2:
                    report.setdefault("hsd_answers_equal", []).append(same[0]["answers"] == same[1]["answers"])
    finally:
        for proc, _, _ in servers.values():
            stop_server(proc)
    for r in report["runs"]:
        r.pop("answers")                                    # compared above; the token ids are not kept
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(a.out, report, indent=2)
    print(f"wrote {a.out}; hsd answers equal with and without the cache: {report.get('hsd_answers_equal')}")


if __name__ == "__main__":
    run(main)
