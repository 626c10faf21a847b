from tessera.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ImageInput(_message.Message):
    __slots__ = ("data", "data_uri")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DATA_URI_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    data_uri: str
    def __init__(self, data: _Optional[bytes] = ..., data_uri: _Optional[str] = ...) -> None: ...

class EncodedImage(_message.Message):
    __slots__ = ("rows", "grid_thw", "mrope_section", "content_hash")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    MROPE_SECTION_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    rows: _tensor_pb2.Tensor
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    mrope_section: _containers.RepeatedScalarFieldContainer[int]
    content_hash: str
    def __init__(self, rows: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., grid_thw: _Optional[_Iterable[int]] = ..., mrope_section: _Optional[_Iterable[int]] = ..., content_hash: _Optional[str] = ...) -> None: ...

class EncodeImagesRequest(_message.Message):
    __slots__ = ("images", "max_image_tokens", "prompt")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[ImageInput]
    max_image_tokens: int
    prompt: PromptBudget
    def __init__(self, images: _Optional[_Iterable[_Union[ImageInput, _Mapping]]] = ..., max_image_tokens: _Optional[int] = ..., prompt: _Optional[_Union[PromptBudget, _Mapping]] = ...) -> None: ...

class PromptBudget(_message.Message):
    __slots__ = ("num_text_tokens", "max_tokens", "max_model_len")
    NUM_TEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    num_text_tokens: int
    max_tokens: int
    max_model_len: int
    def __init__(self, num_text_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class EncodeImagesResponse(_message.Message):
    __slots__ = ("images",)
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[EncodedImage]
    def __init__(self, images: _Optional[_Iterable[_Union[EncodedImage, _Mapping]]] = ...) -> None: ...

class VisionInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VisionInfo(_message.Message):
    __slots__ = ("encoder", "revision", "output_width", "image_size", "patch_size", "max_image_bytes", "max_image_pixels", "max_images_per_request", "mrope_section", "min_pixels", "max_pixels", "encoder_cache", "images_encoded")
    ENCODER_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_WIDTH_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGES_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MROPE_SECTION_FIELD_NUMBER: _ClassVar[int]
    MIN_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_CACHE_FIELD_NUMBER: _ClassVar[int]
    IMAGES_ENCODED_FIELD_NUMBER: _ClassVar[int]
    encoder: str
    revision: str
    output_width: int
    image_size: int
    patch_size: int
    max_image_bytes: int
    max_image_pixels: int
    max_images_per_request: int
    mrope_section: _containers.RepeatedScalarFieldContainer[int]
    min_pixels: int
    max_pixels: int
    encoder_cache: EncoderCacheStats
    images_encoded: int
    def __init__(self, encoder: _Optional[str] = ..., revision: _Optional[str] = ..., output_width: _Optional[int] = ..., image_size: _Optional[int] = ..., patch_size: _Optional[int] = ..., max_image_bytes: _Optional[int] = ..., max_image_pixels: _Optional[int] = ..., max_images_per_request: _Optional[int] = ..., mrope_section: _Optional[_Iterable[int]] = ..., min_pixels: _Optional[int] = ..., max_pixels: _Optional[int] = ..., encoder_cache: _Optional[_Union[EncoderCacheStats, _Mapping]] = ..., images_encoded: _Optional[int] = ...) -> None: ...

class EncoderCacheStats(_message.Message):
    __slots__ = ("hits", "misses", "evictions", "entries", "bytes", "capacity_bytes")
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    hits: int
    misses: int
    evictions: int
    entries: int
    bytes: int
    capacity_bytes: int
    def __init__(self, hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., entries: _Optional[int] = ..., bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ...) -> None: ...
