"""The profiler (issue 3): acceptance rates and costs of a drafter pool for one target -> ``hsd-profile/1``.

    from hsd_opt.profiler import ProfileConfig, run_profile, merge_profiles
    prof = run_profile(ProfileConfig(model="smollm2-135m", out=Path("profile.json")))

Modules: :mod:`~hsd_opt.profiler.prompts` (prompt suites), :mod:`~hsd_opt.profiler.stats` (additive pairwise
statistics), :mod:`~hsd_opt.profiler.costs` (per-layer cost model), :mod:`~hsd_opt.profiler.run` (the driver,
checkpoints, torch.distributed, merge).
"""

from hsd_opt.profiler.prompts import PromptItem, default_prompts_path, load_prompts
from hsd_opt.profiler.stats import PairStats


def __getattr__(name):  # the driver imports torch: load it on first use
    if name in ("ProfileConfig", "run_profile", "merge_profiles", "profile_sequence", "pairwise_overlap"):
        from hsd_opt.profiler import run

        return getattr(run, name)
    if name in ("measure_costs", "LayerCosts"):
        from hsd_opt.profiler import costs

        return getattr(costs, name)
    raise AttributeError(name)


__all__ = ["PromptItem", "default_prompts_path", "load_prompts", "PairStats", "ProfileConfig", "run_profile",
           "merge_profiles", "profile_sequence", "pairwise_overlap", "measure_costs", "LayerCosts"]
