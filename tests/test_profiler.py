"""The profiler on tiny randomly initialised Llamas: streamed statistics are exact, shards/ranks/resume merge
exactly, bad input exits with code 2 and one clear line."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hsd_opt.engine.layered import LayeredLM
from hsd_opt.errors import HsdError, InputFileError
from hsd_opt.formats import load_profile
from hsd_opt.profiler.measure import profile_sequence
from hsd_opt.profiler.pool import NeuralDrafter, default_quantized, exit_boundaries
from hsd_opt.profiler.run import ProfileConfig, run_profile
from hsd_opt.profiler.stats import PairStats
from hsd_opt.prompts import load_prompts
from tests.helpers import cli_output, make_tiny_llama, run_cli, save_tiny, write_prompts

REPO = Path(__file__).resolve().parents[1]
# One torch thread in every profile run of this file: float32 reductions split over 2 threads differ from 1
# thread (each torchrun rank's) in the 7th digit, and the exact-merge comparisons below would see it.
FAST = ["--tmax", "3", "--cost-repeats", "1", "--quiet", "--threads", "1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {"model": save_tiny(root / "model"), "copy": save_tiny(root / "copy"),
            "other_tok": save_tiny(root / "other", n_words=70), "prompts": write_prompts(root / "prompts.jsonl"),
            "root": root}


@pytest.fixture(autouse=True)
def _isolate(isolated_cache):
    """Every test here in a test cache, torch's thread count restored (``conftest.isolated_cache``)."""
    yield


def _cli(args):
    return run_cli(*args)


def _stats(path: Path) -> PairStats:
    prof, _ = load_profile(path)
    return PairStats.from_dict(prof.stats)


def _same_stats(a: PairStats, b: PairStats, skip_tokens=()):
    """Equal statistics, but those of the token drafters ``skip_tokens`` (which either may lack)."""
    ka = [i for i, n in enumerate(a.token) if n not in skip_tokens]
    kb = [i for i, n in enumerate(b.token) if n not in skip_tokens]
    assert a.neural == b.neural and [a.token[i] for i in ka] == [b.token[i] for i in kb] and a.tasks == b.tasks
    np.testing.assert_allclose(a.nn, b.nn, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(a.tn[:, :, ka], b.tn[:, :, kb], rtol=1e-12, atol=1e-12)
    for k in ("prompts", "prompt_tokens", "generated_tokens"):
        assert a.counters[k] == b.counters[k]


# ------------------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.7, 1.0), (0.7, 0.6)])
def test_streamed_equals_direct_computation(temperature, top_p):
    """Chunked, streamed sums equal sum-min / argmax / p_j(proposal) computed from stored full distributions
    (processed as the runtime samples: temperature, then top-p)."""
    from hsd_opt.drafters.ngram import ContextNgramDrafter
    from hsd_opt.runtime.sampling import process_logits

    model = make_tiny_llama(seed=5, vocab_size=64, layers=4, scale=8.0)
    eng = LayeredLM(model)
    neural = [NeuralDrafter(f"layer{b}", "early_exit", eng, b) for b in (1, 2, 3, 4)]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 20, (9,), generator=g).tolist()
    cont = torch.randint(3, 20, (13,), generator=g).tolist()
    ngram = ContextNgramDrafter(name="ngram")
    lookup = ContextNgramDrafter(name="lookup", q=3, min_q=2, abstain=True)
    acc, agr, acc_t, agr_t, _ = profile_sequence(neural, [ngram, lookup], prompt, cont, temperature, chunk=5,
                                                 top_p=top_p)

    full = prompt + cont
    with torch.no_grad():
        out = model(torch.tensor(full)[None], output_hidden_states=True)
    P = len(prompt)
    dists, ams = [], []
    for b in (1, 2, 3, 4):
        with torch.no_grad():
            lg = out.logits[0] if b == 4 else model.lm_head(model.model.norm(out.hidden_states[b][0]))
        lg = lg[P - 1:P - 1 + len(cont)]
        p = process_logits(lg, temperature, top_p) if temperature else torch.softmax(lg, -1)
        if top_p < 1:
            assert (p == 0).any(dim=-1).all()                 # the nucleus dropped tokens at every position
        dists.append(p.double())
        ams.append(lg.argmax(-1))
    for i in range(4):
        for j in range(i + 1, 4):
            direct = torch.minimum(dists[i], dists[j]).sum(-1).numpy()
            np.testing.assert_allclose(acc[i, j], direct, atol=1e-5)
            assert (agr[i, j] == (ams[i] == ams[j]).numpy()).all()
    refs = [ContextNgramDrafter(name="ngram"), ContextNgramDrafter(name="lookup", q=3, min_q=2, abstain=True)]
    abstained = 0
    for t, ref in enumerate(refs):
        ref.reset(prompt)
        for g_ in range(len(cont)):
            prop = ref.propose(full[:P + g_], 1)
            ref.observe(full[:P + g_], [full[P + g_]])
            for j in range(4):
                if not prop:                                   # abstained: NaN, never counted as agreement
                    assert np.isnan(acc_t[t, j, g_]) and not agr_t[t, j, g_]
                    continue
                assert acc_t[t, j, g_] == pytest.approx(float(dists[j][g_, prop[0]]), abs=1e-6)
                assert agr_t[t, j, g_] == (prop[0] == int(ams[j][g_]))
            abstained += not prop
    assert 0 < abstained < len(cont)                           # the lookup both proposed and abstained
    st = PairStats(["layer1", "layer2", "layer3", "layer4"], ["ngram", "lookup"], ["code"])
    st.add_token("code", acc_t, agr_t)
    assert st.proposals("ngram") == len(cont) and st.proposals("lookup") == len(cont) - abstained
    made = ~np.isnan(acc_t[1, 3])
    assert st.acceptance("lookup", "layer4") == pytest.approx(acc_t[1, 3][made].mean(), abs=1e-12)


def test_pairstats_merge_flat_json_and_ci():
    rng = np.random.default_rng(0)
    parts = []
    for _ in range(3):
        s = PairStats(["a", "b", "c"], ["ng"], ["code", "math"], ["prompts"])
        for task in ("code", "math"):
            m = 7
            s.add_neural(task, rng.random((3, 3, m)), rng.random((3, 3, m)) > 0.5)
            s.add_token(task, rng.random((1, 3, m)), rng.random((1, 3, m)) > 0.5)
        s.count("prompts", 2)
        parts.append(s)
    total = parts[0].merge(parts[1]).merge(parts[2])
    back = PairStats.from_dict(json.loads(json.dumps(total.to_dict())))
    np.testing.assert_array_equal(back.nn, total.nn)
    assert back.counters["prompts"] == 6
    flat = PairStats(["a", "b", "c"], ["ng"], ["code", "math"], ["prompts"])
    flat.load_flat(parts[0].flat() + parts[1].flat() + parts[2].flat())
    np.testing.assert_allclose(flat.nn, total.nn)
    assert total.acceptance("a", "c") == total.acceptance("c", "a")       # symmetric measure
    lo, hi = total.ci95("a", "b")
    assert lo < total.acceptance("a", "b") < hi
    assert total.n("ng", "b") == 42 and total.acceptance("b", "ng") is None
    with pytest.raises(ValueError):
        total.merge(PairStats(["a", "b"], [], ["code"]))
    one = PairStats(["a", "b"], [], ["code"])
    one.add_neural("code", np.full((2, 2, 1), 0.7), np.ones((2, 2, 1)))
    assert one.ci95("a", "b") == [0.0, 1.0]          # one position tells no spread (it was 0.7-0.7)
    good = one.to_dict()
    for damage in ({"tasks": ["code", "code"]}, {"nn": np.full((4, 1, 2, 2), np.nan).tolist()},
                   {"nn": np.full((4, 1, 2, 2), -1.0).tolist()}, {"counters": {"prompts": -1}},
                   {"tn": np.zeros((4, 1, 2, 1)).tolist()}):           # merged as they were: NaN written out
        with pytest.raises(ValueError):
            PairStats.from_dict({**good, **damage})


def test_results_keep_every_drafter_target_pair_whatever_the_measured_costs():
    """A drafter that times dearer than the target (a tiny model on a loaded machine) keeps its acceptance
    against the target, and the target never appears as a drafter."""
    from hsd_opt.profiler.assemble import results_from_stats

    st = PairStats(["layer1", "layer2", "layer4"], ["ngram"], ["code"])
    rng = np.random.default_rng(0)
    st.add_neural("code", rng.uniform(0, 1, (3, 3, 7)), rng.integers(0, 2, (3, 3, 7)))
    st.add_token("code", rng.uniform(0, 1, (1, 3, 7)), rng.integers(0, 2, (1, 3, 7)))
    can_verify = {"layer1": True, "layer2": True, "layer4": True, "ngram": False}
    by_cost = ["ngram", "layer2", "layer4", "layer1"]   # layer1 measured dearer than the target layer4
    res = results_from_stats(st, by_cost, can_verify, "layer4")
    acc = res["acceptance"]
    assert "layer4" not in acc
    assert set(acc["layer1"]) == {"layer4"} and set(acc["layer2"]) == {"layer1", "layer4"}
    assert set(acc["ngram"]) == {"layer1", "layer2", "layer4"}
    assert acc["layer1"]["layer4"] == pytest.approx(st.acceptance("layer1", "layer4"))
    assert res["counts"]["layer1"]["layer4"] == 7


def test_exit_boundaries_and_the_default_copies():
    assert exit_boundaries(None, 4) == [1, 2, 3, 4]
    assert exit_boundaries([3, 1, 3], 4) == [1, 3, 4]
    assert exit_boundaries(range(2, 4), 6) == [2, 3, 6]
    assert exit_boundaries([], 4) == [4]                                      # the target only, no exit
    with pytest.raises(HsdError, match=r"--layers: layer 5 .*1\.\.4"):
        exit_boundaries([5], 4)
    with pytest.raises(HsdError, match="--draft-layers: layer 0"):
        exit_boundaries([2, 0], 4, "--draft-layers")
    for bad in ("4,30", [2, "3"], [2.5]):      # a ProfileConfig built in Python: no int("4,30") ValueError
        with pytest.raises(HsdError, match="--layers: expected layer numbers"):
            exit_boundaries(bad, 4)
    assert default_quantized("cpu") == [(None, "int8"), (None, "int4")] and default_quantized("meta") == []


# ------------------------------------------------------------------------------------------- end to end


