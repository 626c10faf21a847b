import pytest
import torch

from services.decoder.block_manager import BlockManager


def test_allocation_order_free_list_and_slot_mapping():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.allocate("a", 5) == [0, 1]                  # 5 tokens -> 2 blocks
    assert bm.allocate("b", 4) == [2]
    assert bm.block_table("a") == [0, 1] and bm.num_free_blocks == 1
    assert bm.slot_mapping("a", 0, 5).tolist() == [0, 1, 2, 3, 4]
    assert bm.slot_mapping("b", 1, 3).tolist() == [9, 10]
    assert bm.append_slots("a", 8) is True                # still fits in 2 blocks
    assert bm.block_table("a") == [0, 1] and bm.num_free_blocks == 1
    assert bm.append_slots("a", 9) is True                # third block: the last free one
    assert bm.block_table("a") == [0, 1, 3]
    assert bm.slot_mapping("a", 7, 9).tolist() == [7, 12]  # pos 8 -> block 3 slot 12
    assert bm.num_free_blocks == 0


def test_out_of_blocks_is_an_ordinary_result_and_allocates_nothing():
    bm = BlockManager(num_blocks=3, block_size=2)
    assert bm.allocate("a", 4) == [0, 1]
    assert not bm.can_allocate("b", 3)
    assert bm.allocate("b", 3) is None
    assert bm.block_table("b") == [] and bm.num_free_blocks == 1
    assert bm.append_slots("a", 7) is False
    assert bm.block_table("a") == [0, 1]


def test_free_returns_blocks_to_the_back_of_the_free_list():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 4)  # [0, 1]
    bm.allocate("b", 2)  # [2]
    assert bm.free("a") == [0, 1]
    assert bm.num_free_blocks == 3
    assert bm.allocate("c", 6) == [3, 0, 1]  # free list order: 3, then the freed 0, 1
    assert bm.slot_mapping("c", 0, 6).tolist() == [6, 7, 0, 1, 2, 3]
    assert bm.free("missing") == []


def test_slot_mapping_past_the_table_raises():
    bm = BlockManager(num_blocks=2, block_size=2)
    bm.allocate("a", 2)
    with pytest.raises(ValueError):
        bm.slot_mapping("a", 0, 3)
    assert bm.slot_mapping("a", 0, 2).dtype == torch.long
