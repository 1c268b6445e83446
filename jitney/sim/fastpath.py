"""Advance several pure-decode steps at once, when the scheduler's decision is known in advance.

A run of steps can be skipped over only when nothing the scheduler looks at can change during it:
every running request decodes exactly one token, nobody can be admitted (the queue is empty,
``max_num_seqs`` is reached, or a static wave runs), no arrival lands before a step starts, and the
KV pool has room for every block the window needs, so no preemption can occur. Then each step's
shape is known (decode count fixed, context growing by one token per request) and the state change
is the one ``update_from_output`` makes: one dummy token and one timestamp per request per step.
Requests reaching their length limit on the window's last step are ended through the scheduler's
own ``finish_requests`` at that step's end time, as ``update_from_output`` would end them.

The clock advances by the same sums in the same order as step by step, so every timestamp is bit
for bit the one the slow path stamps (tests/test_sim_fastpath.py proves it on whole runs).
"""

from __future__ import annotations

from jitney.core.scheduler import Scheduler
from jitney.request import RequestStatus
from jitney.sim.costs import CostModel
from jitney.sim.executor import DUMMY_TOKEN, SlotCounters, VirtualClock
from jitney.sim.roofline import StepShape


def advance_decodes(
    sched: Scheduler,
    clock: VirtualClock,
    cost: CostModel,
    counters: SlotCounters,
    next_arrival: float,
    padding_slots: int,
    max_steps: int = 1 << 30,
) -> int:
    """Run up to ``max_steps`` pure-decode steps without calling ``schedule()``; returns how many
    (0 when the next step is not such a step, or fewer than two would fit)."""
    running = sched.running
    n = len(running)
    if n == 0:
        return 0
    cfg = sched.config
    uses_budget = sched.policy.uses_token_budget
    if len(sched.waiting) and uses_budget and n < cfg.max_num_seqs:
        return 0  # someone could be admitted
    if uses_budget and n > cfg.max_num_batched_tokens:
        return 0
    k = max_steps
    context = 0
    max_model_len = cfg.max_model_len
    for req in running:
        n_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
        if n_tokens - req.num_computed_tokens != 1 or not req.output_token_ids:
            return 0
        params = req.sampling_params
        if DUMMY_TOKEN in params.stop_token_ids or (
            req.eos_token_id == DUMMY_TOKEN and not params.ignore_eos
        ):
            return 0
        # Tokens this request still produces; the one that reaches the limit ends it.
        left = min(params.max_tokens - len(req.output_token_ids), max_model_len - n_tokens)
        if left < k:
            k = left
        context += n_tokens
    if k < 2:
        return 0

    # Shrink the window until the pool covers every block it needs. A running request holds
    # exactly the blocks its computed tokens fill, so the count needs no block table.
    bs = sched.kv.block_size
    free = sched.kv.num_free_blocks
    while k >= 2:
        need = 0
        for req in running:
            c = req.num_computed_tokens
            need += -(-(c + k) // bs) + (-c // bs)  # ceil((c+k)/bs) - ceil(c/bs)
        if need <= free:
            break
        k //= 2
    if k < 2:
        return 0

    # Step costs and timestamps, stopping before a step that would start at or after an arrival.
    times: list[float] = []
    decode_slots = n + padding_slots
    now = clock.now
    step_seconds = cost.step_seconds
    const_dt = None if getattr(cost, "context_sensitive", True) else step_seconds(StepShape(0, decode_slots))
    busy = counters.busy_seconds
    for _ in range(k):
        if times and now >= next_arrival:
            break
        dt = const_dt if const_dt is not None else step_seconds(StepShape(0, decode_slots, context, context))
        now += dt
        busy += dt
        times.append(now)
        context += n
    k = len(times)
    clock.now = now
    counters.busy_seconds = busy

    kv = sched.kv
    skip_empty = not kv.enable_prefix_caching  # then allocation only adds blocks, nothing to register
    ended = []
    dummies = [DUMMY_TOKEN] * k
    for req in running:
        c = req.num_computed_tokens
        if not (skip_empty and -(-(c + k) // bs) == -(-c // bs)):
            if kv.allocate_slots(req, k) is None:  # cannot happen: room was checked above
                raise AssertionError(f"KV pool ran dry inside a decode window for {req.request_id}")
        req.num_computed_tokens = c + k
        out = req.output_token_ids
        out.extend(dummies)
        req.token_times.extend(times)
        if (
            len(out) >= req.sampling_params.max_tokens
            or len(req.prompt_token_ids) + len(out) >= max_model_len
        ):
            ended.append(req.request_id)
    sched.step_id += k
    counters.steps += k
    counters.useful_slots += n * k
    counters.paid_slots += decode_slots * k
    if ended:
        sched.finish_requests(ended, RequestStatus.FINISHED_LENGTH)
    return k
