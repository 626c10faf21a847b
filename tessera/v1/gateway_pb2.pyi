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
    __slots__ = ("decoder", "pooling", "vision", "unavailable")
    DECODER_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    VISION_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    decoder: _decoder_pb2.DecoderInfo
    pooling: _pooling_pb2.PoolingInfo
    vision: _vision_pb2.VisionInfo
    unavailable: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, decoder: _Optional[_Union[_decoder_pb2.DecoderInfo, _Mapping]] = ..., pooling: _Optional[_Union[_pooling_pb2.PoolingInfo, _Mapping]] = ..., vision: _Optional[_Union[_vision_pb2.VisionInfo, _Mapping]] = ..., unavailable: _Optional[_Iterable[str]] = ...) -> None: ...
