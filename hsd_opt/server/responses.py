"""The OpenAI API's response bodies and stream chunks for chat and text completions, with the HSD figures
under an extra ``hsd`` field that OpenAI clients ignore, and server-sent events.

Shapes (``kind`` is ``"chat"`` or ``"completion"``):

- chat: ``{"id": "chatcmpl-...", "object": "chat.completion", "created", "model", "choices": [{"index": 0,
  "message": {"role": "assistant", "content"}, "logprobs": null, "finish_reason"}], "usage", "hsd"}``;
  chunks ``"object": "chat.completion.chunk"`` with ``"delta"`` (the first one ``{"role": "assistant",
  "content": ""}``, the last one ``{}`` with the ``finish_reason`` and ``hsd``);
- completion: ``{"id": "cmpl-...", "object": "text_completion", ..., "choices": [{"index": 0, "text",
  "logprobs": null, "finish_reason"}], "usage", "hsd"}``; chunks of the same object with the new ``text``.

A chat answer that is a function call (``tool_choice``, :mod:`hsd_opt.server.tools`) has ``"message": {"role":
"assistant", "content": null, "tool_calls": [{"id", "type": "function", "function": {"name", "arguments"}}]}``;
streamed, a delta opens the call (its ``id``, ``name`` and empty ``arguments``) and later deltas add to its
``arguments`` (a call of one of several functions comes whole, its name being part of the answer:
:class:`AnswerStream`).

With log-probabilities asked for, ``logprobs`` holds them for the returned tokens (:func:`chat_logprobs`,
:func:`completion_logprobs`); streamed, each chunk those of the tokens that came with its text.

A stream is ``data: {chunk}\\n\\n`` events ending with ``data: [DONE]\\n\\n``; with
``stream_options.include_usage`` a last chunk before it holds ``usage`` and no choices.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any, Sequence

from hsd_opt.server.jobs import Outcome
from hsd_opt.server.metrics import cached_tokens
from hsd_opt.server.text import bytes_text, token_bytes
from hsd_opt.server.tools import ToolCall, as_call, new_call_id

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from hsd_opt.runtime.decode import TokenLogprob

DONE = b"data: [DONE]\n\n"


def new_id(kind: str) -> str:
    """A fresh response id: ``chatcmpl-<hex>`` or ``cmpl-<hex>``."""
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def now() -> int:
    """Unix time in whole seconds (the ``created`` field)."""
    return int(time.time())


def usage(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """``prompt_tokens`` (the prompt's, once), ``completion_tokens`` (the ids returned, every choice's: cut at a
    stop string) and their sum, of the answer whose choices are ``outcomes``; ``prompt_tokens_details.
    cached_tokens``: the prompt's tokens the first choice's target did not compute (taken from an earlier request:
    the chat template's head, a conversation's earlier turns), as the OpenAI API reports them."""
    p, n = outcomes[0].prompt_tokens, sum(len(o.token_ids) for o in outcomes)
    cached = cached_tokens(p, outcomes[0].stats)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n,
            "prompt_tokens_details": {"cached_tokens": cached}}


def acceptance(hierarchy: list[str], levels: list[dict[str, Any]]) -> dict[str, float | None]:
    """Each verifying level's acceptance rate by name: the levels above the bottom of ``hierarchy`` (the last one a
    decoding ran), and any other level that checked drafts (in a hierarchy it ran before, following the load)."""
    above = set(hierarchy[1:])
    return {lv["name"]: lv.get("acceptance_rate") for lv in levels
            if lv["name"] in above or lv.get("acceptance_rate") is not None}


def hsd_figures(o: Outcome) -> dict[str, Any]:
    """The HSD figures of one generation: ``hierarchy`` (bottom first) and ``budgets``, ``mode``,
    ``target_calls``, ``tokens_per_target_call``, ``acceptance`` (each verifying level's acceptance rate, by
    name: :func:`acceptance`), ``levels`` (per-level counters: the last hierarchy's bottom first, then levels of
    hierarchies it ran before), ``generated_tokens`` (every token committed, past a stop string
    too), ``token_ids`` (the returned ids), ``prefill_tokens`` (the prompt's positions its target computed), and
    times in seconds: ``queue_seconds`` (before its prompt's computation began), ``first_token_seconds`` (from its
    arrival), ``prefill_seconds``, ``decode_seconds``, ``seconds`` (prefill + decode) and ``tokens_per_s``."""
    s = o.stats
    levels = s.get("levels") or []
    return {
        "hierarchy": s.get("hierarchy"), "budgets": s.get("budgets"), "mode": s.get("mode"),
        "target_calls": s.get("target_calls"), "tokens_per_target_call": s.get("tokens_per_target_call"),
        "acceptance": acceptance(s.get("hierarchy") or [], levels),
        "levels": levels, "generated_tokens": s.get("tokens"), "token_ids": list(o.token_ids),
        "prefill_tokens": s.get("prefill_tokens"),
        "queue_seconds": o.queue_seconds, "first_token_seconds": o.first_token_seconds,
        "prefill_seconds": s.get("prefill_seconds"),
        "decode_seconds": s.get("decode_seconds"), "seconds": s.get("seconds"),
        "tokens_per_s": s.get("tokens_per_s"),
    }


#: The least log-probability written (JSON has no -Infinity; the OpenAI API writes -9999.0 likewise).
LOGPROB_FLOOR = -9999.0


def _token(tokenizer: "PreTrainedTokenizerBase", token_id: int) -> tuple[str, list[int]]:
    b = token_bytes(tokenizer, token_id)
    return bytes_text(b), list(b)


def _lp(v: float) -> float:
    return max(float(v), LOGPROB_FLOOR)


def chat_logprobs(tokenizer: "PreTrainedTokenizerBase", entries: Sequence["TokenLogprob"]) -> dict[str, Any]:
    """A chat choice's ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
    "logprob", "bytes"}, ...]}, ...], "refusal": null}``, a token's text its bytes read as UTF-8 (a part of a
    character reads as U+FFFD; ``bytes`` has them exactly)."""
    content = []
    for e in entries:
        tok, b = _token(tokenizer, e.token)
        top = []
        for t, v in e.top:
            ttok, tb = _token(tokenizer, t)
            top.append({"token": ttok, "logprob": _lp(v), "bytes": tb})
        content.append({"token": tok, "logprob": _lp(e.logprob), "bytes": b, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer: "PreTrainedTokenizerBase", entries: Sequence["TokenLogprob"],
                        offset: int = 0) -> dict[str, Any]:
    """A text completion's ``logprobs``: ``tokens`` (each token's :func:`completion_name`), ``token_logprobs``,
    ``top_logprobs`` (a token -> log-probability object per token, most likely first; a token whose name another
    one took keeps the first, more likely, value) and ``text_offset`` (where each token's text starts: ``offset``
    plus the lengths of the tokens' texts before it, :func:`offset_length`)."""
    tokens, values, tops, offsets = [], [], [], []
    for e in entries:
        b = token_bytes(tokenizer, e.token)
        offsets.append(offset)
        offset += offset_length(b)
        tokens.append(completion_name(b))
        values.append(_lp(e.logprob))
        top: dict[str, float] = {}
        for t, v in e.top:
            top.setdefault(completion_name(token_bytes(tokenizer, t)), _lp(v))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def offset_length(b: bytes) -> int:
    """Characters a token of bytes ``b`` takes in ``text_offset``'s count: its :func:`bytes_text`'s, not the length
    of its ``bytes:`` name."""
    return len(bytes_text(b))


def completion_name(b: bytes) -> str:
    """A token's bytes ``b`` as a text completion's ``logprobs`` name the token: their text, or where they are not
    whole characters (a part of one), ``bytes:`` and their escapes (``"bytes:\\xe6\\x97"``), as the OpenAI API
    writes them (their text, U+FFFD each, would give several tokens one name in ``top_logprobs``)."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{c:02x}" for c in b)


def logprobs_of(kind: str, tokenizer: "PreTrainedTokenizerBase", entries: Sequence["TokenLogprob"] | None,
                offset: int = 0) -> dict[str, Any] | None:
    """A choice's ``logprobs`` of ``kind`` (None where none were asked for)."""
    if entries is None:
        return None
    return chat_logprobs(tokenizer, entries) if kind == "chat" else completion_logprobs(tokenizer, entries, offset)


def call_finish(o: Outcome) -> str:
    """A function call's ``finish_reason``: ``"tool_calls"`` where the answer ended at the end of sequence (the
    call whole), else as is (``"length"`` at ``max_tokens``, ``"stop"`` at a stop string: arguments cut short)."""
    return "tool_calls" if o.eos else o.finish_reason


def tool_calls(name: str, arguments: str, opening: bool = True) -> list[dict[str, Any]]:
    """``tool_calls`` of one call: whole (``opening``: with a new id, its type and name) or a piece of its
    ``arguments``."""
    if not opening:
        return [{"index": 0, "function": {"arguments": arguments}}]
    return [{"index": 0, "id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}]


def chat_message(o: Outcome, tool: ToolCall | None) -> tuple[dict[str, Any], str]:
    """The chat answer's ``message`` and ``finish_reason``: a function call where the request asked for one and
    the answer holds one (not a call cut before its name by ``max_tokens``: then its text)."""
    call = as_call(tool, o.text) if tool is not None else None
    if call is None:
        return {"role": "assistant", "content": o.text}, o.finish_reason
    calls = [{k: v for k, v in c.items() if k != "index"} for c in tool_calls(*call)]
    return {"role": "assistant", "content": None, "tool_calls": calls}, call_finish(o)


class AnswerStream:
    """The deltas of a streamed chat answer, a function call where the request's tools make it one: :meth:`piece`
    turns new text into deltas (``{"content": ...}`` or ``{"tool_calls": ...}``), :meth:`end` gives the last ones
    and the ``finish_reason``. A named function's call opens at once (:meth:`opening`) and its arguments follow as
    they come; a call of one of several functions is held and sent whole (its name is part of the answer); under
    ``"auto"`` the answer is held until its first character past white space says which it is: ``{`` a call, else
    text, streamed from there."""

    def __init__(self, tool: ToolCall | None):
        self.tool, self.held = tool, []
        self.mode = ("text" if tool is None else "args" if tool.name is not None else
                     "undecided" if tool.auto else "hold")

    def opening(self) -> list[dict[str, Any]]:
        return [{"tool_calls": tool_calls(self.tool.name, "")}] if self.mode == "args" else []

    def piece(self, text: str) -> list[dict[str, Any]]:
        if self.mode == "text":
            return [{"content": text}]
        if self.mode == "args":
            return [{"tool_calls": tool_calls(self.tool.name, text, opening=False)}]
        self.held.append(text)
        if self.mode == "undecided":                 # "hold" only gathers the call until its end
            lead = "".join(self.held).lstrip()
            if lead.startswith("{"):
                self.mode = "hold"
            elif lead:
                self.mode, out, self.held = "text", "".join(self.held), []
                return [{"content": out}]
        return []

    def end(self, o: Outcome) -> tuple[list[dict[str, Any]], str]:
        if self.mode == "args":
            return [], call_finish(o)
        text = "".join(self.held)
        call = as_call(self.tool, text) if self.tool is not None and self.mode == "hold" else None
        if call is not None:
            return [{"tool_calls": tool_calls(*call)}], call_finish(o)
        return ([{"content": text}] if text else []), o.finish_reason


def completion_body(kind: str, rid: str, created: int, model: str, outcomes: Sequence[Outcome],
                    tool: ToolCall | None = None, tokenizer: "PreTrainedTokenizerBase | None" = None) -> dict[str, Any]:
    """The whole (non-streamed) response, choice ``i`` from ``outcomes[i]`` (a chat answer that is a function call
    where ``tool`` says so; the ``tokenizer`` writes the tokens of log-probabilities, where the outcome has them).
    ``hsd``: the first choice's figures; with more than one choice each also carries its own."""
    choices = []
    for i, o in enumerate(outcomes):
        lps = logprobs_of(kind, tokenizer, o.logprobs) if tokenizer is not None else None
        if kind == "chat":
            message, finish = chat_message(o, tool)
            choice = {"index": i, "message": message, "logprobs": lps, "finish_reason": finish}
        else:
            choice = {"index": i, "text": o.text, "logprobs": lps, "finish_reason": o.finish_reason}
        if len(outcomes) > 1:
            choice["hsd"] = hsd_figures(o)
        choices.append(choice)
    return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion", "created": created,
            "model": model, "system_fingerprint": None, "choices": choices, "usage": usage(outcomes),
            "hsd": hsd_figures(outcomes[0])}


def chunk(kind: str, rid: str, created: int, model: str, text: str | None = None, role: bool = False,
          finish_reason: str | None = None, extra: dict[str, Any] | None = None,
          calls: list[dict[str, Any]] | None = None, logprobs: dict[str, Any] | None = None,
          index: int = 0) -> dict[str, Any]:
    """One stream chunk of choice ``index``: new ``text`` (chat: ``delta.content``), the chat's opening ``role``
    delta, a function call's delta (``calls``: :func:`tool_calls`), or the closing chunk with ``finish_reason``
    (and ``extra`` fields such as ``hsd``); ``logprobs``: those of the chunk's tokens (:func:`logprobs_of`)."""
    if kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta = {"role": "assistant", "content": ""}
        elif calls is not None:
            delta = {"tool_calls": calls}
        elif text is not None:
            delta = {"content": text}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
           "choices": [choice]}
    out.update(extra or {})
    return out


class ChoiceStream:
    """The chunks of one choice of a streamed answer (``index``): the chat's opening role delta (and a named
    function's opening call), its text and function-call deltas with their log-probabilities, its closing chunk."""

    def __init__(self, tokenizer: "PreTrainedTokenizerBase", kind: str, model: str, tool: ToolCall | None, rid: str,
                 created: int, index: int):
        self.tokenizer, self.kind, self.model, self.rid, self.created, self.index = (
            tokenizer, kind, model, rid, created, index)
        self.answer = AnswerStream(tool if kind == "chat" else None)
        self.pending: list = []      # log-probabilities of tokens whose text is not sent yet
        self.offset = 0              # text_offset of the next token (completions)

    def _chunk(self, **fields) -> bytes:
        return sse(chunk(self.kind, self.rid, self.created, self.model, index=self.index, **fields))

    def _deltas(self, deltas) -> list[bytes]:
        out = []
        for d in deltas:
            lps = None
            if self.pending:
                lps = logprobs_of(self.kind, self.tokenizer, self.pending, self.offset)
                if self.kind != "chat":         # the next token starts where the last one sent ends
                    last = token_bytes(self.tokenizer, self.pending[-1].token)
                    self.offset = lps["text_offset"][-1] + offset_length(last)
                self.pending = []
            out.append(self._chunk(text=d.get("content"), calls=d.get("tool_calls"), logprobs=lps))
        return out

    def opening(self) -> list[bytes]:
        """The chunks before any text: the chat's role delta, a named function's opening call."""
        first = [self._chunk(role=True)] if self.kind == "chat" else []
        return first + self._deltas(self.answer.opening())

    def event(self, what: str, val) -> list[bytes]:
        """The chunks of a ``"logprobs"`` (kept for the next text) or ``"text"`` event."""
        if what == "logprobs":
            self.pending.extend(val)
            return []
        return self._deltas(self.answer.piece(val))

    def end(self, o: Outcome) -> list[bytes]:
        """The last deltas and the closing chunk (its finish reason and the choice's ``hsd`` figures)."""
        last, finish = self.answer.end(o)
        return self._deltas(last) + [self._chunk(finish_reason=finish, extra={"hsd": hsd_figures(o)})]


def usage_chunk(kind: str, rid: str, created: int, model: str, outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the ``usage`` of them all."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
            "choices": [], "usage": usage(outcomes)}


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
