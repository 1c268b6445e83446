"""Validated configuration. Each dataclass checks itself once, at construction, and a bad value
raises ``ConfigError`` naming the field and the allowed range."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("static", "continuous", "chunked")
QUEUES = ("fcfs", "priority")


class ConfigError(ValueError):
    """A configuration value outside its allowed range."""


def _check_int(owner: str, name: str, value: object, low: int, high: int | None = None) -> None:
    out_of_range = isinstance(value, int) and (value < low or (high is not None and value > high))
    if isinstance(value, bool) or not isinstance(value, int) or out_of_range:
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(f"{owner}.{name} must be an integer {allowed}, got {value!r}")


def _check_choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{owner}.{name} must be one of {', '.join(choices)}; got {value!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    policy: str = "chunked"
    # Cap on the tokens one request may take in one step (its chunk); 0 = only the budget caps it.
    long_prefill_token_threshold: int = 0
    queue: str = "fcfs"
    max_model_len: int = 8192

    def __post_init__(self) -> None:
        owner = "SchedulerConfig"
        _check_int(owner, "max_num_seqs", self.max_num_seqs, 1, 1 << 20)
        _check_int(owner, "max_num_batched_tokens", self.max_num_batched_tokens, 1, 1 << 24)
        _check_choice(owner, "policy", self.policy, POLICIES)
        _check_int(owner, "long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _check_choice(owner, "queue", self.queue, QUEUES)
        _check_int(owner, "max_model_len", self.max_model_len, 1, 1 << 24)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 4096
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        owner = "CacheConfig"
        _check_int(owner, "block_size", self.block_size, 1, 1024)
        _check_int(owner, "num_blocks", self.num_blocks, 1, 1 << 24)
        if not isinstance(self.enable_prefix_caching, bool):
            got = self.enable_prefix_caching
            raise ConfigError(f"{owner}.enable_prefix_caching must be a bool, got {got!r}")

    @property
    def num_tokens(self) -> int:
        """How many tokens of KV the whole pool holds."""
        return self.block_size * self.num_blocks
