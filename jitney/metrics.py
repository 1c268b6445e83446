"""Per-request timestamps -> latency and throughput summary, with vLLM's benchmark field names.

One module serves the engine (timestamps stamped on ``Request`` by the scheduler's clock), the
simulator (the same stamps on a virtual clock) and the load generator (timestamps the client
measures itself), so simulated and measured runs can be diffed field by field. Definitions follow
vLLM's ``benchmark_serving``: TPOT excludes the first token, ITL is every gap between consecutive
outputs, percentiles interpolate linearly (numpy's default), empty samples read as 0.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from jitney.request import Request, RequestStatus

PERCENTILES = (50, 90, 95, 99)
_MS = 1000.0


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What one request's latency metrics need; all times in seconds on one clock.

    ``token_times`` holds the time each output token (or each streamed chunk, for a client that
    cannot see single tokens) arrived, the first token included.
    """

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    prompt_tokens: int
    output_tokens: int
    token_times: tuple[float, ...] = ()
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    success: bool = True
    error: str = ""

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.output_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got {self.prompt_tokens}, {self.output_tokens}")
        if self.success and (self.first_token_time is None or self.finish_time is None):
            raise ValueError("a successful record needs first_token_time and finish_time")

    @property
    def ttft(self) -> float:
        assert self.first_token_time is not None
        return self.first_token_time - self.arrival_time

    @property
    def e2el(self) -> float:
        assert self.finish_time is not None
        return self.finish_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for one-token outputs."""
        if self.output_tokens <= 1:
            return None
        assert self.finish_time is not None and self.first_token_time is not None
        return (self.finish_time - self.first_token_time) / (self.output_tokens - 1)

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


def from_request(req: Request) -> RequestRecord:
    """Record of a request the scheduler has stamped. Aborted or unfinished requests are failures."""
    finished = req.finish_time is not None and req.first_token_time is not None
    success = finished and req.status != RequestStatus.FINISHED_ABORTED
    times = list(req.token_times)
    if req.first_token_time is not None and (not times or times[0] != req.first_token_time):
        times.insert(0, req.first_token_time)
    return RequestRecord(
        arrival_time=req.arrival_time,
        first_token_time=req.first_token_time,
        finish_time=req.finish_time,
        prompt_tokens=req.num_prompt_tokens,
        output_tokens=req.num_output_tokens,
        token_times=tuple(times),
        first_scheduled_time=req.first_scheduled_time,
        num_preemptions=req.num_preemptions,
        success=success,
        error="" if success else (req.status.finish_reason or "unfinished"),
    )


@dataclass(frozen=True, slots=True)
class SLO:
    """Service-level objectives in milliseconds; a request is 'good' when it meets every one set."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2el_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"SLO {name} must be > 0 ms, got {value!r}")

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def met_by(self, rec: RequestRecord) -> bool:
        # vLLM counts a one-token output's TPOT as 0 for goodput.
        checks = ((self.ttft_ms, rec.ttft), (self.tpot_ms, rec.tpot or 0.0), (self.e2el_ms, rec.e2el))
        return all(slo is None or value * _MS <= slo for slo, value in checks)


@dataclass(frozen=True, slots=True)
class Stats:
    """Distribution of one latency metric, in milliseconds."""

    mean: float = 0.0
    median: float = 0.0
    std: float = 0.0
    max: float = 0.0
    percentiles: dict[int, float] = field(default_factory=dict)

    @classmethod
    def of_seconds(cls, values: np.ndarray | Sequence[float]) -> Stats:
        arr = np.asarray(values, dtype=np.float64) * _MS
        if arr.size == 0:
            arr = np.zeros(1)  # vLLM reports an empty sample as 0
        pcts = np.percentile(arr, PERCENTILES)
        return cls(
            mean=float(arr.mean()),
            median=float(np.median(arr)),
            std=float(arr.std()),
            max=float(arr.max()),
            percentiles={p: float(v) for p, v in zip(PERCENTILES, pcts, strict=True)},
        )

    def p(self, q: int) -> float:
        return self.percentiles[q]

    def fields(self, metric: str) -> dict[str, float]:
        out = {
            f"mean_{metric}_ms": self.mean,
            f"median_{metric}_ms": self.median,
            f"std_{metric}_ms": self.std,
        }
        out.update({f"p{q}_{metric}_ms": v for q, v in self.percentiles.items()})
        out[f"max_{metric}_ms"] = self.max
        return out


