"""`hsd serve` through the real ``openai`` client, on a tiny random Llama with a word-level tokenizer and a chat
template (a depth-4 plan: n-gram -> exit 1 -> exit 2 -> target): greedy output equal to ``hsd run``'s token for
token, chat and completions, streamed and not; stop strings; seeded sampling; log-probabilities; no state carried
between requests; every bad request answered with its status and an OpenAI-style error body, and no traceback in
the server log; the API key; the full queue (429); a load of concurrent streaming clients with one that disconnects
mid-stream; the command itself (subprocess: ready line, Ctrl-C) and its flag errors."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from hsd_opt.commands.serve import prepare_server
from hsd_opt.runtime.decode import HSD, Committed
from hsd_opt.server import BackgroundServer, JobQueue, create_app
from hsd_opt.server.text import TextStream
from tests.helpers import TINY_CHAT_TEMPLATE, cli_output, run_cli, save_tiny, write_plan

MODEL = "m"  # the served name: the model directory's name
PROMPTS = ["w1 w2 w3 w4", "w9 w8 w7 w6 w5 w9 w8", "w20 w3 w20 w3"]  # the second one ends at EOS
STOP_PROMPT = "w30 w31 w32"  # its raw greedy continuation is 14 words long
N = 14  # max_tokens of the equality tests
LEAVE_TOKENS = 120  # max_tokens of a client that goes away mid-stream


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(plan path, model directory): a 4-layer tiny Llama with a chat template and a depth-4 plan over it."""
    root = tmp_path_factory.mktemp("serve")
    model_dir = save_tiny(root / MODEL, chat_template=TINY_CHAT_TEMPLATE)
    plan = write_plan(root / "plan.json", model_dir, hierarchy=("ngram", "layer1", "layer2", "layer4"),
                      budgets=(1, 2, 3))
    return plan, model_dir


@pytest.fixture(scope="module")
def direct(tiny):
    """``(runner, tokenizer)``: the plan's :class:`HSD` built as ``hsd run`` builds it, in the test process (the
    reference the server is compared with), and its target alone (our greedy AR loop)."""
    from hsd_opt.formats import load_plan
    from hsd_opt.models.loading import load_model
    from hsd_opt.runtime.runner import hsd_for_plan

    plan, model_dir = tiny
    loaded = load_model(str(model_dir), device="cpu")
    p = load_plan(plan)
    return hsd_for_plan(p, loaded), hsd_for_plan(p, loaded, hierarchy=["layer4"], budgets=[]), loaded.tokenizer


@pytest.fixture(scope="module")
def served(tiny):
    """A server for the tiny plan on 127.0.0.1 (a free port) in a thread: ``(server, jobs)``."""
    app, jobs = prepare_server(tiny[0], device="cpu", max_queue=16)
    with BackgroundServer(app, on_stop=jobs.cancel_all) as srv:
        yield srv, jobs


def client(srv, **kw) -> OpenAI:
    return OpenAI(base_url=srv.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, timeout=60, **kw)


def no_tracebacks(caplog) -> None:
    """The server log (every record of this test, from every thread) holds no traceback and no error."""
    bad = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR or "Traceback" in r.getMessage()]
    assert not bad, [r.getMessage() for r in bad]


def hsd_run_ids(plan: Path, prompt: str, *args) -> list[int]:
    """Token ids that ``hsd run --plan plan --prompt prompt ARGS`` writes to its --json file."""
    out = plan.parent / "run.jsonl"
    res = run_cli("run", "--plan", plan, "--prompt", prompt, "--device", "cpu", "--quiet", "--json", out, *args)
    assert res.exit_code == 0, cli_output(res)
    return json.loads(out.read_text().splitlines()[0])["token_ids"]


def finish_of(ids: list[int], max_tokens: int, eos: int = 2) -> str:
    return "stop" if ids and ids[-1] == eos else "length"


def stream_chat(c: OpenAI, prompt: str, **kw) -> tuple[str, object]:
    """Streamed chat: (the concatenated content, the last chunk with a finish_reason)."""
    text, last = [], None
    for ch in c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], stream=True,
                                        **kw):
        if ch.choices and ch.choices[0].delta.content:
            text.append(ch.choices[0].delta.content)
        if ch.choices and ch.choices[0].finish_reason:
            last = ch
    return "".join(text), last


def stream_completion(c: OpenAI, prompt: str, **kw) -> tuple[str, object]:
    text, last = [], None
    for ch in c.completions.create(model=MODEL, prompt=prompt, stream=True, **kw):
        if ch.choices:
            text.append(ch.choices[0].text)
            if ch.choices[0].finish_reason:
                last = ch
    return "".join(text), last


# ------------------------------------------------------------------------------------------------ lossless output


@pytest.mark.slow
def test_greedy_chat_and_completion_equal_hsd_run_token_for_token(tiny, direct, served, caplog):
    plan, _ = tiny
    _, ar, tok = direct
    from hsd_opt.prompts import encode_prompt

    c = client(served[0])
    for prompt in PROMPTS[:2]:
        want = hsd_run_ids(plan, prompt, "--max-new-tokens", N)               # `hsd run`, chat template
        assert want == ar.generate(encode_prompt(tok, prompt), N).token_ids   # lossless: the target's greedy
        text = tok.decode(want, skip_special_tokens=True)
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=N,
                                      temperature=0)
        assert r.model_extra["hsd"]["token_ids"] == want
        assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
        assert r.choices[0].finish_reason == finish_of(want, N)
        n_prompt = len(encode_prompt(tok, prompt))
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
            (n_prompt, len(want), n_prompt + len(want))
        h = r.model_extra["hsd"]
        assert h["hierarchy"] == ["ngram", "layer1", "layer2", "layer4"] and h["budgets"] == [1, 2, 3]
        assert set(h["acceptance"]) == {"layer1", "layer2", "layer4"} and h["target_calls"] >= 1
        assert h["tokens_per_target_call"] == pytest.approx(len(want) / h["target_calls"])
        streamed, last = stream_chat(c, prompt, max_tokens=N, temperature=0)
        assert streamed == text and last.choices[0].finish_reason == finish_of(want, N)
        assert last.model_extra["hsd"]["token_ids"] == want

        want_raw = hsd_run_ids(plan, prompt, "--max-new-tokens", N, "--raw")  # `hsd run --raw`: no template
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0)
        assert r.model_extra["hsd"]["token_ids"] == want_raw
        assert r.choices[0].text == tok.decode(want_raw, skip_special_tokens=True)
        assert r.usage.prompt_tokens == len(encode_prompt(tok, prompt, raw=True))
        streamed, last = stream_completion(c, prompt, max_tokens=N, temperature=0)
        assert streamed == r.choices[0].text and last.choices[0].finish_reason == r.choices[0].finish_reason
    no_tracebacks(caplog)


def test_stream_is_server_sent_events_ending_with_done(served):
    srv, _ = served
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all(ch["object"] == "text_completion" for ch in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5  # include_usage
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and "hsd" in chunks[-2]


def test_stop_strings_cut_the_text_before_them(served, direct):
    c = client(served[0])
    _, _, tok = direct
    r = c.completions.create(model=MODEL, prompt=STOP_PROMPT, max_tokens=N, temperature=0)
    ids, text = r.model_extra["hsd"]["token_ids"], r.choices[0].text
    words = text.split()
    assert len(words) >= 6
    for stop in [words[3] + " " + words[4], [words[4] + " ", "never-there"]]:
        s = [stop] if isinstance(stop, str) else stop
        at = min(i for i in (text.find(x) for x in s) if i >= 0)
        # the generation ends at the first token whose text completes the stop string
        n = next(k for k in range(1, len(ids) + 1) if any(x in tok.decode(ids[:k], skip_special_tokens=True)
                                                         for x in s))
        r2 = c.completions.create(model=MODEL, prompt=STOP_PROMPT, max_tokens=N, temperature=0, stop=stop)
        assert r2.choices[0].text == text[:at] and r2.choices[0].finish_reason == "stop"
        assert r2.model_extra["hsd"]["token_ids"] == ids[:n] and r2.usage.completion_tokens == n
        streamed, last = stream_completion(c, STOP_PROMPT, max_tokens=N, temperature=0, stop=stop)
        assert streamed == text[:at] and last.choices[0].finish_reason == "stop"
    r3 = c.completions.create(model=MODEL, prompt=STOP_PROMPT, max_tokens=N, temperature=0, stop="w99 w99")
    assert r3.choices[0].text == text and r3.choices[0].finish_reason == r.choices[0].finish_reason


def test_stop_token_ids_end_the_output_at_the_first_of_them_generated(served, direct):
    """vLLM's ``stop_token_ids``: the output ends with the first of them generated, its text kept (a special
    token's dropped, as every special token's), ``finish_reason`` "stop"; the earlier of it and a stop string
    ends the text; ids never generated change nothing."""
    c = client(served[0])
    _, _, tok = direct
    r = c.completions.create(model=MODEL, prompt=STOP_PROMPT, max_tokens=N, temperature=0)
    ids, text = r.model_extra["hsd"]["token_ids"], r.choices[0].text
    assert len(ids) >= 6
    for k in (0, 3):
        n = ids.index(ids[k]) + 1                     # its first occurrence
        kw = dict(model=MODEL, prompt=STOP_PROMPT, max_tokens=N, temperature=0,
                  extra_body={"stop_token_ids": [ids[k], ids[k]]})
        r2 = c.completions.create(**kw)
        assert r2.model_extra["hsd"]["token_ids"] == ids[:n] and r2.usage.completion_tokens == n
        assert r2.choices[0].text == tok.decode(ids[:n], skip_special_tokens=True)
        assert r2.choices[0].finish_reason == "stop"
        streamed, last = stream_completion(c, STOP_PROMPT, max_tokens=N, temperature=0,
                                           extra_body={"stop_token_ids": [ids[k]]})
        assert streamed == r2.choices[0].text and last.choices[0].finish_reason == "stop"
    later = next(t for t in ids if ids.index(t) >= 3)
    before = tok.decode(ids[:2], skip_special_tokens=True).split()[-1]     # a stop string ending before it
    r3 = c.completions.create(model=MODEL, prompt=STOP_PROMPT, max_tokens=N, temperature=0, stop=before,
                              extra_body={"stop_token_ids": [later]})
    assert r3.choices[0].text == text[:text.find(before)] and len(r3.model_extra["hsd"]["token_ids"]) <= 2
    unseen = next(t for t in range(len(tok)) if t not in ids)
    r4 = c.completions.create(model=MODEL, prompt=STOP_PROMPT, max_tokens=N, temperature=0,
                              extra_body={"stop_token_ids": [unseen]})
    assert r4.model_extra["hsd"]["token_ids"] == ids and r4.choices[0].finish_reason == r.choices[0].finish_reason


def test_seeded_sampling_is_reproducible_and_equals_hsd_run(tiny, served):
    c = client(served[0])
    kw = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=N, temperature=0.9,
              top_p=0.95)
    a = c.chat.completions.create(seed=7, **kw).model_extra["hsd"]["token_ids"]
    b = c.chat.completions.create(seed=7, **kw).model_extra["hsd"]["token_ids"]
    assert a == b
    assert a == hsd_run_ids(tiny[0], PROMPTS[0], "--max-new-tokens", N, "--temperature", 0.9, "--top-p", 0.95,
                            "--seed", 7)
    others = {tuple(c.chat.completions.create(seed=s, **kw).model_extra["hsd"]["token_ids"]) for s in (1, 2, 3)}
    assert len(others | {tuple(a)}) > 1  # the seed matters
    # top_p 0 (the OpenAI API and llama-server take it): the most probable token alone, the greedy answer
    greedy = c.chat.completions.create(**dict(kw, temperature=0)).model_extra["hsd"]["token_ids"]
    assert c.chat.completions.create(**dict(kw, top_p=0)).model_extra["hsd"]["token_ids"] == greedy
    # -1, llama-server's default seed, means none: each answer drawn afresh; -2 is a seed like any other
    unseeded = {tuple(c.chat.completions.create(seed=-1, **kw).model_extra["hsd"]["token_ids"]) for _ in range(4)}
    assert len(unseeded) > 1
    assert len({tuple(c.chat.completions.create(seed=-2, **kw).model_extra["hsd"]["token_ids"]) for _ in range(2)}) == 1


