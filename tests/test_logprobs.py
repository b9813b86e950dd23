"""Log-probabilities of the generated tokens (``logprobs=k``): each is the target's own log-softmax at that
position, bit for bit the value its autoregressive steps give, whatever hierarchy drafted the token and whatever
shares the batch; asking for them changes no token."""

from __future__ import annotations

import random

import pytest
import torch

from hsd_opt.engine.layered import LayeredLM
from hsd_opt.errors import HsdError
from hsd_opt.runtime.arguments import MAX_TOP_LOGPROBS
from hsd_opt.runtime.batch import generate_many
from hsd_opt.runtime.decode import HSD, Level
from tests.helpers import engine_logits, four_hierarchies, make_tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def lm():
    return LayeredLM(make_tiny_llama(seed=5, vocab_size=48, layers=6, scale=6.0))


def _reference_rows(lm, prompt, gen):
    """The target's log-softmax at each generated token's position: a pass over the prompt, then a step per
    token (the engine's own autoregressive numbers)."""
    ids = torch.tensor(prompt + gen, dtype=torch.long)
    logits = engine_logits(lm, ids, len(prompt))
    return torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1: len(prompt) - 1 + len(gen)]


def _check(res, rows, k):
    assert res.logprobs is not None and len(res.logprobs) == len(res.token_ids)
    for i, (t, lp) in enumerate(zip(res.token_ids, res.logprobs)):
        assert lp.token == t
        assert lp.logprob == float(rows[i, t])                      # bit for bit the target's step
        assert len(lp.top) == k
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert all(v == float(rows[i, j]) for j, v in lp.top)
        if k:
            assert lp.top[0][1] == float(rows[i].max())
        want = sorted(range(rows.shape[-1]), key=lambda j: (-float(rows[i, j]), j))[:k]
        assert [j for j, _ in lp.top] == want        # the k most likely, equal ones by lower id (at the k-th too)


@pytest.mark.parametrize("seed", range(3))
def test_greedy_logprobs_are_the_targets_and_change_no_token(lm, seed):
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 48) for _ in range(rng.randint(1, 10))]
    n = rng.randint(8, 30)
    ref = HSD([Level("target", lm, lm.n_layers)], []).generate(prompt, n).token_ids
    rows = _reference_rows(lm, prompt, ref)
    for levels, budgets in four_hierarchies(lm, 48):
        for k in (0, 3):
            for mode in ("exact", "eager"):
                res = HSD(levels, budgets, mode=mode).generate(prompt, n, logprobs=k)
                assert res.token_ids == ref, ([lv.name for lv in levels], mode)
                _check(res, rows, k)
                if k:     # greedy: each token is the most likely one
                    assert all(lp.top[0][0] == lp.token for lp in res.logprobs)


def test_alternatives_tied_at_the_last_place_are_the_lower_ids():
    """A head whose rows 3.. are one row: their log-probabilities are equal at every position, and the
    alternatives listed after the distinct ones are the lowest of those ids (``torch.topk`` returns any of them)."""
    model = make_tiny_llama(seed=5, vocab_size=48, layers=2, scale=6.0)
    with torch.no_grad():
        model.lm_head.weight[3:] = model.lm_head.weight[3]
    tied = LayeredLM(model)
    prompt = [5, 9, 4]
    ref = HSD([Level("target", tied, tied.n_layers)], []).generate(prompt, 6).token_ids
    rows = _reference_rows(tied, prompt, ref)
    for k in (4, 8):
        _check(HSD([Level("target", tied, tied.n_layers)], []).generate(prompt, 6, logprobs=k), rows, k)


def test_most_likely_lists_k_even_where_a_row_holds_nan():
    """A NaN ranks above every number, as ``torch.topk`` ranks it: a broken model's row still lists ``k``
    alternatives, NaN ones by lower id."""
    from hsd_opt.runtime.decode import most_likely

    nan = float("nan")
    assert [j for j, _ in most_likely(torch.full((6,), nan), 3)] == [0, 1, 2]
    assert [j for j, _ in most_likely(torch.tensor([1.0, nan, 2.0, 3.0, nan]), 3)] == [1, 4, 3]
    assert most_likely(torch.tensor([1.0, 2.0]), 5) == [(1, 2.0), (0, 1.0)]


def test_no_logprobs_unless_asked(lm):
    assert HSD([Level("target", lm, lm.n_layers)], []).generate([5, 6, 7], 4).logprobs is None


def test_an_eos_ends_the_logprobs_with_the_tokens(lm):
    prompt = [4, 9, 17]
    ref = HSD([Level("target", lm, lm.n_layers)], []).generate(prompt, 20).token_ids
    eos = ref[5]
    want = ref[: ref.index(eos) + 1]
    for levels, budgets in four_hierarchies(lm, 48):
        res = HSD(levels, budgets, eos_ids=[eos]).generate(prompt, 20, logprobs=2)
        assert res.token_ids == want
        _check(res, _reference_rows(lm, prompt, want), 2)


