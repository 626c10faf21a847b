"""Qwen2.5-VL decoder conformance with transformers 5.24 on a tiny seeded checkpoint.

Qwen2.5-VL's language model is Qwen2-VL's (Qwen2 with M-RoPE; images placed by the same
`get_rope_index` rule), so the decoder serves it through model_qwen2_vl; these tests hold that
claim against transformers' `Qwen2_5_VLModel.get_rope_index` and
`Qwen2_5_VLForConditionalGeneration.generate`, with rows from the vision service's Qwen2.5-VL tower
(window attention) run in process. Image sizes are chosen so that merged grids (3 x 4, 5 x 2) are
not multiples of the tower's 2 x 2 windows.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from services.common.checkpoint import check_decoder_dir
from services.common.errors import InvalidArgument
from services.decoder.models import load_model
from services.vision.config import VisionConfig
from services.vision.core import VisionCore
from services.vision.qwen2_vl_encoder import Qwen2VLEncoderConfig
from tessera.cli.topology import pick_encoder
from tests.decoder.test_qwen2_vl import IMAGE_A, IMAGE_B, NEW_TOKENS, TALL, _check, _engine, _ours
from tests.vision.qwen2_5_vl_tiny import build_tiny_qwen2_5_vl
from tests.vision.qwen2_vl_tiny import MROPE_SECTION, hf_greedy, hf_inputs, reference_processor

ONE = ["Describe ", IMAGE_A, " briefly."]
TWO = [IMAGE_A, " versus ", TALL, " which?"]
TEXT = ["Just text, no picture."]
B = ["Describe ", IMAGE_B, " briefly."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2-5-vl-decoder")
    model = build_tiny_qwen2_5_vl(directory)
    vision = VisionCore(VisionConfig.for_qwen2_vl(Qwen2VLEncoderConfig(model_dir=str(directory))))
    return directory, model, vision, (AutoTokenizer.from_pretrained(directory), reference_processor())


@pytest.fixture(scope="module")
def refs(tiny):
    """transformers' greedy ids, fp32 logits and inputs per prompt."""
    _, model, _, processor = tiny
    out = {}
    for name, content in (("one", ONE), ("two", TWO), ("text", TEXT), ("b", B)):
        batch = hf_inputs(*processor, content)
        out[name] = (*hf_greedy(model, batch, NEW_TOKENS), batch)
    return out


@pytest.fixture(scope="module")
def engine(tiny):
    engine = _engine(tiny[0])
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("name", ["one", "two", "text"])
def test_ids_and_positions_equal_processor_and_get_rope_index(tiny, engine, refs, name):
    _, model, vision, _ = tiny
    batch = refs[name][2]
    prompt = engine.parts.prompts.build(_ours(vision, {"one": ONE, "two": TWO, "text": TEXT}[name], "p"))
    assert prompt.token_ids == batch["input_ids"][0].tolist()
    want, delta = model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"],
                                             batch.get("image_grid_thw"))
    assert torch.equal(prompt.mrope_positions, want[:, 0])
    assert prompt.rope_delta == int(delta[0, 0])


def test_greedy_and_logits_one_and_two_images_batched_with_text(tiny, engine, refs):
    _, _, vision, _ = tiny
    requests = [_ours(vision, ONE, "one"), _ours(vision, TWO, "two"), _ours(vision, TEXT, "text")]
    _check(engine, requests, [refs["one"], refs["two"], refs["text"]], admit_together=True)  # one batch


