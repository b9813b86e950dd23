"""A served load's time predicted (``hsd_opt.measure.load_predictor``): it makes the batch scheduler's ticks,
sequence count by sequence count; each tick is priced as documented (decode at the batch size, a prompt's passes
on its cost curve, a shared prompt at one position); one request alone costs its prompt plus its tokens."""

from __future__ import annotations

import math

import pytest
import torch

from hsd_opt.engine import kernels
from hsd_opt.engine.layered import LayeredLM
from hsd_opt.engine.quantized import QuantizedLM
from hsd_opt.errors import HsdError
from hsd_opt.formats import profile_from_dict
from hsd_opt.measure.load_bench import serve_clients
from hsd_opt.measure.load_predictor import (
    Job,
    LoadCosts,
    LoadPredictor,
    Spec,
    predict_level,
    spec_of,
    time_prompt_passes,
)
from hsd_opt.runtime import decode
from hsd_opt.runtime.batch import Batch
from hsd_opt.runtime.decode import HSD, Level
from hsd_opt.solver.api import evaluate
from hsd_opt.solver.batch import at_batch
from tests.helpers import CycleDrafter, make_tiny_llama

HAVE_KERNELS = kernels.load() is not None


def _profile(batch: bool = True):
    """A target ``t`` and a copy ``q``: costs over t = 1..4 positions, batch ratios at 2 and 4 sequences."""
    d = {"format": "hsd-profile/1", "target": "t",
         "models": [{"name": "q", "kind": "quantized", "cost": 0.004}, {"name": "t", "kind": "target", "cost": 0.01}],
         "acceptance": {"q": {"t": 0.8}},
         "cost_curve": {"t": [0.010, 0.012, 0.014, 0.016], "q": [0.004, 0.006, 0.008, 0.010]}}
    if batch:
        d["batch_costs"] = [{"batch": 2, "ratio": {"t": [1.3, 1.5, 1.6, 1.7], "q": [1.8, 1.9, 1.9, 1.9]}},
                            {"batch": 4, "ratio": {"t": [1.9, 2.5, 2.9, 3.2], "q": [3.5, 3.7, 3.8, 3.8]}}]
    return profile_from_dict(d, "<test>")[0]


PLAIN = Spec(("t",), (), ("t",), frozenset({"T"}))
SPEC = Spec(("q", "t"), (3,), ("t", "q"), frozenset({"T", "Q"}))


def test_decode_ticks_cost_the_batched_latency_scaled_by_the_factor_of_their_batch_size():
    prof = _profile()
    costs = LoadCosts(prof, factors={1: {"t": 0.5, "q": 0.5}, 4: {"t": 2.0, "q": 2.0}})
    assert costs.decode(PLAIN, 1) == pytest.approx(0.5 * 0.010)
    assert costs.decode(PLAIN, 4) == pytest.approx(2.0 * 0.010 * 1.9)
    assert costs.decode(PLAIN, 2) == pytest.approx(0.010 * 1.3 * 0.5)      # batch 2 takes batch 1's factors
    three = costs.decode(SPEC, 3)                                           # between 2 and 4: the line
    assert three == pytest.approx((costs.decode(SPEC, 2) + costs.decode(SPEC, 4)) / 2)
    assert costs.decode(SPEC, 4) == pytest.approx(2.0 * evaluate(at_batch(prof, 4), ["q", "t"], [3]))
    six = costs.decode(PLAIN, 6)                                            # past the largest: the line on
    assert six == pytest.approx(costs.decode(PLAIN, 4) + (costs.decode(PLAIN, 4) - costs.decode(PLAIN, 2)))
    with pytest.raises(HsdError, match="--batch-sizes"):
        LoadCosts(_profile(batch=False)).decode(PLAIN, 2)
    with pytest.raises(HsdError, match="no cost for 'layer9'"):
        costs.prompt_pass("layer9", 3)


