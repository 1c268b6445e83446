"""The Russian seed's task 08.2: how many useful tokens each model call brings, pad-to-max waves
against continuous slot refilling.

Attention and the KV cache are left out on purpose (the model is an embedding, a few MLP blocks
and an LM head): what is measured is slot occupancy, not kernels. Both policies must produce
exactly ``sum(out_lens)`` tokens; the difference is how many model calls (and seconds) it takes.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from jitney.metrics import slot_utilization

POLICIES = ("pad_to_max", "continuous")


@dataclass(frozen=True)
class SlotsConfig:
    """The seed's workload: 64 requests, lognormal output lengths clipped to [64, 512]."""

    num_requests: int = 64
    median_output_len: float = 180.0
    sigma: float = 0.5
    min_output_len: int = 64
    max_output_len: int = 512
    prompt_len: int = 64
    batch_sizes: tuple[int, ...] = (8, 32)
    lengths_seed: int = 7
    torch_seed: int = 0
    vocab_size: int = 4096
    d_model: int = 256
    num_blocks: int = 4
    repeats: int = 1  # the reported seconds are the median over repeats
    # One thread: the model is too small to gain from two, and a single thread is far less hurt
    # when another process shares the cores (OpenMP workers spin waiting for each other).
    num_threads: int = 1

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not 1 <= self.min_output_len <= self.max_output_len:
            raise ValueError(
                f"output lengths need 1 <= min <= max, got [{self.min_output_len}, {self.max_output_len}]"
            )
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if self.prompt_len < 1 or self.repeats < 1 or self.num_threads < 1:
            raise ValueError("prompt_len, repeats and num_threads must be >= 1")


class _MLPBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.norm2 = nn.LayerNorm(d)
        self.mix = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.down(F.gelu(self.up(self.norm1(h))))
        return h + self.mix(self.norm2(h))


