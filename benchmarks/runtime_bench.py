"""Runtime benchmark: `hsd bench` on the embedded SmolLM2-135M with a solved plan, plus extra
hierarchies from the same plan's pool (its ranked alternatives), written to benchmarks/results/.

    .venv/bin/python -m benchmarks.runtime_bench --plan plan.json --limit 4 --max-new-tokens 32 [--alternatives 2]

Writes runtime_bench.json (the `hsd bench` report + the machine's load), runtime_bench.png and prints a markdown
table. Timings on a shared 2-core machine are noisy: compare ratios from one run (methods interleave per prompt).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

from benchmarks.entry import count, counts, run, whole
from hsd_opt.jsonio import write_json


def hierarchy_flag(text: str) -> tuple[str, list[str], list[int]]:
    """``--hierarchy NAME=m0,m1,...,target:T0,T1,...`` -> ``(NAME, models, budgets)``; the budgets whole numbers of 1
    or more (none: no budgets)."""
    name, eq, rest = text.partition("=")
    if not eq or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=m0,m1,...,target:T0,T1,..., got {text!r}")
    h, _, b = rest.partition(":")
    return name, h.split(","), counts(b) if b else []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True)
    ap.add_argument("--prompts", default=str(Path(__file__).resolve().parents[1] / "data" / "prompts.jsonl"))
    ap.add_argument("--limit", type=count, default=4)
    ap.add_argument("--per-task", type=count, default=None, help="take the first N prompts of each task instead")
    ap.add_argument("--profile", default=None, help="hsd-profile/1 to predict latency of extra hierarchies")
    ap.add_argument("--max-new-tokens", type=count, default=32)
    ap.add_argument("--alternatives", type=whole, default=2, help="also run the plan's first N alternatives")
    ap.add_argument("--hierarchy", type=hierarchy_flag, action="append", default=[],
                    help="extra hierarchy NAME=m0,m1,...,target:T0,T1,... (repeatable)")
    ap.add_argument("--threads", type=whole, default=None, help="torch threads (default: 1 when the load is high)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "runtime_bench"),
                    help="the reports' path without its ending: writes OUT.json and OUT.png")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--methods", default=None, help="comma list, as hsd bench --methods (default: hsd bench's "
                    "default methods and hf_early_exit, the set the recorded results ran)")
    a = ap.parse_args()

    import torch

    from hsd_opt.formats import load_plan
    from hsd_opt.measure.bench import METHODS, default_methods, plot_report, run_bench
    from hsd_opt.models.loading import load_model
    from hsd_opt.prompts import load_prompts, select_items
    from hsd_opt.runtime.runner import check_provenance

    load = os.getloadavg()
    torch.set_num_threads(a.threads or (1 if load[0] > 2 else 2))
    plan = load_plan(a.plan)
    prov = plan.provenance
    loaded = load_model(prov.model or "smollm2-135m", device=a.device, dtype=prov.dtype or "auto")
    check_provenance(plan, loaded, a.plan)
    extra = {}
    for i, alt in enumerate(plan.alternatives[: a.alternatives], 2):
        extra[f"alt{i}"] = (alt.hierarchy, alt.budgets)
    for name, h, b in a.hierarchy:
        extra[name] = (h, b)
    rows = load_prompts(a.prompts).items
    rows = select_items(rows, per_task=a.per_task) if a.per_task else rows[: a.limit]
    t0 = time.time()
    methods = [m.strip() for m in a.methods.split(",")] if a.methods else \
        sorted({*default_methods(plan), "hf_early_exit"}, key=METHODS.index)
    rep = run_bench(plan, loaded, rows, a.max_new_tokens, methods=methods, extra=extra,
                    log=lambda s: print(s, flush=True))
    rep["wall_seconds"] = time.time() - t0
    rep["command"] = " ".join([".venv/bin/python", "benchmarks/runtime_bench.py"] + sys.argv[1:])
    rep["load_average_before"], rep["load_average_after"] = list(load), list(os.getloadavg())
    rep["platform"] = platform.platform()
    rep["cpus"] = os.cpu_count()
    for name, alt_plan in ((n, extra[n]) for n in extra):
        for alt in plan.alternatives:
            if (alt.hierarchy == list(alt_plan[0]) and alt.budgets == list(alt_plan[1])
                    and rep["methods"].get(name, {}).get("predicted_seconds_per_token") is None):
                rep["methods"][name]["predicted_seconds_per_token"] = alt.expected_latency
    if a.profile:
        from hsd_opt.solver import evaluate

        for name, (hh, bb) in extra.items():
            if rep["methods"].get(name, {}).get("predicted_seconds_per_token") is None and name in rep["methods"]:
                # at the run's mean context (the latency is linear in it between measured contexts)
                d = rep["methods"][name]
                d["predicted_seconds_per_token"] = evaluate(a.profile, hh, bb, context=d.get("mean_context"))
                if d.get("seconds_per_token"):
                    d["measured_over_predicted"] = d["seconds_per_token"] / d["predicted_seconds_per_token"]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(str(out) + ".json", rep, indent=2)
    plot_report(rep, str(out) + ".png")
    print(f"\n{rep['command']}\n")
    print("| method | hierarchy (budgets) | tokens/s | vs hf_ar | vs ar | tok/target call | ms/tok predicted | "
          "ms/tok measured | == greedy ref |")
    print("|---|---|---|---|---|---|---|---|---|")
    f = lambda x, s=".2f": "-" if x is None else format(x, s)  # noqa: E731
    for m, d in rep["methods"].items():
        if "error" in d:
            print(f"| {m} | error: {d['error'][:80]} | | | | | | | |")
            continue
        h = d.get("hierarchy")
        hs = (" <- ".join(reversed(h)) + f" ({d.get('budgets')})") if h else \
            (f"assistant_early_exit={d['assistant_early_exit']}" if "assistant_early_exit" in d else "HF")
        pr, me = d.get("predicted_seconds_per_token"), d.get("seconds_per_token")
        print(f"| {m} | {hs} | {f(d['tokens_per_s'])} | {f(d.get('speedup_vs_hf_ar'))} | {f(d.get('speedup_vs_ar'))} "
              f"| {f(d.get('tokens_per_target_call'))} | {f(pr and pr * 1e3, '.1f')} | {f(me and me * 1e3, '.1f')} "
              f"| {d.get('matches_reference')} |")
    print(f"\nhf_ar matches our AR reference: {rep['hf_ar_matches_reference']}; threads {rep['torch_threads']}, "
          f"load {rep['load_average_before']} -> {rep['load_average_after']}, {rep['wall_seconds']:.0f} s")


if __name__ == "__main__":
    run(main)
