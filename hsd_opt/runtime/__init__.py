"""The HSD runtime: lossless Hierarchical Speculative Decoding over the layered engine (``docs/design.md#runtime``).

    from hsd_opt.runtime import HSD, Level, hsd_for_plan
    h = hsd_for_plan(plan, loaded)               # levels from the plan, exits sharing one KV cache
    res = h.generate(prompt_ids, max_new_tokens=128, temperature=0.0)
    res.token_ids, res.stats
"""

from hsd_opt.runtime.decode import HSD, GenerationResult, Level
from hsd_opt.runtime.penalties import Penalties
from hsd_opt.runtime.runner import build_levels, hsd_for_plan
from hsd_opt.runtime.sampling import process_logits

__all__ = ["HSD", "Level", "GenerationResult", "Penalties", "process_logits", "build_levels", "hsd_for_plan"]
