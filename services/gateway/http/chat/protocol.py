"""Request bodies and answers of /v1/chat/completions and /v1/completions, in OpenAI's (and
vLLM's) shapes: the table of fields each honours, accepts or refuses (the rule: ../fields.py).

Bounds that the gRPC side already enforces (the gateway's caps, the sampler's ranges) are left to
it, so one place states each limit.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    field_validator,
    model_serializer,
    model_validator,
)

from services.gateway.http.chat.structured import GUIDED_REFUSED, ResponseFormat, StructuredOutputs
from services.gateway.http.fields import VLLM_GENERATION, Body, Refusal, Strict, accepted, refusal
from services.gateway.http.protocol import (
    CACHE_HINT,
    Count,
    Int32,
    Logprobs,
    NonNegativeInt32,
    Texts,
    TokenIdLists,
    TokenIds,
    Usage,
)

# OpenAI's documented default for /v1/completions; chat's is the rest of the context, as in
# OpenAI's API and vLLM: 0 on the wire, resolved by the decoder once the prompt is tokenized.
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 0


class ImageURL(Strict):
    url: str = Field(description="a base64 data URI (data:image/png;base64,...); remote URLs are refused")
    refused: ClassVar[dict[str, Refusal]] = {
        "detail": Refusal("the vision service encodes every image at its own resolution", ("auto",))}


class TextPart(Strict):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: dict | None = accepted(CACHE_HINT)


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: ImageURL
    prompt_cache_breakpoint: dict | None = accepted(CACHE_HINT)


# Content parts the decoder cannot take, by their `type` (OpenAI's, vLLM's), and why.
REFUSED_PARTS = {
    "input_audio": "audio input is not supported: the decoder reads text and images",
    "audio_url": "audio input is not supported: the decoder reads text and images",
    "video_url": "video input is not supported: the decoder reads text and images",
    "file": "file parts are not supported: send the text, or images as image_url parts",
    "image_embeds": "image embeddings are not taken: send the image as an image_url part",
    "refusal": "a refusal part cannot be rendered by the chat template: send its text as a text part",
}
_FUNCTION_ROLE = 'OpenAI\'s deprecated function messages: send role "tool" with tool_call_id'


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
TEMPLATE_FIELDS = "the chat template is given each message's role, content, name and tool calls only"


class CalledFunction(Strict):
    name: str = Field(min_length=1)
    arguments: str = Field(description="the arguments as a JSON object (text); the chat template gets the object")

    @field_validator("arguments")
    @classmethod
    def _an_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments) if arguments else {}
        except ValueError as error:
            raise ValueError(f"the arguments are not JSON: {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"the arguments must be a JSON object, not a JSON {type(value).__name__}")
        return arguments


class MessageToolCall(Strict):
    """A call an assistant message made, in OpenAI's shape."""

    id: str = Field(description="the call's id; the `tool` message that answers it names it in tool_call_id")
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description='"developer" is OpenAI\'s newer name for "system", and is sent as one; "tool" answers a '
                    "tool call")
    content: Content | None = Field(default=None, description="null (an assistant message with tool_calls): "
                                    'rendered as ""')
    name: str | None = Field(default=None, description="the participant's name, given to the chat template as "
                             "the message's `name` (vLLM's)")
    tool_calls: list[MessageToolCall] | None = Field(default=None, description="assistant messages: the calls it "
                                                     "made, given to the template as transformers documents them "
                                                     "(arguments as an object)")
    tool_call_id: str | None = Field(default=None, description='role "tool": the id of the call it answers')
    refused: ClassVar[dict[str, Refusal]] = {
        "function_call": Refusal("OpenAI's deprecated function calling: send tool_calls"),
        "audio": Refusal("audio is not supported: the decoder reads text and images"),
        "refusal": Refusal(TEMPLATE_FIELDS),
        "reasoning_content": Refusal(TEMPLATE_FIELDS),
        "reasoning": Refusal(TEMPLATE_FIELDS),
    }
    # values refused by name, with why (docs/http.md lists them): roles, and content parts' types
    refused_values: ClassVar[dict[str, dict[str, str]]] = {
        "role": {"function": _FUNCTION_ROLE}, "content.N.type": REFUSED_PARTS}

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

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise refusal("tool_calls", f"tool_calls are the assistant's calls; this message's role is {self.role!r}")
        if self.tool_call_id is not None and self.role != "tool":
            raise refusal("tool_call_id", f'tool_call_id belongs to a message of role "tool", not {self.role!r}')
        return self