class _Recording:
    """A token drafter that logs every ``propose`` call ``(context length, n, proposal)`` into a shared list."""

    def __init__(self, inner, log: list):
        self.inner, self.log, self.name, self.may_abstain = inner, log, inner.name, inner.may_abstain

    def fork(self):
        return _Recording(self.inner.fork(), self.log)

    def reset(self, prompt_ids):
        self.inner.reset(prompt_ids)

    def observe(self, context, accepted):
        self.inner.observe(context, accepted)

    def propose(self, context, n):
        out = self.inner.propose(context, n)
        self.log.append((len(context), n, tuple(out)))
        return out


@pytest.mark.parametrize("T", [1, 2, 3, 5])
def test_walked_rounds_are_greedy_decodings_rounds(T):
    """An abstaining drafter's walk along the target's greedy continuation calls it at exactly the contexts, with
    exactly the proposals, of greedy decoding with the hierarchy ``[drafter, target]`` and budget ``T`` (its calls
    from positions with a whole block and the round's token inside the continuation), and counts them; rounds
    skip what an accepted block covers, so its share of rounds with a block is below its share of positions."""
    from hsd_opt.drafters import make_token_drafter
    from hsd_opt.profiler.measure import walk_rounds
    from hsd_opt.runtime.decode import HSD, Level

    lm = LayeredLM(make_tiny_llama(seed=6, vocab_size=40, layers=4, scale=6.0))
    prompt, G = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4], 40

    def lookup():
        return make_token_drafter("ngram_context", name="lookup", q=3, w=4, min_q=2, abstain=True)

    decoded: list = []
    res = HSD([Level("lookup", drafter=_Recording(lookup(), decoded)), Level("layer4", lm, 4)], [T]).generate(
        prompt, G)
    cont = res.token_ids
    assert len(cont) == G
    walked: list = []
    counts = walk_rounds(lambda: _Recording(lookup(), walked), prompt, cont, T)
    mine = [c for c in walked if c[1] == T]
    assert mine == [c for c in decoded if c[0] - len(prompt) + T < G]
    assert counts[0, T - 1] == len(mine) and counts[1, T - 1] == sum(bool(c[2]) for c in mine)
    assert 0 < counts[1, T - 1] < counts[0, T - 1]
    accepted = sum(1 for c in mine if c[2] and c[2][0] == cont[c[0] - len(prompt)])
    assert accepted > 0                                       # some rounds skipped positions
    d, proposed = lookup(), 0
    d.reset(prompt)
    for g in range(1, G - T):
        ctx = prompt + cont[:g]
        if g == 1:
            d.observe(prompt, cont[:1])
        proposed += bool(d.propose(ctx, T))
        d.observe(ctx, cont[g:g + 1])
    assert counts[1, T - 1] / counts[0, T - 1] < proposed / (G - T - 1)


def _share_and_variance(counts: np.ndarray) -> tuple[float, float]:
    """``counts`` ``[n, 2]`` per sequence (rounds, rounds with a block): the pooled share and its variance, with the
    sequences as the independent units (rounds of one sequence are correlated)."""
    r = counts[:, 1].sum() / counts[:, 0].sum()
    n = len(counts)
    return r, float(((counts[:, 1] - r * counts[:, 0]) ** 2).sum() / (n - 1) / n / counts[:, 0].mean() ** 2)


def test_walked_rounds_have_sampled_decodings_share_of_blocks():
    """Sampled (temperature 0.3, budget 2), the walk along the target's sampled continuations gives the share of
    rounds with a block that sampled decoding's rounds have (600 sequences each, independent seeds: |z| < 3.5),
    where the share of positions, which the solver took before, is rejected (z < -4)."""
    from hsd_opt.drafters import make_token_drafter
    from hsd_opt.profiler.measure import generate, walk_rounds
    from hsd_opt.runtime.decode import HSD, Level

    lm = LayeredLM(make_tiny_llama(seed=6, vocab_size=40, layers=4, scale=6.0))
    prompt, G, T, temperature, n = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4], 30, 2, 0.3, 600

    def lookup():
        return make_token_drafter("ngram_context", name="lookup", q=3, w=4, min_q=2, abstain=True)

    decoded, walked, positions = [], [], []
    for seed in range(n):
        log: list = []
        HSD([Level("lookup", drafter=_Recording(lookup(), log)), Level("layer4", lm, 4)], [T]).generate(
            prompt, G, temperature=temperature, seed=seed)
        mine = [c for c in log if c[0] - len(prompt) + T < G]          # the rounds a walk counts
        decoded.append([len(mine), sum(bool(c[2]) for c in mine)])
        cont = generate(lm, prompt, G, temperature, set(), torch.Generator().manual_seed(10_000 + seed))
        walked.append(walk_rounds(lookup, prompt, cont, T)[:, T - 1])
        d, made = lookup(), 0
        d.reset(prompt)
        d.observe(prompt, cont[:1])
        for g in range(1, G - T):
            made += bool(d.propose(prompt + cont[:g], T))
            d.observe(prompt + cont[:g], cont[g:g + 1])
        positions.append([G - T - 1, made])
    (rd, vd), (rw, vw), (rp, vp) = (_share_and_variance(np.array(c, dtype=float))
                                    for c in (decoded, walked, positions))
    assert abs(rd - rw) / np.sqrt(vd + vw) < 3.5, (rd, rw)
    assert (rd - rp) / np.sqrt(vd + vp) < -4, (rd, rp)


@pytest.fixture(scope="module")
def full_run(tiny, tmp_path_factory):
    """The single-process reference run (one torch thread, see FAST; restored after, as by ``_isolate``)."""
    out = tmp_path_factory.mktemp("full") / "profile.json"
    os.environ["HSD_CACHE"] = str(tmp_path_factory.getbasetemp() / "hsd-cache")
    threads = torch.get_num_threads()
    try:
        r = _cli(["profile", "--model", str(tiny["model"]), "--prompts", str(tiny["prompts"]), "--out", str(out),
                  "--max-new-tokens", "8", "--draft-model", str(tiny["copy"]), "--token-drafters",
                  "ngram,lookup,bigram,aded", "--device", "cpu", "--cost-contexts", "600,8"] + FAST)
    finally:
        torch.set_num_threads(threads)
    assert r.exit_code == 0, r.output
    return out


def test_cli_profile_identical_drafter_and_solver(full_run, tiny):
    prof, warnings = load_profile(full_run)
    names = prof.names
    assert prof.target == "layer4"
    quantized = {"int8", "int4"}   # the default --quantized on a CPU
    pool = {"layer1", "layer2", "layer3", "layer4", "copy", "ngram", "lookup", "bigram", "aded"}
    assert pool | quantized == set(names)
    assert 0 < prof.entry("lookup").draft_rate < 1 and prof.entry("ngram").draft_rate == 1   # it abstained sometimes
    st = PairStats.from_dict(prof.stats)
    assert prof.entry("lookup").draft_rate == pytest.approx(
        st.proposals("lookup") / st.counters["propose_calls.lookup"], rel=1e-12)
    # its share of rounds per budget 1..tmax (3), walked on every prompt; each task's too, adding up
    by_budget = prof.entry("lookup").draft_rate_by_budget
    from hsd_opt.commands.profile import draft_rate_lines

    assert draft_rate_lines(prof) == [f"lookup proposes at {prof.entry('lookup').draft_rate:.0%} of positions; in "
                                      f"decoding's rounds with blocks of 1 / 2 tokens: {by_budget[0]:.0%} / "
                                      f"{by_budget[1]:.0%} (the solver's draft rate at each budget)"]
    assert len(by_budget) == 3 and all(0 < f <= 1 for f in by_budget)
    tasks = list(prof.draft_rate_by_budget_by_task)
    assert tasks and all(len(prof.draft_rate_by_budget_by_task[t]["lookup"]) <= 3 for t in tasks)
    for T in (1, 2, 3):
        rounds = {t: st.counters[f"walk_rounds.lookup.{T}.{t}"] for t in st.tasks}
        blocks = sum(st.counters[f"walk_blocks.lookup.{T}.{t}"] for t in st.tasks)
        assert by_budget[T - 1] == pytest.approx(max(1e-6, blocks / sum(rounds.values())), rel=1e-12)  # a floor
        assert sum(prof.draft_rate_by_budget_by_task[t]["lookup"][T - 1] * rounds[t] for t in tasks
                   if rounds[t]) == pytest.approx(blocks, abs=1e-4)
    for q in quantized:
        assert prof.entry(q).kind == "quantized" and prof.entry(q).extra["quantization"]["bits"] == int(q[3:])
        a = prof.accept(q, "layer4")          # keyed drafter -> target even where a tiny copy times dearer
        assert a is not None and 0.0 < a <= 1.0
    costs = [m.cost for m in prof.models if m.name != "layer4"]
    assert costs == sorted(costs) and names[-1] == "layer4"    # drafters cheapest first, the target last
    # the draft model is an identical copy of the target: acceptance 1, agreement 1
    assert prof.accept("copy", "layer4") == pytest.approx(1.0, abs=1e-5)
    assert "layer4" not in prof.acceptance                      # the target drafts for nobody
    assert prof.entry("copy").kind == "model" and prof.entry("ngram").can_verify is False
    assert prof.entry("ngram").extra["config"]["kind"] == "ngram_context"
    for d, row in prof.acceptance.items():
        for v, x in row.items():
            assert 0 <= x <= 1 and names.index(d) < names.index(v)
    assert len(prof.cost_curve["layer4"]) == 4
    assert len(prof.verify_cost["layer4"]["layer1"]) == 4
    assert prof.verify_cost["layer4"]["layer1"][0] < prof.cost_curve["layer4"][0]
    pv = prof.provenance.to_dict()
    assert pv["prompts_sha256"] == load_prompts(tiny["prompts"]).sha256
    assert pv["prompt_count"] == 5 and pv["generated_tokens"] > 0 and pv["heads"] is None
    assert set(prof.acceptance_by_task) <= {"code", "math", "chat"}
    # per task: generated positions add up, and so do the lookup's proposals (its draft rate per task)
    pos = pv["positions_by_task"]
    assert sum(pos.values()) == pv["generated_tokens"] and pv["top_p"] == 1.0
    rates = {t: r["lookup"] for t, r in prof.draft_rate_by_task.items()}
    assert set(rates) == set(pos) and "ngram" not in prof.draft_rate_by_task["code"]
    assert sum(rates[t] * pos[t] for t in pos) == pytest.approx(                # (a rate's floor is 1e-6)
        prof.entry("lookup").draft_rate * sum(pos.values()), abs=1e-4)
    assert prof.ci95 and prof.greedy_agreement and prof.counts
    # prompts and their lengths per task (each task's typical context) add up to the totals
    assert sum(pv["prompts_by_task"].values()) == pv["prompt_count"] == 5
    assert sum(pv["prompt_tokens_by_task"].values()) == pv["prompt_tokens"]
    assert set(pv["prompt_tokens_by_task"]) == set(pos)
    r = _cli(["solve", "--profile", str(full_run), "--tmax", "3"])
    assert r.exit_code == 0, r.output


