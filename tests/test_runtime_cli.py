"""`hsd run` / `hsd bench` through typer's CliRunner on a tiny random Llama saved with the embedded model's
tokenizer, and every bad input (exit code 2, one line naming the field or flag)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from hsd_opt.cli import app
from hsd_opt.errors import InputFileError
from tests.helpers import make_tiny_llama, write_plan

runner = CliRunner()


def _out(res) -> str:
    return res.output + (getattr(res, "stderr", "") if getattr(res, "stderr_bytes", None) else "")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, embedded):
    """A 4-layer random Llama with SmolLM2's tokenizer (vocab 49152, EOS 2, chat template), saved to disk."""
    d = tmp_path_factory.mktemp("tiny")
    model = make_tiny_llama(seed=0, vocab_size=len(embedded.tokenizer), layers=4, scale=4.0)
    model.save_pretrained(d / "m")
    embedded.tokenizer.save_pretrained(d / "m")
    other = make_tiny_llama(seed=1, vocab_size=len(embedded.tokenizer), layers=2)
    other.save_pretrained(d / "other")
    embedded.tokenizer.save_pretrained(d / "other")
    return d


_plan = write_plan


def test_run_streams_and_writes_json_equal_to_ar(tiny_dir, tmp_path):
    from hsd_opt.formats import load_plan
    from hsd_opt.models.loading import load_model
    from hsd_opt.prompts import encode_prompt, template_head
    from hsd_opt.runtime.runner import hsd_for_plan

    plan = _plan(tmp_path / "plan.json", tiny_dir / "m", hierarchy=("ngram", "layer1", "layer2", "layer4"),
                 budgets=(1, 2, 3))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hello there", "task": "chat"}\n\n{"prompt": "Count: 1 2 3", "task": "math"}\n')
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["run", "--plan", str(plan), "--prompts", str(prompts), "--max-new-tokens", "9",
                              "--json", str(out), "--device", "cpu"])
    assert res.exit_code == 0, _out(res)
    assert "tokens per target call" in _out(res)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["prompt"] for x in lines] == ["Hello there", "Count: 1 2 3"]
    loaded = load_model(str(tiny_dir / "m"), device="cpu")
    p = load_plan(plan)
    ar = hsd_for_plan(p, loaded, hierarchy=["layer4"], budgets=[])
    other = _plan(tmp_path / "other.json", tiny_dir / "other-model")      # made for another model: refused, as
    with pytest.raises(InputFileError, match="provenance.model: the plan was made for model"):   # hsd run does
        hsd_for_plan(load_plan(other), loaded)
    for x in lines:
        assert set(x) >= {"prompt", "token_ids", "text", "stats"}
        ref = ar.generate(encode_prompt(loaded.tokenizer, x["prompt"]), 9).token_ids
        assert x["token_ids"] == ref
        assert x["stats"]["tokens"] == len(ref) and x["stats"]["levels"][0]["name"] == "ngram"
    # the prompt positions the run computed and their rate: both prompts', the second's template head kept of the
    # first's (as llama.cpp's CLI reports its prompt evaluation, cached tokens left out)
    head = len(template_head(loaded.tokenizer))
    n_prompt = sum(len(encode_prompt(loaded.tokenizer, x["prompt"])) for x in lines) - head
    assert [x["stats"]["prefill_tokens"] for x in lines][0] == len(encode_prompt(loaded.tokenizer, lines[0]["prompt"]))
    assert re.search(rf"prefill: tokens, seconds\s*│\s*{n_prompt}, \d+\.\d{{3}} \(\d+\.\d tok/s\)", _out(res))
    # log-probabilities in the lines: the target's own, the same tokens
    res = runner.invoke(app, ["run", "--plan", str(plan), "--prompts", str(prompts), "--max-new-tokens", "9",
                              "--json", str(out), "--device", "cpu", "--logprobs", "3", "--quiet"])
    assert res.exit_code == 0, _out(res)
    with_lp = [json.loads(x) for x in out.read_text().splitlines()]
    for x, y in zip(lines, with_lp):
        assert y["token_ids"] == x["token_ids"]
        want = ar.generate(encode_prompt(loaded.tokenizer, x["prompt"]), 9, logprobs=3).logprobs
        assert [e["token_id"] for e in y["logprobs"]] == x["token_ids"]
        assert [e["logprob"] for e in y["logprobs"]] == [w.logprob for w in want]
        assert [e["top"] for e in y["logprobs"]] == [[list(t) for t in w.top] for w in want]
        assert "".join(e["token"] for e in y["logprobs"]).startswith(x["text"][:3])
    # sampling, raw prompt, eager mode
    res = runner.invoke(app, ["run", "--plan", str(plan), "--prompt", "abc", "--raw", "--temperature", "0.7",
                              "--top-p", "0.9", "--seed", "3", "--max-new-tokens", "5", "--mode", "eager"])
    assert res.exit_code == 0, _out(res)


