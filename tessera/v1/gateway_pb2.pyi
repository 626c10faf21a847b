from tessera.v1 import adapters_pb2 as _adapters_pb2
from tessera.v1 import decoder_pb2 as _decoder_pb2
from tessera.v1 import pooling_pb2 as _pooling_pb2
from tessera.v1 import vision_pb2 as _vision_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ClusterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterInfo(_message.Message):
    __slots__ = ("decoder", "pooling", "vision", "unavailable", "replicas")
    DECODER_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    VISION_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    decoder: _decoder_pb2.DecoderInfo
    pooling: _pooling_pb2.PoolingInfo
    vision: _vision_pb2.VisionInfo
    unavailable: _containers.RepeatedScalarFieldContainer[str]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaInfo]
    def __init__(self, decoder: _Optional[_Union[_decoder_pb2.DecoderInfo, _Mapping]] = ..., pooling: _Optional[_Union[_pooling_pb2.PoolingInfo, _Mapping]] = ..., vision: _Optional[_Union[_vision_pb2.VisionInfo, _Mapping]] = ..., unavailable: _Optional[_Iterable[str]] = ..., replicas: _Optional[_Iterable[_Union[ReplicaInfo, _Mapping]]] = ...) -> None: ...

class ReplicaInfo(_message.Message):
    __slots__ = ("service", "address", "ready", "state", "num_requests", "num_outstanding", "decoder")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTSTANDING_FIELD_NUMBER: _ClassVar[int]
    DECODER_FIELD_NUMBER: _ClassVar[int]
    service: str
    address: str
    ready: bool
    state: str
    num_requests: int
    num_outstanding: int
    decoder: _decoder_pb2.DecoderInfo
    def __init__(self, service: _Optional[str] = ..., address: _Optional[str] = ..., ready: _Optional[bool] = ..., state: _Optional[str] = ..., num_requests: _Optional[int] = ..., num_outstanding: _Optional[int] = ..., decoder: _Optional[_Union[_decoder_pb2.DecoderInfo, _Mapping]] = ...) -> None: ...
