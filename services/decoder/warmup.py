"""The start-up warm-up: one real prefill and one decode step through every configured backend.

The decoder reports SERVING only after this ran (`LLMEngine.start`, services/common/server.py): a
configuration that cannot compute here (a Triton kernel without a GPU, a device out of memory, a
kernel that does not build) fails at start with its cause instead of failing every request later.
The step uses the engine's own scheduler, block manager, KV cache, model runner (attention
backend), LoRA backend and sampler on the configured device. Its request leases an adapter slot
holding zero factors for one target module, so the LoRA kernels run too (BGMV on the decode row,
SGMV on the prefill rows) without changing a logit, and samples with a seeded generator,
penalties and logprobs. Everything is given back: the request's blocks are freed (no prefix-cache
entry: it has no hasher) and the adapter slot is emptied.
"""

from __future__ import annotations

import torch

from services.decoder.lora import AdapterSlots, LoRAWeights
from services.decoder.model_runner import ModelRunner
from services.decoder.request import Request
from services.decoder.sampler import make_generator
from services.decoder.scheduler import Scheduler
from services.decoder.types import PromptInputs, SamplingParams

WARM_UP = "warm-up"  # the request's key and id, the adapter's digest and lease name
MAX_PROMPT_TOKENS = 3


def warm_up(scheduler: Scheduler, runner: ModelRunner, slots: AdapterSlots, max_tokens: int,
            device: torch.device) -> list[int]:
    """Run one request of up to 3 prompt tokens and 2 sampled tokens (prefill, then one decode
    step) through `runner`; returns the sampled ids. `max_tokens`: the most tokens the cache and the
    model's context hold for one request (at least 1).

    Raises:
        whatever a backend raises (RuntimeError from a kernel, torch.OutOfMemoryError, ...);
        RuntimeError when the scheduler cannot place the request.
    """
    num_prompt = max(1, min(MAX_PROMPT_TOKENS, max_tokens - 1))
    num_samples = 2 if num_prompt + 1 <= max_tokens else 1
    params = SamplingParams(max_tokens=num_samples, temperature=0.8, top_k=20, top_p=0.9, seed=0,
                            repetition_penalty=1.1, top_logprobs=1)
    swaps = slots.num_swaps
    slot = _lease_zero_adapter(slots)
    request = Request(WARM_UP, WARM_UP, PromptInputs(list(range(1, num_prompt + 1))), params, slot,
                      make_generator(params.seed, device), lora_name=WARM_UP)
    try:
        scheduler.add(request)
        for _ in range(num_prompt + num_samples):  # a chunked prefill takes at most one step per token
            if len(request.output_token_ids) == num_samples:
                break
            out = scheduler.schedule()
            if not out.scheduled:
                raise RuntimeError(f"the warm-up request ({num_prompt} prompt tokens) could not be scheduled")
            sample = runner.execute(out).samples.get(request.key)
            scheduler.update(out)
            if isinstance(sample, Exception):
                raise sample
            if sample is not None:
                request.output_token_ids.append(sample.token_id)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # a kernel's asynchronous error surfaces here, not in a request
    finally:
        scheduler.finish(request, "stop")
        slots.release(slot, WARM_UP)
        slots.unload(WARM_UP)
        slots.num_swaps = swaps  # the warm-up's swap-in is not an adapter's
    return list(request.output_token_ids)


def _lease_zero_adapter(slots: AdapterSlots) -> int:
    """Load and lease a rank-1 adapter of zero factors on the first target module."""
    name, (in_features, out_features) = next(iter(slots.module_shapes.items()))
    weights = LoRAWeights(WARM_UP, {name: (torch.zeros(1, in_features), torch.zeros(out_features, 1))})
    slot = slots.load_and_acquire(weights, WARM_UP)
    if slot is None:
        raise RuntimeError("no adapter slot is free for the warm-up")
    return slot
