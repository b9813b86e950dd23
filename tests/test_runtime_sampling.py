"""Sampling is lossless: HSD samples (depth 3, every level verifying with Algorithm 2) follow the target's own
autoregressive distribution, checked by a chi-square test against the exact distribution of the first two
tokens; a deliberately wrong sampler (resampling from p instead of the residual after a rejection) fails it."""

from __future__ import annotations

import itertools

import pytest
import torch

from hsd_opt.engine.layered import LayeredLM
from hsd_opt.errors import HsdError
from hsd_opt.runtime.arguments import check_generation_args
from hsd_opt.runtime.decode import HSD, Level, Pass
from hsd_opt.runtime.sampling import process_logits
from tests.helpers import CycleDrafter, chi_square_pvalue, make_tiny_llama

V, K, N = 12, 2, 1000  # vocab, tokens per sample, samples (seeds 0..N-1)
PROMPT = [3, 5, 7]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def peaky():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    model = make_tiny_llama(seed=0, vocab_size=V, layers=4, scale=15.0)  # peaky: exits disagree with the target
    yield model, LayeredLM(model)
    torch.set_num_threads(n)


def _exact(model, temperature, top_p, top_k=0, min_p=0.0):
    """Exact probability of every K-token continuation under the target's processed distribution."""
    seqs = list(itertools.product(range(V), repeat=K - 1))
    ids = torch.tensor([PROMPT + list(s) for s in seqs])
    with torch.no_grad():
        lg = model(ids).logits[:, len(PROMPT) - 1:]
    p = process_logits(lg.reshape(-1, V), temperature, top_p, top_k, min_p).reshape(len(seqs), K, V)
    out = {}
    for i, s in enumerate(seqs):
        pre = 1.0
        for k in range(K - 1):
            pre *= float(p[i, k, s[k]])
        for x in range(V):
            out[tuple(s) + (x,)] = pre * float(p[i, K - 1, x])
    return out


def _pvalue(h, probs, temperature, top_p, top_k=0, min_p=0.0, n=N):
    return _pvalue_of(lambda seed: h.generate(PROMPT, K, temperature=temperature, top_p=top_p, seed=seed,
                                              top_k=top_k, min_p=min_p).token_ids, probs, n)


def _pvalue_of(draw, probs, n=N):
    """Chi-square p-value of ``n`` samples ``draw(seed)`` (seeds 0..n-1) against the exact distribution
    ``probs``."""
    samples = [tuple(draw(seed)) for seed in range(n)]
    assert all(len(ids) == K and probs[ids] > 0 for ids in samples)  # never a token outside the top-p nucleus
    return chi_square_pvalue(samples, probs)


def test_sampling_depth3_matches_autoregressive_and_wrong_sampler_fails(peaky):
    model, lm = peaky
    probs = _exact(model, 1.0, 1.0)
    levels = [Level("layer1", lm, 1), Level("layer2", lm, 2), Level("layer4", lm, 4)]
    p_ok = _pvalue(HSD(levels, [2, 3]), probs, 1.0, 1.0)
    p_bad = _pvalue(HSD(levels, [2, 3], residual=False), probs, 1.0, 1.0)
    assert p_ok > 1e-3, p_ok
    assert p_bad < 1e-6, p_bad


def test_sampling_token_drafter_temperature_top_p(peaky):
    """One-hot drafts (a token drafter at the bottom), temperature 0.8 and top-p 0.9 at every level; the wrong
    sampler fails. 16,000 samples: a correction drawn from p rather than the residual after a one-hot draft is
    rejected (the rejected token not zeroed) shifts little mass, which 1,000 samples did not see (p 0.21; here
    about 1e-8)."""
    model, lm = peaky
    probs = _exact(model, 0.8, 0.9)
    levels = [Level("cycle", drafter=CycleDrafter(V, step=1)), Level("layer2", lm, 2), Level("layer4", lm, 4)]
    p_ok = _pvalue(HSD(levels, [1, 2], mode="eager"), probs, 0.8, 0.9, n=16 * N)
    p_bad = _pvalue(HSD(levels, [1, 2], mode="eager", residual=False), probs, 0.8, 0.9)
    assert p_ok > 1e-3, p_ok
    assert p_bad < 1e-6, p_bad