def test_bench_tiny(tiny_dir, tmp_path):
    plan = _plan(tmp_path / "plan.json", tiny_dir / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hello there"}\n{"prompt": "Write a list"}\n{"prompt": "third"}\n')
    rep_path, png = tmp_path / "bench.json", tmp_path / "bench.png"
    res = runner.invoke(app, ["bench", "--plan", str(plan), "--prompts", str(prompts), "--limit", "2",
                              "--max-new-tokens", "6", "--json", str(rep_path), "--plot", str(png)])
    assert res.exit_code == 0, _out(res)
    rep = json.loads(rep_path.read_text())
    ms = rep["methods"]
    assert set(ms) == {"hf_ar", "hf_prompt_lookup", "ar", "single_draft", "hsd"}     # hf_early_exit: when named
    for m in ("ar", "single_draft", "hsd", "hf_ar", "hf_prompt_lookup"):
        assert ms[m]["matches_reference"] is True, m
        assert ms[m]["tokens_per_s"] > 0 and "speedup_vs_hf_ar" in ms[m] and "speedup_vs_ar" in ms[m]
    assert ms["hsd"]["predicted_seconds_per_token"] == 0.01 and ms["hsd"]["seconds_per_token"] > 0
    assert rep["prompts"] == 2 and png.stat().st_size > 1000
    assert "hf_early_exit" not in _out(res)


def test_bench_says_not_run_for_a_method_the_plan_lacks_and_sampled_tasks_are_not_compared(tiny_dir, tmp_path):
    """A method the plan has nothing for (``hsd_task`` without plans per task) reads "not run" in the table, not
    "error"; sampled, every entry's ``matches_reference`` is null, each task's too (the tasks' lacked it)."""
    plan = _plan(tmp_path / "plan.json", tiny_dir / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hello there", "task": "a"}\n{"prompt": "Write a list", "task": "b"}\n')
    rep_path = tmp_path / "bench.json"
    res = runner.invoke(app, ["bench", "--plan", str(plan), "--prompts", str(prompts), "--max-new-tokens", "4",
                              "--methods", "ar,hsd_task", "--temperature", "1", "--seed", "3", "--json",
                              str(rep_path)])
    assert res.exit_code == 0, _out(res)
    row = next(line for line in _out(res).splitlines() if line.strip().startswith("hsd_task"))
    assert "not run" in row and "error" not in row, row
    rep = json.loads(rep_path.read_text())
    assert rep["methods"]["ar"]["matches_reference"] is None
    assert [rep["by_task"][t]["ar"]["matches_reference"] for t in ("a", "b")] == [None, None]


def _bench_raising_at_the_third_prompt(tiny_dir, tmp_path, monkeypatch, error: BaseException, nth: int):
    """``hsd bench --methods ar,hsd`` over 4 prompts whose ``nth`` method (1 or 2, in the order of the third
    prompt: ar, hsd) raises ``error`` there: ``(result, the --json report)``."""
    from hsd_opt.measure import bench as bench_mod

    plan = _plan(tmp_path / "plan.json", tiny_dir / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1}"}) + "\n" for i in range(1, 5)))
    real, calls = bench_mod.converse, []

    def converse(runner, tok, it, *a, **kw):
        calls.append(it.index)
        if it.index == 2 and calls.count(2) == nth:
            raise error
        return real(runner, tok, it, *a, **kw)

    monkeypatch.setattr(bench_mod, "converse", converse)
    rep_path = tmp_path / "bench.json"
    res = runner.invoke(app, ["bench", "--plan", str(plan), "--prompts", str(prompts), "--max-new-tokens", "4",
                              "--methods", "ar,hsd", "--json", str(rep_path)])
    return res, json.loads(rep_path.read_text())


def test_bench_stopped_part_way_reports_the_prompts_every_method_finished(tiny_dir, tmp_path, monkeypatch):
    """Ctrl-C during the third prompt: the report (table and --json) holds the two prompts every method finished,
    says it stopped, and the command exits 130 (it wrote nothing and said nothing)."""
    res, rep = _bench_raising_at_the_third_prompt(tiny_dir, tmp_path, monkeypatch, KeyboardInterrupt(), 2)
    assert res.exit_code == 130, _out(res)
    assert rep["prompts"] == 2 and rep["stopped"]["prompts_done"] == 2 and rep["stopped"]["prompts_asked"] == 4
    assert all(rep["methods"][m]["matches_reference"] is True for m in ("ar", "hsd"))
    assert "stopped: the report holds the 2 of 4 prompts" in " ".join(_out(res).split())


def test_a_method_that_fails_part_way_is_dropped_and_the_bench_reports_the_others(tiny_dir, tmp_path, monkeypatch):
    """A method raising on a later prompt (HF out of memory on a long one) ended the bench with a traceback, every
    finished prompt lost; and where the one that failed was ar, the note said ar was not asked for."""
    res, rep = _bench_raising_at_the_third_prompt(tiny_dir, tmp_path, monkeypatch, RuntimeError("out of memory"), 1)
    assert res.exit_code == 0, _out(res)
    assert rep["prompts"] == 4 and rep["methods"]["ar"]["error"] == "failed on prompt 3: RuntimeError: out of memory"
    assert rep["methods"]["hsd"]["tokens"] > 0 and "stopped" not in rep
    assert rep["matches_reference_note"].startswith("not compared: ar, the greedy reference, failed")


@pytest.mark.slow
def test_bench_ended_by_sigterm_reports_the_prompts_it_finished(tiny_dir, tmp_path):
    """``timeout``, ``kill`` and schedulers send SIGTERM: ``hsd bench --json`` (a process) keeps the prompts it
    finished as a Ctrl-C does and exits 143, the signal's own status (it was killed with nothing written)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    plan = _plan(tmp_path / "plan.json", tiny_dir / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1}"}) + "\n" for i in range(1, 200)))
    rep_path = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    out_path = tmp_path / "stdout.txt"
    with open(out_path, "w") as out_file:
        proc = subprocess.Popen([sys.executable, "-m", "hsd_opt", "bench", "--plan", str(plan), "--prompts",
                                 str(prompts), "--max-new-tokens", "8", "--methods", "ar,hsd", "--json", str(rep_path),
                                 "--device", "cpu"], stdout=out_file, stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end:       # the progress lines (stderr)
            line = proc.stderr.readline()
            lines.append(line)
            if not line or line.startswith("prompt 2/199 done"):
                break
        assert lines[-1].startswith("prompt 2/199 done"), "".join(lines) + out_path.read_text()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    log = "".join(lines) + err + out_path.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, log
    rep = json.loads(rep_path.read_text())
    assert rep["prompts"] >= 2 and rep["stopped"]["prompts_done"] == rep["prompts"], rep.get("stopped")
    assert all(rep["methods"][m]["matches_reference"] is True for m in ("ar", "hsd"))
    assert "Traceback" not in log and "stopped: the report holds" in " ".join(log.split())
    assert "interrupted:" not in log                       # said once, by the command that kept its report


def test_bench_runs_hf_early_exit_when_named(tiny_dir, tmp_path):
    plan = _plan(tmp_path / "plan.json", tiny_dir / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hello there"}\n')
    rep_path = tmp_path / "bench.json"
    res = runner.invoke(app, ["bench", "--plan", str(plan), "--prompts", str(prompts), "--max-new-tokens", "6",
                              "--methods", "ar,hf_early_exit", "--json", str(rep_path)])
    assert res.exit_code == 0, _out(res)
    ms = json.loads(rep_path.read_text())["methods"]
    assert set(ms) == {"ar", "hf_early_exit"}
    assert ms["hf_early_exit"].get("matches_reference") is True, ms["hf_early_exit"]
    assert ms["hf_early_exit"]["tokens"] > 0 and "hf_early_exit" in _out(res)


@pytest.mark.parametrize("case,needle", [
    ("layer40", "layer 40"),
    ("target_not_last", "the model has 4 layers"),
    ("token_above_bottom", "may only be the bottom"),
    ("other_model", "provenance.model"),
    ("revision", "provenance.revision"),
    ("dtype", "provenance.dtype"),
    ("unknown_name", "hierarchy[0]"),
    ("unknown_kind", "hierarchy[0]: 'weird' is of kind 'martian', which this runtime cannot run"),
    ("drafter_config", "p.json: models.ngram.config: bad config for ngram_context drafter"),
    ("mixed_config", "p.json: models.ngram.config: mixed_ngram drafter needs 'ngram' and 'bigram'"),
    ("plan_dtype", "p.json: provenance.dtype: expected one of"),
    # a table or matrix made for a larger vocabulary: refused before decoding (it failed when a draft reached
    # such an id, part of the answer already written)
    ("bigram_vocab", "p.json: models.big.config: 'big' drafts token ids up to"),
    ("aded_vocab", "p.json: models.big.config: 'big' drafts token ids up to"),
    ("mixed_vocab", "p.json: models.big.config: 'big' drafts token ids up to"),
])
def test_bad_plans(tiny_dir, tmp_path, case, needle):
    m = tiny_dir / "m"
    args = []
    if case == "layer40":
        plan = _plan(tmp_path / "p.json", m, hierarchy=("layer40", "layer4"), budgets=(2,),
                     models=[{"name": "layer40", "kind": "early_exit", "layer": 40},
                             {"name": "layer4", "kind": "target", "layer": 4}])
    elif case == "target_not_last":
        plan = _plan(tmp_path / "p.json", m, hierarchy=("layer1", "layer2"), budgets=(2,),
                     models=[{"name": "layer1", "kind": "early_exit", "layer": 1},
                             {"name": "layer2", "kind": "target", "layer": 2}])
    elif case == "token_above_bottom":
        plan = _plan(tmp_path / "p.json", m, hierarchy=("layer1", "ngram", "layer4"), budgets=(2, 3))
    elif case == "other_model":
        plan = _plan(tmp_path / "p.json", m)
        args = ["--model", str(tiny_dir / "other")]
    elif case == "revision":
        plan = _plan(tmp_path / "p.json", m, revision="sha256:0000")
    elif case == "dtype":   # a plan for the float32 target, run on the bfloat16 one
        plan = _plan(tmp_path / "p.json", m)
        args = ["--dtype", "bfloat16"]
    elif case == "unknown_kind":   # refused before loading: the model it names does not exist
        plan = _plan(tmp_path / "p.json", tmp_path / "no-such-model", hierarchy=("weird", "layer4"), budgets=(2,),
                     models=[{"name": "weird", "kind": "martian", "cost": 0.001},
                             {"name": "layer4", "kind": "target", "layer": 4}])
    elif case == "drafter_config":   # a value the drafter refuses
        plan = _plan(tmp_path / "p.json", m, hierarchy=("ngram", "layer4"), budgets=(2,),
                     models=[{"name": "ngram", "kind": "ngram_context", "config": {"q": -1, "w": 4}},
                             {"name": "layer4", "kind": "target", "layer": 4}])
    elif case == "mixed_config":     # a mixed drafter without the drafters it mixes
        plan = _plan(tmp_path / "p.json", m, hierarchy=("ngram", "layer4"), budgets=(2,),
                     models=[{"name": "ngram", "kind": "mixed_ngram", "config": {"k": 2, "w": 3}},
                             {"name": "layer4", "kind": "target", "layer": 4}])
    elif case == "plan_dtype":
        plan = _plan(tmp_path / "p.json", m, dtype="int7", target_precision="float32")
    elif case.endswith("_vocab"):
        from hsd_opt.drafters.aded import TrigramMatrix
        from hsd_opt.drafters.bigram import random_bigram_table

        vocab = json.loads((m / "config.json").read_text())["vocab_size"]
        table = random_bigram_table(vocab + 200, top_k=4).save(tmp_path / "t.npz")
        matrix = TrigramMatrix({(1, 2): {3: 0.5, vocab: 0.5}}).save(tmp_path / "m.npz")
        config = {"bigram": {"kind": "bigram_model", "table": str(table)},
                  "aded": {"kind": "aded", "matrix": str(matrix)},
                  "mixed": {"kind": "mixed_ngram", "ngram": {"kind": "ngram_context"},
                            "bigram": {"kind": "bigram_model", "table": str(table)}}}[case.split("_")[0]]
        plan = _plan(tmp_path / "p.json", m, hierarchy=("big", "layer4"), budgets=(2,),
                     models=[{"name": "big", "kind": config["kind"], "config": config},
                             {"name": "layer4", "kind": "target", "layer": 4}])
    else:
        plan = _plan(tmp_path / "p.json", m, hierarchy=("mystery", "layer4"), budgets=(2,))
    res = runner.invoke(app, ["run", "--plan", str(plan), "--prompt", "hi", "--max-new-tokens", "3"] + args)
    assert res.exit_code == 2, _out(res)
    assert needle in _out(res) and "Traceback" not in _out(res)


@pytest.mark.parametrize("extra,needle", [
    (["--prompt", "  "], "empty prompt"),
    (["--prompt", "hi", "--task", ""], "--task: empty"),                   # ran as task "other"
    (["--prompt", "hi", "--task", "co\udcffde"], "--task"),                # went into --json as a lone surrogate
    (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["--prompt", "hi", "--top-p", "0"], "--top-p"),
    (["--prompt", "hi", "--temperature", "-1"], "--temperature"),
    ([], "--prompt"),
    (["--prompt", "hi", "--mode", "lazy"], "--mode"),
    (["--prompts", "BADLINES"], "line 2"),
    (["--prompts", "EMPTYFILE"], "no prompts"),
    (["--prompt", "hi", "--temperature", "nan"], "--temperature: expected a finite value"),
    (["--prompt", "hi", "--temperature", "1", "--seed", str(2**64)], "--seed: expected a 64-bit integer"),
    (["--prompt", "hi", "--target-precision", "int4"], "provenance.target_precision"),
    (["--prompt", "hi", "--json", "TMPDIR"], "is a directory"),
    (["--prompt", "hi", "--logprobs", "2"], "give --json FILE"),
    (["--prompt", "hi", "--logprobs", "21", "--json", "x.jsonl"], "--logprobs: expected a number of"),
    (["--prompt", "hi", "--top-k", "-1"], "--top-k: expected an integer >= 0"),
    (["--prompt", "hi", "--min-p", "1.5"], "--min-p: expected a value in [0, 1]"),
    (["--prompt", "hi", "--top-k", "40"], "--top-k 40 needs --temperature > 0"),
    (["--prompt", "hi", "--min-p", "0.05"], "--min-p 0.05 needs --temperature > 0"),
    (["--prompt", "hi", "--top-p", "0.9"], "--top-p 0.9 needs --temperature > 0"),
    (["--prompt", "hi", "--frequency-penalty", "3"], "--frequency-penalty: frequency_penalty must be a number in"),
    (["--prompt", "hi", "--presence-penalty", "-2.5"], "--presence-penalty: presence_penalty must be a number in"),
    (["--prompt", "hi", "--logit-bias", "{x"], "--logit-bias: not JSON"),
    (["--prompt", "hi", "--logit-bias", '{"3": ' + "1" * 5000 + "}"], "--logit-bias: not JSON that can be read (JSON "
                                                                    "with a number too long"),
    (["--prompt", "hi", "--logit-bias", "[1]"], "--logit-bias: a JSON object from token ids to numbers expected"),
    (["--prompt", "hi", "--logit-bias", '{"a": 1}'], '--logit-bias: "a" is not a token id'),
    (["--prompt", "hi", "--logit-bias", '{"3": 1000}'], "--logit-bias: logit_bias[3] must be a number in"),
    (["--prompt", "hi", "--logit-bias", '{"99999": 1}'], "--logit-bias: token id 99999 is not in the model's"),
    (["--prompt", "hi", "--repetition-penalty", "0"], "--repetition-penalty: the repetition penalty must be a number"),
    (["--prompt", "hi", "--repetition-penalty", "1.2", "--repeat-last-n", "-1"], "--repeat-last-n: a number of tokens"),
    (["--prompt", " ".join(["w5"] * 500), "--raw", "--max-new-tokens", "20"],
     "with --max-new-tokens 20 that exceeds the model's context of 512 positions"),
])
def test_bad_run_inputs(tiny_dir, tmp_path, extra, needle):
    plan = _plan(tmp_path / "p.json", tiny_dir / "m")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": ""}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    extra = [str(bad) if a == "BADLINES" else str(empty) if a == "EMPTYFILE" else str(tmp_path) if a == "TMPDIR"
             else a for a in extra]
    res = runner.invoke(app, ["run", "--plan", str(plan)] + extra)
    assert res.exit_code == 2, _out(res)
    assert needle in _out(res) and "Traceback" not in _out(res)


def test_a_later_turn_that_can_pass_the_context_is_refused_before_anything_runs(tiny_dir, tmp_path):
    """``--turns all``: a second turn after an answer of up to --max-new-tokens can pass the context: refused
    up front naming the file, prompt and turn (bench ran HF's methods past the context, then stopped with an
    error naming no prompt and no report); with --turns first the same file runs."""
    plan = _plan(tmp_path / "p.json", tiny_dir / "m")
    prompts = tmp_path / "two.jsonl"
    turns = [" ".join(["w5"] * 120), "w6 w7"]                 # the first turn about 240 tokens
    prompts.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": turns}) + "\n")
    for cmd in ("run", "bench"):
        res = runner.invoke(app, [cmd, "--plan", str(plan), "--prompts", str(prompts), "--raw", "--max-new-tokens",
                                  "200", "--turns", "all", "--device", "cpu"] + (["--methods", "ar"] if cmd == "bench"
                                                                                else ["--quiet"]))
        out = " ".join(_out(res).split())
        assert res.exit_code == 2 and "(question_id 1), turn 2:" in out and "512 positions" in out, out
        assert "tok/s" not in out and "Traceback" not in out
    res = runner.invoke(app, ["run", "--plan", str(plan), "--prompts", str(prompts), "--raw", "--max-new-tokens",
                              "200", "--device", "cpu", "--quiet"])
    assert res.exit_code == 0, _out(res)


def test_malformed_plan_and_bench_flags(tiny_dir, tmp_path):
    p = tmp_path / "p.json"
    p.write_text('{"format": "hsd-plan/9"}')
    res = runner.invoke(app, ["run", "--plan", str(p), "--prompt", "hi"])
    assert res.exit_code == 2 and "format" in _out(res)
    plan = _plan(tmp_path / "q.json", tiny_dir / "m")
    res = runner.invoke(app, ["bench", "--plan", str(plan), "--max-new-tokens", "0"])
    assert res.exit_code == 2 and "--max-new-tokens" in _out(res)
    res = runner.invoke(app, ["bench", "--plan", str(plan), "--methods", "ar,warp"])
    assert res.exit_code == 2 and "--methods: unknown method 'warp'" in _out(res) and "hf_early_exit" in _out(res)
    res = runner.invoke(app, ["bench", "--plan", str(plan), "--methods", " , "])
    assert res.exit_code == 2 and "--methods" in _out(res) and "Traceback" not in _out(res)
    for methods, said in (("hsd,hsd", "--methods: hsd given twice"), ("hsd,,ar", "an empty item")):
        res = runner.invoke(app, ["bench", "--plan", str(plan), "--methods", methods])
        assert res.exit_code == 2 and said in " ".join(_out(res).split()), _out(res)
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    res = runner.invoke(app, ["bench", "--plan", str(plan), "--prompts", str(bad)])
    assert res.exit_code == 2 and f"{bad}: line 2: not UTF-8 text" in " ".join(_out(res).split()), _out(res)
    res = runner.invoke(app, ["bench", "--plan", str(plan), "--temperature", "1", "--seed", str(2**64 - 1),
                              "--limit", "2", "--methods", "hsd"])   # prompt 2's seed is one past 64 bits
    assert res.exit_code == 2 and "--seed: the seeds of these prompts" in _out(res) and "tok/s" not in _out(res)


def test_bench_under_load_reports_every_method_and_level(tiny_dir, tmp_path):
    """``hsd bench --concurrency 1,2``: for each client count the three methods, 2 clients' figures, the
    load-aware plan's level (its hierarchy, and its prediction where the count is a level), every answer equal to
    the target's; the JSON report and the plot are written."""
    plan = _plan(tmp_path / "plan.json", tiny_dir / "m", hierarchy=("ngram", "layer2", "layer4"), budgets=(2, 3))
    d = json.loads(plan.read_text())
    d["by_load"] = {"1": {"hierarchy": ["ngram", "layer2", "layer4"], "budgets": [2, 3], "expected_latency": 0.01},
                    "4": {"hierarchy": ["layer4"], "budgets": [], "expected_latency": 0.02, "tokens_per_s": 200.0}}
    plan.write_text(json.dumps(d))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hello there"}\n{"prompt": "Write a list"}\n{"prompt": "third"}\n')
    rep_path, png = tmp_path / "load.json", tmp_path / "load.png"
    res = runner.invoke(app, ["bench", "--plan", str(plan), "--prompts", str(prompts), "--concurrency", "1,2",
                              "--requests", "2", "--max-new-tokens", "5", "--json", str(rep_path), "--plot", str(png),
                              "--device", "cpu"])
    assert res.exit_code == 0, _out(res)
    rep = json.loads(rep_path.read_text())
    assert rep["started"] <= rep["ended"]
    assert rep["kind"] == "load" and rep["concurrency"] == [1, 2] and rep["methods"] == ["hsd", "hsd_batch1",
                                                                                       "hsd_plain"]
    assert rep["max_batch"] == {"hsd": 2, "hsd_batch1": 1, "hsd_plain": 2}
    for lv, c in zip(rep["levels"], (1, 2)):
        assert lv["clients"] == c and set(lv["methods"]) == {"hsd", "hsd_batch1", "hsd_plain"}
        for m, f in lv["methods"].items():
            assert f["equal_to_target"] is True, (c, m)
            assert f["aggregate_tokens_per_s"] > 0 and f["ttft_p50_s"] >= 0
            assert [r["requests"] for r in f["rounds"]] == [2 * c]
        assert lv["hsd_over_batch1"] == pytest.approx(lv["methods"]["hsd"]["aggregate_tokens_per_s"]
                                                      / lv["methods"]["hsd_batch1"]["aggregate_tokens_per_s"])
    one, two = (lv["methods"]["hsd"] for lv in rep["levels"])
    assert one["hierarchy"] == ["ngram", "layer2", "layer4"] and one["predicted_tokens_per_s"] == pytest.approx(100)
    assert two["load_level"] == 4 and two["hierarchy"] == ["layer4"] and two["predicted_tokens_per_s"] is None
    assert png.stat().st_size > 1000 and "x batch1" in _out(res)


def test_bench_under_load_stopped_part_way_reports_the_levels_finished(tiny_dir, tmp_path, monkeypatch):
    """Ctrl-C during the second load level: the table and --json hold the first level, ``stopped`` says so, exit
    130 (it kept nothing)."""
    from hsd_opt.measure import load_bench

    plan = _plan(tmp_path / "plan.json", tiny_dir / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hello there"}\n{"prompt": "Write a list"}\n')
    real = load_bench.serve_clients

    def serve(h, prompts, c, *a, **kw):
        if c == 2:
            raise KeyboardInterrupt
        return real(h, prompts, c, *a, **kw)

    monkeypatch.setattr(load_bench, "serve_clients", serve)
    rep_path = tmp_path / "load.json"
    res = runner.invoke(app, ["bench", "--plan", str(plan), "--prompts", str(prompts), "--concurrency", "1,2",
                              "--requests", "1", "--max-new-tokens", "4", "--methods", "hsd,hsd_plain", "--json",
                              str(rep_path), "--device", "cpu"])
    assert res.exit_code == 130, _out(res)
    rep = json.loads(rep_path.read_text())
    assert [lv["clients"] for lv in rep["levels"]] == [1] and rep["stopped"]["levels_done"] == 1
    assert all(f["equal_to_target"] for f in rep["levels"][0]["methods"].values())
    assert "stopped: the report holds the 1 of 2 load levels" in " ".join(_out(res).split())
    # a request that fails (out of memory at a larger batch) ended the bench with a traceback, the levels lost

    def failing(h, prompts, c, *a, **kw):
        if c == 2:
            raise RuntimeError("out of memory")
        return real(h, prompts, c, *a, **kw)

    monkeypatch.setattr(load_bench, "serve_clients", failing)
    rep_path.unlink()
    res = runner.invoke(app, ["bench", "--plan", str(plan), "--prompts", str(prompts), "--concurrency", "1,2",
                              "--requests", "1", "--max-new-tokens", "4", "--methods", "hsd,hsd_plain", "--json",
                              str(rep_path), "--device", "cpu"])
    assert res.exit_code == 1, _out(res)
    rep = json.loads(rep_path.read_text())
    assert [lv["clients"] for lv in rep["levels"]] == [1] and rep["stopped"]["failed"] == "RuntimeError: out of memory"
    assert "a request failed (RuntimeError: out of memory); the report holds the 1 of 2" in " ".join(_out(res).split())


def test_bench_under_load_samples_as_asked(tiny_dir, tmp_path):
    """``hsd bench --concurrency 1,2 --temperature 1 --top-k 5``: the report says how it sampled, the answers are
    not compared (null, ``-`` in the table), the title names the sampling, every request is served."""
    plan = _plan(tmp_path / "plan.json", tiny_dir / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hello there"}\n{"prompt": "Write a list"}\n')
    rep_path = tmp_path / "load.json"
    res = runner.invoke(app, ["bench", "--plan", str(plan), "--prompts", str(prompts), "--concurrency", "1,2",
                              "--requests", "2", "--max-new-tokens", "4", "--temperature", "1", "--top-k", "5",
                              "--methods", "hsd,hsd_plain", "--json", str(rep_path), "--device", "cpu"])
    assert res.exit_code == 0, _out(res)
    rep = json.loads(rep_path.read_text())
    assert rep["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 5, "min_p": 0.0, "seed": None}
    for lv, c in zip(rep["levels"], (1, 2)):
        for f in lv["methods"].values():
            assert f["equal_to_target"] is None and [r["requests"] for r in f["rounds"]] == [2 * c]
    assert "sampling at temperature 1, top-k 5 (unseeded)" in " ".join(_out(res).split())


@pytest.mark.parametrize("extra,needle", [
    (["--concurrency", "0"], "--concurrency: client counts must be >= 1"),
    (["--concurrency", "1,2", "--methods", "ar"],
     "--methods: unknown method 'ar'; known with --concurrency: hsd, hsd_batch1, hsd_plain"),
    (["--concurrency", "2", "--temperature", "0.7", "--seed", "3"], "--seed: not with --concurrency"),
    (["--concurrency", "2", "--top-k", "3"], "--top-k 3 needs --temperature > 0"),
    (["--concurrency", "2", "--temperature", "0.7", "--top-p", "1.5"], "--top-p"),
    (["--concurrency", "2", "--turns", "all", "--assistant", "x"], "--turns, --assistant: not with --concurrency"),
    (["--concurrency", "2", "--retime", "p.json"], "--retime p.json: file not found"),     # before the model loads
    (["--concurrency", "2", "--requests", "0"], "--requests: expected >= 1"),
    (["--concurrency", "2", "--max-batch", "0"], "--max-batch: expected >= 1"),
])
def test_bench_under_load_refuses_bad_flags(tiny_dir, tmp_path, extra, needle):
    plan = _plan(tmp_path / "plan.json", tiny_dir / "m")
    res = runner.invoke(app, ["bench", "--plan", str(plan)] + extra)
    assert res.exit_code == 2, _out(res)
    assert needle in _out(res) and "Traceback" not in _out(res)


def test_stats_table_reads_bottom_as_proposals_and_upper_levels_as_checks():
    from rich.console import Console

    from hsd_opt.commands.run import stats_table
    from hsd_opt.runtime.decode import LevelStats

    levels = [LevelStats("lookup", calls=10, drafted=6, abstained=7).to_dict(),
              LevelStats("int4", calls=10, drafted=6, accepted=4, rejections=2).to_dict(),
              LevelStats("layer30", calls=2, drafted=12, accepted=11, rejections=1).to_dict()]
    stats = {"tokens": 13, "seconds": 1.0, "tokens_per_s": 13.0, "target_calls": 2, "tokens_per_target_call": 6.5,
             "seconds_per_token": 0.05, "levels": levels}
    console = Console(width=200, record=True)
    console.print(stats_table(stats, 0.04))
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in console.export_text().splitlines() if "level " in line}
    assert rows["level lookup"] == "draft calls 10, proposed 6 tokens (in 30% of calls)"
    assert rows["level int4"] == "passes 10, checked 6 drafts, accepted 4, a=0.667"
    assert rows["level layer30"] == "passes 2, checked 12 drafts, accepted 11, a=0.917"
    console = Console(width=200, record=True)            # the target alone: its steps, not "draft calls"
    console.print(stats_table({**stats, "levels": [LevelStats("layer30", calls=13, drafted=13).to_dict()]}, 0.04))
    assert "steps 13, generated 13 tokens" in console.export_text()


def test_run_warns_where_threads_or_kernel_variant_differ_from_the_plans(tiny_dir, tmp_path):
    """A plan's costs were measured with some threads and kernel variant: a run with others says so (its predicted
    speed may not hold), one with the same says nothing."""
    import torch

    from hsd_opt.engine import kernels

    info = kernels.info()
    variant = info.variant if info else None
    same = _plan(tmp_path / "same.json", tiny_dir / "m", torch_threads=torch.get_num_threads(),
                 kernels={"variant": variant, "openmp": True} if variant else None)
    other = _plan(tmp_path / "other.json", tiny_dir / "m", torch_threads=torch.get_num_threads() + 3,
                  kernels={"variant": "avx512-vnni" if variant != "avx512-vnni" else "avx2", "openmp": True})
    res = runner.invoke(app, ["run", "--plan", str(same), "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu"])
    assert res.exit_code == 0, _out(res)
    assert "measured with" not in _out(res) and "measured on" not in _out(res)
    res = runner.invoke(app, ["run", "--plan", str(other), "--prompt", "hi", "--max-new-tokens", "2",
                              "--device", "cpu"])
    assert res.exit_code == 0, _out(res)
    text = " ".join(_out(res).split())
    assert f"measured with {torch.get_num_threads() + 3} thread(s), this run uses {torch.get_num_threads()}" in text
    assert "kernels, this run uses" in text and "profile again on this machine" in text


def test_a_plan_timed_with_openmp_threads_differs_from_kernels_without(tiny_dir, tmp_path):
    """Kernels built without OpenMP (``HSD_OPENMP=0``) run each call on one thread: a plan whose costs were timed
    with OpenMP threads (or without) says so where either side runs more than one thread; one thread each, the
    same variant and threads, or a plan that does not record it, says nothing."""
    from hsd_opt.formats import load_plan
    from hsd_opt.runtime.runner import machine_differences

    def plan(openmp):
        return load_plan(_plan(tmp_path / f"{openmp}.json", tiny_dir / "m", torch_threads=2,
                               kernels={"variant": "avx2", **({} if openmp is None else {"openmp": openmp})}))

    timed_with, timed_without, silent = plan(True), plan(False), plan(None)
    said = machine_differences(timed_with, 2, "avx2", False)
    assert len(said) == 1 and "with OpenMP threads, this run's are without OpenMP (HSD_OPENMP=0" in said[0]
    assert "without OpenMP" in machine_differences(timed_without, 2, "avx2", True)[0]
    assert machine_differences(timed_with, 2, "avx2", True) == []
    assert machine_differences(silent, 2, "avx2", False) == []
    one = load_plan(_plan(tmp_path / "one.json", tiny_dir / "m", torch_threads=1,
                          kernels={"variant": "avx2", "openmp": True}))
    assert machine_differences(one, 1, "avx2", False) == []


def test_run_warns_where_its_sampling_differs_from_the_plans(tiny_dir, tmp_path):
    """A plan's acceptance rates are for the sampling it was profiled with: a run that samples otherwise (greedy
    against sampled, another temperature, other filters) says so, naming the plan; the same sampling, or a plan
    that does not say, says nothing."""
    sampled = _plan(tmp_path / "t1.json", tiny_dir / "m", temperature=1.0, top_p=1.0, top_k=40, min_p=0.05)
    silent = _plan(tmp_path / "old.json", tiny_dir / "m")
    base = ["run", "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu"]
    for plan, extra, said in (
            (sampled, ["--temperature", "1", "--top-k", "40", "--min-p", "0.05"], None),
            (silent, ["--temperature", "1"], None),
            (sampled, [], "was profiled sampling at temperature 1, top-k 40, min-p 0.05; this run is greedy"),
            (sampled, ["--temperature", "1"], "this run is sampling at temperature 1;"),
            (sampled, ["--temperature", "0.7", "--top-k", "40", "--min-p", "0.05"],
             "this run is sampling at temperature 0.7, top-k 40, min-p 0.05")):
        res = runner.invoke(app, base + ["--plan", str(plan), *extra])
        assert res.exit_code == 0, _out(res)
        text = " ".join(_out(res).split())
        if said is None:
            assert "was profiled" not in text, extra
        else:
            assert said in text and str(plan) in text and "hsd profile takes the same sampling options" in text, extra


def test_run_under_a_json_schema_equals_the_targets_masked_output(tiny_dir, tmp_path):
    """``hsd run --json-schema``: every hierarchy level reads the masked model, so the plan's tokens are the target's
    own masked greedy tokens; a regex grammar file constrains the same way."""
    from hsd_opt.commands.common import compile_grammar
    from hsd_opt.formats import load_plan
    from hsd_opt.grammar.compiler import GrammarSpec
    from hsd_opt.grammar.constraint import Constraint
    from hsd_opt.models.loading import load_model
    from hsd_opt.prompts import encode_prompt
    from hsd_opt.runtime.runner import hsd_for_plan

    plan = _plan(tmp_path / "plan.json", tiny_dir / "m", hierarchy=("ngram", "layer1", "layer2", "layer4"),
                 budgets=(1, 2, 3))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yz"]}},
              "required": ["a", "b"], "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    (tmp_path / "g.regex").write_text("[0-9]{3}-[a-c]+\n")
    loaded = load_model(str(tiny_dir / "m"), device="cpu")
    ar = hsd_for_plan(load_plan(plan), loaded, hierarchy=["layer4"], budgets=[])
    cases = [("--json-schema", tmp_path / "s.json", GrammarSpec.json_schema(schema)),
             ("--grammar", tmp_path / "g.regex", GrammarSpec("regex", "[0-9]{3}-[a-c]+"))]
    for flag, path, spec in cases:
        out = tmp_path / "out.jsonl"
        res = runner.invoke(app, ["run", "--plan", str(plan), "--prompt", "Hello", "--max-new-tokens", "24",
                                  flag, str(path), "--json", str(out), "--device", "cpu", "--quiet"])
        assert res.exit_code == 0, _out(res)
        got = json.loads(out.read_text())["token_ids"]
        grammar = compile_grammar(spec, loaded)
        ref = ar.generate(encode_prompt(loaded.tokenizer, "Hello"), 24, constraint=Constraint(grammar)).token_ids
        assert got == ref
        assert got != ar.generate(encode_prompt(loaded.tokenizer, "Hello"), 24).token_ids
        text = loaded.tokenizer.decode(got, skip_special_tokens=True)
        assert text.startswith("{\"a\": ") if flag == "--json-schema" else text[:4].rstrip("-").isdigit()
        cut = "(cut at --max-new-tokens"
        assert (cut in _out(res)) == (not Constraint(grammar).accepting(got))
        res = runner.invoke(app, ["run", "--plan", str(plan), "--prompt", "Hello", "--max-new-tokens", "2", flag,
                                  str(path), "--device", "cpu", "--quiet"])
        assert res.exit_code == 0 and f"{cut} 2: the answer does not yet complete what {flag} {path} asks)" in \
            _out(res), _out(res)


@pytest.mark.parametrize("extra,needle", [
    (["--json-schema", "MISSING"], "--json-schema"),
    (["--json-schema", "BADSCHEMA"], "Invalid type: strin"),
    (["--json-schema", "NOTJSON"], "not JSON"),
    (["--grammar", "BADREGEX"], "--grammar"),
    (["--json-schema", "BADSCHEMA", "--grammar", "BADREGEX"], "at most one of --json-schema"),
])
def test_bad_grammar_inputs_exit_2_naming_the_flag(tiny_dir, tmp_path, extra, needle):
    plan = _plan(tmp_path / "p.json", tiny_dir / "m")
    (tmp_path / "bad.json").write_text('{"type": "strin"}')
    (tmp_path / "notjson.json").write_text("{type: object")
    (tmp_path / "bad.regex").write_text("[a-z")
    names = {"MISSING": tmp_path / "nope.json", "BADSCHEMA": tmp_path / "bad.json",
             "NOTJSON": tmp_path / "notjson.json", "BADREGEX": tmp_path / "bad.regex"}
    extra = [str(names.get(a, a)) for a in extra]
    res = runner.invoke(app, ["run", "--plan", str(plan), "--prompt", "hi", "--max-new-tokens", "3"] + extra)
    assert res.exit_code == 2, _out(res)
    assert needle in _out(res) and "Traceback" not in _out(res)


def test_a_schema_past_the_grammar_engines_limit_stops_the_run_with_exit_2_naming_the_flag(tiny_dir, tmp_path):
    """500 optional properties compile but meet llguidance's parser row limit at the answer's first token: exit 2
    with one line naming ``--json-schema FILE`` (it said ``grammar: token ... is not allowed`` and the engine's
    state and grammar, 14 KB), the streamed text's line ended first (the error was printed after the ``{``)."""
    plan = _plan(tmp_path / "p.json", tiny_dir / "m")
    path = tmp_path / "wide.json"
    path.write_text(json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)}}))
    res = runner.invoke(app, ["run", "--plan", str(plan), "--prompt", "hi", "--max-new-tokens", "4", "--json-schema",
                              str(path), "--device", "cpu"])
    assert res.exit_code == 2, _out(res)
    said = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert said == [ln for ln in said if ln.startswith(f"error: --json-schema {path}: the grammar engine (llguidance) "
                                                       "cannot follow it past ")] and len(said) == 1, _out(res)
    assert "<state>" not in _out(res) and res.stdout.endswith("\n"), repr(res.stdout)


