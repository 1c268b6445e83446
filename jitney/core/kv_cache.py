"""KVCacheManager: which blocks each request holds, prefix-cache lookup, all-or-nothing allocation."""

from __future__ import annotations

from dataclasses import dataclass

from jitney.config import CacheConfig
from jitney.core.block_pool import BlockPool, KVBlock, hash_block_tokens
from jitney.request import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, config: CacheConfig) -> None:
        self.block_size = config.block_size
        self.enable_prefix_caching = config.enable_prefix_caching
        self.pool = BlockPool(config.num_blocks, config.enable_prefix_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_registered: dict[str, int] = {}  # leading blocks already hashed into the cache
        self.prefix_stats = PrefixCacheStats()

    # -- queries -------------------------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def holds(self, request_id: str) -> bool:
        return request_id in self._blocks

    # -- prefix cache --------------------------------------------------------------------------
    def _extend_hashes(self, request: Request, num_full_blocks: int) -> None:
        """Make sure ``request.block_hashes`` covers its first ``num_full_blocks`` full blocks."""
        hashes = request.block_hashes
        bs = self.block_size
        if len(hashes) >= num_full_blocks:
            return
        tokens = request.all_token_ids
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full_blocks):
            parent = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs])
            hashes.append(parent)

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """Longest run of cached full blocks at the start of the request's tokens, never covering
        its last token (that one must be computed to produce logits)."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, max_blocks)
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_stats.queries += num_tokens
        self.prefix_stats.hits += num_hit_tokens

    def fits_whole_prompt(self, request: Request, cached_prefix: list[KVBlock]) -> bool:
        """Whether the free pool could hold all of the request's tokens right now. Admission asks
        this even when only a first chunk is allocated: starting a prefill the pool cannot finish
        only leads to preempting it (or a neighbour) a few steps later, and under pressure that
        loop of admit, grow, preempt, recompute eats the whole machine."""
        need = self.blocks_needed(request.num_tokens) - len(cached_prefix)
        num_prefix_free = sum(1 for b in cached_prefix if b.ref_cnt == 0)
        return need + num_prefix_free <= self.pool.num_free_blocks

    # -- allocation ----------------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_prefix: list[KVBlock] | None = None
    ) -> list[int] | None:
        """Reserve room for ``num_new_tokens`` more tokens of ``request`` (after its computed ones
        and, at admission, after ``cached_prefix``). Returns the ids of the blocks added to its
        table, or None with nothing changed when the pool cannot supply them."""
        rid = request.request_id
        held = self._blocks.get(rid)
        prefix = cached_prefix or []
        num_computed = request.num_computed_tokens + len(prefix) * self.block_size
        total_tokens = num_computed + num_new_tokens
        num_held = len(held) if held is not None else 0
        num_new_blocks = -(-total_tokens // self.block_size) - num_held - len(prefix)

        if not prefix and num_new_blocks <= 0 and held is not None:  # decode fast path
            if total_tokens // self.block_size > self._num_registered[rid]:
                self._register_full_blocks(request, held, total_tokens)
            return []

        # Cached blocks sitting in the free queue are taken out of it: they count against it.
        num_prefix_free = sum(1 for b in prefix if b.ref_cnt == 0)
        if max(num_new_blocks, 0) + num_prefix_free > self.pool.num_free_blocks:
            return None

        if held is None:
            held = self._blocks[rid] = []
            self._num_registered[rid] = 0
        self.pool.touch(prefix)
        held.extend(prefix)
        self._num_registered[rid] += len(prefix)
        new_blocks = self.pool.take_new_blocks(max(num_new_blocks, 0))
        held.extend(new_blocks)
        self._register_full_blocks(request, held, total_tokens)
        return [b.block_id for b in prefix] + [b.block_id for b in new_blocks]

    def _register_full_blocks(self, request: Request, held: list[KVBlock], total_tokens: int) -> None:
        """Hash the blocks this step fills so later requests (or this one, after preemption) hit them.
        Only tokens already known count: a block filled by tokens still to be sampled waits."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        num_full = min(total_tokens, request.num_tokens) // self.block_size
        start = self._num_registered[rid]
        if num_full <= start:
            return
        self._extend_hashes(request, num_full)
        for i in range(start, num_full):
            self.pool.register(held[i], request.block_hashes[i])
        self._num_registered[rid] = num_full

    def free(self, request: Request) -> None:
        """Release every block of ``request``. Deepest blocks go to the free queue first so that
        LRU eviction takes a prefix's tail before its head."""
        blocks = self._blocks.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
        if blocks:
            self.pool.release(reversed(blocks))

    def num_held_requests(self) -> int:
        return len(self._blocks)

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        for blocks in self._blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            if block.ref_cnt != refs.get(block.block_id, 0):
                raise AssertionError(
                    f"{block!r}: ref_cnt {block.ref_cnt} but held by {refs.get(block.block_id, 0)} requests"
                )
