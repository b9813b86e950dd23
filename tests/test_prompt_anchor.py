"""`benchmarks/prompt_anchor.py` reads llama.cpp's prompt tests and decode tests at depth from `llama-bench -o json`
(the fields of the `llama-cpp-python` 0.3.36 sdist's llama-bench), and refuses lengths or output it cannot use."""

from __future__ import annotations

import json

import pytest

from benchmarks.prompt_anchor import decode_rates, parse_lengths, prompt_rates


def _row(n_prompt: int, n_gen: int, ts: float, depth: int = 0) -> dict:
    return {"model_type": "llama 256M Q4_1", "n_threads": 2, "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": depth,
            "avg_ns": 1, "stddev_ns": 0, "avg_ts": ts, "stddev_ts": 0.5, "samples_ts": [ts]}


def test_prompt_rates_are_the_prompt_tests_by_length():
    out = json.dumps([_row(128, 0, 302.2), _row(512, 0, 291.8), _row(0, 32, 159.8)])
    assert prompt_rates(out, [512, 128]) == {512: 291.8, 128: 302.2}


def test_a_decode_test_is_not_taken_for_a_prompt_test():
    out = json.dumps([_row(128, 32, 150.0)])  # a pg test: prompt and generation together
    with pytest.raises(ValueError, match=r"\[128\]"):
        prompt_rates(out, [128])


def test_a_length_llama_bench_did_not_run_is_named():
    with pytest.raises(ValueError, match=r"\[1024\]"):
        prompt_rates(json.dumps([_row(128, 0, 300.0)]), [128, 1024])


@pytest.mark.parametrize("text, want", [("128", [128]), ("128, 512,1024", [128, 512, 1024])])
def test_lengths_are_positive_token_counts(text, want):
    assert parse_lengths(text) == want


@pytest.mark.parametrize("text", ["", "0", "128,-4", "12x", ",,"])
def test_malformed_lengths_name_the_flag(text):
    with pytest.raises(ValueError, match="--lengths"):
        parse_lengths(text)


def test_decode_rates_are_the_decode_tests_of_that_length_by_depth():
    out = json.dumps([_row(0, 64, 160.0), _row(0, 64, 98.6, 512), _row(0, 64, 53.0, 2048), _row(0, 32, 120.0, 512),
                      _row(512, 0, 290.0)])
    assert decode_rates(out, [2048, 512], 64) == {2048: 53.0, 512: 98.6}
    assert decode_rates(out, [0], 64) == {0: 160.0}


def test_a_depth_without_its_decode_test_is_named():
    out = json.dumps([_row(0, 32, 120.0, 512), _row(512, 0, 290.0)])
    with pytest.raises(ValueError, match=r"64 tokens at depth \[512\]"):
        decode_rates(out, [512], 64)


def test_our_decode_rate_counts_the_tokens_that_took_a_decode_pass():
    """A generation's first token is read from its prompt's pass (prefill), so of 5 tokens decoded in 1 s, 4 took a
    decode pass: 4 tok/s, as llama-bench's decode test counts a pass per token (5 gave us 1.25x for free on 4)."""
    from types import SimpleNamespace

    from benchmarks.prompt_anchor import ours_decode

    class Runner:
        def generate(self, ids, max_new_tokens):
            return SimpleNamespace(stats={"tokens": 5, "decode_seconds": 1.0})

    assert ours_decode(Runner(), [1, 2, 3], 5, 3) == (4.0, 5)
