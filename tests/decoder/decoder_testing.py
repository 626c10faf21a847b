"""Tiny random Llama / Qwen2 / Qwen3 checkpoints (with the SmolLM2 tokenizer) for fast conformance tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tessera.paths import default_decoder_dir

torch.set_num_threads(2)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")



# A Hermes-style template (the <tool_call> format of Hermes, Qwen2.5, SmolLM3), tools listed in the
# system turn, assistant calls and tool answers rendered.
HERMES_TEMPLATE = """
{%- if tools %}<|im_start|>system
You may call functions. Their signatures:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": <name>, "arguments": <object>}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- if message.content %}
{{ message.content }}{% endif %}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def make_tiny_llama(path: Path, seed: int = 0, family: str = "llama", **overrides) -> Path:
    """Save a random 2-layer model of `family` (a transformers model_type: hidden 64, 4 heads, 2 kv
    heads, head_dim 16 unless `overrides` say otherwise) with SmolLM2's tokenizer. Qwen2 has q/k/v
    bias, Qwen3 q/k norms (their configs' defaults)."""
    source = default_decoder_dir()
    path.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, path / name)
    options = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                   tie_word_embeddings=False, head_dim=16)
    options.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **options)).eval()
    # a larger init spread makes logits decisive, so greedy argmax has no near-ties
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim in (2, 3):  # matrices, and MoE experts stacked [experts, out, in]
                p.normal_(0, 0.15)
            elif p.ndim == 1 and p.abs().sum() == 0:  # biases: non-zero so that they matter
                p.normal_(0, 0.1)
            else:                                     # norm weights: away from 1 so that they matter
                p.uniform_(0.8, 1.2)
    model.save_pretrained(path)
    return path


@pytest.fixture(params=["torch", "cpu"])
def attention_backend(request) -> str:
    """Both CPU attention backends: the torch path, and the C kernel for decode rows (attention/cpu_backend.py)."""
    return request.param


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    """transformers' model of the tiny Llama (eval mode)."""
    return AutoModelForCausalLM.from_pretrained(tiny_llama).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    """The tiny Llama's tokenizer (SmolLM2's)."""
    return AutoTokenizer.from_pretrained(tiny_llama)


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' generate(do_sample=False) continuation ids (stops at EOS like the engine)."""
    return hf_reference(AutoModelForCausalLM.from_pretrained(model_dir).eval(), prompt_ids, max_new_tokens)[0]


