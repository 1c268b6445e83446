// jitney's CPU kernels, compiled on first use by jitney/model/cpu_kernels.py (see its docstring).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>
#include <atomic>

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

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define JITNEY_AVX512_BF16 1

// e^x, 16 lanes: 2^(x log2 e) split into an integer power (scalef) and a degree-6 polynomial on
// [-0.5, 0.5] (relative error about 2e-7). Inputs are clamped to [-87, 88]: finite results only.
static inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 y = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

static inline __m512 load_bf16_as_f32(const at::BFloat16* src) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

static inline void prefetch_tile(const at::BFloat16* tile, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(tile);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

// Lane-wise sums of 16 vectors in one vector, 45 shuffles and adds instead of 16 horizontal sums:
// halves, then quarters, then in-lane pairs are folded together. Lane 4k + j of the result is the
// sum of v[4j + k], so a caller that stores row r at v[4 * (r % 4) + r / 4] gets row r at lane r.
static inline __m512 fold16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int j = 0; j < 4; ++j)
    x[j] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0xDD));
  const __m512 y0 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
  const __m512 y1 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
  const __m512d y0d = _mm512_castps_pd(y0), y1d = _mm512_castps_pd(y1);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(y0d, y1d)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(y0d, y1d)));
}

// Decode attention, G query heads at a time: one pass over a range of a sequence's blocks per
// (sequence, KV head, G of its group's query heads, block range) task, with the online softmax and
// the G output rows in registers. G is the group itself for groups of up to 8 heads (every model
// in sight); larger groups are split into chunks, each of which reads the KV head's blocks again.
// A sequence's blocks are split into `parts` ranges when there are too few (sequence, head) units
// to keep every thread busy (a single long sequence has as many units as KV heads): each range
// then leaves its peak, sum and unnormalised output in `partial`, and they are merged after.
// Per 16-row tile: each head's 16 scores are bf16 dot products folded into one vector (no
// horizontal sum per row); each V row is widened in registers (bf16 is a float32's high half: the
// even elements are a shift, the odd ones a mask, so the accumulators hold even and odd elements
// apart until the end) and accumulated by every head of the group. The tiles two blocks ahead are
// prefetched, across the boundary into the thread's next task too: the kernel is bound by how
// fast scattered 2 KiB tiles arrive, and a task's first blocks would otherwise arrive cold.
template <int D, int G>
static void decode_bf16_grouped(const torch::Tensor& q, const torch::Tensor& k_cache,
                                const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                const torch::Tensor& context_lens, torch::Tensor& out, double scale,
                                int64_t parts, float* partial) {
  constexpr int QV = D / 32;  // bf16 vectors per head row
  constexpr int AHEAD = 2;    // blocks prefetched ahead (1 is slower here, 3-5 no faster)
  const int64_t num_seqs = q.size(0), num_heads = q.size(1);
  const int64_t kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t max_blocks = block_tables.size(1), chunks = num_heads / kv_heads / G;
  const at::BFloat16* qp = q.data_ptr<at::BFloat16>();
  const at::BFloat16* kp = k_cache.data_ptr<at::BFloat16>();
  const at::BFloat16* vp = v_cache.data_ptr<at::BFloat16>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const __m512 vscale = _mm512_set1_ps(static_cast<float>(scale));
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512 no_score = _mm512_set1_ps(-1e30f);  // rows past the context (finite: -ffast-math)
  const int64_t tile_bytes = block_size * D * static_cast<int64_t>(sizeof(at::BFloat16));
  struct Task {
    int64_t seq, kv_head, first_head, begin_block, end_block;
  };
  auto task_at = [&](int64_t task) {
    const int64_t unit = task / parts, part = task % parts;
    const int64_t s = unit / (kv_heads * chunks);
    const int64_t num_blocks = (lens[s] + block_size - 1) / block_size;
    const int64_t per_part = (num_blocks + parts - 1) / parts;
    const int64_t first = std::min(num_blocks, part * per_part);
    // Units run through a sequence's query heads in order: the first of this unit's G heads.
    return Task{s, unit / chunks % kv_heads, unit % (kv_heads * chunks) * G, first,
                std::min(num_blocks, first + per_part)};
  };
  at::parallel_for(0, num_seqs * kv_heads * chunks * parts, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float probs[G * 16];
    alignas(64) float parity_split[2 * QV * 16];
    float natural[D];
    for (int64_t task = begin; task < end; ++task) {
      const Task t = task_at(task);
      const Task next = task + 1 < end ? task_at(task + 1) : Task{0, 0, 0, 0, 0};
      const int64_t s = t.seq, h = t.kv_head, len = lens[s];
      const int64_t* table = tables + s * max_blocks;
      const at::BFloat16* qrow = qp + (s * num_heads + t.first_head) * D;
      __m512 acc[G][2 * QV];  // per head: even and odd elements of each 32-wide chunk of its row
      __m512 total[G];
      float peak[G];
      for (int g = 0; g < G; ++g) {
        for (int i = 0; i < 2 * QV; ++i) acc[g][i] = _mm512_setzero_ps();
        total[g] = _mm512_setzero_ps();
        peak[g] = -1e30f;
      }
      for (int64_t b = t.begin_block; b < t.end_block; ++b) {
        const int64_t offset = (table[b] * kv_heads + h) * block_size * D;
        if (b + AHEAD < t.end_block) {
          const int64_t ahead = (table[b + AHEAD] * kv_heads + h) * block_size * D;
          prefetch_tile(kp + ahead, tile_bytes);
          prefetch_tile(vp + ahead, tile_bytes);
        } else if (next.begin_block + b + AHEAD - t.end_block < next.end_block) {
          // The thread's next task, which starts cold otherwise.
          const int64_t nb = next.begin_block + b + AHEAD - t.end_block;
          const int64_t ahead = (tables[next.seq * max_blocks + nb] * kv_heads + next.kv_head) * block_size * D;
          prefetch_tile(kp + ahead, tile_bytes);
          prefetch_tile(vp + ahead, tile_bytes);
        }
        const int64_t block_rows = std::min(block_size, len - b * block_size);
        for (int64_t r0 = 0; r0 < block_rows; r0 += 16) {
          const int rows = static_cast<int>(std::min<int64_t>(16, block_rows - r0));
          const __mmask16 valid = static_cast<__mmask16>((1u << rows) - 1u);
          const at::BFloat16* ktile = kp + offset + r0 * D;
          const at::BFloat16* vtile = vp + offset + r0 * D;
          for (int g = 0; g < G; ++g) {
            __m512bh qv[QV];
            for (int i = 0; i < QV; ++i) qv[i] = (__m512bh)_mm512_loadu_si512(qrow + g * D + 32 * i);
            __m512 dots[16];
            for (int r = 0; r < 16; ++r) {  // rows past the context are scored too, then masked
              __m512 dot = _mm512_setzero_ps();
              for (int i = 0; i < QV; ++i)
                dot = _mm512_dpbf16_ps(dot, qv[i], (__m512bh)_mm512_loadu_si512(ktile + r * D + 32 * i));
              dots[4 * (r % 4) + r / 4] = dot;
            }
            const __m512 sv = _mm512_mask_mov_ps(no_score, valid, _mm512_mul_ps(fold16(dots), vscale));
            // Rescale only when a score passes the running peak (rare after the first tiles).
            if (_mm512_cmp_ps_mask(sv, _mm512_set1_ps(peak[g]), _CMP_GT_OQ)) {
              const float tile_peak = _mm512_reduce_max_ps(sv);
              const __m512 c = _mm512_set1_ps(std::exp(peak[g] - tile_peak));  // 0 on the first tile
              for (int i = 0; i < 2 * QV; ++i) acc[g][i] = _mm512_mul_ps(acc[g][i], c);
              total[g] = _mm512_mul_ps(total[g], c);
              peak[g] = tile_peak;
            }
            const __m512 p = _mm512_maskz_mov_ps(valid, exp_ps(_mm512_sub_ps(sv, _mm512_set1_ps(peak[g]))));
            total[g] = _mm512_add_ps(total[g], p);
            _mm512_store_ps(probs + 16 * g, p);
          }
          for (int r = 0; r < rows; ++r) {
            __m512 even[QV], odd[QV];
            for (int i = 0; i < QV; ++i) {
              const __m512i raw = _mm512_loadu_si512(vtile + r * D + 32 * i);
              even[i] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
              odd[i] = _mm512_castsi512_ps(_mm512_and_si512(raw, high_half));
            }
            for (int g = 0; g < G; ++g) {
              const __m512 w = _mm512_set1_ps(probs[16 * g + r]);
              for (int i = 0; i < QV; ++i) {
                acc[g][2 * i] = _mm512_fmadd_ps(w, even[i], acc[g][2 * i]);
                acc[g][2 * i + 1] = _mm512_fmadd_ps(w, odd[i], acc[g][2 * i + 1]);
              }
            }
          }
        }
      }
      for (int g = 0; g < G; ++g) {
        // The row in natural order: the output itself, or this block range's [peak, sum, row]
        // in `partial`, merged below.
        const float sum = _mm512_reduce_add_ps(total[g]);
        const __m512 inv = _mm512_set1_ps(parts == 1 ? 1.f / sum : 1.f);
        for (int i = 0; i < 2 * QV; ++i) _mm512_store_ps(parity_split + 16 * i, _mm512_mul_ps(acc[g][i], inv));
        float* row = parts == 1 ? natural : partial + (task * G + g) * (D + 2) + 2;
        for (int i = 0; i < QV; ++i)
          for (int j = 0; j < 16; ++j) {
            row[32 * i + 2 * j] = parity_split[32 * i + j];
            row[32 * i + 2 * j + 1] = parity_split[32 * i + 16 + j];
          }
        if (parts == 1) {
          at::BFloat16* orow = op + (s * num_heads + t.first_head + g) * D;
          for (int d = 0; d < D; ++d) orow[d] = static_cast<at::BFloat16>(natural[d]);
        } else {
          row[-2] = peak[g];
          row[-1] = sum;
        }
      }
    }
  });
  if (parts == 1) return;
  at::parallel_for(0, num_seqs * kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
    float merged[D];
    for (int64_t unit = begin; unit < end; ++unit) {
      const Task t = task_at(unit * parts);
      for (int g = 0; g < G; ++g) {
        auto slot = [&](int64_t part) { return partial + ((unit * parts + part) * G + g) * (D + 2); };
        float peak = -1e30f, sum = 0.f;
        for (int64_t part = 0; part < parts; ++part) peak = std::max(peak, slot(part)[0]);
        std::fill(merged, merged + D, 0.f);
        for (int64_t part = 0; part < parts; ++part) {
          const float* p = slot(part);
          const float weight = std::exp(p[0] - peak);  // 0 for an empty range (peak -1e30)
          sum += weight * p[1];
          for (int d = 0; d < D; ++d) merged[d] += weight * p[2 + d];
        }
        at::BFloat16* orow = op + (t.seq * num_heads + t.first_head + g) * D;
        for (int d = 0; d < D; ++d) orow[d] = static_cast<at::BFloat16>(merged[d] / sum);
      }
    }
  });
}

