"""``python -m jitney.bench.suite`` (what ``make bench`` runs): the benchmarks that fit in about
15 minutes on this machine, printed as markdown for docs/BENCHMARKS.md, with plots under
docs/img/. Every section states the command that reproduces it.

Sections: the machine and versions; the seed's slot benchmark (median of several runs); offline
throughput of jitney's policies against the Hugging Face baselines on the bundled model; a
``bench serve`` run against ``jitney serve``; the profile fit and the simulated-vs-measured check.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

SECTIONS = ("scheduler", "simulator", "slots", "throughput", "serve", "calibration")


@dataclass(frozen=True)
class SuiteConfig:
    """Sizes chosen so the whole set runs within 15 minutes on 2 CPU cores (about 6 here)."""

    model: str | None = None  # None = the bundled model
    dtype: str = "bfloat16"
    sections: tuple[str, ...] = SECTIONS
    img_dir: Path = Path("docs/img")
    cache_dir: Path = Path(".cache/jitney-bench")
    slots_repeats: int = 3
    tp_prompts: int = 16
    tp_input: str = "lognormal:128,0.6,16,512"
    tp_output: str = "lognormal:32,0.6,16,96"
    tp_repeats: int = 3
    serve_prompts: int = 24
    serve_rate: float = 0.5
    serve_input: str = "lognormal:128,0.6,16,512"
    serve_output: str = "lognormal:32,0.6,8,128"
    slo_ttft_ms: float = 3000.0
    slo_tpot_ms: float = 250.0
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    num_blocks: int = 2048
    kv_cache_mib: int = 1024
    profile_repeats: int = 1
    calibration_threads: int = 1
    seed: int = 0


def _sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def machine_section() -> str:
    import torch
    import transformers

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = _sh(["git", "rev-parse", "--short", "HEAD"]) or "unknown"
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return "\n".join(
        [
            "## Machine and versions",
            "",
            f"- date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}, jitney commit {commit}",
            f"- CPU: {cpu or platform.processor()} ({os.cpu_count()} cores), {mem_gib:.0f} GiB memory, "
            "no GPU",
            f"- Python {platform.python_version()}, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), transformers {transformers.__version__}",
        ]
    )


def slots_section(cfg: SuiteConfig) -> str:
    from jitney.bench.slots import SlotsConfig, format_table, run_all

    runs = run_all(SlotsConfig(repeats=cfg.slots_repeats))
    return "\n".join(
        [
            "## The seed's slot benchmark (task 08.2)",
            "",
            f"`jitney bench slots --repeats {cfg.slots_repeats}` — 64 requests, output lengths lognormal "
            "(median 180, sigma 0.5) clipped to [64, 512], TinyLM (embedding + 4 MLP blocks + lm_head), "
            f"torch.manual_seed(0), one thread; seconds are the median of {cfg.slots_repeats} runs.",
            "",
            format_table(runs),
        ]
    )


def scheduler_section(cfg: SuiteConfig) -> str:
    from jitney.bench.scheduler_overhead import measure

    rows = [measure(n) for n in (32, 64, 128, 256, 512, 1024)]
    lines = [
        "## Scheduler overhead",
        "",
        "`python -m jitney.bench.scheduler_overhead` — one `schedule()` + `update_from_output()` step with "
        "N requests decoding and 1,000 waiting, block size 16, prefix caching on; median and p90 of 300 "
        "steps. Target: at most 300 µs at 256 running, growing linearly or better.",
        "",
        "| running | median µs/step | p90 µs/step | µs per running request |",
        "|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r.running} | {r.median_us:.0f} | {r.p90_us:.0f} | {r.us_per_running_request:.2f} |" for r in rows
    ]
    return "\n".join(lines)


def simulator_section(cfg: SuiteConfig) -> str:
    default_text, default_s = _simulate([])
    hour_text, hour_s = _simulate(["--duration", "3600", "--policy", "chunked"])
    num_hour = 57_521  # requests in an hour of 16 req/s drawn with seed 1234
    return "\n".join(
        [
            "## Simulator",
            "",
            f"`jitney simulate` (the seed's experiment, three policies): {default_s:.2f} s of simulation "
            "wall time (target: under 2 s).",
            "",
            "```",
            default_text.strip(),
            "```",
            "",
            f"`jitney simulate --duration 3600 --policy chunked`: {hour_s:.1f} s of wall time for "
            f"{num_hour:,} requests, {num_hour / hour_s:,.0f} simulated requests per second (target: "
            "at least 5,000).",
            "",
            "```",
            hour_text.strip(),
            "```",
        ]
    )


def _simulate(args: list[str]) -> tuple[str, float]:
    """Run ``jitney simulate`` and return its output and the wall time it reports for simulating."""
    res = subprocess.run(
        [sys.executable, "-m", "jitney.cli", "simulate", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    seconds = float("nan")
    for line in res.stdout.splitlines():
        if line.startswith("simulated in "):
            seconds = float(line.split()[2])
    return res.stdout, seconds


def _model_dir(cfg: SuiteConfig) -> Path:
    from jitney.bench.throughput import prepare_model

    return prepare_model(cfg.model, cfg.cache_dir)


def throughput_section(cfg: SuiteConfig) -> str:
    from jitney.bench.datasets import LengthDist
    from jitney.bench.throughput import ThroughputConfig, format_table, run_all

    tcfg = ThroughputConfig(
        model=cfg.model,
        num_prompts=cfg.tp_prompts,
        input_len=LengthDist.parse(cfg.tp_input),
        output_len=LengthDist.parse(cfg.tp_output),
        seed=cfg.seed,
        dtype=cfg.dtype,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        hf_batch_size=cfg.max_num_seqs,
        kv_cache_mib=cfg.kv_cache_mib,
        repeats=cfg.tp_repeats,
        cache_dir=cfg.cache_dir,
    )
    model_dir, runs = run_all(tcfg, progress=lambda line: print(line, file=sys.stderr, flush=True))
    ok = [r for r in runs if r.ok]
    tokens = f"{ok[0].input_tokens} prompt and {ok[0].requested_output_tokens} output tokens" if ok else ""
    return "\n".join(
        [
            "## Offline throughput",
            "",
            f"`jitney bench throughput --num-prompts {cfg.tp_prompts} --input-len {cfg.tp_input} "
            f"--output-len {cfg.tp_output} --seed {cfg.seed} --dtype {cfg.dtype} "
            f"--max-num-seqs {cfg.max_num_seqs} "
            f"--max-num-batched-tokens {cfg.max_num_batched_tokens} --hf-batch-size {cfg.max_num_seqs} "
            f"--kv-cache-mib {cfg.kv_cache_mib} --repeats {cfg.tp_repeats}` "
            f"on {model_dir.name} ({tokens}; outputs forced, greedy). Each engine runs in its own process; "
            "peak RSS includes the model and each engine's KV pool. Engines alternate in "
            f"{cfg.tp_repeats} rounds; each row is the engine's median run (range of output tok/s "
            "in brackets).",
            "",
            format_table(runs),
        ]
    )


def _engine_settings(cfg: SuiteConfig, model_dir: Path):
    """The engine both the serving and the calibration sections run: one definition, one setup."""
    from jitney.bench import calibrate as cal

    return cal.EngineSettings(
        str(model_dir),
        dtype=cfg.dtype,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        num_blocks=cfg.num_blocks,
    )


def serve_section(cfg: SuiteConfig) -> str:
    from jitney.bench import calibrate as cal
    from jitney.bench.client import ApiTarget, discover_model
    from jitney.bench.datasets import LengthDist, TokenSpace, random_requests
    from jitney.bench.peers import read_vocab_size
    from jitney.bench.plots import plot_run
    from jitney.bench.serve import LoadConfig, format_summary, run_load
    from jitney.metrics import SLO

    model_dir = _model_dir(cfg)
    settings = _engine_settings(cfg, model_dir)
    vocab = read_vocab_size(model_dir)
    reqs = random_requests(
        cfg.serve_prompts,
        LengthDist.parse(cfg.serve_input),
        LengthDist.parse(cfg.serve_output),
        seed=cfg.seed,
        tokens=TokenSpace(vocab_size=vocab),
    )
    slo = SLO(ttft_ms=cfg.slo_ttft_ms, tpot_ms=cfg.slo_tpot_ms)
    with cal.served(settings) as url:
        target = ApiTarget(url, discover_model(url))
        result = run_load(
            target,
            reqs,
            LoadConfig(request_rate=cfg.serve_rate, seed=cfg.seed, num_warmups=2, show_progress=False),
        )
    paths = plot_run(result, cfg.img_dir, slo)
    renamed = []
    for p in paths:
        target_path = p.with_name(f"serve_{p.name}")
        p.replace(target_path)
        renamed.append(target_path)
    images = "\n".join(f"![{p.stem}](img/{p.name})" for p in renamed)
    return "\n".join(
        [
            "## Serving: `jitney bench serve` against `jitney serve`",
            "",
            f"`jitney serve {model_dir} --dtype {cfg.dtype} --max-num-seqs {cfg.max_num_seqs} "
            f"--max-num-batched-tokens {cfg.max_num_batched_tokens} --num-blocks {cfg.num_blocks}` and "
            f"`jitney bench serve --num-prompts {cfg.serve_prompts} --input-len {cfg.serve_input} "
            f"--output-len {cfg.serve_output} --request-rate {cfg.serve_rate:g} --seed {cfg.seed} "
            f"--slo-ttft-ms {cfg.slo_ttft_ms:g} --slo-tpot-ms {cfg.slo_tpot_ms:g} --plot docs/img` "
            "(client and server share the 2 cores).",
            "",
            "```",
            format_summary(result, slo),
            "```",
            "",
            images,
        ]
    )


def calibration_section(cfg: SuiteConfig) -> str:
    from jitney.bench import calibrate as cal
    from jitney.bench.compare import HEADLINE
    from jitney.bench.datasets import LengthDist, TokenSpace

    model_dir = _model_dir(cfg)
    settings = _engine_settings(cfg, model_dir)
    # One torch thread for the profile and the served engine alike: with two OpenMP threads on two
    # shared cores, a step waits for whichever thread another process has descheduled.
    settings = replace(settings, threads=cfg.calibration_threads)
    grid = cal.ProfileGrid(repeats=cfg.profile_repeats)
    profiled = cal.profile_engine(settings, grid, seed=cfg.seed)
    cal.write_jsonl(profiled.rows, cfg.cache_dir / "profile.jsonl")
    cost, held = cal.fit_profile(profiled.rows, 0.25, cfg.seed)
    lengths = LengthDist.parse(cfg.serve_input), LengthDist.parse(cfg.serve_output)
    tokens = TokenSpace(vocab_size=profiled.vocab_size)
    reqs = cal.poisson_traffic(cfg.serve_prompts, *lengths, cfg.serve_rate, cfg.seed + 1, tokens)
    # Training traffic for the serving fit: same distributions and rate, another seed.
    train = cal.poisson_traffic(cfg.serve_prompts, *lengths, cfg.serve_rate, cfg.seed + 2, tokens)
    report = cal.calibrate_and_validate(
        settings, train, reqs, cost, cfg.cache_dir / "serve_steps.jsonl", seed=cfg.seed
    )
    models = (
        ("offline grid fit", report.offline),
        ("grid fit + serving overhead", report.with_overhead),
        ("served-steps fit + serving overhead", report.served),
    )
    rows = [
        "| figure | measured | " + " | ".join(f"{label} | rel. error" for label, _ in models) + " |",
        "|---|---:|" + "---:|---:|" * len(models),
    ]
    for name in HEADLINE:
        cells = [name, f"{report.offline.measured[name]:.2f}"]
        for _, val in models:
            err = val.errors[name]
            cells += [f"{val.simulated[name]:.2f}", "-" if err is None else f"{err:+.1%}"]
        rows.append("| " + " | ".join(cells) + " |")
    sheld = report.served_held_out
    return "\n".join(
        [
            "## Calibration: profile fit and simulated vs measured",
            "",
            f"`jitney bench profile --model {model_dir} --dtype {cfg.dtype} "
            f"--max-num-seqs {cfg.max_num_seqs} "
            f"--max-num-batched-tokens {cfg.max_num_batched_tokens} --num-blocks {cfg.num_blocks} "
            f"--repeats {cfg.profile_repeats} --num-prompts {cfg.serve_prompts} "
            f"--request-rate {cfg.serve_rate:g} "
            f"--input-len {cfg.serve_input} --output-len {cfg.serve_output} --seed {cfg.seed + 1} "
            f"--threads {cfg.calibration_threads}`",
            "",
            f"- grid: {len(profiled.rows)} engine steps timed whole (schedule + execute + update); "
            f"{held.num_trimmed} interference outliers trimmed from the fit.",
            f"- grid fit: {cost.describe()}",
            f"- grid held-out {held.num_steps} steps: median abs error {held.median_abs_pct_error:.1f}%, "
            f"mean {held.mean_abs_pct_error:.1f}%, total time {held.total_time_error:+.1%}.",
            f"- training run: {len(train)} other requests (same distributions and rate, seed + 1) served "
            "with `--step-log`.",
            f"- {report.overhead.describe()}.",
            f"- served-steps fit: {report.served_fit.describe()}; held-out {sheld.num_steps} steps: "
            f"median abs error {sheld.median_abs_pct_error:.1f}%, total time {sheld.total_time_error:+.1%}.",
            "",
            f"The validation traffic, {len(reqs)} requests (Poisson {cfg.serve_rate:g} req/s), served by "
            "`jitney serve` and measured by `bench serve`, and simulated under each model "
            "(target: within 10%):",
            "",
            *rows,
        ]
    )


_SECTIONS: dict[str, Callable[[SuiteConfig], str]] = {
    "scheduler": scheduler_section,
    "simulator": simulator_section,
    "slots": slots_section,
    "throughput": throughput_section,
    "serve": serve_section,
    "calibration": calibration_section,
}


def run_suite(cfg: SuiteConfig, out=print) -> list[str]:
    parts = [machine_section()]
    out(parts[0] + "\n")
    for name in cfg.sections:
        t0 = time.monotonic()
        print(f"[suite] {name} ...", file=sys.stderr, flush=True)
        try:
            text = _SECTIONS[name](cfg)
        except Exception as exc:  # one failing section must not lose the others' figures
            text = f"## {name}\n\nfailed: {type(exc).__name__}: {exc}"
        print(f"[suite] {name} done in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        parts.append(text)
        out(text + "\n")
    return parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jitney.bench.suite", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", help="checkpoint directory, .gguf or known name (default: the bundled model)"
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"subset of {','.join(SECTIONS)}")
    parser.add_argument("--img-dir", default="docs/img")
    parser.add_argument("--out", help="also write the markdown to this file")
    args = parser.parse_args(argv)
    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        print(
            f"suite: error: unknown sections {', '.join(unknown)}; known: {', '.join(SECTIONS)}",
            file=sys.stderr,
        )
        return 2
    cfg = SuiteConfig(model=args.model, dtype=args.dtype, sections=sections, img_dir=Path(args.img_dir))
    parts = run_suite(cfg)
    if args.out:
        Path(args.out).write_text("\n\n".join(parts) + "\n")
    return 0 if not any("\n\nfailed: " in p for p in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
