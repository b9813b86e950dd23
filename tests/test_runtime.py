"""The HSD runtime is lossless under greedy decoding: on tiny random Llamas, every hierarchy (depth 2..4, early
exits, another model, a token drafter at the bottom, varied budgets, exact and eager modes) emits exactly our
autoregressive greedy output, token for token, including EOS in the middle and max_new_tokens limits."""

from __future__ import annotations

import random

import pytest
import torch

from hsd_opt.engine.layered import LayeredLM
from hsd_opt.errors import HsdError
from hsd_opt.runtime.batch import generate_many
from hsd_opt.runtime.decode import HSD, Decoding, Level
from hsd_opt.runtime.sampling import process_logits
from tests.helpers import AbstainingCycleDrafter, CycleDrafter, make_tiny_llama, stepwise_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _ar(lm, prompt, n, eos=()):
    """The target's greedy tokens (the reference, read step by step off its logits), checked to be what the target
    alone decodes."""
    want = stepwise_greedy(lm, prompt, n, eos)
    assert HSD([Level("target", lm, lm.n_layers)], [], eos_ids=eos).generate(prompt, n).token_ids == want
    return want


def _random_hierarchy(rng, lm, other, vocab):
    """A random chain, cheapest first: optional token drafter, some exits of lm (and maybe another model)."""
    L = lm.n_layers
    depth = rng.choice([2, 3, 4])
    exits = sorted(rng.sample(range(1, L), k=min(depth - 1, L - 1)))
    levels = [Level(f"layer{b}", lm, b) for b in exits]
    if other is not None and rng.random() < 0.3:
        levels.insert(0, Level("other", other, other.n_layers))
    if rng.random() < 0.4:
        levels.insert(0, Level("cycle", drafter=CycleDrafter(vocab)))
    levels = levels[: depth - 1] if len(levels) > depth - 1 else levels
    levels.append(Level(f"layer{L}", lm, L))
    budgets = sorted(rng.randint(1, 6) for _ in range(len(levels) - 1))
    return levels, budgets


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(8))
def test_greedy_lossless_tiny_random_hierarchies(seed):
    rng = random.Random(seed)
    vocab = 48
    # peaky weights so the exits agree with the target some of the time and both branches are exercised
    model = make_tiny_llama(seed=seed, vocab_size=vocab, layers=6, scale=6.0)
    lm = LayeredLM(model)
    other = LayeredLM(make_tiny_llama(seed=100 + seed, vocab_size=vocab, layers=2, scale=6.0))
    prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 12))]
    n_new = rng.randint(1, 40)
    ref = _ar(lm, prompt, n_new)
    assert len(ref) == n_new
    eos_tok = ref[len(ref) // 2]  # an EOS in the middle of the reference
    ref_eos = ref[: ref.index(eos_tok) + 1]
    assert _ar(lm, prompt, n_new, eos=[eos_tok]) == ref_eos
    for trial in range(4):
        levels, budgets = _random_hierarchy(rng, lm, other, vocab)
        for mode in ("exact", "eager"):
            for eos, want in (((), ref), ((eos_tok,), ref_eos)):
                h = HSD(levels, budgets, eos_ids=eos, mode=mode)
                res = h.generate(prompt, n_new)
                assert res.token_ids == want, ([lv.name for lv in levels], budgets, mode, eos)
                assert res.stats["tokens"] == len(want)
                assert res.stats["stopped"] == ("eos" if eos and want[-1] == eos_tok else "max_new_tokens")


@pytest.mark.slow
def test_greedy_lossless_fixed_depths_and_acceptance():
    """Depth 2, 3 and 4 exit chains with several budgets; the exits agree with the target often enough that
    multi-token acceptances happen (checked), and the engine state is reused across prompts."""
    model = make_tiny_llama(seed=11, vocab_size=32, layers=8, scale=8.0)
    lm = LayeredLM(model)
    prompts = [[5, 9, 3], [7] * 5, list(range(4, 20))]
    chains = [([6], [[1], [3], [8]]), ([3, 6], [[1, 2], [2, 5], [4, 4]]),
              ([2, 4, 7], [[1, 1, 1], [2, 3, 6], [3, 3, 9]])]
    any_multi = False
    for exits, budget_sets in chains:
        levels = [Level(f"layer{b}", lm, b) for b in exits] + [Level("layer8", lm, 8)]
        for budgets in budget_sets:
            for mode in ("exact", "eager"):
                h = HSD(levels, budgets, mode=mode)
                for p in prompts:
                    res = h.generate(p, 30)
                    assert res.token_ids == _ar(lm, p, 30)
                    any_multi |= res.stats["tokens_per_target_call"] > 1.5
    assert any_multi


def test_exact_mode_hands_up_exactly_budget():
    """In exact mode the target verifies blocks of exactly T_{n-1} drafts (except at the end of generation)."""
    model = make_tiny_llama(seed=4, vocab_size=32, layers=6, scale=8.0)
    lm = LayeredLM(model)
    sizes = []
    orig = Decoding._level

    def spy(self, k):
        room = self.limit - len(self.seq)
        toks, q = yield from orig(self, k)
        if k == 1 and len(self.hsd.levels) == 3:
            sizes.append((len(toks), room))
        return toks, q

    Decoding._level = spy
    try:
        h = HSD([Level("l1", lm, 1), Level("l3", lm, 3), Level("l6", lm, 6)], [2, 5], mode="exact")
        h.generate([3, 4, 5], 60)
    finally:
        Decoding._level = orig
    assert len(sizes) > 5 and all(n == min(5, room) for n, room in sizes)


def _record_rounds_and_passes(monkeypatch, lm, upto):
    """Record, in order, every pass of ``lm`` up to layer ``upto`` (``("pass", positions)``) and every round of
    the top level (``("round", whole block accepted)``) while ``monkeypatch`` is in effect; returns the list."""
    events = []
    orig_advance, orig_level = lm.advance, Decoding._level

    def advance(st, u):
        work = orig_advance(st, u)
        if u == upto:
            events.append(("pass", work // u))
        return work

    def level(self, k):
        stats = self.stats[self.hsd.levels[k].name]
        before = (stats.drafted, stats.accepted)
        out = yield from orig_level(self, k)
        if k == len(self.hsd.levels) - 1:
            d, a = stats.drafted - before[0], stats.accepted - before[1]
            events.append(("round", d > 0 and a == d))
        return out

    monkeypatch.setattr(lm, "advance", advance)
    monkeypatch.setattr(Decoding, "_level", level)
    return events


@pytest.mark.parametrize("budget", [1, 3])
def test_a_fully_accepted_block_costs_a_separate_drafter_one_more_position(budget, monkeypatch):
    """The runtime behind the latency model's catch-up term (docs/design.md, "Catch-up after an accepted
    block"): a drafter with its own cache computes 2 positions in its first step after the target accepted its
    whole block (its own last draft and the bonus token), 1 after a rejection (the corrected token) and in every
    other step; an exit that shares the target's cache computes 1 position in every step."""
    model = make_tiny_llama(seed=4, vocab_size=32, layers=6, scale=8.0)
    target, drafter = LayeredLM(model), LayeredLM(model)        # two engines: two caches, the same weights
    for levels, lm in (([Level("other5", drafter, 5), Level("l6", target, 6)], drafter),
                       ([Level("l5", target, 5), Level("l6", target, 6)], target)):
        with monkeypatch.context() as m:
            events = _record_rounds_and_passes(m, lm, 5)
            HSD(levels, [budget]).generate([3, 4, 5, 6], 80)
        passes_after = []          # per round: the positions of the drafter's passes in the next round
        for kind, v in events[1:]:                              # events[0]: the prefill
            if kind == "round":
                passes_after.append((v, []))
            elif passes_after:
                passes_after[-1][1].append(v)
        rounds = [(full, ps) for full, ps in passes_after if ps]
        full = sum(f for f, _ in rounds)
        assert full >= 3 and len(rounds) - full >= 3, rounds    # both kinds of round happened
        shared = lm is target
        for f, ps in rounds:
            assert ps == [2 if f and not shared else 1] + [1] * (len(ps) - 1), (f, ps)


def test_token_drafter_bottom_and_observe():
    model = make_tiny_llama(seed=5, vocab_size=40, layers=4, scale=6.0)
    lm = LayeredLM(model)
    dr = CycleDrafter(40)
    dr.fork = lambda: dr                 # the generation uses this very drafter (not a fork of it)
    prompt = [3, 4, 5, 6, 3, 4, 5]
    h = HSD([Level("cycle", drafter=dr), Level("layer2", lm, 2), Level("layer4", lm, 4)], [3, 4])
    res = h.generate(prompt, 25)
    assert res.token_ids == _ar(lm, prompt, 25)
    assert dr.observed == 25
    st = res.stats
    assert [lv["name"] for lv in st["levels"]] == ["cycle", "layer2", "layer4"]
    assert st["levels"][0]["drafted"] >= 1 and st["target_calls"] == st["levels"][-1]["calls"]


def test_ngram_drafter_at_the_bottom_is_lossless():
    from hsd_opt.drafters import make_token_drafter

    dr = make_token_drafter("ngram_context", q=2, w=4)
    model = make_tiny_llama(seed=6, vocab_size=40, layers=4, scale=6.0)
    lm = LayeredLM(model)
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    for budgets in ([1, 2], [3, 3], [4, 8]):
        h = HSD([Level("ngram", drafter=dr), Level("layer1", lm, 1), Level("layer4", lm, 4)], budgets)
        assert h.generate(prompt, 30).token_ids == _ar(lm, prompt, 30)


def test_abstaining_drafters_at_the_bottom_are_lossless():
    """Rounds where the bottom proposes nothing are plain steps of the level above; short blocks are verified
    as they are. Both the n-gram lookup (abstains without a 2-gram match) and a drafter that abstains on a
    third of the contexts give exactly the greedy reference, and every kind of round occurs."""
    from hsd_opt.drafters import make_token_drafter

    model = make_tiny_llama(seed=6, vocab_size=40, layers=4, scale=6.0)
    lm = LayeredLM(model)
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    ref = _ar(lm, prompt, 30)
    lookup = make_token_drafter("ngram_context", name="lookup", q=3, w=4, min_q=2, abstain=True)
    assert lookup.may_abstain and lookup.propose([1, 2, 3, 4], 3) == []
    for dr in (lookup, AbstainingCycleDrafter(40)):
        for budgets in ([1, 2], [3, 3], [4, 8]):
            h = HSD([Level(dr.name, drafter=dr), Level("layer1", lm, 1), Level("layer4", lm, 4)], budgets)
            res = h.generate(prompt, 30)
            assert res.token_ids == ref, (dr.name, budgets)
            bottom = res.stats["levels"][0]
            assert 0 < bottom["abstained"] < bottom["calls"] and bottom["drafted"] > 0
        h = HSD([Level(dr.name, drafter=dr), Level("layer4", lm, 4)], [3])
        assert h.generate(prompt, 30).token_ids == ref
    with pytest.raises(HsdError, match="returned 1 tokens, expected 3"):   # only a drafter that may abstain may
        HSD([Level("cut", drafter=_Short(40)), Level("layer4", lm, 4)], [3]).generate(prompt, 5)
    # a drafter that drafts by appending to the context it is given (the decoding's own sequence) is refused: the
    # appended tokens would be taken as the target's
    with pytest.raises(HsdError, match="drafter 'cut' changed the context it was given"):
        HSD([Level("cut", drafter=_Appending(40)), Level("layer4", lm, 4)], [3]).generate(prompt, 5)


class _Appending(CycleDrafter):
    name = "cut"

    def propose(self, context, n):
        out = super().propose(context, n)
        context.append(out[0])
        return out


class _Short(CycleDrafter):
    name = "cut"

    def propose(self, context, n):
        return super().propose(context, n)[:1]


def test_bad_hierarchies_and_inputs():
    lm = LayeredLM(make_tiny_llama(seed=1))
    with pytest.raises(HsdError, match="token drafter may only be the bottom"):
        HSD([Level("a", lm, 1), Level("c", drafter=CycleDrafter(64)), Level("t", lm, 4)], [1, 2])
    with pytest.raises(HsdError, match="budgets"):
        HSD([Level("a", lm, 1), Level("t", lm, 4)], [1, 2])
    with pytest.raises(HsdError, match="an integer >= 1, got 0"):
        HSD([Level("a", lm, 1), Level("t", lm, 4)], [0])
    with pytest.raises(HsdError, match=r"budgets\[0\]: expected an integer >= 1, got '3'"):   # "got 3": which?
        HSD([Level("a", lm, 1), Level("t", lm, 4)], ["3"])
    h = HSD([Level("a", lm, 1), Level("t", lm, 4)], [2])
    with pytest.raises(HsdError, match="empty prompt"):
        h.generate([], 4)
    with pytest.raises(HsdError, match="max-new-tokens"):
        h.generate([3], 0)
    with pytest.raises(HsdError, match="top-p"):
        h.generate([3], 2, temperature=1.0, top_p=0.0)
    with pytest.raises(HsdError, match="an integer >= 1, got 2.5"):
        h.generate([3], 2.5)
    with pytest.raises(HsdError, match="got text: encode it first"):
        h.generate("w3 w4", 2)
    for bad in (-1, lm.vocab_size):
        with pytest.raises(HsdError, match=f"token id {bad}, outside the model's vocabulary 0 .. {lm.vocab_size - 1}"):
            h.generate([3, bad, 4], 2)
    # a hierarchy that knows the model's context refuses a generation past it (the server's check, for the API too)
    ctx = HSD([Level("a", lm, 1), Level("t", lm, 4)], [2], max_positions=16)
    with pytest.raises(HsdError, match=r"the prompt \(10 tokens\) \+ --max-new-tokens \(7\) exceeds the model's "
                                       r"context of 16 positions"):
        ctx.generate(list(range(3, 13)), 7)
    assert len(ctx.generate(list(range(3, 13)), 6).token_ids) <= 6
    # what a caller of the API may hand over by mistake is one line naming it, never a value cut to an integer
    want = h.generate([3, 4], 3).token_ids
    assert h.generate(torch.tensor([3, 4]), 3).token_ids == want            # a 1-D tensor of ids is a prompt
    for prompt, words in ((torch.tensor([[3, 4]]), r"shape \(1, 2\) \(for a batch of one, pass its row"),
                          ([[3, 4]], r"token ids \(integers\), got \[3, 4\] at position 0"),
                          ([3.9, 4], r"got 3.9 at position 0"), (None, "a sequence of token ids, got NoneType")):
        with pytest.raises(HsdError, match=words):
            h.generate(prompt, 3)
    for kwargs, words in (({"temperature": "1"}, "--temperature"), ({"temperature": 1.0, "seed": 1.5}, "--seed"),
                          ({"temperature": 1.0, "top_p": "0.9"}, "--top-p")):
        with pytest.raises(HsdError, match=words):
            h.generate([3, 4], 3, **kwargs)
    for kwargs, words in (({"penalties": {"repeat": 1.1}}, "penalties: expected None or a hsd_opt.runtime"),
                          ({"constraint": "json"}, "constraint: expected None or a hsd_opt.grammar"),
                          ({"on_tokens": 5}, "on_tokens: expected None or a function, got int")):
        with pytest.raises(HsdError, match=words):                # AttributeError or TypeError mid-generation
            h.generate([3, 4], 3, **kwargs)
    for budgets in (["a"], [2.7], [True]):
        with pytest.raises(HsdError, match=r"budgets\[0\]"):
            HSD([Level("a", lm, 1), Level("t", lm, 4)], budgets)
    with pytest.raises(HsdError, match=r"seeds: expected one per prompt \(2\), got 1"):
        generate_many(h, [[3, 4], [5]], 3, temperature=1.0, seeds=[1])
    # cheapest first, target last: an exit above a deeper one of the same model (or the target below an exit)
    # decoded the lower level's greedy output as if it were the target's
    for levels in ([Level("b", lm, 2), Level("a", lm, 1), Level("t", lm, 4)], [Level("t", lm, 4), Level("a", lm, 4)]):
        with pytest.raises(HsdError, match="must read deeper than those below it"):
            HSD(levels, [1] * (len(levels) - 1))
    with pytest.raises(HsdError, match="level 'x': neither an engine nor a drafter"):
        HSD([Level("x"), Level("t", lm, 4)], [2])
    assert HSD([Level("a", lm, 1), Level("t", lm, 4)], [2], eos_ids=None).generate([3, 4], 3).token_ids == want
    for kwargs, words in (({"logprobs": True}, "--logprobs: expected a number of alternatives 0 .. 20, got True"),
                          ({"logprobs": 2.5}, "got 2.5"), ({"temperature": 1.0, "min_p": "x"}, "--min-p")):
        with pytest.raises(HsdError, match=words):
            h.generate([3, 4], 3, **kwargs)


def test_process_logits_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = process_logits(logits, 1.0, 0.8)
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = process_logits(logits, 1.0, 0.5)  # the top token alone reaches 0.5
    assert torch.allclose(p, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    assert torch.allclose(process_logits(logits, 1.0, 1.0), torch.exp(logits))


def test_budgets_keep_every_verification_within_an_exact_pass():
    """A verification covers at most EXACT_PASS positions (those the kernels compute as the target's steps): a
    budget of EXACT_PASS - 1 is taken, one more is refused naming the budgets; in eager mode the budgets in all."""
    from hsd_opt.engine.interface import EXACT_PASS

    lm = LayeredLM(make_tiny_llama(seed=0))
    two = [Level("layer1", lm, 1), Level("layer4", lm, 4)]
    three = [Level("layer1", lm, 1), Level("layer2", lm, 2), Level("layer4", lm, 4)]
    HSD(two, [EXACT_PASS - 1])
    HSD(three, [EXACT_PASS - 1, EXACT_PASS - 1])                   # exact: each level verifies one budget
    with pytest.raises(HsdError, match=f"over {EXACT_PASS + 1} positions"):
        HSD(two, [EXACT_PASS])
    HSD(three, [EXACT_PASS // 2, EXACT_PASS // 2 - 1], mode="eager")
    with pytest.raises(HsdError, match="in all"):
        HSD(three, [EXACT_PASS // 2, EXACT_PASS // 2], mode="eager")
