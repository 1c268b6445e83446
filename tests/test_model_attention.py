"""Attention backends agree with the float32 reference on random paged caches: decodes of many
lengths (1, partial blocks, several blocks), prefill chunks with a cached prefix, padding rows."""

from __future__ import annotations

import pytest
import torch

from jitney.model.attention import AttentionMetadata, SequenceSpan, make_backend

BLOCK = 4


def random_step(
    num_heads: int,
    kv_heads: int,
    dtype: torch.dtype,
    seed: int = 0,
    head_dim: int = 16,
    block: int = BLOCK,
    prefill: tuple[tuple[int, int], ...] = ((0, 6), (9, 5)),  # (cached prefix, chunk length)
):
    """A step with 4 decodes, prefill chunks (by default two, one continuing a cached prefix) and
    2 padding rows."""
    gen = torch.Generator().manual_seed(seed)
    decode_lens = [1, 3, 4, 13]
    num_blocks = sum(-(-n // block) for n in decode_lens) + sum(-(-(a + b) // block) for a, b in prefill) + 8
    k_cache = torch.randn(num_blocks, kv_heads, block, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, kv_heads, block, head_dim, generator=gen).to(dtype)
    free = iter(torch.randperm(num_blocks, generator=gen).tolist())

    def table(n_tokens: int) -> list[int]:
        return [next(free) for _ in range(-(-n_tokens // block))]

    decode_tables = [table(n) for n in decode_lens]
    width = max(map(len, decode_tables))
    prefill_tables = [table(start + n) for start, n in prefill]

    slots, spans, row = [], [], len(decode_lens)
    for n, blocks in zip(decode_lens, decode_tables, strict=True):
        slots.append(blocks[(n - 1) // block] * block + (n - 1) % block)
    for (start, n), blocks in zip(prefill, prefill_tables, strict=True):
        slots += [blocks[p // block] * block + p % block for p in range(start, start + n)]
        spans.append(SequenceSpan(row, n, start + n, torch.tensor(blocks)))
        row += n
    padding = 2
    total = row + padding
    q = torch.randn(total, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(
        block_size=block,
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


@pytest.mark.parametrize(
    ("head_dim", "block", "num_heads", "kv_heads"),
    [(64, 16, 9, 3), (64, 32, 4, 4), (128, 16, 16, 2), (64, 16, 8, 1)],
    ids=["smollm2", "block32", "d128", "mqa"],
)
def test_compiled_prefill_kernel_matches_reference(head_dim, block, num_heads, kv_heads):
    """bf16 steps whose prefill chunks take the compiled causal kernel: whole prompts of 1 to 300
    tokens, chunks continuing a cached prefix (inside a block, on a block edge, long), next to
    decodes and padding rows; the cache writes are the reference's."""
    from jitney.model.cpu_kernels import load_kernels

    kernels = load_kernels()
    if kernels is None or not kernels.has_prefill_kernel():
        pytest.skip("the compiled prefill kernel cannot be built here")
    prefill = ((0, 1), (0, 2), (0, 33), (5, 1), (7, 20), (block, 40), (100, 300), (0, 300))
    q, k, v, k_cache, v_cache, meta = random_step(
        num_heads, kv_heads, torch.bfloat16, seed=3, head_dim=head_dim, block=block, prefill=prefill
    )
    scale = head_dim**-0.5
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = make_backend("reference").forward(q, k, v, ref_k, ref_v, meta, scale)
    sdpa = make_backend("sdpa").forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, scale)
    backend = make_backend("cpu-kernel")
    assert backend._prefill_fits(q, k_cache)
    got = backend.forward(q, k, v, k_cache, v_cache, meta, scale)
    # P is rounded to bf16 before P x V, as torch's bf16 SDPA does: hold the kernel to SDPA's
    # accuracy against the float32 reference (about 0.2% of elements off by a bf16 step or two).
    error, sdpa_error = (got.float() - expected.float()).abs(), (sdpa.float() - expected.float()).abs()
    assert error.max() <= 1.5 * sdpa_error.max() and error.mean() <= 1.25 * sdpa_error.mean()
    torch.testing.assert_close(got.float(), expected.float(), atol=3e-2, rtol=3e-2)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        make_backend("flash")


def _reference_decode(q, k_cache, v_cache, tables, lens, scale):
    """Float32 softmax attention of each decode row over its gathered blocks."""
    num_heads, kv_heads, block = q.shape[1], k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32)
    for s, n in enumerate(lens.tolist()):
        blocks = tables[s, : -(-n // block)]
        keys = k_cache[blocks].transpose(0, 1).reshape(kv_heads, -1, q.shape[2])[:, :n].float()
        values = v_cache[blocks].transpose(0, 1).reshape(kv_heads, -1, q.shape[2])[:, :n].float()
        keys = keys.repeat_interleave(num_heads // kv_heads, dim=0)
        values = values.repeat_interleave(num_heads // kv_heads, dim=0)
        weights = (torch.einsum("hd,hkd->hk", q[s].float(), keys) * scale).softmax(dim=-1)
        out[s] = torch.einsum("hk,hkd->hd", weights, values)
    return out


def _scattered_decode_case(
    lens: list[int], num_heads: int, kv_heads: int, head_dim: int, block: int, seed: int
):
    """bf16 queries and caches for decodes at ``lens``, each sequence's blocks scattered over the
    pool; K is scaled up so scores spread widely and the online softmax must rescale."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block) for n in lens]
    num_blocks = sum(blocks_needed) + 3
    k_cache = (4 * torch.randn(num_blocks, kv_heads, block, head_dim, generator=gen)).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks, kv_heads, block, head_dim, generator=gen).to(torch.bfloat16)
    order = iter(torch.randperm(num_blocks, generator=gen).tolist())
    tables = torch.zeros(len(lens), max(blocks_needed), dtype=torch.int64)
    for s, n in enumerate(blocks_needed):
        tables[s, :n] = torch.tensor([next(order) for _ in range(n)])
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(torch.bfloat16)
    return q, k_cache, v_cache, tables, torch.tensor(lens)


@pytest.mark.parametrize(
    ("head_dim", "block", "num_heads", "kv_heads"),
    [
        (64, 16, 9, 3),
        (64, 32, 4, 4),
        (128, 16, 16, 2),
        (64, 16, 8, 1),
        (64, 16, 14, 2),
        (128, 16, 12, 1),
        (64, 16, 11, 1),
        (32, 16, 4, 2),
    ],
    ids=[
        "smollm2",
        "block32",
        "d128",
        "mqa",
        "group7",
        "group12-two-tasks",
        "group11-one-head-tasks",
        "portable-d32",
    ],
)
def test_compiled_decode_kernel_matches_float32_reference(head_dim, block, num_heads, kv_heads):
    """The vectorised bf16 path (head size 64/128, blocks of 16k rows) and the portable loop agree
    with float32 attention for lengths of 1, partial tiles, exact blocks and many blocks, over
    scattered block tables; large score ranges exercise the online softmax's rescaling."""
    from jitney.model.cpu_kernels import load_kernels

    kernels = load_kernels()
    if kernels is None:
        pytest.skip("the CPU paged-attention kernel cannot be built here")
    lens = [1, 5, block, block + 1, 3 * block - 1, 200, 517]
    q, k_cache, v_cache, tables, lens = _scattered_decode_case(lens, num_heads, kv_heads, head_dim, block, 7)
    scale = head_dim**-0.5
    got = kernels.paged_decode(q, k_cache, v_cache, tables, lens, scale)
    expected = _reference_decode(q, k_cache, v_cache, tables, lens, scale)
    assert got.dtype is torch.bfloat16
    # Within one bf16 rounding of the output (relative 2^-8) plus float32 summation noise.
    torch.testing.assert_close(got.float(), expected, atol=1e-3, rtol=4e-3)
    # Length 1: the softmax weight is exactly 1, the output is that row's V (rounded once).
    v_first = v_cache[tables[0, 0], :, 0].repeat_interleave(num_heads // kv_heads, dim=0)
    torch.testing.assert_close(got[0].float(), v_first.float(), atol=0, rtol=0)


@pytest.mark.parametrize(
    "lens", [[517], [2000], [1100, 3], [3, 4000]], ids=["517", "2000", "1100+3", "3+4000"]
)
@pytest.mark.parametrize(("num_heads", "kv_heads"), [(9, 3), (8, 1)], ids=["smollm2", "mqa"])
def test_compiled_decode_kernel_splits_long_sequences_across_threads(lens, num_heads, kv_heads):
    """With fewer (sequence, KV head) units than threads can share, each sequence's blocks are
    split into ranges merged afterwards; a short sequence next to a long one gets empty ranges."""
    from jitney.model.cpu_kernels import load_kernels

    kernels = load_kernels()
    if kernels is None:
        pytest.skip("the CPU paged-attention kernel cannot be built here")
    head_dim = 64
    q, k_cache, v_cache, tables, context = _scattered_decode_case(lens, num_heads, kv_heads, head_dim, 16, 3)
    got = kernels.paged_decode(q, k_cache, v_cache, tables, context, head_dim**-0.5)
    expected = _reference_decode(q, k_cache, v_cache, tables, context, head_dim**-0.5)
    torch.testing.assert_close(got.float(), expected, atol=1e-3, rtol=4e-3)


@pytest.mark.parametrize(
    ("num_heads", "kv_heads"), [(9, 3), (12, 1)], ids=["one-task-per-group", "two-tasks-per-group"]
)
def test_compiled_decode_kernel_ignores_rows_past_the_context(num_heads, kv_heads):
    """A last block's rows past the context hold whatever an earlier request left there; the
    kernel scores whole tiles, so a NaN there must be masked out, not summed in."""
    from jitney.model.cpu_kernels import load_kernels

    kernels = load_kernels()
    if kernels is None:
        pytest.skip("the CPU paged-attention kernel cannot be built here")
    gen = torch.Generator().manual_seed(11)
    block, head_dim, lens = 16, 64, torch.tensor([3, 21, 40])
    tables = torch.tensor([[0, 0, 0], [1, 2, 0], [3, 4, 5]])
    k_cache = torch.randn(6, kv_heads, block, head_dim, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(6, kv_heads, block, head_dim, generator=gen).to(torch.bfloat16)
    for s, n in enumerate(lens.tolist()):
        last = tables[s, (n - 1) // block]
        k_cache[last, :, n % block or block :] = float("nan")
        v_cache[last, :, n % block or block :] = float("nan")
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(torch.bfloat16)
    got = kernels.paged_decode(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    assert torch.isfinite(got.float()).all()
    expected = _reference_decode(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    torch.testing.assert_close(got.float(), expected, atol=1e-3, rtol=4e-3)
