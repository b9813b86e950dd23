"""A prompt head kept by the engine: a prompt that starts with the model's chat-template head computes the head in a
pass of its own, and the next such prompt takes the keys and values kept of that pass, bit for bit what computing
it gives, so answers stay each prompt's own whoever computed the head."""

from __future__ import annotations

import pytest
import torch

from hsd_opt.engine import kernels
from hsd_opt.engine.layered import LayeredLM
from hsd_opt.engine.quantized import QuantizedLM
from hsd_opt.prompts import MIN_HEAD, encode_prompt, load_prompts, template_head
from hsd_opt.runtime import decode
from hsd_opt.runtime.batch import generate_many
from hsd_opt.runtime.decode import HSD, Level, prompt_pass_ends
from tests.helpers import make_tiny_llama

HAVE_KERNELS = kernels.load() is not None
HEAD = (5, 9, 11, 3, 7, 21)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama(seed=5, vocab_size=64, layers=4, hidden=64, heads=4, kv_heads=2, scale=8.0)


def _engine(tiny, kind: str, head=HEAD):
    if kind != "torch" and not HAVE_KERNELS:
        pytest.skip("no C compiler here: the kernels cannot be built")
    eng = {"f32": lambda: LayeredLM(tiny, kernels=True), "torch": lambda: LayeredLM(tiny, kernels=False),
           "q8": lambda: QuantizedLM(tiny, bits=8, kernels=True)}[kind]()
    eng.prompt_head = tuple(head)
    return eng


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return list(HEAD) + torch.randint(3, 64, (n - len(HEAD),), generator=g).tolist()


def test_the_passes_of_a_prompt_depend_on_its_length_and_head_only(monkeypatch):
    assert prompt_pass_ends(30) == [30]
    assert prompt_pass_ends(600) == [256, 512, 600]
    assert prompt_pass_ends(30, head=6) == [6, 30]
    assert prompt_pass_ends(300, head=6) == [6, 262, 300]
    assert prompt_pass_ends(6, head=6) == [6]          # a prompt that is all head: one pass, the head's


@pytest.mark.parametrize("kind", ["f32", "torch", "q8"])
def test_a_taken_head_is_bit_for_bit_the_computed_one(tiny, kind):
    """The state a kept head fills is the one computing the head gives: every layer's keys and values, the residual
    streams kept, the layers' lengths; and the next pass over the rest of the prompt gives the same logits."""
    eng = _engine(tiny, kind)
    prompt = _prompt(1, 20)
    states = []
    for take in (False, True):
        st = eng.new_state(64, save_boundaries=[2, 4])
        st.prompt = len(prompt)
        eng.append(st, prompt[:len(HEAD)])
        if take:
            assert eng.take_head(st, 4)
        else:
            assert not eng.take_head(st, 4)          # nothing kept yet
            eng.advance(st, 4)
            eng.keep_head(st, 4)
        eng.append(st, prompt[len(HEAD):])
        eng.advance(st, 4)
        states.append(st)
    a, b = states
    assert a.lens == b.lens == [len(prompt)] * 4
    for l in range(4):
        assert torch.equal(a.k[l][:, :, :len(prompt)], b.k[l][:, :, :len(prompt)])
        assert torch.equal(a.v[l][:, :, :len(prompt)], b.v[l][:, :, :len(prompt)])
    for bound in (2, 4):
        assert torch.equal(a.resid[bound][:len(prompt)], b.resid[bound][:len(prompt)])
    n = len(prompt)
    assert torch.equal(eng.logits(a, 4, n - 1, n), eng.logits(b, 4, n - 1, n))


def test_a_head_is_taken_only_by_a_state_it_fits(tiny):
    eng = _engine(tiny, "torch")
    st = eng.new_state(64, save_boundaries=[2])
    eng.append(st, list(HEAD))
    eng.advance(st, 4)
    eng.keep_head(st, 4)
    other = eng.new_state(64)
    eng.append(other, [1] + list(HEAD[1:]))           # other tokens
    assert not eng.take_head(other, 4)
    lower = eng.new_state(64)
    eng.append(lower, list(HEAD))
    assert not eng.take_head(lower, 2)                 # kept to layer 4, asked to layer 2
    more = eng.new_state(64, save_boundaries=[2, 3])
    eng.append(more, list(HEAD))
    assert not eng.take_head(more, 4)                  # a residual stream the kept head lacks
    assert other.lens == lower.lens == more.lens == [0] * 4


