"""The HSD runtime: lossless Hierarchical Speculative Decoding over the layered engine (``docs/design.md#runtime``).

    from hsd_opt.runtime import HSD, Level, hsd_for_plan
    h = hsd_for_plan(plan, loaded)               # levels from the plan, exits sharing one KV cache
    res = h.generate(prompt_ids, max_new_tokens=128, temperature=0.0)
    res.token_ids, res.stats
    h.pool = StatePool(reuse=True)               # a prompt starting with an earlier one's tokens takes their keys
"""

from hsd_opt.lazy import lazy_exports

#: Each name this package exports, and its module: imported on first use (:mod:`hsd_opt.lazy`), so that a module
#: of the runtime that needs no torch (``schedule``, ``modes``, ``arguments``, ``plan_checks``) is read without it.
_EXPORTS = {"HSD": "decode", "Level": "decode", "GenerationResult": "decode", "Penalties": "penalties",
            "StatePool": "state_pool", "process_logits": "sampling", "build_levels": "runner",
            "hsd_for_plan": "runner"}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
