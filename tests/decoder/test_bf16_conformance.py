"""The bf16 conformance rule (README, "Tests"): the prepared SmolLM2 checkpoint served in bfloat16
against transformers running the same checkpoint in bfloat16, on a fixed corpus of 20
natural-text prompts, 32 greedy tokens each, all requests in flight at once.

bf16 keeps 8 significant bits: one ulp at |x| is at most 2^-7 |x| (BF16_ULP). Both sides round
every activation and the lm_head product to bf16, in different summation orders, so logits of
SmolLM2 (|top1| ~ 15..30, ulp 0.0625..0.125) often tie exactly in transformers' own bf16 logits:
measured, 11 of the 20 prompts reach a step within 32 tokens where transformers' top-2 logits are
equal or one ulp apart, and there the argmax is decided by rounding, not by the model. Hence:

1. greedy ids equal transformers' for >= 95% of the prompts (19 of 20) over 32 tokens, or up to
   the first step where transformers' top-2 logits are within one bf16 ulp (a tie);
2. every first divergence lies where transformers' top-2 logits are within bf16 rounding:
   top1 - top2 <= TIE_ULPS ulps of |top1|;
3. up to and at the first divergence (the same context on both sides), every logit is within
   LOGIT_ULPS ulps of the row's largest |logit| of transformers' (measured: at most 4.8). A swap
   needs each of the top two logits to move by up to that much, hence TIE_ULPS = 2 * LOGIT_ULPS.

fp32 stays the exact reference (test_conformance.py, test_smollm.py: ids equal, logits 1e-4).
"""

import asyncio

import pytest
import torch
from decoder_testing import capture_logits
from family_conformance import bf16_follows
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.decoder.config import DecoderConfig
from services.decoder.engine import start_engine
from services.decoder.types import GenerateInput, SamplingParams
from tessera.paths import default_decoder_dir

NEW_TOKENS = 32
PAD = 2
MIN_EQUAL_SHARE = 0.95
CORPUS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):\n    ",
    "Water boils at 100 degrees Celsius at sea level because",
    "The three primary colors are",
    "In 1969, astronauts landed on the Moon. The mission was called",
    "A good recipe for pancakes needs flour, eggs, milk and",
    "The mitochondria is often described as the powerhouse of the cell since it",
    "To install a Python package, you usually run",
    "The quick brown fox jumps over the lazy dog. This sentence is famous because",
    "Photosynthesis converts sunlight, water and carbon dioxide into",
    "Dear hiring manager, I am writing to apply for the position of",
    "The largest planet in our solar system is Jupiter, which",
    "Here is a list of healthy breakfast ideas:\n1.",
    "Machine learning models are trained on data so that they can",
    "The Great Wall of China was built over many centuries to",
    "If you mix blue and yellow paint, you get",
    "The stock market fell sharply on Monday after investors",
    "Shakespeare wrote many plays, including Hamlet, Macbeth and",
    "A triangle has three sides, and the sum of its interior angles is",
]


def corpus(tokenizer) -> list[list[int]]:
    return [tokenizer(text)["input_ids"] for text in CORPUS]


def hf_reference(model_dir, prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    """transformers in bf16: one left-padded greedy generate over all prompts, EOS not stopping;
    [(ids, logits as float32 [NEW_TOKENS, vocab])] per prompt."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=PAD, output_logits=True, return_dict_in_generate=True)
    logits = torch.stack(out.logits, dim=1).float()  # [batch, NEW_TOKENS, vocab]
    return [(out.sequences[row, width:].tolist(), logits[row]) for row in range(len(prompts))]


def tessera_run(model_dir, prompts: list[list[int]], attention_backend: str) -> list[tuple[list[int], torch.Tensor]]:
    """The engine in bf16, every prompt in flight at once: [(ids, float32 logits [NEW_TOKENS, vocab])]."""
    engine = start_engine(DecoderConfig(model_dir=str(model_dir), dtype="bfloat16", max_model_len=256,
                                        max_num_seqs=len(prompts), attention_backend=attention_backend))
    logits = capture_logits(engine)

    async def one(i, prompt):
        request = GenerateInput(SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), request_id=f"r{i}",
                                prompt_token_ids=tuple(prompt))
        return [t for output in [o async for o in engine.generate(request)] for t in output.token_ids]

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    try:
        ids = asyncio.run(main())
    finally:
        engine.shutdown()
    return [(ids[i], torch.stack(logits[f"r{i}"])) for i in range(len(prompts))]


@pytest.fixture(scope="module")
def bf16_reference():
    model_dir = default_decoder_dir()
    prompts = corpus(AutoTokenizer.from_pretrained(model_dir))
    return model_dir, prompts, hf_reference(model_dir, prompts)


@pytest.mark.parametrize("attention_backend", ["torch"])
def test_bf16_greedy_follows_transformers_bf16(bf16_reference, attention_backend):
    model_dir, prompts, refs = bf16_reference
    runs = tessera_run(model_dir, prompts, attention_backend)
    equal = sum(bf16_follows(ids, logits, ref_ids, ref_logits, label=f"prompt {i}")
                for i, ((ids, logits), (ref_ids, ref_logits)) in enumerate(zip(runs, refs, strict=True)))
    assert equal >= MIN_EQUAL_SHARE * len(prompts), (
        f"greedy ids equal (up to transformers' first bf16 tie) for {equal} of {len(prompts)} prompts")