def test_bench_under_a_json_schema_runs_our_methods_masked_and_says_why_hf_does_not_run(tiny_dir, tmp_path):
    plan = _plan(tmp_path / "plan.json", tiny_dir / "m", hierarchy=("ngram", "layer2", "layer4"), budgets=(2, 3))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hello there", "task": "chat"}\n{"prompt": "Count: 1 2 3", "task": "math"}\n')
    (tmp_path / "s.json").write_text(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                 "required": ["a"], "additionalProperties": False}))
    out = tmp_path / "b.json"
    res = runner.invoke(app, ["bench", "--plan", str(plan), "--prompts", str(prompts), "--max-new-tokens", "12",
                              "--json-schema", str(tmp_path / "s.json"), "--json", str(out), "--device", "cpu"])
    assert res.exit_code == 0, _out(res)
    rep = json.loads(out.read_text())
    assert rep["grammar"]["kind"] == "json_schema" and rep["reference"] == "ar"
    assert rep["methods"]["hsd"]["matches_reference"] is True
    assert "HF generate does not follow a grammar" in rep["methods"]["hf_ar"]["error"]
    assert "hf_ar: HF generate does not follow a grammar" in _out(res) and "not run" in _out(res)
    assert set(rep["by_task"]) == {"json"}                   # under a grammar every prompt runs the plan for JSON
    res = runner.invoke(app, ["bench", "--plan", str(plan), "--concurrency", "1,2",
                              "--json-schema", str(tmp_path / "s.json")])
    assert res.exit_code == 2 and "--json-schema" in _out(res)


