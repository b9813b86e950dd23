"""Reading and atomically writing JSON files, with errors that name the file."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from hsd_opt.errors import InputFileError


def read_json(path: str | os.PathLike) -> Any:
    """Parse a JSON file; a missing file or malformed JSON raises :class:`InputFileError` naming the file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputFileError(str(p), "file not found") from None
    except IsADirectoryError:
        raise InputFileError(str(p), "is a directory, expected a JSON file") from None
    except OSError as e:
        raise InputFileError(str(p), f"cannot read: {e.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputFileError(str(p), f"malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: a temporary file in the same directory, fsync, then rename.

    A reader never sees a half-written file, and an interrupted write leaves the old file intact.
    """
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".partial", dir=parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2) -> None:
    """Serialise ``obj`` as JSON and write it atomically (see :func:`atomic_write_bytes`)."""
    atomic_write_bytes(path, (json.dumps(obj, indent=indent, sort_keys=False) + "\n").encode("utf-8"))
