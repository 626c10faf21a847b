"""Every request cap, table-driven: one over is refused naming the field, its size, the limit and its
flag; exactly at the cap passes. Checks run on the protobuf message as it arrived."""

from __future__ import annotations

import argparse
import time

import pytest

from services.adapters.config import RegistryConfig
from services.adapters.convert import check_request, report_from_pb
from services.common.config_cli import add_flags, from_flags
from services.common.errors import InvalidArgument
from services.common.limits import (
    CHARS_PER_CONTEXT_TOKEN,
    GenerateLimits,
    PoolingLimits,
    check_embed,
    check_generate,
    check_rerank,
    check_tokenize,
)
from services.decoder.convert import generate_from_pb
from tessera.v1 import adapters_pb2, decoder_pb2, pooling_pb2, vision_pb2

G = GenerateLimits(max_name_chars=10, max_prompt_chars=50, max_messages=3, max_content_parts=4, max_images=2,
                   max_stop=2, max_stop_chars=5, max_stop_token_ids=3, max_n=4, max_logprobs=5)
P = PoolingLimits(max_name_chars=10, max_batch_size=3, max_request_chars=20, max_request_token_ids=6)
R = RegistryConfig(root="/tmp/tessera-limits-test", max_path_chars=12, max_name_chars=10, max_report_entries=2)
CONTEXT = 100


def text(t: str) -> decoder_pb2.ContentPart:
    return decoder_pb2.ContentPart(text=t)


def image() -> decoder_pb2.ContentPart:
    return decoder_pb2.ContentPart(image=vision_pb2.ImageInput(data=b"x"))


def encoded(grid) -> decoder_pb2.ContentPart:
    return decoder_pb2.ContentPart(encoded_image=vision_pb2.EncodedImage(grid_thw=grid))


def gen(prompt=None, messages=(), max_tokens=4, **fields) -> decoder_pb2.GenerateRequest:
    prompt = (text("hi"),) if prompt is None else prompt
    sampling = {k: fields.pop(k) for k in ("stop", "stop_token_ids", "n", "logprobs", "top_logprobs", "prompt_logprobs")
                if k in fields}
    return decoder_pb2.GenerateRequest(prompt=list(prompt), messages=list(messages),
                                       sampling=decoder_pb2.SamplingParams(max_tokens=max_tokens, **sampling), **fields)


def chat(n: int, role: str = "user", parts: int = 1) -> list[decoder_pb2.ChatMessage]:
    return [decoder_pb2.ChatMessage(role=role, content=[text("a")] * parts) for _ in range(n)]


