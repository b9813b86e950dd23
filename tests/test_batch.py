"""Several sequences in one pass: a batched pass gives each sequence bit for bit what it gets alone (every engine,
both backends, ragged lengths and positions, exits and frontiers), and the batch scheduler's greedy answers are
token for token each prompt's own, whatever shares its passes and whichever hierarchy the load picks; a sampled
answer depends on its seed only."""

from __future__ import annotations

import copy

import pytest
import torch

from hsd_opt.engine import kernels
from hsd_opt.engine.layered import LayeredLM
from hsd_opt.engine.quantized import QuantizedLM
from hsd_opt.errors import HsdError
from hsd_opt.formats import nearest_level
from hsd_opt.runtime import decode
from hsd_opt.runtime.batch import Batch, generate_many, round_passes
from hsd_opt.runtime.decode import HSD, Committed, Level, Pass, serve
from tests.helpers import CycleDrafter, make_tiny_llama

HAVE_KERNELS = kernels.load() is not None


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama(seed=3, vocab_size=64, layers=4, hidden=64, heads=4, kv_heads=2, scale=8.0)


def _engine(tiny, kind: str):
    if kind in ("f32", "bf16", "q8", "q4") and not HAVE_KERNELS:
        pytest.skip("no C compiler here: the kernels cannot be built")
    if kind == "f32":
        return LayeredLM(tiny, kernels=True)
    if kind == "bf16":
        return LayeredLM(copy.deepcopy(tiny).to(torch.bfloat16), kernels=True)
    if kind == "torch":
        return LayeredLM(tiny, kernels=False)
    return QuantizedLM(tiny, bits=8 if kind == "q8" else 4, kernels=True)


def _kernel_calls(eng, monkeypatch) -> list[list[int]]:
    """From now on, each call of ``eng``'s kernels over layers: the row counts of its parts, sorted."""
    calls: list[list[int]] = []
    real = eng._kernels.layers_many
    monkeypatch.setattr(eng._kernels, "layers_many", lambda l0, l1, parts: calls.append(
        sorted(p.x.shape[0] for p in parts)) or real(l0, l1, parts))
    return calls


def _share_calls(copy_engine, monkeypatch) -> list[int]:
    """From now on, each ``share_prompt`` of ``copy_engine``'s class: the positions it copied per layer."""
    calls: list[int] = []
    real = type(copy_engine).share_prompt
    monkeypatch.setattr(type(copy_engine), "share_prompt",
                        lambda self, *a: calls.append(real(self, *a)) or calls[-1])
    return calls


def _states(eng, prompts, bounds):
    out = []
    for p in prompts:
        st = eng.new_state(80, save_boundaries=bounds)
        eng.append(st, p)
        eng.advance(st, 4)
        out.append(st)
    return out


@pytest.mark.parametrize("kind", ["f32", "bf16", "q8", "q4", "torch"])
def test_a_batched_pass_gives_each_sequence_what_it_gets_alone(tiny, kind):
    """Four sequences of different lengths, each appending its own number of tokens (1, 3, 7, 2), advanced to
    different boundaries (an exit first, then the rest: frontiers), in batched passes and alone: the same
    hidden states, caches, logits and greedy ids, bit for bit."""
    eng = _engine(tiny, kind)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 64, (n,), generator=g) for n in (5, 17, 9, 30)]
    news = [torch.randint(3, 64, (n,), generator=g) for n in (1, 3, 7, 2)]
    alone, together = _states(eng, prompts, [2, 4]), _states(eng, prompts, [2, 4])
    for st, new in zip(alone + together, news + news):
        eng.append(st, new)
    for st in alone:
        eng.advance(st, 2)
        eng.advance(st, 4)
    eng.advance_many([(st, 2) for st in together[:2]] + [(st, 4) for st in together[2:]])
    eng.advance_many([(st, 4) for st in together])
    for a, b in zip(alone, together):
        assert a.lens == b.lens
        assert all(torch.equal(x[:, :, :a.n], y[:, :, :a.n]) for x, y in zip(a.k + a.v, b.k + b.v))
    reads = [(st, bd, st.n - len(new) - 1, st.n) for st, new, bd in zip(together, news, (2, 4, 4, 2))]
    want = [eng.logits(st, bd, s0, s1) for (_, bd, s0, s1), st in zip(reads, alone)]
    got = eng.logits_many(reads)
    assert all(torch.equal(w, x) for w, x in zip(want, got))
    ids_alone = [eng.greedy_ids(st, bd, s0, s1) for (_, bd, s0, s1), st in zip(reads, alone)]
    assert all(torch.equal(w, x) for w, x in zip(ids_alone, eng.greedy_ids_many(reads)))


@pytest.mark.parametrize("kind", ["f32", "q8", "q4", "torch"])
def test_a_pass_over_more_positions_than_a_step_shares_the_call_and_gives_what_it_gets_alone(tiny, kind,
                                                                                            monkeypatch):
    """One sequence's pass over 70 new positions (more than ``MAX_PASS``: a quantized copy takes it on the
    kernels, in the same call as another sequence's single position; a float model on the torch path, alone)
    batched and alone: the same caches and logits, bit for bit."""
    eng = _engine(tiny, kind)
    calls = _kernel_calls(eng, monkeypatch) if eng._kernels is not None else []
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 64, (n,), generator=g) for n in (6, 9)]
    news = [torch.randint(3, 64, (n,), generator=g) for n in (kernels.MAX_PASS + 6, 1)]
    alone, together = _states(eng, prompts, [4]), _states(eng, prompts, [4])
    for st, new in zip(alone + together, news + news):
        eng.append(st, new)
    for st in alone:
        eng.advance(st, 4)
    calls.clear()
    eng.advance_many([(st, 4) for st in together])
    assert calls == ([[1, kernels.MAX_PASS + 6]] if kind in ("q8", "q4") else [[1]] if kind == "f32" else [])
    for a, b, new in zip(alone, together, news):
        assert all(torch.equal(x[:, :, :a.n], y[:, :, :a.n]) for x, y in zip(a.k + a.v, b.k + b.v))
        assert torch.equal(eng.logits(a, 4, a.n - len(new), a.n), eng.logits(b, 4, b.n - len(new), b.n))


