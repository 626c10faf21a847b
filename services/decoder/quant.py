"""GGUF block-quantized weights on the CPU: y = x @ W.T (+ b) read straight from the quantized bytes.

The bytes are ggml's block layouts (llama.cpp's ggml-common.h; the `gguf` package's
`gguf.quants.dequantize` reads the same bytes): a weight [out, in] is `out` rows of
`ceil(in / block_size) * block_bytes` bytes, each row a run of blocks of `block_size` weights (32 for
Q8_0 / Q4_0 / Q4_1, 256 for Q4_K / Q6_K), the last block's weights past `in` ignored. The C kernel
(kernels/quant_gemm.c) decodes each block in registers as it streams: no float32 copy of the weight.

Modes (`QUANT_MODES`):
    exact  weights widened to the float32 values gguf's dequantize gives, float32 activations and
           sums: the float64 product up to float32 summation error.
    fast   activations quantized to int8 per 32 values (llama.cpp's q8_0: scale max|x| / 127, round
           to nearest), integer dot products per block: each output within
           sum over x blocks of (scale / 2) * sum |w| of y_exact (plus float32 rounding), the rule
           stated in quant_gemm.c's header.
"""

from __future__ import annotations

import functools
import threading

import torch

# rows from which a product decodes the whole weight once into float32 scratch and runs torch's GEMM
# (MKL) instead of the blocked kernel, which decodes each block again per four rows (prefill chunks);
# not in fast mode where the kernel runs register tiles (`tessera_qgemm_tiled`): 1.4-2.1x decoding +
# MKL at 64-128 rows on SmolLM2's shapes, about even at 256 for Q4_K / Q6_K (bench/quant_gemm.py)
DEQUANTIZED_ROWS = 64
SCRATCH_VALUES = 1 << 24  # the largest weight decoded so (64 MiB; an lm_head past it keeps the kernel)
GGUF_QTYPES = {"Q8_0": 8, "Q4_0": 2, "Q4_1": 3, "Q4_K": 12, "Q6_K": 14}  # name -> GGML type id
# name -> (weights, bytes) of one block (ggml-common.h; kernels/quant_gemm.c's tessera_qblock_size/bytes):
# read without building the C kernels, so a GPU-served checkpoint (quant_triton.py) needs no C compiler
BLOCK_SHAPES = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q6_K": (256, 210)}
QUANT_MODES = ("exact", "fast")


def _library():
    from services.decoder.kernels import native

    return native.load()


def quantized_variant() -> str:
    """Which code the quantized GEMM runs: "avx512-vnni", "avx512", "avx-vnni", "avx2" or "portable"
    (kernels/quant_gemm.c's `tessera_qgemm_variant`). Raises RuntimeError as `native.load`."""
    return _library().tessera_qgemm_variant().decode()


