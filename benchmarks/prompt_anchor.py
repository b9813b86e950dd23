"""A prompt's processing against llama.cpp's on the same GGUF file, in one run: `llama-bench`'s prompt test
interleaved with our target's prefill of prompts of the same lengths, so that both see the same spell of a shared
machine; with ``--decode N``, also decoding at those depths.

    .venv/bin/python -m benchmarks.prompt_anchor --plan out/plan.json \
        --llama-bench <llama.cpp>/build/bin/llama-bench --gguf <the plan's GGUF file> \
        [--lengths 128,512,1024] [--rounds 3] [--reps 3] [--threads 2] [--decode N] \
        [--out benchmarks/results/prompt_anchor.json]

Each round runs `llama-bench -t THREADS -p L1,L2,.. -n 0 -r REPS` (its prompt test: L token ids in one batch of its
default size, the last position's logits), then ours, then `llama-bench` again. Ours: the plan's target alone (the
float32 model, or the quantized copy a plan made for `--target-precision int4` runs) generates one token after L
token ids of the shipped suite's text (no chat template: llama-bench's prompts are ids too), through the runtime
(`HSD.generate`: the prompt in the passes `hsd run` computes it in, then the head at its last position), REPS
times; reported per length: L over the median wall seconds of those generations (the time to the first token), the
median of llama.cpp's two runs, and ours over llama.cpp. The report is written after every round.

``--decode N`` adds a decode test at each length as depth: `llama-bench -p 0 -n N -d L1,L2,..` (N tokens decoded
one at a time after L tokens of context, the context's processing not timed), run in the same two places of each
round, and ours: the target alone generates N tokens greedily after the same L ids (or fewer, where it ends the
text), REPS times; reported: its tokens after the first (read from the prompt's pass) over its decode seconds
(prefill excluded), the median over the reps.
Every step at depth L reads the keys and values of L positions: the test compares the attention's cost as the
context grows, beside the weights' (the same at every depth).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.entry import count, run, whole
from hsd_opt.engine.variants import host


def parse_lengths(text: str) -> list[int]:
    """``"128,512"`` -> ``[128, 512]``; anything but positive integers raises ValueError naming ``--lengths``."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--lengths: {text!r} is not a comma-separated list of positive token counts")
    return [int(p) for p in parts]


def prompt_rates(bench_json: str, lengths: list[int]) -> dict[int, float]:
    """Tokens/s of `llama-bench -o json`'s prompt tests (rows with ``n_prompt`` > 0 and ``n_gen`` 0), by prompt
    length; a length of ``lengths`` without a row raises ValueError naming it."""
    rows = {int(r["n_prompt"]): float(r["avg_ts"]) for r in json.loads(bench_json)
            if r.get("n_prompt") and not r.get("n_gen")}
    missing = [n for n in lengths if n not in rows]
    if missing:
        raise ValueError(f"llama-bench printed no prompt test of {missing} tokens")
    return {n: rows[n] for n in lengths}


def decode_rates(bench_json: str, depths: list[int], n_gen: int) -> dict[int, float]:
    """Tokens/s of `llama-bench -o json`'s decode tests of ``n_gen`` tokens (rows with ``n_prompt`` 0) by depth
    (``n_depth``: the context before them); a depth of ``depths`` without a row raises ValueError naming it."""
    rows = {int(r.get("n_depth") or 0): float(r["avg_ts"]) for r in json.loads(bench_json)
            if not r.get("n_prompt") and int(r.get("n_gen") or 0) == n_gen}
    missing = [n for n in depths if n not in rows]
    if missing:
        raise ValueError(f"llama-bench printed no decode test of {n_gen} tokens at depth {missing}")
    return {n: rows[n] for n in depths}


