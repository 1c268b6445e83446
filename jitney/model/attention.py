"""Attention over the paged KV cache.

A step's tokens arrive flattened and ordered: first the decode rows (one token per sequence),
then the prefill chunks (several tokens per sequence), then padding rows. Padding rows are the
static policy's dummy work: they go through every layer but attend only to themselves and never
touch the cache.

Backends share one interface, ``forward(q, k, v, k_cache, v_cache, meta)``, so a faster kernel per
device can replace the reference one without the model noticing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class SequenceSpan:
    """One sequence's rows in the flattened batch and its cache layout."""

    query_start: int
    query_len: int
    context_len: int  # tokens of this sequence in the cache after this step's write
    block_table: torch.Tensor  # [num_blocks_used] int64 block ids


@dataclass(frozen=True)
class PrefillLayout:
    """A step's prefill chunks, which sit in consecutive rows, as batched tensors."""

    rows: slice  # the chunks' rows in the flattened batch
    starts: torch.Tensor  # [chunks] int64, each chunk's first row relative to ``rows.start``
    query_lens: torch.Tensor  # [chunks] int64
    context_lens: torch.Tensor  # [chunks] int64, tokens in the cache after this step's write
    block_tables: torch.Tensor  # [chunks, max_blocks] int64, padded with block 0


@dataclass
class AttentionMetadata:
    """Where a step's tokens sit in the flattened batch and in the paged cache."""

    block_size: int
    slot_mapping: torch.Tensor  # [num_real_tokens] int64: block_id * block_size + offset
    num_decode_tokens: int  # leading rows, one per decoding sequence
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64, padded with block 0
    decode_context_lens: torch.Tensor  # [num_decodes] int64
    prefills: list[SequenceSpan]  # sequences with a chunk of several tokens (or any chunk at start)
    num_padding_tokens: int  # trailing rows that attend only to themselves

    def __post_init__(self) -> None:
        # Computed once per step, used by every layer's cache write.
        self.slot_blocks = torch.div(self.slot_mapping, self.block_size, rounding_mode="floor")
        self.slot_offsets = self.slot_mapping % self.block_size
        self._decode_bias: torch.Tensor | None = None
        self._prefill_layout: PrefillLayout | None = None

    def decode_bias(self) -> torch.Tensor:
        """[decodes, 1, 1, positions] float32: 0 where a decode row may attend, -inf on padding.
        Built once per step and shared by every layer."""
        if self._decode_bias is None:
            length = self.decode_block_tables.shape[1] * self.block_size
            positions = torch.arange(length, device=self.slot_mapping.device)
            padding = positions[None, :] >= self.decode_context_lens[:, None]
            bias = torch.zeros(padding.shape, dtype=torch.float32, device=padding.device)
            self._decode_bias = bias.masked_fill_(padding, float("-inf"))[:, None, None, :]
        return self._decode_bias

    def prefill_layout(self) -> PrefillLayout:
        """The prefill chunks as batched tensors, built once per step and shared by every layer."""
        if self._prefill_layout is None:
            first = self.prefills[0].query_start if self.prefills else 0
            width = max((int(p.block_table.shape[0]) for p in self.prefills), default=0)
            tables = torch.zeros(len(self.prefills), width, dtype=torch.int64)
            for i, p in enumerate(self.prefills):
                tables[i, : p.block_table.shape[0]] = p.block_table
            self._prefill_layout = PrefillLayout(
                rows=slice(first, first + sum(p.query_len for p in self.prefills)),
                starts=torch.tensor([p.query_start - first for p in self.prefills], dtype=torch.int64),
                query_lens=torch.tensor([p.query_len for p in self.prefills], dtype=torch.int64),
                context_lens=torch.tensor([p.context_len for p in self.prefills], dtype=torch.int64),
                block_tables=tables,
            )
        return self._prefill_layout

    @property
    def num_real_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim], RoPE applied
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Store the real rows' K and V at their slots (padding rows are never stored)."""
    n = meta.num_real_tokens
    if n == 0:
        return
    k_cache[meta.slot_blocks, :, meta.slot_offsets] = k[:n].to(k_cache.dtype)
    v_cache[meta.slot_blocks, :, meta.slot_offsets] = v[:n].to(v_cache.dtype)


