"""ModelRunner: turns a ``SchedulerOutput`` into one forward pass and one sampled token per request
that asked for one.

The runner mirrors just enough request state to build the batch (token ids, block table, sampling
parameters): it learns requests from ``new_requests``, grows block tables from each chunk's
``new_block_ids``, appends the tokens it samples, and forgets requests listed as finished or
preempted. It never decides anything; the scheduler does.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from jitney.config import CacheConfig
from jitney.core.outputs import ExecutorResult, NewRequestData, ScheduledChunk, SchedulerOutput
from jitney.host_malloc import keep_freed_blocks
from jitney.model.attention import AttentionMetadata, CpuKernelAttention, SequenceSpan, make_backend
from jitney.model.decoder import DecoderModel
from jitney.model.loader import LoadedModel, load_model
from jitney.model.paged_cache import (
    PagedKVCache,
    default_kv_cache_memory,
    kv_bytes_per_block,
    max_concurrency,
    num_blocks_for_memory,
)
from jitney.model.sampler import Sampler, greedy_tokens
from jitney.request import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _RequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_id: int | None
    block_table: list[int] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class _Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # flattened row of each sampling chunk's last token
    sample_ids: list[str]  # request id of each sampled row
    max_position: int


@dataclass
class StepLogits:
    request_ids: list[str]  # one per row of ``logits`` (decodes first, then prefill chunks)
    logits: torch.Tensor  # [len(request_ids), vocab] in the model's dtype


class ModelRunner:
    """Executes scheduled steps on a real model over a paged KV cache."""

    def __init__(
        self,
        model: DecoderModel,
        cache_config: CacheConfig,
        *,
        attention: str = "auto",
        loaded: LoadedModel | None = None,
        seed: int | None = None,
        pack_weights: bool = True,
        num_threads: int | None = None,
    ) -> None:
        apply_thread_setting(num_threads)
        self.model = model
        self.model_config = model.config
        self.cache_config = cache_config
        self.device = model.device
        if self.device.type == "cpu":
            keep_freed_blocks()  # a step's activations reuse the last step's memory
        self.loaded = loaded
        model.backend = make_backend(attention, model.device)
        if isinstance(model.backend, CpuKernelAttention):
            model.use_cpu_kernels()
        if pack_weights and not model.pack_weights():
            log.info("weights stay dense (no oneDNN packing on %s)", model.device)
        self.sampler = Sampler(seed)
        self.kv_cache = PagedKVCache(
            model.config, cache_config.num_blocks, cache_config.block_size, model.dtype, model.device
        )
        self._requests: dict[str, _RequestState] = {}

    @classmethod
    def from_pretrained(
        cls,
        path_or_name: str | Path | None = None,
        *,
        dtype: str | torch.dtype | None = None,
        device: str = "cpu",
        cache_config: CacheConfig | None = None,
        kv_cache_memory: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        attention: str = "auto",
        seed: int | None = None,
        pack_weights: bool = True,
        num_threads: int | None = None,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
    ) -> ModelRunner:
        """Load a checkpoint and size the KV pool: ``cache_config`` as given, else ``kv_cache_memory``
        bytes, else a fixed fraction of free memory (see jitney.model.paged_cache) but no more than
        ``max_num_seqs`` x ``max_model_len`` tokens (the model's context length when not given):
        blocks beyond that can never be used, and the zero-filled pool would only cost memory."""
        loaded = load_model(path_or_name, dtype=dtype, device=device)
        if cache_config is None:
            memory = kv_cache_memory if kv_cache_memory is not None else default_kv_cache_memory(device)
            num_blocks = num_blocks_for_memory(memory, loaded.config, block_size, loaded.model.dtype)
            if kv_cache_memory is None and max_num_seqs is not None:
                model_len = max_model_len or loaded.config.max_position_embeddings
                num_blocks = min(num_blocks, -(-max_num_seqs * model_len // block_size))
            cache_config = CacheConfig(
                block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching
            )
        return cls(
            loaded.model,
            cache_config,
            attention=attention,
            loaded=loaded,
            seed=seed,
            pack_weights=pack_weights,
            num_threads=num_threads,
        )

    def describe_kv_pool(self, max_model_len: int) -> str:
        cc = self.cache_config
        per_block = kv_bytes_per_block(self.model_config, cc.block_size, self.model.dtype)
        return (
            f"KV cache: {cc.num_blocks} blocks x {cc.block_size} tokens "
            f"({cc.num_blocks * per_block / 2**20:.1f} MiB, {self.model.dtype}); "
            f"max concurrency at max_model_len={max_model_len}: "
            f"{max_concurrency(cc.num_blocks, cc.block_size, max_model_len):.2f}x"
        )

    # -- the step ------------------------------------------------------------------------------

    def execute(self, output: SchedulerOutput) -> ExecutorResult:
        start = time.perf_counter()
        step = self.compute_logits(output)
        sampled: dict[str, int] = {}
        logprobs = None
        if step.request_ids:
            token_ids, logprobs = self._sample(step.logits, step.request_ids)
            for request_id, token in zip(step.request_ids, token_ids, strict=True):
                self._requests[request_id].token_ids.append(token)
                sampled[request_id] = token
        return ExecutorResult(
            sampled_token_ids=sampled, logprobs=logprobs, step_seconds=time.perf_counter() - start
        )

    def compute_logits(self, output: SchedulerOutput) -> StepLogits:
        """Run the step's forward pass (KV written, state updated) and return the logits (model
        dtype) of the rows that sample, without sampling. ``execute`` is this plus the sampler."""
        self._update_states(output)
        num_padding = output.num_padding_decode_slots + output.num_padding_prefill_tokens
        if not output.chunks and not num_padding:
            return StepLogits([], torch.empty(0, self.model_config.vocab_size))
        batch = self._build_batch(output)
        hidden = self.model(
            batch.input_ids,
            batch.positions,
            batch.meta,
            self.kv_cache.layers,
            max_position=batch.max_position,
        )
        if not batch.sample_rows:
            return StepLogits([], torch.empty(0, self.model_config.vocab_size))
        rows = torch.tensor(batch.sample_rows, dtype=torch.long, device=self.device)
        return StepLogits(batch.sample_ids, self.model.compute_logits(hidden.index_select(0, rows)))

    def _update_states(self, output: SchedulerOutput) -> None:
        for request_id in (*output.finished_ids, *output.preempted_ids):
            self._requests.pop(request_id, None)
        for new in output.new_requests:
            self._requests[new.request_id] = self._new_state(new)
        for chunk in output.chunks:
            state = self._requests.get(chunk.request_id)
            if state is None:
                raise RuntimeError(f"scheduled request {chunk.request_id!r} was never sent as a new request")
            state.block_table.extend(chunk.new_block_ids)

    @staticmethod
    def _new_state(new: NewRequestData) -> _RequestState:
        return _RequestState(
            list(new.token_ids), new.num_prompt_tokens, new.sampling_params, new.eos_token_id
        )

    def _build_batch(self, output: SchedulerOutput) -> _Batch:
        """Decode rows first (one vectorised attention call), then prefill chunks, then padding."""
        block_size = self.cache_config.block_size
        decodes = [c for c in output.chunks if c.num_tokens == 1]
        prefills = [c for c in output.chunks if c.num_tokens > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        spans: list[SequenceSpan] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []

        for chunk in decodes + prefills:
            state = self._requests[chunk.request_id]
            blocks = self._blocks_for(chunk, state, block_size)
            row = len(input_ids)
            input_ids.extend(state.token_ids[chunk.start : chunk.end])
            positions.extend(range(chunk.start, chunk.end))
            slots.extend(
                blocks[p // block_size] * block_size + p % block_size for p in range(chunk.start, chunk.end)
            )
            if chunk.num_tokens == 1:
                decode_tables.append(blocks)
                decode_lens.append(chunk.end)
            else:
                spans.append(SequenceSpan(row, chunk.num_tokens, chunk.end, self._long(blocks)))
            if chunk.sample:
                sample_rows.append(row + chunk.num_tokens - 1)
                sample_ids.append(chunk.request_id)

        num_padding = output.num_padding_decode_slots + output.num_padding_prefill_tokens
        input_ids.extend([0] * num_padding)
        positions.extend([0] * num_padding)
        width = max((len(t) for t in decode_tables), default=0)
        meta = AttentionMetadata(
            block_size=block_size,
            slot_mapping=self._long(slots),
            num_decode_tokens=len(decodes),
            decode_block_tables=self._long([t + [0] * (width - len(t)) for t in decode_tables]).view(
                len(decode_tables), width
            ),
            decode_context_lens=self._long(decode_lens),
            prefills=spans,
            num_padding_tokens=num_padding,
        )
        max_position = max((c.end - 1 for c in output.chunks), default=0)
        return _Batch(
            self._long(input_ids), self._long(positions), meta, sample_rows, sample_ids, max_position
        )

    @staticmethod
    def _blocks_for(chunk: ScheduledChunk, state: _RequestState, block_size: int) -> list[int]:
        if chunk.end > len(state.token_ids):
            raise RuntimeError(
                f"request {chunk.request_id!r}: chunk ends at {chunk.end}, "
                f"but only {len(state.token_ids)} tokens are known"
            )
        needed = math.ceil(chunk.end / block_size)
        if len(state.block_table) < needed:
            raise RuntimeError(
                f"request {chunk.request_id!r}: {needed} blocks needed for {chunk.end} tokens, "
                f"block table has {len(state.block_table)}"
            )
        return state.block_table[:needed]

    def _long(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    # -- sampling ------------------------------------------------------------------------------

    def _sample(
        self, logits: torch.Tensor, request_ids: list[str]
    ) -> tuple[list[int], dict[str, Any] | None]:
        states = [self._requests[r] for r in request_ids]
        if all(_plain_greedy(s) for s in states):
            # Fast path: no logit processing needed, the argmax stays on tensors.
            return greedy_tokens(logits).tolist(), None
        from jitney.model.sampler import SamplingRow

        rows = [SamplingRow(s.params, s.num_output_tokens, s.eos_token_id) for s in states]
        result = self.sampler(logits, rows)
        logprobs = None
        if result.logprobs is not None:
            logprobs = {
                request_id: entry
                for request_id, entry in zip(request_ids, result.logprobs, strict=True)
                if entry is not None
            }
        return list(result.token_ids), logprobs


def apply_thread_setting(num_threads: int | None = None) -> int:
    """Set torch's intra-op thread count: ``num_threads``, else $JITNEY_NUM_THREADS, else torch's
    default (one per physical core). Returns the count in use.

    Why it is overridable: every matmul of a step is an OpenMP parallel region that waits for all
    its threads. On a machine whose cores are also busy with other processes, a descheduled thread
    stalls each region for a scheduler time slice, and with ~150 regions per step a 2-thread decode
    step measured 25x slower than a 1-thread one here; on an idle machine 2 threads are faster.
    """
    if num_threads is None:
        env = os.environ.get("JITNEY_NUM_THREADS", "").strip()
        if env:
            if not env.isdigit() or int(env) < 1:
                raise ValueError(f"JITNEY_NUM_THREADS must be a positive integer, got {env!r}")
            num_threads = int(env)
    if num_threads is not None:
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be a positive integer, got {num_threads!r}")
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()


def _plain_greedy(state: _RequestState) -> bool:
    p = state.params
    return p.greedy and p.logprobs is None and state.num_output_tokens >= p.min_tokens
