"""Model and hardware descriptions for the roofline: presets, Hugging Face ``config.json``, and
``local`` (this machine, measured with torch).

Units are exact: bytes, bytes per second, FLOP per second. Decimal (GB, TB/s) and binary (GiB)
prefixes are never mixed; ``GIB`` exists only for printing.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

GIB = 1 << 30


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape. ``num_params`` overrides the count derived from the
    shape (the seed states "8e9 parameters" for its Qwen3-8B class model)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2
    tie_word_embeddings: bool = False
    num_params: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "dtype_bytes",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model {self.name}: {name} must be an integer >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model {self.name}: num_heads {self.num_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def layer_params(self) -> int:
        """Attention and gated MLP projections plus two norms (biases and q/k norms ignored)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        return attn + 3 * h * self.intermediate_size + 2 * h

    @property
    def total_params(self) -> int:
        if self.num_params is not None:
            return self.num_params
        heads = 1 if self.tie_word_embeddings else 2
        return self.num_layers * self.layer_params + heads * self.embedding_params + self.hidden_size

    @property
    def matmul_params(self) -> int:
        """Parameters multiplied per token: everything but the input embedding lookup (which is a
        gather), unless it is tied to the output head."""
        if self.num_params is not None or self.tie_word_embeddings:
            return self.total_params
        return self.total_params - self.embedding_params

    @property
    def weight_bytes(self) -> int:
        return self.total_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def flops_per_token(self) -> int:
        """Linear-layer FLOPs of one token (a multiply-add is 2 FLOPs)."""
        return 2 * self.matmul_params

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs for one (query token, key token) pair over all layers: QK^T and PV."""
        return 4 * self.num_layers * self.num_heads * self.head_dim


MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        # The seed's "Qwen3-8B class": 32 layers and 8e9 parameters as it states them. The real
        # Qwen3-8B (preset qwen3-8b) has 36 layers, so 147,456 B of KV per token, not 131,072.
        ModelSpec("seed-8b", 32, 4096, 32, 8, 128, 14336, 128256, num_params=8_000_000_000),
        ModelSpec("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936),
        ModelSpec("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
        ModelSpec("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
        ModelSpec("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064),
        ModelSpec("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, tie_word_embeddings=True),
    )
}

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "int8": 1}


def model_from_hf_config(path: str | Path, dtype_bytes: int | None = None) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (a file or a directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no model config at {p}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p} is not valid JSON: {exc}") from None
    cfg = cfg.get("text_config", cfg)
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        spec = ModelSpec(
            name=p.parent.name or p.stem,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            dtype_bytes=dtype_bytes or _DTYPE_BYTES.get(str(cfg.get("torch_dtype") or cfg.get("dtype")), 2),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )
    except KeyError as exc:
        raise ValueError(f"{p} lacks the field {exc.args[0]!r} needed for the roofline") from None
    return spec


def resolve_model(name_or_path: str) -> ModelSpec:
    if name_or_path in MODEL_PRESETS:
        return MODEL_PRESETS[name_or_path]
    if Path(name_or_path).exists():
        return model_from_hf_config(name_or_path)
    raise ValueError(
        f"unknown model {name_or_path!r}: use one of {', '.join(MODEL_PRESETS)} or a config.json path"
    )


@dataclass(frozen=True)
class HardwareSpec:
    """``flops`` is dense bf16 peak; ``efficiency`` is the share of it matmuls reach (MFU).
    ``fp32_flops`` is used for 4-byte models when known."""

    name: str
    memory_bandwidth: float  # bytes/s
    flops: float  # FLOP/s, dense bf16
    memory_bytes: int
    efficiency: float = 0.7
    fp32_flops: float | None = None

    def __post_init__(self) -> None:
        if not self.memory_bandwidth > 0 or not self.flops > 0:
            raise ValueError(f"hardware {self.name}: bandwidth and flops must be > 0")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"hardware {self.name}: efficiency must be in (0, 1], got {self.efficiency}")

    def effective_flops(self, dtype_bytes: int) -> float:
        peak = self.fp32_flops if dtype_bytes >= 4 and self.fp32_flops else self.flops
        return peak * self.efficiency


HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    h.name: h
    for h in (
        HardwareSpec("h100-sxm", 3.35e12, 989.4e12, 80 * 10**9),
        # The H100 as the seed's first section states it: "495 TFLOP/s dense bf16" (that is H100
        # SXM's dense TF32 figure, half its dense bf16) at 70% MFU, i.e. ~350 TFLOP/s effective.
        HardwareSpec("h100-seed", 3.35e12, 495e12, 80 * 10**9),
        HardwareSpec("h200", 4.8e12, 989.4e12, 141 * 10**9),
        HardwareSpec("a100-80g", 2.039e12, 312e12, 80 * 10**9),
        HardwareSpec("l4", 300e9, 121e12, 24 * 10**9),
    )
}


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_local(copy_bytes: int = 256 << 20, matmul_n: int = 1024, repeats: int = 3) -> HardwareSpec:
    """This machine as torch sees it: copy bandwidth over a buffer far larger than the caches
    (read + write bytes counted), fp32 and bf16 square matmul rates; best of ``repeats``.
    Measured rates are achieved ones, so efficiency is 1."""
    import torch

    src = torch.ones(copy_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    bandwidth = 2 * copy_bytes / _best_seconds(lambda: dst.copy_(src), repeats)
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(matmul_n, matmul_n).to(dtype)
        b = torch.randn(matmul_n, matmul_n).to(dtype)
        rates[dtype] = 2 * matmul_n**3 / _best_seconds(lambda a=a, b=b: a @ b, repeats)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 8 * GIB
    return HardwareSpec(
        "local", bandwidth, rates[torch.bfloat16], memory, efficiency=1.0, fp32_flops=rates[torch.float32]
    )


def resolve_hardware(name: str) -> HardwareSpec:
    if name == "local":
        return measure_local()
    if name in HARDWARE_PRESETS:
        return HARDWARE_PRESETS[name]
    raise ValueError(f"unknown hardware {name!r}: use one of {', '.join(HARDWARE_PRESETS)}, local")


def with_overrides(
    hw: HardwareSpec,
    *,
    bandwidth: float | None = None,
    flops: float | None = None,
    efficiency: float | None = None,
) -> HardwareSpec:
    changes = {
        k: v
        for k, v in (("memory_bandwidth", bandwidth), ("flops", flops), ("efficiency", efficiency))
        if v is not None
    }
    return replace(hw, **changes) if changes else hw