def test_bench_follows_each_prompt_lines_own_schema(tiny_dir, tmp_path):
    """A prompt line's ``schema`` applies to its answers (no flag): our methods decode under it, lossless against
    our masked AR loop; a line without one runs free; the load bench refuses such lines, naming the file."""
    plan = _plan(tmp_path / "plan.json", tiny_dir / "m", hierarchy=("ngram", "layer2", "layer4"), budgets=(2, 3))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Count: 1 2 3", "schema": schema}) + "\n"
                       + json.dumps({"prompt": "Hello there", "task": "chat"}) + "\n")
    out = tmp_path / "b.json"
    res = runner.invoke(app, ["bench", "--plan", str(plan), "--prompts", str(prompts), "--max-new-tokens", "12",
                              "--methods", "ar,hsd", "--json", str(out), "--device", "cpu"])
    assert res.exit_code == 0, _out(res)
    rep = json.loads(out.read_text())
    assert rep["methods"]["hsd"]["matches_reference"] is True and set(rep["by_task"]) == {"json", "chat"}
    lines = tmp_path / "run.jsonl"                       # hsd run follows the line's schema too
    res = runner.invoke(app, ["run", "--plan", str(plan), "--prompts", str(prompts), "--max-new-tokens", "40",
                              "--json", str(lines), "--device", "cpu", "--quiet"])
    assert res.exit_code == 0, _out(res)
    under, free = [json.loads(x) for x in lines.read_text().splitlines()]
    assert under["text"].startswith('{"a": ') and not free["text"].startswith("{")
    res = runner.invoke(app, ["bench", "--plan", str(plan), "--prompts", str(prompts), "--concurrency", "1,2"])
    assert res.exit_code == 2 and "does not follow the prompts' schemas" in _out(res) and str(prompts) in _out(res)


