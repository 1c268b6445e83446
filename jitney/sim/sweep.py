"""Latency and throughput against offered load, with each policy's saturation point."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from jitney.config import CacheConfig
from jitney.metrics import SLO
from jitney.sim.costs import CostModel
from jitney.sim.experiment import Outcome, PolicyRun, run_all
from jitney.sim.traffic import TrafficItem, TrafficSpec, generate

# Saturated: the system completes requests at less than this share of the rate they arrive at.
SATURATION_SHARE = 0.9


def parse_rates(text: str) -> list[float]:
    """``A:B:STEP`` -> [A, A+STEP, ..., <= B] in req/s."""
    parts = text.split(":")
    if len(parts) != 3:
        raise ValueError(f"--sweep-rate wants A:B:STEP (req/s), got {text!r}")
    try:
        a, b, step = (float(p) for p in parts)
    except ValueError:
        raise ValueError(f"--sweep-rate wants three numbers A:B:STEP, got {text!r}") from None
    if not (a > 0 and b >= a and step > 0):
        raise ValueError(f"--sweep-rate needs 0 < A <= B and STEP > 0, got {text!r}")
    count = int((b - a) / step + 1e-9) + 1
    if count > 200:
        raise ValueError(f"--sweep-rate {text!r} makes {count} points; at most 200")
    return [round(a + i * step, 10) for i in range(count)]


@dataclass
class SweepPoint:
    rate: float
    offered_rate: float  # requests drawn / window: what the Poisson draw actually offered
    outcome: Outcome

    @property
    def saturated(self) -> bool:
        return self.outcome.summary.request_throughput < SATURATION_SHARE * self.offered_rate


def sweep(
    spec: TrafficSpec,
    rates: list[float],
    runs: list[PolicyRun],
    cache_for: Callable[[list[TrafficItem]], CacheConfig],
    cost: CostModel,
    slo: SLO | None = None,
) -> list[SweepPoint]:
    """Run every policy at every rate on traffic drawn with the same seed. ``cache_for(items)``
    sizes the KV pool for each rate's traffic."""
    points = []
    for rate in rates:
        items = generate(replace(spec, rate=rate))
        if not items:
            continue
        cache = cache_for(items)
        offered = len(items) / spec.duration_s
        for o in run_all(items, runs, cache, cost, slo=slo):
            points.append(SweepPoint(rate, offered, o))
    return points


def saturation_rates(points: list[SweepPoint]) -> dict[str, float | None]:
    """Per policy: the lowest swept rate at which it saturates (None if it never does)."""
    out: dict[str, float | None] = {}
    for p in points:
        label = p.outcome.run.label
        out.setdefault(label, None)
        if out[label] is None and p.saturated:
            out[label] = p.rate
    return out


def sweep_table(points: list[SweepPoint]) -> list[str]:
    head = (
        f"{'rate':>7}  {'policy':<14}{'TTFT p50':>10}{'TTFT p95':>10}{'TPOT p95':>10}"
        f"{'req/s':>8}{'tok/s':>9}  saturated"
    )
    rows = [head, "-" * len(head)]
    for p in points:
        s = p.outcome.summary
        rows.append(
            f"{p.rate:>7g}  {p.outcome.run.label:<14}{s.ttft.median:>10.1f}{s.ttft.p(95):>10.1f}"
            f"{s.tpot.p(95):>10.2f}{s.request_throughput:>8.2f}{s.output_throughput:>9.0f}"
            f"  {'yes' if p.saturated else 'no'}"
        )
    rows.append("-" * len(head))
    for label, rate in saturation_rates(points).items():
        rows.append(
            f"{label}: saturates at {rate:g} req/s"
            if rate is not None
            else f"{label}: not saturated up to {points[-1].rate:g} req/s"
        )
    return rows
