"""/tokenize and /detokenize bodies -> the core's Tokenize / Detokenize messages.
"""

from __future__ import annotations

from services.gateway.http.chat.serving import chat_messages, template_fields
from services.gateway.http.chat.tools import tools_text
from services.gateway.http.errors import ApiError
from services.gateway.http.tokenize.protocol import TokenizeRequest
from tessera.v1 import pooling_pb2

TOKENIZE_FIELDS = {"inputs": "prompt", "inputs.0": "prompt", "text": "prompt"}
DETOKENIZE_FIELDS = {"token_ids": "tokens"}


def tokenize_request(body: TokenizeRequest, model: str) -> pooling_pb2.TokenizeRequest:
    """vLLM's /tokenize as the gateway's Tokenize, for `model` (the body's, canonical).

    Raises:
        ApiError: 400 unless exactly one of prompt and messages is set, for template fields or tools
            without messages, or the refusals of `template_fields`.
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
        request.tools = tools_text(body)
    else:
        for name in ("add_generation_prompt", "chat_template_kwargs", "tools"):
            if getattr(body, name) is not None:
                raise ApiError(400, f"{name} applies to messages (the chat template); a prompt is tokenized as it is",
                               param=name)
        if body.continue_final_message:
            raise ApiError(400, "continue_final_message applies to messages (the chat template)",
                           param="continue_final_message")
    return request
