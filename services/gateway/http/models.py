"""Request bodies of the HTTP API, in OpenAI's (and vLLM's, TEI's, Jina's, Cohere's) shapes: the
table of fields every route honours, accepts or refuses (the rule: fields.py).

Bounds that the gRPC side already enforces (the gateway's caps, the sampler's ranges) are left to
it, so one place states each limit. Answers: responses.py.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from services.gateway.http.fields import VLLM_GENERATION, Body, Refusal, Strict, accepted, refusal

# protobuf's int32 fields: a larger number is refused here (400), not by the message setter
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Count = Annotated[int, Field(ge=1, le=2**31 - 1)]
NonNegativeInt32 = Annotated[int, Field(ge=0, le=2**31 - 1)]  # a bound beside Int32's would be overridden by it
# Lists stop at their first bad item (pydantic's fail_fast): a body of millions of bad items would
# otherwise build an error for each, gigabytes and seconds of the gateway's one event loop.
TokenIds = Annotated[list[Int32], Field(fail_fast=True)]
TokenIdLists = Annotated[list[TokenIds], Field(fail_fast=True)]
Texts = Annotated[list[str], Field(fail_fast=True)]
# TEI's bodies as its router (serde) takes them: no `true` for 1 or "yes" for true
StrictInt32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1, strict=True)]
StrictTokenIds = Annotated[list[StrictInt32], Field(fail_fast=True)]
StrictTokenIdLists = Annotated[list[StrictTokenIds], Field(fail_fast=True)]
Direction = Literal["right", "left", "Right", "Left"]  # TEI's truncation_direction (it takes both spellings)
Logprobs = Annotated[int, Field(ge=0, le=20)]

# OpenAI's documented default for /v1/completions; chat's is the rest of the context, as in
# OpenAI's API and vLLM: 0 on the wire, resolved by the decoder once the prompt is tokenized.
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 0

_CACHE_HINT = "the decoder's prefix cache finds shared prefixes by itself"


# -- chat messages -------------------------------------------------------------------------------


class ImageURL(Strict):
    url: str = Field(description="a base64 data URI (data:image/png;base64,...); remote URLs are refused")
    refused: ClassVar[dict[str, Refusal]] = {
        "detail": Refusal("the vision service encodes every image at its own resolution", ("auto",))}


class TextPart(Strict):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: dict | None = accepted(_CACHE_HINT)


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: ImageURL
    prompt_cache_breakpoint: dict | None = accepted(_CACHE_HINT)


# Content parts the decoder cannot take, by their `type` (OpenAI's, vLLM's), and why.
REFUSED_PARTS = {
    "input_audio": "audio input is not supported: the decoder reads text and images",
    "audio_url": "audio input is not supported: the decoder reads text and images",
    "video_url": "video input is not supported: the decoder reads text and images",
    "file": "file parts are not supported: send the text, or images as image_url parts",
    "image_embeds": "image embeddings are not taken: send the image as an image_url part",
    "refusal": "a refusal part cannot be rendered by the chat template: send its text as a text part",
}
_TOOL_ROLE = "messages that answer tool calls: the gateway does not call tools"


def _part_tag(value: Any) -> str | None:
    """A content part's branch by its `type` (None: not a part at all, which pydantic refuses)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"<{kind}>" if isinstance(kind, str) else None


Part = Annotated[Annotated[TextPart, Tag("<text>")] | Annotated[ImagePart, Tag("<image_url>")],
                 Discriminator(_part_tag)]
# The content's own branches are tagged so a validation error's location names the body's path only
# (errors.clean_location drops "<...>" tags).
Content = Annotated[Annotated[str, Tag("<str>")] | Annotated[Annotated[list[Part], Field(fail_fast=True)],
                                                              Tag("<parts>")],
                    Discriminator(lambda v: "<str>" if isinstance(v, str) else "<parts>")]
