import pytest

from engine.kv_cache.allocator import BlockAllocator, OutOfBlocksError


def test_allocates_in_order_and_reuses_the_last_freed_blocks_first():
    allocator = BlockAllocator(6)
    first = allocator.allocate(2)
    second = allocator.allocate(3)
    assert first == [0, 1] and second == [2, 3, 4]
    allocator.free(reversed(first))                # requests free tail first
    assert allocator.num_free_blocks == 3
    # 0 and 1 (already touched) are reused before block 5, which was never used
    assert allocator.allocate(3) == [0, 1, 5]
    allocator.check_invariants([second, [0, 1, 5]])


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
