"""Grammars compiled for a tokenizer, with llguidance (https://github.com/guidance-ai/llguidance).

A :class:`GrammarSpec` says what a request asks for: a JSON schema, any JSON object, a Lark grammar or a regular
expression. :class:`GrammarCompiler` compiles one for a tokenizer into a :class:`Grammar` (a matcher in its start
state that each sequence copies), cached per spec: a schema a server sees again costs a dictionary lookup and a
copy. A spec that does not compile is an :class:`~hsd_opt.errors.HsdError` naming the problem, never an
unconstrained output.

JSON is produced in one layout (``", "`` between items, ``": "`` after keys, no other white space), so that the
tokens the grammar forces are few and known (:meth:`~hsd_opt.grammar.constraint.Constraint.only`).
"""

from __future__ import annotations

import copy
import functools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from hsd_opt.errors import HsdError
from hsd_opt.jsonio import json_problem
from hsd_opt.packages import need

#: Grammar kinds a :class:`GrammarSpec` may name.
KINDS = ("json_schema", "json_object", "lark", "regex")
#: Compiled grammars a :class:`GrammarCompiler` keeps (least recently used dropped first).
CACHE_SIZE = 256
#: The JSON layout every schema and JSON object is produced in, with every keyword checked (llguidance's options,
#: given as overrides: a schema's own ``x-guidance`` cannot change them).
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", ", "lenient": False}


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to.

    Attributes:
        kind: one of :data:`KINDS`.
        text: the schema as JSON text (``json_schema``), the Lark grammar or the regular expression; ``""`` for
            ``json_object``.
        source: where it came from, for error messages (``"--json-schema schema.json"``,
            ``"response_format.json_schema.schema"``).
    """

    kind: str
    text: str = ""
    source: str = "grammar"

    @staticmethod
    def json_schema(schema: Any, source: str = "json_schema") -> "GrammarSpec":
        """A spec for a JSON schema (a dict, or JSON text); refused when it is not a JSON object."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError) as e:
                raise HsdError(f"{source}: not JSON that can be read: {json_problem(e)}") from None
        if not isinstance(schema, dict):
            raise HsdError(f"{source}: a JSON schema must be an object, got {type(schema).__name__}")
        if "x-guidance" in schema:   # llguidance's options: another layout, keywords it cannot check let through
            raise HsdError(f"{source}: x-guidance: the compiler's own options are not taken (JSON is written in one "
                           f"layout, and a keyword that cannot be checked is refused); leave it out")
        try:
            schema, big = _normalized(schema)
            text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
        except ValueError:
            raise HsdError(f"{source}: holds a number that is not finite (NaN, Infinity, or one beyond a double's "
                           "range such as 1e400)") from None
        except RecursionError:
            raise HsdError(f"{source}: {json_problem(RecursionError())}") from None
        if big is not None:
            where, n = big
            raise HsdError(f"{source}: the integer {n} at {where} is beyond what structured output holds exactly "
                           f"(-2**53 .. 2**53, a double's whole numbers); an answer could break the schema")
        return GrammarSpec("json_schema", text, source)

    @property
    def key(self) -> tuple[str, str]:
        """What the cache is keyed by (the source is only for messages)."""
        return self.kind, self.text


#: The keywords whose numbers bound or fix a value (llguidance holds them as doubles).
_VALUE_KEYWORDS = frozenset({"const", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                             "multipleOf"})
#: The largest integer every double next to it tells apart.
_EXACT = 2 ** 53
#: The keywords whose value maps names (of properties, definitions) to schemas: its keys are no keywords.
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
#: The keywords whose values are data that constrains no answer (an ``examples`` object's ``const`` is no keyword).
_ANNOTATIONS = frozenset({"default", "examples", "title", "description", "$comment"})


#: The keywords that count (items, characters, properties): 2.0 is the count 2 (JSON Schema takes it).
_COUNTS = frozenset({"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"})
#: The keywords whose values are data (a value's ``uniqueItems`` key is no keyword).
_DATA = _ANNOTATIONS | {"const", "enum"}


