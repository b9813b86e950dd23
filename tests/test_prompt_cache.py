"""A prompt that starts with what an earlier sequence held (a conversation's next turn: the previous prompt and its
answer) takes those positions' keys and values from the state that sequence gave back to the pool, where its own
passes and the earlier ones all compute what one-position steps compute; the prompt's keys and values, and so its
answer, are bit for bit those of computing it whole. Where a pass would take another path, nothing is taken."""

from __future__ import annotations

import pytest
import torch

from hsd_opt.engine import kernels
from hsd_opt.engine.layered import LayeredLM
from hsd_opt.engine.quantized import QuantizedLM
from hsd_opt.errors import HsdError
from hsd_opt.runtime.batch import generate_many
from hsd_opt.runtime.decode import HSD, Level, prompt_pass_ends, takable
from hsd_opt.runtime.state_pool import StatePool, state_bytes
from tests.helpers import make_tiny_llama

HAVE_KERNELS = kernels.load() is not None
HEAD = (5, 9, 11, 3, 7, 21)
needs_kernels = pytest.mark.skipif(not HAVE_KERNELS, reason="no C compiler here: the kernels cannot be built")


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama(seed=5, vocab_size=64, layers=4, hidden=64, heads=4, kv_heads=2, scale=8.0)


def _engine(tiny, kind: str):
    eng = {"f32": lambda: LayeredLM(tiny, kernels=True), "torch": lambda: LayeredLM(tiny, kernels=False),
           "q8": lambda: QuantizedLM(tiny, bits=8, kernels=True)}[kind]()
    eng.prompt_head = HEAD
    return eng


def _hsd(eng, pool=None):
    return HSD([Level("layer2", eng, 2), Level("target", eng, 4)], [3], pool=pool)


def _tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 64, (n,), generator=g).tolist()


def _prefilled(hsd: HSD, prompt: list[int]):
    d = hsd.start(prompt, 8)
    d.prefill()
    return d


def test_passes_after_taken_positions_start_there():
    assert prompt_pass_ends(30, head=6, taken=20) == [30]
    assert prompt_pass_ends(600, head=6, taken=100) == [262, 518, 600]       # the prompt's own ends after 100
    assert prompt_pass_ends(600, head=6, taken=262) == [518, 600]
    assert prompt_pass_ends(30, head=6) == [6, 30]


@needs_kernels
@pytest.mark.parametrize("kind", ["f32", "q8"])
def test_a_next_turn_takes_the_conversation_before_it_bit_for_bit(tiny, kind):
    """Turn 1 (head + 10 tokens) answered with 12 tokens, then turn 2 = turn 1 + answer + 7 new tokens: the second
    prompt takes more positions than the head (those the first sequence computed), and after its prefill every
    layer's keys and values, and the last position's logits, equal those of an engine computing it whole."""
    eng = _engine(tiny, kind)
    hsd = _hsd(eng, StatePool(reuse=True))
    first = list(HEAD) + _tokens(1, 10)
    answer = hsd.generate(first, 12).token_ids
    second = first + answer + _tokens(2, 7)
    d = _prefilled(hsd, second)
    assert len(first) < d.prompt_reused < len(second)
    fresh = _prefilled(_hsd(_engine(tiny, kind)), second)
    assert fresh.prompt_reused == 0          # the fresh engine has no head kept either
    n = len(second)
    a, b = d._states[id(eng)], fresh._states[id(fresh.hsd.target)]
    assert a.lens == b.lens
    for l in range(4):
        assert torch.equal(a.k[l][:, :, :n], b.k[l][:, :, :n]) and torch.equal(a.v[l][:, :, :n], b.v[l][:, :, :n])
    assert torch.equal(eng.logits(a, 4, n - 1, n), fresh.hsd.target.logits(b, 4, n - 1, n))
    d.close()
    fresh.close()


