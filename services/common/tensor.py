"""Tensor codec: torch <-> `tessera.v1.Tensor` (shape, dtype name, raw little-endian C-order bytes)."""

from __future__ import annotations

import math

import numpy as np
import torch

from services.common.errors import InvalidArgument
from tessera.v1 import tensor_pb2

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}


def to_pb(tensor: torch.Tensor) -> tensor_pb2.Tensor:
    """Encode any CPU/GPU tensor; the bytes are little-endian C order whatever the host."""
    if tensor.dtype not in _NAMES:
        raise InvalidArgument(f"tensor dtype {tensor.dtype} cannot cross the wire; use one of {sorted(_TORCH_DTYPES)}")
    t = tensor.detach().to("cpu").contiguous()
    # bfloat16 has no numpy dtype: ship its bit pattern as int16.
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    array = raw.numpy()
    if array.dtype.byteorder == ">":
        array = array.byteswap()
    return tensor_pb2.Tensor(shape=list(t.shape), dtype=_NAMES[t.dtype], data=array.tobytes())


def from_pb(message: tensor_pb2.Tensor) -> torch.Tensor:
    """Decode a tensor message into a new CPU tensor.

    Raises:
        InvalidArgument: unknown dtype, negative dims, or a byte count that does not match the shape.
    """
    dtype = _TORCH_DTYPES.get(message.dtype)
    if dtype is None:
        raise InvalidArgument(f"unknown tensor dtype {message.dtype!r}; expected one of {sorted(_TORCH_DTYPES)}")
    shape = tuple(int(d) for d in message.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"tensor shape {shape} has a negative dimension")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if len(message.data) != expected:
        raise InvalidArgument(f"tensor of shape {shape} and dtype {message.dtype} needs {expected} bytes, got {len(message.data)}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    np_dtype = np.dtype("<i2") if dtype == torch.bfloat16 else np.dtype(_np_name(dtype)).newbyteorder("<")
    array = np.frombuffer(message.data, dtype=np_dtype).astype(np_dtype.newbyteorder("="), copy=True)
    out = torch.from_numpy(array).reshape(shape)
    return out.view(torch.bfloat16) if dtype == torch.bfloat16 else out


def _np_name(dtype: torch.dtype) -> str:
    return {torch.bool: "bool"}.get(dtype, _NAMES[dtype])