def test_penalties_and_logit_bias_equal_hsd_run_and_move_the_answer(tiny, served):
    """``frequency_penalty``, ``presence_penalty`` and ``logit_bias`` (chat and completions, greedy and seeded):
    the answer ``hsd run`` gives with the same flags, not the answer without them."""
    c = client(served[0])
    plain = c.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=N, temperature=0)
    plain_ids = plain.model_extra["hsd"]["token_ids"]
    bias = {str(plain_ids[0]): -100}
    flags = ("--frequency-penalty", 1.5, "--presence-penalty", 0.5, "--logit-bias", json.dumps(bias))
    r = c.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=N, temperature=0, frequency_penalty=1.5,
                             presence_penalty=0.5, logit_bias=bias)
    ids = r.model_extra["hsd"]["token_ids"]
    assert ids != plain_ids and ids[0] != plain_ids[0]
    assert ids == hsd_run_ids(tiny[0], PROMPTS[2], "--raw", "--max-new-tokens", N, *flags)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=N, temperature=0.9,
              seed=5, frequency_penalty=1.5, presence_penalty=0.5, logit_bias=bias)
    chat = c.chat.completions.create(**kw).model_extra["hsd"]["token_ids"]
    assert chat == hsd_run_ids(tiny[0], PROMPTS[0], "--max-new-tokens", N, "--temperature", 0.9, "--seed", 5, *flags)


def test_repetition_penalties_equal_hsd_run(tiny, served):
    """vLLM's ``repetition_penalty`` (the whole context) and llama.cpp's ``repeat_penalty`` (its last
    ``repeat_last_n`` tokens, 64 by default, -1 all, 0 none): the answer of ``hsd run --repetition-penalty
    [--repeat-last-n]``, greedy and seeded, and not the answer without it."""
    c = client(served[0])
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=N, temperature=0)
    plain = c.completions.create(**kw).model_extra["hsd"]["token_ids"]
    run = ("--raw", "--max-new-tokens", N)
    vllm = c.completions.create(extra_body={"repetition_penalty": 3.0}, **kw).model_extra["hsd"]["token_ids"]
    assert vllm != plain and vllm == hsd_run_ids(tiny[0], PROMPTS[2], *run, "--repetition-penalty", 3.0)
    llama = c.completions.create(extra_body={"repeat_penalty": 3.0, "repeat_last_n": 4}, **kw)
    assert llama.model_extra["hsd"]["token_ids"] == hsd_run_ids(tiny[0], PROMPTS[2], *run, "--repetition-penalty",
                                                                3.0, "--repeat-last-n", 4)
    whole = c.completions.create(extra_body={"repeat_penalty": 3.0, "repeat_last_n": -1}, **kw)
    assert whole.model_extra["hsd"]["token_ids"] == vllm
    off = c.completions.create(extra_body={"repeat_penalty": 3.0, "repeat_last_n": 0}, **kw)
    assert off.model_extra["hsd"]["token_ids"] == plain
    default = c.completions.create(extra_body={"repeat_penalty": 3.0}, **kw).model_extra["hsd"]["token_ids"]
    assert default == hsd_run_ids(tiny[0], PROMPTS[2], *run, "--repetition-penalty", 3.0, "--repeat-last-n", 64)
    kw = dict(kw, temperature=0.9, seed=4)
    sampled = c.completions.create(extra_body={"repetition_penalty": 1.5}, **kw).model_extra["hsd"]["token_ids"]
    assert sampled == hsd_run_ids(tiny[0], PROMPTS[2], *run, "--temperature", 0.9, "--seed", 4,
                                  "--repetition-penalty", 1.5)


def test_top_k_and_min_p_equal_hsd_run(tiny, served):
    """llama.cpp's and vLLM's ``top_k`` and ``min_p`` (seeded samples): the answer of ``hsd run --top-k --min-p``;
    ``top_k`` -1 is off, as 0."""
    c = client(served[0])
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=N, temperature=1.2, seed=9)
    got = c.completions.create(extra_body={"top_k": 3, "min_p": 0.1}, **kw).model_extra["hsd"]["token_ids"]
    assert got == hsd_run_ids(tiny[0], PROMPTS[0], "--raw", "--max-new-tokens", N, "--temperature", 1.2, "--seed", 9,
                              "--top-k", 3, "--min-p", 0.1)
    off = c.completions.create(extra_body={"top_k": -1}, **kw).model_extra["hsd"]["token_ids"]
    assert off == c.completions.create(**kw).model_extra["hsd"]["token_ids"]


def test_n_choices_are_each_the_answer_of_a_request_of_one(served):
    """``n`` choices: sampled with a seed, choice ``i`` is the answer of the same request of one choice seeded
    ``seed + i``; greedy, every choice is the greedy answer; unseeded, the choices differ. Usage counts the prompt
    once and every choice's tokens; each choice carries its figures."""
    c = client(served[0])
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=N, temperature=1.1)
    r = c.chat.completions.create(n=3, seed=40, **kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    ones = [c.chat.completions.create(seed=40 + i, **kw) for i in range(3)]
    assert [ch.message.content for ch in r.choices] == [o.choices[0].message.content for o in ones]
    assert [ch.model_extra["hsd"]["token_ids"] for ch in r.choices] == \
        [o.model_extra["hsd"]["token_ids"] for o in ones]
    assert r.usage.prompt_tokens == ones[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(o.usage.completion_tokens for o in ones)
    assert r.model_extra["hsd"]["token_ids"] == ones[0].model_extra["hsd"]["token_ids"]
    greedy = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=N, temperature=0, n=4)
    one = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=N, temperature=0)
    assert [ch.text for ch in greedy.choices] == [one.choices[0].text] * 4
    assert greedy.usage.completion_tokens == 4 * one.usage.completion_tokens
    free = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=N, temperature=1.5, n=4)
    assert len({tuple(ch.model_extra["hsd"]["token_ids"]) for ch in free.choices}) > 1
    lp = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=N, temperature=1.1, seed=3, n=2, logprobs=1)
    for i, ch in enumerate(lp.choices):           # each choice's log-probabilities, those of its request alone
        one = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=N, temperature=1.1, seed=3 + i,
                                   logprobs=1)
        assert ch.logprobs.tokens == one.choices[0].logprobs.tokens
        assert ch.logprobs.token_logprobs == one.choices[0].logprobs.token_logprobs
        assert len(ch.logprobs.tokens) == len(ch.model_extra["hsd"]["token_ids"])


def test_an_answers_later_choices_copy_the_prompt_the_first_computed(served, direct):
    """The choices of one answer share a prompt: the first computes it, the others copy its positions while it
    decodes (all but the last, which each computes), and each is still the answer of its request of one."""
    c = client(served[0])
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "w41 w42 w43 w44 w45 w46 w47"}], max_tokens=N,
              temperature=1.1)
    r = c.chat.completions.create(n=3, seed=70, **kw)
    computed = [ch.model_extra["hsd"]["prefill_tokens"] for ch in r.choices]
    assert computed[0] > 1 and computed[1:] == [1, 1]
    runner, _, tok = direct
    fresh = HSD(runner.levels, runner.budgets, eos_ids=runner.eos)
    from hsd_opt.prompts import chat_ids

    ids = chat_ids(tok, kw["messages"])
    for i, ch in enumerate(r.choices):
        assert ch.model_extra["hsd"]["token_ids"] == fresh.generate(ids, N, temperature=1.1, seed=70 + i).token_ids


def test_n_choices_streamed_interleave_by_index_and_equal_the_answer(served):
    """Streamed, each choice's chunks carry its index (the chat's role delta first for each); the text of each
    index is that choice's non-streamed text; one closing chunk per choice, the usage of all, then ``[DONE]``."""
    srv, _ = served
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[2]}]}),
                       ("/v1/completions", {"prompt": PROMPTS[2]})):
        body = {"model": MODEL, "max_tokens": N, "temperature": 1.1, "seed": 5, "n": 3, **body}
        whole = httpx.post(srv.url + path, json=body, timeout=60).json()
        with httpx.stream("POST", srv.url + path, timeout=60,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            raw = r.read().decode()
        events = [e for e in raw.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")   # cached tokens: the earlier request's
        assert chunks[-1]["choices"] == [] and [chunks[-1]["usage"][k] for k in counts] == \
            [whole["usage"][k] for k in counts]
        texts, ends, first = {}, [], {}
        for ch in chunks[:-1]:
            (choice,) = ch["choices"]
            first.setdefault(choice["index"], choice)
            piece = choice["delta"].get("content") if "delta" in choice else choice["text"]
            texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
            if choice["finish_reason"]:
                ends.append(choice["index"])
        want = [ch["message"]["content"] if "message" in ch else ch["text"] for ch in whole["choices"]]
        assert [texts[i] for i in range(3)] == want and sorted(ends) == [0, 1, 2]
        if "messages" in body:
            assert all(first[i]["delta"].get("role") == "assistant" for i in range(3))


def test_no_state_carries_over_between_requests(served):
    srv, _ = served
    c = client(srv)
    kw = dict(model=MODEL, max_tokens=N, temperature=0)
    first = c.completions.create(prompt=PROMPTS[2], **kw).model_extra["hsd"]["token_ids"]
    c.completions.create(prompt=PROMPTS[1], seed=3, **{**kw, "temperature": 1.0})  # another prompt, sampled
    with c.completions.create(prompt=PROMPTS[0], stream=True, **{**kw, "max_tokens": 300}) as s:
        next(iter(s))  # a client that goes away after one chunk
    again = c.completions.create(prompt=PROMPTS[2], **kw).model_extra["hsd"]["token_ids"]
    assert again == first
    # fields a client sends at their defaults ask nothing of the server: the same answer
    defaults = c.completions.create(prompt=PROMPTS[2], logprobs=None, presence_penalty=0, frequency_penalty=0.0,
                                    logit_bias={}, echo=False, best_of=1, user="u",
                                    extra_body={"repetition_penalty": 1, "repeat_penalty": 1.0, "repeat_last_n": 8,
                                                "typical_p": 1, "mirostat": 0, "min_tokens": 0, "ignore_eos": False,
                                                "stop_token_ids": [], "bad_words": [], "n_predict": -1,
                                                "allowed_token_ids": None, "include_stop_str_in_output": False},
                                    **kw)
    assert defaults.model_extra["hsd"]["token_ids"] == first


def test_a_conversations_next_turn_reports_its_earlier_turns_cached_and_is_the_prompts_own(served, direct):
    """A chat's second turn (the first turn, the answer, a new message) starts with the tokens of the first
    request: the server takes them from the state that request left (``usage.prompt_tokens_details``) and the
    answer is the one the plan gives the whole prompt computed afresh."""
    from hsd_opt.prompts import chat_ids

    srv, _ = served
    runner, _, tok = direct
    c = client(srv)
    kw = dict(model=MODEL, max_tokens=N, temperature=0)
    msgs = [{"role": "user", "content": "w5 w6 w7 w8 w9"}]
    first = c.chat.completions.create(messages=msgs, **kw)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "w11 w12"}]
    second = c.chat.completions.create(messages=msgs, **kw)
    prompt = chat_ids(tok, msgs)
    assert second.usage.prompt_tokens == len(prompt)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert second.model_extra["hsd"]["prefill_tokens"] == len(prompt) - cached
    fresh = HSD(runner.levels, runner.budgets, eos_ids=runner.eos)         # a pool of its own: nothing to take
    assert second.model_extra["hsd"]["token_ids"] == fresh.generate(prompt, N).token_ids


