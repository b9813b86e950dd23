"""The engine at a real model's size, on the device at hand: a model built from a shipped configuration with random
weights (speed does not depend on the weights' values; nothing is downloaded), timed against the weight-read floor
and against Hugging Face `generate`, in one run, one JSON.

    python -m benchmarks.gpu_scale [--config layerskip-llama2-7b|tinyllama-1.1b|tiny|FILE.json] [--device cuda] \\
        [--dtype bfloat16] [--context 128] [--t 1,2,4,8,16,32,64] [--batches 1,2,4,8,16,32,64] [--new 64] \\
        [--no-hf] [--no-compile] [--no-graphs] [--no-triton] [--out benchmarks/results/gpu_scale.json]

Configurations: ``hsd_opt/data/configs/<name>.json`` (LayerSkip-Llama2-7B's, TinyLlama-1.1B's) or a config.json of
your own; ``tiny`` is a 4-layer model for a dry run on a CPU (``--device cpu``, seconds). The weights are HF's random
initialisation in ``--dtype``, the LM head scaled by ``--peak`` so that the logits are peaked (greedy outputs then
do not hang on near-ties, and ours can be compared with HF's token for token).

Measured (every figure a median of ``--repeats`` timings, the device synchronised around each):

- ``bandwidth``: a device-to-device copy of ``--copy-mb`` MB (bytes read plus written per second, as copy
  bandwidths are quoted); ``floor_ms``: the bytes a decode step reads (the layers' and the LM head's weights:
  ``read_bytes``) at that rate (the memory's whole rate serves a stream of reads as it serves a copy's reads and
  writes: 7B in bfloat16 at an H200's 4.3 TB/s, 3.1 ms);
- ``step_ms``: our decode step (every layer over one appended token, then the greedy token: the engine's passes are
  timed as every cost measurement times them, ``hsd_opt.engine.timing``) at ``--context`` tokens;
  ``pass_ms[t]``: a verification pass over ``t`` new positions; ``batch_ms[B]``: one step of ``B`` sequences
  together (``advance_many`` and the batched greedy head);
- ``fixed_shapes``: whether the engine timed above computes its passes at fixed shapes (on CUDA by default,
  ``hsd_opt.engine.fixed``); ``own_shapes``: ``step_ms``, ``pass_ms``, ``batch_ms`` (and ratios) at each pass's own
  shapes (``HSD_FIXED_SHAPES=0``): what fixed shapes cost;
- ``exactness``: whether a verify pass over 8 positions gives the logits of 8 steps bit for bit
  (``pass_equal_steps``), and a step of 8 sequences together each one's step alone (``batch_equal_alone``), with
  the largest differences: with fixed shapes, replaying them, compiled and replayed, and at each pass's own
  shapes; and whether replayed
  steps give the op-by-op ones' logits (``replayed_equal_fixed``);
- ``kernels``: one decode step's kernels by kind (``matmul``, ``attention``, ``other``), count and device
  milliseconds (``torch.profiler``; on a CPU its operators): what of a step is not reading weights;
  ``kernels_batch``, ``kernels_batch_triton``: the same for a step of 32 sequences together (the largest batch
  timed where 32 is not), op by op and with the attention in Triton kernels: what each sequence adds;
- ``ops_ms[t]``: the torch path's own operations of a pass over ``t`` positions (every layer, then the head's
  greedy token) at a fixed place, called directly (no engine bookkeeping); ``graph_ms[t]``: the same operations
  captured once as a CUDA graph and replayed, which the host launches as one: the device's time for our kernels,
  against which ``ops_ms`` and ``pass_ms`` show what launching them one by one costs (CUDA only; the reason
  otherwise);
- ``replayed``: ``step_ms``, ``pass_ms``, ``batch_ms`` (and their ratios) of the engine replaying its passes
  from CUDA graphs (:meth:`~hsd_opt.engine.layered.LayeredLM.replay_passes`, ``HSD_CUDA_GRAPHS=1``; on a CPU
  the recorder that calls them again); ``ours_replayed_tok_s``: its AR loop, ``ours_replayed_equal``: its tokens
  equal the op-by-op loop's, ``ours_replayed_hsd_equal``: a hierarchy over it (the middle exit drafting) gives its
  AR tokens;
- ``compiled``: the same figures with the layers' arithmetic compiled (``torch.compile``, ``HSD_COMPILE=1``) and
  replayed: what fusing the small kernels between the products saves;
- ``triton``, ``triton_replayed``: the same figures with the attention in two Triton kernels a layer for all the
  sequences of a pass (``HSD_TRITON_ATTENTION=1``, :mod:`hsd_opt.engine.triton_attention`), op by op and replayed:
  what a batch's step saves against its sequences' own attention calls (``batch_over_step``);
- ``copies``: the int8 and int4 copies' step and 4-position pass (``1_ms``, ``4_ms``; ``step_over_target``),
  de-quantized and reading their codes with torch's weight-only kernels (``HSD_WEIGHT_ONLY=1``): whether a
  quantized drafter pays on this device;
- ``matmul``: one layer's seven projections at one position in ``--dtype`` (``F.linear``, as the torch path) and
  in torch's weight-only kernels, int8 per output row (``_weight_int8pack_mm``) and int4 in groups of 32 with a
  scale and a zero per group (``_weight_int4pack_mm``; ``_for_cpu`` on a CPU): milliseconds, the weight bytes read
  per second, and each one's largest error against the product with its weights de-quantized (whether a quantized
  copy can be cheaper than the target on this device; the error where a kernel is missing);
- ``ours_tok_s``: our AR loop (``HSD`` with the target alone) over ``--new`` tokens after a ``--context``-token
  prompt, decode only; ``hf_eager_tok_s``: HF ``generate`` (dynamic cache), decode only (the total less a
  one-token generate); ``hf_compiled_tok_s``: with a static cache and ``torch.compile`` of the forward
  (``reduce-overhead``), where it compiles (the error otherwise; each timed generate is the second of two of its
  length, the first compiling for it); ``*_equal``: their greedy tokens equal ours;
- ``section_seconds``: each section's seconds, in the order run: the engine's figures, then these generations
  (the headline figures first), then the rest; the JSON is written after each section.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from benchmarks.entry import count, counts, positive, run
from hsd_opt.engine import graphs
from hsd_opt.engine.timing import median_pass, now
from hsd_opt.errors import HsdError
from hsd_opt.models import random_weights
from hsd_opt.models.loading import resolve_device


def config_of(name: str) -> dict:
    """The configuration named ``name`` (a shipped one, ``tiny``, or a config.json path), HF's keys only
    (:func:`hsd_opt.models.random_weights.config_of`; a bad name raises its one-line error)."""
    return random_weights.config_of(name, "--config")


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


def engine(model, fixed_shapes: bool | None = None, record=None, compiled: bool = False, triton: bool = False):
    """An engine over ``model`` as ``hsd`` builds one here, with its passes at fixed shapes or not
    (``fixed_shapes``; None: as the environment says, :data:`hsd_opt.engine.layered.FIXED_SHAPES`), their layers
    compiled (``compiled``, :meth:`LayeredLM.compile_layers`), their attention in Triton kernels (``triton``,
    :meth:`LayeredLM.attend_in_triton`) and replaying them from recordings made by ``record``
    (:meth:`LayeredLM.replay_passes`); any of them set puts it on the torch path (the kernels are a CPU's)."""
    from hsd_opt.engine import layered

    old = layered.FIXED_SHAPES, layered.TRITON_ATTENTION
    layered.FIXED_SHAPES, layered.TRITON_ATTENTION = fixed_shapes, False
    try:
        torch_path = fixed_shapes is not None or record is not None or compiled or triton
        eng = layered.LayeredLM(model, kernels=False if torch_path else None)
    finally:
        layered.FIXED_SHAPES, layered.TRITON_ATTENTION = old
    if fixed_shapes:
        eng.fix_shapes()
    if compiled and not eng.compile_layers():
        raise RuntimeError("compile_layers refused this model (layers with different activations)")
    if triton:
        eng.attend_in_triton()
    if record is not None:
        eng.replay_passes(record)
    return eng


def engine_figures(model, device: str, context: int, ts: list[int], batches: list[int], repeats: int,
                   record=None, fixed_shapes: bool | None = None, compiled: bool = False,
                   triton: bool = False) -> dict:
    """Our step, passes over ``ts`` positions and batched steps of ``batches`` sequences (milliseconds), of
    :func:`engine` ``(model, fixed_shapes, record, compiled, triton)``."""
    eng = engine(model, fixed_shapes, record, compiled, triton)
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


def exactness(model, context: int, t: int = 8, batch: int = 8, triton: bool = True) -> dict:
    """Whether this device computes a position alike whichever pass computes it: ``pass_equal_steps``: the logits
    of a verify pass over ``t`` positions equal, bit for bit, those of ``t`` decode steps, and ``batch_equal_alone``:
    a step of ``batch`` sequences together gives each the logits of its step alone; for :func:`engine` with fixed
    shapes (``fixed``), replaying them (``replayed``, CUDA graphs on a GPU), replaying them compiled (``compiled``,
    ``HSD_COMPILE=1``), with the attention in Triton kernels op by op and replayed (``triton``,
    ``triton_replayed``, ``HSD_TRITON_ATTENTION=1``; where ``triton``) and at each pass's own shapes (``own_shapes``,
    ``HSD_FIXED_SHAPES=0``), with the largest
    differences; ``replayed_equal_fixed``: the replaying
    engine's steps give the op-by-op one's logits bit for bit (a batch, op by op, then agrees with a sequence
    alone, replayed)."""
    out: dict = {}
    step_logits: dict[str, torch.Tensor] = {}
    record = graphs.cuda_graph if next(model.parameters()).is_cuda else graphs.calls_again
    modes = (("fixed", True, None, False, False), ("replayed", True, record, False, False),
             ("compiled", True, record, True, False), ("triton", True, None, False, True),
             ("triton_replayed", True, record, False, True), ("own_shapes", False, None, False, False))
    for name, fixed_shapes, rec, comp, tri in modes:
        if tri and not triton:
            continue
        try:
            eng = engine(model, fixed_shapes, rec, comp, tri)
            L, V = eng.n_layers, eng.vocab_size
            g = torch.Generator().manual_seed(7)
            prompts = torch.randint(3, V, (batch, context), generator=g)
            ids = torch.randint(3, V, (batch, t), generator=g)

            def states(eng, n: int) -> list:
                made = [eng.new_state(context + t + 1) for _ in range(n)]
                for i, st in enumerate(made):
                    eng.append(st, prompts[i])
                    eng.advance(st, L)
                return made

            steps, one = states(eng, 1)[0], states(eng, 1)[0]
            for tok in ids[0]:
                eng.append(steps, tok.reshape(1))
                eng.advance(steps, L)
            eng.append(one, ids[0])
            eng.advance(one, L)
            a, b = (eng.logits(st, L, context, context + t) for st in (steps, one))
            fig = {"pass_equal_steps": torch.equal(a, b), "pass_max_difference": float((a - b).abs().max())}
            step_logits[name] = a
            many, solo = states(eng, batch), states(eng, batch)
            for i in range(batch):
                eng.append(many[i], ids[i, :1])
                eng.append(solo[i], ids[i, :1])
                eng.advance(solo[i], L)
            eng.advance_many([(st, L) for st in many])
            pairs = [(eng.logits(x, L, context, context + 1), eng.logits(y, L, context, context + 1))
                     for x, y in zip(many, solo)]
            fig["batch_equal_alone"] = all(torch.equal(x, y) for x, y in pairs)
            fig["batch_max_difference"] = max(float((x - y).abs().max()) for x, y in pairs)
            out[name] = fig
            del eng, steps, one, many, solo
        except Exception as e:  # noqa: BLE001 (a failure is a figure to report, not a crash)
            out[name] = f"{type(e).__name__}: {str(e)[:300]}"
    if "fixed" in step_logits and "replayed" in step_logits:
        out["replayed_equal_fixed"] = torch.equal(step_logits["fixed"], step_logits["replayed"])
    return out


def with_ratios(figs: dict, floor_ms: float) -> dict:
    """``step_ms``, ``pass_ms`` and ``batch_ms`` of :func:`engine_figures` with ``step_over_floor`` (against the
    weight-read floor ``floor_ms``), ``pass_over_step`` and ``batch_over_step``."""
    step = figs["step_ms"]
    return {**{k: figs[k] for k in ("step_ms", "pass_ms", "batch_ms")}, "step_over_floor": step / floor_ms,
            "pass_over_step": {t: v / step for t, v in figs["pass_ms"].items()},
            "batch_over_step": {B: v / step for B, v in figs["batch_ms"].items()}}


def pass_ops(eng, st, start: int, t: int, seed: int = 3) -> Callable[[], torch.Tensor]:
    """The torch path's operations of a pass over ``t`` new positions of ``st`` at ``start .. start+t-1``, with
    static inputs: every layer (writing those positions' keys and values again at each call), then the final norm,
    the LM head and the greedy tokens ``[t]``."""
    tp, L = eng._torch, eng.n_layers
    ids = torch.randint(3, eng.vocab_size, (t,), generator=torch.Generator().manual_seed(seed)).to(eng.device)
    x = eng.embed(ids)
    cos, sin = (c.contiguous() for c in eng.rope(start, start + t))
    return lambda: tp.head(tp.layers(0, L, x, st, start, cos, sin)).argmax(-1)


#: Kernel names by what they compute (lower case, a substring each), for :func:`kernel_figures`.
KERNEL_KINDS = {"matmul": ("gemm", "gemv", "cutlass", "nvjet", "sm90_xmma", "cublas", "splitk", "addmm", "aten::mm",
                           "aten::bmm"),
                "attention": ("flash", "fmha", "attention", "efficient", "softmax", "attend_rows", "write_rows")}


#: Operators that launch nothing on a device (views, shapes, allocations), left out of a CPU's counts.
VIEWS = {f"aten::{n}" for n in ("view", "reshape", "transpose", "slice", "unsqueeze", "select", "as_strided",
                                  "expand", "t", "narrow", "split", "split_with_sizes", "chunk", "empty",
                                  "empty_strided", "empty_like", "_unsafe_view", "alias", "detach", "resize_",
                                  "result_type", "lift_fresh", "contiguous", "to", "_to_copy", "linear", "matmul",
                                  "scaled_dot_product_attention", "permute", "squeeze", "zeros_like", "zeros")}


def kernel_figures(model, context: int, steps: int = 3, batch: int = 1, triton: bool = False) -> dict:
    """What one decode step of the engine (as the device runs it, op by op; on a CPU the torch path at fixed
    shapes) launches, from
    ``torch.profiler``: per step, the kernels (on a CPU, the operators) by kind (``matmul``, ``attention``,
    ``other``: norms, rotary, activations, copies) with their count and summed milliseconds on the device: how
    much of a step is not reading weights, and whether fusing the small kernels would pay. ``batch``: a step of
    that many sequences together; ``triton``: with the attention in Triton kernels."""
    from torch.profiler import ProfilerActivity, profile

    cuda = next(model.parameters()).is_cuda
    eng = engine(model, None if cuda else True, triton=triton)   # on a CPU the torch path as CUDA runs it
    L = eng.n_layers
    prompt = torch.randint(3, eng.vocab_size, (context,), generator=torch.Generator().manual_seed(8))
    states = [eng.new_state(context + steps + 2) for _ in range(batch)]
    for st in states:
        eng.append(st, prompt)
        eng.advance(st, L)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def step(token: int) -> None:
        for st in states:
            eng.append(st, [token])
        eng.advance_many([(st, L) for st in states])
        eng.greedy_ids_many([(st, L, st.n - 1, st.n) for st in states])

    step(5)                                      # a warm-up step
    with profile(activities=acts) as prof:
        for i in range(steps):
            step(6 + i)
        now()
    out = {k: {"count": 0, "ms": 0.0} for k in (*KERNEL_KINDS, "other")}
    for ev in prof.key_averages():
        if cuda:        # device kernels only (an operator's row sums its kernels again; runtime calls have none)
            ms = (getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)) / 1e3
            if not ms or ev.key.startswith("aten::"):
                continue
        else:           # operators doing work of their own (nested ones count once each; views none)
            ms = ev.self_cpu_time_total / 1e3
            if not ev.key.startswith("aten::") or not ms or ev.key in VIEWS:
                continue
        kind = next((k for k, subs in KERNEL_KINDS.items() if any(x in ev.key.lower() for x in subs)), "other")
        out[kind]["count"] += ev.count
        out[kind]["ms"] += ms
    for v in out.values():
        v["count"], v["ms"] = v["count"] / steps, v["ms"] / steps
    out["unit"] = "per step: device kernels" if cuda else "per step: CPU operators (self time)"
    out["fixed_shapes"], out["batch"], out["triton_attention"] = eng.fixed_shapes, batch, eng.attends_in_triton
    return out


