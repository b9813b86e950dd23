"""The int8 screen of a float32 head gives exactly the head's greedy tokens: its bound holds on every row (the
activation in int16 per position), the argmax over its candidates is the argmax over the
vocabulary (first index on ties), its int16 sums are exact on every instruction set, and it steps aside where it
cannot help."""

from __future__ import annotations

import pytest
import torch

from hsd_opt.engine import kernels
from hsd_opt.engine.layered import LayeredLM
from hsd_opt.engine.screen import MAX_POSITIONS, HeadScreen
from hsd_opt.engine.weights import Mat, quantize_q8
from tests.helpers import i16_reference, kernel_builds, make_tiny_llama

LIB = kernels.load()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler here: the kernels cannot be built")


def _head(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g)   # rows of many norms
    w[:, 3] *= 20                                       # an outlier column, as real heads have
    return w.contiguous()


def _inputs(m: int, cols: int, seed: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(m, cols, generator=g) * scale
    h[:, 5] *= 30                                       # an outlier activation coarsens its group's int8 step
    return h


@pytest.mark.parametrize("cols", [32, 96, 576])
def test_the_bound_holds_on_every_row(cols):
    w = _head(3000, cols, cols)
    screen = HeadScreen(LIB, Mat.in_place(w))
    for seed, scale in ((1, 0.1), (2, 1.0), (3, 30.0)):
        h = _inputs(3, cols, seed, scale)
        approx = screen.logits(h)
        exact = kernels.linear(LIB, screen.head, h)
        err = (approx.double() - exact.double()).abs()
        bound = screen.bounds(h).double()
        assert (err <= bound).all()
        assert (err > bound / 64).any()       # the bound is not loose by orders of magnitude


def _i16_reference(screen: HeadScreen, h: torch.Tensor) -> torch.Tensor:
    """The screen's int16 read computed here (:func:`tests.helpers.i16_reference` of its head's int8 codes)."""
    q8 = quantize_q8(screen.head.tensors[0])
    assert torch.equal(q8.tensors[1], screen.scale)
    return i16_reference(q8.tensors[0], q8.tensors[1], h, screen.q16)


@pytest.mark.parametrize("cols", [64, 576, 4096])
def test_the_int16_sums_are_exact_at_the_largest_codes(cols):
    """Codes at +-127 against activations at the int16 range in the same signs: the largest sum the read can meet
    (cols * 127 * q16, below 2^31 by hsd_screen_q16) comes out exact, as do random rows."""
    q16 = LIB.hsd_screen_q16(cols)
    assert 0 < q16 <= 16383 and cols * 127 * (q16 + 1) < 2 ** 31
    g = torch.Generator().manual_seed(cols)
    w = torch.randn(40, cols, generator=g)
    sign = torch.where(torch.arange(cols) % 3 == 0, -1.0, 1.0)
    w[0] = sign * 0.5                                   # every code +-127, one row scale
    w[1] = -sign * 0.25
    screen = HeadScreen(LIB, Mat.in_place(w))
    assert screen.q16 == q16
    h = torch.cat([sign[None] * 2.0, torch.randn(5, cols, generator=g)])
    got = screen.logits(h)
    assert torch.equal(got, _i16_reference(screen, h))
    assert got[0, 0] > 0 and got[0, 1] < 0


@pytest.mark.slow
def test_the_int16_read_is_the_same_on_every_build():
    """Its sums are integers: every build this CPU runs (each variant, and one without OpenMP) gives the loaded
    build's logits bit for bit, and the same greedy ids and draws' picks."""
    builds = list(kernel_builds().values())
    w = _head(1001, 96, 5)                              # rows past a block of 16, odd pairs of columns
    screen = HeadScreen(LIB, Mat.in_place(w))
    h = _inputs(11, 96, 6, 1.0)
    for m in (1, 2, 5, 8, 9, 11):
        want = kernels.screen_i16(LIB, screen.packed, screen.scale, 1001, h[:m])
        assert torch.equal(want, _i16_reference(screen, h[:m]))
        for lib in builds:
            assert torch.equal(kernels.screen_i16(lib, screen.packed, screen.scale, 1001, h[:m]), want)
            ids = kernels.screen_pick(lib, screen.head, h[:m], want, screen.c, screen.wnorm, 1024, screen.q16)
            assert torch.equal(ids, kernels.linear(LIB, screen.head, h[:m]).argmax(-1))
            o = _gumbel((m, 1001), torch.Generator().manual_seed(m), 1.0)      # a draw's pick, on every build
            ids = kernels.screen_pick(lib, screen.head, h[:m], want, screen.c, screen.wnorm, 1024, screen.q16,
                                      offsets=o)
            assert torch.equal(ids, (kernels.linear(LIB, screen.head, h[:m]) + o).argmax(-1))


def test_rows_f32_are_the_values_of_the_full_head():
    w = _head(517, 96, 0)
    mat = Mat.in_place(w)
    h = _inputs(2, 96, 4, 1.0)
    full = kernels.linear(LIB, mat, h)
    rows = torch.tensor([0, 5, 6, 7, 511, 516, 3, 3, 9])
    pos = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1])
    assert torch.equal(kernels.rows_f32(LIB, mat, rows, pos, h), full[pos, rows])


