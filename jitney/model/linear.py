"""A linear projection that can switch to oneDNN's prepacked-weight kernel on CPU.

``F.linear`` re-lays out the weight on every call for small batches; oneDNN can instead keep the
weight in its own blocked layout (``pack``), which measured about 1.5-2x faster for a decode step
and never slower for prefill on this project's AVX-512 machine, in bf16 and fp32 alike. Packing
is an internal aten op (the one torch.compile's CPU freezing uses), so it is optional: when it is
unavailable the dense path stays. bf16 weights can instead take a compiled kernel over a copy in
dot-product order (``use_pairs``; see jitney.model.cpu_kernels), which measured faster than
oneDNN's at every step size here, most of all for decode steps; it then replaces oneDNN's copy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


PairsPacker = Callable[[torch.Tensor], torch.Tensor]
PairsKernel = Callable[[torch.Tensor, torch.Tensor, int, "torch.Tensor | None"], torch.Tensor]


def _empty(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.out_features = out_features
        self.weight = _empty(out_features, in_features, dtype=dtype, device=device)
        self.bias = _empty(out_features, dtype=dtype, device=device) if bias else None
        self.packed: torch.Tensor | None = None
        # The weight in the pairs kernel's order, when that kernel is on.
        self.pairs: torch.Tensor | None = None
        self.pairs_kernel: PairsKernel | None = None

    @classmethod
    def around(cls, weight: torch.Tensor) -> Linear:
        """A bias-free projection over an existing [out, in] weight, shared, not copied (the
        vocabulary head over the tied input embedding)."""
        layer = cls(0, 0, False, weight.dtype, weight.device)
        layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
        layer.out_features = weight.shape[0]
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pairs is not None:
            if x.dim() == 2:  # the model's case: a step's rows (no reshape ops per call)
                return self.pairs_kernel(x, self.pairs, self.out_features, self.bias)
            out = self.pairs_kernel(x.reshape(-1, x.shape[-1]), self.pairs, self.out_features, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def use_pairs(self, pack: PairsPacker, kernel: PairsKernel) -> bool:
        """Route every step through ``kernel`` over ``pack(weight)`` (bf16 weights with an even
        input size only; call before ``pack``, which then only releases the dense weight)."""
        weight = self.weight
        if weight.dtype != torch.bfloat16 or weight.shape[-1] % 2 or weight.numel() == 0:
            return False
        self.pairs = pack(weight)
        self.pairs_kernel = kernel
        return True

    def pack(self) -> bool:
        """Switch to a prepacked copy and release the dense weight (it would double memory): the
        pairs kernel's copy when it is on, else oneDNN's."""
        if self.pairs is not None:
            self.weight = _empty(0, dtype=self.weight.dtype, device=self.weight.device)
            return True
        if self.packed is None:
            self.packed = pack_weight(self.weight)
            if self.packed is not None:
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
