"""Response bodies and server-sent-event framing for the OpenAI-compatible endpoints.

Plain dicts built by small functions: the shapes are the API contract, so they are spelled out
here once and both the streaming and the non-streaming paths use the same builders.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

SSE_DONE = "data: [DONE]\n\n"

# (logprob of the sampled token, [(token_id, logprob), ...] top-n) per generated token.
TokenLogprob = tuple[float, list[tuple[int, float]]]
TokenText = Callable[[int], str]


def sse_event(payload: dict) -> str:
    """One SSE event; compact JSON keeps per-token overhead small."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[TokenLogprob], token_text: TokenText, text_offset: int
) -> dict:
    """The legacy completions shape: parallel lists of tokens, logprobs and top-n dicts."""
    tokens = [token_text(t) for t in token_ids]
    offsets = []
    for tok in tokens:
        offsets.append(text_offset)
        text_offset += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _ in logprobs],
        "top_logprobs": [{token_text(t): v for t, v in top} for _, top in logprobs],
        "text_offset": offsets,
    }


def _chat_token(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[TokenLogprob], token_text: TokenText) -> dict:
    """The chat shape: one entry per token, each with its own top-n list."""
    content = []
    for tid, (lp, top) in zip(token_ids, logprobs, strict=True):
        entry = _chat_token(token_text(tid), lp)
        entry["top_logprobs"] = [_chat_token(token_text(t), v) for t, v in top]
        content.append(entry)
    return {"content": content}


def completion_body(
    request_id: str, created: int, model: str, text: str, finish_reason: str | None,
    logprobs: dict | None, usage_body: dict | None, chunk: bool = False, with_usage_field: bool = False,
) -> dict:
    """A whole completion, or (``chunk``) one streamed piece of it; the object name is the same.
    Streamed pieces carry ``"usage": null`` only when the client asked for a usage event."""
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    body = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if not chunk or with_usage_field:
        body["usage"] = usage_body
    return body


def chat_body(
    request_id: str, created: int, model: str, text: str, finish_reason: str | None,
    logprobs: dict | None, usage_body: dict,
) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage_body,
    }


def chat_chunk(
    request_id: str, created: int, model: str, delta: dict, finish_reason: str | None,
    logprobs: dict | None, with_usage_field: bool,
) -> dict:
    body = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if with_usage_field:
        body["usage"] = None
    return body


def usage_chunk(request_id: str, created: int, model: str, obj: str, usage_body: dict) -> dict:
    """The last event when ``stream_options.include_usage`` is set: no choices, only usage."""
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage_body}
