// Dense matmul on the CPU, y = x @ w.T, with bf16 or fp32 weights, accumulating in fp32.
//
// Why ours: ATen's bf16 matmul on CPUs without bf16 instructions (AVX2) runs at ~8 GMAC/s
// on two cores at any size (measured), and its fp32 GEMM at 25-52 GMAC/s from 16 to 400
// rows; this kernel at 45-80 (fp32 and bf16, weights streamed from memory, measured). A bf16
// weight is widened to fp32 in registers (exact: its bits are an fp32's top half).
//
// The weight is kept in panels of 16 output columns, [N / 16][K][16] (`dense_panels` in
// runtime/model/linear.py packs it once at load): a panel is one contiguous stream, and a block
// of 6 rows of x times one panel keeps 12 accumulators of 8 outputs in registers, each row
// of x read one value at a time (broadcast). One row (decode at batch 1) takes four panels
// per block instead, four streams at once.
//
// Every output is one fp32 sum over k in order, fused multiply-add by multiply-add from 0,
// whatever block it falls in: a row's result never depends on the other rows or on how
// many there are (batch-invariant, like the int8/int4 kernels), and prefill and decode give
// the same bits.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_simd.h"
#include "cpu_tiles.h"

namespace sgl_nb {

constexpr int64_t kPanel = 16;  // output columns per weight panel

#ifdef SGL_NB_AVX2
// The blocks are not inlined: inlined into the tiling loop GCC 12 kept their accumulators in
// memory (checked in the assembly); alone, all in registers. A call costs nothing next to
// a block's >= 16 * k multiply-adds.
#define SGL_NB_BLOCK __attribute__((noinline))

// NR rows of x (fp32, row stride k) against one panel: out[r * 16 + c].
template <int NR, typename W>
SGL_NB_BLOCK void rows_panel_block(const W* p, const float* x, int64_t k, float* out) {
  __m256 acc[NR][2];
  for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  // k >= 1 (the caller checks); without this GCC keeps a copy of acc in memory for the
  // zero-trip case and stores it on every iteration (2x slower, measured).
  if (k <= 0) __builtin_unreachable();
  for (int64_t i = 0; i < k; ++i) {
    const __m256 w0 = load8(p + i * kPanel), w1 = load8(p + i * kPanel + 8);
    for (int r = 0; r < NR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * k + i);
      acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    _mm256_storeu_ps(out + r * kPanel, acc[r][0]);
    _mm256_storeu_ps(out + r * kPanel + 8, acc[r][1]);
  }
}

// One row of x against NP consecutive panels: out[q * 16 + c].
template <int NP, typename W>
SGL_NB_BLOCK void row_panels_block(const W* p, const float* x, int64_t k, float* out) {
  __m256 acc[NP][2];
  for (int q = 0; q < NP; ++q) acc[q][0] = acc[q][1] = _mm256_setzero_ps();
  if (k <= 0) __builtin_unreachable();  // as above
  for (int64_t i = 0; i < k; ++i) {
    const __m256 xv = _mm256_broadcast_ss(x + i);
    for (int q = 0; q < NP; ++q) {
      const W* w = p + q * k * kPanel + i * kPanel;
      acc[q][0] = _mm256_fmadd_ps(xv, load8(w), acc[q][0]);
      acc[q][1] = _mm256_fmadd_ps(xv, load8(w + 8), acc[q][1]);
    }
  }
  for (int q = 0; q < NP; ++q) {
    _mm256_storeu_ps(out + q * kPanel, acc[q][0]);
    _mm256_storeu_ps(out + q * kPanel + 8, acc[q][1]);
  }
}
#else
// The same sums in the same order, one lane at a time.
template <int NR, typename W>
inline void rows_panel_block(const W* p, const float* x, int64_t k, float* out) {
  for (int r = 0; r < NR; ++r) {
    for (int c = 0; c < kPanel; ++c) {
      float acc = 0.f;
      for (int64_t i = 0; i < k; ++i) acc = std::fma(x[r * k + i], widen(p[i * kPanel + c]), acc);
      out[r * kPanel + c] = acc;
    }
  }
}

template <int NP, typename W>
inline void row_panels_block(const W* p, const float* x, int64_t k, float* out) {
  for (int q = 0; q < NP; ++q) rows_panel_block<1>(p + q * k * kPanel, x, k, out + q * kPanel);
}
#endif

// The block for nr rows (a template instance per count up to NR) and WC panels.
template <int NR, int WC, typename W>
inline void panel_block(const W* p, const float* x, int64_t k, int64_t nr, float* out) {
  if constexpr (WC > 1) {
    static_assert(NR == 1, "several panels per block only for one row");
    row_panels_block<WC>(p, x, k, out);
  } else if constexpr (NR > 1) {
    if (nr < NR) return panel_block<NR - 1, 1>(p, x, k, nr, out);
    rows_panel_block<NR>(p, x, k, out);
  } else {
    rows_panel_block<1>(p, x, k, out);
  }
}

// y [rows, n] = T(x @ w.T), x fp32 [rows, k], w in panels; panels in blocks of NC, rows of
// x in blocks of up to NR.
template <int NR, int NC, typename W, typename T>
void panel_matmul(const W* w, const float* x, int64_t rows, int64_t n, int64_t k, T* y) {
  for_each_block<NR, NC>(rows, n / kPanel, rows, [&](int64_t j0, auto width, int64_t r0,
                                                   int64_t nr) {
    constexpr int WC = decltype(width)::value;
    float part[NR * WC * kPanel];
    panel_block<NR, WC>(w + j0 * k * kPanel, x + r0 * k, k, nr, part);
    for (int64_t r = 0; r < nr; ++r) {
      T* out = y + (r0 + r) * n + j0 * kPanel;
      for (int64_t c = 0; c < WC * kPanel; ++c) out[c] = T(part[r * WC * kPanel + c]);
    }
  });
}

// One row: four panels per block (64 outputs, 8 accumulators). More rows: six rows times
// one panel (12 accumulators; 1.5-2x ATen's fp32 GEMM from 16 to 400 rows, measured).
template <typename W, typename T>
void dense_matmul_any(const W* w, const float* x, int64_t rows, int64_t n, int64_t k, T* y) {
  if (rows == 1) {
    panel_matmul<1, 4>(w, x, rows, n, k, y);
  } else {
    panel_matmul<6, 1>(w, x, rows, n, k, y);
  }
}

// Whether dense_linear takes these weights: fp32 or bf16 panels [N / 16, K, 16].
inline bool dense_kernel_takes(const at::Tensor& panels) {
  return panels.dim() == 3 && panels.size(2) == kPanel && panels.size(1) > 0 &&
         panels.is_contiguous() &&
         (panels.scalar_type() == at::kFloat || panels.scalar_type() == at::kBFloat16);
}

// x's values as fp32: x itself if fp32, else widened into this thread's scratch (valid until
// its next call; a loop here, not an ATen op: ~120 calls per decode step, each op a
// dispatch and an allocation).
inline const float* widened_rows(const at::Tensor& x) {
  if (x.scalar_type() == at::kFloat) return x.data_ptr<float>();
  thread_local std::vector<float> scratch;
  const int64_t count = x.numel();
  scratch.resize(count);
  const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr());
  for (int64_t i = 0; i < count; ++i) scratch[i] = bf16_bits_to_float(src[i]);
  return scratch.data();
}

