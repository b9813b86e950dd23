"""The benchmark scripts' numeric flags (`benchmarks/entry.py`'s types): a bad value is refused by argparse before
anything is loaded, one line naming the flag and the value, exit code 2, no traceback; the defaults given as
strings (comma lists) are parsed to what the scripts use."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.engine import exit_layers
from benchmarks.entry import at_least, count, counts, fraction, nonnegative, positive, seconds, whole

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("fn, text, want", [
    (count, "1", 1), (count, " 12 ", 12), (whole, "0", 0), (whole, "7", 7), (at_least(3), "3", 3),
    (counts, "1,4", [1, 4]), (counts, "8, 2 ,16", [8, 2, 16]), (counts, "5", [5]),
    (seconds, "0.5", 0.5), (seconds, "600", 600.0), (positive, "2e-3", 2e-3), (nonnegative, "0", 0.0),
    (fraction, "0", 0.0), (fraction, "1", 1.0), (fraction, "0.95", 0.95),
])
def test_a_good_value_is_parsed(fn, text, want):
    assert fn(text) == want


@pytest.mark.parametrize("fn, text", [
    (count, "0"), (count, "-1"), (count, "2.5"), (count, "a"), (count, ""), (whole, "-1"), (whole, "x"),
    (at_least(3), "2"), (seconds, "0"), (seconds, "-5"), (seconds, "nan"), (seconds, "inf"), (seconds, "soon"),
    (positive, "0"), (nonnegative, "-0.1"), (nonnegative, "inf"), (fraction, "1.5"), (fraction, "-0.1"),
    (fraction, "nan"),
])
def test_a_bad_value_is_refused_naming_it(fn, text):
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(f"got {text!r}")):
        fn(text)


@pytest.mark.parametrize("text, item", [("1,a", "a"), ("1,,2", ""), ("4,0", "0"), ("", ""), ("1,", ""),
                                        ("2,-3", "-3")])
def test_a_bad_list_names_the_item_and_the_list(text, item):
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(f"got {item!r} in {text!r}")):
        counts(text)


def test_the_errors_are_argparses_one_line_with_exit_2(capsys):
    ap = argparse.ArgumentParser(prog="bench")
    ap.add_argument("--rounds", type=count, default=2)
    with pytest.raises(SystemExit) as e:
        ap.parse_args(["--rounds", "0"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == \
        "bench: error: argument --rounds: expected a whole number >= 1, got '0'"


def test_no_early_exit_is_an_empty_exits_list():
    assert exit_layers("") == [] and exit_layers("15,22") == [15, 22]
    with pytest.raises(argparse.ArgumentTypeError):
        exit_layers("15,x")


def test_non_finite_numbers_are_not_seconds():
    assert math.isfinite(seconds("1e300"))
    with pytest.raises(argparse.ArgumentTypeError):
        seconds("1e400")                                    # inf once parsed


@pytest.mark.parametrize("script, args", [
    ("chat_turns", ["--plan", "p", "--questions", "q", "--concurrency", "1,a"]),
    ("chat_turns", ["--plan", "p", "--questions", "q", "--rounds", "0"]),
    ("chat_turns", ["--plan", "p", "--questions", "q", "--timeout", "-5"]),
    ("serve_sweep", ["--plan", "p", "--top-p", "1.5"]),
    ("json_soak", ["--plan", "p", "--clients", "0"]),
    ("engine", ["--new", "1"]),
    ("load_levels", ["--plan", "p", "--profile", "q", "--levels", "1,,2"]),
    ("kernels_ab", ["--baseline", "b", "--positions", "0"]),
    ("runtime_bench", ["--plan", "p", "--hierarchy", "alt=a,target:x"]),
    ("server_load", ["--out", "o", "--timeout", "nan"]),
    ("engine_ab", ["--rounds", "-1"]),
])
def test_a_script_refuses_a_bad_flag_in_one_line_before_loading_anything(script, args):
    flag = next(a for a in args[::-1] if a.startswith("--"))
    res = subprocess.run([sys.executable, "-m", f"benchmarks.{script}", *args], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert res.returncode == 2, res.stderr
    assert f"error: argument {flag}: " in res.stderr.splitlines()[-1] and "Traceback" not in res.stderr


@pytest.mark.parametrize("script, args, says", [
    ("chat_turns", ["--plan", "p", "--questions", "{bad}", "--in-process"], "{bad}: line 1: malformed JSON"),
    ("chat_turns", ["--plan", "p", "--questions", "{list}", "--in-process"], "{list}: line 1: "),
    ("chat_turns", ["--plan", "p", "--questions", "{one_turn}", "--in-process"], "{one_turn}: no question with two"),
    ("chat_turns", ["--plan", "p", "--questions", "q", "--methods", "foo"], "--methods: expected some of"),
    ("spec_bench_sample", ["--questions", "{missing}", "--eval-out", "e", "--profile-out", "p"], "{missing}: "),
    ("spec_bench_sample", ["--questions", "{bad}", "--eval-out", "e", "--profile-out", "p"], "{bad}: line 1: "),
    ("serve_sweep", ["--plan", "p", "--methods", "foo"], "--methods: unknown ['foo']"),
    # the server it starts refused the plan in one line: said as that line (three lines and exit 1 before)
    ("server_load", ["--plan", "{missing}", "--out", "o.json"], "hsd serve did not start: {missing}: file not found"),
    ("json_soak", ["--plan", "{missing}"], "hsd serve did not start: {missing}: file not found"),
    ("serve_sweep", ["--plan", "p", "--methods", "hsd_base"], "--methods hsd_base and --baseline DIR go together"),
    ("engine_ab", ["--baseline", "{missing}"], "--baseline: expected a checkout of hsd-opt"),
    ("gpu_scale", ["--config", "no-such-model", "--device", "cpu"], "--config"),
    ("gpu_scale", ["--config", "tiny", "--device", "foo"], "--device: expected auto, cpu, cuda"),  # blamed --config
    pytest.param("gpu_scale", ["--config", "tiny", "--device", "cuda:0"], "--device cuda:0: no CUDA device here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")),   # exit 1
])
def test_a_scripts_own_input_check_is_one_line_with_exit_2(tmp_path, script, args, says):
    """Past argparse, a script's checks of its input (a file's lines, a list of methods) raise ``HsdError``, which
    :func:`benchmarks.entry.run` prints as one ``error:`` line with exit code 2, as the ``hsd`` commands do (a
    ``sys.exit(message)`` exited 1; a question file's bad line was a traceback)."""
    files = {"bad": "{\n", "list": "[1]\n", "one_turn": '{"question_id": 1, "category": "writing", "turns": ["a"]}\n'}
    names = {k: str(tmp_path / f"{k}.jsonl") for k in (*files, "missing")}
    for k, text in files.items():
        Path(names[k]).write_text(text)
    args = [a.format(**names) for a in args]
    res = subprocess.run([sys.executable, "-m", f"benchmarks.{script}", *args], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    assert res.stderr.splitlines()[-1].startswith(f"error: {says.format(**names)}"), res.stderr


def test_the_spec_bench_samples_take_every_file_the_prompt_reader_takes_and_copy_its_lines(tmp_path):
    """A byte-order mark, CRLF line ends and U+2028 inside a question (text, not a line end) are read as
    ``load_prompts`` reads them: each sample holds the questions' lines as they are (the script split lines itself:
    a traceback on the mark, a refusal on U+2028)."""
    qs = [{"question_id": i, "category": c, "turns": [f"q{i}\u2028second line"]}
          for i, c in enumerate(["writing", "qa", "writing", "qa", "rag"])]
    lines = [json.dumps(q, ensure_ascii=False) for q in qs]
    src = tmp_path / "q.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode() + b"\r\n\r\n")
    res = subprocess.run([sys.executable, "-m", "benchmarks.spec_bench_sample", "--questions", str(src),
                          "--eval-out", "e.jsonl", "--profile-out", "p.jsonl", "--eval-per-group", "1",
                          "--eval-per-mt-category", "1", "--profile-per-group", "1", "--profile-per-mt-category", "1"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr
    ev = (tmp_path / "e.jsonl").read_text(encoding="utf-8").split("\n")
    pr = (tmp_path / "p.jsonl").read_text(encoding="utf-8").split("\n")
    assert ev == [lines[0], lines[1], lines[4], ""] and pr == [lines[2], lines[3], ""]


def test_every_report_a_script_writes_is_written_atomically():
    """A report goes through ``write_json`` (a temporary file, then a rename): nine scripts wrote theirs in place,
    so an interrupted or failed write left a broken JSON file where a good one had been."""
    in_place = re.compile(r"Path\([^\n]*\)\.write_text\(json\.dumps\(")
    bad = [f"{p.name}:{i}" for p in sorted((REPO / "benchmarks").glob("*.py"))
           for i, line in enumerate(p.read_text().splitlines(), 1) if in_place.search(line)]
    assert not bad, bad


def test_a_layer_list_is_checked_before_the_model_loads():
    res = subprocess.run([sys.executable, "-m", "benchmarks.heads_train", "--cost-layers", "2,x"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.splitlines()[-1].startswith("error: --cost-layers: ")


def test_the_ab_scripts_default_plan_is_there(monkeypatch):
    """``benchmarks.engine_ab`` run with its default ``--plan`` reads a plan that exists (the clean-up of
    ``benchmarks/results/`` had removed it: every run without ``--plan`` stopped with file not found)."""
    from hsd_opt.formats import load_plan

    real, parsed = argparse.ArgumentParser.parse_args, {}

    def parse_and_stop(self, args=None, namespace=None):
        parsed.update(vars(real(self, ["--baseline", "b"], namespace)))
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    with pytest.raises(SystemExit):
        importlib.import_module("benchmarks.engine_ab").main()
    assert load_plan(parsed["plan"]).hierarchy


@pytest.mark.parametrize("script, required, flag, want", [
    ("chat_turns", ["--plan", "p", "--questions", "q"], "concurrency", [1, 4]),
    ("engine", [], "t", [1, 2, 3, 4, 8, 12, 16]),
    ("engine", [], "exits", [15, 22]),
    ("gpu_scale", [], "batches", [1, 2, 4, 8, 16, 32, 64]),
    ("json_serve", ["--plan", "p", "--llama-server", "l", "--gguf", "g"], "concurrency", [1, 8]),
    ("kernels_ab", ["--baseline", "b"], "batches", [2, 4, 5, 7, 8, 11]),
    ("load_levels", ["--plan", "p", "--profile", "q"], "levels", [1, 2, 4, 8, 16]),
    ("prefill_path", [], "lengths", [8, 16, 24, 32, 40, 48, 64, 96]),
    ("serve_sweep", ["--plan", "p"], "concurrency", [1, 2, 4, 8, 16]),
])
def test_a_list_flags_default_is_parsed_to_its_list(monkeypatch, script, required, flag, want):
    """The script's own parser, stopped once it has parsed (its defaults, the required flags given)."""
    real, parsed = argparse.ArgumentParser.parse_args, {}

    def parse_and_stop(self, args=None, namespace=None):
        parsed.update(vars(real(self, required, namespace)))
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    with pytest.raises(SystemExit):
        importlib.import_module(f"benchmarks.{script}").main()
    assert parsed[flag] == want
