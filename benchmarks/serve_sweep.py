"""Serving under load: aggregate tokens/s, time to the first token and tokens/s per stream at each number of
concurrent clients, for `hsd serve` with a load-aware plan, the same server one request at a time, plain batched
decoding (the target alone, batched), and llama.cpp's server (its own batching, and its best speculative
setting), in one interleaved run.

    .venv/bin/python -m benchmarks.serve_sweep --plan out/plan.json --concurrency 1,2,4,8,16 \\
        [--requests 2] [--rounds 1] [--max-tokens 64] [--prompts FILE] [--stream-interval 1] \\
        [--temperature T --top-p P --top-k K --min-p M] \\
        [--methods hsd,hsd_batch1,hsd_plain,llama,llama_spec] \\
        [--llama-server PATH --gguf-f32 FILE --gguf-draft FILE --spec-n-max 8 --spec-p-min 0.5] \\
        [--retime PROFILE | --predict PROFILE] [--plot out.png] [--out benchmarks/results/serve_sweep.json]

Every server listens on 127.0.0.1 only and the run stops by itself (each level bounded by --timeout). At each
concurrency ``c`` (levels in order) the methods run one after the other, their order shifted by one from round to
round and from level to level (over as many rounds as methods, each method runs once in each place at each level:
what runs before a method, llama.cpp's server for one, changes its figures). Before each method's level the sweep
waits ``--settle`` seconds and sends one 8-token request (not measured: a server idle while the others ran starts
from cold caches). Then ``c`` client threads each send ``--requests`` streamed greedy chat requests one after the
other (the suite's prompts in turn, ``--max-tokens`` new tokens each; with ``--temperature T [--top-p P]``
sampled, unseeded, as a client that leaves the OpenAI API's default temperature of 1 asks; ``--top-k K --min-p M``
send those filters to every server, so that llama.cpp's server, whose defaults are top-k 40 and min-p 0.05, and ours
sample the same distribution), all starting together.
The `hsd serve` processes start once and stay up (an idle one costs nothing; all three hold the model, so a large
model needs the memory of three); llama.cpp's server is started per level with ``--parallel c``.

- ``hsd``: ``hsd serve --plan PLAN --max-batch MAX`` (the plan's hierarchy per load level when it has ``by_load``;
  with ``--retime PROFILE``, chosen again at start at the speed of the moment, as ``hsd serve --retime`` does).
  Every ``hsd*`` server runs with the sweep's ``--stream-interval``.
- ``hsd_batch1``: the same plan with ``--max-batch 1``: one request at a time (as before batching).
- ``hsd_plain``: the plan's target alone (a copy of the plan with its hierarchy ``[target]`` and no ``by_load``),
  ``--max-batch MAX``: batched decoding without speculation.
- ``hsd_base``: ``hsd`` run by another checkout's code (``--baseline DIR``, e.g. a ``git worktree`` of an earlier
  commit; its ``python -m hsd_opt`` imports that directory's package): the code before a change, interleaved with
  it.
- ``llama``: ``llama-server -m F32 --parallel c -t THREADS -c CTX`` (continuous batching, no speculation).
- ``llama_spec``: the same with ``-md DRAFT --spec-type draft-simple --spec-draft-n-max N --spec-draft-p-min P``.

With ``--rounds N`` the levels are swept N times (in turn, then reversed), and the report adds the median of each
method and level over the rounds (the plot draws the medians). Reported per method and level: aggregate tokens/s
(every completion token over the wall time from the first request to the last answer), time to the first token p50/p95
(seconds), tokens/s per stream (p50), and for the ``hsd*`` methods whether every answer equals the plan's own
``HSD.generate`` on the prompt (greedy: the target's tokens) and, for ``hsd``, the plan's predicted aggregate at that
load (``by_load``, the level's hierarchy) next to the measured decode aggregate (the mean of each stream's tokens but
its first, which comes with its prompt's pass, over its decode seconds, times ``c``). With ``--predict PROFILE`` every
``hsd*`` level is also predicted whole, prompts and ramps included (``hsd_opt.measure.load_predictor``, as ``hsd bench
--concurrency --retime`` predicts it): the engines the method's server runs are timed in this process right before its
level (the server idle) and right after it, and the report adds ``predicted_run_tokens_per_s`` and
``measured_over_predicted`` (what HTTP, the server's text decoding and streaming add shows there). Where the kernel
reports it (``/proc/stat`` on Linux), each method's level also records the share of the machine's CPU time the
hypervisor gave to others while it ran (``steal_fraction``, 0 to 1): a level run in a spell of high steal is slow for
reasons outside the method (a low share does not prove the opposite: the cores can run slow without any time being
stolen). Each level also records ``client_cpu_seconds``: the CPU time the client threads (this process) used while it
ran, time the server did not have on a machine whose cores serve both (the benchmark's own cost, the same kind for
every method).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.entry import count, counts, fraction, nonnegative, run, seconds, whole
from benchmarks.server_load import pct, run_clients, start, stream_once
from benchmarks.server_load import stop_server as stop
from hsd_opt.engine.variants import host
from hsd_opt.errors import HsdError

REPO = Path(__file__).resolve().parents[1]

HSD_METHODS = ("hsd", "hsd_batch1", "hsd_plain", "hsd_base")
LLAMA_METHODS = ("llama", "llama_spec")


def cpu_ticks() -> tuple[int, int] | None:
    """(stolen, total) CPU ticks of the whole machine so far (``/proc/stat``), or None where it is unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def steal_between(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of CPU ticks stolen between two :func:`cpu_ticks` readings (None if either is missing)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_level(url: str, model: str, prompts: list[str], clients: int, requests: int, max_tokens: int,
               timeout: float, temperature: float = 0.0, top_p: float = 1.0, extra: dict | None = None) -> dict:
    """``clients`` threads x ``requests`` streamed requests each, started together (``extra``: fields every request
    adds, :func:`stream_once`); the figures of the level."""
    from openai import OpenAI

    results: list[tuple[int, dict]] = []
    errors: list[str] = []

    def worker(i: int, c):
        for k in range(requests):
            j = (i * requests + k) % len(prompts)
            try:
                results.append((j, stream_once(c, model, "chat", prompts[j], max_tokens, temperature, top_p,
                                               extra)))
            except Exception as e:  # noqa: BLE001 - reported
                errors.append(repr(e)[:300])

    wall, cpu = run_clients(clients, lambda i: OpenAI(base_url=url, api_key="none", max_retries=0, timeout=timeout),
                            worker, timeout)
    rs = [r for _, r in results]
    tokens = sum(r["tokens"] for r in rs)
    per_stream = [r["tokens"] / r["total"] for r in rs if r["total"] > 0]
    # a stream's first token is read from its prompt's pass, before its decode clock starts: not counted
    decode = [(r["tokens"] - 1) / r["decode_seconds"] for r in rs if r.get("decode_seconds") and r["tokens"] > 1]
    return {"clients": clients, "requests": len(rs), "errors": errors, "wall_seconds": wall, "client_cpu_seconds": cpu,
            "aggregate_tokens_per_s": tokens / wall if wall > 0 else None, "tokens": tokens,
            "ttft_p50": pct([r["ttft"] for r in rs], 50), "ttft_p95": pct([r["ttft"] for r in rs], 95),
            "per_stream_tokens_per_s_p50": pct(per_stream, 50),
            "decode_aggregate_tokens_per_s": clients * sum(decode) / len(decode) if decode else None,
            "answers": [(j, r["token_ids"]) for j, r in results]}


def warm_up(url: str, model: str, prompt: str) -> None:
    """One short request before a method's measured level: a server idle while the others ran starts from cold
    caches, whichever method ran before it."""
    from openai import OpenAI

    stream_once(OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120), model, "chat", prompt, 8)