def test_a_batched_kernel_pass_computes_every_row_once(tiny, monkeypatch):
    """The rows of every sequence of a batched step go to the kernels in one call per run of layers."""
    eng = _engine(tiny, "f32")
    calls = _kernel_calls(eng, monkeypatch)
    states = _states(eng, [torch.arange(3, 3 + n) for n in (4, 6, 8)], [4])
    for st in states:
        eng.append(st, [7])
    calls.clear()                                          # the prefills above: one sequence each
    eng.advance_many([(st, 4) for st in states])
    assert calls == [[1, 1, 1]]


def test_a_prompts_last_pass_shares_the_kernel_call_of_the_others_rounds(tiny, monkeypatch):
    """A prompt's last pass is computed in the batched call that serves the other sequences' rounds: one kernel
    call per run of layers over the new prompt's rows and a decoding sequence's row; both answers are their
    prompts' own."""
    eng = _engine(tiny, "f32")
    ar = HSD([Level("layer4", eng, 4)], [], eos_ids=[2])
    first, second = list(range(3, 8)), list(range(10, 22))
    want = [ar.generate(first, 6).token_ids, ar.generate(second, 6).token_ids]
    calls = _kernel_calls(eng, monkeypatch)
    batch = Batch(ar, max_active=2)
    got: dict[int, list[int]] = {}
    batch.add(first, 6, on_done=lambda res, err: got.__setitem__(0, res.token_ids))
    batch.tick()
    assert calls == [[5]]                   # the first prompt's pass, in its first round's call
    batch.add(second, 6, on_done=lambda res, err: got.__setitem__(1, res.token_ids))
    calls.clear()
    batch.tick()
    assert calls == [[1, 12]]               # the second prompt's 12 rows beside the first sequence's next row
    batch.run()
    assert [got[0], got[1]] == want


def _hierarchies(tiny, eng):
    lm = eng
    q4 = QuantizedLM(tiny, bits=4) if HAVE_KERNELS else QuantizedLM(tiny, bits=4, kernels=False)
    h1 = HSD([Level("cycle", drafter=CycleDrafter(64)), Level("q4", q4, 4), Level("layer4", lm, 4)], [2, 4],
             eos_ids=[2])
    h2 = HSD([Level("layer2", lm, 2), Level("layer4", lm, 4)], [3], eos_ids=[2])
    ar = HSD([Level("layer4", lm, 4)], [], eos_ids=[2])
    return h1, h2, ar


def _chunked_ar(tiny, monkeypatch, seed: int, *sizes: int):
    """Prompt passes of 8 positions, the target alone over a fresh engine, and random prompts of ``sizes``."""
    monkeypatch.setattr(decode, "PREFILL_CHUNK", 8)
    eng = LayeredLM(tiny)
    _, _, ar = _hierarchies(tiny, eng)
    g = torch.Generator().manual_seed(seed)
    return eng, ar, [torch.randint(3, 64, (n,), generator=g).tolist() for n in sizes]


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 64, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("kernels_on", [True, False])
def test_greedy_answers_in_a_batch_are_each_prompts_own(tiny, kernels_on):
    """Seven prompts of different lengths and budgets of new tokens, at most three in flight (sequences join and
    leave between ticks), the hierarchy switching with the load (a three-level plan alone, an exit below two,
    the target alone from three): every answer equals the target's own greedy answer to its prompt. All start
    under a load of three; as the load falls they take the exit's plan (the target's own engine) and the
    three-level one (its copy takes the target's keys and values of every position so far)."""
    if kernels_on and not HAVE_KERNELS:
        pytest.skip("no C compiler here: the kernels cannot be built")
    eng = LayeredLM(tiny, kernels=kernels_on)
    h1, h2, ar = _hierarchies(tiny, eng)
    prompts = _prompts(7)
    news = [5, 40, 17, 1, 33, 26, 9]
    want = [ar.generate(p, n).token_ids for p, n in zip(prompts, news)]
    batch = Batch({1: h1, 2: h2, 3: ar}, max_active=3)
    got: dict[int, list[int]] = {}
    used: set[tuple[str, ...]] = set()
    for i, (p, n) in enumerate(zip(prompts, news)):
        batch.add(p, n, on_done=lambda res, err, i=i: got.__setitem__(i, res.token_ids if err is None else err))
    loads = []
    while batch.busy:
        loads.append(len(batch.active))
        batch.tick()
        used |= {tuple(lv.name for lv in e.decoding.hsd.levels) for e in batch.active}
    assert [got[i] for i in range(7)] == want
    names = lambda h: tuple(lv.name for lv in h.levels)  # noqa: E731
    assert max(loads) == 3 and 1 in loads and used == {names(ar), names(h2), names(h1)}   # the load fell to one


def test_sampled_answers_depend_on_their_seed_only(tiny):
    """A sampled sequence keeps the single-sequence hierarchy: its tokens are those it draws alone with its
    seed, whatever else is in flight."""
    if not HAVE_KERNELS:
        pytest.skip("no C compiler here: the kernels cannot be built")
    eng = LayeredLM(tiny)
    h1, h2, ar = _hierarchies(tiny, eng)
    prompts = _prompts(5, seed=1)
    seeds = [11, 12, 13, 14, 15]
    want = [h1.generate(p, 20, temperature=0.8, top_p=0.9, seed=s).token_ids for p, s in zip(prompts, seeds)]
    got = generate_many({1: h1, 2: h2, 4: ar}, prompts, 20, max_active=4, temperature=0.8, top_p=0.9, seeds=seeds)
    assert [r.token_ids for r in got] == want


