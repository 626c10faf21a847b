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


FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})


def from_pb(message: tensor_pb2.Tensor, field: str = "tensor", dtypes: frozenset[str] | None = None,
            shape: tuple[int | None, ...] | None = None, finite: bool = False) -> torch.Tensor:
    """Decode a tensor message into a new CPU tensor, checking it as it arrives.

    Args:
        field: the message field's name, for error messages (e.g. "encoded_image.rows").
        dtypes: accepted dtype names (None: any the codec knows).
        shape: expected shape; None in a position accepts any size there (None: any shape).
        finite: refuse NaN and +-inf (float dtypes), in O(numel) once.

    Raises:
        InvalidArgument: unknown or unaccepted dtype, negative dims, a shape other than `shape`, a
            byte count that does not match the shape, or (with `finite`) a non-finite value; the
            message names `field`. Everything but finiteness is checked before any decoding.
    """
    dtype = _TORCH_DTYPES.get(message.dtype)
    if dtype is None:
        raise InvalidArgument(f"{field}: unknown tensor dtype {message.dtype[:40]!r}; expected one of {sorted(_TORCH_DTYPES)}")
    if dtypes is not None and message.dtype not in dtypes:
        raise InvalidArgument(f"{field}: tensor dtype {message.dtype} is not accepted here; expected one of {sorted(dtypes)}")
    dims = tuple(int(d) for d in message.shape)
    if any(d < 0 for d in dims):
        raise InvalidArgument(f"{field}: tensor shape {_shape_text(dims)} has a negative dimension")
    if shape is not None and (len(dims) != len(shape) or any(w is not None and d != w for d, w in zip(dims, shape))):
        expected = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise InvalidArgument(f"{field}: tensor has shape {_shape_text(dims)}; expected {expected}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected_bytes = math.prod(dims) * itemsize
    if len(message.data) != expected_bytes:
        raise InvalidArgument(f"{field}: tensor of shape {_shape_text(dims)} and dtype {message.dtype} needs "
                              f"{expected_bytes} bytes, got {len(message.data)}")
    if expected_bytes == 0:
        return torch.empty(dims, dtype=dtype)
    np_dtype = np.dtype("<i2") if dtype == torch.bfloat16 else np.dtype(_np_name(dtype)).newbyteorder("<")
    array = np.frombuffer(message.data, dtype=np_dtype).astype(np_dtype.newbyteorder("="), copy=True)
    out = torch.from_numpy(array).reshape(dims)
    out = out.view(torch.bfloat16) if dtype == torch.bfloat16 else out
    if finite and out.is_floating_point() and not bool(torch.isfinite(out).all()):
        bad = int((~torch.isfinite(out)).sum())
        raise InvalidArgument(f"{field}: tensor holds {bad} non-finite value(s) (NaN or inf) of {out.numel()}")
    return out


def _shape_text(dims: tuple[int, ...]) -> str:
    """`[d0, d1, ...]`, cut after 8 dimensions (a shape is client input and may be huge)."""
    return "[" + ", ".join(str(d) for d in dims[:8]) + (", ...]" if len(dims) > 8 else "]")


def _np_name(dtype: torch.dtype) -> str:
    return {torch.bool: "bool"}.get(dtype, _NAMES[dtype])
