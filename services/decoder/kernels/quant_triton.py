"""GEMM against GGUF block-quantized weights, dequantized in registers (Triton; CUDA, or the CPU under
TRITON_INTERPRET=1, read when this module is imported).

A weight matrix [n, k] is stored as ggml blocks, row after row; row r is data[r]:

    data[r] = block 0 | block 1 | ... | block ceil(k / BS) - 1       row_bytes = ceil(k / BS) * BB
    weight (r, c) lies in block c // BS at position j = c % BS

The block layouts are ggml's (ggml-common.h; gguf-py's quants.py dequantizes the same bytes):

    format  BS   BB   bytes of a block                                       weight j
    Q8_0    32   34   d f16 | qs int8[32]                                    d * qs[j]
    Q4_0    32   18   d f16 | qs[16]: weight j in qs[j % 16] >> 4 * (j // 16)  d * (nibble - 8)
    Q4_1    32   20   d f16 | m f16 | qs[16] (as Q4_0)                       d * nibble + m
    Q4_K   256  144   d f16 | dmin f16 | scales[12] | qs[128]                d * sc[s] * nibble - dmin * mn[s]
                      sub-block s = j // 32; nibble in qs[32 * (j // 64) + j % 32] >> 4 * (s % 2);
                      6-bit sc, mn: s < 4: scales[s] & 63, scales[s + 4] & 63;
                      s >= 4: scales[s + 4] & 15 | scales[s - 4] >> 6 << 4, scales[s + 4] >> 4 | scales[s] >> 6 << 4
    Q6_K   256  210   ql[128] | qh[64] | scales int8[16] | d f16             d * scales[j // 16] * (q - 32)
                      h = j // 128, i = j % 128: q = ql[64h + i % 64] >> 4 * (i // 64) & 15
                                                 | (qh[32h + i % 32] >> 2 * (i // 32) & 3) << 4

f16 fields are read as two bytes (little-endian) combined into a uint16 and bitcast, so no load
depends on the alignment of a field inside its block.

`quantized_matmul` runs one program per (BLOCK_M rows of x, BLOCK_N weight rows); each step of its
k loop loads the packed bytes of a [BLOCK_K, BLOCK_N] weight tile (each weight addressed through its
own block, so a tile may span blocks or lie inside one), dequantizes it in float32 and accumulates
x_tile @ w_tile in float32: IEEE float32 products for float32 x; for float16/bfloat16 x the tile is
rounded to x's dtype first (the tensor-core path), which costs up to one rounding of each weight
(2^-9 relative for bfloat16; the interpreter truncates, 2^-8). Columns past k — x's masked loads and the weights of a last, partial block — count as zero.
Addresses are clamped with `tl.where` as well as masked, because the interpreter evaluates masked-out
addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from services.decoder.quant import BLOCK_SHAPES

_Q8_0, _Q4_0, _Q4_1, _Q4_K, _Q6_K = range(5)


@dataclass(frozen=True)
class QuantFormat:
    """One ggml block format: `block_size` weights in `block_bytes` bytes; `kernel_id` selects the
    kernel's dequantization branch."""

    name: str
    block_size: int
    block_bytes: int
    kernel_id: int

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of k weights: whole blocks, the last one padded."""
        return -(-k // self.block_size) * self.block_bytes


QUANT_FORMATS = {name: QuantFormat(name, *BLOCK_SHAPES[name], kernel_id)  # ggml's block shapes, one table
                 for name, kernel_id in (("Q8_0", _Q8_0), ("Q4_0", _Q4_0), ("Q4_1", _Q4_1), ("Q4_K", _Q4_K),
                                         ("Q6_K", _Q6_K))}


@triton.jit
def _load_f16(ptr):
    """The little-endian float16 at ptr (a block of uint8 pointers), as float32."""
    lo = tl.load(ptr).to(tl.uint16)
    hi = tl.load(ptr + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_tile(block_ptr, j, FORMAT: tl.constexpr):
    """Weights [BLOCK_K, BLOCK_N] float32: block_ptr [BLOCK_K, BLOCK_N] is the start of each weight's
    block, j [BLOCK_K, 1] the positions inside it (the layouts in the module docstring)."""
    if FORMAT == 0:  # Q8_0
        q = tl.load(block_ptr + 2 + j).to(tl.int8, bitcast=True).to(tl.float32)
        w = _load_f16(block_ptr) * q
    elif FORMAT == 1:  # Q4_0
        q = (tl.load(block_ptr + 2 + j % 16).to(tl.int32) >> (4 * (j // 16))) & 15
        w = _load_f16(block_ptr) * (q - 8).to(tl.float32)
    elif FORMAT == 2:  # Q4_1
        q = (tl.load(block_ptr + 4 + j % 16).to(tl.int32) >> (4 * (j // 16))) & 15
        w = _load_f16(block_ptr) * q.to(tl.float32) + _load_f16(block_ptr + 2)
    elif FORMAT == 3:  # Q4_K
        s = j // 32
        low = s < 4
        scales = block_ptr + 4
        a = tl.load(scales + tl.where(low, s, s + 4)).to(tl.int32)   # scales[s] | scales[s + 4]
        b = tl.load(scales + tl.where(low, s + 4, s - 4)).to(tl.int32)  # scales[s + 4] | scales[s - 4]
        c = tl.load(scales + s).to(tl.int32)
        sc = tl.where(low, a & 63, (a & 15) | ((b >> 6) << 4))
        mn = tl.where(low, b & 63, (a >> 4) | ((c >> 6) << 4))
        q = (tl.load(block_ptr + 16 + 32 * (j // 64) + j % 32).to(tl.int32) >> (4 * (s % 2))) & 15
        w = _load_f16(block_ptr) * sc.to(tl.float32) * q.to(tl.float32) - _load_f16(block_ptr + 2) * mn.to(tl.float32)
    else:  # Q6_K
        h = j // 128
        i = j % 128
        ql = (tl.load(block_ptr + 64 * h + i % 64).to(tl.int32) >> (4 * (i // 64))) & 15
        qh = (tl.load(block_ptr + 128 + 32 * h + i % 32).to(tl.int32) >> (2 * (i // 32))) & 3
        scale = tl.load(block_ptr + 192 + j // 16).to(tl.int8, bitcast=True).to(tl.float32)
        w = _load_f16(block_ptr + 208) * scale * ((ql | (qh << 4)) - 32).to(tl.float32)
    return w


@triton.jit
def _quantized_matmul_kernel(x_ptr, data_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_data, stride_om,
                             FORMAT: tl.constexpr, BS: tl.constexpr, BB: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                             BF16_IN_F32: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)                          # [BLOCK_M] rows of x
    row_ok = rows < M
    safe_rows = tl.where(row_ok, rows, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                          # [BLOCK_N] weight rows
    col_ok = cols < N
    row_start = data_ptr + tl.where(col_ok, cols, 0).to(tl.int64) * stride_data        # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)                                                # [BLOCK_K]
        k_ok = ks < K
        a = tl.load(x_ptr + safe_rows[:, None] * stride_xm + tl.where(k_ok, ks, 0)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)                  # [BLOCK_M, BLOCK_K]
        safe_ks = tl.where(k_ok, ks, 0)
        block_ptr = row_start[None, :] + (safe_ks // BS * BB)[:, None]                 # [BLOCK_K, BLOCK_N]
        j = (safe_ks % BS)[:, None]                                                    # [BLOCK_K, 1]
        w = tl.where(k_ok[:, None], _dequant_tile(block_ptr, j, FORMAT), 0.0)          # [BLOCK_K, BLOCK_N]
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        elif BF16_IN_F32:  # the same products, exact in float32
            acc += tl.dot(a.to(tl.float32), w.to(tl.bfloat16).to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w.to(a.dtype))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + tl.where(col_ok, cols, 0), mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + safe_rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


# The interpreter's tl.dot multiplies bfloat16's uint16 storage as integers (triton/runtime/interpreter.py
# create_dot), so there a bfloat16 tile is multiplied as the float32 it widens to exactly.
_INTERPRETED = isinstance(_quantized_matmul_kernel, InterpretedFunction)
# The interpreter's cost is per program (each runs its tile as numpy arrays), not per FLOP: there a
# served weight takes wide tiles, 1024 x 256 (an lm_head of 49152 rows: 48 programs, not 3072; 1.7x faster)
_INTERPRETER_TILE = dict(block_n=1024, block_k=256) if _INTERPRETED else {}


def quant_format(qtype: str) -> QuantFormat:
    """The format named qtype ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"); ValueError for any other."""
    if qtype not in QUANT_FORMATS:
        raise ValueError(f"qtype must be one of {sorted(QUANT_FORMATS)}, got {qtype!r}")
    return QUANT_FORMATS[qtype]


