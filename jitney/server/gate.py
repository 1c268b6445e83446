"""The checks every request passes before any handler runs: body size, server phase, API key.

A pure ASGI middleware (no body buffering of its own) so an oversized body is refused from its
``Content-Length`` before it is read, and a chunked one is cut off as soon as it crosses the limit;
nothing of it reaches the engine. Errors leave in the OpenAI shape like every other error.
"""

from __future__ import annotations

import enum
import hmac
import json
from dataclasses import dataclass

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jitney.server.errors import error_body


class Phase(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"


@dataclass
class ServerState:
    """Mutable server phase, shared by the gate, the lifespan and the drain handler."""

    phase: Phase = Phase.STARTING
    load_error: BaseException | None = None  # set when the model failed to load


# Paths the gate never refuses for phase or key: scrapers and probes must see a draining server.
_OPEN_PATHS = ("/metrics",)


class Gate:
    def __init__(self, app: ASGIApp, state: ServerState, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.state = state
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refusal = self._refusal(path, headers)
        if refusal is not None:
            status, message, code = refusal
            await _send_error(send, status, message, code)
            return
        await self.app(scope, self._limited(receive), send)

    def _refusal(self, path: str, headers: dict[str, str]) -> tuple[int, str, str | None] | None:
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return 400, "invalid Content-Length header", None
            if int(length) > self.max_body_bytes:
                return 413, self._too_large_message(), "request_too_large"
        if path in _OPEN_PATHS:
            return None
        if self.state.load_error is not None:
            return 503, f"the model failed to load: {self.state.load_error}", "server_unavailable"
        if self.state.phase is not Phase.READY:
            return 503, f"the server is {self.state.phase.value}; retry later", "server_unavailable"
        if self.api_key is not None and path.startswith("/v1"):
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            given = token.strip().encode()
            if scheme.lower() != "bearer" or not hmac.compare_digest(given, self.api_key.encode()):
                return 401, "missing or invalid API key: send 'Authorization: Bearer <key>'", "invalid_key"
        return None

    def _too_large_message(self) -> str:
        return f"request body larger than the limit of {self.max_body_bytes} bytes"

    def _limited(self, receive: Receive) -> Receive:
        received = 0
        limit = self.max_body_bytes

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPException(413, self._too_large_message())
            return message

        return limited_receive


async def _send_error(send: Send, status: int, message: str, code: str | None) -> None:
    body = json.dumps(error_body(status, message, None, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
