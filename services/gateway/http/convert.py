"""HTTP bodies (services/gateway/http/models.py) <-> the gateway's protobuf messages."""

from __future__ import annotations

import json
import struct
import uuid

from services.gateway.http import models, responses
from services.gateway.http.errors import ApiError
from services.gateway.http.generate import Shape
from tessera.v1 import decoder_pb2, pooling_pb2, vision_pb2

_DATA_URI_PREFIX = "data:"
# SamplingParams' optional fields: left unset when the body leaves them out, so the served model's
# generation-config defaults apply (decoder.proto)
_OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "skip_special_tokens",
                      "spaces_between_special_tokens")
DEFAULT_TEMPERATURE = 1.0  # OpenAI's, when neither the request nor the model's generation config sets one


def _image(url: str, where: str) -> decoder_pb2.ContentPart:
    if not url.startswith(_DATA_URI_PREFIX) or ";base64," not in url[:256]:
        raise ApiError(400, f"{where}.image_url.url must be a base64 data URI (data:image/png;base64,...); "
                            f"remote URLs are not fetched by the gateway (got {url[:40]!r})", param=f"{where}.image_url")
    return decoder_pb2.ContentPart(image=vision_pb2.ImageInput(data_uri=url))


def chat_messages(messages: list[models.ChatMessage]) -> list[decoder_pb2.ChatMessage]:
    """OpenAI messages -> ChatMessage protos; each `image_url` part becomes an `image` part.

    Raises:
        ApiError: 400 for an image that is not a base64 data URI (remote URLs are never fetched).
    """
    out = []
    for i, message in enumerate(messages):
        content = message.content
        if content is None:
            parts = []
        elif isinstance(content, str):
            parts = [decoder_pb2.ContentPart(text=content)]
        else:
            parts = [decoder_pb2.ContentPart(text=p.text) if isinstance(p, models.TextPart)
                     else _image(p.image_url.url, f"messages.{i}.content.{j}") for j, p in enumerate(content)]
        role = "system" if message.role == "developer" else message.role  # OpenAI's new name for system
        out.append(decoder_pb2.ChatMessage(role=role, content=parts, name=message.name or ""))
    return out


def _stream_fields(body: models.SamplingFields) -> None:
    """Raises ApiError 400 for stream_options without stream (as OpenAI) and prompt_logprobs with
    stream (as vLLM: they are not streamed)."""
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if body.prompt_logprobs is not None and body.stream:
        raise ApiError(400, "prompt_logprobs are not available when stream is true (as vLLM)", param="prompt_logprobs")


