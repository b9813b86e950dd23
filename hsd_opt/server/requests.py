"""Validating the bodies of ``POST /v1/chat/completions`` and ``POST /v1/completions`` into a
:class:`GenerationRequest`; every refusal is an :class:`~hsd_opt.server.errors.ApiError` (400) naming the field.

Honoured fields: ``model``, ``messages`` (chat) or ``prompt`` (completions), ``max_tokens`` (chat also
``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``, ``stop``, ``stop_token_ids`` (vLLM's), ``stream``,
``stream_options.include_usage``, ``n`` (1 .. :data:`MAX_CHOICES` choices: :func:`choice_requests`),
``response_format`` (``text``, ``json_object``, ``json_schema``: the output follows the grammar,
:mod:`hsd_opt.grammar`; one that does not compile is a 400 naming the problem) and log-probabilities (chat:
``logprobs`` true and ``top_logprobs`` 0 .. 20; completions: ``logprobs`` 0 .. 20 alternatives),
``frequency_penalty``, ``presence_penalty`` (-2 .. 2) and ``logit_bias`` (token id -> -100 .. 100:
:mod:`hsd_opt.runtime.penalties`), ``top_k``, ``min_p`` and the repetition penalty (``repetition_penalty``, or
``repeat_penalty`` with ``repeat_last_n``: llama.cpp's and vLLM's sampling extensions, not the OpenAI API's); chat
also ``tools`` and ``tool_choice`` (a function called under the grammar of its parameters:
:mod:`hsd_opt.server.tools`). Fields of the OpenAI API that would change the answer and are not supported
(:data:`UNSUPPORTED`: echo, best-of, suffix), and llama.cpp's and vLLM's sampling extensions beyond these
(typical-p, mirostat, bad words, ...), are a 400 when given a value other than their default; other fields
(``user``, ``metadata``, ...) are ignored."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

from hsd_opt.errors import HsdError
from hsd_opt.grammar.compiler import Grammar, GrammarCompiler, GrammarSpec
from hsd_opt.jsonio import json_problem
from hsd_opt.prompts import chat_ids, encode_prompt
from hsd_opt.runtime.arguments import MAX_TOP_LOGPROBS, bias_from_json
from hsd_opt.runtime.penalties import Penalties, penalties_or_none
from hsd_opt.seeds import seed_fits
from hsd_opt.server.errors import ApiError, bad_request
from hsd_opt.server.tools import (
    Function,
    ToolCall,
    auto_grammar,
    call_schema,
    instruction,
    parse_tool_choice,
    parse_tools,
    past_calls,
    with_instruction,
)
from hsd_opt.values import is_integer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: The OpenAI API's default ``max_tokens`` of ``/v1/completions``.
COMPLETION_DEFAULT_MAX_TOKENS = 16
#: The OpenAI API's default temperature (it samples unless told ``"temperature": 0``).
DEFAULT_TEMPERATURE = 1.0
#: At most this many stop strings (as the OpenAI API).
MAX_STOP = 4
#: The most choices (``n``) one request may ask for.
MAX_CHOICES = 16
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ModelInfo:
    """What validation needs to know about the served model.

    Attributes:
        name: the model id clients send and ``GET /v1/models`` lists.
        tokenizer: its tokenizer (chat template, plain encoding).
        max_positions: the model's context in tokens: prompt + ``max_tokens`` may not exceed it.
        default_max_tokens: ``max_tokens`` of a chat request that gives none (capped by the room left).
        grammars: compiles a request's ``response_format`` for the model (None: structured output refused).
    """

    name: str
    tokenizer: "PreTrainedTokenizerBase"
    max_positions: int
    default_max_tokens: int = 256
    grammars: GrammarCompiler | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request. ``prompt_ids``: token ids (chat template applied for ``kind == "chat"``);
    ``max_tokens`` >= 1 new tokens; ``temperature`` >= 0 (0: greedy; 1 when the request gives none, as the
    OpenAI API); ``top_p`` in (0, 1]; ``seed`` (None when the request gives none: a random one is drawn, and the
    request follows the load's plan, see :mod:`hsd_opt.runtime.batch`); ``stop``: up to 4
    non-empty strings; ``grammar``: what the output follows (``response_format``, or the function ``tool_choice``
    calls), None: free text; ``tool``: the answer is a function call (``tool_choice``), None: a message;
    ``logprobs``: the alternatives listed with each generated token's log-probability (0 .. 20), None: no
    log-probabilities; ``penalties``: frequency and presence penalties and logit biases, None: none; ``top_k``
    (0: off) and ``min_p`` (0: off): sampling's filters; ``n``: the choices the answer holds (1 ..
    :data:`MAX_CHOICES`); ``stop_ids``: token ids that end the output where one is generated (vLLM's
    ``stop_token_ids``; kept in the output, its text too unless it is a special token)."""

    kind: str
    model: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    grammar: Grammar | None = None
    tool: ToolCall | None = None
    logprobs: int | None = None
    penalties: Penalties | None = None
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    stop_ids: tuple[int, ...] = ()