// y = x @ w.T (+ bias) in x's dtype; w as panels, fp32 or bf16, x fp32 or bf16 [rows, K];
// into `out` where it fits (output_rows).
inline at::Tensor dense_linear(const at::Tensor& x_in, const at::Tensor& panels,
                               const at::Tensor& bias, const at::Tensor& out = {}) {
  TORCH_CHECK(dense_kernel_takes(panels) && x_in.dim() == 2 && x_in.size(1) == panels.size(1),
              "dense: x [rows, k], weight panels [n / 16, k, 16] fp32 or bf16");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "dense: fp32 or bf16 activations");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), n = panels.size(0) * kPanel;
  at::Tensor y = output_rows(out, rows, n, x_in.options());
  const float* xp = widened_rows(x);
  auto run = [&](auto* yp) {
    if (panels.scalar_type() == at::kFloat) {
      dense_matmul_any(panels.data_ptr<float>(), xp, rows, n, k, yp);
    } else {
      dense_matmul_any(reinterpret_cast<const uint16_t*>(panels.data_ptr()), xp, rows, n, k,
                       yp);
    }
  };
  if (rows == 0) return y;
  if (x_in.scalar_type() == at::kFloat) {
    run(y.data_ptr<float>());
  } else {
    run(y.data_ptr<c10::BFloat16>());
  }
  if (bias.numel()) y.add_(bias);
  return y;
}

}  // namespace sgl_nb
