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

Some schemas that use only those keywords would still produce text the schema refuses, and are
refused too (`check_schema`): under xgrammar's strict mode (vLLM's default) an object holds only
the properties it names, so `required` may name only those; an array with array keywords but no
`items` holds nothing (a bare {"type": "array"} is any array), so it may not have a `minItems`; and a `pattern` is refused where xgrammar would write a
`"`, a backslash or a control character into the JSON string unescaped (`pattern_problem`).
"""

from __future__ import annotations

import json
import re
import re._constants as sre
import re._parser as sre_parser  # Python's own regex parser: its tree of what each atom can match
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
        _check_unicode(self.spec, self.field)
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


def _check_unicode(text: str, field: str, where: str = "it") -> None:
    """Refuse text that has a lone surrogate (no UTF-8 encoding: the grammar library cannot read it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidArgument(f"{field} holds text that is not valid Unicode: a lone surrogate at character "
                              f"{error.start} of {where}", field=field) from None


def _loads(text: str, field: str, what: str):
    """json.loads of `text`, whose strings must be valid Unicode: JSON's escapes can write a lone
    surrogate ("\\ud800") in ASCII text."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as error:
        raise InvalidArgument(f"{field} must be {what} in JSON: {error}", field=field) from None
    if "\\u" in text:
        pending = [value]
        while pending:
            node = pending.pop()
            if isinstance(node, str):
                _check_unicode(node, field, f"the string {node.encode('utf-8', 'replace').decode()!r}")
            elif isinstance(node, list):
                pending.extend(node)
            elif isinstance(node, dict):
                pending.extend(node)
                pending.extend(node.values())
    return value


def check_schema(schema, field: str = "json_schema") -> None:
    """Refuse a JSON Schema that uses a keyword xgrammar cannot enforce (module docstring).

    Raises:
        InvalidArgument: naming `field`, the keyword and its JSON pointer ("#/properties/a"), e.g.
            "json_schema uses 'uniqueItems' at #/properties/tags, which is not supported: ..."; also
            for a schema whose output would break it under strict mode (module docstring).
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
        _check_strict(node, where, field)
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


def _check_strict(node: dict, where: str, field: str) -> None:
    """Refuse what strict mode would make the output break: a required property the schema does not
    name (xgrammar allows only the named ones, additionalProperties or not, and drops the
    requirement), minItems without items, a pattern whose text would be invalid JSON."""
    required, properties = node.get("required"), node.get("properties", {})
    if isinstance(required, list) and isinstance(properties, dict):
        missing = [name for name in required if isinstance(name, str) and name not in properties]
        if missing:
            raise InvalidArgument(
                f"{field}: 'required' at {where} names {', '.join(map(repr, missing))}, which 'properties' does "
                "not declare; under structured output's strict mode an object holds only the properties it "
                "declares (additionalProperties does not add required ones), so the answer would lack it: "
                "declare it in 'properties'", field=field)
    min_items = node.get("minItems")
    if (isinstance(min_items, int) and not isinstance(min_items, bool) and min_items > 0
            and "items" not in node and "prefixItems" not in node):
        raise InvalidArgument(f"{field}: 'minItems' at {where} needs 'items': an array without items holds no "
                              "items under structured output's strict mode: add items", field=field)
    pattern = node.get("pattern")
    if isinstance(pattern, str) and (problem := pattern_problem(pattern)):
        raise InvalidArgument(f"{field}: 'pattern' at {where} is not supported: {problem}", field=field)


# Characters a JSON string must escape (RFC 8259 section 7): the quote, the backslash, U+0000-U+001F.
_UNSAFE = frozenset((0x22, 0x5C, *range(0x20)))
# Classes of Python's parser that hold a character of _UNSAFE (\s: tab, newline; \S, \W, \D: quote).
_UNSAFE_CATEGORIES = frozenset({sre.CATEGORY_SPACE, sre.CATEGORY_NOT_SPACE, sre.CATEGORY_NOT_WORD,
                                sre.CATEGORY_NOT_DIGIT, sre.CATEGORY_LINEBREAK, sre.CATEGORY_NOT_LINEBREAK})


def pattern_problem(pattern: str) -> str | None:
    r"""Why xgrammar 0.2.9 would write a `"`, a backslash or a control character unescaped into the
    JSON string of a schema with this `pattern`, or None where it cannot.

    xgrammar matches a pattern over the JSON string's text (`json_string=true`, which leaves those
    characters out) unless the pattern names one of them (`"x\"y"`, `[\\]`, `\n`, `\x22`, a range
    from `\0`) or holds a non-ASCII character (`é`); then it writes the pattern's characters as
    they are, and `.`, `[^a]`, `\s`, `\S`, `\W`, `\D` can be any of them. Proven against
    xgrammar's matcher by tests/decoder/test_structured_schemas.py.
    """
    try:
        tree = sre_parser.parse(_ecmascript_to_python(pattern))
    except (re.error, OverflowError, RecursionError) as error:
        return f"it cannot be checked as a regular expression ({error})"
    names_unsafe = can_be_unsafe = False
    for op, av in _atoms(tree):
        names, can = _atom_unsafe(op, av)
        names_unsafe |= names
        can_be_unsafe |= can
    if names_unsafe:
        return ("it names a quote, a backslash or a control character, which structured output would write "
                "unescaped into the JSON string (invalid JSON)")
    if can_be_unsafe and any(ord(ch) > 0x7F for ch in pattern):
        return ("with a non-ASCII character in it, the grammar library matches it outside JSON's escaping, so "
                "its '.', negated class, \\s, \\S, \\W or \\D could write a quote, a backslash or a "
                "control character unescaped (invalid JSON); exclude them (e.g. [^\"\\\\\\x00-\\x1f])")
    return None


def _ecmascript_to_python(pattern: str) -> str:
    """`pattern` with ECMAScript's named groups `(?<name>` and control escapes `\\cX` in Python's
    spelling (`(?P<name>`, `\\x..`), which xgrammar reads as ECMAScript does."""
    pattern = re.sub(r"(?<!\\)((?:\\\\)*)\(\?<(?![=!])", r"\1(?P<", pattern)
    return re.sub(r"\\c([A-Za-z])", lambda m: f"\\x{ord(m.group(1)) % 32:02x}", pattern)


def _atoms(tree):
    """The (op, av) of every atom of a parsed pattern (what matches one character)."""
    pending = [tree]
    while pending:
        for op, av in pending.pop():
            if op in (sre.LITERAL, sre.NOT_LITERAL, sre.ANY, sre.IN):
                yield op, av
            elif op is sre.BRANCH:
                pending.extend(av[1])
            elif op is sre.SUBPATTERN:
                pending.append(av[3])
            elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
                pending.append(av[2])
            elif op in (sre.ASSERT, sre.ASSERT_NOT):
                pending.append(av[1])
            elif op is sre.ATOMIC_GROUP:
                pending.append(av)
            elif op is sre.GROUPREF_EXISTS:
                pending.extend(p for p in av[1:] if p is not None)


def _atom_unsafe(op, av) -> tuple[bool, bool]:
    """(whether the atom names characters of _UNSAFE only, whether it can match one of them)."""
    if op is sre.LITERAL:
        return av in _UNSAFE, av in _UNSAFE
    if op in (sre.NOT_LITERAL, sre.ANY):
        return False, True
    negated = bool(av) and av[0][0] is sre.NEGATE
    listed = set()  # the characters of _UNSAFE the class lists
    only_unsafe = not negated
    for item_op, item in av[negated:]:
        if item_op is sre.LITERAL:
            listed |= {item} & _UNSAFE
            only_unsafe &= item in _UNSAFE
        elif item_op is sre.RANGE:
            low, high = item
            listed |= {c for c in _UNSAFE if low <= c <= high}
            only_unsafe &= high < 0x20 or low == high in _UNSAFE
        else:  # a category (\d, \s, ...): it may hold any of _UNSAFE, and excludes none of them
            listed |= _UNSAFE if item in _UNSAFE_CATEGORIES and not negated else set()
            only_unsafe = False
    if negated:
        return False, listed != _UNSAFE
    return only_unsafe and bool(listed), bool(listed)


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