# (id, request at the cap, request one over, the refusal's text)
GENERATE = [
    ("request_id", gen(request_id="r" * 10), gen(request_id="r" * 11),
     "request_id has 11 characters; the limit is 10 (--max-name-chars)"),
    ("lora", gen(lora="l" * 10), gen(lora="l" * 11), "lora has 11 characters; the limit is 10 (--max-name-chars)"),
    ("role", gen(prompt=(), messages=[decoder_pb2.ChatMessage(role="u" * 10)]),
     gen(prompt=(), messages=[decoder_pb2.ChatMessage(role="u" * 11)]),
     "messages[0].role has 11 characters; the limit is 10 (--max-name-chars)"),
    ("prompt-chars", gen(prompt=(text("a" * 25), text("b" * 25))), gen(prompt=(text("a" * 25), text("b" * 26))),
     "prompt text has 51 characters; the limit is 50 (--max-prompt-chars"),
    ("message-chars", gen(prompt=(), messages=[decoder_pb2.ChatMessage(role="user", content=[text("m" * 50)])]),
     gen(prompt=(), messages=[decoder_pb2.ChatMessage(role="user", content=[text("m" * 51)])]),
     "prompt text has 51 characters"),
    ("messages", gen(prompt=(), messages=chat(3)), gen(prompt=(), messages=chat(4)),
     "messages has 4 messages; the limit is 3 (--max-messages)"),
    ("content-parts", gen(prompt=(), messages=chat(2, parts=2)), gen(prompt=(text("a"),), messages=chat(2, parts=2)),
     "prompt and messages has 5 content parts; the limit is 4 (--max-content-parts)"),
    ("images", gen(prompt=(image(), image())), gen(prompt=(image(), encoded([1, 1, 1]), image())),
     "prompt and messages has 3 images; the limit is 2 (--max-images)"),
    ("stop-count", gen(stop=["a", "b"]), gen(stop=["a", "b", "c"]),
     "sampling.stop has 3 strings; the limit is 2 (--max-stop)"),
    ("stop-chars", gen(stop=["s" * 5]), gen(stop=["a", "s" * 6]),
     "sampling.stop[1] has 6 characters; the limit is 5 (--max-stop-chars)"),
    ("stop-token-ids", gen(stop_token_ids=[1, 2, 3]), gen(stop_token_ids=[1, 2, 3, 4]),
     "sampling.stop_token_ids has 4 ids; the limit is 3 (--max-stop-token-ids)"),
    ("n", gen(n=4), gen(n=5), "sampling.n is 5; the limit is 4 (--max-n)"),
    ("top-logprobs", gen(logprobs=True, top_logprobs=5), gen(logprobs=True, top_logprobs=6),
     "sampling.top_logprobs is 6; the limit is 5 (--max-logprobs)"),
    ("top-logprobs-without-logprobs", gen(logprobs=True, top_logprobs=3), gen(top_logprobs=3),
     "sampling.top_logprobs is 3, which needs sampling.logprobs true"),
    ("prompt-logprobs", gen(prompt_logprobs=5), gen(prompt_logprobs=6),
     "sampling.prompt_logprobs is 6; the limit is 5 (--max-logprobs)"),
    ("max-tokens-negative", gen(max_tokens=0), gen(max_tokens=-1),
     "sampling.max_tokens must be >= 1 (or 0, unset: the rest of the context), got -1"),
    ("max-tokens", gen(max_tokens=CONTEXT - 1), gen(max_tokens=CONTEXT),
     f"sampling.max_tokens is {CONTEXT}; the model's context is {CONTEXT} tokens"),
    ("prompt-token-ids", gen(prompt=(), prompt_token_ids=[1] * 96), gen(prompt=(), prompt_token_ids=[1] * 97),
     f"prompt_token_ids has 97 ids and max_tokens 4; the model's context is {CONTEXT}"),
    ("prompt-token-ids-max-tokens-unset", gen(prompt=(), prompt_token_ids=[1] * (CONTEXT - 1), max_tokens=0),
     gen(prompt=(), prompt_token_ids=[1] * CONTEXT, max_tokens=0),
     f"prompt_token_ids has {CONTEXT} ids and room for one generated token; the model's context is {CONTEXT}"),
    ("image-grid", gen(prompt=(encoded([1, 8, 12]),)), gen(prompt=(encoded([1, 8, 12]), encoded([1, 1, 1]))),
     f"images expand to 97 tokens and max_tokens is 4; the model's context is {CONTEXT}"),
]


@pytest.mark.parametrize("at_cap, over, message", [row[1:] for row in GENERATE], ids=[row[0] for row in GENERATE])
def test_generate_caps(at_cap, over, message):
    check_generate(at_cap, G, CONTEXT)
    with pytest.raises(InvalidArgument) as error:
        check_generate(over, G, CONTEXT)
    assert message in str(error.value)


# The field each cap blames (TesseraError.field), absent where the count spans several fields.
GENERATE_FIELDS = {"request_id": "request_id", "lora": "lora", "role": "messages[0].role", "messages": "messages",
                   "stop-count": "sampling.stop", "stop-chars": "sampling.stop[1]",
                   "stop-token-ids": "sampling.stop_token_ids", "n": "sampling.n", "top-logprobs": "sampling.top_logprobs",
                   "top-logprobs-without-logprobs": "sampling.top_logprobs",
                   "prompt-logprobs": "sampling.prompt_logprobs", "max-tokens-negative": "sampling.max_tokens",
                   "max-tokens": "sampling.max_tokens", "prompt-token-ids": "prompt_token_ids",
                   "prompt-token-ids-max-tokens-unset": "prompt_token_ids"}


