"""Shared fixtures: tiny randomly initialised Llama models built in-process, and the embedded SmolLM2-135M."""

from __future__ import annotations

import pytest
import torch


def make_tiny_llama(seed: int = 0, vocab_size: int = 64, layers: int = 4, hidden: int = 32, heads: int = 4,
                    kv_heads: int = 2, scale: float = 1.0):
    """A randomly initialised ``LlamaForCausalLM`` small enough for exhaustive tests (float32, CPU, eval).

    ``scale`` multiplies the initial weight std (larger = peakier next-token distributions).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=512, initializer_range=0.02 * scale, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    return model


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny_llama()


@pytest.fixture(scope="session")
def embedded():
    """The embedded default model (SmolLM2-135M-Instruct), loaded once per session on the CPU.

    `make test` installs it first (`make model`); a missing model is a failure, not a skip, so the lossless
    tests on it always run.
    """
    from hsd_opt.models.loading import load_model

    return load_model("smollm2-135m", device="cpu", dtype="float32")