@dataclass(frozen=True, slots=True)
class Summary:
    """A run's metrics. ``to_dict`` gives vLLM benchmark JSON names plus jitney's extras."""

    duration: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2el: Stats
    queue: Stats
    num_preemptions: int
    slot_utilization: float | None = None

    def to_dict(self) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = {
            "duration": self.duration,
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
        }
        for name in ("ttft", "tpot", "itl", "e2el", "queue"):
            out.update(getattr(self, name).fields(name))
        out["num_preemptions"] = self.num_preemptions
        out["slot_utilization"] = self.slot_utilization
        return out


def _itl_gaps(records: Iterable[RequestRecord]) -> np.ndarray:
    """Gaps between consecutive outputs of each request: one flat diff with the gaps that span two
    requests cut out (an hour of simulated traffic has millions of tokens)."""
    times = [r.token_times for r in records if r.token_times]
    if not times:
        return np.zeros(0)
    lengths = np.fromiter((len(t) for t in times), dtype=np.int64, count=len(times))
    flat = np.fromiter(itertools.chain.from_iterable(times), dtype=np.float64, count=int(lengths.sum()))
    return np.delete(np.diff(flat), np.cumsum(lengths)[:-1] - 1)


def summarize(
    records: Sequence[RequestRecord],
    *,
    duration: float | None = None,
    slo: SLO | None = None,
    slot_utilization: float | None = None,
) -> Summary:
    """Summarize a run. ``duration`` defaults to first arrival -> last finish (seconds)."""
    done = [r for r in records if r.success]
    if duration is None:
        starts = [r.arrival_time for r in records]
        ends = [r.finish_time for r in done if r.finish_time is not None]
        duration = (max(ends) - min(starts)) if ends else 0.0
    if duration < 0:
        raise ValueError(f"duration must be >= 0 s, got {duration}")
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)

    total_in = sum(r.prompt_tokens for r in done)
    total_out = sum(r.output_tokens for r in done)
    goodput = None
    if slo is not None and slo.is_set:
        goodput = per_s(sum(1 for r in done if slo.met_by(r)))
    queue = [q for r in done if (q := r.queue_time) is not None]
    return Summary(
        duration=duration,
        completed=len(done),
        failed=len(records) - len(done),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=per_s(len(done)),
        request_goodput=goodput,
        output_throughput=per_s(total_out),
        total_token_throughput=per_s(total_in + total_out),
        ttft=Stats.of_seconds([r.ttft for r in done]),
        tpot=Stats.of_seconds([t for r in done if (t := r.tpot) is not None]),
        itl=Stats.of_seconds(_itl_gaps(done)),
        e2el=Stats.of_seconds([r.e2el for r in done]),
        queue=Stats.of_seconds(queue),
        num_preemptions=sum(r.num_preemptions for r in records),
        slot_utilization=slot_utilization,
    )


def slot_utilization(useful_token_slots: int, paid_token_slots: int) -> float:
    """Share of the token slots a batch paid for that produced a wanted token (static: 14.7%)."""
    if paid_token_slots <= 0:
        raise ValueError(f"paid_token_slots must be > 0, got {paid_token_slots}")
    if not 0 <= useful_token_slots <= paid_token_slots:
        raise ValueError(f"useful_token_slots must be in [0, {paid_token_slots}], got {useful_token_slots}")
    return useful_token_slots / paid_token_slots
