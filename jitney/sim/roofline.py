"""Roofline arithmetic for one step: time = max(bytes moved / bandwidth, FLOPs / effective FLOP/s)
plus a fixed overhead. Used by the ``roofline`` cost model and by ``jitney roofline``."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from jitney.sim.specs import GIB, HardwareSpec, ModelSpec


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step computes, as a cost model sees it. ``context_tokens`` is the KV each scheduled
    request's attention reads (sum of chunk ends); ``attention_pairs`` counts (query, key) pairs."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    context_tokens: int = 0
    attention_pairs: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


@dataclass(frozen=True)
class Roofline:
    model: ModelSpec
    hardware: HardwareSpec
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.overhead_s < 0:
            raise ValueError(f"overhead must be >= 0 s, got {self.overhead_s}")

    @property
    def effective_flops(self) -> float:
        return self.hardware.effective_flops(self.model.dtype_bytes)

    def memory_seconds(self, shape: StepShape) -> float:
        kv = self.model.kv_bytes_per_token
        moved = self.model.weight_bytes + kv * shape.context_tokens + kv * shape.num_tokens
        return moved / self.hardware.memory_bandwidth

    def compute_seconds(self, shape: StepShape) -> float:
        m = self.model
        flops = m.flops_per_token * shape.num_tokens + m.attention_flops_per_pair * shape.attention_pairs
        return flops / self.effective_flops

    def step_seconds(self, shape: StepShape) -> float:
        return max(self.memory_seconds(shape), self.compute_seconds(shape)) + self.overhead_s

    def decode_shape(self, batch: int, context: int) -> StepShape:
        """A pure decode step: ``batch`` requests, each attending over ``context`` tokens."""
        return StepShape(decode_tokens=batch, context_tokens=batch * context, attention_pairs=batch * context)

    def figures(
        self,
        batch: int,
        context: int,
        request_tokens: int | None = None,
        kv_pool_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
    ) -> RooflineFigures:
        if batch < 1 or context < 1:
            raise ValueError(f"batch and context must be >= 1, got {batch}, {context}")
        m, hw = self.model, self.hardware
        request_tokens = request_tokens or context
        if kv_pool_bytes is None:
            kv_pool_bytes = max(int(hw.memory_bytes * gpu_memory_utilization) - m.weight_bytes, 0)
        weight_read = m.weight_bytes / hw.memory_bandwidth
        token_compute = m.flops_per_token / self.effective_flops
        step_b = self.decode_shape(batch, context)
        step_1 = self.decode_shape(1, context)
        t_b, t_1 = self.step_seconds(step_b), self.step_seconds(step_1)
        return RooflineFigures(
            model=m.name,
            hardware=hw.name,
            batch=batch,
            context=context,
            num_params=m.total_params,
            weight_bytes=m.weight_bytes,
            weight_gib=m.weight_bytes / GIB,
            kv_bytes_per_token=m.kv_bytes_per_token,
            weight_read_ms=weight_read * 1e3,
            token_compute_us=token_compute * 1e6,
            effective_tflops=self.effective_flops / 1e12,
            ridge_flop_per_byte_peak=hw.flops / hw.memory_bandwidth,
            ridge_flop_per_byte_effective=self.effective_flops / hw.memory_bandwidth,
            decode_step_ms=t_b * 1e3,
            decode_bound="memory"
            if self.memory_seconds(step_b) >= self.compute_seconds(step_b)
            else "compute",
            decode_tokens_per_s=batch / t_b,
            decode_step_ms_batch1=t_1 * 1e3,
            decode_tokens_per_s_batch1=1 / t_1,
            optimal_chunk_tokens=int(weight_read / token_compute),
            kv_pool_bytes=kv_pool_bytes,
            request_tokens=request_tokens,
            requests_in_kv_pool=kv_pool_bytes // (m.kv_bytes_per_token * request_tokens),
            overhead_ms=self.overhead_s * 1e3,
        )


@dataclass(frozen=True)
class RooflineFigures:
    """``optimal_chunk_tokens``: the prefill chunk whose compute equals one weight read (also the
    batch where decode turns compute-bound, ignoring KV reads)."""

    model: str
    hardware: str
    batch: int
    context: int
    num_params: int
    weight_bytes: int
    weight_gib: float
    kv_bytes_per_token: int
    weight_read_ms: float
    token_compute_us: float
    effective_tflops: float
    ridge_flop_per_byte_peak: float
    ridge_flop_per_byte_effective: float
    decode_step_ms: float
    decode_bound: str
    decode_tokens_per_s: float
    decode_step_ms_batch1: float
    decode_tokens_per_s_batch1: float
    optimal_chunk_tokens: int
    kv_pool_bytes: int
    request_tokens: int
    requests_in_kv_pool: int
    overhead_ms: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def lines(self) -> list[str]:
        """Human-readable table rows."""
        gib = self.kv_pool_bytes / GIB
        return [
            f"model {self.model} ({self.num_params:,} params) on {self.hardware}",
            f"weights                 {self.weight_bytes:,} B "
            f"({self.weight_bytes / 1e9:.2f} GB, {self.weight_gib:.2f} GiB)",
            f"KV per token            {self.kv_bytes_per_token:,} B ({self.kv_bytes_per_token / 1024:g} KiB)",
            f"weight read             {self.weight_read_ms:.3f} ms",
            f"compute per token       {self.token_compute_us:.2f} us at {self.effective_tflops:.4g} TFLOP/s",
            f"ridge point             {self.ridge_flop_per_byte_peak:.0f} FLOP/B peak, "
            f"{self.ridge_flop_per_byte_effective:.0f} FLOP/B effective",
            f"decode step B={self.batch} ctx={self.context}  {self.decode_step_ms:.3f} ms "
            f"({self.decode_bound}-bound), {self.decode_tokens_per_s:,.0f} tok/s",
            f"decode step B=1 ctx={self.context}  {self.decode_step_ms_batch1:.3f} ms, "
            f"{self.decode_tokens_per_s_batch1:,.1f} tok/s",
            f"chunk = one weight read {self.optimal_chunk_tokens} tokens",
            f"KV pool                 {self.kv_pool_bytes:,} B ({gib:.1f} GiB): "
            f"{self.requests_in_kv_pool} requests of {self.request_tokens} tokens",
        ]
