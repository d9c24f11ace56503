import pytest

from engine.kv_cache.allocator import BlockAllocator, OutOfBlocksError


def test_allocates_in_order_and_reuses_freed_blocks_fifo():
    allocator = BlockAllocator(6)
    first = allocator.allocate(2)
    second = allocator.allocate(3)
    assert first == [0, 1] and second == [2, 3, 4]
    allocator.free(first)
    assert allocator.num_free_blocks == 3
    # block 5 was never used; 0 and 1 come back after it, in release order
    assert allocator.allocate(3) == [5, 0, 1]
    allocator.check_invariants([second, [5, 0, 1]])


def test_allocate_is_all_or_nothing():
    allocator = BlockAllocator(3)
    allocator.allocate(2)
    with pytest.raises(OutOfBlocksError):
        allocator.allocate(2)
    assert allocator.num_free_blocks == 1


def test_refcounts_keep_shared_blocks_until_last_holder_frees():
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(2)
    allocator.share(blocks)
    assert allocator.ref_count(blocks[0]) == 2
    allocator.free(blocks)
    assert allocator.num_free_blocks == 2
    allocator.check_invariants([blocks])
    allocator.free(blocks)
    assert allocator.num_free_blocks == 4
    allocator.check_invariants([])


def test_double_free_and_leaks_are_caught():
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(2)
    with pytest.raises(AssertionError):
        allocator.check_invariants([])          # a leak: nobody claims the blocks
    allocator.free(blocks)
    with pytest.raises(ValueError):
        allocator.free(blocks)
    with pytest.raises(ValueError):
        allocator.share([0])
