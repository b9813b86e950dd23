"""A/B of two versions of ``kernels.c`` at the level of their matrix products, in one process: ``mat_rows`` over the
exact int4 form (kind q4f, the float32 target's layers) in the shapes of the embedded model's 210 layer matrices,
each version built into its own library and the two called in turn, pass after pass (A then B, then B then A), so
that a shared machine's slow spells hit both alike. A change of layout is measured too: the codes are random bytes
in whatever layout each version reads (their values, not the model's, do not change the time).

    .venv/bin/python -m benchmarks.mat_rows_ab --baseline /tmp/base.c [--candidate hsd_opt/engine/kernels.c] \\
        [--variant avx2] [--positions 1-8] [--passes 40] [--distinct-layers 30] [--threads 2] [--out FILE]

``--baseline``: another ``kernels.c`` (``git show HEAD~1:hsd_opt/engine/kernels.c > /tmp/base.c``). ``--variant``:
the kernel variant both are built for (default: the one this CPU loads; a narrower one measures it on a wider
host). ``--distinct-layers D``: the 30 layers' matrices are D distinct sets repeated (30: every weight from memory, as
a decode step reads them; 1: one layer's 2.2 MB, from the caches). Each pass runs every matrix once on
``--threads`` OpenMP threads, rows shared as the engine shares them. Reported per number of positions: the median
over passes of candidate / baseline (below 1: faster) with its quartiles, each library's median pass (ms), and
whether both computed the same outputs bit for bit (a version that changes an element's operations is not a tiling
change). Two builds of the same source differ by a few percent (where the code lands); a small gain is a gain when
it holds with the versions given the other way round.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.entry import at_least, count, run
from hsd_opt.engine import kernels, variants
from hsd_opt.engine.variants import host
from hsd_opt.errors import HsdError

HERE = Path(__file__).resolve().parents[1]
SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))  # q k v o gate up down
LAYERS = 30
MAX_POSITIONS = 8

# The program each version is built into: its kernels.c included whole, a setup that makes the matrices and a pass.
DRIVER = r"""
#include KERNELS
static hsd_mat mats[LAYERS * 7];
static unsigned long long rng = 88172645463325252ULL;
static unsigned rnd(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return (unsigned)rng; }
static uint16_t half(float f) { _Float16 h = (_Float16)f; uint16_t u; memcpy(&u, &h, 2); return u; }
int ab_setup(int distinct, const int *shapes) {
    for (int l = 0; l < LAYERS; l++)
        for (int j = 0; j < 7; j++) {
            if (l >= distinct) { mats[l * 7 + j] = mats[(l % distinct) * 7 + j]; continue; }
            const int rows = shapes[2 * j], cols = shapes[2 * j + 1], G = cols / 32;
            /* codes: blocks of 4 rows by pairs of groups (the largest layout any version reads), random bytes */
            const size_t nb = (size_t)((rows + 3) / 4) * ((G + 1) / 2) * 128, nf = (size_t)rows * G;
            uint8_t *w = malloc(nb);
            uint16_t *s = malloc(2 * nf), *z = malloc(2 * nf);
            if (!w || !s || !z) return 1;
            for (size_t i = 0; i < nb; i++) w[i] = (uint8_t)rnd();
            for (size_t i = 0; i < nf; i++) { s[i] = half(0.01f * (1 + rnd() % 7)); z[i] = half(-0.05f * (rnd() % 5)); }
            hsd_mat A = {0};
            A.type = HSD_Q4F; A.rows = rows; A.cols = cols; A.w = w; A.scale = s; A.zero = z;
            mats[l * 7 + j] = A;
        }
    return 0;
}
void ab_pass(int m, const float *x, float *y) {
    for (int k = 0; k < LAYERS * 7; k++) {
        const hsd_mat *A = &mats[k];
#pragma omp parallel
        {
            float buf[4 * 1536 * 2];
            int a, b;
            share(A->rows, rows_align(A), &a, &b);
            mat_rows(A, x, A->cols, NULL, m, y, A->rows, a, b, 0, buf);
        }
    }
}
"""


def parse_positions(text: str) -> list[int]:
    """``"1-8"`` or ``"1,2,4"`` -> the pass sizes (1 .. 8 positions)."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--positions: {text!r} is not a list of numbers or ranges") from None
        if not 1 <= a <= b <= MAX_POSITIONS:
            raise argparse.ArgumentTypeError(f"--positions: {part.strip()!r} is not within 1..{MAX_POSITIONS}")
        out.extend(range(a, b + 1))
    return sorted(set(out))