def test_draws_by_noise_depend_on_their_seed_only(tiny):
    """Sampled at top-p 1 over a token drafter, the target draws by noise through its screen (picks); a seeded
    sequence's tokens are those it draws alone, whatever shares its passes: a batch of five reads up to twenty
    rows of the target at once, past the screen's sixteen (the picks then read the logits), and the same draws
    come out."""
    if not HAVE_KERNELS:
        pytest.skip("no C compiler here: the kernels cannot be built")
    eng = LayeredLM(tiny)
    assert eng.picks_cheaply
    h = HSD([Level("cycle", drafter=CycleDrafter(64)), Level("layer4", eng, 4)], [3], eos_ids=[2])
    prompts = _prompts(5, seed=21)
    seeds = [31, 32, 33, 34, 35]
    want = [h.generate(p, 24, temperature=1.0, seed=s).token_ids for p, s in zip(prompts, seeds)]
    assert len({tuple(w) for w in want}) == 5
    rows: list[int] = []
    picks_many = eng.picks_many
    eng.picks_many = lambda reads: rows.append(sum(s1 - s0 for _, _, s0, s1 in reads)) or picks_many(reads)
    for active in (2, 5):
        got = generate_many(h, prompts, 24, max_active=active, temperature=1.0, seeds=seeds)
        assert [r.token_ids for r in got] == want, active
    assert max(rows) > 16 and min(rows) <= 16


def test_filtered_samples_depend_on_their_seed_only(tiny):
    """Sampled with top-k and min-p over a token drafter, the target reads the filters' window through its screen;
    a seeded sequence's tokens are those it draws alone, whatever shares its passes, batches of more than the
    screen's sixteen rows too (each read then through it alone)."""
    if not HAVE_KERNELS:
        pytest.skip("no C compiler here: the kernels cannot be built")
    eng = LayeredLM(tiny)
    h = HSD([Level("cycle", drafter=CycleDrafter(64)), Level("layer4", eng, 4)], [5], eos_ids=[2])
    prompts = _prompts(5, seed=22)
    seeds = [41, 42, 43, 44, 45]
    kw = dict(temperature=1.3, top_k=5, min_p=0.02)
    want = [h.generate(p, 24, seed=s, **kw).token_ids for p, s in zip(prompts, seeds)]
    assert len({tuple(w) for w in want}) == 5
    rows: list[int] = []
    many = eng.window_logits_many
    eng.window_logits_many = lambda reads, w: rows.append(sum(s1 - s0 for _, _, s0, s1 in reads)) or many(reads, w)
    for active in (2, 5):
        got = generate_many(h, prompts, 24, max_active=active, seeds=seeds, **kw)
        assert [r.token_ids for r in got] == want, active
    assert max(rows) > 16 and min(rows) <= 16


def test_a_stop_asked_after_a_block_ends_only_that_sequence(tiny):
    eng = LayeredLM(tiny)
    _, h2, ar = _hierarchies(tiny, eng)
    prompts = _prompts(3, seed=2)
    want = [ar.generate(p, 30).token_ids for p in prompts]
    batch = Batch(h2, max_active=3)
    out = {}
    blocks = []
    for i, p in enumerate(prompts):
        stop = (lambda toks: blocks.append(toks) or True) if i == 1 else None
        batch.add(p, 30, on_tokens=stop, on_done=lambda res, err, i=i: out.__setitem__(i, res))
    batch.run()
    assert out[0].token_ids == want[0] and out[2].token_ids == want[2]
    assert out[1].token_ids == blocks[0] == want[1][:len(blocks[0])] and out[1].stats["stopped"] == "callback"


def test_a_failing_sequence_ends_alone(tiny, monkeypatch):
    eng = LayeredLM(tiny)
    _, h2, ar = _hierarchies(tiny, eng)
    prompts = _prompts(3, seed=3)
    batch = Batch(h2, max_active=3)
    results = {}
    for i, p in enumerate(prompts):
        entry = batch.add(p, 12, on_done=lambda res, err, i=i: results.__setitem__(i, (res, err)))
        if i == 1:
            def steps():
                raise RuntimeError("boom")
                yield  # pragma: no cover
            entry.decoding.steps = steps
    batch.run()
    assert isinstance(results[1][1], RuntimeError) and results[1][0] is None
    assert [results[i][0].token_ids for i in (0, 2)] == [ar.generate(prompts[i], 12).token_ids for i in (0, 2)]


def test_a_batch_refuses_hierarchies_over_different_targets(tiny):
    a = HSD([Level("layer4", LayeredLM(tiny), 4)], [])
    b = HSD([Level("layer4", LayeredLM(tiny), 4)], [])
    with pytest.raises(HsdError, match="same target"):
        Batch({1: a, 2: b})
    with pytest.raises(HsdError, match="--max-batch"):
        Batch(a, max_active=0)


def test_a_copy_switched_in_mid_sequence_takes_the_targets_keys_and_values(tiny, monkeypatch):
    """A sequence decoded by the target alone that switches to a hierarchy with a quantized copy: the copy's
    state takes the target's keys and values of every position so far (as at a prefill) and computes only the
    last; the answer stays the target's."""
    eng = LayeredLM(tiny)
    h1, _, ar = _hierarchies(tiny, eng)
    q4 = h1.levels[1].engine
    shared = _share_calls(q4, monkeypatch)
    prompt = _prompts(1, seed=4)[0]
    want = ar.generate(prompt, 30).token_ids
    d = ar.start(prompt, 30)
    d.prefill()
    steps = d.steps()
    req, rounds = steps.send(None), 0
    from hsd_opt.runtime.decode import Committed, serve
    while True:
        reply = serve(req) if not isinstance(req, Committed) else False
        if isinstance(req, Committed):
            rounds += 1
            if rounds == 5:
                d.switch(h1)
        try:
            req = steps.send(reply)
        except StopIteration:
            break
    assert d.result().token_ids == want
    assert shared and shared[0] == len(prompt) + 5 - 1      # every position the target had computed by then