def test_screened_argmax_equals_the_full_argmax_bit_for_bit():
    w = _head(4000, 64, 7)
    w[1000] = w[1000] / w[1000].norm() * w.norm(dim=1).max() * 2
    w[2000] = w[1000]                                   # an exact tie: the first index wins, as in torch.argmax
    w[1500] = w[1200] * (1 + 1e-7)                      # a near tie
    screen = HeadScreen(LIB, Mat.in_place(w))
    g = torch.Generator().manual_seed(8)
    checked = 0
    for trial in range(300):
        m = 1 + trial % MAX_POSITIONS
        h = torch.randn(m, 64, generator=g) * (0.05 + trial / 30)
        if trial % 3 == 0:                              # aim at the tied and nearly tied rows
            h[0] = w[[1000, 1200][trial % 2]] * 3 + 0.01 * torch.randn(64, generator=g)
        got = screen.argmax(h)
        want = kernels.linear(LIB, screen.head, h).argmax(-1)
        if got is not None:
            assert torch.equal(got, want), trial
            checked += 1
    assert checked > 200
    for m in (1, 2):
        tie = torch.stack([w[1000] * 3] * m)
        assert screen.argmax(tie).tolist() == kernels.linear(LIB, screen.head, tie).argmax(-1).tolist() == [1000] * m


def test_the_screen_steps_aside_where_it_cannot_help():
    w = _head(4000, 64, 9)
    screen = HeadScreen(LIB, Mat.in_place(w))
    assert screen.argmax(torch.randn(MAX_POSITIONS + 1, 64)) is None        # long passes: the full head
    flat = torch.ones(4000, 64) + 1e-4 * torch.randn(4000, 64, generator=torch.Generator().manual_seed(1))
    flat_screen = HeadScreen(LIB, Mat.in_place(flat))   # every logit within the bound: too many candidates
    assert flat_screen.argmax(torch.randn(1, 64)) is None
    bad = torch.randn(1, 64)
    bad[0, 1] = float("nan")
    assert screen.argmax(bad) is None
    with pytest.raises(ValueError):
        HeadScreen(LIB, Mat.in_place(torch.randn(10, 64), torch.randn(10)))   # a head with a bias


def test_engine_greedy_ids_equal_the_logits_argmax_at_every_exit():
    model = make_tiny_llama(seed=3, scale=8.0)
    eng = LayeredLM(model)
    assert eng._screen is not None
    ids = torch.randint(3, 64, (40,), generator=torch.Generator().manual_seed(2))
    st = eng.new_state(48, save_boundaries=[2])
    eng.append(st, ids)
    for b in (2, 4):
        eng.advance(st, b)
        for s in range(0, 38):
            for m in (1, 2, 3):
                assert torch.equal(eng.greedy_ids(st, b, s, min(s + m, 40)),
                                   eng.logits(st, b, s, min(s + m, 40)).argmax(-1))


def _five_states(eng, seed: int) -> list:
    """Five sequences of 9, 14, 6, 11 and 20 random tokens, computed to the tiny model's last layer."""
    g = torch.Generator().manual_seed(seed)
    sts = []
    for n in (9, 14, 6, 11, 20):
        st = eng.new_state(32)
        eng.append(st, torch.randint(3, 64, (n,), generator=g))
        eng.advance(st, 4)
        sts.append(st)
    return sts


