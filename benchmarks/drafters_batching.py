"""Where does batching stop being free on this machine? (N-Grammys paper, arXiv 2411.03786, Sec. 3)

Times one target forward on an input block of ``k`` rows x ``(w + 1)`` new tokens after a KV cache of
``l`` context tokens (the cache repeated to ``k`` rows), relative to ``(k, w) = (1, 0)``, i.e. plain greedy
decoding. On a GPU the block is memory bound (flat) up to a point; on this 2-core CPU it is not.

Usage: .venv/bin/python -m benchmarks.drafters_batching [--ctx 256] [--k 1 2 4 8 16] [--w 0 1 3 7]
Writes benchmarks/results/drafters_batching.json. Model: the embedded SmolLM2-135M-Instruct (``HSD_SMOL``: another
alias, folder or .gguf file), recorded in the JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.drafters_common import RESULTS, SMOL, load_model, machine_load, target_forward_seconds
from benchmarks.entry import count, positive, run, whole
from hsd_opt.jsonio import write_json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=count, nargs="+", default=[256])
    ap.add_argument("--k", type=count, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--w", type=whole, nargs="+", default=[0, 1, 3, 7])
    ap.add_argument("--reps", type=count, default=3)
    ap.add_argument("--threads", type=whole, default=0,
                    help="torch threads (0: torch default); 1 is far more stable when the machine is oversubscribed")
    ap.add_argument("--free", type=positive, default=1.25, help="slowdown still counted as 'free'")
    ap.add_argument("--out", default=str(RESULTS / "drafters_batching.json"))
    a = ap.parse_args()
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    model, tok = load_model()
    res = {"model": SMOL,
           "stat": f"min of {a.reps} after 1 warm-up", "free_threshold": a.free, "load_before": machine_load(),
           "grid": []}
    t_start = time.time()
    for l in a.ctx:
        base = None
        for k in a.k:
            for w in a.w:
                s = target_forward_seconds(model, l, k=k, new_tokens=w + 1, reps=a.reps)
                if (k, w) == (1, 0) or base is None:
                    base = base or s
                row = {"ctx": l, "k": k, "w": w, "tokens": k * (w + 1), "seconds": s, "slowdown": s / base}
                res["grid"].append(row)
                print(json.dumps(row), flush=True)
    frontier = {}
    for l in a.ctx:
        cells = [r for r in res["grid"] if r["ctx"] == l]
        free = [r for r in cells if r["slowdown"] <= a.free]
        frontier[str(l)] = {"max_free_tokens": max((r["tokens"] for r in free), default=1),
                            "free_cells": [[r["k"], r["w"]] for r in free]}
    res["free_frontier"] = frontier
    res["load_after"] = machine_load()
    res["wall_seconds"] = time.time() - t_start
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(a.out, res, indent=1)
    print(json.dumps(frontier, indent=1))


if __name__ == "__main__":
    run(main)
