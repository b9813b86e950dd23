"""Random small HSD instances for the solver tests (shared by tests/test_solver*.py)."""

from __future__ import annotations

import numpy as np

from hsd_opt.formats import Profile, profile_from_dict


def random_profile(rng: np.random.Generator, n_drafters: int, *, non_verifying: bool = False,
                   verify_cost: bool = False, cost_curve: bool = False, missing: float = 0.2,
                   abstaining: bool = False) -> Profile:
    """A target ``t`` (cost 1.0) and ``n_drafters`` drafters ``d0..`` with random costs (seconds),
    acceptances (some pairs missing), optionally drafters that cannot verify (``abstaining``: most of those
    get a ``draft_rate`` below 1), pair verify costs (scalars or curves) and cost curves. Models are listed
    in random order (the solver sorts by cost itself)."""
    costs = rng.uniform(0.005, 0.9, n_drafters)
    names = [f"d{i}" for i in range(n_drafters)]
    models = [{"name": n, "kind": "model", "cost": float(c),
               "can_verify": bool(not (non_verifying or abstaining) or rng.random() > 0.4)}
              for n, c in zip(names, costs)]
    if abstaining:
        for m in models:
            if not m["can_verify"] and rng.random() < 0.8:
                m["draft_rate"] = float(rng.uniform(0.05, 0.95))
    models.append({"name": "t", "kind": "target", "cost": 1.0, "can_verify": True})
    rng.shuffle(models)
    allc = {m["name"]: m["cost"] for m in models}
    acc: dict = {}
    for lo in names:
        for hi in names + ["t"]:
            if lo == hi or allc[lo] >= allc[hi]:
                continue
            if hi != "t" and rng.random() < missing:
                continue
            if hi == "t" and rng.random() < missing / 2:
                continue
            base = 0.25 + 0.7 * (allc[lo] / allc[hi]) ** 0.3
            acc.setdefault(lo, {})[hi] = float(np.clip(base + rng.normal(0, 0.1), 0.0, 1.0))
    d = {"format": "hsd-profile/1", "target": "t", "models": models, "acceptance": acc}
    if verify_cost:
        vc: dict = {}
        for lo, row in acc.items():
            for hi in row:
                if rng.random() < 0.5:
                    if rng.random() < 0.5:
                        vc.setdefault(hi, {})[lo] = float(allc[hi] * rng.uniform(0.3, 1.2))
                    else:
                        n = int(rng.integers(1, 5))
                        vc.setdefault(hi, {})[lo] = [float(allc[hi] * (1 + 0.1 * k) * rng.uniform(0.5, 1.0))
                                                     for k in range(n)]
        d["verify_cost"] = vc
    if cost_curve:
        cc = {}
        for n in names + ["t"]:
            if rng.random() < 0.6:
                L = int(rng.integers(1, 6))
                cc[n] = [float(allc[n] * (1 + rng.uniform(0, 0.15) * k)) for k in range(L)]
        d["cost_curve"] = cc
    return profile_from_dict(d, "<random>")[0]
