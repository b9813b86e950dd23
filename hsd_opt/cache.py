"""The project's cache directory, where every derived file is kept.

Converted models, fetched GGUF files, bigram tables, ADED matrices, head training data, stored quantized copies and
the compiled decode kernels all live under it. It is ``$HSD_CACHE`` when that is set and not empty, else
``~/.cache/hsd-opt``.
"""

from __future__ import annotations

import os
from pathlib import Path

#: The environment variable that moves the cache directory.
CACHE_ENV = "HSD_CACHE"


def cache_dir() -> Path:
    """The project's cache directory: ``$HSD_CACHE`` or ``~/.cache/hsd-opt`` (not created here)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hsd-opt")
