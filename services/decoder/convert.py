"""Protobuf <-> domain conversion for the Decoder service (types.py); with the servicer and the
registry client (adapter_client.py) the only decoder modules that touch generated stubs."""

from __future__ import annotations

import json

from services.common.errors import InvalidArgument, prefixed
from services.common.limits import GenerateLimits, check_decoder_tokenize, check_detokenize, check_generate
from services.common.tensor import FLOAT_DTYPES, from_pb
from services.decoder.constraints import Constraint
from services.decoder.tools import parse_tools, tool_call_from_parts
from services.decoder.types import (
    ChatMessage,
    ChatTemplateOptions,
    DecoderInfo,
    GenerateInput,
    GenerationDefaults,
    ImagePart,
    Part,
    PromptTokenCount,
    RawImagePart,
    RequestOutput,
    Sample,
    SamplingParams,
    TextPart,
    Tokenization,
    TokenizeInput,
    TokenText,
)
from tessera.v1 import decoder_pb2, tensor_pb2


def part_from_pb(part: decoder_pb2.ContentPart, where: str = "part") -> Part:
    """One content part; `where` names it in errors (e.g. "messages[0].content[1]").

    Raises InvalidArgument for an empty part, or image rows that are not a finite 2-D float tensor.
    """
    kind = part.WhichOneof("part")
    if kind == "text":
        return TextPart(part.text)
    if kind == "encoded_image":
        image = part.encoded_image
        rows = from_pb(image.rows, f"{where}.encoded_image.rows", FLOAT_DTYPES, (None, None), finite=True)
        return ImagePart(rows, tuple(image.grid_thw), tuple(image.mrope_section), image.content_hash)
    if kind is None:
        raise InvalidArgument("a content part has neither text nor an image")
    return RawImagePart()


def sampling_from_pb(sampling: decoder_pb2.SamplingParams,
                     defaults: GenerationDefaults | None = None) -> SamplingParams:
    """The request's sampling; each optional field it leaves unset takes the served model's default
    (`defaults`, from --generation-config), else its neutral value: temperature
    `default_temperature` when set, else 0 (greedy); top_p 1, top_k 0, min_p 0, repetition_penalty
    1. A field the request sets always wins. max_tokens 0 (unset) -> None: the engine resolves it
    (the default's max_tokens, else the rest of the context). An empty allowed_token_ids -> None
    (every id). Raises InvalidArgument on
    out-of-range values (max_tokens < 0, negative temperature...)."""
    defaults = defaults or GenerationDefaults()

    def pick(name: str, neutral):
        if sampling.HasField(name):
            return getattr(sampling, name)
        value = getattr(defaults, name)
        return neutral if value is None else value

    neutral_temperature = sampling.default_temperature if sampling.HasField("default_temperature") else 0.0
    try:
        return SamplingParams(
            max_tokens=sampling.max_tokens or None, temperature=pick("temperature", neutral_temperature),
            top_p=pick("top_p", 1.0), top_k=pick("top_k", 0), min_p=pick("min_p", 0.0),
            seed=sampling.seed if sampling.HasField("seed") else None,
            stop=tuple(sampling.stop), stop_token_ids=tuple(sampling.stop_token_ids), ignore_eos=sampling.ignore_eos,
            repetition_penalty=pick("repetition_penalty", 1.0), presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty, n=sampling.n or 1, logprobs=sampling.logprobs,
            top_logprobs=sampling.top_logprobs, min_tokens=sampling.min_tokens,
            include_stop_str_in_output=sampling.include_stop_str_in_output,
            skip_special_tokens=sampling.skip_special_tokens if sampling.HasField("skip_special_tokens") else True,
            spaces_between_special_tokens=(sampling.spaces_between_special_tokens
                                           if sampling.HasField("spaces_between_special_tokens") else True),
            prompt_logprobs=sampling.prompt_logprobs if sampling.HasField("prompt_logprobs") else None,
            logit_bias=dict(sampling.logit_bias), allowed_token_ids=tuple(sampling.allowed_token_ids) or None,
            bad_words=tuple(sampling.bad_words), constraint=constraint_from_pb(sampling))
    except InvalidArgument as error:
        raise prefixed(error, "sampling") from None


