"""A/B of two checkouts of hsd-opt in one interleaved run: our AR, the int4 copy's decode step and a plan's
decoding, each timed by the same script against the code of each tree, rounds alternating between the trees.

    .venv/bin/python -m benchmarks.engine_ab --baseline DIR [--plan PLAN] [--rounds 6] [--prompts 4]
        [--new 64] [--batch 8] [--out benchmarks/results/engine_ab.json]

``--baseline`` is another checkout (e.g. ``git worktree add /tmp/base <commit>``); the tree this script lives in is
the candidate. Each round runs one worker process per tree (the trees' packages cannot share a process), the
order alternating between rounds, so a slow spell of a shared machine hits both alike; every figure is a median
over rounds and the ratios are candidate / baseline (below 1: faster). The worker also returns the greedy tokens
of every prompt, which must be equal between the trees and between AR, the plan and the batch (lossless), and the
work the engines did (``work``: calls of ``advance``/``advance_many`` and the layer-positions they computed, over the
whole worker): where both trees did the same work (``same_work_in_both_trees``), a ratio away from 1 is the machine's
drift or the code's speed at the same work, never more or fewer passes.

- ``ar_ms_per_token``: the target alone (``hsd_for_plan`` with the target's level), decode seconds per token.
- ``plan_ms_per_token``: the plan's hierarchy, decode seconds per token.
- ``int4_step_ms``: the int4 copy of the target, one decode step (append, advance, greedy id) at 64 tokens of
  context, median of 32 steps.
- ``batch_tokens_per_s`` (``--batch B``, 0: not run): B suite prompts decoded together by the plan's hierarchy
  (``generate_many``: the batch the server runs), every new token over the wall seconds, prompts included; above 1
  in the ratio is faster. Each of the first ``--prompts`` answers must equal the plan's answer decoded alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.entry import run
from hsd_opt.engine.variants import host
from hsd_opt.errors import HsdError

try:
    from benchmarks.entry import count, whole
except ImportError:  # the worker in a baseline tree older than them (its flags are the checked ones of main)
    count = whole = int

HERE = Path(__file__).resolve().parents[1]
DEFAULT_PLAN = HERE / "tests" / "data" / "runtime_bench_lookup_plan.json"   # the embedded model's lookup <- int4


def count_work(cls) -> dict[str, int]:
    """Count, from now on, the outermost calls of ``cls.advance`` and ``cls.advance_many`` (an engine class) and the
    layer-positions they return: ``{"calls", "layer_positions"}``, updated in place."""
    work, depth = {"calls": 0, "layer_positions": 0}, [0]

    def counted(fn, many: bool):
        def call(self, *args, **kwargs):
            depth[0] += 1
            try:
                out = fn(self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                work["calls"] += 1
                work["layer_positions"] += int(sum(out) if many else out)
            return out
        return call

    cls.advance, cls.advance_many = counted(cls.advance, False), counted(cls.advance_many, True)
    return work


def worker(plan_path: str, n_prompts: int, new: int, batch: int = 0) -> dict:
    """One round's figures for the package importable here (the tree on ``PYTHONPATH``)."""
    import torch

    from hsd_opt.engine.layered import LayeredLM
    from hsd_opt.engine.quantized import QuantizedLM
    from hsd_opt.formats import load_plan
    from hsd_opt.models.loading import load_model
    from hsd_opt.prompts import encode_prompt, load_prompts
    from hsd_opt.runtime.batch import generate_many
    from hsd_opt.runtime.runner import hsd_for_plan

    work = count_work(LayeredLM)
    plan = load_plan(plan_path)
    loaded = load_model("smollm2-135m", device="cpu", dtype="float32")
    texts = load_prompts().texts
    prompts = [encode_prompt(loaded.tokenizer, t) for t in texts[:max(n_prompts, batch)]]
    out: dict = {"tokens": {}, "work": work}
    ar = hsd_for_plan(plan, loaded, hierarchy=[plan.hierarchy[-1]], budgets=[])
    hsd = hsd_for_plan(plan, loaded)
    for name, runner in (("ar", ar), ("plan", hsd)):
        runner.generate(prompts[0], 8)                                    # warm-up
        secs = toks = 0
        for i, p in enumerate(prompts[:n_prompts]):
            res = runner.generate(p, new)
            secs += res.stats["decode_seconds"]
            toks += res.stats["tokens"]
            out["tokens"][f"{name}:{i}"] = res.token_ids
        out[f"{name}_ms_per_token"] = 1e3 * secs / toks
    if batch:
        generate_many(hsd, prompts[:2], 8)                                # warm-up
        t0 = time.perf_counter()
        results = generate_many(hsd, prompts[:batch], new, max_active=batch)
        out["batch_tokens_per_s"] = sum(len(r.token_ids) for r in results) / (time.perf_counter() - t0)
        for i, r in enumerate(results[:n_prompts]):
            out["tokens"][f"batch:{i}"] = r.token_ids
    q4 = QuantizedLM(loaded.model, bits=4)
    ids = torch.tensor(prompts[0][:64] + [5] * max(0, 64 - len(prompts[0])))
    st = q4.new_state(160)
    q4.append(st, ids)
    q4.advance(st, q4.n_layers)
    tok = q4.greedy_ids(st, q4.n_layers, 63, 64)
    steps = []
    for _ in range(40):
        t0 = time.perf_counter()
        q4.append(st, tok)
        q4.advance(st, q4.n_layers)
        tok = q4.greedy_ids(st, q4.n_layers, st.n - 1, st.n)
        steps.append(time.perf_counter() - t0)
    out["int4_step_ms"] = 1e3 * statistics.median(steps[8:])
    return out