def test_batched_greedy_ids_take_the_screen_up_to_its_rows_and_equal_each_reads_argmax(monkeypatch):
    """Reads of several sequences with at most MAX_POSITIONS rows in all go through one screened call; more take
    the full head; either way every read's ids are its own logits' argmax."""
    eng = LayeredLM(make_tiny_llama(seed=3, scale=8.0))
    sts = _five_states(eng, seed=4)
    calls = []
    argmax = eng._screen.argmax
    monkeypatch.setattr(eng._screen, "argmax", lambda h: calls.append(h.shape[0]) or argmax(h))
    for rows in ([1, 1], [1, 2, 1], [1, 1, 1, 1], [2, 2], [1, 1, 1, 1, 1], [3, 2], [4, 4, 4, 4], [9, 8], [5, 7, 5]):
        reads = [(st, 4, st.n - r, st.n) for st, r in zip(sts, rows)]
        calls.clear()
        got = eng.greedy_ids_many(reads)
        assert calls == ([sum(rows)] if sum(rows) <= MAX_POSITIONS else []), rows
        for (st, b, s0, s1), ids in zip(reads, got):
            assert torch.equal(ids, eng.logits(st, b, s0, s1).argmax(-1))


@pytest.mark.parametrize("greedy", [True, False])
def test_cost_timings_end_passes_as_the_runtime_does(greedy):
    """Greedy profiles time the head the runtime uses in greedy decoding (the screen), sampled ones the logits;
    the timed passes read the given text."""
    from hsd_opt.profiler.costs import measure_costs

    eng = LayeredLM(make_tiny_llama(seed=4))
    calls = {"greedy_ids": 0}
    real = eng.greedy_ids

    def counted(*a):
        calls["greedy_ids"] += 1
        return real(*a)

    eng.greedy_ids = counted
    text = [int(t) for t in torch.randint(3, 64, (50,), generator=torch.Generator().manual_seed(5))]
    states: dict = {}
    measure_costs(eng, [2, 4], tmax=3, repeats=1, warmup=0, curve_repeats=1, contexts=(16,), greedy=greedy,
                  text=text, keep_states=states)
    assert (calls["greedy_ids"] > 0) == greedy
    assert states[16].token_list()[:16] == text[:16]


def test_the_screens_kernels_refuse_an_activation_range_below_one():
    from hsd_opt.errors import HsdError

    w = _head(64, 32, 1)
    screen = HeadScreen(LIB, Mat.in_place(w))
    h = _inputs(1, 32, 2, 1.0)
    a = screen.logits(h)
    for q16 in (0, -1):
        with pytest.raises(HsdError):
            kernels.screen_bounds(LIB, h, screen.c, screen.wnorm, q16)
        with pytest.raises(HsdError):
            kernels.screen_pick(LIB, screen.head, h, a, screen.c, screen.wnorm, 8, q16)


def _gumbel(shape, g: torch.Generator, temperature: float) -> torch.Tensor:
    from hsd_opt.runtime.sampling import LEAST_UNIFORM

    u = torch.rand(shape, generator=g).clamp_min_(LEAST_UNIFORM)
    return -(-u.log()).log() * temperature


def _tied_screen(seed: int) -> tuple[torch.Tensor, HeadScreen]:
    """A head of 4,000 rows (width 64) whose rows 1000 and 2000 are equal and the largest, and its screen."""
    w = _head(4000, 64, seed)
    w[1000] = w[1000] / w[1000].norm() * w.norm(dim=1).max() * 2
    w[2000] = w[1000]
    return w, HeadScreen(LIB, Mat.in_place(w))


@pytest.mark.parametrize("temperature", [1e-3, 0.7, 1.0, 3.0])
def test_a_pick_with_offsets_equals_the_argmax_of_the_logits_plus_them(temperature):
    """The screen's pick of ``logits + offsets`` (sampling by noise, Gumbel-max) is ``(logits + offsets).argmax``
    bit for bit: random noise at several temperatures, exact and near ties in the logits, and offsets that make
    two rows' sums tie exactly (the first wins)."""
    w, screen = _tied_screen(11)                       # equal logits: equal sums where the offsets are equal
    g = torch.Generator().manual_seed(12)
    checked = 0
    for trial in range(120):
        m = 1 + trial % 4
        h = torch.randn(m, 64, generator=g) * (0.05 + trial / 20)
        o = _gumbel((m, 4000), g, temperature)
        if trial % 4 == 0:                              # a tie of sums: rows 1000 and 2000 lead, equal
            h[0] = w[1000] * 3
            o[0, 2000] = o[0, 1000] = o[0].max() + 1
        full = kernels.linear(LIB, screen.head, h)
        want = (full + o).argmax(-1)
        got = screen.pick(h, screen.logits(h), o)
        if got is not None:
            assert torch.equal(got, want), trial
            checked += 1
        if trial % 4 == 0:
            assert want[0] == 1000
    assert checked > 100
    bad = _gumbel((1, 4000), g, 1.0)
    bad[0, 7] = float("inf")                            # an offset not finite: the caller computes the logits
    h = torch.randn(1, 64, generator=g)
    assert screen.pick(h, screen.logits(h), bad) is None


