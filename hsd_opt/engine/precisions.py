"""The precisions a model may be run in, by name, without the engines' imports (torch): the quantized copies a
profile may name (``--quantized``) and the targets a plan may be made for (``--target-precision``), so that the
commands check those flags before anything slow loads."""

from __future__ import annotations

#: Input columns per int4 group (a scale and a minimum each), and the group of the kernels' int8 activations.
GROUP = 32
#: Quantized drafters a profile may name: ``int8`` (per output channel) and ``int4`` (groups of 32 columns), as
#: (bits, group size).
QUANT_KINDS = {"int8": (8, 0), "int4": (4, GROUP)}
#: What ``--quantized`` takes: (bits, group size, LM head bits). ``int4-head4`` is an int4 copy whose LM head is
#: int4 too: half the head's bytes (on a large vocabulary the head is much of a small model's step) for a little
#: agreement; a drafter's head need not be exact, its drafts are verified.
COPY_KINDS = {**{k: (*v, 8) for k, v in QUANT_KINDS.items()}, "int4-head4": (*QUANT_KINDS["int4"], 4)}
#: What ``--target-precision`` takes: the float dtypes the target may be loaded in, and the quantized copies
#: of it that may be the target themselves.
TARGET_PRECISIONS = ("float32", "bfloat16", "float16", "int8", "int4")