def served_name(url: str) -> str:
    """The id of the model a server serves (``GET /v1/models``)."""
    import httpx

    return httpx.get(url + "/models", timeout=60).json()["data"][0]["id"]


def in_process(plan_path: str, prompts: list[str]) -> dict:
    """The plan in this process: the prompts' ids, and per ``hsd*`` method what its server runs (hierarchies,
    sequences decoded together at most: ``None`` for the sweep's ``--max-batch``)."""
    from hsd_opt.formats import load_plan
    from hsd_opt.models.loading import load_model
    from hsd_opt.prompts import encode_prompt
    from hsd_opt.runtime.runner import PlanModels, hsd_by_load, hsd_for_plan

    plan = load_plan(plan_path)
    loaded = load_model(plan.provenance.model, device="cpu", dtype=plan.provenance.dtype or "auto")
    models = PlanModels(loaded)
    h = hsd_for_plan(plan, loaded, source=plan_path, models=models)
    levels = hsd_by_load(plan, loaded, models, source=plan_path, plan_runner=h) or h
    target = hsd_for_plan(plan, loaded, source=plan_path, hierarchy=[plan.hierarchy[-1]], budgets=[], models=models)
    return {"plan": h, "ids": [encode_prompt(loaded.tokenizer, p) for p in prompts],
            "runs": {"hsd": (levels, None), "hsd_batch1": (levels, 1), "hsd_plain": (target, None),
                 "hsd_base": (levels, None)},
            "head": target.levels[-1].engine.prompt_head}