def test_engine_picks_equal_the_argmax_of_each_reads_logits_plus_offsets(monkeypatch):
    """``picks_many``: reads with at most MAX_POSITIONS rows in all through the screen (one int16 read), more
    over their logits; either way row i's pick is ``(logits[i] + offsets).argmax()`` of that read alone."""
    eng = LayeredLM(make_tiny_llama(seed=3, scale=8.0))
    assert eng.picks_cheaply
    sts = _five_states(eng, seed=6)
    g = torch.Generator().manual_seed(6)
    screened = []
    logits = eng._screen.logits
    monkeypatch.setattr(eng._screen, "logits", lambda h: screened.append(h.shape[0]) or logits(h))
    for rows in ([1], [3, 1], [4, 4, 4, 4], [9, 8], [5, 7, 5]):
        reads = [(st, 4, st.n - r, st.n) for st, r in zip(sts, rows)]
        screened.clear()
        got = eng.picks_many(reads)
        assert screened == ([sum(rows)] if sum(rows) <= MAX_POSITIONS else []), rows
        for (st, b, s0, s1), picks in zip(reads, got):
            lg = eng.logits(st, b, s0, s1)
            assert picks.rows == s1 - s0
            for i in range(picks.rows):
                for _ in range(3):
                    o = _gumbel(lg.shape[1], g, 1.0)
                    assert picks.pick(i, o) == int((lg[i] + o).argmax())


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.0])
def test_a_window_holds_every_logit_the_filters_keep_and_gives_their_distribution(temperature):
    """``HeadScreen.window``: every token the top-k / min-p filters may keep of ``logits + offsets`` has its logit
    bit for bit as the full head computes it, the others are ``-inf`` (most of the vocabulary: the window is
    narrow), and the filtered distribution of the window equals that of the full logits (the same tokens, the
    same probabilities to float32 rounding); the columns it names are those some row holds. Exact ties at the k-th
    place (rows 1000 and 2000) and offsets."""
    import math

    from hsd_opt.runtime.sampling import process_logits

    w, screen = _tied_screen(13)
    g = torch.Generator().manual_seed(14)
    narrow = 0
    for trial in range(60):
        m = 1 + trial % 4
        h = torch.randn(m, 64, generator=g) * (0.5 + trial / 10)
        if trial % 5 == 0:
            h[0] = w[1000] * 2
        off = torch.randn(m, 4000, generator=g) * 2 if trial % 2 else None
        top_k, min_p = [(40, 0.0), (1, 0.0), (0, 0.05), (40, 0.05), (2, 0.2)][trial % 5]
        below = -temperature * math.log(min_p) if min_p else math.inf
        # every third trial: a repetition penalty on some tokens (the largest among them), pinned
        pinned = tuple(torch.tensor(sorted({1000, 7, *torch.randint(0, 4000, (5,), generator=g).tolist()}))
                       for _ in range(m)) if trial % 3 == 0 else ()
        window = screen.window(h, screen.logits(h), top_k, below, off, pinned, _penalise)
        assert window is not None, trial
        got, cols = window
        full = kernels.linear(LIB, screen.head, h)
        kept = torch.isfinite(got)
        assert torch.equal(cols, kept.any(0).nonzero()[:, 0]), trial  # the columns: those some row holds
        assert torch.equal(got[kept], full[kept]), trial
        moved = _moved(full, off, pinned)
        want = process_logits(moved, temperature, 1.0, top_k, min_p)
        have = process_logits(_moved(got, off, pinned), temperature, 1.0, top_k, min_p)
        assert bool(kept[want > 0].all()), trial                      # every token the filters keep is there
        assert torch.equal(have > 0, want > 0), trial
        assert torch.allclose(have, want, rtol=1e-5, atol=1e-7), trial
        narrow += int(kept.sum()) < m * 400
    assert narrow > 40
    h = torch.randn(1, 64, generator=g)
    assert screen.window(h, screen.logits(h), 0, math.inf) is None         # no filter: every logit needed


