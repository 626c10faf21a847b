"""HTTP bodies (tessera/gateway/http/models.py) <-> the gateway's protobuf messages.

Token strings in logprobs are `token_id:<id>` (vLLM's `return_tokens_as_token_ids` form): the
gateway holds no tokenizer, and an id is exact where a decoded piece of a multi-byte character is not.
"""

from __future__ import annotations

import struct
import uuid

from tessera.gateway.http import models
from tessera.gateway.http.errors import ApiError
from tessera.v1 import decoder_pb2, pooling_pb2, vision_pb2

_DATA_URI_PREFIX = "data:"


def token_str(token_id: int) -> str:
    return f"token_id:{token_id}"


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
        out.append(decoder_pb2.ChatMessage(role=role, content=parts))
    return out


def sampling(body: models.SamplingFields, max_tokens: int | None, default_max_tokens: int,
             logprobs: bool, top_logprobs: int) -> decoder_pb2.SamplingParams:
    """OpenAI sampling fields -> SamplingParams (OpenAI's defaults: temperature 1, top_p 1; an absent
    max_tokens takes `default_max_tokens`, 0 = the rest of the context).

    Raises:
        ApiError: 400 for a `logit_bias` or `truncate_prompt_tokens` (not supported) or `stream_options`
            without `stream`.
    """
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported", param="logit_bias")
    if body.truncate_prompt_tokens is not None:
        raise ApiError(400, "truncate_prompt_tokens is not supported: a prompt past the model's context is refused; "
                            "shorten it", param="truncate_prompt_tokens")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    params = decoder_pb2.SamplingParams(
        max_tokens=max_tokens or default_max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        stop=stop, n=body.n, presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        logprobs=logprobs, top_logprobs=top_logprobs)
    if body.seed is not None:
        params.seed = body.seed
    return params


def chat_request(body: models.ChatCompletionRequest) -> decoder_pb2.GenerateRequest:
    """The chat's Generate request, base model (the caller sets `lora`).

    Raises:
        ApiError: 400 for a field tessera does not honour (structured output, tools and functions,
            logit_bias), top_logprobs without logprobs (as OpenAI), or a bad image (`chat_messages`).
    """
    if body.response_format is not None and body.response_format != {"type": "text"}:
        raise ApiError(400, f"response_format {body.response_format.get('type')!r} is not supported (structured "
                            "output); only {\"type\": \"text\"}", param="response_format")
    if body.tools or body.functions:
        name = "tools" if body.tools else "functions"
        raise ApiError(400, f"{name} are not supported: the gateway does not call tools", param=name)
    for name in ("tool_choice", "function_call"):
        if getattr(body, name) not in (None, "none"):
            raise ApiError(400, f"{name} is not supported: the gateway does not call tools", param=name)
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return decoder_pb2.GenerateRequest(
        messages=chat_messages(body.messages),
        sampling=sampling(body, body.max_completion_tokens or body.max_tokens, models.DEFAULT_CHAT_MAX_TOKENS,
                          body.logprobs, body.top_logprobs or 0))


MAX_PROMPTS = 64  # prompts in one completions call, each one Generate (a batch past this: several calls)


def completion_requests(body: models.CompletionRequest) -> list[decoder_pb2.GenerateRequest]:
    """One GenerateRequest (base model) per prompt (a list of texts or of id lists is a batch, as in OpenAI).

    Raises:
        ApiError: 400 for `echo`, `suffix` or `best_of` past n (not supported), an empty prompt list,
            more than MAX_PROMPTS prompts, or the refusals of `sampling`.
    """
    if body.echo:
        raise ApiError(400, "echo is not supported: the gateway returns only the generated text", param="echo")
    if body.suffix:
        raise ApiError(400, "suffix (insertion) is not supported", param="suffix")
    if body.best_of not in (None, 1, body.n):
        raise ApiError(400, f"best_of {body.best_of} is not supported: each prompt returns its n = {body.n} "
                            "samples, none ranked out", param="best_of")
    prompt = body.prompt
    if isinstance(prompt, list) and not prompt:
        raise ApiError(400, "prompt is an empty list", param="prompt")
    logprobs = body.logprobs is not None
    params = sampling(body, body.max_tokens, models.DEFAULT_COMPLETION_MAX_TOKENS, logprobs, body.logprobs or 0)
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt[0], int):
        return [decoder_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=params)]
    else:
        prompts = prompt
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"prompt holds {len(prompts)} prompts; the limit is {MAX_PROMPTS} per request",
                       param="prompt")
    out = []
    for item in prompts:
        if isinstance(item, str):
            out.append(decoder_pb2.GenerateRequest(prompt=[decoder_pb2.ContentPart(text=item)], sampling=params))
        else:
            out.append(decoder_pb2.GenerateRequest(prompt_token_ids=item, sampling=params))
    return out


def chat_logprobs(entries) -> models.ChoiceLogprobs:
    return models.ChoiceLogprobs(content=[
        models.TokenLogprob(token=token_str(e.token_id), logprob=e.logprob,
                            top_logprobs=[models.TopLogprob(token=token_str(t.token_id), logprob=t.logprob)
                                          for t in e.top]) for e in entries])