def test_logprobs_are_the_targets_streamed_or_not_and_change_no_token(tiny, direct, served, caplog):
    """Chat (``logprobs``, ``top_logprobs``) and completions (``logprobs: k``): one entry per returned token, each
    value the one ``HSD.generate(..., logprobs=k)`` gives (the target's own log-softmax), the same tokens as
    without them; streamed, the chunks' entries put together equal the whole answer's; a stop string ends them
    with the returned tokens; a seeded sample has them too."""
    from hsd_opt.prompts import encode_prompt

    runner, _, tok = direct
    c = client(served[0])
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    plain = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=N, temperature=0)
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=N, temperature=0, logprobs=True,
                                  top_logprobs=3)
    ids = r.model_extra["hsd"]["token_ids"]
    assert ids == plain.model_extra["hsd"]["token_ids"]
    assert r.choices[0].message.content == plain.choices[0].message.content
    want = runner.generate(encode_prompt(tok, PROMPTS[0]), N, logprobs=3)
    assert want.token_ids == ids
    content = r.choices[0].logprobs.content
    assert [e.logprob for e in content] == [w.logprob for w in want.logprobs]
    for e, w in zip(content, want.logprobs):
        assert e.bytes == list(tok.decode([w.token]).encode()) and e.token == tok.decode([w.token])
        assert [t.logprob for t in e.top_logprobs] == [v for _, v in w.top]
        assert e.top_logprobs[0].token == e.token          # greedy: the most likely token
    streamed = []
    for ch in c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=N, temperature=0, logprobs=True,
                                        top_logprobs=3, stream=True):
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed.extend(ch.choices[0].logprobs.content)
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    assert c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=N, temperature=0).choices[0].logprobs \
        is None

    r = c.completions.create(model=MODEL, prompt=STOP_PROMPT, max_tokens=N, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    want = runner.generate(encode_prompt(tok, STOP_PROMPT, raw=True), N, logprobs=2)
    assert r.model_extra["hsd"]["token_ids"] == want.token_ids
    assert lp.token_logprobs == [w.logprob for w in want.logprobs] and len(lp.tokens) == len(want.token_ids)
    assert [list(d.values()) for d in lp.top_logprobs] == [[v for _, v in w.top] for w in want.logprobs]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    parts = [ch.choices[0].logprobs for ch in c.completions.create(model=MODEL, prompt=STOP_PROMPT, max_tokens=N,
                                                                   temperature=0, logprobs=2, stream=True)
             if ch.choices and ch.choices[0].logprobs is not None]
    assert [t for p in parts for t in p.token_logprobs] == lp.token_logprobs
    assert [o for p in parts for o in p.text_offset] == lp.text_offset
    stop = " ".join(r.choices[0].text.split()[3:5])
    cut = c.completions.create(model=MODEL, prompt=STOP_PROMPT, max_tokens=N, temperature=0, logprobs=0, stop=stop)
    n = cut.usage.completion_tokens
    assert n < len(want.token_ids) and cut.choices[0].logprobs.token_logprobs == lp.token_logprobs[:n]
    assert cut.choices[0].logprobs.top_logprobs == [{}] * n

    kw = dict(model=MODEL, messages=msgs, max_tokens=N, temperature=0.9, top_p=0.95, seed=7)
    sampled = c.chat.completions.create(logprobs=True, **kw)
    want = runner.generate(encode_prompt(tok, PROMPTS[0]), N, temperature=0.9, top_p=0.95, seed=7, logprobs=0)
    assert sampled.model_extra["hsd"]["token_ids"] == want.token_ids
    assert [e.logprob for e in sampled.choices[0].logprobs.content] == [w.logprob for w in want.logprobs]
    no_tracebacks(caplog)


# ------------------------------------------------------------------------------------------------ bad requests


LONG = " ".join(["w5"] * 600)  # 600 tokens: more than the tiny model's 512 positions
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "w1 w2"}]


def TOOL(name, **function):  # noqa: N802 - a request body's part, as the table writes it
    return {"type": "function", "function": {"name": name, **function}}


BAD = [
    (COMP, b"{bad json", 400, None, None),
    (COMP, b"\xff\xfe", 400, None, None),
    (COMP, json.dumps({"prompt": "w1"}).encode("utf-16"), 400, None, None),    # JSON, but not UTF-8
    (COMP, json.dumps({"prompt": "w1"}).encode("utf-32-le"), 400, None, None),
    (COMP, {"model": MODEL, "prompt": "w1", "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
     "stream_options.include_usage", None),
    (COMP, {"model": MODEL, "prompt": "w1", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    (CHAT, {"model": MODEL, "messages": MSG, "stream": False, "stream_options": {}}, 400, "stream_options", None),
    (COMP, [1, 2], 400, None, None),
    (CHAT, {"model": MODEL}, 400, "messages", None),
    (CHAT, {"model": MODEL, "messages": []}, 400, "messages", None),
    (CHAT, {"model": MODEL, "messages": "w1"}, 400, "messages", None),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", None),
    (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "w1"}]}, 400, "messages[0].role", None),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0]", None),
    (COMP, {"model": MODEL}, 400, "prompt", None),
    (COMP, {"model": MODEL, "prompt": 5}, 400, "prompt", None),
    (COMP, {"model": MODEL, "prompt": "  "}, 400, "prompt", None),
    (COMP, {"model": MODEL, "prompt": "w1", "max_tokens": 0}, 400, "max_tokens", None),
    (COMP, {"model": MODEL, "prompt": "w1", "max_tokens": "9"}, 400, "max_tokens", None),
    (COMP, {"model": MODEL, "prompt": "w1", "max_tokens": 2.5}, 400, "max_tokens", None),
    (COMP, {"model": MODEL, "prompt": "w1", "max_tokens": True}, 400, "max_tokens", None),
    (COMP, {"model": MODEL, "prompt": "w1 w2", "max_tokens": 511}, 400, "max_tokens", "context_length_exceeded"),
    (CHAT, {"model": MODEL, "messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens", None),
    (COMP, {"model": MODEL, "prompt": LONG}, 400, "prompt", "context_length_exceeded"),
    (COMP, {"model": MODEL, "prompt": "w1", "temperature": -0.1}, 400, "temperature", None),
    (COMP, {"model": MODEL, "prompt": "w1", "temperature": "hot"}, 400, "temperature", None),
    (COMP, {"model": MODEL, "prompt": "w1", "top_p": -0.1}, 400, "top_p", None),
    (COMP, {"model": MODEL, "prompt": "w1", "top_p": 1.01}, 400, "top_p", None),
    (COMP, {"model": MODEL, "prompt": "w1", "stop": 5}, 400, "stop", None),
    (COMP, {"model": MODEL, "prompt": "w1", "stop": [""]}, 400, "stop", None),
    (COMP, {"model": MODEL, "prompt": "w1", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    (COMP, {"model": MODEL, "prompt": "w1", "stream": "yes"}, 400, "stream", None),
    (COMP, {"model": MODEL, "prompt": "w1", "seed": "x"}, 400, "seed", None),
    (COMP, {"model": MODEL, "prompt": "w1", "seed": 2**64}, 400, "seed", None),
    (CHAT, {"model": MODEL, "messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", None),
    (CHAT, {"model": MODEL, "messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    (CHAT, {"model": MODEL, "messages": MSG, "logprobs": 3}, 400, "logprobs", None),
    (CHAT, {"model": MODEL, "messages": MSG, "logprobs": True, "tool_choice": "required",
            "tools": [TOOL("f", parameters={"type": "object", "properties": {"a": {"type": "integer"}}})]},
     400, "logprobs", None),
    (COMP, {"model": MODEL, "prompt": "w1", "logprobs": -1}, 400, "logprobs", None),
    (COMP, {"model": MODEL, "prompt": "w1", "logprobs": True}, 400, "logprobs", None),
    (COMP, {"model": MODEL, "prompt": "w1", "top_logprobs": 2}, 400, "top_logprobs", None),
    (COMP, {"model": MODEL, "prompt": "w1", "presence_penalty": 2.5}, 400, "presence_penalty", None),
    (COMP, {"model": MODEL, "prompt": "w1", "frequency_penalty": "high"}, 400, "frequency_penalty", None),
    (COMP, {"model": MODEL, "prompt": "w1", "logit_bias": [1, 2]}, 400, "logit_bias", None),
    (COMP, {"model": MODEL, "prompt": "w1", "top_k": -2}, 400, "top_k", None),
    (COMP, {"model": MODEL, "prompt": "w1", "top_k": 2.5}, 400, "top_k", None),
    (CHAT, {"model": MODEL, "messages": MSG, "min_p": 1.5}, 400, "min_p", None),
    (COMP, {"model": MODEL, "prompt": "w1", "logit_bias": {"w1": 5}}, 400, "logit_bias", None),
    (COMP, {"model": MODEL, "prompt": "w1", "logit_bias": {"99999": 5}}, 400, "logit_bias", None),
    (CHAT, {"model": MODEL, "messages": MSG, "logit_bias": {"3": 101}}, 400, "logit_bias", None),
    (CHAT, {"model": MODEL, "messages": MSG, "logit_bias": {"3": True}}, 400, "logit_bias", None),
    (COMP, {"model": MODEL, "prompt": "w1", "echo": True}, 400, "echo", None),
    (CHAT, {"model": MODEL, "messages": MSG, "repetition_penalty": 0}, 400, "repetition_penalty", None),
    (COMP, {"model": MODEL, "prompt": "w1", "repeat_penalty": "x"}, 400, "repeat_penalty", None),
    (COMP, {"model": MODEL, "prompt": "w1", "repeat_penalty": 1.1, "repetition_penalty": 1.1}, 400,
     "repeat_penalty", None),
    (COMP, {"model": MODEL, "prompt": "w1", "repeat_penalty": 1.1, "repeat_last_n": -2}, 400, "repeat_last_n", None),
    (COMP, {"model": MODEL, "prompt": "w1", "repeat_last_n": -2}, 400, "repeat_last_n", None),    # checked alone too
    (COMP, {"model": MODEL, "prompt": "w1", "tools": [TOOL("f")], "tool_choice": "required"}, 400, "tools", None),
    (COMP, {"model": MODEL, "prompt": "w1", "tool_choice": "none"}, 400, "tool_choice", None),
    (CHAT, {"model": MODEL, "messages": MSG, "functions": [{"name": "f"}]}, 400, "functions", None),
    (CHAT, {"model": MODEL, "messages": MSG, "function_call": "auto"}, 400, "function_call", None),
    (CHAT, {"model": MODEL, "messages": MSG, "repeat_last_n": "x"}, 400, "repeat_last_n", None),
    (CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 3, "max_completion_tokens": 511}, 400,
     "max_completion_tokens", "context_length_exceeded"),           # the limit that counts is the one named
    (COMP, {"model": MODEL, "prompt": "w1", "typical_p": 0.5}, 400, "typical_p", None),
    (CHAT, {"model": MODEL, "messages": MSG, "mirostat": 2}, 400, "mirostat", None),
    (COMP, {"model": MODEL, "prompt": "w1", "ignore_eos": True}, 400, "ignore_eos", None),
    # vLLM's and llama.cpp's fields that change the answer were answered without it
    (COMP, {"model": MODEL, "prompt": "w1", "stop_token_ids": 5}, 400, "stop_token_ids", None),
    (COMP, {"model": MODEL, "prompt": "w1", "stop_token_ids": ["5"]}, 400, "stop_token_ids", None),
    (CHAT, {"model": MODEL, "messages": MSG, "stop_token_ids": [True]}, 400, "stop_token_ids", None),
    (COMP, {"model": MODEL, "prompt": "w1", "stop_token_ids": [-1]}, 400, "stop_token_ids", None),
    (COMP, {"model": MODEL, "prompt": "w1", "stop_token_ids": [10**9]}, 400, "stop_token_ids", None),
    (CHAT, {"model": MODEL, "messages": MSG, "include_stop_str_in_output": True, "stop": ["x"]}, 400,
     "include_stop_str_in_output", None),
    (COMP, {"model": MODEL, "prompt": "w1", "allowed_token_ids": [5]}, 400, "allowed_token_ids", None),
    (CHAT, {"model": MODEL, "messages": MSG, "bad_words": ["w1"]}, 400, "bad_words", None),
    (COMP, {"model": MODEL, "prompt": "w1", "n_predict": 2}, 400, "n_predict", None),
    (COMP, {"model": MODEL, "prompt": "w1", "temperature": float("nan")}, 400, "temperature", None),
    (COMP, {"model": MODEL, "prompt": "w1", "temperature": float("inf")}, 400, "temperature", None),
    (COMP, {"model": MODEL, "prompt": "w1 \udfff"}, 400, "prompt", None),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "w1 \ud800"}]}, 400, "messages[0].content",
     None),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, 400,
     "messages[0].content[0].text", None),
    (CHAT, {"model": MODEL, "messages": MSG, "stop": "w1 \ud800"}, 400, "stop", None),      # a stop never met
    (COMP, {"model": MODEL, "prompt": "w1", "stop": ["w2", "\udfff"]}, 400, "stop[1]", None),
    (COMP, b'{"prompt": "w1", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None, None),
    (COMP, b'{"prompt": "w1", "max_tokens": ' + b"1" * 5001 + b"}", 400, None, None),
    # whole numbers past a float's range (float() overflows) and a logit_bias key past int()'s 4,300 digits: each a
    # 400 naming its field, not a 500
    (COMP, f'{{"model": "{MODEL}", "prompt": "w1", "temperature": 1{"0" * 400}}}'.encode(), 400, "temperature", None),
    (CHAT, f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "w1"}}], "frequency_penalty": '
           f'-1{"0" * 400}}}'.encode(), 400, "frequency_penalty", None),
    (COMP, f'{{"model": "{MODEL}", "prompt": "w1", "logit_bias": {{"3": 1{"0" * 400}}}}}'.encode(), 400,
     "logit_bias", None),
    (COMP, {"model": MODEL, "prompt": "w1", "logit_bias": {"1" * 5000: 1}}, 400, "logit_bias", None),
    (COMP, {"model": MODEL, "prompt": "w1", "n": 17}, 400, "n", None),
    (COMP, {"model": MODEL, "prompt": "w1", "n": 0}, 400, "n", None),
    (COMP, {"model": MODEL, "prompt": "w1", "n": 2, "seed": 2 ** 64 - 1}, 400, "seed", None),
    (CHAT, {"model": MODEL, "messages": MSG, "tools": {"type": "function"}}, 400, "tools", None),
    (CHAT, {"model": MODEL, "messages": MSG, "tools": [{"type": "code"}], "tool_choice": "required"}, 400,
     "tools[0]", None),
    (CHAT, {"model": MODEL, "messages": MSG, "tools": [TOOL("a b")], "tool_choice": "required"}, 400,
     "tools[0].function.name", None),
    (CHAT, {"model": MODEL, "messages": MSG, "tools": [TOOL("f"), TOOL("f")], "tool_choice": "required"}, 400,
     "tools[1].function.name", None),
    (CHAT, {"model": MODEL, "messages": MSG, "tools": [TOOL("f", parameters=[])], "tool_choice": "required"},
     400, "tools[0].function.parameters", None),
    (CHAT, {"model": MODEL, "messages": MSG, "tool_choice": "required"}, 400, "tool_choice", None),
    (CHAT, {"model": MODEL, "messages": MSG, "tools": [TOOL("f")], "tool_choice": {"type": "function", "function": {
        "name": "g"}}}, 400, "tool_choice", None),
    (CHAT, {"model": MODEL, "messages": MSG, "tools": [TOOL("f")], "tool_choice": "please"}, 400, "tool_choice",
     None),
    (CHAT, {"model": MODEL, "messages": MSG, "tools": [TOOL("f")], "tool_choice": "required",
            "response_format": {"type": "json_object"}}, 400, "response_format", None),
    (CHAT, {"model": MODEL, "messages": [*MSG, {"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": "{"}}]}]}, 400, "messages[1].tool_calls[0].function.arguments", None),
    # a schema under a response_format type that does not read it was ignored: free text or any object
    (CHAT, {"model": MODEL, "messages": MSG, "response_format": {"type": "text", "json_schema": {"schema": {
        "type": "object"}}}}, 400, "response_format.json_schema", None),
    (CHAT, {"model": MODEL, "messages": MSG, "response_format": {"type": "json_object", "json_schema": {
        "schema": {"type": "object"}}}}, 400, "response_format.json_schema", None),
    (COMP, {"model": MODEL, "prompt": "w1", "response_format": {"type": "text", "schema": {"type": "object"}}}, 400,
     "response_format.schema", None),
    # llama.cpp's and vLLM's fields for constrained output were ignored: free text where a schema was asked for
    (CHAT, {"model": MODEL, "messages": MSG, "guided_json": {"type": "object"}}, 400, "guided_json", None),
    (CHAT, {"model": MODEL, "messages": MSG, "json_schema": {"type": "object"}}, 400, "json_schema", None),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "grammar": "root ::= \"a\""}, 400, "grammar", None),
    (CHAT, {"model": MODEL, "messages": MSG, "guided_choice": ["a", "b"]}, 400, "guided_choice", None),
    (CHAT, {"model": "gpt-4o", "messages": MSG}, 404, "model", "model_not_found"),
    ("/v1/embeddings", {"model": MODEL, "input": "w1"}, 404, None, "not_found"),
    ("/tokenize", {"model": MODEL}, 400, "prompt", None),
    ("/tokenize", {"prompt": "w1", "messages": MSG}, 400, "prompt", None),
    ("/tokenize", {"content": 5}, 400, "content", None),
    ("/tokenize", {"messages": []}, 400, "messages", None),
    ("/tokenize", {"model": "gpt-4o", "prompt": "w1"}, 404, "model", "model_not_found"),
    ("/detokenize", {"tokens": "w1"}, 400, "tokens", None),
    ("/detokenize", {"tokens": [1, 99999]}, 400, "tokens[1]", None),
    ("/detokenize", {"tokens": [1, True]}, 400, "tokens[1]", None),
    ("/detokenize", {}, 400, "tokens", None),
]


