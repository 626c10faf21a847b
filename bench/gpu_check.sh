#!/usr/bin/env bash
# The GPU checks of the decoder's --device, for a machine with a CUDA device:
#   1. the device and warm-up tests and a conformance subset (greedy ids = transformers), with the
#      decoder on CUDA: in-process configs default to --device auto, which is CUDA here;
#   2. `tessera bench decode|lora|kernels` with the Triton attention and LoRA kernels; every
#      `python -m services.decoder` they start reads TESSERA_DECODER_DEVICE=cuda. Their tables are
#      rewritten under bench/results/ with the machine (GPU named) in their header.
# Refuses to run without a CUDA device (the CPU suite covers the plumbing there).
#
#   bench/gpu_check.sh            # from the repository root; PYTHON=... to choose the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}

"$PY" - <<'EOF'
import sys

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

echo "== tessera bench kernels (Triton BGMV/SGMV and paged attention against torch)"
timeout 900 "$PY" -m tessera.cli.main bench kernels --dtype bfloat16

echo "== tessera bench decode (Triton attention)"
timeout 1200 "$PY" -m tessera.cli.main bench decode --attention-backend triton

echo "== tessera bench lora (Triton attention and LoRA kernels)"
timeout 1200 "$PY" -m tessera.cli.main bench lora --attention-backend triton --lora-backend triton

echo "== tables written"
git status --short bench/results/
