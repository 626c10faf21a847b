"""Mistral (sliding-window attention on every layer) against transformers 5.

Tiny 2-layer Mistral checkpoints, head_dim 64 and 128, sliding_window 24: prompts of 40-100 tokens
and 64 new tokens cross the window many times over (transformers' own output changes when the
window is removed, so a backend ignoring it fails). Greedy ids equal transformers' generate and
fp32 logits agree within 1e-4 in every regime of family_conformance (alone, concurrent, chunked,
prefix hit, preemption), with the torch and the cpu attention backends; a PEFT LoRA on Mistral
equals PEFT. A bad `sliding_window` is refused, and Llama keeps refusing sliding-window layers.

Blocks wholly before the window are released (block manager and scheduler on tiny pools, exact
block ids; an engine decoding a long request): every block comes back, a released
cached block is still a prefix hit (the prefix regime above hits blocks released while the first
request ran), and a model with a global layer releases nothing.
"""

import json

import pytest
from decoder_testing import check_greedy, make_tiny_llama
from family_conformance import NEW_TOKENS, PROMPTS, REGIMES, check_lora, check_regime, references
from test_scheduler import _request, _step

from services.decoder.block_manager import PLACEHOLDER_BLOCK, BlockManager
from services.decoder.config import DecoderConfig
from services.decoder.engine import start_engine
from services.decoder.model_mistral import MistralForCausalLM, MistralSpec
from services.decoder.models import family_class, model_sliding_window
from services.decoder.scheduler import Scheduler
from services.decoder.types import GenerateInput, SamplingParams

WINDOW = 24


@pytest.fixture(scope="module", params=[64, 128], ids=lambda d: f"head_dim{d}")
def mistral(request, tmp_path_factory):
    """(model_dir, transformers' references) of a tiny Mistral of head_dim `param`."""
    path = make_tiny_llama(tmp_path_factory.mktemp(f"mistral-{request.param}"), seed=3, family="mistral",
                           head_dim=request.param, sliding_window=WINDOW)
    return path, references(path)


@pytest.mark.parametrize("regime", REGIMES)
def test_mistral_equals_transformers(mistral, regime, attention_backend):
    model_dir, refs = mistral
    if regime == "preempt":
        check_preempted_after_release(model_dir, refs, attention_backend)
    else:
        check_regime(model_dir, refs, regime, attention_backend=attention_backend)


def check_preempted_after_release(model_dir, refs, attention_backend):
    """The preempt regime for a model whose blocks are released: family_conformance's small pool no
    longer runs out (whether a pool does depends on when requests arrive), so every request is
    preempted (recompute) in the first step after it released blocks; greedy ids and logits still
    equal transformers', and every block comes back."""
    engine = start_engine(DecoderConfig(model_dir=str(model_dir), num_blocks=80, block_size=8, max_model_len=256,
                                        max_num_seqs=8, attention_backend=attention_backend))
    scheduler, bm = engine.parts.scheduler, engine.parts.block_manager
    preempted, schedule = [], scheduler.schedule

    def schedule_preempting():
        victims = [r for r in scheduler.running if bm.num_released(r.key) and r.request_id not in preempted]
        for request in victims:
            scheduler.running.remove(request)
            scheduler._preempt(request)
            preempted.append(request.request_id)
        out = schedule()
        out.preempted.extend(victims)
        return out

    scheduler.schedule = schedule_preempting
    try:
        check_greedy(engine, refs, [GenerateInput(SamplingParams(max_tokens=NEW_TOKENS), request_id=f"r{i}",
                                                  prompt_token_ids=tuple(p)) for i, p in enumerate(PROMPTS)])
        assert engine.stats().num_free_blocks == 80
    finally:
        engine.shutdown()
    assert len(preempted) == len(PROMPTS), preempted  # each request outgrows its window


@pytest.fixture(scope="module")
def small_mistral(tmp_path_factory):
    """A tiny Mistral of head_dim 16 (make_tiny_llama's default) and its config.json."""
    path = make_tiny_llama(tmp_path_factory.mktemp("mistral-16"), seed=5, family="mistral", sliding_window=WINDOW)
    return path, json.loads((path / "config.json").read_text())


def test_mistral_lora_equals_peft(small_mistral):
    check_lora(small_mistral[0], "all-linear")


def test_every_mistral_layer_carries_the_window(small_mistral):
    cfg = small_mistral[1]
    assert family_class("mistral") is MistralForCausalLM
    spec = MistralForCausalLM.spec_from_config(cfg)
    assert spec.sliding_window == WINDOW and spec.head_dim == 16
    model = MistralForCausalLM(spec)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [WINDOW, WINDOW]
    assert MistralSpec.from_config({**cfg, "sliding_window": None}).sliding_window is None


@pytest.mark.parametrize("window", [0, -4, 2.5, True, "24"])
def test_a_bad_window_is_refused(small_mistral, window):
    cfg = small_mistral[1]
    with pytest.raises(ValueError, match="sliding_window must be a positive integer or null"):
        MistralSpec.from_config({**cfg, "sliding_window": window})


def test_llama_still_refuses_sliding_window_layers(small_mistral):
    cfg = {**small_mistral[1], "model_type": "llama", "layer_types": ["sliding_attention", "full_attention"]}
    with pytest.raises(ValueError, match="sliding-window attention layers are not supported"):
        family_class("llama").spec_from_config(cfg)


