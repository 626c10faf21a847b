"""One family's conformance against transformers in every scheduling regime, for the family tests.

A family test builds a tiny seeded checkpoint (`decoder_testing.make_tiny_llama(path, family=...)`),
computes transformers' references once (`references`), then runs `check_regime` for each name of
`REGIMES`: greedy ids equal transformers' generate and fp32 logits agree within 1e-4 (`check_greedy`)

- alone: the longest prompt by itself;
- concurrent: every prompt at once;
- chunked: `max_num_batched_tokens` = 32, so prompts are cut into chunks (the boundaries recorded);
- prefix: the longest prompt, then `prefix_prompt`, which shares `PREFIX_TOKENS` of it: a cache hit;
- preempt: a pool too small for every prompt at once, so the scheduler preempts (recompute).

Every regime ends with every KV block free again. `check_lora` serves two PEFT adapters (q/v or
all-linear: `LORA_TARGETS`) and base rows in one batch against PEFT. `check_bf16` serves the family
in bfloat16 against transformers in bfloat16 under the bf16 rule (`bf16_follows`).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from decoder_testing import check_greedy, hf_reference_batch
from transformers import AutoModelForCausalLM

from services.decoder.adapter_source import InMemoryAdapterSource
from services.decoder.config import DecoderConfig
from services.decoder.engine import start_engine
from services.decoder.lora import LoRAWeights
from services.decoder.types import GenerateInput, SamplingParams

REGIMES = ("alone", "concurrent", "chunked", "prefix", "preempt")
NEW_TOKENS = 64
PREFIX_TOKENS = 80  # 5 full blocks of 16
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(3, 49152) for _ in range(n)] for n in (5, 40, 70, 90, 100)]
PREFIX_PROMPT = PROMPTS[-1][:PREFIX_TOKENS] + [_rng.randrange(3, 49152) for _ in range(12)]


def references(model_dir: Path, prompts=None, new_tokens: int = NEW_TOKENS, **load) -> dict:
    """{prompt tuple: (ids, fp32 logits [n, vocab])} from transformers' generate for `prompts`
    (default PROMPTS and PREFIX_PROMPT); `load` goes to from_pretrained (e.g. gguf_file)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, **load).eval()
    prompts = prompts or PROMPTS + [PREFIX_PROMPT]
    return dict(zip(map(tuple, prompts), hf_reference_batch(model, prompts, new_tokens)))


def _requests(prompts, new_tokens):
    return [GenerateInput(SamplingParams(max_tokens=new_tokens), request_id=f"r{i}", prompt_token_ids=tuple(p))
            for i, p in enumerate(prompts)]


def check_regime(model_dir: Path, refs: dict, regime: str, prompts=None, prefix_prompt=None,
                 new_tokens: int = NEW_TOKENS, rtol: float = 0.0, **config) -> None:
    """Serve `model_dir` (`config` overrides DecoderConfig's fields) and check `regime` (see the
    module docstring) against `refs`, logits within 1e-4 plus `rtol` relative; raises AssertionError
    on any difference."""
    prompts = prompts or PROMPTS
    prefix_prompt = prefix_prompt or PREFIX_PROMPT
    options = dict(model_dir=str(model_dir), num_blocks=80, max_model_len=256, max_num_seqs=8)
    if regime == "chunked":
        options["max_num_batched_tokens"] = 32
    if regime == "preempt":  # 28 blocks of 8 cannot hold every prompt and its new tokens at once
        options.update(num_blocks=28, block_size=8)
    options.update(config)
    engine = start_engine(DecoderConfig(**options))
    preempted, chunks = [], []
    scheduler = engine.parts.scheduler
    if regime == "preempt":
        preempt = scheduler._preempt
        scheduler._preempt = lambda r: (preempted.append(r.request_id), preempt(r))
    if regime == "chunked":
        schedule = scheduler.schedule
        scheduler.schedule = lambda: (out := schedule(), chunks.extend(
            s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1))[0]
    try:
        if regime == "alone":
            check_greedy(engine, refs, _requests([max(prompts, key=len)], new_tokens), concurrent=False, rtol=rtol)
        elif regime == "prefix":
            check_greedy(engine, refs, _requests([max(prompts, key=len)], new_tokens), rtol=rtol)
            second = check_greedy(engine, refs, _requests([prefix_prompt], new_tokens), rtol=rtol)[0]
            assert second[2].usage.cached_prompt_tokens > 0, "the second prompt was meant to hit the prefix cache"
        else:
            check_greedy(engine, refs, _requests(prompts, new_tokens), rtol=rtol)
        assert engine.stats().num_free_blocks == options["num_blocks"]
    finally:
        engine.shutdown()
    if regime == "preempt":
        assert preempted, "the pool was meant to force preemption"
    if regime == "chunked":
        assert chunks and max(chunks) <= options["max_num_batched_tokens"]


