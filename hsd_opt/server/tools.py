"""Function calling on ``POST /v1/chat/completions``: a request's ``tools`` and ``tool_choice`` as a grammar for
the answer, an instruction for the prompt, and the answer as ``tool_calls``.

A request that gives ``tools`` gets its answer under a grammar (:mod:`hsd_opt.grammar`), so a call's arguments
always parse and follow the function's ``parameters`` schema:

- ``tool_choice`` ``{"type": "function", "function": {"name": N}}``: the answer is the JSON object of ``N``'s
  arguments (the grammar of its ``parameters``);
- ``tool_choice`` ``"required"``: the answer is ``{"name": ..., "arguments": {...}}`` for one of the ``tools``
  (one branch per function, each with its ``parameters``);
- ``tool_choice`` ``"auto"`` (the default when ``tools`` are given): the model chooses, in the grammar's own
  format: such a call, or text that does not open with ``{`` (:func:`auto_grammar`);
- ``tool_choice`` ``"none"``: the tools are left out, the answer is text (or ``response_format``'s).

The prompt gets the instruction (a system message, or the end of the first one) with each function's name,
description and parameters, in the same format for every model (chat templates' own tool formats differ). The
response has ``message.tool_calls`` (one call, id ``call_<hex>``, ``content`` null) and ``finish_reason``
``"tool_calls"`` where the answer is a whole call (it ended at the end of sequence); an answer cut by ``max_tokens``
or a stop string keeps ``finish_reason`` ``"length"`` or ``"stop"`` with what was generated. Earlier turns may
carry ``tool_calls`` (an assistant turn, given to the model as the JSON of its calls) and ``tool`` results (their
``content``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from hsd_opt.grammar.compiler import JSON_LAYOUT, GrammarSpec
from hsd_opt.server.errors import bad_request

#: A function name as the OpenAI API allows it.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: ``parameters`` of a function that gives none: an object of any properties.
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolCall:
    """How a request's answer becomes a function call: ``name`` the function ``tool_choice`` named (the answer is
    its arguments), or None for ``"required"`` and ``"auto"`` (the answer is ``{"name", "arguments"}``; with
    ``auto``, or text)."""

    name: str | None
    auto: bool = False


@dataclass(frozen=True)
class Function:
    """One function of a request's ``tools``: its name, description (may be empty) and ``parameters`` schema."""

    name: str
    description: str
    parameters: dict[str, Any]


def parse_tools(body: dict) -> list[Function]:
    """The request's ``tools`` (empty when absent); a 400 naming the field for a malformed one."""
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request(f"'tools' must be an array of functions, got {type(tools).__name__}", "tools")
    out: list[Function] = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise bad_request(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}", where)
        f = t["function"]
        name, desc, params = f.get("name"), f.get("description", ""), f.get("parameters", ANY_OBJECT)
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(f"'{where}.function.name' must be 1 to 64 letters, digits, '_' or '-', got "
                              f"{json.dumps(name)}", f"{where}.function.name")
        if any(x.name == name for x in out):
            raise bad_request(f"'{where}.function.name': {name!r} is given twice", f"{where}.function.name")
        if not isinstance(desc, str):
            raise bad_request(f"'{where}.function.description' must be a string", f"{where}.function.description")
        out.append(Function(name, desc, _object_schema(params, f"{where}.function.parameters")))
    return out


def _object_schema(params: Any, where: str) -> dict[str, Any]:
    """A function's ``parameters``: a JSON schema of an object (its arguments are a JSON object, as the OpenAI API
    has them). A schema that gives no ``type`` gets ``"type": "object"`` beside its own keywords (a schema's
    keywords all hold, so this asks only that the arguments be an object); one whose ``type`` does not allow an
    object is a 400 naming ``where``."""
    if not isinstance(params, dict):
        raise bad_request(f"'{where}' must be a JSON schema object", where)
    kind = params.get("type")
    if kind is None or kind == "object" or (isinstance(kind, list) and "object" in kind):
        return {**params, "type": "object"}
    raise bad_request(f"'{where}' must describe an object (a function's arguments are a JSON object), got "
                      f"\"type\": {json.dumps(kind)}", where)


