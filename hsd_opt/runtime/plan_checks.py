"""A plan's checks that need no model, without the runtime's imports (torch): what its levels are, which target
precision it was made for, and whether this runtime can build its kinds, each refused with an
:class:`~hsd_opt.errors.InputFileError` naming the plan's file and field before anything slow loads."""

from __future__ import annotations

from hsd_opt.errors import InputFileError
from hsd_opt.formats import VERIFIER_KINDS, PlanModel


def plan_entries(plan, source: str = "plan") -> dict[str, PlanModel]:
    """Name -> model entry for every level of ``plan`` (from ``plan.models``, else inferred for ``layer<N>``:
    :meth:`~hsd_opt.formats.Plan.level_entry`)."""
    out = {}
    for i, name in enumerate(plan.hierarchy):
        e = plan.level_entry(name, i == len(plan.hierarchy) - 1)
        if e is None:
            raise InputFileError(source, f"{name!r} is not described in the plan's models (and is not a "
                                         f"'layer<N>' exit)", f"hierarchy[{i}]")
        out[name] = e
    return out


def plan_target_precision(plan, source: str = "plan") -> str:
    """The target precision ``plan`` was profiled for: ``provenance.target_precision``, else (plans made before
    it was recorded) the ``dtype``, else ``float32``. An unknown value raises :class:`InputFileError`."""
    from hsd_opt.engine.precisions import TARGET_PRECISIONS

    p = plan.provenance.target_precision or plan.provenance.dtype or "float32"
    if p not in TARGET_PRECISIONS:
        raise InputFileError(source, f"unknown target precision {p!r} (known: {', '.join(TARGET_PRECISIONS)})",
                             "provenance.target_precision")
    return p


def check_target_precision(plan, source: str = "plan", target_precision: str | None = None) -> None:
    """Refuse a plan made for another target precision than ``target_precision`` (None or ``auto``: the plan's
    own), naming ``source`` and ``provenance.target_precision``: before the model is loaded."""
    made = plan_target_precision(plan, source)
    asked = (target_precision or "auto").strip().lower()
    if asked not in ("auto", made):
        raise InputFileError(source, f"the plan was made for the {made} target, not the {asked} one (another "
                                     f"target, with its own greedy output: profile and solve with "
                                     f"--target-precision {asked}, or drop --target-precision)",
                             "provenance.target_precision")


def check_kinds(plan, source: str = "plan") -> None:
    """Refuse a plan whose hierarchy holds a level of a kind this runtime cannot build (the format allows any
    kind; a run needs one of the engines' or the token drafters'), naming ``source`` and the level: before any
    model is loaded."""
    from hsd_opt.drafters import TOKEN_DRAFTER_KINDS

    known = (*VERIFIER_KINDS, *TOKEN_DRAFTER_KINDS)
    entries = plan_entries(plan, source)
    for i, name in enumerate(plan.hierarchy):
        if entries[name].kind not in known:
            raise InputFileError(source, f"{name!r} is of kind {entries[name].kind!r}, which this runtime cannot "
                                         f"run (known: {', '.join(known)})", f"hierarchy[{i}]")
