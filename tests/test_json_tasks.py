"""The JSON-schema tasks shipped for structured output (``hsd_opt/data/json_tasks.jsonl``): every line is a task
with a name, a category, a prompt, a schema and an example; every schema is finite enough for a small model to finish
(bounded strings and arrays); every schema compiles with the project's grammar code, and its example, written in the
grammar's layout and tokenized by the embedded model's tokenizer, is accepted token by token and then ended; a
mutated example (a required key dropped, a value outside an enum, an extra key, too long a string or array) is
refused."""

from __future__ import annotations

import json
import re
from collections import Counter
from importlib.resources import files

import pytest

from hsd_opt.grammar.compiler import GrammarCompiler, GrammarSpec
from hsd_opt.grammar.constraint import Constraint

CATEGORIES = ("extraction", "tool_call", "api_response", "classification", "form", "config")
KEYS = {"name": str, "category": str, "prompt": str, "schema": dict, "example": object}
EOS = 2
VOCAB = 49152
#: Most tokens an example may take (the tasks are sized for a 135M model to finish within ~200 tokens).
MAX_EXAMPLE_TOKENS = 200
#: Formats whose strings are bounded by themselves.
BOUNDED_FORMATS = {"date", "date-time", "time"}


def _load() -> list[dict]:
    text = (files("hsd_opt") / "data" / "json_tasks.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


TASKS = _load()
BY_NAME = {t["name"]: t for t in TASKS}


def _subschemas(schema):
    """Every schema nested in ``schema`` (itself included): properties, items, anyOf members and $defs."""
    yield schema
    for key in ("properties", "$defs"):
        for sub in schema.get(key, {}).values():
            yield from _subschemas(sub)
    if isinstance(schema.get("items"), dict):
        yield from _subschemas(schema["items"])
    for sub in schema.get("anyOf", []):
        yield from _subschemas(sub)


def _text(value) -> str:
    """``value`` in the grammar's JSON layout (``", "`` and ``": "``, no other white space)."""
    return json.dumps(value, ensure_ascii=False)


@pytest.fixture(scope="module")
def compiler(embedded):
    return GrammarCompiler(embedded.tokenizer, [EOS], VOCAB)


def _accepted(embedded, compiler, schema, value) -> tuple[int, int]:
    """How many tokens of ``value`` (then the end of sequence) the schema's grammar allows in a row, and how many
    there are."""
    grammar = compiler.compile(GrammarSpec.json_schema(schema))
    ids = embedded.tokenizer.encode(_text(value), add_special_tokens=False) + [EOS]
    return Constraint(grammar).allowed_prefix(ids, 0, ids), len(ids)


# ------------------------------------------------------------------------------------------------ the file itself

def test_every_line_is_a_task_with_the_keys_and_types():
    assert len(TASKS) >= 50
    for t in TASKS:
        assert set(t) == set(KEYS), t.get("name")
        for key, kind in KEYS.items():
            assert isinstance(t[key], kind), (t["name"], key)
        assert re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", t["name"]), t["name"]
        assert t["category"] in CATEGORIES, t["name"]
        assert t["prompt"].strip() and len(t["prompt"]) <= 600, t["name"]
        assert "json" in t["prompt"].lower(), t["name"]


def test_names_are_unique_and_every_category_has_about_ten_tasks():
    names = [t["name"] for t in TASKS]
    assert len(names) == len(set(names))
    counts = Counter(t["category"] for t in TASKS)
    assert set(counts) == set(CATEGORIES)
    assert all(8 <= n <= 12 for n in counts.values()), counts


def test_the_schemas_vary_and_use_the_features_named():
    text = "\n".join(json.dumps(t["schema"]) for t in TASKS)
    for feature in ('"anyOf"', '"$ref"', '"$defs"', '"const"', '"enum"', '"pattern"', '"format": "date"',
                    '"format": "date-time"', '"format": "email"', '"format": "uri"', '"minimum"', '"minItems"'):
        assert feature in text, feature
    sizes = [len(t["schema"].get("properties", {})) for t in TASKS]
    assert min(sizes) <= 2 and max(sizes) >= 6


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_every_schema_is_finite(name):
    """Objects are closed, free strings have a maxLength, arrays at most 5 items."""
    for sub in _subschemas(BY_NAME[name]["schema"]):
        kind = sub.get("type")
        if kind == "object":
            assert sub.get("additionalProperties") is False, (name, sub)
            assert set(sub.get("required", [])) <= set(sub["properties"]), (name, sub)
        elif kind == "array":
            assert 1 <= sub.get("maxItems", 0) <= 5, (name, sub)
        elif kind == "string" and "enum" not in sub and "maxLength" not in sub:
            bounded_pattern = "pattern" in sub and not re.search(r"(?<!\\)[*+]|\{\d+,\}", sub["pattern"])
            assert sub.get("format") in BOUNDED_FORMATS or bounded_pattern, (name, sub)


# ------------------------------------------------------------------------------------- the grammar and the examples

@pytest.mark.embedded
@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_the_example_is_accepted_token_by_token_then_ended(embedded, compiler, name):
    t = BY_NAME[name]
    n, total = _accepted(embedded, compiler, t["schema"], t["example"])
    assert n == total, f"{name}: refused after {n} of {total} tokens of {_text(t['example'])}"
    assert total - 1 <= MAX_EXAMPLE_TOKENS, (name, total)


def _drop_required(value, schema):
    out = dict(value)
    del out[schema["required"][0]]
    return out


def _mutations():
    """(task, what is wrong, the mutated example): each must be refused."""
    t = BY_NAME
    yield "sentiment_label", "a required key dropped", _drop_required(t["sentiment_label"]["example"],
                                                                     t["sentiment_label"]["schema"])
    yield "contact_card_extraction", "a required key dropped", _drop_required(
        t["contact_card_extraction"]["example"], t["contact_card_extraction"]["schema"])
    yield "sentiment_label", "a value outside the enum", {**t["sentiment_label"]["example"], "sentiment": "angry"}
    yield "logging_config", "an extra key", {**t["logging_config"]["example"], "colour": True}
    yield "get_weather_call", "a wrong const", {**t["get_weather_call"]["example"], "name": "get_forecast"}
    yield "get_weather_call", "an integer out of bounds", {
        "name": "get_weather", "arguments": {**t["get_weather_call"]["example"]["arguments"], "days": 30}}
    yield "spam_detection", "a string instead of a boolean", {**t["spam_detection"]["example"], "is_spam": "yes"}
    yield "flight_confirmation_extraction", "a string off its pattern", {
        **t["flight_confirmation_extraction"]["example"], "origin": "Frankfurt"}
    yield "feedback_survey_form", "a string over its maxLength", {**t["feedback_survey_form"]["example"],
                                                                  "comment": "x" * 121}
    yield "news_topic", "an array over its maxItems", {**t["news_topic"]["example"],
                                                       "subtopics": ["a", "b", "c", "d"]}
    yield "meeting_extraction", "a date off its format", {**t["meeting_extraction"]["example"], "date": "9 July"}


@pytest.mark.embedded
@pytest.mark.parametrize("name,wrong,value", list(_mutations()), ids=lambda x: x if isinstance(x, str) else None)
def test_a_mutated_example_is_refused(embedded, compiler, name, wrong, value):
    assert value != BY_NAME[name]["example"]
    n, total = _accepted(embedded, compiler, BY_NAME[name]["schema"], value)
    assert n < total, f"{name}: {wrong} was accepted: {_text(value)}"
