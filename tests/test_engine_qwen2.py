"""The layered engine on Qwen2 (biases on q/k/v, a tied or untied head, a large vocabulary) computes exactly what
the Hugging Face modules compute, as it does for Llama (tests/test_engine.py)."""

from __future__ import annotations

import pytest
import torch

from hsd_opt.engine.layered import LayeredLM
from tests.helpers import engine_logits, modules_logits

QWEN_VOCAB = 151_936  # the Qwen2.5 vocabulary


def make_tiny_qwen2(tied: bool, seed: int = 0, vocab_size: int = QWEN_VOCAB, layers: int = 4, hidden: int = 32):
    """A randomly initialised ``Qwen2ForCausalLM`` (float32, CPU, eval) with non-zero q/k/v biases."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=tied, use_sliding_window=False,
                      rope_theta=1e6, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises biases to zero: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_qwen2_torch_path_is_bit_identical_to_the_modules(tied):
    model = make_tiny_qwen2(tied)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert model.model.layers[0].self_attn.o_proj.bias is None
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    lm = LayeredLM(model, kernels=False)
    assert lm.vocab_size == QWEN_VOCAB
    ids = torch.randint(0, QWEN_VOCAB, (25,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(engine_logits(lm, ids, 20), modules_logits(model, lm, ids, 20))


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_qwen2_full_forward_and_exits_match_hf(tied):
    model = make_tiny_qwen2(tied, seed=1)
    eng = LayeredLM(model)
    ids = torch.randint(0, QWEN_VOCAB, (30,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids[None], output_hidden_states=True)
    st = eng.new_state(40, save_boundaries=[1, 3])
    eng.append(st, ids[:17])
    eng.advance(st, 1)
    eng.advance(st, 4)
    eng.append(st, ids[17:])
    eng.advance(st, 3)
    eng.advance(st, 4)
    assert torch.allclose(eng.logits(st, 4, 0, 30), ref.logits[0], atol=1e-5)
    for b in (1, 3):
        hb = model.lm_head(model.model.norm(ref.hidden_states[b][0]))
        assert torch.allclose(eng.logits(st, b, 0, 30), hb, atol=1e-5), b
    assert torch.equal(eng.logits(st, 4, 0, 30).argmax(-1), ref.logits[0].argmax(-1))
