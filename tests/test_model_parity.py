"""Parity with transformers on tiny random checkpoints of every supported architecture (float32).

The runner is driven two ways: with hand-made scheduler outputs that mix a decode, a whole prefill
and the continuation of a chunked prefill in one step (logits compared), and with the real
Scheduler under a small token budget and a small KV pool, so that chunked prefill, prefix-cache
hits and preemption by recompute all happen (greedy tokens compared with ``generate``).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from jitney.config import CacheConfig, SchedulerConfig
from jitney.core.outputs import NewRequestData, ScheduledChunk, SchedulerOutput
from jitney.core.scheduler import Scheduler
from jitney.request import Request, SamplingParams
from jitney.runner import ModelRunner

ARCHS = ["llama", "qwen2", "qwen3"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def hf_model(path) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # jitney side runs with ignore_eos
    return model


def hf_last_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0, -1].float()


def new_request(rid: str, ids: list[int]) -> NewRequestData:
    return NewRequestData(rid, tuple(ids), len(ids), GREEDY, None)


def mixed_step_logits(
    path, attention: str, padding: int = 0
) -> tuple[dict[str, torch.Tensor], dict[str, list]]:
    """Two hand-scheduled steps; returns step-2 logits per request and each request's tokens."""
    runner = ModelRunner.from_pretrained(
        path, dtype="float32", cache_config=CacheConfig(block_size=4, num_blocks=32), attention=attention
    )
    a = [7, 31, 99, 4, 250, 18, 3, 77, 301, 12]
    b = [5, 6, 7, 8, 9, 200, 201]
    c = [40 + 9 * i for i in range(20)]
    step1 = SchedulerOutput(
        step_id=1,
        new_requests=[new_request("a", a), new_request("c", c)],
        chunks=[
            ScheduledChunk("a", 0, 10, (0, 1, 2), True, False),
            ScheduledChunk("c", 0, 8, (3, 4), False, False),
        ],
    )
    a_token = runner.execute(step1).sampled_token_ids["a"]
    step2 = SchedulerOutput(
        step_id=2,
        new_requests=[new_request("b", b)],
        chunks=[
            ScheduledChunk("a", 10, 1, (), True, True),
            ScheduledChunk("c", 8, 12, (5, 6, 7), True, False),
            ScheduledChunk("b", 0, 7, (9, 8), True, False),
        ],
        num_padding_decode_slots=padding,
        num_padding_prefill_tokens=padding,
    )
    step = runner.compute_logits(step2)
    logits = dict(zip(step.request_ids, step.logits, strict=True))
    return logits, {"a": a + [a_token], "b": b, "c": c}


def require_backend(name: str) -> None:
    if name == "cpu-kernel":
        from jitney.model.cpu_kernels import load_kernels

        if load_kernels() is None:
            pytest.skip("the CPU paged-attention kernel cannot be built here")


@pytest.mark.parametrize("attention", ["reference", "sdpa", "cpu-kernel"])
@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_step_logits_match_transformers(tiny_checkpoint, arch, attention):
    require_backend(attention)
    path = tiny_checkpoint(arch)
    model = hf_model(path)
    logits, tokens = mixed_step_logits(path, attention)
    assert sorted(logits) == ["a", "b", "c"]
    for rid, ids in tokens.items():
        expected = hf_last_logits(model, ids)
        diff = (logits[rid] - expected).abs().max().item()
        assert diff <= 1e-4, f"{arch}/{attention} request {rid}: max |logit diff| {diff:.2e}"


def test_static_padding_rows_do_not_change_results(tiny_checkpoint):
    path = tiny_checkpoint("qwen2")
    plain, _ = mixed_step_logits(path, "auto")
    padded, _ = mixed_step_logits(path, "auto", padding=3)
    for rid in plain:
        torch.testing.assert_close(padded[rid], plain[rid], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_word_embeddings": True},
        {
            "max_position_embeddings": 4096,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ],
    ids=["tied-embeddings", "llama3-rope"],
)
def test_llama_variants_match_transformers(tiny_checkpoint, overrides):
    path = tiny_checkpoint("llama", **overrides)
    model = hf_model(path)
    logits, tokens = mixed_step_logits(path, "auto")
    for rid, ids in tokens.items():
        assert (logits[rid] - hf_last_logits(model, ids)).abs().max().item() <= 1e-4


def _prompts() -> list[list[int]]:
    shared = [11, 22, 33, 44, 55, 66, 77, 88]  # two full blocks of 4: prefix-cache hits
    prompts = [
        shared + [101, 102, 103],
        shared + [201, 202, 203, 204, 205, 206, 207],
        shared + [301],
        [9, 8, 7],
        [400 + i for i in range(23)],
        [17],
        shared + [5 * i % 500 for i in range(1, 15)],
        [250, 251, 252, 253, 254, 255, 256, 257, 258, 259, 260, 261, 262],
    ]
    assert len({len(p) for p in prompts}) == len(prompts)  # all lengths differ
    return prompts


def run_scheduled(
    runner: ModelRunner, scheduler: Scheduler, prompts: list[list[int]]
) -> dict[str, list[int]]:
    requests = [Request(f"r{i}", list(p), GREEDY) for i, p in enumerate(prompts)]
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        scheduler.update_from_output(output, runner.execute(output))
    return {r.request_id: r.output_token_ids for r in requests}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_generate_with_chunking_prefix_hits_and_preemption(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    model = hf_model(path)
    prompts = _prompts()
    cache = CacheConfig(block_size=4, num_blocks=24, enable_prefix_caching=True)
    runner = ModelRunner.from_pretrained(path, dtype="float32", cache_config=cache)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=64), cache)
    outputs = run_scheduled(runner, scheduler, prompts)

    stats = scheduler.stats()
    assert stats.num_preemptions_total > 0, "the small KV pool should force preemption"
    assert stats.prefix_cache_hits > 0, "shared prompt prefixes should hit the prefix cache"
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            generated = model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=GREEDY.max_tokens, min_new_tokens=0
            )
        expected = generated[0, len(prompt) :].tolist()
        assert outputs[f"r{i}"] == expected, f"{arch} prompt {i} (length {len(prompt)})"
