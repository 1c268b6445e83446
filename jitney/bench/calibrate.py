"""Calibrating the simulator against the real engine.

1. Profile: run a grid of step shapes (prefill lengths, decode batches at several contexts, decodes
   mixed with an arriving prompt) on the real engine, timing every whole step (schedule, execute,
   update: what the virtual clock must advance by), and write them as JSON lines.
2. Fit the simulator's ``profile`` cost model on most steps; report its error on held-out ones.
3. Served steps: a first served run (training traffic, not the validation's) logs every engine
   step with its start time. From it: the host time between a busy step's end and the next
   step's start (streaming the step's tokens, HTTP, the event loop holding the GIL), fitted as
   ``a + b * decode_tokens``; and a profile fitted on the served steps themselves, which run
   slower than the same shapes alone (the event loop and the load generator share the cores).
4. Validate end to end: the validation traffic through a real ``jitney serve`` process (measured
   by the load generator) and through the simulator under three models (grid fit; grid fit plus
   overhead; served-steps fit plus overhead); relative error of mean TTFT, p95 TPOT, throughput.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import numpy as np

from jitney.bench.compare import headline_errors
from jitney.bench.datasets import BenchRequest, LengthDist, TokenSpace, as_traffic, random_requests
from jitney.request import SamplingParams

if TYPE_CHECKING:
    from jitney.sim.costs import ProfileCost


@dataclass(frozen=True)
class EngineSettings:
    """What the profiled engine, the served engine and the simulated scheduler share."""

    model: str
    dtype: str = "float32"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    num_blocks: int = 1024
    block_size: int = 16
    max_model_len: int = 2048
    policy: str = "chunked"
    threads: int | None = None  # torch threads for both the profile and the server (None: torch's)

    def llm_kwargs(self) -> dict:
        return dict(
            dtype=self.dtype,
            max_num_seqs=self.max_num_seqs,
            policy=self.policy,
            max_num_batched_tokens=self.max_num_batched_tokens,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
        )

    def serve_args(self) -> list[str]:
        return [
            self.model,
            "--dtype",
            self.dtype,
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
            "--num-blocks",
            str(self.num_blocks),
            "--block-size",
            str(self.block_size),
            "--max-model-len",
            str(self.max_model_len),
            "--policy",
            self.policy,
        ]


@dataclass(frozen=True)
class ProfileGrid:
    """Step shapes to visit. Each cell is run ``repeats`` times; every step of it is recorded."""

    prefill_lens: tuple[int, ...] = (16, 64, 128, 256, 512)
    decode_batches: tuple[int, ...] = (1, 4, 8, 16, 32)
    decode_contexts: tuple[int, ...] = (64, 256)
    decode_steps: int = 8
    mixed_batches: tuple[int, ...] = (4, 16)
    mixed_prompt: int = 256
    repeats: int = 2

    def cells(self) -> list[tuple[str, list[int], int, int, int]]:
        """(name, prompt lengths, output length, late prompt length or 0, steps before it)."""
        cells = [(f"prefill-{p}", [p], 2, 0, 0) for p in self.prefill_lens]
        cells += [
            (f"decode-b{b}-c{c}", [c] * b, self.decode_steps, 0, 0)
            for b in self.decode_batches
            for c in self.decode_contexts
        ]
        cells += [
            (f"mixed-b{b}-p{self.mixed_prompt}", [32] * b, self.decode_steps + 4, self.mixed_prompt, 3)
            for b in self.mixed_batches
        ]
        return cells * self.repeats


@dataclass
class ProfileRun:
    rows: list[dict]
    vocab_size: int  # of the profiled model: random prompts for the validation run use it


def profile_engine(settings: EngineSettings, grid: ProfileGrid, seed: int = 0) -> ProfileRun:
    """Run every grid cell on a fresh request set and time each engine step from the outside."""
    import torch

    from jitney import LLM

    for name, lengths, out_len, late_prompt, _ in grid.cells():
        longest = max([*lengths, late_prompt]) + out_len
        if longest > settings.max_model_len:
            raise ValueError(
                f"grid cell {name} needs {longest} tokens, more than max_model_len "
                f"{settings.max_model_len}: shorten the grid or raise --max-model-len"
            )
    threads_before = torch.get_num_threads()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    try:
        return _profile(LLM(settings.model, **settings.llm_kwargs()), grid, seed)
    finally:
        torch.set_num_threads(threads_before)


def _profile(llm, grid: ProfileGrid, seed: int) -> ProfileRun:
    engine = llm.engine
    tokens = TokenSpace(vocab_size=llm.tokenizer.vocab_size, first_id=min(10, llm.tokenizer.vocab_size - 1))
    rng = np.random.default_rng(seed)
    captured: list = []
    engine.step_listeners.append(captured.append)

    def add(lengths: list[int], out_len: int) -> None:
        for n in lengths:
            params = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0.0)
            engine.add_request(engine.make_request(list(tokens.draw(rng, n)), params))

    # Warm-up: the first steps pay for allocations and kernel selection that later ones do not.
    add([64, 64], 4)
    while engine.has_unfinished():
        engine.step()
    rows = []
    for name, lengths, out_len, late_prompt, late_after in grid.cells():
        add(lengths, out_len)
        step = 0
        while engine.has_unfinished():
            if late_prompt and step == late_after:
                add([late_prompt], 2)
            captured.clear()
            t0 = time.perf_counter()
            engine.step()
            ms = (time.perf_counter() - t0) * 1e3
            step += 1
            if captured:
                rec = captured[-1]
                rows.append(
                    {
                        "prefill_tokens": rec.prefill_tokens,
                        "decode_tokens": rec.decode_tokens,
                        "context_tokens": rec.context_tokens,
                        "ms": round(ms, 4),
                        "execute_ms": round(rec.ms, 4),
                        "cell": name,
                    }
                )
    return ProfileRun(rows, llm.tokenizer.vocab_size)


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def split_rows(rows: list[dict], holdout: float, seed: int = 0) -> tuple[list[dict], list[dict]]:
    if not 0 < holdout < 1:
        raise ValueError(f"held-out share must be in (0, 1), got {holdout}")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    cut = max(1, int(round(len(rows) * holdout)))
    test = sorted(order[:cut])
    train = sorted(order[cut:])
    return [rows[i] for i in train], [rows[i] for i in test]


def poisson_traffic(
    num: int, input_len: LengthDist, output_len: LengthDist, rate: float, seed: int, tokens: TokenSpace
) -> list[BenchRequest]:
    """Random requests with Poisson arrivals at ``rate``, lengths and arrivals drawn from ``seed``:
    the validation traffic, and (with another seed) the training traffic of the serving fit."""
    from jitney.bench.serve import arrival_offsets

    requests = random_requests(num, input_len, output_len, seed=seed, tokens=tokens)
    offsets = arrival_offsets(len(requests), rate, seed=seed)
    return [replace(r, arrival=t) for r, t in zip(requests, offsets, strict=True)]


def _tuples(rows: list[dict]) -> list[tuple[int, int, int, float]]:
    return [(r["prefill_tokens"], r["decode_tokens"], r["context_tokens"], r["ms"]) for r in rows]


@dataclass(frozen=True)
class HeldOutError:
    num_steps: int
    mean_abs_pct_error: float
    median_abs_pct_error: float  # robust to the few steps another process on the cores stretched
    rmse_ms: float
    total_time_error: float  # (predicted sum - measured sum) / measured sum
    num_trimmed: int  # training steps dropped as interference outliers before the final fit


def _predict_ms(cost, rows: list[dict]) -> np.ndarray:
    from jitney.sim.roofline import StepShape

    shapes = [StepShape(r["prefill_tokens"], r["decode_tokens"], r["context_tokens"], 0) for r in rows]
    return np.array([cost.step_seconds(s) * 1e3 for s in shapes])


def _trim_outliers(rows: list[dict], k: float = 4.0, passes: int = 3) -> list[dict]:
    """Drop steps far slower than the fit predicts (more than ``k`` robust deviations of the
    residuals), refitting up to ``passes`` times: on shared cores a descheduled thread turns a 1 ms
    step into 100 ms, which is not the engine's cost and drags a least-squares plane away from
    every other step (a big spike hides smaller ones until it is gone)."""
    from jitney.sim.costs import ProfileCost

    keep = rows
    for _ in range(passes):
        cost = ProfileCost.fit_samples(_tuples(keep))
        resid = np.array([r["ms"] for r in keep]) - _predict_ms(cost, keep)
        spread = 1.4826 * float(np.median(np.abs(resid - np.median(resid)))) or 1e-9
        kept = [r for r, e in zip(keep, resid, strict=True) if e <= k * spread]
        if len(kept) == len(keep) or len(kept) < 4:
            break
        keep = kept
    return keep


def fit_profile(rows: list[dict], holdout: float = 0.25, seed: int = 0, trim: bool = True):
    """Fit ``ProfileCost`` on the training steps (interference outliers trimmed); its error on
    every held-out step, none trimmed."""
    from jitney.sim.costs import ProfileCost

    train, test = split_rows(rows, holdout, seed)
    fit_rows = _trim_outliers(train) if trim else train
    cost = ProfileCost.fit_samples(_tuples(fit_rows))
    measured = np.array([r["ms"] for r in test])
    predicted = _predict_ms(cost, test)
    pct = np.abs(predicted - measured) / measured * 100
    err = HeldOutError(
        num_steps=len(test),
        mean_abs_pct_error=float(np.mean(pct)),
        median_abs_pct_error=float(np.median(pct)),
        rmse_ms=float(np.sqrt(np.mean((predicted - measured) ** 2))),
        total_time_error=float((predicted.sum() - measured.sum()) / measured.sum()),
        num_trimmed=len(train) - len(fit_rows),
    )
    return cost, err


@dataclass(frozen=True)
class ServingOverhead:
    """Host time between engine steps while serving: ``intercept_ms + ms_per_decode_token * d``
    after a step that decoded ``d`` tokens."""

    intercept_ms: float
    ms_per_decode_token: float
    num_gaps: int
    median_gap_ms: float

    def describe(self) -> str:
        return (
            f"serving overhead: {self.intercept_ms:.3g} ms + {self.ms_per_decode_token:.3g} ms/decode token "
            f"between steps (from {self.num_gaps} gaps, median {self.median_gap_ms:.2f} ms)"
        )


def read_step_log(path: str | Path) -> list[dict]:
    """The JSON lines ``jitney serve --step-log`` wrote."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def fit_serving_overhead(rows: list[dict], max_gap_ms: float = 250.0) -> ServingOverhead:
    """Least squares of the gap after each step that left work pending (the engine went straight
    on, so the gap is host work, not waiting for an arrival) on that step's decode tokens; both
    coefficients kept >= 0. Gaps above ``max_gap_ms`` are a descheduled process, not overhead."""
    gaps, decodes = [], []
    for before, after in zip(rows, rows[1:], strict=False):
        if not before.get("busy_after"):
            continue
        gap = (after["started_s"] - before["started_s"]) * 1e3 - before["ms"]
        if 0 <= gap <= max_gap_ms:
            gaps.append(gap)
            decodes.append(before["decode_tokens"])
    if len(gaps) < 2:
        raise ValueError(f"the step log has {len(gaps)} gaps between busy steps; need at least 2")
    y, d = np.array(gaps), np.array(decodes, dtype=np.float64)
    if np.ptp(d) > 0:
        slope, intercept = np.polyfit(d, y, 1)
        if slope < 0:
            slope, intercept = 0.0, float(y.mean())
        elif intercept < 0:
            slope, intercept = float((d * y).sum() / (d * d).sum()), 0.0
    else:
        slope, intercept = 0.0, float(y.mean())
    return ServingOverhead(float(intercept), float(slope), len(gaps), float(np.median(y)))