class StreamOptions(Strict):
    include_usage: bool = Field(default=False, description="a last event with `usage` and no choices (every "
                                "event before it carries `usage: null`)")
    continuous_usage_stats: bool = Field(default=False, description="vLLM's: every event carries the usage so far")
    include_obfuscation: bool | None = accepted("events carry no obfuscation padding; their content is the same")


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
    logit_bias: dict[str, float] | None = Field(default=None, description="OpenAI's: token id (a JSON key, so "
                                                "a string of digits) -> a value in [-100, 100] added to that "
                                                "token's logit before sampling (-100 all but bans it, 100 all but "
                                                "forces it)")
    allowed_token_ids: TokenIds | None = Field(default=None, description="vLLM's: only these token ids are "
                                               "sampled (not empty)")
    bad_words: Texts | None = Field(default=None, description="vLLM's: words never generated, each with and "
                                    "without a leading space (a word's last token is banned where the output ends "
                                    "with the rest of it)")
    prompt_logprobs: Logprobs | None = Field(default=None, description="vLLM's: each prompt token's log-probability "
                                             "and this many alternatives, as vLLM's `prompt_logprobs` answer "
                                             "(not with stream)")
    return_tokens_as_token_ids: bool | None = Field(default=None, description="vLLM's: logprob tokens as "
                                                    "`token_id:<id>` (absent: the gateway's "
                                                    "--return-tokens-as-token-ids)")
    request_id: str | None = Field(default=None, description="vLLM's: the answer's id is `chatcmpl-<request_id>` "
                                   "(completions: `cmpl-<request_id>`)")
    # structured output (chat/structured.py): at most one constraint; JSON is compact unless
    # structured_outputs.disable_any_whitespace is false
    response_format: ResponseFormat | None = Field(default=None, description="OpenAI's: json_object or json_schema "
                                                   "constrain the answer (compact JSON; docs/structured-output.md)")
    structured_outputs: StructuredOutputs | None = Field(default=None, description="vLLM's: one of json, regex, "
                                                         "choice, grammar, json_object; JSON is compact unless "
                                                         "disable_any_whitespace is false")
    guided_json: dict[str, Any] | str | None = Field(default=None, description="vLLM's older structured_outputs.json")
    guided_regex: str | None = Field(default=None, description="vLLM's older structured_outputs.regex")
    guided_choice: Texts | None = Field(default=None, description="vLLM's older structured_outputs.choice")
    guided_grammar: str | None = Field(default=None, description="vLLM's older structured_outputs.grammar")


LEGACY_FUNCTIONS = ("OpenAI's deprecated function calling (its answers carry `function_call`): send `tools` and "
                    "`tool_choice`")


class FunctionDefinition(Strict):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="a JSON Schema of the arguments (absent: "
                                              "no arguments, {\"type\": \"object\", \"properties\": {}})")
    strict: bool | None = Field(default=None, description="given to the template; under tool_choice \"required\" or "
                                "a named function the arguments always follow `parameters` (a constraint), under "
                                "\"auto\" they are what the model wrote")


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class WithTools(BaseModel):
    """A body with `tools`: the tools as the client sent them (their keys' order, null fields
    dropped) are kept beside the validated ones, for the chat template renders them as they are
    (`tojson`)."""

    _sent_tools: list[dict] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_sent_tools(cls, data: Any, handler):
        model = handler(data)
        tools = data.get("tools") if isinstance(data, dict) else None
        if isinstance(tools, list):
            model._sent_tools = [_without_nulls(tool, depth=2) for tool in tools]
        return model

    @property
    def sent_tools(self) -> list[dict]:
        return self._sent_tools