_TEMPLATE_FIELDS = "the chat template is given each message's role, content and name only"


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"] = Field(
        description='"developer" is OpenAI\'s newer name for "system", and is sent as one')
    content: Content | None = None
    name: str | None = Field(default=None, description="the participant's name, given to the chat template as "
                             "the message's `name` (vLLM's)")
    refused: ClassVar[dict[str, Refusal]] = {
        "tool_calls": Refusal("the gateway does not call tools", ([],)),
        "tool_call_id": Refusal("the gateway does not call tools"),
        "function_call": Refusal("the gateway does not call tools"),
        "audio": Refusal("audio is not supported: the decoder reads text and images"),
        "refusal": Refusal(_TEMPLATE_FIELDS),
        "reasoning_content": Refusal(_TEMPLATE_FIELDS),
        "reasoning": Refusal(_TEMPLATE_FIELDS),
    }
    # values refused by name, with why (docs/http.md lists them): roles, and content parts' types
    refused_values: ClassVar[dict[str, dict[str, str]]] = {
        "role": {"tool": _TOOL_ROLE, "function": _TOOL_ROLE}, "content.N.type": REFUSED_PARTS}

    @model_validator(mode="before")
    @classmethod
    def _roles_and_parts(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        roles = cls.refused_values["role"]
        if isinstance(data.get("role"), str) and data["role"] in roles:
            raise refusal("role", f"{data['role']!r}: {roles[data['role']]}")
        content = data.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in ("text", "image_url"):
                raise refusal(f"content.{j}.type", REFUSED_PARTS.get(kind, f"a {kind!r} part: text and image_url "
                                                                             "parts are"))
        return data


class StreamOptions(Strict):
    include_usage: bool = Field(default=False, description="a last event with `usage` and no choices (every "
                                "event before it carries `usage: null`)")
    continuous_usage_stats: bool = Field(default=False, description="vLLM's: every event carries the usage so far")
    include_obfuscation: bool | None = accepted("events carry no obfuscation padding; their content is the same")


# -- chat and completions ----------------------------------------------------------------------


class SamplingFields(Body):
    """The fields chat and completions share: OpenAI's, and vLLM's sampling extras."""

    model: str | None = Field(default=None, description="the decoder's base model name or one of its aliases "
                              "(--served-model-name), or a loaded adapter's name (absent: the base model, as vLLM)")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False, description="absent: "
                                      "the model's generation-config default, else 1 (OpenAI's)")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False,
                                description="absent: the model's generation-config default, else 1")
    stop: str | Texts | None = Field(default=None, description="stop strings; the match is not returned "
                                     "(see include_stop_str_in_output)")
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63, description="choice i samples with seed + i; a "
                             "negative seed is taken modulo 2^64, as vLLM's (torch's generator) takes it")
    n: Count = 1
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    stream: bool = False
    stream_options: StreamOptions | None = Field(default=None, description="only with stream: true")
    user: str | None = accepted("not recorded")
    # vLLM's sampling extras
    top_k: Int32 | None = Field(default=None, ge=-1, description="vLLM's: sample from the k most likely tokens "
                                "(0 or -1: all); absent: the model's generation-config default, else all")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False, description="vLLM's: drop "
                                "tokens less likely than min_p times the most likely one; absent: the model's "
                                "default, else 0")
    repetition_penalty: float | None = Field(default=None, gt=0.0, allow_inf_nan=False, description="vLLM's "
                                             "(transformers'): > 1 penalizes tokens of the prompt and output; "
                                             "absent: the model's default, else 1")
    ignore_eos: bool = Field(default=False, description="vLLM's: generate past EOS, to max_tokens")
    min_tokens: NonNegativeInt32 = Field(default=0, description="vLLM's: EOS, stop_token_ids and stop strings end no "
                              "choice before this many tokens")
    stop_token_ids: TokenIds | None = Field(default=None, description="vLLM's: token ids that end a choice "
                                            "(finish_reason stop; the id's text is not returned)")
    include_stop_str_in_output: bool = Field(default=False, description="vLLM's: a matched stop string stays "
                                             "at the end of the text")
    skip_special_tokens: bool | None = Field(default=None, description="vLLM's: the text leaves special tokens "
                                             "out (absent: true)")
    spaces_between_special_tokens: bool | None = Field(default=None, description="vLLM's (absent: true)")
    prompt_logprobs: Logprobs | None = Field(default=None, description="vLLM's: each prompt token's log-probability "
                                             "and this many alternatives, as vLLM's `prompt_logprobs` answer "
                                             "(not with stream)")
    return_tokens_as_token_ids: bool | None = Field(default=None, description="vLLM's: logprob tokens as "
                                                    "`token_id:<id>` (absent: the gateway's "
                                                    "--return-tokens-as-token-ids)")
    request_id: str | None = Field(default=None, description="vLLM's: the answer's id is `chatcmpl-<request_id>` "
                                   "(completions: `cmpl-<request_id>`)")


