"""GGUF files of tiny checkpoints in each quantized type the decoder serves as stored, for
test_quantized.py.

The `gguf` package quantizes Q8_0, Q4_0 and Q4_1 (`export_gguf`'s outtypes) but only dequantizes
the K-quants: `quantize_q4_k` and `quantize_q6_k` below are simple quantizers (a scale and a min per
sub-block, rounded to nearest) that pack ggml's block layouts; each packing is checked by the
package's own `dequantize` (`check_packing`). "Q4_K_M" mixes them as llama.cpp's Q4_K_M does: the
v and down projections Q6_K, the rest Q4_K.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from tessera.cli.gguf_export import export_gguf

QK = 256  # weights per K-quant block
FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q4_K_M")


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)  # [n, 2]


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, k] (k a multiple of 256) -> Q4_K bytes [rows, k / 256 * 144]."""
    blocks = x.reshape(-1, 8, 32).astype(np.float32)  # [n, sub-block, 32]
    low = np.minimum(blocks.min(-1), 0.0)
    scale = (blocks.max(-1) - low) / 15  # [n, 8]
    d = np.maximum(scale.max(-1), 1e-8) / 63  # [n]
    dmin = np.maximum((-low).max(-1), 1e-8) / 63
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / d[:, None]), 1, 63).astype(np.uint8)  # [n, 8] 6 bits
    m = np.clip(np.rint(-low / dmin[:, None]), 0, 63).astype(np.uint8)
    q = np.clip(np.rint((blocks + (dmin[:, None] * m)[..., None]) / (d[:, None] * sc)[..., None]), 0, 15)
    q = q.astype(np.uint8)  # [n, 8, 32]
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)], axis=1)  # [n, 12]
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # sub-blocks 2c (low nibble), 2c+1 (high)
    packed = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], axis=1)  # [n, 144]
    return packed.reshape(x.shape[0], -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, k] (k a multiple of 256) -> Q6_K bytes [rows, k / 256 * 210]."""
    blocks = x.reshape(-1, 16, 16).astype(np.float32)  # [n, sub-block, 16]
    scale = np.abs(blocks).max(-1) / 31  # [n, 16]
    d = np.maximum(scale.max(-1), 1e-8) / 127
    d = d.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / d[:, None]), 1, 127).astype(np.int8)
    q = np.clip(np.rint(blocks / (d[:, None] * sc)[..., None]) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(-1, 2, 128)  # two chunks of 128 weights
    ql = (q[:, :, :64] & 0xF) | ((q[:, :, 64:] & 0xF) << 4)  # [n, 2, 64]
    hi = (q >> 4).reshape(-1, 2, 4, 32)  # element 32g + l of a chunk -> bits 2g of qh[l]
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)  # [n, 2, 32]
    packed = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16_bytes(d)], axis=1)
    return packed.reshape(x.shape[0], -1)


K_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}


def check_packing(qtype: str, x: np.ndarray, packed: np.ndarray) -> None:
    """The gguf package's dequantize of `packed` is close to `x` (the layout is ggml's, not ours).
    Raises AssertionError otherwise."""
    values = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType[qtype])
    step = np.abs(x).max() / (7 if qtype == "Q4_K" else 31)
    assert values.shape == x.shape and np.abs(values - x).max() <= step, (qtype, np.abs(values - x).max(), step)


def _matrix_type(fmt: str):
    """`export_gguf`'s matrix_type for `fmt`: GGUF name, float32 matrix -> (bytes, type)."""
    def choose(name: str, data: np.ndarray):
        if fmt == "Q4_K_M":
            qtype = "Q6_K" if (".attn_v." in name or ".ffn_down." in name or name == "output.weight") else "Q4_K"
        else:
            qtype = fmt
        if data.shape[-1] % QK:  # llama.cpp falls back for rows that are not whole K blocks
            qtype = "Q8_0"
        if qtype in K_QUANTIZERS:
            packed = K_QUANTIZERS[qtype](data)
            check_packing(qtype, data, packed)
            return packed, gguf.GGMLQuantizationType[qtype]
        kind = gguf.GGMLQuantizationType[qtype]
        return gguf.quants.quantize(data, kind), kind
    return choose


def write_gguf(model_dir: Path, fmt: str, out: Path) -> Path:
    """`model_dir` written as a GGUF at `out` with its matrices in `fmt` (FORMATS)."""
    if fmt in ("Q8_0", "Q4_0", "Q4_1"):
        return export_gguf(model_dir, out, fmt.lower())
    return export_gguf(model_dir, out, "q8_0", matrix_type=_matrix_type(fmt))
