"""The real server on 127.0.0.1 with a tiny real checkpoint, driven by the official ``openai`` client
and raw HTTP: answers, streaming, concurrency against the offline LLM, disconnects, errors, metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jitney.llm import LLM
from jitney.request import SamplingParams
from jitney.server.launch import EngineBundle, ServerThread, make_app

API_KEY = "test-key"
ENGINE_OPTIONS = dict(
    dtype="float32", num_blocks=2600, block_size=16, max_model_len=2048, max_num_seqs=32,
    max_num_batched_tokens=128,
)
MODEL = "tiny"


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def server(checkpoint):
    llm = LLM(checkpoint, **ENGINE_OPTIONS)
    bundle = EngineBundle(llm.engine, llm.tokenizer, MODEL, llm.scheduler_config.max_model_len)
    app = make_app(bundle, api_key=API_KEY, drain_timeout_s=5.0)
    with ServerThread(app) as srv:
        srv.llm = llm  # type: ignore[attr-defined]
        yield srv


@pytest.fixture(scope="module")
def offline(checkpoint):
    """The offline LLM the server's answers are checked against (its own engine and KV pool)."""
    return LLM(checkpoint, **ENGINE_OPTIONS)


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


def post(server, path: str, body, key: str | None = API_KEY, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    kwargs.setdefault("timeout", 60)
    return httpx.post(server.base_url + path, json=body, headers=headers, **kwargs)


def wait_until_idle(server, timeout_s: float = 20.0):
    """Every request ended and every KV block back in the free pool (as the engine thread reports)."""
    engine = server.engine
    cache = server.llm.cache_config
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snap = engine.snapshot()
        if snap.num_running == snap.num_waiting == 0 and snap.num_free_blocks == cache.num_blocks:
            return snap
        time.sleep(0.02)
    raise AssertionError(f"engine not idle: {engine.snapshot()}")


# -- the openai client ----------------------------------------------------------------------------
def test_completion_and_chat_with_the_openai_client(client):
    r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason in ("stop", "length")
    usage = r.usage
    assert usage.completion_tokens <= 6
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    hi = [{"role": "user", "content": "hi"}]
    c = client.chat.completions.create(model=MODEL, messages=hi, max_tokens=5)
    assert c.object == "chat.completion" and c.choices[0].message.role == "assistant"
    assert isinstance(c.choices[0].message.content, str) and c.usage.completion_tokens <= 5

    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streamed_text_equals_non_streamed_text_for_the_same_seed(client, endpoint):
    common = dict(model=MODEL, max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    if endpoint == "completions":
        whole = client.completions.create(prompt="the quick brown fox", **common)
        chunks = list(client.completions.create(prompt="the quick brown fox", stream=True,
                                                stream_options={"include_usage": True}, **common))
        streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        text = whole.choices[0].text
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    else:
        messages = [{"role": "user", "content": "tell me a story"}]
        whole = client.chat.completions.create(messages=messages, **common)
        chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                     stream_options={"include_usage": True}, **common))
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        text = whole.choices[0].message.content
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert streamed == text and text
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_logprobs_in_both_shapes(client):
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(top) <= 3 for top in lp.top_logprobs)
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_raw_sse_framing_and_streamed_chat_logprobs(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "stream": True,
            "logprobs": True, "top_logprobs": 1, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    pieces = [c["choices"][0]["logprobs"] for c in chunks]
    tokens = [t for lp in pieces if lp for t in lp["content"]]
    assert len(tokens) == 4 and all(len(t["top_logprobs"]) == 1 for t in tokens)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "usage" not in chunks[-1]


def test_tokenize_detokenize_and_health(server):
    toks = post(server, "/v1/tokenize", {"prompt": "hello world"}).json()
    assert toks["count"] == len(toks["tokens"]) > 0
    assert post(server, "/v1/detokenize", {"tokens": toks["tokens"]}).json()["prompt"] == "hello world"
    assert httpx.get(server.base_url + "/health").status_code == 200


# -- concurrency, against the offline LLM ---------------------------------------------------------
def _mixed_requests(n: int, vocab: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(7)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 60))]
        greedy = i % 2 == 0
        params = SamplingParams(max_tokens=rng.randint(1, 40), temperature=0.0 if greedy else 0.8,
                                seed=None if greedy else 1000 + i)
        out.append((prompt, params))
    return out


async def _stream_one(c: openai.AsyncOpenAI, prompt: list[int], params: SamplingParams) -> tuple[str, str]:
    stream = await c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=params.max_tokens, temperature=params.temperature,
        seed=params.seed, stream=True,
    )
    parts, finish = [], None
    async for chunk in stream:
        parts.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    return "".join(parts), finish


def test_64_concurrent_streams_match_the_offline_llm_and_free_every_block(server, offline):
    requests = _mixed_requests(64, server.llm.tokenizer.vocab_size)

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0,
                                      timeout=120) as c:
            return await asyncio.gather(*(_stream_one(c, p, s) for p, s in requests))

    got = asyncio.run(run_all())
    expected = offline.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    for (text, finish), want in zip(got, expected, strict=True):
        assert (text, finish) == (want.text, want.finish_reason)
    wait_until_idle(server)


