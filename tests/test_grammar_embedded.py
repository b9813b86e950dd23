"""Structured output on the embedded SmolLM2-135M-Instruct with the solved plan (the abstaining lookup -> the int4
copy -> the target): under a JSON schema the plan's greedy output is the target's masked greedy output token for
token, alone and served (``response_format``, streamed and not, several requests at once); the JSON is valid where
the answer ended; a schema that does not compile is a 400 naming it."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from hsd_opt.commands.serve import prepare_server
from hsd_opt.engine.layered import LayeredLM
from hsd_opt.grammar.compiler import GrammarCompiler, GrammarSpec
from hsd_opt.grammar.constraint import Constraint
from hsd_opt.models.loading import eos_token_ids
from hsd_opt.prompts import chat_ids
from hsd_opt.runtime.decode import HSD, Level
from hsd_opt.server import BackgroundServer

REPO = Path(__file__).resolve().parents[1]
SOLVED_PLAN = REPO / "tests" / "data" / "runtime_bench_lookup_plan.json"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    "typed": {"type": "boolean"}, "paradigms": {"type": "array", "items": {"enum": ["functional", "object-oriented",
                                                                                   "procedural"]}, "maxItems": 3}},
    "required": ["name", "year", "typed", "paradigms"], "additionalProperties": False}
QUESTIONS = ["Describe the Python programming language as JSON.", "Describe the Rust programming language as JSON.",
             "Describe the C programming language as JSON.", "Describe Haskell as JSON."]
N = 64

pytestmark = [pytest.mark.embedded, pytest.mark.slow]


def _masked_target(embedded):
    """The target alone (no drafter) decoding under the schema: the reference."""
    ar = HSD([Level("layer30", LayeredLM(embedded.model), 30)], [], eos_ids=eos_token_ids(embedded))
    grammars = GrammarCompiler(embedded.tokenizer, eos_token_ids(embedded), ar.target.vocab_size)
    return ar, grammars.compile(GrammarSpec.json_schema(SCHEMA))


def _ids(tok, q):
    return chat_ids(tok, [{"role": "user", "content": q}])


def test_the_served_plan_under_a_schema_is_the_masked_targets_answer(embedded):
    tok = embedded.tokenizer
    ar, grammar = _masked_target(embedded)
    want = [ar.generate(_ids(tok, q), N, constraint=Constraint(grammar)).token_ids for q in QUESTIONS]
    for w in want:
        if w[-1] in eos_token_ids(embedded):                    # ended: the whole answer is valid JSON
            value = json.loads(tok.decode(w, skip_special_tokens=True))
            assert set(value) == set(SCHEMA["required"]) and 1900 <= value["year"] <= 2100
    app, jobs = prepare_server(SOLVED_PLAN, device="cpu")
    plan_out = jobs.runner.generate(_ids(tok, QUESTIONS[0]), N, constraint=Constraint(grammar))
    assert plan_out.token_ids == want[0] and plan_out.stats["hierarchy"] == ["lookup", "int4", "layer30"]
    fmt = {"type": "json_schema", "json_schema": {"name": "language", "schema": SCHEMA}}
    with BackgroundServer(app, on_stop=jobs.cancel_all) as srv:
        c = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)

        def ask(q):
            return c.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": q}],
                                             max_tokens=N, temperature=0, response_format=fmt)

        with ThreadPoolExecutor(4) as pool:                      # decoded together, each its own grammar state
            got = list(pool.map(ask, QUESTIONS))
        assert [r.model_extra["hsd"]["token_ids"] for r in got] == want
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": QUESTIONS[1]}], max_tokens=N,
            temperature=0, response_format=fmt, stream=True) if ch.choices)
        assert streamed == got[1].choices[0].message.content
        llama_form = c.chat.completions.create(   # llama.cpp's server's form: the schema in response_format.schema
            model="smollm2-135m", messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=N, temperature=0,
            response_format={"type": "json_object", "schema": SCHEMA})
        assert llama_form.model_extra["hsd"]["token_ids"] == want[0]      # (was any JSON object: the schema ignored)

        free = c.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": QUESTIONS[0]}],
                                         max_tokens=N, temperature=0)
        assert free.model_extra["hsd"]["token_ids"] != want[0]   # the schema changed the answer

        for body, field in [({"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}},
                             "response_format.json_schema.schema"),
                            ({"type": "json_schema", "json_schema": {"name": "x"}},
                             "response_format.json_schema.schema"),
                            ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#"}}},   # no output
                             "response_format.json_schema.schema"),
                            ({"type": "json_object", "schema": {"type": "strin"}}, "response_format.schema"),
                            ({"type": "yaml"}, "response_format.type"), ("json", "response_format")]:
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
                "model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "response_format": body})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == field and err["type"] == "invalid_request_error", err


def test_a_schema_past_the_grammar_engines_limits_is_a_400_naming_it_streamed_or_not(embedded):
    """500 optional properties compile but reach llguidance's parser row limit at the first token: the answer is a
    400 naming ``response_format.json_schema.schema`` in one line (code ``grammar_limit``), streamed as the
    stream's error event; it was a 500 "generation failed" with the engine's 14 KB state dump and a traceback in
    the log. The server goes on serving."""
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)}}
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Write JSON."}], "max_tokens": 8,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": wide}}}
    app, jobs = prepare_server(SOLVED_PLAN, device="cpu")
    with BackgroundServer(app, on_stop=jobs.cancel_all) as srv:
        url = srv.url + "/v1/chat/completions"
        r = httpx.post(url, json=body, timeout=120)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "response_format.json_schema.schema" and err["code"] == "grammar_limit", err
        assert "cannot follow it" in err["message"] and "<state>" not in err["message"] and len(err["message"]) < 600
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == "grammar_limit", events[-1]
        r = httpx.post(url, json={**body, "response_format": {"type": "json_object"}}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def test_a_plan_with_a_plan_for_json_serves_response_format_requests_with_it(embedded, tmp_path):
    """hsd serve runs a request under a grammar with the plan's plan for task json (by_task) and every other
    request with the plan's own hierarchy; the answers stay the masked target's and the target's."""
    plan = json.loads(SOLVED_PLAN.read_text())
    plan["by_task"] = {"json": {"hierarchy": ["lookup", "layer30"], "budgets": [3], "expected_latency": 0.01}}
    path = tmp_path / "plan_json.json"
    path.write_text(json.dumps(plan))
    tok = embedded.tokenizer
    ar, grammar = _masked_target(embedded)
    want = ar.generate(_ids(tok, QUESTIONS[2]), N, constraint=Constraint(grammar)).token_ids
    app, jobs = prepare_server(path, device="cpu")
    fmt = {"type": "json_schema", "json_schema": {"name": "language", "schema": SCHEMA}}
    with BackgroundServer(app, on_stop=jobs.cancel_all) as srv:
        c = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
        msg = [{"role": "user", "content": QUESTIONS[2]}]
        under = c.chat.completions.create(model="smollm2-135m", messages=msg, max_tokens=N, temperature=0,
                                          response_format=fmt).model_extra["hsd"]
        free = c.chat.completions.create(model="smollm2-135m", messages=msg, max_tokens=N,
                                         temperature=0).model_extra["hsd"]
        about = httpx.get(srv.url + "/health", timeout=30).json()
    assert under["hierarchy"] == ["lookup", "layer30"] and under["token_ids"] == want
    assert free["hierarchy"] == ["lookup", "int4", "layer30"]
    assert about["json_hierarchy"] == ["lookup", "layer30"]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 20},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 12}}, "required": ["timezone"],
    "additionalProperties": False}}}


