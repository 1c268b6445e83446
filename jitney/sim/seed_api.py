"""The seed's own interface (task 08.1), answered by the real scheduler on a virtual clock.

``Req.arrival`` is in milliseconds, as the seed's docstring says; the linear cost model with the
seed's constants prices every step.
"""

from __future__ import annotations

from dataclasses import dataclass

from jitney.config import SchedulerConfig
from jitney.sim.costs import LinearCost
from jitney.sim.simulator import default_cache_config, run
from jitney.sim.traffic import TrafficItem


@dataclass
class Req:
    rid: int
    arrival: float  # ms from the start of the simulation
    prompt_len: int
    out_len: int
    prefill_done: int = 0
    generated: int = 0
    first_tok: float | None = None  # ms
    finish: float | None = None  # ms


def simulate(
    policy: str,
    requests: list[Req],
    *,
    max_num_seqs: int = 32,
    max_num_batched_tokens: int = 8192,
    chunk: int = 512,
) -> tuple[list[Req], float]:
    """Run ``policy`` ("static" | "continuous" | "chunked") over ``requests``; fill ``first_tok``,
    ``finish``, ``prefill_done`` and ``generated`` on the same objects and return them with the
    total simulated time in milliseconds."""
    ordered = sorted(requests, key=lambda r: r.arrival)
    items = [TrafficItem(r.arrival / 1000.0, r.prompt_len, r.out_len) for r in ordered]
    longest = max((r.prompt_len + r.out_len for r in ordered), default=1)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        policy=policy,
        long_prefill_token_threshold=chunk if policy == "chunked" else 0,
        max_model_len=max(longest, 1),
    )
    result = run(items, config, default_cache_config(items, max_num_seqs), LinearCost())
    if result.rejected:
        item, why = result.rejected[0]
        raise ValueError(f"a request of {item.prompt_len}+{item.output_len} tokens cannot run: {why}")
    for req, done in zip(ordered, result.requests, strict=True):
        assert done.first_token_time is not None and done.finish_time is not None
        req.first_tok = done.first_token_time * 1000.0
        req.finish = done.finish_time * 1000.0
        req.prefill_done = req.prompt_len
        req.generated = done.num_output_tokens
    return requests, result.end_time * 1000.0
