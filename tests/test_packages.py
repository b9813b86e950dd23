"""A package that only some commands need, missing: those commands say which and how to install it (exit 2, one
line), the others run, and ``hsd doctor`` lists it."""

from __future__ import annotations

from pathlib import Path

import pytest

from hsd_opt import packages
from hsd_opt.commands.doctor import packages_line
from hsd_opt.errors import HsdError
from tests.helpers import cli_output, run_cli

EXAMPLE = Path(__file__).resolve().parents[1] / "data" / "example_profile.json"


@pytest.fixture
def lacking(monkeypatch):
    """Make the given modules look not installed and every other one installed (as
    :func:`hsd_opt.packages.installed` finds them)."""
    def set_(*modules: str) -> None:
        monkeypatch.setattr(packages, "installed", lambda m: m not in modules)
    return set_


def test_installed_finds_modules_without_importing_them():
    assert packages.installed("json") and packages.installed("torch")
    assert not packages.installed("no_such_module_hsd") and not packages.installed("")


def test_need_names_the_missing_packages_and_how_to_install_them(lacking):
    packages.need("json", what="x")                                   # all there: nothing
    lacking("starlette", "uvicorn")
    with pytest.raises(HsdError, match=r"^hsd serve needs the packages starlette and uvicorn, not installed here: "
                                       r"pip install starlette uvicorn$"):
        packages.need("starlette", "uvicorn", "json", what="hsd serve")
    with pytest.raises(HsdError, match=r"^y needs the package uvicorn, .*: pip install uvicorn$"):
        packages.need("json", "uvicorn", what="y")


def test_a_command_that_needs_a_missing_package_exits_2_naming_it(lacking, tmp_path):
    lacking("cvxpy", "starlette")
    res = run_cli("serve", "--plan", tmp_path / "plan.json", "--port", "0")
    assert res.exit_code == 2 and "hsd serve needs the package starlette" in cli_output(res)
    assert "Traceback" not in cli_output(res)
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object"}')
    lacking("llguidance")
    for cmd in (["run", "--prompt", "hi"], ["bench"]):          # refused before the plan or the model is read
        res = run_cli(*cmd, "--plan", tmp_path / "missing-plan.json", "--json-schema", schema)
        assert res.exit_code == 2 and "--json-schema needs the package llguidance" in cli_output(res), cli_output(res)
    lacking("cvxpy")
    res = run_cli("solve", "--profile", EXAMPLE, "--tmax", "4", "--solver", "lp-cvxpy", "--out", tmp_path / "p.json")
    assert res.exit_code == 2 and "the lp-cvxpy solver needs the package cvxpy" in cli_output(res), cli_output(res)
    res = run_cli("solve", "--profile", EXAMPLE, "--tmax", "4", "--out", tmp_path / "p.json")
    assert res.exit_code == 0, cli_output(res)                       # the default solver needs none of them


def test_doctor_lists_the_missing_packages_and_what_needs_them(lacking):
    lacking()
    assert packages_line(cuda=True) == "optional packages: all installed" and not packages.missing()
    lacking("llguidance", "triton")
    line = packages_line(cuda=False)                                   # a CPU: Triton is no loss
    assert "pip install llguidance" in line and "llguidance, for JSON schemas" in line and "triton" not in line
    assert "triton, for the Triton attention" in packages_line(cuda=True)


def test_a_schema_or_a_gguf_file_says_what_it_needs(lacking, tmp_path, isolated_cache):
    from hsd_opt.grammar.compiler import GrammarCompiler, GrammarSpec
    from hsd_opt.models.loading import convert_gguf

    lacking("llguidance", "gguf")
    compiler = GrammarCompiler(object(), [0], 10)
    with pytest.raises(HsdError, match="a JSON schema or grammar needs the package llguidance"):
        compiler.compile(GrammarSpec.json_schema({"type": "object"}, "s.json"))
    with pytest.raises(HsdError, match="a JSON schema or grammar needs the package llguidance"):
        compiler.tokenizer()
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF not a model")
    with pytest.raises(HsdError, match=r"reading m\.gguf needs the package gguf, .*: pip install gguf$"):
        convert_gguf(gguf, quiet=True)
