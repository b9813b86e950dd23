"""How a benchmark script ends: :func:`run` its ``main``, so that bad input is one line, as the ``hsd`` commands
say it, rather than a traceback.

And the ``type=`` of its numeric flags: :func:`count`, :func:`whole`, :func:`at_least`, :func:`counts`,
:func:`seconds`, :func:`positive`, :func:`nonnegative`, :func:`fraction`. Each raises
:class:`argparse.ArgumentTypeError` naming the bad value, so argparse refuses it before anything is loaded, as
``error: argument --rounds: expected a whole number >= 1, got '0'``, exit code 2."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Callable

from hsd_opt.errors import HsdError

#: Errors that mean the input is wrong (a flag's value, a file that is not there), not the script.
INPUT_ERRORS = (HsdError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def run(main: Callable[[], object]) -> None:
    """Call ``main`` (a script's entry point): an error of :data:`INPUT_ERRORS` is printed as ``error: ...`` on
    stderr and exits 2, Ctrl-C exits 130 (what ``main`` cleans up in ``finally`` has run); ``main``'s return value,
    an exit code or None, is the process's."""
    try:
        code = main()
    except INPUT_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


def _integer(text: str, least: int) -> int:
    try:
        n = int(text)
    except ValueError:
        n = least - 1
    if n < least:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {text!r}")
    return n


def count(text: str) -> int:
    """A whole number of 1 or more: rounds, repeats, requests, clients, tokens to generate, threads where 0 means
    nothing."""
    return _integer(text, 1)


def whole(text: str) -> int:
    """A whole number of 0 or more: where 0 means something (none, all, the default)."""
    return _integer(text, 0)


def at_least(least: int) -> Callable[[str], int]:
    """The type of a whole number of ``least`` or more (``type=at_least(2)``), for a flag that needs more than 1."""

    def parse(text: str) -> int:
        return _integer(text, least)

    parse.__name__ = f"at_least_{least}"
    return parse


def counts(text: str) -> list[int]:
    """A comma-separated list of whole numbers of 1 or more (``"1,4,16"``, spaces around an item allowed, no empty
    item), in its order: concurrency levels, batch sizes, pass sizes, lengths."""
    out = []
    for item in text.split(","):
        try:
            out.append(count(item))
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers >= 1, got {item.strip()!r} "
                                             f"in {text!r}") from None
    return out


def _real(text: str, what: str, ok: Callable[[float], bool]) -> float:
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and ok(x)):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return x


def seconds(text: str) -> float:
    """A finite number of seconds above 0: a timeout."""
    return _real(text, "a number of seconds > 0", lambda x: x > 0)


def positive(text: str) -> float:
    """A finite number above 0: a factor, a ratio, a learning rate, a temperature that must sample."""
    return _real(text, "a number > 0", lambda x: x > 0)


def nonnegative(text: str) -> float:
    """A finite number of 0 or more: a temperature (0: greedy), seconds to wait (0: none)."""
    return _real(text, "a number >= 0", lambda x: x >= 0)


def fraction(text: str) -> float:
    """A number from 0 to 1, both included: top-p, min-p, a probability threshold."""
    return _real(text, "a number from 0 to 1", lambda x: 0 <= x <= 1)