@pytest.mark.parametrize("path,body,status,param,code", BAD, ids=[f"{i}-{c[2]}-{c[3]}" for i, c in enumerate(BAD)])
def test_bad_requests_get_an_error_body_and_no_traceback(served, caplog, path, body, status, param, code):
    srv, _ = served
    caplog.set_level(logging.INFO)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(srv.url + path, content=content, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and err["code"] == code
    assert err["type"] == "invalid_request_error"
    assert any(f'"POST {path} HTTP/1.1" {status}' in r.getMessage() for r in caplog.records)  # the log was seen
    no_tracebacks(caplog)


def test_tokenize_gives_the_ids_a_request_decodes_from_and_detokenize_reads_them_back(served, direct):
    """``/tokenize`` of a chat body is the chat request's prompt (its ``usage.prompt_tokens`` and the ids
    ``hsd run`` encodes), of a prompt the completion's; ``/detokenize`` gives the text back."""
    from hsd_opt.prompts import chat_ids, encode_prompt

    srv, _ = served
    tok = direct[2]
    msgs = [{"role": "system", "content": "w3 w4"}, {"role": "user", "content": "w5 w6 w7"}]
    r = httpx.post(srv.url + "/tokenize", json={"model": MODEL, "messages": msgs}, timeout=30).json()
    answer = client(srv).chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0)
    assert r["tokens"] == chat_ids(tok, msgs) and r["count"] == answer.usage.prompt_tokens == len(r["tokens"])
    assert r["max_model_len"] == 512
    tools = [TOOL("f", parameters={"type": "object", "properties": {"a": {"type": "integer"}}})]
    for choice in ("required", "auto", "none"):     # this server cannot constrain a call: refused as the chat
        body = {"model": MODEL, "messages": msgs, "tools": tools, "tool_choice": choice}     # route refuses it
        r = httpx.post(srv.url + "/tokenize", json=body, timeout=30)    # (a call counted: test_server_embedded)
        if choice == "none":
            assert r.json()["tokens"] == chat_ids(tok, msgs)
        else:
            assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.parameters"
    for key in ("prompt", "content"):
        ids = httpx.post(srv.url + "/tokenize", json={key: PROMPTS[1]}, timeout=30).json()["tokens"]
        assert ids == encode_prompt(tok, PROMPTS[1], raw=True)
    assert httpx.post(srv.url + "/tokenize", json={"prompt": ""}, timeout=30).json()["tokens"] == []
    other = {"max_tokens": 0, "response_format": {"type": "xml"}, "logprobs": "yes"}   # fields that make no ids
    assert httpx.post(srv.url + "/tokenize", json={"messages": msgs, **other}, timeout=30).json()["tokens"] == \
        chat_ids(tok, msgs)
    long = httpx.post(srv.url + "/tokenize", json={"prompt": " ".join(["w1"] * 600)}, timeout=30).json()
    assert long["count"] > long["max_model_len"] == 512          # counted, for the client to compare
    developer = [{"role": "developer", "content": "w3 w4"}, {"role": "user", "content": "w5 w6 w7"}]
    assert httpx.post(srv.url + "/tokenize", json={"messages": developer}, timeout=30).json()["tokens"] == \
        chat_ids(tok, msgs)     # the developer message is the system message
    parts = [{"role": "user", "content": [{"type": "text", "text": "w5 w6"}, {"type": "text", "text": "w7"}]}]
    joined = [{"role": "user", "content": "w5 w6\nw7"}]       # text parts joined by a newline, as llama.cpp and vLLM
    assert httpx.post(srv.url + "/tokenize", json={"messages": parts}, timeout=30).json()["tokens"] == \
        chat_ids(tok, joined) != chat_ids(tok, [{"role": "user", "content": "w5 w6w7"}])
    ids = encode_prompt(tok, PROMPTS[0], raw=True)
    back = httpx.post(srv.url + "/detokenize", json={"tokens": ids}, timeout=30).json()
    assert back["prompt"] == back["content"] == tok.decode(ids) and "w2 w3" in back["prompt"]


def test_wrong_method_and_the_openai_clients_view_of_errors(served, caplog):
    srv, _ = served
    r = httpx.get(srv.url + CHAT, timeout=30)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    c = client(srv)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[], max_tokens=3)
    assert e.value.status_code == 400 and e.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="other", prompt="w1", max_tokens=3)
    assert [m.id for m in c.models.list().data] == [MODEL] and c.models.retrieve(MODEL).id == MODEL
    health = httpx.get(srv.url + "/health", timeout=30).json()
    assert health["status"] == "ok" and health["hierarchy"] == ["ngram", "layer1", "layer2", "layer4"]
    no_tracebacks(caplog)


def test_the_prefill_share_reaches_the_batch_and_health_says_it(tiny):
    """``--prefill-share`` is the batch's (its default the scheduler's own), and ``/health`` says it."""
    from hsd_opt.runtime.schedule import PREFILL_SHARE

    for share in (None, 0.3):
        app, jobs = prepare_server(tiny[0], device="cpu", **({} if share is None else {"prefill_share": share}))
        want = PREFILL_SHARE if share is None else share
        assert jobs.batch.share.share == want
        with BackgroundServer(app, on_stop=jobs.cancel_all) as srv:
            assert httpx.get(srv.url + "/health", timeout=30).json()["prefill_share"] == want


