"""Time the one-off model-bigram table build (N-Grammys paper, arXiv 2411.03786, Sec. 4.1) for the embedded model.

Usage: .venv/bin/python -m benchmarks.drafters_bigram_build [--model smollm2-135m] [--top-k 16] [--batch-size 256]
Writes benchmarks/results/drafters_bigram_build.json and the table into $HSD_CACHE (or --cache-dir).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from benchmarks.entry import count, run, whole
from hsd_opt.drafters.bigram import build_bigram_table, model_fingerprint, table_path
from hsd_opt.engine.variants import host
from hsd_opt.jsonio import write_json


def bos_flag(text: str) -> str | int | None:
    """``--bos``: ``'auto'`` (the config's BOS), ``'none'`` (None) or a token id (0 or more)."""
    if text in ("auto", "none"):
        return None if text == "none" else text
    try:
        return whole(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected 'auto', 'none' or a token id >= 0, got {text!r}") from None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m", help="an alias, a directory or a .gguf file")
    ap.add_argument("--top-k", type=count, default=16)
    ap.add_argument("--batch-size", type=count, default=256)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--rows", type=count, default=None, help="build only this many rows (probe)")
    ap.add_argument("--bos", type=bos_flag, default="auto", help="'auto' (config BOS), an id, or 'none'")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "drafters_bigram_build.json"))
    a = ap.parse_args()
    from benchmarks.drafters_common import load_model

    model, _ = load_model(a.model)
    h = model_fingerprint(model)
    t0 = time.perf_counter()
    load = os.getloadavg()
    table = build_bigram_table(model, top_k=a.top_k, batch_size=a.batch_size, vocab_size=a.rows, bos_id=a.bos)
    secs = time.perf_counter() - t0
    table.meta["model_hash"] = h
    res = {"model": a.model, "model_hash": h, "rows": table.vocab_size, "top_k": a.top_k,
           "batch_size": a.batch_size, "seconds": secs, "rows_per_second": table.vocab_size / secs,
           "bos_id": table.meta["bos_id"], "torch_threads": torch.get_num_threads(),
           "host": host(), "loadavg_before": load, "loadavg_after": os.getloadavg()}
    if a.rows is None:
        path = table.save(table_path(a.cache_dir, h, a.top_k, table.meta["bos_id"]))
        res["table"] = str(path)
        res["table_bytes"] = os.path.getsize(path)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        write_json(a.out, res, indent=2)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    run(main)
