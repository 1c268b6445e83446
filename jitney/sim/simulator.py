"""Drive the real ``Scheduler`` on a virtual clock over a list of arrivals.

Arrivals enter the scheduler once the clock has passed them; an idle engine jumps to the next
arrival. Each step: ``schedule()``, the ``SimExecutor`` charges the step's cost to the clock,
``update_from_output()`` stamps the tokens. Runs of pure-decode steps go through the fast path
(``jitney.sim.fastpath``) unless it is switched off.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from jitney.config import CacheConfig, SchedulerConfig
from jitney.core.scheduler import AdmissionError, Scheduler
from jitney.metrics import SLO, RequestRecord, Summary, from_request, slot_utilization, summarize
from jitney.request import Request, SamplingParams
from jitney.sim.costs import CostModel
from jitney.sim.executor import SimExecutor, SlotCounters, VirtualClock
from jitney.sim.fastpath import advance_decodes
from jitney.sim.traffic import TrafficItem


@dataclass
class Timeline:
    """Scheduler state sampled at the start of every scheduled step (once per fast-path window)."""

    time: list[float] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)
    num_waiting: list[int] = field(default_factory=list)
    num_running: list[int] = field(default_factory=list)

    def sample(self, now: float, sched: Scheduler) -> None:
        self.time.append(now)
        self.kv_usage.append(sched.kv.usage())
        self.num_waiting.append(sched.num_waiting)
        self.num_running.append(len(sched.running))


@dataclass
class SimResult:
    label: str
    requests: list[Request]
    rejected: list[tuple[TrafficItem, str]]
    end_time: float  # seconds on the virtual clock; the run starts at 0
    counters: SlotCounters
    num_fast_steps: int
    timeline: Timeline | None = None

    def records(self) -> list[RequestRecord]:
        recs = [from_request(r) for r in self.requests]
        recs += [
            RequestRecord(it.arrival, None, None, it.prompt_len, 0, success=False, error=why)
            for it, why in self.rejected
        ]
        return recs

    @property
    def slot_utilization(self) -> float | None:
        c = self.counters
        return slot_utilization(c.useful_slots, c.paid_slots) if c.paid_slots else None

    def summary(self, slo: SLO | None = None) -> Summary:
        """Metrics over the run; its duration is the virtual time from 0 to the last step."""
        with gc_paused():
            records = self.records()
            return summarize(records, duration=self.end_time, slo=slo, slot_utilization=self.slot_utilization)

    @property
    def all_finished(self) -> bool:
        return all(r.finish_time is not None for r in self.requests)


def default_cache_config(
    items: list[TrafficItem], max_num_seqs: int, block_size: int = 16, enable_prefix_caching: bool = False
) -> CacheConfig:
    """A pool that holds ``max_num_seqs`` of the longest requests: nothing is ever preempted,
    as in the seed's simulator, which has no KV limit."""
    CacheConfig(block_size=block_size, num_blocks=1)  # validates block_size before it divides
    longest = max((it.prompt_len + it.output_len for it in items), default=1)
    return CacheConfig(
        block_size=block_size,
        num_blocks=max_num_seqs * math.ceil(longest / block_size),
        enable_prefix_caching=enable_prefix_caching,
    )


class _PromptTokens:
    """Prompt token ids for simulated requests. Without prefix caching every request of a length
    shares one list (the scheduler never writes to prompts) so an hour of traffic stays small;
    with it, each request gets its own token value so prompts never share a prefix by accident."""

    def __init__(self, distinct: bool) -> None:
        self.distinct = distinct
        self._shared: dict[int, list[int]] = {}

    def get(self, index: int, length: int) -> list[int]:
        if self.distinct:
            return [index + 1] * length
        tokens = self._shared.get(length)
        if tokens is None:
            tokens = self._shared[length] = [1] * length
        return tokens


@contextmanager
def gc_paused() -> Iterator[None]:
    """A simulation allocates millions of small objects that live to the end of the run (requests,
    token lists, timestamps); Python's cyclic collector would rescan them again and again. Their
    garbage is freed by reference counting meanwhile; any cycle waits for the collector's return."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def run(
    items: list[TrafficItem],
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    cost: CostModel,
    *,
    label: str | None = None,
    fast_path: bool = True,
    record_timeline: bool = False,
    max_steps: int = 100_000_000,
) -> SimResult:
    """Simulate ``items`` (sorted by arrival) through one scheduler configuration."""
    if any(b.arrival < a.arrival for a, b in zip(items, items[1:], strict=False)):
        raise ValueError("traffic items must be sorted by arrival time")
    with gc_paused():
        return _run(items, scheduler_config, cache_config, cost, label, fast_path, record_timeline, max_steps)


def _run(
    items: list[TrafficItem],
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    cost: CostModel,
    label: str | None,
    fast_path: bool,
    record_timeline: bool,
    max_steps: int,
) -> SimResult:
    clock = VirtualClock()
    sched = Scheduler(scheduler_config, cache_config, clock=clock)
    executor = SimExecutor(cost, clock)
    prompts = _PromptTokens(cache_config.enable_prefix_caching)
    timeline = Timeline() if record_timeline else None
    requests: list[Request] = []
    rejected: list[tuple[TrafficItem, str]] = []
    num_fast = 0
    i, n = 0, len(items)

    while i < n or sched.has_unfinished():
        while i < n and items[i].arrival <= clock.now:
            it = items[i]
            req = Request(
                str(i),
                prompts.get(i, it.prompt_len),
                SamplingParams(max_tokens=it.output_len, ignore_eos=True),
                priority=it.priority,
                arrival_time=it.arrival,
            )
            try:
                sched.add_request(req)
                requests.append(req)
            except AdmissionError as exc:
                rejected.append((it, str(exc)))
            i += 1
        if not sched.has_unfinished():
            if i < n:
                clock.now = max(clock.now, items[i].arrival)
            continue
        if executor.counters.steps >= max_steps:
            raise RuntimeError(f"simulation exceeded {max_steps} steps at t={clock.now:.3f} s")
        next_arrival = items[i].arrival if i < n else math.inf

        if timeline is not None:
            timeline.sample(clock.now, sched)
        if fast_path:
            padding = sched.num_padding_decode_slots
            k = advance_decodes(sched, clock, cost, executor.counters, next_arrival, padding)
            if k:
                num_fast += k
                continue

        out = sched.schedule()
        if out.is_empty:
            if i < n:
                clock.now = max(clock.now, next_arrival)  # nothing runnable until more traffic
                continue
            raise RuntimeError(
                f"scheduler made no progress with {sched.num_waiting} waiting and "
                f"{len(sched.running)} running requests at t={clock.now:.3f} s"
            )
        result = executor.execute(out)
        sched.update_from_output(out, result)

    return SimResult(
        label=label or scheduler_config.policy,
        requests=requests,
        rejected=rejected,
        end_time=clock.now,
        counters=executor.counters,
        num_fast_steps=num_fast,
        timeline=timeline,
    )
