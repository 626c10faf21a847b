"""Triton paged attention vs the torch path; run in a subprocess with TRITON_INTERPRET=1 (Triton reads
it when kernels are defined). `python tests/decoder/attention_kernel_cases.py MODEL_DIR` prints OK lines."""

import os
import sys

import torch

from services.decoder.attention import AttentionMetadata, paged_attention, plan_decode, prefill_span
from services.decoder.triton_attention import triton_paged_attention


def kernel_case(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> float:
    """One causal prefill chunk (positions 5..9 of a 10-token sequence) and two decodes, scattered blocks."""
    torch.manual_seed(num_heads * 100 + head_dim)
    num_blocks = 12
    k = torch.randn(num_kv_heads, num_blocks * block_size, head_dim)  # head-major, as KVCache
    v = torch.randn(num_kv_heads, num_blocks * block_size, head_dim)
    tables = [[7, 2, 9, 4], [3, 11], [0, 5, 8]]
    lengths = [10, 2 * block_size - 3, 3 * block_size]  # seq 0 prefills 5..9; 1 and 2 decode their last

    def slots(seq, n):
        pos = torch.arange(n)
        return torch.tensor(tables[seq])[pos // block_size] * block_size + pos % block_size

    query = torch.randn(7, num_heads, head_dim)
    meta = AttentionMetadata(slot_mapping=torch.zeros(7, dtype=torch.long),
                             prefills=[prefill_span(0, 5, slots(0, 10))])
    meta.decode_rows, meta.block_size = torch.tensor([5, 6]), block_size
    meta.decode_groups, meta.decode_index = plan_decode([5, 6], tables[1:], lengths[1:], block_size, num_kv_heads,
                                                        num_blocks)
    expected = paged_attention(query, k, v, meta, head_dim ** -0.5)
    padded = torch.zeros(3, 4, dtype=torch.int32)
    for row, t in enumerate(tables):
        padded[row, :len(t)] = torch.tensor(t, dtype=torch.int32)
    token_seq = torch.tensor([0] * 5 + [1, 2], dtype=torch.int32)
    context_lens = torch.tensor([6, 7, 8, 9, 10, lengths[1], lengths[2]], dtype=torch.int32)
    got = triton_paged_attention(query, k, v, padded, token_seq, context_lens, block_size, head_dim ** -0.5)
    return float((got - expected).abs().max())


def engine_case(model_dir: str) -> None:
    """Greedy ids and logits of the whole engine, triton backend vs torch backend (chunked, batched)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from decoder_testing import capture_logits, run_requests
    from services.decoder.config import DecoderConfig
    from services.decoder.engine import start_engine
    from services.decoder.types import GenerateInput, SamplingParams

    prompts = [list(range(100, 120)), [5, 6, 7]]
    results = {}
    for backend in ("torch", "triton"):
        engine = start_engine(DecoderConfig(model_dir=model_dir, num_blocks=16, block_size=8, max_model_len=128,
                                            max_num_batched_tokens=12, attention_backend=backend))
        logits = capture_logits(engine)
        try:
            ids = [r[0] for r in run_requests(engine, [GenerateInput(SamplingParams(max_tokens=4), request_id=f"r{i}",
                                                                     prompt_token_ids=tuple(p))
                                                       for i, p in enumerate(prompts)])]
        finally:
            engine.shutdown()
        results[backend] = (ids, {k: torch.stack(v) for k, v in logits.items()})
    assert results["torch"][0] == results["triton"][0], results
    for key, rows in results["torch"][1].items():
        torch.testing.assert_close(results["triton"][1][key], rows, atol=1e-4, rtol=0)
    print("OK engine", results["triton"][0])


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    torch.set_num_threads(1)
    for case in [(4, 2, 16, 4), (4, 4, 16, 8), (6, 2, 24, 4)]:  # GQA, MHA, non-power-of-two head_dim
        err = kernel_case(*case)
        assert err < 1e-5, (case, err)
        print("OK kernel", case, err)
    engine_case(sys.argv[1])
