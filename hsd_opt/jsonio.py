"""Reading JSON files with errors that name the file, and writing files atomically."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable

from hsd_opt.errors import HsdError, InputFileError, OutputFileError


def check_path(path: Any) -> None:
    """Refuse a ``path`` that is not a path (``str`` or ``os.PathLike``): the API's callers' None or open file."""
    if not isinstance(path, (str, os.PathLike)):
        raise HsdError(f"path: expected a file path (str or os.PathLike), got {type(path).__name__}")


def read_bytes(path: str | os.PathLike, expected: str = "a JSON file") -> bytes:
    """The bytes of a file; missing, a directory or unreadable raises :class:`InputFileError` naming the file
    (``expected`` says what kind of file was wanted)."""
    check_path(path)
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


def json_problem(e: Exception) -> str:
    """What :func:`json.loads` refused, in words: malformed JSON (where), a number of more digits than Python reads
    (``sys.get_int_max_str_digits``), or nesting too deep to read."""
    if isinstance(e, json.JSONDecodeError):
        return f"malformed JSON at line {e.lineno} column {e.colno}: {e.msg}"
    if isinstance(e, RecursionError):
        return "JSON whose arrays or objects nest too deeply to read"
    return f"JSON with a number too long to read ({str(e).split(';')[0]})"


def read_json(path: str | os.PathLike) -> Any:
    """Parse a JSON file; a missing file or JSON that cannot be read raises :class:`InputFileError` naming the
    file."""
    text = read_text(path)                      # the path checked there
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InputFileError(str(Path(path)), json_problem(e)) from None


def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


#: The permissions a new file gets here (``0o666`` less the process's umask, read once at import), as ``open``
#: would give it; a temporary file is created private and given these before it takes the file's name.
FILE_MODE = 0o666 & ~_umask()
#: The same for a new folder (``0o777`` less the umask), as ``mkdir`` gives it (``mkdtemp`` makes one private).
FOLDER_MODE = 0o777 & ~_umask()


def _give_mode(tmp: str, p: Path) -> None:
    """The temporary file ``tmp`` given the permissions of the file it replaces (else :data:`FILE_MODE`), where the
    file system keeps them (FAT and some network mounts refuse a chmod: the write goes on)."""
    try:
        mode = p.stat().st_mode & 0o7777 if p.is_file() else FILE_MODE
        os.chmod(tmp, mode)
    except OSError:
        pass


def _not_regular(p: Path) -> str:
    """Why ``p`` (a device, a pipe, a socket) is not written: the file would take its name, and the device or pipe
    would be gone (``--out /dev/null`` as root removed the device)."""
    return "not a regular file (a device, pipe or socket); the file is written whole and renamed into place, " \
           "which would replace it: give a file path"


def _cannot_write(p: Path, e: OSError) -> OutputFileError:
    if isinstance(e, OutputFileError):
        return e
    why = "is a directory" if isinstance(e, IsADirectoryError) or p.is_dir() else (e.strerror or str(e))
    return OutputFileError(f"{p}: cannot write it: {why}")


def _parent(p: Path) -> Path:
    """The folder of ``p``, made where it does not exist yet; :class:`HsdError` naming ``p`` where it cannot be."""
    parent = p.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise OutputFileError(f"{p}: cannot write it: its folder {parent} is a file or lies in one") from None
    except OSError as e:
        raise OutputFileError(f"{p}: cannot write it: its folder {parent} cannot be made ({e.strerror or e})") \
            from None
    return parent


def written_path(path: str | os.PathLike) -> Path:
    """The file :func:`atomic_write` writes for ``path``: the one a symbolic link points to (the link stays), else
    ``path``."""
    return Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)


def check_writable(path: str | os.PathLike, flag: str) -> None:
    """Refuse, before any work, an output path :func:`atomic_write` could not write: a directory, a path under a
    file, a folder where no file can be created (tried with a temporary file, removed at once), a folder to be made
    under one the process cannot write, ``-`` (which reads as standard output; a file of that name would be a
    surprise). Leaves no folder made (a folder to be made is tried with a temporary one in the nearest that exists:
    ``os.access`` grants root any folder, even one of a pseudo-filesystem such as ``/proc`` where none can be made).
    :class:`HsdError` naming ``flag`` and the path. A symbolic link is checked where it points, as it is written,
    and in its own folder, where files beside it go (a profile's checkpoint ``<out>.partial.json``)."""
    if str(path) == "-":
        raise HsdError(f"{flag} -: expected a file name (the file is written whole, atomically: it cannot be "
                       f"standard output)")
    _check_place(written_path(path), flag, path)
    if os.path.islink(path):
        _check_place(Path(path), flag, path)


def _check_place(p: Path, flag: str, path: str | os.PathLike) -> None:
    """:func:`check_writable`'s checks of the file ``p`` (``path`` as given, or where its link points)."""
    if not p.name or p.is_dir():
        raise HsdError(f"{flag} {str(path) or repr('')}: is a directory, expected a file path")
    if p.exists() and not p.is_file():
        raise HsdError(f"{flag} {path}: {_not_regular(p)}")
    parent = p.parent
    existing = next(a for a in (parent, *parent.parents) if a.exists())
    if not existing.is_dir():
        raise HsdError(f"{flag} {path}: cannot write it: {existing} is a file, not a folder")
    if existing != parent:          # the folders to be made: the nearest that exists must take them
        try:
            os.rmdir(tempfile.mkdtemp(prefix=f".{p.name}.", suffix=".partial", dir=existing))
        except OSError as e:
            raise HsdError(f"{flag} {path}: cannot write it: no folder can be made in {existing} "
                           f"({e.strerror or e})") from None
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".partial", dir=parent)
    except OSError as e:
        raise HsdError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(tmp)


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> None:
    """Write ``path`` atomically with ``write(f)`` on a binary file: a temporary file in the same directory,
    fsync, then rename. For data written in a stream (``torch.save`` of a large copy) that should not be held
    in memory whole first. A new file gets :data:`FILE_MODE`, a replaced one keeps its permissions.

    A reader never sees a half-written file, and an interrupted write leaves the old file intact. A path that
    cannot be written (a directory, a folder that cannot be made, no room) raises :class:`HsdError` naming it. A
    symbolic link is followed: the file it points to is replaced, the link stays.
    """
    check_path(path)
    p = written_path(path)
    if p.exists() and not p.is_file() and not p.is_dir():
        raise OutputFileError(f"{p}: cannot write it: {_not_regular(p)}")
    parent = _parent(p)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".partial", dir=parent)
    except OSError as e:
        raise _cannot_write(p, e) from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        _give_mode(tmp, p)
        os.replace(tmp, p)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError):
            raise _cannot_write(p, e) from None
        raise


#: Seconds without a write after which a temporary file or folder is one a killed process left behind (a live one
#: writes more often: a download, a conversion, a copy streamed to disk).
STALE_SECONDS = 3600.0


def remove_stale(paths) -> None:
    """Remove each of ``paths`` (temporary files, or folders with what they hold) in which nothing was written for
    :data:`STALE_SECONDS`: what a process killed part-way (SIGKILL, out of memory, power) left behind, never the
    work under way of another process sharing the folder. Errors are ignored (another process removed it)."""
    now = time.time()
    for p in paths:
        try:
            times = [p.stat().st_mtime] + ([f.stat().st_mtime for f in p.rglob("*")] if p.is_dir() else [])
        except OSError:
            continue
        if now - max(times) > STALE_SECONDS:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                try:
                    p.unlink()
                except OSError:
                    pass


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_write`)."""
    atomic_write(path, lambda f: f.write(data))


def write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2) -> None:
    """Serialise ``obj`` as JSON and write it atomically (see :func:`atomic_write_bytes`)."""
    atomic_write_bytes(path, (json.dumps(obj, indent=indent, sort_keys=False) + "\n").encode("utf-8"))
