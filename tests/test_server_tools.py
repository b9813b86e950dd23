"""Function calls without a model: the schema a call's answer follows (the named function's parameters, or one
branch per function with its name fixed; under "auto" that or text), the prompt's instruction (added to a system
message, or one before the others), earlier calls as the text the model sees, and an answer read back as a call (a
call cut before its name is whole, or text, is none)."""

from __future__ import annotations

import json

import pytest

from hsd_opt.server.errors import ApiError
from hsd_opt.server.jobs import Outcome
from hsd_opt.server.responses import AnswerStream, chat_message
from hsd_opt.server.tools import (
    ANY_OBJECT,
    ToolCall,
    as_call,
    auto_grammar,
    call_schema,
    instruction,
    parse_tool_choice,
    parse_tools,
    past_calls,
    with_instruction,
)

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Now.", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "clock"}}]


def test_the_answer_follows_the_named_functions_parameters_or_one_branch_per_function():
    tools = parse_tools({"tools": TOOLS})
    assert [f.name for f in tools] == ["weather", "clock"] and tools[1].parameters == ANY_OBJECT
    assert call_schema(ToolCall("weather"), tools) == PARAMS
    branches = call_schema(ToolCall(None), tools)["anyOf"]
    assert [b["properties"]["name"] for b in branches] == [{"const": "weather"}, {"const": "clock"}]
    assert [b["properties"]["arguments"] for b in branches] == [{"$id": f"urn:hsd:tools:{i}", **p}
                                                                for i, p in enumerate((PARAMS, ANY_OBJECT))]
    assert all(b["required"] == ["name", "arguments"] and b["additionalProperties"] is False for b in branches)


def test_tool_choice_none_leaves_the_tools_out_auto_is_the_default_and_errors_name_the_field():
    tools = parse_tools({"tools": TOOLS})
    assert parse_tool_choice({"tool_choice": "none"}, tools) is None
    assert parse_tool_choice({}, []) is None
    assert parse_tool_choice({}, tools) == parse_tool_choice({"tool_choice": "auto"}, tools) == ToolCall(None, True)
    assert parse_tool_choice({"tool_choice": "required"}, tools) == ToolCall(None)
    assert parse_tool_choice({"tool_choice": {"type": "function", "function": {"name": "clock"}}}, tools) == \
        ToolCall("clock")
    for body, tools_given in (({"tool_choice": {"type": "function", "function": {"name": "x"}}}, tools),
                              ({"tool_choice": "auto"}, []), ({"tool_choice": "maybe"}, tools)):
        with pytest.raises(ApiError) as e:
            parse_tool_choice(body, tools_given)
        assert e.value.status == 400 and e.value.param == "tool_choice"


def test_the_instruction_names_the_functions_to_call_and_joins_the_first_system_message():
    tools = parse_tools({"tools": TOOLS})
    one = instruction(ToolCall("weather"), tools)
    assert "weather" in one and "clock" not in one and json.dumps(PARAMS) in one
    both = instruction(ToolCall(None), tools)
    assert "weather" in both and "clock" in both
    assert "otherwise answer in text" in instruction(ToolCall(None, True), tools) and "otherwise" not in both
    user = [{"role": "user", "content": "hi"}]
    assert with_instruction(user, "T") == [{"role": "system", "content": "T"}, *user]
    sys_first = [{"role": "system", "content": "Be brief."}, *user]
    assert with_instruction(sys_first, "T") == [{"role": "system", "content": "Be brief.\n\nT"}, *user]
    assert sys_first[0]["content"] == "Be brief."                      # the request's messages are not changed