def sampling(body: models.SamplingFields, max_tokens: int, logprobs: bool, top_logprobs: int,
             prompt_logprobs: int | None) -> decoder_pb2.SamplingParams:
    """The body's sampling fields as SamplingParams; a field the body leaves out stays unset (the
    model's generation-config default applies), and `default_temperature` is OpenAI's 1."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    params = decoder_pb2.SamplingParams(
        max_tokens=max_tokens, stop=stop, n=body.n, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, logprobs=logprobs, top_logprobs=top_logprobs,
        stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output, default_temperature=DEFAULT_TEMPERATURE)
    for name in _OPTIONAL_SAMPLING:
        value = getattr(body, name)
        if value is not None:
            setattr(params, name, value)
    if prompt_logprobs is not None:
        params.prompt_logprobs = prompt_logprobs
    return params


def template_fields(body: models.ChatCompletionRequest | models.TokenizeRequest, documents=None) -> dict:
    """add_generation_prompt, continue_final_message and chat_template_kwargs (a JSON object, with
    vLLM's `documents` under its "documents" key) as GenerateRequest and TokenizeRequest take them.

    Raises:
        ApiError: 400 for add_generation_prompt and continue_final_message both true (transformers
            refuses them together), `documents` beside a different chat_template_kwargs["documents"],
            or kwargs that are not JSON (NaN).
    """
    if body.continue_final_message and body.add_generation_prompt:
        raise ApiError(400, "add_generation_prompt and continue_final_message cannot both be true: the last message "
                            "either ends with the assistant's header or is continued", param="add_generation_prompt")
    kwargs = dict(body.chat_template_kwargs or {})
    if documents is not None:
        if "documents" in kwargs and kwargs["documents"] != documents:
            raise ApiError(400, "documents and chat_template_kwargs.documents differ; send one of them",
                           param="documents")
        kwargs["documents"] = documents
    fields = {"continue_final_message": body.continue_final_message}
    if body.add_generation_prompt is not None:
        fields["add_generation_prompt"] = body.add_generation_prompt
    elif body.continue_final_message:
        fields["add_generation_prompt"] = False
    if kwargs:
        try:
            fields["chat_template_kwargs"] = json.dumps(kwargs, allow_nan=False)
        except ValueError as error:
            raise ApiError(400, f"chat_template_kwargs is not JSON: {error}", param="chat_template_kwargs") from None
    return fields


def chat_request(body: models.ChatCompletionRequest) -> decoder_pb2.GenerateRequest:
    """The chat's Generate request, base model (the caller sets `lora`).

    Raises:
        ApiError: 400 for top_logprobs without logprobs (as OpenAI), the refusals of `_stream_fields`
            and `template_fields`, or a bad image (`chat_messages`).
    """
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    _stream_fields(body)
    max_tokens = body.max_completion_tokens or body.max_tokens or models.DEFAULT_CHAT_MAX_TOKENS
    return decoder_pb2.GenerateRequest(
        messages=chat_messages(body.messages),
        sampling=sampling(body, max_tokens, body.logprobs, body.top_logprobs or 0, body.prompt_logprobs),
        return_prompt=_continuous_usage(body), **template_fields(body, body.documents))


def _continuous_usage(body: models.SamplingFields) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.continuous_usage_stats)


def _echo_text(body: models.ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's content when it is the assistant's (text parts joined
    by newlines, as vLLM), else nothing."""
    last = body.messages[-1]
    if not body.echo or last.role != "assistant" or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(p.text for p in last.content if isinstance(p, models.TextPart))


def _shape(body: models.SamplingFields, chat: bool, model: str, as_ids: bool, **fields) -> Shape:
    prefix = "chatcmpl" if chat else "cmpl"
    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    return Shape(chat=chat, model=model, ident=f"{prefix}-{body.request_id or uuid.uuid4().hex}",
                 as_ids=as_ids if body.return_tokens_as_token_ids is None else body.return_tokens_as_token_ids,
                 prompt_logprobs=body.prompt_logprobs is not None, include_usage=include_usage,
                 continuous_usage=_continuous_usage(body), **fields)


def chat_shape(body: models.ChatCompletionRequest, model: str, as_ids: bool) -> Shape:
    """How the chat's answer is shaped; `model` names it, `as_ids`: the gateway's
    --return-tokens-as-token-ids (the body's return_tokens_as_token_ids decides when sent)."""
    return _shape(body, True, model, as_ids, logprobs=body.logprobs, echo_text=_echo_text(body))


def completion_shape(body: models.CompletionRequest, model: str, as_ids: bool) -> Shape:
    """As chat_shape, for completions (echo: the prompt first; max_tokens 0: the prompt alone)."""
    return _shape(body, False, model, as_ids, logprobs=body.logprobs is not None, echo_prompt=body.echo,
                  drop_generated=body.echo and body.max_tokens == 0)


# A refusal that names a protobuf field (TesseraError.field) names the body's field instead
# (errors.body_field): each route's protobuf paths -> the body's names, "" dropping a submessage.
_GENERATE_FIELDS = {"sampling": "", "lora": "model", "prompt_token_ids": "prompt", "prompt": "prompt"}


def chat_fields(body: models.ChatCompletionRequest) -> dict[str, str]:
    """The chat body's names for Generate's fields (max_tokens as the body sent it)."""
    sent = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    return {**_GENERATE_FIELDS, "sampling.max_tokens": sent}


def completion_fields(body: models.CompletionRequest) -> dict[str, str]:
    """The completions body's names for Generate's fields: top_logprobs is `logprobs`, and so is
    prompt_logprobs when echo asked for it through `logprobs`; a prompt's parts are the prompt."""
    fields = {**_GENERATE_FIELDS, "sampling.top_logprobs": "logprobs", "prompt.0": "prompt"}
    if body.prompt_logprobs is None:
        fields["sampling.prompt_logprobs"] = "logprobs"
    return fields


def embed_fields(body: models.EmbeddingRequest | models.TeiEmbedRequest) -> dict[str, str]:
    """The embeddings body's names for Embed's fields (`input`, TEI's `inputs`; a lone text or id
    list is the field itself)."""
    name = "inputs" if isinstance(body, models.TeiEmbedRequest) else "input"
    data = body.inputs if isinstance(body, models.TeiEmbedRequest) else body.input
    fields = {"inputs": name, "input_ids": name}
    if isinstance(data, str) or (data and isinstance(data[0], int)):
        fields |= {"inputs.0": name, "input_ids.0": name}
    return fields


TOKENIZE_FIELDS = {"inputs": "prompt", "inputs.0": "prompt", "text": "prompt"}
DETOKENIZE_FIELDS = {"token_ids": "tokens"}
RERANK_FIELDS = {"documents": "documents"}
TEI_RERANK_FIELDS = {"documents": "texts"}
SCORE_FIELDS = {"query": "text_1", "documents": "text_2"}


MAX_PROMPTS = 64  # prompts in one completions call, each one Generate (a batch past this: several calls)


def completion_requests(body: models.CompletionRequest) -> list[decoder_pb2.GenerateRequest]:
    """One GenerateRequest (base model) per prompt (a list of texts or of id lists is a batch, as in OpenAI).

    With echo, each asks for the prompt back (return_prompt) and, with logprobs, its tokens'
    logprobs (prompt_logprobs = logprobs, as vLLM); `max_tokens: 0` with echo asks for one token,
    which the answer leaves out (as vLLM).

    Raises:
        ApiError: 400 for max_tokens 0 without echo, an empty prompt list (or token id list in one),
            more than MAX_PROMPTS prompts, or the refusals of `_stream_fields`.
    """
    _stream_fields(body)
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(400, "max_tokens 0 asks for nothing: it is only taken with echo (the prompt alone, with "
                            "its logprobs)", param="max_tokens")
    prompt = body.prompt
    if isinstance(prompt, list) and not prompt:
        raise ApiError(400, "prompt is an empty list", param="prompt")
    max_tokens = models.DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else max(body.max_tokens, 1)
    logprobs = body.logprobs is not None
    prompt_logprobs = body.prompt_logprobs
    if prompt_logprobs is None and body.echo and logprobs:
        prompt_logprobs = body.logprobs
    params = sampling(body, max_tokens, logprobs, body.logprobs or 0, prompt_logprobs)
    common = {"sampling": params, "return_prompt": body.echo or _continuous_usage(body)}
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt[0], int):
        return [decoder_pb2.GenerateRequest(prompt_token_ids=prompt, **common)]
    else:
        prompts = prompt
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"prompt holds {len(prompts)} prompts; the limit is {MAX_PROMPTS} per request",
                       param="prompt")
    out = []
    for index, item in enumerate(prompts):
        if not item and isinstance(item, list):
            raise ApiError(400, f"prompt.{index} is an empty list of token ids; a prompt needs at least one",
                           param=f"prompt.{index}")
        if isinstance(item, str):
            out.append(decoder_pb2.GenerateRequest(prompt=[decoder_pb2.ContentPart(text=item)], **common))
        else:
            out.append(decoder_pb2.GenerateRequest(prompt_token_ids=item, **common))
    return out


