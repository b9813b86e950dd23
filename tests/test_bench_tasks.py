"""`hsd bench` and `hsd run` on Spec-Bench-format prompts with a tiny saved Llama (word-level tokenizer): figures
per task that add up to the overall ones, every turn after the method's own answer, the plan of each prompt's
task, and sampling with every method on the same seeds."""

from __future__ import annotations

import json

import pytest

from hsd_opt.formats import plan_from_dict
from hsd_opt.measure.bench import Sampling, build_runners, converse, run_bench
from hsd_opt.models.loading import load_model
from hsd_opt.prompts import PromptItem, conversation_ids, load_prompts
from tests.helpers import cli_output, run_cli, save_tiny

# Spec-Bench's question format over the tiny model's words w0..w59.
QUESTIONS = [
    {"question_id": 82, "category": "writing", "turns": ["w1 w2 w3 w1 w2", "w4 w5"]},
    {"question_id": 100, "category": "translation", "turns": ["w7 w8 w9 w7 w8 w9"]},
    {"question_id": 84, "category": "coding", "turns": ["w10 w11 w10 w11", "w12"]},
    {"question_id": 102, "category": "translation", "turns": ["w20 w21 w22"]},
    {"question_id": 200, "category": "qa", "turns": ["w30 w31 w32 w33"]},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_tasks")
    model = save_tiny(root / "model")
    questions = root / "questions.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    plan = {"format": "hsd-plan/1", "tmax": 8, "hierarchy": ["layer1", "layer2", "layer4"], "budgets": [2, 3],
            "expected_latency": 0.01, "expected_speedup": 1.5,
            "baselines": {"target_only": {"hierarchy": ["layer4"], "budgets": [], "expected_latency": 0.015},
                          "best_single_draft": {"hierarchy": ["layer2", "layer4"], "budgets": [3],
                                                "expected_latency": 0.012, "expected_speedup": 1.25}},
            "models": [{"name": "layer1", "kind": "early_exit", "layer": 1},
                       {"name": "layer2", "kind": "early_exit", "layer": 2},
                       {"name": "ngram", "kind": "ngram_context", "config": {"q": 2, "w": 4}},
                       {"name": "layer4", "kind": "target", "layer": 4}],
            "provenance": {"model": str(model), "revision": None, "heads": None, "device": "cpu",
                           "dtype": "float32", "temperature": 0.0},
            "by_task": {"translation": {"hierarchy": ["ngram", "layer4"], "budgets": [3], "expected_latency": 0.009,
                                        "expected_speedup": 1.6,
                                        "overall_hierarchies": {"plan": 0.011, "best_single_draft": 0.013,
                                                                "target_only": 0.015}}}}
    plan_path = root / "plan.json"
    plan_path.write_text(json.dumps(plan))
    return {"root": root, "model": model, "questions": questions, "plan": plan_path, "plan_dict": plan}


OURS = ("ar", "single_draft", "hsd", "hsd_task")


