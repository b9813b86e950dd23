"""What an installed package carries: every file under ``hsd_opt/data`` is package data of the wheel (pyproject's
``package-data``), and the README's solver example runs outside a clone, on the example profile shipped."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path, PurePosixPath

import tomllib

REPO = Path(__file__).resolve().parents[1]


def test_every_file_under_hsd_opt_data_is_package_data():
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["hsd_opt"]
    files = [p.relative_to(REPO / "hsd_opt").as_posix() for p in (REPO / "hsd_opt" / "data").rglob("*")
             if p.is_file() and "__pycache__" not in p.parts]
    missing = [f for f in files if not any(PurePosixPath(f).match(g) for g in globs)]
    assert files and not missing, f"not in pyproject.toml's package-data (a wheel would lack them): {missing}"


def test_the_readme_solver_example_runs_outside_a_clone(tmp_path):
    """The README's Python API lines up to the runtime's (which need a plan and a model) run from another
    directory: what they read comes with the package."""
    readme = (REPO / "README.md").read_text()
    block = re.search(r"## Python API\n.*?```python\n(.*?)```", readme, re.S).group(1)
    lines = block.split("from hsd_opt import load_plan")[0]
    assert "load_profile(" in lines and "solve(" in lines
    res = subprocess.run([sys.executable, "-c", lines], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
