"""Decoder Tokenize / Detokenize over a real socket on the prepared SmolLM2 checkpoint: ids equal
transformers' AutoTokenizer (text with and without special tokens, the chat template as
`apply_chat_template`), detokenize equals `decode`, and refusals (out-of-vocabulary id, too many
ids, too much text, an image part, neither text nor messages) are INVALID_ARGUMENT naming the field."""

import asyncio

import grpc
import pytest
from decoder_testing import with_decoder_server
from transformers import AutoTokenizer

from services.common.errors import error_from_rpc
from services.common.limits import GenerateLimits
from services.decoder.config import DecoderConfig
from tessera.paths import default_decoder_dir
from tessera.v1 import decoder_pb2, vision_pb2

TEXT = "Tokenizers split text into pieces: naïve café, 日本語, emoji 🙂 and code def f(x): return x."
MESSAGES = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy?"}]
MAX_MODEL_LEN = 256


def _chat(messages) -> list[decoder_pb2.ChatMessage]:
    return [decoder_pb2.ChatMessage(role=m["role"], content=[decoder_pb2.ContentPart(text=m["content"])])
            for m in messages]


async def _refused(call, *words: str, field: str | None = None) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    for word in words:
        assert word in error.value.details()
    if field is not None:  # the field to blame travels as data (its ErrorInfo, tessera/rich_status.py)
        assert error_from_rpc(error.value).field == field


def test_tokenize_and_detokenize_equal_transformers():
    model_dir = default_decoder_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    limits = GenerateLimits(max_prompt_chars=4096)
    config = DecoderConfig(model_dir=str(model_dir), num_blocks=8, max_model_len=MAX_MODEL_LEN, limits=limits)

    async def body(stub, servicer):
        reply = await stub.Tokenize(decoder_pb2.DecoderTokenizeRequest(text=TEXT))
        expected = tokenizer(TEXT)["input_ids"]
        assert list(reply.token_ids) == expected and reply.count == len(expected)
        assert list(reply.tokens) == tokenizer.convert_ids_to_tokens(expected)
        assert list(reply.special) == [i in tokenizer.all_special_ids for i in expected]
        assert reply.max_model_len == MAX_MODEL_LEN and reply.model == model_dir.name
        plain = await stub.Tokenize(decoder_pb2.DecoderTokenizeRequest(text=TEXT, add_special_tokens=False))
        assert list(plain.token_ids) == tokenizer(TEXT, add_special_tokens=False)["input_ids"]

        chat = await stub.Tokenize(decoder_pb2.DecoderTokenizeRequest(messages=_chat(MESSAGES)))
        assert list(chat.token_ids) == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
        assert chat.special[0] and chat.tokens[0] == "<|im_start|>"
        bare = await stub.Tokenize(decoder_pb2.DecoderTokenizeRequest(messages=_chat(MESSAGES),
                                                                      add_generation_prompt=False))
        assert list(bare.token_ids) == tokenizer.apply_chat_template(MESSAGES)["input_ids"]
        assert bare.count < chat.count
        answer = [*MESSAGES[:2], {"role": "assistant", "content": "The capital is"}]
        open_turn = await stub.Tokenize(decoder_pb2.DecoderTokenizeRequest(messages=_chat(answer),
                                                                           continue_final_message=True))
        assert list(open_turn.token_ids) == tokenizer.apply_chat_template(answer, continue_final_message=True)[
            "input_ids"]
        await _refused(stub.Tokenize(decoder_pb2.DecoderTokenizeRequest(messages=_chat(MESSAGES),
                                                                        chat_template_kwargs='{"tokenize": true}')),
                       "chat_template_kwargs", "'tokenize'", field="chat_template_kwargs")

        text = await stub.Detokenize(decoder_pb2.DetokenizeRequest(token_ids=chat.token_ids))
        assert text.text == tokenizer.decode(list(chat.token_ids)) and text.model == model_dir.name
        skipped = await stub.Detokenize(decoder_pb2.DetokenizeRequest(token_ids=chat.token_ids,
                                                                      skip_special_tokens=True))
        assert skipped.text == tokenizer.decode(list(chat.token_ids), skip_special_tokens=True) != text.text
        round_trip = await stub.Detokenize(decoder_pb2.DetokenizeRequest(token_ids=plain.token_ids))
        assert round_trip.text == TEXT

        vocab = len(tokenizer)
        await _refused(stub.Detokenize(decoder_pb2.DetokenizeRequest(token_ids=[1, vocab])),
                       "token_ids[1]", str(vocab), field="token_ids[1]")
        await _refused(stub.Detokenize(decoder_pb2.DetokenizeRequest(token_ids=[-1])), "token_ids[0]")
        await _refused(stub.Detokenize(decoder_pb2.DetokenizeRequest(token_ids=[5] * (MAX_MODEL_LEN + 1))),
                       "token_ids", str(MAX_MODEL_LEN + 1), str(MAX_MODEL_LEN))
        await _refused(stub.Tokenize(decoder_pb2.DecoderTokenizeRequest(text="x" * 4097)),
                       "4097", "4096", "--max-prompt-chars")
        await _refused(stub.Tokenize(decoder_pb2.DecoderTokenizeRequest()), "exactly one")
        image = decoder_pb2.ContentPart(image=vision_pb2.ImageInput(data=b"\x89PNG"))
        await _refused(stub.Tokenize(decoder_pb2.DecoderTokenizeRequest(
            messages=[decoder_pb2.ChatMessage(role="user", content=[image])])), "messages[0]", "image")

    asyncio.run(with_decoder_server(config, body))


def test_consecutive_text_parts_of_a_message_are_joined_by_a_newline_as_vllm():
    """vLLM renders a message's text parts as one text joined by "\\n" (chat_utils); joined with
    nothing, "Translate to French:" + "Good morning" reached the model as one run-on line."""
    from services.decoder.multimodal import PromptBuilder, chat_text_joiner
    from services.decoder.types import ChatMessage, GenerateInput, SamplingParams, TextPart

    model_dir = default_decoder_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    parts = ("Translate to French:", "Good morning")
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "\n".join(parts)}],
                                             add_generation_prompt=True)["input_ids"]
    assert expected != tokenizer.apply_chat_template([{"role": "user", "content": "".join(parts)}],
                                                     add_generation_prompt=True)["input_ids"]
    assert chat_text_joiner(tokenizer) == "\n"  # SmolLM2's template takes the content as one string
    builder = PromptBuilder(tokenizer, tokenizer.vocab_size, 64, None, None)
    message = ChatMessage("user", tuple(TextPart(text) for text in parts))
    assert list(builder.build(GenerateInput(SamplingParams(), messages=(message,))).token_ids) == expected
    config = DecoderConfig(model_dir=str(model_dir), num_blocks=8, max_model_len=MAX_MODEL_LEN)

    async def body(stub, servicer):
        content = [decoder_pb2.ContentPart(text=text) for text in parts]
        reply = await stub.Tokenize(decoder_pb2.DecoderTokenizeRequest(
            messages=[decoder_pb2.ChatMessage(role="user", content=content)]))
        assert list(reply.token_ids) == expected

    asyncio.run(with_decoder_server(config, body))
