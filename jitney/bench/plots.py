"""Pictures of a load-generator run: latency CDFs, token throughput over time, and requests in
flight over time (the last two show warm-up, saturation and drain that averages hide)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jitney.bench.serve import LoadResult, SweepPoint
from jitney.metrics import SLO
from jitney.plotting import pyplot as _pyplot
from jitney.plotting import save


def _cdf(ax, values_ms: list[float], title: str, slo_ms: float | None = None) -> None:
    if values_ms:
        xs = np.sort(values_ms)
        ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs))
    if slo_ms is not None:
        ax.axvline(slo_ms, color="red", linestyle="--", label=f"SLO {slo_ms:g} ms")
        ax.legend()
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("share of requests")
    ax.grid(alpha=0.3)


def plot_run(
    result: LoadResult, out_dir: str | Path, slo: SLO | None = None, bin_s: float = 1.0
) -> list[Path]:
    """Write latency_cdf.png, throughput.png and concurrency.png under ``out_dir``."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ok = [r for r in result.records if r.success]
    slo = slo or SLO()

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    _cdf(axes[0, 0], [r.ttft * 1e3 for r in ok], "TTFT", slo.ttft_ms)
    _cdf(axes[0, 1], [t * 1e3 for r in ok if (t := r.tpot) is not None], "TPOT", slo.tpot_ms)
    itl = [float(g) * 1e3 for r in ok for g in np.diff(r.token_times)]
    _cdf(axes[1, 0], itl, "ITL (between streamed chunks)")
    _cdf(axes[1, 1], [r.e2el * 1e3 for r in ok], "end-to-end latency", slo.e2el_ms)
    paths = [save(fig, out / "latency_cdf.png")]

    t0 = result.start
    end = max(result.duration, bin_s)
    edges = np.arange(0.0, end + bin_s, bin_s)
    token_times = [t - t0 for r in ok for t in r.token_times]
    counts, _ = np.histogram(token_times, bins=edges)
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.step(edges[:-1], counts / bin_s, where="post")
    ax.set_title("streamed chunks per second (output throughput)")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("chunks/s")
    paths.append(save(fig, out / "throughput.png", (ax,)))

    events = sorted(
        [(r.arrival_time - t0, 1) for r in result.records]
        + [((r.finish_time or r.arrival_time) - t0, -1) for r in result.records]
    )
    times, levels, level = [0.0], [0], 0
    for t, step in events:
        level += step
        times.append(t)
        levels.append(level)
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.step(times, levels, where="post")
    ax.set_title("requests in flight")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("requests")
    paths.append(save(fig, out / "concurrency.png", (ax,)))
    return paths


def plot_sweep(points: list[SweepPoint], out_dir: str | Path, slo: SLO) -> Path:
    """Share of requests within SLOs and goodput against the offered rate."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rates = [p.rate for p in points]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(rates, [p.share_good for p in points], marker="o", label="share within SLOs")
    ax.axhline(0.9, color="red", linestyle="--", label="90%")
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("share of requests")
    ax2 = ax.twinx()
    ax2.plot(
        rates,
        [p.result.summary(slo).request_goodput or 0.0 for p in points],
        marker="s",
        color="gray",
        label="goodput",
    )
    ax2.set_ylabel("goodput (req/s)")
    ax.legend(loc="lower left")
    ax.grid(alpha=0.3)
    return save(fig, out / "sweep.png")
