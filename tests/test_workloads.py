"""Workloads without a model: the Spec-Bench reader (first turn, all turns, bad lines), conversations for later
turns, per-task totals that add up to the overall ones, plans per task (the profile's per-task view, dp == brute
force on it, the ``by_task`` section of a plan, which plan a prompt of a task runs)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from hsd_opt.errors import HsdError, InputFileError
from hsd_opt.formats import Plan, load_plan, plan_from_dict, profile_from_dict
from hsd_opt.measure.report import Generation, Totals, totals_by
from hsd_opt.prompts import conversation_ids, encode_prompt, load_prompts, select_items, user_turns
from hsd_opt.runtime.runner import plan_for_prompt
from hsd_opt.solver import evaluate, simulate, solve, solve_tasks, task_profile
from hsd_opt.solver.brute import brute
from tests.helpers import cli_output, random_profile, run_cli

# Spec-Bench's question format, as in its data/spec_bench/question.jsonl (texts made up for the tests).
SPEC_BENCH = [
    {"question_id": 82, "category": "writing", "turns": ["Draft a short email.", "Now critique it."]},
    {"question_id": 100, "category": "translation", "turns": ["Translate to English: bonjour"]},
    {"question_id": 84, "category": "coding", "turns": ["Write is_prime(n).", "Explain it."]},
    {"question_id": 102, "category": "translation", "turns": ["Translate to English: merci"]},
    {"question_id": 200, "category": "qa", "turns": ["Who wrote Hamlet?"]},
]


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------------ the reader


def test_spec_bench_lines_read_as_they_are(tmp_path):
    suite = load_prompts(_write(tmp_path / "q.jsonl", SPEC_BENCH + [{"prompt": "our own", "task": "chat"}]))
    it = suite.items
    assert [x.prompt for x in it[:5]] == [q["turns"][0] for q in SPEC_BENCH]         # the first turn
    assert [x.task for x in it] == ["mt_bench", "translation", "mt_bench", "translation", "qa", "chat"]
    assert [x.category for x in it] == ["writing", "translation", "coding", "translation", "qa", "chat"]
    assert it[0].question_id == 82 and it[0].turns == tuple(SPEC_BENCH[0]["turns"])
    assert it[5].question_id is None and it[5].turns == ("our own",)                  # our lines keep working
    assert suite.tasks == ["chat", "mt_bench", "qa", "translation"]
    assert user_turns(it[0]) == ["Draft a short email."]
    assert user_turns(it[0], "all") == ["Draft a short email.", "Now critique it."]
    assert user_turns(it[1], "all") == ["Translate to English: bonjour"]
    assert it[0].key("group") == "mt_bench" and it[0].key("category") == "writing"


def test_select_items_per_task_is_deterministic(tmp_path):
    items = load_prompts(_write(tmp_path / "q.jsonl", SPEC_BENCH)).items
    assert [x.question_id for x in select_items(items, per_task=1)] == [82, 100, 200]
    assert [x.question_id for x in select_items(items, per_task=1, by="category")] == [82, 100, 84, 200]
    assert [x.question_id for x in select_items(items, per_task=2, limit=3)] == [82, 100, 84]
    assert select_items(items) == items
    with pytest.raises(HsdError, match="--limit-per-task"):
        select_items(items, per_task=0)


@pytest.mark.parametrize("line,needle", [
    ('{"question_id": 1, "category": "qa", "turns": "one string"}', '"turns" must be a non-empty list'),
    ('{"question_id": 1, "category": "qa", "turns": []}', '"turns" must be a non-empty list'),
    ('{"question_id": 1, "category": "qa", "turns": ["ok", " "]}', '"turns"[1]'),
    ('{"question_id": 1, "turns": ["ok"]}', '"category"'),
    ('{"question_id": true, "category": "qa", "turns": ["ok"]}', '"question_id"'),
    ('{"id": 1, "text": "neither format"}', 'missing "prompt"'),
    ('["a", "list"]', "Spec-Bench question"),
    ('{"prompt": 3}', '"prompt" must be a non-empty string'),
    ('{"question_id": 1, "category": "qa", "turns": ["unterminated"', "malformed JSON"),
    ('{"prompt": "a\\ud800b"}', '"prompt" holds a lone surrogate'),       # valid JSON, no Unicode text
    ('{"question_id": 1, "category": "qa", "turns": ["ok", "\\udfff"]}', '"turns"[1] holds a lone surrogate'),
    # the other fields that are printed: a traceback at the summary table, after every prompt had run
    ('{"prompt": "ok", "task": "\\ud800"}', '"task" holds a lone surrogate'),
    ('{"question_id": 1, "category": "q\\ud800", "turns": ["ok"]}', '"category" holds a lone surrogate'),
    ('{"question_id": "\\udc00", "category": "qa", "turns": ["ok"]}', '"question_id" holds a lone surrogate'),
    # two records of one id could not be told apart in --json output (accepted silently before)
    ('{"question_id": 82, "category": "qa", "turns": ["ok"]}', '"question_id" 82 again (first on line 1)'),
])
def test_bad_lines_are_named(tmp_path, line, needle):
    path = _write(tmp_path / "bad.jsonl", [SPEC_BENCH[0], line])
    with pytest.raises(InputFileError) as e:
        load_prompts(path)
    assert str(path) in str(e.value) and "line 2" in str(e.value) and needle in str(e.value)


def _chat_tokenizer():
    """A word-level tokenizer with a chat template (roles and contents as words)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>", "user", "assistant"] + [f"w{i}" for i in range(20)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
                         "{% if add_generation_prompt %}<s> assistant {% endif %}")
    return tok