def _direction(name: str | None) -> int:
    """TEI's truncation_direction (either spelling; None: right) as the protobuf enum."""
    return (pooling_pb2.TRUNCATION_DIRECTION_LEFT if (name or "").lower() == "left"
            else pooling_pb2.TRUNCATION_DIRECTION_RIGHT)


def _truncation(body) -> dict:
    """The pooling request's truncate and truncation_direction, from TEI's fields or vLLM's
    `truncate_prompt_tokens` (-1: cut to the model's maximum input length, keeping the last tokens).

    Raises:
        ApiError: 400 for another truncate_prompt_tokens (a cut to k tokens is not supported).
    """
    tokens = getattr(body, "truncate_prompt_tokens", None)
    if tokens is not None:
        if tokens != -1:
            raise ApiError(400, f"truncate_prompt_tokens {tokens} is not supported: -1 (cut an input to the model's "
                                "maximum input length, keeping its last tokens) is, or truncate: true",
                           param="truncate_prompt_tokens")
        return {"truncate": True, "truncation_direction": pooling_pb2.TRUNCATION_DIRECTION_LEFT}
    return {"truncate": bool(body.truncate), "truncation_direction": _direction(getattr(body, "truncation_direction",
                                                                                       None))}


def usage(*replies) -> responses.Usage:
    """The pooling answers' usage, summed (a total_tokens left 0 counts as the prompt's tokens)."""
    return responses.Usage(prompt_tokens=sum(r.usage.prompt_tokens for r in replies),
                        total_tokens=sum(r.usage.total_tokens or r.usage.prompt_tokens for r in replies))


