"""Lifecycle: 503 while the model loads, 503 to new work while draining (running requests
finish), and `jitney serve` draining on SIGTERM, then exiting cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from jitney.llm import LLM
from jitney.server.launch import EngineBundle, ServerThread, make_app

OPTIONS = dict(dtype="float32", num_blocks=64, block_size=16, max_model_len=512, max_num_batched_tokens=64)


def _stream_in_background(base_url: str, body: dict, sink: list) -> threading.Thread:
    """Read an SSE stream to its end on a thread; ``sink`` gets every data payload."""

    def read():
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as resp:
            sink.append(resp.status_code)
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    sink.append(line[len("data: "):])

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def _wait_for_tokens(sink: list, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(sink) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(sink) >= 3, f"the stream never started: {sink}"


def _finish_reason(sink: list) -> str | None:
    reasons = [json.loads(p)["choices"][0]["finish_reason"] for p in sink[1:] if p != "[DONE]"]
    return next((r for r in reasons if r is not None), None)


def test_draining_server_refuses_new_work_and_finishes_running_requests(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("llama"), **OPTIONS)
    bundle = EngineBundle(llm.engine, llm.tokenizer, "tiny", 512)
    with ServerThread(make_app(bundle, drain_timeout_s=60.0)) as srv:
        sink: list = []
        body = {"prompt": "drain me", "max_tokens": 100, "ignore_eos": True, "stream": True}
        reader = _stream_in_background(srv.base_url, body, sink)
        _wait_for_tokens(sink)
        srv.drain()
        deadline = time.monotonic() + 10
        while httpx.get(srv.base_url + "/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "late"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_unavailable"
        reader.join(120)
        assert sink[0] == 200 and sink[-1] == "[DONE]" and _finish_reason(sink) == "length"


def test_starting_server_answers_503_until_the_model_is_loaded(tiny_checkpoint):
    release = threading.Event()

    def slow_load() -> EngineBundle:
        release.wait(60)
        llm = LLM(tiny_checkpoint("llama"), **OPTIONS)
        return EngineBundle(llm.engine, llm.tokenizer, "tiny", 512)

    with ServerThread(make_app(slow_load)).start(wait_ready=False) as srv:
        health = httpx.get(srv.base_url + "/health")
        assert health.status_code == 503 and "starting" in health.json()["error"]["message"]
        assert httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x"}).status_code == 503
        assert httpx.get(srv.base_url + "/metrics").status_code == 503
        release.set()
        deadline = time.monotonic() + 60
        while httpx.get(srv.base_url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "the server never became ready"
            time.sleep(0.05)
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_a_model_that_fails_to_load_is_reported(tmp_path):
    def broken_load() -> EngineBundle:
        return LLM(tmp_path / "no-such-model", **OPTIONS)  # raises: nothing there

    srv = ServerThread(make_app(broken_load))
    try:
        with pytest.raises(RuntimeError, match="did not load"):
            srv.start()
        health = httpx.get(srv.base_url + "/health")
        assert health.status_code == 503 and "failed to load" in health.json()["error"]["message"]
    finally:
        srv.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_then_exits(tiny_checkpoint):
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "jitney.cli", "serve", str(tiny_checkpoint("llama")), "--port", str(port),
           "--num-blocks", "64", "--dtype", "float32", "--max-model-len", "512",
           "--max-num-batched-tokens", "64", "--drain-timeout", "60", "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if k != "JITNEY_API_KEY"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)
        sink: list = []
        body = {"prompt": "one more thing", "max_tokens": 100, "ignore_eos": True, "stream": True}
        reader = _stream_in_background(base, body, sink)
        _wait_for_tokens(sink)
        proc.send_signal(signal.SIGTERM)
        reader.join(120)
        assert sink[0] == 200 and sink[-1] == "[DONE]" and _finish_reason(sink) == "length"
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
