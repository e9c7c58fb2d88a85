"""Paged KV allocation per request, with chained, multimodal-aware prefix-cache block hashes."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from mmserve.config import CacheConfig
from mmserve.hashing import Hasher
from mmserve.scheduling.block_pool import BlockPool, KVBlock
from mmserve.scheduling.request import Request

_BLOCK_DOMAIN = "mmserve.kv_block.v1"
_ROOT_HASH = ""


def block_extra_keys(request: Request, start: int, end: int) -> list[tuple[str, int]]:
    """`(identity, item_offset - block_start)` for every multimodal item overlapping the block
    [start, end). The offset is part of the key: one image at two in-block offsets is two
    different KV contents (and it may be negative when the item began in an earlier block)."""
    keys = []
    for feature in request.mm_features:
        offset, length = feature.placeholder.offset, feature.placeholder.length
        if offset < end and offset + length > start:
            keys.append((feature.identifier, offset - start))
    return keys


def hash_block(
    hasher: Hasher,
    parent_hash: str,
    token_ids: Sequence[int],
    extra_keys: Sequence[tuple[str, int]],
    cache_salt: str | None,
) -> str:
    """Full-width digest of one full block, chained on its parent's digest. The salt is keyed
    only where given (the first block); the chain carries it to every later block."""
    parts: list[bytes | str | int] = [parent_hash, struct.pack(f"<{len(token_ids)}q", *token_ids)]
    parts.append(len(extra_keys))
    for identifier, offset in extra_keys:
        parts += [identifier, offset]
    if cache_salt is None:
        parts.append(0)
    else:
        parts += [1, cache_salt]
    return hasher.digest(_BLOCK_DOMAIN, parts)


@dataclass(frozen=True)
class ComputedBlocks:
    """The longest cached prefix of full blocks for a waiting request (not yet referenced)."""

    blocks: list[KVBlock]
    num_computed_tokens: int


class KVCacheManager:
    """Maps requests to blocks; finds prefix hits; indexes blocks once they are computed."""

    def __init__(self, cache_config: CacheConfig) -> None:
        self.block_size = cache_config.block_size
        self.enable_caching = cache_config.enable_prefix_caching
        self.hasher = Hasher(cache_config.hash_algorithm)
        self.pool = BlockPool(cache_config.num_blocks, self.enable_caching)
        self._req_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def update_block_hashes(self, request: Request) -> None:
        """Extend `request.block_hashes` to every full block of prompt + output tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        while (len(hashes) + 1) * bs <= request.num_tokens:
            start = len(hashes) * bs
            parent = hashes[-1] if hashes else _ROOT_HASH
            salt = request.cache_salt if not hashes else None
            tokens = request.token_ids_in(start, start + bs)
            extra = block_extra_keys(request, start, start + bs)
            hashes.append(hash_block(self.hasher, parent, tokens, extra, salt))

    def block_hashes_to_compute(self, request: Request, num_new: int) -> list[str]:
        """Hashes of the full prompt blocks that the request's next `num_new` tokens complete
        (what a step computes); none without prefix caching or once past the prompt."""
        if not self.enable_caching or request.num_computed_tokens >= request.num_prompt_tokens:
            return []
        self.update_block_hashes(request)
        first = request.num_computed_tokens // self.block_size
        last = (request.num_computed_tokens + num_new) // self.block_size
        return request.block_hashes[first:last]

    def is_next_block_in(self, request: Request, num_computed: int, hashes: set[str]) -> bool:
        """Whether the block after `num_computed` tokens has one of `hashes` (say, the blocks
        other requests compute this very step)."""
        next_block = num_computed // self.block_size
        own = request.block_hashes
        return next_block < len(own) and own[next_block] in hashes

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest run of cached full blocks from the start of the request.

        NOTE: never the whole request: at least the last token is recomputed so that the step
        produces logits. When every block hits, the last one is dropped (a block-sized back-off).
        """
        if not self.enable_caching:
            return ComputedBlocks([], 0)
        self.update_block_hashes(request)
        if request.skip_reading_prefix_cache:
            return ComputedBlocks([], 0)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return ComputedBlocks(hits, len(hits) * self.block_size)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed: ComputedBlocks | None = None,
    ) -> list[int] | None:
        """Reserve blocks for `num_new_tokens` more tokens; returns the ids of the blocks added
        to the request (prefix hits first), or None (and changes nothing) if the pool is short.

        `computed` is passed once, when a waiting request is admitted; its blocks are then
        referenced and the lookup is counted in the prefix-cache counters.
        """
        hit_blocks = computed.blocks if computed is not None else []
        num_hit_tokens = computed.num_computed_tokens if computed is not None else 0
        req_blocks = self._req_blocks.setdefault(request.request_id, [])
        num_total_tokens = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_needed = -(-num_total_tokens // self.block_size) - len(req_blocks) - len(hit_blocks)
        num_needed = max(num_needed, 0)
        # Hits on free blocks leave the free queue, so they count against the free supply too.
        num_free_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_free_hits:
            if not req_blocks:
                del self._req_blocks[request.request_id]
            return None
        if computed is not None and self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens
        self.pool.touch(hit_blocks)
        new_blocks = hit_blocks + self.pool.get_new_blocks(num_needed)
        req_blocks.extend(new_blocks)
        self._num_cached_blocks.setdefault(request.request_id, 0)
        self._num_cached_blocks[request.request_id] += len(hit_blocks)
        return [b.block_id for b in new_blocks]

    def cache_blocks(self, request: Request) -> None:
        """Index the request's full blocks whose KV has been computed (after a step ran)."""
        if not self.enable_caching or request.request_id not in self._req_blocks:
            return
        self.update_block_hashes(request)
        req_blocks = self._req_blocks[request.request_id]
        num_full = min(request.num_computed_tokens // self.block_size, len(req_blocks))
        first = self._num_cached_blocks.get(request.request_id, 0)
        for i in range(first, num_full):
            if req_blocks[i].block_hash is None:
                self.pool.cache_block(req_blocks[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = max(first, num_full)

    def free(self, request: Request) -> None:
        """Release every block of the request; cached content stays reusable until evicted."""
        blocks = self._req_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        expected_refs = [0] * self.pool.num_blocks
        for blocks in self._req_blocks.values():
            for block in blocks:
                expected_refs[block.block_id] += 1
        for block in self.pool.blocks:
            assert block.ref_cnt == expected_refs[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != holders "
                f"{expected_refs[block.block_id]}"
            )