def test_profile_records_costs_at_every_context(full_run):
    """``--cost-contexts 600,8`` on a model of 512 positions: costs at 8 and at the longest context that fits a pass
    of tmax + 1 = 4 tokens (507), for every model and pair, non-decreasing in t and in the context; the top-level
    costs are the first context's (token drafters: their mean over the profiled positions)."""
    prof, _ = load_profile(full_run)
    pv = prof.provenance.to_dict()
    assert prof.contexts == [8, 507] and pv["cost_contexts"] == {"requested": [8, 600], "measured": [8, 507]}
    first, last = prof.context_costs
    assert set(first.cost) == set(prof.names)                            # every model, token drafters included
    assert set(first.cost_curve) == {m.name for m in prof.models if m.can_verify}
    assert first.verify_cost == prof.verify_cost and first.cost_curve == prof.cost_curve
    for m in prof.models:
        if m.can_verify:
            assert m.cost == first.cost[m.name] == first.cost_curve[m.name][0]
            for e in (first, last):                                      # non-decreasing in t ...
                assert e.cost_curve[m.name] == sorted(e.cost_curve[m.name])
            assert all(a <= b for a, b in zip(first.cost_curve[m.name], last.cost_curve[m.name]))  # ... and context
        assert first.cost[m.name] <= last.cost[m.name]
    pairs = [(v, d) for v, row in first.verify_cost.items() for d in row]
    assert ("layer4", "layer1") in pairs and ("layer3", "layer2") in pairs
    for v, d in pairs:
        assert all(a <= b for a, b in zip(first.verify_cost[v][d], last.verify_cost[v][d]))
        assert len(last.verify_cost[v][d]) == 4
    # the solver takes them at the profile's typical context: mean prompt + half the mean generation
    ctx = round((pv["prompt_tokens"] + pv["generated_tokens"] / 2) / pv["prompt_count"])
    r = _cli(["solve", "--profile", str(full_run), "--tmax", "3", "--out", str(full_run.with_name("plan.json"))])
    assert r.exit_code == 0, r.output
    plan = json.loads(full_run.with_name("plan.json").read_text())
    assert plan["context"] == ctx and plan["context_from"] == "profile_prompts"
    assert [c for c, _ in plan["latency_by_context"]] == [8, 507]


@pytest.mark.slow
def test_shards_merge_equals_single_run(full_run, tiny, tmp_path):
    parts = []
    for k in (0, 1):
        out = tmp_path / f"shard{k}.json"
        r = _cli(["profile", "--model", str(tiny["model"]), "--prompts", str(tiny["prompts"]), "--out", str(out),
                  "--max-new-tokens", "8", "--draft-model", str(tiny["copy"]),
                  "--token-drafters", "ngram,lookup,bigram",
                  "--shard", f"{k}/2", "--device", "cpu"] + FAST)
        assert r.exit_code == 0, r.output
        parts.append(out)
    # ADED's matrix is built from every prompt's continuation, which a shard does not see: not with --shard
    r = _cli(["profile", "--model", str(tiny["model"]), "--prompts", str(tiny["prompts"]), "--out",
              str(tmp_path / "a.json"), "--token-drafters", "ngram,aded", "--shard", "0/2", "--device", "cpu"] + FAST)
    assert r.exit_code == 2 and "--shard" in r.output and "aded" in r.output, r.output
    merged = tmp_path / "merged.json"
    r = _cli(["profile", "merge", str(parts[0]), str(parts[1]), "-o", str(merged)])
    assert r.exit_code == 0, r.output
    # (the full run has ADED too, which shards leave out; under torchrun the ranks gather all continuations first,
    # see the torchrun test)
    _same_stats(_stats(merged), _stats(full_run), skip_tokens=("aded",))
    m, _ = load_profile(merged)
    f, _ = load_profile(full_run)
    assert m.entry("lookup").draft_rate == pytest.approx(f.entry("lookup").draft_rate, rel=1e-12)
    for d, row in f.acceptance.items():
        for v, x in row.items():
            if d in m.acceptance and v in m.acceptance[d]:
                assert m.acceptance[d][v] == pytest.approx(x, abs=1e-12)
    # costs (at every context) are the first file's; each task's prompts and their tokens add up like the rest
    first, _ = load_profile(parts[0])
    assert m.context_costs == first.context_costs and m.contexts == [64, 507]
    for key in ("prompts_by_task", "prompt_tokens_by_task", "positions_by_task"):
        assert m.provenance.get(key) == f.provenance.get(key), key
    # both shards make the whole set: the merged profile is no shard, and merging a shard into it again is said
    assert m.provenance.get("shard") is None and m.provenance.get("shards") is None
    r = _cli(["profile", "merge", str(merged), str(parts[1]), "-o", str(tmp_path / "twice.json")])
    assert r.exit_code == 0 and "overlap" in cli_output(r) and "counted twice" in cli_output(r), cli_output(r)
    d = json.loads(parts[0].read_text())
    d["provenance"].pop("prompt_keys")      # files made before prompt keys: told apart by their sets and seeds
    for seeds, said in (((0, 1), False), ((3, 3), True)):   # sampled with other seeds: other samples, not twice
        for k, seed in enumerate(seeds):
            d["provenance"].update(temperature=1.0, seed=seed)
            (tmp_path / f"s{k}.json").write_text(json.dumps(d))
        r = _cli(["profile", "merge", str(tmp_path / "s0.json"), str(tmp_path / "s1.json"), "-o",
                  str(tmp_path / "s.json")])
        assert r.exit_code == 0 and ("counted twice" in cli_output(r)) == said, cli_output(r)
    # a profile of torchrun's ranks is one file of the whole set too; one without a temperature is greedy
    d["provenance"].update(world_size=2, seed=0)
    d["provenance"].pop("temperature")
    (tmp_path / "w.json").write_text(json.dumps(d))
    r = _cli(["profile", "merge", str(tmp_path / "w.json"), str(tmp_path / "w.json"), "-o", str(tmp_path / "s.json")])
    assert r.exit_code == 0 and "counted twice" in cli_output(r), cli_output(r)
    d = json.loads(parts[1].read_text())
    for damage in ({}, {**d["stats"], "neural": 5}, {**d["stats"], "nn": []}):
        (tmp_path / "bad.json").write_text(json.dumps({**d, "stats": damage}))
        r = _cli(["profile", "merge", str(parts[0]), str(tmp_path / "bad.json"), "-o", str(tmp_path / "b.json")])
        out = cli_output(r)
        assert r.exit_code == 2 and "bad.json" in out and "stats" in out and "Traceback" not in out, out
    for key, value in (("shard", "x"), ("shard", 3), ("shards", [1, 2]), ("shard", [2, 2]),
                       ("prompts_sha256", ["x"])):   # were tracebacks
        prov = {k: v for k, v in d["provenance"].items() if k not in ("shard", "shards")}
        (tmp_path / "bad.json").write_text(json.dumps({**d, "provenance": {**prov, key: value}}))
        r = _cli(["profile", "merge", str(parts[0]), str(tmp_path / "bad.json"), "-o", str(tmp_path / "b.json")])
        out = cli_output(r)
        assert r.exit_code == 2 and f"bad.json: provenance.{key}: expected " in out, out
    from hsd_opt.profiler.assemble import _merged_shards, _overlap
    assert _overlap([(0, 3)], [(1, 3), (2, 3)]) is False and _overlap([(0, 3)], [(0, 2)]) is True
    assert _overlap(None, [(1, 3)]) is True
    assert _merged_shards({"s": [("a", [(0, 3)]), ("b", [(2, 3)])]}) == [[0, 3], [2, 3]]
    assert _merged_shards({"s": [("a", [(0, 2)]), ("b", [(1, 2)])]}) is None
    # a profile of a different model is refused, naming the field
    other = tmp_path / "other.json"
    r = _cli(["profile", "--model", str(tiny["other_tok"]), "--prompts", str(tiny["prompts"]), "--out", str(other),
              "--max-new-tokens", "4", "--token-drafters", "none", "--device", "cpu"] + FAST)
    assert r.exit_code == 0, r.output
    r = _cli(["profile", "merge", str(parts[0]), str(other), "-o", str(tmp_path / "x.json")])
    assert r.exit_code == 2 and "provenance.model" in r.output


def test_a_cache_that_cannot_keep_adeds_matrix_is_said_before_the_continuations_are_generated(tiny, tmp_path,
                                                                                              monkeypatch):
    """ADED's matrix is counted from the continuations and kept in the cache: a cache that cannot keep it (here
    its ``aded`` a file) stops the profile with one line naming ``HSD_CACHE`` before the target generates them (it
    stopped after every continuation was generated)."""
    import hsd_opt.profiler.run as run_module
    from hsd_opt.cache import UnwritableFolder, cache_dir

    cache = tmp_path / "cache"
    cache.mkdir()
    if (cache_dir() / "kernels").is_dir():             # the kernels built already, not built again
        (cache / "kernels").symlink_to(cache_dir() / "kernels")
    (cache / "aded").write_text("not a folder")
    monkeypatch.setenv("HSD_CACHE", str(cache))
    monkeypatch.setattr(run_module, "_generate_continuations",
                        lambda *a, **k: pytest.fail("the continuations were generated first"))
    cfg = ProfileConfig(model=str(tiny["model"]), out=tmp_path / "p.json", prompts=tiny["prompts"],
                        max_new_tokens=6, device="cpu", token_drafters=["ngram", "aded"], tmax=2, cost_repeats=1,
                        curve_repeats=1, progress=False)
    with pytest.raises(UnwritableFolder, match=f"HSD_CACHE={cache}: the cache cannot hold ADED's tri-gram matrix"):
        run_profile(cfg)