LORA_TARGETS = {"q/v": ["q_proj", "v_proj"], "all-linear": "all-linear"}


def peft_model(model_dir: Path, seed: int, target_modules, factor_dtype: torch.dtype | None = None, **load):
    """A PEFT LoRA (r 8, alpha 16) on transformers' model of `model_dir`, its factors drawn from
    N(0, 0.3) with `seed` so that the adapter changes greedy choices decisively (and rounded to
    `factor_dtype`, kept float32, when given)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, **load).eval()
    config = LoraConfig(r=8, lora_alpha=16, target_modules=target_modules, init_lora_weights=False)
    model = get_peft_model(base, config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
                if factor_dtype is not None:
                    p.copy_(p.to(factor_dtype))
    return model


def peft_weights(model, digest: str) -> LoRAWeights:
    """A PEFT model's scaled factors (B carries alpha / r) by transformers module name, as the
    adapter registry serves them."""
    modules, params = {}, dict(model.named_parameters())
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            target = name.removeprefix("base_model.model.")
            a = params[f"{name}.lora_A.default.weight"].detach().clone()
            b = params[f"{name}.lora_B.default.weight"].detach().clone() * module.scaling["default"]
            modules[target] = (a, b)
    return LoRAWeights(digest, modules)


def check_lora(model_dir: Path, target_modules, prompts=None, new_tokens: int = 24, reference: Path | None = None,
               reference_load: dict | None = None, factor_dtype: torch.dtype | None = None, **config) -> None:
    """Two PEFT adapters on `target_modules` (a list, or "all-linear") and base rows in one batch:
    each adapter's greedy ids equal PEFT's generate, base rows equal transformers', and the adapters
    change the output (else the check would prove nothing); every lease comes back. `reference`
    (default `model_dir`) and `reference_load` (from_pretrained's options, e.g. gguf_file): the
    checkpoint PEFT adapts, where the served one is another form of it (GGUF blocks); `factor_dtype`:
    PEFT's factors rounded to it (for `lora_dtype`)."""
    import asyncio

    prompts = prompts or [PROMPTS[1], PROMPTS[3]]
    models = {name: peft_model(reference or model_dir, seed, target_modules, factor_dtype, **(reference_load or {}))
              for name, seed in (("a", 1), ("b", 2))}
    refs = {name: [ids for ids, _ in hf_reference_batch(model, prompts, new_tokens)] for name, model in models.items()}
    with torch.no_grad(), models["a"].disable_adapter():
        refs[""] = [ids for ids, _ in hf_reference_batch(models["a"], prompts, new_tokens)]
    assert refs["a"] != refs[""] and refs["b"] != refs[""], "the adapters were meant to change the output"
    source = InMemoryAdapterSource()
    options = dict(model_dir=str(model_dir), num_blocks=64, max_model_len=256, adapter_slots=2, max_lora_rank=16)
    options.update(config)
    engine = start_engine(DecoderConfig(**options), source)
    try:
        for name, model in models.items():
            source.add(name, peft_weights(model, f"digest-{name}"))
        requests = [GenerateInput(SamplingParams(max_tokens=new_tokens), request_id=f"{name or 'base'}{i}",
                                  prompt_token_ids=tuple(p), lora=name)
                    for i, p in enumerate(prompts) for name in ("a", "", "b")]

        async def collect(request):
            return [t async for out in engine.generate(request) for t in out.token_ids]

        async def main():
            return await asyncio.gather(*(collect(r) for r in requests))

        results = asyncio.run(main())
        expected = [refs[name][i] for i in range(len(prompts)) for name in ("a", "", "b")]
        assert results == expected
        assert all(engine.parts.bank.num_leases(slot) == 0 for slot in range(options["adapter_slots"]))
        assert engine.stats().num_free_blocks == options["num_blocks"]
    finally:
        engine.shutdown()


# The bf16 rule (README, "Tests"; test_bf16_conformance.py): bf16 keeps 8 significant bits, one ulp at
# |x| is at most 2^-7 |x|; both sides round every activation, in different summation orders, so logits
# may differ by a few ulps and an argmax may flip where transformers' top two logits (nearly) tie.
LOGIT_ULPS = 8   # logits: |diff| <= 8 * 2^-7 * the row's largest |logit|
TIE_ULPS = 2 * LOGIT_ULPS  # a swap needs each of the top two logits to move by up to LOGIT_ULPS
BF16_ULP = 2.0 ** -7


def _top2_gap_ulps(logits: torch.Tensor) -> torch.Tensor:
    """float32 [steps, vocab] -> [steps]: top1 - top2 in bf16 ulps of |top1| (2^-7 |top1|)."""
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]) / (BF16_ULP * top[:, 0].abs())