def with_serving_overhead(cost, overhead: ServingOverhead):
    """The profile cost model with the serving overhead added to every step."""
    return replace(
        cost,
        intercept_ms=cost.intercept_ms + overhead.intercept_ms,
        ms_per_decode_token=cost.ms_per_decode_token + overhead.ms_per_decode_token,
        name="profile+serving",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(
    settings: EngineSettings,
    timeout_s: float = 300.0,
    log_path: Path | None = None,
    step_log: Path | None = None,
) -> Iterator[str]:
    """``jitney serve`` in its own process on a free 127.0.0.1 port; yields its base URL and
    stops it (SIGTERM, then kill) on exit. ``step_log``: where the server logs its steps."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "jitney.cli",
        "serve",
        *settings.serve_args(),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *(["--step-log", str(step_log)] if step_log is not None else []),
    ]
    log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed below
    env = dict(os.environ)
    if settings.threads:
        env["OMP_NUM_THREADS"] = str(settings.threads)  # torch sizes its intra-op pool from it
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"jitney serve exited with {proc.returncode} before answering /health")
            try:
                if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"jitney serve did not answer /health within {timeout_s:g} s")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log is not subprocess.DEVNULL:
            log.close()


def simulate_requests(settings: EngineSettings, requests: list[BenchRequest], cost):
    """The simulator's run of the same requests (same arrivals, lengths, limits and KV pool)."""
    from jitney.config import CacheConfig, SchedulerConfig
    from jitney.sim.simulator import run

    sched = SchedulerConfig(
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        policy=settings.policy,
        max_model_len=settings.max_model_len,
    )
    cache = CacheConfig(block_size=settings.block_size, num_blocks=settings.num_blocks)
    return run(as_traffic(requests), sched, cache, cost, label="simulated")


@dataclass
class Validation:
    measured: dict
    simulated: dict
    errors: dict[str, float | None]


def serve_measured(
    settings: EngineSettings,
    requests: list[BenchRequest],
    *,
    log_path: Path | None = None,
    step_log: Path | None = None,
    show_progress: bool = False,
) -> dict:
    """A ``bench serve`` run of the timed requests against a fresh ``jitney serve``: its summary."""
    from jitney.bench.client import ApiTarget, discover_model
    from jitney.bench.serve import LoadConfig, run_load

    if any(r.arrival is None for r in requests):
        raise ValueError("a measured serving run needs requests with arrival times")
    if step_log is not None:
        Path(step_log).unlink(missing_ok=True)
    with served(settings, log_path=log_path, step_log=step_log) as url:
        target = ApiTarget(url, discover_model(url))
        result = run_load(target, requests, LoadConfig(num_warmups=2, show_progress=show_progress))
    return result.summary().to_dict()


def calibrate_serving(
    settings: EngineSettings, requests: list[BenchRequest], step_log: Path
) -> tuple[ServingOverhead, list[dict]]:
    """Serve ``requests`` (training traffic, not the validation's); fit the host time between
    steps from the server's own step log. Returns the fit and the logged steps."""
    serve_measured(settings, requests, step_log=step_log)
    rows = read_step_log(step_log)
    return fit_serving_overhead(rows), rows


def validate(
    settings: EngineSettings,
    requests: list[BenchRequest],
    cost,
    *,
    log_path: Path | None = None,
    show_progress: bool = False,
    measured: dict | None = None,
) -> Validation:
    """Measured ``bench serve`` run (or the given ``measured`` summary of one) vs simulated run of
    the same timed requests."""
    if measured is None:
        measured = serve_measured(settings, requests, log_path=log_path, show_progress=show_progress)
    simulated = simulate_requests(settings, requests, cost).summary().to_dict()
    return Validation(measured, simulated, headline_errors(simulated, measured))


@dataclass
class CalibrationReport:
    """Three cost models against one measured run: the offline grid fit; that fit plus the serving
    overhead; and a fit on the served training run's own steps plus the overhead (the steps as
    they run inside the server, next to its HTTP work and the load generator on the same cores)."""

    overhead: ServingOverhead
    served_fit: ProfileCost  # fitted on the training run's logged steps
    served_held_out: HeldOutError
    offline: Validation
    with_overhead: Validation
    served: Validation


def calibrate_and_validate(
    settings: EngineSettings,
    training: list[BenchRequest],
    validation: list[BenchRequest],
    cost,
    step_log: Path,
    *,
    seed: int = 0,
    show_progress: bool = False,
) -> CalibrationReport:
    """Serve ``training`` with a step log (fit the overhead and the served-steps profile), then
    serve ``validation`` once and compare it with the simulations under the three models."""
    overhead, served_rows = calibrate_serving(settings, training, step_log)
    served_fit, served_held = fit_profile(served_rows, 0.25, seed)
    measured = serve_measured(settings, validation, show_progress=show_progress)
    return CalibrationReport(
        overhead,
        served_fit,
        served_held,
        validate(settings, validation, cost, measured=measured),
        validate(settings, validation, with_serving_overhead(cost, overhead), measured=measured),
        validate(settings, validation, with_serving_overhead(served_fit, overhead), measured=measured),
    )
