"""Reading JSON files with errors that name the file, and writing files atomically."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable

from hsd_opt.errors import InputFileError


def read_bytes(path: str | os.PathLike, expected: str = "a JSON file") -> bytes:
    """The bytes of a file; missing, a directory or unreadable raises :class:`InputFileError` naming the file
    (``expected`` says what kind of file was wanted)."""
    p = Path(path)
    try:
        return p.read_bytes()
    except FileNotFoundError:
        raise InputFileError(str(p), "file not found") from None
    except IsADirectoryError:
        raise InputFileError(str(p), f"is a directory, expected {expected}") from None
    except OSError as e:
        raise InputFileError(str(p), f"cannot read: {e.strerror}") from None


def read_text(path: str | os.PathLike, expected: str = "a JSON file") -> str:
    """UTF-8 text of a file (see :func:`read_bytes`); text that is not UTF-8 raises :class:`InputFileError`."""
    try:
        return read_bytes(path, expected).decode("utf-8")
    except UnicodeDecodeError:
        raise InputFileError(str(path), "not UTF-8 text") from None


def read_json(path: str | os.PathLike) -> Any:
    """Parse a JSON file; a missing file or malformed JSON raises :class:`InputFileError` naming the file."""
    p = Path(path)
    text = read_text(p)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputFileError(str(p), f"malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> None:
    """Write ``path`` atomically with ``write(f)`` on a binary file: a temporary file in the same directory,
    fsync, then rename. For data written in a stream (``torch.save`` of a large copy) that should not be held
    in memory whole first.

    A reader never sees a half-written file, and an interrupted write leaves the old file intact.
    """
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".partial", dir=parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_write`)."""
    atomic_write(path, lambda f: f.write(data))


def write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2) -> None:
    """Serialise ``obj`` as JSON and write it atomically (see :func:`atomic_write_bytes`)."""
    atomic_write_bytes(path, (json.dumps(obj, indent=indent, sort_keys=False) + "\n").encode("utf-8"))