_TOOLS = "the gateway does not call tools"
_GENERATION_REFUSED = {
    **VLLM_GENERATION,
    "logit_bias": Refusal("token biases are not supported by the sampler", ({},)),
    "response_format": Refusal('structured output is not supported: only {"type": "text"}', ({"type": "text"},)),
    "best_of": Refusal("each choice is one sample: none is ranked out", (1,), same_as=("n", 1)),
}


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, fail_fast=True)]
    max_tokens: Count | None = Field(default=None, description="absent: the rest of the context (or the model's "
                                     "generation-config max_new_tokens)")
    max_completion_tokens: Count | None = Field(default=None, description="OpenAI's newer name for max_tokens")
    logprobs: bool = False
    top_logprobs: Logprobs | None = Field(default=None, description="alternatives per position; needs "
                                          "logprobs: true")
    metadata: dict[str, str] | None = accepted("not stored")
    parallel_tool_calls: bool | None = accepted("no tools are called")
    safety_identifier: str | None = accepted("not recorded")
    prompt_cache_key: str | None = accepted(_CACHE_HINT)
    prompt_cache_retention: str | None = accepted(_CACHE_HINT)
    prompt_cache_options: dict | None = accepted(_CACHE_HINT)
    # vLLM's chat extras
    echo: bool = Field(default=False, description="vLLM's: when the last message is the assistant's, the answer "
                       "starts with its content")
    add_generation_prompt: bool | None = Field(default=None, description="vLLM's (transformers'): the template's "
                                               "assistant header ends the prompt (absent: true, false with "
                                               "continue_final_message)")
    continue_final_message: bool = Field(default=False, description="vLLM's (transformers'): the last message is "
                                         "left open for the model to go on (prefill)")
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description="vLLM's: extra variables of the "
                                                        "chat template (enable_thinking, ...)")
    documents: list[dict[str, str]] | None = Field(default=None, description="vLLM's: the template's `documents` "
                                                   "(RAG templates)")

    refused: ClassVar[dict[str, Refusal]] = {
        **_GENERATION_REFUSED,
        "audio": Refusal("audio output is not supported: the answer is text"),
        "modalities": Refusal('the answer is text: only ["text"]', (["text"],)),
        "prediction": Refusal("predicted outputs are not supported"),
        "web_search_options": Refusal("the gateway does not search the web"),
        "reasoning_effort": Refusal("the served model has no reasoning-effort setting"),
        "verbosity": Refusal("the served model has no verbosity setting"),
        "moderation": Refusal("no moderation model runs on requests or answers"),
        "store": Refusal("the gateway stores no answers", (False,)),
        "service_tier": Refusal('one tier serves every request: only "auto" or "default"', ("auto", "default")),
        "tools": Refusal(_TOOLS, ([],)),
        "tool_choice": Refusal(_TOOLS, ("none", "auto")),
        "functions": Refusal(_TOOLS, ([],)),
        "function_call": Refusal(_TOOLS, ("none", "auto")),
        "include_reasoning": Refusal("no reasoning parser runs: the answer holds the model's whole text", (True,)),
        "chat_template": Refusal("the served model's own chat template renders every chat"),
        "add_special_tokens": Refusal("the chat template holds the special tokens; none are added", (False,)),
    }


class CompletionRequest(SamplingFields):
    prompt: str | Texts | TokenIds | TokenIdLists = Field(
        description="text, a list of texts, token ids, or a list of token-id lists")
    max_tokens: Int32 | None = Field(default=None, ge=0, description="absent: 16 (OpenAI's); 0 only with echo "
                                     "(the prompt alone, as OpenAI's legacy API)")
    logprobs: Logprobs | None = Field(default=None, description="the chosen token's log-probability and this many "
                                      "alternatives per position (0: the chosen one only)")
    echo: bool = Field(default=False, description="the answer starts with the prompt (and its tokens' logprobs "
                       "with logprobs: the first one null)")
    refused: ClassVar[dict[str, Refusal]] = {
        **_GENERATION_REFUSED,
        "suffix": Refusal("insertion (text after the completion) is not supported"),
        "add_special_tokens": Refusal("text prompts are tokenized with the tokenizer's special tokens", (True,)),
        "prompt_embeds": Refusal("prompt embeddings are not taken: send text or token ids"),
    }


# -- pooling, tokenizer ---------------------------------------------------------------------------

_TRUNCATE_PROMPT_TOKENS = Field(default=None, description="vLLM's: -1 cuts an input past the model's maximum "
                                "input length to its last tokens; other values are refused (see truncate)")
