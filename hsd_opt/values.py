"""What a value handed to the Python API is: the checks typer gives the CLI's flags, for the API's own callers; and
the on/off settings read from the environment.

Integers are Python's and numpy's (:class:`numbers.Integral`), real numbers also floats; ``True`` and ``False``
are neither (they are ints to Python, never what a caller meant by a count or a rate)."""

from __future__ import annotations

import math
import numbers
import os
from typing import Any

from hsd_opt.errors import HsdError

#: The words an on/off environment setting takes (case and surrounding spaces aside).
OFF_WORDS = ("0", "off", "no", "false")
ON_WORDS = ("1", "on", "yes", "true")


def env_switch(variable: str, default: bool) -> bool:
    """The on/off setting in the environment ``variable``: ``default`` where it is unset or empty, else one of
    :data:`ON_WORDS` or :data:`OFF_WORDS`; any other value is an :class:`HsdError` naming the variable."""
    value = os.environ.get(variable, "").strip().lower()
    if not value:
        return default
    if value in OFF_WORDS or value in ON_WORDS:
        return value in ON_WORDS
    raise HsdError(f"{variable}={os.environ[variable]!r}: expected 1 or 0 (on/off, yes/no, true/false)")


def is_integer(x: Any) -> bool:
    """An integer (not a bool, not a float with an integral value)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x: Any) -> bool:
    """A real number: an integer or a float (not a bool, not a string of digits)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_finite(x: Any) -> bool:
    """A real number a float holds: not NaN, not infinite, and not an integer beyond a double's range."""
    if not is_real(x):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:                     # an int of more than ~308 digits
        return False