def test_earlier_calls_are_their_json_and_an_answer_is_read_back_as_a_call():
    m = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]}
    assert json.loads(past_calls(m, 1)) == {"name": "weather", "arguments": {"city": "Oslo"}}
    assert past_calls({"role": "assistant", "content": "text"}, 0) is None
    with pytest.raises(ApiError) as e:
        past_calls({"tool_calls": [{"function": {"name": "weather", "arguments": "{"}}]}, 3)
    assert e.value.param == "messages[3].tool_calls[0].function.arguments"
    assert as_call(ToolCall("weather"), "{\"city\": \"Oslo\"}") == ("weather", "{\"city\": \"Oslo\"}")
    assert as_call(ToolCall(None), "{\"name\": \"clock\", \"arguments\": {}}") == ("clock", "{}")
    assert as_call(ToolCall(None), "{\"name\": \"clo") is None           # cut by max_tokens before its name ended
    # cut after the name: a call with the arguments written so far (it came back as the call's JSON as text)
    assert as_call(ToolCall(None), "{\"name\": \"clock\", \"argum") == ("clock", "")
    assert as_call(ToolCall(None, True), "{\"name\": \"weather\", \"arguments\": {\"city\": \"Os") == \
        ("weather", "{\"city\": \"Os")
    assert as_call(ToolCall(None), "{\"name\": \"clock\"}, x") is None
    assert as_call(ToolCall(None, True), "It is sunny.") is None           # "auto": text
    # the arguments as written, not parsed and written again (1e400 came back as Infinity, not JSON; digits past a
    # double's were lost; "Zürich" escaped): what a call of a named function returns too
    for args in ('{"x": 1e400}', '{"x": 0.1000000000000000000001, "y": 1e3}', '{"city": "Zürich"}', '{"a": 1, "a": 2}'):
        assert as_call(ToolCall(None), f'{{"name": "f", "arguments": {args}}}') == ("f", args)
    deep = "[" * 100_000 + "]" * 100_000                                    # JSON that Python cannot read
    with pytest.raises(ApiError) as e:
        past_calls({"tool_calls": [{"function": {"name": "weather", "arguments": deep}}]}, 1)
    assert e.value.status == 400 and e.value.param == "messages[1].tool_calls[0].function.arguments"
    assert as_call(ToolCall(None), deep) is None


def test_a_functions_parameters_describe_an_object():
    """Arguments are a JSON object: a schema without ``type`` gets ``"type": "object"`` beside its keywords, one
    whose ``type`` allows an object keeps only that, any other is a 400 naming the function's parameters."""
    def params(p):
        return parse_tools({"tools": [TOOLS[1], {"type": "function", "function": {"name": "f", "parameters": p}}]})

    assert params({"properties": {"a": {"type": "string"}}})[1].parameters == {
        "properties": {"a": {"type": "string"}}, "type": "object"}
    assert params({"type": ["object", "null"]})[1].parameters == {"type": "object"}
    for bad in ({"type": "string"}, {"type": ["array", "null"]}, [], "object"):
        with pytest.raises(ApiError) as e:
            params(bad)
        assert e.value.status == 400 and e.value.param == "tools[1].function.parameters", bad


def test_a_call_is_whole_only_where_the_answer_ended_at_the_end_of_sequence():
    """``finish_reason`` ``"tool_calls"`` for a call that ended; one cut by ``max_tokens`` or a stop string keeps
    ``"length"`` or ``"stop"`` (its arguments are not whole JSON), streamed or not."""
    def outcome(text, finish, eos):
        return Outcome([1], text, finish, 3, {}, 0.0, 0.0, None, eos)

    whole, cut = "{\"city\": \"Oslo\"}", "{\"city\": \"Oslo\""
    for o, want in ((outcome(whole, "stop", True), "tool_calls"), (outcome(cut, "stop", False), "stop"),
                    (outcome(cut, "length", False), "length")):
        message, finish = chat_message(o, ToolCall("weather"))
        assert finish == want and message["tool_calls"][0]["function"]["arguments"] == o.text
        stream = AnswerStream(ToolCall("weather"))
        stream.opening(), stream.piece(o.text)
        assert stream.end(o)[1] == want


def test_an_auto_answer_is_a_call_or_text_that_does_not_open_a_json_object():
    """``"auto"``'s grammar: a call's JSON as in ``"required"``, or text whose first character past white space is
    not ``{`` (read back as a message: :func:`as_call` None)."""
    from hsd_opt.grammar.compiler import JSON_LAYOUT, GrammarCompiler, GrammarSpec
    from hsd_opt.grammar.constraint import Constraint
    from tests.helpers import JSON_TOKENS, TinyTokenizer

    tools = parse_tools({"tools": TOOLS})
    lark = auto_grammar(ToolCall(None, True), tools)
    schema = {**call_schema(ToolCall(None), tools), "x-guidance": JSON_LAYOUT}
    assert lark.startswith("start: call | TEXT\n") and json.dumps(schema) in lark
    assert "TEXT: /\\s*[^{\\s][\\s\\S]*/" in lark
    tok = TinyTokenizer(JSON_TOKENS)
    one = parse_tools({"tools": [{"type": "function", "function": {"name": "g"}}]})
    constraint = Constraint(GrammarCompiler(tok, 2, 64).compile(GrammarSpec("lark", auto_grammar(ToolCall(None, True),
                                                                                                  one))))

    def allowed(text: str) -> bool:
        seq = tok.encode(text) + [2]
        return constraint.allowed_prefix([], 0, seq) == len(seq)

    # the call in the one layout of "required" and every JSON answer (Lark's %json took flexible white space: a
    # call could run on spaces to max_tokens, and one cut short was not read back as a call)
    assert allowed('{"name": "g", "arguments": {}}') and allowed("hi")
    assert not allowed('{"name":"g",  "arguments":{}}') and not allowed('{"name": "g",  "arguments": {}}')


