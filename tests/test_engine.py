"""The layered engine computes exactly what the Hugging Face forward computes, whatever order layers run in."""

from __future__ import annotations

import pytest
import torch

from hsd_opt.engine.layered import LayeredLM
from hsd_opt.errors import HsdError
from tests.helpers import engine_logits, make_tiny_llama, modules_logits


def _reference(model, ids):
    with torch.no_grad():
        out = model(ids[None], output_hidden_states=True)
    return out


def _lens_ok(st):
    return all(a >= b for a, b in zip(st.lens, st.lens[1:]))


def test_full_forward_matches_hf():
    model = make_tiny_llama(seed=1)
    eng = LayeredLM(model)
    ids = torch.randint(3, 64, (30,), generator=torch.Generator().manual_seed(0))
    ref = _reference(model, ids)
    st = eng.new_state(40, save_boundaries=[4])
    eng.append(st, ids)
    eng.advance(st, 4)
    assert torch.allclose(eng.logits(st, 4, 0, 30), ref.logits[0], atol=1e-5)


def test_interleaved_exits_and_crops_match_hf():
    """Exits at 1 and 3 of 4 layers advanced in arbitrary interleavings, with crops, equal a fresh full pass."""
    model = make_tiny_llama(seed=2)
    eng = LayeredLM(model)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (48,), generator=gen)
    ref = _reference(model, ids)
    st = eng.new_state(64, save_boundaries=[1, 3, 4])
    n = 0
    rng = torch.Generator().manual_seed(2)
    steps = 0
    while n < 48 or st.lens[-1] < 48:
        m = int(torch.randint(1, 5, (1,), generator=rng))
        if n < 48:
            m = min(m, 48 - n)
            eng.append(st, ids[n:n + m])
            n += m
        b = int(torch.randint(1, 5, (1,), generator=rng))
        eng.advance(st, b)
        assert _lens_ok(st)
        if steps % 3 == 2 and n > 4:  # a rejection: drop the last tokens, then re-append the same ones
            keep = n - int(torch.randint(1, 4, (1,), generator=rng))
            eng.crop(st, keep)
            n = keep
        if n == 48:
            eng.advance(st, 4)
        steps += 1
    for b in (1, 3):
        hb = model.lm_head(model.model.norm(ref.hidden_states[b][0]))
        assert torch.allclose(eng.logits(st, b, 0, 48), hb, atol=1e-5), b
    assert torch.allclose(eng.logits(st, 4, 0, 48), ref.logits[0], atol=1e-5)


def test_advance_reuses_lower_layers():
    """Verifying at exit 4 drafts made at exit 1 runs only layers 1..3 on them: work counts positions x layers."""
    model = make_tiny_llama(seed=3)
    eng = LayeredLM(model)
    st = eng.new_state(32, save_boundaries=[1, 4])
    eng.append(st, list(range(3, 13)))
    assert eng.advance(st, 4) == 10 * 4
    eng.append(st, [5, 6, 7])
    assert eng.advance(st, 1) == 3 * 1
    assert eng.advance(st, 4) == 3 * 3
    assert eng.advance(st, 4) == 0


def test_hidden_states_and_bad_layer():
    model = make_tiny_llama(seed=4)
    eng = LayeredLM(model)
    ids = torch.arange(3, 20)
    ref = _reference(model, ids)
    hs = eng.hidden_states(ids, [2, 3])
    assert torch.allclose(hs[2], ref.hidden_states[2][0], atol=1e-5)
    st = eng.new_state(8)
    with pytest.raises(HsdError, match="out of range"):
        eng.advance(st, 5)


def test_exit_head_override():
    model = make_tiny_llama(seed=5)
    calls = []

    def head(h):
        calls.append(h.shape)
        return torch.zeros(h.shape[0], 64)

    eng = LayeredLM(model, exit_heads={2: head})
    st = eng.new_state(8, save_boundaries=[2])
    eng.append(st, [3, 4, 5])
    eng.advance(st, 2)
    assert torch.equal(eng.logits(st, 2, 0, 3), torch.zeros(3, 64))
    assert calls == [torch.Size([3, 32])]


