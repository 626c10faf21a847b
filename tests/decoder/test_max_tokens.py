"""max_tokens absent (0 on the wire) generates up to the end of the context, as vLLM's OpenAI
server does: max_model_len less the prompt's tokens, bounded by what the KV cache holds."""

import asyncio

import pytest

from services.common.errors import InvalidArgument
from services.decoder.config import DecoderConfig
from services.decoder.convert import sampling_from_pb
from services.decoder.engine import start_engine
from services.decoder.types import GenerateInput, SamplingParams
from tessera.v1 import decoder_pb2

MAX_MODEL_LEN = 48
PROMPT = tuple(range(10, 22))  # 12 ids


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = start_engine(DecoderConfig(model_dir=str(tiny_llama), num_blocks=64, max_model_len=MAX_MODEL_LEN))
    yield engine
    engine.shutdown()


def _run(engine, request: GenerateInput) -> tuple[list[int], str]:
    async def main():
        token_ids, reason = [], None
        async for output in engine.generate(request):
            token_ids += output.token_ids
            reason = output.finish_reason
        return token_ids, reason
    return asyncio.run(main())


def test_absent_max_tokens_runs_to_the_end_of_the_context(engine):
    sampling = sampling_from_pb(decoder_pb2.SamplingParams(ignore_eos=True))  # max_tokens not sent
    assert sampling.max_tokens is None
    token_ids, reason = _run(engine, GenerateInput(sampling, prompt_token_ids=PROMPT))
    assert len(token_ids) == MAX_MODEL_LEN - len(PROMPT) and reason == "length"
    # the same tokens as asking for exactly the rest of the context
    explicit = SamplingParams(max_tokens=MAX_MODEL_LEN - len(PROMPT), ignore_eos=True)
    assert _run(engine, GenerateInput(explicit, prompt_token_ids=PROMPT)) == (token_ids, "length")


def test_absent_max_tokens_needs_room_for_one_token(engine):
    with pytest.raises(InvalidArgument, match=f"prompt has {MAX_MODEL_LEN} tokens; the model's context is "
                                              f"{MAX_MODEL_LEN} .*no room to generate a token"):
        _run(engine, GenerateInput(SamplingParams(), prompt_token_ids=tuple(range(MAX_MODEL_LEN))))
    token_ids, reason = _run(engine, GenerateInput(SamplingParams(ignore_eos=True),
                                                   prompt_token_ids=tuple(range(MAX_MODEL_LEN - 1))))
    assert (len(token_ids), reason) == (1, "length")


def test_explicit_max_tokens_is_checked_as_before(engine):
    with pytest.raises(InvalidArgument, match=r"max_tokens must be >= 1 \(or unset for the rest of the context\), got -1"):
        sampling_from_pb(decoder_pb2.SamplingParams(max_tokens=-1))
    with pytest.raises(InvalidArgument, match=f"prompt has 12 tokens and max_tokens 40; the model's context is {MAX_MODEL_LEN}"):
        _run(engine, GenerateInput(SamplingParams(max_tokens=40), prompt_token_ids=PROMPT))