def test_bench_refuses_what_it_cannot_run_before_running_anything(tiny_dir, tmp_path):
    """No method that can run, a prompt that passes the model's context (512 positions here: HF's loop would have
    decoded on past it), the load bench's options without --concurrency, and an output that is one of the inputs
    or the other output: each one line, exit 2, nothing written."""
    plan = _plan(tmp_path / "plan.json", tiny_dir / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hello there"}\n\n' + json.dumps({"prompt": "word " * 600}) + "\n")
    before = plan.read_bytes()
    cases = [
        (["--methods", "hsd_task"], "--methods: none of the methods can run: hsd_task: "),
        (["--prompts", str(prompts), "--methods", "hf_ar,ar"], f"--prompts {prompts}: line 3 has "),   # its line
        (["--max-new-tokens", "600", "--methods", "hf_ar,ar", "--limit", "1"], "the suite: line 1 has "),
        (["--requests", "3"], "--requests: only with --concurrency"),
        (["--rounds", "2", "--max-batch", "4"], "--max-batch, --rounds: only with --concurrency"),
        (["--json", str(plan)], f"--json {plan}: the same file as --plan"),
        (["--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.json")], "the same file as --json"),
        (["--json", str(tiny_dir / "m" / "config.json")], "a file of the model in the folder of"),   # plan's model
        (["--concurrency", "1", "--plot", str(tiny_dir / "m" / "model.safetensors")], "a file of the model in the"),
        (["--methods", "hf_assisted", "--assistant", str(tmp_path / "nowhere")], f"--assistant {tmp_path}"),
        (["--methods", "hf_assisted,ar", "--assistant", " "], "--assistant: the name is empty"),   # was ignored
    ]
    for args, needle in cases:
        res = runner.invoke(app, ["bench", "--plan", str(plan), "--max-new-tokens", "4", *args])
        assert res.exit_code == 2 and needle in _out(res) and "Traceback" not in _out(res), (args, _out(res))
    assert plan.read_bytes() == before and not (tmp_path / "b.json").exists()
    config = (tiny_dir / "m" / "config.json").read_text()
    res = runner.invoke(app, ["run", "--plan", str(plan), "--prompt", "hi", "--json",
                              str(tiny_dir / "m" / "config.json")])
    said = " ".join(_out(res).split())
    assert res.exit_code == 2 and "provenance.model" in said and "a file of the model in the folder of" in said, said
    assert (tiny_dir / "m" / "config.json").read_text() == config
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF a model")
    for args in (["--model", str(gguf)], ["--model", "tiny", "--draft-model", str(gguf)]):
        res = runner.invoke(app, ["profile", *args, "--prompts", str(prompts), "--out", str(gguf)])
        assert res.exit_code == 2 and f"the same file as {args[-2]}" in _out(res), _out(res)   # it was replaced
    assert gguf.read_bytes() == b"GGUF a model"
    profile = tmp_path / "profile.json"
    profile.write_text("{}")
    res = runner.invoke(app, ["solve", "--profile", str(profile), "--out", str(profile)])
    assert res.exit_code == 2 and "--out" in _out(res) and "the same file as --profile" in _out(res), _out(res)
    assert profile.read_text() == "{}"


