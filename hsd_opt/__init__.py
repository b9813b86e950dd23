"""hsd-opt: latency-optimal Hierarchical Speculative Decoding.

Python API (plain functions over plain dataclasses)::

    from hsd_opt import load_profile, solve, evaluate, simulate
"""

from importlib import resources
from pathlib import Path

from hsd_opt.errors import HsdError, InputFileError
from hsd_opt.formats import (
    ModelEntry,
    Plan,
    Profile,
    load_plan,
    load_profile,
    plan_from_dict,
    profile_from_dict,
    save_plan,
    save_profile,
)
from hsd_opt.solver import build_gsp_graph, evaluate, gamma, hierarchy_latency, simulate, solve
from hsd_opt.version import __version__

#: The HSD paper's App. B.3 example profile ("Hierarchical Speculative Decoding", arXiv 2510.19705), shipped with
#: the package: costs in the example's units, for trying the solver (``load_profile(EXAMPLE_PROFILE)``,
#: ``hsd solve --profile``).
EXAMPLE_PROFILE = Path(str(resources.files("hsd_opt").joinpath("data", "example_profile.json")))

__all__ = [
    "EXAMPLE_PROFILE", "HsdError", "InputFileError", "ModelEntry", "Plan", "Profile", "load_plan", "load_profile",
    "plan_from_dict", "profile_from_dict", "save_plan", "save_profile", "__version__",
]
__all__ += ["solve", "evaluate", "simulate", "gamma", "hierarchy_latency", "build_gsp_graph"]


def train_heads(*args, **kwargs):
    """Train per-layer exit heads (lazy wrapper of :func:`hsd_opt.heads.train.train_heads`; imports torch)."""
    from hsd_opt.heads.train import train_heads as _f

    return _f(*args, **kwargs)


def load_heads(*args, **kwargs):
    """Load a heads file for a model (lazy wrapper of :func:`hsd_opt.heads.io.load_heads`; imports torch)."""
    from hsd_opt.heads.io import load_heads as _f

    return _f(*args, **kwargs)


def save_heads(*args, **kwargs):
    """Write a heads file (lazy wrapper of :func:`hsd_opt.heads.io.save_heads`; imports torch)."""
    from hsd_opt.heads.io import save_heads as _f

    return _f(*args, **kwargs)


__all__ += ["train_heads", "load_heads", "save_heads"]
