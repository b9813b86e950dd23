"""A weight-quantized copy of a model as a drafter (or as the target itself): the model, cheaper and slightly
less exact.

A model the user already has, stored in fewer bits, agrees with itself on nearly every token while a decode step
reads 4-8x fewer weight bytes. On a CPU, where a decode step is bound by memory traffic, that makes it a strong
drafter for speculative decoding; the full-precision target verifies, so the output stays the target's.

:class:`QuantizedLM` is the engine (:class:`~hsd_opt.engine.layered.LayeredLM`: same state, ``advance``, ``crop``,
``logits``; its early exits share its own KV cache) over quantized copies of the decoder's projections and LM head
(:mod:`hsd_opt.engine.weights`: int8 per output row, or int4 in groups of 32 columns with a float16 scale and
minimum, GGUF Q4_1's scheme, which recovers the codes of Q4_1 weights like the embedded SmolLM2's exactly), with
the model's own embeddings, norms and biases. On the C kernels it computes in float32 with int8 activations for
its projections' integer products and int16 activations for its int8 LM head (the greedy screen's read,
:func:`~hsd_opt.engine.kernels.i16_codes`); on the torch path (other devices; CPUs without a C compiler) it
computes with its weights de-quantized once, which reads no fewer bytes than a float model of that dtype: there a
copy pays only against a target in more bits, and the profiler measures whether it does.

Shapes: hidden ``[m, d]``, logits ``[m, V]`` float32, batch size 1.
"""

from __future__ import annotations

import torch

from hsd_opt.engine import stored_copies
from hsd_opt.engine.layered import LayeredLM
from hsd_opt.engine.precisions import GROUP
from hsd_opt.engine.weights import check_supported, is_released, model_weights
from hsd_opt.errors import HsdError


class QuantizedLM(LayeredLM):
    """The engine over a weight-quantized copy of ``model`` (``bits`` 8 or 4).

    The original model is only read: its projections are quantized into new tensors (int8: ~1/4, int4: ~1/7 of
    the float32 bytes), shared with any other copy of the model at the same bits in this process and stored on
    disk for the next one (:mod:`hsd_opt.engine.stored_copies`). The LM head is quantized to ``head_bits``
    (default 8: the head decides every token, and 4 bits there cost agreement for little time). Early exits use
    the model's final norm and the quantized LM head. ``name`` is what profiles and plans call it. Every pass,
    prefill included, runs on the kernels where they run (in calls of at most ``BATCH_ROWS`` positions)."""

    is_copy = True                  # may take the prompt's keys and values from an engine over the model's own weights
    long_passes_on_kernels = True   # the torch path would de-quantize every weight for every long pass

    def __init__(self, model, bits: int = 4, group_size: int = GROUP, head_bits: int = 8, name: str | None = None,
                 kernels: bool | None = None):
        check_supported(model)
        if is_released(model):
            raise HsdError("the model's float weights were released after quantizing it; build every quantized "
                           "copy before releasing them")
        if bits not in (4, 8) or head_bits not in (4, 8):
            raise HsdError(f"unsupported bit widths {bits} (head {head_bits}): expected 8 or 4")
        if bits == 4 and group_size != GROUP:
            raise HsdError(f"int4 copies are quantized in groups of {GROUP} columns, got {group_size}")
        self.bits, self.group_size, self.head_bits = bits, group_size, head_bits
        self.name = name or f"int{bits}"
        key = stored_copies.weights_key(model)
        stored = stored_copies.load_stored(key, bits, head_bits)
        fresh: dict[str, list[torch.Tensor]] = {}
        every: dict = {}

        def make(name: str, lin, b: int = bits):
            every[name] = stored_copies.matrix(stored, name, b, lin.weight, getattr(lin, "bias", None), fresh)
            return every[name]

        with torch.no_grad():
            weights = model_weights(model, make, lambda lin: make("lm_head", lin, head_bits))
        if fresh:
            stored_copies.save_stored(key, bits, head_bits, {n: m.tensors for n, m in every.items()})
        self._build(model, weights, None, kernels)
