"""What a value handed to the Python API is: the checks typer gives the CLI's flags, for the API's own callers.

Integers are Python's and numpy's (:class:`numbers.Integral`), real numbers also floats; ``True`` and ``False``
are neither (they are ints to Python, never what a caller meant by a count or a rate)."""

from __future__ import annotations

import math
import numbers
from typing import Any


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