def test_a_plan_runs_with_its_model_named_by_any_path(tiny_dir, tmp_path, monkeypatch):
    """A plan made for a local model runs with ``--model`` naming the same folder another way (relative, with
    ``./``, absolute); another folder is still refused."""
    plan = _plan(tmp_path / "plan.json", tiny_dir / "m")
    monkeypatch.chdir(tiny_dir)
    for name in ("m", "./m", str(tiny_dir / "m")):
        res = runner.invoke(app, ["run", "--plan", str(plan), "--prompt", "hi", "--max-new-tokens", "2",
                                  "--model", name])
        assert res.exit_code == 0, (name, _out(res))
    res = runner.invoke(app, ["run", "--plan", str(plan), "--prompt", "hi", "--max-new-tokens", "2",
                              "--model", "./other"])
    assert res.exit_code == 2 and "provenance.model" in _out(res), _out(res)


@pytest.mark.slow
def test_run_writes_its_json_when_the_terminal_output_cannot_be_written(tiny_dir, tmp_path):
    """stdout closed (``| head``) or full: the ``--json`` file still holds every finished prompt's line (nothing
    was written, even with every prompt done: the tables went to stdout first)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    plan = _plan(tmp_path / "plan.json", tiny_dir / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("Hello there", "Count: 1 2 3", "Why?")))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    for name in ("full", "closed"):
        out = tmp_path / f"{name}.jsonl"
        cmd = [sys.executable, "-m", "hsd_opt", "run", "--plan", str(plan), "--prompts", str(prompts),
               "--max-new-tokens", "6", "--device", "cpu", "--json", str(out), "--quiet"]
        if name == "full":
            with open("/dev/full", "w") as full:
                r = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True, env=env, timeout=300)
            err = r.stderr
        else:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            proc.stdout.close()                     # the reader went away before the first line
            err = proc.stderr.read()
            proc.wait(timeout=300)
            r = proc
        assert r.returncode != 0 and "Traceback" not in err, err
        kept = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
        assert [x["prompt"] for x in kept] == ["Hello there", "Count: 1 2 3", "Why?"], (name, err)


@pytest.mark.slow
def test_run_on_a_terminal_that_cannot_encode_the_answer_shows_what_it_can(tmp_path):
    """stdout in an encoding without the answer's characters (``PYTHONIOENCODING=ascii``, a Latin-1 locale): they
    are written as ``?`` and the run goes on; ``--json`` holds the exact text (it was a UnicodeEncodeError traceback
    mid-answer, the finished prompts' lines lost)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    plan = _plan(tmp_path / "plan.json", "smollm2-135m", hierarchy=("layer30",), budgets=(),
                 models=[{"name": "layer30", "kind": "target", "layer": 30}])      # the embedded model
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("Say hi.", "Say cat in Chinese.", "Why?")))
    out = tmp_path / "answers.jsonl"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), PYTHONIOENCODING="ascii")
    r = subprocess.run([sys.executable, "-m", "hsd_opt", "run", "--plan", str(plan), "--prompts", str(prompts),
                        "--max-new-tokens", "16", "--device", "cpu", "--json", str(out)],
                       capture_output=True, env=env, timeout=300)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 0 and "Traceback" not in err, err
    texts = [json.loads(x)["text"] for x in out.read_text(encoding="utf-8").splitlines()]
    assert len(texts) == 3 and any(not t.isascii() for t in texts), texts     # the case itself: not ASCII
    shown = r.stdout.decode("ascii")
    for t in texts:
        assert t.encode("ascii", "replace").decode("ascii") in shown, (t, shown)


