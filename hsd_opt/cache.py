"""The project's cache directory, where every derived file is kept.

Converted models, fetched GGUF files, bigram tables, ADED matrices, head training data, stored quantized copies and
the compiled decode kernels all live under it. It is ``$HSD_CACHE`` when that is set and not empty, else
``~/.cache/hsd-opt``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hsd_opt.errors import HsdError

#: The environment variable that moves the cache directory.
CACHE_ENV = "HSD_CACHE"


def cache_dir() -> Path:
    """The project's cache directory: ``$HSD_CACHE`` (``~`` expanded, made absolute: one cache whichever folder a
    command runs in) or ``~/.cache/hsd-opt`` (not created here)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hsd-opt").expanduser().absolute()


class UnwritableFolder(HsdError):
    """A folder (the cache's, or one the caller was given) that cannot hold what was to be written there: no
    narrower variant or other attempt can do better (:func:`cache_error`)."""


def cache_error(what: str, folder: Path, e: OSError) -> UnwritableFolder:
    """The one-line error for a folder that cannot hold ``what`` (``"the compiled kernels"``): making or writing
    ``folder`` failed with ``e``. Under the cache, it names the cache as the user set it (``HSD_CACHE=...`` when
    set) and says how to move it; elsewhere (a folder the caller was given), it names the folder."""
    if cache_dir() != Path(folder) and cache_dir() not in Path(folder).parents:
        return UnwritableFolder(f"{folder}: cannot write {what} there ({e.strerror or e})")
    where = f"{CACHE_ENV}={cache_dir()}" if os.environ.get(CACHE_ENV) else str(cache_dir())
    return UnwritableFolder(f"{where}: the cache cannot hold {what} (making {folder}: {e.strerror or e}); point "
                    f"{CACHE_ENV} at a folder you can write")


def writable_folder(folder: Path, what: str) -> Path:
    """``folder``, made where missing and checked to take a new file (one made and removed), before the work whose
    result ``what`` is kept there; a :func:`cache_error` where it cannot, so that a read-only cache fails before the
    work, not after it."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
    except OSError as e:
        raise cache_error(what, folder, e) from None
    return folder
