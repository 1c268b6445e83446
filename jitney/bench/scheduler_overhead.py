"""Scheduler overhead: microseconds of one schedule() + update_from_output() step.

N requests decoding with 1,000 more waiting (max_num_seqs = N, so the queue never drains into the
batch), block size 16, prefix caching on, a pool large enough that nothing is preempted. The
executor is the cheapest possible (a token per sampled chunk) so only scheduling is timed.

    python -m jitney.bench.scheduler_overhead [--running 32,64,128,256,512,1024] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass

from jitney.config import CacheConfig, SchedulerConfig
from jitney.core.outputs import ExecutorResult
from jitney.core.scheduler import Scheduler
from jitney.request import Request, SamplingParams


@dataclass
class OverheadResult:
    running: int
    median_us: float
    p90_us: float
    us_per_running_request: float


def measure(num_running: int, num_waiting: int = 1000, steps: int = 300, seed: int = 0) -> OverheadResult:
    rng = random.Random(seed)
    prompt_len, block_size = 128, 16
    blocks_per_req = -(-(prompt_len + 4096) // block_size)
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=num_running,
            max_num_batched_tokens=max(8192, num_running * prompt_len),
            max_model_len=prompt_len + 4096,
        ),
        CacheConfig(block_size=block_size, num_blocks=blocks_per_req * num_running + 64),
    )
    for i in range(num_running + num_waiting):
        prompt = [rng.randrange(1, 32000) for _ in range(prompt_len)]
        sched.add_request(Request(str(i), prompt, SamplingParams(max_tokens=4096, ignore_eos=True)))
    # Warm up until every running request decodes (the first step admits and prefills them all).
    for _ in range(3):
        out = sched.schedule()
        sched.update_from_output(out, ExecutorResult({c.request_id: 1 for c in out.chunks if c.sample}))
    assert len(sched.running) == num_running

    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        result = ExecutorResult({c.request_id: 1 for c in out.chunks if c.sample})
        sched.update_from_output(out, result)
        samples.append((time.perf_counter() - t0) * 1e6)
    assert sched.num_preemptions_total == 0
    samples.sort()
    median = statistics.median(samples)
    return OverheadResult(num_running, median, samples[int(0.9 * len(samples))], median / num_running)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", default="32,64,128,256,512,1024")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.running.split(",")]
    results = [measure(n, steps=args.steps) for n in sizes]
    print("| running | median µs/step | p90 µs/step | µs per running request |")
    print("|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r.running} | {r.median_us:.0f} | {r.p90_us:.0f} | {r.us_per_running_request:.2f} |")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
