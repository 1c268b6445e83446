"""Attention backends agree with the float32 reference on random paged caches: decodes of many
lengths (1, partial blocks, several blocks), prefill chunks with a cached prefix, padding rows."""

from __future__ import annotations

import pytest
import torch

from jitney.model.attention import AttentionMetadata, SequenceSpan, make_backend

BLOCK = 4


def random_step(num_heads: int, kv_heads: int, dtype: torch.dtype, seed: int = 0):
    """A step with 4 decodes, 2 prefill chunks (one continuing a cached prefix) and 2 padding rows."""
    gen = torch.Generator().manual_seed(seed)
    head_dim, num_blocks = 16, 64
    k_cache = torch.randn(num_blocks, kv_heads, BLOCK, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, kv_heads, BLOCK, head_dim, generator=gen).to(dtype)
    free = iter(torch.randperm(num_blocks, generator=gen).tolist())

    def table(n_tokens: int) -> list[int]:
        return [next(free) for _ in range(-(-n_tokens // BLOCK))]

    decode_lens = [1, 3, 4, 13]
    decode_tables = [table(n) for n in decode_lens]
    width = max(map(len, decode_tables))
    prefill = [(0, 6), (9, 5)]  # (cached prefix, chunk length)
    prefill_tables = [table(start + n) for start, n in prefill]

    slots, spans, row = [], [], len(decode_lens)
    for n, blocks in zip(decode_lens, decode_tables, strict=True):
        slots.append(blocks[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK)
    for (start, n), blocks in zip(prefill, prefill_tables, strict=True):
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)]
        spans.append(SequenceSpan(row, n, start + n, torch.tensor(blocks)))
        row += n
    padding = 2
    total = row + padding
    q = torch.randn(total, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(
        block_size=BLOCK,
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=len(decode_lens),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in decode_tables]),
        decode_context_lens=torch.tensor(decode_lens),
        prefills=spans,
        num_padding_tokens=padding,
    )
    return q, k, v, k_cache, v_cache, meta


@pytest.mark.parametrize("backend", ["sdpa", "cpu-kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("num_heads", "kv_heads"), [(4, 4), (6, 2)], ids=["mha", "gqa"])
def test_backend_matches_reference(backend, dtype, num_heads, kv_heads):
    if backend == "cpu-kernel":
        from jitney.model.cpu_kernels import load_kernels

        if load_kernels() is None:
            pytest.skip("the CPU paged-attention kernel cannot be built here")
    q, k, v, k_cache, v_cache, meta = random_step(num_heads, kv_heads, dtype)
    scale = q.shape[-1] ** -0.5
    expected = make_backend("reference").forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, scale)
    cache_k, cache_v = k_cache.clone(), v_cache.clone()
    got = make_backend(backend).forward(q, k, v, cache_k, cache_v, meta, scale)
    tol = 1e-5 if dtype is torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    # Padding rows attend to themselves only and never reach the cache.
    group = num_heads // kv_heads
    torch.testing.assert_close(got[-2:], v[-2:].repeat_interleave(group, dim=1))
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool)
    untouched[meta.slot_blocks] = False
    assert torch.equal(cache_k[untouched], k_cache[untouched])


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        make_backend("flash")
