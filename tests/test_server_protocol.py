"""The server's building blocks without a model: request translation, error shapes, SSE, metrics."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from jitney.server import responses as R
from jitney.server.errors import ApiError, _describe_validation_error, error_body
from jitney.server.metrics import EngineSnapshot, FinishedRequestTimes, ServerMetrics
from jitney.server.protocol import ChatCompletionRequest, CompletionRequest


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **fields})


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_completion_fields_become_sampling_params():
    params = completion(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=3, stop="x", ignore_eos=True,
        min_tokens=2, logprobs=3,
    ).to_sampling_params()
    got = (params.max_tokens, params.temperature, params.top_p, params.top_k, params.min_p, params.seed)
    assert got == (7, 0.5, 0.9, 5, 0.1, 3)
    assert (params.stop, params.ignore_eos, params.min_tokens, params.logprobs) == (["x"], True, 2, 3)


def test_completion_defaults_follow_openai():
    params = completion().to_sampling_params()
    assert params.max_tokens == 16 and params.temperature == 1.0 and params.logprobs is None
    assert completion(top_k=-1).to_sampling_params().top_k == 0


def test_chat_prefers_max_completion_tokens_and_maps_logprobs():
    request = chat(max_tokens=5, max_completion_tokens=9, logprobs=True, top_logprobs=2)
    params = request.to_sampling_params(100)
    assert params.max_tokens == 9 and params.logprobs == 2
    assert chat(logprobs=True).to_sampling_params(100).logprobs == 0
    assert chat().to_sampling_params(100).max_tokens == 100


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"min_p": 2}, "min_p"),
        ({"logprobs": 21}, "logprobs"),
        ({"min_tokens": 50, "max_tokens": 5}, "min_tokens"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"best_of": 3}, "best_of"),
        ({"echo": True}, "echo"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_completion_values_name_their_parameter(fields, param):
    with pytest.raises(ApiError) as info:
        completion(**fields).to_sampling_params()
    assert info.value.status == 400 and info.value.param == param


def test_chat_rejects_top_logprobs_without_logprobs_and_names_max_completion_tokens():
    with pytest.raises(ApiError) as info:
        chat(top_logprobs=2).to_sampling_params(10)
    assert info.value.param == "top_logprobs"
    with pytest.raises(ApiError) as info:
        chat(max_completion_tokens=0).to_sampling_params(10)
    assert info.value.param == "max_completion_tokens"


def test_prompt_forms():
    assert completion(prompt=[1, 2, 3]).single_prompt() == [1, 2, 3]
    assert completion(prompt=["only"]).single_prompt() == "only"
    assert completion(prompt=[[4, 5]]).single_prompt() == [4, 5]
    for bad in (["a", "b"], "", []):
        with pytest.raises(ApiError):
            completion(prompt=bad).single_prompt()


def test_validation_errors_read_as_one_line_with_the_parameter():
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": "many"})
    message, param = _describe_validation_error(info.value.errors())
    assert param == "max_tokens" and "max_tokens" in message


def test_error_body_has_the_openai_shape():
    body = error_body(404, "no such model", "model", "model_not_found")
    assert body == {"error": {"message": "no such model", "type": "not_found_error", "param": "model",
                              "code": "model_not_found"}}


@given(st.dictionaries(st.text(max_size=5), st.text(max_size=20), max_size=4))
def test_sse_event_is_one_data_line_that_round_trips(payload):
    event = R.sse_event(payload)
    assert event.startswith("data: ") and event.endswith("\n\n") and event.count("\n") == 2
    assert json.loads(event[len("data: "):]) == payload


def test_completion_logprobs_offsets_follow_the_text():
    text = {1: "ab", 2: "c", 3: "def"}.__getitem__
    lp = R.completion_logprobs([1, 2, 3], [(-0.1, [(1, -0.1)]), (-0.2, []), (-0.3, [(3, -0.3), (2, -1.0)])],
                               text, 10)
    assert lp["tokens"] == ["ab", "c", "def"] and lp["text_offset"] == [10, 12, 13]
    assert lp["top_logprobs"][2] == {"def": -0.3, "c": -1.0}


def _parse(metrics: ServerMetrics) -> dict[str, float]:
    values = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if not sample.labels.get("le"):
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def test_metrics_use_vllm_names_and_move():
    snap = EngineSnapshot(num_running=3, num_waiting=2, kv_cache_usage=0.25, num_preemptions=4,
                          prefix_cache_queries=100, prefix_cache_hits=40)
    metrics = ServerMetrics("m", lambda: snap)
    before = _parse(metrics)
    for name in ("jitney:num_requests_running", "jitney:num_requests_waiting", "jitney:kv_cache_usage_perc",
                 "jitney:num_preemptions_total", "jitney:prefix_cache_queries_total",
                 "jitney:prefix_cache_hits_total"):
        assert name in before, name
    assert before["jitney:num_requests_running"] == 3 and before["jitney:kv_cache_usage_perc"] == 0.25
    metrics.observe_finished(FinishedRequestTimes(0.01, 0.05, (0.02, 0.03), 0.2, 11, 3), "length")
    after = _parse(metrics)
    assert after["jitney:prompt_tokens_total"] == 11 and after["jitney:generation_tokens_total"] == 3
    assert after["jitney:time_to_first_token_seconds_count"] == 1
    assert after["jitney:inter_token_latency_seconds_count"] == 2
    assert after["jitney:e2e_request_latency_seconds_count"] == 1
    assert after["jitney:request_queue_time_seconds_count"] == 1


def test_each_server_has_its_own_registry():
    a = ServerMetrics("m", EngineSnapshot)
    b = ServerMetrics("m", EngineSnapshot)
    a.observe_finished(FinishedRequestTimes(None, None, (), 0.1, 5, 0), "abort")
    assert _parse(a)["jitney:prompt_tokens_total"] == 5
    assert _parse(b)["jitney:prompt_tokens_total"] == 0
