"""What the scheduler hands an executor each step, and what it gets back.

Ids, integers and plain parameter records only: no tensors, no references to ``Request`` objects,
so the same output can drive the model runner, the simulator, or (later) workers in another
process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jitney.request import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the executor has not seen since it was (re)admitted: a fresh one, or one resumed
    after preemption, whose generated tokens are part of ``token_ids`` and are recomputed."""

    request_id: str
    token_ids: tuple[int, ...]  # prompt + tokens generated so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None


@dataclass(slots=True)
class ScheduledChunk:
    """The tokens one request computes this step: positions ``[start, start + num_tokens)``."""

    request_id: str
    start: int  # = num_computed_tokens before the step (KV already cached, incl. prefix hits)
    num_tokens: int
    new_block_ids: tuple[int, ...]  # blocks appended to this request's block table this step
    sample: bool  # True when the chunk reaches the request's last token: a token is produced
    is_decode: bool  # one token past the prompt with all earlier tokens cached

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    step_id: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    chunks: list[ScheduledChunk] = field(default_factory=list)  # running ones first, then new ones
    preempted_ids: list[str] = field(default_factory=list)
    # Requests that ended outside a step (abort, stop string) or in the previous step: the
    # executor drops their state.
    finished_ids: list[str] = field(default_factory=list)
    # Static batching computes for slots it holds but does not use: finished requests of the wave
    # keep decoding (one dummy token each) and short prompts are padded to the wave's longest.
    num_padding_decode_slots: int = 0
    num_padding_prefill_tokens: int = 0

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(slots=True)
class ExecutorResult:
    """One step's result: a token for every chunk with ``sample`` set."""

    sampled_token_ids: dict[str, int]
    # Per request: (logprob of the sampled token, [(token_id, logprob), ...] top-n), if asked.
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]] | None = None
    step_seconds: float = 0.0  # executor's own measure of the step (wall or modelled)