def _check_data(data: torch.Tensor, fmt: QuantFormat, k: int) -> None:
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != fmt.row_bytes(k):
        raise ValueError(f"data must be uint8 [n, {fmt.row_bytes(k)}] ({fmt.name} rows of k={k}), "
                         f"got {data.dtype} {list(data.shape)}")


def quantized_matmul(x: torch.Tensor, data: torch.Tensor, qtype: str, k: int,
                     bias: torch.Tensor | None = None, block_m: int | None = None, block_n: int | None = None,
                     block_k: int | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) for W [n, k] stored as `qtype` blocks (module docstring).

    x: [m, k] float32, float16 or bfloat16; data: uint8 [n, row_bytes], row_bytes = ceil(k / BS) * BB;
    bias: [n] of any float dtype, or None. All on one device: CUDA, or the CPU under TRITON_INTERPRET=1.
    Returns [m, n] in x's dtype, accumulated in float32. block_m, block_n and block_k are the tile, powers
    of two >= 16; by default block_m is m's power of two (16 to 64) and [block_n, block_k] is [16, 256]
    up to 16 rows of x (many programs, long k steps: decode reads the weight once) and past that
    [128, 32] for 32-blocks, [64, 32] for K-quants (the fastest of a sweep on an H100 at n = k = 4096).
    Raises ValueError for an unknown qtype, for dtypes or shapes that do not fit and for other tiles.
    """
    fmt = quant_format(qtype)
    _check_data(data, fmt, k)
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be float32, float16 or bfloat16 [m, {k}], got {x.dtype} {list(x.shape)}")
    n = data.shape[0]
    if bias is not None and (bias.shape != (n,) or not bias.is_floating_point()):
        raise ValueError(f"bias must be a float tensor [{n}], got {bias.dtype} {list(bias.shape)}")
    few_rows = x.shape[0] <= 16
    block_m = block_m or min(64, max(16, triton.next_power_of_2(x.shape[0])))
    block_n = block_n or (16 if few_rows else 128 if fmt.block_size == 32 else 64)
    block_k = block_k or (256 if few_rows else 32)
    for name, size in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {size}")
    x = x.contiguous()
    data = data if data.stride(1) == 1 else data.contiguous()
    out = x.new_empty(x.shape[0], n)  # [m, n]
    if x.shape[0] == 0 or n == 0:
        return out
    grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(n, block_n))
    _quantized_matmul_kernel[grid](x, data, bias if bias is not None else out, out, x.shape[0], n, k,
                                   x.stride(0), data.stride(0), out.stride(0),
                                   FORMAT=fmt.kernel_id, BS=fmt.block_size, BB=fmt.block_bytes,
                                   HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
                                   BF16_IN_F32=_INTERPRETED and x.dtype == torch.bfloat16,
                                   BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte offset of every block [r, nb, BB] -> float32 [r, nb, 1]."""
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., B] bytes -> [..., 2B] int32: the low nibbles, then the high ones (ggml's order)."""
    q = qs.to(torch.int32)
    return torch.cat([q & 15, q >> 4], dim=-1)


def _dequantize_blocks(blocks: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Blocks uint8 [r, nb, BB] -> weights float32 [r, nb, BS], as gguf-py's dequantize_blocks."""
    r, nb = blocks.shape[:2]
    if fmt.kernel_id == _Q8_0:
        return _f16(blocks, 0) * blocks[..., 2:].contiguous().view(torch.int8).float()
    if fmt.kernel_id == _Q4_0:
        return _f16(blocks, 0) * (_nibbles(blocks[..., 2:]) - 8).float()
    if fmt.kernel_id == _Q4_1:
        return _f16(blocks, 0) * _nibbles(blocks[..., 4:]).float() + _f16(blocks, 2)
    if fmt.kernel_id == _Q4_K:
        scales = blocks[..., 4:16].to(torch.int32)  # [r, nb, 12]
        lo, mid, hi = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
        sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], dim=-1)     # [r, nb, 8]
        mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1)   # [r, nb, 8]
        d = (_f16(blocks, 0) * sc.float()).unsqueeze(-1)                   # [r, nb, 8, 1]
        dm = (_f16(blocks, 2) * mn.float()).unsqueeze(-1)
        q = _nibbles(blocks[..., 16:].reshape(r, nb, 4, 32)).reshape(r, nb, 8, 32).float()
        return (d * q - dm).reshape(r, nb, 256)
    ql = _nibbles(blocks[..., :128].reshape(r, nb, 2, 64))                 # [r, nb, 2, 128]
    qh = blocks[..., 128:192].reshape(r, nb, 2, 1, 32).to(torch.int32)
    qh = ((qh >> torch.tensor([0, 2, 4, 6], device=blocks.device).view(4, 1)) & 3).reshape(r, nb, 2, 128)
    q = ((ql | (qh << 4)) - 32).reshape(r, nb, 16, 16).float()
    d = _f16(blocks, 208) * blocks[..., 192:208].contiguous().view(torch.int8).float()  # [r, nb, 16]
    return (d.unsqueeze(-1) * q).reshape(r, nb, 256)


