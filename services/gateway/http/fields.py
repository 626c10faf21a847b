"""The one rule of every HTTP request body: each field a client sends is honoured, accepted, or
refused by name; none is dropped.

- honoured: declared on the body's model (models.py) and carried into the gRPC request;
- accepted: declared with `accepted(why)`: it cannot change the answer (`user`, `metadata`, ...);
- refused: named in the model's `refused` table with the reason: 400 with `param` naming it.
  A refused field sent as null, or with one of the values its `Refusal` allows (those that ask
  for nothing tessera does not do: `store: false`, `tools: []`), passes;
- any other field, at any level of the body (a message, a content part, `stream_options`), is
  unknown: 400 naming its dotted path (pydantic's extra="forbid" on every `Strict` model).

The same declarations write the OpenAPI document: a body's `properties` are its honoured and
accepted fields (accepted ones carry `x-tessera: accepted`), `additionalProperties` is false,
and its refused fields are absent from `properties`, listed with their reasons under the
schema's `x-refused`. docs/http.md's field lists are rendered from them (docs/render_http.py).
A refusal that depends on two fields (`top_logprobs` without `logprobs`) is the route's
(convert.py), with the same 400 shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

REFUSED_ERROR = "refused"  # the pydantic error type of a refusal (errors.validation_error_handler reads it)
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
    `refused` table unless their `Refusal` permits the value sent.

    A refused field that is not declared (`audio`) and is permitted (null) is removed before
    validation: it asks for nothing. A declared one (`tools`, permitted as []) is validated as
    declared.
    """

    model_config = ConfigDict(extra="forbid")
    refused: ClassVar[dict[str, Refusal]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not cls.refused:
            return data
        kept = data
        for name, rule in cls.refused.items():
            if name not in data:
                continue
            if not rule.permits(data[name], data):
                raise refusal(name, rule.reason)
            if name not in cls.model_fields:
                kept = {k: v for k, v in kept.items() if k != name}
        return kept

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):
        schema = handler(core_schema)
        if cls.refused:
            target = handler.resolve_ref_schema(schema)
            target["x-refused"] = {name: rule.describe() for name, rule in cls.refused.items()}
        return schema


def refusal(field: str, reason: str) -> PydanticCustomError:
    """The validation error refusing `field` (a name, or a dotted path below the model: "content.0.type")."""
    return PydanticCustomError(REFUSED_ERROR, "{field} is not supported: {reason}", {"field": field, "reason": reason})


# -- refusals shared by several bodies ------------------------------------------------------------

_STRUCTURED = "structured output (guided decoding) is not supported: the decoder samples without a grammar"

STRUCTURED_OUTPUT: dict[str, Refusal] = {
    name: Refusal(_STRUCTURED) for name in (
        "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
        "guided_whitespace_pattern", "structural_tag", "structured_outputs")}

# vLLM's sampling and extra parameters that the decoder has no counterpart for (vLLM's
# vllm/entrypoints/openai/protocol.py, ChatCompletionRequest and CompletionRequest).
VLLM_GENERATION: dict[str, Refusal] = {
    "truncate_prompt_tokens": Refusal("a prompt past the model's context is refused; shorten it"),
    "use_beam_search": Refusal("beam search is not supported: choices are sampled", (False,)),
    "length_penalty": Refusal("a beam-search parameter; choices are sampled", (1, 1.0)),
    "allowed_token_ids": Refusal("the sampler has no allow-list of tokens"),
    "bad_words": Refusal("the sampler has no list of banned words", ([],)),
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
    **STRUCTURED_OUTPUT,
}
