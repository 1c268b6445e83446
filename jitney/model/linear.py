"""A linear projection that can switch to oneDNN's prepacked-weight kernel on CPU.

``F.linear`` re-lays out the weight on every call for small batches; oneDNN can instead keep the
weight in its own blocked layout (``pack``), which measured about 1.5-2x faster for a decode step
and never slower for prefill on this project's AVX-512 machine, in bf16 and fp32 alike. Packing
is an internal aten op (the one torch.compile's CPU freezing uses), so it is optional: when it is
unavailable the dense path stays. Steps of a few rows can instead take a compiled GEMV over the
dense weight (``use_gemv``; see jitney.model.cpu_kernels), which streams it faster.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


# Steps of at most this many rows (decodes of a small batch) take the GEMV kernel when it is on.
GEMV_MAX_ROWS = 4
GemvKernel = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _empty(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.weight = _empty(out_features, in_features, dtype=dtype, device=device)
        self.bias = _empty(out_features, dtype=dtype, device=device) if bias else None
        self.packed: torch.Tensor | None = None
        # Compiled kernel for steps of at most ``GEMV_MAX_ROWS`` rows, over the dense weight.
        self.gemv: GemvKernel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS:
            return self.gemv(x, self.weight, self.bias)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def use_gemv(self, kernel: GemvKernel) -> bool:
        """Route steps of a few rows through ``kernel`` (bf16 weights whose input size is a multiple
        of 32 only). The dense weight is then kept next to the packed one."""
        if self.weight.dtype != torch.bfloat16 or self.weight.shape[-1] % 32 or self.weight.numel() == 0:
            return False
        self.gemv = kernel
        return True

    def pack(self) -> bool:
        """Switch to the prepacked kernel and release the dense weight (it would double memory),
        unless the GEMV kernel still reads it."""
        if self.packed is None:
            self.packed = pack_weight(self.weight)
            if self.packed is not None and self.gemv is None:
                self.weight = _empty(0, dtype=self.weight.dtype, device=self.weight.device)
        return self.packed is not None


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a [out, in] weight, or None where it is not available."""
    global _linear_op
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        # The concrete overload, looked up once: skips torch.ops' per-call overload resolution.
        _linear_op = torch.ops.mkldnn._linear_pointwise.default
        _linear_op(torch.zeros(1, weight.shape[1], dtype=weight.dtype), packed, None, "none", [], "")
    except (RuntimeError, AttributeError) as err:
        log.info("oneDNN weight packing unavailable (%s); using dense matmuls", err)
        return None
    return packed


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _linear_op(x, packed, bias, "none", [], "")


_linear_op = None