def _llama_bench(cmd: list[str], parse):
    """Run `llama-bench` (``cmd``) and ``parse`` its JSON output; SystemExit naming the command on any failure."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"llama-bench did not finish within an hour ({' '.join(cmd)})") from None
    if res.returncode != 0:
        raise SystemExit(f"llama-bench failed ({' '.join(cmd)}): {res.stderr.strip()[-500:]}")
    try:
        return parse(res.stdout)
    except (ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"llama-bench's output ({' '.join(cmd)}): {e}") from None


def llama_decode(binary: str, gguf: str, threads: int, depths: list[int], n_gen: int, reps: int) -> dict[int, float]:
    """`llama-bench`'s decode tests at depths (``-p 0 -n n_gen -d depths``): tokens/s by depth (mean of ``reps``)."""
    cmd = [binary, "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(n_gen), "-d", ",".join(map(str, depths)),
           "-r", str(reps), "-o", "json"]
    return _llama_bench(cmd, lambda out: decode_rates(out, depths, n_gen))


def llama_prompt(binary: str, gguf: str, threads: int, lengths: list[int], reps: int) -> dict[int, float]:
    """`llama-bench`'s prompt tests (``-p lengths -n 0``): tokens/s by length (the mean over ``reps`` runs)."""
    cmd = [binary, "-m", gguf, "-t", str(threads), "-p", ",".join(map(str, lengths)), "-n", "0", "-r", str(reps),
           "-o", "json"]
    return _llama_bench(cmd, lambda out: prompt_rates(out, lengths))


def ours_seconds(runner, ids: list[int], reps: int) -> tuple[float, int]:
    """The median wall seconds over ``reps`` greedy generations of one token after ``ids`` (prefill and the first
    token), and that token (the same every time)."""
    times, firsts = [], set()
    for _ in range(reps):
        res = runner.generate(ids, max_new_tokens=1)
        times.append(res.stats["seconds"])
        firsts.add(res.token_ids[0])
    if len(firsts) != 1:
        raise SystemExit(f"the first token after {len(ids)} ids changed between runs: {sorted(firsts)}")
    return statistics.median(times), firsts.pop()


