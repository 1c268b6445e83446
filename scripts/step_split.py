"""The peers workload (200 requests, `jitney.bench.peers.make_workload`) through `LLM.generate`
in this process: output tok/s, and the wall time split into prefill-carrying and pure decode
steps, the decode steps by batch size.

    .venv/bin/python scripts/step_split.py [MODEL_DIR] [--num-requests 200]

MODEL_DIR defaults to the bf16 copy `make bench-peers` converts (.cache/smollm2-135m-bf16).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from jitney import LLM, SamplingParams
from jitney.bench.peers import make_workload, read_vocab_size
from jitney.engine import StepRecord


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=".cache/smollm2-135m-bf16")
    parser.add_argument("--num-requests", type=int, default=200)
    args = parser.parse_args()

    llm = LLM(model=args.model, dtype="bfloat16")
    steps: list[StepRecord] = []
    requests = make_workload(read_vocab_size(Path(args.model)), args.num_requests)
    prompts = [list(r.prompt_token_ids) for r in requests]
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests]
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4, ignore_eos=True)] * 2, use_tqdm=False)  # warm-up
    llm.engine.step_listeners.append(steps.append)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outputs)
    prefill = [s for s in steps if s.prefill_tokens]
    decode = [s for s in steps if not s.prefill_tokens]
    print(f"{produced} output tokens in {wall:.1f} s: {produced / wall:.0f} output tok/s, {len(steps)} steps")
    print(
        f"prefill-carrying steps: {len(prefill)}, {sum(s.ms for s in prefill) / 1e3:.1f} s, "
        f"{sum(s.prefill_tokens for s in prefill)} prompt tokens"
    )
    print(f"pure decode steps: {len(decode)}, {sum(s.ms for s in decode) / 1e3:.1f} s")
    for lo, hi in ((1, 32), (32, 96), (96, 160), (160, 1 << 20)):
        band = [s for s in decode if lo <= s.decode_tokens < hi]
        if band:
            context = sum(s.context_tokens for s in band) / sum(s.decode_tokens for s in band)
            print(
                f"  batch {lo}-{min(hi - 1, max(s.decode_tokens for s in band))}: {len(band)} steps, "
                f"median {statistics.median(s.ms for s in band):.1f} ms, mean context {context:.0f}"
            )


if __name__ == "__main__":
    main()
