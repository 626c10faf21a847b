"""Structured-output workloads shared by bench/grammar_libs.py and bench/structured.py: JSON schemas of
varied shapes, a regex, a choice and a small EBNF grammar, each with a text its grammar accepts (the
token walk whose masks are timed) and the same language in llguidance's form.

Every object schema is closed (`additionalProperties: false` where it says nothing, as xgrammar's
strict mode reads it), so both libraries constrain the same language; JSON is compact (`,` and `:`,
no whitespace), as tessera's json kinds are by default (services/decoder/constraints.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    """One workload: `kind` and `spec` as services/decoder/constraints.Constraint takes them,
    `text` a string in its language, `lark` the same grammar in llguidance's Lark form (None: derived
    from kind and spec by llguidance.grammar_from)."""

    name: str
    kind: str
    spec: str
    text: str
    lark: str | None = None


def _closed(schema):
    """`schema` with `additionalProperties: false` on every object schema that does not state it."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: (_closed(value) if key not in ("enum", "const", "required") else value)
           for key, value in schema.items()}
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _schema_case(name: str, schema: dict, instance) -> Case:
    return Case(name, "json_schema", json.dumps(_closed(schema)), json.dumps(instance, separators=(",", ":")))


_STR, _INT, _NUM, _BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required}


SCHEMAS = [
    _schema_case("person (flat, 3 fields)", _obj({"name": _STR, "age": _INT, "email": _STR}),
                 {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"}),
    _schema_case("address (nested objects)",
                 _obj({"name": _STR, "address": _obj({"street": _STR, "city": _STR, "zip": _STR,
                                                      "geo": _obj({"lat": _NUM, "lon": _NUM})})}),
                 {"name": "Grace Hopper", "address": {"street": "1 Navy Way", "city": "Arlington", "zip": "22202",
                                                      "geo": {"lat": 38.87, "lon": -77.05}}}),
    _schema_case("order (array of objects, 1-5 items)",
                 _obj({"order_id": _INT, "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": _obj(
                     {"sku": _STR, "quantity": {"type": "integer", "minimum": 1}, "price": _NUM})}}),
                 {"order_id": 1042, "items": [{"sku": "A-17", "quantity": 2, "price": 9.5},
                                              {"sku": "B-3", "quantity": 1, "price": 120.0}]}),
    _schema_case("sentiment (enums, const)",
                 _obj({"version": {"const": 1}, "label": {"enum": ["positive", "negative", "neutral"]},
                       "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                       "aspects": {"type": "array", "items": {"enum": ["price", "quality", "service", "delivery"]}}}),
                 {"version": 1, "label": "positive", "confidence": 0.92, "aspects": ["quality", "service"]}),
    _schema_case("event (patterns, formats)",
                 _obj({"id": {"type": "string", "format": "uuid"}, "when": {"type": "string", "format": "date-time"},
                       "contact": {"type": "string", "format": "email"},
                       "room": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}),
                 {"id": "3f2b8c1e-9d4a-4b7e-8f6a-2c1d0e9b7a65", "when": "2025-03-14T15:09:26Z",
                  "contact": "events@example.org", "room": "KB-204"}),
    _schema_case("measurement (anyOf unions, nulls)",
                 _obj({"sensor": _STR, "value": {"anyOf": [_NUM, {"type": "null"}]},
                       "unit": {"anyOf": [{"enum": ["C", "F", "K"]}, _STR]},
                       "tags": {"type": "array", "items": {"anyOf": [_STR, _INT]}}}),
                 {"sensor": "t-7", "value": 21.5, "unit": "C", "tags": ["lab", 3]}),
    _schema_case("tree ($defs, recursive $ref)",
                 {"$ref": "#/$defs/node",
                  "$defs": {"node": _obj({"label": _STR, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}})}},
                 {"label": "root", "children": [{"label": "a", "children": []},
                                                {"label": "b", "children": [{"label": "c", "children": []}]}]}),
    _schema_case("settings (optional fields, bounds)",
                 _obj({"theme": {"enum": ["light", "dark"]}, "font_size": {"type": "integer", "minimum": 8, "maximum": 32},
                       "autosave": _BOOL, "language": {"type": "string", "minLength": 2, "maxLength": 5},
                       "recent": {"type": "array", "items": _STR, "maxItems": 3}}, required=["theme"]),
                 {"theme": "dark", "font_size": 14, "autosave": True, "language": "en-GB"}),
    _schema_case("tool call (function name + arguments)",
                 _obj({"name": {"const": "get_weather"},
                       "arguments": _obj({"location": _STR, "unit": {"enum": ["celsius", "fahrenheit"]},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 14}})}),
                 {"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius", "days": 3}}),
    _schema_case("product (20 fields)",
                 _obj({f"field_{i:02d}": (_STR, _INT, _NUM, _BOOL)[i % 4] for i in range(20)}),
                 {f"field_{i:02d}": ("v", 7, 1.5, False)[i % 4] for i in range(20)}),
]

REGEX = Case("regex (name, ISO date)", "regex",
             r"[A-Z][a-z]+ [A-Z][a-z]+, born (19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
             "Ada Lovelace, born 1915-12-10")
CHOICE = Case("choice (5 labels)", "choice",
              json.dumps(["positive", "negative", "neutral", "mixed", "not applicable"]), "not applicable")
EBNF = Case("EBNF (arithmetic expressions)", "grammar",
            "\n".join(['root ::= expr',
                       'expr ::= term (("+" | "-") term)*',
                       'term ::= factor (("*" | "/") factor)*',
                       'factor ::= number | "(" expr ")"',
                       'number ::= [0-9]+ ("." [0-9]+)?']),
            "(12.5+3)*4-(7/2)*(1+2.25)",
            lark="\n".join(['start: expr',
                            'expr: term (("+" | "-") term)*',
                            'term: factor (("*" | "/") factor)*',
                            'factor: NUMBER | "(" expr ")"',
                            r'NUMBER: /[0-9]+(\.[0-9]+)?/']))

CASES = [*SCHEMAS, REGEX, CHOICE, EBNF]
