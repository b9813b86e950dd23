"""The decode kernels against the torch path: what a CPU without a C compiler pays per decode step.

    .venv/bin/python -m benchmarks.torch_path [--rounds 4] [--steps 16] [--out benchmarks/results/torch_path.json]

The embedded model's float32 target and its int4 copy, each on the C kernels and on the plain torch path
(``kernels=False``; a quantized copy there runs its de-quantized weights), each timed over ``--steps`` decode steps
(append one token of the suite's text, run every layer, the greedy id) after a 64-token prefill; engines
interleaved within each round, the median step (milliseconds) over the rounds reported with the ratios torch over
kernels. The ratios are what ``hsd_opt.engine.kernels.TORCH_PATH_SLOWDOWN`` says in the warning.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.entry import at_least, count, run
from hsd_opt.engine.layered import LayeredLM
from hsd_opt.engine.quantized import QuantizedLM
from hsd_opt.models.loading import load_model
from hsd_opt.prompts import encode_prompt, load_prompts


def step_ms(eng, ids: torch.Tensor, steps: int) -> float:
    """Median decode step of ``eng`` (milliseconds) after a 64-token prefill of ``ids``."""
    st = eng.new_state(256)
    eng.append(st, ids[:64])
    eng.advance(st, eng.n_layers)
    out = []
    for i in range(steps):
        t0 = time.perf_counter()
        eng.append(st, ids[64 + i:65 + i])
        eng.advance(st, eng.n_layers)
        eng.greedy_ids(st, eng.n_layers, st.n - 1, st.n)
        out.append(time.perf_counter() - t0)
    return statistics.median(out[2:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=count, default=4)
    ap.add_argument("--steps", type=at_least(3), default=16)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    loaded = load_model("smollm2-135m")
    text = [t for p in load_prompts().texts for t in encode_prompt(loaded.tokenizer, p)]
    ids = torch.tensor(text[:64 + a.steps])
    engines = {"f32_kernels": LayeredLM(loaded.model, kernels=True),
               "f32_torch": LayeredLM(loaded.model, kernels=False),
               "int4_kernels": QuantizedLM(loaded.model, bits=4, kernels=True),
               "int4_torch": QuantizedLM(loaded.model, bits=4, kernels=False)}
    runs: dict[str, list[float]] = {k: [] for k in engines}
    started = time.strftime("%Y-%m-%d %H:%M")
    for _ in range(a.rounds):
        for k, eng in engines.items():
            runs[k].append(step_ms(eng, ids, a.steps))
    med = {k: statistics.median(v) for k, v in runs.items()}
    report = {"started": started, "threads": torch.get_num_threads(), "step_ms_median": med, "runs": runs,
              "torch_over_kernels": {"f32": med["f32_torch"] / med["f32_kernels"],
                                     "int4": med["int4_torch"] / med["int4_kernels"]}}
    print(json.dumps({k: report[k] for k in ("step_ms_median", "torch_over_kernels")}, indent=1))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = a.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(a.out)


if __name__ == "__main__":
    run(main)
