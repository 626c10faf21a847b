"""A request's life inside the engine: tokens, progress through the prompt, lease and status."""

from __future__ import annotations

import enum

import torch

from services.decoder.grammar import GrammarState
from services.decoder.prefix_cache import BlockHasher
from services.decoder.rotary import LongRope
from services.decoder.types import PromptInputs, Sample, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class PromptLogprobs:
    """The prompt's log-probabilities as prefill computes them, one record shared by a request's n
    choices (whichever computes a position first records it; a recompute after preemption records
    nothing twice).

    Entry j is prompt token j + 1's: the logits row at position j predicts it, so the first token
    has none and a prompt of P tokens has P - 1 entries (vLLM's prompt_logprobs, without its
    leading None). Each entry holds `num_alternatives` most likely tokens besides the chosen one.
    """

    def __init__(self, num_alternatives: int, num_prompt_tokens: int) -> None:
        self.num_alternatives = num_alternatives
        self.num_positions = max(0, num_prompt_tokens - 1)
        self.entries: list[Sample] = []

    @property
    def complete(self) -> bool:
        return len(self.entries) == self.num_positions

    def positions_to_compute(self, start: int, end: int) -> range:
        """Positions in [start, end) whose rows give entries not recorded yet."""
        return range(max(start, len(self.entries)), min(end, self.num_positions))

    def record(self, start: int, entries: list[Sample]) -> None:
        """Record `entries` for positions start, start + 1, ...; those already recorded are skipped.

        Raises:
            ValueError: `start` leaves a gap after the recorded entries.
        """
        if start > len(self.entries):
            raise ValueError(f"prompt logprobs from position {start} would leave a gap after the "
                             f"{len(self.entries)} recorded")
        self.entries.extend(entries[len(self.entries) - start:])


class Request:
    """Engine-side state. `key` is unique per submission (the block manager's id);
    `num_computed_tokens` counts positions whose K/V are in the cache (reset by preemption);
    `hasher` (None = no prefix caching) hashes its full blocks for the prefix cache;
    `lora_slot` is the adapter bank slot it leases, taken as adapter `lora_name`;
    `prompt_logprobs` (None = not asked) is the record its choices share; `grammar` (None = free
    text) is its own structured-output matcher, advanced with each token it appends; `long_rope`
    (None = one set of rotary frequencies) is the model's longrope rule, and `kv_long_rope` says
    whether its computed K/V used the long factors (the scheduler recomputes them on a switch)."""

    def __init__(self, key: str, request_id: str, prompt: PromptInputs, sampling: SamplingParams,
                 lora_slot: int | None = None, generator: torch.Generator | None = None,
                 hasher: BlockHasher | None = None, index: int = 0, parent: Request | None = None,
                 lora_name: str = "", prompt_logprobs: PromptLogprobs | None = None,
                 grammar: GrammarState | None = None, long_rope: LongRope | None = None) -> None:
        self.key = key
        self.request_id = request_id
        self.prompt = prompt
        self.sampling = sampling
        self.lora_slot = lora_slot
        self.lora_name = lora_name
        self.generator = generator
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.hasher = hasher
        self.num_cached_tokens = 0  # prompt tokens taken from the prefix cache at first admission
        self.index = index          # choice index; choices > 0 wait for `parent` to compute the prompt
        self.parent = parent
        self.prompt_logprobs = prompt_logprobs
        self.grammar = grammar  # the choice's structured-output matcher (grammar.py); None = free text
        self.long_rope = long_rope
        self.kv_long_rope = False

    def waits_for_parent(self) -> bool:
        """True while the first choice has not computed the shared prompt (so its blocks can be reused)."""
        p = self.parent
        return p is not None and p.status is not RequestStatus.FINISHED and p.num_computed_tokens < p.num_prompt_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt.token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def max_cached_tokens(self) -> int:
        """The most leading positions admission may take from the prefix cache: all but the last
        token (whose logits are sampled), and none whose prompt logprobs are still to record."""
        limit = self.num_tokens - 1
        if self.prompt_logprobs is not None:
            limit = min(limit, len(self.prompt_logprobs.entries))
        return limit

    @property
    def uses_long_rope(self) -> bool:
        """Whether its rows run on longrope's long factors now (`LongRope`: its tokens so far number
        more than original_max_position_embeddings); False without longrope."""
        return self.long_rope is not None and self.long_rope.uses_long(self.num_tokens)

    def block_hashes(self) -> list[bytes]:
        """Chain hashes of every full block of the known tokens (empty without a hasher), salted
        with the rotary factors its K/V are computed with now."""
        if self.hasher is None:
            return []
        self.hasher.use_long_rope(self.uses_long_rope)
        if self.num_tokens // self.hasher.block_size > len(self.hasher.hashes):
            self.hasher.update(self.prompt.token_ids + self.output_token_ids)
        return self.hasher.hashes

    def token_ids(self, start: int, end: int) -> list[int]:
        """Prompt + generated ids at physical positions [start, end)."""
        prompt = self.prompt.token_ids
        return prompt[start:end] + self.output_token_ids[max(0, start - len(prompt)):max(0, end - len(prompt))]

    def rope_range(self, start: int, end: int) -> range:
        """Rotary positions of [start, end) without M-RoPE: physical, shifted by longrope's
        `position_offset` while its rows run on the long factors (rotary.py)."""
        offset = self.long_rope.position_offset if self.uses_long_rope else 0
        return range(start + offset, end + offset)

    def mrope_positions(self, start: int, end: int) -> torch.Tensor:
        """M-RoPE positions of [start, end): int64 [3, n] (t, h, w); `rope_range` gives a model
        without M-RoPE its positions.

        Prompt positions come from the M-RoPE table; later ones are physical + rope delta
        (as in transformers' Qwen2-VL get_rope_index / decode path).
        """
        table = self.prompt.mrope_positions
        split = min(max(start, self.num_prompt_tokens), end)
        tail = (torch.arange(split, end) + self.prompt.rope_delta).expand(3, -1)
        if table is None:
            head = torch.arange(start, split).expand(3, -1)
        else:
            head = table[:, start:split]
        return torch.cat((head, tail), dim=1)

    def image_rows(self, start: int, end: int) -> tuple[list[int], list[torch.Tensor]]:
        """Image rows inside [start, end): (offsets from `start`, row blocks [k, hidden])."""
        offsets, blocks = [], []
        for span in self.prompt.image_spans:
            lo, hi = max(start, span.start), min(end, span.end)
            if lo < hi:
                offsets.extend(range(lo - start, hi - start))
                blocks.append(span.rows[lo - span.start:hi - span.start])
        return offsets, blocks
