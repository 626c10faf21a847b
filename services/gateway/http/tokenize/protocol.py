"""Request bodies and answers of /tokenize and /detokenize (vLLM's shapes).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, Field

from services.gateway.http.chat.protocol import ChatMessage, Tool, WithTools
from services.gateway.http.fields import Body, Refusal, accepted
from services.gateway.http.protocol import TokenIds


class TokenizeRequest(Body, WithTools):
    """vLLM's /tokenize: exactly one of `prompt` and `messages` (chat: decoder models only)."""

    model: str | None = Field(default=None, description="absent: the decoder's tokenizer when a decoder is served "
                              "(as vLLM), else the default pooling model's; a pooling model's name or alias: that "
                              "model's; the decoder's name, alias or a loaded adapter's name: the decoder's")
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(fail_fast=True)] | None = Field(
        default=None, description="rendered with the decoder's chat template")
    add_special_tokens: bool | None = Field(default=None, description="default true for prompt, false for messages")
    add_generation_prompt: bool | None = Field(default=None, description="messages only (absent: true, false with "
                                               "continue_final_message)")
    continue_final_message: bool = Field(default=False, description="messages only, as chat's")
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description="messages only, as chat's")
    tools: Annotated[list[Tool], Field(max_length=128, fail_fast=True)] | None = Field(
        default=None, description="messages only: rendered by the chat template, as chat's")
    return_token_strs: bool | None = accepted("token_strs are always returned")
    refused: ClassVar[dict[str, Refusal]] = {
        "chat_template": Refusal("the served model's own chat template renders every chat"),
        "mm_processor_kwargs": Refusal("the vision service's processor takes no per-request arguments", ({},)),
        "media_io_kwargs": Refusal("images are decoded with fixed settings", ({},)),
    }


class DetokenizeRequest(Body):
    """vLLM's /detokenize (decoder models only)."""

    model: str | None = Field(default=None, description="the decoder's model, an alias or a loaded adapter's name "
                              "(absent: the decoder's model, as vLLM)")
    tokens: TokenIds


class TokenizeResponse(BaseModel):
    model: str
    count: int
    max_model_len: int | None = Field(default=None, description="decoder models: the context in tokens")
    tokens: list[int]
    token_strs: list[str]


class DetokenizeResponse(BaseModel):
    model: str
    prompt: str