@needs_kernels
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_answers_after_taken_positions_are_the_prompts_own(tiny, temperature):
    """Greedy and seeded sampled answers of next turns, each after the answer before it, equal those of an engine
    that computes every prompt whole; and the statistics count only the positions computed."""
    eng = _engine(tiny, "f32")
    hsd = _hsd(eng, StatePool(reuse=True))
    convo = list(HEAD) + _tokens(3, 9)
    for turn in range(3):
        got = hsd.generate(convo, 10, temperature=temperature, seed=turn)
        want = _hsd(_engine(tiny, "f32")).generate(convo, 10, temperature=temperature, seed=turn)
        assert got.token_ids == want.token_ids
        if turn:
            assert got.stats["prefill_tokens"] < 10          # the new tokens, and the answer's last at most
        convo = convo + got.token_ids + _tokens(10 + turn, 5)


@needs_kernels
def test_a_pool_that_does_not_reuse_takes_nothing(tiny):
    eng = _engine(tiny, "f32")
    hsd = _hsd(eng)                                          # a pool of its own: no reuse
    first = list(HEAD) + _tokens(4, 10)
    answer = hsd.generate(first, 8).token_ids
    d = _prefilled(hsd, first + answer + [7])
    assert d.prompt_reused == len(HEAD)                       # the kept head only
    d.close()


def test_nothing_is_taken_from_a_state_the_torch_path_computed(tiny):
    """The torch path's passes are not batch-invariant: its states are not stepwise, and the next turn computes
    every position (the head aside), with the same answer."""
    eng = _engine(tiny, "torch")
    hsd = _hsd(eng, StatePool(reuse=True))
    first = list(HEAD) + _tokens(5, 10)
    answer = hsd.generate(first, 8).token_ids
    assert not hsd.pool.states(eng)[-1].stepwise
    second = first + answer + [9, 10]
    d = _prefilled(hsd, second)
    assert d.prompt_reused == len(HEAD)
    d.close()
    assert hsd.generate(second, 8).token_ids == _hsd(_engine(tiny, "torch")).generate(second, 8).token_ids


@needs_kernels
def test_a_prompt_whose_own_pass_would_take_the_torch_path_takes_nothing(tiny):
    """A float model's long prompt pass runs on the torch path: a prompt whose own pass over positions is one such
    cannot take them from a state that computed them otherwise (stepwise, or in another pass)."""
    eng = _engine(tiny, "f32")
    long = eng._kernels.prefill_on_torch_from
    hsd = _hsd(eng, StatePool(reuse=True))
    short = list(HEAD) + _tokens(6, 10)
    answer = hsd.generate(short, 8).token_ids
    assert hsd.pool.states(eng)[-1].stepwise
    longer = short + answer + _tokens(7, long + 4)            # its own passes: the head, then one of > long
    d = _prefilled(hsd, longer)
    assert d.prompt_reused == len(HEAD)
    d.close()
    assert not hsd.pool.states(eng)[-1].stepwise               # that pass ran on the torch path
    after = longer + [4, 5]
    got = hsd.generate(after, 6)
    assert got.stats["prefill_tokens"] > long
    assert got.token_ids == _hsd(_engine(tiny, "f32")).generate(after, 6).token_ids


@needs_kernels
def test_a_long_conversation_takes_the_torch_paths_passes_it_shares(tiny, monkeypatch):
    """Prompt passes as long as the torch path's threshold (the runtime's chunks on a long prompt): the next turn's
    own passes over the first turn's full chunks are the very passes that computed them, so it takes them and the
    stepwise rest; its keys and values are those of computing it whole. A prompt that differs inside a chunk
    takes the chunks before it only."""
    from hsd_opt.runtime import decode

    eng = _engine(tiny, "f32")
    chunk = eng._kernels.prefill_on_torch_from
    monkeypatch.setattr(decode, "PREFILL_CHUNK", chunk)
    hsd = _hsd(eng, StatePool(reuse=True))
    first = list(HEAD) + _tokens(50, 2 * chunk + 5)            # the head, two chunks off the kernels, 5 on them
    answer = hsd.generate(first, 8).token_ids
    held = hsd.pool.states(eng)[-1].off_steps
    assert held.passes == [(6, 6 + chunk), (6 + chunk, 6 + 2 * chunk)] and held.unmatched_from is None
    second = first + answer + _tokens(51, 3)
    d = _prefilled(hsd, second)
    assert d.prompt_reused >= len(first)
    fresh = _prefilled(_hsd(_engine(tiny, "f32")), second)
    n = len(second)
    a, b = d._states[id(eng)], fresh._states[id(fresh.hsd.target)]
    for l in range(4):
        assert torch.equal(a.k[l][:, :, :n], b.k[l][:, :, :n]) and torch.equal(a.v[l][:, :, :n], b.v[l][:, :, :n])
    d.close()
    fresh.close()
    other = list(first)
    other[6 + chunk + 3] = (other[6 + chunk + 3] + 1) % 60 + 3   # a token of the second chunk changed
    assert takable(eng, len(other), len(HEAD), hsd.pool.states(eng)[-1], 6 + chunk + 3) == 6 + chunk
    got = hsd.generate(other, 6)
    assert got.stats["prefill_tokens"] == len(other) - (6 + chunk)
    assert got.token_ids == _hsd(_engine(tiny, "f32")).generate(other, 6).token_ids