def _normalized(schema: Any, where: str = "", names: bool = False) -> tuple[Any, tuple[str, int] | None]:
    """``schema`` with what constrains nothing or says a count as a float written as the compiler takes it, and
    the first integer past +-2**53 in a keyword of :data:`_VALUE_KEYWORDS` (at any depth) as ``(JSON pointer,
    value)``, None when there is none (llguidance holds them as doubles). Written: ``"uniqueItems": false`` left
    out (the compiler knows no ``uniqueItems`` and refused it), a count ``2.0`` as ``2`` (it refused it: "expected
    positive integer"); data (``const``, ``enum``, ``default``, ``examples``, ...) is left as it is. ``names``:
    ``schema`` maps names to schemas (a property called ``enum`` is no keyword)."""
    if isinstance(schema, list):
        walked = [_normalized(s, f"{where}/{i}") for i, s in enumerate(schema)]
        return [s for s, _ in walked], next((big for _, big in walked if big is not None), None)
    if not isinstance(schema, dict):
        return schema, None
    out, first = {}, None
    for k, v in schema.items():
        at, big = f"{where}/{k}", None
        if names:
            v, big = _normalized(v, at)
        elif k == "uniqueItems" and v is False:
            continue
        elif k in _COUNTS and isinstance(v, float) and v.is_integer() and v >= 0:
            v = int(v)
        elif k in _VALUE_KEYWORDS:
            big = _inexact_integer(v, at)
        elif k not in _DATA:
            v, big = _normalized(v, at, k in _NAMED_SCHEMAS and isinstance(v, dict))
        out[k] = v
        first = big if first is None else first
    return out, first


def _inexact_integer(value: Any, where: str) -> tuple[str, int] | None:
    """The first integer past +-2**53 in ``value`` (a keyword's data, at any depth) as ``(JSON pointer, value)``;
    None when there is none."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (where, value) if abs(value) > _EXACT else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = _inexact_integer(v, f"{where}/{k}")
        if found is not None:
            return found
    return None


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar: ``template`` is a matcher in its start state (copied per sequence, never advanced);
    ``vocab_size``: tokens of the tokenizer it was compiled for; ``width``: the model's logits (>= ``vocab_size``);
    ``eos_ids``: the tokens that end a sequence, allowed where the grammar accepts."""

    spec: GrammarSpec
    template: Any
    vocab_size: int
    width: int
    eos_ids: tuple[int, ...]
    forget: Callable[[], None] = field(default=lambda: None, compare=False, repr=False)
    """Drops it from its compiler's cache: the copies of ``template`` share llguidance's lexer state, so once one
    ran past a limit of the engine every copy fails (a :class:`~hsd_opt.errors.GrammarStopped`)."""
    fresh: Callable[[], Any] | None = field(default=None, compare=False, repr=False)
    """A new matcher in the start state that shares nothing with ``template``'s copies (built anew: milliseconds
    to seconds, as the compile); None: none can be built."""


class _TokenList:
    """A tokenizer as llguidance reads one: every token's bytes, the special tokens, and a function that
    tokenizes bytes (the tokens the grammar forces are the tokenizer's own split of the forced text)."""

    def __init__(self, tokens: Sequence[bytes], eos_id: int, encode, special: Sequence[int] = (),
                 bos_id: int | None = None):
        self.tokens = list(tokens)
        self.eos_token_id = int(eos_id)
        self.bos_token_id = bos_id
        self.special_token_ids = [int(t) for t in special]
        self._encode = encode

    def __call__(self, data: bytes | str) -> list[int]:
        return list(self._encode(data.encode() if isinstance(data, str) else data))


