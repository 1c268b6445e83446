"""The FastAPI application: routes, lifespan (engine start/stop), request logs and metrics.

``build_app`` takes a function that loads the model, so tests (with a model already in memory) and
the CLI (loading from disk while the port already answers 503) build the server the same way. No
module-level state: each app has its own metrics registry, phase and engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from jitney.async_engine import AsyncEngine, FinishedRequest
from jitney.engine import Engine
from jitney.server import serving
from jitney.server.errors import ApiError, install_error_handlers
from jitney.server.gate import Gate, Phase, ServerState
from jitney.server.metrics import FinishedRequestTimes, ServerMetrics
from jitney.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from jitney.tokenizer import Tokenizer

logger = logging.getLogger("jitney.server")

DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024


def _times(fin: FinishedRequest) -> FinishedRequestTimes:
    rec = fin.record
    ttft = rec.ttft if rec.first_token_time is not None else None
    gaps = tuple(b - a for a, b in zip(rec.token_times, rec.token_times[1:], strict=False))
    e2e = (rec.finish_time if rec.finish_time is not None else time.monotonic()) - rec.arrival_time
    return FinishedRequestTimes(rec.queue_time, ttft, gaps, e2e, rec.prompt_tokens, rec.output_tokens)


def _log_finished(fin: FinishedRequest, times: FinishedRequestTimes) -> None:
    rec = fin.record
    tpot = rec.tpot if rec.first_token_time is not None and rec.finish_time is not None else None

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.1f}"

    logger.info(
        "request finished: id=%s prompt_tokens=%d output_tokens=%d ttft_ms=%s tpot_ms=%s e2e_ms=%s "
        "queue_ms=%s finish_reason=%s preemptions=%d",
        fin.request_id, rec.prompt_tokens, rec.output_tokens, ms(times.ttft), ms(tpot), ms(times.e2e),
        ms(times.queue_time), fin.finish_reason, rec.num_preemptions,
    )


@dataclass(frozen=True)
class EngineBundle:
    """A loaded model: the engine with its tokenizer, and the names and limits the API reports."""

    engine: Engine
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int


@dataclass(frozen=True)
class ServerOptions:
    """What is known before the model loads (validated here, once)."""

    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_timeout_s: float = 30.0
    extra_model_names: tuple[str, ...] = ()  # accepted in 'model' besides the served name

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")


@dataclass
class Services:
    """What exists once the model is loaded; None before (the server answers 503 meanwhile)."""

    ctx: serving.ServingContext
    metrics: ServerMetrics

    @property
    def engine(self) -> AsyncEngine:
        return self.ctx.engine


class ServicesHolder:
    def __init__(self) -> None:
        self.services: Services | None = None

    def get(self) -> Services:
        if self.services is None:
            raise ApiError(503, "the model is still loading; retry later", None, "server_unavailable")
        return self.services


def _start_services(bundle: EngineBundle, options: ServerOptions) -> Services:
    cache = bundle.engine.scheduler.cache_config
    names = (bundle.model_name, *[n for n in options.extra_model_names if n != bundle.model_name])
    engine = AsyncEngine(bundle.engine)
    ctx = serving.ServingContext(engine, bundle.tokenizer, names, bundle.max_model_len, cache.num_tokens)
    metrics = ServerMetrics(ctx.model_name, engine.snapshot)

    def on_finished(fin: FinishedRequest) -> None:
        times = _times(fin)
        metrics.observe_finished(times, fin.finish_reason)
        _log_finished(fin, times)

    engine.on_finished = on_finished
    engine.start()
    return Services(ctx, metrics)


def build_app(
    load: Callable[[], EngineBundle],
    options: ServerOptions | None = None,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """The app. Its lifespan loads the model on a worker thread (``load``), so the port answers at
    once: 503 while starting, then serving; on shutdown it drains the engine."""
    options = options or ServerOptions()
    state = ServerState()
    holder = ServicesHolder()

    async def load_and_start() -> None:
        try:
            bundle = await asyncio.to_thread(load)
            holder.services = _start_services(bundle, options)
        except Exception as exc:  # noqa: BLE001 - reported, and the server is told to stop
            logger.error("could not load the model: %s", exc)
            state.load_error = exc
            if on_load_error is not None:
                on_load_error(exc)
            return
        if state.phase is Phase.STARTING:
            state.phase = Phase.READY
        ctx = holder.services.ctx
        logger.info("serving %s (max_model_len %d)", ctx.model_name, ctx.max_model_len)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        loader = asyncio.create_task(load_and_start())
        try:
            yield
        finally:
            state.phase = Phase.DRAINING
            if not loader.done():
                loader.cancel()  # the load thread itself cannot be stopped; nobody waits for it
            if holder.services is not None:
                await holder.services.engine.drain(options.drain_timeout_s)
                await holder.services.engine.shutdown()

    app = FastAPI(title="jitney", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.services = holder
    app.state.server_state = state
    app.state.options = options
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest):
        return _reply(await serving.create_completion(holder.get().ctx, body, http))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: HttpRequest):
        return _reply(await serving.create_chat_completion(holder.get().ctx, body, http))

    @app.get("/v1/models")
    async def models():
        ctx = holder.get().ctx
        created = int(time.time())
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "jitney",
             "root": ctx.model_name, "max_model_len": ctx.max_model_len}
            for name in ctx.model_names
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/tokenize")
    async def tokenize(body: TokenizeRequest):
        ctx = holder.get().ctx
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of 'prompt' or 'messages'", "prompt")
        if body.prompt is not None:
            ids = ctx.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages or []]
            try:
                ids = ctx.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=body.add_generation_prompt, tokenize=True
                )
            except ValueError as exc:
                raise ApiError(400, f"cannot render the chat template: {exc}", "messages") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len}

    @app.post("/v1/detokenize")
    async def detokenize(body: DetokenizeRequest):
        ctx = holder.get().ctx
        ctx.check_model(body.model)
        vocab = ctx.tokenizer.vocab_size
        bad = [t for t in body.tokens if t < 0 or t >= vocab]
        if bad:
            raise ApiError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}", "tokens")
        return {"prompt": ctx.tokenizer.decode(body.tokens)}

    @app.get("/health")
    async def health():
        if not holder.get().engine.is_running:
            raise ApiError(503, "the engine is not running", None, "server_unavailable")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(holder.get().metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(Gate, state=state, api_key=options.api_key, max_body_bytes=options.max_body_bytes)
    return app


def _reply(result):
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(
        result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
