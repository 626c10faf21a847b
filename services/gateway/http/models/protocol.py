"""Bodies and answers of /v1/models, the adapter routes (vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter) and /health.
"""

from __future__ import annotations

import time
from typing import ClassVar, Literal

from pydantic import BaseModel, Field

from services.gateway.http.fields import Body, Refusal


class LoadLoraAdapterRequest(Body):
    lora_name: str
    lora_path: str
    replace: bool = Field(default=False, strict=True, description="tessera: load new weights under a name already loaded")
    drain: bool = Field(default=False, strict=True, description="tessera: with replace, wait for running requests on the old "
                                                   "weights to end (else 400 while any runs)")


class UnloadLoraAdapterRequest(Body):
    lora_name: str
    drain: bool = Field(default=False, strict=True, description="tessera: refuse new requests and wait for running ones to "
                                                   "end (else 400 while any runs)")
    refused: ClassVar[dict[str, Refusal]] = {"lora_int_id": Refusal("adapters are named, not numbered: send lora_name")}


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()), description="the answer's time, as vLLM")
    owned_by: str = "tessera"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    generation_config: str | None = Field(default=None, description="tessera's, the base model: the decoder's "
                                          "--generation-config (absent when it does not say)")
    generation_defaults: dict[str, float] | None = Field(
        default=None, description="tessera's, the base model: the sampling defaults for fields a request leaves "
        "out (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens; absent when none)")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]
    unavailable: list[str] | None = Field(default=None, description="tessera's: set when the adapter registry "
                                          "did not answer; `data` then lists the served base and pooling models, "
                                          "no adapters (absent otherwise)")


class Health(BaseModel):
    """The answer of /health, /health/generate and /health/embed (docs/operations.md#health): 200 with
    status "ok" (everything serves) or "degraded" (something does not, and what the route checks
    still can be served), 503 with "unavailable"; the lists name what is down either way."""

    status: Literal["ok", "degraded", "unavailable"]
    not_serving: list[str] = Field(default=[], description="each dependency with nothing serving: \"service: why\"")
    degraded: list[str] = Field(default=[], description="each replica down beside others of its service that serve: "
                                "\"service replica host:port: why\"")
    serving: dict[str, bool] = Field(default={}, description="tessera's: whether each capability (generate: a decoder "
                                     "replica serves; embed: a pooler does) can be served now")
