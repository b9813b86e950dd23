"""Structured output: grammars compile or are refused with the problem named; a sequence's grammar state gives the
tokens allowed after each prefix; decoding under a grammar follows it, and HSD under a grammar is lossless against
masked autoregressive decoding (greedy token for token at every depth, alone and in a batch; sampled, the masked
model's distribution, which a wrong sampler fails)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from hsd_opt.engine.layered import LayeredLM
from hsd_opt.errors import GrammarStopped, HsdError
from hsd_opt.grammar.compiler import GrammarCompiler, GrammarSpec
from hsd_opt.grammar.constraint import Constraint
from hsd_opt.runtime.batch import generate_many
from hsd_opt.runtime.decode import HSD, Level
from hsd_opt.runtime.sampling import process_logits
from tests.helpers import (
    JSON_TOKENS,
    AbstainingCycleDrafter,
    CycleDrafter,
    TinyTokenizer,
    chi_square_pvalue,
    make_tiny_llama,
    stepwise_greedy,
)

EOS = 2
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"}, "tag": {"enum": ["ab", "cd"]}},
    "required": ["name", "n", "ok", "tag"], "additionalProperties": False}


@pytest.fixture(scope="module")
def json_tok():
    return TinyTokenizer(JSON_TOKENS)


@pytest.fixture(scope="module")
def compiler(json_tok):
    return GrammarCompiler(json_tok, EOS, 64)


@pytest.fixture(scope="module")
def engine():
    return LayeredLM(make_tiny_llama(seed=3, vocab_size=64, layers=4, hidden=64, heads=4, kv_heads=2, scale=8.0))


def _schema(compiler):
    return compiler.compile(GrammarSpec.json_schema(SCHEMA, "schema.json"))


def _stops_at(grammar, tokens: list[int]) -> int | None:
    """How many of ``tokens`` a fresh sequence under ``grammar`` takes before the engine stops (a
    :class:`GrammarStopped`), None if it takes them all; the error is one line naming the grammar's source."""
    c = Constraint(grammar)
    for n in range(len(tokens) + 1):
        try:
            c.bits(tokens, n)
        except GrammarStopped as e:
            assert str(e).startswith(f"{grammar.spec.source}: the grammar engine (llguidance) cannot follow it past ")
            assert "\n" not in str(e) and "<state>" not in str(e) and e.source == grammar.spec.source
            return n
    return None


@pytest.mark.parametrize("schema, text", [
    # llguidance's lexer runs out of expressions some tokens in (the pattern compiles and passes the start check)
    ({"type": "string", "pattern": "^((a{0,100}){0,100}){0,100}$"}, '"' + "a" * 60),
    # its parser's row limit, met on the first token the mask allows (500 optional properties)
    ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)}}, '{}'),
])
def test_a_grammar_past_the_engines_limits_stops_with_one_line_and_does_not_spoil_the_next_sequence(
        compiler, json_tok, schema, text):
    """A limit of the grammar engine met while decoding is a :class:`GrammarStopped` naming the grammar's source
    in one line (it was an ``HsdError`` ending in a dump of the engine's state and grammar, 14 KB for 500
    properties), and the cached grammar it came from is dropped: its copies share the engine's lexer state, so
    every later sequence with that schema failed at once (after 0 tokens) until the cache let it go."""
    ids = {t: i for i, t in enumerate(JSON_TOKENS)}
    tokens = [ids[ch] for ch in text]
    spec = GrammarSpec.json_schema(schema, "limit.json")
    first = _stops_at(compiler.compile(spec), tokens)
    assert first is not None
    again = compiler.compile(GrammarSpec.json_schema(schema, "response_format.json_schema.schema"))
    assert _stops_at(again, tokens) == first                    # a fresh grammar, named as the new caller names it