template <int D>
static void decode_bf16(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                        const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                        torch::Tensor& out, double scale) {
  const int64_t group = q.size(1) / k_cache.size(1);
  int64_t heads_per_task = 8;  // the largest divisor of the group up to 8
  while (group % heads_per_task) --heads_per_task;
  // Block ranges per sequence: enough tasks for four per thread, in a multiple of the thread
  // count, but ranges of at least 32 blocks: the split and merge cost more than they save on
  // shorter contexts (measured at 512 tokens; at 8,192 tokens, batch 1, the split saves 12%).
  const int64_t units = q.size(0) * q.size(1) / heads_per_task, threads = at::get_num_threads();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t longest = *std::max_element(lens, lens + context_lens.numel());
  const int64_t most_parts = std::max<int64_t>(1, longest / k_cache.size(2) / 32);
  int64_t parts = std::min(most_parts, (4 * threads + units - 1) / units);
  while (parts < most_parts && units * parts % threads) ++parts;
  torch::Tensor partial;
  if (parts > 1) partial = torch::empty({units * parts, heads_per_task, q.size(2) + 2}, q.options().dtype(at::kFloat));
  float* pp = parts > 1 ? partial.data_ptr<float>() : nullptr;
  switch (heads_per_task) {
    case 1: return decode_bf16_grouped<D, 1>(q, k_cache, v_cache, block_tables, context_lens, out, scale, parts, pp);
    case 2: return decode_bf16_grouped<D, 2>(q, k_cache, v_cache, block_tables, context_lens, out, scale, parts, pp);
    case 3: return decode_bf16_grouped<D, 3>(q, k_cache, v_cache, block_tables, context_lens, out, scale, parts, pp);
    case 4: return decode_bf16_grouped<D, 4>(q, k_cache, v_cache, block_tables, context_lens, out, scale, parts, pp);
    case 5: return decode_bf16_grouped<D, 5>(q, k_cache, v_cache, block_tables, context_lens, out, scale, parts, pp);
    case 6: return decode_bf16_grouped<D, 6>(q, k_cache, v_cache, block_tables, context_lens, out, scale, parts, pp);
    case 7: return decode_bf16_grouped<D, 7>(q, k_cache, v_cache, block_tables, context_lens, out, scale, parts, pp);
    default: return decode_bf16_grouped<D, 8>(q, k_cache, v_cache, block_tables, context_lens, out, scale, parts, pp);
  }
}

