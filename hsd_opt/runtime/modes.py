"""How the levels of a hierarchy hand drafts up (``--mode``), checked without the runtime's imports (torch)."""

from __future__ import annotations

from hsd_opt.errors import HsdError

#: How levels hand drafts up (``--mode``): ``exact``, a level's budget per call (the latency model); ``eager``,
#: every verified token.
MODES = ("exact", "eager")


def check_mode(mode: str) -> None:
    """Refuse a ``--mode`` other than :data:`MODES` (one line naming the flag)."""
    if mode not in MODES:
        raise HsdError(f"--mode: expected exact or eager, got {mode!r}")