def row_bytes(qtype: str, in_features: int) -> int:
    """Bytes per weight row of `in_features` weights in format `qtype` (whole blocks).

    Raises:
        ValueError: an unknown qtype or in_features < 1.
    """
    if qtype not in GGUF_QTYPES:
        raise ValueError(f"qtype must be one of {sorted(GGUF_QTYPES)}, got {qtype!r}")
    if in_features < 1:
        raise ValueError(f"in_features must be at least 1, got {in_features}")
    size, nbytes = BLOCK_SHAPES[qtype]
    return -(-in_features // size) * nbytes


class QuantizedWeight:
    """A weight [out, in] in a GGUF block format, callable as y = x @ W.T (+ b): a drop-in for
    `linear.PackedWeight` (what `Linear.gemm` holds).

    `data`: uint8 [out_features, row_bytes(qtype, in_features)] on the CPU, kept as given (a view of
    a memory-mapped file stays one) unless it is not contiguous.

    Raises (constructor): ValueError for an unknown qtype or mode, or data of another dtype, device
    or shape. The first product or lookup raises RuntimeError as `native.load` (no C compiler with
    OpenMP): the kernels are built then.
    """

    def __init__(self, qtype: str, data: torch.Tensor, in_features: int, mode: str = "exact") -> None:
        if mode not in QUANT_MODES:
            raise ValueError(f"mode must be one of {QUANT_MODES}, got {mode!r}")
        expected = row_bytes(qtype, in_features)
        if data.dtype != torch.uint8 or data.device.type != "cpu" or data.dim() != 2 or data.shape[1] != expected:
            raise ValueError(f"{qtype} data for {in_features} inputs must be uint8 [out, {expected}] on the CPU, "
                             f"got {tuple(data.shape)} {data.dtype} on {data.device}")
        self.data = data.contiguous()  # [out, row_bytes]
        self.qtype, self.mode, self.dtype = qtype, mode, torch.float32
        self.out_features, self.in_features = data.shape[0], in_features
        self.nbytes = self.data.numel()
        self._type_id = GGUF_QTYPES[qtype]

    @functools.cached_property
    def _library(self):
        """The C kernels, built on first use (a weight moved to a GPU, quantized_model.to_triton, never builds them)."""
        return _library()

    @functools.cached_property
    def _tiled(self) -> bool:
        return self.mode == "fast" and bool(self._library.tessera_qgemm_tiled(self._type_id))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] float32 or bfloat16 on the CPU, bias [out] or None -> y [rows, out] float32,
        contiguous (a bf16 x is widened exactly).

        Raises:
            ValueError: x not [rows, in] float32 / bfloat16 on the CPU, or bias not [out].
        """
        if (x.dim() != 2 or x.shape[1] != self.in_features or x.device.type != "cpu"
                or x.dtype not in (torch.float32, torch.bfloat16)):
            raise ValueError(f"the {self.qtype} GEMM takes x [rows, {self.in_features}] float32 or bfloat16 on the "
                             f"CPU, got {tuple(x.shape)} {x.dtype} on {x.device}")
        if bias is not None:
            if bias.shape != (self.out_features,):
                raise ValueError(f"bias must have shape ({self.out_features},), got {tuple(bias.shape)}")
            bias = bias.to("cpu", torch.float32).contiguous()
        x = x.float().contiguous()  # [rows, in]; a view when already float32 and contiguous
        values = self.out_features * self.in_features
        if x.shape[0] >= DEQUANTIZED_ROWS and values <= SCRATCH_VALUES and not self._tiled:
            # a prefill chunk: decode once, MKL's GEMM
            weight = self._dequantize_into(_scratch(values))
            return torch.nn.functional.linear(x if self.mode == "exact" else int8_blocks(x), weight, bias)
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)  # [rows, out]
        if x.shape[0]:
            self._library.tessera_qgemm(x.data_ptr(), x.shape[0], self.in_features, self.data.data_ptr(),
                                        self._type_id, None if bias is None else bias.data_ptr(), y.data_ptr(),
                                        self.out_features, int(self.mode == "fast"), torch.get_num_threads())
        return y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 [n] (row indices, e.g. token ids of an embedding) -> [n, in] float32, the rows
        dequantized (the values gguf's dequantize gives).

        Raises:
            ValueError: ids not a 1-D integer tensor, or an id outside [0, out_features).
        """
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"ids must be a 1-D integer tensor, got {tuple(ids.shape)} {ids.dtype}")
        ids = ids.to("cpu", torch.int64).contiguous()  # [n]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.out_features):
            raise ValueError(f"ids must lie in [0, {self.out_features}), got [{int(ids.min())}, {int(ids.max())}]")
        out = torch.empty(ids.numel(), self.in_features, dtype=torch.float32)  # [n, in]
        if ids.numel():
            self._library.tessera_qdequant_rows(self.data.data_ptr(), self._type_id, self.in_features,
                                                ids.data_ptr(), ids.numel(), out.data_ptr())
        return out

    def dequantize(self) -> torch.Tensor:
        """The whole weight [out, in] float32 (for references and tests: 4 bytes a weight)."""
        return self.rows(torch.arange(self.out_features))

    def _dequantize_into(self, buffer: torch.Tensor) -> torch.Tensor:
        """The whole weight decoded into `buffer` (float32, at least out * in values): a view [out, in]."""
        ids = _row_ids(self.out_features)
        out = buffer[:self.out_features * self.in_features].view(self.out_features, self.in_features)
        self._library.tessera_qdequant_rows(self.data.data_ptr(), self._type_id, self.in_features, ids.data_ptr(),
                                            self.out_features, out.data_ptr())
        return out


def int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [rows, k] float32 with each run of 32 values (along k, the last run shorter) rounded as fast
    mode quantizes activations: d = max|x| / 127, q = roundf(x / d) (half away from zero), x' = q d.
    Fast mode's products at prefill sizes are x' @ W.T in float32, the values its integer dot products
    sum (quant_gemm.c's quantize_x)."""
    rows, k = x.shape
    padded = torch.nn.functional.pad(x, (0, -k % 32)).view(rows, -1, 32)  # [rows, blocks, 32]
    d = padded.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    scaled = padded * inverse
    whole = torch.trunc(scaled)
    q = torch.where((scaled - whole).abs() == 0.5, whole + torch.sign(scaled), torch.round(scaled))  # roundf
    return (q * d).view(rows, -1)[:, :k]


_local = threading.local()


def _scratch(values: int) -> torch.Tensor:
    """This thread's float32 buffer of at least `values` values (grown, never shrunk): where a
    prefill chunk's weight is decoded, one at a time, so no float copy of the model is kept."""
    buffer = getattr(_local, "scratch", None)
    if buffer is None or buffer.numel() < values:
        buffer = _local.scratch = torch.empty(values, dtype=torch.float32)
    return buffer


def _row_ids(count: int) -> torch.Tensor:
    """int64 [count] = 0..count-1, cached per thread (the rows `_dequantize_into` decodes)."""
    ids = getattr(_local, "ids", None)
    if ids is None or ids.numel() < count:
        ids = _local.ids = torch.arange(count, dtype=torch.int64)
    return ids