// The fast kernel covers bf16 caches whose head size is 64 or 128 and blocks a multiple of 16
// rows; anything else takes the portable loop below.
static bool decode_fast(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                        const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                        torch::Tensor& out, double scale) {
  if (q.scalar_type() != at::kBFloat16) return false;
  const int64_t head_dim = q.size(2), block_size = k_cache.size(2);
  if (block_size % 16 != 0) return false;
  if (head_dim == 64) {
    decode_bf16<64>(q, k_cache, v_cache, block_tables, context_lens, out, scale);
    return true;
  }
  if (head_dim == 128) {
    decode_bf16<128>(q, k_cache, v_cache, block_tables, context_lens, out, scale);
    return true;
  }
  return false;
}
// Causal attention of the prefill chunks of a step, read straight from the paged cache.
// Sequence i owns query rows [q_starts[i], q_starts[i] + q_lens[i]) of q; its keys are the first
// ctx_lens[i] cached rows, and its query row j sits at position ctx_lens[i] - q_lens[i] + j, so a
// chunk continuing a cached prefix sees that prefix. Work is split into tasks of (sequence,
// KV head, 32 query positions); each task keeps the 32 x group query rows' online-softmax state
// and walks the key tiles (16 cached rows) up to its last position: the tile of K is turned once
// into dot-product order (pairs of dims x 16 keys), so every score vector is 32 bf16 dot-product
// instructions with no horizontal sums. The tile of V is interleaved once into pairs of keys, so
// P x V is bf16 dot products too, with P rounded to bf16 and float32 sums (as torch's flash
// attention for bf16 does; the softmax denominators stay float32).
// Tasks are handed out largest first from a shared counter, which balances the causal triangle.
template <int D>
static void prefill_bf16_avx512(const torch::Tensor& q, const torch::Tensor& k_cache,
                                const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                const torch::Tensor& q_starts, const torch::Tensor& q_lens,
                                const torch::Tensor& ctx_lens, torch::Tensor& out, double scale) {
  constexpr int PAIRS = D / 2;  // 32-bit (bf16 pair) elements per head row
  constexpr int AV = D / 16;    // float32 vectors per head row
  constexpr int QT = 32;        // query positions per task
  constexpr int RP = AV <= 4 ? 4 : 2;  // rows whose outputs stay in registers during P x V
  const int64_t num_heads = q.size(1);
  const int64_t kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = num_heads / kv_heads, max_blocks = block_tables.size(1);
  const int64_t num_seqs = q_starts.size(0);
  const at::BFloat16* qp = q.data_ptr<at::BFloat16>();
  const at::BFloat16* kp = k_cache.data_ptr<at::BFloat16>();
  const at::BFloat16* vp = v_cache.data_ptr<at::BFloat16>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* starts = q_starts.data_ptr<int64_t>();
  const int64_t* qlens = q_lens.data_ptr<int64_t>();
  const int64_t* clens = ctx_lens.data_ptr<int64_t>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const float fscale = static_cast<float>(scale);

  struct Task { int64_t seq, head, first, cost; };
  std::vector<Task> tasks;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t prefix = clens[s] - qlens[s];
    for (int64_t first = 0; first < qlens[s]; first += QT) {
      const int64_t last_pos = prefix + std::min(qlens[s], first + QT) - 1;
      for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({s, h, first, last_pos + 1});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next_task{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(tasks.size()));

  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    const int64_t max_rows = QT * group + 8;  // room for padding the last row group to eight
    // Per row: output, running peak, and the softmax denominator as 16 lane sums (summed at the end).
    std::vector<float> o(max_rows * D), peak(max_rows), total(max_rows * 16);
    std::vector<int64_t> pos(max_rows);
    std::vector<const uint32_t*> qrows(max_rows);
    alignas(64) uint32_t kt[PAIRS * 16];
    // V as 8 key pairs x D dims of (key 2p, key 2p + 1) bf16 pairs, in unpack order: vector 2c of
    // a pair holds dims 32c + 8q + w at lane 4q + w, vector 2c + 1 dims 32c + 8q + 4 + w.
    alignas(64) uint32_t vt[8 * D];
    for (int64_t t = next_task++; t < static_cast<int64_t>(tasks.size()); t = next_task++) {
      const Task task = tasks[t];
      const int64_t s = task.seq, h = task.head;
      const int64_t prefix = clens[s] - qlens[s];
      const int64_t positions = std::min<int64_t>(QT, qlens[s] - task.first);
      const int64_t rows = positions * group;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t j = task.first + r / group, g = r % group;
        pos[r] = prefix + j;
        qrows[r] = reinterpret_cast<const uint32_t*>(qp + ((starts[s] + j) * num_heads + h * group + g) * D);
        peak[r] = -1e30f;  // below any score, finite (built with -ffast-math)
      }
      for (int64_t r = rows; r < rows + 8; ++r) {  // padding rows: see no key, read row 0's query
        pos[r] = -1;
        qrows[r] = qrows[0];
      }
      std::fill(o.begin(), o.begin() + (rows + 8) * D, 0.f);
      std::fill(total.begin(), total.begin() + rows * 16, 0.f);
      const int64_t keys = task.cost;  // keys 0 .. last position
      for (int64_t k0 = 0; k0 < keys; k0 += 16) {
        const int64_t block = tables[s * max_blocks + k0 / block_size];
        const int64_t offset = ((block * kv_heads + h) * block_size + k0 % block_size) * D;
        const int n_keys = static_cast<int>(std::min<int64_t>(16, keys - k0));
        const uint32_t* ksrc = reinterpret_cast<const uint32_t*>(kp + offset);
        for (int n = 0; n < 16; ++n)
          for (int d = 0; d < PAIRS; ++d) kt[d * 16 + n] = n < n_keys ? ksrc[n * PAIRS + d] : 0u;
        for (int np = 0; np < 8; ++np) {  // keys past n_keys are zero (their rows may be stale)
          const int a = 2 * np, b = 2 * np + 1;
          for (int c = 0; c < D / 32; ++c) {
            const __m512i ka = a < n_keys ? _mm512_loadu_si512(vp + offset + a * D + 32 * c) : _mm512_setzero_si512();
            const __m512i kb = b < n_keys ? _mm512_loadu_si512(vp + offset + b * D + 32 * c) : _mm512_setzero_si512();
            _mm512_store_si512(vt + np * D + 32 * c, _mm512_unpacklo_epi16(ka, kb));
            _mm512_store_si512(vt + np * D + 32 * c + 16, _mm512_unpackhi_epi16(ka, kb));
          }
        }
        // Rows are ordered by position: those before this tile see none of it.
        int64_t r0 = 0;
        while (r0 < rows && pos[r0] < k0) ++r0;
        for (int64_t rb = r0 / 8 * 8; rb < rows; rb += 8) {
          // Scores of eight rows at once, two partial sums each: sixteen independent chains of
          // dot-product instructions keep the units busy (one chain would wait on each result).
          __m512 even[8], odd[8];
          _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i) even[i] = odd[i] = _mm512_setzero_ps();
          for (int d = 0; d < PAIRS; d += 2) {
            const __m512bh k_even = (__m512bh)_mm512_load_si512(kt + d * 16);
            const __m512bh k_odd = (__m512bh)_mm512_load_si512(kt + (d + 1) * 16);
            _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i) {
              const uint32_t* qrow = qrows[rb + i];
              even[i] = _mm512_dpbf16_ps(even[i], k_even, (__m512bh)_mm512_set1_epi32(qrow[d]));
              odd[i] = _mm512_dpbf16_ps(odd[i], k_odd, (__m512bh)_mm512_set1_epi32(qrow[d + 1]));
            }
          }
          // Online softmax of the eight rows (padding rows and rows before this tile see nothing).
          alignas(64) uint32_t prob_pairs[8][8];  // probabilities rounded to bf16, as key pairs
          float correction[8];
          int64_t visible_max = 0;
          _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i) {
            const int64_t r = rb + i;
            const int64_t visible = std::max<int64_t>(0, std::min<int64_t>(n_keys, pos[r] - k0 + 1));
            correction[i] = 1.f;
            if (visible == 0) {
              _mm256_store_si256(reinterpret_cast<__m256i*>(prob_pairs[i]), _mm256_setzero_si256());
              continue;
            }
            visible_max = std::max(visible_max, visible);
            const __mmask16 valid = static_cast<__mmask16>((1u << visible) - 1u);
            const __m512 sv = _mm512_mul_ps(_mm512_add_ps(even[i], odd[i]), _mm512_set1_ps(fscale));
            __m512 row_total = _mm512_loadu_ps(total.data() + 16 * r);
            // Rescale only when a score passes the running peak (rare after the first tiles).
            if (_mm512_mask_cmp_ps_mask(valid, sv, _mm512_set1_ps(peak[r]), _CMP_GT_OQ)) {
              const float new_peak = _mm512_mask_reduce_max_ps(valid, sv);
              correction[i] = std::exp(peak[r] - new_peak);  // 0 on the first tile
              row_total = _mm512_mul_ps(row_total, _mm512_set1_ps(correction[i]));
              peak[r] = new_peak;
            }
            const __m512 p = _mm512_maskz_mov_ps(valid, exp_ps(_mm512_sub_ps(sv, _mm512_set1_ps(peak[r]))));
            _mm512_storeu_ps(total.data() + 16 * r, _mm512_add_ps(row_total, p));
            _mm256_store_si256(reinterpret_cast<__m256i*>(prob_pairs[i]), (__m256i)_mm512_cvtneps_pbh(p));
          }
          // P x V, RP rows at a time with their outputs in registers: each V row is loaded once
          // for all of them. Every index below is a compile-time constant after unrolling, so the
          // accumulators never go through memory.
          _Pragma("GCC unroll 4") for (int part = 0; part < 8; part += RP) {
            __m512 ov[RP][AV];
            _Pragma("GCC unroll 4") for (int i = 0; i < RP; ++i) {
              const __m512 c = _mm512_set1_ps(correction[part + i]);
              _Pragma("GCC unroll 8") for (int j = 0; j < AV; ++j)
                ov[i][j] = _mm512_mul_ps(_mm512_loadu_ps(o.data() + (rb + part + i) * D + 16 * j), c);
            }
            for (int64_t np = 0; np < (visible_max + 1) / 2; ++np) {
              __m512bh vpair[AV];
              _Pragma("GCC unroll 8") for (int j = 0; j < AV; ++j)
                vpair[j] = (__m512bh)_mm512_load_si512(vt + np * D + 16 * j);
              _Pragma("GCC unroll 4") for (int i = 0; i < RP; ++i) {
                const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(prob_pairs[part + i][np]));
                _Pragma("GCC unroll 8") for (int j = 0; j < AV; ++j)
                  ov[i][j] = _mm512_dpbf16_ps(ov[i][j], w, vpair[j]);
              }
            }
            _Pragma("GCC unroll 4") for (int i = 0; i < RP; ++i)
              _Pragma("GCC unroll 8") for (int j = 0; j < AV; ++j)
                _mm512_storeu_ps(o.data() + (rb + part + i) * D + 16 * j, ov[i][j]);
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t j = task.first + r / group, g = r % group;
        at::BFloat16* dst = op + ((starts[s] + j) * num_heads + h * group + g) * D;
        const float inv = 1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(total.data() + 16 * r));
        const float* row = o.data() + r * D;  // in V's unpack order (see vt)
        for (int c = 0; c < D / 32; ++c)
          for (int lane = 0; lane < 16; ++lane) {
            const int d = 32 * c + 8 * (lane / 4) + lane % 4;
            dst[d] = static_cast<at::BFloat16>(row[32 * c + lane] * inv);
            dst[d + 4] = static_cast<at::BFloat16>(row[32 * c + 16 + lane] * inv);
          }
      }
    }
  });
}

torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor q_starts, torch::Tensor q_lens,
                            torch::Tensor ctx_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [rows, heads, dim], cache [blocks, kv, bs, dim]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16,
              "the prefill kernel takes bf16 queries and caches");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.size(2) % 16 == 0, "the prefill kernel needs blocks of a multiple of 16 rows");
  TORCH_CHECK(q.size(2) == 64 || q.size(2) == 128, "the prefill kernel takes head sizes 64 and 128");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  auto out = torch::empty_like(q);
  if (q.size(2) == 64)
    prefill_bf16_avx512<64>(q, k_cache, v_cache, block_tables, q_starts.contiguous(), q_lens.contiguous(),
                            ctx_lens.contiguous(), out, scale);
  else
    prefill_bf16_avx512<128>(q, k_cache, v_cache, block_tables, q_starts.contiguous(), q_lens.contiguous(),
                             ctx_lens.contiguous(), out, scale);
  return out;
}

bool has_prefill_kernel() { return true; }
#else
static bool decode_fast(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                        const torch::Tensor&, const torch::Tensor&, torch::Tensor&, double) {
  return false;
}

torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                            torch::Tensor, torch::Tensor, double) {
  TORCH_CHECK(false, "the prefill kernel needs a compiler targeting AVX-512 BF16");
  return q;
}

