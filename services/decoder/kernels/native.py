"""The project's C kernels for CPUs (paged_attention.c, lora_bgmv.c, gemm.c, norm_rope.c, decode_step.c,
quant_gemm.c), built at
start, called
through ctypes.

Build: `$CC` (default `cc`) -O3 -march=native -fopenmp, the sources into one shared library in
a temporary directory, once per process (about a second). OpenMP resolves to the libgomp
torch has already loaded (same soname), so a kernel's parallel region reuses the calling thread's
team; callers pass `torch.get_num_threads()` of that thread. The math library's vector expf
(glibc libmvec) serves the softmax.

Each kernel computes float32 or bfloat16 (`DTYPES`; bf16 in memory, float32 sums). The bf16 dot
products use AVX512-BF16 (VDPBF16PS) when the compiler targets a CPU that has it (-march=native
on such a machine), and portable widening code otherwise (bf16.h); `variant()` says which was
built. The GEMM (gemm.c) runs an AVX2 + FMA micro-kernel where the compiler targets it, scalar code
otherwise (`gemm_variant()`); the decode attention (paged_attention.c) has AVX2 + FMA loops under
the same condition (for head_dim a multiple of 8). TESSERA_CPU_KERNELS=portable forces the portable
code of all of them on any machine; TESSERA_CPU_KERNELS=avx2 builds for an AVX2 + FMA host without
AVX-512 (-march=haswell), so an AVX-512 machine can run, test and measure what such a host runs
(with ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 for torch's own kernels: bench precision --as-avx2).
"""

from __future__ import annotations

import ctypes
import os
import shlex
import subprocess
import tempfile
import threading
from functools import cache
from pathlib import Path

SOURCES = [Path(__file__).with_name(name) for name in ("paged_attention.c", "prefill_attention.c", "lora_bgmv.c",
                                                                   "gemm.c", "norm_rope.c", "decode_step.c", "quant_gemm.c")]
