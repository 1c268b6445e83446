"""The free queue against a plain list model, and the pool's bookkeeping."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from jitney.core.block_pool import BlockPool, FreeBlockQueue, KVBlock, hash_block_tokens

ops = st.lists(
    st.one_of(
        st.tuples(st.just("popleft_n"), st.integers(0, 5)),
        st.tuples(st.just("remove"), st.integers(0, 15)),
        st.tuples(st.just("extend"), st.integers(0, 15)),
        st.tuples(st.just("popleft"), st.integers(0, 0)),
    ),
    max_size=60,
)


@given(ops)
def test_free_queue_behaves_like_a_list(operations) -> None:
    blocks = [KVBlock(i) for i in range(16)]
    queue = FreeBlockQueue(blocks)
    model = list(blocks)
    for op, arg in operations:
        if op == "popleft_n" and arg <= len(model):
            got = queue.popleft_n(arg)
            assert got == model[:arg]
            del model[:arg]
        elif op == "popleft" and model:
            assert queue.popleft() is model.pop(0)
        elif op == "remove" and blocks[arg] in model:
            queue.remove(blocks[arg])
            model.remove(blocks[arg])
        elif op == "extend":
            back = [b for b in blocks if b not in model][:arg]
            queue.extend(back)
            model += back
        assert list(queue) == model and len(queue) == len(model)


def test_hashes_chain_and_are_deterministic() -> None:
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(a, [5, 6]) != hash_block_tokens(None, [5, 6])
    assert len(a) == 16


def test_freed_blocks_stay_cached_until_reused() -> None:
    pool = BlockPool(4, enable_prefix_caching=True)
    (block,) = pool.take_new_blocks(1)
    h = hash_block_tokens(None, [1, 2])
    pool.register(block, h)
    pool.release([block])
    assert pool.get_cached_block(h) is block  # free, yet still a hit
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 3
    pool.release([block])
    taken = pool.take_new_blocks(4)  # the cached block is the last to be evicted
    assert taken[-1] is block and pool.get_cached_block(h) is None
    pool.check_invariants()
