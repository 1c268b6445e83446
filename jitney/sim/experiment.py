"""Several policies over the same traffic: configurations, runs, the table and the JSON rows."""

from __future__ import annotations

from dataclasses import dataclass

from jitney.config import CacheConfig, SchedulerConfig
from jitney.metrics import SLO, Summary
from jitney.sim.costs import CostModel
from jitney.sim.simulator import SimResult, run
from jitney.sim.traffic import TrafficItem


@dataclass(frozen=True)
class PolicyRun:
    label: str  # "static", "continuous", "chunked" or "chunked-<chunk>" when several chunks run
    scheduler_config: SchedulerConfig


def policy_runs(
    policies: list[str],
    chunks: list[int],
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    queue: str,
    max_model_len: int,
) -> list[PolicyRun]:
    runs = []
    for policy in policies:
        for chunk in chunks if policy == "chunked" else [0]:
            label = f"chunked-{chunk}" if policy == "chunked" and len(chunks) > 1 else policy
            runs.append(
                PolicyRun(
                    label,
                    SchedulerConfig(
                        max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens,
                        policy=policy,
                        long_prefill_token_threshold=chunk,
                        queue=queue,
                        max_model_len=max_model_len,
                    ),
                )
            )
    return runs


@dataclass
class Outcome:
    run: PolicyRun
    result: SimResult
    summary: Summary


def run_all(
    items: list[TrafficItem],
    runs: list[PolicyRun],
    cache_config: CacheConfig,
    cost: CostModel,
    *,
    slo: SLO | None = None,
    fast_path: bool = True,
    record_timeline: bool = False,
) -> list[Outcome]:
    outcomes = []
    for pr in runs:
        result = run(
            items,
            pr.scheduler_config,
            cache_config,
            cost,
            label=pr.label,
            fast_path=fast_path,
            record_timeline=record_timeline,
        )
        outcomes.append(Outcome(pr, result, result.summary(slo)))
    return outcomes


def table(outcomes: list[Outcome]) -> list[str]:
    """The seed's table (ms, tok/s, simulated seconds) plus preemptions and slot utilisation."""
    head = (
        f"{'policy':<14}{'TTFT p50':>10}{'TTFT p95':>10}{'TPOT p50':>10}{'TPOT p95':>10}"
        f"{'tok/s':>9}{'wall, s':>9}{'preempt':>9}{'slots':>8}"
    )
    rows = [head, "-" * len(head)]
    for o in outcomes:
        s = o.summary
        util = f"{s.slot_utilization * 100:.1f}%" if s.slot_utilization is not None else "-"
        rows.append(
            f"{o.run.label:<14}{s.ttft.median:>10.1f}{s.ttft.p(95):>10.1f}{s.tpot.median:>10.2f}"
            f"{s.tpot.p(95):>10.2f}{s.output_throughput:>9.0f}{o.result.end_time:>9.2f}"
            f"{s.num_preemptions:>9}{util:>8}"
        )
    rows.append("-" * len(head))
    return rows


def totals_check(items: list[TrafficItem], outcomes: list[Outcome]) -> tuple[bool, list[str]]:
    """Every request finished and the tokens generated equal the tokens asked, per policy."""
    asked = sum(it.output_len for it in items)
    mean = asked / len(items) if items else 0.0
    ok = True
    lines = []
    for o in outcomes:
        r = o.result
        done = sum(1 for q in r.requests if q.finish_time is not None)
        generated = sum(q.num_output_tokens for q in r.requests)
        good = done == len(items) and generated == asked and not r.rejected
        ok &= good
        verdict = "ok" if good else f"MISMATCH: {done}/{len(items)} finished, {len(r.rejected)} rejected"
        lines.append(
            f"{o.run.label}: {generated} of {asked} output tokens "
            f"({len(items)} x {mean:.0f}), {done} of {len(items)} finished: {verdict}"
        )
    return ok, lines


def outcome_json(o: Outcome, extra: dict[str, object]) -> dict[str, object]:
    """One policy's JSON object: vLLM benchmark field names, then the run's configuration.
    Deterministic: no wall-clock measurements, so equal inputs give identical files."""
    sc = o.run.scheduler_config
    r = o.result
    out: dict[str, object] = {"policy": o.run.label}
    out.update(o.summary.to_dict())
    out.update(
        {
            "all_finished": r.all_finished and not r.rejected,
            "num_steps": r.counters.steps,
            "num_fast_path_steps": r.num_fast_steps,
            "busy_seconds": r.counters.busy_seconds,
            "padding_prefill_tokens": r.counters.padding_prefill_tokens,
            "max_num_seqs": sc.max_num_seqs,
            "max_num_batched_tokens": sc.max_num_batched_tokens,
            "chunk": sc.long_prefill_token_threshold,
            "queue": sc.queue,
        }
    )
    out.update(extra)
    return out