def _ll_tokenizer(tokenizer, eos_ids: list[int]):
    """llguidance's tokenizer of ``tokenizer``: a Hugging Face fast tokenizer or one read directly from its
    ``tokenizer.json`` (:class:`~hsd_opt.models.tokenizer.DirectTokenizer`), or an object with ``tokens``
    (bytes per id), ``encode_bytes`` (bytes -> ids) and ``special_ids`` (a test's small tokenizer)."""
    need("llguidance", what="a JSON schema or grammar")
    import llguidance

    direct = getattr(tokenizer, "direct", False)    # tokenizer.json read directly (hsd_opt.models.tokenizer)
    if not direct and hasattr(tokenizer, "encode_bytes"):
        wrapped = _TokenList(tokenizer.tokens, eos_ids[0], tokenizer.encode_bytes,
                             getattr(tokenizer, "special_ids", ()))
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapped), eos_token=eos_ids)
    try:
        if direct:       # what llguidance.hf.from_tokenizer gives a transformers tokenizer, without transformers
            backend = copy.copy(tokenizer.backend_tokenizer)
            backend.no_padding()
            backend.no_truncation()
            return llguidance.LLTokenizer(backend.to_str(), eos_token=eos_ids)
        import llguidance.hf

        return llguidance.hf.from_tokenizer(tokenizer, eos_token=eos_ids)
    except Exception as e:  # noqa: BLE001 - llguidance reads the tokenizer's own JSON: any failure means "cannot"
        raise HsdError(f"structured output needs a tokenizer llguidance reads (a Hugging Face fast tokenizer of "
                       f"BPE or byte-level kind): {_one_line(str(e)) or type(e).__name__}") from None


def _one_line(message: str) -> str:
    """A compiler's message (it may draw the place of an error over several lines) on one line."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def _said(message: str) -> str:
    """The compiler's ``message`` on one line, its advice to set one of its options (which the spec refuses,
    ``x-guidance``) put as what to write instead."""
    line = _one_line(message)
    if "coerce_one_of" in line:
        return ("oneOf: only branches that no value can match two of are taken (llguidance cannot make sure that "
                "exactly one matches); where a value may match several, write anyOf")
    return line


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` s for one tokenizer (see the module doc). The tokenizer's tables are built at
    the first compile (about half a second for a 49,152-token vocabulary), then kept.

    Args:
        tokenizer: a Hugging Face fast tokenizer (or a test's small one, see :func:`_ll_tokenizer`).
        eos_ids: the tokens that end a sequence (allowed only where the grammar accepts).
        vocab_size: the width of the model's logits (may exceed the tokenizer's; the extra ids are never allowed).
        max_positions: the model's context (None: not known); a grammar that forces more tokens from its start is
            refused (no answer under it can end).
    """

    def __init__(self, tokenizer, eos_ids: int | Sequence[int], vocab_size: int, max_positions: int | None = None):
        ids = [int(eos_ids)] if isinstance(eos_ids, int) else [int(e) for e in eos_ids]
        if not ids:
            raise HsdError("structured output needs the model's end-of-sequence token (it has none)")
        self.eos_ids = tuple(ids)
        self.vocab_size = int(vocab_size)
        self.max_positions = max_positions
        self._source = tokenizer
        self._tokenizer = None
        self._unreadable: HsdError | None = None     # why the tables cannot be built, once found (not tried again)
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._lock = threading.Lock()   # the server compiles in worker threads: the cache is one for all of them

    def tokenizer(self):
        """llguidance's tables of the tokenizer, built on first use; an :class:`HsdError` when it cannot read it
        (found once: every later call raises the same error without trying again)."""
        with self._lock:
            if self._unreadable is not None:
                raise HsdError(str(self._unreadable))
            if self._tokenizer is None:
                try:
                    tok = _ll_tokenizer(self._source, list(self.eos_ids))
                    if tok.vocab_size > self.vocab_size:
                        raise HsdError(f"the tokenizer has {tok.vocab_size} tokens, more than the model's "
                                       f"{self.vocab_size} logits")
                except HsdError as e:
                    self._unreadable = e
                    raise
                self._tokenizer = tok
            return self._tokenizer

    def compile(self, spec: GrammarSpec) -> Grammar:
        """``spec`` compiled (from the cache when seen before); an :class:`HsdError` naming ``spec.source`` and
        the problem when it does not compile."""
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                return hit if hit.spec == spec else replace(hit, spec=spec)     # named as this caller names it
        need("llguidance", what="a JSON schema or grammar")
        import llguidance

        if spec.kind not in KINDS:
            raise HsdError(f"{spec.source}: unknown grammar kind {spec.kind!r} (expected one of {', '.join(KINDS)})")
        try:
            if spec.kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.text, overrides=JSON_LAYOUT)
            elif spec.kind == "json_object":
                grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_LAYOUT)
            elif spec.kind == "lark":
                grammar = llguidance.LLMatcher.grammar_from_lark(spec.text)
            else:
                grammar = llguidance.LLMatcher.grammar_from_regex(spec.text)
        except (ValueError, TypeError) as e:
            raise HsdError(f"{spec.source}: {_said(str(e))}") from None
        tokenizer = self.tokenizer()
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise HsdError(f"{spec.source}: {_said(template.get_error())}")
        _check_start(template, spec, self.max_positions)
        out = Grammar(spec, template, tokenizer.vocab_size, self.vocab_size, self.eos_ids,
                      forget=functools.partial(self._forget, spec.key, template),
                      fresh=functools.partial(llguidance.LLMatcher, tokenizer, grammar, log_level=0))
        with self._lock:
            self._cache[spec.key] = out
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return out

    def _forget(self, key: tuple[str, str], template: Any) -> None:
        """Drop the cached grammar of ``key`` if it is still the one of ``template`` (see :attr:`Grammar.forget`)."""
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit.template is template:
                del self._cache[key]