def build(source: Path, variant: variants.Variant, out: Path) -> ctypes.CDLL:
    """``source`` (a kernels.c) with the driver, built for ``variant`` into ``out`` as the engine builds its
    library (:func:`hsd_opt.engine.kernels.build`: the same flags and OpenMP runtime) and loaded."""
    driver = out.with_suffix(".c")
    driver.write_text(f'#define KERNELS "{source.resolve()}"\n#define LAYERS {LAYERS}\n{DRIVER}')
    cc = kernels.compiler()
    if cc is None:
        sys.exit("error: no C compiler found: install gcc or clang, or set CC")
    try:
        kernels.build(cc, out, variant, source=driver)
    except HsdError as e:
        sys.exit(f"error: building {source} for {variant.name}: {e}")
    lib = ctypes.CDLL(str(out))
    lib.ab_setup.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    lib.ab_pass.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="the kernels.c to compare against")
    ap.add_argument("--candidate", type=Path, default=HERE / "hsd_opt" / "engine" / "kernels.c")
    ap.add_argument("--variant", default=None, help="the kernel variant both are built for (default: this CPU's)")
    ap.add_argument("--positions", type=parse_positions, default=parse_positions("1-8"))
    ap.add_argument("--passes", type=at_least(2), default=40,
                    help="timed passes of each library per number of positions")
    ap.add_argument("--distinct-layers", type=int, default=LAYERS, choices=range(1, LAYERS + 1), metavar="1..30")
    ap.add_argument("--threads", type=count, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write the report (JSON) here")
    a = ap.parse_args(argv)
    for flag, path in (("--baseline", a.baseline), ("--candidate", a.candidate)):
        if not path.is_file():
            ap.error(f"{flag}: no such file: {path}")
    try:
        variant = variants.BY_NAME[a.variant] if a.variant else variants.choose()[0]
    except KeyError:
        ap.error(f"--variant: no such kernel variant {a.variant!r} (one of {', '.join(variants.BY_NAME)})")
    lacks = variants.missing(variant, variants.cpu_features())
    if lacks:
        ap.error(f"--variant {variant.name}: this CPU lacks {', '.join(lacks)}")
    os.environ["OMP_NUM_THREADS"] = str(a.threads)        # read once, when the OpenMP runtime loads

    import numpy as np

    shapes = (ctypes.c_int * 14)(*[v for s in SHAPES for v in s])
    with tempfile.TemporaryDirectory() as tmp:
        libs = {name: build(src, variant, Path(tmp) / f"{name}.so")
                for name, src in (("baseline", a.baseline), ("candidate", a.candidate))}
        for name, lib in libs.items():
            if lib.ab_setup(a.distinct_layers, shapes):
                sys.exit(f"error: out of memory making the {name}'s matrices")
        rng = np.random.default_rng(0)
        width = max(c for _, c in SHAPES) * MAX_POSITIONS
        x = rng.uniform(-1, 1, width).astype(np.float32)
        ys = {name: np.zeros(width, np.float32) for name in libs}
        rows = []
        for m in a.positions:
            times: dict[str, list[float]] = {"baseline": [], "candidate": []}
            for name, lib in libs.items():                # one untimed pass each: caches, threads
                lib.ab_pass(m, x.ctypes.data, ys[name].ctypes.data)
            for i in range(a.passes):
                order = ("baseline", "candidate") if i % 2 == 0 else ("candidate", "baseline")
                for name in order:
                    t0 = time.perf_counter()
                    libs[name].ab_pass(m, x.ctypes.data, ys[name].ctypes.data)
                    times[name].append(time.perf_counter() - t0)
            ratios = sorted(c / b for b, c in zip(times["baseline"], times["candidate"]))
            q = statistics.quantiles(ratios, n=4)
            row = {"positions": m, "ratio": statistics.median(ratios), "ratio_quartiles": [q[0], q[2]],
                   "baseline_ms": 1e3 * statistics.median(times["baseline"]),
                   "candidate_ms": 1e3 * statistics.median(times["candidate"]),
                   "equal": bool(np.array_equal(ys["baseline"], ys["candidate"]))}
            rows.append(row)
            print(f"{m} position(s): candidate / baseline {row['ratio']:.3f} (quartiles {q[0]:.3f}-{q[2]:.3f}), "
                  f"{row['baseline_ms']:.2f} -> {row['candidate_ms']:.2f} ms, outputs "
                  f"{'equal' if row['equal'] else 'DIFFERENT'}", flush=True)
    report = {"what": "mat_rows over the q4f form in SmolLM2-135M's layer shapes (benchmarks/mat_rows_ab.py)",
              "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), "host": host(),
              "variant": variant.name, "threads": a.threads, "passes": a.passes,
              "distinct_layers": a.distinct_layers, "baseline": str(a.baseline), "candidate": str(a.candidate),
              "rows": rows}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        tmp_out = a.out.with_name(a.out.name + ".tmp")
        tmp_out.write_text(json.dumps(report, indent=1) + "\n")
        tmp_out.replace(a.out)
        print(f"wrote {a.out}")
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    run(main)
