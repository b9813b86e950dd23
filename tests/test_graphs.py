"""Passes replayed from recordings (:mod:`hsd_opt.engine.graphs`), run on a CPU with the recorder that calls a pass
again into the same buffers (the CUDA graph recorder needs a GPU: ``benchmarks/gpu_scale.py`` runs it there).

Properties: a replayed pass computes bit for bit what the same fixed-shape pass computes op by op (hidden states,
keys and values, logits), one recording serving passes of every size with the same attention lengths; a hierarchy
over an engine that replays gives the target's own greedy output token for token (lossless), and its recordings
go with their decode states.
"""

from __future__ import annotations

import gc

import pytest
import torch

from hsd_opt.engine import graphs
from hsd_opt.engine.layered import LayeredLM
from hsd_opt.models.random_weights import random_model
from hsd_opt.runtime.decode import HSD, Level
from tests.helpers import make_tiny_llama


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama()


def _pair(model):
    """An engine on the torch path computing fixed-shape passes op by op, and one replaying them."""
    eager, replayed = LayeredLM(model, kernels=False), LayeredLM(model, kernels=False)
    eager.fix_shapes()
    replayed.replay_passes(graphs.calls_again)
    assert replayed.fixed_shapes
    return eager, replayed


def test_a_replayed_pass_computes_what_the_pass_computes(model):
    eager, replayed = _pair(model)
    L = eager.n_layers
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, eager.vocab_size, (9,), generator=g)
    sa, sb = eager.new_state(300, save_boundaries=[1, 2]), replayed.new_state(300, save_boundaries=[1, 2])
    for eng, st in ((eager, sa), (replayed, sb)):
        eng.append(st, prompt)
        eng.advance(st, L)
    assert replayed._graphs.recorded == 0                       # a prompt's pass runs op by op
    for m, upto in ((1, L), (3, 2), (2, L), (5, L), (1, 1), (3, L), (1, L)):   # runs from 0, frontiers, exits
        ids = torch.randint(3, eager.vocab_size, (m,), generator=g)
        for eng, st in ((eager, sa), (replayed, sb)):
            eng.append(st, ids)
            eng.advance(st, upto)
        for b in {1, 2, upto}:
            end = sa.lens[b - 1]
            assert sb.lens == sa.lens and torch.equal(sb.resid[b][:end], sa.resid[b][:end])
            assert torch.equal(replayed.logits(sb, b, end - 1, end), eager.logits(sa, b, end - 1, end))
        for l in range(L):
            n = sa.lens[l]
            assert torch.equal(sb.k[l][:, :, :n], sa.k[l][:, :, :n])
            assert torch.equal(sb.v[l][:, :, :n], sa.v[l][:, :, :n])
    # one recording per run of layers (cut at the boundaries kept: 0-1, 1-2, 2-L) and attention length, whatever
    # the pass's size
    assert replayed._graphs.recorded == 3
    before = replayed._graphs.recorded
    for eng, st in ((eager, sa), (replayed, sb)):
        eng.append(st, torch.tensor([7, 8, 9, 10]))
        eng.advance(st, L)
    assert replayed._graphs.recorded == before
    assert torch.equal(sb.resid[L][:sb.n], sa.resid[L][:sa.n])
    # a pass straddling an attention length is a recording of its own (per run of layers), then steps past it
    # another
    n = sa.n
    ids = torch.randint(3, eager.vocab_size, (256 - n + 2,), generator=g)
    for eng, st in ((eager, sa), (replayed, sb)):
        eng.append(st, ids[:-3])
        eng.advance(st, L)             # up to position 254: a pass longer than ROWS, op by op
        eng.append(st, ids[-3:])
        eng.advance(st, L)             # 255, 256, 257: over 256, then 512 positions
        eng.append(st, [11])
        eng.advance(st, L)
    assert torch.equal(sb.resid[L][:sb.n], sa.resid[L][:sa.n])
    assert replayed._graphs.recorded == before + 2 * 3


