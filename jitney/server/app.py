"""The FastAPI application: routes, lifespan (engine start/stop), request logs and metrics.

``build_app`` takes a ready ``AsyncEngine`` and tokenizer, so tests and the CLI build the server
the same way; it holds no module-level state (each app has its own metrics registry and phase).
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from jitney.async_engine import AsyncEngine, FinishedRequest
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


@dataclass(frozen=True)
class ServerSettings:
    model_names: tuple[str, ...]  # the first is the name responses carry; all are accepted
    max_model_len: int
    kv_pool_tokens: int
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.model_names or not all(self.model_names):
            raise ValueError("at least one non-empty model name is needed")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")


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


def build_app(engine: AsyncEngine, tokenizer: Tokenizer, settings: ServerSettings,
              state: ServerState | None = None) -> FastAPI:
    """The app; its lifespan starts the engine thread and drains it on shutdown."""
    state = state or ServerState()
    ctx = serving.ServingContext(engine, tokenizer, settings.model_names, settings.max_model_len,
                                 settings.kv_pool_tokens)
    metrics = ServerMetrics(ctx.model_name, engine.snapshot)

    def on_finished(fin: FinishedRequest) -> None:
        times = _times(fin)
        metrics.observe_finished(times, fin.finish_reason)
        _log_finished(fin, times)

    engine.on_finished = on_finished

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        state.phase = Phase.READY
        logger.info("serving %s (max_model_len %d)", ctx.model_name, settings.max_model_len)
        try:
            yield
        finally:
            state.phase = Phase.DRAINING
            await engine.drain(settings.drain_timeout_s)
            await engine.shutdown()

    app = FastAPI(title="jitney", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.jitney = ctx
    app.state.metrics = metrics
    app.state.server_state = state
    app.state.drain_timeout_s = settings.drain_timeout_s
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest):
        return _reply(await serving.create_completion(ctx, body, http))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: HttpRequest):
        return _reply(await serving.create_chat_completion(ctx, body, http))

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "jitney",
             "root": ctx.model_name, "max_model_len": settings.max_model_len}
            for name in settings.model_names
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/tokenize")
    async def tokenize(body: TokenizeRequest):
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of 'prompt' or 'messages'", "prompt")
        if body.prompt is not None:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages or []]
            try:
                ids = tokenizer.apply_chat_template(
                    messages, add_generation_prompt=body.add_generation_prompt, tokenize=True
                )
            except ValueError as exc:
                raise ApiError(400, f"cannot render the chat template: {exc}", "messages") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": settings.max_model_len}

    @app.post("/v1/detokenize")
    async def detokenize(body: DetokenizeRequest):
        ctx.check_model(body.model)
        vocab = tokenizer.vocab_size
        bad = [t for t in body.tokens if t < 0 or t >= vocab]
        if bad:
            raise ApiError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/health")
    async def health():
        if not engine.is_running:
            raise ApiError(503, "the engine is not running", None, "server_unavailable")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(Gate, state=state, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)
    return app


def _reply(result):
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(
        result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
