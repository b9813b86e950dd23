"""``benchmarks/mat_rows_ab.py``: two versions of kernels.c built into one process and compared pass for pass; its
flags checked before anything is built."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks import mat_rows_ab

KERNELS = Path(mat_rows_ab.__file__).resolve().parents[1] / "hsd_opt" / "engine" / "kernels.c"


def test_positions_are_ranges_or_lists_within_one_tile():
    assert mat_rows_ab.parse_positions("1-3,8,2") == [1, 2, 3, 8]
    for bad in ("0-2", "9", "a", "3-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="--positions"):
            mat_rows_ab.parse_positions(bad)


def test_bad_flags_exit_2_naming_them(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        mat_rows_ab.main(["--baseline", str(tmp_path / "none.c")])
    assert e.value.code == 2 and "--baseline: no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        mat_rows_ab.main(["--baseline", str(KERNELS), "--variant", "avx3"])
    assert e.value.code == 2 and "--variant: no such kernel variant 'avx3'" in capsys.readouterr().err


def test_a_version_against_itself_computes_the_same_outputs(tmp_path):
    out = tmp_path / "r.json"
    assert mat_rows_ab.main(["--baseline", str(KERNELS), "--variant", "portable", "--positions", "1,3",
                             "--passes", "2", "--distinct-layers", "1", "--threads", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["positions"] for r in rows] == [1, 3] and all(r["equal"] and r["baseline_ms"] > 0 for r in rows)


def test_a_version_that_changes_the_weights_is_reported_different(tmp_path):
    line = "buf[c] = fmaf((float)((b >> (4 * (g % 2))) & 15), half_to_float(sc[g]), half_to_float(z[g]));"
    src = KERNELS.read_text()
    assert src.count(line) == 1                          # the portable build's de-quantization of q4f codes
    changed = tmp_path / "kernels.c"
    changed.write_text(src.replace(line, line[:-1] + " + 0.5f;"))
    out = tmp_path / "r.json"
    assert mat_rows_ab.main(["--baseline", str(KERNELS), "--candidate", str(changed), "--variant", "portable",
                             "--positions", "1", "--passes", "2", "--distinct-layers", "1", "--threads", "1",
                             "--out", str(out)]) == 1
    assert json.loads(out.read_text())["rows"][0]["equal"] is False
