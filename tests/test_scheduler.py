"""The scheduler driven by an executor that returns one token per sampled chunk.

The properties run every policy and queue over random arrivals, lengths and pool sizes
(including pools small enough that preemption is frequent).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jitney.config import CacheConfig, ConfigError, SchedulerConfig
from jitney.core.outputs import ExecutorResult, SchedulerOutput
from jitney.core.scheduler import AdmissionError, Scheduler
from jitney.request import Request, RequestStatus, SamplingParams


def token_executor(output: SchedulerOutput, token: int = 7) -> ExecutorResult:
    return ExecutorResult({c.request_id: token for c in output.chunks if c.sample})


def make_request(rid: str, prompt: list[int], max_tokens: int, **kw) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), **kw)


@dataclass
class Workload:
    policy: str
    queue: str
    budget: int
    max_num_seqs: int
    block_size: int
    num_blocks: int
    chunk_cap: int
    # (arrival step, prompt len, output len, priority, prefix id)
    requests: list[tuple[int, int, int, int, int]]


@st.composite
def workloads(draw) -> Workload:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_prompt, max_out = 48, 24
    # Smallest pool that still admits the largest possible request, up to a roomy one.
    min_blocks = -(-(max_prompt + max_out) // block_size)
    num_blocks = draw(st.integers(min_blocks, min_blocks * 6))
    reqs = draw(
        st.lists(
            st.tuples(
                st.integers(0, 30),
                st.integers(1, max_prompt),
                st.integers(1, max_out),
                st.integers(0, 3),
                st.integers(0, 2),
            ),
            min_size=1,
            max_size=25,
        )
    )
    return Workload(
        policy=draw(st.sampled_from(["static", "continuous", "chunked"])),
        queue=draw(st.sampled_from(["fcfs", "priority"])),
        budget=draw(st.integers(8, 96)),
        max_num_seqs=draw(st.integers(1, 10)),
        block_size=block_size,
        num_blocks=num_blocks,
        chunk_cap=draw(st.sampled_from([0, 5, 16])),
        requests=sorted(reqs, key=lambda r: r[0]),
    )


def build(w: Workload) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=w.max_num_seqs,
            max_num_batched_tokens=w.budget,
            policy=w.policy,
            queue=w.queue,
            long_prefill_token_threshold=w.chunk_cap,
            max_model_len=1024,
        ),
        CacheConfig(block_size=w.block_size, num_blocks=w.num_blocks),
    )


def prompt_for(prefix_id: int, length: int, salt: int) -> list[int]:
    """Requests with the same prefix id share their first tokens, so prefix caching is exercised."""
    shared = [100 + prefix_id] * 32
    return (shared + [salt % 97 + 1000] * length)[:length]


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_scheduler_invariants(w: Workload) -> None:
    sched = build(w)
    pending = list(enumerate(w.requests))
    all_reqs: list[Request] = []
    step = 0
    step_limit = 200 + sum((p + o) * 4 for _, p, o, _, _ in w.requests)
    while pending or sched.has_unfinished():
        while pending and pending[0][1][0] <= step:
            i, (_, p, o, prio, prefix) = pending.pop(0)
            req = make_request(str(i), prompt_for(prefix, p, i), o, priority=prio, arrival_time=float(i))
            sched.add_request(req)
            all_reqs.append(req)
        running_before = list(sched.running)
        out = sched.schedule()
        step += 1
        assert step < step_limit, "requests did not finish in a bounded number of steps"

        new_ids = {n.request_id for n in out.new_requests}
        if w.policy == "chunked" or (w.policy == "continuous" and len(out.chunks) > 1):
            assert out.total_num_scheduled_tokens <= w.budget  # continuous: oversized prompts run alone
        assert len(sched.running) <= w.max_num_seqs
        # Running requests are served before new ones.
        seen_new = False
        for chunk in out.chunks:
            if chunk.request_id in new_ids:
                seen_new = True
            else:
                assert not seen_new, "a running request was scheduled after a new one"
        # No admission in a step that preempted.
        if out.preempted_ids:
            assert not out.new_requests
            check_victims(w.queue, running_before, out.preempted_ids)
        for rid in out.preempted_ids:
            victim = next(r for r in all_reqs if r.request_id == rid)
            assert victim.status is RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
        sched.check_invariants()
        sched.update_from_output(out, token_executor(out))
        sched.check_invariants()

    for req in all_reqs:
        assert req.status is RequestStatus.FINISHED_LENGTH
        assert req.num_output_tokens == req.sampling_params.max_tokens
    assert sched.kv.num_free_blocks == w.num_blocks
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)
    assert sched.kv.num_held_requests() == 0 and not sched.requests


def check_victims(queue: str, running_before: list[Request], preempted: list[str]) -> None:
    """FCFS evicts from the back of running; priority evicts the largest (priority, arrival)."""
    if queue == "fcfs":
        expected = [r.request_id for r in reversed(running_before)][: len(preempted)]
        assert preempted == expected
    else:
        worst = max(running_before, key=lambda r: (r.priority, r.arrival_time))
        assert preempted[0] == worst.request_id


def run_to_completion(sched: Scheduler, limit: int = 10_000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        out = sched.schedule()
        outs.append(out)
        sched.update_from_output(out, token_executor(out))
        assert len(outs) < limit
    return outs


def test_shared_prefix_shares_blocks() -> None:
    sched = Scheduler(SchedulerConfig(), CacheConfig(block_size=16, num_blocks=64))
    prefix = list(range(1, 65))
    a = make_request("a", prefix + [500, 501], 4)
    b = make_request("b", prefix + [600], 4)
    sched.add_request(a)
    sched.update_from_output(out := sched.schedule(), token_executor(out))
    sched.add_request(b)
    out = sched.schedule()
    new_b = next(c for c in out.chunks if c.request_id == "b")
    assert new_b.start == 64  # 4 full blocks hit, only the tail is computed
    assert sched.kv.block_ids("a")[:4] == sched.kv.block_ids("b")[:4]
    assert all(sched.kv.pool.blocks[i].ref_cnt == 2 for i in sched.kv.block_ids("a")[:4])
    assert sched.stats().prefix_cache_hits == 64
    sched.update_from_output(out, token_executor(out))
    run_to_completion(sched)
    assert sched.kv.num_free_blocks == 64


def test_never_the_last_prompt_token_from_cache() -> None:
    sched = Scheduler(SchedulerConfig(), CacheConfig(block_size=4, num_blocks=32))
    prompt = list(range(1, 17))  # exactly 4 full blocks
    sched.add_request(make_request("a", prompt, 2))
    run_to_completion(sched)
    sched.add_request(make_request("b", prompt, 2))
    out = sched.schedule()
    (chunk,) = out.chunks
    assert chunk.start == 12 and chunk.num_tokens == 4 and chunk.sample


def test_preempted_request_recomputes_and_reuses_its_cached_prefix() -> None:
    # 10 blocks of 4 tokens: two requests of 16-token prompts growing to 24 tokens cannot coexist.
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64), CacheConfig(block_size=4, num_blocks=10)
    )
    a = make_request("a", list(range(1, 17)), 8)
    b = make_request("b", list(range(101, 117)), 8)
    sched.add_request(a)
    sched.add_request(b)
    outs = run_to_completion(sched)
    preempting = [o for o in outs if o.preempted_ids]
    assert preempting and preempting[0].preempted_ids == ["b"]
    resumed = next(o for o in outs[outs.index(preempting[0]) + 1 :] if o.new_requests)
    (data,) = resumed.new_requests
    chunk = next(c for c in resumed.chunks if c.request_id == data.request_id)
    assert b.num_preemptions >= 1
    # Resumed with its generated tokens as part of the prompt to recompute ...
    assert len(data.token_ids) > data.num_prompt_tokens
    # ... and what had not been evicted was found in the prefix cache.
    assert chunk.start > 0
    assert a.num_output_tokens == b.num_output_tokens == 8
    assert sched.kv.num_free_blocks == 10


def test_abort_frees_blocks_in_every_state() -> None:
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32),
        CacheConfig(block_size=4, num_blocks=20),
    )
    reqs = [make_request(str(i), list(range(1 + i * 50, 41 + i * 50)), 10) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()  # "0" gets a 32-token chunk: running mid-prefill; the others wait
    assert [c.request_id for c in out.chunks] == ["0"]
    sched.update_from_output(out, token_executor(out))
    assert sched.abort("0")  # running
    assert sched.abort("2")  # waiting
    assert not sched.abort("nope")
    run_to_completion(sched)
    assert sched.kv.num_free_blocks == 20
    assert reqs[0].status is RequestStatus.FINISHED_ABORTED
    assert reqs[2].status is RequestStatus.FINISHED_ABORTED
    assert reqs[1].status is RequestStatus.FINISHED_LENGTH
    sched.check_invariants()


def test_abort_of_preempted_request() -> None:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), CacheConfig(block_size=4, num_blocks=10))
    sched.add_request(make_request("a", list(range(1, 17)), 8))
    sched.add_request(make_request("b", list(range(101, 117)), 8))
    while True:
        out = sched.schedule()
        sched.update_from_output(out, token_executor(out))
        if out.preempted_ids:
            break
    victim = out.preempted_ids[0]
    assert sched.requests[victim].status is RequestStatus.PREEMPTED
    assert sched.abort(victim)
    run_to_completion(sched)
    assert sched.kv.num_free_blocks == 10
    sched.check_invariants()


def test_never_fitting_request_rejected_at_entry_others_run() -> None:
    sched = Scheduler(
        SchedulerConfig(max_model_len=256), CacheConfig(block_size=16, num_blocks=8)
    )
    sched.add_request(make_request("ok", [1] * 20, 5))
    with pytest.raises(AdmissionError, match=r"needs 9 KV blocks.*holds 8 blocks.*1 blocks short"):
        sched.add_request(make_request("big", [1] * 120, 16))
    with pytest.raises(AdmissionError, match=r"exceeds max_model_len 256 by 44"):
        sched.add_request(make_request("long", [1] * 200, 100))
    with pytest.raises(AdmissionError, match="empty"):
        sched.add_request(make_request("empty", [], 5))
    assert sched.num_waiting == 1
    run_to_completion(sched)
    assert sched.kv.num_free_blocks == 8


def test_stop_rules() -> None:
    sched = Scheduler(SchedulerConfig(), CacheConfig(block_size=4, num_blocks=64))
    eos = Request("eos", [1, 2, 3], SamplingParams(max_tokens=10), eos_token_id=7)
    ign = Request("ign", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), eos_token_id=7)
    mint = Request("min", [1, 2, 3], SamplingParams(max_tokens=10, min_tokens=4), eos_token_id=7)
    stop = Request("stop", [1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[7]))
    for r in (eos, ign, mint, stop):
        sched.add_request(r)
    run_to_completion(sched)  # the executor always returns token 7
    assert eos.output_token_ids == [7] and eos.status is RequestStatus.FINISHED_STOPPED
    assert ign.output_token_ids == [7, 7, 7] and ign.status is RequestStatus.FINISHED_LENGTH
    assert mint.num_output_tokens == 4 and mint.status is RequestStatus.FINISHED_STOPPED
    assert stop.output_token_ids == [7] and stop.status is RequestStatus.FINISHED_STOPPED


def test_chunked_prefill_shares_steps_with_decodes() -> None:
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=32, long_prefill_token_threshold=16),
        CacheConfig(block_size=4, num_blocks=100),
    )
    sched.add_request(make_request("short", [1] * 4, 20))
    out = sched.schedule()
    sched.update_from_output(out, token_executor(out))
    sched.add_request(make_request("long", [2] * 100, 2))
    out = sched.schedule()
    by_id = {c.request_id: c for c in out.chunks}
    assert by_id["short"].is_decode and by_id["short"].num_tokens == 1
    assert by_id["long"].num_tokens == 16 and not by_id["long"].sample


def test_continuous_never_splits_and_runs_oversized_prompt_alone() -> None:
    sched = Scheduler(
        SchedulerConfig(policy="continuous", max_num_batched_tokens=32),
        CacheConfig(block_size=4, num_blocks=200),
    )
    sched.add_request(make_request("a", [1] * 20, 3))
    sched.add_request(make_request("b", [2] * 20, 3))  # does not fit what a left: waits whole
    sched.add_request(make_request("huge", [3] * 100, 2))
    outs = run_to_completion(sched)
    for out in outs:
        for c in out.chunks:
            if not c.is_decode:
                assert c.start == 0 or c.sample  # whole prompt in one step
    first = outs[0]
    assert [c.request_id for c in first.chunks] == ["a"]
    huge_step = next(o for o in outs if any(c.request_id == "huge" for c in o.chunks))
    assert [c.request_id for c in huge_step.chunks] == ["huge"]  # alone in its step


def test_static_waves_hold_slots_and_pad() -> None:
    sched = Scheduler(
        SchedulerConfig(policy="static", max_num_seqs=8, max_num_batched_tokens=64),
        CacheConfig(block_size=16, num_blocks=1000),
    )
    # The seeds' example: one request of 2,000 output tokens and seven of 50.
    sched.add_request(make_request("long", [1] * 10, 2000))
    for i in range(7):
        sched.add_request(make_request(f"s{i}", [1] * 10, 50))
    outs = run_to_completion(sched)
    assert len(outs) == 2000  # one prefill step + 1,999 decode steps
    useful = sum(len(o.chunks) for o in outs[1:])
    paid = sum(len(o.chunks) + o.num_padding_decode_slots for o in outs[1:])
    assert paid == 8 * 1999
    # Slot utilisation counting the prefill step's first tokens: (2000 + 7*50) / (8 * 2000).
    assert (useful + 8) / (paid + 8) == pytest.approx(2350 / 16000)
    # A new arrival waits for the whole wave to end.
    sched.add_request(make_request("x", [5] * 30, 3))
    sched.add_request(make_request("y", [5] * 10, 3))
    out = sched.schedule()
    assert out.num_padding_prefill_tokens == 20  # y padded to x's 30 tokens


def test_priority_queue_orders_admission() -> None:
    sched = Scheduler(
        SchedulerConfig(queue="priority", max_num_seqs=1), CacheConfig(block_size=4, num_blocks=64)
    )
    for rid, prio in [("low", 5), ("high", 0), ("mid", 2)]:
        sched.add_request(make_request(rid, [1, 2, 3], 1, priority=prio))
    order = []
    while sched.has_unfinished():
        out = sched.schedule()
        order += [n.request_id for n in out.new_requests]
        sched.update_from_output(out, token_executor(out))
    assert order == ["high", "mid", "low"]


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"SchedulerConfig.max_num_seqs must be an integer in \[1"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ConfigError, match="policy must be one of static, continuous, chunked"):
        SchedulerConfig(policy="fast")
    with pytest.raises(ConfigError, match="CacheConfig.block_size"):
        CacheConfig(block_size=0)


def test_lru_eviction_takes_least_recently_freed_and_deepest_first() -> None:
    sched = Scheduler(SchedulerConfig(), CacheConfig(block_size=2, num_blocks=8))
    sched.add_request(make_request("a", [1, 2, 3, 4, 5], 1))  # 3 blocks: [1,2] [3,4] [5,out]
    run_to_completion(sched)
    # Never-used blocks first, then a's blocks deepest first: its head block is evicted last.
    free_order = [b.block_id for b in sched.kv.pool.free_queue]
    a_ids = free_order[-3:]
    # The deepest block is not cached: its last token (the sampled one) never had its KV computed.
    assert [sched.kv.pool.blocks[i].block_hash is not None for i in a_ids] == [False, True, True]
    # b needs 6 blocks (11 prompt + 1 output tokens): the 5 unused ones and a's deepest.
    sched.add_request(make_request("b", list(range(50, 61)), 1))
    out = sched.schedule()
    assert set(out.chunks[0].new_block_ids) == set(free_order[:6])
    sched.update_from_output(out, token_executor(out))
    run_to_completion(sched)
    # a's first two blocks survived: the same prompt hits 4 cached tokens.
    sched.add_request(make_request("c", [1, 2, 3, 4, 5], 1))
    out = sched.schedule()
    assert out.chunks[0].start == 4
    sched.update_from_output(out, token_executor(out))
    run_to_completion(sched)
    sched.check_invariants()
