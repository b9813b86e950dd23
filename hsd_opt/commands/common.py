"""What every command shares: turning :class:`~hsd_opt.errors.HsdError` into one line and exit code 2."""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import typer

from hsd_opt.console import error
from hsd_opt.errors import HsdError

F = TypeVar("F", bound=Callable)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: message`` to stderr and return the Exit to raise (exit code 2 for usage errors)."""
    error(message)
    return typer.Exit(code)


def cli_command(fn: F) -> F:
    """Wrap a command so :class:`HsdError` becomes one line on stderr and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except HsdError as e:
            raise fail(str(e)) from None

    return wrapper  # type: ignore[return-value]


def fmt(x, spec: str = ".3g") -> str:
    """``x`` formatted with ``spec``, or ``-`` for None (table cells)."""
    return "-" if x is None else format(x, spec)
