"""Engine: the synchronous step loop over one scheduler and any executor.

    out    = scheduler.schedule()
    result = executor.execute(out)          # model runner (wall clock) or simulator (virtual)
    deltas = scheduler.update_from_output(out, result)
    -> detokenize, apply stop strings, hand back per-request outputs

The engine owns no batching logic; it turns text into requests and deltas into outputs.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from jitney.core.outputs import ExecutorResult, SchedulerOutput
from jitney.core.scheduler import Scheduler
from jitney.request import Request, RequestStatus, SamplingParams

if TYPE_CHECKING:
    from jitney.detokenizer import IncrementalDetokenizer
    from jitney.tokenizer import Tokenizer


class Executor(Protocol):
    """Runs one scheduled step. Must accept a step with no chunks (it only drops ended requests)."""

    def execute(self, output: SchedulerOutput) -> ExecutorResult: ...


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (a delta), plus the request for its totals."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    request: Request
    new_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.request.output_token_ids


@dataclass
class StepRecord:
    """Timing of one executed step, for the simulator's profile cost model."""

    prefill_tokens: int
    decode_tokens: int
    context_tokens: int
    ms: float
    num_requests: int = 0
    # perf_counter() at the step's start, and whether requests were left unfinished after it: the
    # serving calibration measures the host time between a busy step's end and the next start.
    started_s: float = 0.0
    busy_after: bool = False


class Engine:
    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        tokenizer: Tokenizer | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.tokenizer = tokenizer
        # Called after every step that ran something (profiling, statistics).
        self.step_listeners: list[Callable[[StepRecord], None]] = [on_step] if on_step else []
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._live: dict[str, Request] = {}  # the scheduler forgets a request once it ends
        self._ids = itertools.count()
        self.num_steps = 0

    @property
    def clock(self) -> Callable[[], float]:
        return self.scheduler.clock

    def next_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def make_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> Request:
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass the prompt as token ids")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            vocab = self.tokenizer.vocab_size if self.tokenizer is not None else None
            bad = [t for t in token_ids if not isinstance(t, int) or t < 0 or (vocab and t >= vocab)]
            if bad:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids")
        params = self._with_extra_eos(params)
        return Request(
            request_id=request_id if request_id is not None else self.next_request_id(),
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.tokenizer.eos_token_id if self.tokenizer is not None else None,
            priority=priority,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
        )

    def _with_extra_eos(self, params: SamplingParams) -> SamplingParams:
        """Models with several end tokens (generation_config lists them) stop on all of them."""
        if self.tokenizer is None or params.ignore_eos:
            return params
        extra = [t for t in self.tokenizer.eos_token_ids if t != self.tokenizer.eos_token_id]
        missing = [t for t in extra if t not in params.stop_token_ids]
        if not missing:
            return params
        return dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *missing])

    def add_request(self, request: Request) -> Request:
        """Queue a request; raises AdmissionError (a ValueError) if it can never run."""
        self.scheduler.add_request(request)
        self._live[request.request_id] = request
        if self.tokenizer is not None:
            from jitney.detokenizer import IncrementalDetokenizer

            params = request.sampling_params
            self._detok[request.request_id] = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        return request

    def abort(self, request_id: str) -> bool:
        self._detok.pop(request_id, None)
        self._live.pop(request_id, None)
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        output = self.scheduler.schedule()
        result = self.executor.execute(output)
        self.num_steps += 1
        deltas = self.scheduler.update_from_output(output, result)
        logprobs = result.logprobs or {}
        outputs = []
        for delta in deltas:
            req = self._live[delta.request_id]
            text, finish_reason = self._detokenize(req, delta.new_token_ids, delta.finish_reason)
            new_lp = [logprobs[delta.request_id]] if delta.request_id in logprobs else []
            if finish_reason is not None:
                del self._live[delta.request_id]
            outputs.append(
                RequestOutput(
                    delta.request_id,
                    delta.new_token_ids,
                    text,
                    finish_reason is not None,
                    finish_reason,
                    req,
                    new_lp,
                )
            )
        if self.step_listeners and output.chunks:
            # The whole step (schedule, forward, update, detokenize): what a request waits for.
            record = step_record(output, (time.perf_counter() - start) * 1e3)
            record.started_s = start
            record.busy_after = self.scheduler.has_unfinished()
            for listener in self.step_listeners:
                listener(record)
        return outputs

    def _detokenize(
        self, req: Request, new_ids: list[int], finish_reason: str | None
    ) -> tuple[str, str | None]:
        detok = self._detok.get(req.request_id)
        if detok is None:
            return "", finish_reason
        text, stop_hit = detok.append(new_ids)
        if stop_hit and finish_reason is None:
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
            finish_reason = "stop"
        if finish_reason is not None:
            text += detok.flush() if not stop_hit else ""
            del self._detok[req.request_id]
        return text, finish_reason


def step_record(output: SchedulerOutput, ms: float) -> StepRecord:
    prefill = output.num_padding_prefill_tokens
    decode = output.num_padding_decode_slots
    context = 0
    for chunk in output.chunks:
        if chunk.is_decode:
            decode += 1
        else:
            prefill += chunk.num_tokens
        context += chunk.end
    return StepRecord(prefill, decode, context, ms, len(output.chunks))
