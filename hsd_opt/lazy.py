"""Names a package exports, imported from their modules on first use (PEP 562), so that a package's modules that
need no torch are read without it: a command checks its flags in a fraction of a second, not after torch's
import."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str],
                 namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` (its ``__name__``): each name of ``exports`` (name -> module of
    the package) is imported on first use and kept in ``namespace`` (the package's ``globals()``)."""

    def get(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        namespace[name] = value
        return value

    def names() -> list[str]:
        return sorted({*namespace, *exports})

    return get, names
