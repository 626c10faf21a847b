"""/v1/models: the served base model, every pooling model and each loaded adapter, from the core.
"""

from __future__ import annotations

from services.common.errors import DeadlineExceeded, Unavailable
from services.gateway.core import Call
from services.gateway.http.backend import Backend, DecoderNames
from services.gateway.http.errors import ApiError
from services.gateway.http.models.protocol import Model, ModelList
from tessera.v1 import adapters_pb2


async def served_models(backend: Backend) -> ModelList:
    """The decoder's base model (its first served name), every pooling model, and each loaded
    adapter (parent: the base); aliases are accepted in requests, not listed."""
    info = await backend.info()
    if info.unavailable and not info.decoder.model and not info.pooling.model:
        raise ApiError(503, "; ".join(info.unavailable), "service_unavailable")
    data = []
    base = DecoderNames.of(info.decoder).base if info.decoder.model else None
    if base:
        data.append(Model(id=base, root=base, max_model_len=info.decoder.max_model_len,
                                    generation_config=info.decoder.generation_config or None,
                                    generation_defaults=dict(info.decoder.generation_defaults) or None))
    pooled = list(info.pooling.models) or ([info.pooling] if info.pooling.model else [])
    for model in pooled:
        data.append(Model(id=model.model, root=model.model, max_model_len=model.max_input_length or None))
    try:
        adapters = (await backend.core.list_adapters(adapters_pb2.ListAdaptersRequest(), Call())).adapters
    except (Unavailable, DeadlineExceeded) as error:
        # the registry is down: the models still served are listed (as vLLM's list never fails),
        # and the answer says which part is missing
        return ModelList(data=data, unavailable=[str(error) or f"adapters: {error.code.name}"])
    for adapter in adapters:
        if adapter.state in ("ready", "draining"):  # not those registered for another base model (base_*)
            data.append(Model(id=adapter.name, root=adapter.path, parent=base,
                                        max_model_len=info.decoder.max_model_len or None))
    return ModelList(data=data)


# tessera's fields of a /v1/models entry, present only when they say something
_ENTRY_EXTRAS = ("generation_config", "generation_defaults")


def model_entry(model: Model) -> dict:
    entry = model.model_dump()
    for name in _ENTRY_EXTRAS:
        if entry[name] is None:
            del entry[name]
    return entry


def model_list(listed: ModelList) -> dict:
    """/v1/models' answer: `unavailable` only when the registry did not answer."""
    answer = {"object": listed.object, "data": [model_entry(m) for m in listed.data]}
    if listed.unavailable is not None:
        answer["unavailable"] = listed.unavailable
    return answer
