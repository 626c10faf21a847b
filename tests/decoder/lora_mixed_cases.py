"""Mixed-batch multi-LoRA conformance, shared by the in-process (torch) and subprocess (Triton
interpreter) tests: base rows plus three PEFT adapters in one engine batch, each request compared
with PeftModel holding that adapter alone.

Usage as a script: python lora_mixed_cases.py MODEL_DIR ADAPTER_ROOT BACKEND  (prints one JSON line)
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import torch
from decoder_testing import capture_logits, hf_reference
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaForCausalLM

from services.adapters.base_model import BaseModelShapes
from services.adapters.peft_format import read_peft_adapter
from services.decoder.adapter_source import InMemoryAdapterSource
from services.decoder.config import DecoderConfig
from services.decoder.engine import start_engine
from services.decoder.lora import LoRAWeights
from services.decoder.types import GenerateInput, SamplingParams

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # ranks 4 / 8 / 16: plain LoRA, rsLoRA, rank_pattern + alpha_pattern
    "plain4": dict(r=4, lora_alpha=8, target_modules=ALL),
    "rs8": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj"]),
    "pattern16": dict(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"],
                      rank_pattern={"k_proj": 4}, alpha_pattern={"down_proj": 8}),
}
PROMPTS = [[1, 5, 77, 300, 12, 9], list(range(100, 123))]
NEW_TOKENS = 8
MAX_RANK = 16


def save_adapters(model_dir: Path, root: Path) -> None:
    """Write each adapter as a PEFT directory root/NAME with random (decisive) A and B."""
    for seed, (name, options) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + seed)
        base = LlamaForCausalLM.from_pretrained(model_dir).eval()
        model = get_peft_model(base, LoraConfig(init_lora_weights=False, **options))
        with torch.no_grad():
            for param_name, p in model.named_parameters():
                if "lora_" in param_name:
                    p.normal_(0, 0.2)
        model.save_pretrained(root / name)


def registry_weights(model_dir: Path, root: Path, name: str) -> LoRAWeights:
    """Parse the PEFT directory exactly as the registry serves it (scaled B, per-module ranks)."""
    adapter = read_peft_adapter(root / name, root, name, MAX_RANK, BaseModelShapes.from_model_dir(model_dir))
    return LoRAWeights(adapter.digest, {m: (t.lora_a, t.lora_b) for m, t in adapter.targets.items()})


def peft_references(model_dir: Path, root: Path) -> dict[str, tuple[list[int], torch.Tensor]]:
    refs = {}
    for name in [None, *ADAPTERS]:
        model = LlamaForCausalLM.from_pretrained(model_dir).eval()
        if name is not None:
            model = PeftModel.from_pretrained(model, root / name).eval()
        for i, prompt in enumerate(PROMPTS):
            refs[f"{name or 'base'}-{i}"] = hf_reference(model, prompt, NEW_TOKENS)
    return refs


def run_engine(model_dir: Path, root: Path, backend: str) -> dict[str, tuple[list[int], torch.Tensor]]:
    """All 8 requests (2 prompts x base + 3 adapters) submitted at once to one engine."""
    engine = start_engine(DecoderConfig(model_dir=str(model_dir), num_blocks=64, max_model_len=256,
                                        adapter_slots=len(ADAPTERS), max_lora_rank=MAX_RANK, lora_backend=backend),
                          InMemoryAdapterSource())
    try:
        for name in ADAPTERS:
            weights = registry_weights(model_dir, root, name)
            engine.parts.bank.load(weights)
            engine.adapters.add(name, weights)
        logits = capture_logits(engine)
        jobs = []
        for name in [None, *ADAPTERS]:
            for i, prompt in enumerate(PROMPTS):
                request = GenerateInput(SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True),
                                        request_id=f"{name or 'base'}-{i}", prompt_token_ids=tuple(prompt),
                                        lora=name or "")
                jobs.append((request, name))

        async def collect(request):
            return [t async for out in engine.generate(request) for t in out.token_ids]

        async def main():
            return await asyncio.gather(*(collect(r) for r, _ in jobs))

        ids = asyncio.run(main())
        assert all(engine.parts.bank.num_leases(s) == 0 for s in range(engine.parts.bank.num_slots))
        return {r.request_id: (i, torch.stack(logits[r.request_id])) for (r, _), i in zip(jobs, ids)}
    finally:
        engine.shutdown()


def compare(model_dir: Path, root: Path, backend: str) -> dict:
    """Per request: greedy ids equal PEFT's, max |logit difference|, and whether the adapter changed ids."""
    refs, got = peft_references(model_dir, root), run_engine(model_dir, root, backend)
    report = {}
    for key, (ref_ids, ref_logits) in refs.items():
        ids, logits = got[key]
        base_ids = refs[f"base-{key.rsplit('-', 1)[1]}"][0]
        report[key] = {"ids_equal": ids == ref_ids, "max_logit_err": float((logits - ref_logits).abs().max()),
                       "differs_from_base": ref_ids != base_ids}
    return report


if __name__ == "__main__":
    print(json.dumps(compare(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])))
