"""Schemas that use only supported keywords but whose output under xgrammar's strict mode would
break them are refused by check_schema (services/decoder/constraints.py), each refusal proven
against xgrammar 0.2.9's matcher: the refused schema, compiled as the decoder compiles it, accepts
text that is invalid JSON or fails the schema; an accepted one does not."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import xgrammar as xgr

from services.common.errors import InvalidArgument
from services.decoder.constraints import Constraint, check_schema, pattern_problem
from services.decoder.grammar import json_schema_grammar

_INFO = xgr.TokenizerInfo(["a", "b", "</s>"], stop_token_ids=[2])
_COMPILER = xgr.GrammarCompiler(_INFO, max_threads=1, cache_enabled=False)
_EOS = 2


def _compiled(schema) -> xgr.CompiledGrammar:
    """The grammar the decoder compiles for `schema` (compact JSON), without check_schema."""
    return _COMPILER.compile_grammar(json_schema_grammar(json.dumps(schema), any_whitespace=False,
                                                         separators=(",", ":")))


def _accepts(compiled: xgr.CompiledGrammar, text: str) -> bool:
    """Whether the grammar takes `text` whole (then a stop token ends it)."""
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.accept_token(_EOS) and matcher.is_terminated()


def _refusal(schema) -> str:
    with pytest.raises(InvalidArgument) as refused:
        Constraint("json_schema", json.dumps(schema))
    assert refused.value.field == "json_schema"
    return str(refused.value)


# (schema, text the unchecked grammar takes whole, the undeclared names)
UNDECLARED_REQUIRED = [
    ({"type": "object", "required": ["b"]}, "{}", "'b'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, '{"a":1}', "'b'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"],
      "additionalProperties": {"type": "integer"}}, '{"a":1}', "'b'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b", "c"],
      "additionalProperties": True}, '{"a":1}', "'b', 'c'"),
]


@pytest.mark.parametrize(("schema", "text", "names"), UNDECLARED_REQUIRED, ids=range(len(UNDECLARED_REQUIRED)))
def test_required_names_only_declared_properties(schema, text, names):
    """xgrammar drops a requirement on an undeclared property, additionalProperties or not: the
    grammar takes an object without it."""
    compiled = _compiled(schema)
    assert _accepts(compiled, text)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(text), schema)
    message = _refusal(schema)
    assert "'required' at #" in message and names in message
    nested = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    assert "'required' at #/properties/x" in _refusal(nested)


def test_required_declared_properties_are_enforced():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
              "required": ["a", "b"]}
    Constraint("json_schema", json.dumps(schema))
    compiled = _compiled(schema)
    assert _accepts(compiled, '{"a":1,"b":"x"}')
    assert not _accepts(compiled, '{"a":1}')


def test_an_array_without_items_holds_nothing_and_min_items_needs_items():
    """xgrammar reads a bare {"type": "array"} as any array, but one with other array keywords and
    no items as holding only the items it names (strict mode): none."""
    assert _accepts(_compiled({"type": "array"}), "[1]")
    compiled = _compiled({"type": "array", "maxItems": 3})
    assert _accepts(compiled, "[]") and not _accepts(compiled, "[1]")
    with pytest.raises(RuntimeError, match="additional items are not allowed"):
        _compiled({"type": "array", "minItems": 1})
    message = _refusal({"type": "object", "properties": {"tags": {"type": "array", "minItems": 1}}})
    assert "'minItems' at #/properties/tags" in message and "add items" in message
    for schema in ({"type": "array", "items": {"type": "integer"}, "minItems": 1},
                   {"type": "array", "items": True, "minItems": 2},
                   {"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 1},
                   {"type": "array", "minItems": 0}):
        Constraint("json_schema", json.dumps(schema))


# (pattern, text the unchecked grammar of {"type": "string", "pattern": ...} takes whole)
REFUSED_PATTERNS = [
    ('^x"y$', '"x"y"'),  # a literal quote
    ("^a\\\\b$", '"a\\b"'),  # a literal backslash: JSON reads \b, a backspace
    ("\\x22", '"""'),
    ("\\u0022", '"""'),
    ("^\\n$", '"\n"'),
    ("a\tb", '"a\tb"'),
    ("[\\0-\\x1f]", '"\x01"'),
    ("\\cA", '"\x01"'),
    ("[a-z]\\\\", '"a\\"'),
    (".é", '""é"'),  # non-ASCII: xgrammar writes the pattern's characters unescaped
    ("[^a]é", '"\\é"'),
    ("\\sé", '"\té"'),
    ("é\\W", '"é""'),
    ("é\\S", '"é\\"'),
    ("é\\D", '"é\x01"'),
]


@pytest.mark.parametrize(("pattern", "text"), REFUSED_PATTERNS, ids=range(len(REFUSED_PATTERNS)))
def test_patterns_that_would_write_invalid_json_are_refused(pattern, text):
    schema = {"type": "string", "pattern": pattern}
    assert _accepts(_compiled(schema), text)
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        pass  # invalid JSON
    else:
        assert not re.search(pattern.replace("\\cA", "\\x01"), value)  # or JSON of another value
    message = _refusal({"type": "object", "properties": {"p": schema}})
    assert "'pattern' at #/properties/p" in message and "unescaped" in message


