"""Token selection: greedy, or temperature / top-k / top-p with a per-request generator.

Each sampled request draws from its own `torch.Generator`, so a seeded request gets the same
tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

from services.decoder.inputs import SamplingParams


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with `seed`, or from fresh entropy when None."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """Pick one token per row of float32 `logits` [rows, vocab]; returns token ids."""
    greedy_ids = logits.argmax(dim=-1).tolist()
    tokens = []
    for row, (p, generator) in enumerate(zip(params, generators)):
        if p.greedy:
            tokens.append(greedy_ids[row])
        else:
            tokens.append(_sample_row(logits[row], p, generator))
    return tokens


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    logits = logits / p.temperature  # [vocab]
    if 0 < p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