def dequantize_rows(data: torch.Tensor, qtype: str, k: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the quantized matrix, dequantized: float32 [len(ids), k] (torch, any device).

    data: uint8 [n, row_bytes] as for `quantized_matmul`; ids: integer [num_ids] row ids (an embedding
    lookup's token ids), indexed as torch indexes (out-of-range ids raise torch's IndexError on the CPU).
    Values equal gguf-py's `gguf.quants.dequantize` of the same bytes. Raises ValueError for an unknown
    qtype and for dtypes or shapes that do not fit.
    """
    fmt = quant_format(qtype)
    _check_data(data, fmt, k)
    if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"ids must be an integer tensor [num_ids], got {ids.dtype} {list(ids.shape)}")
    rows = data[ids.to(device=data.device, dtype=torch.long)]              # [num_ids, row_bytes]
    num_blocks = rows.shape[1] // fmt.block_bytes
    blocks = rows.view(rows.shape[0], num_blocks, fmt.block_bytes)                     # [num_ids, nb, BB]
    return _dequantize_blocks(blocks, fmt).reshape(rows.shape[0], num_blocks * fmt.block_size)[:, :k]


class TritonQuantizedWeight:
    """A weight [out, in] kept as GGUF blocks on a device, multiplied by `quantized_matmul`: what
    `Linear.gemm` holds on the triton linear backend (a drop-in for quant.QuantizedWeight, whose C
    kernels compute on the CPU).

    `data`: uint8 [out_features, row_bytes] on CUDA (or the CPU under TRITON_INTERPRET=1); `dtype`:
    the model's compute dtype (float32, float16 or bfloat16), what `rows` returns. Exact mode only:
    for float32 x each product is IEEE float32 (the dequantized model's numbers up to summation
    order); a half-precision x rounds each weight tile to its dtype (module docstring).

    Raises (constructor): ValueError for an unknown qtype, a dtype outside those three, or data that
    does not hold [out, row_bytes] uint8 rows.
    """

    mode = "exact"

    def __init__(self, qtype: str, data: torch.Tensor, in_features: int, dtype: torch.dtype) -> None:
        _check_data(data, quant_format(qtype), in_features)
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"the Triton quantized GEMM computes float32, float16 or bfloat16, not {dtype}")
        self.data = data.contiguous()  # [out, row_bytes]
        self.qtype, self.dtype, self.device = qtype, dtype, data.device
        self.out_features, self.in_features = data.shape[0], in_features
        self.nbytes = self.data.numel()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] (the model's dtype, on `device`), bias [out] or None -> y [rows, out] of x's
        dtype. Raises ValueError as `quantized_matmul`."""
        return quantized_matmul(x, self.data, self.qtype, self.in_features, bias, **_INTERPRETER_TILE)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids integer [n] (an embedding lookup's token ids) -> [n, in] of `dtype`: the rows
        dequantized (gguf's values, then rounded to `dtype`). Raises ValueError as `dequantize_rows`."""
        return dequantize_rows(self.data, self.qtype, self.in_features, ids).to(self.dtype)

    def dequantize(self) -> torch.Tensor:
        """The whole weight [out, in] float32 (references and tests)."""
        return dequantize_rows(self.data, self.qtype, self.in_features,
                               torch.arange(self.out_features, device=self.device))
