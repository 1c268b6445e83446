"""The load generator against real HTTP servers on 127.0.0.1: a small OpenAI-format streaming
server started here (its behaviour is known exactly, so the client's counting can be checked),
and jitney's own server on a tiny checkpoint."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from jitney.bench.client import ApiTarget, discover_model
from jitney.bench.datasets import BenchRequest, LengthDist, TokenSpace, random_requests, seed_traffic
from jitney.bench.serve import LoadConfig, arrival_offsets, result_json, run_load, sweep_rates
from jitney.cli import main
from jitney.metrics import SLO

FAIL_OUTPUT_LEN = 7  # the fixture server refuses requests asking for exactly this many tokens
TOKEN_DELAY_S = 0.002


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _streaming_app() -> FastAPI:
    """Streams ``max_tokens`` one-word chunks (plus a usage event) in the OpenAI shapes."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fixture-model", "object": "model"}]}

    async def stream(body: dict, chat: bool):
        n = body["max_tokens"]
        prompt_tokens = len(body["prompt"]) if not chat else len(body["messages"][0]["content"].split())
        for i in range(n):
            await asyncio.sleep(TOKEN_DELAY_S)
            if chat:
                choice = {"index": 0, "delta": {"content": f" w{i}"}, "finish_reason": None}
            else:
                choice = {"index": 0, "text": f" w{i}", "finish_reason": None}
            yield _sse({"id": "x", "choices": [choice]})
        yield _sse(
            {"id": "x", "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n}}
        )
        yield "data: [DONE]\n\n"

    async def handle(request: Request, chat: bool):
        body = await request.json()
        if body.get("max_tokens") == FAIL_OUTPUT_LEN:
            return JSONResponse(
                {"error": {"message": "refused on purpose", "type": "invalid_request_error"}}, 400
            )
        if not body.get("ignore_eos"):
            return JSONResponse({"error": {"message": "expected ignore_eos"}}, 400)
        return StreamingResponse(stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, chat=True)

    return app


class _Server:
    """uvicorn on a free 127.0.0.1 port in a daemon thread; stopped by the fixture."""

    def __init__(self, app: FastAPI) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> _Server:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fixture server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def fixture_server():
    with _Server(_streaming_app()) as srv:
        yield srv


def _quiet(**kw) -> LoadConfig:
    return LoadConfig(show_progress=False, **kw)


def test_every_token_is_counted_and_latencies_are_ordered(fixture_server):
    reqs = random_requests(12, LengthDist.parse("uniform:4,20"), LengthDist.parse("uniform:2,9"), seed=3)
    reqs = [r for r in reqs if r.output_len != FAIL_OUTPUT_LEN]
    target = ApiTarget(fixture_server.base_url, "fixture-model")
    result = run_load(target, reqs, _quiet(max_concurrency=3))
    s = result.summary()
    assert s.completed == len(reqs) and s.failed == 0
    assert s.total_output_tokens == sum(r.output_len for r in reqs)
    assert s.total_input_tokens == sum(r.prompt_len for r in reqs)
    assert result.max_concurrency_seen() <= 3
    for rec, req in zip(result.records, reqs, strict=True):
        assert len(rec.token_times) == req.output_len
        assert rec.arrival_time < rec.first_token_time <= rec.finish_time
        assert rec.ttft <= rec.e2el
    assert s.ttft.mean > 0 and s.itl.median > 0 and s.e2el.p(99) >= s.e2el.median
    assert result.texts[0].split() == [f"w{i}" for i in range(reqs[0].output_len)]


def test_json_uses_vllm_field_names_and_failures_keep_their_errors(fixture_server):
    reqs = [
        BenchRequest((11, 12, 13), 3, 4),
        BenchRequest((14, 15), 2, FAIL_OUTPUT_LEN),
        BenchRequest((16,), 1, 2),
    ]
    target = ApiTarget(fixture_server.base_url, "fixture-model")
    result = run_load(target, reqs, _quiet(num_warmups=0))
    body = result_json(result, target, SLO(ttft_ms=10_000))
    assert body["completed"] == 2 and body["failed"] == 1
    assert body["total_output_tokens"] == 6
    assert body["errors"][1] == "HTTP 400: refused on purpose" and body["errors"][0] == ""
    for name in (
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "request_goodput",
        "mean_ttft_ms",
        "median_tpot_ms",
        "p99_itl_ms",
        "mean_e2el_ms",
        "duration",
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
        "generated_texts",
        "max_concurrent_requests",
    ):
        assert name in body, name
    assert body["request_rate"] == "inf"
    assert len(body["itls"][0]) == 3 and body["itls"][1] == []
    json.dumps(body)  # serialisable as is


def test_a_failing_warm_up_stops_the_run_with_the_reason(fixture_server):
    target = ApiTarget(fixture_server.base_url, "fixture-model", ignore_eos=False)
    with pytest.raises(ValueError, match="warm-up request .* failed: HTTP 400: expected ignore_eos"):
        run_load(target, [BenchRequest((11,), 1, 3)], _quiet())


def test_unreachable_server_is_reported_per_request():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = ApiTarget(f"http://127.0.0.1:{port}", "m")
    result = run_load(target, [BenchRequest((11,), 1, 3)], _quiet(num_warmups=0))
    assert result.summary().failed == 1 and "ConnectError" in result.records[0].error
    with pytest.raises(ValueError, match="cannot reach"):
        discover_model(f"http://127.0.0.1:{port}")


def test_poisson_and_gamma_arrivals_have_the_asked_rate_and_spread():
    for k in (1.0, 0.25, 4.0):
        gaps = np.diff([0.0] + arrival_offsets(20_000, rate=8.0, burstiness=k, seed=1))
        assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)
        assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(1 / k, rel=0.1)  # gamma: CV^2 = 1/k
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]


