"""Scheduler on a tiny pool: chunked prefill, decode-first order, recompute preemption (exact block ids)."""

from services.decoder.block_manager import BlockManager
from services.decoder.request import Request, RequestStatus
from services.decoder.scheduler import Scheduler
from services.decoder.types import PromptInputs, SamplingParams


def _request(key, num_prompt):
    return Request(key, key, PromptInputs(list(range(1, num_prompt + 1))), SamplingParams(max_tokens=8))


def _step(scheduler, tokens=7):
    out = scheduler.schedule()
    scheduler.update(out)
    for item in out.scheduled:
        if item.request.num_computed_tokens == item.request.num_tokens:
            item.request.output_token_ids.append(tokens)
    return out


def test_chunked_prefill_then_decode_then_preemption():
    bm = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=6, max_waiting=8)
    a, b = _request("a", 10), _request("b", 3)
    scheduler.add(a)
    scheduler.add(b)

    out = _step(scheduler)  # a's first chunk uses the whole budget
    assert [(s.request.key, s.num_new_tokens, s.samples) for s in out.scheduled] == [("a", 6, False)]
    assert bm.block_table("a") == [0, 1] and list(scheduler.waiting) == [b]

    out = _step(scheduler)  # a finishes its prompt (4), b gets a 2-token chunk
    assert [(s.request.key, s.num_new_tokens, s.samples) for s in out.scheduled] == [("a", 4, True), ("b", 2, False)]
    assert bm.block_table("a") == [0, 1, 2] and bm.block_table("b") == [3]

    out = _step(scheduler)  # decode of a first, then b's last prompt token
    assert [(s.request.key, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 1)]
    _step(scheduler)        # a: 12 tokens (3 blocks), b: 4 tokens (1 block) -> pool full
    assert bm.num_free_blocks == 0

    out = _step(scheduler)  # a needs a 4th block: b (latest admitted) is preempted
    assert out.preempted == [b]
    assert [(s.request.key, s.num_new_tokens) for s in out.scheduled] == [("a", 1)]
    assert bm.block_table("a") == [0, 1, 2, 3] and bm.block_table("b") == []
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert list(scheduler.waiting) == [b] and b.num_tokens == 5  # recomputes prompt + generated

    scheduler.finish(a, "length")
    out = _step(scheduler)  # b recomputes all 5 tokens in one prefill and samples
    assert [(s.request.key, s.num_new_tokens, s.samples) for s in out.scheduled] == [("b", 5, True)]
    assert bm.block_table("b") == [0, 1]


def test_max_num_seqs_limits_admission():
    bm = BlockManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64, max_waiting=8)
    for key in "abc":
        scheduler.add(_request(key, 3))
    out = scheduler.schedule()
    assert [s.request.key for s in out.scheduled] == ["a", "b"]
    assert [r.key for r in scheduler.waiting] == ["c"]