def embed_request(body: models.EmbeddingRequest | models.TeiEmbedRequest, model: str) -> pooling_pb2.EmbedRequest:
    """Texts or token ids for `model` (canonical); `dimensions`, the format, normalize and truncation pass
    through (pooling checks them). TEI's body (`inputs`) also sets prompt_name, and normalize by TEI's
    default (true)."""
    tei = isinstance(body, models.TeiEmbedRequest)
    fmt = (pooling_pb2.ENCODING_FORMAT_BASE64 if not tei and body.encoding_format == "base64"
           else pooling_pb2.ENCODING_FORMAT_FLOAT)
    request = pooling_pb2.EmbedRequest(model=model, encoding_format=fmt, **_truncation(body))
    if body.dimensions is not None:
        request.dimensions = body.dimensions
    if body.normalize is not None:
        request.normalize = body.normalize
    if tei:
        request.prompt_name = body.prompt_name or ""
    data = body.inputs if tei else body.input
    if isinstance(data, str):
        request.inputs.append(data)
    elif data and isinstance(data[0], int):
        request.input_ids.add(ids=data)
    elif data and isinstance(data[0], list):
        for ids in data:
            request.input_ids.add(ids=ids)
    else:
        request.inputs.extend(data)
    return request


def embeddings(reply: pooling_pb2.EmbedResponse) -> list[list[float] | str]:
    """One vector (float list) or base64 string per input, in input order."""
    if reply.embeddings_base64:
        return list(reply.embeddings_base64)
    tensor = reply.embeddings
    if not tensor.shape:
        return []
    rows, dim = tensor.shape
    values = struct.unpack(f"<{rows * dim}f", tensor.data)
    return [list(values[r * dim:(r + 1) * dim]) for r in range(rows)]




def tokenize_request(body: models.TokenizeRequest, model: str) -> pooling_pb2.TokenizeRequest:
    """vLLM's /tokenize as the gateway's Tokenize, for `model` (the body's, canonical).

    Raises:
        ApiError: 400 unless exactly one of prompt and messages is set, for template fields without
            messages, or the refusals of `template_fields`.
    """
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "send exactly one of prompt or messages", param="prompt")
    request = pooling_pb2.TokenizeRequest(model=model, inputs=[] if body.prompt is None else [body.prompt],
                                          messages=chat_messages(body.messages or []))
    if body.add_special_tokens is not None:
        request.add_special_tokens = body.add_special_tokens
    if body.messages is not None:
        for name, value in template_fields(body).items():
            setattr(request, name, value)
    else:
        for name in ("add_generation_prompt", "chat_template_kwargs"):
            if getattr(body, name) is not None:
                raise ApiError(400, f"{name} applies to messages (the chat template); a prompt is tokenized as it is",
                               param=name)
        if body.continue_final_message:
            raise ApiError(400, "continue_final_message applies to messages (the chat template)",
                           param="continue_final_message")
    return request


def _raw_scores(body: models.RerankRequest | models.ScoreRequest) -> bool:
    """TEI's raw_scores, or vLLM's activation / use_activation false.

    Raises:
        ApiError: 400 when they contradict (raw_scores true with an activation true).
    """
    raw = getattr(body, "raw_scores", False)
    for name in ("activation", "use_activation"):
        value = getattr(body, name)
        if value is True and raw:
            raise ApiError(400, f"{name} true and raw_scores true contradict: the activation or the raw logit",
                           param=name)
        raw = raw or value is False
    return raw


