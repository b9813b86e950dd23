"""A prompt's pass on the kernels against the torch path: where ``PREFILL_ON_TORCH_FROM`` (8-lane kernels) and
``PREFILL_ON_TORCH_FROM_WIDE`` (16-lane kernels, AVX-512) come from.

    .venv/bin/python -m benchmarks.prefill_path [--lengths 8,16,24,32,40,48,64,96] [--rounds 7] [--chunked] \
        [--out benchmarks/results/prefill_path.json]

The embedded model's float32 target prefills the first ``m`` tokens of the suite's text (every layer, from
position 0, a fresh state) on the C kernels and on the torch path (MKL's blocked GEMMs), the two interleaved
within each round; reported per length: the median over the rounds (milliseconds) and torch over kernels.
The threshold of this machine's kernels (``KernelPath.prefill_on_torch_from``) is the first length from which the
torch path is faster. ``--chunked``: each prompt in the passes the runtime computes it in (``prompt_pass_ends``:
at most ``PREFILL_CHUNK`` positions each, the later ones attending over the earlier), every pass on one path.
``--within A,B``: instead, the runtime's own prefill (``Decoding.prefill``, each pass on the path the engine
chooses) with the kernels' context for prompt passes (``KernelPath.prefill_within``) set to ``A`` and to ``B``
positions in turn, reported as ``A`` over ``B``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.entry import count, counts, run, whole
from hsd_opt.engine import kernels
from hsd_opt.engine.layered import LayeredLM
from hsd_opt.jsonio import write_json
from hsd_opt.models.loading import load_model
from hsd_opt.prompts import encode_prompt, load_prompts, text_of_length
from hsd_opt.runtime.decode import prompt_pass_ends


def prefill_ms(eng: LayeredLM, ids: torch.Tensor, on_kernels: bool, chunked: bool = False) -> float:
    """A prompt over ``ids`` (milliseconds) on the kernels or on the torch path: one pass, or (``chunked``) the
    runtime's passes."""
    saved = (kernels.MAX_PASS, eng._kernels.prefill_on_torch_from, kernels.PREFILL_ON_KERNELS_WITHIN,
             kernels.PREFILL_ON_KERNELS_WITHIN_WIDE)
    if on_kernels:  # every pass on the kernels, in the calls the runtime makes (each at most BATCH_ROWS rows)
        eng._kernels.prefill_on_torch_from = kernels.PREFILL_ON_KERNELS_WITHIN = 10**6
        kernels.PREFILL_ON_KERNELS_WITHIN_WIDE = 10**6
    else:
        kernels.MAX_PASS, eng._kernels.prefill_on_torch_from = 0, 0
    try:
        n = ids.numel()
        st = eng.new_state(n + 1)
        st.prompt = n
        t0 = time.perf_counter()
        a = 0
        for b in (prompt_pass_ends(n, 0) if chunked else [n]):
            eng.append(st, ids[a:b])
            eng.advance(st, eng.n_layers)
            a = b
        return (time.perf_counter() - t0) * 1e3
    finally:
        (kernels.MAX_PASS, eng._kernels.prefill_on_torch_from, kernels.PREFILL_ON_KERNELS_WITHIN,
         kernels.PREFILL_ON_KERNELS_WITHIN_WIDE) = saved


def compare_within(eng: LayeredLM, text: list[int], lengths: list[int], limits: list[int], rounds: int,
                   out: str | None) -> None:
    """The runtime's prefill of a prompt of each length (seconds, median over the rounds) with the kernels'
    context for prompt passes at each of ``limits`` in turn (the order alternating by round)."""
    from hsd_opt.runtime.decode import HSD, Level

    hsd = HSD([Level("target", eng, eng.n_layers)], [])
    rows = []
    for m in lengths:
        ids = text_of_length(text, m)
        got: dict[int, list[float]] = {lim: [] for lim in limits}
        for r in range(rounds):
            for lim in (limits if r % 2 == 0 else limits[::-1]):
                kernels.PREFILL_ON_KERNELS_WITHIN = kernels.PREFILL_ON_KERNELS_WITHIN_WIDE = lim
                d = hsd.start(ids, 1)
                t0 = time.perf_counter()
                d.prefill()
                got[lim].append(time.perf_counter() - t0)
                d.close()
        med = {lim: statistics.median(v) for lim, v in got.items()}
        a, b = limits
        rows.append({"positions": m, **{f"within_{lim}_s": round(med[lim], 3) for lim in limits},
                     "first_over_second": round(med[a] / med[b], 2)})
        print(f"{m:5d} positions: within {a} {med[a]:.3f} s, within {b} {med[b]:.3f} s, {med[a] / med[b]:.2f}",
              flush=True)
    if out:
        report = {"date": time.strftime("%Y-%m-%d %H:%M"), "threads": torch.get_num_threads(), "rounds": rounds,
                  "simd": eng._kernels.lib.hsd_simd(), "within": limits, "lengths": rows}
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        write_json(out, report, indent=1)


def within_pair(text: str) -> list[int]:
    """``--within A,B``: two numbers of positions (0 or more)."""
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected two numbers of positions A,B, got {text!r}")
    return [whole(p) for p in parts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=counts, default="8,16,24,32,40,48,64,96")
    ap.add_argument("--rounds", type=count, default=7)
    ap.add_argument("--chunked", action="store_true", help="the runtime's passes (at most PREFILL_CHUNK each), "
                    "not one pass")
    ap.add_argument("--within", type=within_pair, default=None, help="A,B: the runtime's prefill with prompt "
                    "passes on the kernels within A and within B positions")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    loaded = load_model("smollm2-135m")
    eng = LayeredLM(loaded.model)
    if not eng.uses_kernels:
        raise SystemExit("the kernels are unavailable here: nothing to compare")
    text = [t for p in load_prompts().texts for t in encode_prompt(loaded.tokenizer, p)] * 20
    if a.within:
        return compare_within(eng, text, a.lengths, a.within, a.rounds, a.out)
    rows = []
    for m in a.lengths:
        ids = torch.tensor(text_of_length(text, m))
        got: dict[str, list[float]] = {"kernels": [], "torch": []}
        for r in range(a.rounds):
            for path in (("kernels", "torch") if r % 2 else ("torch", "kernels")):
                got[path].append(prefill_ms(eng, ids, path == "kernels", a.chunked))
        k, t = statistics.median(got["kernels"]), statistics.median(got["torch"])
        rows.append({"positions": m, "kernels_ms": round(k, 1), "torch_ms": round(t, 1),
                     "torch_over_kernels": round(t / k, 2)})
        print(f"{m:4d} positions: kernels {k:7.1f} ms  torch {t:7.1f} ms  torch/kernels {t / k:.2f}", flush=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "threads": torch.get_num_threads(), "rounds": a.rounds,
              "chunked": a.chunked, "prefill_on_torch_from": eng._kernels.prefill_on_torch_from,
              "simd": eng._kernels.lib.hsd_simd(), "lengths": rows}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        write_json(a.out, report, indent=1)


if __name__ == "__main__":
    run(main)
