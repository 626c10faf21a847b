from tessera.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdapterResidency(_message.Message):
    __slots__ = ("decoder_id", "leases")
    DECODER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    decoder_id: str
    leases: int
    def __init__(self, decoder_id: _Optional[str] = ..., leases: _Optional[int] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "digest", "rank", "target_modules", "lora_alpha", "use_rslora", "path", "generation", "state", "residency", "leases", "base_model", "base_model_name")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    LORA_ALPHA_FIELD_NUMBER: _ClassVar[int]
    USE_RSLORA_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    digest: str
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    lora_alpha: float
    use_rslora: bool
    path: str
    generation: int
    state: str
    residency: _containers.RepeatedCompositeFieldContainer[AdapterResidency]
    leases: int
    base_model: str
    base_model_name: str
    def __init__(self, name: _Optional[str] = ..., digest: _Optional[str] = ..., rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ..., lora_alpha: _Optional[float] = ..., use_rslora: _Optional[bool] = ..., path: _Optional[str] = ..., generation: _Optional[int] = ..., state: _Optional[str] = ..., residency: _Optional[_Iterable[_Union[AdapterResidency, _Mapping]]] = ..., leases: _Optional[int] = ..., base_model: _Optional[str] = ..., base_model_name: _Optional[str] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path", "replace", "drain")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    replace: bool
    drain: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., replace: _Optional[bool] = ..., drain: _Optional[bool] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name", "drain")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    name: str
    drain: bool
    def __init__(self, name: _Optional[str] = ..., drain: _Optional[bool] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ...) -> None: ...

class GetAdapterRequest(_message.Message):
    __slots__ = ("name", "include_weights")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    include_weights: bool
    def __init__(self, name: _Optional[str] = ..., include_weights: _Optional[bool] = ...) -> None: ...

class AdapterTensor(_message.Message):
    __slots__ = ("module", "lora_a", "lora_b")
    MODULE_FIELD_NUMBER: _ClassVar[int]
    LORA_A_FIELD_NUMBER: _ClassVar[int]
    LORA_B_FIELD_NUMBER: _ClassVar[int]
    module: str
    lora_a: _tensor_pb2.Tensor
    lora_b: _tensor_pb2.Tensor
    def __init__(self, module: _Optional[str] = ..., lora_a: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., lora_b: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class AdapterWeights(_message.Message):
    __slots__ = ("info", "tensors")
    INFO_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    info: AdapterInfo
    tensors: _containers.RepeatedCompositeFieldContainer[AdapterTensor]
    def __init__(self, info: _Optional[_Union[AdapterInfo, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[AdapterTensor, _Mapping]]] = ...) -> None: ...

class NameLeases(_message.Message):
    __slots__ = ("name", "leases")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    name: str
    leases: int
    def __init__(self, name: _Optional[str] = ..., leases: _Optional[int] = ...) -> None: ...

class ResidentDigest(_message.Message):
    __slots__ = ("digest", "leases", "by_name")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    BY_NAME_FIELD_NUMBER: _ClassVar[int]
    digest: str
    leases: int
    by_name: _containers.RepeatedCompositeFieldContainer[NameLeases]
    def __init__(self, digest: _Optional[str] = ..., leases: _Optional[int] = ..., by_name: _Optional[_Iterable[_Union[NameLeases, _Mapping]]] = ...) -> None: ...

class AdapterRef(_message.Message):
    __slots__ = ("name", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    digest: str
    def __init__(self, name: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class ResidencyReport(_message.Message):
    __slots__ = ("decoder_id", "resident", "draining_acked")
    DECODER_ID_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_ACKED_FIELD_NUMBER: _ClassVar[int]
    decoder_id: str
    resident: _containers.RepeatedCompositeFieldContainer[ResidentDigest]
    draining_acked: _containers.RepeatedCompositeFieldContainer[AdapterRef]
    def __init__(self, decoder_id: _Optional[str] = ..., resident: _Optional[_Iterable[_Union[ResidentDigest, _Mapping]]] = ..., draining_acked: _Optional[_Iterable[_Union[AdapterRef, _Mapping]]] = ...) -> None: ...

class ResidencyAck(_message.Message):
    __slots__ = ("draining", "registered")
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    draining: _containers.RepeatedCompositeFieldContainer[AdapterRef]
    registered: _containers.RepeatedCompositeFieldContainer[AdapterRef]
    def __init__(self, draining: _Optional[_Iterable[_Union[AdapterRef, _Mapping]]] = ..., registered: _Optional[_Iterable[_Union[AdapterRef, _Mapping]]] = ...) -> None: ...
