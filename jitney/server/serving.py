"""The completion endpoints' logic: prompt -> token ids -> engine stream -> OpenAI bodies or SSE.

Kept apart from the routing so each piece reads top to bottom: validate (400 before anything is
queued), submit (admission errors are 400, a draining engine is 503), then stream or collect.
Every path closes the request's stream, so a client that leaves aborts its request.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request as HttpRequest

from jitney.async_engine import AsyncEngine, EngineClosedError, EngineStepError, RequestStream
from jitney.request import SamplingParams
from jitney.server import responses as R
from jitney.server.errors import ApiError, error_body
from jitney.server.protocol import ChatCompletionRequest, CompletionRequest
from jitney.tokenizer import Tokenizer

logger = logging.getLogger("jitney.server")

_DISCONNECT_POLL_S = 0.1


@dataclass
class ServingContext:
    """What the handlers need: the engine, the tokenizer and the served model's limits."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    model_names: tuple[str, ...]  # first = the name responses carry
    max_model_len: int
    kv_pool_tokens: int

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise ApiError(404, f"the model '{model}' does not exist; this server serves "
                           f"'{self.model_name}'", "model", "model_not_found")

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def check_prompt_ids(self, ids: list[int]) -> None:
        vocab = self.tokenizer.vocab_size
        bad = [t for t in ids if t < 0 or t >= vocab]
        if bad:
            raise ApiError(400, f"prompt token ids must be in [0, {vocab}); got {bad[:5]}", "prompt")
        if len(ids) > self.max_model_len:
            raise ApiError(
                400, f"the prompt has {len(ids)} tokens, more than max_model_len {self.max_model_len}",
                "prompt", "context_length_exceeded",
            )

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """Chat without max_tokens: as much as the context and the KV pool can ever give."""
        return max(1, min(self.max_model_len, self.kv_pool_tokens) - num_prompt_tokens)


async def submit(ctx: ServingContext, ids: list[int], params: SamplingParams, priority: int, prefix: str
                 ) -> RequestStream:
    """Queue a request; map engine refusals to API errors before any response is started."""
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    try:
        return await ctx.engine.add_request(ids, params, request_id=request_id, priority=priority)
    except EngineClosedError as exc:
        raise ApiError(503, str(exc), None, "server_unavailable") from None
    except ValueError as exc:  # AdmissionError and token-id checks
        raise ApiError(400, str(exc), "prompt", "context_length_exceeded") from None


async def _watch_disconnect(http: HttpRequest, stream: RequestStream) -> None:
    """Non-streaming requests: Starlette does not cancel them when the client leaves, so poll."""
    while not stream.finished:
        if await http.is_disconnected():
            logger.info("client of %s disconnected; aborting", stream.request_id)
            stream.close()
            return
        await asyncio.sleep(_DISCONNECT_POLL_S)


@dataclass
class Collected:
    text: str
    token_ids: list[int]
    logprobs: list[R.TokenLogprob]
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int


async def collect(http: HttpRequest, stream: RequestStream) -> Collected:
    watcher = asyncio.create_task(_watch_disconnect(http, stream))
    parts: list[str] = []
    token_ids: list[int] = []
    logprobs: list[R.TokenLogprob] = []
    finish_reason = "abort"
    num_output = 0
    try:
        async for out in stream:
            parts.append(out.text)
            token_ids.extend(out.token_ids)
            logprobs.extend(out.logprobs or [])
            num_output = out.num_output_tokens
            if out.finish_reason is not None:
                finish_reason = out.finish_reason
    except EngineStepError as exc:
        raise ApiError(500, str(exc), None, "engine_error") from None
    finally:
        watcher.cancel()
        stream.close()
    return Collected("".join(parts), token_ids, logprobs, finish_reason, stream.num_prompt_tokens, num_output)


