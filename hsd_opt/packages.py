"""The dependencies that only some commands need, and one clear error where such a package is missing.

``pip install hsd-opt`` installs all of them (Triton comes with CUDA builds of torch), but an environment made
otherwise (``--no-deps``, a GPU machine's own image) may lack some: then the commands that need none of them still
run, and one that needs one says which package and how to install it, instead of failing with a traceback.
``hsd doctor`` lists the missing ones (:func:`missing`).
"""

from __future__ import annotations

import importlib.util

from hsd_opt.errors import HsdError

#: module -> what needs it (the pip package has the module's name).
OPTIONAL = {
    "gguf": "reading .gguf files: the embedded model, --model FILE.gguf",
    "llguidance": "JSON schemas and grammars: --json-schema, --grammar, response_format, tools",
    "starlette": "hsd serve",
    "uvicorn": "hsd serve",
    "cvxpy": "hsd solve --solver lp-cvxpy",
    "triton": "the Triton attention on CUDA, HSD_TRITON_ATTENTION=1",
}


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here (found without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing() -> list[str]:
    """The modules of :data:`OPTIONAL` that are not installed here, in its order."""
    return [m for m in OPTIONAL if not installed(m)]


def need(*modules: str, what: str) -> None:
    """Raise :class:`~hsd_opt.errors.HsdError` naming the packages of ``modules`` that are not installed, ``what``
    needs them, and the command that installs them; nothing where all are."""
    lacking = [m for m in modules if not installed(m)]
    if lacking:
        names = " and ".join(lacking)
        raise HsdError(f"{what} needs the package{'s' if len(lacking) > 1 else ''} {names}, not installed here: "
                       f"pip install {' '.join(lacking)}")