bool has_prefill_kernel() { return false; }
#endif

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [seqs, heads, dim], cache [blocks, kv, bs, dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  if (q.size(0) == 0) return out;
  if (decode_fast(q, k_cache, v_cache, block_tables, context_lens, out, scale)) return out;
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

// ---- Element-wise steps of a layer, each one pass instead of several torch ops -----------------
// Both keep the reference's rounding: every intermediate that torch would store in the model
// dtype is rounded to it here too, so bf16 results match the unfused ops (to the last bit, but for
// the rare element where the last bit of exp tips a rounding).

static inline float round_to(float x, float) { return x; }
static inline float round_to(float x, at::BFloat16) {
  return static_cast<float>(static_cast<at::BFloat16>(x));
}
static inline float round_to(float x, at::Half) { return static_cast<float>(static_cast<at::Half>(x)); }

// silu(gate) * up for a fused [rows, 2 * inter] gate/up projection.
template <typename T>
static void silu_mul_scalar(const T* in, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in + r * 2 * inter;
      const T* up = gate + inter;
      for (int64_t i = 0; i < inter; ++i) {
        const float g = static_cast<float>(gate[i]);
        const float act = round_to(g / (1.f + std::exp(-g)), T(0));
        out[r * inter + i] = static_cast<T>(act * static_cast<float>(up[i]));
      }
    }
  });
}

