"""The prepared SmolLM2-135M-Instruct checkpoint: chat prompt ids and greedy ids equal transformers."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from decoder_testing import run_requests
from services.common.paths import default_decoder_dir
from services.decoder.config import DecoderConfig
from services.decoder.engine import LLMEngine
from services.decoder.inputs import ChatMessage, GenerateInput, SamplingParams, TextPart

MESSAGES = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "What is the capital of France?"}]


def test_chat_greedy_equals_transformers():
    model_dir = default_decoder_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ref_prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ref_prompt]), attention_mask=torch.ones(1, len(ref_prompt), dtype=torch.long),
                             max_new_tokens=32, do_sample=False)
    ref_ids = out[0, len(ref_prompt):].tolist()

    engine = LLMEngine(DecoderConfig(model_dir=str(model_dir), num_blocks=32, max_model_len=1024, max_num_seqs=4))
    try:
        messages = tuple(ChatMessage(m["role"], (TextPart(m["content"]),)) for m in MESSAGES)
        assert engine.prompts.build(GenerateInput(SamplingParams(max_tokens=1), messages=messages)).token_ids == ref_prompt
        ids, text, last = run_requests(engine, [GenerateInput(SamplingParams(max_tokens=32), messages=messages)])[0]
        # the same chat again hits the prefix cache (all full blocks but the last token's) and still conforms
        hit_ids, _, hit_last = run_requests(engine, [GenerateInput(SamplingParams(max_tokens=32), messages=messages)])[0]
        hits = engine.stats().prefix_cache_hits
    finally:
        engine.shutdown()
    assert ids == ref_ids
    assert text == tokenizer.decode(ref_ids, skip_special_tokens=True)
    assert "Paris" in text
    assert last.usage.prompt_tokens == len(ref_prompt) and last.usage.completion_tokens == len(ref_ids)
    assert hit_ids == ref_ids and hits == 1
    assert last.usage.cached_prompt_tokens == 0
    assert hit_last.usage.cached_prompt_tokens == (len(ref_prompt) - 1) // 16 * 16 > 0
