"""Token selection: penalties and the min_tokens mask, then greedy or temperature / min-p / top-k /
top-p with a per-request generator.

Each sampled request draws from its own `torch.Generator`, so a seeded request gets the same
tokens whatever else shares its batch. Log-probabilities describe the raw model distribution
(log_softmax of the logits before penalties, masks, temperature and filters), as vLLM reports by
default. A row that asks for none of penalties, min_tokens or filters costs no per-row tensor work
beyond its draw (greedy rows: none at all, the batch's argmax).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.decoder.types import Sample, SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs of one request: its params, generator and token history."""

    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on `device` (where the logits are: multinomial draws with a generator of the
    probabilities' device), seeded with `seed`, or from fresh entropy when None. A seed gives the
    same tokens on every run on one device kind; CPU and CUDA generators differ from each other.
    Any int is a seed, taken modulo 2**64 (torch's manual_seed reads a negative one so, and vLLM
    hands a request's seed to it as it is: seed -1 draws as 2**64 - 1)."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed % 2**64)
    return generator


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """Penalized copy of one row of float32 logits [vocab].

    repetition (transformers' RepetitionPenaltyLogitsProcessor): for every token in prompt +
    output, logit / p if positive else logit * p. presence / frequency (OpenAI): subtract
    presence * [count > 0] + frequency * count, counting generated tokens only.
    """
    p = row.params
    logits = logits.clone()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(list(row.prompt_ids) + list(row.output_ids), dtype=torch.long,
                            device=logits.device).unique()
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and len(row.output_ids):
        counts = torch.bincount(torch.tensor(list(row.output_ids), dtype=torch.long, device=logits.device),
                                minlength=logits.numel()).to(logits.dtype)  # [vocab]
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[Sample]:
    """Pick one token per row of float32 `logits` [rows, vocab]."""
    greedy_ids = logits.argmax(dim=-1).tolist()
    samples = []
    for index, row in enumerate(rows):
        p = row.params
        scores = apply_penalties(logits[index], row) if p.penalized else logits[index]
        masked = _min_tokens_mask(row)
        if masked:
            scores = scores.index_fill(0, torch.tensor(masked, dtype=torch.long, device=scores.device),
                                       float("-inf"))
        if p.greedy:
            token = int(scores.argmax()) if p.penalized or masked else greedy_ids[index]
        else:
            token = _sample_row(scores, p, row.generator)
        samples.append(_with_logprobs(logits[index], token, p) if p.logprobs else Sample(token))
    return samples


def _min_tokens_mask(row: SamplingRow) -> tuple[int, ...]:
    """The ids to mask while the choice has fewer than min_tokens tokens (vLLM's
    MinTokensLogitsProcessor: stop_token_ids and the EOS ids); () once it has them, or unasked."""
    p = row.params
    if len(row.output_ids) >= p.min_tokens:
        return ()
    return p.min_tokens_masked_ids


def _with_logprobs(logits: torch.Tensor, token: int, p: SamplingParams) -> Sample:
    logprobs = torch.log_softmax(logits, dim=-1)  # [vocab]
    top = []
    if p.top_logprobs:
        values, ids = torch.topk(logprobs, p.top_logprobs)
        top = list(zip(ids.tolist(), values.tolist()))
    return Sample(token, float(logprobs[token]), top)


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """One draw from `logits` [vocab] after temperature, min-p (vLLM's order: before top-k and top-p;
    transformers' MinPLogitsWarper's rule), top-k and top-p."""
    logits = logits / p.temperature  # [vocab]
    if p.min_p > 0:
        probs = logits.softmax(-1)
        # drop tokens below min_p times the most likely one's probability (the most likely always stays)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
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