@pytest.mark.parametrize("spec, words", [
    (GrammarSpec.json_schema({"type": "strin"}, "schema.json"), "schema.json: Invalid type: strin"),
    (GrammarSpec.json_schema({"type": "integer", "minimum": 5, "maximum": 1}, "response_format"),
     "response_format: Unsatisfiable schema"),
    (GrammarSpec("lark", "start: foo(", "--grammar g.lark"), "--grammar g.lark: "),
    (GrammarSpec("regex", "[a-z", "--grammar r.txt"), "unclosed character class"),
    (GrammarSpec("yaml", "a: 1", "--grammar"), "unknown grammar kind 'yaml'"),
    # the compiler's advice named an option the spec refuses (x-guidance): what to write instead
    (GrammarSpec.json_schema({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "s.json"),
     "s.json: oneOf: only branches that no value can match two of are taken"),
    # compiled, but no output can follow them: refused when compiled, not while decoding
    (GrammarSpec.json_schema({"$ref": "#"}, "response_format"), "response_format: no output can follow it"),
    (GrammarSpec.json_schema({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                              "$ref": "#/$defs/a"}, "s.json"), "s.json: no output can follow it"),
    (GrammarSpec.json_schema({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                              "required": ["next"]}}, "$ref": "#/$defs/n"}, "s.json"),
     "s.json: no output can follow it"),
])
def test_a_grammar_that_does_not_compile_is_refused_naming_its_source_and_problem(compiler, spec, words):
    with pytest.raises(HsdError, match=None) as e:
        compiler.compile(spec)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_prompt_files_schema_that_does_not_compile_names_its_line_and_field(compiler, tmp_path):
    """It said ``prompt 2``, its place among the prompts (blank lines skipped), where the file's other errors say
    its line."""
    from hsd_opt.grammar.compiler import schema_grammars
    from hsd_opt.prompts import load_prompts

    path = tmp_path / "p.jsonl"
    path.write_text('\n{"prompt": "a"}\n\n{"prompt": "b", "schema": {"type": "strin"}}\n')
    with pytest.raises(HsdError, match=r'p\.jsonl, line 4, "schema": Invalid type: strin'):
        schema_grammars(compiler, load_prompts(path).items, str(path))


def test_a_grammar_that_forces_more_tokens_than_the_context_is_refused(json_tok):
    """Forced tokens are counted, not taken, beyond the model's context (taking them costs seconds by the tens of
    thousands): an answer under such a grammar could never end."""
    short = GrammarCompiler(json_tok, EOS, 64, max_positions=6)
    with pytest.raises(HsdError, match=r"s.json: it forces \d+ tokens from its start, more than the model's context "
                                       r"of 6"):
        short.compile(GrammarSpec.json_schema({"const": [1, 2, 3, 4, 5, 6, 7, 8]}, "s.json"))
    GrammarCompiler(json_tok, EOS, 64, max_positions=512).compile(
        GrammarSpec.json_schema({"const": [1, 2, 3, 4, 5, 6, 7, 8]}, "s.json"))