def _penalise(v: torch.Tensor) -> torch.Tensor:
    """A repetition penalty of 0.1's offsets ``r(l) - l`` (below 1: it raises the repeated tokens, into the
    window from far below it)."""
    return torch.where(v > 0, v / 0.1, v * 0.1) - v


def _moved(logits: torch.Tensor, off: torch.Tensor | None, pinned) -> torch.Tensor:
    """``logits + offsets``, the pinned tokens' offsets plus :func:`_penalise` of their logits where finite."""
    row = torch.zeros_like(logits) if off is None else off.clone()
    for i, ids in enumerate(pinned):
        held = ids[torch.isfinite(logits[i, ids])]
        row[i, held] += _penalise(logits[i, held])
    return logits + row


def test_engine_window_logits_are_each_reads_logits_in_the_window(monkeypatch):
    """``window_logits_many``: reads with at most MAX_POSITIONS rows in all through the screen in one int16 read,
    more each alone; either way the window's logits those of ``logits``, the rest ``-inf``, its columns those some
    row holds, as the read alone gets them."""
    from hsd_opt.engine.interface import Window

    eng = LayeredLM(make_tiny_llama(seed=3, scale=8.0))
    sts = _five_states(eng, seed=7)
    screened = []
    logits = eng._screen.logits
    monkeypatch.setattr(eng._screen, "logits", lambda h: screened.append(h.shape[0]) or logits(h))
    for rows in ([1], [3, 1], [9, 8]):
        reads = [(st, 4, st.n - r, st.n) for st, r in zip(sts, rows)]
        screened.clear()
        got = eng.window_logits_many(reads, [Window(3, 2.0)] * len(reads))
        assert screened == ([sum(rows)] if sum(rows) <= MAX_POSITIONS else rows), rows
        for (st, b, s0, s1), w in zip(reads, got):
            lg, full = w.logits, eng.logits(st, b, s0, s1)
            kept = torch.isfinite(lg)
            assert torch.equal(lg[kept], full[kept])
            assert torch.equal(w.cols, kept.any(0).nonzero()[:, 0])
            top3 = full.topk(3, dim=-1).indices
            assert bool(kept.gather(1, top3).all()) and not bool(kept.all())
            alone = eng.window_logits_many([(st, b, s0, s1)], [Window(3, 2.0)])[0]      # as alone
            assert torch.equal(lg, alone.logits) and torch.equal(w.cols, alone.cols)


