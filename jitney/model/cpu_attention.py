"""A paged decode-attention kernel for CPU, compiled on first use with torch's C++ extension tools.

Plain torch has no way to read K/V through a block table without first gathering the blocks into
a contiguous copy, so the torch backend moves every cached byte three times per layer (gather
read, gather write, matmul read). At large batches that KV traffic, not the weights, bounds a
decode step. This kernel reads each cached K/V row once, straight from its block: one task per
(sequence, KV head), the query heads of its group scored together, softmax in float32.

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
"""

_lock = threading.Lock()
_kernel = None
_tried = False


def load_kernel():
    """The compiled ``paged_decode`` function, or None when it cannot be built here."""
    global _kernel, _tried
    with _lock:
        if _tried:
            return _kernel
        _tried = True
        if os.environ.get("JITNEY_NO_CPU_KERNEL"):
            return None
        try:
            from torch.utils.cpp_extension import load_inline

            log.info("building the CPU paged-attention kernel (once per machine, about a minute)")
            module = load_inline(
                name="jitney_cpu_attention_v3",
                cpp_sources=_SOURCE,
                functions=["paged_decode"],
                extra_cflags=["-O3", "-march=native", "-fopenmp-simd", "-ffast-math"],
                verbose=False,
            )
            _kernel = module.paged_decode
        except Exception as err:  # any build failure means: use the torch path
            log.warning("CPU paged-attention kernel unavailable (%s); using the torch backend", err)
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
    kernel = load_kernel()
    if kernel is None:
        raise RuntimeError("the CPU paged-attention kernel is not available")
    return kernel(q, k_cache, v_cache, block_tables, context_lens, scale)