def test_a_prompt_costs_one_tick_per_pass_of_the_target_and_a_shared_copy_one_position():
    prof = _profile()
    costs = LoadCosts(prof)
    assert costs.prompt_pass("t", 3) == pytest.approx(0.014)                # on the cost curve
    assert costs.prompt_pass("t", 10) == pytest.approx(0.016 + 0.002 * 6)   # past it: the upper half's slope
    timed = LoadCosts(prof, prompt_seconds={"t": [(32, 0.05), (8, 0.02), (96, 0.13)]})
    assert timed.prompt_pass("t", 20) == pytest.approx(0.035)               # between timed passes: their line
    assert timed.prompt_pass("t", 4) == pytest.approx(0.015)                # below them: the first two's line
    assert timed.prompt_pass("t", 128) == pytest.approx(0.17)               # past them: the last two's line
    assert timed.prompt_pass("q", 10) == pytest.approx(costs.prompt_pass("q", 10))   # not timed: its curve
    job = Job(positions=10, tokens=5, head=6)
    assert costs.prefill(PLAIN, job) == [pytest.approx(costs.prompt_pass("t", 10))]
    assert costs.prefill(PLAIN, Job(positions=0, tokens=5, head=6)) == [pytest.approx(0.010)]   # its last, at least
    own = costs.prefill(SPEC, job)
    assert own == [pytest.approx(costs.prompt_pass("t", 10) + costs.prompt_pass("q", 10))]
    shared = costs.prefill(Spec(SPEC.hierarchy, SPEC.budgets, SPEC.prefill, SPEC.engines, frozenset({"q"})), job)
    assert shared == [pytest.approx(costs.prompt_pass("t", 10) + costs.prompt_pass("q", 1))]


def test_a_timed_prompt_pass_computes_its_positions_and_reads_the_last(monkeypatch):
    eng = LayeredLM(make_tiny_llama(seed=1), kernels=HAVE_KERNELS)
    seen = []
    real_advance, real_read = eng.advance, eng.greedy_ids
    monkeypatch.setattr(eng, "advance", lambda st, b: seen.append(("advance", st.n, b)) or real_advance(st, b))
    monkeypatch.setattr(eng, "greedy_ids", lambda st, b, a, z: seen.append(("read", z - a)) or real_read(st, b, a, z))
    out = time_prompt_passes(eng, 3, [5, 6, 7, 8, 9], sizes=(2, 7), context=4, repeats=1)
    assert [m for m, _ in out] == [2, 7] and all(x > 0 for _, x in out)
    assert seen[0] == ("advance", 4, 3)                                   # the head, once
    assert seen[1:] == [("advance", 6, 3), ("read", 1)] * 2 + [("advance", 11, 3), ("read", 1)] * 2


def test_a_long_prompt_takes_a_tick_per_chunk(monkeypatch):
    monkeypatch.setattr(decode, "PREFILL_CHUNK", 4)
    costs = LoadCosts(_profile())
    ticks = costs.prefill(PLAIN, Job(positions=9, tokens=1, head=2))       # positions 2..11: passes of 4, 4, 1
    assert ticks == [pytest.approx(costs.prompt_pass("t", k)) for k in (4, 4, 1)]


def test_one_request_alone_costs_its_prompt_and_its_tokens_and_waiting_clients_wait():
    costs = LoadCosts(_profile())
    job = Job(positions=7, tokens=12)
    one = predict_level(costs, {1: SPEC}, [[job]], max_batch=4)
    expect = sum(costs.prefill(SPEC, job)) + 12 * costs.decode(SPEC, 1)
    assert one.wall_seconds == pytest.approx(expect) and one.tokens == 12 and one.decoding == [1] * 12
    assert one.ttft == [pytest.approx(sum(costs.prefill(SPEC, job)) + costs.decode(SPEC, 1))]
    assert one.aggregate_tokens_per_s == pytest.approx(12 / expect)
    two = predict_level(costs, {1: SPEC}, [[job], [job]], max_batch=1)    # one at a time: twice as long
    assert two.wall_seconds == pytest.approx(2 * expect)
    assert two.ttft[1] == pytest.approx(expect + one.ttft[0])
    both = predict_level(costs, {1: SPEC, 2: PLAIN}, [[job], [job]], max_batch=2)
    assert both.wall_seconds < two.wall_seconds and both.decoding.count(2) == 11


