"""The decode fast path changes nothing: every timestamp and every metric is bit for bit the one
the step-by-step run produces, across policies, queues, preemption, prefix caching and costs."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jitney.config import CacheConfig, SchedulerConfig
from jitney.sim import LinearCost, Roofline, RooflineCost, TrafficItem, TrafficSpec, generate, run
from jitney.sim.simulator import default_cache_config
from jitney.sim.specs import HARDWARE_PRESETS, MODEL_PRESETS


def _assert_identical(items, sc, cache, cost):
    fast = run(items, sc, cache, cost, fast_path=True)
    slow = run(items, sc, cache, cost, fast_path=False)
    assert fast.num_fast_steps > 0 and slow.num_fast_steps == 0
    assert fast.end_time == slow.end_time
    assert fast.counters.steps == slow.counters.steps
    assert (fast.counters.useful_slots, fast.counters.paid_slots) == (
        slow.counters.useful_slots,
        slow.counters.paid_slots,
    )
    for a, b in zip(fast.requests, slow.requests, strict=True):
        assert (a.first_scheduled_time, a.first_token_time, a.finish_time) == (
            b.first_scheduled_time,
            b.first_token_time,
            b.finish_time,
        )
        assert a.token_times == b.token_times
        assert a.num_preemptions == b.num_preemptions and a.status == b.status
    assert fast.summary().to_dict() == slow.summary().to_dict()
    return fast


@pytest.mark.parametrize("policy", ["static", "continuous", "chunked"])
def test_seed_workload_is_identical_with_and_without_the_fast_path(policy):
    items = generate(TrafficSpec(duration_s=8.0))
    sc = SchedulerConfig(
        max_num_seqs=32,
        max_num_batched_tokens=8192,
        policy=policy,
        long_prefill_token_threshold=512 if policy == "chunked" else 0,
    )
    fast = _assert_identical(items, sc, default_cache_config(items, 32), LinearCost())
    assert fast.num_fast_steps > fast.counters.steps // 2


def test_roofline_cost_whose_steps_grow_with_context_is_identical():
    items = generate(TrafficSpec(rate=4.0, duration_s=4.0, burstiness=0.5))
    sc = SchedulerConfig(max_num_seqs=8, policy="chunked", long_prefill_token_threshold=256)
    cost = RooflineCost(Roofline(MODEL_PRESETS["llama-3-8b"], HARDWARE_PRESETS["l4"], 2e-4))
    _assert_identical(items, sc, default_cache_config(items, 8), cost)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    policy=st.sampled_from(["static", "continuous", "chunked"]),
    queue=st.sampled_from(["fcfs", "priority"]),
    num_blocks=st.integers(30, 200),
    prefix_caching=st.booleans(),
)
def test_random_small_pools_and_queues_are_identical(seed, policy, queue, num_blocks, prefix_caching):
    rng = random.Random(seed)
    t = 0.0
    items = []
    for _ in range(40):
        t += rng.expovariate(200.0)
        items.append(TrafficItem(t, rng.randint(8, 200), rng.randint(2, 90), rng.randint(0, 2)))
    sc = SchedulerConfig(
        max_num_seqs=rng.choice([2, 6, 16]),
        max_num_batched_tokens=256,
        policy=policy,
        long_prefill_token_threshold=rng.choice([0, 32, 100]),
        queue=queue,
    )
    cache = CacheConfig(
        block_size=rng.choice([4, 16]), num_blocks=num_blocks, enable_prefix_caching=prefix_caching
    )
    fast = run(items, sc, cache, LinearCost(), fast_path=True)
    slow = run(items, sc, cache, LinearCost(), fast_path=False)
    assert [r.token_times for r in fast.requests] == [r.token_times for r in slow.requests]
    assert [r.finish_time for r in fast.requests] == [r.finish_time for r in slow.requests]
    assert len(fast.rejected) == len(slow.rejected)
    assert fast.summary().to_dict() == slow.summary().to_dict()