def test_resume_after_interruption_equals_uninterrupted(tiny, tmp_path):
    def cfg(out, **kw):
        base = dict(model=str(tiny["model"]), out=out, prompts=tiny["prompts"], max_new_tokens=6, device="cpu",
                    token_drafters=["ngram", "aded"], tmax=2, cost_repeats=1, curve_repeats=1, progress=False,
                    threads=1)  # a fixed thread count: auto picks 1 on a busy machine, and sums differ with it
        base.update(kw)
        return ProfileConfig(**base)

    ref = run_profile(cfg(tmp_path / "ref.json"))

    class Crash(Exception):
        pass

    def crash_after_2(k):
        if k == 2:
            raise Crash()

    out = tmp_path / "run.json"
    with pytest.raises(Crash):
        run_profile(cfg(out), on_prompt=crash_after_2)
    partial = Path(str(out) + ".partial.json")
    assert partial.exists() and not out.exists()
    assert len(json.loads(partial.read_text())["done"]) == 2
    with pytest.raises(HsdError, match="--resume"):                      # never silently overwritten
        run_profile(cfg(out))
    with pytest.raises(InputFileError, match="max_new_tokens"):          # different settings: refused
        run_profile(cfg(out, max_new_tokens=7, resume=True))
    with pytest.raises(InputFileError, match="tmax"):                    # budgets walked further: refused
        run_profile(cfg(out, tmax=3, resume=True))
    for field, bad, named in (("stats", "garbage", "stats"), ("done", ["x"], "done"),
                              ("continuations", {"0": "abc"}, "continuations.0"), ("settings", [], "settings"),
                              ("rank", "x", "rank"), ("rank", True, "rank")):
        damaged = tmp_path / f"damaged-{field}.json"
        d = json.loads(partial.read_text())
        d[field] = bad
        Path(str(damaged) + ".partial.json").write_text(json.dumps(d))
        with pytest.raises(InputFileError, match=f"partial.json: {named}: a damaged checkpoint"):
            run_profile(cfg(damaged, resume=True))

    def first(d):
        return str(d["done"][0])

    # damage a resumed run took as it was: prompts profiled again and added ("45 prompts" of 40), one exit's
    # acceptance taken for another's, a profile without rates, tokens the model cannot have produced (a traceback)
    for field, damage in (("done", lambda d: d.pop("done")),
                          ("stats.neural", lambda d: d["stats"]["neural"].reverse()),
                          ("stats.tasks", lambda d: d["stats"]["tasks"].__setitem__(0, "other")),
                          ("stats.counters", lambda d: d["stats"]["counters"].clear()),
                          ("stats", lambda d: d["stats"]["nn"][0][0][0].__setitem__(1, float("nan"))),
                          ("done", lambda d: d["stats"]["counters"].__setitem__("prompts", 5.0)),
                          ("continuations", lambda d: d["continuations"].pop(first(d))),
                          (None, lambda d: d["continuations"][first(d)].append(10 ** 6)),
                          (None, lambda d: d["continuations"][first(d)].extend([4] * 7)),
                          # indices that are no prompt of the run (a prompt's statistics counted twice, another
                          # never measured), read from a bool or a float, or a key int() cannot read (a traceback)
                          ("done", lambda d: d["done"].__setitem__(-1, 99)),
                          ("done", lambda d: d["done"].__setitem__(0, True)),
                          ("done", lambda d: d["done"].__setitem__(0, 0.7)),
                          ("continuations.abc", lambda d: d["continuations"].__setitem__("abc", [1, 2])),
                          ("continuations.99", lambda d: d["continuations"].__setitem__("99", [1, 2])),
                          (None, lambda d: d["continuations"][first(d)].__setitem__(0, 3.5))):
        damaged = tmp_path / "damaged.json"
        d = json.loads(partial.read_text())
        damage(d)
        Path(str(damaged) + ".partial.json").write_text(json.dumps(d))
        field = field or f"continuations.{first(json.loads(partial.read_text()))}"
        with pytest.raises(InputFileError, match=f"partial.json: {field}: a damaged checkpoint"):
            run_profile(cfg(damaged, resume=True))
    left = tmp_path / ".run.json.partial.json.x1y2.partial"           # a save a SIGKILL cut short, long ago
    left.write_text("{")
    os.utime(left, (1e9, 1e9))
    sampled = tmp_path / "sampled.json.partial.json"                   # as if made at T = 1 (no top-k recorded)
    d = json.loads(partial.read_text())
    d["settings"]["temperature"] = 1.0
    d["settings"].pop("top_k")
    sampled.write_text(json.dumps(d))
    with pytest.raises(InputFileError, match="top_k"):                   # other filters: refused
        run_profile(cfg(tmp_path / "sampled.json", temperature=1.0, top_k=40, resume=True))
    done_again = []
    prof = run_profile(cfg(out, resume=True), on_prompt=done_again.append)
    assert len(done_again) == 3                                          # only the 3 missing prompts ran
    assert not left.exists()
    assert out.exists() and not partial.exists()
    a = PairStats.from_dict(prof.stats)
    b = PairStats.from_dict(ref.stats)
    _same_stats(a, b)


def test_a_left_checkpoint_without_resume_is_refused_before_the_model_loads(tmp_path):
    """It was refused once the target, its copies and the draft models were loaded (minutes for a large model)."""
    out = tmp_path / "p.json"
    Path(str(out) + ".partial.json").write_text("{}")
    # a hub id (its name passes the checks before loading; loading it would fail: no network)
    cfg = ProfileConfig(model="no-such-org/no-such-model", out=out, device="cpu", progress=False)
    with pytest.raises(HsdError, match="a checkpoint of an interrupted run exists; pass --resume"):
        run_profile(cfg)


def test_a_draft_model_whose_weights_changed_is_not_resumed(tiny, tmp_path):
    """A checkpoint recorded the draft models' names only: one re-saved with other weights was resumed, its
    sums of the old weights mixed with the new (acceptance 0.523 where a run of the new one measured 0.526)."""
    import os
    import shutil

    draft = tmp_path / "draft"
    shutil.copytree(tiny["copy"], draft)

    class Crash(Exception):
        pass

    def crash(k):
        raise Crash()

    def cfg(**kw):
        return ProfileConfig(model=str(tiny["model"]), out=tmp_path / "p.json", prompts=tiny["prompts"],
                             max_new_tokens=4, device="cpu", token_drafters=["ngram"], tmax=2, cost_repeats=1,
                             curve_repeats=1, progress=False, threads=1, draft_models=[str(draft)], **kw)

    with pytest.raises(Crash):
        run_profile(cfg(), on_prompt=crash)
    save_tiny(draft, seed=5)                                     # other weights, the same name and size
    for f in draft.iterdir():
        os.utime(f, (1e9, 1e9))
    with pytest.raises(InputFileError, match="settings.draft_revisions"):
        run_profile(cfg(resume=True))


def test_sampled_profile_records_top_p_and_merges_only_with_the_same(tiny, tmp_path, monkeypatch):
    """A profile made with a temperature records it and top-p, and adds the sampling work of a pass over t tokens
    (``sampling_seconds``, here a patched 1, 2, 3, 4 s, far above any pass of the tiny model) to every model's
    costs, and to no token drafter's."""
    from hsd_opt.profiler import run as profiler_run

    monkeypatch.setattr(profiler_run, "time_sampling", lambda rows, temperature, top_p, tmax1, **kw: [1.0 + t for t
                                                                                                     in range(tmax1)])
    outs = {}
    for top_p in (0.9, 1.0):
        outs[top_p] = tmp_path / f"p{top_p}.json"
        r = _cli(["profile", "--model", str(tiny["model"]), "--prompts", str(tiny["prompts"]), "--out",
                  str(outs[top_p]), "--max-new-tokens", "4", "--layers", "2", "--token-drafters", "none",
                  "--quantized", "none", "--temperature", "0.8", "--top-p", str(top_p), "--device", "cpu"] + FAST)
        assert r.exit_code == 0, r.output
    prof, _ = load_profile(outs[0.9])
    pv = prof.provenance.to_dict()
    assert pv["temperature"] == 0.8 and pv["top_p"] == 0.9 and "top-p" in pv["temperature_note"]
    assert 0 < prof.accept("layer2", "layer4") <= 1
    assert pv["sampling_seconds"] == [1.0, 2.0, 3.0, 4.0] and "sampling_seconds" in pv["cost_model"]
    for e in prof.context_costs:
        for m in ("layer2", "layer4"):
            assert all(t + 1 < c < t + 1.5 for t, c in enumerate(e.cost_curve[m])) and 1 < e.cost[m] < 1.5
        assert all(t + 1 < c < t + 1.5 for t, c in enumerate(e.verify_cost["layer4"]["layer2"]))
    assert pv["draw_saving_seconds"] is None           # top-p: the target draws from its distributions
    r = _cli(["profile", "merge", str(outs[0.9]), str(outs[1.0]), "-o", str(tmp_path / "m.json")])
    assert r.exit_code == 2 and "provenance.top_p" in r.output


def test_a_target_that_draws_by_noise_is_costed_so(tiny, tmp_path, monkeypatch):
    """At top-p 1 the target draws by noise through its screen: what its pass saves (``draw_saving_seconds``,
    here a patched 0.5, 0.6, 0.7, 0.8 s against sampling's 1, 2, 3, 4 s) is taken off its cost (the target alone)
    and off its verification of a token drafter, non-decreasing, and not off its cost curve (a model drafter below
    it reads its distributions) nor off any other model's costs."""
    from hsd_opt.profiler import run as profiler_run

    monkeypatch.setattr(profiler_run, "time_sampling", lambda rows, temperature, top_p, tmax1, **kw: [1.0 + t for t
                                                                                                     in range(tmax1)])
    monkeypatch.setattr(profiler_run, "time_draw_saving", lambda eng, text, temperature, tmax1: [0.5 + 0.1 * t for t
                                                                                                in range(tmax1)])
    out = tmp_path / "p.json"
    r = _cli(["profile", "--model", str(tiny["model"]), "--prompts", str(tiny["prompts"]), "--out", str(out),
              "--max-new-tokens", "4", "--layers", "2", "--token-drafters", "lookup", "--quantized", "none",
              "--temperature", "0.8", "--device", "cpu"] + FAST)
    assert r.exit_code == 0, r.output
    prof, _ = load_profile(out)
    pv = prof.provenance.to_dict()
    assert pv["draw_saving_seconds"] == [0.5, 0.6, 0.7, 0.8] and "draw_saving_seconds" in pv["cost_model"]
    for e in prof.context_costs:
        curve = e.cost_curve["layer4"]
        assert all(t + 1 < c < t + 1.5 for t, c in enumerate(curve))
        assert e.cost["layer4"] == pytest.approx(curve[0] - 0.5)
        drawn = e.verify_cost["layer4"]["lookup"]
        assert drawn == sorted(drawn) and all(0.5 + 0.9 * t < d < 1 + 0.9 * t for t, d in enumerate(drawn))
        assert 1 < e.cost["layer2"] < 1.5 and all(t + 1 < c < t + 1.5 for t, c in enumerate(e.cost_curve["layer2"]))
        assert all(t + 1 < c < t + 1.5 for t, c in enumerate(e.verify_cost["layer4"]["layer2"]))
    assert prof.entry("layer4").cost == prof.context_costs[0].cost["layer4"]
    assert prof.verify_cost["layer4"]["lookup"] == prof.context_costs[0].verify_cost["layer4"]["lookup"]


