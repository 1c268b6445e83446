"""One decoder-only transformer for Llama, Qwen2 and Qwen3 (RMSNorm, RoPE, GQA, SwiGLU).

Projections are fused at load time: q/k/v are one matmul and gate/up another, because on a CPU
each extra small matmul costs a kernel launch and a pass over the activations. Weights are
allocated empty here and filled by the loader; nothing is randomly initialised.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from jitney.model.attention import AttentionBackend, AttentionMetadata, TorchSdpaAttention
from jitney.model.config import ModelConfig
from jitney.model.linear import Linear
from jitney.model.rope import RotaryEmbedding, apply_rotary

# (x, residual, weight, eps) -> norm(x + residual); residual updated in place.
AddNormKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(size, dtype=dtype, device=device)
        self.kernel: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None
        self.add_kernel: AddNormKernel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.dim() == 2:
            return self.kernel(x, self.weight, self.eps)
        # Normalises in float32 internally, as the reference does.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): one pass with the compiled kernel (which updates
        ``residual`` in place), else an add and a norm."""
        if self.add_kernel is not None and x.dim() == 2 and residual.is_contiguous():
            return self.add_kernel(x, residual, self.weight, self.eps), residual
        total = x + residual
        return self.forward(total), total


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.qkv_bias, dtype, device)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, cfg.o_bias, dtype, device)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
        self.scale = cfg.head_dim**-0.5
        self.rotate: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = apply_rotary

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata, backend: AttentionBackend):
        cfg = self.cfg
        qkv = self.qkv(x)
        num_qk_heads = cfg.num_heads + cfg.num_kv_heads
        qk = qkv[:, : cfg.q_size + cfg.kv_size].view(-1, num_qk_heads, cfg.head_dim)
        v = qkv[:, cfg.q_size + cfg.kv_size :].view(-1, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, : cfg.num_heads]), self.k_norm(qk[:, cfg.num_heads :])), dim=1)
        # q and k share the rotation tables: rotate them in one pass.
        qk = self.rotate(qk, cos, sin)
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
        out = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, cfg.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias, dtype, device)
        self.down = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, dtype, device)
        self.silu_mul: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if self.silu_mul is not None and gate_up.dim() == 2:
            return self.down(self.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.attn = Attention(cfg, dtype, device)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(cfg, dtype, device)

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta, backend):
        """Returns (this layer's MLP output, the residual stream before adding it): the add is left
        to the next layer's input norm (or the final norm), which fuses it."""
        if residual is None:
            residual = x
            h = self.input_norm(x)
        else:
            h, residual = self.input_norm.add_forward(x, residual)
        h, residual = self.post_attn_norm.add_forward(
            self.attn(h, cos, sin, k_cache, v_cache, meta, backend), residual
        )
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    """``forward`` maps a flattened step to hidden states; ``compute_logits`` is applied only to the
    rows that sample, since the vocabulary projection is the largest matmul of a decode step."""

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ):
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.embed = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        )
        self.rotary = RotaryEmbedding(cfg, dtype, device)
        self.backend: AttentionBackend = TorchSdpaAttention()
        # The vocabulary projection as a Linear over the head weight, made on first use (after
        # loading, which may tie the head to the embedding), so it is packed like every other.
        self.head: Linear | None = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_position: int | None = None,
    ) -> torch.Tensor:
        """``max_position`` (the largest entry of ``positions``) saves a device sync when given."""
        x = F.embedding(input_ids, self.embed)
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else 0
        cos, sin = self.rotary.cos_sin(positions, max_position)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, k_cache, v_cache, meta, self.backend)
        return self.norm.add_forward(x, residual)[0]  # ModelConfig guarantees a layer

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype: widening a large batch's rows to float32 costs as much as
        the greedy argmax itself, so the sampler widens only the rows that need float32 math."""
        return self._vocab_head()(hidden)

    def _vocab_head(self) -> Linear:
        if self.head is None:
            self.head = Linear.around(self.embed if self.lm_head is None else self.lm_head)
        return self.head

    def use_cpu_kernels(self) -> bool:
        """Route RMSNorm (with the residual add before it), SwiGLU's silu-and-multiply and the
        rotary embedding through the compiled CPU kernels (one pass each instead of several small
        ops), and bf16 projections (the vocabulary head too) through the pairs kernel. Call before
        ``pack_weights``. Returns False, changing nothing, when the kernels are unavailable."""
        from jitney.model.cpu_kernels import load_kernels, pack_pairs

        kernels = load_kernels() if self.device.type == "cpu" else None
        if kernels is None:
            return False
        pairs = kernels.linear_pairs if kernels.has_linear_pairs() else None
        self._vocab_head()
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.kernel = kernels.rms_norm
                module.add_kernel = kernels.add_rms_norm
            elif isinstance(module, MLP):
                module.silu_mul = kernels.silu_mul
            elif isinstance(module, Attention):
                module.rotate = kernels.rotary
            elif isinstance(module, Linear) and pairs is not None:
                module.use_pairs(pack_pairs, pairs)
        return True

    def pack_weights(self) -> bool:
        """Switch every projection, the vocabulary head included, to a prepacked copy (see
        ``Linear.pack``). Returns False, changing nothing, where packing is unavailable (non-CPU
        device, no oneDNN)."""
        self._vocab_head()
        return all([module.pack() for module in self.modules() if isinstance(module, Linear)])