@pytest.mark.slow
def test_bench_by_task_adds_up_and_every_turn_follows_its_own_answer(tiny):
    out, png = tiny["root"] / "bench.json", tiny["root"] / "bench.png"
    r = run_cli("bench", "--plan", tiny["plan"], "--prompts", tiny["questions"], "--turns", "all",
                "--max-new-tokens", 6, "--methods", "hf_ar,ar,single_draft,hsd,hsd_task", "--json", out,
                "--plot", png, "--device", "cpu")
    assert r.exit_code == 0, cli_output(r)
    text = " ".join(cli_output(r).split())
    assert "task mt_bench: 2 prompts, 4 turns" in text and "task qa: 1 prompt" in text
    assert "hsd_task ran mt_bench: plan; qa: plan; translation: by_task.translation" in text
    rep = json.loads(out.read_text())
    assert rep["turns"] == "all" and rep["by"] == "group" and rep["sampling"] is None and rep["prompts"] == 5
    assert set(rep["by_task"]) == {"mt_bench", "translation", "qa"}
    for m, d in rep["methods"].items():
        assert d["generations"] == 7, m                    # 5 first turns + the 2 second turns of MT-bench
        assert d["matches_reference"] is True and d["prompts_matching"] == 5, m
        tasks = [rep["by_task"][t][m] for t in rep["by_task"]]
        for k in ("prompts", "generations", "tokens") + (("target_calls",) if m in OURS else ()):
            assert sum(t[k] for t in tasks) == d[k], (m, k)
        for k in ("seconds",) + (("decode_seconds",) if m in OURS else ()):
            assert sum(t[k] for t in tasks) == pytest.approx(d[k], rel=1e-12), (m, k)
        assert all(t["matches_reference"] for t in tasks)
        assert d["tokens_per_s"] == pytest.approx(d["tokens"] / d["seconds"])
        if m in OURS:
            assert d["tokens_per_target_call"] == pytest.approx(d["tokens"] / d["target_calls"])
        if m in ("ar", "single_draft", "hsd"):                 # one hierarchy: per-level counters add up too
            for i, lv in enumerate(d["levels"]):
                for k in ("calls", "drafted", "accepted", "rejections"):
                    assert sum(t["levels"][i][k] for t in tasks) == lv[k], (m, i, k)
    # the plan of each prompt's task: translation ran its own plan, the others the plan itself
    ht = rep["methods"]["hsd_task"]
    assert "levels" not in ht and ht["plans"] == ["by_task.translation", "plan"]            # those that ran
    assert set(ht["plan_hierarchies"]) == {"plan", "by_task.translation"}
    assert rep["by_task"]["translation"]["hsd_task"]["plans"] == ["by_task.translation"]
    assert rep["by_task"]["translation"]["hsd_task"]["levels"][0]["name"] == "ngram"
    assert rep["by_task"]["qa"]["hsd_task"]["plans"] == ["plan"]
    # predictions per task: the plan's hierarchies evaluated for that task where the plan knows them
    assert rep["by_task"]["translation"]["hsd"]["predicted_seconds_per_token"] == pytest.approx(0.011)
    assert rep["by_task"]["translation"]["hsd_task"]["predicted_seconds_per_token"] == pytest.approx(0.009)
    assert rep["by_task"]["qa"]["hsd"]["predicted_seconds_per_token"] == pytest.approx(0.01)
    assert rep["by_task"]["mt_bench"]["hf_ar"]["speedup_vs_hf_ar"] == pytest.approx(1.0)
    assert png.stat().st_size > 1000
    # --by category: the raw categories, the same overall sums
    r = run_cli("bench", "--plan", tiny["plan"], "--prompts", tiny["questions"], "--max-new-tokens", 4,
                "--methods", "ar,hsd", "--by", "category", "--limit-per-task", 1, "--json", out, "--device", "cpu")
    assert r.exit_code == 0, cli_output(r)
    rep = json.loads(out.read_text())
    assert set(rep["by_task"]) == {"writing", "translation", "coding", "qa"} and rep["prompts"] == 4
    # without ar there is no greedy reference: nothing is compared, and the report says why
    r = run_cli("bench", "--plan", tiny["plan"], "--prompts", tiny["questions"], "--max-new-tokens", 4,
                "--methods", "hf_ar,hsd", "--limit", 1, "--json", out, "--device", "cpu")
    assert r.exit_code == 0, cli_output(r)
    rep = json.loads(out.read_text())
    assert rep["reference"] is None and "matches_reference" not in rep["methods"]["hsd"]
    assert "did not include ar" in rep["matches_reference_note"]
    assert "did not include ar" in " ".join(cli_output(r).split())


