"""ADED's MCTS cost per call vs its iteration count, against the target's forward time (ADED, arXiv 2407.12021).

1. The target (the embedded SmolLM2-135M-Instruct, or ``HSD_SMOL``) greedily generates 64 tokens for the first 3 prompts
   of every task of data/prompts.jsonl (cached in /tmp/hsdbench).
2. Two folds: the tri-gram matrix is built from the prompts + generations of one half of the suite (the
   default ADED corpus: text the target itself generates) and evaluated on the other half, so no continuation
   is in its own matrix.
3. For each iteration count, greedy speculative decoding with ADED as the only drafter (w = 4) is simulated
   teacher-forced (benchmarks/drafters_common.py): tokens per target call, first-token acceptance, and the
   MCTS wall time per call.
4. The target's one-token forward (KV cache of 256) and its 5-token verify forward are timed; the iteration
   count whose MCTS time equals the one-token forward is interpolated. The other learning-free drafters are
   reported on the same folds for comparison, per task.

Usage: .venv/bin/python -m benchmarks.drafters_aded [--iters 1 5 10 25 50 100 150 300] [--w 4]
Writes benchmarks/results/drafters_aded.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from benchmarks.drafters_common import (
    RESULTS,
    SMOL,
    greedy_generations,
    load_model,
    machine_load,
    simulate_greedy,
    summarize,
    target_forward_seconds,
)
from benchmarks.entry import count, run, whole
from hsd_opt.drafters.aded import AdedDrafter, TrigramMatrix
from hsd_opt.drafters.bigram import BigramDrafter, BigramTable
from hsd_opt.drafters.mixed import MixedNgramDrafter
from hsd_opt.drafters.ngram import ContextNgramDrafter
from hsd_opt.jsonio import write_json


def folds(gens):
    even = [g for i, g in enumerate(gens) if i % 2 == 0]
    odd = [g for i, g in enumerate(gens) if i % 2 == 1]
    return [(even, odd), (odd, even)]


def run_drafter(make, gens, w, k=1):
    """make(train) -> drafter; returns (summary over all eval prompts, per-task summaries)."""
    runs, by_task = [], {}
    for train, test in folds(gens):
        for g in test:
            d = make(train)
            r = simulate_greedy(d, g["prompt_ids"], g["gen_ids"], w, k)
            runs.append(r)
            by_task.setdefault(g["task"], []).append(r)
    return summarize(runs), {t: summarize(v) for t, v in by_task.items()}


def matrix_of(train, threshold):
    return TrigramMatrix.from_sequences([g["prompt_ids"] + g["gen_ids"] for g in train], threshold=threshold)


def run_sweep(a, model, gens, res):
    """Target timings + ADED iteration sweep into ``res``; returns (one-token s, verify s)."""
    c1 = target_forward_seconds(model, 256, 1, 1, reps=7)
    cv = target_forward_seconds(model, 256, 1, a.w + 1, reps=7)
    res["target_forward_ms"] = {"one_token_ctx256": 1e3 * c1, f"verify_{a.w + 1}_tokens_ctx256": 1e3 * cv}
    print(json.dumps(res), flush=True)
    m0 = matrix_of(folds(gens)[0][0], a.threshold)
    res["matrix_fold0"] = m0.meta

    def speedup(s):  # greedy, one draft row: tokens per call over (verify forward + drafting)
        return s["tokens_per_call"] * c1 / (cv + s["draft_ms_per_call"] / 1e3)

    sweep = []
    for it in a.iters:
        s, _ = run_drafter(lambda train: AdedDrafter(matrix_of(train, a.threshold), iterations=it), gens, a.w)
        s["iterations"] = it
        s["estimated_speedup"] = speedup(s)
        sweep.append(s)
        print(json.dumps(s), flush=True)
    res["aded_sweep"] = sweep
    its = np.array([s["iterations"] for s in sweep], float)
    ms = np.array([s["draft_ms_per_call"] for s in sweep])
    slope, icpt = np.polyfit(its, ms, 1)
    res["mcts_ms_fit"] = {"ms_per_iteration": slope, "ms_fixed": icpt}
    res["balance_iterations"] = (1e3 * c1 - icpt) / slope if slope > 0 else None
    res["balance_note"] = ("iteration count at which one MCTS call costs as much as one target forward "
                           "(one token, KV cache of 256), from a linear fit of MCTS ms per call vs iterations")
    return c1, cv



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=count, nargs="+", default=[1, 5, 10, 25, 50, 100, 150, 300])
    ap.add_argument("--w", type=count, default=4)
    ap.add_argument("--threshold", type=whole, default=2)
    ap.add_argument("--max-new-tokens", type=count, default=64)
    ap.add_argument("--per-task", type=whole, default=3, help="prompts per task of data/prompts.jsonl (0: all)")
    ap.add_argument("--bigram-table", default=None, help="default: the table of drafters_bigram_build.json")
    ap.add_argument("--out", default=str(RESULTS / "drafters_aded.json"))
    ap.add_argument("--drafters-only", action="store_true",
                    help="keep the target timings and the sweep of an existing --out, redo the drafter comparison")
    a = ap.parse_args()
    t_start = time.time()
    model, tok = load_model()
    gens = greedy_generations(model, tok, a.max_new_tokens, per_task=a.per_task or None)
    res = {"model": SMOL,
           "w": a.w, "threshold": a.threshold, "prompts": len(gens),
           "generated_tokens": sum(len(g["gen_ids"]) for g in gens), "load_before": machine_load()}
    if a.drafters_only and Path(a.out).exists():
        old = json.loads(Path(a.out).read_text())
        old.update({k: v for k, v in res.items() if k != "load_before"})
        res = old
        c1 = res["target_forward_ms"]["one_token_ctx256"] / 1e3
        cv = res["target_forward_ms"][f"verify_{a.w + 1}_tokens_ctx256"] / 1e3
    else:
        c1, cv = run_sweep(a, model, gens, res)

    def speedup(s):  # greedy, one draft row: tokens per call over (verify forward + drafting)
        return s["tokens_per_call"] * c1 / (cv + s["draft_ms_per_call"] / 1e3)

    table_file = a.bigram_table
    if table_file is None:
        bj = RESULTS / "drafters_bigram_build.json"
        if bj.exists():
            table_file = json.loads(bj.read_text()).get("table")
    others = {
        "ngram_q2": lambda train: ContextNgramDrafter(q=2),
        "ngram_q3": lambda train: ContextNgramDrafter(q=3),
        "aded_150": lambda train: AdedDrafter(matrix_of(train, a.threshold)),
        "aded_150_no_adapt": lambda train: AdedDrafter(matrix_of(train, a.threshold), adapt=False),
    }
    if table_file and Path(table_file).exists():
        table = BigramTable.load(table_file)
        others["bigram"] = lambda train: BigramDrafter(table)
        others["mixed_k1"] = lambda train: MixedNgramDrafter(ContextNgramDrafter(q=1), BigramDrafter(table))
        res["bigram_table"] = table_file
    res["drafters"] = {}
    for name, make in others.items():
        s, per_task = run_drafter(make, gens, a.w)
        s["estimated_speedup"] = speedup(s)
        res["drafters"][name] = {"all": s, "by_task": per_task}
        print(name, json.dumps(s), flush=True)
    res["load_after"] = machine_load()
    res["wall_seconds"] = time.time() - t_start
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(a.out, res, indent=1)


if __name__ == "__main__":
    run(main)
