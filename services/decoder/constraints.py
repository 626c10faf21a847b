"""Structured-output constraints as a request states them, checked before anything is compiled.

A `Constraint` is one of the kinds of vLLM's `structured_outputs` (and OpenAI's response_format):

- "json_schema": the text is JSON valid under a JSON Schema (`spec`: the schema, JSON text);
- "json_object": the text is any JSON object (`spec` empty);
- "regex": the whole text matches a regular expression (xgrammar's dialect: ECMAScript-like);
- "choice": the whole text is one of a list of strings (`spec`: the list, JSON text);
- "grammar": the text is in the language of an EBNF grammar (xgrammar's form, GBNF-like, whose
  start rule is `root`).

JSON kinds are compact by default (no whitespace between JSON tokens, `,` and `:` as separators,
as vLLM's `disable_any_whitespace`); `any_whitespace` allows what the JSON grammar allows.

A JSON schema is checked against the keywords the grammar library enforces (`SCHEMA_KEYWORDS`,
each proven by tests/decoder/test_structured.py's validity tests): a schema that uses any other
keyword that constrains values (`oneOf`, which xgrammar reads as `anyOf`; `multipleOf`;
`uniqueItems`; `patternProperties`; `not`; `if`/`then`/`else`; `allOf` with more than one schema;
an external `$ref`; a `format` outside `STRING_FORMATS`; ...) is refused naming the keyword and
where it is, never silently loosened. Keywords that only annotate (title, description, default,
examples, ...) are accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from services.common.errors import InvalidArgument

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")

# Keywords that constrain, and are enforced by xgrammar 0.2.9's JSON-schema converter.
SCHEMA_KEYWORDS = frozenset({
    "type", "enum", "const", "anyOf", "allOf", "$ref", "$defs", "definitions",
    "properties", "required", "additionalProperties",
    "items", "prefixItems", "minItems", "maxItems",
    "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
})
# Keywords that only annotate a schema (JSON Schema 2020-12's meta-data and core identifiers).
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly",
    "$schema", "$id", "$comment", "$anchor", "contentEncoding", "contentMediaType",
})
# String formats xgrammar enforces (its json_schema_converter's builtin formats).
STRING_FORMATS = frozenset({"date", "time", "date-time", "duration", "email", "uuid", "ipv4", "ipv6", "hostname"})
# Keywords whose value holds subschemas: (keyword, how) with how in "schema", "list", "map".
_SUBSCHEMAS = {"items": "schema", "additionalProperties": "schema", "anyOf": "list", "allOf": "list",
               "prefixItems": "list", "properties": "map", "$defs": "map", "definitions": "map"}
_WHY = {
    "oneOf": "the grammar library reads oneOf as anyOf (a text matching two branches would pass); use anyOf",
    "allOf": "the grammar library intersects no more than one schema",
    "format": f"the grammar library enforces only the formats {', '.join(sorted(STRING_FORMATS))}",
    "$ref": "only references inside the schema ('#' or '#/...') are resolved",
}
MAX_SCHEMA_DEPTH = 64


@dataclass(frozen=True)
class Constraint:
    """One structured-output constraint (module docstring). Hashable: the compile cache's key.

    Raises InvalidArgument (naming `field`: the kind, e.g. "json_schema") when `spec` is not what
    its kind needs: a schema that is not JSON, not an object or a boolean, or uses a keyword the
    library cannot enforce; a choice list that is not a non-empty JSON array of non-empty strings;
    an empty regex or grammar.
    """

    kind: str
    spec: str = ""
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument(f"unknown constraint kind {self.kind!r}; one of {', '.join(KINDS)}")
        if self.kind == "json_schema":
            check_schema(_loads(self.spec, self.field, "a JSON Schema"), self.field)
        elif self.kind == "choice":
            choices = _loads(self.spec, self.field, "a JSON array of strings")
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
                raise InvalidArgument(f"{self.field} must be a non-empty list of non-empty strings", field=self.field)
        elif self.kind in ("regex", "grammar") and not self.spec:
            raise InvalidArgument(f"{self.field} must not be empty", field=self.field)

    @property
    def field(self) -> str:
        """The SamplingParams field that states this constraint (what an error names)."""
        return self.kind

    @property
    def choices(self) -> list[str]:
        return json.loads(self.spec) if self.kind == "choice" else []


def _loads(text: str, field: str, what: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as error:
        raise InvalidArgument(f"{field} must be {what} in JSON: {error}", field=field) from None


def check_schema(schema, field: str = "json_schema") -> None:
    """Refuse a JSON Schema that uses a keyword xgrammar cannot enforce (module docstring).

    Raises:
        InvalidArgument: naming `field`, the keyword and its JSON pointer ("#/properties/a"), e.g.
            "json_schema uses 'uniqueItems' at #/properties/tags, which is not supported: ...".
    """
    pending = [(schema, "#", 0)]
    while pending:
        node, where, depth = pending.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise InvalidArgument(f"{field}: the schema at {where} must be an object or a boolean, got a JSON "
                                  f"{type(node).__name__}", field=field)
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidArgument(f"{field} nests schemas deeper than {MAX_SCHEMA_DEPTH} at {where}", field=field)
        for keyword, value in node.items():
            if keyword in ANNOTATIONS:
                continue
            if keyword not in SCHEMA_KEYWORDS or not _supported(keyword, value):
                why = _WHY.get(keyword, "structured output cannot enforce it")
                raise InvalidArgument(f"{field} uses {keyword!r} at {where}, which is not supported: {why}",
                                      field=field)
            how = _SUBSCHEMAS.get(keyword)
            if how == "schema" or (how == "list" and not isinstance(value, list)) or (
                    how == "map" and not isinstance(value, dict)):
                if how != "schema":
                    raise InvalidArgument(f"{field}: {keyword!r} at {where} must be a JSON "
                                          f"{'array' if how == 'list' else 'object'}", field=field)
                pending.append((value, f"{where}/{keyword}", depth + 1))
            elif how == "list":
                pending.extend((item, f"{where}/{keyword}/{i}", depth + 1) for i, item in enumerate(value))
            elif how == "map":
                pending.extend((item, f"{where}/{keyword}/{name}", depth + 1) for name, item in value.items())


def _supported(keyword: str, value) -> bool:
    if keyword == "allOf":
        return isinstance(value, list) and len(value) <= 1
    if keyword == "format":
        return value in STRING_FORMATS
    if keyword == "$ref":
        return isinstance(value, str) and (value == "#" or value.startswith("#/"))
    if keyword == "items":
        return isinstance(value, bool | dict)  # a list of schemas is draft 4's tuple form (prefixItems now)
    return True


def choice_grammar(choices: list[str]) -> str:
    """The EBNF grammar whose language is exactly `choices` (xgrammar's string literals take
    JSON's escapes, so each choice is its JSON string)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
