"""M-RoPE: expansion positions and delta, reduction to RoPE for text, image rows vs a reference, chunking."""

import pytest
import torch
from decoder_testing import hf_greedy, run_requests
from transformers import LlamaForCausalLM

from services.decoder.config import DecoderConfig
from services.decoder.engine import start_engine
from services.decoder.types import GenerateInput, ImagePart, SamplingParams, TextPart

SECTION = (2, 3, 3)  # tiny model: head_dim 16 -> 8 rotary pairs
IMAGE_TOKEN = "<repo_name>"
NEW_TOKENS = 10


def _engine(model_dir, **overrides):
    options = dict(model_dir=str(model_dir), num_blocks=64, max_model_len=512, mrope_section=SECTION,
                   image_token=IMAGE_TOKEN)
    options.update(overrides)
    return start_engine(DecoderConfig(**options))


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = _engine(tiny_llama)
    yield engine
    engine.shutdown()


def _image(grid, seed=0):
    torch.manual_seed(seed)
    t, h, w = grid
    return ImagePart(torch.randn(t * h * w, 64) * 0.5, grid, SECTION, f"hash-{seed}")


def _image_request(prompt_parts, max_tokens=NEW_TOKENS):
    return GenerateInput(SamplingParams(max_tokens=max_tokens), prompt=tuple(prompt_parts))


def test_positions_and_delta_match_a_hand_computed_example(engine):
    tokenizer = engine.parts.tokenizer
    before, after = tokenizer("a b", add_special_tokens=False).input_ids, tokenizer(" c d e", add_special_tokens=False).input_ids
    assert (len(before), len(after)) == (2, 3)
    prompt = engine.parts.prompts.build(_image_request([TextPart("a b"), _image((1, 2, 3)), TextPart(" c d e")]))
    assert prompt.token_ids == before + [3] * 6 + after
    assert prompt.mrope_positions.tolist() == [
        [0, 1, 2, 2, 2, 2, 2, 2, 5, 6, 7],   # t
        [0, 1, 2, 2, 2, 3, 3, 3, 5, 6, 7],   # h
        [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7],   # w
    ]
    assert prompt.rope_delta == 8 - 11
    assert [(s.start, s.end) for s in prompt.image_spans] == [(2, 8)]


def test_text_only_requests_reduce_to_ordinary_rope(tiny_llama, engine):
    prompts = [[1, 5, 77, 300, 12], list(range(100, 140))]
    refs = [hf_greedy(tiny_llama, p, 24) for p in prompts]
    results = run_requests(engine, [GenerateInput(SamplingParams(max_tokens=24), prompt_token_ids=tuple(p))
                                    for p in prompts])
    assert [ids for ids, _, _ in results] == refs


def _mrope_cos_sin(positions, head_dim, theta, sections):
    """Float64 reference (the seed's formula): angles per axis, selected per pair, repeated per half."""
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    selected, start = [], 0
    for axis, count in enumerate(sections):
        selected.append(positions[axis, :, None].double() * inv[start:start + count])
        start += count
    angles = torch.cat(selected, -1)
    angles = torch.cat((angles, angles), -1)[None]  # [1, T, head_dim]
    return angles.cos(), angles.sin()


class _FixedRotary(torch.nn.Module):
    def __init__(self, cos, sin):
        super().__init__()
        self.cos, self.sin = cos, sin

    def forward(self, x, position_ids):
        return self.cos.to(x.dtype), self.sin.to(x.dtype)


def _reference_greedy(model_dir, prompt, num_new):
    """HF Llama in float64 with image rows as inputs_embeds and M-RoPE cos/sin; full recompute each token."""
    model = LlamaForCausalLM.from_pretrained(model_dir).double().eval()
    ids, positions = list(prompt.token_ids), prompt.mrope_positions.clone()
    out = []
    for _ in range(num_new):
        with torch.no_grad():
            embeds = model.model.embed_tokens(torch.tensor([ids]))
            for span in prompt.image_spans:
                embeds[0, span.start:span.end] = span.rows.double()
            model.model.rotary_emb = _FixedRotary(*_mrope_cos_sin(positions, 16, 10000.0, SECTION))
            logits = model(inputs_embeds=embeds, position_ids=torch.arange(len(ids))[None]).logits[0, -1]
        token = int(logits.argmax())
        out.append(token)
        next_position = len(ids) + prompt.rope_delta  # decode: physical position + rope delta
        ids.append(token)
        positions = torch.cat((positions, torch.full((3, 1), next_position)), dim=1)
    return out


def test_image_rows_and_decode_delta_match_reference(tiny_llama, engine):
    parts = [TextPart("Look at"), _image((1, 3, 4), seed=1), TextPart(" and"), _image((2, 2, 2), seed=2),
             TextPart(" describe.")]
    request = _image_request(parts)
    prompt = engine.parts.prompts.build(request)
    assert prompt.rope_delta < 0
    ref = _reference_greedy(tiny_llama, prompt, NEW_TOKENS)
    ids, _, last = run_requests(engine, [request])[0]
    assert ids == ref
    assert last.usage.image_tokens == 12 + 8 and last.usage.prompt_tokens == len(prompt.token_ids)

    other = _image_request([TextPart("Look at"), _image((1, 3, 4), seed=7), TextPart(" and"), _image((2, 2, 2), seed=2),
                            TextPart(" describe.")])
    assert run_requests(engine, [other])[0][0] != ids  # same placeholders, different image -> different output


def test_chunk_boundary_inside_an_image_matches_unchunked(tiny_llama, engine):
    request = _image_request([TextPart("Look at"), _image((1, 4, 4), seed=3), TextPart(" please")])
    unchunked = run_requests(engine, [request])[0][0]
    chunked_engine = _engine(tiny_llama, max_num_batched_tokens=5)  # boundaries at 5, 10, 15 cut the 16-row image
    try:
        assert run_requests(chunked_engine, [request])[0][0] == unchunked
    finally:
        chunked_engine.shutdown()


def test_image_refusals(engine):
    from services.common.errors import InvalidArgument

    def build(parts):
        return engine.parts.prompts.build(_image_request(parts))

    with pytest.raises(InvalidArgument, match="hidden size is 64"):
        build([ImagePart(torch.zeros(4, 32), (1, 2, 2), SECTION)])
    with pytest.raises(InvalidArgument, match="needs 4"):
        build([ImagePart(torch.zeros(5, 64), (1, 2, 2), SECTION)])
    with pytest.raises(InvalidArgument, match="differs from the decoder's"):
        build([ImagePart(torch.zeros(4, 64), (1, 2, 2), (4, 2, 2))])
    with pytest.raises(InvalidArgument, match="must not contain the image token"):
        build([TextPart(f"sneaky {IMAGE_TOKEN}")])
    # expansion happens before the context check: 1 placeholder part of 500 rows does not fit 512 - 20
    big = ImagePart(torch.zeros(500, 64), (1, 20, 25), SECTION)
    import asyncio

    async def submit():
        async for _ in engine.generate(_image_request([TextPart("x"), big], max_tokens=20)):
            pass
    with pytest.raises(InvalidArgument, match="prompt has 501 tokens and max_tokens 20; the model's context is 512"):
        asyncio.run(submit())
