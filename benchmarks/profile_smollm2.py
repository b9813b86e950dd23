"""Time `hsd profile --model smollm2-135m` with its default settings, then check `hsd solve` accepts the profile.

Usage: .venv/bin/python benchmarks/profile_smollm2.py [--out /tmp/profile.json] [-- extra hsd profile flags]
Writes benchmarks/results/profile_smollm2.json: wall time, machine load, the acceptance-per-layer table
(acceptance / greedy agreement of every drafter against the target, and of layer l against layer l+1) and costs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/hsd-profile-smollm2.json")
    ap.add_argument("--plan", default="/tmp/hsd-plan-smollm2.json")
    ap.add_argument("--results", default=str(REPO / "benchmarks" / "results" / "profile_smollm2.json"))
    ap.add_argument("extra", nargs="*", help="extra flags for hsd profile (after --)")
    a = ap.parse_args()
    load0 = os.getloadavg()
    cmd = [sys.executable, "-m", "hsd_opt", "profile", "--model", "smollm2-135m", "--out", a.out, *a.extra]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO)
    wall = time.perf_counter() - t0
    load1 = os.getloadavg()
    t1 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "hsd_opt", "solve", "--profile", a.out, "--tmax", "15", "--out", a.plan],
                   check=True, cwd=REPO)
    solve_wall = time.perf_counter() - t1
    prof = json.loads(Path(a.out).read_text())
    plan = json.loads(Path(a.plan).read_text())
    tgt = prof["target"]
    acc, agr, ci = prof["acceptance"], prof["greedy_agreement"], prof["ci95"]
    rows = []
    for m in prof["models"]:
        n = m["name"]
        rows.append({"name": n, "kind": m["kind"], "layer": m.get("layer"), "cost_ms": round(m["cost"] * 1e3, 3),
                     "accept_vs_target": None if n == tgt else round(acc.get(n, {}).get(tgt, float("nan")), 4),
                     "ci95": ci.get(n, {}).get(tgt), "greedy_vs_target":
                         None if n == tgt else round(agr.get(n, {}).get(tgt, float("nan")), 4)})
    rows.sort(key=lambda r: (r["layer"] is None, r["layer"] or 0))
    res = {"command": " ".join(["hsd", "profile", "--model", "smollm2-135m", "--out", a.out, *a.extra]),
           "wall_seconds": round(wall, 1), "solve_wall_seconds": round(solve_wall, 2),
           "load_average_before": load0, "load_average_after": load1, "cpus": os.cpu_count(),
           "platform": platform.platform(), "provenance": prof["provenance"], "table": rows,
           "cost_curve_target_ms": [round(x * 1e3, 3) for x in prof["cost_curve"][tgt]],
           "plan": {k: plan[k] for k in ("hierarchy", "budgets", "expected_latency", "expected_speedup")}}
    Path(a.results).parent.mkdir(parents=True, exist_ok=True)
    Path(a.results).write_text(json.dumps(res, indent=2) + "\n")
    print(f"hsd profile: {wall:.1f} s wall; hsd solve: {solve_wall:.2f} s; plan {res['plan']}")


if __name__ == "__main__":
    main()
