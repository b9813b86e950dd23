"""The terminal output every layer shares: one console for results (stdout), one for messages (stderr).

Commands print results on :data:`console`; progress, warnings and errors go to :data:`err_console`, so that
piping a command's output keeps only the results. Lower layers (profiler, runtime, heads) never print on their
own: they take ``log``/``warn`` callbacks, and :func:`progress_bar` when they show progress.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Callable, Iterator

from rich.console import Console
from rich.markup import escape

#: Columns of a console that is not a terminal (a log file, a pipe, CI). rich assumes 80 there and cuts table
#: cells to "…"; a log has no width to respect, so the tables get room for every column. ``COLUMNS`` wins.
LOG_WIDTH = 160


def _console(**kwargs) -> Console:
    """A console that prints strings as they are (no rich markup: a path or a value with ``[...]`` in it is text;
    no emoji codes: ``:x:`` in a path stays ``:x:``); a caller that styles passes ``markup=True`` or rich's
    ``Text``."""
    c = Console(highlight=False, markup=False, emoji=False, **kwargs)
    if not c.is_terminal and not os.environ.get("COLUMNS"):
        c.width = LOG_WIDTH
    return c


console = _console()
err_console = _console(stderr=True, soft_wrap=True)


def warn(message: str) -> None:
    """Print ``warning: message`` on stderr."""
    err_console.print(f"[yellow]warning:[/] {escape(message)}", markup=True)


def warn_some(messages: list[str], limit: int = 5) -> None:
    """:func:`warn` the first ``limit`` of ``messages`` and how many more there were."""
    for m in messages[:limit]:
        warn(m)
    if len(messages) > limit:
        warn(f"... and {len(messages) - limit} more like these")


#: The line of a command stopped by Ctrl-C or SIGTERM before it finished anything it keeps.
INTERRUPTED = "interrupted: stopped before it finished"


def error(message: str) -> None:
    """Print ``error: message`` on stderr (the one line a usage error gets)."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", markup=True)


def progress_bar(enabled: bool = True, transient: bool = False, fields: str = "", percent: bool = False,
                 every: float = 10.0):
    """A :class:`rich.progress.Progress` on stderr: description, bar, count (``percent``: the share done, for
    tasks counted in other units than items, e.g. estimated seconds), elapsed time and ETA (``fields``: a
    template of extra task fields shown before the times, e.g. ``"loss {task.fields[loss]}"``). Use it as a
    context manager, or ``start()``/``stop()`` it; ``enabled=False`` shows nothing.

    On a stderr that is not a terminal (a log file, a pipe, CI) a live bar cannot redraw, so each task prints a
    plain line instead — ``description: done/total, elapsed, ETA`` — at most once per ``every`` seconds and
    when it completes."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    cols = [TextColumn("{task.description}", markup=False), BarColumn(),
            TaskProgressColumn() if percent else MofNCompleteColumn()]
    cols += [TextColumn(fields, markup=False)] if fields else []
    cols += [TimeElapsedColumn(), TextColumn("ETA", markup=False), TimeRemainingColumn()]
    # the speed behind the ETA over the last hour, not rich's default 30 s: long tasks advance once a minute
    return progress_class()(*cols, console=err_console, transient=transient, disable=not enabled, every=every,
                             percent=percent, speed_estimate_period=3600.0)


@contextlib.contextmanager
def heartbeat(log: Callable[[str], None], what: str, every: float = 15.0) -> Iterator[None]:
    """While the ``with`` block runs, call ``log(f"{what}: running, <elapsed>")`` every ``every`` seconds (from a
    daemon thread that sleeps in between), so that one long call (a generation of several minutes) is not
    silent; nothing is logged for a block shorter than ``every``, and nothing after it ends."""
    stop = threading.Event()
    t0 = time.monotonic()

    def beat() -> None:
        while not stop.wait(every):
            log(f"{what}: running, elapsed {_clock(time.monotonic() - t0)}")

    thread = threading.Thread(target=beat, name="hsd-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _remaining(task) -> float | None:
    """Seconds left for a rich task: rich's estimate, else the average pace so far (None before any progress)."""
    if task.time_remaining is not None:
        return task.time_remaining
    if task.total is None or not task.completed or not task.elapsed:
        return None
    return task.elapsed * max(task.total - task.completed, 0) / task.completed


def progress_class():
    """:class:`rich.progress.Progress` with plain progress lines for consoles that are not terminals (imported
    lazily: ``rich.progress`` is only paid for by commands that show progress)."""
    import time

    from rich.progress import Progress

    class LoggedProgress(Progress):
        def __init__(self, *columns, every: float = 10.0, percent: bool = False, **kwargs):
            super().__init__(*columns, **kwargs)
            self._every, self._percent, self._last_line = every, percent, {}
            if not self.console.is_terminal:    # else the live display prints its bar after the plain lines
                self.live.transient = True

        def _line(self, task_id) -> None:
            if self.disable or self.console.is_terminal:
                return
            task = next((t for t in self.tasks if t.id == task_id), None)
            if task is None:
                return
            now = time.monotonic()
            last = self._last_line.get(task_id)
            done = task.total is not None and task.completed >= task.total
            if last == "finished" or (not done and last is not None and now - last < self._every):
                return
            self._last_line[task_id] = "finished" if done else now
            if task.total is None:
                count = f"{task.completed:g}"
            elif self._percent:
                count = f"{100 * task.completed / task.total:.0f}%" if task.total else "100%"
            else:
                count = f"{task.completed:g}/{task.total:g}"
            self.console.print(f"{task.description}: {count}, elapsed {_clock(task.elapsed)}, "
                               f"ETA {_clock(0 if done else _remaining(task))}", markup=False, highlight=False)

        def add_task(self, *args, **kwargs):
            task_id = super().add_task(*args, **kwargs)
            self._last_line[task_id] = time.monotonic()  # the first line after ``every`` seconds of work
            return task_id

        def update(self, task_id, *args, **kwargs) -> None:
            super().update(task_id, *args, **kwargs)
            self._line(task_id)

        def advance(self, task_id, advance: float = 1) -> None:
            super().advance(task_id, advance)
            self._line(task_id)

        def stop(self) -> None:
            if self.disable or self.console.is_terminal:
                return super().stop()
            self.live.stop()            # without rich's blank line that ends its bar

    return LoggedProgress