class _AbstainsAfterEven(CycleDrafter):
    """Proposes nothing after an even token, a whole block after an odd one (as a lookup that finds no match):
    within the samples' two tokens it abstains at the first or the second round. Counts its calls of each kind."""

    name, may_abstain = "abstaining", True

    def __init__(self, vocab: int, step: int = 1):
        super().__init__(vocab, step)
        self.calls = {"abstained": 0, "proposed": 0}

    def propose(self, context, n):
        abstains = context[-1] % 2 == 0
        self.calls["abstained" if abstains else "proposed"] += 1
        return [] if abstains else super().propose(context, n)


@pytest.mark.parametrize("depth", [2, 3])
def test_sampling_with_an_abstaining_drafter(peaky, depth):
    """A bottom drafter that abstains in some rounds: the target's distribution still, over a middle level (depth 3:
    the wrong sampler fails) and right under the target (depth 2: a draw by noise where it abstains). The drafter
    before abstained in no sample (by context length, never reached within two tokens), and a round that took the
    target's argmax where the drafter abstained passed."""
    model, lm = peaky
    probs = _exact(model, 1.0, 1.0)
    drafter = _AbstainsAfterEven(V)
    mid = [Level("layer2", lm, 2)] if depth == 3 else []
    levels, budgets = [Level("abstaining", drafter=drafter), *mid, Level("layer4", lm, 4)], [2] * (depth - 1)
    p_ok = _pvalue(HSD(levels, budgets), probs, 1.0, 1.0)
    assert p_ok > 1e-3, p_ok
    assert min(drafter.calls.values()) > N // 10, drafter.calls
    if depth == 3:
        p_bad = _pvalue(HSD(levels, budgets, residual=False), probs, 1.0, 1.0)
        assert p_bad < 1e-6, p_bad


def _switching(ha: HSD, hb: HSD):
    """``draw(seed)``: a sample decoded as a batch decodes a sequence that follows the load, the load changing
    mid-round: after the ``2 + seed % 4``-th pass (a draft, a verification, or past the end) the hierarchy switches
    to the other one, so the round under way stops drafting and verifies what it has."""

    def draw(seed: int) -> list[int]:
        d = ha.start(PROMPT, K, temperature=1.0, seed=seed)
        d.follows_load = True      # as an unseeded sample in a batch; seeded here so that the test is reproducible
        passes = []

        def on_pass(p: Pass) -> None:
            passes.append(p)
            if len(passes) == 2 + seed % 4:
                d.switch(hb if d.hsd is ha else ha)

        try:
            return d.run(on_pass=on_pass).token_ids
        finally:
            d.close()

    return draw


def test_sampling_that_switches_hierarchy_mid_round_keeps_the_targets_distribution(peaky):
    """A sequence that follows the load (an unseeded sample in a batch) stops drafting when its hierarchy
    switches and verifies the drafts it has at every level: still the target's distribution; the wrong sampler
    fails under the same switches."""
    model, lm = peaky
    probs = _exact(model, 1.0, 1.0)
    deep = [Level("layer1", lm, 1), Level("layer2", lm, 2), Level("layer4", lm, 4)]
    two = [Level("layer1", lm, 1), Level("layer4", lm, 4)]
    p_ok = _pvalue_of(_switching(HSD(deep, [2, 3]), HSD(two, [3])), probs)
    p_bad = _pvalue_of(_switching(HSD(deep, [2, 3], residual=False), HSD(two, [3], residual=False)), probs)
    assert p_ok > 1e-3, p_ok
    assert p_bad < 1e-6, p_bad


def test_sampling_is_reproducible(peaky):
    _, lm = peaky
    h = HSD([Level("layer1", lm, 1), Level("layer4", lm, 4)], [3])
    a = h.generate(PROMPT, 10, temperature=1.0, seed=7).token_ids
    b = h.generate(PROMPT, 10, temperature=1.0, seed=7).token_ids
    assert a == b and len(a) == 10


