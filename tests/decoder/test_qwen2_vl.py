"""Qwen2-VL decoder conformance with transformers 5.24 on a tiny seeded checkpoint.

References run in process: the checkpoint's chat template, transformers' PIL image processor
and Qwen2VLProcessor's expansion rule (`replace_image_token`: grid.prod() // merge_size**2 copies
of <|image_pad|>; the processor class itself needs torchvision for its video half, which is not
installed), `Qwen2VLModel.get_rope_index` and `Qwen2VLForConditionalGeneration.generate`
with pixel_values / image_grid_thw. Our side: rows from the vision engine in process, then the
decoder engine (chunked prefill, prefix cache, preemption as configured).
"""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
import torch
from decoder_testing import capture_logits, capture_prompt_logits, run_requests, with_decoder_server
from PIL import Image
from transformers import AutoTokenizer

from services.common.errors import InvalidArgument
from services.decoder.config import DecoderConfig
from services.decoder.engine import start_engine
from services.decoder.types import ChatMessage, GenerateInput, ImagePart, RawImagePart, SamplingParams, TextPart
from services.vision.config import VisionConfig
from services.vision.core import VisionCore
from services.vision.processor import ImageSource
from services.vision.qwen2_vl_encoder import Qwen2VLEncoderConfig
from tests.vision.qwen2_vl_tiny import MROPE_SECTION, build_tiny_qwen2_vl, hf_greedy, hf_inputs, reference_processor

NEW_TOKENS = 32
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2-vl-decoder")
    model = build_tiny_qwen2_vl(directory)
    vision = VisionCore(VisionConfig.for_qwen2_vl(Qwen2VLEncoderConfig(model_dir=str(directory))))
    return directory, model, vision, (AutoTokenizer.from_pretrained(directory), reference_processor())


def _engine(directory, **overrides):
    options = dict(model_dir=str(directory), num_blocks=64, block_size=8, max_model_len=512)
    options.update(overrides)
    return start_engine(DecoderConfig(**options))


@pytest.fixture(scope="module")
def engine(tiny):
    engine = _engine(tiny[0])
    yield engine
    engine.shutdown()


def _png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


# content items: bytes = an image, str = text
def _ours(vision, content, request_id, max_tokens=NEW_TOKENS) -> GenerateInput:
    images = [c for c in content if isinstance(c, bytes)]
    encoded = iter(vision.encode(vision.process([ImageSource(data=d) for d in images])) if images else [])
    parts = []
    for item in content:
        if isinstance(item, bytes):
            e = next(encoded)
            parts.append(ImagePart(e.rows, e.grid_thw, e.mrope_section, e.content_hash))
        else:
            parts.append(TextPart(item))
    return GenerateInput(SamplingParams(max_tokens=max_tokens), request_id=request_id,
                         messages=(ChatMessage("user", tuple(parts)),))


def _hf_batch(processor, content):
    return hf_inputs(*processor, content)


def _hf_reference(model, processor, content):
    """generate(do_sample=False) ids (cut after EOS) and per-step fp32 logits; also the batch."""
    batch = _hf_batch(processor, content)
    new, logits = hf_greedy(model, batch, NEW_TOKENS)
    return new, logits, batch


def _run_together(engine, requests):
    """Submit every request while the engine thread is held, so all are admitted in one schedule."""
    async def collect(request):
        ids, last = [], None
        async for out in engine.generate(request):
            ids.extend(out.token_ids)
            last = out
        return ids, "", last

    async def main():
        engine.core.lock.acquire()  # re-entrant: generate() takes it again on this thread
        try:
            tasks = [asyncio.create_task(collect(r)) for r in requests]
            while len(engine.core.requests) < len(requests):
                await asyncio.sleep(0.001)
        finally:
            engine.core.lock.release()
        return await asyncio.gather(*tasks)

    return asyncio.run(main())


def _check(engine, requests, refs, admit_together=False):
    rows = capture_logits(engine)
    results = _run_together(engine, requests) if admit_together else run_requests(engine, requests)
    for request, (ids, _, _), (want_ids, want_logits, _) in zip(requests, results, refs):
        assert ids == want_ids, request.request_id
        got = torch.stack(rows[request.request_id])
        assert got.shape == want_logits.shape
        torch.testing.assert_close(got, want_logits, atol=TOL, rtol=0)
    return results


