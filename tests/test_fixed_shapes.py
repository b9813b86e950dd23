"""Fixed-shape passes of the torch path (:mod:`hsd_opt.engine.fixed`), run on a CPU.

Properties: with fixed shapes a verify pass over ``m`` positions gives, bit for bit, the hidden states, keys,
values and logits of ``m`` decode steps (float32 and bfloat16, a pass straddling an attention length too); the
rows of several sequences in one pass give each sequence what it gets alone; greedy speculative decoding over a
bfloat16 model whose logits are not peaked gives the target's own greedy tokens (near-ties are common there: the
torch path at each pass's own shapes gives other tokens than the target's own in 5 of these 12 generations, as
measured when this test was written); the helpers round and group as documented.
"""

from __future__ import annotations

import pytest
import torch

from hsd_opt.engine import fixed
from hsd_opt.engine.layered import LayeredLM, torch_path_settings
from hsd_opt.models.random_weights import TINY, random_model
from hsd_opt.runtime.decode import HSD, Level
from tests.helpers import steps_pass_and_reference, stepwise_greedy


def _fixed_engine(dtype: torch.dtype, peak: float = 1.0, seed: int = 0) -> LayeredLM:
    eng = LayeredLM(random_model(TINY, "cpu", dtype, peak=peak, seed=seed), kernels=False)
    eng.fix_shapes()
    return eng


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verify_pass_computes_what_its_steps_compute(dtype):
    eng = _fixed_engine(dtype)
    L = eng.n_layers
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, eng.vocab_size, (250,), generator=g)
    steps, passes = eng.new_state(300, save_boundaries=[2]), eng.new_state(300, save_boundaries=[2])
    assert steps.max_len == 512                                    # rounded up to the attention length
    for st in (steps, passes):
        eng.append(st, prompt)
        eng.advance(st, L)
    for m in (1, 3, 8, 2):   # the last pass ends at 263: it straddles position 256's attention length
        ids = torch.randint(3, eng.vocab_size, (m,), generator=g)
        start = passes.n
        for t in ids:
            eng.append(steps, t.reshape(1))
            eng.advance(steps, L)
        eng.append(passes, ids)
        eng.advance(passes, L)
        end = passes.n
        for b in (2, L):
            assert torch.equal(eng.logits(steps, b, start, end), eng.logits(passes, b, start, end))
        assert torch.equal(steps.resid[2][:end], passes.resid[2][:end])
        for l in range(L):
            assert torch.equal(steps.k[l][:, :, :end], passes.k[l][:, :, :end])
            assert torch.equal(steps.v[l][:, :, :end], passes.v[l][:, :, :end])


def test_several_sequences_in_one_pass_each_get_what_they_get_alone():
    """Sequences of different lengths, pass sizes and exits through ``advance_many`` (their rows in fixed-shape
    passes of at most ROWS rows: here 70 rows in all, so two passes) against each through ``advance``."""
    eng = _fixed_engine(torch.bfloat16)
    L = eng.n_layers
    g = torch.Generator().manual_seed(2)
    sizes, ends = [1, 5, 30, 2, 32], [L, 2, L, L, 1]
    alone, together = [], []
    for i, m in enumerate(sizes):
        prompt = torch.randint(3, eng.vocab_size, (5 + 60 * i,), generator=g)
        ids = torch.randint(3, eng.vocab_size, (m,), generator=g)
        pair = [eng.new_state(400, save_boundaries=[1, 2]) for _ in range(2)]
        for st in pair:
            eng.append(st, prompt)
            eng.advance(st, L)
            eng.append(st, ids)
        eng.advance(pair[0], ends[i])
        alone.append(pair[0])
        together.append(pair[1])
    eng.advance_many(list(zip(together, ends)))
    for a, b, e in zip(alone, together, ends):
        assert a.lens == b.lens
        assert torch.equal(eng.logits(a, e, 0, a.n), eng.logits(b, e, 0, b.n))
        for l in range(e):
            assert torch.equal(a.k[l][:, :, :a.n], b.k[l][:, :, :a.n])
    # the heads read together (rows of several reads in one head over ROWS rows): each read's logits as alone
    reads = [(st, e, st.n - m, st.n) for st, e, m in zip(together, ends, sizes)] + [(together[0], 1, 3, 5),
                                                                                    (together[2], L, 0, 80)]
    for got, (st, e, s0, s1) in zip(eng.logits_many(reads), reads):
        assert torch.equal(got, eng.logits(st, e, s0, s1))
    assert [t.tolist() for t in eng.greedy_ids_many(reads)] == [eng.logits(*r).argmax(-1).tolist() for r in reads]


