"""The latency model at each load level against the batch scheduler, in one process: predicted aggregate tokens/s
(a plan's ``by_load``, re-timed at the machine's speed of the moment) against the measured steady-state aggregate
of ``B`` sequences decoded together, and every greedy answer against the target's own.

    .venv/bin/python -m benchmarks.load_levels --plan out/plan.json --profile out/profile.json \\
        [--levels 1,2,4,8,16] [--rounds 2] [--max-new-tokens 64] [--max-wait SECONDS] [--clock-repeats 15] \
        [--out benchmarks/results/load_levels.json]

Per round and level ``B`` (levels in turn, the order reversed every other round): every engine of the plan's
hierarchies is timed for one decode step (:class:`~hsd_opt.measure.retime.StepClock`, as ``hsd bench --retime``
does), then ``--per-level`` x ``B`` suite prompts (their chat template; the next ones each round) are decoded by
:class:`~hsd_opt.runtime.batch.Batch` with the plan of every load level, ``B`` at a time (the others wait and
join as sequences end), ``--max-new-tokens`` each.

- measured: tokens committed over the seconds of the ticks in which all ``B`` places were decoding (so no prompt
  was prefilled: the steady state the model describes), and over the whole run (prefills and the tail
  included);
- predicted: ``B`` over the level's hierarchy's seconds per token (:func:`~hsd_opt.solver.batch.at_batch` of the
  profile) at the run's mean context (prompt plus half the generated tokens), with the profile's costs as they
  are and re-timed twice: every engine's costs scaled by its step over its profiled step (one sequence), and by
  its batched pass of ``B`` sequences over the profile's cost of that pass (``StepClock(batch=B)``), each timed
  just before and just after the level and averaged;
- every answer equal to the plan's target alone on that prompt (``HSD.generate``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.entry import count, counts, run, whole
from hsd_opt.errors import HsdError

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--levels", type=counts, default="1,2,4,8,16")
    ap.add_argument("--rounds", type=count, default=2)
    ap.add_argument("--max-new-tokens", type=count, default=64)
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--max-wait", type=whole, default=None,
                    help="the scheduler's max_wait (ticks; default: the batch's own, a round's draft passes)")
    ap.add_argument("--per-level", type=count, default=3, help="prompts per level, as a multiple of B: more than B "
                                                             "wait and join as others end")
    ap.add_argument("--clock-repeats", type=count, default=15, help="timed steps per engine per re-timing")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "load_levels.json"))
    a = ap.parse_args()

    import torch

    from hsd_opt.formats import load_plan, load_profile, nearest_level
    from hsd_opt.jsonio import write_json
    from hsd_opt.measure.retime import StepClock, scale_costs
    from hsd_opt.models.loading import load_model
    from hsd_opt.prompts import encode_prompt, load_prompts
    from hsd_opt.runtime.batch import Batch
    from hsd_opt.runtime.runner import PlanModels, hsd_by_load, hsd_for_plan
    from hsd_opt.solver.api import evaluate
    from hsd_opt.solver.batch import at_batch

    plan = load_plan(a.plan)
    profile, _ = load_profile(a.profile)
    loaded = load_model(plan.provenance.model, device="cpu", dtype=plan.provenance.dtype or "auto")
    models = PlanModels(loaded)
    levels = hsd_by_load(plan, loaded, models)
    if not levels:
        raise HsdError(f"--plan: {a.plan} has no plans per load level (solve with --batch-sizes)")
    ar = hsd_for_plan(plan, loaded, hierarchy=[plan.hierarchy[-1]], budgets=[], models=models)
    texts = load_prompts(a.prompts).texts
    ids = [encode_prompt(loaded.tokenizer, t) for t in texts]
    text = [t for x in ids for t in x]
    clock = StepClock(profile, list(levels.values()), repeats=a.clock_repeats, text=text)
    want: dict[int, list[int]] = {}
    sizes = a.levels
    level_of = {b: nearest_level(plan.by_load, b) for b in sizes}      # the level the scheduler runs there
    at_load = {b: StepClock(profile, [levels[level_of[b]]], repeats=a.clock_repeats, text=text, batch=b)
               for b in sizes}
    rows = []
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    nxt = 0
    for r in range(a.rounds):
        for b in (sizes if r % 2 == 0 else list(reversed(sizes))):
            speed_before, load_before = clock.measure(), at_load[b].measure()
            picks = [(nxt + k) % len(ids) for k in range(b * a.per_level)]
            nxt += len(picks)
            for j in picks:
                if j not in want:
                    want[j] = ar.generate(ids[j], a.max_new_tokens).token_ids
            batch = Batch(levels, max_active=b, max_wait=a.max_wait)
            got: dict[int, list[int]] = {}
            committed = [0]
            for k, j in enumerate(picks):
                def on_tokens(toks, committed=committed):
                    committed[0] += len(toks)
                batch.add(ids[j], a.max_new_tokens, on_tokens=on_tokens,
                          on_done=lambda res, err, k=k: got.__setitem__(k, res.token_ids if err is None else None))
            steady_s = steady_tokens = 0.0
            t_all = time.perf_counter()
            while batch.busy:
                full = len(batch.active) == b           # every place taken: no prefill in this tick
                before, t0 = committed[0], time.perf_counter()
                batch.tick()
                if full:
                    steady_s += time.perf_counter() - t0
                    steady_tokens += committed[0] - before
            whole_s = time.perf_counter() - t_all
            speed_after, load_after = clock.measure(), at_load[b].measure()  # before and after, averaged
            factors = {k: (speed_before[k] + speed_after[k]) / 2 for k in speed_before}
            load_factors = {k: (load_before[k] + load_after[k]) / 2 for k in load_before}
            tokens = sum(len(got[k]) for k in got if got[k] is not None)
            ctx = statistics.mean(len(ids[j]) for j in picks) + a.max_new_tokens / 2
            e = plan.by_load[level_of[b]]
            at = at_batch(profile, b)
            pred = b / evaluate(at, e.hierarchy, e.budgets, context=ctx)
            pred_rt = b / evaluate(at_batch(scale_costs(profile, factors), b), e.hierarchy, e.budgets, context=ctx)
            pred_load = b / evaluate(scale_costs(at, load_factors), e.hierarchy, e.budgets, context=ctx)
            meas = steady_tokens / steady_s if steady_s > 0 else None
            row = {"round": r + 1, "sequences": b, "hierarchy": e.hierarchy, "budgets": e.budgets,
                   "context": ctx, "predicted_tokens_per_s": pred, "retimed_tokens_per_s": pred_rt,
                   "retimed_at_load_tokens_per_s": pred_load,
                   "measured_steady_tokens_per_s": meas, "steady_seconds": steady_s,
                   "measured_whole_tokens_per_s": tokens / whole_s, "retimed_over_measured":
                   pred_rt / meas if meas else None, "retimed_at_load_over_measured":
                   pred_load / meas if meas else None, "factors": factors, "factors_at_load": load_factors,
                   "equal_to_target": all(got[k] == want[j] for k, j in enumerate(picks))}
            rows.append(row)
            print(f"round {r + 1} B={b:2d} {' <- '.join(reversed(e.hierarchy)):32s} predicted {pred:6.1f} "
                  f"re-timed {pred_rt:6.1f} (at the load {pred_load:6.1f}) measured {meas or float('nan'):6.1f} "
                  f"tok/s (whole run {tokens / whole_s:6.1f}) equal {row['equal_to_target']}", flush=True)
            write_json(a.out, {"started": started, "plan": a.plan, "profile": a.profile,
                               "max_new_tokens": a.max_new_tokens, "torch_threads": torch.get_num_threads(),
                               "rows": rows})
    summary: dict[str, dict[int, float | None]] = {}
    for key in ("retimed_over_measured", "retimed_at_load_over_measured"):
        summary[key + "_median"] = {}
        for b in sizes:
            rs = [x[key] for x in rows if x["sequences"] == b and x[key]]
            summary[key + "_median"][b] = statistics.median(rs) if rs else None
    write_json(a.out, {"started": started, "ended": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "plan": a.plan, "profile": a.profile, "max_new_tokens": a.max_new_tokens,
                       "torch_threads": torch.get_num_threads(), **summary, "rows": rows})
    print(json.dumps(summary))


if __name__ == "__main__":
    run(main)
