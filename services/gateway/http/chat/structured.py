"""Structured output on /v1/chat/completions and /v1/completions: OpenAI's `response_format`,
vLLM's `structured_outputs` and its older `guided_*` fields, as the decoder's one constraint
(SamplingParams' `constraint` oneof; the decoder compiles it with xgrammar and masks every step).

- `response_format`: {"type": "json_object"} -> json_object; {"type": "json_schema", "json_schema":
  {"name", "schema"}} -> json_schema (no `schema`: any JSON object, as vLLM); {"type": "text"}: none.
- `structured_outputs` (vLLM's StructuredOutputsParams): json (an object or JSON text), regex,
  choice, grammar (xgrammar's EBNF, start rule `root`), json_object; `disable_any_whitespace`.
- `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`: vLLM's older spellings.

A body states at most one constraint: a second is refused 400 naming it (the order above, fields
in their declared order). JSON is compact unless `structured_outputs.disable_any_whitespace` is
sent as false (vLLM's default is any whitespace; tessera's is the decoder's compact JSON, which
a random or small model cannot pad forever). A refusal of the constraint by the decoder (a schema
keyword it cannot enforce, a regex that does not compile) names the body's field that carried it
(`constraint_fields`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from services.gateway.http.errors import ApiError
from services.gateway.http.fields import Refusal, Strict, accepted, refusal
from services.gateway.http.protocol import Texts
from tessera.v1 import decoder_pb2

BACKEND = "xgrammar"
_BACKENDS = (BACKEND, "auto")  # the backend values that ask for what tessera does
_NO_STRUCTURAL_TAG = ("structural tags (constrained regions inside free text) are not compiled: constrain the "
                      "whole answer with json, regex, choice or grammar")
_NO_WHITESPACE_PATTERN = ("JSON is compact, or allows any whitespace with structured_outputs.disable_any_whitespace "
                          "false; no other whitespace pattern is taken")
_BACKEND_WHY = f"structured output runs on {BACKEND} alone: only {BACKEND!r} or 'auto'"
_NAME_PATTERN = r"^[a-zA-Z0-9_-]+$"  # OpenAI's rule for a response format's name (at most 64 characters)


class JsonSchemaFormat(Strict):
    """OpenAI's `response_format.json_schema`."""

    name: str = accepted("names the format; the constraint is the schema", ..., min_length=1, max_length=64,
                         pattern=_NAME_PATTERN)
    description: str | None = accepted("the model is not shown it: the schema constrains the output")
    schema_: dict[str, Any] | None = Field(default=None, alias="schema", description="the JSON Schema the answer "
                                           "follows (absent: any JSON object, as vLLM)")
    strict: bool | None = accepted("the answer always follows the schema (a constraint), strict or not")


