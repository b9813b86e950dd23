"""Load benchmark of `hsd serve`: concurrent streaming clients through the ``openai`` client, then the server's
overhead against ``HSD.generate`` called directly on the same prompts.

    .venv/bin/python -m benchmarks.server_load --plan out/plan.json --clients 8 --requests 4 --max-tokens 64 \\
        --out benchmarks/results/server_load.json

Steps (everything on 127.0.0.1; the run is bounded by --timeout and stops by itself):

1. starts ``hsd serve --plan PLAN --port 0`` in a subprocess (or uses ``--url``) and waits for its ready line;
2. sequential: each distinct prompt once through the server, one request at a time (the reference answers),
   interleaved with the plan's ``HSD.generate`` in this process on the same prompt ids (``hsd run``'s code
   path), in a worker thread (as the server decodes) and in the main thread (as ``hsd run``), the order rotating
   per prompt; checks the token ids equal the server's;
3. load: ``--clients`` threads, each sending ``--requests`` streamed greedy requests one after the other (chat
   through the model's template, or ``--kind completion``), prompts of the suite in turn; records the time to the
   first token and the end of every stream; checks every answer equals the sequential one;
4. stops the server (SIGINT) and compares the tokens/s of the sequential phase.

Reports (JSON to --out, written atomically): requests/s, time to first token p50/p95 (seconds), tokens/s per
stream (p50/p95/mean; a stream's tokens over its time from request to last token, queueing included, and over
its time after the first token), aggregate tokens/s, and the overhead: sequential tokens/s through the server
(client-side time per request) over direct tokens/s (``server_over_direct``: both decoding in a worker
thread). The server batches concurrent requests (the plan per load level); `benchmarks/serve_sweep.py` compares it
with llama.cpp's server and plain batching. Timings on a shared machine are noisy; run it on a quiet one.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.entry import count, run, seconds, whole

REPO = Path(__file__).resolve().parents[1]


def start(cmd: list[str], ready: str, timeout: float, env: dict | None = None, cwd: str | None = None):
    """``(process, url, log lines)`` of a server started with ``cmd`` (in ``cwd``: None, this directory) once a line
    of its output (stdout and stderr) matches ``ready``, a regex whose group 1 is the base URL (without a group: the
    URL is ``""``, the caller knows it). The output is drained into the list by a thread to the end (a full pipe
    would block the server). A program that is not there exits with one line (llama.cpp's binaries: README's
    Development section builds them)."""
    exe = cmd[0]
    if os.sep in exe and not os.access(exe, os.X_OK):
        print(f"error: {exe} is not an executable program (llama.cpp's server: README's Development section "
              f"builds it)", file=sys.stderr)
        sys.exit(2)
    proc = subprocess.Popen(cmd, stderr=subprocess.STDOUT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, cwd=cwd)
    lines: list[str] = []
    got: list[str] = []
    ok = threading.Event()

    def drain():
        for line in proc.stdout:
            lines.append(line)
            m = re.search(ready, line)
            if m and not got:
                got.append(m.group(1) if m.groups() else "")
                ok.set()
        ok.set()

    threading.Thread(target=drain, daemon=True).start()
    if not ok.wait(timeout) or not got:
        proc.kill()
        said = [ln.strip()[len("error: "):] for ln in lines if ln.startswith("error: ")]
        if said and proc.wait() not in (0, -signal.SIGKILL):    # it refused its input in one line (exit 2): say it
            from hsd_opt.errors import HsdError

            name = "hsd serve" if "hsd_opt" in cmd else os.path.basename(str(exe))
            raise HsdError(f"{name} did not start: {said[-1]}")
        raise SystemExit(f"{' '.join(map(str, cmd[:4]))} did not become ready:\n" + "".join(lines[-20:]))
    return proc, got[0], lines


def start_server(plan: str, max_queue: int, threads: int | None, device: str, timeout: float):
    """``(process, url, log lines)`` of ``hsd serve`` on a free port of 127.0.0.1, once it says it is ready."""
    env = {"PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "hsd_opt", "serve", "--plan", plan, "--host", "127.0.0.1", "--port", "0",
           "--max-queue", str(max_queue), "--device", device]
    return start(cmd, r"^ready: .* at (http://\S+/v1)", timeout, env)


def stop_server(proc, timeout: float = 60) -> int:
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def stream_once(client, model: str, kind: str, prompt: str, max_tokens: int, temperature: float = 0.0,
                top_p: float = 1.0, extra: dict | None = None) -> dict:
    """One streamed request (greedy unless ``temperature`` > 0, then unseeded; ``extra``: fields beyond the OpenAI
    API's, such as ``top_k``): text, token ids (from the ``hsd`` figures), tokens, and client-side times (seconds
    since the request was sent): ``ttft`` (first text), ``total`` (last event)."""
    t0 = time.perf_counter()
    ttft, parts, hsd, usage = None, [], None, None
    if kind == "chat":
        it = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                            stream=True, stream_options={"include_usage": True}, extra_body=extra)
    else:
        it = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                                       top_p=top_p, stream=True, stream_options={"include_usage": True},
                                       extra_body=extra)
    for ch in it:
        if ch.usage is not None:
            usage = ch.usage
        if not ch.choices:
            continue
        c = ch.choices[0]
        text = c.delta.content if kind == "chat" else c.text
        if text:
            if ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(text)
        if c.finish_reason:
            hsd = (ch.model_extra or {}).get("hsd")
    total = time.perf_counter() - t0
    return {"text": "".join(parts), "ttft": ttft, "total": total,
            "tokens": usage.completion_tokens if usage else None,
            "token_ids": (hsd or {}).get("token_ids"), "engine_seconds": (hsd or {}).get("seconds"),
            "decode_seconds": (hsd or {}).get("decode_seconds")}


def run_clients(clients: int, setup, work, timeout: float) -> tuple[float, float]:
    """``work(i, setup(i))`` in ``clients`` threads, each set up first (a client object: not timed), then all
    started together; returns the wall seconds from the start to the last thread's end (each waited for at most
    ``timeout``) and the CPU seconds this process used meanwhile."""
    go = threading.Barrier(clients + 1)

    def run(i: int) -> None:
        ready = setup(i)
        go.wait()
        work(i, ready)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    go.wait()
    t0, cpu0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.join(timeout)
    return time.perf_counter() - t0, time.process_time() - cpu0


def pct(xs: list[float], q: float) -> float | None:
    """The ``q``-th percentile of the values of ``xs`` that are not None (linear between order statistics)."""
    from hsd_opt.measure.load_bench import percentile

    return percentile([x for x in xs if x is not None], q)


def load_direct(a):
    """The plan's runner in this process (``hsd run``'s code path): returns ``direct(prompt, worker)`` ->
    ``(token ids, seconds)``, decoding in a worker thread (as the server does) or in the calling thread."""
    import torch

    from hsd_opt.commands.common import load_plan_and_model
    from hsd_opt.engine.kernels import release_thread_pool
    from hsd_opt.prompts import encode_prompt
    from hsd_opt.runtime.runner import hsd_for_plan

    if a.threads:
        torch.set_num_threads(a.threads)
    plan, loaded = load_plan_and_model(Path(a.plan), None, a.device, None)
    runner = hsd_for_plan(plan, loaded, source=a.plan)
    runner.generate(encode_prompt(loaded.tokenizer, "Hello", raw=True), 2)  # warm-up, as the server does

    def direct(prompt: str, worker: bool) -> tuple[list[int], float]:
        ids = encode_prompt(loaded.tokenizer, prompt, raw=a.kind == "completion")
        out: dict = {}

        def work():
            t = time.perf_counter()
            out["ids"] = list(runner.generate(ids, a.max_tokens).token_ids)
            out["seconds"] = time.perf_counter() - t

        if worker:  # as `hsd serve` does: this thread's OpenMP pool freed first (kernels.release_thread_pool)
            release_thread_pool()
            th = threading.Thread(target=work)
            th.start()
            th.join()
        else:
            work()
        return out["ids"], out["seconds"]

    return direct


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", default=str(REPO / "out" / "plan.json"))
    ap.add_argument("--url", default=None, help="use a running server (…/v1) instead of starting one")
    ap.add_argument("--prompts", default=None, help="JSON-lines prompts (default: the shipped suite)")
    ap.add_argument("--clients", type=count, default=8)
    ap.add_argument("--requests", type=count, default=4, help="requests per client")
    ap.add_argument("--max-tokens", type=count, default=64)
    ap.add_argument("--kind", choices=("chat", "completion"), default="chat")
    ap.add_argument("--threads", type=whole, default=None, help="torch threads of the server and the direct run")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--timeout", type=seconds, default=1800, help="seconds for start-up and for each phase")
    ap.add_argument("--no-direct", action="store_true", help="skip the direct HSD.generate comparison")
    ap.add_argument("--out", required=True, help="JSON report path")
    a = ap.parse_args()

    from openai import OpenAI

    from hsd_opt.jsonio import write_json
    from hsd_opt.prompts import load_prompts

    items = load_prompts(a.prompts).items
    n_total = a.clients * a.requests
    prompts = [items[i % len(items)].prompt for i in range(n_total)]
    distinct = list(dict.fromkeys(prompts))

    proc, lines = None, []
    if a.url:
        url = a.url.rstrip("/")
    else:
        print(f"starting hsd serve --plan {a.plan} ...", flush=True)
        proc, url, lines = start_server(a.plan, max(16, a.clients), a.threads, a.device, a.timeout)
    try:
        probe = OpenAI(base_url=url, api_key=os.environ.get("HSD_API_KEY", "none"), max_retries=0,
                       timeout=a.timeout)
        model = probe.models.list().data[0].id

        # sequential: each distinct prompt once through the server, one request at a time (the reference
        # answers), interleaved with the same prompt decoded directly in this process (worker thread, main
        # thread), the order rotating per prompt, so that the machine's drift falls on every side alike
        direct = load_direct(a) if not a.no_direct else None
        seq: dict[str, dict] = {}
        runs: dict[str, dict] = {"direct": {"tokens": 0, "seconds": 0.0}, "direct_main_thread":
                                 {"tokens": 0, "seconds": 0.0}}
        differ: list[str] = []  # prompts whose direct ids differ from the server's
        for i, p in enumerate(distinct):
            order = ["server", "direct", "direct_main_thread"] if direct else ["server"]
            order = order[i % len(order):] + order[: i % len(order)]
            for what in order:
                if what == "server":
                    seq[p] = stream_once(probe, model, a.kind, p, a.max_tokens)
                    continue
                ids, secs = direct(p, worker=what == "direct")
                runs[what]["tokens"] += len(ids)
                runs[what]["seconds"] += secs
                runs[what].setdefault("ids", {})[p] = ids
        print(f"sequential: {len(seq)} requests done", flush=True)

        # load: clients x requests, streamed, concurrent
        results: list[dict] = []
        errors: list[str] = []
        lock = threading.Lock()

        def client_loop(i: int):
            c = OpenAI(base_url=url, api_key=os.environ.get("HSD_API_KEY", "none"), max_retries=0,
                       timeout=a.timeout)
            for k in range(a.requests):
                p = prompts[i * a.requests + k]
                try:
                    r = stream_once(c, model, a.kind, p, a.max_tokens)
                    r["prompt"] = p
                    with lock:
                        results.append(r)
                except Exception as e:  # counted and reported
                    with lock:
                        errors.append(f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(a.clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, a.timeout - (time.perf_counter() - t0)))
        wall = time.perf_counter() - t0
        print(f"load: {len(results)} of {n_total} requests in {wall:.1f} s", flush=True)
    finally:
        code = stop_server(proc) if proc is not None else None

    ttft = [r["ttft"] for r in results]
    per_stream = [r["tokens"] / r["total"] for r in results if r["tokens"] and r["total"]]
    after_first = [(r["tokens"] - 1) / (r["total"] - r["ttft"]) for r in results
                   if r["tokens"] and r["tokens"] > 1 and r["ttft"] is not None and r["total"] > r["ttft"]]
    tokens = sum(r["tokens"] or 0 for r in results)
    load = {
        "requests": n_total, "completed": len(results), "errors": errors[:10], "error_count": len(errors),
        "wall_seconds": wall, "requests_per_s": len(results) / wall if wall > 0 else None,
        "ttft_seconds": {"p50": pct(ttft, 50), "p95": pct(ttft, 95)},
        "stream_tokens_per_s": {"p50": pct(per_stream, 50), "p95": pct(per_stream, 95),
                                "mean": sum(per_stream) / len(per_stream) if per_stream else None},
        "stream_tokens_per_s_after_first_token": {"p50": pct(after_first, 50), "p95": pct(after_first, 95)},
        "aggregate_tokens_per_s": tokens / wall if wall > 0 else None,
        "matches_sequential": all(r["text"] == seq[r["prompt"]]["text"] for r in results) and not errors,
    }
    s_tokens = sum(r["tokens"] or 0 for r in seq.values())
    s_seconds = sum(r["total"] for r in seq.values())
    e_seconds = sum(r["engine_seconds"] or 0 for r in seq.values())
    sequential = {"server": {"requests": len(seq), "tokens": s_tokens, "seconds": s_seconds,
                             "tokens_per_s": s_tokens / s_seconds if s_seconds else None,
                             "engine_seconds": e_seconds, "http_overhead_seconds": s_seconds - e_seconds}}

    if direct is not None:
        import torch

        for key in ("direct", "direct_main_thread"):
            r = runs[key]
            differ += [p for p, ids in r.pop("ids").items() if ids != seq[p]["token_ids"]]
            sequential[key] = {"requests": len(seq), **r,
                               "tokens_per_s": r["tokens"] / r["seconds"] if r["seconds"] else None,
                               "torch_threads": torch.get_num_threads()}
        sequential["outputs_equal"] = not differ
        st = sequential["server"]["tokens_per_s"]
        for key, name in (("direct", "server_over_direct"), ("direct_main_thread", "server_over_direct_main_thread")):
            dt = sequential[key]["tokens_per_s"]
            sequential[name] = st / dt if st and dt else None

    report = {"plan": a.plan, "url": url, "model": model, "kind": a.kind, "clients": a.clients,
              "requests_per_client": a.requests, "max_tokens": a.max_tokens, "load": load,
              "sequential": sequential, "server_exit_code": code,
              "machine": {"cpu_count": os.cpu_count(), "load_average": list(os.getloadavg()),
                          "python": platform.python_version(), "threads": a.threads},
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    write_json(a.out, report)
    f = lambda x, spec=".2f": "-" if x is None else format(x, spec)  # noqa: E731
    print(f"requests/s {f(load['requests_per_s'])}, TTFT p50 {f(load['ttft_seconds']['p50'], '.3f')} s "
          f"p95 {f(load['ttft_seconds']['p95'], '.3f')} s, tokens/s per stream p50 "
          f"{f(load['stream_tokens_per_s']['p50'])}, aggregate {f(load['aggregate_tokens_per_s'])}, "
          f"answers equal to sequential: {load['matches_sequential']}")
    if "direct" in sequential:
        print(f"sequential tokens/s: server {f(sequential['server']['tokens_per_s'])}, direct in a worker thread "
              f"{f(sequential['direct']['tokens_per_s'])} (server/direct {f(sequential['server_over_direct'], '.3f')}"
              f"), direct in the main thread {f(sequential['direct_main_thread']['tokens_per_s'])}; token ids "
              f"equal: {sequential['outputs_equal']}")
    print(f"wrote {a.out}")
    if errors or not load["matches_sequential"] or sequential.get("outputs_equal") is False:
        sys.exit(1)


if __name__ == "__main__":
    run(main)
