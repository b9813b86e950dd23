"""The terminal output every layer shares: one console for results (stdout), one for messages (stderr).

Commands print results on :data:`console`; progress, warnings and errors go to :data:`err_console`, so that
piping a command's output keeps only the results. Lower layers (profiler, runtime, heads) never print on their
own: they take ``log``/``warn`` callbacks, and :func:`progress_bar` when they show progress.
"""

from __future__ import annotations

from rich.console import Console

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def warn(message: str) -> None:
    """Print ``warning: message`` on stderr."""
    err_console.print(f"[yellow]warning:[/] {message}", markup=True)


def warn_some(messages: list[str], limit: int = 5) -> None:
    """:func:`warn` the first ``limit`` of ``messages`` and how many more there were."""
    for m in messages[:limit]:
        warn(m)
    if len(messages) > limit:
        warn(f"... and {len(messages) - limit} more like these")


def error(message: str) -> None:
    """Print ``error: message`` on stderr (the one line a usage error gets)."""
    err_console.print(f"[bold red]error:[/] {message}", markup=True)


def progress_bar(enabled: bool = True, transient: bool = False, fields: str = "", percent: bool = False):
    """A :class:`rich.progress.Progress` on stderr: description, bar, count (``percent``: the share done, for
    tasks counted in other units than items, e.g. estimated seconds), elapsed time and ETA (``fields``: a
    template of extra task fields shown before the times, e.g. ``"loss {task.fields[loss]}"``). Use it as a
    context manager, or ``start()``/``stop()`` it; ``enabled=False`` shows nothing."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    cols = [TextColumn("{task.description}"), BarColumn(), TaskProgressColumn() if percent else MofNCompleteColumn()]
    cols += [TextColumn(fields)] if fields else []
    cols += [TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()]
    return Progress(*cols, console=err_console, transient=transient, disable=not enabled)