@pytest.mark.parametrize("name, over", [(row[0], row[2]) for row in GENERATE], ids=[row[0] for row in GENERATE])
def test_generate_caps_name_the_field_to_blame(name, over):
    with pytest.raises(InvalidArgument) as error:
        check_generate(over, G, CONTEXT)
    assert error.value.field == GENERATE_FIELDS.get(name)
    assert error.value.field is None or str(error.value).startswith(error.value.field)


def embed(**fields) -> pooling_pb2.EmbedRequest:
    return pooling_pb2.EmbedRequest(**fields)


def ids(*lengths) -> list[pooling_pb2.TokenIds]:
    return [pooling_pb2.TokenIds(ids=[1] * n) for n in lengths]


POOLING = [
    ("embed-model", check_embed, embed(model="m" * 10), embed(model="m" * 11),
     "model has 11 characters; the limit is 10 (--max-name-chars)"),
    ("embed-prompt-name", check_embed, embed(prompt_name="p" * 10), embed(prompt_name="p" * 11),
     "prompt_name has 11 characters"),
    ("embed-inputs", check_embed, embed(inputs=["a"] * 3), embed(inputs=["a"] * 4),
     "inputs has 4 inputs; the limit is 3 (--max-batch-size)"),
    ("embed-input-ids", check_embed, embed(input_ids=ids(1, 1, 1)), embed(input_ids=ids(1, 1, 1, 1)),
     "input_ids has 4 inputs; the limit is 3 (--max-batch-size)"),
    ("embed-chars", check_embed, embed(inputs=["a" * 10, "b" * 10]), embed(inputs=["a" * 10, "b" * 11]),
     "inputs hold 21 characters of text; the limit is 20 (--max-request-chars)"),
    ("embed-token-ids", check_embed, embed(input_ids=ids(3, 3)), embed(input_ids=ids(3, 4)),
     "input_ids has 7 token ids; the limit is 6 (--max-request-token-ids)"),
    ("rerank-method", check_rerank, pooling_pb2.RerankRequest(method="x" * 10),
     pooling_pb2.RerankRequest(method="x" * 11), "method has 11 characters"),
    ("rerank-documents", check_rerank, pooling_pb2.RerankRequest(documents=["d"] * 3),
     pooling_pb2.RerankRequest(documents=["d"] * 4), "documents has 4 documents; the limit is 3 (--max-batch-size)"),
    ("rerank-chars", check_rerank, pooling_pb2.RerankRequest(query="q" * 10, documents=["d" * 10]),
     pooling_pb2.RerankRequest(query="q" * 11, documents=["d" * 10]),
     "query and documents hold 21 characters of text; the limit is 20 (--max-request-chars)"),
    ("tokenize-inputs", check_tokenize, pooling_pb2.TokenizeRequest(inputs=["t"] * 3),
     pooling_pb2.TokenizeRequest(inputs=["t"] * 4), "inputs has 4 inputs"),
    ("tokenize-chars", check_tokenize, pooling_pb2.TokenizeRequest(inputs=["t" * 20]),
     pooling_pb2.TokenizeRequest(inputs=["t" * 21]), "inputs hold 21 characters of text"),
    ("tokenize-model", check_tokenize, pooling_pb2.TokenizeRequest(model="m" * 10),
     pooling_pb2.TokenizeRequest(model="m" * 11), "model has 11 characters"),
]


@pytest.mark.parametrize("check, at_cap, over, message", [row[1:] for row in POOLING], ids=[row[0] for row in POOLING])
def test_pooling_caps(check, at_cap, over, message):
    check(at_cap, P)
    with pytest.raises(InvalidArgument) as error:
        check(over, P)
    assert message in str(error.value)


def report(resident=1, by_name=1, acked=1, decoder_id="d", digest="x", name="n") -> adapters_pb2.ResidencyReport:
    entry = adapters_pb2.ResidentDigest(digest=digest, leases=1,
                                        by_name=[adapters_pb2.NameLeases(name=name, leases=1)] * by_name)
    return adapters_pb2.ResidencyReport(decoder_id=decoder_id, resident=[entry] * resident,
                                        draining_acked=[adapters_pb2.AdapterRef(name=name, digest=digest)] * acked)


