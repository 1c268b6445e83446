"""Putting a server together: model -> runner -> scheduler -> Engine -> AsyncEngine -> app -> uvicorn.

Also the shutdown policy: the first SIGTERM (or SIGINT) starts a drain (new requests get 503,
running ones finish within ``drain_timeout_s``, the rest are aborted) and only then asks uvicorn to
exit; a second signal exits at once. ``ServerThread`` runs the same server on a background thread
for tests and benchmarks (no signals there; ``stop()`` drains the same way).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from jitney.async_engine import AsyncEngine
from jitney.server.app import EngineBundle, ServerOptions, build_app
from jitney.server.gate import Phase, ServerState

logger = logging.getLogger("jitney.server")


def build_engine(
    model: str | Path | None, *, model_name: str | None = None, **llm_options: Any
) -> EngineBundle:
    """Load ``model`` (directory, .gguf or registry name; None = the bundled model) exactly as the
    offline ``LLM`` does, so the server and ``LLM`` answer the same prompts the same way.
    ``llm_options`` are ``LLM``'s keyword arguments (scheduler, KV pool, dtype, device)."""
    from jitney.llm import LLM

    llm = LLM(model, **llm_options)
    max_model_len = llm.scheduler_config.max_model_len
    return EngineBundle(llm.engine, llm.tokenizer, model_name or llm.model_name, max_model_len)


def make_app(
    bundle_or_loader: EngineBundle | Callable[[], EngineBundle], options: ServerOptions | None = None,
    on_load_error: Callable[[BaseException], None] | None = None, **option_fields: Any,
) -> FastAPI:
    """The app over a loaded model, or over a function that loads one (called at startup on a
    worker thread). Keyword arguments are ``ServerOptions`` fields."""
    if options is None:
        options = ServerOptions(**option_fields)
    elif option_fields:
        raise TypeError("give either options or option fields, not both")
    if isinstance(bundle_or_loader, EngineBundle):
        bundle = bundle_or_loader
        return build_app(lambda: bundle, options, on_load_error)
    return build_app(bundle_or_loader, options, on_load_error)


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains the engine before exiting."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self._app = app
        self._drain_started = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_started or self._loop is None:
            self.force_exit = self._drain_started
            self.should_exit = True
            return
        self._drain_started = True
        logger.info("received %s: draining", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.drain()))

    async def drain(self) -> None:
        """Refuse new requests, let running ones finish (bounded), then let uvicorn exit."""
        state: ServerState = self._app.state.server_state
        state.phase = Phase.DRAINING
        services = self._app.state.services.services
        if services is not None:
            start = time.monotonic()
            clean = await services.engine.drain(self._app.state.options.drain_timeout_s)
            logger.info("drained in %.1fs (%s)", time.monotonic() - start,
                        "all requests finished" if clean else "remaining requests aborted")
        self.should_exit = True


def serve(
    load: Callable[[], EngineBundle], options: ServerOptions, host: str, port: int, log_level: str = "info"
) -> None:
    """Listen at once (503 while the model loads), serve, drain on SIGTERM. Raises the load error
    if the model could not be loaded."""
    server: DrainingServer | None = None

    def stop_on_load_error(_: BaseException) -> None:
        if server is not None:
            server.should_exit = True

    app = make_app(load, options, on_load_error=stop_on_load_error)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            access_log=False)
    server = DrainingServer(config, app)
    server.run()
    error = app.state.server_state.load_error
    if error is not None:
        raise error


class ServerThread:
    """The real server on 127.0.0.1 and a free port, in a background thread."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app = app
        self.host = host
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, access_log=False)
        self.server = DrainingServer(config, app)
        self._thread = threading.Thread(target=self._run, name="jitney-server", daemon=True)

    @property
    def engine(self) -> AsyncEngine:
        """The running AsyncEngine (after ``start``)."""
        return self.app.state.services.get().engine

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        self.server.run(sockets=[self._sock])

    def start(self, timeout_s: float = 60.0, wait_ready: bool = True) -> ServerThread:
        """Start serving; with ``wait_ready``, return once the model is loaded (503s are over).
        Starting a started server does nothing."""
        if self._thread.ident is not None:
            return self
        self._thread.start()
        state: ServerState = self.app.state.server_state
        deadline = time.monotonic() + timeout_s
        while not self.server.started or (wait_ready and state.phase is Phase.STARTING):
            if state.load_error is not None:
                raise RuntimeError(f"the model did not load: {state.load_error}")
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def drain(self) -> None:
        """What SIGTERM does, for a server on a thread."""
        loop = self.server._loop
        assert loop is not None
        asyncio.run_coroutine_threadsafe(self.server.drain(), loop)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._thread.is_alive():
            self.server.should_exit = True
            self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
