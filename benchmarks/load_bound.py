"""How far a batched load level could go on this machine: one request at a time against plain batching, and the
rate the batched rows would need.

    .venv/bin/python -m benchmarks.load_bound --plan out/plan.json [--clients 8] [--requests 2] [--rounds 3] \\
        [--max-tokens 64] [--out benchmarks/results/load_bound_c8.json]

In one process, each round in turn: ``--clients`` closed-loop clients (``--requests`` greedy requests each, the
suite's prompts) served one request at a time (the plan per load level, ``--max-batch 1``) and then by plain
batching (the plan's target alone, every sequence in one pass); each level's prompt passes and decode passes timed
apart. Then the target's parts, interleaved: the layers and the greedy head of one decode step of ``--clients``
sequences (context 90), and the layers of one sequence's pass over 128 and over 256 new positions (a row of it
is the cheapest row these kernels compute: each weight read and decoded once for many rows).

The bound: the batched level with every decode row at that cheapest row's cost plus the head's cost per row, its
prompts as measured; its aggregate over the one-at-a-time level's. Units: seconds, tokens.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from pathlib import Path

import torch

from benchmarks.entry import count, run
from hsd_opt.formats import load_plan
from hsd_opt.jsonio import write_json
from hsd_opt.measure.load_bench import serve_clients
from hsd_opt.models.loading import load_model
from hsd_opt.prompts import encode_prompt, load_prompts, text_of_length
from hsd_opt.runtime import batch as batch_mod
from hsd_opt.runtime.runner import PlanModels, hsd_by_load, hsd_for_plan


def _timed_scheduler(acc: dict) -> None:
    """Time the batch scheduler's prompt passes and decode passes into ``acc``."""
    prefill, serve = batch_mod.Batch._prefill_pass, batch_mod.Batch._serve

    def timed_prefill(self, e):
        a = time.perf_counter()
        prefill(self, e)
        acc["prompts"] += time.perf_counter() - a

    def timed_serve(passes):
        a = time.perf_counter()
        out = serve(passes)
        acc["decode"] += time.perf_counter() - a
        acc["rows"] += sum(p.end - p.start for p in passes)
        acc["passes"] += 1
        return out

    batch_mod.Batch._prefill_pass = timed_prefill
    batch_mod.Batch._serve = staticmethod(timed_serve)


def _parts(eng, text: list[int], seqs: int, ctx: int = 90, repeats: int = 6) -> dict:
    """Median seconds of: ``seqs`` sequences' decode step (layers, then greedy head), one sequence's pass over 128
    and 256 positions (layers)."""
    L = eng.n_layers
    states = []
    for i in range(seqs):
        ids = torch.tensor(text_of_length(text[i * 37:] + text[:i * 37], ctx + 1))
        st = eng.new_state(ctx + 260)
        eng.append(st, ids[:ctx])
        eng.advance(st, L)
        states.append((st, ids[ctx:]))
    out = collections.defaultdict(list)
    for r in range(repeats + 1):
        for st, tok in states:
            eng.append(st, tok)
        a = time.perf_counter()
        eng.advance_many([(st, L) for st, _ in states])
        b = time.perf_counter()
        eng.greedy_ids_many([(st, L, st.n - 1, st.n) for st, _ in states])
        c = time.perf_counter()
        for st, _ in states:
            eng.crop(st, ctx)
        if r:
            out["step_layers"].append(b - a)
            out["step_head"].append(c - b)
        for n in (128, 256):
            st = states[0][0]
            eng.append(st, torch.tensor(text_of_length(text, n)))
            a = time.perf_counter()
            eng.advance(st, L)
            if r:
                out[f"pass{n}_layers"].append(time.perf_counter() - a)
            eng.crop(st, ctx)
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", required=True, type=Path)
    ap.add_argument("--clients", type=count, default=8)
    ap.add_argument("--requests", type=count, default=2)
    ap.add_argument("--rounds", type=count, default=3)
    ap.add_argument("--max-tokens", type=count, default=64)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    plan = load_plan(a.plan)
    loaded = load_model(plan.provenance.model, device="cpu", dtype="float32")
    models = PlanModels(loaded)
    runner = hsd_for_plan(plan, loaded, models=models)
    by_load = hsd_by_load(plan, loaded, models, plan_runner=runner) or runner
    target = hsd_for_plan(plan, loaded, hierarchy=[plan.hierarchy[-1]], budgets=[], models=models)
    prompts = [encode_prompt(loaded.tokenizer, t) for t in load_prompts().texts]
    text = [t for p in prompts for t in p]
    for h in (target, runner):
        h.generate(prompts[0], 4)
    acc: dict = collections.defaultdict(float)
    _timed_scheduler(acc)
    rounds = []
    for r in range(a.rounds):
        row: dict = {"round": r + 1}
        for name, h, mb in (("one_at_a_time", by_load, 1), ("plain", target, a.clients)):
            acc.clear()
            t0 = time.perf_counter()
            reqs = serve_clients(h, prompts, a.clients, a.requests, a.max_tokens, mb, start=r * a.clients * a.requests)
            wall = time.perf_counter() - t0
            tokens = sum(len(q.token_ids) for q in reqs)
            row[name] = {"wall_seconds": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
                         "prompt_seconds": acc["prompts"], "decode_seconds": acc["decode"],
                         "decode_rows": int(acc["rows"]), "decode_passes": int(acc["passes"])}
        parts = _parts(target.levels[-1].engine, text, a.clients)
        row["parts_seconds"] = parts
        one, plain = row["one_at_a_time"], row["plain"]
        cheapest = min(parts["pass128_layers"] / 128, parts["pass256_layers"] / 256)
        head = parts["step_head"] / a.clients
        bound = plain["prompt_seconds"] + plain["decode_rows"] * (cheapest + head)
        row["ratio"] = plain["tokens_per_s"] / one["tokens_per_s"]
        row["bound_wall_seconds"] = bound
        row["bound_ratio"] = plain["tokens"] / bound / one["tokens_per_s"]
        rounds.append(row)
        print(f"round {r + 1}: one at a time {one['tokens_per_s']:.1f} tok/s (prompts {one['prompt_seconds']:.2f} s), "
              f"plain x{a.clients} {plain['tokens_per_s']:.1f} (prompts {plain['prompt_seconds']:.2f} s, decode "
              f"{plain['decode_seconds']:.2f} s over {plain['decode_rows']} rows): {row['ratio']:.2f}x; a step of "
              f"{a.clients}: layers {1e3 * parts['step_layers']:.1f} ms, head {1e3 * parts['step_head']:.1f} ms; a row "
              f"of a 128 / 256-position pass {1e3 * parts['pass128_layers'] / 128:.2f} / "
              f"{1e3 * parts['pass256_layers'] / 256:.2f} ms; every decode row at {1e3 * (cheapest + head):.2f} ms: "
              f"{bound:.2f} s, {row['bound_ratio']:.2f}x", flush=True)
    if a.out:
        write_json(a.out, {"kind": "load_bound", "plan": str(a.plan), "clients": a.clients, "requests": a.requests,
                           "max_tokens": a.max_tokens, "rounds": rounds, "model": loaded.provenance()})


if __name__ == "__main__":
    run(main)
