"""The prepared SmolLM2-135M-Instruct checkpoint in every engine regime: greedy ids equal
transformers' generate for 64 tokens and fp32 logits agree within 1e-4 — alone, 16 concurrent
mixed-length requests, chunked prefill (16-token budget), a prefix-cache hit, recompute preemption,
and a request cancelled mid-stream, each with both CPU attention backends (the torch path and the C
decode kernel, attention_backend="cpu"). Also the chat template path (prompt ids and "Paris")."""


import pytest
import torch
from decoder_testing import cancel_mid_stream, check_greedy, run_requests
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.decoder.config import DecoderConfig
from services.decoder.engine import start_engine
from services.decoder.types import ChatMessage, GenerateInput, SamplingParams, TextPart
from tessera.paths import default_decoder_dir

NEW_TOKENS = 64
PAD = 2
LENGTHS = [1, 3, 5, 9, 16, 17, 20, 24, 31, 33, 40, 47, 50, 57, 64, 70]
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden screw press into a practical system. Within decades, "
    "printing shops had spread to more than two hundred cities across Europe. Books became cheaper, "
    "literacy rose, and ideas travelled faster than ever before. Scientists shared their results in print, "
    "merchants relied on printed price lists, and governments issued printed laws. Meanwhile, in the "
    "kitchen, a good bread needs only flour, water, salt and yeast, yet bakers argue endlessly about "
    "hydration, fermentation time and the temperature of the oven. Rivers shape valleys over millions "
    "of years; glaciers carve fjords; volcanoes build islands from the ocean floor. A simple Python "
    "function that adds two numbers is written as def add(a, b): return a + b, and it can be tested "
    "with a single assertion. The orchestra tuned their instruments while the conductor waited calmly."
)
MESSAGES = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "What is the capital of France?"}]


def _prompts(tokenizer):
    """16 distinct natural-text prompts of LENGTHS tokens (windows at different offsets), and one that
    shares the last prompt's first 40 tokens (2 full 16-token blocks) and then diverges."""
    ids = tokenizer(TEXT)["input_ids"]
    assert len(ids) >= 7 * 15 + 70
    prompts = [ids[7 * i:7 * i + n] for i, n in enumerate(LENGTHS)]
    return prompts, prompts[-1][:40] + ids[:12]


