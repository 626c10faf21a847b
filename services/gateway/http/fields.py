"""The one rule of every HTTP request body: each field a client sends is honoured, accepted, or
refused by name; none is dropped.

- honoured: declared on the body's model (each route family's protocol.py) and carried into the gRPC request;
- accepted: declared with `accepted(why)`: it cannot change the answer (`user`, `metadata`, ...);
- refused: named in the model's `refused` table with the reason: 400 with `param` naming it.
  A refused field sent as null, or with one of the values its `Refusal` allows (those that ask
  for nothing tessera does not do: `store: false`, `tools: []`), passes;
- any other field, at any level of the body (a message, a content part, `stream_options`), is
  unknown: 400 naming its dotted path (pydantic's extra="forbid" on every `Strict` model).

Every optional field takes `null` for its default, as OpenAI's spec marks them nullable and vLLM
declares them `Optional[...] = default` (the `openai` SDK sends `"presence_penalty": null` for
None). A whole body (`Body`) is refused first, naming its path, for a string (or key) that is not
valid Unicode: JSON's "\\ud800" escapes a lone UTF-16 surrogate, which no protobuf string, log line
or answer can carry.

The same declarations write the OpenAPI document: a body's `properties` are its honoured and
accepted fields (accepted ones carry `x-tessera: accepted`; every optional one is nullable), `additionalProperties` is false,
and its refused fields are absent from `properties`, listed with their reasons under the
schema's `x-refused`. docs/http.md's field lists are rendered from them (docs/render_http.py).
A refusal that depends on two fields (`top_logprobs` without `logprobs`) is the route's
(each family's serving.py), with the same 400 shape.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

REFUSED_ERROR = "refused"  # the pydantic error type of a refusal (errors.validation_error_handler reads it)
NOT_UNICODE_ERROR = "not_unicode"  # ... and of a string that is not valid Unicode
ACCEPTED = "accepted"      # the `x-tessera` mark of an accepted field in the JSON schema


@dataclass(frozen=True)
class Refusal:
    """Why a field is refused, and the values that still pass (null always does).

    `allowed`: values that ask for nothing beyond what tessera does, compared with their JSON type
    (`false` is not `0`); `same_as`: a sibling field whose value also passes, with that field's
    default (best_of equal to n: ("n", 1)).
    """

    reason: str
    allowed: tuple = ()
    same_as: tuple[str, Any] | None = None

    def permits(self, value: Any, body: dict) -> bool:
        if value is None or any(type(value) is type(a) and value == a for a in self.allowed):
            return True
        if self.same_as is not None:
            name, default = self.same_as
            sibling = body.get(name, default)
            return type(value) is type(sibling) and value == sibling
        return False

    def describe(self) -> str:
        """The reason, with the values that pass besides null (the OpenAPI `x-refused` entry,
        docs/http.md's list)."""
        passing = [_json(a) for a in self.allowed]
        if self.same_as is not None:
            passing.append(f"equal to `{self.same_as[0]}`")
        return f"{self.reason} (passes: {', '.join(passing)})" if passing else self.reason


def _json(value: Any) -> str:
    return f"`{json.dumps(value)}`"


def accepted(why: str, default: Any = None, **kwargs) -> Any:
    """A field declared so it validates and shows in the OpenAPI document, that cannot change the
    answer (`why` says what tessera does instead)."""
    return Field(default, description=f"accepted, no effect: {why}", json_schema_extra={"x-tessera": ACCEPTED},
                 **kwargs)


def is_accepted(info) -> bool:
    """Whether a pydantic FieldInfo was declared with `accepted`."""
    extra = info.json_schema_extra
    return isinstance(extra, dict) and extra.get("x-tessera") == ACCEPTED


class Strict(BaseModel):
    """A request body (or part of one): unknown fields are refused, and so are the fields of its
    `refused` table unless their `Refusal` permits the value sent; an optional field sent as null
    takes its default.

    A refused field that is not declared (`audio`) and is permitted (null) is removed before
    validation: it asks for nothing. A declared one (`tools`, permitted as []) is validated as
    declared.
    """

    model_config = ConfigDict(extra="forbid")
    refused: ClassVar[dict[str, Refusal]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        defaulted = _defaulted(cls)
        kept = {k: v for k, v in data.items() if not (v is None and k in defaulted)}
        for name, rule in cls.refused.items():
            if name not in data:
                continue
            if not rule.permits(data[name], data):
                raise refusal(name, rule.reason)
            if name not in cls.model_fields:
                kept.pop(name, None)
        return kept

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):
        schema = handler(core_schema)
        target = handler.resolve_ref_schema(schema)
        required = set(target.get("required", ()))
        for name, spec in target.get("properties", {}).items():
            if name not in required:
                target["properties"][name] = _nullable(spec)
        if cls.refused:
            target["x-refused"] = {name: rule.describe() for name, rule in cls.refused.items()}
        return schema


# the keys of a property's JSON schema that describe the field, not its value's type
_FIELD_KEYS = ("title", "default", "description", "x-tessera", "examples", "deprecated")


def _nullable(spec: dict) -> dict:
    """A property's schema with `null` among its values (a field that takes null for its default)."""
    options = spec.get("anyOf", [spec])
    if any(option.get("type") == "null" for option in options):
        return spec
    value = {k: v for k, v in spec.items() if k not in _FIELD_KEYS}
    return {"anyOf": [value, {"type": "null"}], **{k: spec[k] for k in _FIELD_KEYS if k in spec}}


@functools.cache
def _defaulted(model: type[Strict]) -> frozenset[str]:
    """The optional fields of `model` whose default is not null: null sent for one means the default."""
    return frozenset(name for name, info in model.model_fields.items()
                     if not info.is_required() and info.get_default(call_default_factory=False) is not None)


class Body(Strict):
    """A whole request body: first of all, every string in it (keys included) must be valid
    Unicode, else the first that is not is refused naming its dotted path."""

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        path = not_unicode(data)
        if path is not None:
            where = ".".join(_printable(str(p)) for p in path)
            raise PydanticCustomError(NOT_UNICODE_ERROR, "{field} is text that is not valid Unicode", {"field": where})
        return data


def _encodes(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _printable(text: str) -> str:
    """`text` with each lone surrogate as its escape (\\ud800), so an answer can name it."""
    return text.encode("utf-8", "backslashreplace").decode()


_TEXTUAL = frozenset({str, dict, list})  # JSON values that are or may hold strings


def not_unicode(value: Any) -> tuple | None:
    """The path (keys and indices) of the first string, or object key, in a parsed JSON `value`
    that does not encode as UTF-8 (a lone surrogate); None when every one does.

    Iterative (a deeply nested body cannot exhaust the stack); a list of numbers is passed over
    by one set test of its items' types.
    """
    pending: list[tuple[Any, tuple]] = [(value, ())]
    while pending:
        item, path = pending.pop()
        kind = type(item)
        if kind is str:
            if not _encodes(item):
                return path
        elif kind is dict:
            for key in item:
                if isinstance(key, str) and not _encodes(key):
                    return (*path, key)
            pending.extend(reversed([(v, (*path, k)) for k, v in item.items() if type(v) in _TEXTUAL]))
        elif kind is list and not _TEXTUAL.isdisjoint(map(type, item)):
            pending.extend(reversed([(v, (*path, i)) for i, v in enumerate(item) if type(v) in _TEXTUAL]))
    return None


def refusal(field: str, reason: str) -> PydanticCustomError:
    """The validation error refusing `field` (a name, or a dotted path below the model: "content.0.type")."""
    return PydanticCustomError(REFUSED_ERROR, "{field} is not supported: {reason}", {"field": field, "reason": reason})


# -- refusals shared by several bodies ------------------------------------------------------------

# vLLM's sampling and extra parameters that the decoder has no counterpart for (vLLM's
# vllm/entrypoints/openai/protocol.py, ChatCompletionRequest and CompletionRequest).
VLLM_GENERATION: dict[str, Refusal] = {
    "truncate_prompt_tokens": Refusal("a prompt past the model's context is refused; shorten it"),
    "use_beam_search": Refusal("beam search is not supported: choices are sampled", (False,)),
    "length_penalty": Refusal("a beam-search parameter; choices are sampled", (1, 1.0)),
    "logits_processors": Refusal("custom logits processors are not loaded into the decoder"),
    "priority": Refusal("the decoder schedules requests first come, first served", (0,)),
    "cache_salt": Refusal("the prefix cache is shared by every request; there is no per-request salt"),
    "kv_transfer_params": Refusal("disaggregated prefill (KV transfer) is not supported"),
    "vllm_xargs": Refusal("no extension reads extra arguments"),
    "repetition_detection": Refusal("generation does not stop on repeated n-grams; use stop or max_tokens"),
    "return_token_ids": Refusal("answers carry text (and logprobs' token ids), not token id lists"),
    "return_token_offsets": Refusal("answers carry no character offsets per token (completions' logprobs "
                                    "have text_offset)"),
    "mm_processor_kwargs": Refusal("the vision service's processor takes no per-request arguments", ({},)),
    "media_io_kwargs": Refusal("images are decoded with fixed settings", ({},)),
    "thinking_token_budget": Refusal("no reasoning parser runs: the model's whole text is the answer"),
}