def test_a_sequence_that_ends_at_its_prefill_leaves_an_empty_tick(tiny):
    """A sequence that fails (or ends) in the tick that prefills it leaves nothing to serve: the tick returns."""
    eng = LayeredLM(tiny)
    _, h2, _ = _hierarchies(tiny, eng)
    batch = Batch(h2, max_active=2)
    out = []
    entry = batch.add(_prompts(1)[0], 5, on_done=lambda res, err: out.append(err))

    def steps():
        raise RuntimeError("boom")
        yield  # pragma: no cover

    entry.decoding.steps = steps
    assert batch.tick() == 0 and not batch.busy and isinstance(out[0], RuntimeError)


def test_a_sequence_starts_with_the_hierarchy_of_the_load_it_starts_under(tiny):
    """Three prompts waiting at once: the first one prefilled already counts the two behind it, so it starts
    with the hierarchy of three sequences (its prefill computes that hierarchy's engines), not one's."""
    eng = LayeredLM(tiny)
    h1, _, ar = _hierarchies(tiny, eng)
    batch = Batch({1: h1, 3: ar}, max_active=3)
    entries = [batch.add(p, 6) for p in _prompts(3, seed=5)]
    batch.tick()
    d = entries[0].decoding
    assert d.hsd is ar and list(d._states) == [id(eng)]          # the target alone: no copy was prefilled
    batch.run()


def test_a_round_begun_under_a_lighter_load_drafts_no_further_once_the_load_rises(tiny):
    """One sequence alone starts a round of the three-level plan; two more arrive: at the next tick its round
    stops drafting and its next pass is the target's (shared with the others), not more draft passes of its own
    (served only every few ticks while the others step); every answer stays the target's own."""
    eng = LayeredLM(tiny)
    h1, _, ar = _hierarchies(tiny, eng)
    prompts, news = _prompts(3, seed=6), [30, 12, 20]
    want = [ar.generate(p, n).token_ids for p, n in zip(prompts, news)]
    batch = Batch({1: h1, 3: ar}, max_active=3)
    got: dict[int, list[int]] = {}
    first = batch.add(prompts[0], news[0], on_done=lambda res, err: got.__setitem__(0, res.token_ids))
    batch.tick()                                   # prefill; the first token is the target's, over one position
    batch.tick()                                   # the first token; the round of h1 begins: a draft pass
    assert first.pending.engine is not eng and first.decoding.hsd is h1
    for i in (1, 2):
        batch.add(prompts[i], news[i], on_done=lambda res, err, i=i: got.__setitem__(i, res.token_ids))
    waiting = first.pending
    while first.pending is waiting:                # the draft pass it waited for is served (the others' first)
        batch.tick()
    assert first.pending.engine is eng             # its tokens so far go to the target now
    batch.run()
    assert [got[i] for i in range(3)] == want


def test_a_rounds_draft_passes_bound_how_long_a_pass_waits(tiny):
    """A batch's default ``max_wait`` is the most passes a round of its hierarchies takes below the top: the
    bottom model's budget, or a middle level's budget of rounds of the level below (a token drafter: none)."""
    eng = LayeredLM(tiny)
    h1, h2, ar = _hierarchies(tiny, eng)
    q4 = h1.levels[1].engine
    deep = HSD([Level("layer2", eng, 2), Level("q4", q4, 4), Level("layer4", eng, 4)], [2, 3], eos_ids=[2])
    assert [round_passes(h) for h in (h1, h2, ar, deep)] == [4, 3, 0, 3 * (2 + 1)]
    assert Batch({1: h1, 2: h2, 3: ar}).max_wait == 4 and Batch(ar).max_wait == 3
    assert Batch({1: deep, 2: ar}).max_wait == 9 and Batch(ar, max_wait=0).max_wait == 0


def test_sequences_out_of_step_meet_at_the_targets_pass_and_share_it(tiny, monkeypatch):
    """Two sequences drafting six tokens a round with the int4 copy, the second joining while the first drafts:
    the second's first token is served at once (alone), and from then on no target pass serves one of them alone
    while both decode: the one ahead waits at the target for the other's drafts (more ticks than the old fixed
    wait of 3). Every answer stays the target's own."""
    eng = LayeredLM(tiny)
    q4 = _hierarchies(tiny, eng)[0].levels[1].engine
    spec = HSD([Level("q4", q4, 4), Level("layer4", eng, 4)], [6], eos_ids=[2])
    ar = HSD([Level("layer4", eng, 4)], [], eos_ids=[2])
    prompts, news = _prompts(2, seed=13), [40, 34]
    want = [ar.generate(p, n).token_ids for p, n in zip(prompts, news)]
    batch = Batch(spec, max_active=2)
    # (a target pass, sequences in it, sequences decoding, of them without their first token yet)
    served: list[tuple[bool, int, int, int]] = []
    real = Batch._serve
    monkeypatch.setattr(Batch, "_serve", staticmethod(lambda passes: served.append(
        (passes[0].engine is eng, len(passes), len(batch.active),
         sum(e.first_token is None for e in batch.active))) or real(passes)))
    got: dict[int, list[int]] = {}
    batch.add(prompts[0], news[0], on_done=lambda res, err: got.__setitem__(0, res.token_ids))
    for _ in range(2):                                 # its prefill, its first token (its six drafts to come)
        batch.tick()
    batch.add(prompts[1], news[1], on_done=lambda res, err: got.__setitem__(1, res.token_ids))
    batch.run()
    assert [got[0], got[1]] == want
    target = [(n, active, new) for is_target, n, active, new in served if is_target]
    assert target.count((1, 2, 1)) == 1                  # the second's first token, served in its own tick
    assert (2, 2, 0) in target and (1, 2, 0) not in target


