"""The three batching policies as small hooks the one scheduler calls.

Each hook answers one question: how many tokens may this request take now? (0 = not this step),
and may waiting requests be admitted at all this step? The scheduler's loop is shared.
"""

from __future__ import annotations

from dataclasses import dataclass

from jitney.config import SchedulerConfig


@dataclass(frozen=True)
class BatchingPolicy:
    name: str
    chunk_cap: int  # per-request tokens per step; 0 = uncapped
    uses_token_budget: bool = True

    def running_tokens(self, remaining: int, budget: int) -> int:
        """Tokens for a request already running (a decode, or its next prefill chunk)."""
        return self._cap(remaining, budget)

    def admission_open(self, num_running: int) -> bool:
        return True

    def admit_tokens(self, remaining: int, budget: int, step_is_empty: bool) -> int:
        """Tokens for a waiting request being admitted; 0 leaves it (and those behind it) waiting."""
        return self._cap(remaining, budget)

    def _cap(self, remaining: int, budget: int) -> int:
        n = min(remaining, budget)
        return min(n, self.chunk_cap) if self.chunk_cap else n


@dataclass(frozen=True)
class ContinuousPolicy(BatchingPolicy):
    """Orca: a prompt is computed whole in one step, never split."""

    def running_tokens(self, remaining: int, budget: int) -> int:
        return remaining if remaining <= budget else 0

    def admit_tokens(self, remaining: int, budget: int, step_is_empty: bool) -> int:
        if remaining <= budget:
            return remaining
        # Larger than the whole step budget: it would wait forever, so it runs alone instead.
        return remaining if step_is_empty else 0


@dataclass(frozen=True)
class StaticPolicy(BatchingPolicy):
    """Request-level batching: a wave is admitted only when the previous one has fully ended; its
    prompts run whole in one step (padded to the longest) regardless of the token budget, and its
    slots stay paid for until its longest request ends."""

    uses_token_budget: bool = False

    def running_tokens(self, remaining: int, budget: int) -> int:
        return remaining

    def admission_open(self, num_running: int) -> bool:
        return num_running == 0

    def admit_tokens(self, remaining: int, budget: int, step_is_empty: bool) -> int:
        return remaining


def make_policy(config: SchedulerConfig) -> BatchingPolicy:
    if config.policy == "chunked":
        return BatchingPolicy("chunked", config.long_prefill_token_threshold)
    if config.policy == "continuous":
        return ContinuousPolicy("continuous", 0)
    if config.policy == "static":
        return StaticPolicy("static", 0)
    raise ValueError(f"unknown policy {config.policy!r}")
