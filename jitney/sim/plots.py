"""PNG figures of a simulation (matplotlib, Agg backend: no display needed).

- ``timeline.png``: the first requests of each policy as bars (waiting, prefill, decode), the
  seeds' slot pictures drawn from the run's own timestamps;
- ``cdf.png``: CDFs of TTFT and TPOT per policy;
- ``kv_queue.png``: KV pool usage and waiting-queue length over simulated time;
- ``sweep.png``: latency and throughput against offered load, saturation points marked.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jitney.plotting import pyplot as _pyplot
from jitney.plotting import save
from jitney.sim.experiment import Outcome
from jitney.sim.sweep import SweepPoint, saturation_rates


def plot_timeline(outcomes: list[Outcome], path: Path, first: int = 40) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(len(outcomes), 1, figsize=(11, 2.4 * len(outcomes) + 0.6), squeeze=False)
    for ax, o in zip(axes[:, 0], outcomes, strict=True):
        reqs = sorted(o.result.requests, key=lambda r: r.arrival_time)[:first]
        for y, r in enumerate(reqs):
            start = r.first_scheduled_time if r.first_scheduled_time is not None else r.arrival_time
            ft = r.first_token_time if r.first_token_time is not None else start
            end = r.finish_time if r.finish_time is not None else ft
            ms = 1000.0
            ax.barh(y, (start - r.arrival_time) * ms, left=r.arrival_time * ms, color="0.85", height=0.8)
            ax.barh(y, (ft - start) * ms, left=start * ms, color="tab:orange", height=0.8)
            ax.barh(y, (end - ft) * ms, left=ft * ms, color="tab:blue", height=0.8)
        ax.set_title(f"{o.run.label}: first {len(reqs)} requests", fontsize=9, loc="left")
        ax.set_ylabel("request")
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("simulated time, ms  (grey: waiting, orange: prefill, blue: decode)")
    save(fig, path)


def _cdf(ax, values_ms: np.ndarray, label: str) -> None:
    xs = np.sort(values_ms)
    ax.plot(xs, np.arange(1, len(xs) + 1) / max(len(xs), 1), label=label)


def plot_cdfs(outcomes: list[Outcome], path: Path) -> None:
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for o in outcomes:
        recs = [r for r in o.result.records() if r.success]
        _cdf(a, np.array([r.ttft for r in recs]) * 1000, o.run.label)
        _cdf(b, np.array([t for r in recs if (t := r.tpot) is not None]) * 1000, o.run.label)
    a.set_xscale("symlog", linthresh=1.0)
    a.set(xlabel="TTFT, ms", ylabel="share of requests", title="TTFT")
    b.set(xlabel="TPOT, ms", title="TPOT")
    save(fig, path, (a, b), legend_fontsize=8)


def plot_kv_queue(outcomes: list[Outcome], path: Path) -> None:
    plt = _pyplot()
    fig, (a, b) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    for o in outcomes:
        tl = o.result.timeline
        if tl is None:
            continue
        a.step(tl.time, np.array(tl.kv_usage) * 100, where="post", label=o.run.label, lw=0.8)
        b.step(tl.time, tl.num_waiting, where="post", label=o.run.label, lw=0.8)
    a.set(ylabel="KV pool used, %", title="KV cache usage")
    b.set(ylabel="waiting requests", xlabel="simulated time, s", title="queue length")
    save(fig, path, (a, b), legend_fontsize=8)


def plot_sweep(points: list[SweepPoint], path: Path) -> None:
    plt = _pyplot()
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4))
    labels = list(dict.fromkeys(p.outcome.run.label for p in points))
    saturation = saturation_rates(points)
    for label in labels:
        pts = [p for p in points if p.outcome.run.label == label]
        rates = [p.rate for p in pts]
        line = a.plot(rates, [p.outcome.summary.ttft.p(95) for p in pts], marker="o", label=label)[0]
        b.plot(
            rates,
            [p.outcome.summary.tpot.p(95) for p in pts],
            marker="o",
            label=label,
            color=line.get_color(),
        )
        c.plot(
            rates,
            [p.outcome.summary.output_throughput for p in pts],
            marker="o",
            label=label,
            color=line.get_color(),
        )
        sat = saturation[label]
        if sat is not None:
            for ax in (a, b, c):
                ax.axvline(sat, color=line.get_color(), ls="--", lw=0.8)
    a.set(xlabel="offered load, req/s", ylabel="ms", title="TTFT p95", yscale="log")
    b.set(xlabel="offered load, req/s", ylabel="ms", title="TPOT p95")
    c.set(xlabel="offered load, req/s", ylabel="output tok/s", title="throughput (dashed: saturation)")
    save(fig, path, (a, b, c), legend_fontsize=8)


def plot_all(outcomes: list[Outcome], directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / "timeline.png", directory / "cdf.png", directory / "kv_queue.png"]
    plot_timeline(outcomes, paths[0])
    plot_cdfs(outcomes, paths[1])
    plot_kv_queue(outcomes, paths[2])
    return paths