def choice_requests(req: GenerationRequest) -> list[GenerationRequest]:
    """The decodings that answer ``req``'s ``n`` choices, each a request of one choice: greedy (temperature 0), one
    whose answer is every choice's (the target's greedy output is the same each time); sampled, one per choice,
    choice ``i`` seeded ``seed + i`` where the request gives a seed (each reproducible, no two alike), else each
    unseeded."""
    if req.n == 1:
        return [req]
    if req.temperature == 0:
        return [replace(req, n=1)]
    return [replace(req, n=1, seed=None if req.seed is None else req.seed + i) for i in range(req.n)]


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 (malformed JSON, not UTF-8, not an object)."""
    try:
        body = json.loads(raw.decode("utf-8"))   # json.loads would take UTF-16 and UTF-32 bytes too
    except UnicodeDecodeError:
        raise bad_request("the request body is not UTF-8 text") from None
    except (ValueError, RecursionError) as e:   # malformed, a number too long, nested too deeply
        raise bad_request(f"the request body cannot be read: {json_problem(e)}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_type_name(body)}")
    return body


#: Fields the answer would depend on that this server does not compute, with the value that asks nothing of it
#: (what clients send by default; absent or null too): any other value is a 400 naming the field rather than an
#: answer without it. The OpenAI API's, then llama.cpp's and vLLM's servers' sampling extensions.
UNSUPPORTED = {"echo": False, "best_of": 1, "suffix": "",
               "typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0, "dry_multiplier": 0.0, "xtc_probability": 0.0,
               "min_tokens": 0, "ignore_eos": False, "n_predict": -1, "dynatemp_range": 0.0, "n_probs": 0,
               "include_stop_str_in_output": False, "allowed_token_ids": None, "bad_words": [],
               "use_beam_search": False, "length_penalty": 1.0, "prompt_logprobs": None,
               "truncate_prompt_tokens": None}
#: llama.cpp's server's default for ``repeat_last_n`` (the tokens its ``repeat_penalty`` looks back over).
LLAMA_REPEAT_LAST_N = 64


def _asks_nothing(v: Any, default: Any) -> bool:
    if v is None:
        return True
    if isinstance(default, bool) or isinstance(v, bool):
        return v is default
    if isinstance(default, (int, float)):
        return isinstance(v, (int, float)) and v == default
    return type(v) is type(default) and v == default


_AS_SCHEMA = 'send the schema as response_format {"type": "json_schema", "json_schema": {"schema": ...}}'
_SCHEMAS_ONLY = "this server constrains answers by JSON schemas (response_format) only"
#: llama.cpp's and vLLM's servers' own fields for constrained output: any value but null is a 400 naming the field
#: (ignored, they gave free text where the client asked for a schema), with what this server takes instead.
OTHER_CONSTRAINTS = {"json_schema": _AS_SCHEMA, "guided_json": _AS_SCHEMA, "structured_outputs": _AS_SCHEMA,
                     "guided_choice": "send an enum schema as response_format", "guided_regex": _SCHEMAS_ONLY,
                     "guided_grammar": _SCHEMAS_ONLY, "grammar": _SCHEMAS_ONLY}


def _unsupported(body: dict) -> None:
    for key, default in UNSUPPORTED.items():
        if not _asks_nothing(body.get(key), default):
            raise bad_request(f"'{key}' is not supported by this server (got {json.dumps(body[key])}); leave it "
                              f"out or send {json.dumps(default)}", key)
    for key, instead in OTHER_CONSTRAINTS.items():
        if body.get(key) is not None:
            raise bad_request(f"'{key}' is not supported by this server: {instead}", key)


def _calls_elsewhere(body: dict, kind: str) -> None:
    """A 400 for function-call fields a ``kind`` request cannot follow (they would be ignored): ``tools`` and
    ``tool_choice`` on a completion, the older ``functions`` and ``function_call`` anywhere."""
    for key in ("functions", "function_call"):
        if body.get(key) is not None:
            raise bad_request(f"'{key}' (the OpenAI API's older form of function calls) is not supported; send "
                              f"'tools' and 'tool_choice' to /v1/chat/completions", key)
    for key in ("tools", "tool_choice"):
        if kind != "chat" and body.get(key) is not None:
            raise bad_request(f"'{key}' is for /v1/chat/completions: a completion is text (or follows its "
                              f"'response_format')", key)


def _type_name(x: Any) -> str:
    return "null" if x is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                     list: "array", dict: "object"}.get(type(x), type(x).__name__)


def _int(body: dict, key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"'{key}' must be an integer, got {_type_name(v)} {json.dumps(v)}", key)
    return v


def _number(body: dict, key: str, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad_request(f"'{key}' must be a number, got {_type_name(v)} {json.dumps(v)}", key)
    try:
        return float(v)
    except OverflowError:            # an integer of hundreds of digits: past every float
        raise bad_request(f"'{key}' must be a number within a float's range, got an integer of {len(str(v))} "
                          f"digits", key) from None


def _bool(body: dict, key: str, name: str | None = None) -> bool:
    """``body[key]`` as a boolean (absent or null: False); ``name``: the field's full name in errors (``key``)."""
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad_request(f"'{name or key}' must be a boolean, got {_type_name(v)}", name or key)
    return v


