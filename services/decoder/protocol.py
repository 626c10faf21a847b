"""Protobuf <-> domain conversion for the Decoder service (the only decoder module, with the
servicer and the adapter client, that touches generated stubs)."""

from __future__ import annotations

from services.common.errors import InvalidArgument
from services.common.limits import GenerateLimits, check_generate
from services.common.tensor import from_pb
from services.decoder.inputs import (ChatMessage, GenerateInput, ImagePart, Part, RawImagePart,
                                     SamplingParams, TextPart)
from services.decoder.request import RequestOutput
from tessera.v1 import decoder_pb2, tensor_pb2


def part_from_pb(part: decoder_pb2.ContentPart) -> Part:
    kind = part.WhichOneof("part")
    if kind == "text":
        return TextPart(part.text)
    if kind == "encoded_image":
        image = part.encoded_image
        return ImagePart(from_pb(image.rows), tuple(image.grid_thw), tuple(image.mrope_section), image.content_hash)
    if kind is None:
        raise InvalidArgument("a content part has neither text nor an image")
    return RawImagePart()


def sampling_from_pb(sampling: decoder_pb2.SamplingParams) -> SamplingParams:
    """Raises InvalidArgument on out-of-range values (max_tokens < 1, negative temperature...)."""
    return SamplingParams(
        max_tokens=sampling.max_tokens, temperature=sampling.temperature,
        top_p=sampling.top_p if sampling.top_p else 1.0, top_k=sampling.top_k,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop=tuple(sampling.stop), stop_token_ids=tuple(sampling.stop_token_ids), ignore_eos=sampling.ignore_eos,
        repetition_penalty=sampling.repetition_penalty or 1.0, presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty, n=sampling.n or 1, logprobs=sampling.logprobs,
        top_logprobs=sampling.top_logprobs)


def generate_from_pb(request: decoder_pb2.GenerateRequest, limits: GenerateLimits | None = None,
                     max_model_len: int | None = None) -> GenerateInput:
    """Raises InvalidArgument: a cap of `limits` passed (checked first, on the protobuf, before any
    tensor is copied; `max_model_len` adds the context checks that need no tokenizer), or a bad part."""
    if limits is not None:
        check_generate(request, limits, max_model_len)
    return GenerateInput(
        sampling=sampling_from_pb(request.sampling),
        request_id=request.request_id,
        prompt=tuple(part_from_pb(p) for p in request.prompt),
        messages=tuple(ChatMessage(m.role, tuple(part_from_pb(p) for p in m.content)) for m in request.messages),
        prompt_token_ids=tuple(request.prompt_token_ids),
        lora=request.lora,
    )


def output_to_pb(output: RequestOutput) -> decoder_pb2.GenerateResponse:
    response = decoder_pb2.GenerateResponse(request_id=output.request_id, token_ids=output.token_ids,
                                            text=output.text, finish_reason=output.finish_reason or "",
                                            index=output.index)
    for sample in output.logprobs:
        response.logprobs.add(token_id=sample.token_id, logprob=sample.logprob,
                              top=[decoder_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in sample.top])
    if output.usage is not None:
        u = output.usage
        response.usage.CopyFrom(tensor_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                                 total_tokens=u.total_tokens, image_tokens=u.image_tokens,
                                                 cached_prompt_tokens=u.cached_prompt_tokens))
    return response