def test_a_top_k_of_the_whole_vocabulary_draws_as_no_top_k(peaky):
    """A top-k of the vocabulary or more filters nothing: seeded, it now draws what no top-k draws (it drew through
    the distribution where no top-k draws by noise: the same distribution, other tokens for one seed)."""
    _, lm = peaky
    h = HSD([Level("layer1", lm, 1), Level("layer4", lm, 4)], [3])
    for seed in range(6):
        off = h.generate(PROMPT, 8, temperature=1.0, seed=seed).token_ids
        assert all(h.generate(PROMPT, 8, temperature=1.0, seed=seed, top_k=k).token_ids == off for k in (V, 10 * V))


class GreedyDrafter(CycleDrafter):
    """Proposes the target's own greedy continuation: drafts that a draw often takes (a peaky target), so that a
    wrong correction after a rejection shows in the counts."""

    name = "greedy"

    def __init__(self, model):
        super().__init__(V)
        self.model = model

    def propose(self, context, n):
        ctx = list(context)
        with torch.no_grad():
            for _ in range(n):
                ctx.append(int(self.model(torch.tensor([ctx])).logits[0, -1].argmax()))
        return ctx[len(context):]


def _target_passes(h: HSD, temperature: float, top_p: float = 1.0, **filters) -> list[bool]:
    """``picks`` of every pass of the target (its top level) in one generation."""
    return [p.picks for p in _target_pass_list(h, temperature, top_p, **filters)]


def _target_pass_list(h: HSD, temperature: float, top_p: float = 1.0, **filters) -> list[Pass]:
    """Every pass of the target (its top level) in one generation."""
    passes: list[Pass] = []
    d = h.start(PROMPT, K, temperature=temperature, top_p=top_p, seed=0, **filters)
    try:
        d.run(on_pass=passes.append)
    finally:
        d.close()
    top = h.levels[-1]
    return [p for p in passes if p.engine is top.engine and p.boundary == top.boundary]


def test_draws_by_noise_through_the_screen_follow_the_targets_distribution(peaky):
    """At top-p 1 the target alone and the target over a token drafter draw by the Gumbel-max form (every target
    pass ends in picks through the head's int8 screen): the samples follow the target's distribution at two
    temperatures, and the wrong correction (a fresh draw after a rejection) fails. Top-p takes the distributions."""
    model, lm = peaky
    assert lm.picks_cheaply
    for temperature in (1.0, 0.6):
        probs = _exact(model, temperature, 1.0)
        alone = HSD([Level("layer4", lm, 4)], [])
        over = HSD([Level("greedy", drafter=GreedyDrafter(model)), Level("layer4", lm, 4)], [2])
        for h in (alone, over):
            assert all(_target_passes(h, temperature))
            p_ok = _pvalue(h, probs, temperature, 1.0)
            assert p_ok > 1e-3, (temperature, p_ok)
    bad = HSD([Level("greedy", drafter=GreedyDrafter(model)), Level("layer4", lm, 4)], [2], residual=False)
    assert _pvalue(bad, _exact(model, 1.0, 1.0), 1.0, 1.0) < 1e-6
    assert not any(_target_passes(HSD([Level("layer4", lm, 4)], []), 1.0, top_p=0.9))


def test_sampling_with_top_k_and_min_p_follows_the_filtered_targets_distribution(peaky):
    """Top-k and min-p (with top-p, or alone over a token drafter: then the target reads its distributions, not
    draws by noise, and only the logits in the filters' window through its int8 screen; with top-p and no top-k
    every logit): the filtered target's distribution at depth 2 and 3; decoding without the filters fails."""
    model, lm = peaky
    deep = HSD([Level("layer1", lm, 1), Level("layer2", lm, 2), Level("layer4", lm, 4)], [2, 3])
    over = HSD([Level("greedy", drafter=GreedyDrafter(model)), Level("layer4", lm, 4)], [2])
    for h, temperature, top_p, top_k, min_p in ((deep, 1.0, 0.95, 4, 0.0), (over, 1.3, 1.0, 0, 0.1),
                                                (over, 1.0, 1.0, 3, 0.05), (over, 1.0, 0.9, 0, 0.1)):
        passes = _target_pass_list(h, temperature, top_p, top_k=top_k, min_p=min_p)
        assert not any(p.picks for p in passes)
        assert all((p.window is not None) == (top_k > 0 or top_p == 1.0) for p in passes)
        probs = _exact(model, temperature, top_p, top_k, min_p)
        p_ok = _pvalue(h, probs, temperature, top_p, top_k, min_p)
        assert p_ok > 1e-3, (temperature, top_p, top_k, min_p, p_ok)
    probs = _exact(model, 1.0, 1.0, 3, 0.05)
    unfiltered = {tuple(over.generate(PROMPT, K, temperature=1.0, seed=s).token_ids) for s in range(300)}
    assert any(probs[x] == 0 for x in unfiltered)     # tokens the filters never let through


