"""The load generator: send a list of requests to an OpenAI-compatible server on an arrival
schedule (Poisson, gamma with burstiness, replayed timestamps, or a closed loop bounded by a
concurrency limit), stream every answer, and summarize with :mod:`jitney.metrics`.

Warm-up requests go first, one at a time, and are left out of the figures: the first calls of a
fresh server pay for lazy initialisation that no steady-state user sees.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime

import httpx
import numpy as np
from tqdm import tqdm

from jitney.bench.client import ApiTarget, StreamResult, stream_request
from jitney.bench.datasets import BenchRequest
from jitney.metrics import SLO, RequestRecord, Summary, summarize

GOOD_SHARE = 0.9  # a rate "meets the SLOs" when this share of its requests does


@dataclass(frozen=True)
class LoadConfig:
    """How requests arrive. ``request_rate`` inf sends everything at once (bounded only by
    ``max_concurrency``); ``burstiness`` is the gamma shape (1 = Poisson, < 1 burstier)."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 1
    seed: int = 0
    timeout_s: float = 600.0
    show_progress: bool = True

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request rate must be > 0 req/s (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"warm-up count must be >= 0, got {self.num_warmups}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout must be > 0 s, got {self.timeout_s}")


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of ``n`` requests: gamma inter-arrivals with mean
    ``1/rate`` and shape ``burstiness`` (exponential when it is 1); all zero at an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return [float(t) for t in np.cumsum(gaps)]


@dataclass
class LoadResult:
    """A finished run: one record per measured request (in send order), on a clock whose zero is
    ``start`` (perf_counter seconds)."""

    records: list[RequestRecord]
    texts: list[str]
    start: float
    duration: float
    config: LoadConfig

    def summary(self, slo: SLO | None = None) -> Summary:
        return summarize(self.records, duration=self.duration, slo=slo)

    def share_meeting(self, slo: SLO) -> float:
        """Share of all requests (failures count against) that met every SLO."""
        good = sum(1 for r in self.records if r.success and slo.met_by(r))
        return good / len(self.records) if self.records else 0.0

    def errors(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.records:
            if not r.success:
                counts[r.error] = counts.get(r.error, 0) + 1
        return counts

    def max_concurrency_seen(self) -> int:
        events = sorted(
            [(r.arrival_time, 1) for r in self.records]
            + [(r.finish_time or r.arrival_time, -1) for r in self.records]
        )
        level = peak = 0
        for _, step in events:
            level += step
            peak = max(peak, level)
        return peak


async def _send_all(target: ApiTarget, requests: list[BenchRequest], cfg: LoadConfig) -> LoadResult:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=cfg.max_concurrency or 256)
    timeout = httpx.Timeout(cfg.timeout_s, connect=min(cfg.timeout_s, 30.0))
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        for _ in range(cfg.num_warmups):
            warm = replace(requests[0], output_len=min(requests[0].output_len, 16))
            got = await stream_request(client, target, warm)
            if not got.record.success:
                raise ValueError(f"warm-up request to {target.url} failed: {got.record.error}")

        if all(r.arrival is not None for r in requests):
            offsets = [float(r.arrival) for r in requests]  # type: ignore[arg-type]
        else:
            offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
        gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        bar = tqdm(total=len(requests), disable=not cfg.show_progress, desc="requests", unit="req")
        start = time.perf_counter()

        async def one(req: BenchRequest) -> StreamResult:
            if gate is None:
                got = await stream_request(client, target, req)
            else:
                async with gate:
                    got = await stream_request(client, target, req)
            bar.update(1)
            return got

        tasks = []
        for req, offset in zip(requests, offsets, strict=True):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return LoadResult([r.record for r in results], [r.generated_text for r in results], start, duration, cfg)


def run_load(target: ApiTarget, requests: list[BenchRequest], cfg: LoadConfig) -> LoadResult:
    if not requests:
        raise ValueError("no requests to send")
    return asyncio.run(_send_all(target, requests, cfg))


_CLIENT_BLIND = ("queue", "num_preemptions", "slot_utilization")