def completion_logprobs(entries) -> models.CompletionLogprobs:
    return models.CompletionLogprobs(
        tokens=[token_str(e.token_id) for e in entries], token_logprobs=[e.logprob for e in entries],
        top_logprobs=[{token_str(t.token_id): t.logprob for t in e.top} for e in entries])


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


def usage(*replies) -> models.Usage:
    """The pooling answers' usage, summed (a total_tokens left 0 counts as the prompt's tokens)."""
    return models.Usage(prompt_tokens=sum(r.usage.prompt_tokens for r in replies),
                        total_tokens=sum(r.usage.total_tokens or r.usage.prompt_tokens for r in replies))


def embed_request(body: models.EmbeddingRequest | models.TeiEmbedRequest) -> pooling_pb2.EmbedRequest:
    """Texts or token ids; `dimensions`, the format and truncation pass through (pooling checks them).
    TEI's body (`inputs`) also sets normalize (TEI's default: true) and prompt_name."""
    tei = isinstance(body, models.TeiEmbedRequest)
    fmt = (pooling_pb2.ENCODING_FORMAT_BASE64 if not tei and body.encoding_format == "base64"
           else pooling_pb2.ENCODING_FORMAT_FLOAT)
    request = pooling_pb2.EmbedRequest(model=body.model or "", encoding_format=fmt, **_truncation(body))
    if body.dimensions is not None:
        request.dimensions = body.dimensions
    if tei:
        request.normalize = body.normalize
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




def tokenize_request(body: models.TokenizeRequest) -> pooling_pb2.TokenizeRequest:
    """Raises ApiError 400 unless exactly one of prompt and messages is set."""
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "send exactly one of prompt or messages", param="prompt")
    request = pooling_pb2.TokenizeRequest(model=body.model or "", inputs=[] if body.prompt is None else [body.prompt],
                                          messages=chat_messages(body.messages or []))
    if body.add_special_tokens is not None:
        request.add_special_tokens = body.add_special_tokens
    if body.messages is not None:
        request.add_generation_prompt = body.add_generation_prompt
    return request


def rerank_request(body: models.RerankRequest, tei_allowed: bool) -> pooling_pb2.RerankRequest:
    """Jina's / Cohere's body (`documents`) or, where `tei_allowed`, TEI's (`texts`).

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
    request = pooling_pb2.RerankRequest(model=body.model or "", query=body.query, documents=documents,
                                        return_documents=body.return_text if tei else body.return_documents,
                                        raw_scores=body.raw_scores, **_truncation(body))
    if body.top_n is not None:
        request.top_n = body.top_n
    return request


def score_requests(body: models.ScoreRequest) -> list[pooling_pb2.RerankRequest]:
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
    common = {"model": body.model or "", **_truncation(body)}
    if len(first) == 1:
        return [pooling_pb2.RerankRequest(query=first[0], documents=second, **common)]
    if len(first) != len(second):
        raise ApiError(400, f"text_1 has {len(first)} texts and text_2 {len(second)}; pairwise scoring needs lists "
                            "of equal length (or text_1 a single text)", param="text_2")
    return [pooling_pb2.RerankRequest(query=q, documents=[d], **common) for q, d in zip(first, second, strict=True)]


def scores(replies: list[pooling_pb2.RerankResponse]) -> models.ScoreResponse:
    """The replies of `score_requests`' calls as vLLM's /score answer, in the pairs' order."""
    by_pair = [r.score for reply in replies for r in sorted(reply.results, key=lambda r: r.index)]
    return models.ScoreResponse(id=f"score-{uuid.uuid4().hex}", model=replies[0].model,
                                data=[models.ScoreData(index=i, score=s) for i, s in enumerate(by_pair)],
                                usage=usage(*replies))


def tei_ranks(reply: pooling_pb2.RerankResponse) -> list[dict]:
    """TEI's answer: [{index, score, text?}], highest score first (`text` only when asked for)."""
    return [{"index": r.index, "text": r.document, "score": r.score} if r.document else {"index": r.index, "score": r.score}
            for r in reply.results]


def tei_info(info: pooling_pb2.PoolingInfo, version: str) -> models.TeiInfo:
    """TEI's /info for the pooling service's default model."""
    entry = next((m for m in info.models if m.model == info.model), None)
    kind = entry.kind if entry else "embedding"
    model_type = ({"embedding": models.TeiEmbeddingModel(pooling=info.pooling_mode)} if kind == "embedding"
                  else {"reranker": models.TeiClassifierModel(id2label={}, label2id={})})
    return models.TeiInfo(model_id=info.model, served_model_name=info.model, model_type=model_type,
                          max_concurrent_requests=info.max_queue_size, max_input_length=info.max_input_length,
                          max_batch_tokens=info.max_batch_tokens, max_client_batch_size=info.max_batch_size,
                          version=version)


def rerank_response(reply: pooling_pb2.RerankResponse) -> models.RerankResponse:
    results = [models.RerankResult(index=r.index, relevance_score=r.score,
                                   document=models.RerankDocument(text=r.document) if r.document else None)
               for r in reply.results]
    return models.RerankResponse(model=reply.model, results=results, usage=usage(reply))