def test_greedy_hierarchies_give_the_target_s_own_tokens_at_near_ties():
    eng = _fixed_engine(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        p = torch.randint(3, eng.vocab_size, (8,), generator=g).tolist()
        want = stepwise_greedy(eng, p, 40)
        assert HSD([Level("t", eng, 4)], []).generate(p, 40).token_ids == want
        assert HSD([Level("l1", eng, 1), Level("t", eng, 4)], [5]).generate(p, 40).token_ids == want
        assert HSD([Level("l1", eng, 1), Level("l2", eng, 2), Level("t", eng, 4)], [2, 3]).generate(
            p, 40).token_ids == want


def test_positions_lengths_and_groups():
    assert [fixed.attended(p) for p in (0, 255, 256, 600)] == [256, 256, 512, 768]
    assert [fixed.capacity(n) for n in (1, 256, 257)] == [256, 256, 512]
    assert fixed.positions(10, 3, "cpu").tolist() == [10, 11, 12] + [12] * (fixed.ROWS - 3)
    assert fixed.takes(5, 1) and fixed.takes(10, fixed.ROWS, prompt=10)
    assert not fixed.takes(0, 4) and not fixed.takes(6, 4, prompt=10) and not fixed.takes(5, fixed.ROWS + 1)
    assert fixed.fill([7, 8, 9, 10], [30, 30, 10, 64]) == [[7, 8], [9], [10]]
    x = torch.arange(6.0).reshape(3, 2)
    assert fixed.pad(x, 0).shape == (fixed.ROWS, 2) and torch.equal(fixed.pad(x, 0)[-1], x[-1])


def test_the_setting_and_engines_it_applies_to(monkeypatch):
    """Fixed shapes are on by default for engines built on CUDA (``HSD_FIXED_SHAPES=0`` turns them off), on a
    CPU's torch path only with ``HSD_FIXED_SHAPES=1``; an engine on the kernels (exact at any pass size already)
    ignores them and keeps its states' sizes."""
    monkeypatch.delenv("HSD_FIXED_SHAPES", raising=False)
    assert torch_path_settings()["fixed_shapes"]
    monkeypatch.setenv("HSD_FIXED_SHAPES", "0")
    assert not torch_path_settings()["fixed_shapes"]
    plain = LayeredLM(random_model(TINY, "cpu", torch.float32), kernels=False)
    assert not plain.fixed_shapes and plain.new_state(40).max_len == 40       # a CPU engine: off unless asked
    monkeypatch.setenv("HSD_FIXED_SHAPES", "1")
    assert LayeredLM(plain.model, kernels=False).fixed_shapes
    monkeypatch.setenv("HSD_FIXED_SHAPES", "0")
    early = plain.new_state(40)
    plain.fix_shapes()
    for st in (early, plain.new_state(40)):       # a state made before computes at its passes' own shapes
        plain.append(st, [3, 4, 5])
        plain.advance(st, plain.n_layers)
        plain.append(st, [6, 7])
        plain.advance(st, plain.n_layers)
    assert early.max_len == 40 and st.max_len == fixed.BLOCK
    assert torch.allclose(plain.logits(early, 4, 3, 5), plain.logits(st, 4, 3, 5), atol=1e-4)
    on_kernels = LayeredLM(random_model(TINY, "cpu", torch.float32))
    if on_kernels.uses_kernels:
        on_kernels.fix_shapes()
        assert not on_kernels.fixed_shapes and on_kernels.new_state(40).max_len == 40


def test_the_batch_scheduler_gives_each_prompt_what_it_gets_alone():
    """Served together (the batch scheduler: a prompt's last pass left to the first round's pass, the sequences'
    steps in shared passes), each prompt's greedy tokens are those ``HSD.generate`` gives it alone, over a bfloat16
    model with fixed shapes, for the target alone and for a hierarchy of exits."""
    from hsd_opt.runtime.batch import generate_many

    eng = _fixed_engine(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, eng.vocab_size, (n,), generator=g).tolist() for n in (5, 40, 9, 300, 17, 70)]
    for hsd in (HSD([Level("t", eng, 4)], []), HSD([Level("l1", eng, 1), Level("l2", eng, 2), Level("t", eng, 4)],
                                                    [2, 3])):
        alone = [hsd.generate(p, 24).token_ids for p in prompts]
        together = generate_many(hsd, prompts, 24, max_active=4)
        assert [r.token_ids for r in together] == alone


def test_compiled_layers_keep_every_pass_at_its_steps_numbers():
    """Fixed-shape passes compiled (``torch.compile``, here its CPU code): a verify pass still gives its steps'
    logits bit for bit and a batch's step each sequence's own; the compiled layers compute the same function as op
    by op (within bfloat16's rounding); greedy hierarchies give the compiled target's own tokens."""
    eng = _fixed_engine(torch.bfloat16)
    plain = _fixed_engine(torch.bfloat16)
    assert eng.compile_layers() and eng.compiled and not plain.compiled
    L = eng.n_layers
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, eng.vocab_size, (n,), generator=g) for n in (12, 30, 7)]
    ids = torch.randint(3, eng.vocab_size, (6,), generator=g)
    steps, one, ref = steps_pass_and_reference(eng, plain, prompts[0], ids, 64)
    got = eng.logits(one, L, 12, 18)
    assert torch.equal(eng.logits(steps, L, 12, 18), got)
    want = plain.logits(ref, L, 12, 18)
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    many, solo = [eng.new_state(64) for _ in prompts], [eng.new_state(64) for _ in prompts]
    for p, a, b in zip(prompts, many, solo):
        for st in (a, b):
            eng.append(st, p)
            eng.advance(st, L)
            eng.append(st, ids[:2])
        eng.advance(b, L)
    eng.advance_many([(st, L) for st in many])
    for a, b in zip(many, solo):
        assert torch.equal(eng.logits(a, L, a.n - 2, a.n), eng.logits(b, L, b.n - 2, b.n))
    p = prompts[1].tolist()
    want = HSD([Level("t", eng, 4)], []).generate(p, 24).token_ids
    assert HSD([Level("l1", eng, 1), Level("l2", eng, 2), Level("t", eng, 4)], [2, 3]).generate(p, 24).token_ids == want