def test_run_keeps_the_finished_prompts_when_stopped_and_seeds_each_prompt_and_turn(tiny_dir, tmp_path,
                                                                                    monkeypatch, capsys):
    """Ctrl-C (or an error) after some prompts: their lines are written to --json and said, exit 130 (they were
    all lost); sampled, prompt i turn k is seeded ``seed + i + 1000003 k`` as ``hsd bench`` seeds it (every prompt
    and turn had the same seed)."""
    import hsd_opt.commands.run as run_module
    from hsd_opt.formats import load_plan
    from hsd_opt.models.loading import load_model
    from hsd_opt.prompts import encode_prompt
    from hsd_opt.runtime.runner import hsd_for_plan

    plan = _plan(tmp_path / "plan.json", tiny_dir / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("Hello there", "Count: 1 2 3", "Why?")))
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["run", "--plan", str(plan), "--prompts", str(prompts), "--max-new-tokens", "6",
                              "--temperature", "0.9", "--seed", "5", "--json", str(out), "--quiet"])
    assert res.exit_code == 0, _out(res)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    loaded = load_model(str(tiny_dir / "m"), device="cpu")
    h = hsd_for_plan(load_plan(plan), loaded)
    for i, x in enumerate(lines):
        want = h.generate(encode_prompt(loaded.tokenizer, x["prompt"]), 6, temperature=0.9, seed=5 + i).token_ids
        assert x["token_ids"] == want, i

    real, calls = run_module._run_prompt, []

    def stopped_at_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(run_module, "_run_prompt", stopped_at_the_second)
    out.unlink()
    res = runner.invoke(app, ["run", "--plan", str(plan), "--prompts", str(prompts), "--max-new-tokens", "6",
                              "--temperature", "0.9", "--seed", "5", "--json", str(out), "--quiet"])
    assert res.exit_code == 130 and f"the 1 turns of the prompts finished are in {out}" in _out(res), _out(res)
    kept = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["prompt"], x["token_ids"]) for x in kept] == [(x["prompt"], x["token_ids"]) for x in lines[:1]]
    import signal
    import sys

    from hsd_opt import cli

    calls.clear()                   # the console script: the stop said once (not also "interrupted" by the CLI)
    monkeypatch.setattr(sys, "argv", ["hsd", "run", "--plan", str(plan), "--prompts", str(prompts),
                                      "--max-new-tokens", "6", "--json", str(out), "--quiet"])
    before = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as e:
            cli.main()
    finally:
        signal.signal(signal.SIGTERM, before)
    err = capsys.readouterr().err
    assert e.value.code == 130 and "turns of the prompts finished" in err and "interrupted" not in err, err
    def stopped_at_the_first(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "_run_prompt", stopped_at_the_first)      # nothing finished: said, not silent
    out.unlink()
    base = ["run", "--plan", str(plan), "--prompts", str(prompts), "--max-new-tokens", "6", "--quiet"]
    res = runner.invoke(app, [*base, "--json", str(out)])
    assert res.exit_code == 130 and "interrupted: stopped before it finished" in _out(res) and not out.exists()
    monkeypatch.setattr(run_module, "_run_prompt", stopped_at_the_second)     # without --json: said where they are
    calls.clear()
    res = runner.invoke(app, base)
    assert res.exit_code == 130 and "the 1 turns of the prompts finished are printed above" in _out(res), _out(res)


