"""The KV cache's storage: one preallocated K and one V tensor per layer, addressed by block id.

The block *accounting* (which request owns which block, prefix hashes) lives in jitney.core; this
module only owns the memory and answers how many blocks a memory budget buys.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from jitney.model.config import ModelConfig

log = logging.getLogger(__name__)

# Share of currently free memory the KV pool takes when no size is given. The weights are already
# loaded when this is measured; the rest is left for activations, the OS and other processes.
DEFAULT_CPU_MEMORY_FRACTION = 0.25
DEFAULT_CUDA_MEMORY_FRACTION = 0.80


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block holds across all layers: K and V, kv_heads x head_dim per token."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * element


def num_blocks_for_memory(
    kv_cache_memory_bytes: int, cfg: ModelConfig, block_size: int, dtype: torch.dtype
) -> int:
    per_block = kv_bytes_per_block(cfg, block_size, dtype)
    blocks = int(kv_cache_memory_bytes) // per_block
    if blocks < 1:
        raise ValueError(
            f"kv_cache_memory={kv_cache_memory_bytes} bytes is smaller than one KV block ({per_block} bytes)"
        )
    return blocks


def available_memory_bytes(device: str) -> int:
    """Memory free right now: CUDA's free figure, or /proc/meminfo's MemAvailable on Linux."""
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise RuntimeError("cannot read free memory (no /proc/meminfo): pass kv_cache_memory explicitly")


def default_kv_cache_memory(device: str) -> int:
    fraction = DEFAULT_CUDA_MEMORY_FRACTION if device.startswith("cuda") else DEFAULT_CPU_MEMORY_FRACTION
    return int(available_memory_bytes(device) * fraction)


def max_concurrency(num_blocks: int, block_size: int, max_model_len: int) -> float:
    """How many requests of ``max_model_len`` tokens the pool holds at once."""
    return num_blocks * block_size / max_model_len


class PagedKVCache:
    """Per-layer (K, V) tensors of shape [num_blocks, kv_heads, block_size, head_dim].

    Heads outside tokens, so a gathered block is a ready [tokens, head_dim] matrix per head for the
    attention matmuls.

    Zero-filled, not empty: attention gathers whole blocks and masks the unused rows, and a masked
    row only contributes nothing if its values are finite.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        shape = (num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)
        ]
        self.nbytes = sum(k.nbytes + v.nbytes for k, v in self.layers)
