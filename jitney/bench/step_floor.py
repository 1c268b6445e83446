"""jitney's decode step against this machine's roofline floor (``make bench-peers`` runs it).

    python -m jitney.bench.step_floor --model DIR [--batches 1 32] [--context 512] [--json FILE]

For each batch size: start that many requests with ``--context``-token prompts, run them until
every prompt is in the cache, then time ``--steps`` pure decode steps (median). The floor is
``jitney roofline --hardware local`` for the same model and shape, measured in the same process
just before: max(bytes moved / measured bandwidth, FLOPs / measured matmul rate). The fraction is
floor / measured step, so 1.0 would be a step that runs at the machine's measured limits.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from jitney.bench.peers import split_marked_section, write_marked_section


@dataclass(frozen=True)
class StepFloor:
    batch: int
    context: int
    measured_ms: float
    floor_ms: float
    bound: str  # "memory" or "compute": which side of the roofline sets the floor

    @property
    def fraction(self) -> float:
        return self.floor_ms / self.measured_ms


def prefill_everything(engine) -> None:
    """Step until no request is waiting or still has prompt left: the next steps are pure decodes."""
    scheduler = engine.scheduler
    while scheduler.num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running
    ):
        engine.step()


def decode_step_ms(llm, batch: int, context: int, steps: int, seed: int = 0) -> float:
    """Median wall time of ``steps`` pure decode steps of ``batch`` requests at ``context``."""
    from jitney import SamplingParams

    rng = random.Random(seed)
    engine = llm.engine
    vocab = llm.tokenizer.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(engine.make_request([rng.randrange(vocab) for _ in range(context)], params))
    prefill_everything(engine)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return 1000 * statistics.median(times)


def measure(model: str, batches: list[int], context: int, steps: int) -> tuple[list[StepFloor], dict]:
    from jitney import LLM
    from jitney.sim.roofline import Roofline
    from jitney.sim.specs import measure_local, model_from_hf_config

    llm = LLM(model=model, dtype="bfloat16")
    decode_step_ms(llm, 1, 64, 4)  # warm-up: lazy allocations and kernel loading
    hardware = measure_local()
    spec = model_from_hf_config(Path(model) / "config.json", dtype_bytes=2)
    roofline = Roofline(spec, hardware)
    rows = []
    for batch in batches:
        measured = decode_step_ms(llm, batch, context, steps)
        # The timed steps attend over context .. context + steps tokens: use the middle.
        shape = roofline.decode_shape(batch, context + steps // 2)
        memory, compute = roofline.memory_seconds(shape), roofline.compute_seconds(shape)
        rows.append(
            StepFloor(
                batch,
                context,
                measured,
                1000 * max(memory, compute),
                "memory" if memory >= compute else "compute",
            )
        )
    machine = {
        "bandwidth_gb_s": hardware.memory_bandwidth / 1e9,
        "bf16_tflop_s": hardware.flops / 1e12,
        "weight_bytes": spec.weight_bytes,
        "kv_bytes_per_token": spec.kv_bytes_per_token,
    }
    return rows, machine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jitney.bench.step_floor", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", required=True, help="a Hugging Face checkpoint directory")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument(
        "--doc", type=Path, default=None, help="markdown file with a step-floor section to rewrite"
    )
    args = parser.parse_args(argv)
    if not (Path(args.model) / "config.json").is_file():
        print(f"error: {args.model} has no config.json", file=sys.stderr)
        return 2
    if min(args.batches) < 1 or args.context < 1 or args.steps < 1:
        print("error: --batches, --context and --steps must be >= 1", file=sys.stderr)
        return 2
    if args.doc is not None:
        try:  # before measuring, not after
            split_marked_section(args.doc.read_text(), "step-floor")
        except (OSError, ValueError) as exc:
            print(f"error: {args.doc}: {exc}", file=sys.stderr)
            return 2
    rows, machine = measure(args.model, args.batches, args.context, args.steps)
    text = markdown(rows, machine)
    print(text)
    if args.json:
        record = {"machine": machine, "steps": [asdict(r) | {"fraction": r.fraction} for r in rows]}
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    if args.doc is not None:
        write_marked_section(args.doc, "step-floor", text)
    return 0


def markdown(rows: list[StepFloor], machine: dict) -> str:
    lines = [
        "| batch | context | jitney step (ms) | roofline floor (ms) | bound | floor / step |",
        "|---:|---:|---:|---:|---|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.batch} | {row.context} | {row.measured_ms:.2f} | {row.floor_ms:.2f} | {row.bound} "
            f"| {row.fraction:.0%} |"
        )
    lines += [
        "",
        f"This machine, measured in the same process: {machine['bandwidth_gb_s']:.1f} GB/s copy bandwidth, "
        f"{machine['bf16_tflop_s']:.3f} TFLOP/s bf16 matmul.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