def gather_sequence(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """A sequence's first ``context_len`` cached rows, [kv_heads, context_len, head_dim]."""
    blocks = cache.index_select(0, block_table)  # [blocks, kv_heads, block_size, head_dim]
    kv_heads, head_dim = cache.shape[1], cache.shape[3]
    return blocks.transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :context_len]


def _padding_output(v: torch.Tensor, num_heads: int, meta: AttentionMetadata) -> torch.Tensor:
    # Attending only to itself, a row's softmax weight is 1: its output is its own V.
    pad_v = v[v.shape[0] - meta.num_padding_tokens :]
    return pad_v.repeat_interleave(num_heads // v.shape[1], dim=1)


class TorchReferenceAttention:
    """Explicit per-sequence softmax attention in float32: slow, simple, correct everywhere."""

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        write_kv(k, v, k_cache, v_cache, meta)
        num_heads = q.shape[1]
        out = torch.empty_like(q)
        spans = [
            SequenceSpan(i, 1, int(meta.decode_context_lens[i]), meta.decode_block_tables[i])
            for i in range(meta.num_decode_tokens)
        ] + meta.prefills
        for span in spans:
            keys = gather_sequence(k_cache, span.block_table, span.context_len)
            values = gather_sequence(v_cache, span.block_table, span.context_len)
            rows = slice(span.query_start, span.query_start + span.query_len)
            out[rows] = self._attend(q[rows], keys, values, scale).to(q.dtype)
        if meta.num_padding_tokens:
            out[q.shape[0] - meta.num_padding_tokens :] = _padding_output(v, num_heads, meta)
        return out

    @staticmethod
    def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [q_len, heads, d]; keys/values: [kv_heads, ctx, d]."""
        group = q.shape[1] // keys.shape[0]
        keys = keys.float().repeat_interleave(group, dim=0)
        values = values.float().repeat_interleave(group, dim=0)
        scores = torch.einsum("qhd,hkd->hqk", q.float(), keys) * scale
        q_len, ctx = q.shape[0], keys.shape[1]
        # Query i sits at position ctx - q_len + i and sees keys up to and including itself.
        key_pos = torch.arange(ctx)[None, :]
        query_pos = torch.arange(ctx - q_len, ctx)[:, None]
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
        return torch.einsum("hqk,hkd->qhd", scores.softmax(dim=-1), values)


class TorchSdpaAttention:
    """The fast path in plain torch: every decode of a step in one batched gather + SDPA call, and
    one SDPA call per prefill chunk (there are few per step)."""

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        self._write_kv(k, v, k_cache, v_cache, meta)
        d = meta.num_decode_tokens
        if d and d == q.shape[0]:
            # Decodes only (most steps): the decode output is the whole result, no copy.
            return self._decode(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        if d:
            out[:d] = self._decode(q[:d], k_cache, v_cache, meta, scale)
        if meta.prefills:
            self._prefill_chunks(q, k_cache, v_cache, meta, scale, out)
        if meta.num_padding_tokens:
            out[q.shape[0] - meta.num_padding_tokens :] = _padding_output(v, q.shape[1], meta)
        return out

    @staticmethod
    def _write_kv(k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        write_kv(k, v, k_cache, v_cache, meta)

    def _prefill_chunks(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out) -> None:
        """Write every prefill chunk's attention into its rows of ``out``."""
        for span in meta.prefills:
            rows = slice(span.query_start, span.query_start + span.query_len)
            out[rows] = self._prefill(q[rows], k_cache, v_cache, span, scale)

    @staticmethod
    def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # Block by block: the gathered blocks [seqs, blocks, kv_heads, block_size, d] feed the
        # matmuls as they are (no permuted copy of K/V), query heads grouped under their KV head
        # (no repeat), and the softmax runs across blocks by hand. (CPU SDPA with a padding mask
        # measured far slower here, in bf16 most.)
        tables = meta.decode_block_tables
        num_seqs, max_blocks = tables.shape
        _, kv_heads, block_size, head_dim = k_cache.shape
        group = q.shape[1] // kv_heads
        flat = tables.reshape(-1)
        keys = k_cache.index_select(0, flat).view(num_seqs, max_blocks, kv_heads, block_size, head_dim)
        values = v_cache.index_select(0, flat).view(num_seqs, max_blocks, kv_heads, block_size, head_dim)
        query = q.view(num_seqs, 1, kv_heads, group, head_dim).to(keys.dtype)
        scores = torch.matmul(query, keys.transpose(-1, -2))  # [seqs, blocks, kv, group, bs]
        # Softmax over all positions: bring the (small) scores to [seqs, kv, group, positions].
        length = max_blocks * block_size
        scores = scores.permute(0, 2, 3, 1, 4).reshape(num_seqs, kv_heads, group, length).float()
        scores.mul_(scale).add_(meta.decode_bias())
        probs = scores.softmax(dim=-1).to(values.dtype)
        probs = probs.view(num_seqs, kv_heads, group, max_blocks, block_size).permute(0, 3, 1, 2, 4)
        out = torch.matmul(probs, values).float().sum(dim=1)  # [seqs, kv_heads, group, head_dim]
        return out.to(q.dtype).view(num_seqs, kv_heads * group, head_dim)

    @staticmethod
    def _prefill(q, k_cache, v_cache, span: SequenceSpan, scale: float) -> torch.Tensor:
        keys = gather_sequence(k_cache, span.block_table, span.context_len)[None]
        values = gather_sequence(v_cache, span.block_table, span.context_len)[None]
        query = q.transpose(0, 1)[None].to(keys.dtype)
        q_len, ctx = span.query_len, span.context_len
        if q_len == ctx:
            out = F.scaled_dot_product_attention(
                query, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            key_pos = torch.arange(ctx, device=q.device)[None, :]
            query_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
            mask = key_pos <= query_pos
            out = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
            )
        return out[0].transpose(0, 1)


class CpuKernelAttention(TorchSdpaAttention):
    """The compiled CPU kernels (see jitney.model.cpu_kernels): decodes read K/V straight from their
    blocks instead of gathering them into a copy first; in bf16 with head size 64 or 128 all of a
    step's prefill chunks go through one causal kernel call as well. Other shapes and dtypes take
    SDPA for the prefill chunks."""

    def __init__(self) -> None:
        from jitney.model.cpu_kernels import load_kernels

        kernels = load_kernels()
        if kernels is None:
            raise RuntimeError("the CPU paged-attention kernel could not be built on this machine")
        self._paged_decode = kernels.paged_decode
        self._paged_prefill = kernels.paged_prefill if kernels.has_prefill_kernel() else None
        self._kv_write = kernels.kv_write

    def _prefill_chunks(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out) -> None:
        if not self._prefill_fits(q, k_cache):
            super()._prefill_chunks(q, k_cache, v_cache, meta, scale, out)
            return
        layout = meta.prefill_layout()
        out[layout.rows] = self._paged_prefill(
            q[layout.rows],
            k_cache,
            v_cache,
            layout.block_tables,
            layout.starts,
            layout.query_lens,
            layout.context_lens,
            scale,
        )

    def _write_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        if k.dtype == k_cache.dtype and v.dtype == v_cache.dtype:
            self._kv_write(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            write_kv(k, v, k_cache, v_cache, meta)

    def _prefill_fits(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return (
            self._paged_prefill is not None
            and q.dtype == torch.bfloat16
            and k_cache.dtype == torch.bfloat16
            and q.shape[-1] in (64, 128)
            and k_cache.shape[2] % 16 == 0
        )

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self._paged_decode(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale
        )


BACKENDS = {
    "reference": TorchReferenceAttention,
    "sdpa": TorchSdpaAttention,
    "cpu-kernel": CpuKernelAttention,
}


def make_backend(name: str, device: torch.device | str = "cpu") -> AttentionBackend:
    """``auto`` picks the compiled kernel on CPU when it builds, else the torch SDPA path."""
    if name == "auto":
        if torch.device(device).type == "cpu":
            try:
                return CpuKernelAttention()
            except RuntimeError:
                pass
        return TorchSdpaAttention()
    try:
        return BACKENDS[name]()
    except KeyError:
        choices = ", ".join(("auto", *BACKENDS))
        raise ValueError(f"unknown attention backend {name!r}; choose one of {choices}") from None
