"""The profiler: acceptance rates and costs of a drafter pool for one target -> ``hsd-profile/1``.

    from hsd_opt.profiler import ProfileConfig, run_profile, merge_profiles
    prof = run_profile(ProfileConfig(model="smollm2-135m", out=Path("profile.json")))

Modules: :mod:`~hsd_opt.profiler.pool` (the drafters), :mod:`~hsd_opt.profiler.measure` (per-position
statistics of one prompt), :mod:`~hsd_opt.profiler.stats` (additive pairwise sums),
:mod:`~hsd_opt.profiler.costs` (the cost model), :mod:`~hsd_opt.profiler.assemble` (a profile from the sums;
merge), :mod:`~hsd_opt.profiler.checkpoint` (resume), :mod:`~hsd_opt.profiler.dist` (torchrun),
:mod:`~hsd_opt.profiler.run` (the driver). See ``docs/design.md#the-profiler``.
"""

from hsd_opt.profiler.stats import PairStats

_LAZY = {  # loaded on first use (all but config import torch)
    "ProfileConfig": "config", "run_profile": "run", "merge_profiles": "assemble", "build_profile": "assemble",
    "profile_sequence": "measure", "pairwise_overlap": "measure", "measure_costs": "costs", "LayerCosts": "costs",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"hsd_opt.profiler.{_LAZY[name]}"), name)
    raise AttributeError(name)


__all__ = ["PairStats", *_LAZY]
