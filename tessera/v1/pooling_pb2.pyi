from tessera.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodingFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODING_FORMAT_FLOAT: _ClassVar[EncodingFormat]
    ENCODING_FORMAT_BASE64: _ClassVar[EncodingFormat]
ENCODING_FORMAT_FLOAT: EncodingFormat
ENCODING_FORMAT_BASE64: EncodingFormat

class EmbedRequest(_message.Message):
    __slots__ = ("model", "inputs", "normalize", "encoding_format")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FORMAT_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _containers.RepeatedScalarFieldContainer[str]
    normalize: bool
    encoding_format: EncodingFormat
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Iterable[str]] = ..., normalize: _Optional[bool] = ..., encoding_format: _Optional[_Union[EncodingFormat, str]] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("model", "embeddings", "embeddings_base64", "usage")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_BASE64_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    model: str
    embeddings: _tensor_pb2.Tensor
    embeddings_base64: _containers.RepeatedScalarFieldContainer[str]
    usage: _tensor_pb2.Usage
    def __init__(self, model: _Optional[str] = ..., embeddings: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., embeddings_base64: _Optional[_Iterable[str]] = ..., usage: _Optional[_Union[_tensor_pb2.Usage, _Mapping]] = ...) -> None: ...

class RerankRequest(_message.Message):
    __slots__ = ("model", "query", "documents", "top_n", "return_documents")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    RETURN_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    query: str
    documents: _containers.RepeatedScalarFieldContainer[str]
    top_n: int
    return_documents: bool
    def __init__(self, model: _Optional[str] = ..., query: _Optional[str] = ..., documents: _Optional[_Iterable[str]] = ..., top_n: _Optional[int] = ..., return_documents: _Optional[bool] = ...) -> None: ...

class RerankResult(_message.Message):
    __slots__ = ("index", "score", "document")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    index: int
    score: float
    document: str
    def __init__(self, index: _Optional[int] = ..., score: _Optional[float] = ..., document: _Optional[str] = ...) -> None: ...

class RerankResponse(_message.Message):
    __slots__ = ("model", "method", "results", "usage")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    model: str
    method: str
    results: _containers.RepeatedCompositeFieldContainer[RerankResult]
    usage: _tensor_pb2.Usage
    def __init__(self, model: _Optional[str] = ..., method: _Optional[str] = ..., results: _Optional[_Iterable[_Union[RerankResult, _Mapping]]] = ..., usage: _Optional[_Union[_tensor_pb2.Usage, _Mapping]] = ...) -> None: ...

class PoolingInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolingInfo(_message.Message):
    __slots__ = ("model", "pooling_mode", "normalize", "dimension", "max_input_length", "max_batch_size", "rerank_method")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    POOLING_MODE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    DIMENSION_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    RERANK_METHOD_FIELD_NUMBER: _ClassVar[int]
    model: str
    pooling_mode: str
    normalize: bool
    dimension: int
    max_input_length: int
    max_batch_size: int
    rerank_method: str
    def __init__(self, model: _Optional[str] = ..., pooling_mode: _Optional[str] = ..., normalize: _Optional[bool] = ..., dimension: _Optional[int] = ..., max_input_length: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., rerank_method: _Optional[str] = ...) -> None: ...
