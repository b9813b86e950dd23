"""A/B of the exact greedy head screen's position limit in HSD generation: the same plan, prompts and process,
with ``hsd_opt.engine.screen.MAX_POSITIONS`` switched per generation between two values (interleaved, the order
alternating per prompt), so the ratio is taken under the same machine conditions.

    .venv/bin/python -m benchmarks.screen_positions --plan out/plan.json [--limit 24] [--max-new-tokens 64]
        [--old 2] [--new 10] [--out benchmarks/results/screen_positions.json]

Reports tokens/s (decode only and with prefill) per setting and checks that every output is the same under both
(the screen is exact, so it must be).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks.entry import count, run, whole


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--prompts", default=None, help="default: the project's suite")
    ap.add_argument("--limit", type=count, default=24)
    ap.add_argument("--max-new-tokens", type=count, default=64)
    ap.add_argument("--old", type=whole, default=2)
    ap.add_argument("--new", type=whole, default=10)
    ap.add_argument("--threads", type=count, default=2)
    ap.add_argument("--out", default="benchmarks/results/screen_positions.json")
    a = ap.parse_args()

    import torch

    from hsd_opt.engine import screen
    from hsd_opt.formats import load_plan
    from hsd_opt.jsonio import write_json
    from hsd_opt.models.loading import load_model
    from hsd_opt.prompts import conversation_ids, load_prompts
    from hsd_opt.runtime.runner import hsd_for_plan

    torch.set_num_threads(a.threads)
    plan = load_plan(a.plan)
    prov = plan.provenance
    print(f"loading {prov.model} ...", file=sys.stderr)
    loaded = load_model(prov.model, device="cpu", dtype=prov.dtype or "float32")
    items = list(load_prompts(a.prompts).items)[: a.limit]
    h = hsd_for_plan(plan, loaded, source=a.plan)
    ids0 = conversation_ids(loaded.tokenizer, items[0].turns, [], False)
    h.generate(ids0, 8)
    settings = {"old": a.old, "new": a.new}
    rows = {k: {"tokens": 0, "seconds": 0.0, "decode_seconds": 0.0, "per_prompt": []} for k in settings}
    same = True
    for i, it in enumerate(items):
        ids = conversation_ids(loaded.tokenizer, it.turns, [], False)
        order = list(settings) if i % 2 == 0 else list(settings)[::-1]
        outs = {}
        for k in order:
            screen.MAX_POSITIONS = settings[k]
            res = h.generate(ids, a.max_new_tokens)
            outs[k] = res.token_ids
            r = rows[k]
            r["tokens"] += len(res.token_ids)
            r["seconds"] += res.stats["seconds"]
            r["decode_seconds"] += res.stats["decode_seconds"]
            r["per_prompt"].append(len(res.token_ids) / res.stats["decode_seconds"])
        same &= outs["old"] == outs["new"]
        print(f"prompt {i + 1}/{len(items)}: decode tok/s old {rows['old']['per_prompt'][-1]:.1f}, "
              f"new {rows['new']['per_prompt'][-1]:.1f}", file=sys.stderr)
    report = {"what": "greedy screen position limit, A/B in one process (benchmarks/screen_positions.py)",
              "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), "plan": a.plan,
              "hierarchy": list(plan.hierarchy), "budgets": list(plan.budgets), "settings": settings,
              "outputs_equal": same, "threads": a.threads}
    for k, r in rows.items():
        report[k] = {"tokens": r["tokens"], "tokens_per_s": r["tokens"] / r["seconds"],
                     "decode_tokens_per_s": r["tokens"] / r["decode_seconds"],
                     "median_prompt_decode_tokens_per_s": statistics.median(r["per_prompt"])}
    report["new_over_old_decode"] = report["new"]["decode_tokens_per_s"] / report["old"]["decode_tokens_per_s"]
    write_json(a.out, report, indent=1)
    for k in settings:
        print(f"MAX_POSITIONS={settings[k]}: {report[k]['decode_tokens_per_s']:.2f} decode tok/s, "
              f"{report[k]['tokens_per_s']:.2f} tok/s with prefill")
    print(f"new / old (decode): {report['new_over_old_decode']:.3f}; outputs equal: {same}; wrote {a.out}")


if __name__ == "__main__":
    run(main)
