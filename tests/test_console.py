"""Progress output when stderr is not a terminal (a log file, a pipe, CI)."""

from __future__ import annotations

import io

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
