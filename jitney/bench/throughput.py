"""Offline throughput: the same requests through jitney's three policies and the Hugging Face
baselines, each engine in its own process (peak memory per engine), same model and dtype.

A GGUF model (the bundled one included) is first dequantized once into a safetensors checkpoint
that every engine loads, so all of them compute with identical weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from jitney.bench.datasets import LengthDist, TokenSpace, random_requests
from jitney.bench.throughput_worker import ENGINES

REFERENCE = "jitney-chunked"
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ThroughputConfig:
    """The workload (PEERS.md's by default) and the engines' batch limits."""

    model: str | None = None  # None = the bundled model
    engines: tuple[str, ...] = ENGINES
    num_prompts: int = 200
    input_len: LengthDist = field(default_factory=lambda: LengthDist.parse("lognormal:256,0.6,16,1024"))
    output_len: LengthDist = field(default_factory=lambda: LengthDist.parse("lognormal:128,0.6,16,512"))
    seed: int = 1234
    dtype: str = "bfloat16"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    hf_batch_size: int = 32
    threads: int | None = None
    kv_cache_mib: int | None = None  # jitney's KV pool (default: the engine's own sizing)
    repeats: int = 1  # rounds of every engine, alternating; each engine's median run is reported
    timeout_s: float = 3600.0
    cache_dir: Path = Path(".cache/jitney-bench")

    def __post_init__(self) -> None:
        unknown = [e for e in self.engines if e not in ENGINES]
        if unknown or not self.engines:
            raise ValueError(
                f"engines must be among {', '.join(ENGINES)}, got {', '.join(unknown) or 'none'}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_mib is not None and self.kv_cache_mib < 1:
            raise ValueError(f"kv_cache_mib must be >= 1, got {self.kv_cache_mib}")
        for name in ("num_prompts", "max_num_seqs", "max_num_batched_tokens", "hf_batch_size", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class EngineRun:
    engine: str
    ok: bool
    wall_s: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    requested_output_tokens: int = 0
    peak_rss_mib: float = 0.0
    load_s: float = 0.0
    error: str = ""
    # Output tok/s of every round when the engine ran several times (this run is their median).
    round_output_tps: list[float] = field(default_factory=list)

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s if self.ok and self.wall_s > 0 else 0.0

    @property
    def total_tps(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.wall_s if self.ok and self.wall_s > 0 else 0.0


def prepare_model(model: str | None, cache_dir: Path) -> Path:
    """A safetensors checkpoint directory every engine can load (GGUF is dequantized once)."""
    from jitney.model.registry import resolve_model

    resolved = resolve_model(model)
    if resolved.kind == "hf":
        return resolved.path
    from jitney.bench.peers import convert_gguf

    out = cache_dir / f"{resolved.path.stem}-dequantized"
    convert_gguf(resolved.path, out)
    return out


def _vocab_size(model_dir: Path) -> int:
    from jitney.bench.peers import read_vocab_size

    return read_vocab_size(model_dir)


def build_workload(cfg: ThroughputConfig, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    reqs = random_requests(
        cfg.num_prompts,
        cfg.input_len,
        cfg.output_len,
        seed=cfg.seed,
        tokens=TokenSpace(vocab_size=vocab_size, first_id=min(10, vocab_size - 1)),
    )
    return [list(r.prompt) for r in reqs], [r.output_len for r in reqs]  # type: ignore[arg-type]


def run_engine(engine: str, common: dict, workdir: Path, timeout_s: float) -> EngineRun:
    spec_path = workdir / f"{engine}.json"
    spec_path.write_text(json.dumps({**common, "engine": engine}))
    cmd = [sys.executable, "-m", "jitney.bench.throughput_worker", str(spec_path)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return EngineRun(engine, False, error=f"timed out after {timeout_s:g} s")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return EngineRun(engine, False, error=f"exit {proc.returncode}: {tail[:300]}")
    data = json.loads(lines[-1])
    return EngineRun(
        engine,
        True,
        wall_s=data["wall_s"],
        input_tokens=data["input_tokens"],
        output_tokens=data["output_tokens"],
        requested_output_tokens=data["requested_output_tokens"],
        peak_rss_mib=data["peak_rss_mib"],
        load_s=data["load_s"],
    )


def run_all(cfg: ThroughputConfig, progress=print) -> tuple[Path, list[EngineRun]]:
    model_dir = prepare_model(cfg.model, cfg.cache_dir)
    prompts, outs = build_workload(cfg, _vocab_size(model_dir))
    common = {
        "model": str(model_dir),
        "dtype": cfg.dtype,
        "prompts": prompts,
        "output_lens": outs,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "hf_batch_size": cfg.hf_batch_size,
        "threads": cfg.threads,
        "kv_cache_memory": cfg.kv_cache_mib * 2**20 if cfg.kv_cache_mib else None,
    }
    rounds: dict[str, list[EngineRun]] = {engine: [] for engine in cfg.engines}
    with tempfile.TemporaryDirectory(prefix="jitney-bench-") as tmp:
        # Engines alternate within each round, so a slow spell on the shared machine hits them
        # alike instead of all the runs of one engine.
        for round_no in range(cfg.repeats):
            for engine in cfg.engines:
                run = run_engine(engine, common, Path(tmp), cfg.timeout_s)
                label = f"{engine}" + (f" (round {round_no + 1}/{cfg.repeats})" if cfg.repeats > 1 else "")
                progress(
                    f"{label}: "
                    + (
                        f"{run.output_tps:.1f} output tok/s in {run.wall_s:.1f} s"
                        if run.ok
                        else f"failed ({run.error})"
                    )
                )
                rounds[engine].append(run)
    return model_dir, [median_run(rounds[engine]) for engine in cfg.engines]


def median_run(runs: list[EngineRun]) -> EngineRun:
    """The run with the median output tok/s (the lower middle one for an even count), carrying
    every round's figure; a failure if any round failed."""
    failed = next((r for r in runs if not r.ok), None)
    if failed is not None:
        return failed
    ordered = sorted(runs, key=lambda r: r.output_tps)
    middle = ordered[(len(ordered) - 1) // 2]
    middle.round_output_tps = [r.output_tps for r in runs]
    return middle


def format_table(runs: list[EngineRun]) -> str:
    """Markdown; ratios are to jitney chunked (x1.00 for itself), throughput up is better, memory down."""
    ref = next((r for r in runs if r.engine == REFERENCE and r.ok), None)
    lines = [
        "| engine | output tok/s | total tok/s | wall s | peak RSS MiB | output tok/s vs chunked "
        "| peak RSS vs chunked |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        if not r.ok:
            lines.append(f"| {r.engine} | failed: {r.error} | | | | | |")
            continue
        tps_ratio = f"x{r.output_tps / ref.output_tps:.2f}" if ref and ref.output_tps else "-"
        mem_ratio = f"x{r.peak_rss_mib / ref.peak_rss_mib:.2f}" if ref and ref.peak_rss_mib else "-"
        spread = ""
        if len(r.round_output_tps) > 1:
            spread = f" ({min(r.round_output_tps):.1f}-{max(r.round_output_tps):.1f})"
        lines.append(
            f"| {r.engine} | {r.output_tps:.1f}{spread} | {r.total_tps:.1f} | {r.wall_s:.2f} | "
            f"{r.peak_rss_mib:.0f} | {tps_ratio} | {mem_ratio} |"
        )
    return "\n".join(lines)