def test_the_streamed_text_is_the_answers_text_whole_characters_included(embedded, capsys):
    """Blocks that end inside a character of several UTF-8 bytes: the complete characters before it are written
    at once, and what is left when the answer ends (it held the whole block back, and dropped the rest)."""
    from hsd_opt.commands.run import text_streamer

    tok = embedded.tokenizer
    text = "🌟🌟 party 🎉🎂 ok 日本語"
    ids = tok.encode(text, add_special_tokens=False)
    for cut in (1, 2, 3):
        stream = text_streamer(tok, False)
        for i in range(0, len(ids) - cut, cut):               # the last block never comes: a cut answer
            stream(ids[i:i + cut])
        partial = tok.decode(ids[: (len(ids) - cut - 1) // cut * cut + cut], skip_special_tokens=True)
        stream.finish(partial)
        assert capsys.readouterr().out == partial, cut


def test_streamed_text_goes_on_where_a_longer_decode_rewrites_what_was_written(capsys):
    """A byte-fallback decoder (Llama 2's) reads a run of byte tokens that turns invalid as U+FFFD, the character
    it printed before included: the stream wrote nothing more, the rest of the answer lost from stdout."""
    from hsd_opt.commands.run import text_streamer

    class Rewriting:
        texts = {1: "Hello\u00e9", 2: "Hello\ufffd\ufffd", 3: "Hello\ufffd\ufffd world.",
                 4: "Hello\ufffd\ufffd world. The end."}

        def decode(self, ids, skip_special_tokens=True):
            return self.texts[len(ids)]

    stream = text_streamer(Rewriting(), False)
    for t in (1, 2, 3):
        stream([t])
    stream.finish(Rewriting.texts[4])
    printed = capsys.readouterr().out
    assert printed.endswith(" world. The end.") and len(printed) == len(Rewriting.texts[4]), printed


def test_text_given_on_the_command_line_that_is_not_utf8_is_one_line(tmp_path):
    """Bytes of argv that are no UTF-8 (Python's lone surrogates) were a TypeError traceback from the tokenizer once
    the model had loaded (``--prompt``), or a chat template's refusal (``hsd chat --system``)."""
    from tests.helpers import cli_output, run_cli, save_tiny

    plan = write_plan(tmp_path / "plan.json", save_tiny(tmp_path / "m"), hierarchy=("ngram", "layer4"), budgets=(1,))
    for args in (("run", "--plan", plan, "--prompt", "w1 \udcff w2"), ("chat", "--plan", plan, "--system", "\udcff")):
        res = run_cli(*args)
        flag = args[3]
        assert res.exit_code == 2 and f"error: {flag}: not UTF-8 text" in cli_output(res), cli_output(res)


def test_a_plans_missing_model_is_named_as_the_plans_and_an_empty_model_flag_is_refused(tmp_path):
    """Where the model comes from the plan (no --model), an error loading it names the plan's field, not a --model
    the user never gave; ``--model ""`` was silently the plan's model."""
    from tests.helpers import cli_output, run_cli, save_tiny

    plan = write_plan(tmp_path / "plan.json", save_tiny(tmp_path / "m"), hierarchy=("ngram", "layer4"), budgets=(1,))
    d = json.loads(plan.read_text())
    gone = tmp_path / "no-such-model"
    d["provenance"]["model"] = str(gone)
    plan.write_text(json.dumps(d))
    res = run_cli("run", "--plan", plan, "--prompt", "w1", "--max-new-tokens", 2)
    out = cli_output(res)
    assert res.exit_code == 2 and f"error: {plan}: provenance.model {gone}: " in out and "--model" not in out, out
    for empty in ("", "  "):
        res = run_cli("run", "--plan", plan, "--model", empty, "--prompt", "w1")
        assert res.exit_code == 2 and "--model: an empty name" in cli_output(res), cli_output(res)


def test_a_broken_chat_template_is_one_line_not_a_traceback(tmp_path):
    """A model whose chat template does not compile (or names what is undefined) says so, with what to do; it was a
    jinja2 traceback in every command that encodes a prompt."""
    from tests.helpers import cli_output, run_cli, save_tiny

    for template in ("{% for m in messages %}{{ m.content }", "{{ messages[0].content | no_such_filter }}"):
        model = save_tiny(tmp_path / "m", chat_template=template)
        plan = write_plan(tmp_path / "plan.json", model, hierarchy=("ngram", "layer4"), budgets=(1,))
        res = run_cli("run", "--plan", plan, "--prompt", "w1", "--max-new-tokens", 2)
        out = cli_output(res)
        assert res.exit_code == 2 and "its chat template fails" in out and "--raw" in out, out
        assert "Traceback" not in out
        assert run_cli("run", "--plan", plan, "--prompt", "w1", "--max-new-tokens", 2, "--raw").exit_code == 0


def test_hsd_for_plan_refuses_what_is_not_a_plan_or_a_loaded_model(tiny_dir, tmp_path):
    """The README's runtime call handed a path or None: AttributeError on ``provenance`` or ``model_id``."""
    from hsd_opt.errors import HsdError
    from hsd_opt.formats import load_plan
    from hsd_opt.models.loading import load_model
    from hsd_opt.runtime.runner import hsd_for_plan

    plan = _plan(tmp_path / "plan.json", tiny_dir / "m")
    loaded = load_model(str(tiny_dir / "m"), device="cpu", dtype="float32")
    for args, said in (((None, loaded), "plan: expected a Plan .*got NoneType"),
                       ((str(plan), loaded), "plan: expected a Plan .*got str"),
                       ((load_plan(plan), None), "loaded: expected a LoadedModel .*got NoneType")):
        with pytest.raises(HsdError, match=said):
            hsd_for_plan(*args)


def test_an_output_beside_a_local_models_files_is_written_over_theirs_refused(tmp_path):
    """An output in a model's folder: a profile or report there (new, or from an earlier run) is written; one of
    the model's own files (weights, configuration, tokenizer) is refused, as the model's GGUF file itself is."""
    from hsd_opt.commands.common import check_outputs, local_model
    from hsd_opt.errors import HsdError

    folder = tmp_path / "m"
    folder.mkdir()
    for name in ("config.json", "model-00001-of-00002.safetensors", "tokenizer_config.json", "profile.json"):
        (folder / name).write_text("{}")
    for out in ("profile.json", "new-report.json"):
        check_outputs(("--out", folder / out), inputs=local_model("--model", str(folder)))
    for name in ("config.json", "model-00001-of-00002.safetensors", "tokenizer_config.json"):
        with pytest.raises(HsdError, match="a file of the model in the folder of --model"):
            check_outputs(("--out", folder / name), inputs=local_model("--model", str(folder)))
    with pytest.raises(HsdError, match="the same file as --model"):
        check_outputs(("--out", folder / "profile.json"), inputs=local_model("--model", str(folder / "profile.json")))
    assert local_model("--model", "smollm2-135m") == [] and local_model("--model", None) == []


_KIND = [{"name": "weird", "kind": "martian"}, {"name": "layer4", "kind": "target", "layer": 4}]
_PROFILE = ["profile", "--model", "smollm2-135m", "--out", "p.json"]


@pytest.mark.parametrize("args,needle", [
    (["run", "--prompt", "hi", "--mode", "lazy"], "--mode"),
    (["run", "--prompt", "hi", "--temperature", "-1"], "--temperature"),
    (["run", "--prompt", "hi", "--top-k", "5"], "--top-k 5 needs --temperature > 0"),
    (["run", "--prompt", "hi", "--logit-bias", '{"1": 1000}'], "--logit-bias"),
    (["run", "--prompt", "hi", "--repetition-penalty", "50"], "--repetition-penalty"),
    (["run", "--prompt", "hi", "--logprobs", "99", "--json", "out.jsonl"], "--logprobs"),
    (["run", "--prompt", "hi", "--target-precision", "int4"], "provenance.target_precision"),
    (["chat", "--min-p", "2", "--temperature", "1"], "--min-p"),
    (["bench", "--methods", "nope"], "--methods"),
    (["bench", "--concurrency", "0"], "--concurrency"),
    (["bench", "--concurrency", "2", "--top-p", "2", "--temperature", "1"], "--top-p"),
    (["bench", "--temperature", "1", "--seed", str(2**64 - 1)], "--seed"),
    (["bench", "--target-precision", "int8"], "provenance.target_precision"),
    ([*_PROFILE, "--tmax", "0"], "--tmax"),
    ([*_PROFILE, "--quantized", "int3"], "--quantized"),
    ([*_PROFILE, "--target-precision", "int2"], "--target-precision"),
    ([*_PROFILE, "--temperature", "nan"], "--temperature"),
    (["run", "--prompt", "hi", "--plan-kind"], "hierarchy[0]: 'weird' is of kind 'martian'"),
    (["run", "--prompt", "hi", "--model", "no-such-model"], "--model no-such-model: unknown model"),
    (["profile", "--model", "no-such-model", "--out", "p.json"], "--model no-such-model: unknown model"),
    ([*_PROFILE, "--prompts", "none.jsonl"], "none.jsonl: file not found"),
    (["heads", "train", "--out", "h.safetensors", "--kind", "square"], "--kind"),
    (["heads", "train", "--out", "h.safetensors", "--lr", "5"], "--lr"),
    (["heads", "eval", "--heads", "h.safetensors", "--tokens", "0"], "--tokens"),
    (["run", "--prompt", "hi", "--device", "tpu"], "--device"),
    (["bench", "--dtype", "float64"], "--dtype"),
    ([*_PROFILE, "--device", "cuda:x"], "--device"),
    (["heads", "train", "--out", "h.safetensors", "--dtype", "f64"], "--dtype"),
    (["bench", "--assistant", "no-such-model"], "--assistant no-such-model: unknown model"),
    (["models", "fetch", "smollm2-135m", "--device", "tpu"], "--device"),
])
def test_a_flag_or_plan_error_comes_before_torch_is_imported(tiny_dir, tmp_path, args, needle):
    """A mistyped flag of ``hsd run``, ``chat``, ``bench``, ``profile`` or ``heads``, and a plan the run cannot take,
    is said at once (exit 2, naming the flag or the plan's field): importing the runtime (torch, seconds) waited
    for it."""
    if args[-1] == "--plan-kind":
        args = [*args[:-1], "--plan", str(_plan(tmp_path / "k.json", tiny_dir / "m", hierarchy=("weird", "layer4"),
                                                 budgets=(2,), models=_KIND))]
    elif args[0] not in ("profile", "heads", "models"):
        args = [*args, "--plan", str(_plan(tmp_path / "p.json", tiny_dir / "m"))]
    code = ("import sys, atexit\natexit.register(lambda: print('torch' in sys.modules))\n"
            f"from hsd_opt.cli import app\napp({args!r})\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 2 and needle in res.stderr, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "False"

