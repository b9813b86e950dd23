"""`benchmarks/llama_anchor.py` reads llama.cpp's speculative decoding from what `llama-speculative-simple`
prints (its log format of the `llama-cpp-python` 0.3.36 sdist), and refuses what it cannot read."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.llama_anchor import parse_spec_config, parse_spec_output, spec_summary
from tests.helpers import save_tiny, write_plan

PRINTED = """\
0.12.277.195 I encoded   16 tokens in    0.518 seconds, speed:   30.868 t/s
0.12.277.232 I decoded   73 tokens in    8.710 seconds, speed:    8.381 t/s
0.12.277.264 I
0.12.277.296 I n_draft   = 8
0.12.277.327 I n_predict = 73
0.12.277.358 I n_drafted = 99
0.12.277.389 I n_accept  = 60
0.12.277.421 I accept    = 60.606%
"""


def test_the_counts_are_read_from_the_lines_that_carry_them():
    got = parse_spec_output("some generated text\n" + PRINTED)
    assert got == {"tokens": 73, "decode_seconds": 8.71, "prompt_tokens": 16, "drafted": 99, "accepted": 60,
                   "n_draft": 8}


def test_a_run_past_n_by_a_last_verify_pass_counts_and_one_past_that_is_left_out():
    """The draft model's drafter does not cut its last draft at ``-n``: at a draft length of 2 / 4 / 8 every run
    decoded 66-73 tokens for 64 and was left out (no rate at all); only a run past ``-n + 1 + n_draft`` (``ngram-mod``
    drafting 64 tokens past it where the text repeats) decoded what a verify pass does not explain."""
    def run(tokens, n_draft, seconds=1.0):
        return {"tokens": tokens, "decode_seconds": seconds, "prompt_tokens": 9, "drafted": 10, "accepted": 5,
                "n_draft": n_draft}

    draft = spec_summary([run(65, 8), run(73, 8), run(66, 2)], 64)
    assert draft["past_n"] == [] and draft["decode_tok_s"] == pytest.approx((65 + 73 + 66) / 3.0)
    mod = spec_summary([run(65, 3), run(161, 3, 2.0), run(68, 3)], 96)
    assert mod["past_n"] == [1] and mod["decode_tok_s"] == pytest.approx((65 + 68) / 2.0)
    assert spec_summary([run(75, 8)], 64)["decode_tok_s"] is None


def test_output_without_a_count_is_an_error_naming_it():
    with pytest.raises(ValueError, match="'accepted'"):
        parse_spec_output(PRINTED.replace("n_accept", "n_acc"))


@pytest.mark.parametrize("text, want", [("draft-simple:4", ("draft-simple", 4)), ("ngram-cache", ("ngram-cache", None)),
                                        (" draft-simple:12 ", ("draft-simple", 12))])
def test_a_configuration_is_a_type_and_an_optional_draft_length(text, want):
    assert parse_spec_config(text) == want


@pytest.mark.parametrize("text", ["", ":4", "draft-simple:four", "draft-simple:-1"])
def test_a_malformed_configuration_names_the_flag(text):
    with pytest.raises(ValueError, match="--spec-configs"):
        parse_spec_config(text)


@pytest.mark.parametrize("flags, said", [(["--task", "no-such-task"], "--task: no prompt of task 'no-such-task'"),
                                         (["--methods", " , "], "--methods: expected")])
def test_prompts_and_methods_are_checked_before_llama_bench_runs(tmp_path, flags, said):
    """A task without prompts or an empty method list is refused before the first (minutes long) llama-bench run:
    the llama-bench given here would leave a mark if it ran."""
    model_dir = save_tiny(tmp_path / "m")
    plan = write_plan(tmp_path / "plan.json", model_dir, hierarchy=("ngram", "layer4"), budgets=(1,))
    mark = tmp_path / "ran"
    bench = tmp_path / "llama-bench"
    bench.write_text(f"#!/bin/sh\ntouch {mark}\n")
    bench.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    res = subprocess.run([sys.executable, "-m", "benchmarks.llama_anchor", "--plan", str(plan), "--llama-bench",
                          str(bench), "--gguf", str(gguf), *flags], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and said in res.stderr.splitlines()[-1], res.stderr
    assert "Traceback" not in res.stderr and not mark.exists()


def test_llama_cpp_runs_are_spread_over_the_round_and_the_first_token_is_not_counted(tmp_path):
    """A round samples llama.cpp's decode speed before the first prompt, after every ``--llama-every`` prompts and
    after the last, and runs llama.cpp's speculative decoding of each prompt right after ours: the order the fake
    binaries log. The reference is the mean of the round's llama-bench runs, and our decode tokens/s counts only the
    tokens that took a decode pass (a generation's first token comes from its prompt's pass)."""
    import json

    model_dir = save_tiny(tmp_path / "m")
    plan = write_plan(tmp_path / "plan.json", model_dir, hierarchy=("ngram", "layer4"), budgets=(1,))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1} w{i + 2}", "task": "t"}) + "\n"
                               for i in range(1, 4)))
    order, counter = tmp_path / "order.log", tmp_path / "n"
    bench = tmp_path / "llama-bench"
    bench.write_text(f"#!/bin/sh\nn=$(cat {counter} 2>/dev/null || echo 0); n=$((n + 1)); echo $n > {counter}\n"
                     f"echo bench >> {order}\n"
                     f"echo '[{{\"n_gen\": 4, \"avg_ts\": '$((n * 100))'}}]'\n")
    spec = tmp_path / "llama-speculative-simple"     # 5 tokens (-n 4 and its last pass's); on prompt 2, 20: past
    # -n 4, its last token and a last verify pass of 8 drafts
    spec.write_text(f"#!/bin/sh\nn=5\nwhile [ $# -gt 0 ]; do [ \"$1\" = -p ] && echo \"spec $2\" >> {order} && "
                    f"case \"$2\" in *w2\\ w3\\ w4*) n=20;; esac; shift; done\n"
                    f"cat <<END\n{PRINTED.replace('decoded   73 tokens', 'decoded   $n tokens')}END\n")
    for b in (bench, spec):
        b.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "r.json"
    res = subprocess.run([sys.executable, "-m", "benchmarks.llama_anchor", "--plan", str(plan), "--llama-bench",
                          str(bench), "--gguf", str(gguf), "--prompts", str(prompts), "--task", "", "--rounds", "1",
                          "--max-new-tokens", "4", "--methods", "ar,hsd", "--llama-every", "2",
                          "--speculative", str(spec), "--spec-configs", "ngram-cache", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    steps = [line.split()[0] for line in order.read_text().splitlines()]
    assert steps == ["bench", "spec", "spec", "bench", "spec", "bench"]
    rd = json.loads(out.read_text())["rounds"][0]
    assert [r["tok_s"] for r in rd["llama_cpp_runs"]] == [100, 200, 300] and rd["llama_cpp_decode_tok_s"] == 200
    bench_ar, ours = rd["bench"]["methods"]["ar"], rd["ours"]["ar"]
    assert ours["decode_tokens"] == bench_ar["tokens"] - 3
    assert ours["decode_tok_s"] == pytest.approx((bench_ar["tokens"] - 3) / bench_ar["decode_seconds"])
    assert ours["decode_vs_llama_cpp"] == pytest.approx(ours["decode_tok_s"] / 200)
    # a run of llama.cpp's past -n is left out, and the plan is rated against it over the same prompts
    sp = rd["llama_cpp_speculative"]["ngram-cache"]
    assert len(sp["runs"]) == 3 and [r["tokens"] for r in sp["runs"]] == [5, 20, 5] and sp["past_n"] == [1]
    assert sp["tokens"] == 10 and sp["decode_tok_s"] == pytest.approx(10 / (2 * 8.71))
    by = rd["bench"]["by_task"]
    kept = [by[g]["hsd"] for g in ("t #1", "t #3")]
    plan = sum(d["tokens"] - d["generations"] for d in kept) / sum(d["decode_seconds"] for d in kept)
    assert sp["plan_decode_tok_s_same_prompts"] == pytest.approx(plan)
    assert sp["plan_vs_this"] == pytest.approx(plan / sp["decode_tok_s"])
    assert "prompts 2 left out" in res.stderr + res.stdout