class ResponseFormat(Strict):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"] = Field(description='"text" (no constraint), "json_object" '
                                                                '(any JSON object) or "json_schema"')
    json_schema: JsonSchemaFormat | None = Field(default=None, description='with type "json_schema" (required there)')
    refused_values: ClassVar[dict[str, dict[str, str]]] = {"type": {"structural_tag": _NO_STRUCTURAL_TAG}}

    @model_validator(mode="before")
    @classmethod
    def _refused_types(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind in cls.refused_values["type"]:
            raise refusal("type", f"{kind!r}: {cls.refused_values['type'][kind]}")
        return data

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema goes with type "json_schema", and type "json_schema" needs it')
        return self


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs` (its StructuredOutputsParams): one constraint, and options."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json", description="a JSON Schema (an object, "
                                               "or its JSON text)")
    regex: str | None = Field(default=None, description="the whole answer matches it (xgrammar's dialect)")
    choice: Texts | None = Field(default=None, description="the answer is one of these strings")
    grammar: str | None = Field(default=None, description="an EBNF grammar (xgrammar's, start rule `root`)")
    json_object: bool | None = Field(default=None, description="true: any JSON object")
    disable_any_whitespace: bool | None = Field(default=None, description="absent or true: compact JSON (tessera's "
                                                "default); false: any whitespace JSON allows (vLLM's default)")
    disable_fallback: bool | None = accepted(f"{BACKEND} is the only backend: nothing falls back")
    refused: ClassVar[dict[str, Refusal]] = {
        "backend": Refusal(_BACKEND_WHY, _BACKENDS),
        "disable_additional_properties": Refusal("the schema is followed as sent: set additionalProperties false in "
                                                 "it", (False,)),
        "whitespace_pattern": Refusal(_NO_WHITESPACE_PATTERN),
        "structural_tag": Refusal(_NO_STRUCTURAL_TAG),
    }


# SamplingFields' refusals of the guided_* options tessera does not take (vLLM's protocol.py)
GUIDED_REFUSED: dict[str, Refusal] = {
    "guided_decoding_backend": Refusal(_BACKEND_WHY, _BACKENDS),
    "guided_whitespace_pattern": Refusal(_NO_WHITESPACE_PATTERN),
    "structural_tag": Refusal(_NO_STRUCTURAL_TAG),
}


@dataclass(frozen=True)
class OutputConstraint:
    """One constraint of a body: `field`, the body's dotted path that states it; `kind`, the
    SamplingParams oneof member (json_schema, json_object, regex, choice, grammar); `value` as
    that member takes it (JSON text, True, a pattern, a list of strings, a grammar)."""

    field: str
    kind: str
    value: Any

    def apply(self, params: decoder_pb2.SamplingParams) -> None:
        if self.kind == "choice":
            params.choice.SetInParent()  # set even for an empty list, which the decoder refuses naming it
            params.choice.choices.extend(self.value)
        else:
            setattr(params, self.kind, self.value)


def _schema(value: dict | str) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _stated(body) -> list[OutputConstraint]:
    """Every constraint `body` states, in the module docstring's order."""
    out = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        out.append(OutputConstraint("response_format", "json_object", True))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema.schema_ is None:
            out.append(OutputConstraint("response_format.json_schema", "json_object", True))
        else:
            out.append(OutputConstraint("response_format.json_schema.schema", "json_schema",
                                        _schema(rf.json_schema.schema_)))
    so = body.structured_outputs
    if so is not None:
        for name, kind, value in (("json", "json_schema", so.json_), ("regex", "regex", so.regex),
                                  ("choice", "choice", so.choice), ("grammar", "grammar", so.grammar),
                                  ("json_object", "json_object", so.json_object or None)):
            if value is not None:
                out.append(OutputConstraint(f"structured_outputs.{name}", kind,
                                            _schema(value) if kind == "json_schema" else value))
    for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(body, name)
        if value is not None:
            out.append(OutputConstraint(name, kind, _schema(value) if kind == "json_schema" else value))
    return out


def output_constraint(body) -> OutputConstraint | None:
    """The one constraint `body` (chat or completions) states, or None.

    Raises:
        ApiError: 400 naming the second constraint when the body states two.
    """
    stated = _stated(body)
    if len(stated) > 1:
        first, second = stated[0], stated[1]
        raise ApiError(400, f"{second.field} and {first.field} both constrain the output; a request takes one "
                            "structured-output constraint", param=second.field)
    return stated[0] if stated else None


def apply(body, params: decoder_pb2.SamplingParams) -> None:
    """Set `params`' constraint and any_whitespace from `body`.

    Raises:
        ApiError: 400 for two constraints (`output_constraint`).
    """
    constraint = output_constraint(body)
    if constraint is not None:
        constraint.apply(params)
    so = body.structured_outputs
    if so is not None and so.disable_any_whitespace is False:
        params.any_whitespace = True


def check_options(body, params: decoder_pb2.SamplingParams) -> None:
    """Refuse `structured_outputs` that holds options alone where nothing constrains the output
    (call once every constraint is set: the tools' too).

    Raises:
        ApiError: 400 naming structured_outputs.
    """
    if body.structured_outputs is not None and params.WhichOneof("constraint") is None:
        raise ApiError(400, "structured_outputs holds no constraint (json, regex, choice, grammar or json_object "
                            "true) and nothing else in the request constrains the output: its options would do "
                            "nothing", param="structured_outputs")


def constraint_fields(body) -> dict[str, str]:
    """The body's field for the SamplingParams constraint it states (`sampling.json_schema` ->
    `response_format.json_schema.schema`, ...), for a refusal's `param`; empty without one."""
    stated = _stated(body)
    return {f"sampling.{stated[0].kind}": stated[0].field} if len(stated) == 1 else {}