def test_chunked_prefix_hit_and_preemption(tiny, refs):
    """One small engine: chunks of 5 rows cut through the 12-row image; the same image again hits
    the prefix cache past its end, a different one of the same size does not; three requests at once
    overflow the 40-block pool (160 tokens; they need ~3 x 120) and are preempted (recompute)."""
    directory, _, vision, _ = tiny
    engine = _engine(directory, max_num_batched_tokens=5, num_blocks=40, block_size=4)
    preempted = []
    preempt = engine.parts.scheduler._preempt
    engine.parts.scheduler._preempt = lambda r: (preempted.append(r.request_id), preempt(r))
    try:
        span = engine.parts.prompts.build(_ours(vision, ONE, "x")).image_spans[0]
        assert span.end - span.start == 12 and span.start % 5 != 0
        first = _check(engine, [_ours(vision, ONE, "one")], [refs["one"]])[0]
        other = _check(engine, [_ours(vision, B, "b")], [refs["b"]])[0]
        again = _check(engine, [_ours(vision, ONE, "one")], [refs["one"]])[0]
        assert not preempted
        requests = [_ours(vision, ONE, "one"), _ours(vision, TWO, "two"), _ours(vision, B, "b")]
        _check(engine, requests, [refs["one"], refs["two"], refs["b"]], admit_together=True)
        assert engine.stats().num_free_blocks == 40
    finally:
        engine.shutdown()
    assert first[2].usage.cached_prompt_tokens == 0
    assert other[2].usage.cached_prompt_tokens <= span.start // 4 * 4  # B never reuses A's image blocks
    assert again[2].usage.cached_prompt_tokens >= span.end  # A reuses its own image blocks
    assert preempted, "the pool was meant to force preemption"
    assert refs["b"][0] != refs["one"][0]


def test_head_dim_128_with_the_released_sections(tmp_path):
    """Qwen2.5-VL-7B's text geometry in small: head_dim 128, M-RoPE sections (16, 24, 24); images and
    text in one batch equal transformers."""
    rope = {"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1000000.0}
    model = build_tiny_qwen2_5_vl(tmp_path, seed=1, text=dict(hidden_size=256, num_attention_heads=2,
                                                               num_key_value_heads=1, rope_parameters=rope))
    vision = VisionCore(VisionConfig.for_qwen2_vl(Qwen2VLEncoderConfig(model_dir=str(tmp_path))))
    assert vision.config.mrope_section == (16, 24, 24)
    processor = (AutoTokenizer.from_pretrained(tmp_path), reference_processor())
    contents = {"one": ONE, "two": TWO, "text": TEXT}
    refs = [(*hf_greedy(model, batch := hf_inputs(*processor, c), NEW_TOKENS), batch) for c in contents.values()]
    engine = _engine(tmp_path)
    try:
        assert engine.parts.model.spec.head_dim == 128
        _check(engine, [_ours(vision, c, name) for name, c in contents.items()], refs, admit_together=True)
    finally:
        engine.shutdown()


def test_checkpoint_check_loader_and_up_take_qwen2_5_vl(tiny, tmp_path):
    """check_decoder_dir serves it with plain-RoPE M-RoPE only; the loader keeps its architecture and
    sections; `tessera up` pairs it with its own vision tower."""
    directory, _, _, _ = tiny
    checkpoint = check_decoder_dir(directory)
    assert pick_encoder(checkpoint) == ("qwen2-vl", "")
    model = load_model(checkpoint, torch.float32)
    assert model.spec.architecture == "Qwen2_5_VLForConditionalGeneration"
    assert model.rotary.mrope_section == tuple(MROPE_SECTION) and model.spec.qkv_bias and not model.spec.o_bias
    config = json.loads((directory / "config.json").read_text())
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).symlink_to(directory / name)
    # Qwen2.5-VL-7B-Instruct's own config.json: flat, rope_scaling {type: mrope}, a sliding_window it does not use
    text = {k: v for k, v in config["text_config"].items() if k not in ("rope_parameters", "layer_types")}
    release = {**{k: v for k, v in config.items() if k != "text_config"}, **text, "model_type": "qwen2_5_vl",
               "rope_theta": 10000.0, "rope_scaling": {"type": "mrope", "mrope_section": MROPE_SECTION},
               "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 28}
    (tmp_path / "config.json").write_text(json.dumps(release))
    released = load_model(check_decoder_dir(tmp_path), torch.float32)
    assert released.spec == model.spec
    assert all(torch.equal(value, released.state_dict()[name]) for name, value in model.state_dict().items())
    config["text_config"]["rope_parameters"].update(rope_type="linear", factor=2.0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidArgument, match="RoPE scaling 'linear' is not supported"):
        check_decoder_dir(tmp_path)
