"""The OpenAI routes' max_tokens defaults, as OpenAI and vLLM: chat runs to the end of the context
(0 on the wire, resolved by the decoder: tests/decoder/test_max_tokens.py), completions take 16."""

from services.gateway.http.chat import protocol as chat_protocol
from services.gateway.http.chat.serving import chat_request, completion_requests

MESSAGES = [{"role": "user", "content": "hi"}]


def test_chat_without_max_tokens_asks_for_the_rest_of_the_context():
    assert chat_request(chat_protocol.ChatCompletionRequest(model="m", messages=MESSAGES)).sampling.max_tokens == 0
    for field in ("max_tokens", "max_completion_tokens"):
        body = chat_protocol.ChatCompletionRequest(model="m", messages=MESSAGES, **{field: 7})
        assert chat_request(body).sampling.max_tokens == 7


def test_completions_keep_openais_default_of_16():
    [request] = completion_requests(chat_protocol.CompletionRequest(model="m", prompt="hi"))
    assert request.sampling.max_tokens == 16
    [request] = completion_requests(chat_protocol.CompletionRequest(model="m", prompt="hi", max_tokens=3))
    assert request.sampling.max_tokens == 3
