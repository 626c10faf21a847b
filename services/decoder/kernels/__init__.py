"""Multi-LoRA kernels: per-step batch metadata and the torch / Triton (BGMV, SGMV) backends."""

from services.decoder.kernels.backend import BACKENDS, LoRABackend, TorchLoRABackend, make_backend, triton_available
from services.decoder.kernels.batch import BASE_SLOT, LoRABatch

__all__ = ["BACKENDS", "BASE_SLOT", "LoRABackend", "LoRABatch", "TorchLoRABackend", "make_backend",
           "triton_available"]