def test_a_hierarchy_over_replayed_passes_gives_the_target_s_own_output(model):
    """Greedy HSD with an exit drafting for the model's head, each over an engine that replays: the target's own
    greedy tokens, and the same as the op-by-op engine's; every recording is dropped with its state."""
    eager, replayed = _pair(model)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        p = torch.randint(3, eager.vocab_size, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        want = HSD([Level("layer4", eager, 4)], []).generate(p, 30).token_ids
        assert HSD([Level("layer4", replayed, 4)], []).generate(p, 30).token_ids == want
        hsd = HSD([Level("layer1", replayed, 1), Level("layer2", replayed, 2), Level("layer4", replayed, 4)], [3, 2])
        assert hsd.generate(p, 30).token_ids == want
    del hsd
    gc.collect()
    assert replayed._graphs.recorded > 0 and not replayed._graphs._by_state


def test_bfloat16_passes_replay_bit_for_bit_and_stay_lossless():
    """A bfloat16 model (the dtype on a GPU): a replayed pass is the op-by-op fixed-shape pass bit for bit, and a
    hierarchy over the replaying engine gives the target's own greedy tokens."""
    from hsd_opt.models.random_weights import TINY

    model = random_model(TINY, "cpu", torch.bfloat16)
    eager, replayed = _pair(model)
    p = list(range(3, 15))
    sa, sb = eager.new_state(40), replayed.new_state(40)
    for eng, st in ((eager, sa), (replayed, sb)):
        eng.append(st, p)
        eng.advance(st, 4)
        eng.append(st, [20, 21])
        eng.advance(st, 4)
    assert replayed._graphs.recorded == 1 and torch.equal(sa.resid[4][12:14], sb.resid[4][12:14])
    want = HSD([Level("t", replayed, 4)], []).generate(p, 24).token_ids
    assert HSD([Level("t", eager, 4)], []).generate(p, 24).token_ids == want
    assert HSD([Level("l2", replayed, 2), Level("t", replayed, 4)], [3]).generate(p, 24).token_ids == want


def _failing(fn):
    raise RuntimeError("operation not permitted when stream is capturing")


def test_a_pass_that_cannot_be_recorded_is_computed_op_by_op(model):
    """A recording that fails is said once; the engine then computes every pass op by op: the same numbers."""
    eager, replayed = _pair(model)
    replayed.replay_passes(_failing)
    p = list(range(3, 15))
    want = HSD([Level("l2", eager, 2), Level("t", eager, 4)], [3]).generate(p, 20).token_ids
    with pytest.warns(RuntimeWarning, match="recording a pass failed .*operation not permitted") as said:
        got = HSD([Level("l2", replayed, 2), Level("t", replayed, 4)], [3]).generate(p, 20).token_ids
    assert got == want and len(said) == 1 and replayed._graphs.failed.startswith("operation not permitted")


def test_a_state_keeps_its_most_recent_recordings(model, monkeypatch):
    monkeypatch.setattr(graphs, "KEPT", 2)
    eager, replayed = _pair(model)
    sa, sb = eager.new_state(40, save_boundaries=[1, 2]), replayed.new_state(40, save_boundaries=[1, 2])
    for i in range(4):   # each step runs layers 0-1, 1-2 and 2-4: three recordings, two kept
        for eng, st in ((eager, sa), (replayed, sb)):
            eng.append(st, [3 + i] if i else [3, 4, 5])
            eng.advance(st, eng.n_layers)
        assert len(replayed._graphs._by_state.get(id(sb), {})) <= 2
    assert replayed._graphs.recorded == 3 * 3       # the evicted ones recorded again at each step after the prompt
    assert torch.equal(sa.resid[4][:sa.n], sb.resid[4][:sb.n])


def test_doctor_says_how_the_torch_path_runs_on_cuda(monkeypatch):
    """``hsd doctor``'s CUDA line follows the settings an engine built now would take."""
    from hsd_opt.commands.doctor import cuda_line

    monkeypatch.delenv("HSD_CUDA_GRAPHS", raising=False)
    monkeypatch.delenv("HSD_FIXED_SHAPES", raising=False)
    monkeypatch.delenv("HSD_COMPILE", raising=False)
    monkeypatch.delenv("HSD_TRITON_ATTENTION", raising=False)
    monkeypatch.setenv("HSD_WEIGHT_ONLY", "1")
    line = cuda_line()
    assert "fixed shapes on (HSD_FIXED_SHAPES=0 turns it off)" in line
    assert "layers compiled off (HSD_COMPILE=1 turns it on)" in line
    assert "CUDA graphs off (HSD_CUDA_GRAPHS=1 turns it on)" in line
    assert "Triton kernels off (HSD_TRITON_ATTENTION=1 turns it on)" in line
    assert "codes on (HSD_WEIGHT_ONLY=0 turns it off)" in line