def test_sampled_logprobs_are_the_raw_targets_and_change_no_token(lm):
    """Sampled: the same draws with and without log-probabilities (same seed), each the target's own
    log-softmax (before temperature and the filters): at top-p 1, where the target draws by the Gumbel-max form
    (it drew from its distribution, consuming the seed's stream otherwise, when they were asked for), and with
    top-p, top-k or min-p (which read only a window of logits without them: with top-k or min-p a traceback)."""
    prompt = [7, 3, 30, 11]
    for levels, budgets in four_hierarchies(lm, 48):
        h = HSD(levels, budgets)
        for seed, filters in ((0, {"top_p": 0.9}), (1, {"top_p": 0.9}), (0, {}), (1, {}), (0, {"top_k": 5}),
                              (1, {"min_p": 0.1}), (2, {"top_k": 8, "min_p": 0.05})):
            plain = h.generate(prompt, 24, temperature=0.8, seed=seed, **filters)
            res = h.generate(prompt, 24, temperature=0.8, seed=seed, logprobs=4, **filters)
            assert res.token_ids == plain.token_ids, (seed, filters)
            _check(res, _reference_rows(lm, prompt, res.token_ids), 4)


def test_logprobs_in_a_batch_equal_alone(lm):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 48) for _ in range(rng.randint(1, 9))] for _ in range(5)]
    levels, budgets = four_hierarchies(lm, 48)[2]
    h = HSD(levels, budgets)
    alone = [h.generate(p, 16, logprobs=3) for p in prompts]
    together = generate_many(h, prompts, 16, max_active=3, logprobs=3)
    for a, b in zip(alone, together):
        assert b.token_ids == a.token_ids
        assert b.logprobs == a.logprobs


def test_bad_logprobs_are_refused(lm):
    h = HSD([Level("target", lm, lm.n_layers)], [])
    for k in (-1, MAX_TOP_LOGPROBS + 1):
        with pytest.raises(HsdError, match="logprobs"):
            h.generate([3, 4], 2, logprobs=k)


def test_embedded_logprobs_on_the_kernels(embedded):
    """On the embedded model, whose greedy steps read a screened head (not every logit): a pass that reads every
    logit picks the same tokens, and the log-probabilities are the target's steps', for the float32 target and
    for the int4 copy as a target; under two hierarchies each."""
    from hsd_opt.drafters import make_token_drafter
    from hsd_opt.engine.quantized import QuantizedLM
    from hsd_opt.models.loading import eos_token_ids
    from hsd_opt.prompts import encode_prompt

    lm = LayeredLM(embedded.model)
    q4 = QuantizedLM(embedded.model, bits=4)
    assert lm.uses_kernels
    eos = eos_token_ids(embedded)
    prompt = encode_prompt(embedded.tokenizer, "Write a Python function that reverses a list.")
    for target in (lm, q4):
        L = target.n_layers
        ref = HSD([Level("target", target, L)], [], eos_ids=eos).generate(prompt, 12).token_ids
        rows = _reference_rows(target, prompt, ref)
        for levels, budgets in (([Level("target", target, L)], []),
                                ([Level("ngram", drafter=make_token_drafter("ngram_context", q=2, w=4)),
                                  Level("layer20", target, 20), Level("target", target, L)], [2, 4])):
            res = HSD(levels, budgets, eos_ids=eos).generate(prompt, 12, logprobs=5)
            assert res.token_ids == ref
            _check(res, rows, 5)
            for filters in ({}, {"top_k": 40}, {"min_p": 0.05}):      # sampled: draws through the screen without
                h = HSD(levels, budgets, eos_ids=eos)                  # log-probabilities, the same tokens
                plain = h.generate(prompt, 12, temperature=0.9, seed=5, **filters)
                res = h.generate(prompt, 12, temperature=0.9, seed=5, logprobs=2, **filters)
                assert res.token_ids == plain.token_ids, filters
                _check(res, _reference_rows(target, prompt, res.token_ids), 2)


def test_token_bytes_of_a_byte_level_tokenizer_join_into_its_text(embedded):
    """The served ``bytes`` of each token, joined, are the text's UTF-8 bytes, characters split across tokens
    included; a special token's bytes are its text."""
    from hsd_opt.server.responses import chat_logprobs
    from hsd_opt.server.text import token_bytes

    tok = embedded.tokenizer
    text = "héllo wörld: 世界 🤖 — ∑x² ok"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [token_bytes(tok, i) for i in ids]
    assert b"".join(pieces) == text.encode("utf-8")
    assert any(p.decode("utf-8", errors="replace") != p.decode("utf-8", errors="ignore") for p in pieces)  # split
    eos = tok.eos_token_id
    assert token_bytes(tok, eos) == tok.convert_ids_to_tokens(eos).encode()
    from hsd_opt.runtime.decode import TokenLogprob

    content = chat_logprobs(tok, [TokenLogprob(i, -0.5, [(i, -0.5)]) for i in ids])["content"]
    assert b"".join(bytes(e["bytes"]) for e in content) == text.encode("utf-8")
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in content)