def test_released_blocks_go_back_and_cached_ones_stay_hits():
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.allocate("a", 12) == [0, 1, 2]
    bm.cache_blocks("a", [b"h0", b"h1"], 12)  # blocks 0 and 1 registered, 2 private
    assert bm.release_before("a", 2) == [0, 1] and bm.release_before("a", 2) == []
    assert bm.block_table("a") == [PLACEHOLDER_BLOCK, PLACEHOLDER_BLOCK, 2] and bm.num_held_blocks("a") == 1
    assert bm.num_free_blocks == 5 and bm.free_block_ids() == [3, 4, 5, 1, 0]  # cached: evictable, not free
    assert bm.cached_prefix([b"h0", b"h1"]) == [0, 1]  # still offered as a hit
    assert bm.allocate("b", 9, cached_blocks=[0, 1]) == [3]  # revived by reference, one fresh block
    assert bm.allocate("a", 16) == [4]
    assert bm.free("a") == [2, 4] and bm.free("b") == [0, 1, 3]
    assert bm.num_free_blocks == 6 and sorted(bm.free_block_ids()) == list(range(6))


def test_a_windowed_request_outgrows_the_pool_and_returns_every_block():
    """Window 6, blocks of 4, a pool of 4 blocks: the request grows to 30 tokens (8 blocks) holding at
    most 3, the blocks before the window of its next position released each step."""
    bm = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8, max_waiting=8, sliding_window=6)
    a = _request("a", 10)
    scheduler.add(a)
    _step(scheduler)  # positions 0..7
    _step(scheduler)  # 8..9, first sample
    assert bm.block_table("a") == [0, 1, 2] and bm.num_released("a") == 0
    _step(scheduler)  # position 10 attends 5..10: block 0 (0..3) released
    assert bm.block_table("a") == [PLACEHOLDER_BLOCK, 1, 2] and bm.free_block_ids() == [3, 0]
    held = []
    while a.num_tokens < 30:
        out = _step(scheduler)
        assert not out.preempted
        held.append(bm.num_held_blocks("a"))
    assert len(bm.block_table("a")) == 8 and max(held) <= 3 and bm.num_released("a") >= 5
    scheduler.finish(a, "length")  # cancellation or the end: every block back, none twice
    assert bm.num_free_blocks == 4 and sorted(bm.free_block_ids()) == [0, 1, 2, 3]


def test_no_window_no_release():
    bm = BlockManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8, max_waiting=8)
    a = _request("a", 10)
    scheduler.add(a)
    for _ in range(6):
        _step(scheduler)
    assert bm.block_table("a") == [0, 1, 2, 3] and bm.num_released("a") == 0


def test_only_a_model_windowed_on_every_layer_releases_blocks(small_mistral):
    spec = MistralForCausalLM.spec_from_config(small_mistral[1])
    model = MistralForCausalLM(spec)
    assert model_sliding_window(model) == WINDOW
    model.model.layers[1].self_attn.sliding_window = None  # a global layer: nothing may be released
    assert model_sliding_window(model) is None
    assert model_sliding_window(family_class("llama")(spec)) is None


def test_a_long_request_holds_only_its_window(mistral):
    """100 prompt tokens + 64 new need 21 blocks of 8; while decoding the request holds at most the
    blocks its window of 24 touches (4), its output equals transformers', and every block comes back."""
    model_dir, refs = mistral
    prompt = max(PROMPTS, key=len)
    engine = start_engine(DecoderConfig(model_dir=str(model_dir), num_blocks=21, block_size=8, max_model_len=256,
                                        attention_backend="cpu"))
    scheduler, bm = engine.parts.scheduler, engine.parts.block_manager
    held, update = [], scheduler.update
    scheduler.update = lambda out: (update(out), held.extend(bm.num_held_blocks(s.request.key) for s in out.scheduled))
    try:
        assert scheduler.sliding_window == WINDOW
        check_greedy(engine, refs, [GenerateInput(SamplingParams(max_tokens=NEW_TOKENS), request_id="long",
                                                  prompt_token_ids=tuple(prompt))], concurrent=False)
        assert engine.stats().num_free_blocks == 21
    finally:
        engine.shutdown()
    assert bm.blocks_for(len(prompt) + NEW_TOKENS) == 21
    assert held[0] == 13 and max(held[1:]) <= -(-WINDOW // 8) + 1  # the prefill's 13, then at most 4


# Qwen2 / Qwen3 with use_sliding_window: (family, max_window_layers) -> the windows of the 2 layers
QWEN_WINDOWS = {("qwen2", 1): (None, WINDOW), ("qwen3", 0): (WINDOW, WINDOW)}


@pytest.fixture(scope="module", params=list(QWEN_WINDOWS), ids=lambda p: f"{p[0]}-max_window_layers{p[1]}")
def qwen_windowed(request, tmp_path_factory):
    family, max_window_layers = request.param
    path = make_tiny_llama(tmp_path_factory.mktemp(family), seed=4, family=family, use_sliding_window=True,
                           sliding_window=WINDOW, max_window_layers=max_window_layers)
    return path, references(path), QWEN_WINDOWS[request.param]


@pytest.mark.parametrize("regime", ["alone", "chunked", "prefix"])
def test_qwen_sliding_window_layers_equal_transformers(qwen_windowed, regime):
    """Qwen2 windows layer 1 only (a global layer: nothing released), Qwen3 both (released)."""
    model_dir, refs, windows = qwen_windowed
    check_regime(model_dir, refs, regime, attention_backend="cpu")
    cfg = json.loads((model_dir / "config.json").read_text())
    model = family_class(cfg["model_type"])(family_class(cfg["model_type"]).spec_from_config(cfg))
    assert tuple(layer.self_attn.sliding_window for layer in model.model.layers) == windows
    assert model_sliding_window(model) == (WINDOW if None not in windows else None)