def test_arrivals_are_followed_when_the_requests_carry_them(fixture_server):
    reqs = [BenchRequest((11, 12), 2, 2, arrival=t) for t in (0.0, 0.3, 0.6)]
    result = run_load(ApiTarget(fixture_server.base_url, "fixture-model"), reqs, _quiet(num_warmups=0))
    sent = [r.arrival_time - result.start for r in result.records]
    assert sent[1] >= 0.3 and sent[2] >= 0.6
    assert result.duration >= 0.6


def test_length_specs_parse_and_bad_ones_are_named():
    assert LengthDist.parse("128") == LengthDist("fixed", 128, 128)
    assert LengthDist.parse("uniform:4,9").sample(np.random.default_rng(0), 50) == pytest.approx(
        np.clip(LengthDist.parse("uniform:4,9").sample(np.random.default_rng(0), 50), 4, 9)
    )
    lengths = LengthDist.parse("lognormal:256,0.6,16,1024").sample(np.random.default_rng(0), 2000)
    assert 16 <= min(lengths) and max(lengths) <= 1024 and 200 < float(np.median(lengths)) < 310
    for bad, why in (
        ("gauss:1,2", "kind must be"),
        ("uniform:9,4", "low <= high"),
        ("lognormal:1,2", "takes 4"),
        ("uniform:a,b", "expected numbers"),
    ):
        with pytest.raises(ValueError, match=why):
            LengthDist.parse(bad)


def test_shared_prefix_and_token_range():
    reqs = random_requests(
        5,
        LengthDist.parse("3"),
        LengthDist.parse("2"),
        prefix_len=4,
        tokens=TokenSpace(vocab_size=20, first_id=10),
    )
    assert all(r.prompt[:4] == reqs[0].prompt[:4] and r.prompt_len == 7 == len(r.prompt) for r in reqs)
    assert all(10 <= t < 20 for r in reqs for t in r.prompt)


