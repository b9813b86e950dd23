"""ADED (arXiv 2407.12021): tri-gram matrix (Eq. 1), Algorithm 2 update, MCTS draft maker (Algorithm 1), drafter."""

from __future__ import annotations

import random

import pytest

from hsd_opt.drafters import make_token_drafter
from hsd_opt.drafters.aded import AdedDrafter, MctsDraftMaker, TrigramMatrix
from hsd_opt.errors import InputFileError


def test_matrix_eq1_counts_and_threshold():
    seqs = [[1, 2, 3, 1, 2, 3, 1, 2, 4], [1, 2, 3]]
    m = TrigramMatrix.from_sequences(seqs, threshold=1)
    # (1,2) is followed by 3 three times and by 4 once: C(1,2) = 4
    assert m.get(1, 2, 3) == pytest.approx(3 / 4)
    assert m.get(1, 2, 4) == pytest.approx(1 / 4)
    assert m.get(2, 3, 1) == pytest.approx(1.0)
    assert m.get(3, 1, 2) == pytest.approx(1.0)
    assert len(m) == 4
    t = TrigramMatrix.from_sequences(seqs, threshold=2)  # (1,2,4) seen once: dropped, denominator unchanged
    assert t.get(1, 2, 4) == 0.0 and t.get(1, 2, 3) == pytest.approx(3 / 4)
    assert t.meta["trigrams_seen"] == 4 and t.meta["trigrams_kept"] == 3
    assert t.candidates(1, 2) == ([3], [pytest.approx(0.75)])


def test_matrix_save_load_round_trip(tmp_path):
    m = TrigramMatrix.from_sequences([[5, 6, 7, 5, 6, 8, 5, 6, 7]], threshold=1)
    p = m.save(tmp_path / "tri.npz")
    m2 = TrigramMatrix.load(p)
    assert m2.table.keys() == m.table.keys()
    for k, d in m.table.items():
        assert m2.table[k] == pytest.approx(d)
    assert m2.meta["threshold"] == 1 and m2.path == str(p)
    with pytest.raises(InputFileError):
        TrigramMatrix.load(tmp_path / "missing.npz")


def test_adjust_follows_algorithm_2():
    m = TrigramMatrix.from_sequences([[1, 2, 3, 1, 2, 4]], threshold=1)
    before = m.get(1, 2, 3)  # 0.5
    n = m.adjust([9, 9, 9, 1, 2, 3, 7], max_length=5, increment=0.3, max_prob=0.9)
    # only the last 5 tokens [9, 1, 2, 3, 7] are considered -> tri-grams (9,1,2), (1,2,3), (2,3,7)
    assert n == 3
    assert m.get(1, 2, 3) == pytest.approx(min(before + 0.3, 0.9))  # raised by the increment
    assert m.get(9, 1, 2) == pytest.approx(0.3)  # new tri-gram: set to the increment
    assert m.get(2, 3, 7) == pytest.approx(0.3)
    assert m.get(9, 9, 9) == 0.0  # outside the window
    m.adjust([1, 2, 3], max_length=5, increment=0.3, max_prob=0.9)
    assert m.get(1, 2, 3) == pytest.approx(0.9)  # capped at max_prob
    m.adjust([1, 2, 3], max_length=5, increment=0.3, max_prob=0.9)
    assert m.get(1, 2, 3) == pytest.approx(0.9)
    assert m.candidates(1, 2)[0][0] == 3  # sorted cache invalidated


def _random_matrix(seed=0, vocab=30, n=3000):
    rng = random.Random(seed)
    # a Markov-ish corpus so that tri-grams repeat
    seq = [0, 1]
    for _ in range(n):
        seq.append((seq[-1] * 7 + seq[-2] + rng.choice([0, 0, 1, 2, 5])) % vocab)
    return TrigramMatrix.from_sequences([seq], threshold=2, backoff=False), seq


def test_mcts_valid_depth_support_and_deterministic():
    m, seq = _random_matrix()
    mk = MctsDraftMaker(m, iterations=150, depth=4, n_candidates=24, seed=3)
    a, b = seq[100], seq[101]
    res = mk.search(a, b)
    assert 1 <= len(res) <= 24
    assert len(res[0][0]) == 4
    full = [len(t) == 4 for t, _ in res]
    assert full == sorted(full, reverse=True)  # full-depth candidates first
    for toks, _ in res:
        hist = [a, b] + toks
        for i in range(2, len(hist)):
            assert m.get(hist[i - 2], hist[i - 1], hist[i]) > 0  # inside the tri-gram support
        if len(toks) < 4:  # shorter only at a dead end of the support
            assert m.candidates(hist[-2], hist[-1]) == ([], [])
    assert len({tuple(t) for t, _ in res}) == len(res)
    scores = [s for t, s in res if len(t) == 4]
    assert scores == sorted(scores, reverse=True)
    assert MctsDraftMaker(m, seed=3).search(a, b) == res  # deterministic under a seed
    assert MctsDraftMaker(m, seed=3).search(a, b, depth=6)[0][0].__len__() == 6
    assert mk.search(999, 998) == []  # unknown context, no backoff