def test_when_the_load_falls_a_sequence_takes_on_a_copy_by_its_keys_and_values_not_a_draft_model(tiny,
                                                                                                   monkeypatch):
    """Three sequences started together decode with the target alone (the plan of three). When the other two end,
    the one left takes the single-sequence plan's copy, which takes the target's keys and values of every position
    so far (one pass of the copy's own for the last); a plan whose drafter is a draft model of its own weights
    (it would compute every position so far, unpriced) is not taken. Every answer is the target's own."""
    eng = LayeredLM(tiny)
    h1, _, ar = _hierarchies(tiny, eng)
    q4 = h1.levels[1].engine
    other = LayeredLM(make_tiny_llama(seed=8, vocab_size=64, layers=2, hidden=32, heads=2, kv_heads=1, scale=8.0))
    hd = HSD([Level("draft", other, 2), Level("layer4", eng, 4)], [3], eos_ids=[2])
    shared = _share_calls(q4, monkeypatch)
    prompts, news = _prompts(3, seed=11), [30, 4, 4]
    want = [ar.generate(p, n).token_ids for p, n in zip(prompts, news)]
    for low, takes in ((h1, True), (hd, False)):
        shared.clear()
        batch = Batch({1: low, 3: ar}, max_active=3)
        got: dict[int, list[int]] = {}
        entries = [batch.add(p, n, on_done=lambda res, err, i=i: got.__setitem__(i, res.token_ids))
                   for i, (p, n) in enumerate(zip(prompts, news))]
        while len(batch.active) + len(batch.starting) > 1:
            batch.tick()
        for _ in range(3):
            batch.tick()
        first = entries[0].decoding
        drafter = next(lv.engine for lv in low.levels if lv.is_model)
        assert (first.hsd is low) is takes and (id(drafter) in first._states) is takes
        if takes:            # the copy took every position the target had computed when it joined
            assert len(shared) == 1 and shared[0] >= len(prompts[0]) + 4
        batch.run()
        assert [got[i] for i in range(3)] == want


def test_a_copy_left_behind_while_the_load_was_high_takes_the_targets_keys_and_values_again(tiny, monkeypatch):
    """A sequence started alone (with the copy) decodes with the target alone while two others are in flight, then
    alone again with the copy: the copy takes the target's keys and values of the positions it missed instead of
    computing them, so no pass of the copy computes more than a round's positions; the answer stays the
    target's."""
    eng = LayeredLM(tiny)
    h1, _, ar = _hierarchies(tiny, eng)
    q4 = h1.levels[1].engine
    shared, widest = _share_calls(q4, monkeypatch), [0]
    real_many = type(q4).advance_many

    def advance_many(self, parts):
        widest[0] = max([widest[0]] + [st.n - min(st.lens[:b]) for st, b in parts])
        return real_many(self, parts)

    monkeypatch.setattr(type(q4), "advance_many", advance_many)
    prompts = _prompts(3, seed=11)
    want = ar.generate(prompts[0], 60).token_ids
    batch = Batch({1: h1, 3: ar}, max_active=3)
    got: dict[str, list[int]] = {}
    lone = batch.add(prompts[0], 60, on_done=lambda res, err: got.__setitem__("lone", res.token_ids))
    batch.tick()
    batch.tick()
    assert lone.decoding.hsd is h1
    others = [batch.add(p, 20) for p in prompts[1:]]
    while any(e in batch.starting or e in batch.active for e in others):
        batch.tick()
    missed = len(lone.decoding.seq) - min(lone.decoding._states[id(q4)].lens)
    assert missed > 10                                   # the target alone decoded these, the copy none of them
    batch.run()
    assert got["lone"] == want and lone.decoding.hsd is h1
    # at the prefill (all but its last position), then again after the positions it missed
    assert len(shared) == 2 and shared[0] == len(prompts[0]) - 1 and shared[1] >= len(prompts[0]) + 10
    assert widest[0] <= 1 + 2 + 2                        # a round's own positions: lag, cycle's 2 drafts, the bonus

def test_a_long_prompt_is_prefilled_a_pass_per_tick_while_the_others_decode(tiny, monkeypatch):
    """Prompts first (``prefill_share`` 1): a prompt of 30 positions with passes of 8 takes 4 ticks to prefill, and
    a sequence already decoding commits a token in each of them (it does not wait for the whole prompt); both
    answers are their prompts' own, with the same passes alone."""
    _, ar, (short, long) = _chunked_ar(tiny, monkeypatch, 9, 5, 30)
    want = [ar.generate(short, 20).token_ids, ar.generate(long, 10).token_ids]
    batch = Batch(ar, max_active=2, prefill_share=1.0)            # prompts first: a prompt pass in every tick
    got: dict[int, list[int]] = {}
    blocks: list[list[int]] = []

    def first_tokens(toks):
        blocks.append(toks)

    batch.add(short, 20, on_tokens=first_tokens, on_done=lambda res, err: got.__setitem__(0, res.token_ids))
    batch.tick()                                    # the short prompt in one pass, and its first token
    second = batch.add(long, 10, on_done=lambda res, err: got.__setitem__(1, res.token_ids))
    before, ticks = len(blocks), 0
    while second in batch.waiting or second in batch.prefilling:
        batch.tick()
        ticks += 1
    assert ticks == 4 and len(blocks) - before == 4         # a token of the other sequence in every one of them
    batch.run()
    assert [got[0], got[1]] == want


def _priced_clock(eng, monkeypatch, events: list | None = None) -> list[float]:
    """From now on ``eng``'s calls advance a clock (returned, its one entry the seconds): a second per position of a
    call's longest row, a prompt's pass or a batched call; each call also appended to ``events`` as ``("prompt" |
    "decode", seconds)`` where given."""
    now = [0.0]
    real_advance, real_many = eng.advance, eng.advance_many

    def charge(kind: str, seconds: float) -> None:
        now[0] += seconds
        if events is not None:
            events.append((kind, seconds))

    def advance(st, upto):                      # returns positions computed, summed over layers
        out = real_advance(st, upto)
        charge("prompt", out / eng.n_layers)
        return out

    def advance_many(work):
        out = real_many(work)
        charge("decode", max(out) / eng.n_layers)
        return out

    monkeypatch.setattr(eng, "advance", advance)
    monkeypatch.setattr(eng, "advance_many", advance_many)
    return now