#ifdef JITNEY_AVX512_BF16
static inline __m512 round_bf16(__m512 x) {
  const __m256i packed = (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(packed), 16));
}

static void silu_mul_bf16(const at::BFloat16* in, at::BFloat16* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const at::BFloat16* gate = in + r * 2 * inter;
      const at::BFloat16* up = gate + inter;
      at::BFloat16* dst = out + r * inter;
      int64_t i = 0;
      for (; i + 16 <= inter; i += 16) {
        const __m512 g = load_bf16_as_f32(gate + i);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.f), e);
        const __m512 sig = _mm512_div_ps(g, denominator);
        const __m512 prod = _mm512_mul_ps(round_bf16(sig), load_bf16_as_f32(up + i));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(prod));
      }
      for (; i < inter; ++i) {
        const float g = static_cast<float>(gate[i]);
        const float act = round_to(g / (1.f + std::exp(-g)), at::BFloat16(0));
        dst[i] = static_cast<at::BFloat16>(act * static_cast<float>(up[i]));
      }
    }
  });
}
#endif

#ifdef JITNEY_AVX512_BF16
// bf16 rows, 16 lanes at a time (the tail, dim % 16, scalar): the same roundings as the loops below.
static void norm_rows_bf16(const at::BFloat16* xp, at::BFloat16* rp, const at::BFloat16* wp,
                           at::BFloat16* op, int64_t rows, int64_t dim, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> sf(dim);
    for (int64_t r = begin; r < end; ++r) {
      const at::BFloat16* x = xp + r * dim;
      at::BFloat16* res = rp ? rp + r * dim : nullptr;
      __m512 sq = _mm512_setzero_ps();
      int64_t d = 0;
      for (; d + 16 <= dim; d += 16) {
        __m512 v = load_bf16_as_f32(x + d);
        if (res) {
          v = round_bf16(_mm512_add_ps(v, load_bf16_as_f32(res + d)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(res + d), (__m256i)_mm512_cvtneps_pbh(v));
        }
        _mm512_storeu_ps(sf.data() + d, v);
        sq = _mm512_fmadd_ps(v, v, sq);
      }
      float total = _mm512_reduce_add_ps(sq);
      for (; d < dim; ++d) {
        float v = static_cast<float>(x[d]);
        if (res) {
          const at::BFloat16 sum = static_cast<at::BFloat16>(v + static_cast<float>(res[d]));
          res[d] = sum;
          v = static_cast<float>(sum);
        }
        sf[d] = v;
        total += v * v;
      }
      const float inv = 1.f / std::sqrt(total / static_cast<float>(dim) + static_cast<float>(eps));
      const __m512 vinv = _mm512_set1_ps(inv);
      at::BFloat16* out = op + r * dim;
      for (d = 0; d + 16 <= dim; d += 16) {
        const __m512 normed = round_bf16(_mm512_mul_ps(_mm512_loadu_ps(sf.data() + d), vinv));
        const __m512 scaled = _mm512_mul_ps(load_bf16_as_f32(wp + d), normed);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), (__m256i)_mm512_cvtneps_pbh(scaled));
      }
      for (; d < dim; ++d) {
        const float normed = static_cast<float>(static_cast<at::BFloat16>(sf[d] * inv));
        out[d] = static_cast<at::BFloat16>(static_cast<float>(wp[d]) * normed);
      }
    }
  });
}
#endif

torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up [rows, 2 * intermediate]");
  gate_up = gate_up.contiguous();
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({rows, inter}, gate_up.options());
  switch (gate_up.scalar_type()) {
    case at::kBFloat16:
#ifdef JITNEY_AVX512_BF16
      silu_mul_bf16(gate_up.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, inter);
#else
      silu_mul_scalar(gate_up.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, inter);
#endif
      break;
    case at::kFloat:
      silu_mul_scalar(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, inter);
      break;
    case at::kHalf:
      silu_mul_scalar(gate_up.data_ptr<at::Half>(), out.data_ptr<at::Half>(), rows, inter);
      break;
    default:
      TORCH_CHECK(false, "unsupported dtype");
  }
  return out;
}

// The half rotation of RoPE for x [rows, heads, dim] (rows may be strided, e.g. a slice of the
// fused q/k/v projection) with per-row tables cos and signed_sin [rows, 1, dim] (sin with its
// first half negated): out = round(x * cos) + swap_halves(x) * signed_sin, as the torch path.
template <typename T>
static void rotary_impl(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        torch::Tensor& out) {
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t row_stride = x.stride(0), head_stride = x.stride(1);
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cp + r * dim;
      const T* sn = sp + r * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* src = xp + r * row_stride + h * head_stride;
        T* dst = op + (r * heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d) {
          const float scaled = round_to(static_cast<float>(src[d]) * static_cast<float>(c[d]), T(0));
          const float swapped = static_cast<float>(src[d < half ? d + half : d - half]);
          dst[d] = static_cast<T>(scaled + swapped * static_cast<float>(sn[d]));
        }
      }
    }
  });
}

torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "x [rows, heads, even dim], dims contiguous");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && x.scalar_type() == sin.scalar_type(), "dtypes differ");
  cos = cos.contiguous();
  sin = sin.contiguous();
  TORCH_CHECK(cos.numel() == x.size(0) * x.size(2) && sin.numel() == cos.numel(), "tables [rows, 1, dim]");
  auto out = torch::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat: rotary_impl<float>(x, cos, sin, out); break;
    case at::kBFloat16: rotary_impl<at::BFloat16>(x, cos, sin, out); break;
    case at::kHalf: rotary_impl<at::Half>(x, cos, sin, out); break;
    default: TORCH_CHECK(false, "unsupported dtype");
  }
  return out;
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
#ifdef JITNEY_AVX512_BF16
      norm_rows_bf16(x.data_ptr<at::BFloat16>(), nullptr, weight.data_ptr<at::BFloat16>(),
                     out.data_ptr<at::BFloat16>(), x.size(0), x.size(1), eps);
#else
      rms_norm_impl<at::BFloat16>(x, weight, out, eps);
#endif
      break;
    case at::kHalf:
      rms_norm_impl<at::Half>(x, weight, out, eps);
      break;
    default:
      TORCH_CHECK(false, "unsupported dtype");
  }
  return out;
}
// residual += x (rounded to the model dtype, as torch's add), then RMSNorm of the new residual:
// the two steps between a layer's sublayers, one pass, the residual updated in place.
template <typename T>
static void add_rms_norm_impl(const torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight,
                              torch::Tensor& out, double eps) {
  const int64_t rows = x.size(0), dim = x.size(1);
  const T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> sf(dim), wf(dim);
    widen(wp, wf.data(), dim);
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t d = 0; d < dim; ++d) {
        const float exact = static_cast<float>(xp[r * dim + d]) + static_cast<float>(rp[r * dim + d]);
        const T sum = static_cast<T>(exact);
        rp[r * dim + d] = sum;
        sf[d] = static_cast<float>(sum);
      }
      float sq = 0.f;
#pragma omp simd reduction(+ : sq)
      for (int64_t d = 0; d < dim; ++d) sq += sf[d] * sf[d];
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(dim) + static_cast<float>(eps));
      for (int64_t d = 0; d < dim; ++d) {
        const float normed = static_cast<float>(static_cast<T>(sf[d] * inv));
        op[r * dim + d] = static_cast<T>(wf[d] * normed);
      }
    }
  });
}

torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes() && weight.dim() == 1 &&
                  x.size(1) == weight.size(0),
              "x and residual [rows, dim], weight [dim]");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "x, residual and weight dtypes differ");
  TORCH_CHECK(residual.is_contiguous(), "residual must be contiguous (it is updated in place)");
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = torch::empty_like(x);
  switch (x.scalar_type()) {
    case at::kFloat: add_rms_norm_impl<float>(x, residual, weight, out, eps); break;
    case at::kBFloat16:
#ifdef JITNEY_AVX512_BF16
      norm_rows_bf16(x.data_ptr<at::BFloat16>(), residual.data_ptr<at::BFloat16>(),
                     weight.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), x.size(0), x.size(1),
                     eps);
#else
      add_rms_norm_impl<at::BFloat16>(x, residual, weight, out, eps);
#endif
      break;
    case at::kHalf: add_rms_norm_impl<at::Half>(x, residual, weight, out, eps); break;
    default: TORCH_CHECK(false, "unsupported dtype");
  }
  return out;
}

// Store the first slots.size(0) rows of k and v [rows, kv_heads, dim] (rows and heads may be
// strided, dims contiguous) at their slots (block * block_size + offset) of the caches: one call
// per layer instead of two advanced-indexing assignments.
void kv_write(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slots) {
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes(), "k and v [rows, kv_heads, dim]");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k and v dims must be contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches [blocks, kv_heads, block_size, dim], contiguous");
  TORCH_CHECK(k_cache.size(1) == k.size(1) && k_cache.size(3) == k.size(2) &&
                  v_cache.sizes() == k_cache.sizes(),
              "cache and k/v shapes differ");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "k/v and cache dtypes differ");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) <= k.size(0),
              "slots: int64 [rows]");
  slots = slots.contiguous();
  const int64_t n = slots.size(0), heads = k.size(1), dim = k.size(2);
  const int64_t block_size = k_cache.size(2), num_slots = k_cache.size(0) * block_size;
  const int64_t elem = k.element_size(), row_bytes = dim * elem;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "slot ", sp[i], " is outside the cache");
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t block = sp[i] / block_size, offset = sp[i] % block_size;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t dst = ((block * heads + h) * block_size + offset) * row_bytes;
        std::memcpy(kc + dst, kp + (i * k.stride(0) + h * k.stride(1)) * elem, row_bytes);
        std::memcpy(vc + dst, vp + (i * v.stride(0) + h * v.stride(1)) * elem, row_bytes);
      }
    }
  });
}

#ifdef JITNEY_AVX512_BF16
// y = x W^T (+ bias) over a weight stored in dot-product order, [ceil(N/16)][K/2][16][2] bf16
// (jitney/model/cpu_kernels.py packs it): each 64-byte load is 16 output columns x 2 inputs, so a
// register tile of up to 8 rows x 48 columns takes one bf16 dot-product instruction per row,
// 16 columns and input pair, with a broadcast input pair and no horizontal sums. At one row it
// streams the weight near the memory bandwidth; at hundreds of rows it runs near the machine's
// bf16 rate (the tile re-reads its weight columns from L2 for every 8 rows). Rows are taken 256
// at a time, so that their inputs stay in cache while the weight streams past; threads split the
// column tiles.
template <int MT, int NT>
static inline void pairs_tile(const at::BFloat16* xp, int64_t k_in, const at::BFloat16* wp,
                              at::BFloat16* op, int64_t n_out, int64_t n0, const at::BFloat16* bp) {
  const int64_t pairs = k_in / 2, block_elems = pairs * 32;  // bf16 elements per 16-column block
  const int32_t* x32 = reinterpret_cast<const int32_t*>(xp);  // an input pair is one 32-bit lane
  __m512 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < pairs; ++kp) {
    __m512bh wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wp + j * block_elems + kp * 32);
    for (int m = 0; m < MT; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(x32[m * pairs + kp]);
      for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, wv[j]);
    }
  }
  for (int j = 0; j < NT; ++j) {
    const int64_t c0 = n0 + 16 * j, valid = std::min<int64_t>(16, n_out - c0);
    if (valid <= 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    const __m512 bias = bp ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bp + c0)), 16))
                           : _mm512_setzero_ps();
    for (int m = 0; m < MT; ++m)  // float32 sum + bias, one rounding to bf16 (nearest even)
      _mm256_mask_storeu_epi16(op + m * n_out + c0, mask,
                               (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][j], bias)));
  }
}