def _logprobs(body: dict, kind: str) -> int | None:
    """The alternatives asked for with each token's log-probability (None: none asked): chat ``logprobs`` (a
    boolean) with ``top_logprobs`` (0 .. 20, only with ``logprobs`` true); completions ``logprobs`` (0 .. 20,
    as the OpenAI API's ``logprobs`` of ``/v1/completions``, whose own limit is 5)."""
    if kind == "chat":
        on = _bool(body, "logprobs")
        top = _int(body, "top_logprobs")
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad_request(f"'top_logprobs' must be in 0 .. {MAX_TOP_LOGPROBS}, got {top}", "top_logprobs")
        if top and not on:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if on else None
    if not _asks_nothing(body.get("top_logprobs"), 0):
        raise bad_request("'top_logprobs' is a field of chat completions; here 'logprobs' takes the number of "
                          "alternatives", "top_logprobs")
    n = _int(body, "logprobs")
    if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
        raise bad_request(f"'logprobs' must be in 0 .. {MAX_TOP_LOGPROBS}, got {n}", "logprobs")
    return n


def _penalties(body: dict, info: ModelInfo) -> Penalties | None:
    """``frequency_penalty`` and ``presence_penalty`` (numbers in -2 .. 2) and ``logit_bias`` (an object from
    token ids, as strings, to numbers in -100 .. 100; ids of the model's tokenizer), None when nothing moves."""
    frequency = _number(body, "frequency_penalty", 0.0)
    presence = _number(body, "presence_penalty", 0.0)
    _field("frequency_penalty", lambda: Penalties(frequency=frequency))
    _field("presence_penalty", lambda: Penalties(presence=presence))
    raw = body.get("logit_bias")
    bias = {} if raw is None else _field("logit_bias", lambda: _bias(raw, len(info.tokenizer)))
    repetition, last = _repetition(body)
    return penalties_or_none(frequency, presence, bias, repetition, last)


def _repetition(body: dict) -> tuple[float, int | None]:
    """The repetition penalty's factor and the context's tokens it looks at (None: all of them): vLLM's
    ``repetition_penalty`` (over the whole context), or llama.cpp's ``repeat_penalty`` over its last
    ``repeat_last_n`` tokens (default 64; -1: the whole context; 0: off); not both."""
    vllm = _number(body, "repetition_penalty", 1.0)
    llama = _number(body, "repeat_penalty", 1.0)
    for key, v in (("repetition_penalty", vllm), ("repeat_penalty", llama)):
        _field(key, lambda v=v: Penalties(repetition=v))
    if vllm != 1.0 and llama != 1.0:
        raise bad_request("send one of 'repetition_penalty' and 'repeat_penalty', not both", "repeat_penalty")
    n = _int(body, "repeat_last_n")              # checked whether or not a repeat_penalty uses it
    n = LLAMA_REPEAT_LAST_N if n is None else n
    if n < -1:
        raise bad_request(f"'repeat_last_n' must be -1 (the whole context), 0 (off) or a number of tokens, got {n}",
                          "repeat_last_n")
    if llama == 1.0:
        return vllm, None
    return (1.0, None) if n == 0 else (llama, None if n == -1 else n)