def test_second_turn_is_sent_after_the_methods_own_answer(tiny):
    loaded = load_model(str(tiny["model"]), device="cpu")
    plan = plan_from_dict(tiny["plan_dict"])
    item = load_prompts(tiny["questions"]).items[0]
    runners, *_ = build_runners(plan, loaded, ["ar"], Sampling(), "exact", "plan", ["mt_bench"])
    seen = []

    def spy(ids, n, seed, task):
        seen.append(list(ids))
        return runners["ar"](ids, n, seed, task)

    gens = converse(spy, loaded.tokenizer, item, "all", False, 5, Sampling())
    assert [g.turn for g in gens] == [0, 1] and all(g.task == "mt_bench" for g in gens)
    answer = loaded.tokenizer.decode(gens[0].token_ids, skip_special_tokens=True)
    assert seen[1] == conversation_ids(loaded.tokenizer, item.turns, [answer])
    assert seen[1][: len(seen[0])] == seen[0]                   # no chat template: the texts joined


@pytest.mark.slow
def test_sampling_runs_every_method_on_the_same_seeds(tiny):
    loaded = load_model(str(tiny["model"]), device="cpu")
    plan = plan_from_dict(tiny["plan_dict"])
    items = load_prompts(tiny["questions"]).items
    methods = ["hf_ar", "hf_prompt_lookup", "ar", "hsd", "hsd_task"]
    greedy, *_ = build_runners(plan, loaded, ["ar"], Sampling(), "exact", "plan", ["translation"])
    ref = [converse(greedy["ar"], loaded.tokenizer, it, "all", False, 6, Sampling()) for it in items]
    # a nucleus, a top-k or a min-p that keeps only the most likely token: every method's sampler must give the
    # greedy output (HF generate is handed each filter)
    for narrow in (Sampling(temperature=0.9, top_p=1e-6, seed=5), Sampling(temperature=0.9, seed=5, top_k=1),
                   Sampling(temperature=0.9, seed=5, min_p=1.0)):
        runners, *_ = build_runners(plan, loaded, methods, narrow, "exact", "plan", ["translation", "mt_bench", "qa"])
        for m in methods:
            for it, want in zip(items, ref):
                got = converse(runners[m], loaded.tokenizer, it, "all", False, 6, narrow)
                assert [g.token_ids for g in got] == [g.token_ids for g in want], (m, it.question_id, narrow)
    # a wide nucleus: draws, the same ones again for the same seed, with every method
    wide = Sampling(temperature=1.5, top_p=0.95, seed=11)
    runners, *_ = build_runners(plan, loaded, methods, wide, "exact", "plan", ["translation", "mt_bench", "qa"])
    item = PromptItem(3, "w1 w2 w3", "qa")
    for m in methods:
        a = converse(runners[m], loaded.tokenizer, item, "first", False, 8, wide)[0].token_ids
        b = converse(runners[m], loaded.tokenizer, item, "first", False, 8, wide)[0].token_ids
        assert a == b, m
    said: list[str] = []
    rep = run_bench(plan, loaded, items[:3], 5, methods=["hf_ar", "ar", "hsd"], sampling=wide, source="plan",
                    log=said.append)
    # every generation says what it was and how long it took, every prompt how far the run is
    for i in range(3):
        for m in ("hf_ar", "ar", "hsd"):
            assert sum(s.startswith(f"prompt {i + 1}/3 (") and f"), {m}: " in s and " tok/s)" in s
                       for s in said) == 1, (i, m, said)
        assert sum(s.startswith(f"prompt {i + 1}/3 done, elapsed ") and " ETA " in s for s in said) == 1
    assert rep["sampling"] == {"temperature": 1.5, "top_p": 0.95, "seed": 11, "top_k": 0, "min_p": 0.0}
    assert rep["reference"] is None
    assert "not compared under sampling" in rep["matches_reference_note"]
    for m, d in rep["methods"].items():
        assert d["matches_reference"] is None and d["tokens"] > 0, m
        assert rep["by_task"]["mt_bench"][m]["matches_reference"] is None      # each task as the whole


