"""Where a batched decode step's time goes: cProfile over decode steps of N sequences.

    .venv/bin/python scripts/profile_decode.py [MODEL] [--seqs 128] [--steps 10]

Prints the wall time of the steps (timed once without the profiler, then profiled) and the
functions with the most time of their own. cProfile rather than torch.profiler: the compiled CPU
kernels (attention, the pairs linear, norms, rotary, KV writes) are called directly, not through
the torch dispatcher, so torch.profiler does not see them, while cProfile counts each as one call.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

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
    params = SamplingParams(temperature=0, max_tokens=2 * args.steps + 8, ignore_eos=True)
    engine = llm.engine
    for p in prompts:
        engine.add_request(engine.make_request(p, params))
    prefill_everything(engine)
    engine.step()  # the first decode step after prefill allocates its buffers
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = time.perf_counter() - start
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(args.steps):
        engine.step()
    profiler.disable()
    profiled = time.perf_counter() - start
    print(
        f"{args.steps} decode steps of {len(engine.scheduler.running)} sequences: {wall:.2f} s wall "
        f"({profiled:.2f} s under cProfile)"
    )
    pstats.Stats(profiler).sort_stats("tottime").print_stats(10)


if __name__ == "__main__":
    main()