def test_api_key_is_required_when_set(tiny, caplog):
    app, jobs = prepare_server(tiny[0], device="cpu", api_key="sekrit")
    with BackgroundServer(app, on_stop=jobs.cancel_all) as srv:
        for key in ("wrong", None):
            headers = {"authorization": f"Bearer {key}"} if key else {}
            r = httpx.get(srv.url + "/v1/models", headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(srv, api_key="wrong").completions.create(model=MODEL, prompt="w1", max_tokens=2)
        r = client(srv, api_key="sekrit").completions.create(model=MODEL, prompt="w1", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens >= 1
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200  # open
        assert httpx.post(srv.url + "/tokenize", json={"prompt": "w1"}, timeout=30).status_code == 401
        ok = httpx.post(srv.url + "/tokenize", json={"prompt": "w1"}, timeout=30,
                        headers={"authorization": "Bearer sekrit"})
        assert ok.status_code == 200
    no_tracebacks(caplog)


def test_routes_answer_with_a_trailing_slash_and_without_v1_as_llama_server(served, direct, caplog):
    """``/v1/completions/`` (a base URL with a slash too many) is answered in place, not redirected (307: httpx
    and the OpenAI client do not follow it for a POST); ``/completions``, ``/chat/completions`` and ``/models``
    (llama-server's paths, a base URL without ``/v1``) are the same routes."""
    srv, _ = served
    caplog.set_level(logging.INFO)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0}
    want = httpx.post(srv.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
    for path in ("/v1/completions/", "/completions", "/completions/"):
        r = httpx.post(srv.url + path, json=body, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, (path, r.status_code)
    msg = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 5, "temperature": 0}
    want = httpx.post(srv.url + "/v1/chat/completions", json=msg, timeout=30).json()["choices"][0]["message"]
    for path in ("/v1/chat/completions/", "/chat/completions"):
        r = httpx.post(srv.url + path, json=msg, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"] == want, path
    for path in ("/models", "/v1/models/", f"/models/{MODEL}", "/health/"):
        assert httpx.get(srv.url + path, timeout=30).status_code == 200, path
    assert httpx.post(srv.url + "/v2/completions/", json=body, timeout=30).status_code == 404
    no_tracebacks(caplog)


def test_api_key_guards_every_spelling_of_a_route(tiny):
    app, jobs = prepare_server(tiny[0], device="cpu", api_key="sekrit")
    with BackgroundServer(app, on_stop=jobs.cancel_all) as srv:
        for path in ("/v1/models/", "/models", "/models/"):
            assert httpx.get(srv.url + path, timeout=30).status_code == 401, path
        assert httpx.get(srv.url + "/health/", timeout=30).status_code == 200   # open, as /health


def test_allowed_origins_are_refused_unless_origins_and_written_as_a_browser_sends_them():
    """A port that is not a number, a query, a fragment, a user or an empty host passed as an origin; an upper-case
    host or a default port never matched a browser's ``Origin`` (compared as a string), silently."""
    from hsd_opt.commands.serve import parse_origins
    from hsd_opt.errors import HsdError

    for bad in ("http://localhost:abc", "http://localhost:99999", "http://a.com?x=1", "http://user@a.com",
                "http://a.com#f", "http://a b", "http://:3000", "http://a.com:", "localhost:3000"):
        with pytest.raises(HsdError, match="--allowed-origins: .* is not an origin"):
            parse_origins(bad)
    assert parse_origins("http://LocalHost:3000, http://localhost:80,https://a.com:443,https://a.com:8443") == \
        ["http://localhost:3000", "http://localhost", "https://a.com", "https://a.com:8443"]
    assert parse_origins("http://[::1]:3000") == ["http://[::1]:3000"] and parse_origins(" none ") == []


@pytest.mark.parametrize("origins, extra, says, not_says", [
    (["https://a.example"], {}, "Disallowed CORS origin (the server's --allowed-origins", "Private Network"),
    # an allowed origin asking for Private Network Access: no --allowed-origins would change the answer
    (["*"], {"access-control-request-private-network": "true"}, "Disallowed CORS private-network (a public page",
     "--allowed-origins"),
])
def test_a_refused_preflight_says_what_refused_it(origins, extra, says, not_says):
    from starlette.datastructures import Headers

    from hsd_opt.server.app import CorsMiddleware

    m = CorsMiddleware(None, allow_origins=origins, allow_methods=["*"], allow_headers=["*"])
    r = m.preflight_response(Headers({"origin": "http://localhost:3000", "access-control-request-method": "POST",
                                      **extra}))
    err = json.loads(r.body)["error"]
    assert r.status_code == 400 and err["code"] == "cors_refused" and err["message"].startswith(says), err
    assert not_says not in err["message"]


def test_web_pages_of_the_allowed_origins_may_call_the_server_and_their_preflight_needs_no_key(tiny):
    preflight = {"origin": "http://localhost:3000", "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}
    body = {"model": MODEL, "prompt": "w1", "max_tokens": 1, "temperature": 0}
    for origins, allowed in (("*", True), ("http://localhost:3000,https://a.example", True),
                             ("https://a.example", False), ("none", False)):
        from hsd_opt.commands.serve import parse_origins

        app, jobs = prepare_server(tiny[0], device="cpu", api_key="k", allowed_origins=parse_origins(origins))
        with BackgroundServer(app, on_stop=jobs.cancel_all) as srv:
            r = httpx.options(srv.url + "/v1/completions", headers=preflight, timeout=30)
            assert (r.status_code == 200) == allowed, (origins, r.status_code, r.text)
            if not allowed and origins != "none":       # refused by the CORS check: the API's error body
                assert r.status_code == 400 and r.json()["error"]["code"] == "cors_refused", r.text
                assert r.json()["error"]["message"].startswith("Disallowed CORS origin")
            elif not allowed:                           # none: no preflight answered (the key is asked for)
                assert r.status_code == 401, r.text
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30,
                           headers={"origin": preflight["origin"], "authorization": "Bearer k"})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
            assert ("access-control-allow-origin" in r.headers) == allowed
            if not allowed:
                continue
            r = httpx.post(srv.url + "/v1/completions", json=body, headers={"origin": preflight["origin"]},
                           timeout=30)
            assert r.status_code == 401                               # the key is still asked for


# ------------------------------------------------------------------------------------------------ queue and load


def gated(runner, gate: threading.Event):
    """A copy of the HSD ``runner`` whose decodings wait for ``gate`` before their prefill: lets a test hold the
    worker busy."""
    import copy

    h = copy.copy(runner)

    def start(*args, **kwargs):
        d = HSD.start(h, *args, **kwargs)
        passes = d.prefill_passes

        def wait_then_prefill(**kw):
            assert gate.wait(60)
            return (yield from passes(**kw))

        d.prefill_passes = wait_then_prefill
        return d

    h.start = start
    return h


def _poll(url: str, pred, timeout: float = 30.0) -> dict:
    end = time.monotonic() + timeout
    while True:
        h = httpx.get(url + "/health", timeout=30).json()
        if pred(h) or time.monotonic() > end:
            return h
        time.sleep(0.02)


def test_full_queue_answers_429(tiny, direct, caplog):
    app, jobs = prepare_server(tiny[0], device="cpu")  # for its ModelInfo
    gate = threading.Event()
    svc = app.state.service
    gated_jobs = JobQueue(gated(direct[0], gate), svc.info.tokenizer, max_queue=1)
    with BackgroundServer(create_app(gated_jobs, svc.info), on_stop=gated_jobs.cancel_all) as srv:
        c = client(srv)
        results: list = []
        with pytest.raises(openai.BadRequestError) as e:      # more sampled choices than the server ever holds
            c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=1.0, n=3)
        assert e.value.body["param"] == "n" and "holds at most 2 requests (1 decoding, 1 waiting" in \
            e.value.body["message"]
        # two fit one decoding and one waiting: answered (they were refused as more than --max-queue)
        gate.set()
        assert len(c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=1.0,
                                        n=2).choices) == 2
        gate.clear()

        def ask():
            results.append(c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0))

        first = threading.Thread(target=ask)
        first.start()
        assert _poll(srv.url, lambda h: h["busy"])["busy"]            # decoding (held at the gate)
        second = threading.Thread(target=ask)
        second.start()
        assert _poll(srv.url, lambda h: h["waiting"] == 1)["waiting"] == 1
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4)
        assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
        gate.set()
        first.join(60)
        second.join(60)
        assert len(results) == 2 and results[0].choices[0].text == results[1].choices[0].text
        assert _poll(srv.url, lambda h: h["completed"] == 4)["refused"] == 1
    no_tracebacks(caplog)


def test_an_answers_choices_are_queued_all_or_none(tiny, direct):
    """``JobQueue.submit_all`` (an answer's ``n`` decodings): into a queue with fewer free places than jobs, none
    is queued (a refused answer leaves no cancelled jobs taking places), and the refusal is counted once."""
    from hsd_opt.server.errors import ApiError
    from hsd_opt.server.jobs import Job, QueueFull
    from hsd_opt.server.requests import choice_requests, parse_request

    app, _ = prepare_server(tiny[0], device="cpu")
    info = app.state.service.info
    req = parse_request({"model": MODEL, "prompt": "w1", "max_tokens": 2, "n": 2, "seed": 3}, "completion", info)
    runs = choice_requests(req)
    assert [r.seed for r in runs] == [3, 4] and all(r.n == 1 for r in runs)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "w1"}]}       # the newer name wins, both checked
    assert parse_request({**chat, "max_tokens": 2, "max_completion_tokens": 5}, "chat", info).max_tokens == 5
    assert parse_request({**chat, "max_tokens": 2}, "chat", info).max_tokens == 2
    with pytest.raises(ApiError) as e:
        parse_request({**chat, "max_tokens": 2, "max_completion_tokens": 0}, "chat", info)
    assert e.value.param == "max_completion_tokens"
    q = JobQueue(direct[0], info.tokenizer, max_queue=2)      # no worker: nothing leaves the queue; 1 + 2 places
    q.submit_all([Job(r, lambda ev: None) for r in runs])
    with pytest.raises(QueueFull):
        q.submit_all([Job(r, lambda ev: None) for r in runs])
    assert q.waiting == 2 and q.metrics.requests["refused"] == 1
    q.submit_all([Job(runs[0], lambda ev: None)])
    assert q.waiting == 3


def test_a_burst_that_fits_the_batch_and_the_queue_is_taken_before_the_worker_reaches_it(tiny, direct):
    """``--max-batch`` requests decode and ``--max-queue`` more wait: requests that arrive together (or while a long
    prompt is computed) sit in the hand-off queue until the worker's next step, and were all counted against
    ``--max-queue`` (8 at once on a server of 8 + 2 places: 3 answered, 5 refused)."""
    from hsd_opt.server.jobs import Job, QueueFull
    from hsd_opt.server.requests import parse_request

    app, _ = prepare_server(tiny[0], device="cpu")
    info = app.state.service.info
    req = parse_request({"model": MODEL, "prompt": "w1", "max_tokens": 2}, "completion", info)
    q = JobQueue(direct[0], info.tokenizer, max_queue=2, max_batch=8)     # no worker: none admitted yet
    for _ in range(10):
        q.submit(Job(req, lambda ev: None))
    with pytest.raises(QueueFull, match="8 requests are being decoded and 2 already wait"):
        q.submit(Job(req, lambda ev: None))
    assert q.metrics.requests["refused"] == 1


def test_a_request_cancelled_while_it_waits_frees_its_place_at_once(tiny, direct):
    """A client that leaves while its request waits (the job cancelled in the queue) frees its place at once: it is
    not counted as waiting, a new request takes the place (it was a 429 until the worker reached the job), and the
    worker ends it as cancelled at its next tick, without decoding it."""
    from hsd_opt.server.jobs import Job, QueueFull
    from hsd_opt.server.requests import parse_request

    app, _ = prepare_server(tiny[0], device="cpu")
    req = parse_request({"model": MODEL, "prompt": "w1", "max_tokens": 2}, "completion", app.state.service.info)
    q = JobQueue(direct[0], app.state.service.info.tokenizer, max_queue=1)      # no worker yet: 1 + 1 places
    events: dict[int, list] = {}
    jobs = [Job(req, lambda ev, i=i: events.setdefault(i, []).append(ev[0])) for i in range(4)]
    q.submit_all(jobs[:2])
    with pytest.raises(QueueFull):
        q.submit(jobs[2])
    jobs[0].cancel()
    assert q.waiting == 1 and q.status()["waiting"] == 1
    q.submit(jobs[2])                                     # the cancelled job's place
    with pytest.raises(QueueFull):
        q.submit(jobs[3])
    q.start()
    try:
        deadline = time.monotonic() + 60
        while len(events) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        q.stop()
    assert events[0] == ["cancelled"] and events[1][-1] == "done" and events[2][-1] == "done"
    assert q.metrics.requests["cancelled"] == 1 and q.metrics.requests["completed"] == 2