@pytest.mark.parametrize("share", [0.5, 0.25])
def test_while_others_decode_prompt_passes_take_at_most_their_share_of_the_time(tiny, monkeypatch, share):
    """On a clock where a call of the engine costs a second per position of its longest row, a long prompt (30
    positions, passes of 8) computed while another sequence decodes: after each of its passes the decoding sequence
    gets ``(1 - share) / share`` times that pass's seconds of decoding (at most a tick more) before the next pass
    (with ``share`` 1 it got one step per pass); the long prompt is still computed, and both answers are their
    prompts' own."""
    eng, ar, (short, long) = _chunked_ar(tiny, monkeypatch, 21, 5, 30)
    want = [ar.generate(short, 60).token_ids, ar.generate(long, 4).token_ids]
    events: list[tuple[str, float]] = []
    now = _priced_clock(eng, monkeypatch, events)
    batch = Batch(ar, max_active=2, prefill_share=share, clock=lambda: now[0])
    got: dict[int, list[int]] = {}
    batch.add(short, 60, on_done=lambda res, err: got.__setitem__(0, res.token_ids))
    batch.tick()
    events.clear()
    batch.add(long, 4, on_done=lambda res, err: got.__setitem__(1, res.token_ids))
    batch.run()
    assert [got[0], got[1]] == want
    prompts = [i for i, (kind, _) in enumerate(events) if kind == "prompt"]
    assert [events[i][1] for i in prompts] == [8, 8, 8]           # the fourth pass is the first round's (6 + 1)
    owed = (1 - share) / share
    for a, b in zip(prompts, prompts[1:]):
        decoded = sum(s for kind, s in events[a + 1:b])
        assert owed * events[a][1] <= decoded <= owed * events[a][1] + 1


@pytest.mark.parametrize("third_size", [6, 30])
def test_a_prompts_first_pass_is_not_held_for_the_decoding_sequences(tiny, monkeypatch, third_size):
    """While the decoding sequences are owed time after a long prompt's pass, a request that arrives takes its first
    pass in the next tick (a short one: its only pass, its first token waiting for no one; a long one: instead of
    the begun prompt's held pass), and every answer is its prompt's own."""
    eng, ar, (first, long, third) = _chunked_ar(tiny, monkeypatch, 23, 5, 30, third_size)
    now = _priced_clock(eng, monkeypatch)
    batch = Batch(ar, max_active=3, prefill_share=0.25, clock=lambda: now[0])
    got: dict[int, list[int]] = {}
    batch.add(first, 40, on_done=lambda res, err: got.__setitem__(0, res.token_ids))
    batch.tick()
    second = batch.add(long, 3, on_done=lambda res, err: got.__setitem__(1, res.token_ids))
    batch.tick()                                # the long prompt's first pass: 8 s, 24 s owed to the first one
    assert batch.share.owed > 0 and second.computed == 8
    entry = batch.add(third, 5, on_done=lambda res, err: got.__setitem__(2, res.token_ids))
    batch.tick()
    assert batch.share.owed > 0 and second.computed == 8
    assert entry in batch.active if third_size == 6 else entry.computed == 8
    batch.run()
    assert [got[0], got[1], got[2]] == [ar.generate(p, n).token_ids for p, n in ((first, 40), (long, 3), (third, 5))]


def test_a_stream_of_short_requests_does_not_hold_a_long_prompt(tiny, monkeypatch):
    """A short request every other tick beside a decoding sequence: their passes end their prompts and owe nothing,
    so a long prompt's passes wait only for what its own passes owe, and it is computed (its passes were held for
    ever, every short pass adding to what was owed)."""
    eng, _, (first, long, short) = _chunked_ar(tiny, monkeypatch, 29, 5, 60, 6)
    h1 = _hierarchies(tiny, eng)[0]             # a quantized copy beside the target: every prompt pass computed apart
    now = _priced_clock(eng, monkeypatch)
    batch = Batch(h1, max_active=8, prefill_share=0.5, clock=lambda: now[0])
    batch.add(first, 200)
    batch.tick()
    second = batch.add(long, 2)
    ticks = 0
    while second.first_token is None and ticks < 200:
        if ticks % 2 == 0:
            batch.add(short, 2)
        batch.tick()
        ticks += 1
    assert second.first_token is not None and ticks < 120, (ticks, second.computed, batch.share.owed)


def test_a_short_prompt_is_not_held_behind_a_long_one_s_passes(tiny, monkeypatch):
    """A short request that arrives while a long prompt is computed (passes of 8: 40 positions in 5 ticks) gets its
    first token in the tick after, not after the long prompt's remaining passes (it waited for all of them), and the
    long prompt resumes after it; two long prompts that arrive together are computed one after the other, in
    arrival order. Every answer is its prompt's own."""
    _, ar, (*longs, short) = _chunked_ar(tiny, monkeypatch, 11, 40, 40, 5)
    want = {"a": ar.generate(longs[0], 6).token_ids, "b": ar.generate(longs[1], 6).token_ids,
            "s": ar.generate(short, 6).token_ids}
    for burst in (False, True):
        batch = Batch(ar, max_active=4, prefill_share=1.0)
        got: dict[str, list[int]] = {}
        first: dict[str, int] = {}
        tick = 0

        def add(name, prompt):
            return batch.add(prompt, 6, on_tokens=lambda toks: first.setdefault(name, tick),
                             on_done=lambda res, err: got.__setitem__(name, res.token_ids))

        a = add("a", longs[0])
        b = add("b", longs[1]) if burst else None
        for tick in range(1, 3):
            batch.tick()
        assert a in batch.prefilling and (b is None or b in batch.waiting)     # the first come is computed first
        if not burst:
            add("s", short)
            tick = 3
            batch.tick()
            assert first == {"s": 3} and a in batch.prefilling                  # its first token at once
        while batch.busy:
            tick += 1
            batch.tick()
        assert (first["a"] < first["b"]) if burst else (first["s"] < first["a"] == 6)    # alone: 5
        assert got == {k: want[k] for k in got} and len(got) == 2