def test_a_sequence_keeps_its_hierarchy_until_it_holds_every_engine_of_the_levels():
    """Started under plain batching (load 2), a sequence does not take the speculative hierarchy of load 1 when
    the other ends: it holds no state of the copy. Started alone under the speculative one, it takes plain
    batching when a second joins."""
    costs = LoadCosts(_profile())
    a, b = Job(positions=3, tokens=4), Job(positions=3, tokens=10)
    both = predict_level(costs, {1: SPEC, 2: PLAIN}, [[a], [b]], max_batch=2)
    pre = costs.prefill(PLAIN, a)[0]
    tail = 7 * costs.decode(PLAIN, 1)                                        # b alone, still on plain decoding
    assert both.wall_seconds == pytest.approx(2 * pre + costs.decode(PLAIN, 1) + 3 * costs.decode(PLAIN, 2) + tail)
    assert both.decoding == [1, 2, 2, 2] + [1] * 7


def test_a_sequence_takes_a_copy_that_shares_the_targets_keys_and_values_when_the_load_falls():
    """The same two requests, the copy now taking the target's keys and values: started under plain batching,
    the longer request takes the speculative hierarchy once the other ends (as the batch's ``can_switch``)."""
    costs = LoadCosts(_profile())
    shared = Spec(SPEC.hierarchy, SPEC.budgets, SPEC.prefill, SPEC.engines, frozenset({"q"}),
                  frozenset({("Q", "T")}))
    a, b = Job(positions=3, tokens=4), Job(positions=3, tokens=10)
    both = predict_level(costs, {1: shared, 2: PLAIN}, [[a], [b]], max_batch=2)
    pre = costs.prefill(PLAIN, a)[0]
    tail = 7 * costs.decode(shared, 1)                                       # b alone, now speculating
    assert both.wall_seconds == pytest.approx(2 * pre + costs.decode(PLAIN, 1) + 3 * costs.decode(PLAIN, 2) + tail)
    assert costs.decode(shared, 1) < costs.decode(PLAIN, 1)


@pytest.mark.parametrize("max_batch", [1, 2, 3])
def test_the_prediction_makes_the_schedulers_ticks(monkeypatch, max_batch):
    """3 clients x 2 requests on the target alone (prompts of 3 to 21 positions, passes of at most 8), prompts first
    (``prefill_share`` 1: the batch's share follows its clock, the prediction's its prices): the real scheduler's
    decode passes, tick by tick, serve as many sequences as the prediction decodes; and it makes as many prompt
    passes."""
    monkeypatch.setattr(decode, "PREFILL_CHUNK", 8)
    eng = LayeredLM(make_tiny_llama(seed=5, vocab_size=64, layers=4, hidden=64, heads=4, kv_heads=2, scale=8.0),
                    kernels=HAVE_KERNELS)
    ar = HSD([Level("layer4", eng, 4)], [], eos_ids=[2])
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (3, 21, 9, 14)]
    served, prefills = [], []
    real_serve, real_prefill = Batch._serve, Batch._prefill_pass
    monkeypatch.setattr(Batch, "_serve", staticmethod(lambda ps: served.append(len(ps)) or real_serve(ps)))
    monkeypatch.setattr(Batch, "_prefill_pass", lambda self, e: prefills.append(1) or real_prefill(self, e))
    reqs = serve_clients(ar, prompts, clients=3, requests=2, max_new_tokens=9, max_batch=max_batch, start=1,
                         prefill_share=1.0)
    lengths = {r.prompt: len(r.token_ids) for r in reqs}
    jobs = LoadPredictor(_profile()).jobs(prompts, lengths, clients=3, requests=2, start=1)
    p = predict_level(LoadCosts(_profile()), {1: PLAIN}, jobs, max_batch, prefill_share=1.0)
    assert p.decoding == served
    assert len(prefills) == sum(len(LoadCosts(_profile()).prefill(PLAIN, j)) for row in jobs for j in row)
    assert p.tokens == sum(len(r.token_ids) for r in reqs)


