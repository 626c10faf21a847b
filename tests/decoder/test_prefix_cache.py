"""Prefix cache units: the exact hash encoding, salting by adapter and image, and the block pool's
reference counts, LRU evictable list and block ids on tiny pools."""

import hashlib
import struct

import torch

from services.decoder.block_manager import BlockManager
from services.decoder.prefix_cache import BlockHasher, hash_block, image_keys, rows_digest
from services.decoder.request import Request
from services.decoder.scheduler import Scheduler
from services.decoder.types import ImageSpan, PromptInputs, SamplingParams


def _expected_hash(parent, ids, extras=()):
    """The documented encoding, written out independently of the implementation."""
    data = (parent or bytes(32)) + struct.pack("<q", len(ids)) + b"".join(struct.pack("<q", i) for i in ids)
    for key in extras:
        data += struct.pack("<q", len(key.encode())) + key.encode()
    return hashlib.sha256(data).digest()


def test_hash_chain_encoding_is_exact():
    h0 = hash_block(None, [1, 2, 3, 4])
    assert h0 == _expected_hash(None, [1, 2, 3, 4])
    assert h0.hex() == hashlib.sha256(bytes(32) + struct.pack("<5q", 4, 1, 2, 3, 4)).hexdigest()
    h1 = hash_block(h0, [5, 6, 7, 8], ("lora:abc",))
    assert h1 == _expected_hash(h0, [5, 6, 7, 8], ("lora:abc",))
    assert h1 != hash_block(h0, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    hasher = BlockHasher(4)
    assert hasher.update(list(range(1, 11))) == [h0, hash_block(h0, [5, 6, 7, 8])]  # 10 tokens: 2 full blocks
    assert hasher.update(list(range(1, 13)))[2] == hash_block(hasher.hashes[1], [9, 10, 11, 12])


def test_adapter_digest_salts_every_block():
    plain, lora_a, lora_b = BlockHasher(4), BlockHasher(4, "digest-a"), BlockHasher(4, "digest-b")
    ids = list(range(8))
    assert lora_a.extra_keys(0) == lora_a.extra_keys(1) == ("lora:digest-a",)
    assert lora_a.update(ids)[0] == _expected_hash(None, ids[:4], ("lora:digest-a",))
    assert len({plain.update(ids)[0], lora_a.hashes[0], lora_b.update(ids)[0]}) == 3


def _image_prompt(rows_seed, content_hash, start=5, grid=(1, 2, 2)):
    torch.manual_seed(rows_seed)
    n = grid[0] * grid[1] * grid[2]
    ids = list(range(100, 100 + start)) + [3] * n + [7, 8, 9, 10, 11, 12, 13]
    positions = torch.arange(len(ids)).expand(3, -1).clone()
    positions[1, start:start + n] += torch.tensor([0, 0, 1, 1])
    return PromptInputs(ids, [ImageSpan(start, torch.randn(n, 8), content_hash)], positions, -1)


def test_image_salts_from_its_first_block_on_and_never_before():
    section = (1, 1, 2)
    a = BlockHasher.for_prompt(4, _image_prompt(0, "img-a"), None, section)
    b = BlockHasher.for_prompt(4, _image_prompt(0, "img-b"), None, section)   # same rows, other content hash
    ids = _image_prompt(0, "img-a").token_ids  # 16 tokens; image at positions 5..8 -> blocks 1 and 2
    ha, hb = a.update(ids), b.update(ids)
    assert ha[0] == hb[0] == hash_block(None, ids[:4])       # block 0: untouched by the image
    assert ha[1] != hb[1] and ha[2] != hb[2] and ha[3] != hb[3]
    prompt = _image_prompt(0, "img-a")
    key = image_keys(prompt)[0].key
    assert key.startswith(f"image:img-a:{rows_digest(prompt.image_spans[0].rows, ())}:5:9:")
    assert a.extra_keys(1) == (key, "mrope:1,1,2:-1")
    assert a.extra_keys(3) == ("mrope:1,1,2:-1",)            # after the image: delta and sections still salt
    # without a content hash the rows themselves key the image
    r0 = BlockHasher.for_prompt(4, _image_prompt(0, ""), None, section).update(ids)
    r1 = BlockHasher.for_prompt(4, _image_prompt(1, ""), None, section).update(ids)
    assert r0[0] == r1[0] and r0[1] != r1[1]
    # a content hash is a claim: other rows under the same hash key differently
    forged = BlockHasher.for_prompt(4, _image_prompt(1, "img-a"), None, section).update(ids)
    assert forged[0] == ha[0] and forged[1] != ha[1]


def test_rows_digest_covers_the_received_rows_and_grid():
    rows = torch.randn(4, 8)
    digest = rows_digest(rows, (1, 2, 2))
    expected = hashlib.sha256(struct.pack("<3q", 1, 2, 2) + rows.numpy().tobytes()).hexdigest()
    assert digest == expected
    assert rows_digest(rows * -3, (1, 2, 2)) != digest and rows_digest(rows, (1, 4, 1)) != digest
    assert rows_digest(rows.to(torch.bfloat16), (1, 2, 2)) == rows_digest(rows.to(torch.bfloat16).float(), (1, 2, 2))


def test_allocation_hits_refcounts_and_lru_eviction_order():
    bm = BlockManager(num_blocks=6, block_size=4)
    hashes = BlockHasher(4).update(list(range(12)))           # 3 full blocks
    assert bm.allocate("a", 12) == [0, 1, 2]
    bm.cache_blocks("a", hashes, 8)                            # only 2 blocks computed so far
    assert [bm.block_hash(b) for b in (0, 1, 2)] == [hashes[0], hashes[1], None]
    bm.cache_blocks("a", hashes, 12)
    assert bm.num_cached_blocks == 3 and bm.cached_prefix(hashes) == [0, 1, 2]

    assert bm.allocate("b", 10, cached_blocks=[0, 1]) == [3]  # shares 0, 1; fresh block 3
    assert bm.block_table("b") == [0, 1, 3] and bm.ref_count(0) == 2 and bm.ref_count(3) == 1
    assert bm.free_block_ids() == [4, 5]

    bm.free("a")  # 0, 1 still held by b; 2 has no holder but is cached -> evictable
    assert bm.free_block_ids() == [4, 5, 2] and bm.ref_count(0) == 1
    bm.free("b")  # tail first into the LRU end: 3 (unhashed) -> free; then 1, 0 -> evictable
    assert bm.free_block_ids() == [4, 5, 3, 2, 1, 0] and bm.num_free_blocks == 6

    assert bm.allocate("c", 4, cached_blocks=[0]) == []       # revives 0 out of evictable
    assert bm.free_block_ids() == [4, 5, 3, 2, 1]
    assert bm.allocate("d", 16) == [4, 5, 3, 2]               # empty blocks first, then evict LRU (2)
    assert bm.block_hash(2) is None and bm.cached_prefix(hashes) == [0, 1]
    assert bm.free_block_ids() == [1]
    assert bm.allocate("e", 8) is None and bm.free_block_ids() == [1]  # out of blocks: nothing taken
    assert bm.allocate("e", 4) == [1] and bm.cached_prefix(hashes) == [0]


def test_duplicate_hash_keeps_the_first_block():
    bm = BlockManager(num_blocks=4, block_size=2)
    hashes = BlockHasher(2).update([5, 6])
    bm.allocate("a", 2)
    bm.allocate("b", 2)
    bm.cache_blocks("a", hashes, 2)
    bm.cache_blocks("b", hashes, 2)                           # computed concurrently: b's copy stays private
    assert bm.block_hash(0) == hashes[0] and bm.block_hash(1) is None
    bm.free("b")
    assert bm.free_block_ids() == [2, 3, 1]


def _request(key, ids, max_tokens=4):
    return Request(key, key, PromptInputs(list(ids)), SamplingParams(max_tokens=max_tokens),
                   hasher=BlockHasher(4))


def test_scheduler_reuses_the_longest_cached_prefix_but_computes_the_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_waiting=8)
    a = _request("a", range(10))
    scheduler.add(a)
    out = scheduler.schedule()
    scheduler.update(out)
    assert bm.block_table("a") == [0, 1, 2] and bm.num_cached_blocks == 2
    scheduler.finish(a, "stop")

    b = _request("b", list(range(9)) + [99])                  # shares 2 full blocks (8 tokens) with a
    c = _request("c", range(8))                               # exactly 2 blocks: last token recomputed
    scheduler.add(b)
    scheduler.add(c)
    out = scheduler.schedule()
    assert [(s.request.key, s.start, s.num_new_tokens) for s in out.scheduled] == [("b", 8, 2), ("c", 4, 4)]
    assert bm.block_table("b") == [0, 1, 3] and bm.block_table("c") == [0, 4]  # 2 went to the back of free
    assert (b.num_cached_tokens, c.num_cached_tokens) == (8, 4)
    assert (bm.stats.num_queries, bm.stats.num_hits, bm.stats.num_hit_tokens) == (3, 2, 12)
