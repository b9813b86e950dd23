"""Passes replayed from recordings (:mod:`hsd_opt.engine.graphs`), run on a CPU with the recorder that calls a pass
again into the same buffers (the CUDA graph recorder needs a GPU: ``benchmarks/gpu_scale.py`` runs it there).

Properties: a replayed pass computes what the pass computes op by op, to the attention's summation order (the
same greedy tokens; the same keys and values in the cache); a hierarchy over an engine that replays gives the
target's own greedy output token for token (lossless), and its recordings go with their decode states.
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
    """An engine on the torch path op by op, and one replaying its passes."""
    eager, replayed = LayeredLM(model, kernels=False), LayeredLM(model, kernels=False)
    replayed.replay_passes(graphs.calls_again)
    return eager, replayed


def test_a_replayed_pass_computes_what_the_pass_computes(model):
    eager, replayed = _pair(model)
    L = eager.n_layers
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, eager.vocab_size, (9,), generator=g)
    sa, sb = eager.new_state(64, save_boundaries=[1, 2]), replayed.new_state(64, save_boundaries=[1, 2])
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
            assert sb.lens == sa.lens and torch.allclose(sb.resid[b][:end], sa.resid[b][:end], atol=1e-5)
            assert torch.equal(replayed.greedy_ids(sb, b, end - 1, end), eager.greedy_ids(sa, b, end - 1, end))
        for l in range(L):
            n = sa.lens[l]
            assert torch.allclose(sb.k[l][:, :, :n], sa.k[l][:, :, :n], atol=1e-5)
    assert replayed._graphs.recorded >= 4
    # the same run, size and state again replays its recording: no new one
    before = replayed._graphs.recorded
    for eng, st in ((eager, sa), (replayed, sb)):
        eng.append(st, torch.tensor([7]))
        eng.advance(st, L)
    assert replayed._graphs.recorded == before
    assert torch.allclose(sb.resid[L][:sb.n], sa.resid[L][:sa.n], atol=1e-5)


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


def test_bfloat16_passes_replay_within_its_rounding_and_stay_lossless():
    """A bfloat16 model (the dtype on a GPU): a replayed step's hidden state is the op-by-op one's within
    bfloat16's rounding (the attention sums in another order, so a near-tie may go the other way: the replaying
    engine is a target of its own), and a hierarchy over the replaying engine gives its own greedy tokens."""
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
    a, b = sa.resid[4][12:14].float(), sb.resid[4][12:14].float()
    assert replayed._graphs.recorded == 1 and (a - b).abs().max() <= 0.02 * a.abs().max()
    want = HSD([Level("t", replayed, 4)], []).generate(p, 24).token_ids
    assert HSD([Level("l2", replayed, 2), Level("t", replayed, 4)], [3]).generate(p, 24).token_ids == want


def test_only_continuing_passes_of_bounded_size_replay():
    assert graphs.GraphedPasses.takes(5, 1) and graphs.GraphedPasses.takes(1, graphs.MAX_POSITIONS)
    assert not graphs.GraphedPasses.takes(0, 4)                        # a prompt from position 0
    assert not graphs.GraphedPasses.takes(6, 4, prompt=10)             # the rest of a prompt after its head
    assert graphs.GraphedPasses.takes(10, 4, prompt=10)
    assert not graphs.GraphedPasses.takes(5, graphs.MAX_POSITIONS + 1)


def test_doctor_says_how_the_torch_path_runs_on_cuda(monkeypatch):
    """``hsd doctor``'s CUDA line follows the settings an engine built now would take."""
    from hsd_opt.commands.doctor import cuda_line

    monkeypatch.delenv("HSD_CUDA_GRAPHS", raising=False)
    monkeypatch.setenv("HSD_WEIGHT_ONLY", "1")
    line = cuda_line()
    assert "CUDA graphs off (HSD_CUDA_GRAPHS=1 turns it on)" in line
    assert "codes on (HSD_WEIGHT_ONLY=0 turns it off)" in line
