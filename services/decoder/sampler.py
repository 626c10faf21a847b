"""Token selection: the structured-output grammar's mask and the token controls (allowed_token_ids,
bad_words, min_tokens, logit_bias) on the whole batch, then per row penalties and greedy or
temperature / min-p / top-k / top-p with a per-request generator.

Order, as vLLM v1's sampler: the grammar's bitmask (structured output, services/decoder/grammar.py),
the allowed_token_ids mask, the bad_words mask, the min_tokens mask and logit_bias
(`adjusted_scores`), then penalties, then greedy argmax or temperature and the filters: sampling is
from the constrained distribution. Each sampled request draws from its own `torch.Generator`, so a
seeded request gets the same tokens whatever else shares its batch. Log-probabilities describe the
raw model distribution (log_softmax of the logits before every mask, control, penalty, temperature
and filter), as vLLM reports by default. A row that asks for none of the controls, penalties or
filters costs no per-row tensor work beyond its draw (greedy rows: none at all, the batch's argmax);
a batch in which no row asks for a grammar or a control is not copied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.common.errors import InvalidArgument
from services.decoder.grammar import apply_bitmask
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


def sample(logits: torch.Tensor, rows: list[SamplingRow], grammar_mask: tuple[torch.Tensor, list[int]] | None = None,
           greedy_ids: list[int] | None = None) -> list[Sample | InvalidArgument]:
    """Pick one token per row of float32 `logits` [rows, vocab] (finite: model_runner drops the rest).

    `greedy_ids`, where the caller has them (the fused decode step's logits call), are each row's
    argmax of `logits`, the first of equal maxima as torch.max(dim=-1) returns it: used for the
    greedy rows when no mask or token control changed the scores, instead of a max over them.

    `grammar_mask` (bitmask int32 [rows, ceil(vocab / 32)], the constrained rows' indices;
    services/decoder/grammar.py) sets the tokens a row's grammar does not allow next to -inf first,
    before the token controls. A row whose grammar and controls together leave no token to sample
    (allowed_token_ids all banned by bad_words, held back by min_tokens, or outside its grammar)
    gets an InvalidArgument instead of a sample; the other rows are unaffected.
    """
    constrained: list[int] = []
    scores = logits
    if grammar_mask is not None:
        bitmask, constrained = grammar_mask
        # masked in place unless a row's logprobs need the raw logits afterwards
        scores = apply_bitmask(logits, bitmask, constrained, copy=any(row.params.logprobs for row in rows))
    scores = adjusted_scores(scores, rows)  # [rows, vocab]; unchanged when no row asks for a control
    # only an allow-list or a grammar can mask a whole row (bad words and min_tokens ban a few ids each):
    # such a row's best score is -inf
    allowing = sorted({i for i, row in enumerate(rows) if row.params.allowed_token_ids is not None} | set(constrained))
    # the caller's argmax holds while the scores are the logits it was taken over (a grammar masks in place)
    if greedy_ids is None or grammar_mask is not None or allowing or scores is not logits:
        best, greedy = scores.max(dim=-1)
        greedy_ids = greedy.tolist()
    exhausted = set()
    if allowing:
        alive = (best[allowing] > float("-inf")).tolist()  # [num_allowing]
        exhausted = {i for i, ok in zip(allowing, alive) if not ok}
    samples: list[Sample | InvalidArgument] = []
    for index, row in enumerate(rows):
        p = row.params
        if index in exhausted:
            field = ("sampling.allowed_token_ids" if p.allowed_token_ids is not None
                     else f"sampling.{p.constraint.field}")
            samples.append(InvalidArgument("the structured-output constraint, allowed_token_ids, bad_words and "
                                           "min_tokens together mask every token of the vocabulary here: no token "
                                           "can be sampled", field=field))
            continue
        row_scores = apply_penalties(scores[index], row) if p.penalized else scores[index]
        if p.greedy:
            token = int(row_scores.argmax()) if p.penalized else greedy_ids[index]
        else:
            token = _sample_row(row_scores, p, row.generator)
        samples.append(_with_logprobs(logits[index], token, p) if p.logprobs else Sample(token))
    return samples


def adjusted_scores(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """`logits` [rows, vocab] float32 with every row's token controls applied, before penalties
    and temperature (vLLM v1's order): ids outside a row's `allowed_token_ids` get -inf; so does the
    last token of each `bad_words_token_ids` sequence whose other tokens end the row's output
    (vLLM's bad words rule: a one-token word always); so do the min_tokens ids (stop_token_ids and
    EOS) while the row has fewer than `min_tokens` tokens (vLLM's MinTokensLogitsProcessor); then
    `logit_bias` values are added (OpenAI's; -inf stays -inf).

    Returns `logits` itself when no row asks for any of them, else a copy changed by one indexed
    write per kind (a masked_fill of the allow-lists' rows, an index_put_ of the bans, one of the
    biases), each over flat (row, token) index tensors gathered from the asking rows: no Python
    loop over the vocabulary, no tensor work for rows that ask nothing.

        rows:     0 1 2 3      row 1 allows {5, 9}; rows 0 and 3 ban 7; row 2 biases 4 by +3
        allowed:  . X . .  ->  blocked [1 row, vocab] = True but (0, 5), (0, 9); scores[[1]] masked
        banned:   X . . X  ->  index (rows [0, 3], tokens [7, 7]) <- -inf
        bias:     . . X .  ->  index (rows [2], tokens [4]) += [3.0]
    """
    allowed_rows, allowed_ids, allowed_local = [], [], []
    banned_rows, banned_ids = [], []
    bias_rows, bias_ids, bias_values = [], [], []
    for index, row in enumerate(rows):
        p = row.params
        if p.allowed_token_ids is not None:
            allowed_local.extend([len(allowed_rows)] * len(p.allowed_token_ids))
            allowed_rows.append(index)
            allowed_ids.extend(p.allowed_token_ids)
        banned = _bad_words_mask(row) + _min_tokens_mask(row)
        banned_rows.extend([index] * len(banned))
        banned_ids.extend(banned)
        if p.logit_bias:
            bias_rows.extend([index] * len(p.logit_bias))
            bias_ids.extend(p.logit_bias)
            bias_values.extend(p.logit_bias.values())
    if not (allowed_rows or banned_rows or bias_rows):
        return logits
    device = logits.device
    scores = logits.clone()  # [rows, vocab]

    def index(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    if allowed_rows:
        blocked = torch.ones(len(allowed_rows), scores.shape[1], dtype=torch.bool, device=device)  # [asking, vocab]
        blocked[index(allowed_local), index(allowed_ids)] = False
        picked = index(allowed_rows)
        scores[picked] = scores[picked].masked_fill(blocked, float("-inf"))
    if banned_rows:
        scores[index(banned_rows), index(banned_ids)] = float("-inf")
    if bias_rows:
        scores.index_put_((index(bias_rows), index(bias_ids)),
                          torch.tensor(bias_values, dtype=scores.dtype, device=device), accumulate=True)
    return scores


def _bad_words_mask(row: SamplingRow) -> tuple[int, ...]:
    """The last token of each of the row's bad-word sequences whose other tokens are the last ones
    of its output (vLLM v1's apply_bad_words: generated tokens only, the prompt not counted)."""
    output, banned = row.output_ids, []
    for sequence in row.params.bad_words_token_ids:
        prefix = len(sequence) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or tuple(output[len(output) - prefix:]) == sequence[:-1]:
            banned.append(sequence[-1])
    return tuple(banned)


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
