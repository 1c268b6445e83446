"""Rotary position embeddings (the half-rotation layout Hugging Face checkpoints use), with the
Llama 3 frequency scaling. cos/sin are computed per step from the positions, once for all layers."""

from __future__ import annotations

import math

import torch

from jitney.model.config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Per-pair rotation frequencies in float32 (length head_dim // 2)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended smoothly.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    in_band = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding:
    """Turns a step's positions into the cos/sin tables every layer applies to q and k.

    The tables are precomputed (in float32, then cast once to the model dtype) and grown on demand,
    so a step costs one row lookup instead of trigonometry. ``sin`` is stored with the first half
    negated, which lets ``apply_rotary`` rotate with one flip instead of slice/negate/concatenate.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        self.inv_freq = inv_freq.to(device)
        self.dtype = dtype
        self._cos = self._signed_sin = torch.empty(0, config.head_dim, dtype=dtype, device=device)
        self._grow(min(config.max_position_embeddings, 4096))

    def _grow(self, length: int) -> None:
        positions = torch.arange(length, dtype=torch.float32, device=self.inv_freq.device)
        freqs = positions[:, None] * self.inv_freq[None, :]
        self._cos = torch.cat((freqs, freqs), dim=-1).cos().to(self.dtype)
        self._signed_sin = torch.cat((-freqs, freqs), dim=-1).sin().to(self.dtype)

    def cos_sin(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, head_dim] tables for ``positions`` (``max_position`` bounds them, host-side)."""
        if max_position >= self._cos.shape[0]:
            self._grow(max(2 * self._cos.shape[0], max_position + 1))
        return self._cos[positions][:, None, :], self._signed_sin[positions][:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; the half-rotation (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    t, heads, dim = x.shape
    swapped = x.view(t, heads, 2, dim // 2).flip(2).view(t, heads, dim)
    return torch.addcmul(x * cos, swapped, signed_sin)