FIGURES = ("ar_ms_per_token", "plan_ms_per_token", "int4_step_ms", "batch_tokens_per_s")


def figures(batch: int) -> tuple[str, ...]:
    """The figures a run reports (``batch_tokens_per_s`` only with ``--batch``)."""
    return FIGURES if batch else FIGURES[:-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="the other checkout (its repository root)")
    ap.add_argument("--plan", default=str(DEFAULT_PLAN))
    ap.add_argument("--rounds", type=count, default=6)
    ap.add_argument("--prompts", type=count, default=4, help="suite prompts per round")
    ap.add_argument("--new", type=count, default=64, help="new tokens per prompt")
    ap.add_argument("--batch", type=whole, default=8, help="prompts decoded together (0: none)")
    ap.add_argument("--out", default=str(HERE / "benchmarks" / "results" / "engine_ab.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.plan, a.prompts, a.new, a.batch)))
        return
    if not a.baseline or not (Path(a.baseline) / "hsd_opt").is_dir():
        raise HsdError(f"--baseline: expected a checkout of hsd-opt (a folder with hsd_opt/), got {a.baseline!r}")
    trees = {"baseline": str(Path(a.baseline).resolve()), "candidate": str(HERE)}
    a.plan = str(Path(a.plan).resolve())                 # the workers run in the trees' folders
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    started = time.strftime("%Y-%m-%d %H:%M")
    for r in range(a.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            env = dict(os.environ, PYTHONPATH=trees[name])
            res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", "--plan", a.plan,
                                  "--prompts", str(a.prompts), "--new", str(a.new), "--batch", str(a.batch)],
                                 cwd=trees[name], env=env,
                                 capture_output=True, text=True)
            if res.returncode != 0:
                sys.exit(f"{name} worker failed:\n{res.stderr[-3000:]}")
            runs[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {name:9s} " + "  ".join(f"{f} {runs[name][-1][f]:.2f}" for f in figures(a.batch)),
                  flush=True)
    med = {k: {f: statistics.median(x[f] for x in v) for f in figures(a.batch)} for k, v in runs.items()}
    ratio = {f: med["candidate"][f] / med["baseline"][f] for f in figures(a.batch)}
    per_round = {f: [c[f] / b[f] for b, c in zip(runs["baseline"], runs["candidate"])] for f in figures(a.batch)}
    base_tokens = runs["baseline"][0]["tokens"]
    same = all(x["tokens"] == base_tokens for v in runs.values() for x in v)
    lossless = all(t == base_tokens[k.replace("plan:", "ar:").replace("batch:", "ar:")]
                   for k, t in base_tokens.items())
    same_work = all(x["work"] == runs["baseline"][0]["work"] for v in runs.values() for x in v)
    report = {"started": started, "host": host(), "trees": trees,
              "plan": a.plan, "rounds": a.rounds, "prompts": a.prompts, "new_tokens": a.new, "median": med,
              "candidate_over_baseline": ratio, "per_round": per_round, "same_tokens_in_both_trees": same,
              "plan_equals_ar": lossless, "same_work_in_both_trees": same_work,
              "work": {k: v[0]["work"] for k, v in runs.items()}, "batch": a.batch,
              "runs": {k: [{f: x[f] for f in figures(a.batch)} for x in v] for k, v in runs.items()}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    from hsd_opt.jsonio import write_json  # here: the worker may run in a baseline tree without it

    write_json(a.out, report, indent=1)
    print(json.dumps({"median": med, "candidate_over_baseline": ratio, "same_tokens_in_both_trees": same,
                      "plan_equals_ar": lossless, "same_work_in_both_trees": same_work,
                      "work": report["work"]}, indent=1))


if __name__ == "__main__":
    run(main)
