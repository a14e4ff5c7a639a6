// Dense matmul on the CPU, y = x @ w.T, with bf16 or fp32 weights, accumulating in fp32.
//
// Why ours: ATen's bf16 matmul on CPUs without bf16 instructions (AVX2) runs at ~8 GMAC/s
// on two cores at any size (measured), a third of its fp32 GEMM. Here a bf16 weight is
// widened to fp32 in registers (exact: its bits are an fp32's top half) and multiplied with
// fp32 FMAs: bf16 then reads half the bytes of fp32 at decode and computes like fp32 in
// prefill.
//
// Blocks of up to 6 rows of x times 2 weight rows; each output has its own 8-lane
// accumulator over k in order and one horizontal sum, whatever block it falls in, so a
// row's result never depends on the other rows (batch-invariant, like the int8/int4 ones).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_simd.h"
#include "cpu_tiles.h"

namespace sgl_nb {


#ifdef SGL_NB_AVX2
// NR rows of x (fp32, row stride k) against NC weight rows: out[r * NC + c] = x_r . w_c.
template <int NR, int NC, typename W>
inline void dense_block(const W* w, const float* x, int64_t k, float* out) {
  __m256 acc[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) {
    __m256 wv[NC];
    for (int c = 0; c < NC; ++c) wv[c] = load8(w + c * k + i);
    for (int r = 0; r < NR; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * k + i);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) out[r * NC + c] = hsum(acc[r][c]);
}
#else
template <int NR, int NC, typename W>
inline void dense_block(const W* w, const float* x, int64_t k, float* out) {
  for (int r = 0; r < NR; ++r) {
    for (int c = 0; c < NC; ++c) {
      float acc[8] = {};
      for (int64_t i = 0; i < k; i += 8)
        for (int e = 0; e < 8; ++e) acc[e] += x[r * k + i + e] * widen(w[c * k + i + e]);
      float y = 0.f;
      for (int e = 0; e < 8; ++e) y += acc[e];
      out[r * NC + c] = y;
    }
  }
}
#endif

// dense_block<nr, NC> for a run-time nr <= NR (a template instance per count).
template <int NR, int NC, typename W>
inline void dense_rows_block(const W* w, const float* x, int64_t k, int64_t nr, float* out) {
  if constexpr (NR > 1) {
    if (nr < NR) return dense_rows_block<NR - 1, NC>(w, x, k, nr, out);
  }
  dense_block<NR, NC>(w, x, k, out);
}

// y [rows, n] = T(x @ w.T), x fp32 [rows, k]; weight rows in blocks of NC, rows of x in
// blocks of up to NR.
template <int NR, int NC, typename W, typename T>
void dense_matmul(const W* w, const float* x, int64_t rows, int64_t n, int64_t k, T* y) {
  const int64_t chunk = std::max<int64_t>(NR, row_chunk(k * sizeof(float)) / NR * NR);
  for_each_block<NR, NC>(rows, n, chunk, [&](int64_t j0, auto width, int64_t r0, int64_t nr) {
    constexpr int WC = decltype(width)::value;
    float part[NR * WC];
    dense_rows_block<NR, WC>(w + j0 * k, x + r0 * k, k, nr, part);
    for (int64_t r = 0; r < nr; ++r)
      for (int64_t c = 0; c < WC; ++c) y[(r0 + r) * n + j0 + c] = T(part[r * WC + c]);
  });
}

// One row (decode at batch 1): four weight rows per block, x loaded once for the four.
// More rows: six rows of x times two weight rows (12 accumulators; 1.2-1.4x four times
// two at 16 and 256 rows, measured).
template <typename W, typename T>
void dense_matmul_any(const W* w, const float* x, int64_t rows, int64_t n, int64_t k, T* y) {
  if (rows == 1) {
    dense_matmul<1, 4>(w, x, rows, n, k, y);
  } else {
    dense_matmul<6, 2>(w, x, rows, n, k, y);
  }
}

// Whether dense_linear takes this weight: fp32 or bf16, input size a multiple of 8.
inline bool dense_kernel_takes(const at::Tensor& w) {
  return w.dim() == 2 && w.size(1) % 8 == 0 && w.is_contiguous() &&
         (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16);
}

// y = x @ w.T (+ bias) in x's dtype; w fp32 or bf16 [N, K], x fp32 or bf16 [rows, K].
inline at::Tensor dense_linear(const at::Tensor& x_in, const at::Tensor& w,
                               const at::Tensor& bias) {
  TORCH_CHECK(dense_kernel_takes(w) && x_in.dim() == 2 && x_in.size(1) == w.size(1),
              "dense: x [rows, k], w [n, k] fp32 or bf16, k a multiple of 8");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "dense: fp32 or bf16 activations");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0);
  at::Tensor y = at::empty({rows, n}, x_in.options());
  const float* xp = x.data_ptr<float>();
  auto run = [&](auto* yp) {
    if (w.scalar_type() == at::kFloat) {
      dense_matmul_any(w.data_ptr<float>(), xp, rows, n, k, yp);
    } else {
      dense_matmul_any(reinterpret_cast<const uint16_t*>(w.data_ptr()), xp, rows, n, k, yp);
    }
  };
  if (x_in.scalar_type() == at::kFloat) {
    run(y.data_ptr<float>());
  } else {
    run(y.data_ptr<c10::BFloat16>());
  }
  if (bias.numel()) y.add_(bias);
  return y;
}

}  // namespace sgl_nb