def _without_nulls(value: Any, depth: int) -> Any:
    """`value` less its null fields, `depth` levels of objects down (a tool and its function)."""
    if not isinstance(value, dict) or depth == 0:
        return value
    return {k: _without_nulls(v, depth - 1) for k, v in value.items() if v is not None}


ToolChoice = Annotated[Annotated[Literal["none", "auto", "required"], Tag("<mode>")]
                       | Annotated[NamedToolChoice, Tag("<named>")],
                       Discriminator(lambda v: "<mode>" if isinstance(v, str) else "<named>")]
_GENERATION_REFUSED = {
    **VLLM_GENERATION,
    **GUIDED_REFUSED,
    "best_of": Refusal("each choice is one sample: none is ranked out", (1,), same_as=("n", 1)),
}


class ChatCompletionRequest(SamplingFields, WithTools):
    messages: Annotated[list[ChatMessage], Field(min_length=1, fail_fast=True)]
    max_tokens: Count | None = Field(default=None, description="absent: the rest of the context (or the model's "
                                     "generation-config max_new_tokens)")
    max_completion_tokens: Count | None = Field(default=None, description="OpenAI's newer name for max_tokens")
    logprobs: bool = False
    top_logprobs: Logprobs | None = Field(default=None, description="alternatives per position; needs "
                                          "logprobs: true")
    metadata: dict[str, str] | None = accepted("not stored")
    tools: Annotated[list[Tool], Field(max_length=128, fail_fast=True)] | None = Field(
        default=None, description="functions the model may call (OpenAI's, at most 128), rendered by the chat "
        "template when it takes tools")
    tool_choice: ToolChoice | None = Field(default=None, description='"none", "auto" (the default with tools: '
                                           'the model\'s text parsed for calls), "required" (at least one call) '
                                           'or {"type": "function", "function": {"name": ...}} (that call)')
    parallel_tool_calls: bool | None = Field(default=None, description="false: at most one call per choice "
                                             "(absent: true)")
    safety_identifier: str | None = accepted("not recorded")
    prompt_cache_key: str | None = accepted(CACHE_HINT)
    prompt_cache_retention: str | None = accepted(CACHE_HINT)
    prompt_cache_options: dict | None = accepted(CACHE_HINT)
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
        "functions": Refusal(LEGACY_FUNCTIONS, ([],)),
        "function_call": Refusal(LEGACY_FUNCTIONS, ("none",)),
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


class TopLogprob(BaseModel):
    token: str = Field(description="the token's text (tokenizer.decode([id]); U+FFFD for part of a character), "
                       "or `token_id:<id>` with return_tokens_as_token_ids")
    logprob: float
    bytes: list[int] | None = Field(default=None, description="the token's exact UTF-8 bytes (OpenAI's)")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one prompt position's token or alternative."""

    logprob: float
    rank: int | None = Field(default=None, description="1 = most likely: the prompt's token's place in the whole "
                             "distribution, an alternative's among the alternatives (vLLM's)")
    decoded_token: str


# vLLM's prompt_logprobs answer: per prompt token, null for the first (it has no context), then
# {token id: PromptLogprob} holding the prompt's own token and the alternatives asked for.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class AnswerFunction(BaseModel):
    name: str
    arguments: str = Field(description="JSON text")


class AnswerToolCall(BaseModel):
    id: str = Field(description="chatcmpl-tool-<hex> (vLLM's)")
    type: Literal["function"] = "function"
    function: AnswerFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="null when the answer is tool calls alone")
    tool_calls: list[AnswerToolCall] | None = Field(default=None, description="requests with tools: the calls "
                                                    "the choice made (absent otherwise)")

    @model_serializer(mode="wrap")
    def _without_absent_calls(self, handler):
        data = handler(self)
        if self.tool_calls is None:
            data.pop("tool_calls", None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = Field(default=None, description="vLLM's, with prompt_logprobs")


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs: one entry per token of the returned text (with echo, the prompt's
    first: its first token's logprob and alternatives null)."""

    text_offset: list[int] = Field(description="each token's character offset in the returned text")
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None] = Field(description="the chosen token and the `logprobs` most "
                                                        "likely alternatives, by their text")


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = Field(default=None, description="vLLM's, with prompt_logprobs")


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
