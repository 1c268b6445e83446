"""CPU kernels compiled on first use with torch's C++ extension tools: paged attention (decode and
prefill), RMSNorm and the other element-wise steps of a layer, the KV write, and a bf16 linear.

Plain torch has no way to read K/V through a block table without first gathering the blocks into
a contiguous copy, so the torch backend moves every cached byte three times per layer (gather
read, gather write, matmul read). At large batches that KV traffic, not the weights, bounds a
decode step. This kernel reads each cached K/V row once, straight from its block: one task per
(sequence, KV head), the query heads of its group scored together, softmax in float32. For bf16
caches with head size 64 or 128 (built where the compiler targets AVX-512 BF16) it is a single
pass with an online softmax; a head's 16 scores per tile are bf16 dot products folded into one
vector, V is widened in registers, and blocks are prefetched two ahead, across task boundaries
too. It reads scattered 2 KiB tiles at about 40-45 GB/s here (23 GB/s for its first version, 11
for the portable two-pass loop that serves every other shape and dtype). When a step has too few
(sequence, KV head) units for the threads (one long sequence), each sequence's blocks are split
into ranges whose partial softmax states are merged after.

RMSNorm is here because in plain torch it is about ten small ops per call, and at batch 1 their
dispatch overhead costs a tenth of a decode step; the kernel does it in one pass, with the
reference's rounding (normalise in float32, round to the model dtype, then scale by the weight).
SwiGLU's silu-and-multiply and the rotary embedding are single passes for the same reason (three
and four torch ops, each a full pass over the activations of an 8,192-token prefill step); they
too round every intermediate the torch ops would store (silu-and-multiply differs from them by one
bf16 step in about 1 of 2,000 elements, where its exp tips a rounding; the rotation is exact).

The bf16 projections (and the vocabulary head) use one more kernel over a copy of the weight in
dot-product order (16 output columns x 2 inputs per 64-byte vector), which replaces oneDNN's
packed copy: one bf16 dot-product instruction per row, 16 columns and input pair, no horizontal
sums. At one row it streams the weights at about 80 GB/s here, where oneDNN's kernels reach 40-60
(2.6 vs 4.1 ms for SmolLM2's 30 layers); at 32 rows it is 11.2 vs 13.5 ms, and from 4,096 to
8,192 rows (prefill) it runs at oneDNN's rate or slightly above (1.75 vs 1.77 s at 8,192).

Compilation takes about a minute once per machine (cached by torch under
~/.cache/torch_extensions); if it fails, ``load_kernels`` returns None and the torch path is used.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# The C++ source; torch rebuilds the extension whenever it (or the flags) change.
SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"

_lock = threading.Lock()
_kernel = None
_tried = False


def load_kernels():
    """The compiled module (attention, norm, element-wise and cache-write kernels), or None when it
    cannot be built here."""
    global _kernel, _tried
    with _lock:
        if _tried:
            return _kernel
        _tried = True
        if os.environ.get("JITNEY_NO_CPU_KERNEL"):
            return None
        try:
            from torch.utils.cpp_extension import load

            log.info("building jitney's CPU kernels (once per machine and source, about a minute)")
            module = load(
                name="jitney_cpu_kernels",
                sources=[str(SOURCE)],
                # -fopenmp: at::parallel_for is a header template that is serial without it.
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
            _kernel = module
        except Exception as err:  # any build failure means: use the torch path
            log.warning("jitney's CPU kernels are unavailable (%s); using plain torch", err)
            _kernel = None
        return _kernel


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention over the paged cache: q [seqs, heads, dim] -> [seqs, heads, dim]."""
    return _require().paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a fused [rows, 2 * intermediate] projection, rounded as torch rounds."""
    return _require().silu_mul(gate_up)


def rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``jitney.model.rope.apply_rotary`` in one pass, into a new contiguous [rows, heads, dim]."""
    return _require().rotary(x, cos, signed_sin)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` (in place, rounded as torch's add), then RMSNorm of it: the normed rows."""
    return _require().add_rms_norm(x, residual, weight, eps)


def kv_write(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Store the rows of k and v [rows, kv_heads, dim] at ``slot_mapping``'s cache slots."""
    _require().kv_write(k, v, k_cache, v_cache, slot_mapping)


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] bf16 weight in ``linear_pairs``' order, [ceil(out / 16), in / 2, 16, 2]: 16
    output columns x 2 inputs per 64 bytes (the last block padded with zero columns)."""
    out_features, in_features = weight.shape
    if weight.dtype != torch.bfloat16 or in_features % 2:
        raise ValueError("pack_pairs needs a bf16 weight with an even input size")
    blocks = -(-out_features // 16)
    padded = torch.zeros(blocks * 16, in_features, dtype=weight.dtype, device=weight.device)
    padded[:out_features] = weight
    return padded.view(blocks, 16, in_features // 2, 2).transpose(1, 2).contiguous()


def linear_pairs(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for bf16 rows, given ``pack_pairs(weight)``."""
    return _require().linear_pairs(x, packed, out_features, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [rows, dim] normalised in float32, rounded to x's dtype, then scaled by ``weight``."""
    return _require().rms_norm(x, weight, eps)


def _require():
    kernels = load_kernels()
    if kernels is None:
        raise RuntimeError("jitney's CPU kernels are not available on this machine")
    return kernels
