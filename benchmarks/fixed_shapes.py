"""Fixed-shape passes (``hsd_opt.engine.fixed``) on this machine's torch path: what they fix and what they cost.

    python -m benchmarks.fixed_shapes [--prompts 12] [--new 40] [--timing-config qwen2.5-coder-0.5b]
        [--device cpu] [--out benchmarks/results/fixed_shapes_cpu.json]

- ``lossless``: greedy speculative decoding over a bfloat16 model whose logits are not peaked (the tiny
  configuration, random weights, the head scaled by 1: near-ties are common) against the target's own greedy
  loop, on ``--prompts`` prompts of 8 random tokens, ``--new`` tokens each, with two hierarchies (an exit under the
  head with 5 drafts; two exits with 2 and 3): how many generations differ from the target's own tokens, at each
  pass's own shapes (``own_shapes``) and at fixed shapes (``fixed``);
- ``timing``: a decode step and a verify pass over 4 positions of ``--timing-config`` (random weights in
  ``--timing-dtype``) on the torch path at a 128-token context, milliseconds (median of ``--repeats``), at each
  pass's own shapes and at fixed shapes: what computing 64 rows for one costs on this device.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from benchmarks.entry import count, run
from hsd_opt.engine.layered import LayeredLM
from hsd_opt.engine.timing import median_pass
from hsd_opt.models.random_weights import TINY, config_of, random_model
from hsd_opt.runtime.decode import HSD, Level


def engine(model, fixed_shapes: bool) -> LayeredLM:
    eng = LayeredLM(model, kernels=False)
    if fixed_shapes:
        eng.fix_shapes()
    return eng


def lossless(device: str, prompts: int, new: int) -> dict:
    """Generations (of ``2 * prompts``) whose greedy tokens differ from the target's own, per way of running."""
    model = random_model(TINY, device, torch.bfloat16, peak=1.0, seed=0)
    out = {}
    for name, fixed_shapes in (("own_shapes", False), ("fixed", True)):
        eng = engine(model, fixed_shapes)
        g = torch.Generator().manual_seed(0)
        differ = 0
        for _ in range(prompts):
            p = torch.randint(3, eng.vocab_size, (8,), generator=g).tolist()
            want = HSD([Level("t", eng, 4)], []).generate(p, new).token_ids
            for levels, budgets in (([Level("l1", eng, 1)], [5]), ([Level("l1", eng, 1), Level("l2", eng, 2)], [2, 3])):
                differ += HSD([*levels, Level("t", eng, 4)], budgets).generate(p, new).token_ids != want
        out[name] = {"generations": 2 * prompts, "differ_from_target": differ}
    return out


def timing(config: str, device: str, dtype: torch.dtype, repeats: int, context: int = 128) -> dict:
    """Step and 4-position pass, milliseconds, at own and fixed shapes."""
    model = random_model(config_of(config, "--timing-config"), device, dtype)
    out = {}
    for name, fixed_shapes in (("own_shapes", False), ("fixed", True)):
        eng = engine(model, fixed_shapes)
        L = eng.n_layers
        g = torch.Generator().manual_seed(1)
        st = eng.new_state(context + 16)
        eng.append(st, torch.randint(3, eng.vocab_size, (context,), generator=g))
        eng.advance(st, L)
        out[name] = {f"{t}_ms": median_pass(eng, [(st, torch.randint(3, eng.vocab_size, (t,), generator=g))], L,
                                            repeats) * 1e3 for t in (1, 4)}
    out["fixed_step_over_own"] = out["fixed"]["1_ms"] / out["own_shapes"]["1_ms"]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=count, default=12)
    ap.add_argument("--new", type=count, default=40)
    ap.add_argument("--timing-config", default="qwen2.5-coder-0.5b")
    ap.add_argument("--timing-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=count, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "fixed_shapes_cpu.json"))
    a = ap.parse_args(argv)
    from hsd_opt.jsonio import write_json

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    report = {"what": "fixed-shape passes on the torch path (benchmarks/fixed_shapes.py)",
              "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "device": a.device, "cpu": cpu,
              "torch": torch.__version__, "threads": torch.get_num_threads()}
    report["lossless"] = lossless(a.device, a.prompts, a.new)
    report["timing"] = {"config": a.timing_config, "dtype": a.timing_dtype,
                        **timing(a.timing_config, a.device, getattr(torch, a.timing_dtype), a.repeats)}
    write_json(Path(a.out), report)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    run(main)
