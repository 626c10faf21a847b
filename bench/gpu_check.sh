#!/usr/bin/env bash
# The GPU checks of the decoder's --device, for a machine with a CUDA device:
#   1. the device and warm-up tests and a conformance subset (greedy ids = transformers), with the
#      decoder on CUDA: in-process configs default to --device auto, which is CUDA here;
#   2. the GGUF dequantize-in-the-GEMM Triton kernels (tests/decoder/test_quant_triton.py) compiled for
#      the GPU, against gguf-py's dequantization and a float64 matmul, and a Q4_K_M checkpoint served
#      with --linear-backend triton on CUDA (tests/decoder/test_quantized.py: ids and logits = transformers);
#   3. `tessera bench decode|lora|kernels` with the Triton attention and LoRA kernels; every
#      `python -m services.decoder` they start reads TESSERA_DECODER_DEVICE=cuda. Their tables are
#      rewritten under bench/results/ with the machine (GPU named) in their header.
# Refuses to run without a CUDA device (the CPU suite covers the plumbing there).
#
# The GPU machine has python 3.12 with torch 2.11 and triton 3.6 (and numpy) preinstalled and no package
# registry: carry the wheels (cp312, manylinux x86_64) of
#   transformers tokenizers safetensors regex tqdm gguf PyYAML (gguf imports yaml) pillow
#   grpcio grpcio-health-checking grpcio-reflection grpcio-status protobuf googleapis-common-protos
#   prometheus-client xgrammar apache-tvm-ffi pytest pytest-timeout peft
# at services/pyproject.toml's pins, with their own dependencies less torch, triton and numpy, and install
# them there with `pip install --no-index --find-links wheels/ NAMES`. The script first imports a module
# of each (and of torch and triton) and names the wheel of any that is missing.
#
#   bench/gpu_check.sh            # from the repository root; PYTHON=... to choose the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}

"$PY" - <<'EOF'
import importlib
import sys

WHEELS = {  # module -> the wheel that provides it (header)
    "numpy": "numpy", "transformers": "transformers", "tokenizers": "tokenizers", "safetensors": "safetensors",
    "regex": "regex", "tqdm": "tqdm", "gguf": "gguf", "yaml": "PyYAML", "PIL": "pillow", "grpc": "grpcio",
    "grpc_health": "grpcio-health-checking", "grpc_reflection": "grpcio-reflection", "grpc_status": "grpcio-status",
    "google.protobuf": "protobuf", "google.rpc": "googleapis-common-protos", "prometheus_client": "prometheus-client",
    "xgrammar": "xgrammar", "tvm_ffi": "apache-tvm-ffi", "pytest": "pytest", "pytest_timeout": "pytest-timeout",
    "peft": "peft", "torch": "torch", "triton": "triton",
}
missing = []
for module, wheel in WHEELS.items():
    try:
        importlib.import_module(module)
    except ImportError as error:
        missing.append(f"{wheel} (import {module}: {error})")
if missing:
    sys.exit("bench/gpu_check.sh: missing wheels, carry and install them (see this script's header):\n  "
             + "\n  ".join(missing))

import torch

if not torch.cuda.is_available():
    sys.exit("bench/gpu_check.sh: torch sees no CUDA device on this machine; nothing to check")
print(f"GPU: {torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} device(s)), torch {torch.__version__}")
EOF

unset TRITON_INTERPRET  # the kernels compile for the GPU, not for Triton's CPU interpreter
export TESSERA_DECODER_DEVICE=cuda TESSERA_POOLING_DEVICE=cuda

echo "== device plumbing, warm-up and conformance subset on CUDA"
timeout 900 "$PY" -m pytest -q tests/decoder/test_device.py tests/decoder/test_warmup.py \
    tests/decoder/test_conformance.py tests/decoder/test_model_families.py tests/decoder/test_lora.py \
    -k "not cpu"

echo "== GGUF dequantize-in-the-GEMM Triton kernels on CUDA (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K against gguf-py)"
timeout 600 "$PY" -m pytest -q tests/decoder/test_quant_triton.py \
    tests/decoder/test_quantized.py::test_triton_linear_backend_serves_the_blocks_equal_to_transformers

echo "== tessera bench kernels (Triton BGMV/SGMV and paged attention against torch)"
timeout 900 "$PY" -m tessera.cli.main bench kernels --dtype bfloat16

echo "== tessera bench decode (Triton attention)"
timeout 1200 "$PY" -m tessera.cli.main bench decode --attention-backend triton

echo "== tessera bench lora (Triton attention and LoRA kernels)"
timeout 1200 "$PY" -m tessera.cli.main bench lora --attention-backend triton --lora-backend triton

echo "== tables written"
git status --short bench/results/