@pytest.fixture(scope="module")
def smollm():
    """(model dir, tokenizer, prompts, prefix prompt, {prompt tuple: (ref ids, ref logits [n, vocab])})."""
    model_dir = default_decoder_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts, prefix_prompt = _prompts(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    every = prompts + [prefix_prompt]
    refs = dict(zip(map(tuple, every), _hf_reference(model, every)))
    return model_dir, tokenizer, prompts, prefix_prompt, refs


def _hf_reference(model, prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    """One left-padded generate(do_sample=False) over all prompts, EOS not stopping (the engine runs
    with ignore_eos, so every prompt compares 64 tokens): [(ids, raw fp32 logits [64, vocab])]."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=PAD, output_logits=True, return_dict_in_generate=True)
    logits = torch.stack(out.logits, dim=1).float()  # [batch, 64, vocab]
    return [(out.sequences[row, width:].tolist(), logits[row]) for row in range(len(prompts))]


def _engine(model_dir, attention_backend="torch", **overrides):
    options = dict(model_dir=str(model_dir), num_blocks=160, max_model_len=512, max_num_seqs=16,
                   attention_backend=attention_backend)
    options.update(overrides)
    return start_engine(DecoderConfig(**options))


def _greedy(prompt, request_id, max_tokens=NEW_TOKENS):
    return GenerateInput(SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=request_id, prompt_token_ids=tuple(prompt))


def _check(engine, refs, prompts, concurrent=True):
    """Run `prompts` (all at once, or one after another); ids and logits must match transformers."""
    assert all(len(refs[tuple(p)][0]) == NEW_TOKENS for p in prompts)
    return check_greedy(engine, refs, [_greedy(p, f"r{i}") for i, p in enumerate(prompts)], concurrent)


def test_alone_and_chat_template(smollm, attention_backend):
    model_dir, tokenizer, prompts, _, refs = smollm
    engine = _engine(model_dir, attention_backend)
    try:
        _check(engine, refs, [prompts[0], prompts[-1]], concurrent=False)
        messages = tuple(ChatMessage(m["role"], (TextPart(m["content"]),)) for m in MESSAGES)
        chat_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]
        assert engine.parts.prompts.build(GenerateInput(SamplingParams(max_tokens=1), messages=messages)).token_ids == chat_ids
        _, text, _ = run_requests(engine, [GenerateInput(SamplingParams(max_tokens=8), messages=messages)])[0]
    finally:
        engine.shutdown()
    assert "Paris" in text


def test_sixteen_concurrent_mixed_lengths(smollm, attention_backend):
    model_dir, _, prompts, _, refs = smollm
    engine = _engine(model_dir, attention_backend)
    try:
        _check(engine, refs, prompts)
        assert engine.stats().num_free_blocks == 160
    finally:
        engine.shutdown()


@pytest.mark.parametrize("linear_backend", ["cpu", "torch"])
def test_each_linear_backend_with_chunked_prefill(smollm, linear_backend):
    """Both linear backends, whatever auto picks on this CPU: decode steps of 1..16 rows and prefill
    chunks of up to 40 rows (the C GEMM on packed weights for all, or MKL for all)."""
    model_dir, _, prompts, _, refs = smollm
    engine = _engine(model_dir, "cpu", linear_backend=linear_backend, max_num_batched_tokens=40)
    try:
        assert engine.config.linear_backend == linear_backend
        kernel = linear_backend == "cpu"  # every projection and the lm_head packed for the C GEMM
        assert (engine.parts.model.lm_head.gemm is not None) == kernel
        assert (engine.parts.model.model.layers[0].mlp.down_proj.gemm is not None) == kernel
        assert (engine.parts.model.model.layers[0].mlp.down_proj.weight.numel() == 0) == kernel  # released
        layer = engine.parts.model.model.layers[0]  # RMSNorm and rotary in the C kernels too
        assert all((m.pointwise is not None) == kernel for m in (layer.input_layernorm, layer.self_attn,
                                                                 engine.parts.model.model.norm))
        _check(engine, refs, prompts)
    finally:
        engine.shutdown()


def test_auto_torch_gemm_with_the_c_pointwise_kernels(smollm, monkeypatch):
    """Where auto picks torch's GEMM (MKL's AVX-512 on Intel, oneDNN's bf16 with AVX512-BF16 or AMX)
    the C RMSNorm, rotary and SiLU gate still run: weights stay row-major for torch, ids and logits
    equal transformers'."""
    from services.decoder import engine_parts

    monkeypatch.setattr(engine_parts, "resolve_linear_backend", lambda *args: "torch")  # as on such a CPU
    model_dir, _, prompts, _, refs = smollm
    engine = _engine(model_dir, "cpu", max_num_batched_tokens=40)
    try:
        assert engine.parts.backends.linear == "torch" and engine.parts.backends.pointwise
        layer = engine.parts.model.model.layers[0]
        assert layer.mlp.down_proj.gemm is None and layer.mlp.down_proj.weight.numel() > 0
        assert all(m.pointwise is not None for m in (layer.input_layernorm, layer.self_attn, layer.mlp,
                                                     engine.parts.model.model.norm))
        _check(engine, refs, prompts)
    finally:
        engine.shutdown()


def test_chunked_prefill_every_prompt_chunked(smollm, attention_backend):
    model_dir, _, prompts, _, refs = smollm
    engine = _engine(model_dir, attention_backend, max_num_batched_tokens=16)
    chunks = []
    schedule = engine.parts.scheduler.schedule
    engine.parts.scheduler.schedule = lambda: (out := schedule(), chunks.extend(
        s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1))[0]
    try:
        _check(engine, refs, prompts[-4:])  # prompts of 50..70 tokens: at least 4 chunks each
    finally:
        engine.shutdown()
    assert chunks and max(chunks) <= 16
    assert len(chunks) >= 4 * 4


def test_prefix_cache_hit(smollm, attention_backend):
    model_dir, _, prompts, prefix_prompt, refs = smollm
    engine = _engine(model_dir, attention_backend)
    try:
        first = _check(engine, refs, [prompts[-1]])[0]
        second = _check(engine, refs, [prefix_prompt])[0]
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert first[2].usage.cached_prompt_tokens == 0
    assert second[2].usage.cached_prompt_tokens == 32  # two full 16-token blocks of the shared 40
    assert stats.prefix_cache_hits == 1 and stats.prefix_cache_hit_tokens == 32


def test_preemption_recompute(smollm, attention_backend):
    model_dir, _, prompts, _, refs = smollm
    # 16 blocks of 8 tokens (128 tokens) cannot hold 5 requests of 40..64 + 64 tokens at once
    engine = _engine(model_dir, attention_backend, num_blocks=16, block_size=8)
    preempted = []
    original = engine.parts.scheduler._preempt
    engine.parts.scheduler._preempt = lambda r: (preempted.append(r.request_id), original(r))
    try:
        _check(engine, refs, prompts[-6:-1])
        assert engine.stats().num_free_blocks == 16
    finally:
        engine.shutdown()
    assert preempted, "the pool was meant to force preemption"


def test_cancel_mid_stream_frees_blocks(smollm, attention_backend):
    model_dir, _, prompts, _, refs = smollm
    engine = _engine(model_dir, attention_backend)
    others = prompts[8:11]

    try:
        held, results = cancel_mid_stream(engine, _greedy(prompts[-1], "victim", max_tokens=400),
                                          [_greedy(p, f"o{i}") for i, p in enumerate(others)])
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert held and held >= 5   # 70-token prompt + 3 tokens in 16-token blocks
    assert [ids for ids, _, _ in results] == [refs[tuple(p)][0] for p in others]
    assert stats.num_free_blocks == 160 and stats.num_running == 0
