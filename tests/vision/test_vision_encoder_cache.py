"""Encoder cache: a repeated image skips decoding and the encoder; bounded by bytes; keyed by content hash."""

from __future__ import annotations

import pytest
import torch
from vision_images import solid

from services.vision.config import VisionConfig
from services.vision.core import VisionCore
from services.vision.encoder import DemoEncoderConfig, EncoderOutput
from services.vision.encoder_cache import EncoderCache
from services.vision.processor import ImageSource

WIDTH = 32
ROW_BYTES = 64 * WIDTH * 4  # one demo image: 64 rows of WIDTH float32


def _engine(cache_bytes: int) -> VisionCore:
    return VisionCore(VisionConfig(encoder=DemoEncoderConfig(output_width=WIDTH), encoder_cache_bytes=cache_bytes))


def _encode(engine: VisionCore, *images: bytes):
    return engine.encode(engine.process([ImageSource(data=d) for d in images]))


RED, BLUE, GREEN = solid((255, 0, 0)), solid((0, 0, 255)), solid((0, 255, 0))


def test_repeated_image_skips_the_encoder():
    engine = _engine(10 * ROW_BYTES)
    (first,) = _encode(engine, RED)
    (second,) = _encode(engine, RED)
    assert engine.images_encoded == 1
    assert torch.equal(first.rows, second.rows) and first.content_hash == second.content_hash
    stats = engine.cache.stats()
    assert (stats.hits, stats.misses, stats.entries, stats.bytes) == (1, 1, 1, ROW_BYTES)
    # A, B, A: only A is reused; B is encoded
    a, b, a_again = (_encode(engine, d)[0] for d in (RED, BLUE, RED))
    assert engine.images_encoded == 2 and engine.cache.stats().hits == 3
    assert torch.equal(a.rows, a_again.rows) and not torch.allclose(a.rows, b.rows, atol=1e-3)
    info = engine.info()
    assert (info.images_encoded, info.cache.hits, info.cache.entries) == (2, 3, 2)


def test_duplicates_in_one_request_are_encoded_once():
    engine = _engine(10 * ROW_BYTES)
    a, b, c = _encode(engine, GREEN, BLUE, GREEN)
    assert engine.images_encoded == 2
    assert torch.equal(a.rows, c.rows) and a.content_hash == c.content_hash != b.content_hash


def test_bounded_by_bytes_with_lru_eviction():
    engine = _engine(2 * ROW_BYTES)  # room for two images
    _encode(engine, RED)
    _encode(engine, BLUE)
    _encode(engine, RED)  # hit: RED becomes most recently used
    _encode(engine, GREEN)  # evicts BLUE, the least recently used
    assert engine.images_encoded == 3
    stats = engine.cache.stats()
    assert (stats.entries, stats.bytes, stats.evictions) == (2, 2 * ROW_BYTES, 1)
    _encode(engine, RED)
    assert engine.images_encoded == 3  # RED survived
    _encode(engine, BLUE)
    assert engine.images_encoded == 4  # BLUE was evicted and re-encoded
    assert engine.cache.stats().bytes <= 2 * ROW_BYTES


def test_zero_capacity_disables_and_oversized_entries_are_not_stored():
    engine = _engine(0)
    _encode(engine, RED)
    _encode(engine, RED)
    assert engine.images_encoded == 2 and engine.cache.stats().entries == 0
    cache = EncoderCache(capacity_bytes=100)
    big = EncoderOutput(rows=torch.zeros(10, 10), grid_thw=(1, 1, 10))  # 400 bytes
    assert not cache.put("k", big) and cache.get("k") is None
    small = EncoderOutput(rows=torch.zeros(5, 5), grid_thw=(1, 1, 5))  # 100 bytes
    assert cache.put("k", small) and cache.put("k", small) and cache.stats().bytes == 100  # replace, not add
    with pytest.raises(ValueError, match="capacity_bytes must be >= 0"):
        EncoderCache(-1)


def test_key_includes_encoder_revision():
    """Same bytes, other weights: no cross-talk even through one shared cache."""
    cache_owner = _engine(10 * ROW_BYTES)
    reseeded = VisionCore(VisionConfig(encoder=DemoEncoderConfig(output_width=WIDTH, seed=9)))
    reseeded.cache = cache_owner.cache  # share the cache; keys must still differ
    (a,) = _encode(cache_owner, RED)
    (b,) = _encode(reseeded, RED)
    assert reseeded.images_encoded == 1 and a.content_hash != b.content_hash
    assert not torch.allclose(a.rows, b.rows, atol=1e-3)