template <int NT>
static void pairs_rows(const at::BFloat16* xp, int64_t rows, int64_t k_in, const at::BFloat16* wp,
                       at::BFloat16* op, int64_t n_out, int64_t n0, const at::BFloat16* bp) {
  constexpr int MT = 8;
  int64_t m = 0;
  for (; m + MT <= rows; m += MT) pairs_tile<MT, NT>(xp + m * k_in, k_in, wp, op + m * n_out, n_out, n0, bp);
  const at::BFloat16* x = xp + m * k_in;
  at::BFloat16* o = op + m * n_out;
  switch (rows - m) {
    case 1: return pairs_tile<1, NT>(x, k_in, wp, o, n_out, n0, bp);
    case 2: return pairs_tile<2, NT>(x, k_in, wp, o, n_out, n0, bp);
    case 3: return pairs_tile<3, NT>(x, k_in, wp, o, n_out, n0, bp);
    case 4: return pairs_tile<4, NT>(x, k_in, wp, o, n_out, n0, bp);
    case 5: return pairs_tile<5, NT>(x, k_in, wp, o, n_out, n0, bp);
    case 6: return pairs_tile<6, NT>(x, k_in, wp, o, n_out, n0, bp);
    case 7: return pairs_tile<7, NT>(x, k_in, wp, o, n_out, n0, bp);
    default: return;
  }
}

torch::Tensor linear_pairs(torch::Tensor x, torch::Tensor packed, int64_t n_out,
                           c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4, "x [rows, in], packed [blocks, in / 2, 16, 2]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(packed.is_contiguous() && packed.size(2) == 16 && packed.size(3) == 2, "packed [blocks, in / 2, 16, 2]");
  TORCH_CHECK(x.size(1) == 2 * packed.size(1), "x has ", x.size(1), " inputs, the weight ", 2 * packed.size(1));
  TORCH_CHECK(n_out > 16 * (packed.size(0) - 1) && n_out <= 16 * packed.size(0), "n_out does not match the blocks");
  x = x.contiguous();
  const at::BFloat16* bp = nullptr;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kBFloat16 && b.numel() == n_out, "bias [out], bf16");
    bp = b.data_ptr<at::BFloat16>();
  }
  const int64_t rows = x.size(0), k_in = x.size(1), blocks = packed.size(0);
  auto out = torch::empty({rows, n_out}, x.options());
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  constexpr int NT = 3;          // 16-column blocks per tile: 8 x 3 accumulators + 3 weight vectors
  constexpr int64_t ROWS = 256;  // rows whose inputs stay in cache while the weight streams
  const int64_t tiles = (blocks + NT - 1) / NT, block_elems = k_in * 16;
  for (int64_t m0 = 0; m0 < rows; m0 += ROWS) {
    const int64_t m_rows = std::min(ROWS, rows - m0);
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t b0 = t * NT;
        const at::BFloat16* w = wp + b0 * block_elems;
        const at::BFloat16* x0 = xp + m0 * k_in;
        at::BFloat16* o0 = op + m0 * n_out;
        switch (std::min<int64_t>(NT, blocks - b0)) {
          case 1: pairs_rows<1>(x0, m_rows, k_in, w, o0, n_out, 16 * b0, bp); break;
          case 2: pairs_rows<2>(x0, m_rows, k_in, w, o0, n_out, 16 * b0, bp); break;
          default: pairs_rows<3>(x0, m_rows, k_in, w, o0, n_out, 16 * b0, bp); break;
        }
      }
    });
  }
  return out;
}

bool has_linear_pairs() { return true; }
#else
torch::Tensor linear_pairs(torch::Tensor x, torch::Tensor, int64_t, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "the bf16 pairs linear kernel needs a compiler targeting AVX-512 BF16");
  return x;
}

bool has_linear_pairs() { return false; }
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over the paged KV cache");
  m.def("paged_prefill", &paged_prefill, "causal attention of a step's prefill chunks over the paged KV cache (bf16)");
  m.def("has_prefill_kernel", &has_prefill_kernel, "whether this build has the AVX-512 BF16 prefill kernel");
  m.def("rms_norm", &rms_norm, "RMSNorm of [rows, dim]");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate/up projection");
  m.def("rotary", &rotary, "RoPE half rotation with per-row cos and signed sin tables");
  m.def("add_rms_norm", &add_rms_norm, "residual += x, then RMSNorm of the residual");
  m.def("kv_write", &kv_write, "store k/v rows at their cache slots");
  m.def("linear_pairs", &linear_pairs, "x W^T (+ bias), bf16, W in dot-product order", py::arg("x"),
        py::arg("packed"), py::arg("n_out"), py::arg("bias") = py::none());
  m.def("has_linear_pairs", &has_linear_pairs, "whether this build has the AVX-512 BF16 pairs linear kernel");
}
