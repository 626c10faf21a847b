"""Tiny random Llama checkpoints (with the SmolLM2 tokenizer) for fast conformance tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.common.paths import default_decoder_dir

torch.set_num_threads(2)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_tiny_llama(path: Path, seed: int = 0, **overrides) -> Path:
    """Save a random 2-layer Llama (hidden 64, 4 heads, 2 kv heads) with SmolLM2's tokenizer."""
    source = default_decoder_dir()
    path.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, path / name)
    options = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                   tie_word_embeddings=False)
    options.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**options)).eval()
    # a larger init spread makes logits decisive, so greedy argmax has no near-ties
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' generate(do_sample=False) continuation ids (stops at EOS like the engine)."""
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


async def _collect(engine, request):
    ids, text, last = [], "", None
    async for out in engine.generate(request):
        ids.extend(out.token_ids)
        text += out.text
        last = out
    return ids, text, last


def run_requests(engine, requests) -> list[tuple[list[int], str, object]]:
    """Submit all requests at once; returns (token ids, text, final output) per request."""
    import asyncio

    async def main():
        return await asyncio.gather(*(_collect(engine, r) for r in requests))

    return asyncio.run(main())
