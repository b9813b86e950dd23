"""The HSD runtime: lossless Hierarchical Speculative Decoding over the layered engine (``docs/design.md#runtime``).

    from hsd_opt.runtime import HSD, Level, hsd_for_plan
    h = hsd_for_plan(plan, loaded)               # levels from the plan, exits sharing one KV cache
    res = h.generate(prompt_ids, max_new_tokens=128, temperature=0.0)
    res.token_ids, res.stats
    h.pool = StatePool(reuse=True)               # a prompt starting with an earlier one's tokens takes their keys
"""

import importlib

#: Each name this package exports, and its module: imported on first use, so that a module of the runtime that
#: needs no torch (``schedule``, ``modes``) is read without it (a command's flags are checked in a fraction of a
#: second, not after torch's import).
_EXPORTS = {"HSD": "decode", "Level": "decode", "GenerationResult": "decode", "Penalties": "penalties",
            "StatePool": "state_pool", "process_logits": "sampling", "build_levels": "runner",
            "hsd_for_plan": "runner"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