def test_the_kernels_filters_over_a_window_are_process_logits():
    """``kernels.filter_probs`` (``hsd_filter_probs``, what ``window_probs`` runs on the CPU): over rows whose
    columns outside their window are ``-inf``, the distribution ``process_logits`` gives (the same tokens kept,
    the same probabilities to float32 rounding; a token under ``e^-87.3`` of the largest counts as 0 there), with
    top-k, top-p and min-p alone and together; among equal logits at top-k's ``k``-th place or at top-p's edge the
    lower columns; a
    row it cannot take (every column ``-inf``, a value not a number, ``x / T`` infinite) is left to
    ``process_logits`` (None)."""
    import math

    from hsd_opt.runtime.sampling import process_logits

    g = torch.Generator().manual_seed(21)
    for trial in range(600):
        m, n = 1 + trial % 5, int(torch.randint(1, 400, (), generator=g))
        x = torch.randn(m, n, generator=g) * float(torch.rand((), generator=g) * 8)
        x[torch.rand(m, n, generator=g) < 0.5] = -math.inf
        x[torch.arange(m), torch.randint(n, (m,), generator=g)] = torch.randn(m, generator=g)
        t = (0.3, 0.7, 1.0, 2.0)[trial % 4]
        top_p, top_k, min_p = (1.0, 0.95, 0.5)[trial % 3], (0, 40, 3, 1, 0)[trial % 5], (0.0, 0.05, 0.2)[trial % 7 % 3]
        got = kernels.filter_probs(LIB, x, t, top_p, top_k, min_p)
        want = process_logits(x, t, top_p, top_k, min_p)
        assert got is not None, trial
        assert torch.equal(got > 1e-30, want > 1e-30), trial
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), trial
        if top_k:
            assert int((got > 0).sum(-1).max()) <= top_k
    tied = torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0, -math.inf]])
    assert kernels.filter_probs(LIB, tied, 1.0, 1.0, 2, 0.0)[0].tolist() == [0.0, 0.5, 0.0, 0.5, 0.0, 0.0]
    for k in (1, 2, 4):                           # process_logits keeps the same tied columns (torch.topk: any)
        assert torch.equal(process_logits(tied, 1.0, 1.0, k, 0.0), kernels.filter_probs(LIB, tied, 1.0, 1.0, k, 0.0))
    many = torch.zeros(3, 40)
    many[:, 5] = 1.0
    many[1, 30:] = 2.0                             # ten tied above the rest
    kept = (process_logits(many, 0.7, 1.0, 4, 0.0) > 0).nonzero().tolist()
    assert kept == [[0, 0], [0, 1], [0, 2], [0, 5], [1, 30], [1, 31], [1, 32], [1, 33], [2, 0], [2, 1], [2, 2], [2, 5]]
    edge = torch.full((2, 150), -5.0)              # top-p's edge among 100 equal logits: the lower columns kept
    edge[:, 20:120] = 0.0
    edge[:, 0] = torch.tensor([3.0, 1.0])
    for top_p, top_k in ((0.5, 0), (0.8, 0), (0.5, 110)):
        want = kernels.filter_probs(LIB, edge, 1.0, top_p, top_k, 0.0)
        got = process_logits(edge, 1.0, top_p, top_k, 0.0)
        assert torch.equal(got > 0, want > 0) and torch.allclose(got, want, rtol=1e-5, atol=1e-7), (top_p, top_k)
        for row in got:
            kept = (row > 0).nonzero().flatten().tolist()
            assert kept == [0, *range(20, 19 + len(kept))] and 2 < len(kept) < 101, (top_p, top_k, kept)
    for row in ([-math.inf, -math.inf], [0.0, math.nan], [1.0, 2.0]):
        assert kernels.filter_probs(LIB, torch.tensor([row]), 1e-39 if row == [1.0, 2.0] else 1.0, 1.0, 0, 0.0) \
            is None, row


def test_window_probs_takes_the_kernels_filters_for_a_window_and_process_logits_for_every_column(monkeypatch):
    """``window_probs`` on the CPU: rows that leave columns out (a window) through ``kernels.filter_probs`` over
    their columns (the same distribution as ``process_logits``, to rounding); rows holding every column (the engine
    read every logit: the screen stepped aside) through ``process_logits`` itself, bit for bit, since the kernels'
    filters sort every column they hold."""
    import math

    from hsd_opt.runtime.sampling import process_logits, window_probs

    calls = []
    real = kernels.filter_probs
    monkeypatch.setattr(kernels, "filter_probs", lambda *a: calls.append(a[1].shape) or real(*a))
    g = torch.Generator().manual_seed(5)
    full = torch.randn(3, 3000, generator=g) * 3
    assert torch.equal(window_probs(full, 0.7, 0.95, 40, 0.05), process_logits(full, 0.7, 0.95, 40, 0.05))
    assert calls == []
    held = full.clone()
    held[:, 100:] = -math.inf
    held[1, 2000] = 5.0
    got = window_probs(held, 0.7, 0.95, 40, 0.05)
    assert calls == [(3, 101)]                                      # its 101 columns, in one call
    want = process_logits(held, 0.7, 0.95, 40, 0.05)
    assert torch.equal(got > 0, want > 0) and torch.allclose(got, want, rtol=1e-5, atol=1e-7)
    # a top-k past 32 bits is no top-k; a temperature or top-p below float32's least is what process_logits makes
    # of it (softmax's limit; the most probable token alone), not an error
    for t, top_p, top_k, min_p in ((1.0, 1.0, 2 ** 32 + 5, 0.01), (1e-50, 1.0, 5, 0.0), (1.0, 1e-50, 5, 0.0)):
        got, want = window_probs(held, t, top_p, top_k, min_p), process_logits(held, t, top_p, top_k, min_p)
        assert torch.equal(got > 0, want > 0) and torch.allclose(got, want, rtol=1e-5, atol=1e-7), (t, top_p, top_k)