_ALPHABET = ['"', "\\", "\t", "\n", "\x01", "a", "z", "A", "0", "-", "!", " ", "é", "x"]


def _writes_invalid_json(compiled: xgr.CompiledGrammar, depth: int = 3) -> str | None:
    """A text of up to `depth` characters after the opening quote the grammar takes that is not the
    start of a JSON string, or that it ends and JSON cannot read; None if there is none."""
    frontier = [""]
    for _ in range(depth):
        grown = []
        for body in frontier:
            for ch in _ALPHABET:
                matcher = xgr.GrammarMatcher(compiled)
                if not matcher.accept_string('"' + body + ch):
                    continue
                if not _json_string_start(body + ch):
                    return '"' + body + ch
                if matcher.accept_token(_EOS) and matcher.is_terminated():
                    try:
                        json.loads('"' + body + ch)
                    except json.JSONDecodeError:
                        return '"' + body + ch
                grown.append(body + ch)
        frontier = grown
    return None


def _json_string_start(body: str) -> bool:
    """Whether `body` can follow a JSON string's opening quote: no raw control character, a
    backslash only as a JSON escape, a quote only as the last (closing) character."""
    i = 0
    while i < len(body):
        if ord(body[i]) < 0x20 or (body[i] == '"' and i < len(body) - 1):
            return False
        if body[i] == "\\":
            if i + 1 < len(body) and body[i + 1] not in '"\\/bfnrtu':
                return False
            i += 1
        i += 1
    return True


# (pattern, a value it takes): common patterns, and classes xgrammar matches inside JSON's escaping
ACCEPTED_PATTERNS = [
    ("^[a-z]{1,4}$", "abc"), ("^\\d{3}-\\d{4}$", "555-1234"), ("^[A-Z][a-z]+$", "Ada"),
    ("^[\\w.+-]+@[\\w-]+\\.\\w+$", "a.b@c.de"), ("^(19|20)\\d\\d$", "1999"), (".", "a"), ("^.+$", "ab"),
    ("[^a]", "z"), ("^[^,]+$", "x y"), ('^[^"]*$', "abc"), ("\\s", " "), ("\\W", "!"), ("\\S", "x"),
    ("\\D", "x"), ("[ -~]", "!"), ("caf[eé]", "café"), ("\\u00e9.", "éa"), ("(?<year>\\d{4})", "2024"),
]


@pytest.mark.parametrize(("pattern", "value"), ACCEPTED_PATTERNS, ids=range(len(ACCEPTED_PATTERNS)))
def test_patterns_xgrammar_keeps_inside_json_strings_are_accepted(pattern, value):
    schema = {"type": "string", "pattern": pattern}
    Constraint("json_schema", json.dumps(schema))
    compiled = _compiled(schema)
    assert _accepts(compiled, json.dumps(value, ensure_ascii=False))
    assert _writes_invalid_json(compiled) is None


_PIECES = ["a", '"', "\\\\", "\\n", "\\t", ".", "[^a]", "\\s", "\\W", "\\S", "\\D", "[ -~]", "[\\0-\\x1f]",
           "é", "\\u00e9", '[a"]', '(a|")', '[^"]', "+", "?", "\\d", "[\\x21-\\x23]", "\\x22", "[a-z]",
           "[^\\s]", '[^\\\\"\\x00-\\x1f]', "(ab|c)"]


def test_no_pattern_that_writes_invalid_json_is_accepted():
    """Random patterns of two or three pieces: every one whose grammar writes invalid JSON is refused
    (the check may refuse more: a pattern naming a quote that xgrammar would drop)."""
    rng = random.Random(0)
    patterns = {"".join(rng.choice(_PIECES) for _ in range(rng.randint(2, 3))) for _ in range(120)}
    for pattern in sorted(patterns):
        try:
            compiled = _compiled({"type": "string", "pattern": pattern})
        except RuntimeError:
            continue  # xgrammar refuses it itself
        witness = _writes_invalid_json(compiled)
        assert witness is None or pattern_problem(pattern), (pattern, witness)


def test_a_pattern_the_check_cannot_read_is_refused_naming_it():
    message = _refusal({"type": "string", "pattern": "\\p{L}"})
    assert "'pattern' at #" in message and "cannot be checked" in message


@pytest.mark.parametrize(("kind", "spec"), [
    ("json_schema", '{"const": "\\ud800"}'),  # JSON text whose escape writes a lone surrogate
    ("json_schema", '{"properties": {"\\udfff": {}}}'),
    ("choice", '["a", "\\ud800"]'),
    ("regex", "a\ud800"),
    ("grammar", 'root ::= "\ud800"'),
])
def test_a_lone_surrogate_is_refused_naming_the_field(kind, spec):
    with pytest.raises(InvalidArgument, match="not valid Unicode") as refused:
        Constraint(kind, spec)
    assert refused.value.field == kind
    Constraint("json_schema", '{"const": "\\ud83d\\ude00"}')  # a pair is one character


def test_check_schema_names_the_field_it_is_given():
    with pytest.raises(InvalidArgument, match="^guided_json: 'required' at #") as refused:
        check_schema({"type": "object", "required": ["b"]}, "guided_json")
    assert refused.value.field == "guided_json"