def test_the_torch_path_is_bit_identical_to_the_modules(tiny_llama):
    """The torch path calls the weights directly (no nn.Module overhead), with the modules' operations in their
    order: a prefill and decode steps give the logits of the modules themselves, bit for bit."""
    lm = LayeredLM(tiny_llama, kernels=False)
    ids = torch.randint(3, 64, (25,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(engine_logits(lm, ids, 20), modules_logits(tiny_llama, lm, ids, 20))


def test_offloaded_models_and_other_architectures_are_refused():
    """Weights behind accelerate hooks (offloaded or dispatched) are not plain tensors the engine can read."""
    model = make_tiny_llama(seed=5)
    model.model.layers[0].mlp._hf_hook = object()
    with pytest.raises(HsdError, match="accelerate hooks"):
        LayeredLM(model)
    model = make_tiny_llama(seed=5)
    model.config.model_type = "gpt2"
    with pytest.raises(HsdError, match="not supported"):
        LayeredLM(model)


@pytest.mark.parametrize("m,start", [(1, 0), (2, 0), (37, 0), (300, 0), (5, 11), (64, 100)])
def test_causal_attention_equals_the_masked_kernel_bit_for_bit(m, start):
    """A pass from position 0 takes the attention kernel's causal mode (it skips the masked blocks): its values
    are exactly those of the explicit mask; a pass over a filled cache is the masked kernel itself."""
    import torch.nn.functional as F

    from hsd_opt.engine.ops import causal_attention, causal_mask

    g = torch.Generator().manual_seed(m + start)
    q = torch.randn(1, 6, m, 16, generator=g)
    k, v = torch.randn(2, 1, 2, start + m, 16, generator=g)
    masked = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(start, start + m, q.device),
                                            enable_gqa=True)
    assert torch.equal(causal_attention(q, k, v, start), masked)
    if m > 1:                                  # the mask matters: attending to every key gives other values
        full = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        assert not torch.equal(causal_attention(q, k, v, start), full)


def test_rotary_table_slices_equal_the_module_for_any_positions(tiny_llama):
    """The engine computes the rotary tables once and slices them; every slice equals what the model's rotary
    module gives for exactly those positions, bit for bit, also after the table has grown."""
    lm = LayeredLM(tiny_llama)
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        a = int(torch.randint(0, 2500, (1,), generator=g))
        b = a + int(torch.randint(1, 70, (1,), generator=g))
        c1, s1 = lm.rope(a, b)
        c2, s2 = lm._rope_direct(a, b)
        assert c1.shape == (1, b - a, lm.head_dim)
        assert torch.equal(c1, c2) and torch.equal(s1, s2), (a, b)
    assert lm._rope_table[0].shape[1] >= 2500


def test_dynamic_rotary_embeddings_are_not_tabled(tiny_llama, monkeypatch):
    """A dynamic rotary embedding's frequencies depend on the sequence: computed per call, never tabled."""
    monkeypatch.setattr(tiny_llama.model.rotary_emb, "rope_type", "dynamic", raising=False)
    lm = LayeredLM(tiny_llama)
    c, s = lm.rope(3, 8)
    assert lm._rope_table is None
    c2, s2 = lm._rope_direct(3, 8)
    assert torch.equal(c, c2) and torch.equal(s, s2)


@pytest.mark.parametrize("kernels", [False, True])
def test_an_empty_read_is_empty_on_both_paths_and_the_embeddings_are_no_exit(kernels):
    """``logits``/``greedy_ids`` over ``start == end`` are ``[0, V]``/``[0]`` as the interface says (the kernel path
    raised: ``torch.cat`` of no blocks, the screen refusing 0 rows), for the model and its quantized copies; a state
    asked to keep boundary 0 is refused (nothing writes the embeddings there: its exit read zeros)."""
    from hsd_opt.engine import kernels as kernel_lib
    from hsd_opt.engine.quantized import QuantizedLM

    if kernels and kernel_lib.load() is None:
        pytest.skip("no C compiler for the kernels")
    model = make_tiny_llama(seed=6)
    for eng in (LayeredLM(model, kernels=kernels), QuantizedLM(model, bits=8, kernels=kernels),
                QuantizedLM(model, bits=4, kernels=kernels)):
        assert eng.uses_kernels == kernels
        n = eng.n_layers
        st = eng.new_state(16, save_boundaries=[n])
        eng.append(st, [5, 6, 7])
        eng.advance(st, n)
        assert eng.logits(st, n, 3, 3).shape == (0, eng.vocab_size)
        assert eng.greedy_ids(st, n, 3, 3).shape == (0,)
        assert eng.greedy_ids(st, n, 0, 3).tolist() == eng.logits(st, n, 0, 3).argmax(-1).tolist()
        with pytest.raises(HsdError, match="layer 0 is out of range: the model has layers 1.."):
            eng.new_state(16, save_boundaries=[0, n])