def _filtered_by_full_sort(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                           min_p: float) -> torch.Tensor:
    """The definitions in HF ``generate``'s order, each renormalising: the ``top_k`` largest of the sorted
    probabilities, the nucleus of what is left, the tokens at least ``min_p`` times the largest."""
    p = torch.softmax(logits.float() / temperature, dim=-1)
    sp, idx = torch.sort(p, dim=-1, descending=True)
    if top_k:
        sp[..., top_k:] = 0.0
        sp = sp / sp.sum(-1, keepdim=True)
    if top_p < 1.0:
        sp = sp.masked_fill((sp.cumsum(-1, dtype=torch.float64) - sp) >= top_p, 0.0)
        sp = sp / sp.sum(-1, keepdim=True)
    if min_p:
        sp = sp.masked_fill(sp < min_p * sp[..., :1], 0.0)
        sp = sp / sp.sum(-1, keepdim=True)
    return torch.zeros_like(p).scatter_(-1, idx, sp)


def test_a_window_the_screen_steps_aside_for_is_read_and_filtered_whole(peaky, monkeypatch):
    """Where the screen steps aside for a window (too many candidates, values not finite), the engine reads every
    logit and the decoding filters them as without a window: the same seeded tokens, drafts verified and drawn
    alike, as a decoding that asks for no window."""
    from hsd_opt.runtime.decode import Decoding

    model, lm = peaky
    h = HSD([Level("greedy", drafter=GreedyDrafter(model)), Level("layer4", lm, 4)], [2])
    kw = dict(temperature=1.0, top_k=3, min_p=0.05)
    assert all(p.window is not None for p in _target_pass_list(h, **kw))
    monkeypatch.setattr(lm._screen, "window", lambda *a, **k: None)
    aside = [h.generate(PROMPT, 8, seed=s, **kw).token_ids for s in range(30)]
    monkeypatch.setattr(Decoding, "_window", lambda self, *a: None)
    assert all(p.window is None for p in _target_pass_list(h, **kw))
    assert aside == [h.generate(PROMPT, 8, seed=s, **kw).token_ids for s in range(30)]


def test_top_k_and_min_p_are_their_definitions():
    g = torch.Generator().manual_seed(11)
    for _ in range(40):
        m = int(torch.randint(1, 4, (), generator=g))
        logits = torch.randn(m, 300, generator=g) * float(torch.rand((), generator=g) * 6 + 0.1)
        t = float(torch.rand((), generator=g)) * 1.5 + 0.2
        top_p = float(torch.rand((), generator=g)) * 0.5 + 0.5 if int(torch.randint(2, (), generator=g)) else 1.0
        top_k = int(torch.randint(0, 40, (), generator=g))
        min_p = float(torch.rand((), generator=g)) * 0.3 if int(torch.randint(2, (), generator=g)) else 0.0
        got = process_logits(logits, t, top_p, top_k, min_p)
        want = _filtered_by_full_sort(logits, t, top_p, top_k, min_p)
        assert torch.equal(got > 0, want > 0), (t, top_p, top_k, min_p)
        assert torch.allclose(got, want, rtol=1e-6, atol=0), (t, top_p, top_k, min_p)
        if top_k:
            assert int((got > 0).sum(-1).max()) <= top_k
    p = process_logits(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), 1.0, 1.0, 0, 0.3)   # e^-1 = 0.37 >= 0.3 > e^-2
    assert (p > 0).tolist() == [[True, True, False, False]]