DTYPES = ("float32", "bfloat16")  # what every kernel computes
VARIANT_ENV = "TESSERA_CPU_KERNELS"  # "portable": build without the AVX512-BF16 and AVX2 code; "avx2": as an AVX2 host
AVX2_MARCH = "haswell"  # AVX2, FMA, F16C and no AVX-512: what -march=native gives on an AVX2-only x86 host
_FLAGS = ["-O3", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared"]
_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ATTENTION_ARGS = [_P, _P, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _I64, _F32, _INT]
# query, k_cache, v_cache, spans, num_spans, slots, out, heads, kv_heads, head_dim, num_slots, scale, window, cap, threads
_PREFILL_ARGS = [_P, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _F32, _I64, _F32, _INT]
# x, x_stride, parts (bgmv_part_t [num_parts]), num_parts, rows, group_starts, group_slots, num_groups, in, shrunk, threads
_BGMV_PARTS_ARGS = [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _P, _INT]
_GEMM_ARGS = [_P, _I64, _I64, _P, _P, _P, _I64, _INT]
_RMS_NORM_ARGS = [_P, _P, _P, _I64, _I64, _F32, _INT]
_ROTARY_ARGS = [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _INT]
_WRITE_KV_ARGS = [_P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64, _P, _P]
_SILU_MUL_ARGS = [_P, _I64, _P, _I64, _I64, _INT]
# name -> (restype, argtypes)
_SIGNATURES = {
    "tessera_paged_decode_attention_f32": (_INT, _ATTENTION_ARGS),
    "tessera_paged_decode_attention_bf16": (_INT, _ATTENTION_ARGS),
    "tessera_paged_decode_attention_f32_bf16kv": (_INT, _ATTENTION_ARGS),
    "tessera_paged_prefill_attention_f32": (_INT, _PREFILL_ARGS),
    "tessera_paged_prefill_attention_bf16": (_INT, _PREFILL_ARGS),
    "tessera_paged_prefill_attention_f32_bf16kv": (_INT, _PREFILL_ARGS),
    "tessera_lora_bgmv_parts_f32": (None, _BGMV_PARTS_ARGS),
    "tessera_lora_bgmv_parts_bf16": (None, _BGMV_PARTS_ARGS),
    "tessera_lora_bgmv_parts_f32_bf16w": (None, _BGMV_PARTS_ARGS),
    "tessera_gemm_f32": (None, _GEMM_ARGS),
    "tessera_gemm_bf16": (None, _GEMM_ARGS),
    "tessera_rms_norm_f32": (None, _RMS_NORM_ARGS),
    "tessera_rms_norm_bf16": (None, _RMS_NORM_ARGS),
    "tessera_rotary_f32": (None, _ROTARY_ARGS),
    "tessera_rotary_bf16": (None, _ROTARY_ARGS),
    "tessera_write_kv_f32": (None, _WRITE_KV_ARGS),
    "tessera_write_kv_bf16": (None, _WRITE_KV_ARGS),
    "tessera_write_kv_f32_bf16kv": (None, _WRITE_KV_ARGS),
    "tessera_silu_mul_f32": (None, _SILU_MUL_ARGS),
    "tessera_silu_mul_bf16": (None, _SILU_MUL_ARGS),
    "tessera_decode_step_f32": (_INT, [_P, _I64, _P]),
    "tessera_decode_step_bf16": (_INT, [_P, _I64, _P]),
    "tessera_decode_logits_f32": (None, [_P, _P, _I64, _P, _F32, _P, _P, _P, _P, _INT]),
    "tessera_decode_logits_bf16": (None, [_P, _P, _I64, _P, _F32, _P, _P, _P, _P, _P, _P, _INT]),
    "tessera_gemv_f32": (None, _GEMM_ARGS),
    "tessera_panel_gemv_f32": (None, _GEMM_ARGS),
    "tessera_gemv_bf16": (None, _GEMM_ARGS),
    "tessera_decode_max_rows": (_I64, []),
    "tessera_gemv_variant": (ctypes.c_char_p, []),
    "tessera_kernels_variant": (ctypes.c_char_p, []),
    "tessera_gemm_variant": (ctypes.c_char_p, []),
    "tessera_gemm_panel_width": (_I64, []),
    "tessera_qgemm": (None, [_P, _I64, _I64, _P, _I64, _P, _P, _I64, _I64, _INT]),
    "tessera_qdequant_rows": (None, [_P, _I64, _I64, _P, _I64, _P]),
    "tessera_qblock_size": (_I64, [_I64]),
    "tessera_qblock_bytes": (_I64, [_I64]),
    "tessera_qgemm_variant": (ctypes.c_char_p, []),
    "tessera_qgemm_tiled": (_I64, [_I64]),
}
_lock = threading.Lock()
_library: ctypes.CDLL | None = None


def _compile(directory: str, portable: bool, march: str = "native") -> Path:
    compiler = shlex.split(os.environ.get("CC", "cc"))
    target = Path(directory) / "libtessera_cpu.so"
    defines = ["-DTESSERA_PORTABLE"] if portable else []
    errors = []
    # -march=native: the build runs on the machine that runs it (and so enables AVX512-BF16 where
    # the CPU has it); retried without it for compilers or architectures that refuse it
    for arch in ([f"-march={march}"], []):
        command = [*compiler, *_FLAGS, *arch, *defines, *map(str, SOURCES), "-o", str(target), "-lmvec", "-lm"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"the cpu kernels need a C compiler with OpenMP ($CC, default cc): "
                               f"{' '.join(command)!r} failed: {exc}") from exc
        if done.returncode == 0:
            return target
        output = (done.stderr.strip() or done.stdout.strip() or "(no output)")[-2000:]
        errors.append(f"{' '.join(command)!r} exited with {done.returncode}: {output}")
    raise RuntimeError("compiling the cpu kernels failed:\n" + "\n".join(errors))


def build(portable: bool = False, march: str = "native") -> ctypes.CDLL:
    """Compile and load a fresh kernel library (`load` keeps the process's one); `portable`: without
    the AVX512-BF16 and AVX2 code (GEMM, attention) whatever the CPU; `march`: the compiler's target
    ("haswell": the code an AVX2 + FMA host without AVX-512 builds, `AVX2_MARCH`).

    Raises:
        RuntimeError: as `load`.
    """
    with tempfile.TemporaryDirectory(prefix="tessera-kernels-") as directory:
        path = _compile(directory, portable, march)
        try:  # a "compiler" that succeeds without output, or a noexec temporary directory
            library = ctypes.CDLL(str(path))  # mapped now: the file may go
            functions = [getattr(library, name) for name in _SIGNATURES]
        except (OSError, AttributeError) as exc:
            raise RuntimeError(f"the cpu kernels were built but could not be loaded from {path} "
                               f"($CC {os.environ.get('CC', 'cc')!r}; TMPDIR must allow executables): "
                               f"{exc}") from exc
    for fn, (restype, argtypes) in zip(functions, _SIGNATURES.values()):
        fn.restype, fn.argtypes = restype, argtypes
    return library


def load() -> ctypes.CDLL:
    """The compiled kernel library (built on the first call, then shared by the process); the
    portable variant when TESSERA_CPU_KERNELS=portable, the AVX2 host's when it is avx2.

    Raises:
        RuntimeError: no working C compiler with OpenMP and glibc's libmvec, or the built library
            cannot be loaded (the message names the command, its exit code and output).
    """
    global _library
    with _lock:
        if _library is None:
            chosen = os.environ.get(VARIANT_ENV, "")
            _library = build(portable=chosen == "portable", march=AVX2_MARCH if chosen == "avx2" else "native")
        return _library


def is_loaded() -> bool:
    """Whether this process has built and loaded its kernel library (`load`) yet."""
    return _library is not None


def gemm_variant(library: ctypes.CDLL | None = None) -> str:
    """Which GEMM `library` (default: the process's, built if needed) runs: "avx2" (AVX2 + FMA
    micro-kernel) or "portable" (scalar; also under TESSERA_CPU_KERNELS=portable). Raises RuntimeError as `load`."""
    return (library or load()).tessera_gemm_variant().decode()


def variant(library: ctypes.CDLL | None = None) -> str:
    """Which bf16 code `library` (default: the process's, built if needed) runs: "avx512_bf16" or
    "portable". Raises RuntimeError as `load`."""
    return (library or load()).tessera_kernels_variant().decode()


@cache
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux
        return ""


def _cpuinfo_field(*names: str) -> str:
    """The first /proc/cpuinfo value of a field named one of `names` ("" where there is none)."""
    for line in _cpuinfo().splitlines():
        if line.startswith(names):
            return line.partition(":")[2].strip()
    return ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none, e.g. not Linux)."""
    return frozenset(_cpuinfo_field("flags", "Features").split())


def cpu_vendor() -> str:
    """The CPU's vendor id from /proc/cpuinfo ("GenuineIntel", "AuthenticAMD"; "" where there is none)."""
    return _cpuinfo_field("vendor_id")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("" where there is none)."""
    return _cpuinfo_field("model name")


def cpu_has_bf16() -> bool:
    """Whether the CPU computes bf16 natively (AVX512-BF16 or AMX-BF16): where it does not, bf16
    matmuls are emulated and slower than float32."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def unavailable(dtype: str) -> str | None:
    """None if the kernels build here (building them now, once per process) and compute `dtype`
    (a torch dtype name); else why not, for a backend chosen automatically to say why it fell back."""
    if dtype not in DTYPES:
        return f"the cpu kernels compute {' and '.join(DTYPES)}, not {dtype}"
    try:
        load()
    except RuntimeError as error:
        return str(error)
    return None
