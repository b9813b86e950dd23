"""`hsd serve` on the embedded SmolLM2-135M-Instruct with the solved plan (the abstaining lookup -> the int4 copy
-> the target), through the ``openai`` client: greedy chat and completions, streamed and not, are token for token
the target's greedy output and the plan's own ``HSD.generate``; a stop string cuts the text; a seed reproduces a
sampled answer."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from hsd_opt.commands.serve import prepare_server
from hsd_opt.engine.layered import LayeredLM
from hsd_opt.models.loading import eos_token_ids
from hsd_opt.prompts import encode_prompt
from hsd_opt.runtime.decode import HSD, Level
from hsd_opt.server import BackgroundServer

REPO = Path(__file__).resolve().parents[1]
SOLVED_PLAN = REPO / "tests" / "data" / "runtime_bench_lookup_plan.json"
PROMPT = "Write a Python function that returns the n-th Fibonacci number."
N = 24

pytestmark = [pytest.mark.embedded, pytest.mark.slow]


def test_server_on_the_embedded_plan_is_lossless(embedded):
    tok = embedded.tokenizer
    ar = HSD([Level("layer30", LayeredLM(embedded.model), 30)], [], eos_ids=eos_token_ids(embedded))
    want = ar.generate(encode_prompt(tok, PROMPT), N).token_ids                 # the target's greedy output
    want_raw = ar.generate(encode_prompt(tok, PROMPT, raw=True), N).token_ids
    app, jobs = prepare_server(SOLVED_PLAN, device="cpu")
    assert jobs.runner.generate(encode_prompt(tok, PROMPT), N).token_ids == want  # the plan, directly
    with BackgroundServer(app, on_stop=jobs.cancel_all) as srv:
        c = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
        msgs = [{"role": "user", "content": PROMPT}]
        r = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=N, temperature=0)
        assert r.model_extra["hsd"]["token_ids"] == want
        assert r.model_extra["hsd"]["hierarchy"] == ["lookup", "int4", "layer30"]
        text = tok.decode(want, skip_special_tokens=True)
        assert r.choices[0].message.content == text
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="smollm2-135m", messages=msgs, max_tokens=N, temperature=0, stream=True) if ch.choices)
        assert streamed == text

        r = c.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=N, temperature=0)
        assert r.model_extra["hsd"]["token_ids"] == want_raw
        raw_text = r.choices[0].text
        stop = raw_text.strip().split()[2]  # the third word of the answer
        cut = c.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=N, temperature=0, stop=stop)
        assert cut.choices[0].text == raw_text[: raw_text.index(stop)] and cut.choices[0].finish_reason == "stop"

        tools = [{"type": "function", "function": {"name": "fib", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer"}}}}}]
        for choice in ("required", "auto"):     # /tokenize counts what a request with tools decodes from
            counted = httpx.post(srv.url + "/tokenize", json={"messages": msgs, "tools": tools, "tool_choice": choice},
                                 timeout=60).json()["count"]
            r = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=1, temperature=0,
                                          tools=tools, tool_choice=choice)
            assert counted == r.usage.prompt_tokens > len(encode_prompt(tok, PROMPT))

        kw = dict(model="smollm2-135m", messages=msgs, max_tokens=12, temperature=0.8, top_p=0.9, seed=11)
        a, b = (c.chat.completions.create(**kw).model_extra["hsd"]["token_ids"] for _ in range(2))
        assert a == b and len(a) >= 1


def test_four_concurrent_requests_are_each_the_targets_answer(embedded):
    """Four clients at once on the embedded plan, decoded together, each asking for another number of tokens:
    every answer is token for token what the plan gives its prompt alone (``hsd run``'s code path), which is
    the target's greedy output."""
    import threading

    tok = embedded.tokenizer
    app, jobs = prepare_server(SOLVED_PLAN, device="cpu", max_batch=4)
    asks = [(PROMPT, 40), ("Name three prime numbers.", 9), ("What is the capital of France?", 23),
            ("Write a haiku about the sea.", 31)]
    want = [jobs.runner.generate(encode_prompt(tok, p), n).token_ids for p, n in asks]
    got: dict[int, list[int]] = {}
    with BackgroundServer(app, on_stop=jobs.cancel_all) as srv:
        def ask(i: int):
            c = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
            r = c.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": asks[i][0]}],
                                          max_tokens=asks[i][1], temperature=0)
            got[i] = r.model_extra["hsd"]["token_ids"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    assert [got[i] for i in range(4)] == want
