"""Where a batched decode step's time goes: torch.profiler over decode steps of N sequences.

    .venv/bin/python scripts/profile_decode.py [MODEL] [--seqs 128] [--steps 10]

Prints the wall time of the profiled steps, the time inside recorded torch ops, and the top ops.
Time outside recorded ops is the compiled CPU attention kernel (called directly, not through the
torch dispatcher) plus Python.
"""

from __future__ import annotations

import argparse
import random
import time

from torch.profiler import ProfilerActivity, profile

from jitney import LLM, SamplingParams
from jitney.bench.step_floor import prefill_everything


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--seqs", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.seqs, max_model_len=2048)
    rng = random.Random(0)
    vocab = llm.tokenizer.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(100, 400))] for _ in range(args.seqs)]
    params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
    engine = llm.engine
    for p in prompts:
        engine.add_request(engine.make_request(p, params))
    prefill_everything(engine)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    wall = time.perf_counter() - start
    recorded = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6
    print(f"{args.steps} decode steps of {len(engine.scheduler.running)} sequences: {wall:.2f} s wall, "
          f"{recorded:.2f} s inside recorded torch ops")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main()