@pytest.mark.slow
def test_run_uses_the_plan_of_each_prompts_task(tiny):
    out = tiny["root"] / "run.jsonl"
    r = run_cli("run", "--plan", tiny["plan"], "--prompts", tiny["questions"], "--turns", "all",
                "--max-new-tokens", 5, "--quiet", "--json", out, "--device", "cpu")
    assert r.exit_code == 0, cli_output(r)
    text = " ".join(cli_output(r).split())
    assert "per task" in text and "by_task.translation ran translation: layer4 <- ngram (T=[3])" in text
    assert "plan ran mt_bench, qa: layer4 <- layer2 <- layer1 (T=[2, 3])" in text
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["question_id"], x["turn"]) for x in lines] == [(82, 0), (82, 1), (100, 0), (84, 0), (84, 1),
                                                                (102, 0), (200, 0)]
    assert {x["plan"] for x in lines if x["task"] == "translation"} == {"by_task.translation"}
    assert {x["plan"] for x in lines if x["task"] != "translation"} == {"plan"}
    assert lines[1]["prompt"] == "w4 w5" and lines[1]["category"] == "writing"
    # the same outputs with the plan itself everywhere (lossless either way)
    out2 = tiny["root"] / "run2.jsonl"
    r = run_cli("run", "--plan", tiny["plan"], "--prompts", tiny["questions"], "--turns", "all",
                "--max-new-tokens", 5, "--quiet", "--json", out2, "--no-per-task", "--device", "cpu")
    assert r.exit_code == 0, cli_output(r)
    other = [json.loads(x) for x in out2.read_text().splitlines()]
    assert {x["plan"] for x in other} == {"plan"}
    assert [x["token_ids"] for x in other] == [x["token_ids"] for x in lines]
    # one prompt of a known task
    r = run_cli("run", "--plan", tiny["plan"], "--prompt", "w7 w8 w9", "--task", "translation", "--quiet",
                "--max-new-tokens", 4, "--device", "cpu")
    assert r.exit_code == 0 and "layer4 <- ngram (T=[3]) (by_task.translation)" in cli_output(r)


@pytest.mark.parametrize("cmd,args,needle", [
    ("bench", ["--turns", "some"], "--turns"),
    ("bench", ["--by", "topic"], "--by"),
    ("bench", ["--limit-per-task", "0"], "--limit-per-task"),
    ("bench", ["--top-p", "0.5"], "--temperature > 0"),
    ("bench", ["--temperature", "0.5", "--top-p", "1.5"], "--top-p"),
    ("bench", ["--top-k", "3"], "--top-k 3 needs --temperature > 0"),
    ("bench", ["--temperature", "0.5", "--min-p", "2"], "--min-p"),
    ("bench", ["--temperature", "0.5", "--top-k", "-1"], "--top-k"),
    ("bench", ["--methods", "hsd,hsd_tasks"], "--methods"),
    ("run", ["--prompt", "w1", "--limit-per-task", "1"], "--limit-per-task"),
    ("run", ["--prompts", "QUESTIONS", "--task", "qa"], "--task"),
    ("run", ["--prompts", "QUESTIONS", "--turns", "two"], "--turns"),
])
def test_bad_workload_flags(tiny, cmd, args, needle):
    args = [str(tiny["questions"]) if a == "QUESTIONS" else a for a in args]
    base = ["--prompts", str(tiny["questions"])] if cmd == "bench" else []
    r = run_cli(cmd, "--plan", tiny["plan"], *base, *args, "--device", "cpu")
    assert r.exit_code == 2, cli_output(r)
    assert needle in cli_output(r) and "Traceback" not in cli_output(r)


