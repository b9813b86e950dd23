"""Trained early-exit heads (``docs/design.md#trained-exit-heads``): translator heads distilled to the final layer,
their file format, training and evaluation. See :mod:`hsd_opt.heads.modules`, :mod:`hsd_opt.heads.train`,
:mod:`hsd_opt.heads.io`."""

from hsd_opt.heads.data import generate_training_sequences, sequences_sha256, split_sequences
from hsd_opt.heads.io import FORMAT, HeadsModelMismatch, load_heads, read_heads_file, save_heads
from hsd_opt.heads.modules import KINDS, RawHead, TranslatorHead
from hsd_opt.heads.train import TrainResult, evaluate_heads, frequent_vocab, head_layers, train_heads

__all__ = ["FORMAT", "KINDS", "HeadsModelMismatch", "RawHead", "TrainResult", "TranslatorHead", "evaluate_heads",
           "frequent_vocab", "generate_training_sequences", "head_layers", "load_heads",
           "read_heads_file", "save_heads", "sequences_sha256", "split_sequences", "train_heads"]
