// A step's logits on the CPU: each row's best entries and logsumexp (the token picker's
// alternatives), and the LM head's refinement (runtime/model/linear.py, LogitsHead): each
// row's best candidates recomputed from 16-bit weight rows with fp32 accumulation.
//
// Why the refinement is here: in torch it took topk over the vocabulary, a gather, a
// widening, a multiply and a sum, ~0.4 ms of a ~9 ms int4 decode step (measured), most of it
// torch's topk on one thread; this is one pass over the logits per row and r short dot
// products.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_simd.h"
#include "cpu_worker_pool.h"

namespace sgl_nb {

struct Ranked {
  float value;
  int64_t id;
};

// a ranks above b: larger, a NaN above any number (as torch.topk), ties: the lower id.
inline bool above(const Ranked& a, const Ranked& b) {
  const bool a_nan = std::isnan(a.value), b_nan = std::isnan(b.value);
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && a.value != b.value) return a.value > b.value;
  return a.id < b.id;
}

// The r best entries of v[0, n), best first. One pass: 8 lanes at a time are compared with
// the worst kept, and only a lane that beats it (or a NaN) goes to the heap.
inline std::vector<Ranked> top_entries(const float* v, int64_t n, int64_t r) {
  r = std::min(r, n);
  std::vector<Ranked> heap;  // a heap under `above`: its front is the worst kept
  if (r <= 0) return heap;
  heap.reserve(r);
  int64_t i = 0;
  for (; i < r; ++i) heap.push_back({v[i], i});
  std::make_heap(heap.begin(), heap.end(), above);
  auto offer = [&](int64_t j) {
    const Ranked e{v[j], j};
    if (!above(e, heap.front())) return;
    std::pop_heap(heap.begin(), heap.end(), above);
    heap.back() = e;
    std::push_heap(heap.begin(), heap.end(), above);
  };
#ifdef SGL_NB_AVX2
  for (; i + 8 <= n; i += 8) {
    // Not (x <= worst): larger, or unordered (a NaN here or kept).
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(
        _mm256_loadu_ps(v + i), _mm256_set1_ps(heap.front().value), _CMP_NLE_UQ));
    for (; mask; mask &= mask - 1) offer(i + __builtin_ctz(mask));
  }
#endif
  for (; i < n; ++i) offer(i);
  std::sort(heap.begin(), heap.end(), above);
  return heap;
}

// log(sum(exp(v[0, n)))) given its largest entry `peak`: exp(v - peak) summed in 8 float
// lanes per block of kExpBlock entries (exp_block_sum; the vector loop's entries, n rounded
// down to a multiple of 8), the blocks' sums in order and then the entries past them one by
// one in double (a float sum over 150k entries drifts by 1e-4). Split so that the blocks can
// be summed on several threads with the same bits (a decode step's alternatives).
constexpr int64_t kExpBlock = 512;

// How many blocks logsumexp sums in lanes (none without AVX2).
inline int64_t exp_blocks(int64_t n) {
#ifdef SGL_NB_AVX2
  return (n / 8 * 8 + kExpBlock - 1) / kExpBlock;
#else
  (void)n;
  return 0;
#endif
}

// Block j's float sum of exp(v - peak).
inline float exp_block_sum(const float* v, int64_t n, float peak, int64_t j) {
#ifdef SGL_NB_AVX2
  const __m256 p = _mm256_set1_ps(peak);
  __m256 acc = _mm256_setzero_ps();
  const int64_t end = std::min(n / 8 * 8, (j + 1) * kExpBlock);
  for (int64_t i = j * kExpBlock; i < end; i += 8) {
    acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(v + i), p)));
  }
  return hsum(acc);
#else
  (void)v, (void)n, (void)peak, (void)j;
  return 0.f;
#endif
}

// logsumexp given block j's sum as block_sum(j) (exp_block_sum, here or computed before).
template <typename BlockSum>
inline double logsumexp_of_blocks(const float* v, int64_t n, float peak,
                                  const BlockSum& block_sum) {
  if (std::isnan(peak) || std::isinf(peak)) return peak;  // NaN, +inf, or a row of -inf only
  double total = 0.0;
  const int64_t blocks = exp_blocks(n);
  for (int64_t j = 0; j < blocks; ++j) total += block_sum(j);
  for (int64_t i = blocks ? n / 8 * 8 : 0; i < n; ++i) total += std::exp(v[i] - peak);
  return peak + std::log(total);
}

inline double logsumexp(const float* v, int64_t n, float peak) {
  return logsumexp_of_blocks(v, n, peak, [&](int64_t j) { return exp_block_sum(v, n, peak, j); });
}

// Each row of rows [B, V] (fp32): the ids and values of its k largest logits (best first) and
// its logsumexp: the alternatives the token picker records each step. In torch this took
// ~10 ops a step, each ~10 us once the weight reads have evicted the caches.
inline std::tuple<std::vector<std::vector<int64_t>>, std::vector<std::vector<float>>,
                  std::vector<double>>