def test_a_long_prompt_lets_a_decoding_request_go_on_in_the_share_of_the_time_left(monkeypatch):
    """A short request decoding while a long prompt (60 positions, passes of 8) is computed: the prediction gives
    the prompt passes at most ``share`` of the time, so the short request ends sooner and the long one's first
    token comes later than prompts first; the same tokens in all; after each prompt pass the short one decodes for
    as many ticks as it is owed, but for the last pass."""
    monkeypatch.setattr(decode, "PREFILL_CHUNK", 8)
    costs = LoadCosts(_profile())
    short, long = Job(positions=3, tokens=40), Job(positions=60, tokens=2)
    runs = {s: predict_level(costs, {1: PLAIN}, [[short], [long]], max_batch=2, prefill_share=s)
            for s in (1.0, 0.5, 0.25)}
    assert len({r.tokens for r in runs.values()}) == 1
    first = {s: r.ttft[1] for s, r in runs.items()}                # the long prompt's first token
    assert first[1.0] < first[0.5] < first[0.25]
    passes, step = costs.prefill(PLAIN, long), costs.decode(PLAIN, 1)
    for share in (1.0, 0.5):     # each pass owes the short one ceil(owed / step) ticks (its own too), and the last
        per_pass = max(1, math.ceil(passes[0] * (1 - share) / share / step - 1e-9))    # (at most a pass) waits for none
        assert runs[share].decoding.index(2) == (len(passes) - 2) * per_pass + 2
    assert 2 not in runs[0.25].decoding                           # the short one ends before the long one decodes


def test_sampled_requests_on_one_prompt_are_priced_at_their_own_answers_lengths():
    """Sampled, the requests on one prompt end at lengths of their own (an end-of-sequence drawn early): they were
    priced at the last one's length (4 requests answered 43 tokens, priced 48)."""
    from hsd_opt.measure.bench import Sampling
    from hsd_opt.measure.load_bench import answer_lengths

    eng = LayeredLM(make_tiny_llama(seed=5, vocab_size=64, layers=4, hidden=64, heads=4, kv_heads=2, scale=8.0),
                    kernels=HAVE_KERNELS)
    ar = HSD([Level("layer4", eng, 4)], [], eos_ids=list(range(2, 34)))      # half the vocabulary ends an answer
    prompts = [[5, 9, 14]]
    for seed in range(20):
        torch.manual_seed(seed)
        reqs = serve_clients(ar, prompts, clients=2, requests=3, max_new_tokens=12, max_batch=2,
                             sampling=Sampling(temperature=1.0))
        if len({len(r.token_ids) for r in reqs}) > 1:
            break
    assert len({len(r.token_ids) for r in reqs}) > 1
    jobs = LoadPredictor(_profile()).jobs(prompts, answer_lengths(reqs), clients=2, requests=3)
    mine = {}
    for r in reqs:
        mine.setdefault(r.client, []).append(max(1, len(r.token_ids)))
    assert [[j.tokens for j in row] for row in jobs] == [mine[0], mine[1]]


