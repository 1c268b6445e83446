"""One engine of ``jitney bench throughput``, run in a process of its own so that its peak memory
(``ru_maxrss``) is its own: ``python -m jitney.bench.throughput_worker SPEC.json``.

Reads the requests and settings from SPEC.json, loads the model (not timed), warms up with one
short request, times generating every request, and prints one JSON line with the result.
Output lengths are forced (``ignore_eos`` or its equivalent) so every engine does the same work;
only the tokens each request asked for are counted.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

ENGINES = ("jitney-chunked", "jitney-continuous", "jitney-static", "hf-generate", "hf-continuous")

Runner = Callable[[list[list[int]], list[int]], int]  # (prompts, output lens) -> tokens produced


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _jitney(spec: dict[str, Any]) -> Runner:
    from jitney import LLM, SamplingParams

    policy = spec["engine"].split("-", 1)[1]
    llm = LLM(
        spec["model"],
        policy=policy,
        dtype=spec["dtype"],
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        kv_cache_memory=spec.get("kv_cache_memory"),
    )

    def run(prompts: list[list[int]], outs: list[int]) -> int:
        params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in outs]
        got = llm.generate(prompts, params, use_tqdm=False)
        return sum(min(len(o.token_ids), n) for o, n in zip(got, outs, strict=True))

    return run


def _hf_model(spec: dict[str, Any]):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, spec["dtype"])
    return AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype).eval()


def _hf_generate(spec: dict[str, Any]) -> Runner:
    """Static batching as users meet it: padded batches, each runs to its longest output."""
    import torch

    model = _hf_model(spec)
    batch_size = spec["hf_batch_size"]
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def run(prompts: list[list[int]], outs: list[int]) -> int:
        useful = 0
        for start in range(0, len(prompts), batch_size):
            batch, wanted = prompts[start : start + batch_size], outs[start : start + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            n = max(wanted)
            with torch.inference_mode():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=pad_id,
                )
            produced = out.shape[1] - width
            useful += sum(min(w, produced) for w in wanted)
        return useful

    return run


def _hf_num_blocks(model, kv_cache_memory: int | None, page_size: int = 256) -> int | None:
    """transformers' KV blocks (``page_size`` tokens over every layer) in the same byte budget as
    jitney's pool; left to transformers (which sizes it from free memory) when no budget is set."""
    if not kv_cache_memory:
        return None
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize
    return max(1, kv_cache_memory // (per_token * page_size))


def _hf_continuous(spec: dict[str, Any]) -> Runner:
    """transformers' own continuous batching, with each request's own output length."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = _hf_model(spec)
    if not hasattr(model, "continuous_batching_context_manager"):
        raise RuntimeError("the installed transformers has no continuous batching")

    def run(prompts: list[list[int]], outs: list[int]) -> int:
        gen = GenerationConfig(do_sample=False, max_new_tokens=max(outs))
        cb = ContinuousBatchingConfig(
            max_requests_per_batch=spec["max_num_seqs"],
            max_batch_tokens=spec["max_num_batched_tokens"],
            num_blocks=_hf_num_blocks(model, spec.get("kv_cache_memory")),
        )
        wanted: dict[str, int] = {}
        produced = 0
        with (
            torch.inference_mode(),
            model.continuous_batching_context_manager(
                generation_config=gen, continuous_batching_config=cb, block=True, timeout=30, warmup=False
            ) as manager,
        ):
            for i, (p, n) in enumerate(zip(prompts, outs, strict=True)):
                rid = manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
                wanted[rid or f"r{i}"] = n
            done = 0
            while done < len(prompts):
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' continuous batching loop stopped early")
                    continue
                if result.is_finished():
                    done += 1
                    produced += min(len(result.generated_tokens), wanted[result.request_id])
        return produced

    return run


_BUILDERS: dict[str, Callable[[dict[str, Any]], Runner]] = {
    "jitney-chunked": _jitney,
    "jitney-continuous": _jitney,
    "jitney-static": _jitney,
    "hf-generate": _hf_generate,
    "hf-continuous": _hf_continuous,
}


def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    prompts: list[list[int]] = spec["prompts"]
    outs: list[int] = spec["output_lens"]
    t0 = time.perf_counter()
    runner = _BUILDERS[spec["engine"]](spec)
    load_s = time.perf_counter() - t0
    runner([prompts[0][:16]], [2])  # warm-up: first calls pay for allocations no later step sees
    t0 = time.perf_counter()
    produced = runner(prompts, outs)
    wall = time.perf_counter() - t0
    return {
        "engine": spec["engine"],
        "ok": True,
        "wall_s": wall,
        "load_s": load_s,
        "input_tokens": sum(len(p) for p in prompts),
        "output_tokens": produced,
        "requested_output_tokens": sum(outs),
        "peak_rss_mib": _peak_rss_mib(),
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m jitney.bench.throughput_worker SPEC.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as fh:
        spec = json.load(fh)
    if spec.get("engine") not in ENGINES:
        print(f"unknown engine {spec.get('engine')!r}; known: {', '.join(ENGINES)}", file=sys.stderr)
        return 2
    print(json.dumps(run_spec(spec)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