def test_a_function_call_is_the_masked_targets_answer_under_its_parameters(embedded):
    """tool_choice naming a function: the answer is a call of it whose arguments follow its parameters, the
    masked target's greedy answer token for token (the prompt told to call it), streamed as the same call;
    "required": a call of one of the functions, whole, streamed or not; earlier calls and their results in the
    conversation are read."""
    from hsd_opt.server.tools import ToolCall, instruction, parse_tools, with_instruction

    tok = embedded.tokenizer
    msgs = [{"role": "user", "content": "What is the weather in Paris? Use celsius."}]
    ar, _ = _masked_target(embedded)
    grammars = GrammarCompiler(tok, eos_token_ids(embedded), ar.target.vocab_size)
    tools = parse_tools({"tools": [WEATHER]})
    told = with_instruction(msgs, instruction(ToolCall("get_weather"), tools))
    grammar = grammars.compile(GrammarSpec.json_schema(WEATHER["function"]["parameters"]))
    want = ar.generate(chat_ids(tok, told), N, constraint=Constraint(grammar)).token_ids
    assert want[-1] in eos_token_ids(embedded)                   # the call ends within N tokens
    app, jobs = prepare_server(SOLVED_PLAN, device="cpu")
    named = {"type": "function", "function": {"name": "get_weather"}}
    with BackgroundServer(app, on_stop=jobs.cancel_all) as srv:
        c = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
        r = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=N, temperature=0,
                                      tools=[WEATHER], tool_choice=named)
        assert r.model_extra["hsd"]["token_ids"] == want
        choice = r.choices[0]
        call = choice.message.tool_calls[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
        args = json.loads(call.function.arguments)
        assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
        chunks = [ch for ch in c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=N,
                                                         temperature=0, tools=[WEATHER], tool_choice=named,
                                                         stream=True) if ch.choices]
        deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
        assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
        assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        listed = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=N, temperature=0,
                                           tools=[WEATHER], tool_choice=named,
                                           extra_body={"stop_token_ids": [want[-1]]})   # ended by the EOS listed
        assert listed.model_extra["hsd"]["token_ids"] == want and listed.choices[0].finish_reason == "tool_calls"

        either = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=N, temperature=0,
                                           tools=[WEATHER, CLOCK], tool_choice="required")
        call2 = either.choices[0].message.tool_calls[0]
        params = {"get_weather": WEATHER, "get_time": CLOCK}[call2.function.name]["function"]["parameters"]
        assert set(json.loads(call2.function.arguments)) == set(params["required"])
        streamed = [d for ch in c.chat.completions.create(
            model="smollm2-135m", messages=msgs, max_tokens=N, temperature=0, tools=[WEATHER, CLOCK],
            tool_choice="required", stream=True) if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
        assert [(d.function.name, d.function.arguments) for d in streamed] == [(call2.function.name,
                                                                               call2.function.arguments)]

        history = msgs + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "get_weather",
                                                             "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "{\"temperature\": 18}"},
            {"role": "user", "content": "And in Rome?"}]
        again = c.chat.completions.create(model="smollm2-135m", messages=history, max_tokens=N, temperature=0,
                                          tools=[WEATHER], tool_choice=named)
        assert again.choices[0].message.tool_calls[0].function.name == "get_weather"
        cut = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=N, temperature=0,
                                        tools=[WEATHER], tool_choice=named, stop=[", "])
        assert cut.choices[0].finish_reason == "stop"           # arguments cut by the stop string: not a call
        assert cut.choices[0].message.tool_calls[0].function.arguments == call.function.arguments.split(", ")[0]
        streamed_cut = [ch for ch in c.chat.completions.create(
            model="smollm2-135m", messages=msgs, max_tokens=N, temperature=0, tools=[WEATHER], tool_choice=named,
            stop=[", "], stream=True) if ch.choices]
        assert streamed_cut[-1].choices[0].finish_reason == "stop"
        bad_parameters = (({"type": "strin"}, "required", "must describe an object"),
                          ({"type": "string"}, named, "must describe an object"),
                          ({"type": "object", "properties": {"a": {"type": "strin"}}}, named, "strin"))
        for parameters, choice, why in bad_parameters:         # every function's parameters, named by index
            bad = {"type": "function", "function": {"name": "bad", "parameters": parameters}}
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
                "model": "smollm2-135m", "messages": msgs, "tools": [WEATHER, bad], "tool_choice": choice})
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == "tools[1].function.parameters", r.text
            assert error["message"].startswith("'tools[1].function.parameters'") or \
                error["message"].startswith("tools[1].function.parameters:"), error["message"]
            assert why in error["message"]
        # under "none" the answer is text, but parameters that do not compile are refused all the same, and by
        # /tokenize (which answered ids for a body the chat route refuses)
        bad = {"type": "function", "function": {"name": "bad", "parameters": bad_parameters[2][0]}}
        for path, extra in (("/v1/chat/completions", {"tool_choice": "none"}), ("/tokenize", {})):
            r = httpx.post(srv.url + path, timeout=60, json={"model": "smollm2-135m", "messages": msgs,
                                                              "tools": [WEATHER, bad], **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tools[1].function.parameters", r.text


def test_auto_answers_a_call_or_text_the_masked_targets_answer_either_way(embedded):
    """tool_choice "auto" (the default with tools): the grammar allows a whole call or text that does not open a
    JSON object, nothing else; the served answer is the masked target's greedy answer under it, a call where it is
    one (finish_reason tool_calls) and a message otherwise, streamed the same."""
    from hsd_opt.server.tools import ToolCall, auto_grammar, instruction, parse_tools, with_instruction

    tok, eos = embedded.tokenizer, eos_token_ids(embedded)
    ar, _ = _masked_target(embedded)
    tools = parse_tools({"tools": [WEATHER, CLOCK]})
    grammar = GrammarCompiler(tok, eos, ar.target.vocab_size).compile(
        GrammarSpec("lark", auto_grammar(ToolCall(None, True), tools)))
    for text, whole in [('{"name": "get_time", "arguments": {"timezone": "UTC"}}', True),
                        ("It is sunny in Paris.", True), ('{"name": "get_date", "arguments": {}}', False),
                        ('{"city": "Paris"}', False)]:
        ids = tok.encode(text, add_special_tokens=False) + [eos[0]]
        assert (Constraint(grammar).allowed_prefix(ids, 0, ids) == len(ids)) == whole, text
    app, jobs = prepare_server(SOLVED_PLAN, device="cpu")
    with BackgroundServer(app, on_stop=jobs.cancel_all) as srv:
        c = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
        for q in ("What is the weather in Paris? Use celsius.", "Say hello."):
            msgs = [{"role": "user", "content": q}]
            told = with_instruction(msgs, instruction(ToolCall(None, True), tools))
            want = ar.generate(chat_ids(tok, told), N, constraint=Constraint(grammar)).token_ids
            r = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=N, temperature=0,
                                          tools=[WEATHER, CLOCK])
            assert r.model_extra["hsd"]["token_ids"] == want
            text = tok.decode(want, skip_special_tokens=True)
            m = r.choices[0].message
            streamed = [ch.choices[0].delta for ch in c.chat.completions.create(
                model="smollm2-135m", messages=msgs, max_tokens=N, temperature=0, tools=[WEATHER, CLOCK],
                stream=True) if ch.choices]
            if text.lstrip().startswith("{") and r.choices[0].finish_reason == "tool_calls":
                call = json.loads(text)
                assert m.content is None and m.tool_calls[0].function.name == call["name"]
                assert json.loads(m.tool_calls[0].function.arguments) == call["arguments"]
                assert [d.tool_calls[0].function.name for d in streamed if d.tool_calls] == [call["name"]]
            else:
                assert m.tool_calls is None and m.content == text
                assert "".join(d.content or "" for d in streamed) == text
