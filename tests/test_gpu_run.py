"""The device run (``benchmarks/gpu_run.sh``) needs nothing that a GPU machine's image may lack.

A lent GPU machine has torch, transformers, Triton, typer, rich, NumPy, SciPy and networkx, but none of this
package's other dependencies, and nothing can be installed there without carrying it. Its run is one command
within minutes, so an import that fails there costs the whole run. Here the run's commands (the costs-only
profile, ``merge-costs``, ``hsd solve``, ``benchmarks/gpu_scale.py``) run in a fresh interpreter that cannot import
:data:`LACKING`: a module of the run that imports one of them, at its top or on the run's path, fails this test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import save_tiny, write_prompts

#: Dependencies of the package that a GPU machine's image lacks (GGUF files, the LP cross-check, the server,
#: structured output): the device run must not import them.
LACKING = ("gguf", "cvxpy", "starlette", "uvicorn", "llguidance")

_BLOCKER = """import sys


class _Lacking:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {names!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (a GPU machine's image lacks it)", name=name)
        return None


sys.meta_path.insert(0, _Lacking())
"""

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def lacking(tmp_path, isolated_cache):
    """Run ``python ARGS...`` in the repository as a GPU machine would: :data:`LACKING` not importable."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_BLOCKER.format(names=set(LACKING)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}

    def run(*args) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=600)

    return run


@pytest.mark.slow
def test_the_device_run_imports_none_of_what_a_gpu_machine_lacks(lacking, tmp_path):
    for name in LACKING:                      # the interpreter really lacks them (else this test could not fail)
        res = lacking("-c", f"import {name}")
        assert res.returncode == 1 and "a GPU machine's image lacks it" in res.stderr, (name, res.stderr)
    model, copy = save_tiny(tmp_path / "model"), save_tiny(tmp_path / "copy", seed=1, layers=2)
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    fast = ["--layers", "1", "--quantized", "int8,int4", "--token-drafters", "lookup,ngram", "--tmax", "3",
            "--cost-repeats", "1", "--cost-contexts", "8,64", "--batch-sizes", "1,2", "--quiet", "--threads", "1",
            "--device", "cpu", "--draft-model"]
    rates, costs, merged, plan = (tmp_path / f"{n}.json" for n in ("rates", "costs", "merged", "plan"))
    steps = [  # the rates as a CPU measures them, then gpu_run.sh's commands: costs from configurations alone
        ["-m", "hsd_opt", "profile", "--model", model, "--prompts", prompts, *fast, copy, "--max-prompts", "2",
         "--max-new-tokens", "4", "--out", rates],
        ["-m", "hsd_opt", "profile", "--costs-only", "--model", model / "config.json", *fast, copy / "config.json",
         "--cost-budget", "20", "--out", costs],
        ["-m", "hsd_opt", "profile", "merge-costs", "--rates", rates, "--costs", costs, "-o", merged],
        ["-m", "hsd_opt", "solve", "--profile", merged, "--tmax", "3", "--out", plan],
        ["-m", "benchmarks.gpu_scale", "--config", "tiny", "--device", "cpu", "--dtype", "float32", "--t", "1,2",
         "--batches", "1,2", "--new", "4", "--repeats", "1", "--copy-mb", "4", "--no-compile", "--no-triton",
         "--out", tmp_path / "gpu_scale.json"],
    ]
    for args in steps:
        res = lacking(*args)
        assert res.returncode == 0, (args[:3], res.stdout[-2000:], res.stderr[-4000:])
    assert json.loads(costs.read_text())["provenance"]["costs_only"] is True
    assert json.loads(plan.read_text())["hierarchy"]
    assert json.loads((tmp_path / "gpu_scale.json").read_text())["hf_eager_equal"] is True


def test_the_device_run_leaves_few_files_refreshed_after_every_step(tmp_path):
    """A lent device gives back at most 8 files from its output folder: the run leaves three there (the work folder
    bundled, the steps, gpu_scale's JSON), whatever folder it is started from; every step's log is in the bundle.
    The steps' Python is a stand-in here that writes ``{}`` where it is given ``--out``/``-o``."""
    import tarfile

    stub = tmp_path / "py"
    stub.write_text('#!/usr/bin/env bash\nout=""\nwhile [ $# -gt 0 ]; do case "$1" in --out|-o) out=$2;; esac; '
                    'shift; done\n[ -n "$out" ] && echo "{}" >"$out"\necho ran\n')
    stub.chmod(0o755)
    out, work = tmp_path / "out", tmp_path / "work"
    res = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_run.sh"), str(out)], cwd=tmp_path,
                         env={**os.environ, "PY": str(stub), "WORK": str(work)}, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["gpu_run.tar.gz", "gpu_scale.json", "steps.tsv"]
    steps = (out / "steps.tsv").read_text().splitlines()[1:]
    assert len(steps) == 9 and all(line.split("\t")[1] == "0" for line in steps), steps
    with tarfile.open(out / "gpu_run.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {f"{line.split()[0]}.log" for line in steps} <= names and "family_plan_replayed.json" in names