class TinyLM(nn.Module):
    """Embedding, ``num_blocks`` residual MLP blocks, LM head: [B, T] ids -> [B, T, V] logits."""

    def __init__(self, vocab_size: int = 4096, d_model: int = 256, num_blocks: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(_MLPBlock(d_model) for _ in range(num_blocks))
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.lm_head(h)


def sample_output_lens(cfg: SlotsConfig) -> list[int]:
    """Lognormal output lengths, clipped, from their own seeded generator (same list every run)."""
    rng = random.Random(cfg.lengths_seed)
    mu = math.log(cfg.median_output_len)
    return [
        int(min(cfg.max_output_len, max(cfg.min_output_len, rng.lognormvariate(mu, cfg.sigma))))
        for _ in range(cfg.num_requests)
    ]


def build_model(cfg: SlotsConfig | None = None) -> TinyLM:
    cfg = cfg or SlotsConfig()
    torch.manual_seed(cfg.torch_seed)
    return TinyLM(cfg.vocab_size, cfg.d_model, cfg.num_blocks).eval()


@dataclass
class SlotRun:
    """One policy at one batch size. ``slot_tokens`` counts every slot computed, useful or not."""

    policy: str
    batch_size: int
    tokens: int
    seconds: float
    model_calls: int
    slot_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def utilization(self) -> float:
        return slot_utilization(self.tokens, self.slot_tokens)


class _Counter:
    """Wraps the model so every call and every computed slot is counted in one place."""

    def __init__(self, model: TinyLM) -> None:
        self.model = model
        self.calls = 0
        self.slots = 0

    def next_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.slots += ids.shape[0]
        return self.model(ids)[:, -1, :].argmax(dim=-1)


def _prompts(n: int, prompt_len: int, vocab_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n * 7919 + prompt_len)
    return torch.randint(0, vocab_size, (n, prompt_len), generator=gen)


def _pad_to_max(counter: _Counter, out_lens: list[int], batch_size: int, prompts: torch.Tensor) -> int:
    """Waves of ``batch_size``: a wave keeps all its slots until its longest request is done."""
    useful = 0
    for start in range(0, len(out_lens), batch_size):
        wave = out_lens[start : start + batch_size]
        last = counter.next_tokens(prompts[start : start + len(wave)])  # prefill gives token 1
        useful += len(wave)
        for step in range(1, max(wave)):
            last = counter.next_tokens(last.unsqueeze(1))
            useful += sum(1 for n in wave if n > step)  # finished slots compute padding
    return useful


def _continuous(counter: _Counter, out_lens: list[int], batch_size: int, prompts: torch.Tensor) -> int:
    """A slot freed by a finished request is refilled from the queue before the next step."""
    queue = deque(range(len(out_lens)))
    remaining: list[int] = []  # tokens still owed to each active slot
    last = torch.empty(0, dtype=torch.long)
    useful = 0
    while queue or remaining:
        free = batch_size - len(remaining)
        if queue and free > 0:
            admitted = [queue.popleft() for _ in range(min(free, len(queue)))]
            first = counter.next_tokens(prompts[admitted])  # prefill gives token 1
            useful += len(admitted)
            remaining += [out_lens[i] - 1 for i in admitted]
            last = torch.cat([last, first])
        keep = [i for i, left in enumerate(remaining) if left > 0]
        remaining = [remaining[i] for i in keep]
        last = last[keep]
        if not remaining:
            continue
        last = counter.next_tokens(last.unsqueeze(1))
        useful += len(remaining)
        remaining = [left - 1 for left in remaining]
    return useful


def run_policy(
    policy: str, out_lens: list[int], batch_size: int, model: TinyLM, prompt_len: int = 64
) -> SlotRun:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not out_lens or any(n < 1 for n in out_lens):
        raise ValueError("out_lens must be a non-empty list of lengths >= 1")
    prompts = _prompts(len(out_lens), prompt_len, model.embed.num_embeddings)
    counter = _Counter(model)
    loop = _pad_to_max if policy == "pad_to_max" else _continuous
    with torch.inference_mode():
        t0 = time.perf_counter()
        tokens = loop(counter, out_lens, batch_size, prompts)
        seconds = time.perf_counter() - t0
    if tokens != sum(out_lens):
        raise AssertionError(f"{policy}: produced {tokens} tokens, expected sum(out_lens) = {sum(out_lens)}")
    return SlotRun(policy, batch_size, tokens, seconds, counter.calls, counter.slots)


def bench(
    policy: str, out_lens: list[int], batch_size: int, model: TinyLM | None = None
) -> tuple[int, float, int]:
    """The seed's interface: (tokens generated, seconds, model calls)."""
    run = run_policy(policy, out_lens, batch_size, model or build_model())
    return run.tokens, run.seconds, run.model_calls


def run_all(cfg: SlotsConfig) -> list[SlotRun]:
    """Both policies at every batch size on one model; seconds are medians over ``cfg.repeats``."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(cfg.num_threads)
    try:
        model = build_model(cfg)
        out_lens = sample_output_lens(cfg)
        with torch.inference_mode():  # warm-up: first calls pay for allocator and kernel selection
            for _ in range(3):
                model(_prompts(max(cfg.batch_sizes), cfg.prompt_len, cfg.vocab_size))
        runs = []
        for batch_size in cfg.batch_sizes:
            for policy in POLICIES:
                tries = [
                    run_policy(policy, out_lens, batch_size, model, cfg.prompt_len)
                    for _ in range(cfg.repeats)
                ]
                tries.sort(key=lambda r: r.seconds)
                runs.append(tries[len(tries) // 2])
        return runs
    finally:
        torch.set_num_threads(threads_before)


def format_table(runs: list[SlotRun]) -> str:
    """Markdown table; each continuous row carries its speed-up over pad_to_max at that batch."""
    lines = [
        "| batch | policy | tokens | model calls | slot utilisation | seconds | tok/s | calls saved "
        "| speed-up |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = {r.batch_size: r for r in runs if r.policy == "pad_to_max"}
    for r in runs:
        ref = base.get(r.batch_size)
        ratio_calls = ref.model_calls / r.model_calls if ref else 1.0
        speedup = r.tokens_per_s / ref.tokens_per_s if ref and ref.tokens_per_s else 1.0
        lines.append(
            f"| {r.batch_size} | {r.policy} | {r.tokens} | {r.model_calls} | {r.utilization:.1%} | "
            f"{r.seconds:.2f} | {r.tokens_per_s:,.0f} | x{ratio_calls:.2f} | x{speedup:.2f} |"
        )
    return "\n".join(lines)
