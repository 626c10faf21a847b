"""The project's C kernels for CPUs (paged_attention.c, lora_bgmv.c) and their build (native.py)."""