def test_a_schema_that_may_hold_itself_compiles(compiler, json_tok):
    """Recursion that can end (the property optional) is a grammar like any other: objects nested in it are
    followed to any depth, the output ends only after the outermost one, and a value that is no object is
    refused at each depth."""
    c = Constraint(compiler.compile(GrammarSpec.json_schema({"$defs": {"n": {"type": "object", "properties": {
        "next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}, "s.json")))
    ids = json_tok.encode('{"next": {"next": {}}}')
    assert c.allowed_prefix(ids, 0, ids + [EOS]) == len(ids) + 1
    assert not any(c.allows(ids, i, EOS) for i in range(len(ids)))
    for text in ('{"next": 1', '{"next": {"next": "'):
        bad = json_tok.encode(text)
        assert c.allowed_prefix(bad, 0, bad) == len(bad) - 1


def test_a_schema_that_is_not_json_or_not_an_object_is_refused():
    with pytest.raises(HsdError, match=r"s.json: not JSON"):
        GrammarSpec.json_schema("{nope", "s.json")
    with pytest.raises(HsdError, match=r"s.json: a JSON schema must be an object, got list"):
        GrammarSpec.json_schema([1], "s.json")
    for text in ('{"type": "number", "maximum": 1e400}', '{"type": "number", "minimum": NaN}'):
        with pytest.raises(HsdError, match=r"s.json: holds a number that is not finite"):
            GrammarSpec.json_schema(text, "s.json")


def test_a_schemas_own_compiler_options_are_refused_and_cannot_loosen_it(compiler):
    """``x-guidance`` (llguidance's options in a schema) took precedence over the layout: ``lenient`` let
    ``uniqueItems`` through unchecked (``[1, 1]`` allowed), a separator made output in another layout."""
    with pytest.raises(HsdError, match="s.json: x-guidance: the compiler's own options are not taken"):
        GrammarSpec.json_schema({"x-guidance": {"lenient": True}, "type": "array", "items": {"type": "integer"},
                                 "uniqueItems": True}, "s.json")
    with pytest.raises(HsdError, match="uniqueItems"):             # without it, refused as ever
        compiler.compile(GrammarSpec.json_schema({"type": "array", "items": {"type": "integer"},
                                                  "uniqueItems": True}, "s.json"))


def test_an_integer_a_double_cannot_hold_where_it_bounds_or_fixes_a_value_is_refused(compiler, json_tok):
    """The grammar engine holds a schema's numbers as doubles: ``const`` 12345678901234567890 gave the i64
    maximum and ``minimum``/``maximum`` 2**53 + 1 gave 2**53, answers outside the schema. Such integers are refused,
    naming where; 2**53 itself and big integers in keywords that bound no value are kept (and 2**53 is answered)."""
    for schema, where in (({"type": "integer", "const": 12345678901234567890}, "/const"),
                          ({"properties": {"a": {"minimum": 2**53 + 1, "maximum": 2**53 + 1}}},
                           "/properties/a/minimum"),
                          ({"enum": [1, [2, {"x": -2**60}]]}, "/enum/1/1/x"),
                          ({"type": "number", "exclusiveMaximum": -2**53 - 1}, "/exclusiveMaximum"),
                          ({"type": "integer", "multipleOf": 2**54 + 1}, "/multipleOf")):
        with pytest.raises(HsdError, match=f"^s.json: the integer -?[0-9]+ at {where} is beyond"):
            GrammarSpec.json_schema(schema, "s.json")
    GrammarSpec.json_schema({"type": "integer", "default": 2**70}, "s.json")
    # an example or default object's keys are data: its "const" is no keyword
    GrammarSpec.json_schema({"type": "object", "examples": [{"const": 2**60}], "default": {"enum": [2**60]}},
                            "s.json")
    # properties (and definitions) named like value keywords are names: their defaults bound nothing
    GrammarSpec.json_schema({"properties": {"enum": {"type": "integer", "default": 2**70},
                                            "minimum": {"examples": [2**60]}},
                             "$defs": {"const": {"default": 2**60}}}, "s.json")
    with pytest.raises(HsdError, match="at /properties/enum/maximum is beyond"):
        GrammarSpec.json_schema({"properties": {"enum": {"type": "integer", "maximum": 2**60}}}, "s.json")
    grammar = compiler.compile(GrammarSpec.json_schema({"type": "integer", "const": 2**53}, "s.json"))
    seq = json_tok.encode(str(2**53)) + [EOS]
    assert Constraint(grammar).allowed_prefix([], 0, seq) == len(seq)


def test_what_constrains_nothing_or_counts_with_a_float_is_taken_as_json_schema_reads_it(compiler, json_tok):
    """``"uniqueItems": false`` (no constraint) and ``"minItems": 2.0`` (JSON Schema's count 2) were refused by the
    compiler; they compile, and the count holds. ``uniqueItems: true``, which it cannot check, is still refused,
    and a property named ``uniqueItems`` stays a property."""
    g = compiler.compile(GrammarSpec.json_schema({"type": "array", "items": {"type": "integer"}, "minItems": 2.0,
                                                  "uniqueItems": False}, "s.json"))
    assert json.loads(g.spec.text) == {"type": "array", "items": {"type": "integer"}, "minItems": 2}

    def accepted(text: str) -> bool:
        seq = json_tok.encode(text) + [EOS]
        return Constraint(g).allowed_prefix([], 0, seq) == len(seq)

    assert accepted("[1, 2]") and not accepted("[1]")
    with pytest.raises(HsdError, match="uniqueItems"):
        compiler.compile(GrammarSpec.json_schema({"type": "array", "uniqueItems": True}, "s.json"))
    named = {"type": "object", "properties": {"uniqueItems": {"const": False}}, "required": ["uniqueItems"]}
    assert json.loads(GrammarSpec.json_schema(named, "s.json").text) == named


def test_a_regex_files_spaces_are_the_patterns_own_only_its_last_line_break_is_not(tmp_path):
    from hsd_opt.commands.common import grammar_spec

    for text, pattern in ((" (yes|no)\n", " (yes|no)"), ("a+ \r\n", "a+ "), ("\tb", "\tb")):
        (tmp_path / "g.regex").write_text(text, newline="")
        spec = grammar_spec(None, tmp_path / "g.regex")
        assert (spec.kind, spec.text) == ("regex", pattern)


def test_a_sequence_beside_one_that_ran_past_the_engines_limit_goes_on_as_alone(json_tok):
    """Two requests with one schema hold copies of one cached matcher, which share llguidance's lexer state: when
    one runs past the engine's limit, the other (already decoding, or admitted later with the grammar it was given
    when parsed) goes on as it would alone, on a matcher built anew for it (it was refused an allowed token, a
    500 served, or stopped at 0 tokens), while the first stops where it stops alone."""
    compiler = GrammarCompiler(json_tok, EOS, 64)
    ids = {t: i for i, t in enumerate(JSON_TOKENS)}
    spec = GrammarSpec.json_schema({"type": "string", "pattern": "^((a{0,100}){0,100}){0,100}$"}, "s.json")
    alone = _stops_at(GrammarCompiler(json_tok, EOS, 64).compile(spec), [ids[ch] for ch in '"' + "a" * 60])
    gx, gy = compiler.compile(spec), compiler.compile(spec)          # parsed one after the other: one matcher
    y, short = Constraint(gy), [ids[ch] for ch in '"aaaa']
    assert [len(y.allowed(short, n).nonzero()) > 0 for n in range(3)] == [True] * 3
    assert _stops_at(gx, [ids[ch] for ch in '"' + "a" * 60]) == alone
    for n in range(len(short) + 1):                                    # y goes on, then a later copy of gy
        assert y.allows(short, n, short[n]) if n < len(short) else y.allowed(short, n).any()
    assert _stops_at(gy, short) is None and _stops_at(compiler.compile(spec), short) is None


def test_a_compiled_grammar_is_kept_and_its_properties_keep_their_order(compiler, json_tok):
    g = _schema(compiler)
    again = compiler.compile(GrammarSpec.json_schema(json.dumps(SCHEMA), "other source"))
    assert again.template is g.template and again.spec.source == "other source"     # kept, named as asked
    c, forced = Constraint(g), []
    while (t := c.only(forced, len(forced))) is not None:         # the tokens the grammar forces at the start
        forced.append(t)
    assert json_tok.decode(forced).startswith('{"name')


def test_a_tokenizer_llguidance_cannot_read_is_tried_once_and_every_compile_says_why(monkeypatch):
    """A tokenizer whose tables cannot be built fails the first compile with the reason, and every later one with
    the same reason without building them again (each structured request on such a server retried it)."""
    import hsd_opt.grammar.compiler as compiler_module

    tries = []

    def unreadable(tokenizer, eos_ids):
        tries.append(tokenizer)
        raise HsdError("structured output needs a tokenizer llguidance reads: not this one")

    monkeypatch.setattr(compiler_module, "_ll_tokenizer", unreadable)
    compiler = GrammarCompiler(object(), EOS, 64)
    for _ in range(3):
        with pytest.raises(HsdError, match="needs a tokenizer llguidance reads: not this one"):
            compiler.compile(GrammarSpec.json_schema({"type": "object"}, "schema.json"))
        with pytest.raises(HsdError, match="not this one"):
            compiler.tokenizer()
    assert len(tries) == 1


def test_the_cache_of_compiled_grammars_is_safe_across_threads(json_tok, monkeypatch):
    """The server compiles in worker threads: one thread's hit and another's eviction of the same entry between the
    lookup and its move to the end was a KeyError (a 500). A lookup that dwells is here made to meet an eviction."""
    import threading
    import time

    import hsd_opt.grammar.compiler as compiler_module

    monkeypatch.setattr(compiler_module, "CACHE_SIZE", 1)
    comp = GrammarCompiler(json_tok, EOS, 64)
    first = comp.compile(GrammarSpec.json_schema({"type": "integer"}, "a"))
    inside = threading.Event()

    class Dwelling(type(comp._cache)):
        def get(self, key, default=None):
            hit = super().get(key, default)
            if threading.current_thread() is not threading.main_thread():
                inside.set()
                time.sleep(0.3)             # the other compile evicts the entry now, unless the cache is locked
            return hit

    comp._cache = Dwelling(comp._cache)
    got, errors = [], []

    def hit():
        try:
            got.append(comp.compile(GrammarSpec.json_schema({"type": "integer"}, "a")))
        except Exception as e:  # noqa: BLE001 - the failure under test
            errors.append(e)

    t = threading.Thread(target=hit)
    t.start()
    assert inside.wait(10)
    comp.compile(GrammarSpec.json_schema({"type": "boolean"}, "b"))      # evicts "a" (one entry kept)
    t.join()
    assert not errors and got == [first]


def test_allowed_rows_follow_a_valid_output_and_end_only_where_the_grammar_accepts(compiler, json_tok):
    text = '{"name": "ab", "n": 10, "ok": true, "tag": "cd"}'
    ids = json_tok.encode(text)
    c = Constraint(_schema(compiler))
    for i, t in enumerate(ids):
        row = c.allowed(ids, i)
        assert row.shape == (64,) and row.dtype == torch.bool
        assert row[t], (i, t)
        assert not row[EOS] and not row[0] and not row[1]          # no special token inside, no end before it
    assert c.allowed(ids, len(ids)).nonzero().flatten().tolist() == [EOS]
    assert c.accepting(ids) and not c.accepting(ids[:-1])
    assert c.allowed_prefix(ids, 0, ids + [EOS]) == len(ids) + 1
    bad = json_tok.encode('{"nope"')                            # '{"', 'n' (of "n"), then 'o'
    assert c.allowed_prefix(bad, 0, bad) == 2


def test_rows_after_a_changed_prefix_are_computed_again_not_kept(compiler, json_tok):
    a = json_tok.encode('{"name": "ab", "n": 1')
    b = json_tok.encode('{"name": "abcdef", "n": 2')
    kept = Constraint(_schema(compiler))
    for i in range(len(a) + 1):
        kept.allowed(a, i)
    for seq in (b, a, b):
        fresh = Constraint(_schema(compiler))
        for i in range(len(seq) + 1):
            assert torch.equal(kept.allowed(seq, i), fresh.allowed(seq, i)), i


def test_the_bits_answer_what_the_rows_say_token_by_token(compiler, json_tok):
    """allows() and only() read the packed bits; the boolean row is made from the same bits: they must agree for
    every token id of the logits' width (ids past the tokenizer's never allowed), at every prefix, after a changed
    prefix and after the end of sequence."""
    a = json_tok.encode('{"name": "ab", "n": 10, "ok": true, "tag": "cd"}') + [EOS]
    b = json_tok.encode('{"name": "abcdef", "n": 2')
    c = Constraint(_schema(compiler))
    seen_only = 0
    for seq in (a, b, a):
        for i in range(len(seq) + 1 if seq[-1] != EOS else len(seq)):
            row = c.allowed(seq, i)
            assert [c.allows(seq, i, t) for t in range(-1, c.vocab_size + 3)] == \
                [False] + row.tolist() + [False] * 3, i
            ids = row.nonzero().flatten().tolist()
            assert c.only(seq, i) == (ids[0] if len(ids) == 1 and ids[0] != EOS else None), i
            seen_only += c.only(seq, i) is not None
    assert seen_only > 3                           # the schema forces its keys' tokens: the test sees one-token rows
    after_end = a + [5]
    assert c.allowed(after_end, len(a)).nonzero().flatten().tolist() == [EOS] and c.only(after_end, len(a)) is None


def _levels(engine):
    return {
        "ar": ([Level("layer4", engine, 4)], []),
        "exit": ([Level("layer2", engine, 2), Level("layer4", engine, 4)], [3]),
        "cycle-exit": ([Level("cycle", drafter=CycleDrafter(64)), Level("layer2", engine, 2),
                        Level("layer4", engine, 4)], [2, 3]),
        "abstaining": ([Level("abst", drafter=AbstainingCycleDrafter(64)), Level("layer1", engine, 1),
                        Level("layer4", engine, 4)], [3, 2]),
    }


PROMPTS = [[5, 9, 13], [40, 41, 42, 43, 44], [7]]


def test_greedy_output_follows_the_schema(compiler, json_tok, engine):
    levels, budgets = _levels(engine)["ar"]
    for prompt in PROMPTS:
        out = HSD(levels, budgets, eos_ids=[EOS]).generate(prompt, 80, constraint=Constraint(_schema(compiler)))
        assert out.token_ids[-1] == EOS, json_tok.decode(out.token_ids)
        value = json.loads(json_tok.decode(out.token_ids))
        assert list(value) == ["name", "n", "ok", "tag"] and len(value["name"]) <= 6
        assert 0 <= value["n"] <= 99 and isinstance(value["ok"], bool) and value["tag"] in ("ab", "cd")


def test_unconstrained_greedy_output_is_not_json_here(compiler, json_tok, engine):
    """The check above can fail: without the grammar this model writes no such object."""
    levels, budgets = _levels(engine)["ar"]
    out = HSD(levels, budgets, eos_ids=[EOS]).generate(PROMPTS[0], 40)
    with pytest.raises(ValueError):
        json.loads(json_tok.decode(out.token_ids))


def _stepwise_masked_greedy(eng, prompt, n, grammar):
    """Masked greedy decoding one step at a time, read off the engine's logits: the reference."""
    return stepwise_greedy(eng, prompt, n, eos=(EOS,), constraint=Constraint(grammar))


def test_masked_decoding_equals_the_stepwise_reference_and_skips_the_forced_tokens_passes(compiler, engine):
    """Where the grammar allows one token only, the target's pass is not run for it (its next pass computes that
    position too, the same numbers): fewer target passes than tokens, the same tokens as one masked step each."""
    levels, budgets = _levels(engine)["ar"]
    for prompt in PROMPTS:
        ref = _stepwise_masked_greedy(engine, prompt, 60, _schema(compiler))
        d = HSD(levels, budgets, eos_ids=[EOS]).start(prompt, 60, constraint=Constraint(_schema(compiler)))
        passes: list = []
        try:
            out = d.run(on_pass=passes.append)
        finally:
            d.close()
        assert out.token_ids == ref
        assert len(passes) < 0.8 * len(ref), (len(passes), len(ref))


@pytest.mark.parametrize("kind", ["exit", "cycle-exit", "abstaining"])
def test_greedy_hsd_under_a_grammar_equals_masked_autoregressive_decoding(compiler, engine, kind):
    ar_levels, _ = _levels(engine)["ar"]
    levels, budgets = _levels(engine)[kind]
    for prompt in PROMPTS:
        ref = HSD(ar_levels, [], eos_ids=[EOS]).generate(prompt, 60, constraint=Constraint(_schema(compiler)))
        out = HSD(levels, budgets, eos_ids=[EOS]).generate(prompt, 60, constraint=Constraint(_schema(compiler)))
        assert out.token_ids == ref.token_ids, (kind, prompt)


def _subset_heads(model, layers, ids):
    """Reduced-vocabulary exit heads (``hsd heads train --vocab-subset``, untrained: the logit lens on ``ids``):
    ``-inf`` at every other token."""
    from hsd_opt.heads import TranslatorHead

    return LayeredLM(model, {b: TranslatorHead(model, vocab_ids=torch.tensor(ids)) for b in layers})


def test_greedy_hsd_with_heads_that_cannot_propose_what_the_grammar_allows_is_the_targets(compiler):
    """Drafting heads over letters only, under a schema whose structure ('{', '"', digits ...) lies outside them:
    their masked rows held no token, so they drafted token 0 and the grammar refused it (an error, exit 2);
    such a row drafts from the allowed tokens and the output is the masked target's."""
    model = make_tiny_llama(seed=3, vocab_size=64, layers=4, hidden=64, heads=4, kv_heads=2, scale=8.0)
    letters = [i for i, t in enumerate(JSON_TOKENS) if t.isalpha() and len(t) == 1]
    lm = _subset_heads(model, (1, 2), letters)
    ar = HSD([Level("layer4", LayeredLM(model), 4)], [], eos_ids=[EOS])
    h = HSD([Level("layer1", lm, 1), Level("layer2", lm, 2), Level("layer4", lm, 4)], [2, 3], eos_ids=[EOS])
    for prompt in PROMPTS:
        ref = ar.generate(prompt, 60, constraint=Constraint(_schema(compiler)))
        assert h.generate(prompt, 60, constraint=Constraint(_schema(compiler))).token_ids == ref.token_ids


def test_log_probabilities_under_a_grammar_are_the_raw_targets_and_change_no_token(compiler, engine):
    """Under a grammar (forced tokens included, which a lone target otherwise takes without a pass), the tokens
    with log-probabilities are the masked decoding's, and each value is the target's unmasked log-softmax there."""
    from tests.helpers import engine_logits

    for kind in ("ar", "cycle-exit"):
        levels, budgets = _levels(engine)[kind]
        for prompt in PROMPTS[:2]:
            ref = _stepwise_masked_greedy(engine, prompt, 60, _schema(compiler))
            res = HSD(levels, budgets, eos_ids=[EOS]).generate(prompt, 60, constraint=Constraint(_schema(compiler)),
                                                                logprobs=2)
            assert res.token_ids == ref
            rows = torch.log_softmax(engine_logits(engine, torch.tensor(prompt + ref), len(prompt)), -1)
            rows = rows[len(prompt) - 1:]
            assert [e.logprob for e in res.logprobs] == [float(rows[i, t]) for i, t in enumerate(ref)]
            assert [[v for _, v in e.top] for e in res.logprobs] == [rows[i].topk(2).values.tolist()
                                                                     for i in range(len(ref))]


def test_greedy_under_a_grammar_in_a_batch_equals_alone(compiler, engine):
    """Sequences with and without a grammar share passes; each gets what it gets alone."""
    levels, budgets = _levels(engine)["cycle-exit"]
    h = HSD(levels, budgets, eos_ids=[EOS])
    prompts = PROMPTS + [[11, 12]]
    constraints = [Constraint(_schema(compiler)), None, Constraint(_schema(compiler)), None]
    alone = [h.generate(p, 50, constraint=Constraint(_schema(compiler)) if c is not None else None).token_ids
             for p, c in zip(prompts, constraints)]
    together = generate_many(h, prompts, 50, max_active=4, constraints=constraints)
    assert [r.token_ids for r in together] == alone


# ---------------------------------------------------------------------------------------------- sampling

V, K, N = 12, 2, 1000
PROMPT = [3, 5, 7]
#: tokens of the sampled test: the special three, then letters and pieces of two
SMALL_TOKENS = ["<pad>", "<s>", "</s>", "a", "b", "c", "ab", "bc", "ca", "x", "y", "z"]
FORCED_REGEX = "ab[abxyz]{1,3}"     # "ab" first, then a choice
REGEX = "[abxy]{2,4}"      # refuses c, bc, ca and z, which hold half the unmasked first token's mass


@pytest.fixture(scope="module")
def peaky():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    model = make_tiny_llama(seed=0, vocab_size=V, layers=4, scale=15.0)
    yield model, LayeredLM(model)
    torch.set_num_threads(n)


def _exact_masked(model, grammar):
    """The probability of every K-token output under the model's logits masked by the grammar at each prefix,
    then processed (temperature 1, top-p 1): masked autoregressive sampling, computed exactly."""
    c = Constraint(grammar)
    out = {}
    for first in range(V):
        with torch.no_grad():
            lg = model(torch.tensor([PROMPT + [first]])).logits[0, -2:]
        p1 = process_logits(lg[:1].masked_fill(~c.allowed([], 0)[None], float("-inf")), 1.0, 1.0)[0]
        if p1[first] == 0:
            continue
        p2 = process_logits(lg[1:].masked_fill(~c.allowed([first], 1)[None], float("-inf")), 1.0, 1.0)[0]
        for x in range(V):
            out[(first, x)] = float(p1[first]) * float(p2[x])
    return out


def _pvalue(draw, probs):
    samples = [tuple(draw(seed)) for seed in range(N)]
    assert all(len(ids) == K and probs[ids] > 0 for ids in samples)       # never a token the grammar refuses
    return chi_square_pvalue(samples, probs)


@pytest.mark.slow
def test_sampling_under_a_grammar_has_the_masked_models_distribution_and_a_wrong_sampler_fails(peaky):
    model, lm = peaky
    grammar = GrammarCompiler(TinyTokenizer(SMALL_TOKENS), EOS, V).compile(GrammarSpec("regex", REGEX))
    probs = _exact_masked(model, grammar)
    assert sum(probs.values()) == pytest.approx(1.0, abs=1e-5)
    assert all(probs.get((a, b), 0) == 0 for a, b in itertools.product((5, 7, 8, 11), range(V)))   # c bc ca z
    levels = [Level("cycle", drafter=CycleDrafter(V, step=1)), Level("layer1", lm, 1), Level("layer2", lm, 2),
              Level("layer4", lm, 4)]

    def draw(h):
        return lambda seed: h.generate(PROMPT, K, temperature=1.0, seed=seed,
                                       constraint=Constraint(grammar)).token_ids

    p_ok = _pvalue(draw(HSD(levels, [2, 2, 3])), probs)
    p_bad = _pvalue(draw(HSD([levels[1], levels[3]], [3], residual=False)), probs)
    assert p_ok > 1e-3, p_ok
    assert p_bad < 1e-6, p_bad


@pytest.mark.slow
def test_sampling_with_heads_that_cannot_propose_what_the_grammar_allows_keeps_the_masked_distribution(peaky):
    """Drafting heads whose vocabulary (c, bc, ca, z) the grammar refuses everywhere: every draft row was empty
    ("every token of a row is masked", an error); drawn from the allowed tokens instead, a proper draft
    distribution, the output has the masked target's distribution."""
    model, _ = peaky
    grammar = GrammarCompiler(TinyTokenizer(SMALL_TOKENS), EOS, V).compile(GrammarSpec("regex", REGEX))
    lm = _subset_heads(model, (1, 2), [5, 7, 8, 11])
    h = HSD([Level("layer1", lm, 1), Level("layer2", lm, 2), Level("layer4", lm, 4)], [2, 3])
    p = _pvalue(lambda seed: h.generate(PROMPT, K, temperature=1.0, seed=seed,
                                        constraint=Constraint(grammar)).token_ids, _exact_masked(model, grammar))
    assert p > 1e-3, p


@pytest.mark.slow
def test_sampling_where_the_grammar_forces_a_token_keeps_the_masked_distribution(peaky):
    """A forced first token is every level's draw without a pass (its draft row one-hot): the second token's
    distribution is still the masked model's after it."""
    model, lm = peaky
    grammar = GrammarCompiler(TinyTokenizer(SMALL_TOKENS), EOS, V).compile(GrammarSpec("regex", FORCED_REGEX))
    assert Constraint(grammar).only([], 0) is not None               # the first token is forced
    probs = _exact_masked(model, grammar)
    levels = [Level("layer1", lm, 1), Level("layer2", lm, 2), Level("layer4", lm, 4)]
    ok = HSD(levels, [2, 3])
    bad = HSD([levels[0], levels[2]], [3], residual=False)

    def draw(h):
        return lambda seed: h.generate(PROMPT, K, temperature=1.0, seed=seed,
                                       constraint=Constraint(grammar)).token_ids

    assert _pvalue(draw(ok), probs) > 1e-3
    assert _pvalue(draw(bad), probs) < 1e-6


def test_a_seeded_sample_through_forced_tokens_is_the_same_with_logprobs_and_in_a_batch():
    """Where the grammar allows one token, a level takes it without a draw. The target alone with
    log-probabilities, or in a batch whose prompt pass is deferred (a 70-token prompt), runs the pass anyway: the
    token must still be taken without a draw, or every later draw of the seed moves (it did, for every seed)."""
    from tests.helpers import make_tiny_llama

    tok = TinyTokenizer(["<pad>", "<s>", "</s>", "a", "b", "c", "ab", "bc", "ca", "x", "y", "z"])
    grammar = GrammarCompiler(tok, EOS, 12).compile(GrammarSpec("regex", "ab[abxyz]{1,3}c[abxyz]{2,6}"))
    lm = LayeredLM(make_tiny_llama(seed=0, vocab_size=12, layers=4, scale=15.0))
    h = HSD([Level("t", lm, 4)], [], eos_ids=[EOS])
    for prompt in ([3, 5, 7], [3, 5, 7, 9] * 17 + [3, 5]):
        for seed in range(6):
            alone = h.generate(prompt, 10, temperature=1.0, seed=seed, constraint=Constraint(grammar)).token_ids
            assert alone[0] == 6 and tok.decode(alone).startswith("ab")          # the forced token
            lp = h.generate(prompt, 10, temperature=1.0, seed=seed, constraint=Constraint(grammar), logprobs=0)
            batched = generate_many(h, [prompt], 10, temperature=1.0, seeds=[seed],
                                    constraints=[Constraint(grammar)])[0]
            assert lp.token_ids == alone and batched.token_ids == alone, (prompt[:4], seed)