def test_seed_traffic_matches_the_simulator_generator():
    reqs = seed_traffic(16.0, 2.0, seed=1234)
    from jitney.sim.traffic import TrafficSpec, generate

    items = generate(TrafficSpec(rate=16.0, duration_s=2.0, seed=1234))
    assert [(r.arrival, r.prompt_len, r.output_len) for r in reqs] == [
        (i.arrival, i.prompt_len, i.output_len) for i in items
    ]


def test_sweep_finds_the_highest_rate_meeting_the_slo(fixture_server):
    reqs = random_requests(6, LengthDist.parse("4"), LengthDist.parse("3"), seed=1)
    target = ApiTarget(fixture_server.base_url, "fixture-model")
    points, capacity = sweep_rates(target, reqs, [40.0, 20.0], _quiet(), SLO(ttft_ms=5_000))
    assert [p.rate for p in points] == [20.0, 40.0] and capacity == 40.0
    _, none = sweep_rates(target, reqs[:2], [50.0], _quiet(num_warmups=0), SLO(ttft_ms=0.001))
    assert none is None
    with pytest.raises(ValueError, match="needs at least one SLO"):
        sweep_rates(target, reqs, [1.0], _quiet(), SLO())


def test_cli_writes_json_and_plots_and_names_bad_input(fixture_server, tmp_path, capsys):
    out = tmp_path / "run.json"
    rc = main(
        [
            "bench",
            "serve",
            "--base-url",
            fixture_server.base_url,
            "--num-prompts",
            "6",
            "--input-len",
            "uniform:3,8",
            "--output-len",
            "uniform:2,5",
            "--request-rate",
            "50",
            "--slo-ttft-ms",
            "5000",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "plots"),
            "--no-progress",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0 and "successful / failed requests" in text
    body = json.loads(out.read_text())
    assert body["model_id"] == "fixture-model" and body["completed"] == 6 and body["request_rate"] == 50.0
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "concurrency.png",
        "latency_cdf.png",
        "throughput.png",
    ]
    assert main(["bench", "serve", "--base-url", fixture_server.base_url, "--endpoint", "chat"]) == 2
    assert "--tokenizer" in capsys.readouterr().err
    assert main(["bench", "serve", "--base-url", fixture_server.base_url, "--input-len", "normal:3"]) == 2
    assert "kind must be" in capsys.readouterr().err


# ---- jitney's own server --------------------------------------------------------------------


@pytest.fixture(scope="module")
def jitney_server(tiny_checkpoint):
    from jitney.llm import LLM
    from jitney.server.launch import EngineBundle, ServerThread, make_app

    ckpt = tiny_checkpoint("llama")
    llm = LLM(
        ckpt,
        dtype="float32",
        num_blocks=64,
        block_size=16,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,
    )
    app = make_app(EngineBundle(llm.engine, llm.tokenizer, "tiny", 256))
    with ServerThread(app) as srv:
        srv.checkpoint = ckpt  # type: ignore[attr-defined]
        yield srv


def test_against_jitney_server_outputs_are_forced_to_length(jitney_server):
    reqs = random_requests(
        8,
        LengthDist.parse("uniform:8,40"),
        LengthDist.parse("uniform:4,16"),
        seed=2,
        tokens=TokenSpace(vocab_size=500),
    )
    target = ApiTarget(jitney_server.base_url, discover_model(jitney_server.base_url))
    result = run_load(target, reqs, _quiet(request_rate=40.0))
    s = result.summary()
    assert s.completed == 8, result.errors()
    assert s.total_output_tokens == sum(r.output_len for r in reqs)  # ignore_eos honoured
    assert s.total_input_tokens == sum(r.prompt_len for r in reqs)
    assert s.ttft.mean > 0 and s.tpot.mean > 0


def test_against_jitney_server_chat_with_text_prompts(jitney_server, capsys):
    rc = main(
        [
            "bench",
            "serve",
            "--base-url",
            jitney_server.base_url,
            "--endpoint",
            "chat",
            "--num-prompts",
            "3",
            "--input-len",
            "6",
            "--output-len",
            "5",
            "--tokenizer",
            str(jitney_server.checkpoint),
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "3 / 0" in out
