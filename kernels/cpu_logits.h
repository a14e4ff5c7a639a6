// The LM head's refinement on the CPU (runtime/model/linear.py, LogitsHead): each row's best
// candidates recomputed from 16-bit weight rows with fp32 accumulation.
//
// Why here: in torch it took topk over the vocabulary, a gather, a widening, a multiply and
// a sum, ~0.4 ms of a ~9 ms int4 decode step (measured), most of it torch's topk on one
// thread; this is one pass over the logits per row and r short dot products.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "cpu_simd.h"

namespace sgl_nb {

// The r largest entries of v[0, n) (ties: the lower index), in no particular order.
inline std::vector<int64_t> top_indices(const float* v, int64_t n, int64_t r) {
  using Entry = std::pair<float, int64_t>;
  // A min-heap of the best r so far; an entry beats another when larger, or equal and earlier.
  auto worse = [](const Entry& a, const Entry& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  std::vector<Entry> heap;
  heap.reserve(r);
  for (int64_t i = 0; i < n; ++i) {
    if (static_cast<int64_t>(heap.size()) < r) {
      heap.emplace_back(v[i], i);
      std::push_heap(heap.begin(), heap.end(), worse);
    } else if (v[i] > heap.front().first) {
      std::pop_heap(heap.begin(), heap.end(), worse);
      heap.back() = {v[i], i};
      std::push_heap(heap.begin(), heap.end(), worse);
    }
  }
  std::vector<int64_t> out;
  for (const Entry& e : heap) out.push_back(e.second);
  return out;
}

// x . w over k (fp32 x, bf16 w), in 8 lanes over k in order, then one horizontal sum.
inline float dot_bf16(const float* x, const uint16_t* w, int64_t k) {
#ifdef SGL_NB_AVX2
  if (k % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) {
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), load8(w + i), acc);
    }
    return hsum(acc);
  }
#endif
  float acc = 0.f;
  for (int64_t i = 0; i < k; ++i) acc += x[i] * bf16_bits_to_float(w[i]);
  return acc;
}

// logits [T, V] fp32 (updated in place): the r best of each row replaced by h_row . w_j with
// fp32 accumulation; h [T, K] fp32 or bf16, w [V, K] bf16.
inline void refine_top_logits(at::Tensor& logits, const at::Tensor& h_in, const at::Tensor& w,
                              int64_t r) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "refine: logits [T, V] contiguous float32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() &&
              w.size(0) == logits.size(1), "refine: weight [V, K] contiguous bfloat16");
  const at::Tensor h = h_in.to(at::kFloat).contiguous();
  TORCH_CHECK(h.dim() == 2 && h.size(0) == logits.size(0) && h.size(1) == w.size(1),
              "refine: h [T, K]");
  const int64_t rows = logits.size(0), vocab = logits.size(1), k = h.size(1);
  float* lp = logits.data_ptr<float>();
  const float* hp = h.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  for (int64_t t = 0; t < rows; ++t) {
    float* row = lp + t * vocab;
    for (int64_t j : top_indices(row, vocab, std::min(r, vocab))) {
      row[j] = dot_bf16(hp + t * k, wp + j * k, k);
    }
  }
}

}  // namespace sgl_nb