def failing(runner, n: int):
    """A copy of the HSD ``runner`` whose first ``n`` generations fail after one block (a stand-in for a decoder
    bug); the later ones decode."""
    import copy

    h, left = copy.copy(runner), [n]

    def start(*args, **kwargs):
        d = HSD.start(h, *args, **kwargs)
        if left[0] > 0:
            left[0] -= 1

            def steps():
                yield Committed([5])
                raise RuntimeError("boom")

            d.steps = steps
        return d

    h.start = start
    return h


def test_a_generation_failure_is_a_500_and_the_server_keeps_serving(tiny, direct, caplog):
    app, _ = prepare_server(tiny[0], device="cpu")
    info = app.state.service.info
    failing_jobs = JobQueue(failing(direct[0], 2), info.tokenizer)
    with BackgroundServer(create_app(failing_jobs, info), on_stop=failing_jobs.cancel_all) as srv:
        c = client(srv)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
        assert e.value.status_code == 500 and "boom" in e.value.body["message"]
        with pytest.raises(openai.APIError, match="boom"):
            stream_completion(c, PROMPTS[0], max_tokens=4, temperature=0)
        r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4
        assert httpx.get(srv.url + "/health", timeout=30).json()["failed"] == 2
    assert sum("generation failed" in r.getMessage() and r.exc_info is not None for r in caplog.records) == 2


@pytest.mark.slow
def test_load_concurrent_streams_with_a_client_killed_mid_stream(served, direct, caplog):
    """8 clients x 4 streamed greedy requests (chat and completions over three prompts) while one more client
    leaves mid-stream: every response is complete and equal to the sequential output, none is lost, the
    abandoned generation is cancelled."""
    srv, jobs = served
    runner, _, tok = direct
    from hsd_opt.prompts import encode_prompt

    want, lens = {}, {}
    for p in PROMPTS:  # sequential references, straight from HSD.generate
        for kind, raw in (("chat", False), ("completion", True)):
            ids = runner.generate(encode_prompt(tok, p, raw=raw), N).token_ids
            want[kind, p] = (tok.decode(ids, skip_special_tokens=True), finish_of(ids, N))
            lens[kind, p] = len(ids)
    # the client that leaves asks for a long answer: this many tokens, were it not cancelled
    full = len(runner.generate(encode_prompt(tok, STOP_PROMPT), LEAVE_TOKENS).token_ids)
    assert full > 2 * N
    before = httpx.get(srv.url + "/health", timeout=30).json()
    got, errors = [], []

    def worker(i: int):
        c = client(srv)
        try:
            for k in range(4):
                p, kind = PROMPTS[(i + k) % 3], ("chat", "completion")[(i + k) % 2]
                fn = stream_chat if kind == "chat" else stream_completion
                text, last = fn(c, p, max_tokens=N, temperature=0)
                got.append(((kind, p), (text, last.choices[0].finish_reason if last else None)))
        except Exception as e:  # reported below
            errors.append(repr(e))

    def leaver():
        c = client(srv)
        with c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": STOP_PROMPT}],
                                       max_tokens=LEAVE_TOKENS, temperature=0, stream=True) as s:
            for ch in s:
                if ch.choices and ch.choices[0].delta.content:
                    break  # generation is under way: go away

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)] + [threading.Thread(target=leaver)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert len(got) == 32
    for key, res in got:
        assert res == want[key], key
    h = _poll(srv.url, lambda h: not h["busy"] and h["waiting"] == 0 and h["cancelled"] > before["cancelled"])
    assert h["completed"] - before["completed"] == 32 and h["cancelled"] - before["cancelled"] == 1
    left = h["generated_tokens"] - before["generated_tokens"] - sum(lens[key] for key, _ in got)
    assert 0 < left < full  # the abandoned generation stopped early
    assert h["failed"] == before["failed"] and h["refused"] == before["refused"]
    no_tracebacks(caplog)


# ------------------------------------------------------------------------------------------------ text stream


class CharTokenizer:
    """Ids are indexes into ``pieces``; decoding concatenates them (``\\ufffd`` pieces stand for half a
    character until the next piece completes it: ``"\\ufffd" + "!"`` decodes to ``"é"``)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids).replace("\ufffd!", "é")


def test_text_stream_holds_back_possible_stops_and_half_characters():
    tok = CharTokenizer(["ab", "c", "x", "\ufffd", "!", "cd", "e"])
    ts = TextStream(tok, ["cde"])
    assert ts.feed([0, 1]) == "ab"        # "c" may start "cde": held
    assert ts.feed([3]) == ""             # a half character: wait
    assert ts.feed([4, 5]) == "cé"        # "c" cannot start the stop any more; "cd" can: held
    assert ts.feed([6, 2]) == "" and ts.stopped and ts.ids == [0, 1, 3, 4, 5, 6]
    assert ts.text == "abcé" and ts.finish() == ""
    ts = TextStream(tok, ["zz"])
    assert ts.feed([0, 1, 2]) == "abcx" and ts.finish() == "" and not ts.stopped
    ts = TextStream(tok)
    assert ts.feed([0, 3]) == "" and ts.feed([4]) == "abé" and ts.feed([2]) == "x"


def _sentencepiece_like():
    """A fast tokenizer made as Llama-2's is (a BPE over "▁"-joined words with byte fallback; its decoder turns "▁"
    into spaces, reads byte pieces and strips the first space), trained here on one sentence."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tk.train_from_iterator(["Hello world, the capital of France is Paris."] * 20, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]))
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_a_sentencepiece_answer_keeps_its_first_space_and_its_tokens_bytes():
    """A SentencePiece decoder strips the first space of what it decodes: an answer read after the prompt's last
    ids keeps it (prompt text + answer text = the text of all the ids, as the OpenAI API and vLLM give it; it was
    lost), and each token's bytes are its piece ("▁Pa": " Pa"; a byte piece: that byte, not U+FFFD)."""
    from hsd_opt.server.text import token_bytes

    tok = _sentencepiece_like()
    prompt, pa = tok.encode("Hello"), tok.convert_tokens_to_ids("\u2581Pa")
    assert tok.decode([pa]) == "Pa"                     # alone: the space stripped
    ts = TextStream(tok, (), prompt)
    got = ts.feed([pa, pa]) + ts.finish()
    assert got == " Pa Pa" and tok.decode(prompt) + got == tok.decode(prompt + [pa, pa])
    stopped = TextStream(tok, [" Pa P"], prompt)        # a stop string across the first space
    assert stopped.feed([pa, pa, pa]) == "" and stopped.stopped and stopped.text == ""
    e2 = tok.convert_tokens_to_ids("<0xE2>")
    assert token_bytes(tok, pa) == b" Pa" and token_bytes(tok, e2) == b"\xe2"
    assert token_bytes(tok, tok.eos_token_id) == tok.decode([tok.eos_token_id]).encode()


def test_completion_logprobs_name_each_alternative_apart_parts_of_characters_by_their_bytes():
    """A text completion's ``top_logprobs`` is an object keyed by token: tokens that are parts of characters
    (whose text is U+FFFD alike) are named ``bytes:`` and their escapes, as the OpenAI API names them, so each
    alternative keeps its own value (they overwrote one another: 2 of 3 alternatives, the chosen token's value
    the least likely one's); ``text_offset`` counts such a token's text as before."""
    from hsd_opt.runtime.decode import TokenLogprob
    from hsd_opt.server.responses import completion_logprobs

    tok = _sentencepiece_like()
    e2, e3, pa = (tok.convert_tokens_to_ids(t) for t in ("<0xE2>", "<0xE3>", "\u2581Pa"))
    entries = [TokenLogprob(e2, -1.0, [(e2, -1.0), (pa, -1.5), (e3, -2.0)]), TokenLogprob(pa, -0.5, [(pa, -0.5)])]
    lp = completion_logprobs(tok, entries, offset=7)
    assert lp["tokens"] == ["bytes:\\xe2", " Pa"] and lp["token_logprobs"] == [-1.0, -0.5]
    assert lp["top_logprobs"] == [{"bytes:\\xe2": -1.0, " Pa": -1.5, "bytes:\\xe3": -2.0}, {" Pa": -0.5}]
    assert lp["text_offset"] == [7, 8]


def test_a_streamed_completions_text_offset_counts_a_part_of_a_character_as_one():
    """Streamed, ``text_offset`` moved on by the length of each token's name: 10 for ``bytes:\\xe2`` where the
    answer unstreamed counts its text, one U+FFFD."""
    import json

    from hsd_opt.runtime.decode import TokenLogprob
    from hsd_opt.server.responses import ChoiceStream, completion_logprobs

    tok = _sentencepiece_like()
    e2, pa = (tok.convert_tokens_to_ids(t) for t in ("<0xE2>", "\u2581Pa"))
    entries = [TokenLogprob(t, -1.0, [(t, -1.0)]) for t in (e2, pa, e2, pa)]
    stream = ChoiceStream(tok, "completion", "m", None, "id", 0, 0)
    offsets = []
    for entry, text in zip(entries, ("\ufffd", " Pa", "\ufffd", " Pa")):
        stream.event("logprobs", [entry])
        for raw in stream.event("text", text):
            lp = json.loads(raw[len(b"data: "):])["choices"][0]["logprobs"]
            offsets += lp["text_offset"] if lp else []
    assert offsets == completion_logprobs(tok, entries)["text_offset"] == [0, 1, 4, 5]


class _Decodes:
    """A tokenizer's ``decode`` alone (no backend to read): decoded whole every time, and the ids it was asked
    to decode counted."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def decode(self, ids, **kw):
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, **kw)


def test_a_text_stream_decodes_a_window_of_a_byte_level_tokenizer_and_hands_out_the_same_text(embedded):
    """SmolLM2's byte-level tokenizer: answers of natural text (accents, CJK, emoji: tokens that split a
    character's bytes) and of random ids (specials, stray bytes), fed in blocks of 1-6 ids, with and without stop
    strings: every block's text, the stop and the end are those of decoding every id each time, and the natural
    answers' decodes read at most a few windows of ids."""
    import random

    from hsd_opt.server.text import WINDOW, decodes_by_concatenation

    tok = embedded.tokenizer
    assert decodes_by_concatenation(tok) and not decodes_by_concatenation(_Decodes(tok))
    rng = random.Random(0)
    natural = tok.encode("Café naïve — 東京は晴れ 🙂🚀 déjà vu.\n\nΣύνολο: 42 ✓ " * 12)
    answers = [natural[:300], [rng.randrange(len(tok)) for _ in range(300)],
               [rng.choice(natural + list(range(20))) for _ in range(300)]]
    for i, ids in enumerate(answers):
        for stop in ((), ("\n\n", "✓ Caf")):
            counted = _Decodes(tok)
            fast, whole = TextStream(tok, stop), TextStream(_Decodes(tok), stop)
            fast.tokenizer = counted
            k = 0
            while k < len(ids) and not whole.stopped:
                n = rng.randint(1, 6)
                assert fast.feed(ids[k:k + n]) == whole.feed(ids[k:k + n]), (i, stop, k)
                k += n
            assert (fast.stopped, fast.ids) == (whole.stopped, whole.ids)
            assert fast.finish() == whole.finish() and fast.text == whole.text
            if i == 0:
                assert counted.longest <= 3 * WINDOW + 6 < len(ids)
    assert TextStream(tok).feed(natural) == tok.decode(natural, skip_special_tokens=True)


# ------------------------------------------------------------------------------------------------ the command


