"""What the commands share: turning :class:`~hsd_opt.errors.HsdError` into one line and exit code 2, table cells,
loading a plan with its model (`hsd run`, `hsd bench`)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable, Optional, TypeVar

import typer

from hsd_opt.console import error
from hsd_opt.errors import HsdError

F = TypeVar("F", bound=Callable)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: message`` to stderr and return the Exit to raise (exit code 2 for usage errors)."""
    error(message)
    return typer.Exit(code)


def cli_command(fn: F) -> F:
    """Wrap a command so :class:`HsdError` becomes one line on stderr and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except HsdError as e:
            raise fail(str(e)) from None

    return wrapper  # type: ignore[return-value]


def fmt(x, spec: str = ".3g") -> str:
    """``x`` formatted with ``spec``, or ``-`` for None (table cells)."""
    return "-" if x is None else format(x, spec)


def level_acceptance(d: dict) -> str:
    """Acceptance of each verifying level, bottom up (``"0.62 / 0.91"``), from a report's ``levels``."""
    levels = d.get("levels") or []
    return "/".join(fmt(lv.get("acceptance_rate"), ".2f") for lv in levels[1:]) or "-"


#: The help of ``--target-precision`` on ``hsd run``, ``hsd bench`` and ``hsd serve``.
TARGET_PRECISION_HELP = ("The target the plan must have been made for: float32, bfloat16, int8 or int4 (refused "
                         "otherwise). Default: the plan's provenance.target_precision.")


def load_plan_and_model(plan_path: Path, model: Optional[str], device: str, dtype: Optional[str],
                        target_precision: Optional[str] = None):
    """Load the plan and the model it names (or ``model``, which must match the plan's provenance); refuse a
    plan made for another target precision than ``target_precision`` (None: the plan's own)."""
    from hsd_opt.commands.options import resolve_target_precision
    from hsd_opt.errors import InputFileError
    from hsd_opt.formats import load_plan
    from hsd_opt.models.loading import load_model
    from hsd_opt.runtime.runner import check_provenance

    plan = load_plan(str(plan_path))
    name = model or plan.provenance.model
    if not name:
        raise InputFileError(str(plan_path), "the plan names no model (provenance.model); give --model",
                             "provenance.model")
    _, asked = resolve_target_precision(target_precision, None)   # a bad value is refused before loading anything
    loaded = load_model(name, device=device, dtype=dtype or plan.provenance.dtype or "auto")
    check_provenance(plan, loaded, str(plan_path), asked)
    prepare_kernels(loaded.device)
    return plan, loaded


def prepare_kernels(device: str) -> None:
    """On a CPU, load the decode kernels now, so that their one-time build (a few seconds) is announced on stderr
    rather than passing silently inside the first engine that wants them."""
    from hsd_opt.models.loading import resolve_device

    if resolve_device(str(device)).type == "cpu":
        from hsd_opt.console import err_console
        from hsd_opt.engine import kernels

        kernels.load(log=lambda m: err_console.print(m))