def test_a_prompt_that_takes_a_kept_head_computes_one_pass_less(tiny, monkeypatch):
    """With passes of 8, a 20-position prompt with a 6-token head is computed in passes ending at 6, 14 and 20:
    two yields to a batch when the head is computed, one when it is taken; the answers are the same."""
    monkeypatch.setattr(decode, "PREFILL_CHUNK", 8)
    eng = _engine(tiny, "torch")
    hsd = HSD([Level("target", eng, 4)], [])
    yields, answers = [], []
    for seed in (2, 3):
        d = hsd.start(_prompt(seed, 20), 12)
        yields.append(list(d.prefill_passes()))
        answers.append([t for step in _drive(d) for t in step])
        d.close()
    assert yields == [[6, 14], [14]]
    fresh = _engine(tiny, "torch")                     # computes every head itself
    ar = HSD([Level("target", fresh, 4)], [])
    assert answers[1] == ar.generate(_prompt(3, 20), 12).token_ids


def _drive(d):
    """The committed blocks of a prefilled decoding, each pass served alone."""
    steps = d.steps()
    reply = None
    while True:
        try:
            item = steps.send(reply)
        except StopIteration:
            return
        if isinstance(item, decode.Committed):
            reply = None
            yield item.tokens
        else:
            reply = decode.serve(item)


@pytest.mark.parametrize("kind", ["f32", "torch"])
def test_greedy_answers_in_a_batch_with_a_kept_head_are_each_prompts_own(tiny, kind):
    """Prompts of different lengths that share the head, four decoded together on an engine that keeps the head:
    each answer is the one an engine computing every head itself gives the prompt alone."""
    eng = _engine(tiny, kind)
    prompts = [_prompt(10 + i, n) for i, n in enumerate((9, 23, 14, 40, 7))]
    got = generate_many(HSD([Level("target", eng, 4)], []), prompts, 16, max_active=4)
    for p, res in zip(prompts, got):
        fresh = _engine(tiny, kind)
        assert res.token_ids == HSD([Level("target", fresh, 4)], []).generate(p, 16).token_ids


def test_the_embedded_chat_template_has_a_head_every_chat_prompt_starts_with(embedded):
    head = template_head(embedded.tokenizer)
    assert len(head) >= MIN_HEAD
    for text in load_prompts().texts:
        ids = encode_prompt(embedded.tokenizer, text)
        assert tuple(ids[:len(head)]) == head and len(ids) > len(head)
    raw = encode_prompt(embedded.tokenizer, "plain text, no template", raw=True)
    assert tuple(raw[:len(head)]) != head


def test_a_tokenizer_without_a_chat_template_has_no_head():
    class Plain:
        chat_template = None

    assert template_head(Plain()) == ()


def test_a_prompt_pass_after_the_head_may_take_the_torch_path_a_verification_may_not(embedded):
    eng = LayeredLM(embedded.model)
    if not eng.uses_kernels:
        pytest.skip("the kernels are unavailable here")
    n = eng._kernels.prefill_on_torch_from
    assert not eng._on_kernels(24, n, prompt=24 + n)            # the rest of a prompt after its head
    v = min(n, kernels.MAX_PASS)
    assert eng._on_kernels(24 + n, v, prompt=24 + n)            # a verification after that prompt
    assert not eng._on_kernels(24 + n, kernels.MAX_PASS + 1, prompt=24 + n)   # longer: not as steps compute
    assert eng._on_kernels(24, n - 1, prompt=24 + n - 1)        # a short rest stays on the kernels


def test_a_prompt_that_is_all_head_takes_the_kept_state_whole(tiny, monkeypatch):
    """A prompt of exactly the head's tokens is one pass, the head's: the second such prompt takes it, the last
    position's residual stream included, and its answer is the one computing it gives."""
    kind = "f32" if HAVE_KERNELS else "torch"
    eng = _engine(tiny, kind)
    hsd = HSD([Level("layer2", eng, 2), Level("target", eng, 4)], [3])
    taken = []
    take = eng.take_head
    monkeypatch.setattr(eng, "take_head", lambda st, upto: taken.append(take(st, upto)) or taken[-1])
    first = hsd.generate(list(HEAD), 12).token_ids
    again = hsd.generate(list(HEAD), 12).token_ids
    assert taken == [False, True]
    fresh = _engine(tiny, kind)
    assert first == again == HSD([Level("layer2", fresh, 2), Level("target", fresh, 4)], [3]).generate(
        list(HEAD), 12).token_ids


def test_the_prefill_counts_the_positions_it_computed_not_a_head_taken(tiny):
    """``prefill_tokens``: a prompt's positions the target computed, the head left out once another prompt kept it
    (the prompt rate `hsd run` prints divides these by the prefill's seconds); a prompt without the head: all."""
    eng = _engine(tiny, "f32" if HAVE_KERNELS else "torch")
    hsd = HSD([Level("layer2", eng, 2), Level("target", eng, 4)], [3])
    first, second = _prompt(1, 20), _prompt(2, 17)
    assert hsd.generate(first, 3).stats["prefill_tokens"] == 20
    assert hsd.generate(second, 3).stats["prefill_tokens"] == 17 - len(HEAD)
    assert hsd.generate([4] + second, 3).stats["prefill_tokens"] == 18          # not starting with the head