def graphed_figures(eng, device: str, context: int, ts: list[int], repeats: int) -> dict:
    """``ops_ms[t]``: :func:`pass_ops` called eagerly; ``graph_ms[t]``: captured as one CUDA graph and replayed
    (milliseconds); ``graph_equal[t]``: the replay's greedy tokens equal the eager call's. On a device without CUDA
    graphs ``graph_ms`` is the reason instead."""
    st = eng.new_state(context + max(ts) + 8)
    eng.append(st, torch.randint(3, eng.vocab_size, (context,), generator=torch.Generator().manual_seed(4)))
    eng.advance(st, eng.n_layers)
    out: dict = {"ops_ms": {}, "graph_ms": {}, "graph_equal": {}}
    for t in ts:
        fn = pass_ops(eng, st, context, t)
        out["ops_ms"][t] = timed(fn, repeats) * 1e3
        if not (device.startswith("cuda") and torch.cuda.is_available()):
            out["graph_ms"] = "CUDA graphs need a CUDA device"
            continue
        try:
            replay, replayed = graphs.cuda_graph(fn)
            out["graph_ms"][t] = timed(replay, repeats) * 1e3
            replay()
            out["graph_equal"][t] = torch.equal(replayed, fn())
        except Exception as e:  # noqa: BLE001 (a capture failure is a figure to report, not a crash)
            out["graph_ms"][t] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def matmul_figures(config: dict, device: str, dtype: torch.dtype, repeats: int) -> dict:
    """One layer's projections of ``config`` (q, k, v, o, gate, up, down) at one position: milliseconds, weight
    bytes per second and largest error against the de-quantized product, in ``dtype`` and in torch's int8 and
    int4 weight-only kernels, each matrix quantized and packed as a copy reading its codes is
    (:mod:`hsd_opt.engine.weight_only`; int4 with bfloat16 activations, the GPU kernel's; the reason where a kernel
    takes none here)."""
    import torch.nn.functional as F

    from hsd_opt.engine import weight_only
    from hsd_opt.engine.weights import quantize_q4, quantize_q8

    d, f = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    hd = config.get("head_dim") or d // heads
    kv = (config.get("num_key_value_heads") or heads) * hd
    shapes = [(heads * hd, d), (kv, d), (kv, d), (d, heads * hd), (f, d), (f, d), (d, f)]
    g = torch.Generator(device=device).manual_seed(5)
    ws = [torch.randn(n, k, generator=g, device=device).mul_(0.02).to(dtype) for n, k in shapes]
    xs = [torch.randn(1, k, generator=g, device=device).to(dtype) for _, k in shapes]

    def entry(fn, nbytes: int, ref: list[torch.Tensor]) -> dict:
        try:
            got = fn()
            err = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, ref))
            scale = max(float(b.float().abs().max()) for b in ref)
            sec = timed(fn, repeats)
            return {"ms": sec * 1e3, "weight_gb_s": nbytes / sec / 1e9, "bytes": nbytes, "max_error": err,
                    "max_value": scale}
        except Exception as e:  # noqa: BLE001 (a missing kernel is a figure to report, not a crash)
            return {"error": f"{type(e).__name__}: {str(e)[:300]}"}

    out = {"shapes": shapes}
    dense = [F.linear(x, w) for x, w in zip(xs, ws)]
    out[str(dtype).replace("torch.", "")] = entry(lambda: [F.linear(x, w) for x, w in zip(xs, ws)],
                                                  sum(w.numel() * w.element_size() for w in ws), dense)
    for name, quantize, act in (("int8", quantize_q8, dtype), ("int4", quantize_q4, torch.bfloat16)):
        mats = [quantize(w) for w in ws]
        packed = [weight_only.pack(m, act) for m in mats]
        if any(p is None for p in packed):
            out[name] = {"error": "weight_only.pack: no kernel takes these matrices here (missing on this device "
                                  "or torch, or its product disagrees with the de-quantized one)"}
            continue
        ref = [F.linear(x.float(), m.dense(torch.float32)) for x, m in zip(xs, mats)]
        nbytes = sum(t.numel() * t.element_size() for p in packed for t in (p.codes, p.scales))
        out[name] = entry(lambda packed=packed: [weight_only.linear(x, p) for x, p in zip(xs, packed)], nbytes, ref)
    return out


