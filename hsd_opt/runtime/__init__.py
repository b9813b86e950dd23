"""The HSD runtime: lossless Hierarchical Speculative Decoding over the layered engine (``docs/design.md#runtime``).

    from hsd_opt.runtime import HSD, Level, hsd_for_plan
    h = hsd_for_plan(plan, loaded)               # levels from the plan, exits sharing one KV cache
    res = h.generate(prompt_ids, max_new_tokens=128, temperature=0.0)
    res.token_ids, res.stats
    h.pool = StatePool(reuse=True)               # a prompt starting with an earlier one's tokens takes their keys
"""

from hsd_opt.runtime.decode import HSD, GenerationResult, Level
from hsd_opt.runtime.penalties import Penalties
from hsd_opt.runtime.runner import build_levels, hsd_for_plan
from hsd_opt.runtime.sampling import process_logits
from hsd_opt.runtime.state_pool import StatePool

__all__ = ["HSD", "Level", "GenerationResult", "Penalties", "StatePool", "process_logits", "build_levels",
           "hsd_for_plan"]