IMAGE_A, IMAGE_B = _png(112, 84, 1), _png(112, 84, 2)   # same size, different pixels: merged grid (1, 3, 4)
TALL = _png(60, 150, 3)
ONE = ["Describe ", IMAGE_A, " briefly."]
TWO = [IMAGE_A, " versus ", TALL, " which?"]
TEXT = ["Just text, no picture."]
# consecutive text parts: Qwen2-VL's template loops over the parts and puts them side by side (no
# "\n", unlike a template that takes the content as one string: test_tokenize.py)
PARTS = ["First part.", "Second part.", IMAGE_A, "Third.", "Fourth."]


@pytest.mark.parametrize("content", [ONE, TWO, TEXT, PARTS], ids=["one-image", "two-images", "text-only", "text-parts"])
def test_ids_and_positions_equal_processor_and_get_rope_index(tiny, engine, content):
    _, model, vision, processor = tiny
    batch = _hf_batch(processor, content)
    prompt = engine.parts.prompts.build(_ours(vision, content, "p"))
    assert prompt.token_ids == batch["input_ids"][0].tolist()
    want, delta = model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"],
                                             batch.get("image_grid_thw"))
    assert torch.equal(prompt.mrope_positions, want[:, 0])
    assert prompt.rope_delta == int(delta[0, 0])
    if content is TWO:
        assert prompt.rope_delta < 0 and len(prompt.image_spans) == 2


@pytest.mark.parametrize("content", [ONE, TWO, TEXT, PARTS], ids=["one-image", "two-images", "text-only", "text-parts"])
def test_text_tokens_counted_before_encoding_are_the_prompts_less_its_image_pads(tiny, engine, content):
    """What the gateway's context check asks before vision encodes anything (CountPromptTokens):
    the built prompt's tokens less the images' <|image_pad|> copies, its vision start/end tokens
    included, from a request whose images are not encoded (RawImagePart)."""
    _, _, vision, _ = tiny
    built = engine.parts.prompts.build(_ours(vision, content, "built"))
    raw = GenerateInput(SamplingParams(max_tokens=NEW_TOKENS), messages=(ChatMessage("user", tuple(
        RawImagePart() if isinstance(item, bytes) else TextPart(item) for item in content)),))
    count = asyncio.run(engine.count_prompt_tokens(raw))
    pads = sum(len(span.rows) for span in built.image_spans)
    assert count.num_text_tokens == len(built.token_ids) - pads
    assert count.num_images == len(built.image_spans) and count.max_model_len == 512


@pytest.fixture(scope="module")
def refs(tiny):
    _, model, _, processor = tiny
    return {name: _hf_reference(model, processor, content) for name, content in
            (("one", ONE), ("two", TWO), ("text", TEXT), ("b", ["Describe ", IMAGE_B, " briefly."]))}


def test_greedy_and_logits_one_and_two_images_batched_with_text(tiny, engine, refs):
    _, _, vision, _ = tiny
    requests = [_ours(vision, ONE, "one"), _ours(vision, TWO, "two"), _ours(vision, TEXT, "text")]
    _check(engine, requests, [refs["one"], refs["two"], refs["text"]], admit_together=True)  # one batch


def test_chunk_boundary_inside_the_image(tiny, refs):
    directory, _, vision, _ = tiny
    request = _ours(vision, ONE, "one")
    chunked = _engine(directory, max_num_batched_tokens=5)  # chunks of 5 rows: the 12-row image spans three
    try:
        span = chunked.parts.prompts.build(request).image_spans[0]
        assert span.end - span.start == 12 and span.start % 5 != 0
        _check(chunked, [request], [refs["one"]])
    finally:
        chunked.shutdown()


@pytest.mark.parametrize("budget", [512, 5], ids=["whole-prompt", "chunks-of-5"])
def test_prompt_logits_equal_transformers_forward(tiny, refs, budget):
    """Every prompt position's logits, including image rows and chunk boundaries inside the image."""
    directory, model, vision, _ = tiny
    engine = _engine(directory, max_num_batched_tokens=budget)
    try:
        prompt_rows = capture_prompt_logits(engine)
        run_requests(engine, [_ours(vision, TWO, "two", max_tokens=1)])
    finally:
        engine.shutdown()
    batch = refs["two"][2]
    with torch.no_grad():
        want = model(**batch).logits[0].float()  # [prompt_len, vocab]
    got = prompt_rows["two"]
    assert sorted(got) == list(range(want.shape[0]))
    torch.testing.assert_close(torch.stack([got[i] for i in sorted(got)]), want, atol=TOL, rtol=0)


