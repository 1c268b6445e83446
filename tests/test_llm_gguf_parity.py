"""The bundled SmolLM2 GGUF through jitney matches transformers loading the same file (float32).

jitney runs the eight chat prompts together with chunked prefill forced by a small token budget,
prefix caching on their shared chat-template prefix, and preemption forced by a small KV pool;
transformers decodes each prompt alone. Greedy tokens must be identical for 64 new tokens.
"""

from __future__ import annotations

import pytest
import torch

from jitney import LLM, SamplingParams
from jitney.model.registry import DEFAULT_MODEL, known_model_path

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colors.",
    "What is 12 times 12?",
    "Explain what a CPU cache is in one sentence.",
    "Give me a tip for staying focused.",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Celsius?",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def jitney_llm() -> LLM:
    # 8 requests of ~40 prompt + 64 new tokens need ~56 blocks of 16: a pool of 30 must preempt.
    return LLM(
        DEFAULT_MODEL,
        dtype="float32",
        max_num_batched_tokens=48,
        num_blocks=30,
        block_size=16,
        max_model_len=256,
    )


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """Plain greedy decoding with transformers' own KV cache, never stopping early."""
    out: list[int] = []
    with torch.no_grad():
        res = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
        cache = res.cache
        for _ in range(n):
            token = int(res.logits[0, -1].argmax())
            out.append(token)
            res = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
            cache = res.cache
    return out


def test_bundled_gguf_greedy_matches_transformers(jitney_llm: LLM) -> None:
    transformers = pytest.importorskip("transformers")
    path = known_model_path(DEFAULT_MODEL)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent),
        gguf_file=path.name,
        quantization_config=transformers.GgufConfig(dequantize=True),
        dtype=torch.float32,
    ).eval()
    tok = jitney_llm.tokenizer
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": c}]), add_special_tokens=False)
        for c in CHATS
    ]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = jitney_llm.generate(prompts, params, use_tqdm=False)

    stats = jitney_llm.engine.scheduler.stats()
    assert stats.num_preemptions_total > 0, "the small pool was meant to force preemption"
    assert stats.prefix_cache_hits > 0, "the shared chat prefix was meant to hit the prefix cache"
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS), out.text
    assert "Paris" in outs[0].text
    assert jitney_llm.engine.scheduler.kv.num_free_blocks == 30