@needs_kernels
def test_a_batch_of_next_turns_answers_each_as_alone(tiny):
    """Next turns of three conversations decoded together after their first turns: each answer is the one an
    engine computing the prompt whole gives it alone, and each took its own conversation's positions."""
    eng = _engine(tiny, "f32")
    hsd = _hsd(eng, StatePool(keep_bytes=1 << 30, reuse=True))
    firsts = [list(HEAD) + _tokens(20 + i, 6 + 3 * i) for i in range(3)]
    answers = [r.token_ids for r in generate_many(hsd, firsts, 9, max_active=3)]
    seconds = [f + a + _tokens(30 + i, 4) for i, (f, a) in enumerate(zip(firsts, answers))]
    got = generate_many(hsd, seconds, 9, max_active=3)
    for p, r in zip(seconds, got):
        assert r.token_ids == _hsd(_engine(tiny, "f32")).generate(p, 9).token_ids
        assert r.stats["prefill_tokens"] <= 5


@needs_kernels
def test_a_state_too_short_for_the_next_turn_is_copied_into_a_longer_one(tiny):
    """(A quantized model: its long passes run on the kernels too.)"""
    eng = _engine(tiny, "q8")
    pool = StatePool(reuse=True)
    hsd = _hsd(eng, pool)
    first = list(HEAD) + _tokens(8, 10)
    answer = hsd.generate(first, 8).token_ids
    small = pool.states(eng)[-1]
    second = first + answer + _tokens(9, 300)                   # longer than the first state holds
    assert small.max_len < len(second) + 8
    d = _prefilled(hsd, second)
    st = d._states[id(eng)]
    assert st is not small and st.max_len >= len(second) + 8 and d.prompt_reused > len(first)
    d.close()
    assert hsd.generate(second, 8).token_ids == _hsd(_engine(tiny, "q8")).generate(second, 8).token_ids


def test_the_pool_keeps_each_engines_latest_and_others_within_its_bytes(tiny):
    a, b = _engine(tiny, "torch"), _engine(tiny, "torch")
    one = state_bytes(a.new_state(256))
    pool = StatePool(keep_bytes=one)
    sa = [a.new_state(256) for _ in range(3)]
    sb = b.new_state(256)
    for st in sa:
        pool.give(a, st)
    pool.give(b, sb)
    assert [id(s) for s in pool.states(a)] == [id(s) for s in sa[1:]]      # the latest, and one within the bytes
    assert [id(s) for s in pool.states(b)] == [id(sb)]
    taken = pool.take(a, 100, [])
    assert taken is sa[1] and taken.n == 0                       # nothing reused: the least recently given
    for kw, said in (({"keep_bytes": -1}, "keep_bytes: expected an integer >= 0"),
                     ({"keep_bytes": 1.5}, "keep_bytes: expected an integer >= 0"),
                     ({"reuse": "yes"}, "reuse: expected True or False")):      # ValueError; "yes" was taken
        with pytest.raises(HsdError, match=said):
            StatePool(**kw)


