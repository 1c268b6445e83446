"""ModelRunner bookkeeping: request state across steps, sampling through the sampler, errors."""

from __future__ import annotations

import pytest

from jitney.config import CacheConfig, SchedulerConfig
from jitney.core.outputs import NewRequestData, ScheduledChunk, SchedulerOutput
from jitney.core.scheduler import Scheduler
from jitney.request import Request, SamplingParams
from jitney.runner import ModelRunner

CACHE = CacheConfig(block_size=4, num_blocks=64)


@pytest.fixture(scope="module")
def runner_factory(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    return lambda **kw: ModelRunner.from_pretrained(path, dtype="float32", cache_config=CACHE, **kw)


def prefill(rid: str, ids: list[int], blocks: tuple[int, ...], params: SamplingParams) -> SchedulerOutput:
    return SchedulerOutput(
        step_id=0,
        new_requests=[NewRequestData(rid, tuple(ids), len(ids), params, None)],
        chunks=[ScheduledChunk(rid, 0, len(ids), blocks, True, False)],
    )


def test_empty_step_and_forgotten_requests(runner_factory):
    runner = runner_factory()
    assert runner.execute(SchedulerOutput(step_id=0)).sampled_token_ids == {}
    greedy = SamplingParams(temperature=0.0)
    token = runner.execute(prefill("a", [1, 2, 3], (0,), greedy)).sampled_token_ids["a"]
    assert isinstance(token, int)
    decode = ScheduledChunk("a", 3, 1, (), True, True)
    runner.execute(SchedulerOutput(step_id=1, chunks=[decode]))
    # Once the scheduler reports the request finished, the runner no longer knows it.
    with pytest.raises(RuntimeError, match="never sent"):
        runner.execute(
            SchedulerOutput(step_id=2, finished_ids=["a"], chunks=[ScheduledChunk("a", 4, 1, (), True, True)])
        )


def test_inconsistent_chunks_fail_loudly(runner_factory):
    runner = runner_factory()
    greedy = SamplingParams(temperature=0.0)
    out = prefill("a", [1, 2, 3, 4, 5], (0,), greedy)  # 5 tokens need 2 blocks of 4
    with pytest.raises(RuntimeError, match="2 blocks needed"):
        runner.execute(out)
    runner = runner_factory()
    out = prefill("b", [1, 2], (0,), greedy)
    out.chunks[0] = ScheduledChunk("b", 0, 3, (0,), True, False)
    with pytest.raises(RuntimeError, match="only 2 tokens"):
        runner.execute(out)


def generate(runner: ModelRunner, prompts: dict[str, list[int]], params: dict[str, SamplingParams]):
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64), CACHE)
    requests = {rid: Request(rid, ids, params[rid]) for rid, ids in prompts.items()}
    for request in requests.values():
        scheduler.add_request(request)
    logprobs: dict[str, list] = {rid: [] for rid in prompts}
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        result = runner.execute(output)
        for rid, entry in (result.logprobs or {}).items():
            logprobs[rid].append(entry)
        scheduler.update_from_output(output, result)
    return {rid: r.output_token_ids for rid, r in requests.items()}, logprobs


def test_seeded_sampling_does_not_depend_on_the_batch(runner_factory):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=10, ignore_eos=True)
    other = SamplingParams(temperature=0.8, top_k=20, max_tokens=7, ignore_eos=True)
    alone, _ = generate(runner_factory(), {"s": [5, 6, 7, 8]}, {"s": seeded})
    crowd, _ = generate(
        runner_factory(seed=7),
        {"x": [9, 9, 9], "s": [5, 6, 7, 8], "y": list(range(30, 50))},
        {"x": other, "s": seeded, "y": other},
    )
    assert alone["s"] == crowd["s"]
    assert len(alone["s"]) == 10


def test_logprobs_are_returned_for_requests_that_ask(runner_factory):
    asks = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True)
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tokens, logprobs = generate(runner_factory(), {"a": [1, 2, 3], "b": [4, 5]}, {"a": asks, "b": plain})
    assert logprobs["b"] == []
    assert len(logprobs["a"]) == 4
    for token, (chosen_logprob, top) in zip(tokens["a"], logprobs["a"], strict=True):
        assert len(top) == 3
        assert top[0][0] == token  # greedy picks the most likely token
        assert chosen_logprob == pytest.approx(top[0][1])
        assert chosen_logprob <= 0.0


def test_kv_pool_description(runner_factory):
    text = runner_factory().describe_kv_pool(max_model_len=64)
    assert "64 blocks x 4 tokens" in text and "4.00x" in text


def test_thread_setting_is_overridable(monkeypatch):
    import torch

    from jitney.runner import apply_thread_setting

    before = torch.get_num_threads()
    try:
        assert apply_thread_setting(1) == 1
        monkeypatch.setenv("JITNEY_NUM_THREADS", str(before))
        assert apply_thread_setting() == before
        monkeypatch.setenv("JITNEY_NUM_THREADS", "two")
        with pytest.raises(ValueError, match="JITNEY_NUM_THREADS"):
            apply_thread_setting()
        with pytest.raises(ValueError, match="num_threads"):
            apply_thread_setting(0)
    finally:
        torch.set_num_threads(before)