def parse_tool_choice(body: dict, tools: list[Function]) -> ToolCall | None:
    """The call ``tool_choice`` asks for (None: none, the answer is text; ``"auto"`` where the request gives tools
    and no choice); a 400 naming ``tool_choice`` for a choice without tools or a function not among them."""
    choice = body.get("tool_choice")
    if choice is None and not tools:
        return None
    if choice == "none":
        return None
    if not tools:
        raise bad_request("'tool_choice' asks for a function call but the request gives no 'tools'", "tool_choice")
    if choice is None or choice == "auto":
        return ToolCall(None, auto=True)
    if choice == "required":
        return ToolCall(None)
    if (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str)):
        name = choice["function"]["name"]
        if not any(f.name == name for f in tools):
            raise bad_request(f"'tool_choice' names the function {name!r}, which is not among 'tools' "
                              f"({', '.join(f.name for f in tools)})", "tool_choice")
        return ToolCall(name)
    raise bad_request("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                      f"\"function\": {{\"name\": ...}}}}, got {json.dumps(choice)}", "tool_choice")


def call_schema(call: ToolCall, tools: list[Function]) -> dict[str, Any]:
    """The JSON schema the answer follows: the named function's ``parameters``, or one branch per function of
    ``{"name": <its name>, "arguments": <its parameters>}``, each function's parameters a schema resource of their
    own (:func:`own_resource`)."""
    if call.name is not None:
        return next(f.parameters for f in tools if f.name == call.name)
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": f.name},
                                                        "arguments": own_resource(f.parameters, i)},
                       "required": ["name", "arguments"], "additionalProperties": False}
                      for i, f in enumerate(tools)]}


def own_resource(schema: Any, i: int) -> Any:
    """The ``i``-th function's ``parameters`` with an ``$id`` (``urn:hsd:tools:<i>``) unless it has one: placed
    in the document of every function's call, its references (``"#"``, ``"#/$defs/x"``, anchors ``"#name"``)
    still resolve within it, and two functions' anchors of one name stay apart."""
    if not isinstance(schema, dict) or "$id" in schema:
        return schema
    return {"$id": f"urn:hsd:tools:{i}", **schema}


def auto_grammar(call: ToolCall, tools: list[Function]) -> str:
    """The Lark grammar of an ``"auto"`` answer: a call (:func:`call_schema`, in the layout of every other JSON
    answer: Lark's ``%json`` takes its options from the schema's ``x-guidance``, else flexible white space) or text
    whose first character past white space is not ``{``. The schema as :meth:`GrammarSpec.json_schema` writes it
    for every other answer (what constrains nothing left out, counts as integers): the same parameters compile
    under ``"auto"`` as under ``"required"``. :class:`~hsd_opt.errors.HsdError` where it is no schema."""
    written = json.loads(GrammarSpec.json_schema(call_schema(call, tools), "tools").text)
    schema = {**written, "x-guidance": JSON_LAYOUT}
    return f"start: call | TEXT\ncall: %json {json.dumps(schema)}\nTEXT: /\\s*[^{{\\s][\\s\\S]*/\n"


def instruction(call: ToolCall, tools: list[Function]) -> str:
    """What the prompt tells the model: which function(s) to call and how to write the call."""
    described = [{"name": f.name, **({"description": f.description} if f.description else {}),
                  "parameters": f.parameters} for f in tools if call.name in (None, f.name)]
    if call.name is not None:
        return (f"Answer by calling the function {call.name}: write only the JSON object of its arguments. "
                f"The function: {json.dumps(described[0])}")
    if call.auto:
        return ("You may call one of these functions: to call one, write only a JSON object {\"name\": <the "
                "function>, \"arguments\": <its arguments>}; otherwise answer in text. The functions: "
                f"{json.dumps(described)}")
    return ("Answer by calling one of these functions: write only a JSON object {\"name\": <the function>, "
            f"\"arguments\": <its arguments>}}. The functions: {json.dumps(described)}")