@needs_kernels
def test_a_kept_conversation_outlives_other_clients_requests_in_between(tiny):
    """``hsd serve --prompt-cache``: between two turns of a conversation, another client's request (sharing
    nothing past the template head) and a request sharing only the conversation's first turn's prompt (an edited
    answer, a regenerated one) took the kept state and cropped it: the pool held one conversation per request
    decoding at once, whatever its bytes, and the next turn computed its whole prompt again. Within the bytes,
    each gets a new state (the partial one a copy of the shared positions) and the next turn takes its whole
    conversation; every answer is the one computed without the pool."""
    eng = _engine(tiny, "f32")
    pool = StatePool(keep_bytes=1 << 30, reuse=True)
    hsd, fresh = _hsd(eng, pool), _hsd(eng)
    x1 = list(HEAD) + _tokens(1, 10)
    ans = hsd.generate(x1, 12).token_ids
    other = hsd.generate(list(HEAD) + _tokens(2, 10), 12)
    edited = x1 + _tokens(4, 3)                                  # the first turn's prompt, another answer
    forked = hsd.generate(edited, 6)
    assert forked.stats["prefill_tokens"] <= len(edited) - len(x1)    # x1's positions (at least) copied
    x2 = x1 + ans + _tokens(3, 5)
    got = hsd.generate(x2, 4)
    assert got.stats["prefill_tokens"] == 6, got.stats["prefill_tokens"]   # the 5 new, the answer's last token
    assert len(pool.states(eng)) == 3           # x2 took x1's state itself (it held nothing x2 did not take)
    for prompt, res, n in ((list(HEAD) + _tokens(2, 10), other, 12), (edited, forked, 6), (x2, got, 4)):
        assert res.token_ids == fresh.generate(prompt, n).token_ids


@needs_kernels
def test_a_full_pool_drops_the_conversations_unused_longest_not_a_recent_one(tiny):
    """The pool's room was measured with each engine's latest state, which its bytes leave out: once full, it
    stayed full, and a client sharing a recent conversation's system prompt cropped that conversation's state
    (its next turn computed 15 positions again) while older conversations' states stayed. Each turn also kept a
    copy of the turns before it."""
    eng = _engine(tiny, "f32")
    one = state_bytes(eng.new_state(256, [2, 4]))
    pool = StatePool(keep_bytes=3 * one, reuse=True)             # three states beyond the latest
    hsd, fresh = _hsd(eng, pool), _hsd(eng)
    for s in range(3):
        hsd.generate(list(HEAD) + _tokens(100 + s, 6), 8)        # other clients' conversations, older
        assert pool.kept_bytes() <= pool.keep_bytes
    system = list(HEAD) + _tokens(1, 4)
    x1 = system + _tokens(2, 4)
    ans = hsd.generate(x1, 8).token_ids                          # conversation X, turn 1
    hsd.generate(system + _tokens(3, 4), 8)                      # client Y: the same system prompt
    x2 = x1 + ans + _tokens(4, 3)
    got = hsd.generate(x2, 4)
    assert got.stats["prefill_tokens"] <= 4, got.stats["prefill_tokens"]   # the 3 new (and the last answer token)
    assert got.token_ids == fresh.generate(x2, 4).token_ids
    assert pool.kept_bytes() <= pool.keep_bytes and len(pool.states(eng)) == 4


def test_a_pool_without_bytes_keeps_one_state_per_engine(tiny):
    a = _engine(tiny, "torch")
    pool = StatePool()
    states = [a.new_state(256) for _ in range(3)]
    for st in states:
        pool.give(a, st)
    assert [id(s) for s in pool.states(a)] == [id(states[-1])]
    assert pool.take(a, 10_000, []) is not states[-1]           # too short: a new one


def test_cropping_to_nothing_makes_a_state_stepwise_again(tiny):
    eng = _engine(tiny, "torch")
    st = eng.new_state(64)
    eng.append(st, list(HEAD) + [4, 5])
    eng.advance(st, 4)
    assert not st.stepwise
    eng.crop(st, 3)
    assert not st.stepwise
    eng.crop(st, 0)
    assert st.stepwise


@needs_kernels
def test_keys_and_values_from_another_model_are_not_stepwise(tiny):
    src, copy = LayeredLM(tiny, kernels=True), QuantizedLM(tiny, bits=8, kernels=True)
    prompt = list(HEAD) + [4, 5, 6]
    s = src.new_state(64)
    s.prompt = len(prompt)
    src.append(s, prompt)
    src.advance(s, 4)
    assert s.stepwise
    c = copy.new_state(64)
    copy.append(c, prompt)
    assert copy.share_prompt(c, src, s, 4) == len(prompt) - 1
    assert not c.stepwise



