"""Constraints for the structured-output tests: a seeded generator of JSON schemas, regexes with
their Python equivalents, choice lists and a small EBNF grammar with the regex of its language.

Every schema bounds what a random model could otherwise write forever (strings have maxLength, an
enum or a pattern; arrays maxItems; numbers bounds), so a choice sampled at temperature 1 ends
within a few hundred tokens and "ends with stop" is part of what the tests assert.
"""

from __future__ import annotations

import random
import re

_WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa", "lam", "mu"]


def _leaf(rng: random.Random, defs: dict) -> dict:
    kind = rng.choice(["integer", "number", "string", "pattern", "enum", "boolean", "const", "null", "ref",
                       "anyof", "date"])
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        low = rng.randint(-10, 10)
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 100)}
    if kind == "string":
        low = rng.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 5)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(["^[a-z]{1,4}$", "^[A-Z][0-9]{2}$", "^(ab|cd){1,3}x?$",
                                                         "^[0-9a-f]{4}-[0-9a-f]{2}$"])}
    if kind == "enum":
        return {"enum": rng.sample(_WORDS, rng.randint(1, 4)) + ([None, 7] if rng.random() < 0.3 else [])}
    if kind == "const":
        return {"const": rng.choice(["fixed", 3, True, {"k": [1, 2]}])}
    if kind == "null":
        return {"type": "null"}
    if kind == "date":
        return {"type": "string", "format": "date"}
    if kind == "ref":
        name = f"d{len(defs)}"
        defs[name] = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                                       "tag": {"enum": ["x", "y"]}},
                      "required": ["id"], "additionalProperties": False}
        return {"$ref": f"#/$defs/{name}"}
    if kind == "anyof":
        return {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 3},
                          {"type": "boolean"}]}
    return {"type": "boolean"}


def _node(rng: random.Random, depth: int, defs: dict) -> dict:
    roll = rng.random()
    if depth < 2 and roll < 0.3:
        return _object(rng, depth + 1, defs)
    if depth < 2 and roll < 0.5:
        low = rng.randint(0, 2)
        return {"type": "array", "items": _node(rng, depth + 1, defs), "minItems": low,
                "maxItems": low + rng.randint(0, 2)}
    return _leaf(rng, defs)


def _object(rng: random.Random, depth: int, defs: dict) -> dict:
    names = rng.sample(_WORDS, rng.randint(1, 4))
    properties = {name: _node(rng, depth, defs) for name in names}
    required = [n for n in names if rng.random() < 0.7]
    schema = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = required
    if rng.random() < 0.3:
        schema["title"] = "annotated"  # an annotation: accepted, enforces nothing
    return schema


def random_schemas(count: int, seed: int = 1234) -> list[dict]:
    """`count` JSON schemas drawn from a fixed seed: nested objects, arrays with min/max items,
    enums, consts, required fields, bounded integers and numbers, bounded and patterned strings, a
    date format, `$ref` into `$defs` and `anyOf`."""
    rng = random.Random(seed)
    schemas = []
    for _ in range(count):
        defs: dict = {}
        schema = _object(rng, 0, defs) if rng.random() < 0.85 else _node(rng, 1, defs)
        if defs:
            schema = {**schema, "$defs": defs}
        schemas.append(schema)
    return schemas


# (xgrammar's regex, the same language as a Python regex for re.fullmatch)
REGEXES = [
    (r"[a-z]{2,5}-\d{3}", r"[a-z]{2,5}-\d{3}"),
    (r"(yes|no|maybe)!?", r"(yes|no|maybe)!?"),
    (r"\d{1,3}(\.\d{1,3}){3}", r"\d{1,3}(\.\d{1,3}){3}"),
    (r"[A-Z][a-z]{0,6} [A-Z][a-z]{0,6}", r"[A-Z][a-z]{0,6} [A-Z][a-z]{0,6}"),
    (r"0x[0-9a-fA-F]{1,8}", r"0x[0-9a-fA-F]{1,8}"),
    (r"(ab|cd){1,3}e?", r"(ab|cd){1,3}e?"),
]

CHOICES = [["yes", "yesterday", "no"], ["red", "green", "blue", "grün"], ["A) first", "B) second"]]

# A small EBNF grammar (xgrammar's form) and a Python regex of its language
GRAMMAR = r'''root ::= "(" item ("," item){0,3} ")"
item ::= [0-9]{1,3} | "\"" [a-z]{1,4} "\""
'''
GRAMMAR_LANGUAGE = re.compile(r'\((\d{1,3}|"[a-z]{1,4}")(,(\d{1,3}|"[a-z]{1,4}")){0,3}\)')
