"""``hsd bench --concurrency`` underneath: closed-loop clients against the batch scheduler send every request, each
client's next only after its previous answer, and every greedy answer is the target's own; the figures of a level
are computed from the requests' times as documented; bad client counts are refused naming the flag."""

from __future__ import annotations

import pytest
import torch

from hsd_opt.engine import kernels
from hsd_opt.engine.layered import LayeredLM
from hsd_opt.errors import HsdError
from hsd_opt.measure.bench import Sampling
from hsd_opt.measure.load_bench import Request, level_figures, serve_clients
from hsd_opt.measure.methods import parse_concurrency
from hsd_opt.runtime.decode import HSD, Level
from tests.helpers import CycleDrafter, make_tiny_llama

HAVE_KERNELS = kernels.load() is not None


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama(seed=5, vocab_size=64, layers=4, hidden=64, heads=4, kv_heads=2, scale=8.0)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, 64, (int(torch.randint(2, 25, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("max_batch", [1, 2, 8])
def test_clients_send_in_a_closed_loop_and_get_the_targets_answers(tiny, max_batch):
    """3 clients x 3 requests over 4 prompts (from prompt 2 on), a three-level plan at one sequence and the target
    alone from two: 9 requests, client i's k-th on prompt (2 + 3i + k) mod 4, each submitted after its client's
    previous one ended, first tokens between submission and end, every answer the target's greedy answer."""
    eng = LayeredLM(tiny, kernels=HAVE_KERNELS)
    plan = HSD([Level("cycle", drafter=CycleDrafter(64)), Level("layer2", eng, 2), Level("layer4", eng, 4)],
               [2, 3], eos_ids=[2])
    ar = HSD([Level("layer4", eng, 4)], [], eos_ids=[2])
    prompts = _prompts(4)
    reqs = serve_clients({1: plan, 2: ar}, prompts, clients=3, requests=3, max_new_tokens=12, max_batch=max_batch,
                         start=2)
    assert len(reqs) == 9
    assert sorted(r.prompt for r in reqs) == sorted((2 + 3 * i + k) % 4 for i in range(3) for k in range(3))
    assert [r.prompt for r in reqs[:3]] == [2, 1, 0]            # the three first requests, all at once
    for r in reqs:
        assert r.submitted <= r.first <= r.ended
        assert r.token_ids == ar.generate(prompts[r.prompt], 12).token_ids
    assert max(r.submitted for r in reqs[:3]) <= min(r.submitted for r in reqs[3:])
    for client in range(3):                                    # each client's next waits for its answer
        own = [r for r in reqs if r.client == client]
        assert [r.prompt for r in own] == [(2 + 3 * client + k) % 4 for k in range(3)]
        assert all(b.submitted >= a.ended for a, b in zip(own, own[1:]))


def test_sampled_clients_sample_with_the_filters(tiny):
    """Sampled requests (unseeded) draw: at temperature 4 some answer differs from the target's greedy one (a load
    bench that sent greedy requests fails this); with top-k 1 at the same temperature every answer is the greedy
    one (a load bench that dropped the filters fails that); every request is served either way."""
    eng = LayeredLM(tiny, kernels=HAVE_KERNELS)
    plan = HSD([Level("cycle", drafter=CycleDrafter(64)), Level("layer4", eng, 4)], [2], eos_ids=[2])
    ar = HSD([Level("layer4", eng, 4)], [], eos_ids=[2])
    prompts = _prompts(4)
    greedy = {j: ar.generate(p, 12).token_ids for j, p in enumerate(prompts)}
    hot = serve_clients({1: plan, 2: ar}, prompts, clients=2, requests=4, max_new_tokens=12, max_batch=2,
                        sampling=Sampling(4.0))
    assert len(hot) == 8 and all(r.token_ids for r in hot)
    assert any(r.token_ids != greedy[r.prompt] for r in hot)
    top1 = serve_clients({1: plan, 2: ar}, prompts, clients=2, requests=4, max_new_tokens=12, max_batch=2,
                         sampling=Sampling(4.0, top_k=1))
    assert [r.token_ids for r in top1] == [greedy[r.prompt] for r in top1]


def test_level_figures_from_request_times():
    """Aggregate = tokens / (last end - first submission); TTFT percentiles linear between order statistics;
    per-stream rate = tokens after the first over (end - first); equality against the reference per prompt."""
    reqs = [Request(0, 0, 0.0, 0.5, 2.5, [1, 2, 3, 4, 5]), Request(1, 1, 0.0, 1.0, 2.0, [7, 8, 9]),
            Request(0, 0, 2.5, 3.0, 4.0, [1, 2, 3, 4, 5])]
    f = level_figures(reqs, {0: [1, 2, 3, 4, 5], 1: [7, 8, 9]})
    assert f["tokens"] == 13 and f["wall_seconds"] == 4.0 and f["aggregate_tokens_per_s"] == 13 / 4.0
    assert f["ttft_p50_s"] == 0.5 and f["ttft_p95_s"] == pytest.approx(0.5 + 0.5 * 0.9)
    assert f["stream_tokens_per_s_p50"] == 2.0               # rates 4 / 2, 2 / 1, 4 / 1: 2, 2, 4
    assert f["equal_to_target"] is True
    assert level_figures(reqs, {0: [1, 2, 3, 4, 5], 1: [7, 8]})["equal_to_target"] is False
    assert level_figures(reqs)["equal_to_target"] is None


@pytest.mark.parametrize("text,needle", [("", "client counts like"), ("1,x", "'x'"), ("2,0", ">= 1, got 0"),
                                         (" , ", "client counts like")])
def test_bad_client_counts_are_refused_naming_the_flag(text, needle):
    with pytest.raises(HsdError, match="--concurrency") as e:
        parse_concurrency(text)
    assert needle in str(e.value)
    assert parse_concurrency("1, 2,2,8") == [1, 2, 8]
