"""The kept prompt head against computing every prompt whole, in one process: the suite's chat prompts decoded by
the batch scheduler, ``--active`` at a time, with the engines keeping the chat template's head (as every command
runs) and with no head (each prompt computed from its first token), interleaved round by round.

    .venv/bin/python -m benchmarks.prompt_head --plan out/plan.json [--prompts-used 16] [--active 8] \\
        [--max-new-tokens 64] [--rounds 4] [--out benchmarks/results/prompt_head.json]

Reported per round and setting: aggregate tokens/s over the whole run (prefills included), the prompt seconds
summed over the sequences (each prompt's prefill, the other sequences' passes in between included), and whether
every answer equals the plan's own answer without the head (greedy: the target's tokens either way).
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.entry import count, run
from hsd_opt.errors import HsdError

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--prompts", default=None, help="prompt file (default: the suite)")
    ap.add_argument("--prompts-used", type=count, default=16)
    ap.add_argument("--active", type=count, default=8, help="sequences decoded together")
    ap.add_argument("--max-new-tokens", type=count, default=64)
    ap.add_argument("--rounds", type=count, default=4)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "prompt_head.json"))
    a = ap.parse_args()

    import torch

    from hsd_opt.formats import load_plan
    from hsd_opt.jsonio import write_json
    from hsd_opt.models.loading import load_model
    from hsd_opt.prompts import encode_prompt, load_prompts
    from hsd_opt.runtime.batch import generate_many
    from hsd_opt.runtime.runner import PlanModels, hsd_by_load, hsd_for_plan

    plan = load_plan(a.plan)
    loaded = load_model(plan.provenance.model, device="cpu", dtype=plan.provenance.dtype or "auto")
    models = PlanModels(loaded)
    levels = hsd_by_load(plan, loaded, models) or hsd_for_plan(plan, loaded, models=models)
    engines = {id(e): e for h in (levels.values() if isinstance(levels, dict) else [levels]) for e in h.engines}
    heads = {k: e.prompt_head for k, e in engines.items()}
    if not any(heads.values()):
        raise HsdError(f"--plan: the model of {a.plan} has no chat-template head to keep")
    ids = [encode_prompt(loaded.tokenizer, t) for t in load_prompts(a.prompts).texts[:a.prompts_used]]

    def run(keep: bool) -> tuple[float, float, list[list[int]]]:
        for k, e in engines.items():
            e.prompt_head = heads[k] if keep else ()
        t0 = time.perf_counter()
        out = generate_many(levels, ids, a.max_new_tokens, max_active=a.active)
        dt = time.perf_counter() - t0
        return (sum(len(o.token_ids) for o in out) / dt, sum(o.stats["prefill_seconds"] for o in out),
                [o.token_ids for o in out])

    want = run(False)[2]                          # also the warm-up
    rows = []
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    for r in range(a.rounds):
        for keep in ((True, False) if r % 2 == 0 else (False, True)):
            tps, prompt_s, answers = run(keep)
            rows.append({"round": r + 1, "kept_head": keep, "aggregate_tokens_per_s": tps,
                         "prompt_seconds_summed": prompt_s, "equal": answers == want})
            print(f"round {r + 1} {'kept head' if keep else 'no head  '}: {tps:6.1f} tok/s, prompt seconds summed "
                  f"{prompt_s:5.2f}, answers equal {answers == want}", flush=True)
    ratios = [next(x for x in rows if x["round"] == r and x["kept_head"])["aggregate_tokens_per_s"]
              / next(x for x in rows if x["round"] == r and not x["kept_head"])["aggregate_tokens_per_s"]
              for r in range(1, a.rounds + 1)]
    report = {"started": started, "ended": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "plan": a.plan, "prompts": len(ids), "active": a.active, "max_new_tokens": a.max_new_tokens,
              "head_tokens": max(len(h) for h in heads.values()), "torch_threads": torch.get_num_threads(),
              "kept_over_none": ratios, "kept_over_none_median": statistics.median(ratios), "rows": rows}
    write_json(a.out, report)
    print(f"kept head over no head, per round: {', '.join(f'{x:.2f}' for x in ratios)}")


if __name__ == "__main__":
    run(main)
