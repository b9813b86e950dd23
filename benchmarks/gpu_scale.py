"""The engine at a real model's size, on the device at hand: a model built from a shipped configuration with random
weights (speed does not depend on the weights' values; nothing is downloaded), timed against the weight-read floor
and against Hugging Face `generate`, in one run, one JSON.

    python -m benchmarks.gpu_scale [--config layerskip-llama2-7b|tinyllama-1.1b|tiny|FILE.json] [--device cuda] \\
        [--dtype bfloat16] [--context 128] [--t 1,2,4,8,16,32,64] [--batches 1,2,4,8,16,32,64] [--new 64] \\
        [--no-hf] [--no-compile] [--out benchmarks/results/gpu_scale.json]

Configurations: ``hsd_opt/data/configs/<name>.json`` (LayerSkip-Llama2-7B's, TinyLlama-1.1B's) or a config.json of
your own; ``tiny`` is a 4-layer model for a dry run on a CPU (``--device cpu``, seconds). The weights are HF's random
initialisation in ``--dtype``, the LM head scaled by ``--peak`` so that the logits are peaked (greedy outputs then
do not hang on near-ties, and ours can be compared with HF's token for token).

Measured (every figure a median of ``--repeats`` timings, the device synchronised around each):

- ``bandwidth``: a device-to-device copy of ``--copy-mb`` MB (bytes read plus written per second); ``floor_ms``:
  the bytes a decode step reads (the layers' and the LM head's weights: ``read_bytes``) at half that rate (read
  alone);
- ``step_ms``: our decode step (every layer over one appended token, then the greedy token: the engine's passes are
  timed as every cost measurement times them, ``hsd_opt.engine.timing``) at ``--context`` tokens;
  ``pass_ms[t]``: a verification pass over ``t`` new positions; ``batch_ms[B]``: one step of ``B`` sequences
  together (``advance_many`` and the batched greedy head);
- ``ours_tok_s``: our AR loop (``HSD`` with the target alone) over ``--new`` tokens after a ``--context``-token
  prompt, decode only; ``hf_eager_tok_s``: HF ``generate`` (dynamic cache), decode only (the total less a
  one-token generate); ``hf_compiled_tok_s``: with a static cache and ``torch.compile`` of the forward
  (``reduce-overhead``), where it compiles (the error otherwise); ``*_equal``: their greedy tokens equal ours.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from hsd_opt.engine.timing import median_pass, now
from hsd_opt.errors import HsdError
from hsd_opt.models import random_weights


def config_of(name: str) -> dict:
    """The configuration named ``name`` (a shipped one, ``tiny``, or a config.json path), HF's keys only
    (:func:`hsd_opt.models.random_weights.config_of`; a bad name exits with its one line)."""
    try:
        return random_weights.config_of(name, "--config")
    except HsdError as e:
        raise SystemExit(str(e)) from None


def build(config: dict, device: str, dtype: torch.dtype, peak: float, seed: int = 0):
    """A model of ``config`` with random weights, made directly on ``device`` in ``dtype`` (eval; the LM head
    scaled by ``peak``): :func:`hsd_opt.models.random_weights.random_model`."""
    return random_weights.random_model(config, device, dtype, peak, seed, "--config")


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after one warm-up (the device's queued work waited for)."""
    out = []
    for i in range(repeats + 1):
        t0 = now()
        fn()
        if i:
            out.append(now() - t0)
    return statistics.median(out)


def copy_bandwidth(device: str, mb: int, repeats: int) -> float:
    """Bytes read plus written per second by a device-to-device copy of ``mb`` MB."""
    x = torch.empty(mb << 20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() / timed(lambda: y.copy_(x), repeats)


def engine_figures(model, device: str, context: int, ts: list[int], batches: list[int], repeats: int) -> dict:
    """Our step, passes over ``ts`` positions and batched steps of ``batches`` sequences (milliseconds)."""
    from hsd_opt.engine.layered import LayeredLM

    eng = LayeredLM(model)
    L, V = eng.n_layers, eng.vocab_size
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, V, (context,), generator=g)
    st = eng.new_state(context + max(ts) + 8)
    eng.append(st, prompt)
    eng.advance(st, L)

    def new(t: int) -> torch.Tensor:
        return torch.randint(3, V, (t,), generator=g)

    out = {"step_ms": median_pass(eng, [(st, new(1))], L, repeats) * 1e3,
           "pass_ms": {t: median_pass(eng, [(st, new(t))], L, repeats) * 1e3 for t in ts}}
    states = [eng.new_state(context + 4) for _ in range(max(batches))]
    for s in states:
        eng.append(s, prompt)
    eng.advance_many([(s, L) for s in states])
    out["batch_ms"] = {B: median_pass(eng, [(s, new(1)) for s in states[:B]], L, repeats, many=True) * 1e3
                       for B in batches}
    out["weight_bytes"] = eng.weight_bytes()
    return out


