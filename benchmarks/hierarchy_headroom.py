"""How much a hierarchy could gain over the best single draft on a measured profile, under three what-ifs.

    .venv/bin/python -m benchmarks.hierarchy_headroom --profile out/profile.json [--tmax 15] [--json OUT]

A hierarchy beats the best single draft only by making its drafter's own drafting cheaper: something below the
drafter must propose tokens the drafter accepts, and the drafter must check a block for about the price of one
step. This script asks the solver (``hsd_opt.solver.api.solve``, the exact optimum, no ``--min-gain``) how the
ratio *best single draft latency / plan latency* moves when the profile is changed in one way at a time:

1. ``rate``: every abstaining token drafter (``draft_rate`` below 1, e.g. ``lookup``) proposes more often (its
   share of positions and of rounds at every budget at least ``rate``), with the acceptance and cost it was
   measured at.
2. ``free``: a drafter of no cost that proposes at every position is added, with acceptance ``alpha`` against
   every model that can verify except the target, and ``alpha`` times the best single draft's own acceptance
   against the target (it agrees with the target through the drafter).
3. ``flat``: every drafter that can verify checks a block of up to ``k`` positions for the price of one step (as
   on a device where a pass is bound by reading the weights), including the catch-up pass.

Nothing is measured here: every figure is the latency model's prediction on the given profile
(`docs/design.md`), so read it as what the pool and the machine's cost structure allow, not as a speed.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from benchmarks.entry import count, run
from hsd_opt.errors import HsdError
from hsd_opt.formats import profile_from_dict
from hsd_opt.jsonio import write_json
from hsd_opt.solver.api import solve

RATES = (0.5, 0.75, 1.0)
ALPHAS = (0.3, 0.5, 0.66, 0.8, 0.9)
FLAT_POSITIONS = (2, 4, 8, 16)
FREE = "free-drafter"


def _case(raw: dict, tmax: int, change: Callable[[dict], None] | None) -> dict[str, Any]:
    d = copy.deepcopy(raw)
    if change is not None:
        change(d)
    plan = solve(profile_from_dict(d, "<what-if>")[0], tmax, top=1, min_gain=0.0)
    single = plan.baselines.get("best_single_draft")
    out = {"plan": plan.hierarchy, "budgets": plan.budgets, "plan_ms_per_token": plan.expected_latency * 1e3}
    if single is not None:
        out.update(single_draft=single["hierarchy"], single_draft_budgets=single["budgets"],
                   single_draft_ms_per_token=single["expected_latency"] * 1e3,
                   plan_over_single_draft=single["expected_latency"] / plan.expected_latency)
    return out


def _set_rate(rate: float) -> Callable[[dict], None]:
    def change(d: dict) -> None:
        for m in d["models"]:
            if m.get("draft_rate", 1.0) < 1.0:
                m["draft_rate"] = max(m["draft_rate"], rate)
                if m["draft_rate"] >= 1.0:                 # a drafter that never abstains has no shares per budget
                    m.pop("draft_rate_by_budget", None)
                elif m.get("draft_rate_by_budget"):        # the share of rounds at every budget too
                    m["draft_rate_by_budget"] = [max(f, rate) for f in m["draft_rate_by_budget"]]
    return change


def _add_free(alpha: float, a_drafter_target: float) -> Callable[[dict], None]:
    def change(d: dict) -> None:
        d["models"].insert(0, {"name": FREE, "kind": "ngram_context", "cost": 1e-9, "can_verify": False,
                               "config": {"kind": "ngram_context", "name": FREE}})
        acc = {m["name"]: alpha for m in d["models"] if m.get("can_verify") and m["name"] != d["target"]}
        acc[d["target"]] = alpha * a_drafter_target
        d["acceptance"][FREE] = acc
    return change


def _flatten(k: int) -> Callable[[dict], None]:
    def flat(curve: list[float]) -> list[float]:
        return [curve[0] if i < k else max(v, curve[0]) for i, v in enumerate(curve)]

    def change(d: dict) -> None:
        names = {m["name"] for m in d["models"] if m.get("can_verify") and m["name"] != d["target"]}
        for costs in [d] + d.get("context_costs", []):
            curves = costs.get("cost_curve", {})
            for name in names & set(curves):
                curves[name] = flat(curves[name])
            for verifier in names & set(costs.get("verify_cost", {})):
                row = costs["verify_cost"][verifier]
                for drafter, c in row.items():
                    if isinstance(c, list):
                        row[drafter] = flat(c)
    return change


def _row(label: str, r: dict) -> str:
    plan = " <- ".join(reversed([f"{n} (T={t})" for n, t in zip(r["plan"], r["budgets"])] + [r["plan"][-1]]))
    ratio = r.get("plan_over_single_draft")
    return (f"  {label:<22} {r['plan_ms_per_token']:7.2f} ms/token  {ratio:5.3f}x the best single draft"
            f" ({r.get('single_draft_ms_per_token', float('nan')):.2f})  {plan}")


def _usage_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True, help="hsd-profile/1 JSON")
    ap.add_argument("--tmax", type=count, default=15, help="largest budget (tokens), as for hsd solve")
    ap.add_argument("--json", help="write the what-ifs here (JSON, atomically)")
    a = ap.parse_args()
    try:
        raw = json.loads(Path(a.profile).read_text(encoding="utf-8"))
        base = _case(raw, a.tmax, None)
    except (OSError, ValueError, HsdError) as e:
        _usage_error(f"{a.profile}: {e}")
    if "single_draft" not in base:
        _usage_error(f"{a.profile}: no single draft in this profile; nothing to compare")
    drafter = base["single_draft"][0]
    profile = profile_from_dict(raw, a.profile)[0]
    a_dt = profile.accept(drafter, profile.target) or 0.0
    report: dict[str, Any] = {"profile": os.fspath(a.profile), "tmax": a.tmax, "as_measured": base,
                              "rate": {}, "free": {}, "flat": {}}
    print(f"{a.profile}: the best single draft is {drafter} (acceptance {a_dt:.3f} against {profile.target})")
    print(_row("as measured", base))
    print("token drafters that abstain propose at a share of positions of at least:")
    for rate in RATES:
        report["rate"][str(rate)] = r = _case(raw, a.tmax, _set_rate(rate))
        print(_row(f"{rate:.2f}", r))
    print(f"a drafter of no cost proposing everywhere, acceptance alpha against the drafters (alpha x {a_dt:.3f}"
          f" against {profile.target}):")
    for alpha in ALPHAS:
        report["free"][str(alpha)] = r = _case(raw, a.tmax, _add_free(alpha, a_dt))
        print(_row(f"alpha {alpha:.2f}", r))
    print("the drafters check up to k positions for the price of one step:")
    for k in FLAT_POSITIONS:
        report["flat"][str(k)] = r = _case(raw, a.tmax, _flatten(k))
        print(_row(f"k = {k}", r))
    if a.json:
        write_json(a.json, report)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    run(main)
