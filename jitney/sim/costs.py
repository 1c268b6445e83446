"""Step cost models: a step's shape -> its duration in seconds.

All three share one interface so the simulator, the sweep and the CLI do not care which is used:
``linear`` (the seed's constants), ``roofline`` (model + hardware), ``profile`` (least squares
over step timings measured on the real engine).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from jitney.core.outputs import SchedulerOutput
from jitney.sim.roofline import Roofline, StepShape


def shape_of(output: SchedulerOutput) -> StepShape:
    """Prefill tokens (non-decode chunks plus static padding), decode slots (decode chunks plus
    static padding slots), KV context read (sum of chunk ends) and attention (query, key) pairs."""
    prefill = decode = context = pairs = 0
    for c in output.chunks:
        end = c.start + c.num_tokens
        context += end
        pairs += c.num_tokens * c.start + c.num_tokens * (c.num_tokens + 1) // 2
        if c.is_decode:
            decode += 1
        else:
            prefill += c.num_tokens
    return StepShape(
        prefill + output.num_padding_prefill_tokens, decode + output.num_padding_decode_slots, context, pairs
    )


class CostModel(Protocol):
    name: str
    context_sensitive: bool  # False: a step's cost ignores context_tokens and attention_pairs

    def step_seconds(self, shape: StepShape) -> float: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class LinearCost:
    """The seed's step cost, in milliseconds as it states the constants:
    overhead + prefill_ms_per_token * prefill + (decode_base + decode_per_seq * n_decode if any decode)."""

    step_overhead_ms: float = 0.20
    prefill_ms_per_token: float = 0.020
    decode_base_ms: float = 0.40
    decode_per_seq_ms: float = 0.030
    name: str = "linear"
    context_sensitive = False  # equal shapes but for context cost the same: steps can share one cost

    def __post_init__(self) -> None:
        for field in ("step_overhead_ms", "prefill_ms_per_token", "decode_base_ms", "decode_per_seq_ms"):
            if getattr(self, field) < 0:
                raise ValueError(f"linear cost {field} must be >= 0, got {getattr(self, field)}")

    def step_ms(self, prefill_tokens: int, n_decode: int) -> float:
        ms = self.step_overhead_ms + self.prefill_ms_per_token * prefill_tokens
        if n_decode > 0:
            ms += self.decode_base_ms + self.decode_per_seq_ms * n_decode
        return ms

    def step_seconds(self, shape: StepShape) -> float:
        return self.step_ms(shape.prefill_tokens, shape.decode_tokens) / 1000.0

    def describe(self) -> str:
        return (
            f"linear: {self.step_overhead_ms} ms + {self.prefill_ms_per_token} ms/prefill token + "
            f"({self.decode_base_ms} + {self.decode_per_seq_ms} x decodes) ms"
        )


@dataclass(frozen=True)
class RooflineCost:
    roofline: Roofline
    name: str = "roofline"
    context_sensitive = True

    def step_seconds(self, shape: StepShape) -> float:
        return self.roofline.step_seconds(shape)

    def describe(self) -> str:
        r = self.roofline
        return (
            f"roofline: {r.model.name} on {r.hardware.name} ({r.hardware.memory_bandwidth / 1e12:.3g} TB/s, "
            f"{r.effective_flops / 1e12:.3g} TFLOP/s effective), overhead {r.overhead_s * 1e3:g} ms"
        )


@dataclass(frozen=True)
class ProfileFit:
    """How well the fitted plane reproduces the measured steps."""

    num_samples: int
    rmse_ms: float
    mean_abs_pct_error: float
    r2: float


@dataclass(frozen=True)
class ProfileCost:
    """ms = intercept + a * prefill_tokens + b * decode_tokens + c * context_tokens."""

    intercept_ms: float
    ms_per_prefill_token: float
    ms_per_decode_token: float
    ms_per_context_token: float
    fit: ProfileFit
    name: str = "profile"

    @property
    def context_sensitive(self) -> bool:
        return self.ms_per_context_token != 0.0

    def step_seconds(self, shape: StepShape) -> float:
        ms = (
            self.intercept_ms
            + self.ms_per_prefill_token * shape.prefill_tokens
            + self.ms_per_decode_token * shape.decode_tokens
            + self.ms_per_context_token * shape.context_tokens
        )
        return max(ms, 0.0) / 1000.0

    def describe(self) -> str:
        f = self.fit
        return (
            f"profile: {self.intercept_ms:.4g} ms + {self.ms_per_prefill_token:.4g} ms/prefill tok + "
            f"{self.ms_per_decode_token:.4g} ms/decode + {self.ms_per_context_token:.4g} ms/context tok "
            f"(n={f.num_samples}, RMSE {f.rmse_ms:.3g} ms, MAPE {f.mean_abs_pct_error:.1f}%, R2 {f.r2:.3f})"
        )

    @classmethod
    def fit_samples(cls, rows: list[tuple[int, int, int, float]]) -> ProfileCost:
        """Least squares over (prefill_tokens, decode_tokens, context_tokens, ms) rows."""
        if len(rows) < 4:
            raise ValueError(
                f"a profile needs at least 4 step timings to fit 4 coefficients, got {len(rows)}"
            )
        data = np.asarray(rows, dtype=np.float64)
        x = np.column_stack([np.ones(len(data)), data[:, :3]])
        y = data[:, 3]
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        pred = x @ coef
        resid = y - pred
        ss_tot = float(((y - y.mean()) ** 2).sum())
        nonzero = y > 0
        mape = float(np.mean(np.abs(resid[nonzero] / y[nonzero])) * 100) if nonzero.any() else 0.0
        fit = ProfileFit(
            num_samples=len(data),
            rmse_ms=float(np.sqrt(np.mean(resid**2))),
            mean_abs_pct_error=mape,
            r2=1.0 - float((resid**2).sum()) / ss_tot if ss_tot > 0 else 1.0,
        )
        return cls(*(float(c) for c in coef), fit=fit)

    @classmethod
    def from_jsonl(cls, path: str | Path) -> ProfileCost:
        p = Path(path)
        rows = []
        with p.open() as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    row = (
                        int(obj["prefill_tokens"]),
                        int(obj["decode_tokens"]),
                        int(obj["context_tokens"]),
                        float(obj["ms"]),
                    )
                except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                    raise ValueError(
                        f"{p}:{lineno}: expected {{prefill_tokens, decode_tokens, context_tokens, ms}}: {exc}"
                    ) from None
                if min(row[:3]) < 0 or not row[3] >= 0:
                    raise ValueError(f"{p}:{lineno}: counts and ms must be >= 0")
                rows.append(row)
        return cls.fit_samples(rows)
