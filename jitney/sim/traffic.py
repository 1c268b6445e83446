"""Request arrivals for the simulator: the seed's Poisson generator, gamma arrivals with a
burstiness factor, and trace replay from CSV or JSON Lines. Times are in seconds."""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

# The seed's workload (task 08.1).
SEED_RNG_SEED = 1234
SEED_RATE = 16.0
SEED_DURATION_S = 30.0
MIN_PROMPT, MAX_PROMPT = 64, 4096
MIN_OUTPUT, MAX_OUTPUT = 16, 384
MAX_REQUESTS = 2_000_000  # keeps one run's timestamps within a few GiB of memory


@dataclass(frozen=True, slots=True)
class TrafficItem:
    arrival: float  # seconds from the start of the simulation
    prompt_len: int
    output_len: int
    priority: int = 0


@dataclass(frozen=True)
class TrafficSpec:
    """A synthetic workload. ``burstiness`` is the gamma shape k of inter-arrival times (k = 1 is
    Poisson, k < 1 burstier); ``seed_units`` reproduces the seed's defect of reading arrival
    seconds as milliseconds, which squeezes the whole window into its first thousandth."""

    rate: float = SEED_RATE
    duration_s: float = SEED_DURATION_S
    seed: int = SEED_RNG_SEED
    burstiness: float = 1.0
    seed_units: bool = False

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate must be a finite number > 0 req/s, got {self.rate}")
        if not (self.duration_s > 0 and math.isfinite(self.duration_s)):
            raise ValueError(f"duration must be a finite number > 0 s, got {self.duration_s}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a finite number > 0, got {self.burstiness}")
        expected = self.rate * self.duration_s
        if expected > MAX_REQUESTS:
            raise ValueError(
                f"rate x duration = {expected:.0f} requests; at most {MAX_REQUESTS:,} fit in one simulation"
            )


def generate(spec: TrafficSpec) -> list[TrafficItem]:
    """The seed's ``make_traffic``, draw for draw: per request one inter-arrival draw, then the
    prompt length, then the output length, all from one ``random.Random(seed)``."""
    rng = random.Random(spec.seed)
    scale = 1e-3 if spec.seed_units else 1.0
    k = spec.burstiness
    items: list[TrafficItem] = []
    t = 0.0
    while True:
        t += rng.expovariate(spec.rate) if k == 1.0 else rng.gammavariate(k, 1.0 / (k * spec.rate))
        if t >= spec.duration_s:
            break
        p = int(min(MAX_PROMPT, max(MIN_PROMPT, rng.lognormvariate(math.log(700), 0.9))))
        o = int(min(MAX_OUTPUT, max(MIN_OUTPUT, rng.lognormvariate(math.log(110), 0.6))))
        items.append(TrafficItem(t * scale, p, o))
    return items


_ARRIVAL_KEYS = ("arrival", "arrival_time", "timestamp")
_PROMPT_KEYS = ("prompt_len", "prompt_tokens", "input_len")
_OUTPUT_KEYS = ("output_len", "output_tokens", "max_tokens")


def _pick(row: dict, keys: tuple[str, ...], where: str) -> object:
    for key in keys:
        if key in row and row[key] not in ("", None):
            return row[key]
    raise ValueError(f"{where}: missing a column named one of {', '.join(keys)}")


def _item(row: dict, where: str) -> TrafficItem:
    try:
        arrival = float(_pick(row, _ARRIVAL_KEYS, where))
        prompt = int(_pick(row, _PROMPT_KEYS, where))
        output = int(_pick(row, _OUTPUT_KEYS, where))
        priority = int(row.get("priority") or 0)
    except (TypeError, ValueError) as exc:
        if str(exc).startswith(where):
            raise
        raise ValueError(f"{where}: {exc}") from None
    if not (math.isfinite(arrival) and arrival >= 0):
        raise ValueError(f"{where}: arrival must be a finite number of seconds >= 0, got {arrival}")
    if prompt < 1 or output < 1:
        raise ValueError(f"{where}: prompt and output lengths must be >= 1, got {prompt}, {output}")
    return TrafficItem(arrival, prompt, output, priority)


def load_trace(path: str | Path) -> list[TrafficItem]:
    """Read a trace: CSV with a header, or JSON Lines (``.jsonl``/``.json``), one request per row
    with arrival (seconds), prompt and output lengths, optional priority. Sorted by arrival and
    shifted so the first request arrives at 0 (a trace may carry wall-clock timestamps)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no trace file at {p}")
    items: list[TrafficItem] = []
    if p.suffix in (".jsonl", ".json", ".ndjson"):
        with p.open() as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{p}:{lineno}: not JSON: {exc}") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{p}:{lineno}: expected a JSON object per line")
                items.append(_item(row, f"{p}:{lineno}"))
    else:
        with p.open(newline="") as fh:
            for lineno, row in enumerate(csv.DictReader(fh), 2):
                items.append(_item(row, f"{p}:{lineno}"))
    if not items:
        raise ValueError(f"{p}: the trace holds no requests")
    items.sort(key=lambda it: it.arrival)
    t0 = items[0].arrival
    if t0 > 0:
        items = [TrafficItem(it.arrival - t0, it.prompt_len, it.output_len, it.priority) for it in items]
    return items