def test_an_unseeded_sample_follows_the_load_a_seeded_one_keeps_its_hierarchy(tiny):
    """Sampled sequences waiting together: one without a seed starts with the hierarchy of the load (here the
    target alone), one with a seed with the single-sequence hierarchy, and draws what it draws alone."""
    eng = LayeredLM(tiny)
    h1, _, ar = _hierarchies(tiny, eng)
    prompts = _prompts(3, seed=7)
    batch = Batch({1: h1, 3: ar}, max_active=3)
    got: dict[int, list[int]] = {}
    entries = [batch.add(p, 15, temperature=0.8, seed=s, on_done=lambda res, err, i=i: got.__setitem__(i, res))
               for i, (p, s) in enumerate(zip(prompts, [None, 9, None]))]
    assert [e.decoding.follows_load for e in entries] == [True, False, True]
    for _ in entries:                              # one prefill per tick
        batch.tick()
    assert [e.decoding.hsd for e in entries] == [ar, h1, ar]
    batch.run()
    assert got[1].token_ids == h1.generate(prompts[1], 15, temperature=0.8, seed=9).token_ids
    assert all(len(got[i].token_ids) >= 1 for i in (0, 2))
    with pytest.raises(HsdError, match="seeded"):
        entries[1].decoding.switch(ar)


def test_a_load_between_levels_runs_the_plan_of_the_nearest_level_on_a_log_scale(tiny):
    """Levels 1, 2, 4, 8: a load just under a level runs that level's plan (a client between two requests does
    not drop eight sequences to the plan of four), a load just over one runs that one's; past the ends, the end."""
    eng = LayeredLM(tiny)
    h1, h2, ar = _hierarchies(tiny, eng)
    batch = Batch({1: h1, 2: h2, 4: h2, 8: ar})
    levels = [1, 1, 2, 4, 4, 4, 8, 8, 8, 8, 8, 8]
    assert [batch.hierarchy_for(n) for n in range(0, 12)] == [batch.levels[k] for k in levels]
    assert batch.hierarchy_for(7) is ar and batch.hierarchy_for(5) is h2
    # the benchmarks price a load by the same rule, from a plan's levels in any order
    assert [nearest_level([8, 2, 4, 1], n) for n in range(0, 12)] == levels
    assert [nearest_level([2, 16], n) for n in (1, 5, 6, 40)] == [2, 2, 16, 16]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_first_token_is_the_targets_own_before_any_draft(tiny, temperature):
    """After the prefill a three-level hierarchy asks for one pass, on the target over the prompt's last position
    only, and commits that token alone: a request's first token waits for no drafting."""
    eng = LayeredLM(tiny)
    h1, _, ar = _hierarchies(tiny, eng)
    prompt = _prompts(1, seed=3)[0]
    d = h1.start(prompt, 12, temperature=temperature, seed=4)
    d.prefill()
    steps = d.steps()
    first = next(steps)
    assert isinstance(first, Pass) and first.engine is eng and first.boundary == 4
    assert (first.start, first.end) == (len(prompt) - 1, len(prompt))
    block = steps.send(serve(first))
    assert isinstance(block, Committed) and len(block.tokens) == 1
    if temperature == 0:
        assert block.tokens == ar.generate(prompt, 1).token_ids
    d.close()


@pytest.mark.parametrize("seed", range(8))
def test_random_schedules_keep_every_answer_its_own(tiny, seed):
    """Ten requests arriving at random ticks, with random prompt lengths, numbers of new tokens and places
    (``max_active`` 2 to 4), some asking to stop after a random block, some sampled with a seed, under a plan
    whose levels hold an exit, a quantized copy and a draft model of its own weights: every greedy answer is
    the target's own (one stopped early, the target's own up to where it stopped), every seeded sample is what it
    draws alone, every request ends once, and nothing is left in flight."""
    gen = torch.Generator().manual_seed(100 + seed)

    def rand(lo: int, hi: int) -> int:  # an int in [lo, hi]
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    eng = LayeredLM(tiny)
    h1, h2, ar = _hierarchies(tiny, eng)
    other = LayeredLM(make_tiny_llama(seed=8, vocab_size=64, layers=2, hidden=32, heads=2, kv_heads=1, scale=8.0))
    hd = HSD([Level("draft", other, 2), Level("layer4", eng, 4)], [3], eos_ids=[2])
    batch = Batch({1: h1, 2: hd, 3: h2, 5: ar}, max_active=rand(2, 4))
    n = 10
    prompts = _prompts(n, seed=200 + seed)
    news = [rand(1, 40) for _ in range(n)]
    kinds = [("greedy", "greedy", "greedy", "stop", "seeded")[rand(0, 4)] for _ in range(n)]
    stop_after = [rand(1, 3) for _ in range(n)]
    arrive = sorted(rand(0, 30) for _ in range(n))
    blocks: dict[int, list[list[int]]] = {i: [] for i in range(n)}
    done: dict[int, list] = {i: [] for i in range(n)}

    def on_tokens(i):
        def f(block):
            blocks[i].append(block)
            return kinds[i] == "stop" and len(blocks[i]) >= stop_after[i]
        return f

    tick = 0
    added = 0
    while added < n or batch.busy:
        while added < n and arrive[added] <= tick:
            i = added
            sampled = kinds[i] == "seeded"
            batch.add(prompts[i], news[i], temperature=0.8 if sampled else 0.0, top_p=0.9 if sampled else 1.0,
                      seed=7 + i if sampled else 0, on_tokens=on_tokens(i),
                      on_done=lambda res, err, i=i: done[i].append((res, err)))
            added += 1
        batch.tick()
        tick += 1
        assert tick < 10_000
    assert not batch.active and not batch.waiting and not batch.prefilling
    for i in range(n):
        assert len(done[i]) == 1 and done[i][0][1] is None, (i, done[i])
        got = done[i][0][0].token_ids
        assert got == [t for b in blocks[i] for t in b]
        if kinds[i] == "seeded":
            assert got == h1.generate(prompts[i], news[i], temperature=0.8, top_p=0.9, seed=7 + i).token_ids
            continue
        want = ar.generate(prompts[i], news[i]).token_ids
        if kinds[i] == "stop" and len(blocks[i]) >= stop_after[i]:
            assert got == want[:len(got)]
        else:
            assert got == want