def test_mcts_prefers_the_likely_chain():
    # (1,2) -> 3 (x9) or 4 (x1); (2,3) -> 5 always; (3,5) -> 6
    seqs = [[1, 2, 3, 5, 6]] * 9 + [[1, 2, 4, 5, 6]]
    m = TrigramMatrix.from_sequences(seqs, threshold=1)
    res = MctsDraftMaker(m, depth=3).search(1, 2)
    assert res[0][0] == [3, 5, 6]


def test_aded_drafter_propose_observe_and_rebuild(tmp_path):
    m, seq = _random_matrix()
    m.save(tmp_path / "tri.npz")
    d = AdedDrafter(str(tmp_path / "tri.npz"), iterations=50, increment=0.2)
    ctx = seq[:50]
    d.reset(ctx)
    out = d.propose(ctx, 4)
    assert len(out) == 4
    rows = d.propose_batch(ctx, 5, 4)
    assert len(rows) == 5 and all(len(r) == 4 for r in rows) and rows[0] == out
    assert d.propose([], 3) == [0, 0, 0] and len(d.propose([1000, 1001], 7)) == 7
    # observe applies Algorithm 2 to the new tri-grams
    v = d.matrix.version
    d.observe(ctx, [77, 78])
    assert d.matrix.get(ctx[-1], 77, 78) == pytest.approx(0.2) and d.matrix.version > v
    cfg = d.config()
    r = make_token_drafter(**cfg)
    assert r.config() == cfg
    fresh = AdedDrafter(str(tmp_path / "tri.npz"), iterations=50, increment=0.2)
    again = AdedDrafter(str(tmp_path / "tri.npz"), iterations=50, increment=0.2)
    assert fresh.propose(seq[:50], 4) == again.propose(seq[:50], 4)  # deterministic for a seed and matrix


def test_each_fork_adapts_its_own_copy_and_the_drafter_it_came_from_never_changes():
    """What one sequence teaches the matrix (reset on its prompt, observe on its tokens) reaches no other fork and
    not the drafter built from the plan: a sequence drafts the same after any other, and the matrix does not grow
    (it did, request after request, in a long-running server)."""
    m, seq = _random_matrix()
    base = AdedDrafter(m, iterations=30)
    rows, probs = len(base.matrix.table), {k: dict(v) for k, v in base.matrix.table.items()}
    a, b = seq[:40], seq[100:140]

    def drafts(prompt, after=None):
        if after is not None:                   # another sequence first: reset, drafts, observed tokens
            other = base.fork()
            other.reset(after)
            other.observe(after, [5, 6, 7, 8])
            other.propose(after + [5, 6, 7, 8], 4)
        d = base.fork()
        d.reset(prompt)
        out = [d.propose(prompt[:i], 4) for i in range(len(prompt) - 6, len(prompt) + 1)]
        d.observe(prompt, [9, 10, 11])
        return out + [d.propose(prompt + [9, 10, 11], 4)]

    assert drafts(b) == drafts(b, after=a) == drafts(b, after=b)
    assert len(base.matrix.table) == rows and base.matrix.table == probs
    f = base.fork()
    f.reset(a)
    assert f.matrix.table != probs and base.matrix.table == probs       # the fork adapted, its source did not
    # and the other way: a drafter that adapts after it was forked (the source, or a fork forked again) does
    # not change what its forks read: each copies a shared row before changing it, on either side
    src = AdedDrafter(TrigramMatrix({k: dict(v) for k, v in probs.items()}), iterations=30)
    child = src.fork()
    before = {k: dict(v) for k, v in child.matrix.table.items()}
    src.reset(a)
    src.observe(a, [5, 6, 7, 8])
    assert src.matrix.table != before and child.matrix.table == before
    grandchild = child.fork()
    child.reset(b)
    assert child.matrix.table != before and grandchild.matrix.table == before


@pytest.mark.parametrize("max_length", [3, 5, 64])
def test_a_drafter_given_its_history_at_once_adapts_as_one_given_it_round_by_round(max_length):
    """A drafter taken on mid-sequence (a switched hierarchy) is given every generated token in one ``observe``:
    its matrix must be the one a drafter observing round by round holds (only the last ``max_length`` tokens were
    raised, so its drafts, not the output, differed between a run alone and batched)."""
    rng = random.Random(max_length)
    prompt, gen = [rng.randrange(12) for _ in range(10)], [rng.randrange(12) for _ in range(100)]
    base = AdedDrafter(TrigramMatrix({}), max_length=max_length)
    rounds, whole = base.fork(), base.fork()
    rounds.reset(prompt)
    whole.reset(prompt)
    ctx = list(prompt)
    for i in range(0, len(gen), 3):
        rounds.observe(ctx, gen[i:i + 3])
        ctx += gen[i:i + 3]
    whole.observe(prompt, gen)
    assert whole.matrix.table == rounds.matrix.table and len(whole.matrix) > len(base.matrix)
    assert whole.propose(ctx, 4) == rounds.propose(ctx, 4)
