"""What the ecosystem offers for the batch-1 matrix products of a decode step, measured side by side: every
decoder layer's projections (q, k, v, o, gate, up, down) plus the LM head of a model, one token, float32 unless
named, interleaved rounds, median ms.

    .venv/bin/python -m benchmarks.engine_options [--model smollm2-135m] [--rounds 7] [--compile]
        [--out benchmarks/results/engine_options.json]

Options timed: `F.linear` (what an eager forward calls), `x @ W` with the weight stored transposed, `torch.mv`,
MKL-packed weights (`torch.ops.mkl._mkl_linear`), oneDNN-prepacked weights (a TorchScript module frozen and
`optimize_for_inference`), `F.linear` in bfloat16, and this project's kernels (float32 and bfloat16 weights read
in place, int4 copies); with `--compile`, `torch.compile` (inductor, `freezing=True`) of the whole projection stack,
whose compile time is reported too. The floor is `torch.sum` over a float32 tensor of the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.entry import count, run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=count, default=7)
    ap.add_argument("--threads", type=count, default=2)
    ap.add_argument("--compile", action="store_true", help="also torch.compile the stack (slow to compile)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "engine_options.json"))
    a = ap.parse_args()

    import torch
    import torch.nn.functional as F

    from hsd_opt.engine import kernels
    from hsd_opt.models.loading import load_model

    torch.set_num_threads(a.threads)
    model = load_model(a.model, device="cpu", dtype="float32").model
    ws = []
    for layer in model.model.layers:
        at, mlp = layer.self_attn, layer.mlp
        ws += [m.weight.detach() for m in (at.q_proj, at.k_proj, at.v_proj, at.o_proj, mlp.gate_proj,
                                            mlp.up_proj, mlp.down_proj)]
    ws.append(model.lm_head.weight.detach())
    nbytes = sum(w.numel() * 4 for w in ws)
    xs = {k: torch.randn(1, k) for k in {w.shape[1] for w in ws}}
    wt = [w.t().contiguous() for w in ws]
    wb = [w.bfloat16() for w in ws]
    xb = {k: v.bfloat16() for k, v in xs.items()}
    lib = kernels.load(log=lambda m: print(m, file=sys.stderr))
    options = {
        "F.linear float32": lambda: [F.linear(xs[w.shape[1]], w) for w in ws],
        "x @ W (stored transposed)": lambda: [xs[w.shape[0]] @ w for w in wt],
        "torch.mv": lambda: [torch.mv(w, xs[w.shape[1]][0]) for w in ws],
        "F.linear bfloat16": lambda: [F.linear(xb[w.shape[1]], w) for w in wb],
    }
    try:
        packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, 1) for w in ws]
        options["MKL packed"] = lambda: [torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, 1)
                                         for w, p in zip(ws, packed)]
    except (RuntimeError, AttributeError) as e:
        print(f"MKL packed: unavailable ({e})", file=sys.stderr)

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lins = torch.nn.ModuleList()
            for w in ws:
                lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
                lin.weight = torch.nn.Parameter(w, requires_grad=False)
                self.lins.append(lin)

        def forward(self, x576: torch.Tensor, x1536: torch.Tensor) -> list[torch.Tensor]:
            out = []
            for lin in self.lins:
                out.append(lin(x1536 if lin.in_features == x1536.shape[1] else x576))
            return out

    stack = Stack().eval()
    dims = sorted(xs)
    args = (xs[dims[0]], xs[dims[-1]])
    try:
        t0 = time.perf_counter()
        frozen = torch.jit.optimize_for_inference(torch.jit.freeze(torch.jit.script(stack)))
        frozen(*args)
        print(f"oneDNN prepack (TorchScript freeze): {time.perf_counter() - t0:.1f} s to build", file=sys.stderr)
        options["oneDNN prepacked (TorchScript optimize_for_inference)"] = lambda: frozen(*args)
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"oneDNN prepack: failed ({e})", file=sys.stderr)
    compile_s = None
    if a.compile:
        import torch._inductor.config as icfg

        icfg.freezing = True
        comp = torch.compile(stack, backend="inductor")
        t0 = time.perf_counter()
        with torch.no_grad():
            comp(*args)
        compile_s = time.perf_counter() - t0
        print(f"torch.compile (inductor, freezing): {compile_s:.1f} s to compile", file=sys.stderr)
        options["torch.compile inductor, freezing"] = lambda: comp(*args)
    if lib is not None:
        from hsd_opt.engine.weights import Mat, quantize_q4

        km = [Mat.in_place(w) for w in ws]
        kb = [Mat.in_place(w) for w in wb]
        kq = [quantize_q4(w) for w in ws]
        options["hsd kernels float32"] = lambda: [kernels.linear(lib, m, xs[m.cols]) for m in km]
        options["hsd kernels bfloat16"] = lambda: [kernels.linear(lib, m, xs[m.cols]) for m in kb]
        options["hsd kernels int4 (groups of 32)"] = lambda: [kernels.linear(lib, m, xs[m.cols]) for m in kq]
    big = torch.randn(nbytes // 4)
    options["floor: torch.sum over the float32 bytes"] = lambda: big.sum()

    times: dict[str, list[float]] = {k: [] for k in options}
    with torch.no_grad():
        for r in range(a.rounds + 1):
            for k, fn in options.items():
                t0 = time.perf_counter()
                fn()
                if r:
                    times[k].append(time.perf_counter() - t0)
            print(f"  round {r}/{a.rounds}", file=sys.stderr)
    res = {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}
    report = {"what": "batch-1 projections of every layer + LM head (benchmarks/engine_options.py), median ms",
              "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), "model": a.model,
              "threads": a.threads, "bytes_float32": nbytes, "load_avg": os.getloadavg(),
              "compile_seconds": compile_s, "ms": res}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(a.out + ".partial")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, a.out)
    print("\n| option | ms |\n|---|---:|")
    for k, v in res.items():
        print(f"| {k} | {v} |")
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    run(main)
