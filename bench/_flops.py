"""Shared by bench/decode.py: the decoder's floating-point work and the machine's matmul rate.

Work of one token at position p (0-based) of a Llama-family model (GQA, SiLU-gated MLP), counted
as 2 flops per multiply-add, as the matmul rate is:

    linear   2 * P_lin,  P_lin = L * (H*q + 2*H*kv + q*H + 3*H*I)   (q/k/v/o, gate/up/down weights;
                                  q = heads * head_dim, kv = kv_heads * head_dim)
    attention 4 * L * q * (p + 1)  (q.k scores and probs.v over p + 1 keys, every head)
    lm_head  2 * H * V, only for tokens that sample

Norms, RoPE, SiLU and softmax are left out (O(H) per token, under 1% here). A request with a
prompt of n tokens and m generated tokens forwards n + m - 1 tokens (the last sampled token is
never fed back) and samples m.

A mixture-of-experts model (services/common/checkpoint.py `moe_layout`: Mixtral, Qwen2/3-MoE) counts,
on each sparse layer, the k experts a token is routed to (3*H*I_moe each), the router (H*E) and a
shared expert with its gate (3*H*I_s + H) in place of the dense MLP: `linear_params` is what one
token multiplies, `weight_params` what is stored (every expert), which a step of many rows reads.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.checkpoint import moe_layout


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    q_width: int      # heads * head_dim
    kv_width: int     # kv_heads * head_dim
    vocab: int
    sparse_layers: int = 0        # MoE layers (module docstring); the other layers are dense
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0  # Qwen2-MoE's shared expert, 0 for none

    @classmethod
    def read(cls, model_dir: Path) -> ModelShape:
        cfg = json.loads((model_dir / "config.json").read_text())
        cfg = cfg.get("text_config") or cfg
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        moe = moe_layout(cfg, cfg["num_hidden_layers"], cfg["intermediate_size"])
        sparse = {} if moe is None else dict(
            sparse_layers=len(moe.sparse_layers), experts=moe.num_experts,
            experts_per_token=cfg.get("num_experts_per_tok", 2), moe_intermediate=moe.moe_intermediate_size,
            shared_intermediate=cfg.get("shared_expert_intermediate_size") or 0)
        return cls(cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], heads * head_dim,
                   (cfg.get("num_key_value_heads") or heads) * head_dim, cfg["vocab_size"], **sparse)

    def _params(self, experts: int) -> int:
        h = self.hidden
        attention = self.layers * (2 * h * self.q_width + 2 * h * self.kv_width)
        dense = (self.layers - self.sparse_layers) * 3 * h * self.intermediate
        shared = 3 * h * self.shared_intermediate + h if self.shared_intermediate else 0
        sparse = self.sparse_layers * (experts * 3 * h * self.moe_intermediate + h * self.experts + shared)
        return attention + dense + sparse

    @property
    def linear_params(self) -> int:
        """Weights one token multiplies (a MoE layer: its k routed experts, router, shared expert)."""
        return self._params(self.experts_per_token)

    @property
    def weight_params(self) -> int:
        """Weights stored (every expert): what a step of many rows reads."""
        return self._params(self.experts)

    def request_flops(self, prompt: int, generated: int) -> float:
        """Flops of one request: `prompt` tokens in, `generated` tokens out (see module docstring)."""
        forwarded = prompt + generated - 1
        attention = 4 * self.layers * self.q_width * forwarded * (forwarded + 1) / 2  # sum of (p + 1)
        return 2 * self.linear_params * forwarded + attention + 2 * self.hidden * self.vocab * generated

    def decode_step_flops(self, batch: int, context: float) -> float:
        """Flops of one decode step: `batch` rows of one token each, attending to `context` keys."""
        return batch * (2 * self.linear_params + 4 * self.layers * self.q_width * context
                        + 2 * self.hidden * self.vocab)


def matmul_peak(shape: ModelShape, dtype: torch.dtype, rows=(32, 64, 128, 256, 512),
                repeats: int = 5) -> dict[int, float]:
    """GFLOP/s of torch.matmul [M, hidden] @ [hidden, intermediate] in `dtype` for each M in `rows`:
    the best of `repeats` timed batches of products (after a warm-up), on this process's threads."""
    rates = {}
    for m in rows:
        a = torch.randn(m, shape.hidden).to(dtype)
        b = torch.randn(shape.hidden, shape.intermediate).to(dtype)
        inner = max(1, int(2e9 / (2 * m * shape.hidden * shape.intermediate) / 10))  # ~0.2 GFLOP a batch
        torch.matmul(a, b)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(inner):
                torch.matmul(a, b)
            best = min(best, (time.perf_counter() - start) / inner)
        rates[m] = 2 * m * shape.hidden * shape.intermediate / best / 1e9
    return rates


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """GB/s at which this process's threads read memory: the best of `repeats` sums of a float32
    tensor of `megabytes` (far past any cache), after one untimed sum."""
    data = torch.ones(megabytes * 2**20 // 4)
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def roofline_s(shape: ModelShape, work, peak_gflops: float, bandwidth_gbs: float, element_bytes: int,
               step_tokens: int = 2048) -> tuple[float, float]:
    """Seconds the workload `work` ([(prompt ids, max_tokens)]) needs at least on a machine computing
    `peak_gflops` and reading memory at `bandwidth_gbs`, for weights and KV of `element_bytes` each:
    (every step taking max(its flops / peak, its bytes / bandwidth), every step taking their sum).

    Steps follow the engine's schedule: every decoding request one row, then prompts in order in
    chunks filling `step_tokens` (max_num_batched_tokens). A step reads every linear weight once (every expert),
    the lm_head when a row samples, and the KV of each row's context (a prompt chunk: its prefix).
    """
    kv_token = element_bytes * 2 * shape.kv_width * shape.layers  # K and V of one position, all layers
    weights, lm_head = element_bytes * shape.weight_params, element_bytes * shape.hidden * shape.vocab
    prompt = [len(p) for p, _ in work]
    left = [n for _, n in work]
    done = [0] * len(work)
    overlapped = summed = 0.0
    while any(left):
        budget, flops, kv_bytes, sampled = step_tokens, 0.0, 0.0, False
        for i in range(len(work)):
            if done[i] == prompt[i] and left[i] and budget:  # a decode row at position prompt + generated
                context = prompt[i] + work[i][1] - left[i]
                flops += shape.decode_step_flops(1, context)
                kv_bytes += kv_token * context
                left[i], budget, sampled = left[i] - 1, budget - 1, True
        for i in range(len(work)):
            if done[i] < prompt[i] and budget:
                first, n = done[i], min(budget, prompt[i] - done[i])
                flops += 2 * shape.linear_params * n + 4 * shape.layers * shape.q_width * (
                    n * first + n * (n + 1) / 2)  # sum over the chunk's positions p of (p + 1)
                kv_bytes += kv_token * (first + n)
                done[i], budget = first + n, budget - n
                if done[i] == prompt[i]:  # the prompt's last position samples the first token
                    flops += 2 * shape.hidden * shape.vocab
                    left[i], sampled = left[i] - 1, True
        seconds_compute = flops / (peak_gflops * 1e9)
        seconds_memory = (weights + (lm_head if sampled else 0) + kv_bytes) / (bandwidth_gbs * 1e9)
        overlapped += max(seconds_compute, seconds_memory)
        summed += seconds_compute + seconds_memory
    return overlapped, summed
