"""The iteration-level scheduler: one class for the engine and the simulator.

Every step starts with a token budget. Running requests are served first (a decode token or the
next prefill chunk); when the KV pool runs dry a victim is preempted (its blocks freed, its
progress reset to zero, recomputed later). Waiting requests are admitted only if this step
preempted nothing and budget and ``max_num_seqs`` allow. There are no prefill or decode phases:
each request just advances ``num_computed_tokens`` toward ``num_tokens``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from jitney.config import CacheConfig, SchedulerConfig
from jitney.core.kv_cache import KVCacheManager
from jitney.core.outputs import ExecutorResult, NewRequestData, ScheduledChunk, SchedulerOutput
from jitney.core.policies import make_policy
from jitney.core.queues import make_waiting_queue
from jitney.request import Request, RequestStatus


class AdmissionError(ValueError):
    """The request can never run with this configuration; it was not queued."""


@dataclass(slots=True)
class RequestDelta:
    """What one step changed for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    step_id: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_preemptions_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = scheduler_config
        self.max_model_len = scheduler_config.max_model_len
        self.cache_config = cache_config
        self.clock = clock
        self.policy = make_policy(scheduler_config)
        self.kv = KVCacheManager(cache_config)
        self.waiting = make_waiting_queue(scheduler_config.queue)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._ended_since_last_step: list[str] = []
        self._wave_size = 0  # static policy: slots the current wave holds
        self.step_id = 0
        self.num_preemptions_total = 0

    # -- entry -----------------------------------------------------------------------------------
    def check_admissible(self, request: Request) -> None:
        """Raise AdmissionError if ``request`` could never run here, saying why and by how much."""
        n_prompt = request.num_prompt_tokens
        if n_prompt == 0:
            raise AdmissionError("the prompt is empty: at least one token is needed")
        max_tokens = request.sampling_params.max_tokens
        total = request.max_total_tokens
        limit = self.config.max_model_len
        if total > limit:
            raise AdmissionError(
                f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) = {total} tokens exceeds "
                f"max_model_len {limit} by {total - limit}"
            )
        need = self.kv.blocks_needed(total)
        have = self.cache_config.num_blocks
        if need > have:
            bs = self.cache_config.block_size
            raise AdmissionError(
                f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) needs {need} KV blocks of "
                f"{bs} tokens, but the whole KV cache holds {have} blocks ({have * bs} tokens): "
                f"{need - have} blocks short"
            )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise AdmissionError(f"request id {request.request_id!r} is already in use")
        self.check_admissible(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    # -- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.step_id += 1
        policy = self.policy
        budget = self.config.max_num_batched_tokens
        use_budget = policy.uses_token_budget
        chunks: dict[str, ScheduledChunk] = {}  # insertion order = execution order
        new_reqs: list[NewRequestData] = []
        preempted: list[str] = []
        kv = self.kv
        now = self.clock()

        # 1. Running requests first.
        idx = 0
        running = self.running
        while idx < len(running):
            if use_budget and budget <= 0:
                break
            req = running[idx]
            remaining = len(req.prompt_token_ids) + len(req.output_token_ids) - req.num_computed_tokens
            # A decode takes one token under every policy; only prefill chunks ask the policy.
            num_new = 1 if remaining == 1 else policy.running_tokens(remaining, budget)
            if num_new <= 0:
                idx += 1
                continue
            new_block_ids = kv.allocate_slots(req, num_new)
            while new_block_ids is None:
                victim = self._pick_victim()
                budget += self._preempt(victim, chunks)
                preempted.append(victim.request_id)
                if victim is req:
                    break
                new_block_ids = kv.allocate_slots(req, num_new)
            if new_block_ids is None:
                continue  # req itself was preempted; running[idx] is now the next one
            chunks[req.request_id] = self._chunk(req, num_new, new_block_ids, now)
            budget -= num_new
            idx = running.index(req) + 1 if preempted else idx + 1

        # 2. Then waiting ones, only if nothing was preempted and room remains.
        num_padding_prefill = 0
        if not preempted and policy.admission_open(len(running)):
            admitted_sizes = []
            while self.waiting and len(running) < self.config.max_num_seqs:
                if use_budget and budget <= 0:
                    break
                req = self.waiting.peek()
                prefix = kv.find_cached_prefix(req)
                num_hit = len(prefix) * kv.block_size
                num_new = policy.admit_tokens(req.num_tokens - num_hit, budget, not chunks)
                if num_new <= 0 or not kv.fits_whole_prompt(req, prefix):
                    break
                new_block_ids = kv.allocate_slots(req, num_new, prefix)
                if new_block_ids is None:
                    break
                self.waiting.pop()
                self._admit(req, num_hit)
                new_reqs.append(
                    NewRequestData(
                        req.request_id,
                        tuple(req.all_token_ids),
                        req.num_prompt_tokens,
                        req.sampling_params,
                        req.eos_token_id,
                    )
                )
                chunks[req.request_id] = self._chunk(req, num_new, new_block_ids, now)
                budget -= num_new
                admitted_sizes.append(num_new)
            if admitted_sizes and not use_budget:  # static: a new wave, padded to its longest prompt
                self._wave_size = len(admitted_sizes)
                num_padding_prefill = max(admitted_sizes) * len(admitted_sizes) - sum(admitted_sizes)

        num_padding_decode = 0
        if not use_budget and running and not new_reqs:
            num_padding_decode = max(self._wave_size - len(chunks), 0)

        ended, self._ended_since_last_step = self._ended_since_last_step, []
        return SchedulerOutput(
            step_id=self.step_id,
            new_requests=new_reqs,
            chunks=list(chunks.values()),
            preempted_ids=preempted,
            finished_ids=ended,
            num_padding_decode_slots=num_padding_decode,
            num_padding_prefill_tokens=num_padding_prefill,
        )

    def _chunk(self, req: Request, num_new: int, new_block_ids: list[int], now: float) -> ScheduledChunk:
        """Record the chunk and advance the request's progress now: if it is preempted later in
        this step, preemption resets its progress to zero anyway."""
        start = req.num_computed_tokens
        end = start + num_new
        req.num_computed_tokens = end
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        n_out = len(req.output_token_ids)
        sample = end == len(req.prompt_token_ids) + n_out
        return ScheduledChunk(
            req.request_id,
            start,
            num_new,
            tuple(new_block_ids),
            sample,
            sample and num_new == 1 and n_out > 0,
        )

    def _admit(self, req: Request, num_hit_tokens: int) -> None:
        if req.num_preemptions == 0:
            self.kv.record_prefix_lookup(req.num_prompt_tokens, num_hit_tokens)
            req.num_cached_prompt_tokens = num_hit_tokens
        req.num_computed_tokens = num_hit_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _pick_victim(self) -> Request:
        if self.config.queue == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, victim: Request, chunks: dict[str, ScheduledChunk]) -> int:
        """Free the victim's blocks and send it back to the front of the queue. Returns the
        budget its chunk had taken this step, if it was already scheduled."""
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.add_preempted(victim)
        undone = chunks.pop(victim.request_id, None)
        return undone.num_tokens if undone is not None else 0

    # -- after the executor ----------------------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, result: ExecutorResult) -> list[RequestDelta]:
        """Append sampled tokens, apply stop rules, free finished requests."""
        now = self.clock()
        sampled = result.sampled_token_ids
        deltas: list[RequestDelta] = []
        for chunk in output.chunks:
            if not chunk.sample:
                continue
            req = self.requests.get(chunk.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # ended (aborted, stopped) while the step ran
            token = sampled[chunk.request_id]
            req.output_token_ids.append(token)
            req.token_times.append(now)
            if req.first_token_time is None:
                req.first_token_time = now
            status = self._stop_status(req, token)
            if status is not None:
                self._end(req, status, now)
            deltas.append(RequestDelta(req.request_id, [token], status.finish_reason if status else None))
        return deltas

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        n_out = len(req.output_token_ids)
        if n_out >= params.max_tokens or n_out + len(req.prompt_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if n_out < params.min_tokens:
            return None
        if (token == req.eos_token_id and not params.ignore_eos) or token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        return None

    def _end(self, req: Request, status: RequestStatus, now: float) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif not self.waiting.remove(req):
            raise AssertionError(f"request {req.request_id} is neither running nor waiting")
        self.kv.free(req)
        req.status = status
        req.finish_time = now
        del self.requests[req.request_id]
        self._ended_since_last_step.append(req.request_id)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests from outside a step (abort, stop string). Unknown ids are ignored: the
        request may have finished on its own meanwhile."""
        if not status.is_finished:
            raise ValueError(f"{status!r} is not a finished status")
        now = self.clock()
        ended = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._end(req, status, now)
                ended.append(req)
        return ended

    def abort(self, request_id: str) -> bool:
        return bool(self.finish_requests([request_id], RequestStatus.FINISHED_ABORTED))

    # -- state -----------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_padding_decode_slots(self) -> int:
        """Static policy: slots the running wave holds beyond its live requests (paid padding)."""
        if self.policy.uses_token_budget or not self.running:
            return 0
        return max(self._wave_size - len(self.running), 0)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def stats(self) -> SchedulerStats:
        prefix = self.kv.prefix_stats
        return SchedulerStats(
            step_id=self.step_id,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage(),
            num_free_blocks=self.kv.num_free_blocks,
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
        )

    def check_invariants(self) -> None:
        """Cross-checks used by tests: queues, block ownership and ref counts agree."""
        self.kv.check_invariants()
        running_ids = {r.request_id for r in self.running}
        waiting_ids = {r.request_id for r in self.waiting}
        if running_ids & waiting_ids:
            raise AssertionError(f"requests both running and waiting: {running_ids & waiting_ids}")
        if running_ids | waiting_ids != set(self.requests):
            raise AssertionError("the request table disagrees with the queues")
        if len(self.running) > self.config.max_num_seqs:
            raise AssertionError(f"{len(self.running)} running > max_num_seqs {self.config.max_num_seqs}")
        for rid in waiting_ids:
            if self.kv.holds(rid):
                raise AssertionError(f"waiting request {rid} still holds KV blocks")