def copy_figures(model, context: int, repeats: int, kinds=(("int8", 8), ("int4", 4))) -> dict:
    """Each quantized copy's decode step and a verify pass over 4 positions (milliseconds), its matrices
    de-quantized (the torch path's default) and read as codes by torch's weight-only kernels
    (:meth:`LayeredLM.read_codes`; ``packed``: how many of its matrices took them); the error where one fails."""
    from hsd_opt.engine.quantized import QuantizedLM

    out: dict = {}
    g = torch.Generator().manual_seed(6)
    for name, bits in kinds:
        out[name] = {}
        for mode in ("dequantized", "codes"):
            try:
                eng = QuantizedLM(model, bits=bits, kernels=False)
                if mode == "codes":
                    eng.read_codes()
                L = eng.n_layers
                st = eng.new_state(context + 16)
                eng.append(st, torch.randint(3, eng.vocab_size, (context,), generator=g))
                eng.advance(st, L)
                fig = {f"{t}_ms": median_pass(eng, [(st, torch.randint(3, eng.vocab_size, (t,), generator=g))],
                                              L, repeats) * 1e3 for t in (1, 4)}
                packed = eng._torch._packed
                fig["packed"] = sum(p is not None for p in packed.values()) if mode == "codes" else 0
                fig["matrices"] = len(packed) if mode == "codes" else None
                out[name][mode] = fig
                del eng, st
            except Exception as e:  # noqa: BLE001 (a copy that fails is a figure to report, not a crash)
                out[name][mode] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def _ar_loop(lm, prompt: list[int], new: int) -> tuple[float | None, list[int]]:
    """Tokens/s of the AR loop (``HSD`` with the target alone) on ``lm`` over ``new`` tokens after ``prompt``,
    decode only (after a warm-up), and its tokens."""
    from hsd_opt.runtime.decode import HSD, Level

    ar = HSD([Level("target", lm, lm.n_layers)], [])
    ar.generate(prompt, 4)
    res = ar.generate(prompt, new)
    sec = res.stats.get("decode_seconds")
    return (len(res.token_ids) / sec if sec else None), res.token_ids