def test_parameters_compile_under_auto_as_under_required():
    """A function's parameters are written as every schema is (``"uniqueItems": false`` left out, a count ``1.0``
    as ``1``) in ``"auto"``'s grammar too: the default ``tool_choice`` refused what ``"required"`` took (a 400)."""
    from hsd_opt.grammar.compiler import GrammarCompiler, GrammarSpec
    from hsd_opt.grammar.constraint import Constraint
    from tests.helpers import JSON_TOKENS, TinyTokenizer

    params = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"},
                                                      "uniqueItems": False, "minItems": 1.0}},
              "required": ["xs"], "additionalProperties": False}
    tools = parse_tools({"tools": [{"type": "function", "function": {"name": "g", "parameters": params}}]})
    tok = TinyTokenizer(JSON_TOKENS)
    compiler = GrammarCompiler(tok, 2, 64)
    compiler.compile(GrammarSpec.json_schema(call_schema(ToolCall(None), tools)))          # "required"
    constraint = Constraint(compiler.compile(GrammarSpec("lark", auto_grammar(ToolCall(None, True), tools))))

    def allowed(text: str) -> bool:
        seq = tok.encode(text) + [2]
        return constraint.allowed_prefix([], 0, seq) == len(seq)

    assert allowed('{"name": "g", "arguments": {"xs": [1]}}') and allowed("hi")
    assert not allowed('{"name": "g", "arguments": {"xs": []}}')           # minItems still holds


def test_a_functions_references_into_its_own_parameters_point_there_in_the_answers_schema():
    """``$ref`` s into a function's own ``parameters`` (its ``$defs``, ``"#"`` itself, an ``$anchor``; with or
    without an ``$id`` of its own) reach its own schemas once the parameters sit under a branch of the answer's
    schema: a call that follows them is allowed to its end, one that follows the wrapper (a name and arguments where
    the function recurses) or another function's anchor of the same name is not. (Rewriting the pointers left
    anchors shared between functions, and missed the pointers of a function with an ``$id``: a 400.)"""
    from hsd_opt.grammar.compiler import GrammarCompiler, GrammarSpec
    from hsd_opt.grammar.constraint import Constraint
    from tests.helpers import JSON_TOKENS, TinyTokenizer

    params = {"type": "object", "$defs": {"u": {"enum": ["c", "f"]}, "enum": {"const": {"$ref": "#"}}},
              "properties": {"u": {"$ref": "#/$defs/u"}, "k": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
              "required": ["u", "k"], "additionalProperties": False}

    def anchored(kind: str, **more) -> dict:
        return {"type": "object", "$defs": {"x": {"$anchor": "v", "type": kind}}, "properties": {"a": {"$ref": "#v"}},
                "required": ["a"], "additionalProperties": False, **more}

    with_id = {"$id": "https://example.com/p.json", "$defs": {"n": {"enum": [5, 6]}}, "type": "object",
               "properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["a"], "additionalProperties": False}
    tools = parse_tools({"tools": [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in (
        ("g", ANY_OBJECT), ("f", params), ("i", anchored("integer")), ("b", anchored("boolean")), ("d", with_id))]})
    schema = call_schema(ToolCall(None), tools)
    assert schema["anyOf"][4]["properties"]["arguments"] == with_id                # its own $id kept
    tok = TinyTokenizer(JSON_TOKENS)
    constraint = Constraint(GrammarCompiler(tok, 2, 64).compile(GrammarSpec.json_schema(schema, "tools")))

    def allowed(call: dict) -> bool:
        seq = tok.encode(json.dumps(call))
        return constraint.allowed_prefix([], 0, seq) == len(seq) and constraint.accepting(seq)

    assert allowed({"name": "f", "arguments": {"u": "c", "k": {"u": "f", "k": None}}})
    assert not allowed({"name": "f", "arguments": {"u": "c", "k": {"name": "f", "arguments": {}}}})
    assert not allowed({"name": "f", "arguments": {"u": "ab", "k": None}})
    assert allowed({"name": "g", "arguments": {}})
    assert allowed({"name": "i", "arguments": {"a": 10}}) and not allowed({"name": "i", "arguments": {"a": True}})
    assert allowed({"name": "b", "arguments": {"a": True}}) and not allowed({"name": "b", "arguments": {"a": 10}})
    assert allowed({"name": "d", "arguments": {"a": 5}}) and not allowed({"name": "d", "arguments": {"a": 7}})