def rerank_request(body: models.RerankRequest, model: str, tei_allowed: bool) -> pooling_pb2.RerankRequest:
    """Jina's / Cohere's body (`documents`) or, where `tei_allowed`, TEI's (`texts`), for `model` (canonical).

    Raises:
        ApiError: 400 unless exactly one of documents and texts is set (texts only where allowed).
    """
    if body.texts is not None and not tei_allowed:
        raise ApiError(400, "texts is TEI's field, taken on POST /rerank; send documents here", param="texts")
    if (body.documents is None) == (body.texts is None):
        raise ApiError(400, "send exactly one of documents (Jina's, Cohere's) or texts (TEI's)",
                       param="documents" if body.documents is None else "texts")
    tei = body.texts is not None
    documents = body.texts if tei else [d if isinstance(d, str) else d.text for d in body.documents]
    request = pooling_pb2.RerankRequest(model=model, query=body.query, documents=documents,
                                        return_documents=body.return_text if tei else body.return_documents,
                                        raw_scores=_raw_scores(body), **_truncation(body))
    if body.top_n is not None:
        request.top_n = body.top_n
    return request


def score_requests(body: models.ScoreRequest, model: str) -> list[pooling_pb2.RerankRequest]:
    """vLLM's /score pairs as Rerank calls: one text against many is one call, pairwise lists one
    call per pair (each a query with one document). Scores come back in the pairs' order
    (`scores`).

    Raises:
        ApiError: 400 for two lists of different lengths, or an empty one.
    """
    first = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    second = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    for name, texts in (("text_1", first), ("text_2", second)):
        if not texts:
            raise ApiError(400, f"{name} is empty; send a text or a list of texts", param=name)
    common = {"model": model, "raw_scores": _raw_scores(body), **_truncation(body)}
    if len(first) == 1:
        return [pooling_pb2.RerankRequest(query=first[0], documents=second, **common)]
    if len(first) != len(second):
        raise ApiError(400, f"text_1 has {len(first)} texts and text_2 {len(second)}; pairwise scoring needs lists "
                            "of equal length (or text_1 a single text)", param="text_2")
    return [pooling_pb2.RerankRequest(query=q, documents=[d], **common) for q, d in zip(first, second, strict=True)]


def scores(replies: list[pooling_pb2.RerankResponse]) -> responses.ScoreResponse:
    """The replies of `score_requests`' calls as vLLM's /score answer, in the pairs' order."""
    by_pair = [r.score for reply in replies for r in sorted(reply.results, key=lambda r: r.index)]
    return responses.ScoreResponse(id=f"score-{uuid.uuid4().hex}", model=replies[0].model,
                                data=[responses.ScoreData(index=i, score=s) for i, s in enumerate(by_pair)],
                                usage=usage(*replies))


def tei_ranks(reply: pooling_pb2.RerankResponse) -> list[dict]:
    """TEI's answer: [{index, score, text?}], highest score first (`text` only when asked for)."""
    return [{"index": r.index, "text": r.document, "score": r.score} if r.document else {"index": r.index, "score": r.score}
            for r in reply.results]


def tei_info(info: pooling_pb2.PoolingInfo, version: str) -> responses.TeiInfo:
    """TEI's /info for the pooling service's default model."""
    entry = next((m for m in info.models if m.model == info.model), None)
    kind = entry.kind if entry else "embedding"
    model_type = ({"embedding": responses.TeiEmbeddingModel(pooling=info.pooling_mode)} if kind == "embedding"
                  else {"reranker": responses.TeiClassifierModel(id2label={}, label2id={})})
    return responses.TeiInfo(model_id=info.model, served_model_name=info.model, model_type=model_type,
                          max_concurrent_requests=info.max_queue_size, max_input_length=info.max_input_length,
                          max_batch_tokens=info.max_batch_tokens, max_client_batch_size=info.max_batch_size,
                          version=version)


def rerank_response(reply: pooling_pb2.RerankResponse) -> responses.RerankResponse:
    results = [responses.RerankResult(index=r.index, relevance_score=r.score,
                                   document=responses.RerankDocument(text=r.document) if r.document else None)
               for r in reply.results]
    return responses.RerankResponse(model=reply.model, results=results, usage=usage(reply))
