"""The project's C kernels for CPUs (paged_attention.c, lora_bgmv.c, gemm.c, norm_rope.c) and their build
(native.py)."""
