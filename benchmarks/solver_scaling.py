"""Time the dp solver on random pools: K = 80 drafters with tmax = 32 (a LayerSkip-70B-sized pool of early
exits), K = 32 with tmax = 15, and a grid of K and tmax. Prints a table and writes
``benchmarks/results/solver_scaling.json``.

Run: ``.venv/bin/python -m benchmarks.solver_scaling [--repeats 5]``

Times are wall seconds, median over repeats: ``build`` = the shared arrays (gamma tables, edge costs),
``dp`` = the Bellman recursion, ``total`` = ``hsd_opt.solver.api.optimum(profile, tmax)`` end to end
(``build + dp``), ``ranked5`` = the top-5 distinct hierarchies used for a plan's alternatives, ``solve`` =
``hsd_opt.solver.api.solve(profile, tmax, min_gain=0.03)`` end to end, what ``hsd solve`` runs with its default
flags once the profile is loaded (build, dp, the optima per depth for the min-gain rule, the ranked
alternatives and the baselines). ``ranked5`` and ``solve`` are timed on the two headline pools only.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.entry import count, run
from hsd_opt.formats import profile_from_dict
from hsd_opt.solver.api import optimum, solve
from hsd_opt.solver.dp import dp, dp_ranked
from hsd_opt.solver.instance import build_instance


def random_pool(K: int, seed: int = 0):
    """K drafters (think: early exits at increasing depth) and a target of cost 1 s; acceptance to a verifier
    grows with the cost ratio, with noise; every pair measured."""
    rng = np.random.default_rng(seed)
    cost = np.sort(rng.uniform(0.01, 0.95, K))
    names = [f"e{i}" for i in range(K)] + ["target"]
    allc = list(cost) + [1.0]
    acc = {}
    for i in range(K):
        acc[names[i]] = {names[j]: float(np.clip(0.3 + 0.65 * (allc[i] / allc[j]) ** 0.35 + rng.normal(0, 0.03),
                                                 0.0, 1.0)) for j in range(i + 1, K + 1)}
    d = {"format": "hsd-profile/1", "target": "target",
         "models": [{"name": n, "cost": float(c)} for n, c in zip(names, allc)], "acceptance": acc}
    return profile_from_dict(d)[0]


def timeit(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def measure(K: int, tmax: int, repeats: int, ranked: bool) -> dict:
    prof = random_pool(K, seed=K * 1000 + tmax)
    inst = build_instance(prof, tmax)
    row = {"K": K, "tmax": tmax,
           "build_s": timeit(lambda: build_instance(prof, tmax), repeats),
           "dp_s": timeit(lambda: dp(inst), repeats),
           "total_s": timeit(lambda: optimum(prof, tmax), repeats)}
    sol = dp(inst)
    row["levels"] = len(sol.hierarchy)
    row["speedup"] = 1.0 / sol.latency
    if ranked:
        row["ranked5_s"] = timeit(lambda: dp_ranked(inst, 5), max(1, repeats // 3))
        row["solve_s"] = timeit(lambda: solve(prof, tmax, min_gain=0.03), max(1, repeats // 3))
        row["solve_levels"] = len(solve(prof, tmax, min_gain=0.03).hierarchy)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=count, default=5)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "solver_scaling.json"))
    args = ap.parse_args()
    headline = [measure(80, 32, args.repeats, True), measure(32, 15, args.repeats, True)]
    grid = [measure(K, T, args.repeats, False) for K in (8, 16, 32, 64, 80, 128) for T in (8, 16, 32, 64)]
    print(f"{'K':>4} {'tmax':>5} {'build s':>9} {'dp s':>9} {'total s':>9} {'ranked5 s':>10} {'solve s':>9} "
          f"{'levels':>6} {'speedup':>8}")
    for r in headline + [None] + grid:
        if r is None:
            print("-" * 78)
            continue
        rk = f"{r['ranked5_s']:10.4f}" if "ranked5_s" in r else " " * 10
        sv = f"{r['solve_s']:9.4f}" if "solve_s" in r else " " * 9
        print(f"{r['K']:>4} {r['tmax']:>5} {r['build_s']:9.4f} {r['dp_s']:9.4f} {r['total_s']:9.4f} {rk} {sv} "
              f"{r['levels']:>6} {r['speedup']:8.3f}")
    out = {"what": "dp solver wall time (median seconds) on random pools, see benchmarks/solver_scaling.py",
           "machine": {"platform": platform.platform(), "python": platform.python_version(),
                       "cpus": os.cpu_count(), "numpy": np.__version__},
           "repeats": args.repeats, "headline": headline, "grid": grid}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    from hsd_opt.jsonio import write_json
    write_json(args.out, out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run(main)