# -- /v1/completions ----------------------------------------------------------------------------
async def create_completion(ctx: ServingContext, body: CompletionRequest, http: HttpRequest):
    ctx.check_model(body.model)
    params = body.to_sampling_params(default_max_tokens=16)
    prompt = body.single_prompt()
    ids = ctx.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    ctx.check_prompt_ids(ids)
    stream = await submit(ctx, ids, params, body.priority, "cmpl")
    created = int(time.time())
    if body.stream:
        return _completion_events(ctx, body, stream, created)
    got = await collect(http, stream)
    logprobs = None
    if params.logprobs is not None:
        logprobs = R.completion_logprobs(got.token_ids, got.logprobs, ctx.token_text, 0)
    return R.completion_body(
        stream.request_id, created, ctx.model_name, got.text, got.finish_reason, logprobs,
        R.usage(got.num_prompt_tokens, got.num_output_tokens),
    )


async def _completion_events(
    ctx: ServingContext, body: CompletionRequest, stream: RequestStream, created: int
) -> AsyncIterator[str]:
    rid, model = stream.request_id, ctx.model_name
    want_logprobs = body.logprobs is not None
    offset = 0
    num_output = 0
    try:
        async for out in stream:
            num_output = out.num_output_tokens
            logprobs = None
            if want_logprobs and out.token_ids:
                logprobs = R.completion_logprobs(out.token_ids, out.logprobs or [], ctx.token_text, offset)
            offset += len(out.text)
            if out.text or logprobs or out.finished:
                yield R.sse_event(
                    R.completion_body(rid, created, model, out.text, out.finish_reason, logprobs, None,
                                      chunk=True, with_usage_field=body.include_usage)
                )
        if body.include_usage:
            usage = R.usage(stream.num_prompt_tokens, num_output)
            yield R.sse_event(R.usage_chunk(rid, created, model, "text_completion", usage))
    except EngineStepError as exc:
        yield R.sse_event(error_body(500, str(exc), None, "engine_error"))
    finally:
        stream.close()
    yield R.SSE_DONE


# -- /v1/chat/completions -----------------------------------------------------------------------
async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, http: HttpRequest):
    ctx.check_model(body.model)
    try:
        ids = ctx.tokenizer.apply_chat_template(
            body.template_messages(), add_generation_prompt=body.add_generation_prompt, tokenize=True
        )
    except ValueError as exc:
        raise ApiError(400, f"cannot render the chat template: {exc}", "messages") from None
    assert isinstance(ids, list)
    ctx.check_prompt_ids(ids)
    params = body.to_sampling_params(default_max_tokens=ctx.default_max_tokens(len(ids)))
    stream = await submit(ctx, ids, params, body.priority, "chatcmpl")
    created = int(time.time())
    if body.stream:
        return _chat_events(ctx, body, stream, created)
    got = await collect(http, stream)
    logprobs = R.chat_logprobs(got.token_ids, got.logprobs, ctx.token_text) if body.logprobs else None
    return R.chat_body(
        stream.request_id, created, ctx.model_name, got.text, got.finish_reason, logprobs,
        R.usage(got.num_prompt_tokens, got.num_output_tokens),
    )


async def _chat_events(
    ctx: ServingContext, body: ChatCompletionRequest, stream: RequestStream, created: int
) -> AsyncIterator[str]:
    rid, model, with_usage = stream.request_id, ctx.model_name, body.include_usage
    num_output = 0
    try:
        yield R.sse_event(R.chat_chunk(rid, created, model, {"role": "assistant", "content": ""}, None, None,
                                       with_usage))
        async for out in stream:
            num_output = out.num_output_tokens
            logprobs = None
            if body.logprobs and out.token_ids:
                logprobs = R.chat_logprobs(out.token_ids, out.logprobs or [], ctx.token_text)
            if out.text or logprobs:
                yield R.sse_event(R.chat_chunk(rid, created, model, {"content": out.text}, None, logprobs,
                                               with_usage))
            if out.finished:
                yield R.sse_event(R.chat_chunk(rid, created, model, {}, out.finish_reason, None, with_usage))
        if with_usage:
            usage = R.usage(stream.num_prompt_tokens, num_output)
            yield R.sse_event(R.usage_chunk(rid, created, model, "chat.completion.chunk", usage))
    except EngineStepError as exc:
        yield R.sse_event(error_body(500, str(exc), None, "engine_error"))
    finally:
        stream.close()
    yield R.SSE_DONE