REGISTRY = [
    ("load-path", adapters_pb2.LoadAdapterRequest(name="a", path="p" * 12),
     adapters_pb2.LoadAdapterRequest(name="a", path="p" * 13), "path has 13 characters; the limit is 12 (--max-path-chars)"),
    ("unload-name", adapters_pb2.UnloadAdapterRequest(name="n" * 10), adapters_pb2.UnloadAdapterRequest(name="n" * 11),
     "name has 11 characters; the limit is 10 (--max-name-chars)"),
    ("get-name", adapters_pb2.GetAdapterRequest(name="n" * 10), adapters_pb2.GetAdapterRequest(name="n" * 11),
     "name has 11 characters"),
    ("report-resident", report(resident=2), report(resident=3), "resident has 3 entries; the limit is 2 (--max-report-entries)"),
    ("report-by-name", report(by_name=2), report(by_name=3), "resident[0].by_name has 3 entries"),
    ("report-acked", report(acked=2), report(acked=3), "draining_acked has 3 entries"),
    ("report-decoder-id", report(decoder_id="d" * 10), report(decoder_id="d" * 11), "decoder_id has 11 characters"),
    ("report-digest", report(digest="x" * 10), report(digest="x" * 11), "resident[0].digest has 11 characters"),
    ("report-name", report(name="n" * 10), report(name="n" * 11), "resident[0].by_name[0].name has 11 characters"),
]


@pytest.mark.parametrize("at_cap, over, message", [row[1:] for row in REGISTRY], ids=[row[0] for row in REGISTRY])
def test_registry_caps(at_cap, over, message):
    check = report_from_pb if isinstance(at_cap, adapters_pb2.ResidencyReport) else check_request
    check(at_cap, R)
    with pytest.raises(InvalidArgument) as error:
        check(over, R)
    assert message in str(error.value)


def test_default_prompt_chars_follow_the_context():
    limits = GenerateLimits()
    assert limits.prompt_chars(2048) == CHARS_PER_CONTEXT_TOKEN * 2048
    assert limits.prompt_chars(None) is None
    check_generate(gen(prompt=(text("a" * 100_000),)), limits, None)  # context unknown: left to the decoder
    with pytest.raises(InvalidArgument, match="prompt text has 65537 characters; the limit is 65536"):
        check_generate(gen(prompt=(text("a" * 65_537),)), limits, 2048)


def test_a_huge_request_id_is_refused_by_the_decoders_conversion_at_once():
    request = gen(request_id="r" * 3_000_000, prompt=(text("x" * 50_000_000),))
    start = time.perf_counter()
    with pytest.raises(InvalidArgument, match="request_id has 3000000 characters; the limit is 256"):
        generate_from_pb(request, GenerateLimits(), 2048)
    assert time.perf_counter() - start < 0.1


@pytest.mark.parametrize("cls, field, value", [
    (GenerateLimits, "max_name_chars", 0), (GenerateLimits, "max_prompt_chars", -1), (GenerateLimits, "max_n", 17),
    (GenerateLimits, "max_logprobs", 21), (PoolingLimits, "max_request_token_ids", 0),
])
def test_limits_are_validated_once(cls, field, value):
    with pytest.raises(ValueError, match=field):
        cls(**{field: value})


def test_flags_are_generated_from_the_fields_and_shared_by_name():
    parser = argparse.ArgumentParser()
    add_flags(parser, GenerateLimits)
    add_flags(parser, PoolingLimits)  # --max-name-chars already there: one setting for both
    args = parser.parse_args(["--max-name-chars", "7", "--max-stop", "3", "--max-request-token-ids", "9"])
    assert from_flags(GenerateLimits, args) == GenerateLimits(max_name_chars=7, max_stop=3)
    assert from_flags(PoolingLimits, args) == PoolingLimits(max_name_chars=7, max_request_token_ids=9)