def generations(model, device: str, context: int, new: int, hf: bool, compile_: bool) -> dict:
    """Tokens/s of our AR loop and of HF ``generate`` (eager; static cache and compiled), and whether their greedy
    tokens equal ours."""
    from hsd_opt.engine.layered import LayeredLM
    from hsd_opt.runtime.decode import HSD, Level

    eng = LayeredLM(model)
    prompt = torch.randint(3, eng.vocab_size, (context,), generator=torch.Generator().manual_seed(2)).tolist()
    ar = HSD([Level("target", eng, eng.n_layers)], [])
    ar.generate(prompt, 4)
    res = ar.generate(prompt, new)
    ours = res.token_ids
    out = {"ours_tok_s": len(ours) / res.stats["decode_seconds"] if res.stats.get("decode_seconds") else None,
           "ours_tokens": len(ours)}
    if not hf:
        return out
    ids = torch.tensor([prompt], device=device)

    def hf_run(n: int, **kw):
        t0 = now()
        o = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)
        return now() - t0, o[0, len(prompt):].tolist()

    def decode_rate(**kw):
        hf_run(2, **kw)
        one, _ = hf_run(1, **kw)
        total, toks = hf_run(new, **kw)
        return (new - 1) / max(total - one, 1e-9), toks

    out["hf_eager_tok_s"], toks = decode_rate()
    out["hf_eager_equal"] = toks[:len(ours)] == ours
    if compile_:
        try:
            t0 = time.perf_counter()
            model.generation_config.cache_implementation = "static"
            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
            out["hf_compiled_tok_s"], toks = decode_rate()
            out["hf_compiled_equal"] = toks[:len(ours)] == ours
            out["hf_compile_seconds"] = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 (a compile failure is a figure to report, not a crash)
            out["hf_compiled_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="layerskip-llama2-7b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--context", type=int, default=128, help="tokens before the timed steps and generations")
    ap.add_argument("--t", default="1,2,4,8,16,32,64", help="positions of the timed verification passes")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64", help="sequences of the timed batched steps")
    ap.add_argument("--new", type=int, default=64, help="tokens generated by each AR loop")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--copy-mb", type=int, default=1024)
    ap.add_argument("--peak", type=float, default=8.0, help="factor on the LM head's random weights")
    ap.add_argument("--no-hf", action="store_true", help="skip HF generate")
    ap.add_argument("--no-compile", action="store_true", help="skip HF with a static cache and torch.compile")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "gpu_scale.json"))
    a = ap.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (a dry run: --config tiny --device cpu)")
    import transformers

    from hsd_opt.jsonio import write_json

    dtype = getattr(torch, a.dtype)
    ts, batches = [int(x) for x in a.t.split(",")], [int(x) for x in a.batches.split(",")]
    t0 = time.perf_counter()
    model = build(config_of(a.config), a.device, dtype, a.peak)
    report = {"what": "the engine at a real model's size with random weights (benchmarks/gpu_scale.py)",
              "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "config": a.config, "dtype": a.dtype,
              "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device,
              "torch": torch.__version__, "transformers": transformers.__version__, "context": a.context,
              "build_seconds": round(time.perf_counter() - t0, 2)}
    bw = copy_bandwidth(a.device, a.copy_mb, a.repeats)
    figs = engine_figures(model, a.device, a.context, ts, batches, a.repeats)
    read = figs["weight_bytes"]               # the layers' and the head's matrices: what a step reads
    report.update(bandwidth_gb_s=bw / 1e9, read_bytes=read, floor_ms=read / (bw / 2) * 1e3, **figs)
    report["step_over_floor"] = figs["step_ms"] / report["floor_ms"]
    report["pass_over_step"] = {t: v / figs["step_ms"] for t, v in figs["pass_ms"].items()}
    report["batch_over_step"] = {B: v / figs["step_ms"] for B, v in figs["batch_ms"].items()}
    report.update(generations(model, a.device, a.context, a.new, not a.no_hf, not a.no_compile))
    if report.get("hf_eager_tok_s") and report.get("ours_tok_s"):
        report["ours_over_hf_eager"] = report["ours_tok_s"] / report["hf_eager_tok_s"]
    if report.get("hf_compiled_tok_s") and report.get("ours_tok_s"):
        report["ours_over_hf_compiled"] = report["ours_tok_s"] / report["hf_compiled_tok_s"]
    report["seconds"] = round(time.perf_counter() - t0, 1)
    write_json(Path(a.out), report)
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in report.items()
                      if not isinstance(v, dict)}))
    return report


if __name__ == "__main__":
    main()
