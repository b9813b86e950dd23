"""Trained early-exit heads (``docs/design.md#trained-exit-heads``): translator heads distilled to the final layer,
their file format, training and evaluation. See :mod:`hsd_opt.heads.modules`, :mod:`hsd_opt.heads.train`,
:mod:`hsd_opt.heads.io`; :mod:`hsd_opt.heads.settings` holds what training takes, without torch."""

from hsd_opt.lazy import lazy_exports

#: Each name this package exports, and its module: imported on first use, so that ``settings`` is read without
#: torch (``hsd heads train`` checks its flags before torch's import).
_EXPORTS = {
    "generate_training_sequences": "data", "sequences_sha256": "data", "split_sequences": "data",
    "FORMAT": "io", "HeadsModelMismatch": "io", "load_heads": "io", "read_heads_file": "io", "save_heads": "io",
    "KINDS": "settings", "RawHead": "modules", "TranslatorHead": "modules",
    "TrainResult": "train", "evaluate_heads": "train", "frequent_vocab": "train", "head_layers": "train",
    "train_heads": "train",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