@pytest.mark.skipif(not HAVE_KERNELS, reason="no C compiler here: the kernels cannot be built")
def test_spec_of_a_built_hierarchy_names_its_engines_and_the_copy_that_shares_the_prompt():
    model = make_tiny_llama(seed=5, vocab_size=64, layers=4, hidden=64, heads=4, kv_heads=2, scale=8.0)
    eng, q = LayeredLM(model, kernels=True), QuantizedLM(model, bits=4, kernels=True)
    h = HSD([Level("cycle", drafter=CycleDrafter(64)), Level("q", q, 4), Level("layer2", eng, 2),
             Level("layer4", eng, 4)], [2, 2, 3])
    s = spec_of(h)
    assert s.hierarchy == ("cycle", "q", "layer2", "layer4") and s.budgets == (2, 2, 3)
    assert s.prefill == ("layer4", "q") and len(s.engines) == 2 and s.shared == frozenset({"q"})
    assert s.sources == frozenset({(str(id(q)), str(id(eng)))})
    alone = spec_of(HSD([Level("layer4", eng, 4)], []))
    assert alone.prefill == ("layer4",) and alone.engines < s.engines and alone.budgets == ()
    assert s.takes(alone.engines) and alone.takes(s.engines) and not s.takes(frozenset({str(id(q))}))
    unshared = spec_of(HSD(h.levels, h.budgets, share_prompt=False))
    assert unshared.shared == frozenset() and unshared.sources == frozenset() and not unshared.takes(alone.engines)


def test_jobs_follow_the_clients_prompts_and_a_kept_head_is_not_computed():
    pred = LoadPredictor(_profile(), head=[5, 6])
    prompts = [[5, 6, 7, 8], [5, 6], [1, 2, 3]]
    jobs = pred.jobs(prompts, {0: 3, 1: 1, 2: 4}, clients=2, requests=2, start=1)
    assert jobs == [[Job(2, 1, 0), Job(3, 4, 0)], [Job(2, 3, 2), Job(2, 1, 0)]]


def test_without_batch_costs_only_loads_of_one_sequence_are_predicted():
    """A profile of one sequence at a time prices one client, or any number served one at a time; several
    sequences sharing passes get no prediction (None), not an error in the middle of a benchmark."""
    pred = LoadPredictor(_profile(batch=False))                 # not re-timed: the profile's own costs
    eng = LayeredLM(make_tiny_llama(seed=1), kernels=HAVE_KERNELS)
    h = HSD([Level("t", eng, 4)], [])
    jobs = [[Job(3, 4)], [Job(5, 2)]]
    assert pred.predict(h, 2, jobs)["predicted_run_tokens_per_s"] is None
    one = pred.predict(h, 1, jobs)["predicted_run_tokens_per_s"]
    assert one == pytest.approx(6 / (0.010 * 6 + 0.014 + 0.016 + 0.002))   # two prompts of 3 and 5, 6 steps


@pytest.mark.parametrize("change, said", [
    ([1, 2], "a JSON object of the model's settings expected, got list"),
    (None, "a JSON object of the model's settings expected, got NoneType"),
    ({"vocab_size": "60"}, 'vocab_size: an integer >= 1 expected, got "60"'),
    ({"hidden_size": None}, "hidden_size: an integer >= 1 expected, got null"),
    ({"num_attention_heads": 0}, "num_attention_heads: an integer >= 1 expected, got 0"),
    ({"num_hidden_layers": "4"}, 'num_hidden_layers: an integer >= 1 expected, got "4"'),
    ({"eos_token_id": "x"}, 'eos_token_id: a token id (an integer >= 0), a list of them or null expected, got "x"'),
])
def test_a_config_of_the_wrong_types_is_one_line_naming_the_field(tmp_path, change, said):
    """Wrong types in a model directory's config.json were a TypeError, ZeroDivisionError or validation traceback
    deep in transformers, in every command that loads a model."""
    import json

    from hsd_opt.errors import HsdError
    from hsd_opt.models.loading import load_model
    from tests.helpers import save_tiny

    model = save_tiny(tmp_path / "m")
    cfg = model / "config.json"
    d = json.loads(cfg.read_text())
    cfg.write_text(json.dumps({**d, **change} if isinstance(change, dict) else change))
    for engines_only in (False, True):
        with pytest.raises(HsdError) as e:
            load_model(str(model), device="cpu", engines_only=engines_only)
        assert str(e.value).startswith(f"--model {model}: {cfg}: ") and said in str(e.value), str(e.value)