def test_prefix_hits_only_for_the_same_image(tiny, refs):
    directory, _, vision, _ = tiny
    engine = _engine(directory, block_size=4)
    try:
        a, b = ["Describe ", IMAGE_A, " briefly."], ["Describe ", IMAGE_B, " briefly."]
        span = engine.parts.prompts.build(_ours(vision, a, "x")).image_spans[0]
        first = _check(engine, [_ours(vision, a, "one")], [refs["one"]])[0]
        second = _check(engine, [_ours(vision, b, "b")], [refs["b"]])[0]
        third = _check(engine, [_ours(vision, a, "one")], [refs["one"]])[0]
        # transposed grid, same rows and content hash: positions differ, so the key differs
        e = vision.encode(vision.process([ImageSource(data=IMAGE_A)]))[0]
        flipped = ImagePart(e.rows, (1, e.grid_thw[2], e.grid_thw[1]), e.mrope_section, e.content_hash)
        fourth = run_requests(engine, [GenerateInput(SamplingParams(max_tokens=NEW_TOKENS), request_id="flip",
                                                     messages=(ChatMessage("user", (TextPart("Describe "), flipped,
                                                                                    TextPart(" briefly."))),))])[0]
    finally:
        engine.shutdown()
    image_block = span.start // 4 * 4  # tokens before the image's first block may be shared
    assert first[2].usage.cached_prompt_tokens == 0
    assert second[2].usage.cached_prompt_tokens <= image_block     # B never reuses A's image blocks
    assert third[2].usage.cached_prompt_tokens >= span.end          # A reuses its own image blocks
    assert fourth[2].usage.cached_prompt_tokens <= image_block
    assert refs["b"][0] != refs["one"][0] and not torch.allclose(refs["b"][1][0], refs["one"][1][0])
    assert fourth[0] != first[0]


def test_preemption_and_recompute(tiny, refs):
    directory, _, vision, _ = tiny
    engine = _engine(directory, num_blocks=24, block_size=8)  # 3 requests of 121-130 tokens need ~48 blocks
    preempted = []
    original = engine.parts.scheduler._preempt
    engine.parts.scheduler._preempt = lambda r: (preempted.append(r.request_id), original(r))
    try:
        requests = [_ours(vision, ONE, "one"), _ours(vision, TWO, "two"), _ours(vision, ["Describe ", IMAGE_B, " briefly."], "b")]
        _check(engine, requests, [refs["one"], refs["two"], refs["b"]], admit_together=True)
        assert engine.stats().num_free_blocks == 24
    finally:
        engine.shutdown()
    assert preempted, "the pool was meant to force preemption"


def test_literal_placeholders_and_sections_are_refused(tiny, engine):
    directory, _, vision, _ = tiny
    for token in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"):
        with pytest.raises(InvalidArgument, match="must not contain"):
            engine.parts.prompts.build(_ours(vision, [f"look {token} here"], "x"))
    with pytest.raises(InvalidArgument, match="placeholder token 250"):
        engine.parts.prompts.build(GenerateInput(SamplingParams(max_tokens=1), prompt_token_ids=(5, 250, 6)))
    with pytest.raises(InvalidArgument, match="differs from the decoder's"):
        engine.parts.prompts.build(_ours(vision, ["x"], "x").__class__(
            SamplingParams(max_tokens=1), prompt=(ImagePart(torch.zeros(4, 64), (1, 2, 2), (4, 2, 2)),)))
    assert engine.config.mrope_section == tuple(MROPE_SECTION)
    with pytest.raises(ValueError, match="differs from the checkpoint's"):
        DecoderConfig(model_dir=str(directory), mrope_section=(4, 2, 2))


