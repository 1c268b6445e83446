"""Two runs side by side, field by field: typically a simulated run and a measured run of the same
traffic. Both carry vLLM benchmark field names (the shared metrics module writes them), so the
relative error of each figure is a plain lookup.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# The figures the calibration target is stated in.
HEADLINE = ("mean_ttft_ms", "p95_tpot_ms", "output_throughput")

DEFAULT_FIELDS = (
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "duration",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "request_goodput",
    *(
        f"{stat}_{metric}_ms"
        for metric in ("ttft", "tpot", "itl", "e2el")
        for stat in ("mean", "median", "p90", "p95", "p99")
    ),
)

_MARKER = "mean_ttft_ms"  # a dict holding this is a run summary


@dataclass(frozen=True)
class FieldDiff:
    name: str
    a: float | None
    b: float | None

    @property
    def rel_error(self) -> float | None:
        """(a - b) / b: how far ``a`` (the simulation) is from ``b`` (the measurement)."""
        if self.a is None or self.b is None:
            return None
        if self.b == 0:
            return 0.0 if self.a == 0 else math.inf
        return (self.a - self.b) / abs(self.b)


def _candidates(obj: object, path: str = "") -> list[tuple[str, dict]]:
    if isinstance(obj, dict):
        if _MARKER in obj:
            return [(path or "(top)", obj)]
        found = []
        for key, value in obj.items():
            found += _candidates(value, f"{path}.{key}" if path else str(key))
        return found
    if isinstance(obj, list):
        found = []
        for i, value in enumerate(obj):
            found += _candidates(value, f"{path}[{i}]")
        return found
    return []


def _label(path: str, run: dict) -> list[str]:
    names = [path, path.rsplit(".", 1)[-1]]
    names += [str(run[k]) for k in ("label", "policy", "backend", "name") if k in run]
    return names


def load_run(path: str | Path, select: str | None = None) -> dict:
    """The run summary in a JSON file: the file itself, or the one nested run it holds, or the
    nested run named ``select`` (by key, index path, or its label/policy/backend field)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no such file: {p}")
    try:
        obj = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}: not JSON: {exc}") from None
    runs = _candidates(obj)
    if not runs:
        raise ValueError(f"{p}: holds no run summary (no '{_MARKER}' field)")
    if select is not None:
        picked = [run for where, run in runs if select in _label(where, run)]
        if len(picked) != 1:
            names = ", ".join(where for where, _ in runs)
            raise ValueError(
                f"{p}: {'no' if not picked else 'several'} runs named {select!r}; it holds {names}"
            )
        return picked[0]
    if len(runs) > 1:
        names = ", ".join(where for where, _ in runs)
        raise ValueError(f"{p}: holds several runs ({names}); pick one with --select-a/--select-b")
    return runs[0][1]


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def compare(a: dict, b: dict, fields: tuple[str, ...] | list[str] = DEFAULT_FIELDS) -> list[FieldDiff]:
    """Every listed field present in either run, as (a, b, relative error of a against b)."""
    out = []
    for name in fields:
        if name in a or name in b:
            out.append(FieldDiff(name, _number(a.get(name)), _number(b.get(name))))
    return out


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"


def _fmt_err(err: float | None) -> str:
    if err is None:
        return "-"
    return "inf" if math.isinf(err) else f"{err:+.1%}"


def format_compare(diffs: list[FieldDiff], name_a: str = "sim", name_b: str = "real") -> str:
    lines = [f"| field | {name_a} | {name_b} | rel. error |", "|---|---:|---:|---:|"]
    lines += [f"| {d.name} | {_fmt(d.a)} | {_fmt(d.b)} | {_fmt_err(d.rel_error)} |" for d in diffs]
    return "\n".join(lines)


def headline_errors(a: dict, b: dict) -> dict[str, float | None]:
    """Relative errors of the calibration target's three figures."""
    return {d.name: d.rel_error for d in compare(a, b, HEADLINE)}