@pytest.mark.parametrize("top_k, min_p, flag", [(-1, 0.0, "--top-k"), (2.5, 0.0, "--top-k"), (0, 1.5, "--min-p"),
                                               (0, float("nan"), "--min-p")])
def test_bad_filters_are_refused_naming_the_flag(top_k, min_p, flag):
    from hsd_opt.runtime.arguments import check_sampling_flags

    with pytest.raises(HsdError, match=flag):
        check_sampling_flags(8, 1.0, 1.0, top_k, min_p)


def _nucleus_by_full_sort(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The definition: sort the whole vocabulary, drop tokens whose preceding mass (float64) reaches top_p,
    renormalise."""
    p = torch.softmax(logits.float() / temperature, dim=-1)
    sp, idx = torch.sort(p, dim=-1, descending=True)
    sp = sp.masked_fill((sp.cumsum(-1, dtype=torch.float64) - sp) >= top_p, 0.0)
    p = torch.zeros_like(p).scatter_(-1, idx, sp)
    return p / p.sum(-1, keepdim=True)


@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0, 20.0])
def test_top_p_over_the_most_probable_tokens_equals_the_full_sort(scale):
    """process_logits finds the nucleus among the top k tokens (growing k); its probabilities must be exactly those
    of sorting the whole vocabulary, from flat distributions (nucleus of thousands) to peaked ones (of one)."""
    g = torch.Generator().manual_seed(int(scale * 100))
    for _ in range(20):
        m = int(torch.randint(1, 5, (), generator=g))
        logits = torch.randn(m, 5000, generator=g) * scale
        t = float(torch.rand((), generator=g)) * 1.5 + 0.2
        top_p = float(torch.rand((), generator=g)) * 0.98 + 0.01
        got = process_logits(logits, t, top_p)
        assert torch.equal(got, _nucleus_by_full_sort(logits, t, top_p)), (scale, m, t, top_p)
        assert torch.allclose(got.sum(-1), torch.ones(m))


def _draws(sampler, p, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.bincount(torch.tensor([sampler(p, g) for _ in range(n)]), minlength=p.numel())


def test_sample_token_draws_from_its_weights_and_never_a_zero_one():
    """The inverse-CDF sampler follows unnormalised weights (chi-square) and never returns a token of weight 0;
    the same test rejects a sampler that draws uniformly over the positive weights."""
    from scipy.stats import chisquare

    from hsd_opt.runtime.sampling import sample_token

    w = torch.tensor([0.0, 3.0, 0.0, 1.0, 6.0, 0.0, 0.5, 2.5, 0.0])  # sums to 13, not 1
    n = 4000
    cnt = _draws(sample_token, w, n)
    assert int(cnt[w == 0].sum()) == 0
    pos = w > 0
    exp = (w[pos] / w.sum() * n).tolist()
    assert chisquare(cnt[pos].tolist(), exp).pvalue > 1e-3

    def uniform(p, g):  # a deliberately wrong sampler
        support = torch.nonzero(p > 0).flatten()
        return int(support[torch.randint(len(support), (1,), generator=g)])

    assert chisquare(_draws(uniform, w, n)[pos].tolist(), exp).pvalue < 1e-6
    # a single positive weight anywhere, last position included
    for k in (0, 4, 8):
        one = torch.zeros(9)
        one[k] = 0.2
        assert set(_draws(sample_token, one, 50).nonzero().flatten().tolist()) == {k}


def test_draws_over_a_support_are_the_draws_over_every_column():
    """``sample_token`` and ``rejection_sample`` told the support (the columns outside which ``p`` is 0, as a
    window's columns) draw over it alone and give, for the same generator, the same tokens as over every column:
    the bonus, a correction after a one-hot draft and after a drafter's rows (its weight outside the support
    too), rows whose draft lies outside the support included. A support that leaves out a positive column would
    change the draws (the check can fail)."""
    from hsd_opt.runtime.sampling import rejection_sample, sample_token

    g = torch.Generator().manual_seed(3)
    V, changed = 500, 0
    for trial in range(200):
        support = torch.randperm(V, generator=g)[:1 + trial % 40].sort().values
        d = trial % 4
        p = torch.zeros(d + 1, V)
        p[:, support] = torch.rand(d + 1, len(support), generator=g) ** 4
        p[:, support[0]] += 1e-3                 # every row positive somewhere
        p /= p.sum(-1, keepdim=True)
        drafts = [int(support[int(torch.randint(len(support), (), generator=g))]) if i % 3 else
                  int(torch.randint(V, (), generator=g)) for i in range(d)]
        q = None
        if trial % 2:
            q = torch.rand(d, V, generator=g) ** 8
            q[torch.arange(d), drafts] += 1.0
            q /= q.sum(-1, keepdim=True)
        for seed in range(3):
            a, b = (torch.Generator().manual_seed(seed) for _ in range(2))
            assert sample_token(p[0], a, support) == sample_token(p[0], b)
            a, b = (torch.Generator().manual_seed(seed) for _ in range(2))
            assert rejection_sample(p, q, drafts, a, support=support) == rejection_sample(p, q, drafts, b)
        if len(support) > 1:   # the same draws over too few columns differ somewhere
            a, b = (torch.Generator().manual_seed(trial) for _ in range(2))
            short = support[1:] if float(p[0, support[0]]) > 0.2 else support[:-1]
            changed += sample_token(p[0], a, short) != sample_token(p[0], b)
    assert changed > 0


def test_temperatures_and_top_p_at_the_edges_of_float32():
    """A temperature so small that ``logits / T`` overflows gives softmax's limit (equal weight on the largest
    logits, masked ones never), a top-p that rounds to 0 in float32 keeps the most probable token; neither
    changes a distribution that float32 computes."""
    logits = torch.tensor([[1.0, 3.0, 3.0, float("-inf")], [0.5, -2.0, 4.0, 1.0]])
    for t in (1e-45, 1e-40):
        p = process_logits(logits, t, 1.0)
        assert torch.equal(p, torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0]]))
    p = process_logits(logits, 1.0, 1e-320)
    assert torch.equal(p, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]))
    for t, top_p in ((0.7, 1.0), (1.3, 0.8), (1e-3, 0.5)):
        want = torch.softmax(logits / t, -1)
        got = process_logits(logits, t, top_p)
        if top_p == 1.0:
            assert torch.equal(got, want)
        assert torch.isfinite(got).all() and torch.allclose(got.sum(-1), torch.ones(2))
    with pytest.raises(HsdError, match="not numbers"):
        process_logits(torch.full((1, 4), float("nan")), 1.0, 1.0)
    with pytest.raises(HsdError, match="every token of a row is masked"):
        process_logits(torch.full((1, 4), float("-inf")), 1.0, 1.0)


@pytest.mark.parametrize("args, flag", [((4, float("nan"), 1.0), "--temperature"), ((4, float("inf"), 1.0),
                                        "--temperature"), ((4, 1.0, 1.0, 2**64), "--seed"),
                                        ((4, 1.0, 1.0, -2**63 - 1), "--seed")])
def test_generation_args_refuse_what_a_generator_cannot_take(args, flag):
    with pytest.raises(HsdError, match=flag):
        check_generation_args(*args)
    check_generation_args(4, 1.0, 1.0, 2**64 - 1)
    check_generation_args(4, 1.0, 1.0, -2**63)


def test_a_temperature_past_the_noises_range_draws_from_the_distribution_near_uniform(peaky):
    """Up to ``MAX_NOISE_TEMPERATURE`` a draw is by noise; hotter, the offsets ``T g`` would overflow float32 (the
    first row with an infinite offset would win), so the draw goes through the distribution: at 1e35 and 1e308 the
    tokens spread over the vocabulary as at 1e30."""
    from hsd_opt.runtime.sampling import MAX_NOISE_TEMPERATURE

    model, lm = peaky
    alone = HSD([Level("layer4", lm, 4)], [])
    assert all(_target_passes(alone, MAX_NOISE_TEMPERATURE))
    for temperature in (MAX_NOISE_TEMPERATURE, 1e35, 1e308):
        toks = alone.generate([3, 4, 5], 120, temperature=temperature, seed=1).token_ids
        assert len(toks) == 120 and len(set(toks)) > V // 2 and max(toks) > V // 2, (temperature, sorted(set(toks)))
    assert not any(_target_passes(alone, 1e35))
