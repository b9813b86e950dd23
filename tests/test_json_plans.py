"""Plans for answers under a grammar: prompt lines carry their JSON schema, the profiler generates and measures
them under it (masked models compared, forced positions counted apart), ``hsd solve --per-task`` gives task ``json``
its own hierarchy with the share of forced tokens, and a batch runs a sequence of a task with that task's
hierarchy."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hsd_opt.engine.layered import LayeredLM
from hsd_opt.errors import InputFileError
from hsd_opt.formats import load_plan, load_profile
from hsd_opt.grammar.compiler import GrammarCompiler, GrammarSpec
from hsd_opt.grammar.constraint import Constraint, mask_logits
from hsd_opt.profiler import measure
from hsd_opt.profiler.measure import generate, profile_sequence
from hsd_opt.profiler.pool import NeuralDrafter
from hsd_opt.profiler.run import ProfileConfig, run_profile
from hsd_opt.prompts import JSON_TASK, load_prompts, with_json_tasks
from hsd_opt.runtime.batch import Batch
from hsd_opt.runtime.decode import HSD, Level
from tests.helpers import JSON_TOKENS, CycleDrafter, TinyTokenizer, make_tiny_llama, run_cli, save_tiny_family

EOS = 2
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tag": {"enum": ["ab", "cd"]}}, "required": ["name", "n", "tag"], "additionalProperties": False}


@pytest.fixture(scope="module")
def grammar():
    return GrammarCompiler(TinyTokenizer(JSON_TOKENS), EOS, 64).compile(GrammarSpec.json_schema(SCHEMA, "s.json"))


@pytest.fixture(scope="module")
def engine():
    return LayeredLM(make_tiny_llama(seed=3, vocab_size=64, layers=4, hidden=64, heads=4, kv_heads=2, scale=8.0))


def test_a_prompt_line_carries_its_schema_and_is_a_json_task_unless_it_names_one(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "a", "schema": SCHEMA}) + "\n" + json.dumps({"prompt": "b", "task": "x",
                                                                                   "schema": SCHEMA}) + "\n"
                 + json.dumps({"prompt": "c"}) + "\n")
    a, b, c = load_prompts(p).items
    assert (a.task, a.schema) == (JSON_TASK, SCHEMA) and (b.task, b.schema) == ("x", SCHEMA)
    assert (c.task, c.schema) == ("other", None)
    p.write_text(json.dumps({"prompt": "a", "schema": [1]}) + "\n")
    with pytest.raises(InputFileError, match=r'line 1.*"schema" must be a JSON schema object, got list'):
        load_prompts(p)


def test_the_shipped_json_tasks_join_a_suite_numbered_after_it():
    suite = load_prompts(None)
    both = with_json_tasks(suite, 3)
    assert both.items[:len(suite.items)] == suite.items and len(both.items) == len(suite.items) + 3
    extra = both.items[len(suite.items):]
    assert [it.index for it in extra] == list(range(len(suite.items), len(suite.items) + 3))
    assert all(it.task == JSON_TASK and isinstance(it.schema, dict) for it in extra)
    assert both.sha256 != suite.sha256 and with_json_tasks(suite, 0) is suite
    # messages name the joined suite: a task is placed there, not by its line of the shipped file (line 1 again)
    assert [it.place for it in extra] == [f"prompt {len(suite.items) + k}" for k in (1, 2, 3)]
    assert suite.items[0].place == "line 1"


def _masked_reference(eng, prompt, n, g):
    """Masked greedy decoding of the target alone, through the runtime (the reference of losslessness)."""
    return HSD([Level("layer4", eng, 4)], [], eos_ids=[EOS]).generate(prompt, n, constraint=Constraint(g)).token_ids


def test_the_profilers_continuation_under_a_grammar_is_masked_decodings(engine, grammar):
    for prompt in ([5, 9, 13], [40, 41, 42]):
        cont = generate(engine, prompt, 60, 0.0, {EOS}, constraint=Constraint(grammar))
        assert cont == _masked_reference(engine, prompt, 60, grammar)
        assert cont[-1] == EOS and Constraint(grammar).accepting(cont)


def test_under_a_grammar_the_profiler_compares_masked_models_and_leaves_forced_positions_out(engine, grammar,
                                                                                               monkeypatch):
    prompt = [5, 9, 13]
    cont = generate(engine, prompt, 60, 0.0, {EOS}, constraint=Constraint(grammar))
    c = Constraint(grammar)
    allowed = torch.stack([c.allowed(cont, k) for k in range(len(cont))])
    forced = np.array([c.only(cont, k) is not None for k in range(len(cont))])
    assert 0 < forced.sum() < len(cont)
    neural = [NeuralDrafter("layer1", "early_exit", engine, 1), NeuralDrafter("layer4", "target", engine, 4)]
    refused = CycleDrafter(64)                     # proposes ids in turn: mostly refused by the grammar
    acc, agr, acc_t, _, _ = profile_sequence(neural, [refused], prompt, cont, 0.0, chunk=5, allowed=allowed,
                                             forced=forced)
    keep = np.flatnonzero(~forced)
    assert acc.shape[-1] == acc_t.shape[-1] == len(keep)
    # the reference: each exit's masked softmax at the positions kept
    hidden = engine.hidden_states(prompt + cont[:-1], {1, 4})
    rows = torch.tensor(len(prompt) - 1 + keep)
    p = [torch.softmax(mask_logits(engine.head(hidden[b][rows], b), allowed[keep]), -1) for b in (1, 4)]
    ref = torch.minimum(p[0], p[1]).sum(-1).double().numpy()
    np.testing.assert_allclose(acc[0, 1], ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(agr[0, 1], (p[0].argmax(-1) == p[1].argmax(-1)).numpy())
    # a token drafter's refused proposal counts as none; an allowed one is priced by the masked target
    d = CycleDrafter(64)
    d.reset(prompt)
    props = []
    for g in range(len(cont)):
        props.append(d.propose(prompt + cont[:g], 1)[0])
        d.observe(prompt + cont[:g], [cont[g]])
    for j, g in enumerate(keep):
        t = props[g]
        if bool(allowed[g, t]):
            assert acc_t[0, 1, j] == pytest.approx(float(p[1][j, t]), rel=1e-5, abs=1e-7)
        else:
            assert np.isnan(acc_t[0, 1, j])
    assert np.isnan(acc_t[0, 1]).any()
    # a token drafter's seconds are those of the positions kept, the calls it is counted for (its cost per call)
    ticks = iter(range(10**6))
    monkeypatch.setattr(measure, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    *_, secs = profile_sequence(neural, [CycleDrafter(64)], prompt, cont, 0.0, chunk=5, allowed=allowed, forced=forced)
    assert secs.tolist() == [len(keep)]             # one tick a timed call


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("fam")
    big, _ = save_tiny_family(root)
    prompts = root / "p.jsonl"
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    prompts.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "w1 w2 w3 w1 w2", "task": "chat"}, {"prompt": "w4 w5", "task": "chat"},
        {"prompt": "give json", "schema": schema}, {"prompt": "more json", "schema": schema}]) + "\n")
    out = root / "prof.json"
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:      # a test cache; torch's thread count as it was (--threads 1 sets it)
        mp.setenv("HSD_CACHE", str(root / "hsd-cache"))
        try:
            run_profile(ProfileConfig(model=str(big), out=out, prompts=prompts, max_new_tokens=24, device="cpu",
                                      token_drafters=["ngram", "lookup"], tmax=3, cost_repeats=1, curve_repeats=1,
                                      progress=False, threads=1, layers=[2]))
        finally:
            torch.set_num_threads(threads)
    return {"root": root, "model": big, "profile": out}


def test_a_profile_counts_the_forced_positions_of_a_json_task_apart(family):
    prof, _ = load_profile(family["profile"])
    counters = prof.stats["counters"]
    forced, measured = counters["forced_tokens.json"], counters["generated_tokens.json"]
    assert forced > 0 and measured > 0 and "forced_tokens.chat" not in counters
    assert prof.provenance.get("forced_by_task") == {"json": forced}
    assert prof.provenance.get("positions_by_task")["json"] == measured
    assert counters["propose_calls.ngram"] == counters["generated_tokens"]       # drafters asked where not forced
    assert set(prof.acceptance_by_task) == {"chat", "json"}


def test_solve_per_task_gives_json_its_plan_with_the_forced_share(family, tmp_path):
    out = tmp_path / "plan.json"
    r = run_cli("solve", "--profile", family["profile"], "--tmax", "3", "--per-task", "--min-gain", "0",
                "--out", out)
    assert r.exit_code == 0, r.output
    assert "of its tokens forced by its grammar" in " ".join(r.output.split())
    plan = load_plan(out)
    prof, _ = load_profile(family["profile"])
    c = prof.stats["counters"]
    share = c["forced_tokens.json"] / (c["forced_tokens.json"] + c["generated_tokens.json"])
    assert plan.by_task["json"].forced_share == pytest.approx(share)
    assert plan.by_task["chat"].forced_share is None
    assert load_plan(out).to_dict()["by_task"]["json"]["forced_share"] == pytest.approx(share)   # round trip


def test_a_batch_runs_a_sequence_of_a_task_with_its_hierarchy_and_the_others_with_the_plans(engine, grammar):
    plain = HSD([Level("layer1", engine, 1), Level("layer4", engine, 4)], [3], eos_ids=[EOS])
    json_h = HSD([Level("cycle", drafter=CycleDrafter(64)), Level("layer4", engine, 4)], [2], eos_ids=[EOS])
    batch = Batch({1: plain, 4: plain}, max_active=4, by_task={JSON_TASK: {1: json_h, 4: json_h}})
    got: dict[str, object] = {}
    e1 = batch.add([5, 9, 13], 30, seed=None, on_done=lambda r, e: got.__setitem__("plain", r))
    e2 = batch.add([5, 9, 13], 30, seed=None, constraint=Constraint(grammar), task=JSON_TASK,
                   on_done=lambda r, e: got.__setitem__("json", r))
    batch.run()
    assert e1.decoding.hsd is plain and e2.decoding.hsd is json_h      # load switches stay within the task's plans
    assert got["plain"].token_ids == plain.generate([5, 9, 13], 30).token_ids
    assert got["json"].token_ids == _masked_reference(engine, [5, 9, 13], 30, grammar)


def test_asking_more_json_tasks_than_are_shipped_warns_and_takes_them_all(monkeypatch):
    from hsd_opt.profiler import run as profiler_run
    from hsd_opt.profiler.run import ProfileConfig, _threads_and_prompts
    from hsd_opt.prompts import json_tasks_path

    monkeypatch.setattr(profiler_run, "set_threads", lambda threads, warn: "as it is")   # torch's threads untouched

    shipped = len(load_prompts(json_tasks_path()).items)
    said: list[str] = []
    _, suite, items = _threads_and_prompts(ProfileConfig(model="m", out="o.json", json_tasks=shipped + 5, threads=1),
                                           said.append)
    assert sum(it.task == JSON_TASK for it in items) == shipped
    assert said == [f"--json-tasks {shipped + 5}: the package ships {shipped} JSON-schema tasks; profiling all "
                    f"{shipped}"]
    said.clear()
    _threads_and_prompts(ProfileConfig(model="m", out="o.json", json_tasks=shipped, threads=1), said.append)
    assert said == []
    _, suite, items = _threads_and_prompts(ProfileConfig(model="m", out="o.json", json_tasks=3, max_prompts=2,
                                                         threads=1), said.append)
    assert [it.task == JSON_TASK for it in items] == [False, False, True, True, True]   # --max-prompts: the suite's
    assert items[:2] == suite.items[:2] and items[2:] == suite.items[-3:]
