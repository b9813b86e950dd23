"""Shared helpers of the drafter benchmarks: load the embedded model, greedy generations of the prompt suite,
and a teacher-forced simulation of greedy speculative decoding with a token drafter (no model calls needed:
under greedy decoding the target's continuation is fixed, so the accepted prefix of a draft is its longest
prefix equal to the target's own continuation, plus the target's next token)."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Sequence

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
#: The model the drafter benchmarks measure: ``HSD_SMOL`` (an alias, a directory or a .gguf file), else the
#: embedded SmolLM2-135M-Instruct.
SMOL = os.environ.get("HSD_SMOL", "smollm2-135m")


def load_model(path: str = SMOL):
    """``(model, tokenizer)`` of ``path`` (an alias, a directory or a .gguf file) in float32 on the CPU, loaded as
    ``hsd`` loads it; a name that does not load raises its one-line error (:func:`benchmarks.entry.run` prints it
    and exits 2)."""
    from hsd_opt.models.loading import load_model as load

    loaded = load(path, device="cpu", dtype="float32", flag="HSD_SMOL")
    return loaded.model.eval(), loaded.tokenizer


def prompts(path: Path = ROOT / "data" / "prompts.jsonl", per_task: int | None = None) -> list[dict]:
    """The prompt suite; ``per_task``: keep only the first that many prompts of every task."""
    ps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if per_task is None:
        return ps
    seen: dict[str, int] = {}
    out = []
    for p in ps:
        seen[p["task"]] = seen.get(p["task"], 0) + 1
        if seen[p["task"]] <= per_task:
            out.append(p)
    return out


def encode_prompt(tok, text: str) -> list[int]:
    """The chat-template ids of ``text`` (:func:`hsd_opt.prompts.encode_prompt`); bytes mod 512 without a
    tokenizer (the random stand-in model)."""
    if tok is None:
        return [int(b) % 512 for b in text.encode()][:64]
    from hsd_opt.prompts import encode_prompt as encode

    return encode(tok, text)


def greedy_generations(model, tok, max_new_tokens: int = 64, cache: Path | None = None,
                       threads: int | None = 1, per_task: int | None = 3) -> list[dict]:
    """``[{"task", "prompt_ids", "gen_ids"}]`` for every prompt of the suite (target greedy, KV cache).

    ``threads``: torch threads while generating (1 by default: far faster than 2 when other processes
    oversubscribe this 2-core machine); restored afterwards.
    """
    cache = cache or Path(os.environ.get("HSD_BENCH_TMP", "/tmp/hsdbench")) / f"gens-{max_new_tokens}-{per_task}.json"
    if cache.exists() and tok is not None:
        return json.loads(cache.read_text())
    out = []
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _generate_all(model, tok, max_new_tokens, cache, out, per_task)
    finally:
        torch.set_num_threads(old_threads)


def _generate_all(model, tok, max_new_tokens, cache, out, per_task):
    t0 = time.perf_counter()
    for i, p in enumerate(prompts(per_task=per_task)):
        ids = encode_prompt(tok, p["prompt"])
        with torch.inference_mode():
            g = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                               pad_token_id=getattr(model.config, "eos_token_id", 0) or 0)
        out.append({"task": p["task"], "prompt_ids": ids, "gen_ids": [int(t) for t in g[0, len(ids):]]})
        print(f"generated {i + 1} prompts, {time.perf_counter() - t0:.0f} s", flush=True)
    if tok is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(out))
    return out


def simulate_greedy(drafter, prompt_ids: Sequence[int], gen_ids: Sequence[int], w: int, k: int = 1) -> dict:
    """Greedy speculative decoding of ``gen_ids`` with ``drafter`` (teacher forced). Returns tokens/call,
    first-token agreement (= the greedy acceptance rate a[drafter][target]) and drafting seconds per call."""
    ctx = list(prompt_ids)
    gen = list(gen_ids)
    drafter.reset(ctx)
    t = calls = first_ok = 0
    draft_s = 0.0
    while t < len(gen):
        t0 = time.perf_counter()
        rows = drafter.propose_batch(ctx, k, w) if k > 1 else [drafter.propose(ctx, w)]
        draft_s += time.perf_counter() - t0
        best = 0
        for r in rows:
            m = 0
            while m < len(r) and t + m < len(gen) and r[m] == gen[t + m]:
                m += 1
            best = max(best, m)
        first_ok += int(any(r and r[0] == gen[t] for r in rows))
        acc = gen[t:t + best + 1]
        drafter.observe(ctx, acc)
        ctx.extend(acc)
        t += len(acc)
        calls += 1
    return {"tokens": len(gen), "calls": calls, "first_token_hits": first_ok, "draft_seconds": draft_s}


def summarize(runs: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in runs)
    calls = sum(r["calls"] for r in runs)
    return {"tokens_per_call": tokens / max(calls, 1),
            "first_token_acceptance": sum(r["first_token_hits"] for r in runs) / max(calls, 1),
            "draft_ms_per_call": 1e3 * sum(r["draft_seconds"] for r in runs) / max(calls, 1),
            "calls": calls, "tokens": tokens}


def time_call(fn, reps: int = 5, warmup: int = 1, stat: str = "min") -> float:
    """Wall seconds of ``fn()`` over ``reps`` runs: ``min`` (default; robust when other processes share the
    2 cores, each sample is only ever slowed down by contention) or ``median``."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts) if stat == "min" else statistics.median(ts)


def machine_load() -> dict:
    """Load averages and core count at measurement time (other processes share this machine)."""
    la = os.getloadavg()
    return {"loadavg_1m": la[0], "loadavg_5m": la[1], "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}


def target_forward_seconds(model, context_len: int, k: int = 1, new_tokens: int = 1, reps: int = 5) -> float:
    """Min-of-reps seconds of one target forward on ``[k, new_tokens]`` tokens after a KV cache of ``context_len``."""
    from transformers import DynamicCache

    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, V, (1, context_len), generator=g)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=ctx, past_key_values=cache, use_cache=True)
        if k > 1:
            cache.batch_repeat_interleave(k)
        x = torch.randint(0, V, (k, new_tokens), generator=g)

        def step():
            model(input_ids=x, past_key_values=cache, use_cache=True)
            cache.crop(-new_tokens)  # transformers 5: a negative value removes that many tokens
            assert cache.get_seq_length() == context_len

        return time_call(step, reps=reps)