def _with_context_tables(plan: dict) -> dict:
    """``plan`` as solved from costs at contexts 2 and 1002: every latency rises by 1e-5 s per context token."""
    p = json.loads(json.dumps(plan))

    def table(v):
        return [[2, v], [1002, v + 0.01]]

    p.update(context=100, context_from="profile_prompts", latency_by_context=table(p["expected_latency"]))
    for b in p["baselines"].values():
        b["latency_by_context"] = table(b["expected_latency"])
    e = p["by_task"]["translation"]
    e.update(context=50, latency_by_context=table(e["expected_latency"]),
             overall_hierarchies_by_context={k: table(v) for k, v in e["overall_hierarchies"].items()})
    return p


def test_run_and_bench_predict_at_each_generations_context(tiny):
    """With a plan solved from costs at several contexts, ``hsd run`` predicts every generation at its own context
    (prompt + half the generated tokens) and says so; ``hsd bench`` reports the context its figures were
    predicted at. A plan without context tables predicts its own figure and reports no context."""
    plan = tiny["root"] / "plan_ctx.json"
    plan.write_text(json.dumps(_with_context_tables(tiny["plan_dict"])))
    out = tiny["root"] / "run_ctx.jsonl"
    r = run_cli("run", "--plan", plan, "--prompts", tiny["questions"], "--max-new-tokens", 4, "--quiet",
                "--json", out, "--device", "cpu")
    assert r.exit_code == 0, cli_output(r)
    assert "(plan's prediction) at" in cli_output(r)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == len(QUESTIONS)
    for x in lines:
        prompt = x["context"] - len(x["token_ids"]) / 2
        assert prompt == int(prompt) and prompt >= len(x["prompt"].split())   # the prompt's tokens (chat template)
        assert x["predicted_at_context"] == x["context"]
        base = 0.009 if x["plan"] == "by_task.translation" else 0.01
        assert x["predicted_seconds_per_token"] == pytest.approx(base + (x["context"] - 2) * 1e-5, rel=1e-12)
    rep_path = tiny["root"] / "bench_ctx.json"
    r = run_cli("bench", "--plan", plan, "--prompts", tiny["questions"], "--max-new-tokens", 4,
                "--methods", "ar,hsd", "--json", rep_path, "--device", "cpu")
    assert r.exit_code == 0, cli_output(r)
    rep = json.loads(rep_path.read_text())
    assert rep["plan"]["context"] == 100 and rep["prediction_context"].startswith("each generation's own")
    for task, ms in [(None, rep["methods"])] + list(rep["by_task"].items()):
        for m, base in (("ar", 0.015), ("hsd", 0.011 if task == "translation" else 0.01)):
            d = ms[m]
            assert d["predicted_at_context"] == pytest.approx(d["mean_context"], rel=1e-12)
            if task is not None:                  # linear in the context: the mean context gives the mean figure
                assert d["predicted_seconds_per_token"] == pytest.approx(
                    base + (d["predicted_at_context"] - 2) * 1e-5, rel=1e-9), (task, m)
    r = run_cli("run", "--plan", tiny["plan"], "--prompt", "w1 w2", "--max-new-tokens", 3, "--quiet",
                "--json", out, "--device", "cpu")
    x = json.loads(out.read_text())
    assert r.exit_code == 0 and x["predicted_seconds_per_token"] == 0.01 and x["predicted_at_context"] is None


def test_a_bench_title_says_how_the_torch_path_ran():
    """``hsd bench``'s title names the CPU kernels, or on CUDA the torch path's settings that were on."""
    from hsd_opt.commands.bench import _variant

    assert _variant({"kernels": {"variant": "avx2", "openmp": True}}) == ", avx2 kernels"
    on_gpu = {"kernels": None, "torch_path": {"fixed_shapes": True, "compiled": False, "cuda_graphs": True,
                                                "weight_only": False, "triton_attention": True}}
    assert _variant(on_gpu) == ", torch path: fixed shapes, CUDA graphs, Triton attention"
    assert _variant({"torch_path": dict.fromkeys(on_gpu["torch_path"], False)}) == ", torch path: op by op"