def test_later_turns_follow_the_models_own_answers():
    tok = _chat_tokenizer()
    turns = ["w1 w2", "w3", "w4 w5"]
    assert conversation_ids(tok, turns) == encode_prompt(tok, "w1 w2")
    got = conversation_ids(tok, turns, ["w7 w8"])
    want = tok.apply_chat_template([{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w7 w8"},
                                    {"role": "user", "content": "w3"}], add_generation_prompt=True, tokenize=False)
    assert got == tok(want, add_special_tokens=False)["input_ids"]
    assert tok.decode(got) == "<s> user w1 w2 </s> <s> assistant w7 w8 </s> <s> user w3 </s> <s> assistant"
    raw = conversation_ids(tok, turns, ["w7", "w9"], raw=True)          # no template: texts joined by blank lines
    assert raw == tok("w1 w2\n\nw7\n\nw3\n\nw9\n\nw4 w5")["input_ids"]
    with pytest.raises(HsdError, match="user turns"):
        conversation_ids(tok, turns[:1], ["w7"])


def test_the_room_a_later_turn_is_checked_for_holds_the_answers_it_can_follow():
    """``check_room`` counted a later turn with empty answers, whose blank lines on either side ran together
    (``"\\n\\n\\n\\n"`` is 2 tokens of the embedded model's, ``"\\n\\n"`` twice 4): a run it passed stopped
    at the second turn. Whatever answer of up to ``max_new_tokens`` tokens comes first, the second turn and its
    answer fit in the least context it passes."""
    from hsd_opt.models.loading import load_tokenizer, model_source
    from hsd_opt.prompts import PromptItem, check_room

    tok = load_tokenizer(model_source("smollm2-135m")[1], "embedded")
    it = PromptItem(0, "What is 2+2?", "t", turns=("What is 2+2?", "And 3+3?"))
    answers = ["Four.", "4", "It is four.\n", "\n\nFour", " four", "Four!\n\n"]
    for raw in (True, False):
        for n_new in (2, 3, 5):
            least = next(c for c in range(1, 200) if _passes(check_room, it, tok, raw, n_new, c))
            for a in answers:
                if len(encode_prompt(tok, a, raw=True)) <= n_new:
                    assert len(conversation_ids(tok, it.turns, [a], raw)) + n_new <= least, (raw, n_new, a)


def _passes(check_room, it, tok, raw, n_new, context) -> bool:
    try:
        check_room([it], tok, raw, n_new, context, "f.jsonl", "all")
    except HsdError:
        return False
    return True


# ------------------------------------------------------------------------------------------------ totals


def _gen(item, turn, task, cat, n, secs, hierarchy=("d", "t"), calls=None, pred=0.01):
    levels = [{"name": h, "calls": calls or n, "drafted": n + k, "accepted": n - k, "rejections": k}
              for k, h in enumerate(hierarchy)]
    stats = {"decode_seconds": secs * 0.9, "target_calls": calls or n, "levels": levels}
    return Generation(item, turn, task, cat, list(range(n)), secs, stats, "plan", pred)


def test_per_task_totals_add_up_to_the_overall_ones():
    gens = [_gen(0, 0, "mt_bench", "writing", 7, 0.3), _gen(0, 1, "mt_bench", "writing", 5, 0.21, calls=2),
            _gen(1, 0, "qa", "qa", 9, 0.4, pred=0.02), _gen(2, 0, "mt_bench", "coding", 3, 0.1),
            _gen(3, 0, "rag", "rag", 11, 0.77, calls=4, pred=None)]
    for by in ("group", "category"):
        overall, per = totals_by(gens, by)
        o = overall.to_dict()
        tasks = [t.to_dict() for t in per.values()]
        for k in ("prompts", "generations", "tokens", "target_calls"):
            assert sum(t[k] for t in tasks) == o[k], k
        for k in ("seconds", "decode_seconds"):
            assert sum(t[k] for t in tasks) == pytest.approx(o[k], rel=1e-12), k
        for i in range(2):
            for k in ("calls", "drafted", "accepted", "rejections"):
                assert sum(t["levels"][i][k] for t in tasks) == o["levels"][i][k]
        assert o["tokens_per_target_call"] == o["tokens"] / o["target_calls"]
        assert o["predicted_seconds_per_token"] is None          # one generation without a prediction
    _, per = totals_by(gens, "group")
    assert list(per) == ["mt_bench", "qa", "rag"] and per["mt_bench"].to_dict()["prompts"] == 2
    mt = per["mt_bench"].to_dict()
    assert mt["predicted_seconds_per_token"] == pytest.approx(0.01)
    # two hierarchies in one total (plans per task): sums stay, per-level counters are dropped
    mixed = Totals()
    mixed.add(_gen(0, 0, "a", "a", 4, 0.1)).add(_gen(1, 0, "b", "b", 4, 0.1, hierarchy=("e", "t")))
    assert mixed.to_dict()["tokens"] == 8 and "levels" not in mixed.to_dict()


def test_prefill_rate_is_computed_prompt_positions_over_prefill_seconds_of_every_generation():
    def gen(item, task, positions, prefill):
        g = _gen(item, 0, task, task, 5, 0.2)
        g.stats.update(prefill_tokens=positions, prefill_seconds=prefill)
        return g

    gens = [gen(0, "a", 40, 0.1), gen(1, "b", 200, 0.3), gen(2, "b", 60, 0.1)]
    overall, per = totals_by(gens)
    o = overall.to_dict()
    assert (o["prefill_tokens"], o["prefill_seconds"]) == (300, pytest.approx(0.5))
    assert o["prefill_tokens_per_s"] == pytest.approx(600.0)
    assert per["b"].to_dict()["prefill_tokens_per_s"] == pytest.approx(650.0)
    # a generation without them (stats of before, or a Hugging Face method's): no rate rather than a wrong one
    assert "prefill_tokens" not in Totals().add(gens[0]).add(_gen(3, 0, "a", "a", 5, 0.2)).to_dict()
    assert "prefill_tokens" not in Totals().add(Generation(0, 0, "a", "a", [1], 0.1)).to_dict()


# ------------------------------------------------------------------------------------------------ plans per task


def _task_profile_dict():
    """A target t, an exit e, a copy q and an abstaining lookup k; two tasks with different acceptance."""
    return {"format": "hsd-profile/1", "target": "t",
            "models": [{"name": "k", "kind": "ngram_context", "cost": 0.0005, "can_verify": False, "draft_rate": 0.4,
                        "draft_rate_by_budget": [0.3, 0.2]},
                       {"name": "e", "kind": "early_exit", "layer": 2, "cost": 0.3},
                       {"name": "q", "kind": "quantized", "cost": 0.35},
                       {"name": "t", "kind": "target", "layer": 8, "cost": 1.0}],
            "acceptance": {"k": {"e": 0.5, "q": 0.6, "t": 0.6}, "e": {"q": 0.5, "t": 0.45}, "q": {"t": 0.8}},
            "acceptance_by_task": {
                "summarization": {"k": {"e": 0.8, "q": 0.9, "t": 0.9}, "e": {"q": 0.6, "t": 0.55}, "q": {"t": 0.85}},
                "qa": {"k": {"q": 0.2, "t": 0.2}, "e": {"q": 0.3, "t": 0.25}, "q": {"t": 0.75}}},   # no k->e
            "draft_rate_by_task": {"summarization": {"k": 0.9}},                                     # qa: none
            "draft_rate_by_budget_by_task": {"summarization": {"k": [0.8, 0.7, 0.6]}},
            "provenance": {"model": "m", "positions_by_task": {"summarization": 120, "qa": 80}}}


def test_task_view_takes_the_tasks_figures_and_names_fallbacks():
    prof, _ = profile_from_dict(_task_profile_dict())
    view, fb = task_profile(prof, "summarization")
    assert view.accept("k", "t") == 0.9 and view.accept("e", "q") == 0.6 and fb == []
    assert view.entry("k").draft_rate == 0.9 and view.entry("t").cost == prof.entry("t").cost
    assert [view.entry("k").rate_at(T) for T in (1, 3, 5)] == [0.8, 0.6, 0.6]      # the task's rates per budget
    view, fb = task_profile(prof, "qa")
    assert view.accept("k", "e") == 0.5 and view.accept("k", "t") == 0.2      # k->e: the overall value
    assert fb == ["k->e", "draft_rate of k"] and view.entry("k").draft_rate == 0.4
    assert [view.entry("k").rate_at(T) for T in (1, 2, 9)] == [0.3, 0.2, 0.2]      # the overall ones
    with pytest.raises(HsdError, match="qa, summarization"):
        task_profile(prof, "rag")
    bare, _ = profile_from_dict({k: v for k, v in _task_profile_dict().items() if k != "acceptance_by_task"})
    with pytest.raises(HsdError, match="no per-task statistics"):
        task_profile(bare, "qa")


def test_a_task_where_the_drafter_proposed_at_every_position_keeps_its_shares_of_rounds_per_budget():
    """A lookup that proposed at every position of a task's prompts (its task draft rate 1) still proposes a block
    of 2+ tokens in a share of rounds only: its task view abstains there. The shares were dropped at a task rate of
    exactly 1, the drafter priced as proposing every block (a plan 2.5x too optimistic), unlike at 0.999."""
    d = _task_profile_dict()
    lat = {}
    for r in (0.999, 1.0):
        d["draft_rate_by_task"] = {"summarization": {"k": r}}
        d["draft_rate_by_budget_by_task"] = {"summarization": {"k": [r, 0.2, 0.1, 0.05]}}
        view, _ = task_profile(profile_from_dict(copy.deepcopy(d))[0], "summarization")
        assert view.entry("k").abstains and [view.entry("k").rate_at(T) for T in (1, 2, 4)] == [r, 0.2, 0.05]
        plan = solve(view, 4)
        assert plan.expected_latency == pytest.approx(solve(view, 4, solver="brute").expected_latency, rel=1e-9)
        assert plan.expected_latency == pytest.approx(evaluate(view, plan.hierarchy, plan.budgets), rel=1e-9)
        lat[r] = evaluate(view, ["k", "t"], [4])
        again, _ = profile_from_dict(view.to_dict())           # written and read back: the same shares
        assert [again.entry("k").rate_at(T) for T in (1, 2, 4)] == [r, 0.2, 0.05]
    assert lat[1.0] == pytest.approx(lat[0.999], rel=0.01)


def test_a_drafter_abstaining_only_per_budget_takes_the_tasks_rates():
    """A drafter whose overall rate is 1 but whose shares of rounds per budget are below it abstains (a task's view
    written out and read back holds one): its task's rates were dropped without a word, the overall ones kept."""
    d = _task_profile_dict()
    d["models"][0].update(draft_rate=1.0, draft_rate_by_budget=[1.0, 0.8, 0.6])
    prof, _ = profile_from_dict(d)
    assert prof.entry("k").abstains
    view, fb = task_profile(prof, "summarization")
    assert fb == [] and view.entry("k").draft_rate == 0.9
    assert [view.entry("k").rate_at(T) for T in (1, 2, 3)] == [0.8, 0.7, 0.6]
    view, fb = task_profile(prof, "qa")                     # no rates of its own: the overall ones, and said
    assert "draft_rate of k" in fb and [view.entry("k").rate_at(T) for T in (1, 2, 3)] == [1.0, 0.8, 0.6]


def test_plans_per_task_are_each_tasks_optimum_dp_equals_brute_force():
    rng = np.random.default_rng(7)
    for case in range(12):
        prof = random_profile(rng, int(rng.integers(2, 5)), abstaining=bool(case % 2), verify_cost=bool(case % 3),
                              cost_curve=True)
        by: dict = {}
        for task in ("a", "b"):                       # each task: the acceptance perturbed, some pairs missing
            for d, row in prof.acceptance.items():
                for v, x in row.items():
                    if rng.random() < 0.8:
                        by.setdefault(task, {}).setdefault(d, {})[v] = float(np.clip(x + rng.normal(0, 0.2), 0, 1))
        prof.acceptance_by_task = by
        plan = solve(prof, 4)
        entries, fallbacks = solve_tasks(prof, plan, 4)
        assert sorted(entries) == sorted(by)
        for task, e in entries.items():
            view, fb = task_profile(prof, task)
            assert fb == fallbacks[task] and e["fallback_pairs"] == len(fb)
            best = brute(view, 4)
            assert e["expected_latency"] == pytest.approx(best.latency, rel=1e-9)
            assert e["expected_latency"] == pytest.approx(evaluate(view, e["hierarchy"], e["budgets"]), rel=1e-12)
            assert e["expected_latency"] <= e["overall_hierarchies"]["plan"] * (1 + 1e-12)
            assert e["overall_hierarchies"]["plan"] == pytest.approx(evaluate(view, plan.hierarchy, plan.budgets))


def _plan_dict(**over):
    d = {"format": "hsd-plan/1", "tmax": 8, "hierarchy": ["e", "t"], "budgets": [3], "expected_latency": 0.5,
         "expected_speedup": 2.0, "baselines": {},
         "by_task": {"summarization": {"hierarchy": ["k", "q", "t"], "budgets": [2, 6], "expected_latency": 0.3,
                                       "expected_speedup": 3.3, "overall_hierarchies": {"plan": 0.45}},
                     "qa": {"hierarchy": ["q", "t"], "budgets": [4], "expected_latency": 0.4,
                            "expected_speedup": 2.5}}}
    d.update(over)
    return d


def test_a_prompt_runs_its_tasks_plan_else_the_plan():
    plan = plan_from_dict(_plan_dict())
    assert plan.tasks == ["qa", "summarization"]
    assert plan_for_prompt(plan, "summarization") == (["k", "q", "t"], [2, 6], 0.3, "by_task.summarization")
    assert plan_for_prompt(plan, "qa") == (["q", "t"], [4], 0.4, "by_task.qa")
    assert plan_for_prompt(plan, "chat") == (["e", "t"], [3], 0.5, "plan")          # no plan for the task
    assert plan_for_prompt(plan, None) == (["e", "t"], [3], 0.5, "plan")
    # the plan itself on a task it was evaluated for: that task's prediction
    assert plan_for_prompt(plan, "summarization", per_task=False) == (["e", "t"], [3], 0.45, "plan")
    old = Plan(8, ["e", "t"], [3], 0.5, 2.0)                                          # no by_task at all
    assert old.tasks == [] and plan_for_prompt(old, "qa") == (["e", "t"], [3], 0.5, "plan")


@pytest.mark.parametrize("by_task,field", [
    ({"qa": {"hierarchy": ["q", "x"], "budgets": [4], "expected_latency": 0.4}}, "by_task.qa.hierarchy"),
    ({"qa": {"hierarchy": ["q", "t"], "budgets": [9], "expected_latency": 0.4}}, "by_task.qa.budgets[0]"),
    ({"qa": {"hierarchy": ["q", "t"], "budgets": [], "expected_latency": 0.4}}, "by_task.qa.budgets"),
    ({"qa": {"hierarchy": ["q", "t"], "budgets": [4], "expected_latency": 0}}, "by_task.qa.expected_latency"),
    ({"qa": ["q", "t"]}, "by_task.qa"),
    (["qa"], "by_task"),
])
def test_bad_by_task_sections_are_refused(by_task, field):
    with pytest.raises(InputFileError, match=field.replace("[", r"\[").replace("]", r"\]")):
        plan_from_dict(_plan_dict(by_task=by_task), "plan.json")


def test_cli_solve_per_task_and_task(tmp_path):
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(_task_profile_dict()))
    out = tmp_path / "plan.json"
    r = run_cli("solve", "--profile", prof, "--tmax", 8, "--per-task", "--out", out, "--min-gain", 0)
    assert r.exit_code == 0, cli_output(r)
    text = cli_output(r)
    assert "plans per task" in text and "task qa: no per-task figure for k->e, draft_rate of k" in text
    plan = load_plan(out)
    assert plan.tasks == ["qa", "summarization"] and plan.to_dict()["by_task"]["qa"]["positions"] == 80
    for task in plan.tasks:
        one = tmp_path / f"{task}.json"
        r = run_cli("solve", "--profile", prof, "--tmax", 8, "--task", task, "--out", one, "--min-gain", 0)
        assert r.exit_code == 0, cli_output(r)
        p = load_plan(one)
        e = plan.by_task[task]
        assert (p.hierarchy, p.budgets) == (e.hierarchy, e.budgets)
        assert p.expected_latency == pytest.approx(e.expected_latency, rel=1e-12)
        assert p.task == task and p.profile_sha256 == plan.profile_sha256
        sim = simulate(prof, p, rounds=2000)                    # the task's acceptance, as the plan was solved
        assert sim.predicted == pytest.approx(p.expected_latency, rel=1e-12), task
        r = run_cli("simulate", "--plan", one, "--profile", prof, "--rounds", 2000)
        assert r.exit_code == 0 and "differs from the profile's model" not in cli_output(r), cli_output(r)
    assert plan.by_task["summarization"].hierarchy != plan.by_task["qa"].hierarchy
    for args, needle in ((["--task", "rag"], "qa, summarization"), (["--task", "qa", "--per-task"], "one of"),
                         ):
        r = run_cli("solve", "--profile", prof, "--tmax", 8, *args)
        assert r.exit_code == 2 and needle in cli_output(r) and "Traceback" not in cli_output(r)
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({k: v for k, v in _task_profile_dict().items() if k != "acceptance_by_task"}))
    r = run_cli("solve", "--profile", bare, "--per-task")
    assert r.exit_code == 2 and "no per-task statistics" in cli_output(r)


def test_a_prompt_holding_unicode_line_separators_is_one_line(tmp_path):
    """JSON writes U+2028, U+2029 and U+0085 unescaped inside a string (``ensure_ascii=False``): they are text of
    the line, not line ends (the line was cut there and refused as malformed JSON); CRLF files read as LF ones."""
    texts = ["a\u2028b", "c\u2029d", "e\x85f"]
    path = tmp_path / "p.jsonl"
    path.write_bytes("\r\n".join(json.dumps({"prompt": t}, ensure_ascii=False) for t in texts).encode() + b"\r\n")
    assert [it.prompt for it in load_prompts(path).items] == texts
    path.write_text(json.dumps({"prompt": "x\u2028y"}, ensure_ascii=False) + "\n{bad\n")
    with pytest.raises(InputFileError, match="line 2"):
        load_prompts(path)


def test_a_prompt_file_may_start_with_a_byte_order_mark(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "hello"}).encode() + b"\n")
    assert [it.prompt for it in load_prompts(path).items] == ["hello"]
