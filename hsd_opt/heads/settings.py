"""What training exit heads takes, checked without the heads' imports (torch): ``hsd heads train`` refuses a
mistyped flag before anything slow loads, and training checks the same values again."""

from __future__ import annotations

from pathlib import Path

from hsd_opt.errors import HsdError

#: The heads' kinds: ``affine`` (a full d x d translator) and ``lowrank`` (rank ``r``).
KINDS = ("affine", "lowrank")
#: The largest learning rate training takes (past float32's range Adam's first step overflows).
MAX_LR = 1.0
#: What ``train_vocab`` takes (:mod:`hsd_opt.heads.train`): ``auto`` (candidates on a CPU, full on CUDA), ``full``,
#: ``candidates``.
TRAIN_VOCABS = ("auto", "full", "candidates")
#: Tokens of a sequence training reads at most, held-out ones too (longer ones are cut there).
MAX_LEN = 1024


def check_checkpoint(checkpoint: str | Path | None, resume: bool) -> None:
    """Refuse to start over where an interrupted training left ``checkpoint`` and ``resume`` is off: its first
    save would replace the checkpoint (hours of training), as the profiler refuses its own."""
    if checkpoint and not resume and Path(checkpoint).exists():
        raise HsdError(f"{checkpoint}: a checkpoint of an interrupted training exists; pass --resume to continue "
                       f"it, or delete it to start over")