def test_a_profile_sampled_with_top_k_or_min_p_measures_the_filtered_target(tiny, tmp_path, monkeypatch):
    """With ``--top-k``/``--min-p`` the acceptance rates are those of the filtered distributions: at top-k 1 every
    distribution is one-hot on its largest logit, so a drafter's acceptance is its greedy agreement with the target
    (unfiltered it is not). The filters are recorded, a profile merges only with one of the same filters, the
    sampling work is timed with them, and what the target's engine saves by reading the filters' window
    (``window_saving_seconds``, here a patched 0.5, 0.6, 0.7, 0.8 s) comes off every pass of each of its levels
    (costs, cost curves, verification) where draws by noise do not apply."""
    from hsd_opt.profiler import run as profiler_run

    asked = []
    monkeypatch.setattr(profiler_run, "time_sampling", lambda rows, temperature, top_p, tmax1, **kw: asked.append(
        kw) or [1.0 + t for t in range(tmax1)])
    monkeypatch.setattr(profiler_run, "time_window_saving", lambda eng, text, temperature, top_p, top_k, min_p, tmax1: [
        0.5 + 0.1 * t for t in range(tmax1)])
    monkeypatch.setattr(profiler_run, "time_draw_saving", lambda *a: pytest.fail("draws by noise under a filter"))
    outs = {}
    for name, flags in (("k1", ["--top-k", "1"]), ("k1m", ["--top-k", "1", "--min-p", "0.05"]), ("none", [])):
        outs[name] = tmp_path / f"{name}.json"
        if name == "none":
            monkeypatch.setattr(profiler_run, "time_draw_saving", lambda eng, text, temperature, tmax1: [0.0] * tmax1)
        r = _cli(["profile", "--model", str(tiny["model"]), "--prompts", str(tiny["prompts"]), "--out",
                  str(outs[name]), "--max-new-tokens", "6", "--layers", "1,2", "--token-drafters", "none",
                  "--quantized", "none", "--temperature", "0.8", "--device", "cpu", *flags] + FAST)
        assert r.exit_code == 0, r.output
    prof, _ = load_profile(outs["k1"])
    pv = prof.provenance
    assert pv.top_k == 1 and pv.min_p == 0.0 and asked[0] == {"top_k": 1, "min_p": 0.0}
    for d in ("layer1", "layer2"):
        assert prof.accept(d, "layer4") == pytest.approx(prof.greedy_agreement[d]["layer4"], abs=1e-6)
    plain, _ = load_profile(outs["none"])
    assert any(abs(plain.accept(d, "layer4") - plain.greedy_agreement[d]["layer4"]) > 1e-3
               for d in ("layer1", "layer2"))
    assert pv.get("window_saving_seconds") == [0.5, 0.6, 0.7, 0.8]
    assert plain.provenance.get("window_saving_seconds") is None
    for e, p in zip(prof.context_costs, plain.context_costs):
        for m in ("layer1", "layer2", "layer4"):
            assert all(0.5 + 0.9 * t < c < 1 + 0.9 * t for t, c in enumerate(e.cost_curve[m])), m
            assert all(c < q for c, q in zip(e.cost_curve[m], p.cost_curve[m])), m
            assert e.cost[m] == pytest.approx(e.cost_curve[m][0])
        assert all(0.5 + 0.9 * t < c < 1 + 0.9 * t for t, c in enumerate(e.verify_cost["layer4"]["layer1"]))
    r = _cli(["profile", "merge", str(outs["k1"]), str(outs["k1m"]), "-o", str(tmp_path / "m.json")])
    assert r.exit_code == 2 and "provenance.min_p" in r.output
    r = _cli(["solve", "--profile", str(outs["k1m"]), "--tmax", "3", "--out", str(tmp_path / "plan.json")])
    assert r.exit_code == 0 and "for sampling at temperature 0.8, top-k 1, min-p 0.05" in " ".join(r.output.split())
    r = _cli(["profile", "--model", str(tiny["model"]), "--prompts", str(tiny["prompts"]), "--out",
              str(tmp_path / "x.json"), "--top-k", "40"])
    assert r.exit_code == 2 and "--top-k 40 needs --temperature > 0" in r.output


def test_time_window_saving_times_every_pass_size():
    """What a pass over t = 1..tmax1 tokens saves by the filters' window: one finite value per t, on a target with
    a screen; refused where the filters keep every logit."""
    from hsd_opt.engine.layered import LayeredLM
    from hsd_opt.profiler.costs import time_window_saving
    from tests.helpers import make_tiny_llama

    eng = LayeredLM(make_tiny_llama(seed=3, scale=8.0))
    text = torch.randint(3, 64, (80,), generator=torch.Generator().manual_seed(1)).tolist()
    c = time_window_saving(eng, text, 1.0, 1.0, 40, 0.05, 5, repeats=2)
    assert len(c) == 5 and all(abs(x) < 1.0 for x in c)
    with pytest.raises(ValueError):
        time_window_saving(eng, text, 1.0, 0.9, 0, 0.05, 5)     # min-p under top-p: every logit


def test_time_draw_saving_times_every_pass_size():
    """What a pass over t = 1..tmax1 tokens saves by draws: one finite value per t, on a target with a screen."""
    from hsd_opt.engine.layered import LayeredLM
    from hsd_opt.profiler.costs import time_draw_saving
    from tests.helpers import make_tiny_llama

    eng = LayeredLM(make_tiny_llama(seed=3, scale=8.0))
    assert eng.picks_cheaply
    text = torch.randint(3, 64, (80,), generator=torch.Generator().manual_seed(1)).tolist()
    c = time_draw_saving(eng, text, 1.0, 5, repeats=2)
    assert len(c) == 5 and all(abs(x) < 1.0 for x in c)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_torchrun_two_gloo_ranks_equal_single_run(full_run, tiny, tmp_path):
    out = tmp_path / "dist.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(_free_port()), "-m", "hsd_opt", "profile", "--model", str(tiny["model"]), "--prompts",
           str(tiny["prompts"]), "--out", str(out), "--max-new-tokens", "8", "--draft-model", str(tiny["copy"]),
           "--token-drafters", "ngram,lookup,bigram,aded", "--device", "cpu"] + FAST
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=str(tmp_path), env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    _same_stats(_stats(out), _stats(full_run))
    prof, _ = load_profile(out)
    assert prof.provenance.get("world_size") == 2
    assert not list(tmp_path.glob("*.partial*"))


@pytest.mark.slow
def test_torchrun_ranks_of_which_one_has_a_schemas_prompt_merge(tmp_path):
    """A rank that profiled a JSON schema's prompt keeps counters (its forced tokens) the others lack: the
    all-reduce of vectors of different lengths aborted the run (gloo: "data size doesn't match")."""
    from tests.helpers import save_tiny_family

    big, _ = save_tiny_family(tmp_path / "fam")
    prompts = tmp_path / "p.jsonl"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    prompts.write_text("\n".join(json.dumps(x) for x in ({"prompt": "a b c a b", "task": "chat"},
                                                        {"prompt": "d e", "task": "chat"},
                                                        {"prompt": "give json", "schema": schema})) + "\n")
    out = tmp_path / "dist.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(_free_port()), "-m", "hsd_opt", "profile", "--model", str(big), "--prompts", str(prompts),
           "--out", str(out), "--max-new-tokens", "6", "--token-drafters", "ngram", "--quantized", "none",
           "--cost-contexts", "8", "--batch-sizes", "1", "--device", "cpu"] + FAST
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=str(tmp_path), env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    st = _stats(out)
    assert st.counters["prompts"] == 3 and st.counters["forced_tokens.json"] > 0