top_logits(const at::Tensor& rows, int64_t k) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kFloat && rows.is_contiguous() &&
              rows.device().is_cpu(), "top_logits: rows [B, V] contiguous float32 on the CPU");
  TORCH_CHECK(k >= 1, "top_logits: k >= 1");
  const int64_t b = rows.size(0), n = rows.size(1);
  const float* p = rows.data_ptr<float>();
  std::vector<std::vector<int64_t>> ids(b);
  std::vector<std::vector<float>> values(b);
  std::vector<double> lse(b);
  // Rows on the kernels' threads: a decode ahead hands the picker a row per step at once.
  WorkerPool::get().parallel_for(b, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = p + t * n;
      for (const Ranked& e : top_entries(row, n, k)) {
        ids[t].push_back(e.id);
        values[t].push_back(e.value);
      }
      const float peak = values[t].empty() ? -INFINITY : values[t][0];
      lse[t] = logsumexp(row, n, peak);
    }
  });
  return {std::move(ids), std::move(values), std::move(lse)};
}

// x . w over k (x fp32 or bf16, w bf16 bits), in 8 lanes over k in order, then one
// horizontal sum. bf16 x widens exactly, so it gives the bits its fp32 copy gives.
template <typename X>
inline float dot_bf16(const X* x, const uint16_t* w, int64_t k) {
#ifdef SGL_NB_AVX2
  if (k % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) acc = _mm256_fmadd_ps(load8(x + i), load8(w + i), acc);
    return hsum(acc);
  }
#endif
  float acc = 0.f;
  for (int64_t i = 0; i < k; ++i) acc += float(x[i]) * bf16_bits_to_float(w[i]);
  return acc;
}

// A refinement's best entries of each row, [rows, k] (refine_rows).
struct RowTop {
  int64_t k = 0;
  int64_t* ids = nullptr;
  float* values = nullptr;
};

// refine_top_logits on checked pointers: logits [rows, vocab] fp32 in place, h [rows, k]
// (fp32 or bf16), w [vocab, k] bf16 bits. The decode step calls this on pointers it took
// once: through the tensors (their checks, and h widened by a torch op, all cold after the
// step's weight reads) the phase took 0.035 ms a step against 0.018 (int4, alternating in
// one process, medians of 16). Where `top` is given (top.k <= r + 1), each row's top.k best
// entries after the refinement go there, best first: top_logits' ids and values of the
// refined row, since no entry left out of the r + 1 ranks above the (r + 1)-th.
template <typename H>
inline void refine_rows(float* logits, int64_t rows, int64_t vocab, const H* h,
                        const uint16_t* w, int64_t k, int64_t r, int64_t* picks = nullptr,
                        const RowTop& top = {}) {
  for (int64_t t = 0; t < rows; ++t) {
    float* row = logits + t * vocab;
    // On this thread, though the head's threads wrote the row, each its half: ranked by
    // both cores, each its own half, then merged, the phase took as long (alternating in
    // one process).
    std::vector<Ranked> best = top_entries(row, vocab, r + 1);
    const int64_t refined = std::min<int64_t>(r, static_cast<int64_t>(best.size()));
    // Every candidate's weight row asked for at once: the weight stream evicted them, and
    // one row after another paid a memory latency each (the phase 0.039 -> 0.034 ms a step).
    for (int64_t i = 0; i < refined; ++i) prefetch_bytes(w + best[i].id * k, k * 2);
    for (int64_t i = 0; i < refined; ++i) {
      best[i].value = row[best[i].id] = dot_bf16(h + t * k, w + best[i].id * k, k);
    }
    std::sort(best.begin(), best.end(), above);
    if (picks != nullptr && !best.empty()) picks[t] = best.front().id;
    const int64_t kept = std::min<int64_t>(top.k, static_cast<int64_t>(best.size()));
    for (int64_t i = 0; i < kept; ++i) {
      top.ids[t * top.k + i] = best[i].id;
      top.values[t * top.k + i] = best[i].value;
    }
  }
}

// logits [T, V] fp32 (updated in place): the r best of each row replaced by h_row . w_j with
// fp32 accumulation; h [T, K] fp32 or bf16, w [V, K] bf16. Where `picks` is given, each
// row's pick after the refinement goes there, by numpy's argmax rule (the first largest,
// the first NaN): the best under `above` of the r refined entries and the row's (r + 1)-th,
// the best of the entries left as they were.
inline void refine_top_logits(at::Tensor& logits, const at::Tensor& h_in, const at::Tensor& w,
                              int64_t r, int64_t* picks = nullptr) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "refine: logits [T, V] contiguous float32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() &&
              w.size(0) == logits.size(1), "refine: weight [V, K] contiguous bfloat16");
  const at::Tensor h = h_in.to(at::kFloat).contiguous();
  TORCH_CHECK(h.dim() == 2 && h.size(0) == logits.size(0) && h.size(1) == w.size(1),
              "refine: h [T, K]");
  refine_rows(logits.data_ptr<float>(), logits.size(0), logits.size(1), h.data_ptr<float>(),
              reinterpret_cast<const uint16_t*>(w.data_ptr()), h.size(1), r, picks);
}

}  // namespace sgl_nb