@needs_kernels
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_prompt_copies_the_positions_of_one_still_decoding(tiny, temperature):
    """The same prompt twice in one batch: the second copies the first's prompt positions while the first decodes
    (it computes only the last position), and both answers are those of an engine computing the prompt alone."""
    eng = _engine(tiny, "f32")
    hsd = _hsd(eng, StatePool(reuse=True))
    prompt = list(HEAD) + _tokens(40, 12)
    got = generate_many(hsd, [prompt, prompt], 10, temperature=temperature, max_active=2, seeds=[3, 4])
    assert [r.stats["prefill_tokens"] for r in got] == [len(prompt), 1]     # no head kept yet
    for r, seed in zip(got, (3, 4)):
        assert r.token_ids == _hsd(_engine(tiny, "f32")).generate(prompt, 10, temperature=temperature,
                                                                  seed=seed).token_ids


@needs_kernels
def test_a_state_lent_by_a_decoding_dropped_unclosed_is_not_kept(tiny):
    import gc

    eng = _engine(tiny, "f32")
    pool = StatePool(reuse=True)
    hsd = _hsd(eng, pool)
    prompt = list(HEAD) + _tokens(41, 12)
    d = _prefilled(hsd, prompt)
    assert len(pool._live) == 1
    del d
    gc.collect()
    again = _prefilled(hsd, prompt)
    assert again.prompt_reused == len(HEAD)                  # nothing left to copy from but the kept head
    again.close()
    assert pool._live == []


@needs_kernels
def test_layers_catching_up_over_earlier_positions_match_no_prompt_pass(tiny):
    """A prompt pass off the kernels to layer 2, then layers 2 and 3 catching up over those positions (a deeper
    hierarchy after a switch): the upper layers were not computed by the prompt's own pass, so nothing there may
    be taken as if they were."""
    eng = _engine(tiny, "f32")
    ids = list(HEAD) + _tokens(60, eng._kernels.prefill_on_torch_from + 4)
    st = eng.new_state(256)
    st.prompt = len(ids)
    eng.append(st, ids)
    eng.advance(st, 2)
    assert st.off_steps.passes == [(0, len(ids))] and st.off_steps.unmatched_from is None
    eng.advance(st, 4)
    assert st.off_steps.unmatched_from == 0 and not st.off_steps.computed_by(0, len(ids))
    assert takable(eng, len(ids) + 5, 0, st, len(ids)) == 0


def test_a_pass_cut_by_a_crop_or_overlapped_matches_nothing():
    from hsd_opt.engine.state import OffSteps

    cut = OffSteps([(0, 10), (10, 20)]).below(15)
    assert cut.passes == [(0, 10)] and cut.unmatched_from == 10 and cut.first_within(0, 15) == 0
    assert cut.computed_by(0, 10) and not cut.computed_by(10, 20)
    assert not OffSteps([(0, 10), (0, 20)]).computed_by(0, 10)
    assert OffSteps().none and OffSteps().first_within(0, 100) is None


@needs_kernels
def test_a_copy_sharing_the_targets_prompt_keeps_its_prompt_length(tiny):
    target, copy = LayeredLM(tiny, kernels=True), QuantizedLM(tiny, bits=8, kernels=True)
    hsd = HSD([Level("q8", copy, 4), Level("target", target, 4)], [2], pool=StatePool(reuse=True))
    prompt = list(HEAD) + _tokens(61, 9)
    hsd.generate(prompt, 4)
    d = _prefilled(hsd, prompt + [5, 6])
    assert d._states[id(copy)].prompt == len(prompt) + 2 and not d._states[id(copy)].stepwise
    d.close()


def test_the_pool_forgets_the_states_of_an_engine_no_longer_held(tiny):
    import gc

    pool = StatePool(keep_bytes=1 << 30)
    gone = _engine(tiny, "torch")
    pool.give(gone, gone.new_state(256))
    del gone
    gc.collect()
    kept = _engine(tiny, "torch")
    pool.give(kept, kept.new_state(256))
    assert len(pool._free) == 1 and pool.states(kept)
