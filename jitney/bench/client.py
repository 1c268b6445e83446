"""One streamed request to an OpenAI-compatible server, timed from the client.

Times are taken as each server-sent event arrives (``time.perf_counter``), so they include the
network and the server's own framing: that is what a user sees. A chunk that carries text counts
as one arrival; the number of output tokens comes from the ``usage`` event when the server sends
one (``stream_options.include_usage``), else from the number of text chunks.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from jitney.bench.datasets import BenchRequest
from jitney.metrics import RequestRecord

ENDPOINTS = ("completions", "chat")


@dataclass(frozen=True)
class ApiTarget:
    """Where and how to send: the server, the model name, and the request fields every call shares."""

    base_url: str
    model: str
    endpoint: str = "completions"
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base URL must start with http:// or https://, got {self.base_url!r}")
        if not self.model:
            raise ValueError("a model name is required")

    @property
    def url(self) -> str:
        root = self.base_url.rstrip("/")
        if not root.endswith("/v1"):
            root += "/v1"
        return root + ("/completions" if self.endpoint == "completions" else "/chat/completions")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def payload(self, req: BenchRequest) -> dict:
        body: dict = {
            "model": self.model,
            "max_tokens": req.output_len,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True  # not in OpenAI's API; jitney, vLLM and llama.cpp honour it
        if self.endpoint == "completions":
            body["prompt"] = req.prompt if isinstance(req.prompt, str) else list(req.prompt)
        else:
            if not isinstance(req.prompt, str):
                raise ValueError("the chat endpoint needs text prompts: pass a tokenizer to decode token ids")
            body["messages"] = [{"role": "user", "content": req.prompt}]
        body.update(self.extra_body)
        return body


@dataclass
class StreamResult:
    """A record for the metrics module plus what the record does not hold."""

    record: RequestRecord
    generated_text: str


def _chunk_text(event: dict, endpoint: str) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if endpoint == "completions":
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


def _error_message(status: int, body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
        message = err.get("message") if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        message = body.decode("utf-8", "replace")[:200]
    return f"HTTP {status}: {message}"


def _failure(req: BenchRequest, start: float, error: str, times: list[float] | None = None) -> StreamResult:
    times = times or []
    record = RequestRecord(
        arrival_time=start,
        first_token_time=times[0] if times else None,
        finish_time=time.perf_counter(),
        prompt_tokens=req.prompt_len,
        output_tokens=len(times),
        token_times=tuple(times),
        success=False,
        error=error,
    )
    return StreamResult(record, "")


async def stream_request(client: httpx.AsyncClient, target: ApiTarget, req: BenchRequest) -> StreamResult:
    """Send ``req`` with streaming and time every chunk; never raises for a failed request."""
    payload = target.payload(req)
    start = time.perf_counter()
    times: list[float] = []
    parts: list[str] = []
    usage: dict | None = None
    try:
        async with client.stream("POST", target.url, json=payload, headers=target.headers) as resp:
            if resp.status_code != 200:
                return _failure(req, start, _error_message(resp.status_code, await resp.aread()))
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event names
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                event = json.loads(data)
                if "error" in event:
                    err = event["error"]
                    message = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                    return _failure(req, start, f"stream error: {message}", times)
                if text := _chunk_text(event, target.endpoint):
                    times.append(now)
                    parts.append(text)
                if event.get("usage"):
                    usage = event["usage"]
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        return _failure(req, start, f"{type(exc).__name__}: {exc}", times)
    end = time.perf_counter()
    if not times:
        return _failure(req, start, "the stream ended without any output")
    output_tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else len(times)
    prompt_tokens = int(usage["prompt_tokens"]) if usage and "prompt_tokens" in usage else req.prompt_len
    record = RequestRecord(
        arrival_time=start,
        first_token_time=times[0],
        finish_time=end,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        token_times=tuple(times),
    )
    return StreamResult(record, "".join(parts))


def discover_model(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    """The first model a server lists at ``/v1/models`` (so ``--model`` can be left out)."""
    root = base_url.rstrip("/")
    url = (root if root.endswith("/v1") else root + "/v1") + "/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(url, headers=headers, timeout=timeout_s, trust_env=False)
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from None
    if resp.status_code != 200:
        raise ValueError(f"{url}: {_error_message(resp.status_code, resp.content)}")
    try:
        return str(resp.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"{url} lists no model; pass --model") from None
