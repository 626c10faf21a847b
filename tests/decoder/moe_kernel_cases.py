"""The Triton grouped GEMM (kernels/moe_triton.py) against the torch path, run under TRITON_INTERPRET=1
by test_moe.py (Triton reads it when kernels are defined): odd row counts per expert, experts with
no rows, sizes that are not multiples of the kernel's blocks, and a whole sparse block with the
Triton GEMM. Prints one "OK ..." line per case."""

from __future__ import annotations

import torch

from services.decoder.kernels.moe_triton import TritonGroupedGemm
from services.decoder.moe import MoeSpec, SparseMoeBlock, TorchGroupedGemm

COUNTS = ([0, 1, 0, 0, 0], [3, 0, 7, 0, 1], [0, 0, 0, 0, 40], [13, 11, 0, 9, 7], [17, 1, 1, 1, 0])


def check_gemm() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(5, 70, 37, generator=generator)  # [experts, out, in]: 70 > BLOCK_N, 37 > BLOCK_K
    for counts in COUNTS:
        offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
        x = torch.randn(sum(counts), 37, generator=generator)
        got = TritonGroupedGemm()(x, weight, offsets)
        torch.testing.assert_close(got, TorchGroupedGemm()(x, weight, offsets), atol=1e-5, rtol=0)
        print("OK gemm", counts)


def check_block() -> None:
    spec = MoeSpec(architecture="x", vocab_size=8, hidden_size=48, intermediate_size=64, num_layers=1, num_heads=1,
                   num_kv_heads=1, head_dim=48, rms_norm_eps=1e-6, rope_theta=1e4, tie_word_embeddings=False,
                   qkv_bias=False, o_bias=False, mlp_bias=False, max_position_embeddings=64, num_experts=6,
                   num_experts_per_tok=2, moe_intermediate_size=40, sparse_layers=(0,))
    torch.manual_seed(1)
    block = SparseMoeBlock(spec, 0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
        x = torch.randn(23, 48)
        block.experts.grouped_gemm = TorchGroupedGemm()
        expected = block(x)
        block.experts.grouped_gemm = TritonGroupedGemm()
        torch.testing.assert_close(block(x), expected, atol=1e-5, rtol=0)
    print("OK block")


if __name__ == "__main__":
    check_gemm()
    check_block()
