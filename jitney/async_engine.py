"""AsyncEngine: the synchronous ``Engine`` driven by a background thread, for asyncio servers.

The step loop runs in its own thread (torch releases the GIL inside its kernels, so the event loop
keeps accepting and streaming while a step runs). Everything that touches the engine happens on
that thread: the event loop hands it commands (add, abort) through a locked inbox, and the thread
hands each step's outputs back with one ``call_soon_threadsafe`` per step, which pushes every
request's piece into that request's own ``asyncio.Queue``. So:

- ``add_request`` awaits the engine thread's verdict: an admission error (``ValueError``) reaches
  the caller before any streaming starts;
- a stream that is closed early (client gone, task cancelled) aborts its request, and the abort is
  applied before the next step, so its KV blocks are free within one step;
- an exception inside a step fails every request the engine holds with ``EngineStepError``; none
  is left waiting forever;
- ``drain`` refuses new requests, lets running ones finish up to a timeout, then aborts the rest.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from jitney.engine import Engine
from jitney.engine import RequestOutput as EngineOutput
from jitney.metrics import RequestRecord, from_request
from jitney.request import Request, SamplingParams
from jitney.server.metrics import EngineSnapshot

logger = logging.getLogger("jitney.engine")

# (logprob of the sampled token, [(token_id, logprob), ...] top-n)
TokenLogprob = tuple[float, list[tuple[int, float]]]


class EngineStepError(RuntimeError):
    """A step raised; the requests it held were failed with this error."""


class EngineClosedError(RuntimeError):
    """The engine is draining or stopped and takes no new requests."""


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (a delta), plus running totals."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    num_prompt_tokens: int
    num_output_tokens: int  # total so far, this delta included

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """Handed to ``on_finished`` once per request that ends: "stop" | "length" | "abort", or "error"
    when a failed step took it down."""

    request_id: str
    finish_reason: str
    record: RequestRecord


@dataclass(slots=True)
class _Command:
    kind: str  # "add" | "abort"
    request: Request | None = None
    request_id: str = ""
    done: concurrent.futures.Future | None = None


class RequestStream:
    """Async iterator over one request's outputs. Closing it before the end aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str, num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:
            self.close()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        """Abort the request unless it already ended; safe to call many times."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    """Runs ``engine`` on a background thread and streams each request's outputs."""

    def __init__(
        self,
        engine: Engine,
        *,
        on_finished: Callable[[FinishedRequest], None] | None = None,
        state_log_interval_s: float = 5.0,
        idle_wait_s: float = 0.1,
    ) -> None:
        self.engine = engine
        self.on_finished = on_finished
        self.state_log_interval_s = state_log_interval_s
        self.idle_wait_s = idle_wait_s
        self._inbox: list[_Command] = []
        self._inbox_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # event-loop side only
        self._held: dict[str, Request] = {}  # engine-thread side only: requests the engine holds
        self._snapshot = EngineSnapshot()
        self._accepting = True
        self._dead: BaseException | None = None
        self._next_id = 0

    # -- lifecycle (event loop) -------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._publish_snapshot()
        self._thread = threading.Thread(target=self._run, name="jitney-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def accepting(self) -> bool:
        return self._accepting and self.is_running

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    async def shutdown(self) -> None:
        """Stop the thread; requests still held are failed so nobody waits forever."""
        self._accepting = False
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)
        self._fail_inbox(EngineClosedError("the engine stopped"))
        for stream in list(self._streams.values()):
            stream._put(EngineClosedError("the engine stopped"))
        self._streams.clear()

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests; wait up to ``timeout_s`` for in-flight ones, then abort the rest.
        Returns True when everything finished on its own."""
        self._accepting = False
        deadline = time.monotonic() + max(0.0, timeout_s)
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        clean = not self._streams
        if not clean:
            logger.warning("drain timeout after %.1fs: aborting %d request(s)", timeout_s, len(self._streams))
            for rid in list(self._streams):
                self.abort(rid)
            end = time.monotonic() + 5.0
            while self._streams and time.monotonic() < end:
                await asyncio.sleep(0.02)
        return clean

    # -- requests (event loop) --------------------------------------------------------------------
    def new_request_id(self, prefix: str = "req") -> str:
        self._next_id += 1
        return f"{prefix}-{self._next_id}"

    async def add_request(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Queue a request and return its stream. Admission errors raise here, before streaming."""
        if self._dead is not None:
            raise EngineClosedError(f"the engine failed and stopped: {self._dead}")
        if not self.accepting:
            raise EngineClosedError("the engine is draining or stopped and takes no new requests")
        rid = request_id or self.new_request_id()
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        request = self.engine.make_request(
            list(prompt_token_ids), sampling_params, request_id=rid, priority=priority
        )
        stream = RequestStream(self, rid, len(prompt_token_ids))
        self._streams[rid] = stream
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Command("add", request=request, request_id=rid, done=done))
        if not self.is_running:  # the thread died or stopped meanwhile: nobody will answer
            self._fail_inbox(self._dead or EngineClosedError("the engine stopped"))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self._streams.pop(rid, None)
            self._send(_Command("abort", request_id=rid))
            raise
        except BaseException:
            self._streams.pop(rid, None)
            raise
        return stream

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they are produced; leaving the loop early aborts it."""
        stream = await self.add_request(
            prompt_token_ids, sampling_params, request_id=request_id, priority=priority
        )
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request ends (KV freed) before the next step. Unknown ids are ignored."""
        self._send(_Command("abort", request_id=request_id))

    def _send(self, command: _Command) -> None:
        with self._inbox_lock:
            self._inbox.append(command)
        self._wake.set()

    # -- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        last_state_log = time.monotonic()
        tokens_since_log = 0
        try:
            while not self._stop:
                self._wake.clear()
                self._apply_commands()
                if not self.engine.has_unfinished():
                    self._wake.wait(self.idle_wait_s)
                    continue
                try:
                    step_outputs = self.engine.step()
                except Exception as exc:  # noqa: BLE001 - a failed step must fail its requests
                    logger.exception("engine step failed; failing %d request(s)", len(self._held))
                    self._fail_held(exc)
                    continue
                outputs, finished = self._collect(step_outputs)
                tokens_since_log += sum(len(out.token_ids) for out in outputs)
                self._publish_snapshot()
                self._deliver_threadsafe(outputs, finished)
                now = time.monotonic()
                if now - last_state_log >= self.state_log_interval_s:
                    self._log_state(tokens_since_log / (now - last_state_log))
                    last_state_log, tokens_since_log = now, 0
        except BaseException as exc:  # the thread itself broke: fail everyone, refuse new work
            logger.exception("engine thread stopped")
            self._dead = exc
            self._fail_held(exc)
            self._fail_inbox(exc)

    def _apply_commands(self) -> None:
        with self._inbox_lock:
            commands, self._inbox = self._inbox, []
        aborted: list[RequestOutput] = []
        finished: list[FinishedRequest] = []
        for cmd in commands:
            if cmd.kind == "add":
                assert cmd.request is not None and cmd.done is not None
                try:
                    self.engine.add_request(cmd.request)
                except BaseException as exc:  # noqa: BLE001 - returned to the awaiting caller
                    cmd.done.set_exception(exc)
                else:
                    self._held[cmd.request_id] = cmd.request
                    cmd.done.set_result(None)
            elif cmd.kind == "abort":
                req = self._held.pop(cmd.request_id, None)
                if req is None:
                    continue
                self.engine.abort(cmd.request_id)
                aborted.append(self._output(req, [], "", "abort", None))
                finished.append(self._finished(req, "abort"))
        if commands:
            self._publish_snapshot()
        if aborted:
            self._deliver_threadsafe(aborted, finished)

    def _output(
        self, req: Request, token_ids: list[int], text: str, finish_reason: str | None,
        logprobs: list[TokenLogprob] | None,
    ) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            token_ids=token_ids,
            text=text,
            finish_reason=finish_reason,
            logprobs=logprobs,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
        )

    @staticmethod
    def _finished(req: Request, reason: str) -> FinishedRequest:
        return FinishedRequest(req.request_id, reason, from_request(req))

    def _collect(self, step_outputs: list[EngineOutput]) -> tuple[list[RequestOutput], list[FinishedRequest]]:
        outputs: list[RequestOutput] = []
        finished: list[FinishedRequest] = []
        for delta in step_outputs:
            req = self._held.get(delta.request_id)
            if req is None:
                continue  # aborted while the step ran
            outputs.append(
                self._output(
                    req, list(delta.new_token_ids), delta.new_text, delta.finish_reason,
                    list(delta.new_logprobs) if req.sampling_params.logprobs is not None else None,
                )
            )
            if delta.finish_reason is not None:
                del self._held[delta.request_id]
                finished.append(self._finished(req, delta.finish_reason))
        return outputs, finished

    def _fail_held(self, exc: BaseException) -> None:
        error = EngineStepError(f"the engine failed while running this request: {type(exc).__name__}: {exc}")
        failed = list(self._held)
        ended: list[FinishedRequest] = []
        for rid in failed:
            req = self._held.pop(rid)
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - the engine is already broken; the request still fails
                logger.exception("abort of %s after a failed step also failed", rid)
            ended.append(self._finished(req, "error"))
        self._publish_snapshot()
        if failed and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._deliver_errors, failed, error, ended)
            except RuntimeError:
                pass  # the event loop is closed: nobody is listening any more

    def _fail_inbox(self, exc: BaseException) -> None:
        with self._inbox_lock:
            commands, self._inbox = self._inbox, []
        error = exc if isinstance(exc, EngineClosedError) else EngineClosedError(f"the engine stopped: {exc}")
        for cmd in commands:
            if cmd.done is not None and not cmd.done.done():
                cmd.done.set_exception(error)

    def _publish_snapshot(self) -> None:
        try:
            stats = self.engine.scheduler.stats()
        except Exception:  # noqa: BLE001 - metrics must never break serving
            return
        self._snapshot = EngineSnapshot(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_cache_usage=stats.kv_cache_usage,
            num_preemptions=stats.num_preemptions_total,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            num_free_blocks=stats.num_free_blocks,
        )

    def _log_state(self, generation_tokens_per_s: float) -> None:
        s = self._snapshot
        logger.info(
            "engine: running=%d waiting=%d generation_throughput=%.1f tok/s kv_cache_usage=%.1f%% "
            "preemptions=%d prefix_hit_rate=%.1f%%",
            s.num_running, s.num_waiting, generation_tokens_per_s, 100.0 * s.kv_cache_usage,
            s.num_preemptions,
            100.0 * s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0,
        )

    def _deliver_threadsafe(self, outputs: list[RequestOutput], finished: list[FinishedRequest]) -> None:
        if self._loop is None or (not outputs and not finished):
            return
        try:
            self._loop.call_soon_threadsafe(self._deliver, outputs, finished)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more

    # -- back on the event loop -------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput], finished: list[FinishedRequest]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream._put(out)
            if out.finished:
                del self._streams[out.request_id]
        if self.on_finished is not None:
            for fin in finished:
                try:
                    self.on_finished(fin)
                except Exception:  # noqa: BLE001 - a logging hook must not break delivery
                    logger.exception("on_finished hook failed")

    def _deliver_errors(
        self, request_ids: list[str], error: BaseException, ended: list[FinishedRequest]
    ) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream._put(error)
        self._deliver([], ended)

