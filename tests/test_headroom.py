"""benchmarks/hierarchy_headroom.py: each what-if only makes the pool better, so the solver's optimum can only get
faster; with nothing changed (passes flat over one position) it is the profile's own plan."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def headroom():
    spec = importlib.util.spec_from_file_location("hierarchy_headroom", REPO / "benchmarks" / "hierarchy_headroom.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def raw() -> dict:
    """The measured SmolLM2 profile of the results, cut to its token drafters, two exits and the copies (fast)."""
    d = json.loads((REPO / "tests" / "data" / "profile_lookup.json").read_text())
    keep = {"lookup", "ngram", "layer2", "layer8", "int4", "int8", d["target"]}
    d["models"] = [m for m in d["models"] if m["name"] in keep]
    for section in ("acceptance", "verify_cost"):
        d[section] = {k: {v: x for v, x in row.items() if v in keep} for k, row in d[section].items() if k in keep}
    d["cost_curve"] = {k: c for k, c in d["cost_curve"].items() if k in keep}
    for key in ("greedy_agreement", "counts", "ci95", "acceptance_by_task", "stats"):
        d.pop(key, None)
    return d


def test_flat_over_one_position_is_the_profile_as_measured(headroom, raw):
    base = headroom._case(raw, 8, None)
    same = headroom._case(raw, 8, headroom._flatten(1))
    assert same["plan"] == base["plan"] and same["plan_ms_per_token"] == pytest.approx(base["plan_ms_per_token"])


def test_cheaper_passes_never_slow_the_optimum(headroom, raw):
    lat = [headroom._case(raw, 8, None if k == 1 else headroom._flatten(k))["plan_ms_per_token"] for k in (1, 2, 4, 8)]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(lat, lat[1:]))
    assert lat[-1] < lat[0]                       # the copies' passes are dearer than a step in this profile


def test_a_free_drafter_never_slows_the_optimum_and_helps_more_the_better_it_agrees(headroom, raw):
    base = headroom._case(raw, 8, None)
    a_dt = raw["acceptance"]["int8"][raw["target"]]
    lat = [headroom._case(raw, 8, headroom._add_free(alpha, a_dt))["plan_ms_per_token"]
           for alpha in (0.1, 0.5, 0.9)]
    assert lat[0] <= base["plan_ms_per_token"] * (1 + 1e-9)
    assert all(b <= a * (1 + 1e-9) for a, b in zip(lat, lat[1:]))
    best = headroom._case(raw, 8, headroom._add_free(0.9, a_dt))
    assert best["plan"] == [headroom.FREE, raw["target"]]     # good enough against the target: a single draft


def test_rates_only_rise(headroom, raw):
    changed = json.loads(json.dumps(raw))
    headroom._set_rate(0.1)(changed)
    lookup = next(m for m in changed["models"] if m["name"] == "lookup")
    assert lookup["draft_rate"] == next(m for m in raw["models"] if m["name"] == "lookup")["draft_rate"]
    headroom._set_rate(0.9)(changed)
    assert next(m for m in changed["models"] if m["name"] == "lookup")["draft_rate"] == 0.9
    walked = json.loads(json.dumps(raw))        # a drafter with shares of rounds per budget: each rises, none falls
    lookup = next(m for m in walked["models"] if m["name"] == "lookup")
    lookup["draft_rate_by_budget"] = [0.2, 0.1, 0.05]
    headroom._set_rate(0.15)(walked)
    assert lookup["draft_rate_by_budget"] == [0.2, 0.15, 0.15]
    headroom._set_rate(1.0)(walked)             # a drafter that never abstains: no shares per budget, and it loads
    assert lookup["draft_rate"] == 1.0 and "draft_rate_by_budget" not in lookup
    from hsd_opt.formats import profile_from_dict
    profile_from_dict(walked, "<what-if>")


def test_a_benchmarks_bad_input_is_one_line_and_exit_2(capsys):
    """``benchmarks.entry.run``: an error of the input (an HsdError, a file that is not there) is ``error: ...``
    and exit 2, not a traceback; a script's exit code passes through."""
    import pytest

    from benchmarks.entry import run
    from hsd_opt.errors import InputFileError

    def bad_plan():
        raise InputFileError("/nowhere/plan.json", "file not found")

    with pytest.raises(SystemExit) as e:
        run(bad_plan)
    assert e.value.code == 2 and capsys.readouterr().err == "error: /nowhere/plan.json: file not found\n"
    with pytest.raises(SystemExit) as e:
        run(lambda: 1)
    assert e.value.code == 1