def test_a_stream_interval_sends_the_first_text_at_once_then_every_interval_tokens(direct):
    """With an interval of 4 tokens, one-token blocks: text goes out with the first block, then with the 5th and
    the 9th; what is held after the 10th, with the end's text, completes the text sent one block at a time."""
    from hsd_opt.server.jobs import Job, _Stream

    runner, _, tok = direct
    ids = runner.generate(tok.encode(PROMPTS[2]), 10).token_ids
    assert len(ids) == 10
    sent: dict[int, list] = {1: [], 4: []}
    streams = {}
    for interval in (1, 4):
        job = Job(None, lambda ev, i=interval: sent[i].append((len(streams[i].text.ids), ev[1])))
        streams[interval] = _Stream(job, TextStream(tok), interval)
        for t in ids:
            assert streams[interval]([t]) is False
    assert [n for n, _ in sent[4]] == [1, 5, 9]
    every = "".join(t for _, t in sent[1]) + streams[1].text.finish()
    assert "".join(t for _, t in sent[4]) + streams[4].held + streams[4].text.finish() == every
    assert len(sent[1]) == 10 and every


def test_a_served_stream_with_an_interval_has_fewer_chunks_and_the_same_text(tiny, caplog):
    """`hsd serve --stream-interval 3`: a streamed completion's text equals the same request unstreamed, in at
    most one chunk for the first token and one per 3 tokens after it."""
    app, jobs = prepare_server(tiny[0], device="cpu", stream_interval=3)
    with BackgroundServer(app, on_stop=jobs.cancel_all) as srv:
        c = client(srv)
        whole = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N, temperature=0)
        parts = [ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=N,
                                                                   temperature=0, stream=True)
                 if ch.choices and ch.choices[0].text]
        health = httpx.get(srv.url + "/health", timeout=30).json()
    n = whole.usage.completion_tokens
    assert "".join(parts) == whole.choices[0].text and n == N
    assert 2 <= len(parts) <= 1 + -(-(n - 1) // 3) and health["stream_interval"] == 3
    no_tracebacks(caplog)


def test_serve_flag_errors_exit_2_with_one_line(tiny, tmp_path, monkeypatch):
    plan = tiny[0]
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    cases = [(["--plan", tmp_path / "nope.json"], "nope.json"),
             (["--plan", plan, "--port", "70000"], "--port"),
             (["--plan", plan, "--max-queue", "0"], "--max-queue"),
             (["--plan", plan, "--mode", "lazy"], "--mode"),
             (["--plan", plan, "--stream-interval", "0"], "--stream-interval"),
             (["--plan", plan, "--log-stats", "-1"], "--log-stats"),
             (["--plan", plan, "--prefill-share", "0"], "--prefill-share"),
             (["--plan", plan, "--prefill-share", "1.5"], "--prefill-share"),
             (["--plan", plan, "--prefill-share", "nan"], "--prefill-share"),
             (["--plan", plan, "--allowed-origins", "localhost:3000"], "--allowed-origins"),
             (["--plan", plan, "--host", "h" * 300], "not a valid host name"),      # (a label over 63 characters)
             (["--plan", plan, "--api-key", "", "--port", str(port)], "--api-key (or HSD_API_KEY): an empty key"),
             (["--plan", plan, "--api-key", " k", "--port", str(port)], "--api-key (or HSD_API_KEY): a key must be"),
             (["--plan", plan, "--port", str(port)], "--port")]
    try:
        for args, needle in cases:
            res = run_cli("serve", *args)
            out = cli_output(res)
            errors = [x for x in out.splitlines() if x.startswith("error:")]
            assert res.exit_code == 2 and len(errors) == 1 and needle in errors[0] and "Traceback" not in out, out
        monkeypatch.setenv("HSD_API_KEY", "")     # set but empty, as ``HSD_API_KEY=$UNSET``: not an open server
        out = cli_output(run_cli("serve", "--plan", plan, "--port", str(port)))    # (checked before the port)
        assert "an empty key would leave the server open" in out, out
    finally:
        taken.close()


@pytest.mark.parametrize("flag,value", [("--max-batch", "0"), ("--prefill-share", "2"), ("--mode", "lazy"),
                                        ("--allowed-origins", "ftp://x"), ("--target-precision", "int9"),
                                        ("--target-precision", "int8"), ("--model", "no-such-model"),
                                        ("--device", "tpu"), ("--retime", "none.json")])
def test_a_serve_flag_error_comes_before_torch_is_imported(tiny, flag, value):
    """A mistyped flag of ``hsd serve``, or a plan made for another target precision than it asks, is said at
    once: importing the runtime (torch, seconds) waited for it."""
    code = ("import sys, atexit\natexit.register(lambda: print('torch' in sys.modules))\n"
            "from hsd_opt.cli import app\n"
            f"app(['serve', '--plan', {str(tiny[0])!r}, {flag!r}, {value!r}])\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and flag in res.stderr, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_serve_command_says_ready_serves_and_stops_on_ctrl_c(tiny, stop):
    """``hsd serve`` in a subprocess: progress and the ready line on stderr, a request, a bad request logged
    without a traceback, and Ctrl-C (or SIGTERM, what service managers send) during an open stream: the stream
    ends at once, the process says it stopped and exits 0."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-m", "hsd_opt", "serve", "--plan", str(tiny[0]), "--port", "0",
                             "--device", "cpu"], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    try:
        url = None
        end = time.monotonic() + 120
        while url is None and time.monotonic() < end:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("ready: "):
                url = line.split(" at ")[1].split()[0]
        assert url and url.startswith("http://127.0.0.1:"), "".join(lines)
        c = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w1 w2"}], max_tokens=3,
                                      temperature=0)
        assert r.usage.completion_tokens >= 1
        assert httpx.post(url + "/completions", content=b"{", timeout=30).status_code == 400
        started, ended = threading.Event(), []

        def long_stream():  # still streaming when Ctrl-C comes
            try:
                for ch in c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": STOP_PROMPT}],
                                                    max_tokens=400, temperature=0, stream=True):
                    if ch.choices and ch.choices[0].delta.content:
                        started.set()
                ended.append("finished")
            except openai.APIError as e:  # the server cancelled it: an error event
                ended.append(str(e))

        t = threading.Thread(target=long_stream)
        t.start()
        assert started.wait(60)
        late = _half_sent(url, {"prompt": STOP_PROMPT, "max_tokens": 400, "temperature": 0})
        time.sleep(1.0)                      # its headers read (a connection not read yet is closed unanswered)
        proc.send_signal(stop)
        time.sleep(1.0)
        late.sendall(b"}")                   # its body whole after the signal: refused, not decoded then cut off
        answer = late.makefile("rb").read().decode()
        _, err = proc.communicate(timeout=60)
        t.join(60)
        assert not t.is_alive() and len(ended) == 1 and "server is stopping" in ended[0], ended
        assert answer.startswith("HTTP/1.1 503") and '"code":"cancelled"' in answer.replace(" ", ""), answer
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    log = "".join(lines) + err
    assert proc.returncode == 0, log
    assert "loading" in log and "stopped" in log and "Traceback" not in log
    assert '"POST /v1/completions HTTP/1.1" 400' in log
    assert "timeout graceful shutdown exceeded" not in log  # the open stream ended when its job was cancelled


def _half_sent(url: str, body: dict):
    """A socket that sent a completion request to ``url`` (``http://host:port/v1``) but its body's last byte
    (``}``), which the caller sends when it likes."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((u.hostname, u.port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(data) + data[:-1])
    return sock


def test_a_port_is_claimed_when_bound_so_a_second_server_is_refused_before_it_loads():
    """Two servers started together: the second's bind fails at once, naming the flags (it bound too, loaded its
    model, then crashed with a traceback when it began to listen)."""
    from hsd_opt.errors import HsdError
    from hsd_opt.server.serving import bind_socket

    first = bind_socket("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        with pytest.raises(HsdError, match=f"--host 127.0.0.1 --port {port}: cannot listen there"):
            bind_socket("127.0.0.1", port)
    finally:
        first.close()


def test_a_body_still_arriving_when_the_server_has_stopped_waiting_is_answered_503(tiny, caplog):
    """A client whose body had not all come when the server began to stop, nor by the end of its grace period,
    is answered 503 (the server is stopping) with an error body, and the log holds no traceback (uvicorn's
    cancelling of the request logged one and answered a plain-text 500)."""
    app, jobs = prepare_server(tiny[0], device="cpu")
    srv = BackgroundServer(app, on_stop=jobs.stop_taking).__enter__()
    slow = _half_sent(srv.url + "/v1", {"prompt": PROMPTS[0], "max_tokens": 2})
    time.sleep(0.5)
    srv.stop()                  # waits out the grace period, then cancels what still runs
    answer = slow.makefile("rb").read().decode()
    assert answer.startswith("HTTP/1.1 503") and '"code":"cancelled"' in answer.replace(" ", ""), answer
    said = [r.getMessage() for r in caplog.records]
    assert not any(r.exc_info for r in caplog.records) and not any("Traceback" in m or "ASGI" in m for m in said)


def test_a_body_over_max_body_is_answered_413_unread(tiny, caplog):
    """A body whose Content-Length is over --max-body is refused before it is read; one sent in chunks without
    a length is refused as soon as it passes the bound (the rest is not read)."""
    app, jobs = prepare_server(tiny[0], device="cpu", max_body=1000)
    with BackgroundServer(app, on_stop=jobs.cancel_all) as srv:
        url = srv.url + "/v1/completions"
        r = httpx.post(url, content=b"x" * 5000, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

        def chunks():
            for _ in range(50):
                yield b"y" * 100

        r = httpx.post(url, content=chunks(), headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 413
        ok = httpx.post(url, json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200
    no_tracebacks(caplog)


def test_a_client_leaving_while_sending_a_body_is_no_server_error(served, caplog):
    """A client that closes its connection part-way through its body, on every route that reads one: no
    traceback in the log, and the server answers the next request."""
    import time
    from urllib.parse import urlparse

    srv, _ = served
    url = urlparse(srv.url)
    for route in (CHAT, COMP, "/tokenize", "/detokenize"):
        with socket.create_connection((url.hostname, url.port), timeout=30) as s:
            s.sendall(f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: 100\r\n\r\n{{\"prompt\":".encode())
        time.sleep(0.3)                             # the server notices the closed connection
    r = httpx.post(srv.url + "/tokenize", json={"prompt": PROMPTS[0]}, timeout=30)
    assert r.status_code == 200 and r.json()["count"] > 0
    no_tracebacks(caplog)


@pytest.mark.slow
def test_concurrent_requests_decode_together_and_each_is_its_own_answer(tiny, direct, caplog):
    """Four clients at once with different prompts and lengths on a server decoding up to four together: its
    batch holds several in flight at once (counted at each of its ticks; /health reports them), and every answer
    is the one the plan gives the prompt alone."""
    from hsd_opt.prompts import encode_prompt

    runner, _, tok = direct
    app, jobs = prepare_server(tiny[0], device="cpu", max_batch=4)
    asks = [(PROMPTS[0], 30), (PROMPTS[1], 7), (STOP_PROMPT, 40), (PROMPTS[2], 19)]
    want = [runner.generate(encode_prompt(tok, p, raw=True), n).token_ids for p, n in asks]
    seen_active, at_ticks = [], []
    tick = jobs.batch.tick
    jobs.batch.tick = lambda: at_ticks.append(jobs.batch.in_flight) or tick()
    with BackgroundServer(app, on_stop=jobs.cancel_all) as srv:
        got: dict[int, list[int]] = {}

        def ask(i: int):
            r = client(srv).completions.create(model=MODEL, prompt=asks[i][0], max_tokens=asks[i][1],
                                               temperature=0)
            got[i] = r.model_extra["hsd"]["token_ids"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            seen_active.append(httpx.get(srv.url + "/health", timeout=30).json()["active"])
            time.sleep(0.005)
        for t in threads:
            t.join(60)
        h = httpx.get(srv.url + "/health", timeout=30).json()
    assert [got[i] for i in range(4)] == want
    assert max(at_ticks) >= 2 and max(seen_active) <= 4 and h["max_batch"] == 4 and h["completed"] == 4
    no_tracebacks(caplog)


def test_a_stop_string_ends_the_text_at_the_token_that_completes_it_whole_characters_or_not(embedded):
    """Feeding one id at a time, the text ends at the first id whose decoded text, up to a character whose bytes
    are still coming, holds a stop string: cut before the stop (what precedes it handed out whole, half characters
    included), the ids ending at that id; at the end of the answer (``max_tokens``, EOS) a stop in the whole text
    still cuts. The reference decodes every prefix whole."""
    import random

    tok = embedded.tokenizer

    def reference(ids, stop):
        for k in range(1, len(ids) + 1):
            whole = tok.decode(ids[:k], skip_special_tokens=True).rstrip("\ufffd")
            hits = [i for i in (whole.find(s) for s in stop) if i >= 0]
            if hits:
                return whole[:min(hits)], ids[:k], True
        full = tok.decode(ids, skip_special_tokens=True)
        hits = [i for i in (full.find(s) for s in stop) if i >= 0]
        return (full[:min(hits)], ids, True) if hits else (full, ids, False)

    def streamed(ids, stop):
        ts = TextStream(tok, stop)
        text = "".join(ts.feed([t]) for t in ids) + ts.finish()
        return text, ts.ids, ts.stopped

    cases = [(tok.encode("Привет, пока", add_special_tokens=False), ["по"]),          # the id after it was kept
             (tok.encode("Привет, пока", add_special_tokens=False)[:8], ["по"]),      # ends in half a character
             (tok.encode("Answer:", add_special_tokens=False) + [459], [": "]),
             ([218, 218] + tok.encode(" x", add_special_tokens=False), [" x"]),       # stray bytes before the stop
             ([459] + tok.encode("Hello…", add_special_tokens=False), ["Hel"])]
    rng = random.Random(1)
    natural = tok.encode("Café naïve — 東京は晴れ 🙂🚀 «déjà vu» — Привет, пока! ✓ " * 3, add_special_tokens=False)
    for _ in range(40):
        ids = natural[rng.randrange(20):][: rng.randint(5, 40)]
        text = tok.decode(ids, skip_special_tokens=True).replace("\ufffd", "")
        i = rng.randrange(max(1, len(text) - 2))
        cases.append((ids, [text[i:i + rng.randint(1, 3)] or "x"]))
    for ids, stop in cases:
        assert streamed(ids, stop) == reference(ids, stop), (ids, stop)


def test_a_request_is_read_and_tokenized_off_the_event_loop(served, monkeypatch):
    """Reading a body and tokenizing its prompt (seconds for a prompt of megabytes) run in a worker thread, not on
    the event loop that streams every other client's answer: each parser here finds no running loop in its thread,
    and the answers are the same as ever."""
    import asyncio

    import hsd_opt.server.app as app_module

    on_loop = []

    def watched(fn):
        def call(*args, **kw):
            try:
                asyncio.get_running_loop()
                on_loop.append(fn.__name__)
            except RuntimeError:
                pass
            return fn(*args, **kw)
        return call

    for name in ("parse_request", "parse_tokenize", "parse_detokenize"):
        monkeypatch.setattr(app_module, name, watched(getattr(app_module, name)))
    srv, _ = served
    out = client(srv).completions.create(model=MODEL, prompt="w1 w2", max_tokens=3, temperature=0)
    assert out.choices[0].text and out.usage.completion_tokens >= 1
    ids = httpx.post(srv.url + "/tokenize", json={"prompt": "w1 w2"}).json()["tokens"]
    assert httpx.post(srv.url + "/detokenize", json={"tokens": ids}).json()["content"] == "w1 w2"
    bad = httpx.post(srv.url + COMP, json={"model": MODEL, "prompt": "w1", "top_p": 1.5})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_p"     # errors still reach the client
    assert on_loop == []


class _ByteTokenizer:
    """A tokenizer without a chat template: a text's UTF-8 bytes are its ids (a conversation is its contents
    joined by blank lines)."""

    def __call__(self, text, **kw):
        return {"input_ids": list(text.encode())}

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode()


def test_an_assistant_turn_with_text_and_calls_keeps_both_and_whitespace_is_a_prompt():
    """An earlier assistant turn that says something and calls a function (as OpenAI's models answer) gives the
    model its text and its call (the call was dropped: the tool's result then answered a call never made), and
    its calls are checked; whitespace is a prompt OpenAI's API completes (refused as empty)."""
    from hsd_opt.server.errors import ApiError
    from hsd_opt.server.requests import ModelInfo, parse_request

    info = ModelInfo("m", _ByteTokenizer(), 4096)
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = _ByteTokenizer().decode(parse_request({"messages": msgs}, "chat", info).prompt_ids)
    assert text == 'Weather?\n\nLet me check.\n{"name": "weather", "arguments": {"city": "Oslo"}}\n\nsunny'
    msgs[1]["tool_calls"] = [{"function": {"name": "weather", "arguments": "{"}}]
    with pytest.raises(ApiError) as e:
        parse_request({"messages": msgs}, "chat", info)
    assert e.value.param == "messages[1].tool_calls[0].function.arguments"
    assert parse_request({"prompt": "\n", "max_tokens": 2}, "completion", info).prompt_ids == [10]
    assert parse_request({"messages": [{"role": "user", "content": " "}]}, "chat", info).prompt_ids == [32]
    for body, kind in (({"prompt": ""}, "completion"), ({"messages": [{"role": "user", "content": ""}]}, "chat")):
        with pytest.raises(ApiError, match="empty"):
            parse_request(body, kind, info)


def test_a_request_without_tools_reads_no_grammar_tokenizer():
    """Checking a request's tools reads the grammar compiler's tokenizer (llguidance's tables: built on first use,
    a long build for a large vocabulary, tried again per request where it fails); a request without tools, on the
    chat route or ``/tokenize``, reads none."""
    from hsd_opt.server.requests import ModelInfo, parse_request, parse_tokenize

    class Compiler:
        def tokenizer(self):
            raise AssertionError("the grammar tokenizer was read for a request without tools")

    info = ModelInfo("m", _ByteTokenizer(), 4096, grammars=Compiler())
    msgs = [{"role": "user", "content": "Weather?"}]
    assert parse_request({"messages": msgs}, "chat", info).prompt_ids == list(b"Weather?")
    assert parse_tokenize({"messages": msgs}, info) == list(b"Weather?")


def test_tokenize_refuses_tools_the_chat_route_refuses_on_a_server_that_cannot_constrain():
    """On a server without a grammar compiler, a chat request whose answer follows its tools (``tool_choice``
    "auto", "required" or a named function) is a 400 naming the tool's parameters; ``/tokenize`` of the same body
    refuses the same way (it answered the ids of a request the server does not decode), and under "none" both
    read the body (the answer does not follow the tools)."""
    from hsd_opt.server.errors import ApiError
    from hsd_opt.server.requests import ModelInfo, parse_request, parse_tokenize

    info = ModelInfo("m", _ByteTokenizer(), 4096)
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    msgs = [{"role": "user", "content": "Weather?"}]
    for choice in ("auto", "required", {"type": "function", "function": {"name": "weather"}}):
        body = {"messages": msgs, "tools": [tool], "tool_choice": choice}
        for parse in (lambda b: parse_request(b, "chat", info), lambda b: parse_tokenize(b, info)):
            with pytest.raises(ApiError, match="cannot constrain") as e:
                parse(body)
            assert e.value.status == 400 and e.value.param == "tools[0].function.parameters"
    body = {"messages": msgs, "tools": [tool], "tool_choice": "none"}
    assert parse_tokenize(body, info) == parse_request(body, "chat", info).prompt_ids == list(b"Weather?")


def test_the_short_behind_long_benchmark_times_every_request(served):
    """``benchmarks/ttft_behind_long.py`` against a running server: every request answered, each short one's first
    token before its end, and the same text as the short request sent alone where the prompt is the same."""
    from benchmarks.ttft_behind_long import SHORT, measure, timed_stream

    srv, _ = served
    rep = measure(srv.url, repeats=30, shorts=2, gap=0.05, max_tokens=3, text="w1 w2 w3 ")
    assert rep["long_prompt_tokens"] >= 90
    for r in [rep["alone"], rep["long"], *rep["shorts"]]:
        assert r["ttft_s"] is not None and 0 < r["ttft_s"] <= r["total_s"] and r["text"]
    assert timed_stream(srv.url, SHORT, 3, 60)["text"] == rep["alone"]["text"]


def test_the_short_behind_long_benchmark_names_a_url_with_no_server():
    from benchmarks.ttft_behind_long import measure
    from hsd_opt.errors import HsdError

    with socket.socket() as s:                      # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(HsdError, match=f"--url http://127.0.0.1:{port}: ConnectError"):
        measure(f"http://127.0.0.1:{port}", repeats=2, shorts=1, gap=0.0, max_tokens=2, timeout=5)


def test_a_seeded_sample_runs_the_plans_own_hierarchy_whatever_its_load_levels(tiny):
    """A plan's load levels need not hold its own hierarchy at level 1 (``--min-gain`` may keep more levels in the
    plan itself, a plan may be solved for ``--batch-sizes 2,4``, ``--retime`` chooses level 1 again): a seeded
    sampled request still runs the plan's own hierarchy, so that its seed gives what ``hsd run`` gives."""
    plan, _ = tiny
    d = json.loads(plan.read_text())
    level = {"expected_latency": 0.01, "tokens_per_s": 100.0, "batched_target_latency": 0.012}
    d["by_load"] = {"1": {"hierarchy": ["layer2", "layer4"], "budgets": [3], **level},
                    "4": {"hierarchy": ["layer4"], "budgets": [], **level}}
    levels = plan.parent / "levels.json"
    levels.write_text(json.dumps(d))
    app, jobs = prepare_server(levels, device="cpu", max_queue=4)
    with BackgroundServer(app, on_stop=jobs.cancel_all) as srv:
        c = client(srv)
        for seed, extra in ((7, {}), (11, {"top_p": 0.9}), (3, {"extra_body": {"top_k": 5, "min_p": 0.05}})):
            got = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                            max_tokens=N, temperature=0.9, seed=seed, **extra)
            flags = ["--top-p", extra["top_p"]] if "top_p" in extra else []
            flags += ["--top-k", 5, "--min-p", 0.05] if "extra_body" in extra else []
            assert got.model_extra["hsd"]["token_ids"] == hsd_run_ids(
                plan, PROMPTS[0], "--max-new-tokens", N, "--temperature", 0.9, "--seed", seed, *flags)


def test_tools_under_none_are_answered_by_a_server_that_cannot_constrain(served):
    """The tiny model's tokenizer is not one llguidance reads, so this server refuses structured output; with
    ``tool_choice`` ``"none"`` the answer is free text, which it can give (the tools' parameters are checked where
    the server can compile them), and ``/tokenize`` gives the ids of that request; under "auto" both refuse."""
    import httpx

    body = {"model": MODEL, "messages": MSG, "tools": [TOOL("f")], "max_tokens": 3, "temperature": 0}
    r = httpx.post(served[0].url + "/v1/chat/completions", json={**body, "tool_choice": "none"}, timeout=60)
    assert r.status_code == 200 and not r.json()["choices"][0]["message"].get("tool_calls"), r.text
    assert httpx.post(served[0].url + "/v1/chat/completions", json=body, timeout=60).status_code == 400   # "auto"
    tokenize = {"messages": MSG, "tools": [TOOL("f")]}
    assert httpx.post(served[0].url + "/tokenize", json=tokenize, timeout=60).status_code == 400
    assert httpx.post(served[0].url + "/tokenize", json={**tokenize, "tool_choice": "none"},
                      timeout=60).status_code == 200
