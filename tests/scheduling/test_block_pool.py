"""The KV block pool: reference counts, the prefix-cache index, the order blocks are reused in."""

from __future__ import annotations

import random

import pytest

from mmserve.scheduling.block_pool import BlockPool, KVBlock


def _ids(blocks: list[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_new_blocks_are_taken_once_and_come_back_when_freed() -> None:
    pool = BlockPool(4, enable_caching=True)
    first = pool.get_new_blocks(3)
    pool.check_integrity()
    assert len(set(_ids(first))) == 3 and all(b.ref_cnt == 1 for b in first)
    assert pool.num_free_blocks == 1
    (last,) = pool.get_new_blocks(1)
    assert last.block_id not in _ids(first)
    pool.free_blocks(first)
    pool.check_integrity()
    assert pool.num_free_blocks == 3


def test_a_freed_block_keeps_its_content_until_its_space_is_needed() -> None:
    pool = BlockPool(3, enable_caching=True)
    (cached,) = pool.get_new_blocks(1)
    pool.cache_block(cached, "h-a")
    pool.free_blocks([cached])
    pool.check_integrity()
    assert pool.get_cached_block("h-a") is cached  # free, but its content is still a hit
    # The two empty blocks go first: nothing cached is lost while empty ones remain.
    taken = pool.get_new_blocks(2)
    assert cached.block_id not in _ids(taken)
    assert pool.get_cached_block("h-a") is cached
    pool.free_blocks(taken)
    pool.check_integrity()
    # Freed empty blocks go back to the front as well: the cached block is still last in line.
    assert cached.block_id not in _ids(pool.get_new_blocks(2))
    (evicted,) = pool.get_new_blocks(1)
    pool.check_integrity()
    assert evicted is cached and evicted.block_hash is None
    assert pool.get_cached_block("h-a") is None  # its content is gone with its old tokens


def test_the_least_recently_freed_cached_block_is_evicted_first() -> None:
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    for block, block_hash in zip(blocks, ("h0", "h1", "h2"), strict=True):
        pool.cache_block(block, block_hash)
    # Freed tail first (as a finishing request frees), then another request's block.
    pool.free_blocks([blocks[2], blocks[1]])
    pool.free_blocks([blocks[0]])
    pool.check_integrity()
    assert _ids(pool.get_new_blocks(1)) == [blocks[2].block_id]
    assert pool.get_cached_block("h2") is None
    assert pool.get_cached_block("h1") is blocks[1] and pool.get_cached_block("h0") is blocks[0]
    assert _ids(pool.get_new_blocks(2)) == [blocks[1].block_id, blocks[0].block_id]
    pool.check_integrity()


def test_a_hit_on_a_free_block_takes_it_out_of_the_free_queue() -> None:
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, "prefix")
    pool.free_blocks([block])
    assert pool.num_free_blocks == 2
    hit = pool.get_cached_block("prefix")
    assert hit is block
    pool.touch([hit])
    pool.check_integrity()
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    (other,) = pool.get_new_blocks(1)
    assert other is not block and pool.get_cached_block("prefix") is block
    pool.touch([block])  # a second request shares the prefix
    pool.free_blocks([block])
    pool.check_integrity()
    assert block.ref_cnt == 1 and pool.num_free_blocks == 0


def test_a_prefix_computed_twice_at_once_is_indexed_once() -> None:
    pool = BlockPool(3, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    pool.cache_block(first, "same")
    pool.cache_block(second, "same")
    pool.check_integrity()
    assert pool.get_cached_block("same") is first and second.block_hash is None
    pool.free_blocks([first])
    pool.free_blocks([second])
    pool.check_integrity()
    # The anonymous duplicate went to the front: it is reused before the indexed one.
    assert _ids(pool.get_new_blocks(2)) == [second.block_id, 2]
    assert pool.get_cached_block("same") is first


def test_a_double_free_is_caught() -> None:
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([block])


@pytest.mark.parametrize("seed", range(6))
def test_randomised_requests_never_share_a_block_they_did_not_hit(seed: int) -> None:
    """Requests take, hit, index and free blocks at random; after every operation the pool's
    books balance, no block in use is handed out again, and every hit returns its content."""
    rng = random.Random(seed)
    num_blocks = rng.choice([4, 9, 16])
    pool = BlockPool(num_blocks, enable_caching=True)
    held: dict[str, list[KVBlock]] = {}  # request id -> its blocks, in order
    content: dict[int, str] = {}  # block id -> the hash it was indexed under (the model)
    for step in range(400):
        op = rng.random()
        in_use = {b.block_id for blocks in held.values() for b in blocks}
        if op < 0.35 and pool.num_free_blocks:
            num = rng.randint(1, pool.num_free_blocks)
            new = pool.get_new_blocks(num)
            assert not in_use & set(_ids(new)), "a block in use was handed out"
            for block in new:
                content.pop(block.block_id, None)  # its old content was evicted
                assert block.ref_cnt == 1 and block.block_hash is None
            held.setdefault(f"r{step}", []).extend(new)
        elif op < 0.55 and content:
            block_id, block_hash = rng.choice(sorted(content.items()))
            hit = pool.get_cached_block(block_hash)
            assert hit is not None and hit.block_id == block_id, "a hit lost its content"
            was_free = hit.ref_cnt == 0
            num_free = pool.num_free_blocks
            pool.touch([hit])
            assert pool.num_free_blocks == num_free - was_free
            held.setdefault(f"hit{step}", []).append(hit)
        elif op < 0.75 and held:
            request_id = rng.choice(sorted(held))
            anonymous = [b for b in held[request_id] if b.block_hash is None]
            if anonymous:
                block = rng.choice(anonymous)
                block_hash = f"h{rng.randrange(12)}"  # few hashes: duplicates happen
                already = pool.get_cached_block(block_hash)
                pool.cache_block(block, block_hash)
                if already is None:
                    content[block.block_id] = block_hash
                else:
                    assert block.block_hash is None and pool.get_cached_block(block_hash) is already
        elif held:
            request_id = rng.choice(sorted(held))
            num_free = pool.num_free_blocks
            blocks = held.pop(request_id)
            pool.free_blocks(reversed(blocks))
            still_used = {b.block_id for bs in held.values() for b in bs}
            released = {b.block_id for b in blocks} - still_used
            assert pool.num_free_blocks == num_free + len(released)
        pool.check_integrity()
        in_use = {b.block_id for blocks in held.values() for b in blocks}
        assert pool.num_free_blocks == num_blocks - len(in_use)
        for block_id, block_hash in content.items():
            assert pool.get_cached_block(block_hash) is pool.blocks[block_id]
    for blocks in held.values():
        pool.free_blocks(reversed(blocks))
    pool.check_integrity()
    assert pool.num_free_blocks == num_blocks
