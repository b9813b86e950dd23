"""Structured output served: `hsd serve` against llama.cpp's server on the same JSON-schema tasks
(``hsd_opt/data/json_tasks.jsonl``), every request with its schema in ``response_format``, greedy, in one run:

    .venv/bin/python -m benchmarks.json_serve --plan tests/data/runtime_bench_lookup_plan.json \\
        --llama-server <llama.cpp>/build/bin/llama-server --gguf <the embedded Q4_1 GGUF> \\
        [--concurrency 1,8] [--skip 0] [--limit 60] [--max-tokens 200] [--out benchmarks/results/json_serve.json]

At each number of clients ``c`` both servers answer every task once (``c`` client threads taking the tasks in turn;
the servers' order alternates between levels, ``--first`` going first at the first: give the other in a second run);
llama.cpp's server runs with ``--parallel c`` and ``-t THREADS``, `hsd serve` with as many threads
(``OMP_NUM_THREADS``). With a plan that has a
plan for task ``json`` (``hsd solve --per-task``), `hsd serve` answers these requests with it. Reported per server
and level: aggregate completion tokens/s (every completion token over the wall time from the first request to the
last answer), how many answers ended (``finish_reason`` ``"stop"``), how many of those parse as JSON, and how many
requests failed (an HTTP error or a dropped connection: counted, not lost with its client thread).
"""

from __future__ import annotations

import argparse
import functools
import json
import queue
import threading
import time
from pathlib import Path

import httpx

from benchmarks.entry import count, counts, run, seconds, whole
from benchmarks.serve_sweep import free_port, served_name
from benchmarks.server_load import start, start_server, stop_server
from hsd_opt.engine.variants import host
from hsd_opt.jsonio import write_json

TASKS = Path(__file__).resolve().parents[1] / "hsd_opt" / "data" / "json_tasks.jsonl"


@functools.lru_cache(maxsize=None)
def _name(url: str) -> str:
    return served_name(url)


def answer(client: httpx.Client, url: str, task: dict, max_tokens: int) -> dict:
    """One greedy chat request with the task's schema: its completion tokens, whether it ended and parses."""
    body = {"model": _name(url), "messages": [{"role": "user", "content": task["prompt"]}], "max_tokens": max_tokens,
            "temperature": 0, "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": task["name"], "schema": task["schema"]}}}
    r = client.post(url + "/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    d = r.json()
    text = d["choices"][0]["message"]["content"]
    ended = d["choices"][0]["finish_reason"] == "stop"
    try:
        json.loads(text)
        parses = True
    except ValueError:
        parses = False
    return {"task": task["name"], "tokens": d["usage"]["completion_tokens"], "ended": ended, "parses": parses}


def run_clients(work: list, clients: int, one) -> tuple[list, float]:
    """``(results, wall seconds)``: ``clients`` threads, each with its own HTTP client, taking the items of ``work``
    in turn and appending ``one(client, item)``."""
    todo: queue.Queue = queue.Queue()
    for w in work:
        todo.put(w)
    out: list = []

    def take():
        with httpx.Client() as client:
            while True:
                try:
                    w = todo.get_nowait()
                except queue.Empty:
                    return
                out.append(one(client, w))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=take) for _ in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return out, time.perf_counter() - t0


def level(url: str, tasks: list[dict], clients: int, max_tokens: int) -> dict:
    """Every task answered once by ``clients`` threads: aggregate tokens/s, ended and parsing counts."""
    def attempt(client: httpx.Client, t: dict) -> dict:
        try:
            return answer(client, url, t, max_tokens)
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:    # counted, not lost with its thread
            return {"task": t["name"], "error": f"{type(e).__name__}: {str(e)[:200]}"}

    out, wall = run_clients(tasks, clients, attempt)
    done = [x for x in out if "error" not in x]
    tokens = sum(x["tokens"] for x in done)
    return {"clients": clients, "answers": len(done), "errors": len(out) - len(done), "tokens": tokens,
            "wall_seconds": wall, "aggregate_tokens_per_s": tokens / wall, "ended": sum(x["ended"] for x in done),
            "ended_and_parse": sum(x["ended"] and x["parses"] for x in done), "rows": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--concurrency", type=counts, default="1,8")
    ap.add_argument("--skip", type=whole, default=0, help="leave out the first N tasks (e.g. those profiled)")
    ap.add_argument("--limit", type=count, default=60)
    ap.add_argument("--max-tokens", type=count, default=200)
    ap.add_argument("--threads", type=count, default=2)
    ap.add_argument("--ctx", type=whole, default=16384)
    ap.add_argument("--timeout", type=seconds, default=300)
    ap.add_argument("--first", choices=("hsd", "llama"), default="hsd", help="the server that goes first at the "
                    "first level (the order alternates between levels)")
    ap.add_argument("--out", default="benchmarks/results/json_serve.json")
    a = ap.parse_args()
    tasks = [json.loads(x) for x in TASKS.read_text().splitlines() if x.strip()][a.skip:a.skip + a.limit]
    levels = a.concurrency
    hsd, hsd_url, _ = start_server(a.plan, 64, a.threads, "cpu", a.timeout)
    report = {"host": host(), "plan": a.plan, "gguf": a.gguf, "threads": a.threads, "first": a.first,
              "max_tokens": a.max_tokens, "tasks": len(tasks), "levels": []}
    try:
        for i, c in enumerate(levels):
            port = free_port()
            cmd = [a.llama_server, "-m", a.gguf, "--host", "127.0.0.1", "--port", str(port), "--parallel", str(c),
                   "-t", str(a.threads), "-c", str(a.ctx), "--no-webui"]
            llama, _, _ = start(cmd, r"(listening on http|server is listening)", a.timeout)
            try:
                row = {"clients": c}
                order = [("hsd", hsd_url), ("llama", f"http://127.0.0.1:{port}/v1")]
                if a.first == "llama":
                    order.reverse()
                for name, url in (order if i % 2 == 0 else order[::-1]):
                    with httpx.Client() as client:             # warm-up, not measured
                        answer(client, url, tasks[0], 8)
                    row[name] = level(url, tasks, c, a.max_tokens)
                    r = row[name]
                    print(f"{c} clients, {name}: {r['aggregate_tokens_per_s']:.1f} tok/s, ended {r['ended']}/"
                          f"{r['answers']}, parse {r['ended_and_parse']}, failed {r['errors']}", flush=True)
                row["hsd_over_llama"] = row["hsd"]["aggregate_tokens_per_s"] / row["llama"]["aggregate_tokens_per_s"]
                report["levels"].append(row)
            finally:
                stop_server(llama)
    finally:
        stop_server(hsd)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(a.out, report, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    run(main)