def generations(model, context: int, new: int) -> tuple[dict, list[int], list[int]]:
    """Tokens/s of our AR loop over ``new`` tokens after a ``context``-token prompt. Returns the figures, the
    prompt and our tokens (what :func:`hf_generations` and :func:`replayed_generations` compare theirs with)."""
    eng = engine(model)
    prompt = torch.randint(3, eng.vocab_size, (context,), generator=torch.Generator().manual_seed(2)).tolist()
    rate, ours = _ar_loop(eng, prompt, new)
    return {"ours_tok_s": rate, "ours_tokens": len(ours)}, prompt, ours


def replayed_generations(model, prompt: list[int], new: int, ours: list[int], record) -> dict:
    """Our AR loop replaying its steps from recordings made by ``record`` (``ours_replayed_tok_s``;
    ``ours_replayed_equal``: its tokens equal the op-by-op loop's ``ours``; ``ours_replayed_hsd_equal``: a hierarchy
    over it gives its AR tokens)."""
    from hsd_opt.runtime.decode import HSD, Level

    replaying = engine(model, record=record)
    out: dict = {}
    out["ours_replayed_tok_s"], toks = _ar_loop(replaying, prompt, new)
    out["ours_replayed_equal"] = toks == ours
    # verify passes replayed too: the middle exit drafting 3 tokens for the model's head, lossless
    L = replaying.n_layers
    hsd = HSD([Level(f"layer{L // 2}", replaying, L // 2), Level("target", replaying, L)], [3])
    out["ours_replayed_hsd_equal"] = hsd.generate(prompt, new).token_ids == toks
    return out


def hf_generations(model, device: str, prompt: list[int], new: int, ours: list[int], compiled: bool) -> dict:
    """Tokens/s of HF ``generate`` over ``new`` tokens after ``prompt``, decode only (the total less a one-token
    generate), and whether its greedy tokens equal ``ours``: eager (dynamic cache), or with ``compiled`` a static
    cache and ``torch.compile`` of the forward (``reduce-overhead``; the error where it does not compile)."""
    ids = torch.tensor([prompt], device=device)

    def hf_run(n: int):
        t0 = now()
        o = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return now() - t0, o[0, len(prompt):].tolist()

    def second_run(n: int):
        """The second of two runs of ``n`` tokens: a static cache is sized by ``n``, so the first compiles (and
        records) for that size; timing it would time the compiler."""
        hf_run(n)
        return hf_run(n)

    def decode_rate():
        one, _ = second_run(1)
        total, toks = second_run(new)
        return (new - 1) / max(total - one, 1e-9), toks

    if not compiled:
        rate, toks = decode_rate()
        return {"hf_eager_tok_s": rate, "hf_eager_equal": toks[:len(ours)] == ours}
    try:
        t0 = time.perf_counter()
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        rate, toks = decode_rate()
        return {"hf_compiled_tok_s": rate, "hf_compiled_equal": toks[:len(ours)] == ours,
                "hf_compile_seconds": time.perf_counter() - t0}
    except Exception as e:  # noqa: BLE001 (a compile failure is a figure to report, not a crash)
        return {"hf_compiled_error": f"{type(e).__name__}: {str(e)[:300]}"}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="layerskip-llama2-7b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--context", type=count, default=128, help="tokens before the timed steps and generations")
    ap.add_argument("--t", type=counts, default="1,2,4,8,16,32,64", help="positions of the timed verification passes")
    ap.add_argument("--batches", type=counts, default="1,2,4,8,16,32,64", help="sequences of the timed batched steps")
    ap.add_argument("--new", type=count, default=64, help="tokens generated by each AR loop")
    ap.add_argument("--repeats", type=count, default=10)
    ap.add_argument("--copy-mb", type=count, default=1024)
    ap.add_argument("--peak", type=positive, default=8.0, help="factor on the LM head's random weights")
    ap.add_argument("--no-hf", action="store_true", help="skip HF generate")
    ap.add_argument("--no-compile", action="store_true", help="skip HF with a static cache and torch.compile")
    ap.add_argument("--no-graphs", action="store_true", help="skip the passes' operations called directly and as "
                                                             "CUDA graphs, the engine replaying its passes, and "
                                                             "the weight-only matmuls")
    ap.add_argument("--no-triton", dest="triton", action="store_false",
                    help="skip the figures with the attention in Triton kernels")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "gpu_scale.json"))
    a = ap.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise HsdError(f"--device {a.device}: no CUDA device here (a dry run: --config tiny --device cpu)")
    resolve_device(a.device)           # a device torch does not know: named by --device, not by --config
    import transformers

    from hsd_opt.jsonio import write_json

    dtype = getattr(torch, a.dtype)
    ts, batches = a.t, a.batches
    t0 = time.perf_counter()
    model = build(config_of(a.config), a.device, dtype, a.peak)
    report = {"what": "the engine at a real model's size with random weights (benchmarks/gpu_scale.py)",
              "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "config": a.config, "dtype": a.dtype,
              "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device,
              "torch": torch.__version__, "transformers": transformers.__version__, "context": a.context,
              "build_seconds": round(time.perf_counter() - t0, 2)}

    sections = report.setdefault("section_seconds", {})
    last = [time.perf_counter()]

    def save(section: str) -> None:
        """Write what is measured so far (a run stopped by a time limit keeps it), with the seconds of the section
        that ends here."""
        t = time.perf_counter()
        sections[section] = round(t - last[0], 1)
        last[0] = t
        report["seconds"] = round(t - t0, 1)
        write_json(Path(a.out), report)

    def hf_ratios() -> None:
        for k in ("ours", "ours_replayed"):
            if report.get("hf_eager_tok_s") and report.get(f"{k}_tok_s"):
                report[f"{k}_over_hf_eager"] = report[f"{k}_tok_s"] / report["hf_eager_tok_s"]

    bw = copy_bandwidth(a.device, a.copy_mb, a.repeats)
    figs = engine_figures(model, a.device, a.context, ts, batches, a.repeats)
    read = figs["weight_bytes"]               # the layers' and the head's matrices: what a step reads
    report.update(bandwidth_gb_s=bw / 1e9, read_bytes=read, floor_ms=read / bw * 1e3, **figs)
    report.update(with_ratios(figs, report["floor_ms"]))
    report["fixed_shapes"] = engine(model).fixed_shapes
    save("engine")
    # the headline figures first (a later section's compile that runs long must not lose them)
    figs, prompt, ours = generations(model, a.context, a.new)
    report.update(figs)
    if not a.no_hf:
        report.update(hf_generations(model, a.device, prompt, a.new, ours, compiled=False))
    hf_ratios()
    save("generations")
    report["exactness"] = exactness(model, a.context, triton=a.triton)
    save("exactness")
    big = 32 if 32 in batches else max(batches)      # a batch's step: what its sequences add to the launches
    for name, how in (("kernels", {}), ("kernels_batch", {"batch": big}),
                      ("kernels_batch_triton", {"batch": big, "triton": True})):
        if how.get("triton") and not a.triton:
            continue
        try:
            report[name] = kernel_figures(model, a.context, **how)
        except Exception as e:  # noqa: BLE001 (a figure to report; the rest still runs)
            report[name] = f"{type(e).__name__}: {str(e)[:300]}"
        save(name)

    def variant(name: str, few: bool = False, **how) -> bool:
        """The step, passes and batches of :func:`engine` ``(model, **how)`` with their ratios, as ``report[name]``
        (the error instead where it fails: a figure to report; the rest still runs); ``few``: only the first and
        the largest pass, and batches of 1, 8 and the largest two. True where it ran."""
        t_, b_ = (sorted({ts[0], ts[-1]}), sorted({1, 8, *batches[-2:]})) if few else (ts, batches)
        try:
            figs = engine_figures(model, a.device, a.context, t_, b_, a.repeats, **how)
        except Exception as e:  # noqa: BLE001
            report[name] = f"{type(e).__name__}: {str(e)[:300]}"
            return False
        report[name] = with_ratios(figs, report["floor_ms"])
        return True

    variant("own_shapes", fixed_shapes=False)     # what fixed shapes cost: each pass at its own shapes
    save("own_shapes")
    if a.triton:   # a batch's attention in two kernels a layer instead of its sequences' own calls
        variant("triton", few=True, triton=True)
        save("triton")
    # the engine's passes replayed from CUDA graphs; on a CPU, from the recorder that calls them again (a dry run)
    record = None if a.no_graphs else graphs.cuda_graph if a.device.startswith("cuda") else graphs.calls_again
    if not a.no_graphs:
        report.update(graphed_figures(engine(model), a.device, a.context, ts, a.repeats))
        if isinstance(report["graph_ms"], dict) and 1 in report["graph_ms"] \
                and isinstance(report["graph_ms"][1], float):
            report["graph_step_over_floor"] = report["graph_ms"][1] / report["floor_ms"]
        report["matmul"] = matmul_figures(config_of(a.config), a.device, dtype, a.repeats)
        save("graphs_matmul")
        report["copies"] = copy_figures(model, a.context, a.repeats)
        for fig in report["copies"].values():
            for v in fig.values():
                if isinstance(v, dict):
                    v["step_over_target"] = v["1_ms"] / report["step_ms"]
        save("copies")
        if not variant("replayed", record=record):
            record = None
        save("replayed")
        if a.triton and record is not None:
            variant("triton_replayed", few=True, record=record, triton=True)
            save("triton_replayed")
        variant("compiled", record=record, compiled=True)   # the small kernels fused, replayed
        save("compiled")
    if record is not None:                  # the AR loop replaying its steps, against the op-by-op one run above
        report.update(replayed_generations(model, prompt, a.new, ours, record))
        hf_ratios()
        save("generations_replayed")
    if not (a.no_hf or a.no_compile):       # last: compiling may take minutes
        report.update(hf_generations(model, a.device, prompt, a.new, ours, compiled=True))
        if report.get("hf_compiled_tok_s") and report.get("ours_tok_s"):
            report["ours_over_hf_compiled"] = report["ours_tok_s"] / report["hf_compiled_tok_s"]
        save("hf_compiled")
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in report.items()
                      if not isinstance(v, dict)}))
    return report


if __name__ == "__main__":
    run(main)