def test_merges_tell_the_same_prompts_and_draws_apart_whatever_their_files_and_refuse_other_tokenizers(tmp_path):
    """A merge says which positions it counts twice by the prompts each file measured (their content, and the draw
    where sampled), not by the files' names: the same prompts in two prompt files, a sampled file merged twice
    beside another seed's; shards of one prompt set with other ``--max-prompts`` are refused. A model whose
    tokenizer or chat template changed, its weights not, is another model to a resume and a merge."""
    from tests.helpers import TINY_CHAT_TEMPLATE

    model = save_tiny(tmp_path / "m")
    lines = (tmp_path / "all.jsonl", tmp_path / "more.jsonl")
    write_prompts(tmp_path / "src.jsonl", n=4)
    src = (tmp_path / "src.jsonl").read_text().splitlines(keepends=True)
    lines[0].write_text("".join(src[:3]))
    lines[1].write_text("".join(src[:3] + src[3:] + ["{\"prompt\": \"w5 w6 w7\", \"task\": \"chat\"}\n"]))

    def profile(out: str, prompts: Path, *extra: str):
        r = _cli(["profile", "--model", str(model), "--prompts", str(prompts), "--out", str(tmp_path / out),
                  "--max-new-tokens", "4", "--token-drafters", "ngram", "--quantized", "none", "--cost-contexts",
                  "8", "--device", "cpu", *extra] + FAST)
        assert r.exit_code == 0, cli_output(r)
        return str(tmp_path / out)

    def merge(*files: str):
        return _cli(["profile", "merge", *files, "-o", str(tmp_path / "merged.json")])

    a, b = profile("a.json", lines[0]), profile("b.json", lines[1])        # two files, three prompts in both
    r = merge(a, b)
    assert r.exit_code == 0 and "3 of them the same prompt" in cli_output(r), cli_output(r)
    t0, t1 = (profile(f"t{s}.json", lines[0], "--temperature", "1", "--seed", str(s)) for s in (0, 1))
    r = merge(t0, t1)
    assert r.exit_code == 0 and "counted twice" not in cli_output(r), cli_output(r)
    m01 = tmp_path / "m01.json"
    (tmp_path / "merged.json").rename(m01)
    for files in ((t0, t1, t1), (str(m01), t1)):      # t1's draws twice, the second file or a merge holding it
        r = merge(*files)
        assert r.exit_code == 0 and "same prompt and draw" in cli_output(r), cli_output(r)
    s0, s1 = profile("s0.json", lines[1], "--shard", "0/2"), profile("s1.json", lines[1], "--shard", "1/2",
                                                                     "--max-prompts", "2")
    r = merge(s0, s1)
    assert r.exit_code == 2 and "provenance.max_prompts" in cli_output(r), cli_output(r)
    # the chat template changed in place: the revision (config and weights) is the same, the tokenizer is not
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TINY_CHAT_TEMPLATE}))
    c = profile("c.json", lines[0])
    assert load_profile(c)[0].provenance.get("revision") == load_profile(a)[0].provenance.get("revision")
    r = merge(a, c)
    assert r.exit_code == 2 and "provenance.tokenizer_sha256" in cli_output(r), cli_output(r)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    crashed = ProfileConfig(model=str(model), out=tmp_path / "r.json", prompts=lines[0], max_new_tokens=4,
                            device="cpu", token_drafters=["ngram"], tmax=2, cost_repeats=1, curve_repeats=1,
                            progress=False, threads=1, cost_contexts=(8,))

    def crash(k):
        raise RuntimeError("crashed")

    with pytest.raises(RuntimeError, match="crashed"):
        run_profile(crashed, on_prompt=crash)
    partial = Path(str(tmp_path / "r.json") + ".partial.json")
    assert partial.is_file()
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TINY_CHAT_TEMPLATE}))
    with pytest.raises(InputFileError, match="settings.tokenizer_sha256"):
        run_profile(dataclasses.replace(crashed, resume=True))


def test_run_profile_destroys_the_process_group_it_made_and_leaves_a_callers(tiny, tmp_path, monkeypatch):
    """A group left alive at exit meets the interpreter's teardown with gloo's threads running, which now and then
    aborted a torchrun rank after its work was written; a caller's own group is the caller's to close."""
    import torch.distributed as dist

    from hsd_opt.profiler.dist import ensure_process_group

    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port())), ("RANK", "0"),
                 ("WORLD_SIZE", "1")):
        monkeypatch.setenv(k, v)
    cfg = ProfileConfig(model=str(tiny["model"]), out=tmp_path / "a.json", prompts=tiny["prompts"],
                        max_new_tokens=3, device="cpu", token_drafters=["ngram"], tmax=2, cost_repeats=1,
                        curve_repeats=1, progress=False, threads=1, batch_sizes=(1,), cost_contexts=(8,))
    try:
        ensure_process_group(torch.device("cpu"))              # as the profiler's first collective makes it
        assert dist.is_initialized()
        run_profile(cfg)
        assert not dist.is_initialized()
        dist.init_process_group(backend="gloo")                # the caller's own
        run_profile(dataclasses.replace(cfg, out=tmp_path / "b.json"))
        assert dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- bad input


