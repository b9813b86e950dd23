"""Terminal output: progress when stderr is not a terminal (a log file, a pipe, CI); stdout that cannot be written."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from rich.console import Console
from rich.progress import TextColumn

from hsd_opt.console import progress_class


def _progress(file, every: float, percent: bool = False):
    console = Console(file=file, force_terminal=False, width=120)
    return progress_class()(TextColumn("{task.description}"), console=console, every=every, percent=percent)


def test_not_a_terminal_prints_plain_lines_with_counts_and_eta():
    out = io.StringIO()
    with _progress(out, every=0.0) as prog:
        task = prog.add_task("generating", total=4)
        for _ in range(4):
            prog.advance(task)
    lines = [ln for ln in out.getvalue().splitlines() if ln.startswith("generating:")]
    assert [ln.split(",")[0] for ln in lines] == ["generating: 1/4", "generating: 2/4", "generating: 3/4",
                                                 "generating: 4/4"]
    assert all("elapsed " in ln and "ETA " in ln for ln in lines)
    assert lines[-1].endswith("ETA 0:00:00")


def test_not_a_terminal_gets_the_plain_lines_only():
    """The live display printed its bar once more when it stopped (``generating ━━━ 3/3 ...``), and rich a blank
    line after it, below the plain lines of a log file."""
    out = io.StringIO()
    with _progress(out, every=0.0) as prog:
        for name in ("generating", "profiling"):
            task = prog.add_task(name, total=2)
            prog.advance(task, 2)
    assert [ln.split(",")[0] for ln in out.getvalue().split("\n")] == ["generating: 2/2", "profiling: 2/2", ""]


def test_lines_are_throttled_but_completion_is_always_reported():
    out = io.StringIO()
    with _progress(out, every=3600.0, percent=True) as prog:
        task = prog.add_task("costs", total=200.0)
        for _ in range(10):
            prog.update(task, advance=20.0)
        prog.update(task, advance=5.0)  # past completion: no second final line
    lines = [ln for ln in out.getvalue().splitlines() if ln.startswith("costs:")]
    assert len(lines) == 1 and lines[0].startswith("costs: 100%")


def test_a_terminal_gets_the_live_bar_only():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with progress_class()(TextColumn("{task.description}"), console=console, every=0.0) as prog:
        task = prog.add_task("generating", total=2)
        prog.advance(task)
        prog.advance(task)
    assert "generating: " not in out.getvalue()


def test_heartbeat_reports_a_long_block_while_it_runs_and_stops_with_it():
    import threading
    import time

    from hsd_opt.console import heartbeat

    said: list[str] = []
    with heartbeat(said.append, "prompt 1/2, hsd", every=0.02):
        time.sleep(0.15)
    n = len(said)
    assert n >= 2 and all(s.startswith("prompt 1/2, hsd: running, elapsed 0:00:0") for s in said)
    time.sleep(0.1)
    assert len(said) == n                                  # nothing after the block
    assert not any(t.name == "hsd-heartbeat" for t in threading.enumerate())
    with heartbeat(said.append, "short", every=30.0):
        pass                                               # a short block: no line, and no wait for the period
    assert len(said) == n


def test_sparse_progress_still_gets_an_eta():
    """Items a minute apart (a profile's prompts): rich keeps no speed over its 30 s window, so the line's ETA
    comes from the average pace so far: 2 of 6 done in 120 s -> 240 s left."""
    out = io.StringIO()
    clock = [0.0]
    console = Console(file=out, force_terminal=False, width=120)
    with progress_class()(TextColumn("{task.description}"), console=console, every=0.0,
                          get_time=lambda: clock[0]) as prog:
        task = prog.add_task("profiling", total=6)
        for _ in range(2):
            clock[0] += 60.0
            prog.advance(task)
    lines = [ln for ln in out.getvalue().splitlines() if ln.startswith("profiling:")]
    assert lines[-1] == "profiling: 2/6, elapsed 0:02:00, ETA 0:04:00", lines


def test_tables_in_a_log_are_not_cut_to_80_columns(monkeypatch):
    from rich.table import Table

    from hsd_opt.console import LOG_WIDTH, _console

    monkeypatch.delenv("COLUMNS", raising=False)
    out = io.StringIO()
    c = _console(file=out)
    assert c.width == LOG_WIDTH
    t = Table()
    for name in ("method", "tokens per second", "speed-up over HF generate", "tokens per target call",
                 "predicted ms/token", "measured ms/token"):
        t.add_column(name)
    t.add_row("single_draft", "5.22", "2.69", "8.56", "112.9", "113.4")
    c.print(t)
    assert "…" not in out.getvalue() and "speed-up over HF generate" in out.getvalue()
    monkeypatch.setenv("COLUMNS", "100")
    assert _console(file=io.StringIO()).width == 100


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_output_that_cannot_be_written_is_one_error_line_not_a_traceback():
    """stdout on a full disk (``/dev/full``): one line naming the cause and exit 1, no traceback (a closed pipe
    is a quiet exit 1: click's)."""
    with open("/dev/full", "w") as full:
        res = subprocess.run([sys.executable, "-m", "hsd_opt", "models", "list"], stdout=full,
                             stderr=subprocess.PIPE, text=True, timeout=120)
    assert res.returncode == 1
    assert res.stderr.strip() == "error: cannot write the output: No space left on device", res.stderr