def _check_start(template, spec: GrammarSpec, max_positions: int | None = None) -> None:
    """Refuse a grammar no output can follow, found where its decoding would fail at once: its first mask (rules
    that refer to each other without end allow no first token) and the tokens it forces from its start (an object
    whose required property holds itself forces an opening without end), computed on a copy of ``template``; and
    one that forces more than ``max_positions`` tokens (without taking them: their cost grows faster than their
    count, seconds for tens of thousands)."""
    probe = template.deep_copy()
    probe.compute_logit_bias()
    if not probe.is_error():
        forced = probe.compute_ff_tokens()
        if max_positions is not None and len(forced) > max_positions:
            raise HsdError(f"{spec.source}: it forces {len(forced)} tokens from its start, more than the model's "
                           f"context of {max_positions}: no answer under it can end")
        if forced and not probe.is_error():
            probe.try_consume_tokens(forced)
    if probe.is_error():
        why = _one_line(probe.get_error().split("<state>")[0])
        raise HsdError(f"{spec.source}: no output can follow it from its start ({why})")


def compiler_for(loaded) -> GrammarCompiler:
    """A :class:`GrammarCompiler` for a loaded model (:class:`~hsd_opt.models.loading.LoadedModel`): its tokenizer,
    its end-of-sequence ids and its LM head's rows (the width of every engine's logits over it)."""
    from hsd_opt.models.loading import eos_token_ids, model_positions

    width = loaded.model.get_output_embeddings().weight.shape[0]
    return GrammarCompiler(loaded.tokenizer, eos_token_ids(loaded), width, model_positions(loaded.model.config))


def schema_grammars(compiler: GrammarCompiler, items, source: str) -> dict[int, Grammar]:
    """The compiled grammar of every prompt item with a JSON ``schema`` (:class:`~hsd_opt.prompts.PromptItem`), by
    item index; a schema that does not compile is an :class:`HsdError` naming ``source`` and the prompt."""
    return {it.index: compiler.compile(GrammarSpec.json_schema(it.schema, f'{source}, {it.place}, "schema"'))
            for it in items if it.schema is not None}