def hf_reference(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """generate(do_sample=False) ids and the raw fp32 logits of each step [num_new, vocab]."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt_ids):].tolist(), torch.cat(out.logits).float()


def hf_reference_batch(model, prompts: list[list[int]], max_new_tokens: int,
                       eos_token_id: int = 2) -> list[tuple[list[int], torch.Tensor]]:
    """`hf_reference` for many prompts in one left-padded generate call (64 steps, not 64 per prompt);
    each continuation is cut after its first EOS, as the engine stops there."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), eos_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=eos_token_id, output_logits=True, return_dict_in_generate=True)
    logits = torch.stack(out.logits, dim=1).float()  # [batch, steps, vocab]
    refs = []
    for row in range(len(prompts)):
        new = out.sequences[row, width:].tolist()
        n = new.index(eos_token_id) + 1 if eos_token_id in new else len(new)
        refs.append((new[:n], logits[row, :n]))
    return refs


def capture_logits(engine) -> dict[str, list[torch.Tensor]]:
    """Record the engine's sampled fp32 logits rows per request id (one row per generated token)."""
    rows: dict[str, list[torch.Tensor]] = {}
    compute = engine.parts.runner.logits

    def recording(inputs, *args):
        logits, *rest = compute(inputs, *args)
        for item, row in zip(inputs.sampled, logits):
            rows.setdefault(item.request.request_id, []).append(row.clone())
        return logits, *rest

    engine.parts.runner.logits = recording
    return rows


def capture_prompt_logits(engine) -> dict[str, dict[int, torch.Tensor]]:
    """Record fp32 logits at every prompt position the engine computes, per request id.

    The engine only projects sampled rows to the vocabulary; this wraps the runner so each step's
    final hidden states are projected for every scheduled prompt row (chunks included), keyed by
    the row's absolute position.
    """
    found: dict[str, dict[int, torch.Tensor]] = {}
    runner = engine.parts.runner
    prepare, forward = runner.prepare, runner._forward
    step = {}

    def preparing(out):
        step["scheduled"] = out.scheduled
        return prepare(out)

    def forwarding(inputs):
        hidden = forward(inputs)
        row = 0
        for item in step["scheduled"]:
            request = item.request
            for offset in range(item.num_new_tokens):
                position = item.start + offset
                if position < request.num_prompt_tokens:
                    logits = runner.model.compute_logits(hidden[row + offset:row + offset + 1])[0]
                    found.setdefault(request.request_id, {})[position] = logits.float().clone()
            row += item.num_new_tokens
        return hidden

    runner.prepare, runner._forward = preparing, forwarding
    return found


async def _collect(engine, request):
    ids, text, last = [], "", None
    async for out in engine.generate(request):
        ids.extend(out.token_ids)
        text += out.text
        last = out
    return ids, text, last


def cancel_mid_stream(engine, victim, others, num_outputs: int = 3):
    """Run `others` while `victim` is cancelled after `num_outputs` outputs.

    Returns (blocks the victim held when cancelled, or None if it never left the running list
    within 2 s; (ids, text, final output) per other request).
    """
    import asyncio

    async def cancelled():
        stream = engine.generate(victim)
        for _ in range(num_outputs):
            await stream.__anext__()
        key = next(k for k, r in engine.core.requests.items() if r.request_id == victim.request_id)
        held = len(engine.parts.block_manager.block_table(key))
        await stream.aclose()
        for _ in range(400):
            if all(r.request_id != victim.request_id for r in engine.parts.scheduler.running):
                return held
            await asyncio.sleep(0.005)
        return None

    async def main():
        return await asyncio.gather(cancelled(), *(_collect(engine, r) for r in others))

    held, *results = asyncio.run(main())
    return held, results


def run_requests(engine, requests) -> list[tuple[list[int], str, object]]:
    """Submit all requests at once; returns (token ids, text, final output) per request."""
    import asyncio

    async def main():
        return await asyncio.gather(*(_collect(engine, r) for r in requests))

    return asyncio.run(main())


def check_greedy(engine, refs, requests, concurrent: bool = True,
                 rtol: float = 0.0) -> list[tuple[list[int], str, object]]:
    """Run `requests` (request_id "r{i}"; all at once, or one after another): each request's ids and
    fp32 logits (1e-4, plus `rtol` times the step's largest |logit|) must equal
    `refs[tuple(prompt_token_ids)]` = (ids, logits) from transformers."""
    logits = capture_logits(engine)
    if concurrent:
        results = run_requests(engine, requests)
    else:
        results = [run_requests(engine, [r])[0] for r in requests]
    for i, (request, (ids, _, _)) in enumerate(zip(requests, results)):
        prompt = request.prompt_token_ids
        ref_ids, ref_logits = refs[tuple(prompt)]
        assert ids == ref_ids, f"request {i} (prompt of {len(prompt)} tokens)"
        ours = torch.stack(logits[request.request_id])
        if rtol:
            bound = 1e-4 + rtol * ref_logits.abs().amax(-1, keepdim=True)  # [steps, 1]
            worst = float(((ours - ref_logits).abs() - bound).amax())
            assert ours.shape == ref_logits.shape and worst <= 0, f"request {i}: logits past the bound by {worst}"
        else:
            torch.testing.assert_close(ours, ref_logits, atol=1e-4, rtol=0)
    return results


async def with_decoder_server(config, body):
    """Serve a DecoderServicer for `config` on a free local port; returns `await body(stub, servicer)`."""
    from services.common.server import create_server, insecure_channel
    from services.decoder.engine import LLMEngine
    from services.decoder.servicer import DecoderServicer
    from tessera.v1 import decoder_pb2_grpc

    servicer = DecoderServicer(LLMEngine(config))
    server = create_server()
    decoder_pb2_grpc.add_DecoderServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.engine.start()
    try:
        async with insecure_channel(f"127.0.0.1:{port}") as channel:
            return await body(decoder_pb2_grpc.DecoderStub(channel), servicer)
    finally:
        await server.stop(0)
        await servicer.engine.stop()
