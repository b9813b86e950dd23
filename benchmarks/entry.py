"""How a benchmark script ends: :func:`run` its ``main``, so that bad input is one line, as the ``hsd`` commands
say it, rather than a traceback."""

from __future__ import annotations

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
