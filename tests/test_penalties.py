"""Frequency and presence penalties and logit biases: the offsets are the API's formula; HSD with them is lossless
against the penalised target decoded alone (greedy token for token against an autoregressive reference that adds
the offsets to every logit, at every depth, alone and in a batch, under a grammar, on the embedded model's
screened head; sampled, the penalised target's distribution, which decoding that ignores the penalties fails)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from hsd_opt.engine.layered import LayeredLM
from hsd_opt.errors import HsdError
from hsd_opt.runtime.batch import generate_many
from hsd_opt.runtime.decode import HSD, Level
from hsd_opt.runtime.penalties import Penalties, penalties_or_none
from hsd_opt.runtime.sampling import process_logits
from tests.helpers import CycleDrafter, chi_square_pvalue, engine_logits, four_hierarchies, make_tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PEN = Penalties(0.7, 0.4, {7: 2.5, 11: -3.0})


def _offsets_by_formula(pen: Penalties, generated: list[int], vocab: int) -> torch.Tensor:
    """The API's formula written out token by token: ``bias - (frequency * count + presence)`` where the token
    occurs, ``bias`` elsewhere (float32 arithmetic, as the decoding's)."""
    row = torch.zeros(vocab, dtype=torch.float32)
    for t, b in pen.bias.items():
        row[t] = b
    for t in set(generated):
        c = torch.tensor(float(generated.count(t)), dtype=torch.float32)
        row[t] = row[t] + -(c * torch.tensor(pen.frequency, dtype=torch.float32)
                            + torch.tensor(pen.presence, dtype=torch.float32))
    return row


def _moved_by_formula(pen: Penalties, context: list[int], generated: list[int], logits: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[V]`` of the row after ``context`` (the prompt's and the generated tokens; ``generated`` the
    latter) moved as written out: :func:`_offsets_by_formula`, and for each distinct token of the context (its last
    ``repetition_last``) ``r(l) - l`` added to its offset, ``r(l)`` ``l / repetition`` for ``l`` > 0, else ``l *
    repetition`` (float32)."""
    row = _offsets_by_formula(pen, generated, logits.shape[-1])
    if pen.repetition != 1.0:
        tail = context[-pen.repetition_last:] if pen.repetition_last else context
        for t in sorted(set(tail)):
            v = logits[t].float()
            r = v / pen.repetition if float(v) > 0 else v * pen.repetition
            row[t] = row[t] + (r - v)
    return logits + row


def _reference(lm, prompt: list[int], n: int, pen: Penalties, eos: frozenset = frozenset()) -> list[int]:
    """The penalised target decoded alone, greedy, from its whole logits: ``argmax(logits + offsets)`` per step."""
    gen: list[int] = []
    for _ in range(n):
        logits = engine_logits(lm, torch.tensor(prompt + gen), len(prompt))[-1]
        gen.append(int(torch.argmax(_moved_by_formula(pen, prompt + gen, gen, logits))))
        if gen[-1] in eos:
            break
    return gen


@pytest.fixture(scope="module")
def lm():
    return LayeredLM(make_tiny_llama(seed=5, vocab_size=48, layers=6, scale=6.0))


def test_offsets_are_the_apis_formula():
    rng = random.Random(0)
    for _ in range(20):
        pen = Penalties(rng.uniform(-2, 2), rng.uniform(-2, 2),
                        {rng.randrange(40): rng.uniform(-100, 100) for _ in range(rng.randint(0, 4))})
        gen = [rng.randrange(40) for _ in range(rng.randint(0, 30))]
        assert torch.equal(pen.offsets(gen, 40), _offsets_by_formula(pen, gen, 40))
        rows = pen.rows(gen, 0, len(gen) + 1, 40)
        assert rows.shape == (len(gen) + 1, 40)
        for n in range(len(gen) + 1):
            assert torch.equal(rows[n], pen.offsets(gen[:n], 40))
    # a token twice: both penalties once, the frequency twice
    assert Penalties(0.5, 0.25).offsets([3, 3, 4], 6).tolist() == [0, 0, 0, -1.25, -0.75, 0]


@pytest.mark.parametrize("kwargs, words", [
    ({"frequency": 2.5}, r"frequency_penalty must be a number in \[-2, 2\], got 2.5"),
    ({"presence": float("nan")}, r"presence_penalty must be a number in \[-2, 2\]"),
    ({"bias": {-1: 1.0}}, r"logit_bias: token ids must be non-negative integers, got -1"),
    ({"bias": {3: 101}}, r"logit_bias\[3\] must be a number in \[-100, 100\], got 101"),
    ({"bias": {3: "1"}}, r"logit_bias\[3\] must be a number"),
    ({"repetition": 0.0}, r"the repetition penalty must be a number in \[0.1, 10\], got 0.0"),
    ({"repetition": 1e-39}, r"in \[0.1, 10\], got 1e-39"),        # logits / 1e-39: out of float32's range
    ({"repetition": 0.099}, r"in \[0.1, 10\], got 0.099"),
    ({"repetition": float("inf")}, r"the repetition penalty must be a number"),
    ({"repetition": 1.1, "repetition_last": 0}, r"repeat_last_n must be a positive integer, got 0"),
])
def test_bad_penalties_are_refused_naming_the_field(kwargs, words):
    with pytest.raises(HsdError, match=words):
        Penalties(**kwargs)


def test_a_biased_token_outside_the_vocabulary_is_refused(lm):
    with pytest.raises(HsdError, match="logit_bias: token id 48 is not in the model's vocabulary of 48"):
        HSD([Level("target", lm, lm.n_layers)], []).generate([3, 4], 2, penalties=Penalties(bias={48: 1.0}))


def test_nothing_that_moves_is_no_penalties():
    assert penalties_or_none() is None and penalties_or_none(0.0, 0.0, {5: 0.0}) is None
    assert penalties_or_none(0.1) == Penalties(0.1)
    assert penalties_or_none(repetition=1.0, repetition_last=64) is None
    assert penalties_or_none(repetition=1.2) == Penalties(repetition=1.2)


def test_the_repetition_penalty_is_its_formula():
    """The repeated tokens are the context's distinct ids (its last ``repetition_last``), and a logit ``l`` moves to
    ``l / r`` where positive, ``l * r`` elsewhere."""
    pen = Penalties(repetition=1.25, repetition_last=3)
    assert pen.repeated([7, 1, 5, 5, 2]).tolist() == [2, 5]
    assert Penalties(repetition=1.25).repeated([7, 1, 5, 5, 2]).tolist() == [1, 2, 5, 7]
    assert Penalties(0.5).repeated([7, 1]).numel() == 0 and pen.repeated([]).numel() == 0
    v = torch.tensor([2.5, -2.0, 0.0, 5.0])
    assert torch.equal(v + pen.repetition_offsets(v), torch.tensor([2.0, -2.5, 0.0, 4.0]))


@pytest.mark.parametrize("seed", range(3))
def test_greedy_with_penalties_is_the_penalised_targets_at_every_depth(lm, seed):
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 48) for _ in range(rng.randint(1, 10))]
    n = rng.randint(12, 30)
    pen = Penalties(rng.uniform(0.2, 1.5), rng.uniform(0, 1), {rng.randrange(48): rng.uniform(-5, 5)},
                    *[(1.0, None), (1.6, None), (1.3, 5)][seed])
    ref = _reference(lm, prompt, n, pen)
    assert ref != _reference(lm, prompt, n, Penalties())        # the penalties change this output
    for levels, budgets in four_hierarchies(lm, 48):
        for mode in ("exact", "eager"):
            for logprobs in (None, 2):
                res = HSD(levels, budgets, mode=mode).generate(prompt, n, penalties=pen, logprobs=logprobs)
                assert res.token_ids == ref, ([lv.name for lv in levels], mode, logprobs)


def test_penalties_in_a_batch_equal_alone(lm):
    """Sequences with other penalties, or none, share passes: each decodes what it decodes alone."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 48) for _ in range(rng.randint(1, 9))] for _ in range(5)]
    pens = [PEN, None, Penalties(1.2), Penalties(bias={9: 4.0}), Penalties(0.3, 1.1, repetition=1.4)]
    levels, budgets = four_hierarchies(lm, 48)[2]
    h = HSD(levels, budgets)
    alone = [h.generate(p, 18, penalties=pen).token_ids for p, pen in zip(prompts, pens)]
    together = generate_many(h, prompts, 18, max_active=3, penalties=pens)
    assert [r.token_ids for r in together] == alone
    for kw in ({}, {"top_k": 6, "min_p": 0.01}):
        sampled_alone = [h.generate(p, 18, temperature=0.9, seed=i, penalties=pen, **kw).token_ids
                         for i, (p, pen) in enumerate(zip(prompts, pens))]
        sampled = generate_many(h, prompts, 18, max_active=3, temperature=0.9, seeds=range(5), penalties=pens, **kw)
        assert [r.token_ids for r in sampled] == sampled_alone, kw


def test_penalties_under_a_grammar_are_the_masked_penalised_targets():
    """The offsets move the logits, the grammar masks them: greedy HSD equals the reference that does both."""
    from hsd_opt.grammar.compiler import GrammarCompiler, GrammarSpec
    from hsd_opt.grammar.constraint import Constraint, mask_logits
    from tests.helpers import JSON_TOKENS, TinyTokenizer

    eos = 2
    tok = TinyTokenizer(JSON_TOKENS)
    grammar = GrammarCompiler(tok, eos, 64).compile(GrammarSpec.json_schema(
        {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
         "required": ["name", "n"], "additionalProperties": False}, "schema.json"))
    eng = LayeredLM(make_tiny_llama(seed=3, vocab_size=64, layers=4, hidden=64, heads=4, kv_heads=2, scale=8.0))
    prompt = [5, 9, 12]
    pen = Penalties(1.0, 0.5, {tok.encode("7")[0]: 3.0})
    c, gen = Constraint(grammar), []
    for _ in range(40):
        logits = engine_logits(eng, torch.tensor(prompt + gen), len(prompt))[-1]
        moved = logits + _offsets_by_formula(pen, gen, 64)
        gen.append(int(mask_logits(moved[None], c.allowed(gen, len(gen))[None])[0].argmax()))
        if gen[-1] == eos:
            break
    for levels, budgets in (([Level("target", eng, 4)], []),
                            ([Level("cycle", drafter=CycleDrafter(64)), Level("layer2", eng, 2),
                              Level("target", eng, 4)], [2, 3])):
        res = HSD(levels, budgets, eos_ids=[eos]).generate(prompt, 40, constraint=Constraint(grammar), penalties=pen)
        assert res.token_ids == gen, [lv.name for lv in levels]


V, K, N = 12, 2, 1000
PROMPT = [3, 5, 7]


@pytest.fixture(scope="module")
def peaky():
    model = make_tiny_llama(seed=0, vocab_size=V, layers=4, scale=15.0)
    return model, LayeredLM(model)


def _exact(model, pen: Penalties, temperature: float, top_p: float, top_k: int = 0, min_p: float = 0.0) -> dict:
    """The exact probability of every K-token continuation under the penalised target's processed distribution."""
    out = {}
    for s in itertools.product(range(V), repeat=K - 1):
        with torch.no_grad():
            lg = model(torch.tensor([PROMPT + list(s)])).logits[0, len(PROMPT) - 1:]
        rows = torch.stack([_moved_by_formula(pen, PROMPT + list(s[:k]), list(s[:k]), lg[k]) for k in range(K)])
        p = process_logits(rows, temperature, top_p, top_k, min_p)
        pre = 1.0
        for k in range(K - 1):
            pre *= float(p[k, s[k]])
        for x in range(V):
            out[tuple(s) + (x,)] = pre * float(p[K - 1, x])
    return out


def _pvalue(h, probs, temperature, top_p, pen, top_k=0, min_p=0.0):
    from tests.test_runtime_sampling import _pvalue_of

    return _pvalue_of(lambda seed: h.generate(PROMPT, K, temperature=temperature, top_p=top_p, seed=seed,
                                              penalties=pen, top_k=top_k, min_p=min_p).token_ids, probs)


@pytest.mark.slow
def test_sampled_with_penalties_follows_the_penalised_targets_distribution(peaky):
    """Draws by noise (the target alone, over a token drafter: the screen's picks with the offsets added to the
    noise) and distributions (exits verifying exits, top-p; top-k and min-p: the window of the offset logits
    through the screen): the penalised target's distribution; decoding that drops the penalties fails the same
    test."""
    model, lm = peaky
    assert lm.picks_cheaply
    pen = Penalties(1.5, 1.0, {4: 1.5})
    repeats = Penalties(0.5, 0.0, {}, 2.0)               # the repetition penalty, over the prompt too
    exits = [Level("layer1", lm, 1), Level("layer2", lm, 2), Level("layer4", lm, 4)]
    cycle = [Level("cycle", drafter=CycleDrafter(V, step=1)), Level("layer4", lm, 4)]
    for temperature, top_p, top_k, min_p, levels, budgets, pen in (
            (1.0, 1.0, 0, 0.0, [Level("layer4", lm, 4)], [], pen),
            (0.8, 1.0, 0, 0.0, cycle, [2], pen),
            (1.0, 0.9, 0, 0.0, exits, [2, 3], pen),
            (1.0, 1.0, 3, 0.05, exits, [2, 3], pen),
            (1.0, 1.0, 0, 0.0, cycle, [2], repeats),
            (1.0, 1.0, 3, 0.0, exits, [2, 3], repeats)):
        probs = _exact(model, pen, temperature, top_p, top_k, min_p)
        p_ok = _pvalue(HSD(levels, budgets), probs, temperature, top_p, pen, top_k, min_p)
        assert p_ok > 1e-3, (temperature, top_p, top_k, min_p, p_ok)
    for pen in (Penalties(1.5, 1.0, {4: 1.5}), repeats):
        probs = _exact(model, pen, 1.0, 1.0)
        assert _pvalue(HSD([Level("layer4", lm, 4)], []), probs, 1.0, 1.0, None) < 1e-6


def _exact_tree(model, pen: Penalties, length: int, prune: float = 1e-7) -> dict:
    """The probability of every ``length``-token continuation of ``PROMPT`` (those of a prefix below ``prune``
    left out) under the penalised target's distribution at temperature 1, computed token by token."""
    out: dict[tuple, float] = {}

    def grow(gen: list[int], pre: float) -> None:
        with torch.no_grad():
            row = model(torch.tensor([PROMPT + gen])).logits[0, -1]
        p = process_logits(_moved_by_formula(pen, PROMPT + gen, gen, row)[None], 1.0, 1.0)[0].double()
        for x in range(V):
            q = pre * float(p[x])
            if len(gen) + 1 == length:
                out[tuple(gen) + (x,)] = q
            elif q > prune:
                grow(gen + [x], q)

    grow([], 1.0)
    return out


def _marginal_pvalue(samples: list[tuple], probs: dict, idx: tuple[int, ...]) -> float:
    """Chi-square p-value of the samples' tokens at positions ``idx`` against their marginal under ``probs``."""
    want: dict[tuple, float] = {}
    for seq, q in probs.items():
        key = tuple(seq[i] for i in idx)
        want[key] = want.get(key, 0.0) + q
    return chi_square_pvalue([tuple(seq[i] for i in idx) for seq in samples], want)


@pytest.mark.slow
def test_four_tokens_through_blocks_of_accepted_drafts_follow_the_penalised_target(peaky):
    """Two tokens a sample left every round past the first one draft (the target draws the first token; the room
    left for the second is one): chains of accepted drafts, a level handing several up with its rows as their draft
    distribution, the penalties counting the drafts accepted within a block, went untested. Four tokens through
    depth 3 (exits; a token drafter under an exit), with penalties: every position's and every adjacent pair's
    distribution is the penalised target's; the wrong sampler fails."""
    model, lm = peaky
    pen = Penalties(1.5, 0.7, {5: 2.0, 0: -3.0})
    probs = _exact_tree(model, pen, 4)
    where = [(1,), (2,), (3,), (1, 2), (2, 3), (0, 1, 2, 3)]

    def pvalues(levels, budgets, residual: bool = True) -> list[float]:
        h = HSD(levels, budgets, residual=residual)
        samples = [tuple(h.generate(PROMPT, 4, temperature=1.0, seed=s, penalties=pen).token_ids)
                   for s in range(2000)]
        assert all(len(x) == 4 for x in samples)
        return [_marginal_pvalue(samples, probs, idx) for idx in where]

    exits = [Level("layer1", lm, 1), Level("layer2", lm, 2), Level("layer4", lm, 4)]
    cycle = [Level("cycle", drafter=CycleDrafter(V, step=1)), Level("layer2", lm, 2), Level("layer4", lm, 4)]
    for levels, budgets in ((exits, [2, 3]), (cycle, [2, 2])):
        ps = pvalues(levels, budgets)
        assert min(ps) > 1e-4, ([lv.name for lv in levels], ps)
    assert min(pvalues(exits, [2, 3], residual=False)) < 1e-6      # 1e-24 or so on the joint


def test_embedded_greedy_with_penalties_through_the_screen(embedded):
    """On the embedded model (its float32 head read through the int8 screen, the offsets added to the screened
    logits) and on its int4 copy as a target: HSD with penalties equals the reference from whole logits."""
    from hsd_opt.drafters import make_token_drafter
    from hsd_opt.engine.quantized import QuantizedLM
    from hsd_opt.models.loading import eos_token_ids
    from hsd_opt.prompts import encode_prompt

    lm = LayeredLM(embedded.model)
    assert lm.picks_cheaply
    eos = frozenset(eos_token_ids(embedded))
    prompt = encode_prompt(embedded.tokenizer, "List three fruits, then list them again.")
    pen = Penalties(0.8, 0.6, {28: 2.0})
    for target, pen in ((lm, pen), (QuantizedLM(embedded.model, bits=4), pen), (lm, Penalties(repetition=1.3,
                                                                                                 repetition_last=64))):
        L = target.n_layers
        ref = _reference(target, prompt, 16, pen, eos)
        for levels, budgets in (([Level("target", target, L)], []),
                                ([Level("lookup", drafter=make_token_drafter("ngram_context", q=2, w=4)),
                                  Level("layer20", target, 20), Level("target", target, L)], [2, 4])):
            res = HSD(levels, budgets, eos_ids=sorted(eos)).generate(prompt, 16, penalties=pen)
            assert res.token_ids == ref, [lv.name for lv in levels]
