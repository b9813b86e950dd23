"""What a value handed to the Python API is: the checks typer gives the CLI's flags, for the API's own callers; and
the on/off settings read from the environment.

Integers are Python's and numpy's (:class:`numbers.Integral`), real numbers also floats; ``True`` and ``False``
are neither (they are ints to Python, never what a caller meant by a count or a rate)."""

from __future__ import annotations

import math
import numbers
import os
from typing import Any

from hsd_opt.errors import SettingError

#: The words an on/off environment setting takes (case and surrounding spaces aside).
OFF_WORDS = ("0", "off", "no", "false")
ON_WORDS = ("1", "on", "yes", "true")


def env_switch(variable: str, default: bool) -> bool:
    """The on/off setting in the environment ``variable``: ``default`` where it is unset or empty, else one of
    :data:`ON_WORDS` or :data:`OFF_WORDS`; any other value is a :class:`~hsd_opt.errors.SettingError` naming the
    variable."""
    value = os.environ.get(variable, "").strip().lower()
    if not value:
        return default
    if value in OFF_WORDS or value in ON_WORDS:
        return value in ON_WORDS
    raise SettingError(f"{variable}={os.environ[variable]!r}: expected 1 or 0 (on/off, yes/no, true/false)")


#: The environment's on/off settings (docs/cli.md, "Environment"), each read where it applies and every one checked
#: by every command before any work (:func:`check_env_switches`).
ON_OFF_VARIABLES = ("HSD_OPENMP", "HSD_EXACT_INT4", "HSD_EXACT_INT8", "HSD_FIXED_SHAPES", "HSD_WEIGHT_ONLY",
                    "HSD_COMPILE", "HSD_CUDA_GRAPHS", "HSD_TRITON_ATTENTION")


def check_env_switches() -> None:
    """Refuse a value any of :data:`ON_OFF_VARIABLES` does not take (:class:`SettingError` naming it), whether or
    not what runs reads it (an int4 target never reads ``HSD_EXACT_INT4``: a typo went unnoticed)."""
    for variable in ON_OFF_VARIABLES:
        env_switch(variable, True)


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
