from tessera.v1 import decoder_pb2 as _decoder_pb2
from tessera.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TruncationDirection(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRUNCATION_DIRECTION_RIGHT: _ClassVar[TruncationDirection]
    TRUNCATION_DIRECTION_LEFT: _ClassVar[TruncationDirection]

class EncodingFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODING_FORMAT_FLOAT: _ClassVar[EncodingFormat]
    ENCODING_FORMAT_BASE64: _ClassVar[EncodingFormat]
TRUNCATION_DIRECTION_RIGHT: TruncationDirection
TRUNCATION_DIRECTION_LEFT: TruncationDirection
ENCODING_FORMAT_FLOAT: EncodingFormat
ENCODING_FORMAT_BASE64: EncodingFormat

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("model", "inputs", "normalize", "encoding_format", "input_ids", "truncate", "truncation_direction", "dimensions", "prompt_name")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FORMAT_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_DIRECTION_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _containers.RepeatedScalarFieldContainer[str]
    normalize: bool
    encoding_format: EncodingFormat
    input_ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    truncate: bool
    truncation_direction: TruncationDirection
    dimensions: int
    prompt_name: str
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Iterable[str]] = ..., normalize: _Optional[bool] = ..., encoding_format: _Optional[_Union[EncodingFormat, str]] = ..., input_ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., truncate: _Optional[bool] = ..., truncation_direction: _Optional[_Union[TruncationDirection, str]] = ..., dimensions: _Optional[int] = ..., prompt_name: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("model", "query", "documents", "top_n", "return_documents", "raw_scores", "method", "truncate", "truncation_direction")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    RETURN_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    RAW_SCORES_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_DIRECTION_FIELD_NUMBER: _ClassVar[int]
    model: str
    query: str
    documents: _containers.RepeatedScalarFieldContainer[str]
    top_n: int
    return_documents: bool
    raw_scores: bool
    method: str
    truncate: bool
    truncation_direction: TruncationDirection
    def __init__(self, model: _Optional[str] = ..., query: _Optional[str] = ..., documents: _Optional[_Iterable[str]] = ..., top_n: _Optional[int] = ..., return_documents: _Optional[bool] = ..., raw_scores: _Optional[bool] = ..., method: _Optional[str] = ..., truncate: _Optional[bool] = ..., truncation_direction: _Optional[_Union[TruncationDirection, str]] = ...) -> None: ...

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
    __slots__ = ("model", "pooling_mode", "normalize", "dimension", "max_input_length", "max_batch_size", "rerank_method", "models", "max_batch_tokens", "max_queue_size", "max_wait_ms", "dynamic_batching")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    POOLING_MODE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    DIMENSION_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    RERANK_METHOD_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_BATCHING_FIELD_NUMBER: _ClassVar[int]
    model: str
    pooling_mode: str
    normalize: bool
    dimension: int
    max_input_length: int
    max_batch_size: int
    rerank_method: str
    models: _containers.RepeatedCompositeFieldContainer[PoolingModelInfo]
    max_batch_tokens: int
    max_queue_size: int
    max_wait_ms: float
    dynamic_batching: bool
    def __init__(self, model: _Optional[str] = ..., pooling_mode: _Optional[str] = ..., normalize: _Optional[bool] = ..., dimension: _Optional[int] = ..., max_input_length: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., rerank_method: _Optional[str] = ..., models: _Optional[_Iterable[_Union[PoolingModelInfo, _Mapping]]] = ..., max_batch_tokens: _Optional[int] = ..., max_queue_size: _Optional[int] = ..., max_wait_ms: _Optional[float] = ..., dynamic_batching: _Optional[bool] = ...) -> None: ...

class PoolingModelInfo(_message.Message):
    __slots__ = ("model", "kind", "pooling_mode", "normalize", "dimension", "max_input_length", "rerank_method", "matryoshka_dimensions", "matryoshka", "prompts", "aliases")
    class PromptsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    POOLING_MODE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    DIMENSION_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    RERANK_METHOD_FIELD_NUMBER: _ClassVar[int]
    MATRYOSHKA_DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    MATRYOSHKA_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    model: str
    kind: str
    pooling_mode: str
    normalize: bool
    dimension: int
    max_input_length: int
    rerank_method: str
    matryoshka_dimensions: _containers.RepeatedScalarFieldContainer[int]
    matryoshka: bool
    prompts: _containers.ScalarMap[str, str]
    aliases: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., kind: _Optional[str] = ..., pooling_mode: _Optional[str] = ..., normalize: _Optional[bool] = ..., dimension: _Optional[int] = ..., max_input_length: _Optional[int] = ..., rerank_method: _Optional[str] = ..., matryoshka_dimensions: _Optional[_Iterable[int]] = ..., matryoshka: _Optional[bool] = ..., prompts: _Optional[_Mapping[str, str]] = ..., aliases: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "inputs", "add_special_tokens", "prompt_name", "messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _containers.RepeatedScalarFieldContainer[str]
    add_special_tokens: bool
    prompt_name: str
    messages: _containers.RepeatedCompositeFieldContainer[_decoder_pb2.ChatMessage]
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template_kwargs: str
    tools: str
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Iterable[str]] = ..., add_special_tokens: _Optional[bool] = ..., prompt_name: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_decoder_pb2.ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., chat_template_kwargs: _Optional[str] = ..., tools: _Optional[str] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("id", "text", "special", "start", "stop")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    special: bool
    start: int
    stop: int
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., special: _Optional[bool] = ..., start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class TokenizedInput(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    def __init__(self, tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("model", "results", "max_model_len")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    model: str
    results: _containers.RepeatedCompositeFieldContainer[TokenizedInput]
    max_model_len: int
    def __init__(self, model: _Optional[str] = ..., results: _Optional[_Iterable[_Union[TokenizedInput, _Mapping]]] = ..., max_model_len: _Optional[int] = ...) -> None: ...