def test_bad_inputs_exit_2(tiny, tmp_path):
    base = ["profile", "--out", str(tmp_path / "p.json"), "--device", "cpu"] + FAST
    cases = []
    r = _cli(base + ["--model", "no-such-model"])
    cases.append((r, "smollm2-135m"))                                    # lists the known models
    r = _cli(base + ["--model", str(tmp_path / "missing.gguf")])
    cases.append((r, "GGUF file not found"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    r = _cli(base + ["--model", str(tiny["model"]), "--prompts", str(empty)])
    cases.append((r, "empty prompt file"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "w1 w2", "task": "chat"}\n{"prompt": "w1\n')
    r = _cli(base + ["--model", str(tiny["model"]), "--prompts", str(bad)])
    cases.append((r, "line 2"))
    noprompt = tmp_path / "noprompt.jsonl"
    noprompt.write_text('{"text": "w1 w2", "task": "chat"}\n')
    r = _cli(base + ["--model", str(tiny["model"]), "--prompts", str(noprompt)])
    cases.append((r, 'missing "prompt"'))
    r = _cli(base + ["--model", str(tiny["model"]), "--prompts", str(tiny["prompts"]), "--layers", "2,9"])
    cases.append((r, "1..4"))
    r = _cli(base + ["--model", str(tiny["model"]), "--prompts", str(tiny["prompts"]), "--draft-model",
                     str(tiny["other_tok"])])
    cases.append((r, "tokenizer differs"))
    r = _cli(base + ["--model", str(tiny["model"]), "--prompts", str(tiny["prompts"]), "--quantized",
                     f"{tiny['other_tok']}:int8"])
    cases += [(r, "tokenizer differs"), (r, "error: --quantized ")]      # it named --draft-model, not given
    r = _cli(base + ["--model", str(tiny["model"]), "--prompts", str(tiny["prompts"]), "--token-drafters", "foo"])
    cases.append((r, "unknown token drafter"))
    r = _cli(base + ["--model", str(tiny["model"]), "--prompts", str(tiny["prompts"]), "--top-p", "0.9"])
    cases.append((r, "--top-p 0.9 needs --temperature > 0"))
    r = _cli(base + ["--model", str(tiny["model"]), "--prompts", str(tiny["prompts"]), "--temperature", "1",
                     "--top-p", "0"])
    cases.append((r, "--top-p: expected a value in (0, 1]"))
    r = _cli(base + ["--model", str(tiny["model"]), "--prompts", str(tiny["prompts"]), "--cost-contexts", "64,x"])
    cases.append((r, "--cost-contexts: expected context lengths in tokens"))
    for flags, needle in [(["--cost-repeats", "0"], "--cost-repeats: expected >= 1"),
                          (["--max-prompts", "0"], "--max-prompts: expected >= 1"),
                          (["--threads", "-1"], "--threads: expected an integer in 0..4096"),
                          (["--tmax", "64"], "--tmax: expected an integer in 1..63"),
                          (["--layers", "5-2"], "--layers: the range '5-2' runs backwards"),
                          (["--out", str(tmp_path)], "is a directory"),
                          (["--temperature", "nan"], "--temperature: expected a finite value"),
                          (["--temperature", "1", "--seed", str(2**60)], "--seed: expected an integer of magnitude")]:
        cases.append((_cli(base + ["--model", str(tiny["model"]), "--prompts", str(tiny["prompts"])] + flags), needle))
    for r, needle in cases:
        text = " ".join(r.output.split())
        assert r.exit_code == 2, (needle, r.output)
        assert needle in text, (needle, r.output)
        assert "Traceback" not in r.output


def test_levels_of_another_width_are_refused_by_the_hierarchy(tiny):
    """Engines whose heads have more (or fewer) rows than the target's crashed sampling, grammars and logit biases
    stacking their distributions: the hierarchy refuses them, naming the level and what gives a draft model the
    target's width (the CLI does it, tests/test_family.py)."""
    from hsd_opt.engine.layered import LayeredLM
    from hsd_opt.runtime.decode import HSD, Level

    target = LayeredLM(make_tiny_llama(seed=0, vocab_size=64, layers=2))
    for extra in (8, -4):
        wide = make_tiny_llama(seed=5, vocab_size=64 + extra, layers=2, scale=8.0)
        with pytest.raises(HsdError, match=f"level 'd': its head has {64 + extra} rows, the target's 64.*match_width"):
            HSD([Level("d", LayeredLM(wide), 2), Level("t", target, 2)], [3])


def test_default_suite_is_packaged_and_valid():
    suite = load_prompts(None)
    assert len(suite.items) >= 8 and {"code", "math", "chat", "summarization"} <= set(suite.tasks)
    # data/prompts.jsonl is the packaged suite itself (a link), not a copy that could drift
    repo_copy = REPO / "data" / "prompts.jsonl"
    assert repo_copy.resolve() == (REPO / "hsd_opt" / "data" / "prompts.jsonl").resolve()


@pytest.mark.slow
def test_trained_heads_are_used_and_recorded(tiny, tmp_path):
    from hsd_opt.heads.io import save_heads
    from hsd_opt.heads.modules import TranslatorHead
    from hsd_opt.models.loading import load_model

    lm = load_model(str(tiny["model"]), device="cpu", dtype="float32")
    torch.manual_seed(0)
    heads = {b: TranslatorHead(lm.model, "affine") for b in (1, 2)}
    with torch.no_grad():
        for h in heads.values():
            for p in h.parameters():
                if p.requires_grad:
                    p.add_(0.5 * torch.randn_like(p))
    hp = tmp_path / "heads.safetensors"
    save_heads(hp, heads, lm.model, model_id=lm.model_id, revision=lm.revision)
    out = tmp_path / "h.json"
    r = _cli(["profile", "--model", str(tiny["model"]), "--prompts", str(tiny["prompts"]), "--out", str(out),
              "--max-new-tokens", "4", "--token-drafters", "none", "--layers", "1,2", "--heads", str(hp),
              "--device", "cpu"] + FAST)
    assert r.exit_code == 0, r.output
    prof, _ = load_profile(out)
    pv = prof.provenance.to_dict()
    assert pv["heads"] == str(hp) and len(pv["heads_sha256"]) == 64
    plain = tmp_path / "plain.json"
    r = _cli(["profile", "--model", str(tiny["model"]), "--prompts", str(tiny["prompts"]), "--out", str(plain),
              "--max-new-tokens", "4", "--token-drafters", "none", "--layers", "1,2", "--device", "cpu"] + FAST)
    assert r.exit_code == 0, r.output
    p2, _ = load_profile(plain)
    assert p2.provenance.heads is None
    assert prof.acceptance["layer1"]["layer4"] != pytest.approx(p2.acceptance["layer1"]["layer4"], abs=1e-9)
    r = _cli(["profile", "--model", str(tiny["model"]), "--prompts", str(tiny["prompts"]), "--out", str(plain),
              "--heads", str(tmp_path / "nope.safetensors"), "--device", "cpu"] + FAST)
    assert r.exit_code == 2 and "nope.safetensors" in r.output


def test_pairwise_overlap_blocks_and_batched_heads():
    from hsd_opt.profiler.measure import exit_logits, pairwise_overlap

    P = torch.softmax(torch.randn(5, 3, 23) * 2, -1)
    got = pairwise_overlap(P, block=4)                                 # ragged last block
    for i in range(5):
        for j in range(5):
            want = torch.minimum(P[i], P[j]).sum(-1) if i < j else torch.zeros(3)
            assert torch.allclose(got[i, j], want, atol=1e-6)
    model = make_tiny_llama(seed=7, vocab_size=40, layers=3)
    eng = LayeredLM(model, exit_heads={2: lambda h: torch.zeros(h.shape[0], 40)})
    neural = [NeuralDrafter(f"layer{b}", "early_exit", eng, b) for b in (1, 2, 3)]
    hid = {id(eng): eng.hidden_states(list(range(3, 12)), [1, 2, 3])}
    rows = torch.tensor([2, 5, 7])
    lgs = exit_logits(neural, hid, rows)
    for nd, lg in zip(neural, lgs):
        assert torch.allclose(lg, eng.head(hid[id(eng)][nd.boundary][rows], nd.boundary), atol=1e-5)
    assert torch.count_nonzero(lgs[1]) == 0                            # the trained head of exit 2 was used


@pytest.mark.slow
def test_verify_curve_runs_lower_layers_on_the_last_draft():
    """A verify pass of exit b over drafts of exit a < b runs layers a..b-1 on every position and layers 0..a-1
    on the last draft only (the drafter never fed it back in): the engine's own work accounting says so too."""
    from hsd_opt.engine.layered import LayeredLM
    from hsd_opt.profiler.costs import LayerCosts
    from tests.helpers import make_tiny_llama

    seg = {b: [1.0 * b * t for t in range(1, 5)] for b in range(1, 5)}  # advance to b (layer b-1) on t tokens: b*t s
    lc = LayerCosts(context=64, n_layers=4, seg=seg, head={-1: [0.5] * 4})
    curve = lc.verify_curve(1, 4, 4)
    assert curve[0] == pytest.approx((2 + 3 + 4) * 1 + 0.5)            # t = 1: no draft, x0 already at layer 1
    assert curve[2] == pytest.approx(1 * 1 + (2 + 3 + 4) * 3 + 0.5)    # t = 3: layer 0 on the last draft only
    eng = LayeredLM(make_tiny_llama(seed=7))
    st = eng.new_state(32, save_boundaries=[1, 4])
    eng.append(st, list(range(3, 11)))
    eng.advance(st, 4)
    eng.append(st, [5])                      # x0, the verifier's own last token
    for d in (6, 7):                         # exit 1 drafts two tokens: feeds x0 and the first draft
        eng.advance(st, 1)
        eng.append(st, [d])
    assert eng.advance(st, 4) == 1 * 1 + 3 * 3  # layer 0 on the last draft, layers 1..3 on three positions
    # with a direct whole-model measurement, the target's curve is that measurement, and every other curve (exits,
    # verify passes) is its segment sum scaled by measured / summed over the whole model at each t
    lc.full = [20.0, 30.0, 40.0, 50.0]
    assert lc.curve(4, 4) == [20.0, 30.0, 40.0, 50.0] and lc.step_cost(4) == 20.0
    whole = [0.5 + 10.0 * t for t in range(1, 5)]
    assert lc.verify_curve(1, 4, 4)[2] == pytest.approx(curve[2] * 40.0 / whole[2])
    assert lc.curve(2, 4) == pytest.approx([(0.5 + 3.0 * t) * f / w for t, f, w in zip(range(1, 5), lc.full, whole)])


@pytest.mark.slow
def test_measure_costs_times_every_context_through_the_engine():
    """Costs at two contexts, timed through the engine's public calls: one result per context, the whole model
    timed directly at the first, every curve non-decreasing in t; the progress callback fires as often as
    the passes ``plan_passes`` lists say (one call per prefill chunk, step check, segment and direct round)."""
    from hsd_opt.engine.layered import LayeredLM
    from hsd_opt.profiler.costs import measure_costs
    from tests.helpers import make_tiny_llama, timing_calls

    steps: list[str] = []
    eng = LayeredLM(make_tiny_llama(seed=7))
    states: dict = {}
    lcs = measure_costs(eng, [1, 4], tmax=3, repeats=1, warmup=0, curve_repeats=1, contexts=[300, 8],
                        on_step=lambda m, s: steps.append(m), keep_states=states)
    assert [lc.context for lc in lcs] == [8, 300] and sorted(states) == [8, 300] and states[300].n == 300
    assert len(steps) == timing_calls([8, 300], 2, tmax=3, repeats=1, warmup=0, curve_repeats=1)
    assert any("prefill 300/300" in s for s in steps)
    from hsd_opt.engine.quantized import QuantizedLM

    q = QuantizedLM(eng.model, bits=8)           # a quantized copy takes the target's keys and values, as at run time
    qsteps: list[str] = []
    qlcs = measure_costs(q, [4], tmax=3, repeats=1, warmup=0, curve_repeats=1, contexts=[8, 300],
                         on_step=lambda m, s: qsteps.append(m), share_from=(eng, states))
    assert len(qsteps) == timing_calls([8, 300], 1, tmax=3, repeats=1, warmup=0, curve_repeats=1, shared=True)
    assert "context 300: prefill 300/300 tokens (shared)" in qsteps and len(qlcs) == 2
    first, second = lcs
    assert len(first.full) == 4 and all(x > 0 for x in first.full)
    assert first.curve(4, 4) == first.full and second.curve(4, 4) == second.full
    assert set(first.check["measured"]) == {"1", "2", "4"} and first.step   # the raw medians, kept as a check
    for lc in lcs:
        for b in (1, 4):
            assert lc.seg[b] == sorted(lc.seg[b]) and len(lc.seg[b]) == 4      # isotonic: never cheaper for more t
        assert lc.full == sorted(lc.full)
        assert lc.verify_curve(1, 4, 4)[1] <= lc.curve(4, 4)[1]             # activation reuse: layer 0 on one


def test_direct_timings_run_the_layers_as_the_runtime_does(monkeypatch):
    """A pass of the target with no exit drafting is one run of every layer at run time; the profiler's direct
    timing of the whole model (its cost curve) is too, not the segments' state that stops at every exit."""
    from hsd_opt.engine.layered import LayeredLM
    from hsd_opt.profiler.costs import measure_costs
    from tests.helpers import make_tiny_llama

    eng = LayeredLM(make_tiny_llama(seed=7))
    n = eng.n_layers
    runs: list[tuple[int, int]] = []
    real = eng.run_layers
    monkeypatch.setattr(eng, "run_layers", lambda l0, l1, *a: runs.append((l0, l1)) or real(l0, l1, *a))
    lc = measure_costs(eng, list(range(1, n + 1)), tmax=3, repeats=1, warmup=0, curve_repeats=1, contexts=[8])[0]
    assert runs.count((0, n)) >= len(lc.full)          # every directly timed pass (and the target's step check)
    assert set(runs) - {(0, n)} <= {(b - 1, b) for b in range(1, n + 1)} | {(0, b) for b in range(1, n + 1)}
    assert lc.curve(n, 4) == lc.full


def test_monotone_in_context_keeps_the_order_in_t():
    from hsd_opt.profiler.costs import monotone_in_context

    rng = np.random.default_rng(5)
    for _ in range(200):
        k, n = int(rng.integers(1, 5)), int(rng.integers(1, 7))
        fit = monotone_in_context(rng.uniform(0.1, 1.0, (k, n)).tolist())
        assert all(row == sorted(row) for row in fit)                          # non-decreasing in t
        assert all(fit[i][t] <= fit[i + 1][t] for i in range(k - 1) for t in range(n))   # and in the context
    assert monotone_in_context([[1.0, 3.0], [2.0, 2.0]]) == [[1.0, 2.5], [2.0, 2.5]]


def test_cost_contexts_fit_the_models_positions():
    from hsd_opt.profiler.costs import fit_contexts, t_grid

    assert fit_contexts([64, 512, 2048], 8192, 15) == [64, 512, 2048]
    assert fit_contexts([64, 512, 2048], 1024, 15) == [64, 512, 1007]       # lowered to the longest that fits
    assert fit_contexts([600, 2048], 512, 3) == [507] and fit_contexts([9], None, 3) == [9]
    assert t_grid(16) == [1, 2, 4, 8, 16] and t_grid(4) == [1, 2, 4] and t_grid(1) == [1] and t_grid(6) == [1, 2, 4, 6]


def test_isotonic_fit():
    from hsd_opt.profiler.costs import isotonic

    assert isotonic([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert isotonic([5.0, 1.0, 0.0]) == [2.0, 2.0, 2.0]
    assert isotonic([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0] and isotonic([]) == []


def test_time_sampling_is_a_non_decreasing_cost_per_pass():
    """The sampling cost of a pass over t = 1..tmax1 tokens: positive, non-decreasing, one value per t."""
    from hsd_opt.profiler.costs import time_sampling

    rows = torch.randn(40, 5000, generator=torch.Generator().manual_seed(0)) * 3
    c = time_sampling(rows, 0.7, 0.9, 6, repeats=3)
    assert len(c) == 6 and all(x > 0 for x in c) and c == sorted(c)
    assert time_sampling(rows, 1.0, 1.0, 1, repeats=2)[0] > 0


def test_cost_prefill_chunks_are_whole_kernel_passes_for_quantized_copies():
    """A quantized copy runs long passes on the kernels in passes of MAX_PASS: its prefill chunks are whole
    passes (65 tokens would be a pass and a step); a float engine's stay longer than one pass (its GEMM path)."""
    from types import SimpleNamespace

    from hsd_opt.engine.kernels import MAX_PASS
    from hsd_opt.profiler.run import PREFILL_CHUNK, PROGRESS_SECONDS, prefill_chunk

    copy, dense = SimpleNamespace(long_passes_on_kernels=True), SimpleNamespace(long_passes_on_kernels=False)
    for per_token in (PROGRESS_SECONDS, PROGRESS_SECONDS / 100, PROGRESS_SECONDS / 150, PROGRESS_SECONDS / 1e4):
        c, d = prefill_chunk(copy, per_token), prefill_chunk(dense, per_token)
        assert c % MAX_PASS == 0 and MAX_PASS <= c <= max(MAX_PASS, PREFILL_CHUNK)
        assert MAX_PASS < d <= max(MAX_PASS + 1, PREFILL_CHUNK)
    assert prefill_chunk(copy, PROGRESS_SECONDS / 150) == 128 and prefill_chunk(dense, PROGRESS_SECONDS / 150) == 150


def test_auto_threads_follow_what_the_machine_does_now(monkeypatch):
    """``--threads 0`` keeps torch's threads unless other processes keep the cores busy now (not a load average
    that still counts a job that ended a minute ago); then 1 thread, said and recorded."""
    import os

    import torch

    from hsd_opt.profiler.run import busy_cores_now, set_threads

    before = torch.get_num_threads()
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))      # a busy minute ago: ignored
    try:
        torch.set_num_threads(2)
        said = []
        assert set_threads(0, said.append, busy=lambda: 0.1) == "torch default" and not said
        assert torch.get_num_threads() == 2
        note = set_threads(0, said.append, busy=lambda: 1.9)
        assert torch.get_num_threads() == 1 and note.startswith("auto: 1") and "busy now" in said[0]
        torch.set_num_threads(2)
        assert set_threads(3, said.append, busy=lambda: 2.0) == "--threads 3" and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
    busy = busy_cores_now(0.05)
    assert busy is None or 0.0 <= busy <= 2.5


def test_merge_costs_takes_one_profiles_rates_and_anothers_costs(tmp_path):
    """Plans for hardware the rates were not measured on: the rates (and draft rates, statistics) of one profile
    with every cost of another; a profile merged with itself is itself (but for where its costs came from); a pool
    the costs do not cover is refused, naming the drafter."""
    import numpy as np

    from hsd_opt.errors import InputFileError
    from hsd_opt.formats import save_profile
    from hsd_opt.profiler.assemble import merge_costs
    from hsd_opt.solver.api import solve
    from tests.helpers import random_profile, run_cli

    here = random_profile(np.random.default_rng(1), 6, verify_cost=True, cost_curve=True, contexts=True,
                          abstaining=True)
    there = random_profile(np.random.default_rng(2), 6, verify_cost=True, cost_curve=True, contexts=True,
                           abstaining=True)
    m = merge_costs(here, there, "here.json", "there.json")
    assert m.acceptance == here.acceptance and m.stats == here.stats
    for e in m.models:
        assert e.cost == there.entry(e.name).cost and e.draft_rate == here.entry(e.name).draft_rate
    assert m.cost_curve == there.cost_curve and m.verify_cost == there.verify_cost
    assert [c.to_dict() for c in m.context_costs] == [c.to_dict() for c in there.context_costs]
    assert m.provenance.get("costs_from")["file"] == "there.json"
    same = merge_costs(here, here, "here.json", "here.json").to_dict()
    want = here.to_dict()
    same.pop("provenance"), want.pop("provenance", None)
    assert same == want
    assert solve(merge_costs(here, here, "a", "a"), 6).hierarchy == solve(here, 6).hierarchy
    small = random_profile(np.random.default_rng(3), 4)
    with pytest.raises(InputFileError, match="there.json: models: has no costs for d4, d5"):
        merge_costs(here, small, "here.json", "there.json")
    save_profile(here, tmp_path / "here.json")
    save_profile(there, tmp_path / "there.json")
    res = run_cli("profile", "merge-costs", "--rates", tmp_path / "here.json", "--costs", tmp_path / "there.json",
                  "--out", tmp_path / "m.json")
    assert res.exit_code == 0 and (tmp_path / "m.json").is_file()
    assert run_cli("solve", "--profile", tmp_path / "m.json", "--tmax", 6, "--out", tmp_path / "p.json").exit_code == 0


def test_json_tasks_on_a_tokenizer_llguidance_cannot_read_name_the_flag(tiny, tmp_path):
    """A schema's grammar needs a tokenizer llguidance reads (the tiny word-level one is not): the error names
    the flag that brought the schemas in, one line, exit 2."""
    r = _cli(["profile", "--model", str(tiny["model"]), "--prompts", str(tiny["prompts"]), "--json-tasks", "1",
              "--out", str(tmp_path / "p.json"), "--device", "cpu"] + FAST)
    out = cli_output(r)
    assert r.exit_code == 2 and "--json-tasks" in out and "llguidance" in out and "Traceback" not in out, out


def test_costs_that_order_two_models_the_other_way_keep_their_measured_pair(tmp_path):
    """A pair of verifying models is stored once, the cheaper first in the order the rates were measured in;
    costs of another device that order them the other way round (``merge-costs``) still give the solver that pair
    (it offered the pair to neither order before); a token drafter's pair is never read backwards."""
    from dataclasses import replace

    import numpy as np

    from hsd_opt.profiler.assemble import merge_costs
    from hsd_opt.solver.hierarchy import cost_order
    from hsd_opt.solver.instance import build_instance
    from tests.helpers import random_profile

    here = random_profile(np.random.default_rng(5), 6, missing=0.0, abstaining=True)
    costs = replace(here, models=[replace(m, cost=m.cost if m.name == here.target else 0.9 - m.cost)
                                  for m in here.models])          # every drafter's cost order reversed
    merged = merge_costs(here, costs, "here.json", "there.json")
    stored = [(d, v) for d, row in here.acceptance.items() for v in row if v != here.target]
    both = [(d, v) for d, v in stored if here.entry(d).can_verify and here.entry(v).can_verify]
    assert both, "the random pool has pairs of verifying drafters"
    for d, v in both:                                   # now v is the cheaper: it drafts for d
        assert merged.accept(v, d) == here.acceptance[d][v]
    for d, v in stored:
        if not here.entry(d).can_verify:
            assert merged.accept(v, d) is None
    inst = build_instance(merged, 4)
    offered = {(inst.names[k], inst.names[i]) for i, ks in enumerate(inst.below) for k in ks}
    assert offered == {(v, d) for d, v in both}
    assert cost_order(merged)[: len(inst.names)] == inst.names


def test_no_flags_leave_the_rest_of_the_default_pool_as_it_was(tiny, monkeypatch, tmp_path):
    """``--no-ngram`` (any ``--no-*``) takes one drafter out of the default pool and leaves the others its own: a
    bigram table not yet cached is skipped with a warning, not built (minutes on a real model); named in
    ``--token-drafters`` it is built."""
    from hsd_opt.commands.profile import _token_drafter_names
    from hsd_opt.drafters import bigram as bg
    from hsd_opt.models.loading import load_model
    from hsd_opt.profiler.pool import _pool_token_drafters

    flags = {"ngram": True, "lookup": False, "bigram": False, "aded": False}
    assert _token_drafter_names(None, flags) == (None, ("ngram",))
    assert _token_drafter_names(None, {k: False for k in flags}) == (None, ())
    assert _token_drafter_names("ngram,bigram", flags) == (["bigram"], ())
    built = []

    def build(model, key, **kw):
        built.append(key)
        return bg.random_bigram_table(int(model.config.vocab_size))

    monkeypatch.setattr(bg, "load_or_build_bigram_table", build)
    monkeypatch.setenv("HSD_CACHE", str(tmp_path / "cache"))      # no bigram table cached (the session's cache has)
    loaded = load_model(str(tiny["model"]), device="cpu")
    warnings: list[str] = []
    names, left_out = _token_drafter_names(None, flags)
    tds, _ = _pool_token_drafters(names, loaded, set(), warnings.append, left_out)
    assert [d.name for d in tds] == ["lookup"] and not built
    assert any("'bigram' skipped" in w and "not cached" in w for w in warnings)
    names, left_out = _token_drafter_names("bigram", flags)
    tds, _ = _pool_token_drafters(names, loaded, set(), warnings.append, left_out)
    assert [d.name for d in tds] == ["bigram"] and len(built) == 1


def test_ctrl_c_says_where_the_finished_prompts_are_only_where_they_were_kept(tiny, tmp_path, monkeypatch):
    """Interrupted, ``hsd profile`` names the partial file and ``--resume`` where the file is there, else says
    nothing was kept (it pointed at a file that did not exist, and suggested ``--resume`` to ``--costs-only``);
    exit code 130 either way."""
    import hsd_opt.profiler.run as run_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "run_profile", interrupted)
    out = tmp_path / "p.json"
    args = ["profile", "--model", str(tiny["model"]), "--prompts", str(tiny["prompts"]), "--out", str(out),
            "--device", "cpu"]
    r = _cli(args)
    assert r.exit_code == 130 and "interrupted before any prompt's statistics were kept" in cli_output(r)
    (tmp_path / "p.json.partial.json").write_text("{}")
    r = _cli(args)
    assert r.exit_code == 130 and f"are in {tmp_path / 'p.json.partial.json'}; rerun with --resume" in cli_output(r)
    r = _cli(args + ["--costs-only"])
    assert r.exit_code == 130 and "(--costs-only keeps none)" in cli_output(r) and "--resume" not in cli_output(r)


def test_a_prompt_that_cannot_fit_the_context_with_its_answer_is_refused_before_any_work(tiny, tmp_path):
    """``hsd run`` and ``hsd bench`` refuse it; ``hsd profile`` measured it past the model's positions."""
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"prompt": "w1"}) + "\n\n" + json.dumps({"prompt": " ".join(["w2"] * 600)}) + "\n")
    out = tmp_path / "p.json"
    r = _cli(["profile", "--model", str(tiny["model"]), "--prompts", str(prompts), "--out", str(out), "--device",
              "cpu", "--max-new-tokens", "4"])
    text = " ".join(cli_output(r).split())
    assert r.exit_code == 2 and f"{prompts}: line 3 has " in text and "context of 512 positions" in text, text
    assert not out.exists() and not (tmp_path / "p.json.partial.json").exists()


def test_an_unknown_draft_model_is_refused_before_the_target_loads(tiny, tmp_path, monkeypatch):
    """It was refused only after the target had loaded (about 10 s on the embedded model)."""
    import hsd_opt.models.loading as loading

    def no_loading(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(loading, "load_model", no_loading)
    r = _cli(["profile", "--model", str(tiny["model"]), "--prompts", str(tiny["prompts"]), "--out",
              str(tmp_path / "p.json"), "--device", "cpu", "--draft-model", "no-such-draft"])
    assert r.exit_code == 2 and "--draft-model no-such-draft: unknown model or alias" in r.output, r.output