_ACTIVATION = "vLLM's: false gives the raw logit (TEI's raw_scores)"
_POOLING_REFUSED = {
    "priority": Refusal("the pooling service batches requests first come, first served", (0,)),
    "mm_processor_kwargs": Refusal("the pooling models take text only", ({},)),
}


class EmbeddingRequest(Body):
    model: str | None = Field(default=None, description="an embedding model's name or alias (absent: the pooling "
                              "service's default embedding model)")
    truncate_prompt_tokens: int | None = _TRUNCATE_PROMPT_TOKENS
    input: str | Texts | TokenIds | TokenIdLists
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Count | None = None
    normalize: bool | None = Field(default=None, description="vLLM's: unit vectors (absent: the model's "
                                   "sentence-transformers config)")
    user: str | None = accepted("not recorded")
    truncate: bool | None = Field(default=None, strict=True, description="TEI's: an input past the model's "
                                  "maximum input length is cut to it instead of refused with 400 (null: false)")
    truncation_direction: Direction | None = Field(
        default=None, description="TEI's: which end `truncate` keeps the tokens of (right, the default: the first ones)")
    refused: ClassVar[dict[str, Refusal]] = {
        **_POOLING_REFUSED,
        "add_special_tokens": Refusal("inputs are tokenized with the model's special tokens", (True,)),
        "request_id": Refusal("the embeddings answer carries no id"),
        "embed_dtype": Refusal("embeddings are float32", ("float32",)),
        "endianness": Refusal("base64 embeddings are little-endian float32", ("little",)),
        "messages": Refusal("embeddings take text or token ids in `input`, not chat messages"),
        "chat_template": Refusal("embeddings take text or token ids in `input`, not chat messages"),
        "chat_template_kwargs": Refusal("embeddings take text or token ids in `input`, not chat messages"),
        "add_generation_prompt": Refusal("embeddings take text or token ids in `input`, not chat messages"),
        "continue_final_message": Refusal("embeddings take text or token ids in `input`, not chat messages"),
    }


class RerankRequestDocument(Strict):
    text: str


class RerankRequest(Body):
    """Jina's and Cohere's rerank body (documents: texts or `{"text": ...}` objects), or on POST /rerank
    also TEI's (`texts`, answered as TEI's list of ranks): exactly one of `documents` and `texts`."""

    model: str | None = None
    query: str
    documents: Annotated[list[str | RerankRequestDocument], Field(fail_fast=True)] | None = None
    top_n: Count | None = None
    return_documents: bool = Field(default=True, description="Jina's default (and vLLM's answer): each result "
                                   "carries its document; false leaves it null")
    truncate_prompt_tokens: int | None = Field(default=None, description="vLLM's: -1 as truncate with "
                                               "truncation_direction left; other values are refused")
    activation: bool | None = Field(default=None, description=_ACTIVATION)
    use_activation: bool | None = Field(default=None, description=_ACTIVATION + " (vLLM's newer name)")
    texts: Texts | None = Field(default=None, description="TEI's name for the documents (POST /rerank only); the "
                                "answer is then TEI's: a list of {index, score, text?}, highest score first")
    return_text: bool = Field(default=False, strict=True, description="TEI's name for return_documents")
    raw_scores: bool = Field(default=False, strict=True,
                             description="TEI's: the cross-encoder's logit instead of its sigmoid")
    truncate: bool | None = Field(default=None, strict=True, description="TEI's: a (query, document) pair past the "
                                  "model's maximum input length is cut to it, the longer side first, instead of "
                                  "refused with 400 (null: false)")
    truncation_direction: Direction = "right"
    refused: ClassVar[dict[str, Refusal]] = {
        **_POOLING_REFUSED,
        "rank_fields": Refusal("documents are texts: there are no fields to rank by"),
        "max_chunks_per_doc": Refusal("documents are not chunked: a long one is refused, or cut with truncate"),
        "max_tokens_per_doc": Refusal("documents are cut only to the model's maximum input length (truncate)"),
    }


class ScoreRequest(Body):
    """vLLM's /score body: `text_1` one text scored against each of `text_2`, or two lists of equal
    length scored pairwise (a list of one text counts as one text)."""

    model: str | None = None
    text_1: str | Texts
    text_2: str | Texts
    truncate_prompt_tokens: int | None = Field(default=None, description="vLLM's: -1 as truncate with "
                                               "truncation_direction left; other values are refused")
    truncate: bool | None = Field(default=None, strict=True, description="tessera's (TEI's): a pair past the "
                                  "model's maximum input length is cut to it, the longer side first, instead of "
                                  "refused (null: false)")
    activation: bool | None = Field(default=None, description=_ACTIVATION)
    use_activation: bool | None = Field(default=None, description=_ACTIVATION + " (vLLM's newer name)")
    refused: ClassVar[dict[str, Refusal]] = dict(_POOLING_REFUSED)


