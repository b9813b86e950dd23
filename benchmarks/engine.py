"""Engine benchmark: ms per decode step and per pass over t tokens, torch path vs the CPU kernels, for the target,
its early exits and its quantized copies, against the weight-read floor and HF `generate` measured in the same
run, with llama.cpp's `llama-bench` on the same GGUF as an anchor when a binary is given.

    .venv/bin/python -m benchmarks.engine [--model smollm2-135m] [--t 1,2,3,4,8,12,16] [--exits 15,22]
        [--llama-bench PATH --gguf-f32 FILE --gguf-q4 FILE] [--out benchmarks/results/engine.json]

Every figure is a median over interleaved rounds (each round times every engine and t once), so a slow spell of a
shared machine hits all columns alike; compare ratios within one run.

- floor: `torch.sum` over a float32 tensor as large as the engine's weights (and over one as large as the int4
  copy's): the time to read the bytes once, the limit of a batch-1 decode step.
- step / pass over t: `advance` + `logits` of the engine at context `--context`, t new positions, then crop.
- AR: our decode loop (`HSD` with the target alone) and HF `generate`, tokens/s over `--new` tokens (prefill
  excluded for ours: `decode_seconds`; HF: total minus a 1-token generate).
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

from benchmarks.entry import at_least, count, counts, run, whole
from hsd_opt.engine.variants import host


def exit_layers(text: str) -> list[int]:
    """``--exits``: layer numbers (1 or more), comma-separated, or nothing (no early exit timed)."""
    return counts(text) if text.strip() else []


def _ms(xs):
    return round(statistics.median(xs) * 1e3, 3)


def llama_bench(binary: str, gguf: str, threads: int, prompt: int, gen: int) -> dict:
    """`llama-bench -o json` on one file: prefill and decode tokens/s."""
    res = subprocess.run([binary, "-m", gguf, "-t", str(threads), "-p", str(prompt), "-n", str(gen), "-o", "json"],
                         capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        return {"error": res.stderr.strip()[-500:]}
    rows = json.loads(res.stdout)
    out = {"file": os.path.basename(gguf), "threads": threads}
    for r in rows:
        key = "prefill_tok_s" if r.get("n_prompt") else "decode_tok_s"
        out[key] = r.get("avg_ts")
        out["type"] = r.get("model_type")
    if out.get("decode_tok_s"):
        out["decode_ms_per_token"] = 1e3 / out["decode_tok_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--t", type=counts, default="1,2,3,4,8,12,16", help="pass sizes (tokens)")
    ap.add_argument("--exits", type=exit_layers, default="15,22", help="early exits to time besides the target")
    ap.add_argument("--quantized", default="int8,int4")
    ap.add_argument("--context", type=whole, default=64, help="tokens already in the cache")
    ap.add_argument("--rounds", type=count, default=7)
    ap.add_argument("--threads", type=count, default=2)
    ap.add_argument("--new", type=at_least(2), default=64, help="tokens for the AR comparisons (2 or more)")
    ap.add_argument("--llama-bench", default=None, help="a llama-bench binary (llama.cpp) for anchor figures")
    ap.add_argument("--gguf-f32", default=None, help="the model as an F32 GGUF, for llama-bench")
    ap.add_argument("--gguf-q4", default=None, help="the model in its stored 4-bit GGUF, for llama-bench")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "engine.json"))
    a = ap.parse_args()

    import torch

    from hsd_opt.commands.options import quant_spec
    from hsd_opt.engine import kernels
    from hsd_opt.engine.layered import LayeredLM
    from hsd_opt.engine.quantized import QuantizedLM
    from hsd_opt.jsonio import write_json
    from hsd_opt.models.loading import eos_token_ids, load_model
    from hsd_opt.prompts import encode_prompt
    from hsd_opt.runtime.decode import HSD, Level

    torch.set_num_threads(a.threads)
    ts, exits = a.t, a.exits
    print(f"loading {a.model} ({a.dtype}) ...", file=sys.stderr)
    loaded = load_model(a.model, device="cpu", dtype=a.dtype)
    model = loaded.model
    engines: dict[str, tuple] = {}   # name -> (engine, boundaries)
    eager = LayeredLM(model, kernels=False)
    lean = LayeredLM(model, kernels=True)
    L = eager.n_layers
    engines["target/torch"] = (eager, L)
    engines["target/kernels"] = (lean, L)
    for b in exits:
        engines[f"layer{b}/torch"] = (eager, b)
        engines[f"layer{b}/kernels"] = (lean, b)
    for q in [s for s in a.quantized.split(",") if s.strip()]:
        bits, group = quant_spec(q)
        print(f"quantizing {q} ...", file=sys.stderr)
        engines[f"{q}/torch"] = (QuantizedLM(model, bits=bits, group_size=group or 32, kernels=False), L)
        engines[f"{q}/kernels"] = (QuantizedLM(model, bits=bits, group_size=group or 32, kernels=True), L)
    target_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters())
    floors = {"target": torch.randn(target_bytes // 4)}
    q4 = engines.get("int4/kernels")
    if q4:
        floors["int4"] = torch.randn(q4[0].weight_bytes() // 4)

    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(3, eager.vocab_size - 1, (a.context + max(ts) + 2,), generator=g)
    states = {}
    for name, (eng, b) in engines.items():
        st = eng.new_state(a.context + max(ts) + 2)
        eng.append(st, ctx[: a.context])
        eng.advance(st, eng.n_layers)
        states[name] = st
    times: dict[str, dict[int, list[float]]] = {n: {t: [] for t in ts} for n in engines}
    floor_t: dict[str, list[float]] = {k: [] for k in floors}
    print(f"timing {len(engines)} engines x {len(ts)} pass sizes x {a.rounds} rounds ...", file=sys.stderr)
    for r in range(a.rounds + 1):
        for k, big in floors.items():
            t0 = time.perf_counter()
            big.sum()
            if r:
                floor_t[k].append(time.perf_counter() - t0)
        for name, (eng, b) in engines.items():
            st = states[name]
            n0 = a.context
            for t in ts:
                eng.append(st, ctx[n0:n0 + t])
                t0 = time.perf_counter()
                eng.advance(st, b)
                eng.logits(st, b, n0, n0 + t)
                dt = time.perf_counter() - t0
                eng.crop(st, n0)
                if r:
                    times[name][t].append(dt)
        print(f"  round {r}/{a.rounds}", file=sys.stderr)

    # our AR loop and HF generate on one prompt, interleaved
    eos = eos_token_ids(loaded)
    prompt = encode_prompt(loaded.tokenizer, "Write a Python function that checks whether a number is prime.")
    ids = torch.tensor([prompt])
    ar = {"ours/torch": HSD([Level("target", eager, L)], [], eos_ids=[]),
          "ours/kernels": HSD([Level("target", lean, L)], [], eos_ids=[])}
    ar_t: dict[str, list[float]] = {k: [] for k in [*ar, "hf_generate"]}
    outs = {}
    print("timing AR loops ...", file=sys.stderr)
    for r in range(max(3, a.rounds // 2)):
        for k, h in ar.items():
            res = h.generate(prompt, a.new)
            outs[k] = res.token_ids
            ar_t[k].append(res.stats["decode_seconds"] / len(res.token_ids))
        kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, temperature=None, top_p=None, top_k=None,
                  pad_token_id=eos[0] if eos else None)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter()
        o = model.generate(ids, max_new_tokens=a.new, min_new_tokens=a.new, **kw)
        t2 = time.perf_counter()
        outs["hf_generate"] = o[0, len(prompt):].tolist()
        ar_t["hf_generate"].append(((t2 - t1) - (t1 - t0)) / (a.new - 1))

    report = {
        "what": "engine benchmark (benchmarks/engine.py): median ms over interleaved rounds",
        "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
        "machine": {"platform": platform.platform(), "host": host(), "threads": a.threads,
                    "load_avg": os.getloadavg()},
        "model": a.model, "dtype": a.dtype, "context": a.context, "rounds": a.rounds,
        "kernels_simd": bool(kernels.load().hsd_simd()) if kernels.load() else None,
        "floor_ms": {k: _ms(v) for k, v in floor_t.items()},
        "floor_bytes": {"target": target_bytes, **({"int4": q4[0].weight_bytes()} if q4 else {})},
        "pass_ms": {n: {str(t): _ms(v) for t, v in d.items()} for n, d in times.items()},
        "ar_ms_per_token": {k: _ms(v) for k, v in ar_t.items()},
        "ar_equal_to_hf": {k: outs[k] == outs["hf_generate"] for k in ar},
    }
    if a.llama_bench:
        print("running llama-bench ...", file=sys.stderr)
        report["llama_cpp"] = {k: llama_bench(a.llama_bench, f, a.threads, 512, 128)
                               for k, f in (("f32", a.gguf_f32), ("q4", a.gguf_q4)) if f}
    write_json(a.out, report, indent=1)

    # the table
    print(f"\nfloor (read the weights once): target {report['floor_ms']['target']} ms"
          + (f", int4 copy {report['floor_ms']['int4']} ms" if "int4" in report["floor_ms"] else ""))
    print("\n| engine | " + " | ".join(f"t={t}" for t in ts) + " |")
    print("|---|" + "---:|" * len(ts))
    for n, d in report["pass_ms"].items():
        print(f"| {n} | " + " | ".join(f"{d[str(t)]:.1f}" for t in ts) + " |")
    print("\n| AR loop | ms/token | tok/s | x HF generate | = HF output |")
    print("|---|---:|---:|---:|---|")
    hf = report["ar_ms_per_token"]["hf_generate"]
    for k, v in report["ar_ms_per_token"].items():
        eq = report["ar_equal_to_hf"].get(k, "-")
        print(f"| {k} | {v:.1f} | {1e3 / v:.1f} | {hf / v:.2f} | {eq} |")
    if "llama_cpp" in report:
        for k, v in report["llama_cpp"].items():
            print(f"llama.cpp {k}: {v}")
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    run(main)
