"""A/B of two versions of the decode kernels' source in one process: the embedded target's batched step (one new
token for each of ``B`` sequences, or ``--positions`` tokens each: ``advance_many`` and the batched head) on the
library built from ``--baseline`` (a ``kernels.c``, e.g. ``git show HEAD~1:hsd_opt/engine/kernels.c >
/tmp/base.c``) against the library of this tree, rounds alternating between the two.

    .venv/bin/python -m benchmarks.kernels_ab --baseline /tmp/base.c [--batches 2,4,5,7,8,11] [--rounds 6] \\
        [--steps 7] [--positions 1] [--greedy] [--engine float32|int4|int8] [--level N --max-tokens 64] \\
        [--changes-numerics] \\
        [--out benchmarks/results/kernels_ab.json]

``--positions`` may list several pass sizes (``1,2,3,4,6,8``): every batch size is timed at each, in the same
rounds. ``--greedy`` reads each pass's greedy tokens (the screened head, what greedy decoding and verification
read) instead of the whole head's logits.

``--engine int4`` times the int4 copy of the target instead (``QuantizedLM``, what ``--target-precision int4``
decodes with: the integer path's products) on both libraries; ``--engine int8`` its int8 copy.

``--baseline float32`` compares instead this tree's kernels reading the model's float32 weights in place (the
engine ``HSD_EXACT_INT4=0 HSD_EXACT_INT8=0`` builds) against the same kernels reading them in the exact forms
(``docs/design.md#exact-int4-form``, ``#exact-int8-head``; the same bits); ``--baseline float32-head`` only the LM
head read as float32 against its exact int8 form (the layers in their exact form in both). Both engines take a
prompt on the kernels below the candidate's ``prefill_on_torch_from`` positions, so that they compute the same
numbers.

Both engines read the same weights; every sequence holds one of the suite's chat prompts. Before timing, the
outputs of both libraries are compared at every batch size and must be equal bit for bit (the kernels' tiles may
change which elements are computed together, never an element's operations), or, with ``--changes-numerics``
(a candidate that changes an element's operations), the logits' largest difference and argmax agreement (with
``--level``: how many answers are equal) are reported. Reported: per batch size the median over rounds of each
library's median step (ms), and candidate / baseline per round (below 1: faster). With ``--level N``: N prompts
decoded at most B at a time, whole (prompts included), timed once per round, with tokens/s.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.entry import count, counts, run, whole
from hsd_opt.errors import HsdError

REPO = Path(__file__).resolve().parents[1]


def _engines(a, loaded, float32_baseline: bool) -> tuple[dict, list | None]:
    """The two engines, both on this tree's library, and the exact int4 layers the baseline is to read on the other
    library (None: none). ``--engine float32``: the target, ``candidate`` reading the exact forms where the model has
    them, ``baseline`` the same, or with ``--baseline float32`` / ``float32-head`` the float32 weights in place;
    ``int4`` / ``int8``: the target's quantized copy (its codes, no exact forms) twice."""
    from hsd_opt.engine import layered, stored_copies
    from hsd_opt.engine.layered import LayeredLM
    from hsd_opt.engine.quantized import QuantizedLM

    if a.engine != "float32":
        bits = int(a.engine[3:])
        return {name: QuantizedLM(loaded.model, bits=bits) for name in ("candidate", "baseline")}, None
    engines = {"candidate": LayeredLM(loaded.model)}
    layered.EXACT_INT8 = not float32_baseline
    layered.EXACT_INT4 = a.baseline != "float32"
    engines["baseline"] = b = LayeredLM(loaded.model)
    exact = stored_copies.exact_int4_layers(loaded.model, b.weights) if not float32_baseline else None
    return engines, exact


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True,
                    help="the kernels.c to compare this tree's against, or 'float32': this tree's kernels reading "
                         "the float32 weights instead of their exact forms, or 'float32-head': only the head")
    ap.add_argument("--batches", type=counts, default="2,4,5,7,8,11")
    ap.add_argument("--rounds", type=count, default=6)
    ap.add_argument("--steps", type=count, default=7, help="timed steps per library, batch size and round")
    ap.add_argument("--changes-numerics", action="store_true",
                    help="the candidate changes an element's operations: report how far its logits are from the "
                         "baseline's (largest difference, argmax agreement) instead of requiring equal bits")
    ap.add_argument("--positions", type=counts, default="1",
                    help="new positions per sequence and step, one or a list (a verification pass; 1: a decode "
                         "step); every batch size is timed at each")
    ap.add_argument("--greedy", action="store_true",
                    help="each step reads the greedy tokens (the screened head, as greedy decoding and verification "
                         "do) instead of the whole head's logits")
    ap.add_argument("--engine", choices=("float32", "int4", "int8"), default="float32",
                    help="the engine timed: the float32 target (its exact forms) or its int4 / int8 copy")
    ap.add_argument("--level", type=whole, default=0,
                    help="instead of steps: this many suite prompts, each prefilled and decoded for --max-tokens "
                         "with at most B at a time (generate_many, the target alone, the template's head kept): "
                         "a served level of plain batching, timed whole, once per round")
    ap.add_argument("--max-tokens", type=count, default=64, help="new tokens per prompt with --level")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "kernels_ab.json"))
    a = ap.parse_args()

    import torch

    from hsd_opt.engine import kernels
    from hsd_opt.jsonio import write_json
    from hsd_opt.models.loading import load_model
    from hsd_opt.prompts import encode_prompt, load_prompts

    float32_baseline = a.baseline in ("float32", "float32-head")
    if float32_baseline and a.engine != "float32":
        raise HsdError(f"--baseline {a.baseline} compares the float32 target's weight forms: "
                       f"not with --engine {a.engine}")
    base_src = Path(a.baseline)
    if not float32_baseline and not base_src.is_file():
        raise HsdError(f"--baseline: no file {base_src}")
    batches, positions = a.batches, a.positions
    cases = [(n, p) for n in batches for p in (positions if not a.level else [1])]   # (sequences, positions)
    cc = kernels.compiler()
    if cc is None or kernels.load() is None:
        sys.exit("the kernels are unavailable here (no C compiler, or HSD_KERNELS=0)")
    if not float32_baseline:
        lib_path = Path(tempfile.mkdtemp(prefix="hsd-kernels-ab-")) / "baseline.so"
        kernels.build(cc, lib_path, kernels.info().variant, source=base_src)     # the same instruction set
        base_lib = kernels._bind(ctypes.CDLL(str(lib_path)))
        got = (ctypes.c_long * 6)()
        base_lib.hsd_layout(got)
        if list(got)[1:] != kernels.expected_layout()[1:]:     # the version may differ; the structs may not
            raise HsdError(f"--baseline: its structs are laid out as {list(got)}, this tree's as "
                           f"{kernels.expected_layout()}")

    loaded = load_model("smollm2-135m", device="cpu", dtype="float32")
    engines, exact = _engines(a, loaded, float32_baseline)
    b = engines["baseline"]
    if not float32_baseline:                              # the other library, reading the weights the same way
        b._kernels = kernels.KernelPath(base_lib, b.weights, b.n_heads, b.n_kv, b.head_dim, exact,
                                        engines["candidate"]._kernels.head_mat)
    # prompts take the same path in both (the exact form keeps longer ones on the kernels): only speed may differ
    b._kernels.prefill_on_torch_from = engines["candidate"]._kernels.prefill_on_torch_from
    L = b.n_layers
    texts = load_prompts().texts
    prompts = [encode_prompt(loaded.tokenizer, texts[i % len(texts)]) for i in range(max(batches))]
    states = {}
    for name, eng in engines.items():
        states[name] = []
        for p in prompts:
            st = eng.new_state(len(p) + 8 + max(positions))
            eng.append(st, p)
            eng.advance(st, L)
            states[name].append(st)

    def step(name: str, n: int, positions: int) -> tuple[float, list[torch.Tensor]]:
        eng, sts = engines[name], states[name][:n]
        for st in sts:
            eng.append(st, [42] * positions)
        t0 = time.perf_counter()
        eng.advance_many([(st, L) for st in sts])
        reads = [(st, L, st.n - positions, st.n) for st in sts]
        logits = eng.greedy_ids_many(reads) if a.greedy else eng.logits_many(reads)
        dt = time.perf_counter() - t0
        for st in sts:
            eng.crop(st, st.n - positions)
        return dt, logits

    if a.level:
        from hsd_opt.prompts import template_head
        from hsd_opt.runtime.batch import generate_many
        from hsd_opt.runtime.decode import HSD, Level
        from hsd_opt.runtime.runner import eos_ids

        head = template_head(loaded.tokenizer)
        runners = {}
        for name, eng in engines.items():
            eng.prompt_head = head
            runners[name] = HSD([Level("target", eng, L)], [], eos_ids=eos_ids(loaded))
        level_prompts = [encode_prompt(loaded.tokenizer, texts[i % len(texts)]) for i in range(a.level)]

    def measure(name: str, case: tuple[int, int]) -> tuple[float, list[torch.Tensor]]:
        """Seconds and outputs (logits or greedy tokens of a step, or each answer's token ids with --level) of one
        run of ``case`` (sequences, positions)."""
        n, positions = case
        if not a.level:
            return step(name, n, positions)
        t0 = time.perf_counter()
        res = generate_many(runners[name], level_prompts, a.max_tokens, max_active=n)
        return time.perf_counter() - t0, [torch.tensor(r.token_ids) for r in res]

    numerics = {}
    for case in cases:
        n = case[0]
        pairs = list(zip(measure("baseline", case)[1], measure("candidate", case)[1]))
        if a.changes_numerics and a.level:
            same = sum(x.shape == y.shape and torch.equal(x, y) for x, y in pairs)
            numerics[f"{n}x{case[1]}"] = {"answers_equal": same, "answers": len(pairs)}
            print(f"B={n:2d} answers equal: {same} of {len(pairs)}", flush=True)
        elif a.changes_numerics:
            key = f"{n}x{case[1]}"
            numerics[key] = {"max_abs_diff": max((x - y).abs().max().item() for x, y in pairs),
                             "argmax_equal": all(torch.equal(x.argmax(-1), y.argmax(-1)) for x, y in pairs)}
            print(f"B={n:2d} P={case[1]} logits: largest difference {numerics[key]['max_abs_diff']:.3g}, "
                  f"argmax {'equal' if numerics[key]['argmax_equal'] else 'DIFFERS'}", flush=True)
        elif not all(x.shape == y.shape and torch.equal(x, y) for x, y in pairs):
            sys.exit(f"the two libraries' outputs differ at {n} sequences x {case[1]} positions "
                     "(--changes-numerics to compare anyway)")
    if not a.changes_numerics:
        print(f"outputs equal bit for bit at {batches} sequences x {positions} positions", flush=True)
    tokens = {case: sum(x.numel() for x in measure("candidate", case)[1]) for case in cases} if a.level else {}
    repeats = 1 if a.level else a.steps
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    ms: dict[str, dict[tuple[int, int], list[float]]] = {name: {c: [] for c in cases} for name in engines}
    for r in range(a.rounds):
        for name in (("baseline", "candidate") if r % 2 == 0 else ("candidate", "baseline")):
            for case in cases:
                ms[name][case].append(1e3 * statistics.median(measure(name, case)[0] for _ in range(repeats)))
    rows = []
    for case in cases:
        n = case[0]
        ratio = [c / x for x, c in zip(ms["baseline"][case], ms["candidate"][case])]
        rows.append({"sequences": n, "positions": case[1], "baseline_ms": statistics.median(ms["baseline"][case]),
                     "candidate_ms": statistics.median(ms["candidate"][case]), "candidate_over_baseline": ratio,
                     "ratio_median": statistics.median(ratio)})
        if a.level:
            rows[-1].update(tokens=tokens[case], baseline_tokens_per_s=1e3 * tokens[case] / rows[-1]["baseline_ms"],
                            candidate_tokens_per_s=1e3 * tokens[case] / rows[-1]["candidate_ms"])
        rate = (f" ({rows[-1]['baseline_tokens_per_s']:.1f} / {rows[-1]['candidate_tokens_per_s']:.1f} tok/s)"
                if a.level else "")
        print(f"B={n:2d} P={case[1]} baseline {rows[-1]['baseline_ms']:5.1f} ms  "
              f"candidate {rows[-1]['candidate_ms']:5.1f} ms{rate}  "
              f"candidate/baseline per round {', '.join(f'{x:.2f}' for x in ratio)}", flush=True)
    write_json(a.out, {"started": started, "ended": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "baseline": str(base_src), "engine": a.engine, "rounds": a.rounds, "steps": repeats,
                       "positions": positions,
                       "greedy": a.greedy, "level": a.level and {"prompts": a.level, "max_tokens": a.max_tokens},
                       "torch_threads": torch.get_num_threads(), "rows": rows,
                       "numerics": numerics or "equal bit for bit"})


if __name__ == "__main__":
    run(main)
