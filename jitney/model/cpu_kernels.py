"""CPU kernels compiled on first use with torch's C++ extension tools: paged decode attention and
RMSNorm.

Plain torch has no way to read K/V through a block table without first gathering the blocks into
a contiguous copy, so the torch backend moves every cached byte three times per layer (gather
read, gather write, matmul read). At large batches that KV traffic, not the weights, bounds a
decode step. This kernel reads each cached K/V row once, straight from its block: one task per
(sequence, KV head), the query heads of its group scored together, softmax in float32.

RMSNorm is here because in plain torch it is about ten small ops per call, and at batch 1 their
dispatch overhead costs a tenth of a decode step; the kernel does it in one pass, with the
reference's rounding (normalise in float32, round to the model dtype, then scale by the weight).

Compilation takes about a minute once per machine (cached by torch under
~/.cache/torch_extensions); if it fails, ``load_kernel`` returns None and the torch path is used.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

// Widen n contiguous values to float32 (vectorises: bf16 is the high half of a float32).
static inline void widen(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
static inline void widen(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(raw[i]) << 16;
}
static inline void widen(const at::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
static void decode_impl(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                        const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                        torch::Tensor& out, double scale) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = num_heads / kv_heads, max_blocks = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  const int64_t block_elems = block_size * head_dim;

  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), tile(block_elems), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / kv_heads, h = task % kv_heads;
      const int64_t len = lens[s];
      const int64_t num_blocks = (len + block_size - 1) / block_size;
      scores.assign(group * len, 0.f);
      widen(qp + (s * num_heads + h * group) * head_dim, qf.data(), group * head_dim);
      for (auto& x : qf) x *= fscale;
      // Scores, one block at a time: its rows for this head are contiguous [block_size, head_dim].
      for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t block = tables[s * max_blocks + b];
        const int64_t rows = std::min(block_size, len - b * block_size);
        widen(kp + (block * kv_heads + h) * block_elems, tile.data(), rows * head_dim);
        for (int64_t r = 0; r < rows; ++r) {
          const float* krow = tile.data() + r * head_dim;
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * head_dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * krow[d];
            scores[g * len + b * block_size + r] = dot;
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        // Finite values only (built with -ffast-math): the peak starts at a real score.
        float* sg = scores.data() + g * len;
        float peak = sg[0];
#pragma omp simd reduction(max : peak)
        for (int64_t p = 0; p < len; ++p) peak = sg[p] > peak ? sg[p] : peak;
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t p = 0; p < len; ++p) {
          sg[p] = expf(sg[p] - peak);
          total += sg[p];
        }
        const float inv = 1.f / total;
#pragma omp simd
        for (int64_t p = 0; p < len; ++p) sg[p] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t block = tables[s * max_blocks + b];
        const int64_t rows = std::min(block_size, len - b * block_size);
        widen(vp + (block * kv_heads + h) * block_elems, tile.data(), rows * head_dim);
        for (int64_t r = 0; r < rows; ++r) {
          const float* vrow = tile.data() + r * head_dim;
          for (int64_t g = 0; g < group; ++g) {
            const float w = scores[g * len + b * block_size + r];
            float* ag = acc.data() + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) ag[d] += w * vrow[d];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          op[(s * num_heads + h * group + g) * head_dim + d] = static_cast<T>(acc[g * head_dim + d]);
    }
  });
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [seqs, heads, dim], cache [blocks, kv, bs, dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  switch (q.scalar_type()) {
    case at::kFloat:
      decode_impl<float>(q, k_cache, v_cache, block_tables, context_lens, out, scale);
      break;
    case at::kBFloat16:
      decode_impl<at::BFloat16>(q, k_cache, v_cache, block_tables, context_lens, out, scale);
      break;
    case at::kHalf:
      decode_impl<at::Half>(q, k_cache, v_cache, block_tables, context_lens, out, scale);
      break;
    default: TORCH_CHECK(false, "unsupported dtype");
  }
  return out;
}

template <typename T>
static void rms_norm_impl(const torch::Tensor& x, const torch::Tensor& weight, torch::Tensor& out,
                          double eps) {
  const int64_t rows = x.size(0), dim = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(dim), wf(dim);
    widen(wp, wf.data(), dim);
    for (int64_t r = begin; r < end; ++r) {
      widen(xp + r * dim, xf.data(), dim);
      float sq = 0.f;
#pragma omp simd reduction(+ : sq)
      for (int64_t d = 0; d < dim; ++d) sq += xf[d] * xf[d];
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(dim) + static_cast<float>(eps));
      for (int64_t d = 0; d < dim; ++d) {
        const float normed = static_cast<float>(static_cast<T>(xf[d] * inv));
        op[r * dim + d] = static_cast<T>(wf[d] * normed);
      }
    }
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && x.size(1) == weight.size(0),
              "x [rows, dim], weight [dim]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight dtypes differ");
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = torch::empty_like(x);
  switch (x.scalar_type()) {
    case at::kFloat:
      rms_norm_impl<float>(x, weight, out, eps);
      break;
    case at::kBFloat16:
      rms_norm_impl<at::BFloat16>(x, weight, out, eps);
      break;
    case at::kHalf:
      rms_norm_impl<at::Half>(x, weight, out, eps);
      break;
    default:
      TORCH_CHECK(false, "unsupported dtype");
  }
  return out;
}
"""

_lock = threading.Lock()
_kernel = None
_tried = False


def load_kernels():
    """The compiled module (``paged_decode``, ``rms_norm``), or None when it cannot be built here."""
    global _kernel, _tried
    with _lock:
        if _tried:
            return _kernel
        _tried = True
        if os.environ.get("JITNEY_NO_CPU_KERNEL"):
            return None
        try:
            from torch.utils.cpp_extension import load_inline

            log.info("building jitney's CPU kernels (once per machine, about a minute)")
            module = load_inline(
                name="jitney_cpu_kernels_v2",
                cpp_sources=_SOURCE,
                functions=["paged_decode", "rms_norm"],
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [rows, dim] normalised in float32, rounded to x's dtype, then scaled by ``weight``."""
    return _require().rms_norm(x, weight, eps)


def _require():
    kernels = load_kernels()
    if kernels is None:
        raise RuntimeError("jitney's CPU kernels are not available on this machine")
    return kernels