class TokenizeRequest(Body):
    """vLLM's /tokenize: exactly one of `prompt` and `messages` (chat: decoder models only)."""

    model: str | None = Field(default=None, description="absent: the decoder's tokenizer when a decoder is served "
                              "(as vLLM), else the default pooling model's; a pooling model's name or alias: that "
                              "model's; the decoder's name, alias or a loaded adapter's name: the decoder's")
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(fail_fast=True)] | None = Field(
        default=None, description="rendered with the decoder's chat template")
    add_special_tokens: bool | None = Field(default=None, description="default true for prompt, false for messages")
    add_generation_prompt: bool | None = Field(default=None, description="messages only (absent: true, false with "
                                               "continue_final_message)")
    continue_final_message: bool = Field(default=False, description="messages only, as chat's")
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description="messages only, as chat's")
    return_token_strs: bool | None = accepted("token_strs are always returned")
    refused: ClassVar[dict[str, Refusal]] = {
        "chat_template": Refusal("the served model's own chat template renders every chat"),
        "tools": Refusal(_TOOLS, ([],)),
        "mm_processor_kwargs": Refusal("the vision service's processor takes no per-request arguments", ({},)),
        "media_io_kwargs": Refusal("images are decoded with fixed settings", ({},)),
    }


class DetokenizeRequest(Body):
    """vLLM's /detokenize (decoder models only)."""

    model: str | None = Field(default=None, description="the decoder's model, an alias or a loaded adapter's name "
                              "(absent: the decoder's model, as vLLM)")
    tokens: TokenIds


class LoadLoraAdapterRequest(Body):
    lora_name: str
    lora_path: str
    replace: bool = Field(default=False, strict=True, description="tessera: load new weights under a name already loaded")
    drain: bool = Field(default=False, strict=True, description="tessera: with replace, wait for running requests on the old "
                                                   "weights to end (else 400 while any runs)")


class UnloadLoraAdapterRequest(Body):
    lora_name: str
    drain: bool = Field(default=False, strict=True, description="tessera: refuse new requests and wait for running ones to "
                                                   "end (else 400 while any runs)")
    refused: ClassVar[dict[str, Refusal]] = {"lora_int_id": Refusal("adapters are named, not numbered: send lora_name")}


# -- text-embeddings-inference's native routes (its router's http/types.rs) -----------------------


class TeiEmbedRequest(Body):
    """TEI's /embed body (also POST /, where huggingface_hub's InferenceClient.feature_extraction sends it)."""

    inputs: str | Texts | StrictTokenIds | StrictTokenIdLists = Field(
        description="a text, texts, a token id list or token id lists (special tokens are the client's)")
    normalize: bool = Field(default=True, strict=True, description="TEI's default: unit vectors")
    truncate: bool | None = Field(default=None, strict=True, description="an input past the model's maximum input "
                                  "length is cut to it instead of refused (null: false)")
    truncation_direction: Direction = "right"
    prompt_name: str | None = Field(default=None, description="a key of the model's sentence-transformers prompts")
    dimensions: Annotated[int, Field(ge=1, le=2**31 - 1, strict=True)] | None = Field(
        default=None, description="Matryoshka models only: the first `dimensions`")
    model: str | None = Field(default=None, description="tessera's, not TEI's: which pooling model (TEI serves one; "
                              "default: the pooling service's default embedding model)")


# Every request body, by the routes that take it (docs/render_http.py lists their fields).
REQUEST_BODIES: dict[str, type[Body]] = {
    "POST /v1/chat/completions": ChatCompletionRequest,
    "POST /v1/completions": CompletionRequest,
    "POST /v1/embeddings": EmbeddingRequest,
    "POST /v1/rerank, /rerank": RerankRequest,
    "POST /v1/score, /score": ScoreRequest,
    "POST /tokenize": TokenizeRequest,
    "POST /detokenize": DetokenizeRequest,
    "POST /embed, / (TEI)": TeiEmbedRequest,
    "POST /v1/load_lora_adapter": LoadLoraAdapterRequest,
    "POST /v1/unload_lora_adapter": UnloadLoraAdapterRequest,
}
