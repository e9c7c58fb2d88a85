"""Fixed pool of KV blocks: reference counts, a content-hash index, and an LRU free queue."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class KVBlock:
    """One block of `block_size` KV slots. `block_hash` is set once its tokens are computed."""

    block_id: int
    ref_cnt: int = 0
    block_hash: str | None = None


class BlockPool:
    """Owns every block. A block with ref_cnt 0 sits in the free queue and may still hold
    cached content (its hash stays in the index) until a fresh block is needed.

    Free queue order is eviction order: empty blocks at the front (used first, nothing lost),
    freed blocks that hold content at the back (least recently freed is evicted first).
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(block_id=i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[str, int] = {}  # block hash -> block id

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def get_cached_block(self, block_hash: str) -> KVBlock | None:
        block_id = self._cached.get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` from the front of the free queue, evicting their old content."""
        assert num_blocks <= len(self._free), "caller must check num_free_blocks first"
        new_blocks = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits; a hit on a free block un-frees it."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each, in the given order (pass a request's blocks tail first, so
        that its last blocks, the least likely to be shared, are evicted first)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache_block(self, block: KVBlock, block_hash: str) -> None:
        """Index a full, computed block. If an identical block is already indexed (two
        requests computed the same prefix at once), this one stays anonymous."""
        assert block.ref_cnt > 0 and block.block_hash is None
        if block_hash not in self._cached:
            self._cached[block_hash] = block.block_id
            block.block_hash = block_hash

    def check_integrity(self) -> None:
        assert len(self.blocks) == self.num_blocks
        num_used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert num_used + len(self._free) == self.num_blocks, "free + used != total"
        for block in self.blocks:
            assert block.ref_cnt >= 0
            assert (block.ref_cnt == 0) == (block.block_id in self._free)
            if block.block_hash is not None:
                assert self.enable_caching
                assert self._cached.get(block.block_hash) == block.block_id
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash, "hash index out of sync"
