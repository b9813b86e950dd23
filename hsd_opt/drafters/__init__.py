"""Learning-free drafters: context n-grams, model bigram, mixed batches, ADED
(``docs/design.md#token-drafters``).

All implement :class:`hsd_opt.drafters.base.TokenDrafter`. :func:`make_token_drafter` rebuilds one from the
``config()`` dict stored in a profile / plan entry, e.g.::

    {"kind": "ngram_context", "name": "ngram", "q": 2, "w": 4, "min_q": 1, "max_occurrences": 512}
    {"kind": "bigram_model", "name": "bigram", "table": "/root/.cache/hsd-opt/bigram-<hash>-k16.npz", "top_k": 16}
    {"kind": "aded", "name": "aded", "matrix": "/path/trigram.npz", "iterations": 150, "c1": 32.0, "c2": 8.0,
     "depth": 4, "n_candidates": 24, "max_children": 16, "seed": 0, "adapt": true, "increment": 0.1,
     "max_prob": 1.0, "max_length": 64, "backoff": true}
    {"kind": "mixed_ngram", "name": "mixed", "k": 5, "w": 4, "ngram": {...ngram config...}, "bigram": {...}}

Extra keyword arguments override the config (e.g. ``table=BigramTable`` or ``matrix=TrigramMatrix`` objects
already in memory instead of paths).
"""

from __future__ import annotations

from hsd_opt.drafters.base import TokenDrafter
from hsd_opt.errors import HsdError

TOKEN_DRAFTER_KINDS = ("ngram_context", "bigram_model", "unigram_model", "aded", "mixed_ngram")


def make_token_drafter(kind: str, **config) -> TokenDrafter:
    """Rebuild a token drafter from ``kind`` and its ``config()`` fields (unknown fields raise HsdError)."""
    config.pop("kind", None)
    try:
        if kind == "ngram_context":
            from hsd_opt.drafters.ngram import ContextNgramDrafter

            return ContextNgramDrafter(**config)
        if kind in ("bigram_model", "unigram_model"):
            from hsd_opt.drafters.bigram import BigramDrafter, UnigramDrafter

            config.pop("top_k", None)  # a property of the table file
            if config.get("table") is None:
                raise HsdError(f"{kind} drafter needs 'table' (path of the cached bigram table)")
            cls = BigramDrafter if kind == "bigram_model" else UnigramDrafter
            return cls(**config)
        if kind == "aded":
            from hsd_opt.drafters.aded import AdedDrafter

            if config.get("matrix") is None:
                raise HsdError("aded drafter needs 'matrix' (path of the tri-gram matrix .npz)")
            return AdedDrafter(**config)
        if kind == "mixed_ngram":
            from hsd_opt.drafters.mixed import MixedNgramDrafter

            if "ngram" not in config or "bigram" not in config:
                raise HsdError("mixed_ngram drafter needs 'ngram' and 'bigram' (each a drafter's config)")
            ng = config.pop("ngram")
            bg = config.pop("bigram")
            parts = []
            for part, v, kinds in (("ngram", ng, ("ngram_context",)),
                                   ("bigram", bg, ("bigram_model", "unigram_model"))):
                d = v if isinstance(v, TokenDrafter) else make_token_drafter(**v) if isinstance(v, dict) else None
                if d is None or d.kind not in kinds:
                    raise HsdError(f"mixed_ngram drafter: its {part!r} must be a {' or '.join(kinds)} drafter's "
                                   f"config, got {getattr(d, 'kind', None) or type(v).__name__}")
                parts.append(d)
            return MixedNgramDrafter(*parts, **config)
    except (TypeError, ValueError) as e:      # a field the drafter lacks, a value it refuses
        raise HsdError(f"bad config for {kind} drafter: {e}") from None
    raise HsdError(f"unknown token drafter kind {kind!r} (known: {', '.join(TOKEN_DRAFTER_KINDS)})")


__all__ = ["TokenDrafter", "make_token_drafter", "TOKEN_DRAFTER_KINDS"]
