"""A model whose configuration puts an attention window in force (Mistral's ``sliding_window``, Qwen's
``use_sliding_window``): the engine attends over every position, which is the model's own attention only within the
window, so its context is the window and a generation past it is refused, never answered with another model's
tokens."""

from __future__ import annotations

import pytest
import torch

from hsd_opt.errors import HsdError
from hsd_opt.models.loading import load_model, model_positions
from hsd_opt.runtime.runner import hsd_for_plan, model_context
from tests.helpers import run_cli, word_tokenizer, write_plan

WINDOW = 12


def _windowed_mistral(path):
    from transformers import MistralConfig, MistralForCausalLM

    fast = word_tokenizer(60)
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        initializer_range=0.16, sliding_window=WINDOW, tie_word_embeddings=False, bos_token_id=1,
                        eos_token_id=2, pad_token_id=0)
    model = MistralForCausalLM(cfg).eval()
    model.save_pretrained(str(path))
    fast.save_pretrained(str(path))
    return model


def test_the_window_in_force_is_the_context():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    assert model_positions(MistralConfig(sliding_window=8, max_position_embeddings=64)) == 8
    assert model_positions(MistralConfig(sliding_window=None, max_position_embeddings=64)) == 64
    assert model_positions(MistralConfig(sliding_window=4096, max_position_embeddings=1024)) == 1024
    assert model_positions(Qwen2Config(sliding_window=8, max_position_embeddings=64)) == 64    # not in force
    assert model_positions(Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1,
                                       num_hidden_layers=3, max_position_embeddings=64)) == 8
    assert model_positions(LlamaConfig(max_position_embeddings=64)) == 64
    assert model_positions(None) is None


def test_within_the_window_the_output_is_the_windowed_models_and_past_it_refused(tmp_path):
    """The engine computed a windowed Mistral's logits over the whole context: past the window they were another
    model's (up to 3.0 apart, the greedy token differing at over half the positions) and nothing said so."""
    model = _windowed_mistral(tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"), device="cpu", dtype="float32")
    assert model_context(loaded) == WINDOW
    plan = write_plan(tmp_path / "plan.json", tmp_path / "m")
    from hsd_opt.formats import load_plan

    runner = hsd_for_plan(load_plan(plan), loaded)
    prompt = [5, 9, 14, 7]
    out = runner.generate(prompt, WINDOW - len(prompt)).token_ids
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=WINDOW - len(prompt), do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
    assert out == ref[:len(out)] and len(out) >= 1
    with pytest.raises(HsdError, match=rf"exceeds the model's context of {WINDOW} positions"):
        runner.generate(prompt, WINDOW - len(prompt) + 1)
    r = run_cli("run", "--plan", plan, "--prompt", "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10", "--max-new-tokens", 8)
    assert r.exit_code == 2 and "context" in r.output and str(WINDOW) in r.output, r.output