def constraint_from_pb(sampling: decoder_pb2.SamplingParams) -> Constraint | None:
    """The `constraint` oneof as a Constraint (None: unset). Raises InvalidArgument (Constraint's
    checks: a schema or choice list that is not JSON, a schema keyword that cannot be enforced)."""
    kind = sampling.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_object":
        if not sampling.json_object:
            return None  # false: no constraint, as unset
        spec = ""
    elif kind == "choice":
        spec = json.dumps(list(sampling.choice.choices), ensure_ascii=False)
    else:
        spec = getattr(sampling, kind)
    return Constraint(kind, spec, sampling.any_whitespace)


def chat_options_from_pb(request: decoder_pb2.GenerateRequest | decoder_pb2.DecoderTokenizeRequest
                         ) -> ChatTemplateOptions:
    """The chat template options of a Generate or Tokenize request: add_generation_prompt unset =
    not continue_final_message (true by default, false when continuing); chat_template_kwargs a
    JSON object ("" = none); tools a JSON array of OpenAI tools ("" = none; tools.parse_tools).

    Raises:
        InvalidArgument: chat_template_kwargs that is not JSON or not an object, tools that are not
            a valid tool array (naming the entry), or a refused combination or key (ChatTemplateOptions).
    """
    continue_final = request.continue_final_message
    add_prompt = request.add_generation_prompt if request.HasField("add_generation_prompt") else not continue_final
    kwargs = {}
    if request.chat_template_kwargs:
        try:
            kwargs = json.loads(request.chat_template_kwargs, parse_constant=_not_json)
        except json.JSONDecodeError as error:
            raise InvalidArgument(f"chat_template_kwargs is not JSON: {error}", field="chat_template_kwargs") from None
        if not isinstance(kwargs, dict):
            raise InvalidArgument(f"chat_template_kwargs must be a JSON object, got a JSON {type(kwargs).__name__}",
                                  field="chat_template_kwargs")
    return ChatTemplateOptions(add_prompt, continue_final, kwargs, parse_tools(request.tools))


def _not_json(constant: str):
    """NaN and Infinity, which Python's json reads and JSON (RFC 8259, the HTTP API) does not."""
    raise InvalidArgument(f"chat_template_kwargs is not JSON: {constant} is not a JSON value",
                          field="chat_template_kwargs")


def generate_from_pb(request: decoder_pb2.GenerateRequest, limits: GenerateLimits | None = None,
                     max_model_len: int | None = None, defaults: GenerationDefaults | None = None) -> GenerateInput:
    """`defaults`: the served model's sampling defaults (sampling_from_pb). Raises InvalidArgument:
    a cap of `limits` passed (checked first, on the protobuf, before any tensor is copied;
    `max_model_len` adds the context checks that need no tokenizer), a bad part, sampling value or
    chat template option."""
    if limits is not None:
        check_generate(request, limits, max_model_len)
    return GenerateInput(
        sampling=sampling_from_pb(request.sampling, defaults),
        request_id=request.request_id,
        prompt=tuple(part_from_pb(p, f"prompt[{i}]") for i, p in enumerate(request.prompt)),
        messages=_messages_from_pb(request.messages),
        prompt_token_ids=tuple(request.prompt_token_ids),
        lora=request.lora,
        return_prompt=request.return_prompt,
        chat=chat_options_from_pb(request),
    )


def _messages_from_pb(messages) -> tuple[ChatMessage, ...]:
    """Raises InvalidArgument: a bad part, or a tool call without a name or whose arguments are not
    a JSON object (naming messages[i].tool_calls[j])."""
    return tuple(ChatMessage(m.role, tuple(part_from_pb(p, f"messages[{i}].content[{j}]") for j, p in enumerate(m.content)),
                             m.name, m.tool_call_id,
                             tuple(tool_call_from_parts(c.id, c.name, c.arguments, f"messages[{i}].tool_calls[{j}]")
                                   for j, c in enumerate(m.tool_calls)))
                 for i, m in enumerate(messages))


