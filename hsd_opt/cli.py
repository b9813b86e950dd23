"""The ``hsd`` command line: profile -> solve -> run / bench (typer).

Each command group lives in ``hsd_opt/commands/<name>.py`` and registers itself on :data:`app`.
Errors meant for the user (:class:`~hsd_opt.errors.HsdError`) print as one line and exit with code 2.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable, TypeVar

import typer
from rich.console import Console

from hsd_opt.errors import HsdError

app = typer.Typer(
    name="hsd",
    help="Latency-optimal Hierarchical Speculative Decoding: profile drafters, solve for the best hierarchy, "
         "decode losslessly.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

err_console = Console(stderr=True, highlight=False, soft_wrap=True)
console = Console(highlight=False)

F = TypeVar("F", bound=Callable)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: message`` to stderr and return the Exit to raise (exit code 2 for usage errors)."""
    err_console.print(f"[bold red]error:[/] {message}", markup=True)
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


def warn(message: str) -> None:
    err_console.print(f"[yellow]warning:[/] {message}", markup=True)


def _register_all() -> None:
    from hsd_opt.commands import heads, models, profile, run, solve

    for mod in (models, profile, solve, run, heads):
        mod.register(app)


_register_all()


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except HsdError as e:  # raised outside a wrapped command (e.g. in a callback)
        err_console.print(f"[bold red]error:[/] {e}", markup=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