def test_disconnected_clients_are_aborted_and_the_server_keeps_serving(server, client):
    async def drop_mid_stream(c: httpx.AsyncClient):
        body = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 2000, "ignore_eos": True,
                "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            seen = 0
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen == 3:
                        break  # leave mid-stream: the connection closes

    async def run_all():
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=server.base_url, headers=headers, timeout=60) as c:
            await asyncio.gather(*(drop_mid_stream(c) for _ in range(20)))

    aborted_before = _metric(server, "jitney:request_success_total", finished_reason="abort")
    asyncio.run(run_all())
    wait_until_idle(server)
    assert _metric(server, "jitney:request_success_total", finished_reason="abort") - aborted_before == 20
    r = client.completions.create(model=MODEL, prompt="still there?", max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_non_streaming_client_that_leaves_is_aborted(server):
    aborted_before = _metric(server, "jitney:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "a long answer", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        post(server, "/v1/completions", body, timeout=httpx.Timeout(60, read=0.2))
    deadline = time.monotonic() + 20
    while _metric(server, "jitney:request_success_total", finished_reason="abort") == aborted_before:
        assert time.monotonic() < deadline, "the abandoned request was not aborted"
        time.sleep(0.05)
    wait_until_idle(server)


# -- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [5] * 2100, "max_tokens": 1}, "prompt"),  # longer than max_model_len
        ({"prompt": "hi there", "max_tokens": 2047}, "prompt"),  # prompt + max_tokens over max_model_len
        ({"prompt": "hi", "temperature": -0.5}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "n": 3}, "n"),
        ({"prompt": "hi", "max_tokens": "lots"}, "max_tokens"),  # wrong type: 400, not 422
        ({"prompt": "hi", "stop": 5}, "stop"),
        ({"prompt": [1, 2, 10**6]}, "prompt"),
        ({"max_tokens": 3}, "prompt"),
    ],
)
def test_bad_completion_requests_get_400_in_the_openai_shape(server, body, param):
    r = post(server, "/v1/completions", {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] is not None and error["param"].startswith(param)


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b""])
def test_malformed_bodies_get_400(server, raw):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    r = httpx.post(server.base_url + "/v1/completions", content=raw, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_request_that_can_never_fit_the_kv_pool_is_refused_at_once(checkpoint):
    llm = LLM(checkpoint, **{**ENGINE_OPTIONS, "num_blocks": 4, "max_model_len": 256})  # 64 tokens of KV
    bundle = EngineBundle(llm.engine, llm.tokenizer, MODEL, 256)
    with ServerThread(make_app(bundle)) as srv:
        r = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 100}, key=None)
        assert r.status_code == 400 and "KV" in r.json()["error"]["message"]
        assert not llm.engine.has_unfinished()


def test_chat_errors(server):
    assert post(server, "/v1/chat/completions", {"messages": []}).status_code == 400
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
    x = [{"role": "user", "content": "x"}]
    r = post(server, "/v1/chat/completions", {"messages": x, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_unknown_model_is_404(server):
    r = post(server, "/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    x = [{"role": "user", "content": "x"}]
    r = post(server, "/v1/chat/completions", {"model": "gpt-4", "messages": x})
    assert r.status_code == 404


def test_unknown_route_is_404_in_the_openai_shape(server):
    r = post(server, "/v1/embeddings", {"input": "x"})
    assert r.status_code == 404 and "error" in r.json()


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_missing_or_wrong_api_key_is_401(server, key):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi"}, key=key)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.base_url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="nope", max_retries=0).models.list()


def test_several_megabyte_body_is_refused_without_harm(server, client):
    huge = json.dumps({"model": MODEL, "prompt": "x" * (5 * 1024 * 1024)})
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    r = httpx.post(server.base_url + "/v1/completions", content=huge, headers=headers, timeout=60)
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: the limit still holds while the body streams in
        for _ in range(6):
            yield b"x" * (1024 * 1024)

    r = httpx.post(server.base_url + "/v1/completions", content=chunked(), headers=headers, timeout=60)
    assert r.status_code == 413
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).choices
    wait_until_idle(server)


# -- metrics --------------------------------------------------------------------------------------
def _metric(server, name: str, **labels: str) -> float:
    text = httpx.get(server.base_url + "/metrics").text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def test_metrics_parse_and_counters_move(server, client, caplog):
    caplog.set_level(logging.INFO, logger="jitney.server")
    names = {"jitney:prompt_tokens_total", "jitney:generation_tokens_total", "jitney:num_requests_running",
             "jitney:num_requests_waiting", "jitney:kv_cache_usage_perc", "jitney:num_preemptions_total",
             "jitney:prefix_cache_queries_total", "jitney:prefix_cache_hits_total",
             "jitney:time_to_first_token_seconds_count", "jitney:inter_token_latency_seconds_count",
             "jitney:e2e_request_latency_seconds_count", "jitney:request_queue_time_seconds_count"}
    text = httpx.get(server.base_url + "/metrics").text
    present = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert names <= present, names - present
    before = {n: _metric(server, n) for n in names}
    client.completions.create(model=MODEL, prompt="count me", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    wait_until_idle(server)
    after = {n: _metric(server, n) for n in names}
    assert after["jitney:generation_tokens_total"] - before["jitney:generation_tokens_total"] == 5
    assert after["jitney:prompt_tokens_total"] > before["jitney:prompt_tokens_total"]
    assert after["jitney:prefix_cache_queries_total"] > before["jitney:prefix_cache_queries_total"]
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request finished")]
    assert len(logged) == 1 and "output_tokens=5 " in logged[0] and "finish_reason=length" in logged[0]
    moved = {n: after[n] - before[n] for n in names}
    assert moved["jitney:e2e_request_latency_seconds_count"] == 1
    assert moved["jitney:inter_token_latency_seconds_count"] == 4