def with_instruction(messages: list[dict[str, str]], text: str) -> list[dict[str, str]]:
    """``messages`` with ``text`` at the end of the first system (or developer) message, or as a system message
    before the others."""
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0], content=(messages[0]["content"] + "\n\n" + text).strip())
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def past_calls(m: dict, i: int) -> str | None:
    """An earlier assistant turn's ``tool_calls`` as the text the model sees (the JSON of its calls, each
    ``{"name", "arguments"}``), None when it has none; a 400 naming the field when they are malformed."""
    calls = m.get("tool_calls")
    if calls is None:
        return None
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list) or not calls:
        raise bad_request(f"'{where}' must be a non-empty array of calls", where)
    out = []
    for k, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments"), str):
            raise bad_request(f"'{where}[{k}]' must be {{\"function\": {{\"name\": str, \"arguments\": str}}}}",
                              f"{where}[{k}]")
        try:
            args = json.loads(f["arguments"])
        except (ValueError, RecursionError):
            raise bad_request(f"'{where}[{k}].function.arguments' is not JSON", f"{where}[{k}].function.arguments")
        out.append({"name": f["name"], "arguments": args})
    return json.dumps(out[0] if len(out) == 1 else out)


def new_call_id() -> str:
    """A fresh id of a function call: ``call_<hex>``."""
    return "call_" + uuid.uuid4().hex[:24]


#: The opening of a call of one of several functions as the grammar lays it out (``{"name": "<fn>", "arguments":
#: ...``): its name, then what comes before the arguments, which a cut answer holds in part.
_NAMED = re.compile(r'\s*\{"name": "((?:[^"\\]|\\.)*)"', re.DOTALL)
_BEFORE_ARGUMENTS = ', "arguments": '


def _cut_call(text: str) -> tuple[str, str] | None:
    """``(name, arguments so far)`` of a call cut after its name (the arguments empty where the cut came before
    them), None before the name is whole."""
    named = _NAMED.match(text)
    if named is None:
        return None
    rest = text[named.end():]
    if rest.startswith(_BEFORE_ARGUMENTS):
        arguments = rest[len(_BEFORE_ARGUMENTS):]
    elif _BEFORE_ARGUMENTS.startswith(rest):
        arguments = ""
    else:
        return None
    try:
        return json.loads(f'"{named.group(1)}"'), arguments
    except ValueError:
        return None


def as_call(call: ToolCall, text: str) -> tuple[str, str] | None:
    """``(name, arguments)`` of the answer ``text``, or None where it is not a call (text under ``"auto"``, or cut
    by ``max_tokens`` or a stop string before its name is complete). A call cut after its name has the arguments
    written so far (not whole JSON: its ``finish_reason`` says so)."""
    if call.name is not None:
        return call.name, text
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return _cut_call(text)
    return (obj["name"], _arguments_text(text, obj)) if isinstance(obj, dict) and "name" in obj else None


def _arguments_text(text: str, obj: dict) -> str:
    """The arguments of the whole call ``text`` (read as ``obj``) as the model wrote them: parsed and written again
    they changed (``1e400`` became ``Infinity``, not JSON; digits past a double's were lost; repeated keys
    merged), and a call of a named function returns its text as written."""
    cut = _cut_call(text)                  # (name, the text from the arguments on)
    if cut is not None and cut[1]:
        try:
            return cut[1][:json.JSONDecoder().raw_decode(cut[1])[1]]
        except (ValueError, RecursionError):
            pass
    return json.dumps(obj.get("arguments"))