def result_json(result: LoadResult, target: ApiTarget, slo: SLO | None, *, label: str = "openai") -> dict:
    """The run as vLLM's benchmark JSON: same field names and units (ms for latencies, seconds in
    the per-request lists), plus the arrival settings."""
    cfg = result.config
    summary = result.summary(slo).to_dict()
    fields = {k: v for k, v in summary.items() if not k.startswith(_CLIENT_BLIND)}
    ok = [r for r in result.records if r.success]
    out: dict = {
        "date": datetime.now(UTC).strftime("%Y%m%d-%H%M%S"),
        "backend": label,
        "endpoint_type": target.endpoint,
        "base_url": target.base_url,
        "model_id": target.model,
        "num_prompts": len(result.records),
        "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        "seed": cfg.seed,
        **fields,
        "max_concurrent_requests": result.max_concurrency_seen(),
        "input_lens": [r.prompt_tokens for r in result.records],
        "output_lens": [r.output_tokens for r in result.records],
        "ttfts": [r.ttft if r.success else 0.0 for r in result.records],
        "itls": [np.diff(r.token_times).tolist() if r.success else [] for r in result.records],
        "generated_texts": result.texts,
        "errors": [r.error for r in result.records],
    }
    if slo is not None and slo.is_set:
        out["goodput_slo"] = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}
        out["share_meeting_slo"] = result.share_meeting(slo)
    if not ok:
        out["note"] = "no request succeeded"
    return out


def format_summary(result: LoadResult, slo: SLO | None, title: str = "Serving benchmark") -> str:
    s = result.summary(slo)
    cfg = result.config
    rate = "inf" if math.isinf(cfg.request_rate) else f"{cfg.request_rate:g}"
    rows: list[tuple[str, str]] = [
        ("request rate (req/s) / burstiness", f"{rate} / {cfg.burstiness:g}"),
        ("max concurrency (limit / seen)", f"{cfg.max_concurrency or '-'} / {result.max_concurrency_seen()}"),
        ("successful / failed requests", f"{s.completed} / {s.failed}"),
        ("duration (s)", f"{s.duration:.2f}"),
        ("input / output tokens", f"{s.total_input_tokens} / {s.total_output_tokens}"),
        ("request throughput (req/s)", f"{s.request_throughput:.2f}"),
        ("output token throughput (tok/s)", f"{s.output_throughput:.2f}"),
        ("total token throughput (tok/s)", f"{s.total_token_throughput:.2f}"),
    ]
    if s.request_goodput is not None and slo is not None:
        rows.append(("request goodput (req/s)", f"{s.request_goodput:.2f}"))
        rows.append(("share of requests meeting SLOs", f"{result.share_meeting(slo):.1%}"))
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")):
        st = getattr(s, name)
        rows.append(
            (
                f"{label} ms: mean / median / p90 / p95 / p99",
                f"{st.mean:.1f} / {st.median:.1f} / {st.p(90):.1f} / {st.p(95):.1f} / {st.p(99):.1f}",
            )
        )
    width = max(len(k) for k, _ in rows)
    lines = [f"{title:=^{width + 24}}"]
    lines += [f"{k:<{width}}  {v:>20}" for k, v in rows]
    errors = result.errors()
    for err, n in sorted(errors.items(), key=lambda kv: -kv[1])[:5]:
        lines.append(f"failed x{n}: {err}")
    lines.append("=" * (width + 24))
    return "\n".join(lines)


@dataclass
class SweepPoint:
    rate: float
    result: LoadResult
    share_good: float


def sweep_rates(
    target: ApiTarget, requests: list[BenchRequest], rates: list[float], cfg: LoadConfig, slo: SLO
) -> tuple[list[SweepPoint], float | None]:
    """Run the same requests at each rate (ascending); capacity is the highest rate at which at
    least 90% of requests met every SLO (None if none did)."""
    if not slo.is_set:
        raise ValueError("a rate sweep needs at least one SLO (--slo-ttft-ms / --slo-tpot-ms)")
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"sweep rates must be > 0, got {rates}")
    timed = [replace(r, arrival=None) for r in requests]  # the sweep sets the arrivals
    points = []
    for i, rate in enumerate(sorted(rates)):
        run_cfg = replace(cfg, request_rate=rate, num_warmups=cfg.num_warmups if i == 0 else 0)
        result = run_load(target, timed, run_cfg)
        points.append(SweepPoint(rate, result, result.share_meeting(slo)))
    meeting = [p.rate for p in points if p.share_good >= GOOD_SHARE]
    return points, (max(meeting) if meeting else None)


def format_sweep(points: list[SweepPoint], capacity: float | None, slo: SLO) -> str:
    lines = [
        "| rate (req/s) | completed | failed | output tok/s | mean TTFT ms | p95 TPOT ms | meets SLOs "
        "| goodput |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in points:
        s = p.result.summary(slo)
        lines.append(
            f"| {p.rate:g} | {s.completed} | {s.failed} | {s.output_throughput:.1f} | {s.ttft.mean:.1f} | "
            f"{s.tpot.p(95):.1f} | {p.share_good:.0%} | {s.request_goodput or 0.0:.2f} |"
        )
    verdict = (
        f"capacity: {capacity:g} req/s (highest rate with >= {GOOD_SHARE:.0%} of requests within SLOs)"
        if capacity is not None
        else f"no rate met the SLOs for {GOOD_SHARE:.0%} of requests"
    )
    return "\n".join(lines + ["", verdict])
