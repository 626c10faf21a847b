"""docs/reference/http.md from the OpenAPI document of the gateway's FastAPI app, and the field
lists of docs/http.md from the request bodies' table (services/gateway/http/app.py REQUEST_BODIES, each family's protocol.py).

The app is built without a cluster (its Backend only opens a lazy loopback channel), so the page
is what `GET /openapi.json` serves: every path and method, its request body's fields and its
responses, then every schema the bodies name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_METHODS = ("get", "post", "put", "delete", "patch")
_CONSTRAINTS = (("minimum", ">= {}"), ("exclusiveMinimum", "> {}"), ("maximum", "<= {}"),
                ("exclusiveMaximum", "< {}"), ("minLength", "length >= {}"), ("maxLength", "length <= {}"),
                ("minItems", ">= {} items"), ("maxItems", "<= {} items"))


def openapi_document() -> dict[str, Any]:
    """The gateway HTTP API's OpenAPI document, as served at /openapi.json."""
    from services.gateway.http.app import create_app
    from services.gateway.http.backend import Backend

    return create_app(Backend(None, {}), max_body_bytes=1).openapi()  # the routes' shapes need no core


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _number(value) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def schema_type(schema: dict[str, Any]) -> str:
    """A JSON schema as one short type expression: `string`, `array of integer`, a [Schema](#schema) link."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if "anyOf" in schema or "oneOf" in schema:
        options = [schema_type(s) for s in schema.get("anyOf", schema.get("oneOf"))]
        return " \\| ".join(dict.fromkeys(options))
    if "const" in schema:
        return f"`{schema['const']!r}`".replace("'", '"')
    if "enum" in schema:
        return " \\| ".join(f'`"{v}"`' if isinstance(v, str) else f"`{v}`" for v in schema["enum"])
    kind = schema.get("type", "any")
    if kind == "array":
        items = schema.get("items", {})
        item_type = schema_type(items)
        kind = f"array of ({item_type})" if "anyOf" in items or "oneOf" in items else f"array of {item_type}"
    elif kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        kind = f"object of {schema_type(schema['additionalProperties'])}"
    limits = [template.format(_number(schema[key])) for key, template in _CONSTRAINTS if key in schema]
    return f"{kind} ({', '.join(limits)})" if limits else kind


def _default(schema: dict[str, Any]) -> str:
    if "default" not in schema:
        return ""
    value = schema["default"]
    return "`null`" if value is None else f"`{value}`".replace("'", '"') if not isinstance(value, bool) \
        else f"`{str(value).lower()}`"


def _render_schema(name: str, schema: dict[str, Any], lines: list[str]) -> None:
    lines += [f"### {name}", ""]
    if schema.get("description"):
        lines += [_cell(schema["description"]), ""]
    properties = schema.get("properties", {})
    if not properties:
        lines += [f"Type: {schema_type(schema)}", ""]
        return
    required = set(schema.get("required", ()))
    lines += ["| field | type | required | default | description |", "|---|---|---|---|---|"]
    for field, spec in properties.items():
        lines.append(f"| `{field}` | {schema_type(spec)} | {'yes' if field in required else ''} | "
                     f"{_default(spec)} | {_cell(spec.get('description', ''))} |")
    lines.append("")
    if schema.get("x-refused"):
        refused = "; ".join(f"`{name}` ({_cell(why)})" for name, why in schema["x-refused"].items())
        lines += [f"Refused with 400 (`x-refused`): {refused}.", ""]


def _render_operation(path: str, method: str, operation: dict[str, Any], lines: list[str]) -> None:
    lines += [f"### {method.upper()} {path}", ""]
    if operation.get("summary"):
        lines += [f"**{_cell(operation['summary'])}**", ""]
    if operation.get("description"):
        lines += [_cell(operation["description"]), ""]
    body = operation.get("requestBody", {}).get("content", {})
    for media, content in body.items():
        lines += [f"Request body (`{media}`): {schema_type(content.get('schema', {}))}", ""]
    rows: dict[str, list[tuple[str, str]]] = {}  # body -> (status, meaning), so shared error bodies share a row
    for status, response in sorted(operation.get("responses", {}).items()):
        body_type = " ".join(schema_type(c["schema"]) for c in response.get("content", {}).values() if c.get("schema"))
        rows.setdefault(body_type, []).append((status, _cell(response.get("description", ""))))
    lines += ["| status | meaning | body |", "|---|---|---|"]
    for body_type, entries in rows.items():
        lines.append(f"| {', '.join(s for s, _ in entries)} | {'; '.join(m for _, m in entries)} | {body_type} |")
    lines.append("")


def render_http_reference(document: dict[str, Any] | None = None) -> str:
    """The markdown of docs/reference/http.md."""
    document = document or openapi_document()
    info = document.get("info", {})
    lines = ["# HTTP reference", "",
             "Generated by `python docs/generate.py` from the OpenAPI document of the gateway's FastAPI app "
             "(services/gateway/http/); a running gateway serves the same document at `/openapi.json`. "
             "Usage, errors and the SDK: [../http.md](../http.md).", "",
             f"{info.get('title', '')} {info.get('version', '')}: {_cell(info.get('summary', ''))}", "",
             "Every error status answers with an [ErrorResponse](#errorresponse) (OpenAI's error object).", "",
             "## Routes", ""]
    for path, item in document["paths"].items():
        for method in _METHODS:
            if method in item:
                _render_operation(path, method, item[method], lines)
    lines += ["## Schemas", ""]
    for name, schema in sorted(document.get("components", {}).get("schemas", {}).items()):
        _render_schema(name, schema, lines)
    return "\n".join(lines).rstrip() + "\n"


# -- docs/http.md's field lists ---------------------------------------------------------------------

GUIDE = Path(__file__).resolve().parent / "http.md"
_BEGIN = "<!-- fields: generated by python docs/generate.py from the HTTP request bodies -->"
_END = "<!-- end of the generated fields -->"
_SECTION = re.compile(re.escape(_BEGIN) + ".*?" + re.escape(_END), re.S)


def _nested(model) -> list:
    """`model` and the Strict models its fields hold (messages, content parts, ...), each once, in order."""
    import typing

    from services.gateway.http.fields import Strict

    found = [model]

    def walk(annotation) -> None:
        if isinstance(annotation, type) and issubclass(annotation, Strict):
            if annotation not in found:
                found.append(annotation)
                for info in annotation.model_fields.values():
                    walk(info.annotation)
            return
        for argument in typing.get_args(annotation):
            walk(argument)

    for info in model.model_fields.values():
        walk(info.annotation)
    return found


def _names(names) -> str:
    return ", ".join(f"`{n}`" for n in names) or "none"


def field_lists() -> tuple[list[str], dict[str, int]]:
    """The markdown of every request body's honoured / accepted / refused fields, and their counts
    over chat and completions."""
    from services.gateway.http.app import REQUEST_BODIES
    from services.gateway.http.fields import is_accepted

    lines: list[str] = []
    counts = {"honoured": 0, "accepted": 0, "refused": 0}
    shown: set = set()
    for routes, body in REQUEST_BODIES.items():
        for model in _nested(body):
            if model in shown:
                continue
            shown.add(model)
            fields = {info.alias or n: info for n, info in model.model_fields.items()}  # as a body spells them
            honoured = [n for n, info in fields.items() if not is_accepted(info)]
            accepted = [(n, info.description.removeprefix("accepted, no effect: "))
                        for n, info in fields.items() if is_accepted(info)]
            if body.__name__ in ("ChatCompletionRequest", "CompletionRequest"):
                counts["honoured"] += len(honoured)
                counts["accepted"] += len(accepted)
                counts["refused"] += len(model.refused)
            title = f"`{routes}`" if model is body else f"`{model.__name__}` (in {routes.split(',')[0]})"
            lines += [f"#### {title}", "", f"- honoured: {_names(honoured)}"]
            if accepted:
                lines.append("- accepted, no effect: " + "; ".join(f"`{n}` ({why})" for n, why in accepted))
            by_reason: dict[str, list[str]] = {}
            for name, rule in model.refused.items():
                by_reason.setdefault(rule.describe(), []).append(name)
            if by_reason:
                lines.append("- refused:")
                lines += [f"  - {_names(names)}: {why}" for why, names in by_reason.items()]
            for name, values in getattr(model, "refused_values", {}).items():
                lines.append(f"- refused values of `{name}`: " + "; ".join(f"`{v}` ({why})" for v, why in values.items()))
            lines.append("")
    return lines, counts


def render_http_guide() -> str:
    """docs/http.md with its generated field lists brought up to date (the rest is written by hand)."""
    text = GUIDE.read_text()
    lines, counts = field_lists()
    summary = (f"Chat and completions together: {counts['honoured']} fields honoured, {counts['accepted']} "
               f"accepted with no effect, {counts['refused']} refused by name (nested objects included).")
    section = "\n".join([_BEGIN, "", summary, "", *lines, _END])
    if not _SECTION.search(text):
        raise SystemExit(f"{GUIDE}: the markers {_BEGIN!r} ... {_END!r} are missing")
    return _SECTION.sub(lambda _: section, text)