def ours_decode(runner, ids: list[int], n_gen: int, reps: int) -> tuple[float, int]:
    """The median over ``reps`` greedy generations of ``n_gen`` tokens after ``ids`` of their decoded tokens over
    their decode seconds (prefill excluded), and the tokens generated (the same every time). The first token is read
    from the prompt's pass, so the tokens that took a decode pass are one fewer than those generated (llama-bench's
    decode test pays a pass for every token it counts)."""
    rates, counts = [], set()
    for _ in range(reps):
        res = runner.generate(ids, max_new_tokens=n_gen)
        if res.stats["tokens"] < 2:
            raise SystemExit(f"the greedy generation after {len(ids)} ids ended after {res.stats['tokens']} token: "
                             f"no decode pass to time")
        rates.append((res.stats["tokens"] - 1) / res.stats["decode_seconds"])
        counts.add(res.stats["tokens"])
    if len(counts) != 1:
        raise SystemExit(f"the greedy generation after {len(ids)} ids changed length between runs: {sorted(counts)}")
    return statistics.median(rates), counts.pop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", required=True, help="the plan whose target (and target precision) to run")
    ap.add_argument("--llama-bench", required=True, help="a llama-bench binary (llama.cpp)")
    ap.add_argument("--gguf", required=True, help="the GGUF file the plan's model was loaded from")
    ap.add_argument("--lengths", default="128,512,1024", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--rounds", type=count, default=3)
    ap.add_argument("--reps", type=count, default=3, help="runs per length and round, each side")
    ap.add_argument("--threads", type=count, default=2)
    ap.add_argument("--decode", type=whole, default=0, metavar="N",
                    help="also decode N tokens at each length as depth (0: prompts only)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "prompt_anchor.json"))
    a = ap.parse_args()
    try:
        lengths = parse_lengths(a.lengths)
    except ValueError as e:
        ap.error(str(e))
    if not os.path.isfile(a.gguf):
        ap.error(f"--gguf: no file at {a.gguf}")
    if not os.access(a.llama_bench, os.X_OK):
        ap.error(f"--llama-bench: {a.llama_bench} is not an executable")

    import torch

    from hsd_opt.commands.common import load_plan_and_model
    from hsd_opt.jsonio import write_json
    from hsd_opt.prompts import encode_prompt, load_prompts, text_of_length
    from hsd_opt.runtime.plan_checks import plan_target_precision
    from hsd_opt.runtime.runner import hsd_for_plan

    torch.set_num_threads(a.threads)
    plan, loaded = load_plan_and_model(Path(a.plan), None, "cpu", None)
    runner = hsd_for_plan(plan, loaded, hierarchy=[plan.hierarchy[-1]], budgets=[], source=a.plan)
    stream = [t for p in load_prompts().texts for t in encode_prompt(loaded.tokenizer, p, raw=True)]
    prompts = {n: text_of_length(stream, n) for n in lengths}
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    ours_seconds(runner, prompts[lengths[0]], 1)  # warm-up (llama-bench warms up too)
    rounds = []
    for r in range(a.rounds):
        log(f"round {r + 1}/{a.rounds}: llama-bench ...")
        before = llama_prompt(a.llama_bench, a.gguf, a.threads, lengths, a.reps)
        dec_before = llama_decode(a.llama_bench, a.gguf, a.threads, lengths, a.decode, a.reps) if a.decode else {}
        ours = {n: ours_seconds(runner, prompts[n], a.reps) for n in lengths}
        ours_dec = {n: ours_decode(runner, prompts[n], a.decode, a.reps) for n in lengths} if a.decode else {}
        after = llama_prompt(a.llama_bench, a.gguf, a.threads, lengths, a.reps)
        dec_after = llama_decode(a.llama_bench, a.gguf, a.threads, lengths, a.decode, a.reps) if a.decode else {}
        rows = {}
        for n in lengths:
            llama = statistics.median([before[n], after[n]])
            mine = n / ours[n][0]
            rows[str(n)] = {"llama_cpp_tok_s": llama, "llama_cpp_before": before[n], "llama_cpp_after": after[n],
                            "ours_tok_s": mine, "ours_seconds": ours[n][0], "first_token": ours[n][1],
                            "ours_vs_llama_cpp": mine / llama}
            log(f"  {n:5d} tokens: llama.cpp {llama:8.1f} tok/s, ours {mine:8.1f} ({mine / llama:.2f}x)")
            if a.decode:
                ld, (od, got) = statistics.median([dec_before[n], dec_after[n]]), ours_dec[n]
                rows[str(n)]["decode"] = {"llama_cpp_tok_s": ld, "llama_cpp_before": dec_before[n],
                                          "llama_cpp_after": dec_after[n], "ours_tok_s": od, "ours_tokens": got,
                                          "ours_vs_llama_cpp": od / ld}
                log(f"  decode at depth {n}: llama.cpp {ld:7.1f} tok/s, ours {od:7.1f} ({od / ld:.2f}x, {got} tokens)")
        rounds.append(rows)
        write_json(a.out, {
            "what": "a prompt's processing against llama.cpp's on the same GGUF (benchmarks/prompt_anchor.py)",
            "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
            "machine": {"platform": platform.platform(), "host": host(), "threads": a.threads},
            "plan": a.plan, "model": loaded.model_id, "gguf": os.path.basename(a.gguf), "target": plan.hierarchy[-1],
            "target_precision": plan_target_precision(plan, a.plan), "lengths": lengths, "reps": a.reps,
            "decode_tokens": a.decode, "rounds": rounds}, indent=1)
    print("\nprompt tok/s per round: llama.cpp / ours (ours x llama.cpp)")
    for n in lengths:
        cells = [f"{rd[str(n)]['llama_cpp_tok_s']:.1f} / {rd[str(n)]['ours_tok_s']:.1f} "
                 f"({rd[str(n)]['ours_vs_llama_cpp']:.2f}x)" for rd in rounds]
        print(f"{n:5d} tokens: " + "   ".join(cells))
    if a.decode:
        print(f"\ndecode tok/s of {a.decode} tokens at depth, per round: llama.cpp / ours (ours x llama.cpp)")
        for n in lengths:
            cells = [f"{rd[str(n)]['decode']['llama_cpp_tok_s']:.1f} / {rd[str(n)]['decode']['ours_tok_s']:.1f} "
                     f"({rd[str(n)]['decode']['ours_vs_llama_cpp']:.2f}x)" for rd in rounds]
            print(f"{n:5d} deep:   " + "   ".join(cells))
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    run(main)