def bf16_follows(ids: list[int], logits: torch.Tensor, ref_ids: list[int], ref_logits: torch.Tensor,
                 label: str) -> bool:
    """Assert the bf16 rule for one prompt (ours: ids and float32 logits [steps, vocab]; transformers'
    the same): up to and at the first divergence every logit is within LOGIT_ULPS ulps of the row's
    largest |logit|, and a divergence lies where transformers' top two logits are within TIE_ULPS.
    Returns whether the ids are equal up to transformers' first tie (top two within one ulp)."""
    assert len(ids) == len(ref_ids), f"{label}: {len(ids)} tokens, transformers {len(ref_ids)}"
    gaps = _top2_gap_ulps(ref_logits)  # [steps]
    ties = torch.nonzero(gaps <= 1).flatten().tolist()
    decided = ties[0] if ties else len(ref_ids)  # steps before transformers' first bf16 tie
    step = next((i for i, (a, b) in enumerate(zip(ids, ref_ids, strict=True)) if a != b), None)
    compared = len(ids) if step is None else step + 1  # the same context up to and at the divergence
    diff = (logits[:compared] - ref_logits[:compared]).abs().amax(-1)      # [compared]
    limit = LOGIT_ULPS * BF16_ULP * ref_logits[:compared].abs().amax(-1)  # [compared]
    assert bool((diff <= limit).all()), (
        f"{label}: logits differ by up to {diff.max():.4f}, over {LOGIT_ULPS} bf16 ulps of the row's largest "
        f"logit at step {int((diff - limit).argmax())}")
    if step is not None:
        assert gaps[step] <= TIE_ULPS, (f"{label} diverges at step {step} where transformers' top-2 logits are "
                                        f"{gaps[step]:.1f} bf16 ulps apart, not within rounding ({TIE_ULPS})")
    return step is None or step >= decided


def check_bf16(model_dir: Path, prompts=None, new_tokens: int = 24, **config) -> int:
    """Serve `model_dir` in bfloat16 with every prompt (default PROMPTS) in flight at once, against
    transformers' generate in bfloat16 one prompt at a time; assert `bf16_follows` for each and
    every KV block back. Returns how many prompts' ids are equal up to transformers' first tie."""
    import asyncio

    from decoder_testing import capture_logits, hf_reference

    prompts = prompts or PROMPTS
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    refs = [hf_reference(model, p, new_tokens) for p in prompts]
    options = dict(model_dir=str(model_dir), dtype="bfloat16", num_blocks=80, max_model_len=256, max_num_seqs=8)
    options.update(config)
    engine = start_engine(DecoderConfig(**options))
    logits = capture_logits(engine)
    requests = [GenerateInput(SamplingParams(max_tokens=new_tokens, ignore_eos=True), request_id=f"r{i}",
                              prompt_token_ids=tuple(p)) for i, p in enumerate(prompts)]

    async def collect(request):
        return [t async for out in engine.generate(request) for t in out.token_ids]

    async def main():
        return await asyncio.gather(*(collect(r) for r in requests))

    try:
        ids = asyncio.run(main())
        assert engine.stats().num_free_blocks == options["num_blocks"]
    finally:
        engine.shutdown()
    return sum(bf16_follows(ids[i], torch.stack(logits[f"r{i}"]), *refs[i], label=f"prompt {i}")
               for i in range(len(prompts)))