def test_clear_removes_every_sequence_and_closes_its_decoding(tiny):
    """What the server does after a failed tick: every sequence out (decoding, being prefilled, waiting), each
    decoding closed, the batch idle and ready for new ones."""
    eng = LayeredLM(tiny)
    batch = Batch(HSD([Level("layer4", eng, 4)], []), max_active=2)
    entries = [batch.add([5, 6, 7, 8], 6) for _ in range(4)]
    batch.tick()
    batch.tick()
    assert batch.in_flight >= 1 and batch.queued >= 1
    out = batch.clear()
    assert sorted(map(id, out)) == sorted(map(id, entries)) and not batch.busy and batch.queued == 0
    again = batch.add([5, 6, 7, 8], 3)
    batch.run()
    assert again.decoding.result().token_ids and len(again.decoding.result().token_ids) == 3


def test_a_switched_sequence_reports_its_last_hierarchys_levels_bottom_first_and_each_verifiers_acceptance(tiny):
    """A sequence that starts on the target alone and takes a deeper hierarchy after some tokens (following the
    load) lists its counters with the last hierarchy's levels bottom first, then the levels it ran only before; the
    server's ``acceptance`` names the levels that checked drafts, never the bottom drafter."""
    from hsd_opt.server.responses import acceptance

    eng = LayeredLM(tiny)
    h1, h2, ar = _hierarchies(tiny, eng)
    d = ar.start(_prompts(1, seed=5)[0], 24, temperature=0.0)
    seen = []

    def on_pass(p):
        seen.append(p)
        if len(seen) == 4:
            d.switch(h1)

    res = d.run(on_pass=on_pass)
    names = [lv["name"] for lv in res.stats["levels"]]
    assert res.stats["hierarchy"] == ["cycle", "q4", "layer4"] and names == ["cycle", "q4", "layer4"]
    acc = acceptance(res.stats["hierarchy"], res.stats["levels"])
    assert set(acc) == {"q4", "layer4"} and acc["layer4"] is not None
    d = h2.start(_prompts(1, seed=6)[0], 24, temperature=0.0)
    seen.clear()

    def to_ar(p):
        seen.append(p)
        if len(seen) == 6:
            d.switch(ar)

    res = d.run(on_pass=to_ar)
    assert [lv["name"] for lv in res.stats["levels"]] == ["layer4", "layer2"]
    assert set(acceptance(res.stats["hierarchy"], res.stats["levels"])) == {"layer4"}


def _drive(d) -> None:
    """Run a decoding's steps to the end, every pass served alone."""
    steps = d.steps()
    try:
        item = next(steps)
        while True:
            item = steps.send(serve(item) if isinstance(item, Pass) else None)
    except StopIteration:
        pass


def test_a_decoding_runs_in_its_order_prefill_once_steps_then_close(tiny):
    """A second ``prefill`` added the prompt again, and its result was the prompt as the generated answer;
    ``steps`` before ``prefill`` failed deep in torch, and after ``close`` took fresh states and kept them."""
    eng = LayeredLM(tiny)
    h1, _, ar = _hierarchies(tiny, eng)
    prompt = _prompts(1, seed=5)[0]
    d = h1.start(prompt, 6)
    with pytest.raises(HsdError, match="call prefill"):
        next(d.steps())
    d.prefill()
    with pytest.raises(HsdError, match="prefills once"):
        d.prefill()
    with pytest.raises(HsdError, match="switch: expected an HSD"):
        d.switch("ar")
    _drive(d)
    assert d.result().token_ids == ar.generate(prompt, 6).token_ids
    d.close()
    d.close()                                      # again: nothing
    with pytest.raises(HsdError, match="closed"):
        next(d.steps())
    assert d._states == {}


def test_batch_and_generate_many_refuse_arguments_of_another_form_naming_them(tiny):
    eng = LayeredLM(tiny)
    h1, h2, ar = _hierarchies(tiny, eng)
    for kw, said in (({"hierarchies": {1: "h1"}}, "hierarchies: expected an HSD or a mapping"),
                     ({"hierarchies": {"a": h1}}, "hierarchies: expected an HSD or a mapping"),
                     ({"hierarchies": [h1, ar]}, "hierarchies: expected an HSD or a mapping"),
                     ({"hierarchies": {0: h1}}, "hierarchies: expected an HSD or a mapping"),
                     ({"by_task": [h1]}, "by_task: expected a mapping"),
                     ({"by_task": {"json": "x"}}, "by_task['json']: expected an HSD or a mapping"),
                     ({"seeded": "h1"}, "seeded: expected an HSD or None"),
                     ({"max_active": None}, "--max-batch: expected >= 1"),
                     ({"max_wait": "x"}, "max_wait: expected None or an integer >= 0")):
        with pytest.raises(HsdError) as e:
            Batch(**{"hierarchies": h1, **kw})
        assert str(e.value).startswith(said), str(e.value)
    prompts = _prompts(3, seed=2)
    with pytest.raises(HsdError, match="seeds: expected a list, one per prompt, got int"):
        generate_many(h1, prompts, 4, temperature=1.0, seeds=5)
    with pytest.raises(HsdError, match="prompts: expected a list of token id lists, got generator"):
        generate_many(h1, (p for p in prompts), 4)


def test_load_levels_are_built_over_one_plans_models():
    """``hsd_by_load`` without the :class:`PlanModels` gave each level engines of its own (a second copy of every
    model, and a batch that refused them as another target)."""
    from hsd_opt.runtime.runner import hsd_by_load

    with pytest.raises(HsdError, match="models: expected the PlanModels"):
        hsd_by_load(None, None, None)