def tokenize_from_pb(request: decoder_pb2.DecoderTokenizeRequest, limits: GenerateLimits,
                     max_model_len: int) -> TokenizeInput:
    """Raises InvalidArgument: a cap of `limits` passed (checked first), a bad part or chat template option."""
    check_decoder_tokenize("text and messages", [request.text, request.tools], request.messages, limits,
                           max_model_len)
    return TokenizeInput(
        text=request.text, messages=_messages_from_pb(request.messages),
        add_special_tokens=request.add_special_tokens if request.HasField("add_special_tokens") else None,
        chat=chat_options_from_pb(request))


def prompt_count_to_pb(count: PromptTokenCount) -> decoder_pb2.PromptTokenCount:
    return decoder_pb2.PromptTokenCount(num_text_tokens=count.num_text_tokens, num_images=count.num_images,
                                        max_model_len=count.max_model_len)


def tokenization_to_pb(result: Tokenization) -> decoder_pb2.DecoderTokenizeResponse:
    return decoder_pb2.DecoderTokenizeResponse(model=result.model, token_ids=result.token_ids,
                                               count=len(result.token_ids), max_model_len=result.max_model_len,
                                               tokens=result.tokens, special=result.special)


def detokenize_from_pb(request: decoder_pb2.DetokenizeRequest, limits: GenerateLimits,
                       max_model_len: int) -> list[int]:
    """The request's token ids. Raises InvalidArgument: more ids than the context (checked first)."""
    check_detokenize(request, limits, max_model_len)
    return list(request.token_ids)


def output_to_pb(output: RequestOutput) -> decoder_pb2.GenerateResponse:
    """One GenerateResponse; every logprob entry (chosen and alternatives, of the sampled tokens
    and of the prompt) carries its token's text and bytes from `output.token_texts`."""
    response = decoder_pb2.GenerateResponse(request_id=output.request_id, token_ids=output.token_ids,
                                            text=output.text, finish_reason=output.finish_reason or "",
                                            index=output.index)
    texts = output.token_texts
    response.logprobs.extend(_logprob_to_pb(sample, texts) for sample in output.logprobs)
    response.prompt_logprobs.extend(_logprob_to_pb(sample, texts) for sample in output.prompt_logprobs or ())
    if output.prompt_token_ids is not None:
        response.prompt_token_ids.extend(output.prompt_token_ids)
        response.prompt_text = output.prompt_text or ""
    if output.usage is not None:
        u = output.usage
        response.usage.CopyFrom(tensor_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                                 total_tokens=u.total_tokens, image_tokens=u.image_tokens,
                                                 cached_prompt_tokens=u.cached_prompt_tokens))
    return response


def _logprob_to_pb(sample: Sample, texts: dict[int, TokenText]) -> decoder_pb2.TokenLogprob:
    none = TokenText("", b"")
    chosen = texts.get(sample.token_id, none)
    top = []
    for token_id, logprob in sample.top:
        text = texts.get(token_id, none)
        top.append(decoder_pb2.TopLogprob(token_id=token_id, logprob=logprob, token=text.text, token_bytes=text.bytes))
    return decoder_pb2.TokenLogprob(token_id=sample.token_id, logprob=sample.logprob, top=top, token=chosen.text,
                                    token_bytes=chosen.bytes, rank=sample.rank or 0)


def info_to_pb(info: DecoderInfo) -> decoder_pb2.DecoderInfo:
    stats = info.stats
    return decoder_pb2.DecoderInfo(
        model=info.model, architecture=info.architecture, max_model_len=info.max_model_len,
        vocab_size=info.vocab_size, hidden_size=info.hidden_size, block_size=info.block_size,
        num_blocks=stats.num_blocks, num_free_blocks=stats.num_free_blocks, mrope_section=list(info.mrope_section),
        image_token_id=info.image_token_id or 0, num_running=stats.num_running, num_waiting=stats.num_waiting,
        dtype=info.dtype, num_cached_blocks=stats.num_cached_blocks, prefix_cache_hits=stats.prefix_cache_hits,
        prefix_cache_hit_tokens=stats.prefix_cache_hit_tokens, resident_adapters=info.resident_adapters,
        served_model_names=list(info.served_model_names), generation_config=info.generation_config,
        generation_defaults=info.generation_defaults, chat_template_takes_tools=info.chat_template_takes_tools,
        tool_call_parser=info.tool_call_parser, model_impl=info.model_impl,
        decode_step=info.decode_step, quantization=info.quantization)