def _bias(raw: object, vocab: int) -> dict[int, float]:
    """``logit_bias`` as ``{token id: bias}``, its ids below ``vocab`` (an :class:`HsdError` otherwise)."""
    bias = bias_from_json(raw)
    Penalties(bias=bias).check_vocab(vocab)
    return bias


def _field(key: str, make: Callable[[], Any]) -> Any:
    """``make()``, or a 400 naming the field ``key`` for the :class:`HsdError` it raises."""
    try:
        return make()
    except HsdError as e:
        raise bad_request(str(e), key) from None


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request(f"'stop' must be a string or an array of strings, got {_type_name(v)}", "stop")
    if len(stops) > MAX_STOP:
        raise bad_request(f"'stop' takes at most {MAX_STOP} strings, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise bad_request("'stop' strings must not be empty", "stop")
    return tuple(_text(s, "stop" if isinstance(v, str) else f"stop[{i}]") for i, s in enumerate(stops))


def _stop_ids(body: dict, info: ModelInfo) -> tuple[int, ...]:
    """vLLM's ``stop_token_ids``: an array of the model's token ids (below its tokenizer's size); absent or null:
    none."""
    v = body.get("stop_token_ids")
    if v is None:
        return ()
    vocab = len(info.tokenizer)
    if not isinstance(v, list) or not all(is_integer(t) for t in v):
        raise bad_request(f"'stop_token_ids' must be an array of token ids (integers), got {_type_name(v)} "
                          f"{json.dumps(v)[:80]}", "stop_token_ids")
    bad = [t for t in v if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"'stop_token_ids': {bad[0]} is not a token id of this model (0 .. {vocab - 1})",
                          "stop_token_ids")
    return tuple(dict.fromkeys(v))


def _text(s: str, where: str) -> str:
    """``s`` when it is text (JSON's escapes can write a lone UTF-16 surrogate, which is not), else a 400 naming
    ``where``."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"'{where}' holds a lone UTF-16 surrogate (\\u{ord(s[e.start]):04x} at character "
                          f"{e.start}), which is not text", where) from None
    return s


def _content(m: dict, i: int) -> str:
    c = m.get("content")
    where = f"messages[{i}].content"
    if isinstance(c, str):
        return _text(c, where)
    if c is None and m.get("role") == "assistant":
        return ""
    if isinstance(c, list):
        parts = []
        for k, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}[{k}]: only text parts ({{\"type\": \"text\", \"text\": \"...\"}}) "
                                  f"are supported", f"{where}[{k}]")
            parts.append(_text(part["text"], f"{where}[{k}].text"))
        return "\n".join(parts)          # as llama.cpp's server and vLLM join a message's text parts
    raise bad_request(f"'{where}' must be a string or an array of text parts, got {_type_name(c)}", where)


def _messages(body: dict) -> list[dict[str, str]]:
    if "messages" not in body:
        raise bad_request("missing required field 'messages'", "messages")
    msgs = body["messages"]
    if not isinstance(msgs, list):
        raise bad_request(f"'messages' must be an array of messages, got {_type_name(msgs)}", "messages")
    if not msgs:
        raise bad_request("'messages' must hold at least one message", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad_request(f"'messages[{i}]' must be an object, got {_type_name(m)}", f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"'messages[{i}].role' must be one of {', '.join(ROLES)}, got {json.dumps(role)}",
                              f"messages[{i}].role")
        content = _content(m, i)
        calls = past_calls(m, i) if role == "assistant" else None
        if calls:            # its calls after its text, where a client's turn has both (the model sees both)
            content = f"{content}\n{calls}" if content.strip() else calls
        # the OpenAI API's developer message is the system message (the template knows no developer role)
        out.append({"role": "system" if role == "developer" else role, "content": content})
    if not any(m["content"] for m in out):      # whitespace is text a model completes, as OpenAI's API takes it
        raise bad_request("every message in 'messages' is empty", "messages")
    return out


def _prompt(body: dict) -> str:
    if "prompt" not in body:
        raise bad_request("missing required field 'prompt'", "prompt")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if not isinstance(p, str):
        raise bad_request(f"'prompt' must be a string (or an array of one string), got {_type_name(p)}", "prompt")
    _text(p, "prompt")
    if not p:                     # whitespace is text a model completes, as OpenAI's API takes it
        raise bad_request("'prompt' is empty", "prompt")
    return p


#: ``response_format.type`` values.
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _compile(spec: GrammarSpec, info: ModelInfo, where: str) -> Grammar:
    """``spec`` compiled for the model; a 400 naming ``where`` when it does not compile."""
    try:
        if info.grammars is None:
            raise HsdError(f"{where}: this server cannot constrain its output")
        return info.grammars.compile(spec)
    except HsdError as e:
        raise bad_request(str(e), where) from None


def _response_format(body: dict, info: ModelInfo) -> Grammar | None:
    """The grammar ``response_format`` asks for, compiled (None: free text); a 400 naming the field otherwise."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise bad_request(f"'response_format' must be an object, got {_type_name(rf)}", "response_format")
    kind = rf.get("type")
    if kind not in RESPONSE_FORMATS:
        raise bad_request(f"'response_format.type' must be one of {', '.join(RESPONSE_FORMATS)}, got "
                          f"{json.dumps(kind)}", "response_format.type")
    for key in ("json_schema", "schema"):    # a schema the type given would leave unread: not an answer without it
        if rf.get(key) is not None and (kind, key) not in (("json_schema", "json_schema"), ("json_object", "schema")):
            raise bad_request(f"'response_format.{key}' is read with type \"json_schema\" (or llama.cpp's "
                              f"\"json_object\" with 'schema'), not with type {json.dumps(kind)}; send "
                              f"{{\"type\": \"json_schema\", \"json_schema\": {{\"schema\": ...}}}}",
                              f"response_format.{key}")
    if kind == "text":
        return None
    if kind == "json_object":
        if rf.get("schema") is not None:     # llama.cpp's server's form of a schema
            return _compile_schema(rf["schema"], info, "response_format.schema")
        return _compile(GrammarSpec("json_object", "", "response_format"), info, "response_format")
    js = rf.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(js, dict):
        raise bad_request(f"'{where}' must be an object holding 'schema', got {_type_name(js)}", where)
    if "schema" not in js:
        raise bad_request(f"missing required field '{where}.schema'", f"{where}.schema")
    return _compile_schema(js["schema"], info, f"{where}.schema")


def _compile_schema(schema: Any, info: ModelInfo, where: str) -> Grammar:
    """The JSON schema ``schema`` compiled for the model; a 400 naming ``where`` when it is not a schema that
    compiles."""
    try:
        spec = GrammarSpec.json_schema(schema, where)
    except HsdError as e:
        raise bad_request(str(e), where) from None
    return _compile(spec, info, where)


def _compile_tools(tools: list[Function], info: ModelInfo, unused: bool = False) -> None:
    """Compile each function's ``parameters``: one that does not compile is a 400 naming it, whatever
    ``tool_choice`` says (``"none"`` included) and on ``/tokenize``. ``unused``: the answer does not follow them
    (``"none"``, ``/tokenize``), so a server that cannot constrain its output (no grammar compiler, or a tokenizer
    llguidance cannot read) leaves them unchecked rather than refuse the request."""
    if not tools or (unused and not _can_constrain(info)):    # a request without tools reads no tokenizer
        return
    for i, f in enumerate(tools):
        _compile_schema(f.parameters, info, f"tools[{i}].function.parameters")


def _can_constrain(info: ModelInfo) -> bool:
    """Whether the server can compile a grammar for its model's tokenizer."""
    if info.grammars is None:
        return False
    try:
        info.grammars.tokenizer()
    except HsdError:
        return False
    return True


def _tool_call(body: dict, info: ModelInfo, logprobs: int | None) -> tuple[ToolCall | None, Grammar | None, str]:
    """A chat request's function call (``tools``, ``tool_choice``): the call, the grammar of its answer and the
    instruction for the prompt; ``(None, None, "")`` for none. A 400 naming the field for a malformed one, for a
    call asked together with a ``response_format`` that constrains the answer, or with log-probabilities
    (``logprobs`` not None)."""
    tools = parse_tools(body)
    call = parse_tool_choice(body, tools)
    if call is None:
        _compile_tools(tools, info, unused=True)
        return None, None, ""
    if logprobs is not None:
        raise bad_request("'logprobs' with 'tools' is not supported: the answer may be a call, which has no "
                          "tokens of its own in the response; leave 'logprobs' out or use tool_choice \"none\"",
                          "logprobs")
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type", "text") != "text":
        raise bad_request("'response_format' and 'tools' ask for two different answers (with tools the answer is a "
                          "call, or text under tool_choice \"auto\"); give one of them, or tool_choice \"none\"",
                          "response_format")
    _compile_tools(tools, info)
    if call.auto:
        grammar = _compile(GrammarSpec("lark", _field("tools", lambda: auto_grammar(call, tools)), "tools"), info,
                           "tools")
    else:
        where = ("tools" if call.name is None else
                 f"tools[{[f.name for f in tools].index(call.name)}].function.parameters")
        grammar = _compile_schema(call_schema(call, tools), info, where)
    return call, grammar, instruction(call, tools)


def parse_request(body: dict[str, Any], kind: str, info: ModelInfo) -> GenerationRequest:
    """Validate a request body of ``kind`` (``"chat"`` or ``"completion"``) for the model ``info``.

    Raises:
        ApiError: 400 for a missing or empty ``messages``/``prompt``, a field of the wrong type, ``max_tokens``
            < 1 or beyond the context (prompt + ``max_tokens`` > ``info.max_positions``), ``temperature`` < 0,
            ``top_p`` outside [0, 1], ``n`` outside 1 .. :data:`MAX_CHOICES`, more than 4 or empty ``stop`` strings, a
            ``response_format`` that is malformed or does not compile; 404 for another model than ``info.name``.
    """
    _served_model(body, info)
    model = body.get("model", info.name)
    _unsupported(body)
    _calls_elsewhere(body, kind)
    n = _int(body, "n")
    n = 1 if n is None else n
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"'n' must be 1 .. {MAX_CHOICES} (choices in the answer), got {n}", "n")
    # chat: max_completion_tokens (the OpenAI API's name now) wins over the deprecated max_tokens; each is checked
    limits = {key: _int(body, key) for key in (("max_completion_tokens", "max_tokens") if kind == "chat"
                                               else ("max_tokens",))}
    for key, v in limits.items():
        if v is not None and v < 1:
            raise bad_request(f"'{key}' must be at least 1, got {v}", key)
    key, max_tokens = next(((k, v) for k, v in limits.items() if v is not None), (None, None))
    temperature = _number(body, "temperature", DEFAULT_TEMPERATURE)
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise bad_request(f"'temperature' must be a finite number >= 0, got {temperature:g}", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 <= top_p <= 1.0:
        raise bad_request(f"'top_p' must be in [0, 1], got {top_p:g}", "top_p")
    top_k = _int(body, "top_k")
    if top_k is not None and top_k < 0 and top_k != -1:
        raise bad_request(f"'top_k' must be an integer >= 0 (0 or -1: off), got {top_k}", "top_k")
    top_k = max(top_k or 0, 0)
    if top_p == 0.0:                 # the smallest nucleus, the most probable token alone (as the OpenAI API and
        temperature, top_p = 0.0, 1.0    # llama-server take 0): the greedy answer
    min_p = _number(body, "min_p", 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise bad_request(f"'min_p' must be in [0, 1], got {min_p:g}", "min_p")
    seed = _int(body, "seed")
    if seed == -1:                   # llama-server's "no seed" (its default): sampled unseeded, as without one
        seed = None
    if seed is not None and not (seed_fits(seed) and seed_fits(seed + n - 1)):
        raise bad_request(f"'seed' must be a 64-bit integer (-2**63 .. 2**64 - 1; with 'n', seed + n - 1 too: "
                          f"choice i is seeded seed + i), got {seed}", "seed")
    stop = _stop(body)
    stop_ids = _stop_ids(body, info)
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad_request(f"'stream_options' must be an object, got {_type_name(opts)}", "stream_options")
    if opts is not None and not stream:     # as the OpenAI API and vLLM: options of a stream not asked for
        raise bad_request("'stream_options' is only allowed with 'stream': true", "stream_options")
    include_usage = _bool(opts or {}, "include_usage", "stream_options.include_usage") if stream else False
    logprobs = _logprobs(body, kind)
    penalties = _penalties(body, info)
    tool, grammar, told = _tool_call(body, info, logprobs) if kind == "chat" else (None, None, "")
    grammar = _response_format(body, info) or grammar   # with a call: checked, free text only (_tool_call)
    try:
        if kind == "chat":
            msgs = _messages(body)
            ids = chat_ids(info.tokenizer, with_instruction(msgs, told) if tool is not None else msgs)
        else:
            ids = encode_prompt(info.tokenizer, _prompt(body), raw=True)
    except HsdError as e:
        raise bad_request(str(e), "messages" if kind == "chat" else "prompt") from None
    room = info.max_positions - len(ids)
    field = "messages" if kind == "chat" else "prompt"
    if room < 1:
        raise bad_request(f"the prompt is {len(ids)} tokens; the model's context is {info.max_positions} tokens, "
                          f"which leaves no room to generate", field, "context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(room, info.default_max_tokens if kind == "chat" else COMPLETION_DEFAULT_MAX_TOKENS)
    elif max_tokens > room:
        raise bad_request(f"the prompt ({len(ids)} tokens) + '{key}' ({max_tokens}) exceeds the model's context "
                          f"of {info.max_positions} tokens", key, "context_length_exceeded")
    return GenerationRequest(kind, model, ids, max_tokens, temperature, top_p, seed, stop, stream, include_usage,
                             grammar, tool, logprobs, penalties, top_k, min_p, n, stop_ids)


def _served_model(body: dict[str, Any], info: ModelInfo) -> None:
    """A 400 for a ``model`` that is not a string, a 404 for another model than ``info.name`` (absent: served)."""
    model = body.get("model", info.name)
    if not isinstance(model, str):
        raise bad_request(f"'model' must be a string, got {_type_name(model)}", "model")
    if model != info.name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {info.name!r}",
                       "invalid_request_error", "model", "model_not_found")


def parse_tokenize(body: dict[str, Any], info: ModelInfo) -> list[int]:
    """``POST /tokenize``: the token ids a generation request would decode from: ``messages`` through the chat
    template (as ``/v1/chat/completions``), or ``prompt`` (vLLM's name) or ``content`` (llama.cpp's) encoded as it is
    (as ``/v1/completions``; empty: no tokens). A 400 naming the field for anything else, a 404 for another model."""
    _served_model(body, info)
    given = [k for k in ("messages", "prompt", "content") if k in body]
    if len(given) != 1:
        both = f", not {' and '.join(given)}" if given else ""
        raise bad_request(f"send one of 'messages', 'prompt' or 'content'{both}", given[-1] if given else "prompt")
    key = given[0]
    try:
        if key == "messages":                   # with the instruction a function call adds, as a chat request
            tools = parse_tools(body)
            call = parse_tool_choice(body, tools)
            _compile_tools(tools, info, unused=call is None)    # a call the chat route cannot constrain: refused
            msgs = _messages(body)
            return chat_ids(info.tokenizer, msgs if call is None else with_instruction(msgs, instruction(call, tools)))
        p = body[key]
        if not isinstance(p, str):
            raise bad_request(f"'{key}' must be a string, got {_type_name(p)}", key)
        return encode_prompt(info.tokenizer, _text(p, key), raw=True) if p else []
    except HsdError as e:
        raise bad_request(str(e), key) from None


def parse_detokenize(body: dict[str, Any], info: ModelInfo) -> list[int]:
    """``POST /detokenize``: ``tokens``, an array of token ids of the model's vocabulary (a 400 naming the field
    otherwise; a 404 for another model)."""
    _served_model(body, info)
    if "tokens" not in body:
        raise bad_request("missing required field 'tokens'", "tokens")
    ids, vocab = body["tokens"], len(info.tokenizer)
    if not isinstance(ids, list):
        raise bad_request(f"'tokens' must be an array of token ids, got {_type_name(ids)}", "tokens")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise bad_request(f"'tokens[{i}]' must be a token id 0 .. {vocab - 1}, got {json.dumps(t)}",
                              f"tokens[{i}]")
    return ids