def references(ours: dict, max_tokens: int) -> list[list[int]]:
    """The plan's own greedy answers (``HSD.generate``, as ``hsd run``), prompt by prompt, in this process."""
    return [ours["plan"].generate(ids, max_tokens).token_ids for ids in ours["ids"]]


def plain_plan(plan_path: str, out: Path) -> Path:
    """A copy of the plan whose hierarchy is its target alone, without load levels (plain batched decoding)."""
    d = json.loads(Path(plan_path).read_text())
    d["hierarchy"], d["budgets"] = [d["hierarchy"][-1]], []
    d.pop("by_load", None)
    d.pop("by_task", None)
    out.write_text(json.dumps(d))
    return out


def predicted(plan_path: str, clients: int) -> tuple[float | None, list[str] | None]:
    """The plan's predicted aggregate tokens/s at ``clients`` sequences (the load level the server runs there,
    :func:`~hsd_opt.formats.nearest_level`; None for a plan without load levels)."""
    from hsd_opt.formats import load_plan, nearest_level

    plan = load_plan(plan_path)
    if not plan.by_load:
        return None, None
    e = plan.by_load[nearest_level(plan.by_load, clients)]
    return clients / e.expected_latency, e.hierarchy


def medians(methods: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Per method and number of clients, the median over rounds of the aggregate tokens/s, the time to the first
    token p50/p95 and the tokens/s per stream."""
    import statistics

    out = {}
    keys = ("aggregate_tokens_per_s", "ttft_p50", "ttft_p95", "per_stream_tokens_per_s_p50",
            "decode_aggregate_tokens_per_s", "predicted_aggregate_tokens_per_s", "predicted_run_tokens_per_s",
            "measured_over_predicted")
    for m, rows in methods.items():
        out[m] = []
        for c in sorted({r["clients"] for r in rows}):
            at = [r for r in rows if r["clients"] == c]
            med = {k: statistics.median(r[k] for r in at) for k in keys if all(r.get(k) is not None for r in at)}
            out[m].append({"clients": c, "rounds": len(at), **med,
                           **({"equal_to_plan": all(r["equal_to_plan"] for r in at)} if "equal_to_plan" in at[0]
                              else {})})
    return out


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m, rows in report.get("median", report["methods"]).items():
        xs = [r["clients"] for r in rows]
        ax.plot(xs, [r["aggregate_tokens_per_s"] for r in rows], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title(f"{report['model']}: {report['max_tokens']} new tokens per request, {report['threads']} threads")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--concurrency", type=counts, default="1,2,4,8,16")
    ap.add_argument("--requests", type=count, default=2, help="requests per client, one after the other")
    ap.add_argument("--rounds", type=count, default=1, help="sweeps over the levels (in turn, then reversed)")
    ap.add_argument("--max-tokens", type=count, default=64)
    ap.add_argument("--temperature", type=nonnegative, default=0.0,
                    help="> 0: every request samples (unseeded), and answers are not compared with the plan's")
    ap.add_argument("--top-p", type=fraction, default=1.0)
    ap.add_argument("--top-k", type=whole, default=None,
                    help="sent as top_k to every server (llama.cpp's default is 40; absent: each server's own)")
    ap.add_argument("--min-p", type=fraction, default=None,
                    help="sent as min_p to every server (llama.cpp's default is 0.05; absent: each server's own)")
    ap.add_argument("--prompts", default=None, help="prompt file (default: the suite)")
    ap.add_argument("--methods", default="hsd,hsd_batch1,hsd_plain")
    ap.add_argument("--max-batch", type=count, default=16)
    ap.add_argument("--retime", default=None, help="the plan's profile: hsd serve --retime for the hsd method")
    ap.add_argument("--predict", default=None,
                    help="the plan's profile: predict every hsd* level whole, re-timed in this process around it")
    ap.add_argument("--threads", type=count, default=2)
    ap.add_argument("--stream-interval", type=count, default=1, help="hsd serve --stream-interval of every hsd* server")
    ap.add_argument("--baseline", help="another checkout of hsd-opt (a git worktree of an earlier commit): method "
                                       "hsd_base serves the plan with its code")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--gguf-f32", default=None)
    ap.add_argument("--gguf-draft", default=None)
    ap.add_argument("--spec-n-max", type=count, default=8)
    ap.add_argument("--spec-p-min", type=fraction, default=0.5)
    ap.add_argument("--ctx", type=whole, default=16384, help="llama-server -c (split between its slots)")
    ap.add_argument("--timeout", type=seconds, default=900.0)
    ap.add_argument("--settle", type=nonnegative, default=2.0,
                    help="seconds of quiet before each method's level (after the previous one's server stopped)")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "serve_sweep.json"))
    a = ap.parse_args()

    from hsd_opt.jsonio import write_json
    from hsd_opt.prompts import load_prompts

    levels = a.concurrency
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in HSD_METHODS + LLAMA_METHODS]
    if bad:
        raise HsdError(f"--methods: unknown {bad}; known: {', '.join(HSD_METHODS + LLAMA_METHODS)}")
    if ("hsd_base" in methods) != bool(a.baseline):
        raise HsdError("--methods hsd_base and --baseline DIR go together")
    if any(m in LLAMA_METHODS for m in methods) and not (a.llama_server and a.gguf_f32):
        raise HsdError("--methods llama*: give --llama-server and --gguf-f32 (and --gguf-draft for llama_spec)")
    prompts = load_prompts(a.prompts).texts
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    refs, predictor = [], None
    if a.predict and a.retime:
        raise HsdError("--predict: not with --retime (the served hsd would choose its hierarchies again; the "
                       "prediction prices the plan's)")
    if any(m in HSD_METHODS for m in methods):
        print("references (the plan's own answers, one prompt at a time) ...", flush=True)
        ours = in_process(a.plan, prompts)
        refs = references(ours, a.max_tokens)
        if a.predict:
            from hsd_opt.formats import load_profile
            from hsd_opt.measure.load_predictor import LoadPredictor

            text = [t for ids in ours["ids"][:8] for t in ids]
            predictor = LoadPredictor(load_profile(a.predict)[0], text, head=ours["head"])
            lengths = {j: len(ids) for j, ids in enumerate(refs)}
    tmp = Path(tempfile.mkdtemp(prefix="hsd-sweep-"))
    env = {"PYTHONUNBUFFERED": "1", "COLUMNS": "200", "OMP_NUM_THREADS": str(a.threads)}
    servers = {}
    hsd_args = {"hsd": (a.plan, a.max_batch, ["--retime", a.retime] if a.retime else []), "hsd_batch1": (a.plan, 1, []),
                "hsd_plain": (str(plain_plan(a.plan, tmp / "plain.json")), a.max_batch, []),
                "hsd_base": (str(Path(a.plan).resolve()), a.max_batch, [])}
    try:
        for m in methods:
            if m in HSD_METHODS:
                plan, mb, extra = hsd_args[m]
                servers[m] = start([sys.executable, "-m", "hsd_opt", "serve", "--plan", plan, "--host", "127.0.0.1",
                                    "--port", "0", "--max-batch", str(mb), "--max-queue", "64", "--device", "cpu",
                                    "--stream-interval", str(a.stream_interval), *extra],
                                   r"ready: .* at (http://\S+/v1)", a.timeout, env,
                                   cwd=a.baseline if m == "hsd_base" else None)
        report = {"started": started, "model": "smollm2-135m", "plan": a.plan, "retime": a.retime,
                  "max_tokens": a.max_tokens, "temperature": a.temperature, "top_p": a.top_p,
                  "top_k": a.top_k, "min_p": a.min_p,
                  "requests_per_client": a.requests, "threads": a.threads, "max_batch": a.max_batch,
                  "stream_interval": a.stream_interval,
                  "host": host(), "cpu_count": os.cpu_count(),
                  "methods": {m: [] for m in methods}}
        filters = {k: v for k, v in (("top_k", a.top_k), ("min_p", a.min_p)) if v is not None} or None
        runs = [(r, c) for r in range(a.rounds) for c in (levels if r % 2 == 0 else list(reversed(levels)))]
        for rnd, c in runs:
            # the order shifts by one per round at every level, so that over len(methods) rounds each method runs
            # once in each place at each level (a shift by the run's index aliases: with 2 levels and 4 methods
            # a level's runs are all even, and one method always followed llama.cpp's server at one level)
            k = (rnd + levels.index(c)) % len(methods)
            order = methods[k:] + methods[:k]
            for m in order:
                proc = None
                if m in HSD_METHODS:
                    url = servers[m][1]
                else:
                    port = free_port()
                    cmd = [a.llama_server, "-m", a.gguf_f32, "--host", "127.0.0.1", "--port", str(port),
                           "--parallel", str(c), "-t", str(a.threads), "-c", str(a.ctx), "--no-webui"]
                    if m == "llama_spec":
                        cmd += ["-md", a.gguf_draft, "--spec-type", "draft-simple", "--spec-draft-n-max",
                                str(a.spec_n_max), "--spec-draft-p-min", str(a.spec_p_min), "-td", str(a.threads)]
                    proc, _, _ = start(cmd, r"(listening on http|server is listening)", a.timeout)
                    url = f"http://127.0.0.1:{port}/v1"
                timed = predictor is not None and m in HSD_METHODS
                if timed:
                    h, mb = ours["runs"][m]
                    mb = a.max_batch if mb is None else mb
                try:
                    name = served_name(url)
                    time.sleep(a.settle)        # the previous method's processes gone, the cores quiet
                    if timed:
                        predictor.retime(h, mb)
                    warm_up(url, name, prompts[0])
                    ticks = cpu_ticks()
                    r = load_level(url, name, prompts, c, a.requests, a.max_tokens, a.timeout, a.temperature,
                                   a.top_p, filters)
                    r["steal_fraction"] = steal_between(ticks, cpu_ticks())
                    if timed:
                        r.update(predictor.after(h, mb, predictor.jobs(ours["ids"], lengths, c, a.requests),
                                                 r["aggregate_tokens_per_s"]))
                finally:
                    if proc is not None:
                        stop(proc)
                if m in HSD_METHODS and a.temperature == 0:
                    r["equal_to_plan"] = all(ids == refs[j] for j, ids in r["answers"])
                if m == "hsd":
                    r["predicted_aggregate_tokens_per_s"], r["load_hierarchy"] = predicted(a.plan, c)
                r.pop("answers")
                r["round"] = rnd + 1
                report["methods"][m].append(r)
                print(f"round {rnd + 1} c={c:2d} {m:10s} {r['aggregate_tokens_per_s']:7.1f} tok/s  ttft p50 "
                      f"{r['ttft_p50'] or float('nan'):.2f} s p95 {r['ttft_p95'] or float('nan'):.2f} s"
                      + (f"  equal {r['equal_to_plan']}" if "equal_to_plan" in r else "")
                      + (f"  predicted {r['predicted_aggregate_tokens_per_s']:.1f}, decode "
                         f"{r['decode_aggregate_tokens_per_s']:.1f}" if r.get("predicted_aggregate_tokens_per_s")
                         else "")
                      + (f"  predicted whole {r['predicted_run_tokens_per_s']:.1f}"
                         if r.get("predicted_run_tokens_per_s") else "")
                      + f"  clients' cpu {r['client_cpu_seconds']:.2f} s"
                      + (f"  steal {r['steal_fraction']:.0%}" if r["steal_fraction"] else "")
                      + (f"  errors {len(r['errors'])}" if r["errors"] else ""), flush=True)
                write_json(a.out, report)
    finally:
        for proc, _, _ in servers.values():
            stop(proc)
    report["ended"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    report["median"] = medians(report["methods"])
    write_json(a.out, report)
    for m, rows in report["median"].items():
        print(m, "  ".join(f"c={r['clients']}: {r['aggregate_tokens_per_s']:.1f} tok/s, ttft p50 {r['ttft_p50']:.2f} s"
                           for r in rows))
    if a.plot:
        plot(report, a.plot)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    run(main)
