"""The ``hsd`` command line: profile -> solve -> run / bench (typer).

Each command lives in ``hsd_opt/commands/<name>.py`` as plain functions or a sub-app; this module only
assembles them into :data:`app`. Errors meant for the user (:class:`~hsd_opt.errors.HsdError`) print as one
line and exit with code 2.
"""

from __future__ import annotations

import errno
import os
import signal
import sys

import typer

from hsd_opt.commands import bench, chat, doctor, heads, models, profile, run, serve, solve
from hsd_opt.console import INTERRUPTED, error
from hsd_opt.errors import HsdError, Terminated

app = typer.Typer(
    name="hsd",
    help="Latency-optimal Hierarchical Speculative Decoding: profile drafters, solve for the best hierarchy, "
         "decode losslessly.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

app.add_typer(models.app, name="models")
app.add_typer(profile.app, name="profile")
app.command("solve")(solve.solve_cmd)
app.command("simulate")(solve.simulate_cmd)
app.command("run")(run.run_cmd)
app.command("chat")(chat.chat_cmd)
app.command("bench")(bench.bench_cmd)
app.command("serve")(serve.serve_cmd)
app.add_typer(heads.app, name="heads")
app.command("doctor")(doctor.doctor_cmd)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=doctor.version_callback, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Latency-optimal Hierarchical Speculative Decoding: profile drafters, solve for the best hierarchy, decode
    losslessly."""


def main() -> None:
    """Console-script entry point. SIGTERM is raised as :class:`~hsd_opt.errors.Terminated` (a Ctrl-C), so that
    ``hsd bench``, ``run --json``, ``profile`` and ``heads train`` keep what they finished when ``timeout`` or a
    scheduler stops them; the exit status is then 143, as the signal's own."""
    terminated: list[int] = []

    def on_sigterm(signum, frame) -> None:
        terminated.append(signum)
        raise Terminated

    signal.signal(signal.SIGTERM, on_sigterm)
    _replace_unencodable(sys.stdout)
    try:
        app()
    except HsdError as e:  # raised outside a wrapped command (e.g. in a callback)
        error(str(e))
        sys.exit(2)
    except OSError as e:  # output that cannot be written (a closed pipe is click's: a quiet exit 1)
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # files are written atomically and name themselves (HsdError): this is the terminal's output, stdout
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        error(f"cannot write the output: {e.strerror}")
        sys.exit(1)
    except SystemExit as e:
        if e.code == 130 and _unhandled_interrupt(e):   # a command that keeps nothing: typer's silent 130
            error(INTERRUPTED)
        if terminated:
            sys.exit(128 + signal.SIGTERM)
        raise


def _replace_unencodable(stream) -> None:
    """Have ``stream`` (stdout) write ``?`` for a character its encoding cannot hold (``PYTHONIOENCODING=ascii``,
    a Latin-1 locale) instead of raising mid-answer: the text streamed to a terminal is shown as it can be, and
    ``--json`` files, written as UTF-8, hold it exactly."""
    if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
        stream.reconfigure(errors="replace")


def _unhandled_interrupt(e: SystemExit) -> bool:
    """Whether ``e`` is typer's exit for a Ctrl-C (or SIGTERM) that no command caught (those that keep what they
    finished say so themselves and exit 130): typer raises its ``Exit(130)`` from the ``KeyboardInterrupt``."""
    exc = e.__context__
    return exc is not None and isinstance(exc.__cause__, KeyboardInterrupt)


if __name__ == "__main__":
    main()
