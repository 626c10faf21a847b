"""The project's C kernels for CPUs (paged_attention.c, lora_bgmv.c), built at start and called through ctypes.

Build: `$CC` (default `cc`) -O3 -march=native -fopenmp, both sources into one shared library in
a temporary directory, once per process (well under a second). OpenMP resolves to the libgomp
torch has already loaded (same soname), so a kernel's parallel region reuses the calling thread's
team; callers pass `torch.get_num_threads()` of that thread. The math library's vector expf
(glibc libmvec) serves the softmax.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import subprocess
import tempfile
import threading
from pathlib import Path

SOURCES = [Path(__file__).with_name("paged_attention.c"), Path(__file__).with_name("lora_bgmv.c")]
_FLAGS = ["-O3", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared"]
_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# name -> (restype, argtypes)
_SIGNATURES = {
    "tessera_paged_decode_attention_f32": (_INT, [_P, _P, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64,
                                                  _I64, _I64, _F32, _INT]),
    "tessera_lora_bgmv_f32": (None, [_P, _I64, _P, _I64, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _P, _INT]),
}
_lock = threading.Lock()
_library: ctypes.CDLL | None = None


def _compile(directory: str) -> Path:
    compiler = shlex.split(os.environ.get("CC", "cc"))
    target = Path(directory) / "libtessera_cpu.so"
    errors = []
    # -march=native: the build runs on the machine that runs it; retried without it for compilers
    # or architectures that refuse it
    for arch in (["-march=native"], []):
        command = [*compiler, *_FLAGS, *arch, *map(str, SOURCES), "-o", str(target), "-lmvec", "-lm"]
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


def load() -> ctypes.CDLL:
    """The compiled kernel library (built on the first call, then shared by the process).

    Raises:
        RuntimeError: no working C compiler with OpenMP and glibc's libmvec, or the built library
            cannot be loaded (the message names the command, its exit code and output).
    """
    global _library
    with _lock:
        if _library is None:
            with tempfile.TemporaryDirectory(prefix="tessera-kernels-") as directory:
                path = _compile(directory)
                try:  # a "compiler" that succeeds without output, or a noexec temporary directory
                    library = ctypes.CDLL(str(path))  # mapped now: the file may go
                    functions = [getattr(library, name) for name in _SIGNATURES]
                except (OSError, AttributeError) as exc:
                    raise RuntimeError(f"the cpu kernels were built but could not be loaded from {path} "
                                       f"($CC {os.environ.get('CC', 'cc')!r}; TMPDIR must allow executables): "
                                       f"{exc}") from exc
            for fn, (restype, argtypes) in zip(functions, _SIGNATURES.values()):
                fn.restype, fn.argtypes = restype, argtypes
            _library = library
        return _library
