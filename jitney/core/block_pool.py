"""Fixed-size KV blocks: reference counts, an LRU free queue, and the prefix-hash map.

A freed block keeps its hash and stays findable until allocation takes it from the head of the
free queue; only then is the hash dropped. So the free queue doubles as the prefix cache's LRU
eviction order, and a cache hit on a free block takes it back out of the middle of the queue,
which is why the queue is a doubly linked list (O(1) removal) and not a Python list.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence

# Fixed key: hashes are deterministic across processes and runs, and keyed so that they are not
# plain content digests that another system could collide with on purpose.
_HASH_KEY = b"jitney-prefix-cache-v1"


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Hash of one full block, chained from its parent's hash so equal hashes mean equal prefixes."""
    h = hashlib.blake2b(digest_size=16, key=_HASH_KEY)
    if parent_hash is not None:
        h.update(parent_hash)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class KVBlock:
    """One block of ``block_size`` token slots. ``prev``/``next`` link it into the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop from the head (least recently freed), append at the
    tail, remove from anywhere in O(1)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels
        self._tail = KVBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def popleft(self) -> KVBlock:
        block = self._head.next
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        assert last is not None
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self._len += 1

    def popleft_n(self, n: int) -> list[KVBlock]:
        """Unlink the first ``n`` blocks as one run (every prefill takes several at once)."""
        if n > self._len:
            raise IndexError(f"asked for {n} blocks, only {self._len} free")
        taken = []
        block = self._head.next
        for _ in range(n):
            assert block is not None
            taken.append(block)
            nxt = block.next
            block.prev = block.next = None
            block = nxt
        assert block is not None
        self._head.next = block
        block.prev = self._head
        self._len -= n
        return taken

    def extend(self, blocks: list[KVBlock]) -> None:
        """Link ``blocks`` at the tail, in order, as one run."""
        last = self._tail.prev
        assert last is not None
        for block in blocks:
            last.next = block
            block.prev = last
            last = block
        last.next = self._tail
        self._tail.prev = last
        self._len += len(blocks)

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in the free queue")
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self._len -= 1

    def __iter__(self):
        block = self._head.next
        while block is not None and block is not self._tail:
            yield block
            block = block.next


class BlockPool:
    """All KV blocks of the cache and who holds them."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def take_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue, evicting their cached hashes."""
        if n > len(self.free_queue):
            raise ValueError(f"asked for {n} blocks, only {len(self.free_queue)} free")
        taken = self.free_queue.popleft_n(n)
        cached = self.cached
        for block in taken:
            if block.block_hash is not None:
                if cached.get(block.block_hash) is block:
                    del cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the eviction queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference on each block, in the order given; unreferenced ones join the tail."""
        freed = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                freed.append(block)
        if freed:
            self.free_queue.extend(freed)

    def register(self, block: KVBlock, block_hash: bytes) -> None:
        """Mark a filled block as reusable under ``block_hash`` (first writer wins on duplicates)."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        if block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def check_invariants(self) -> None:
        """free + held = all blocks; ref counts >= 0; no block both free and held; hash map sane."""
        free_ids = set()
        for block in self.free_queue:
            if block.block_id in free_ids:
                raise AssertionError(f"{block!r} twice in the free queue")
            free_ids.add(block.block_id)
        if len(free_ids) != len(self.free_queue):
            raise AssertionError("free queue length out of sync")
        for block in self.blocks:
            if block.ref_cnt < 0:
                raise AssertionError(f"{block!r} has a negative ref count")
            is_free = block.block_id in free_ids
            if is_free == (block.ref_cnt > 0):
                raise AssertionError(f"{block!r}: free={is_free} but ref_cnt={block.ref_cnt}")
        for block_hash, block in self.cached.items():
            if block.block_hash != block_hash:
                raise AssertionError(f"{block!r} cached under a hash it does not carry")
