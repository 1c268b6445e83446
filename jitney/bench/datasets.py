"""What a load-generator run sends: prompts with their lengths, output lengths, and (for replayed
or seeded traffic) arrival offsets.

Random-token prompts are lists of token ids (the completions endpoint accepts them), so the prompt
length the server sees is exactly the one drawn; for the chat endpoint, or servers that want text,
the ids are decoded with a tokenizer. Lengths come from small parsed specs such as
``lognormal:256,0.6,16,1024`` so a run is reproducible from its command line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jitney.sim.traffic import TrafficItem, TrafficSpec, generate, load_trace

DIST_KINDS = ("fixed", "uniform", "lognormal")


@dataclass(frozen=True)
class LengthDist:
    """A length distribution: ``fixed:N``, ``uniform:LOW,HIGH`` or ``lognormal:MEDIAN,SIGMA,LOW,HIGH``
    (lognormal clipped to [LOW, HIGH], as the seeds draw lengths)."""

    kind: str
    low: int
    high: int
    median: float = 0.0
    sigma: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in DIST_KINDS:
            raise ValueError(f"length distribution must be one of {', '.join(DIST_KINDS)}, got {self.kind!r}")
        if not 1 <= self.low <= self.high:
            raise ValueError(f"length range needs 1 <= low <= high, got [{self.low}, {self.high}]")
        if self.kind == "lognormal" and not (self.median > 0 and self.sigma >= 0):
            raise ValueError(f"lognormal needs median > 0 and sigma >= 0, got {self.median}, {self.sigma}")

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        kind, _, rest = text.partition(":")
        if not rest:  # a bare number means a fixed length
            kind, rest = "fixed", kind
        try:
            nums = [float(x) for x in rest.split(",")]
        except ValueError:
            raise ValueError(f"bad length spec {text!r}: expected numbers after '{kind}:'") from None
        arity = {"fixed": 1, "uniform": 2, "lognormal": 4}.get(kind)
        if arity is None:
            raise ValueError(f"bad length spec {text!r}: kind must be one of {', '.join(DIST_KINDS)}")
        if len(nums) != arity:
            raise ValueError(f"bad length spec {text!r}: {kind} takes {arity} number(s)")
        if kind == "fixed":
            return cls("fixed", int(nums[0]), int(nums[0]))
        if kind == "uniform":
            return cls("uniform", int(nums[0]), int(nums[1]))
        return cls("lognormal", int(nums[2]), int(nums[3]), median=nums[0], sigma=nums[1])

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "fixed":
            return [self.low] * n
        if self.kind == "uniform":
            return [int(x) for x in rng.integers(self.low, self.high + 1, size=n)]
        draws = rng.lognormal(math.log(self.median), self.sigma, size=n)
        return [int(x) for x in np.clip(draws, self.low, self.high)]

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(self.low)
        if self.kind == "uniform":
            return f"uniform:{self.low},{self.high}"
        return f"lognormal:{self.median:g},{self.sigma:g},{self.low},{self.high}"


@dataclass(frozen=True)
class BenchRequest:
    """One request to send. ``arrival`` (seconds from the start) is set for seeded or replayed
    traffic; synthetic datasets leave it None and the arrival process decides."""

    prompt: tuple[int, ...] | str
    prompt_len: int
    output_len: int
    arrival: float | None = None


@dataclass(frozen=True)
class TokenSpace:
    """Where random prompt ids come from: ``[first_id, vocab_size)``, skipping low special ids."""

    vocab_size: int = 500
    first_id: int = 10

    def __post_init__(self) -> None:
        if not 0 <= self.first_id < self.vocab_size:
            raise ValueError(
                f"token ids need 0 <= first_id < vocab_size, got {self.first_id}, {self.vocab_size}"
            )

    def draw(self, rng: np.random.Generator, n: int) -> tuple[int, ...]:
        return tuple(int(x) for x in rng.integers(self.first_id, self.vocab_size, size=n))


def random_requests(
    num: int,
    input_len: LengthDist,
    output_len: LengthDist,
    *,
    seed: int = 0,
    prefix_len: int = 0,
    tokens: TokenSpace | None = None,
) -> list[BenchRequest]:
    """``num`` requests with random-token prompts; all share a ``prefix_len``-token prefix (to
    exercise prefix caching) followed by their own ``input_len`` tokens."""
    if num < 1:
        raise ValueError(f"the number of prompts must be >= 1, got {num}")
    if prefix_len < 0:
        raise ValueError(f"prefix length must be >= 0, got {prefix_len}")
    tokens = tokens or TokenSpace()
    rng = np.random.default_rng(seed)
    prefix = tokens.draw(rng, prefix_len)
    ins = input_len.sample(rng, num)
    outs = output_len.sample(rng, num)
    return [
        BenchRequest(prefix + tokens.draw(rng, n), prefix_len + n, o) for n, o in zip(ins, outs, strict=True)
    ]


def from_traffic(
    items: list[TrafficItem], *, seed: int = 0, tokens: TokenSpace | None = None
) -> list[BenchRequest]:
    """Random-token prompts for traffic whose lengths and arrivals are given (the seed's generator
    or a trace), so the same list can drive a server and the simulator."""
    tokens = tokens or TokenSpace()
    rng = np.random.default_rng(seed)
    return [
        BenchRequest(tokens.draw(rng, it.prompt_len), it.prompt_len, it.output_len, it.arrival)
        for it in items
    ]


def seed_traffic(
    rate: float,
    duration_s: float,
    seed: int = 1234,
    burstiness: float = 1.0,
    tokens: TokenSpace | None = None,
) -> list[BenchRequest]:
    """The Russian seed's task 08.1 workload (its lognormal lengths, its random call order)."""
    items = generate(TrafficSpec(rate=rate, duration_s=duration_s, seed=seed, burstiness=burstiness))
    if not items:
        raise ValueError(f"no request arrives within {duration_s} s at {rate} req/s")
    return from_traffic(items, seed=seed, tokens=tokens)


def trace_requests(
    path: str | Path, *, seed: int = 0, tokens: TokenSpace | None = None
) -> list[BenchRequest]:
    """Replay a CSV / JSON Lines trace of (arrival seconds, prompt length, output length)."""
    return from_traffic(load_trace(path), seed=seed, tokens=tokens)


def as_traffic(requests: list[BenchRequest]) -> list[TrafficItem]:
    """The simulator's view of requests that carry arrivals (for a simulated twin of a run)."""
    if any(r.arrival is None for r in requests):
        raise ValueError("every request needs an arrival time to be simulated")
    return [TrafficItem(float(r.arrival), r.prompt_len, r.output_len) for r in requests]  # type: ignore[arg-type]


def with_text_prompts(requests: list[BenchRequest], decode) -> list[BenchRequest]:
    """Turn token-id prompts into text with ``decode(ids) -> str`` (for chat or text-only servers);
    the server's own tokenization decides the final prompt length, reported back in ``usage``."""
    out = []
    for r in requests:
        text = r.prompt if isinstance(r.prompt, str) else decode(list(r.prompt))
        out.append(BenchRequest(text, r.prompt_len, r.output_len, r.arrival))
    return out