def test_loader_layouts_and_refusals(tiny, tmp_path):
    """The in-memory naming (model.language_model.*, model.visual.*) loads to the same weights as the
    saved original layout (model.*, visual.*); scaled RoPE and a differing section are refused."""
    import json
    import shutil

    from safetensors.torch import save_file

    from services.decoder.model_qwen2_vl import load_qwen2_vl
    from services.decoder.models import load_model

    directory, model, _, _ = tiny
    saved = load_model(directory, torch.float32)
    assert saved.rotary.mrope_section == tuple(MROPE_SECTION) and saved.spec.qkv_bias and not saved.spec.o_bias
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    shutil.copy(directory / "config.json", renamed / "config.json")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(renamed / "model.safetensors"))
    assert any(k.startswith("model.language_model.") for k in model.state_dict())
    loaded = load_qwen2_vl(renamed, torch.float32)
    for name, value in saved.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name]), name
    config = json.loads((directory / "config.json").read_text())
    flat = {**{k: v for k, v in config.items() if k != "text_config"}, **config["text_config"]}  # Qwen2-VL-2B style
    flat.pop("rope_parameters")
    flat.update(model_type="qwen2_vl", rope_theta=10000.0, rope_scaling={"type": "mrope", "mrope_section": MROPE_SECTION})
    (renamed / "config.json").write_text(json.dumps(flat))
    assert load_qwen2_vl(renamed, torch.float32).spec == loaded.spec
    config["text_config"]["rope_parameters"].update(rope_type="linear", factor=2.0)
    (renamed / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="scaled RoPE 'linear'"):
        load_qwen2_vl(renamed, torch.float32)
    with pytest.raises(ValueError, match="differs from the checkpoint's"):
        load_qwen2_vl(directory, torch.float32, (4, 2, 2))


def test_rope_scaling_beside_rope_parameters_is_read_as_transformers_reads_it(tiny, tmp_path):
    """Both fields present (a config saved by an older transformers, edited by hand): transformers 5
    takes the legacy rope_scaling; the decoder's sections and the vision encoder's must be the same."""
    import json

    from transformers import AutoConfig

    from services.decoder.model_qwen2_vl import mrope_section
    from services.vision.qwen2_vl_encoder import _mrope_section

    directory, _, _, _ = tiny
    config = json.loads((directory / "config.json").read_text())
    legacy = list(reversed(MROPE_SECTION))
    assert legacy != MROPE_SECTION
    config["text_config"]["rope_scaling"] = {"type": "mrope", "mrope_section": legacy}
    (tmp_path / "config.json").write_text(json.dumps(config))
    expected = tuple(AutoConfig.from_pretrained(tmp_path).text_config.rope_parameters["mrope_section"])
    assert expected == tuple(legacy)
    assert mrope_section(config) == _mrope_section(config) == expected


def test_decoder_service_serves_a_qwen2_vl_dir(tiny, refs):
    """--model-dir of a Qwen2-VL checkpoint just works over gRPC: sections from the checkpoint, an
    encoded image part in a chat message, the same greedy ids as transformers."""
    from services.common.tensor import to_pb
    from services.decoder.__main__ import parse_args
    from tessera.v1 import decoder_pb2, vision_pb2

    directory, _, vision, _ = tiny
    config = parse_args(["--address", "127.0.0.1:0", "--model-dir", str(directory), "--num-blocks", "64",
                         "--max-model-len", "512"])
    e = vision.encode(vision.process([ImageSource(data=IMAGE_A)]))[0]
    image = vision_pb2.EncodedImage(rows=to_pb(e.rows), grid_thw=list(e.grid_thw), mrope_section=list(e.mrope_section),
                                    content_hash=e.content_hash)
    content = [decoder_pb2.ContentPart(text="Describe "), decoder_pb2.ContentPart(encoded_image=image),
               decoder_pb2.ContentPart(text=" briefly.")]
    request = decoder_pb2.GenerateRequest(messages=[decoder_pb2.ChatMessage(role="user", content=content)],
                                          sampling=decoder_pb2.SamplingParams(max_tokens=NEW_TOKENS))

    async def body(stub, servicer):
        info = await stub.GetInfo(decoder_pb2.DecoderInfoRequest())
        return info, [t async for r in stub.Generate(request) for t in r.token_ids]

    info, ids = asyncio.run(with_decoder_server(config, body))
    assert list(info.mrope_section) == MROPE_SECTION and info.architecture == "Qwen2VLForConditionalGeneration"
    assert ids == refs["one"][0]
