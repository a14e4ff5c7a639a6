// int4 and int8 weight-only matmuls on the CPU, y = x @ w.T, for one row (decode) or many
// (prefill, batched decode): the same kernel at every size.
//
// int4 weights in groups of 32 inputs: w = (q - 8) * scale + zero, q in 0..15, scale and
// zero in bf16 (the values torch's int4 kernel computes with; the group minimum
// zero - 8 scale is computed in fp32, as rounding it to bf16 costs accuracy in groups with an
// outlier). Our own layout: per row, 16 bytes per group, byte i holding input i in its low
// nibble and input i + 16 in its high one, so that one shift and one mask give the group's
// 32 values in order; scale and zero [N, G] beside it, G rounded up to 8 with zeros (whole
// vectors only: a scalar tail of 2 groups at K = 576 cost a third of the time, measured).
//
// int8 weights: [N, K] values with a bf16 scale per output row.
//
// Both keep the weight rows interleaved in panels of 8 rows by units of 32 bytes (int8: one
// group; int4: two groups, so K must be a multiple of 64), [N / 8][K bytes / 32][8][32]
// (`interleave_rows` in runtime/model/linear.py packs them at load): a block of up to 8 weight
// rows then reads one sequential stream. With each row apart, a block read 4-8 short
// streams of K bytes and the hardware prefetcher never got going: at one row of x, int8
// streamed 10-12 GB/s from memory, interleaved 19-24 (measured).
//
// As llama.cpp does on CPUs without wider integer dot products, each row of x is quantized
// per group of 32 to int8 (xq * dx, dx = max|x| / 127), so that one group of one output is
// a u8 x s8 dot product (maddubs): y = sum_g scale_g dx_g (q . xq)_g + (zero_g - 8 scale_g)
// sum_g(x).
//
// Blocks of up to 4 rows of x times NC weight rows share their loads: each weight group is
// loaded (int4: and unpacked) once per block. Every output is the same sequence of
// operations whatever block it falls in (its own accumulator, groups in order, one
// horizontal sum), so a row's result never depends on the other rows: a request decodes to
// the same bits in any batch, and prefill computes the bits decode would.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_simd.h"
#include "cpu_tiles.h"
#include "cpu_worker_pool.h"

namespace sgl_nb {

constexpr int64_t kGroup = 32;
constexpr int64_t kRowPanel = 8;  // weight rows per interleaved panel
// Rows of x per block: 4 (8 accumulators with 2 weight rows; 5 or 6 spill, measured slower).
constexpr int kMaxRowBlock = 4;

// x rounded per row and group of 32: xq int8 [rows, k]; dx and the sum of the rounded
// values (dx * sum xq) [rows, stride], stride = groups rounded up to 8, zero beyond. The
// rounded sum, not the exact one: int4's q is 0..15, not centred, and its rounding errors
// then cancel against the zero-point term's (as in llama.cpp's Q8_1); with the exact sum the
// error measured 3x larger.
struct QuantizedRows {
  int64_t rows = 0, k = 0, groups = 0, stride = 0;
  std::vector<int8_t> xq;
  std::vector<float> dx, xsum;
  // int4 (pairs): dx spread as int4_block multiplies it, [dx_2p x 4, dx_2p+1 x 4] per two
  // groups, [rows, 4 * stride].
  std::vector<float> dx_pairs;
};

// One group of 32 values: its int8 values, step and rounded sum. Rounds to nearest even,
// as std::nearbyint does in the default rounding mode.
template <typename T>
inline void quantize_group(const T* v, int8_t* q, float* d_out, float* sum_out) {
#ifdef SGL_NB_AVX2
  __m256 a[4];
  for (int i = 0; i < 4; ++i) a[i] = load8(v + 8 * i);
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 m = _mm256_max_ps(
      _mm256_max_ps(_mm256_andnot_ps(sign, a[0]), _mm256_andnot_ps(sign, a[1])),
      _mm256_max_ps(_mm256_andnot_ps(sign, a[2]), _mm256_andnot_ps(sign, a[3])));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float d = _mm_cvtss_f32(h) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  const __m256 iv = _mm256_set1_ps(inv);
  __m256i qi[4];
  for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(a[i], iv));
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]),
                                     _mm256_add_epi32(qi[2], qi[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_hadd_epi32(t, t);
  t = _mm_hadd_epi32(t, t);
  // packs interleave the two 128-bit lanes; the permute puts the 32 bytes back in order.
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                       _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  *d_out = d;
  *sum_out = d * static_cast<float>(_mm_cvtsi128_si32(t));
#else
  float amax = 0.f;
  for (int64_t e = 0; e < kGroup; ++e) amax = std::max(amax, std::fabs(float(v[e])));
  const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  int32_t qsum = 0;
  for (int64_t e = 0; e < kGroup; ++e) {
    q[e] = static_cast<int8_t>(std::nearbyint(float(v[e]) * inv));
    qsum += q[e];
  }
  *d_out = d;
  *sum_out = d * static_cast<float>(qsum);
#endif
}

// Inputs 0-15 of groups 2p and 2p + 1, then their inputs 16-31: the order int4_block
// multiplies them in (its 32 weight bytes hold both groups' inputs i and i + 16), so that it
// loads x straight into its products, with no regrouping per block.
inline void pair_halves(int8_t* row, int64_t k) {
#ifdef SGL_NB_AVX2
  for (int64_t i = 0; i + 2 * kGroup <= k; i += 2 * kGroup) {
    auto* v = reinterpret_cast<__m256i*>(row + i);
    const __m256i a = _mm256_loadu_si256(v), b = _mm256_loadu_si256(v + 1);
    _mm256_storeu_si256(v, _mm256_permute2x128_si256(a, b, 0x20));
    _mm256_storeu_si256(v + 1, _mm256_permute2x128_si256(a, b, 0x31));
  }
#else
  int8_t t[2 * kGroup];
  for (int64_t i = 0; i + 2 * kGroup <= k; i += 2 * kGroup) {
    for (int h = 0; h < 2; ++h)
      for (int g = 0; g < 2; ++g)
        std::copy_n(row + i + g * kGroup + h * 16, 16, t + h * 32 + g * 16);
    std::copy_n(t, 2 * kGroup, row + i);
  }
#endif
}

// x [rows, k] into q (its vectors reused: no allocation once they have grown); pairs: each
// row's xq in int4_block's order (pair_halves), else in input order.
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, bool pairs, QuantizedRows& q) {
  q.rows = rows;
  q.k = k;
  q.groups = k / kGroup;
  q.stride = (q.groups + 7) / 8 * 8;
  q.xq.resize(rows * k);
  q.dx.assign(rows * q.stride, 0.f);
  q.xsum.assign(rows * q.stride, 0.f);
  if (pairs) q.dx_pairs.assign(rows * 4 * q.stride, 0.f);
  auto part = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t g = 0; g < q.groups; ++g) {
        quantize_group(x + r * k + g * kGroup, q.xq.data() + r * k + g * kGroup,
                       q.dx.data() + r * q.stride + g, q.xsum.data() + r * q.stride + g);
      }
      if (pairs) {
        pair_halves(q.xq.data() + r * k, k);
        float* spread = q.dx_pairs.data() + r * 4 * q.stride;
        for (int64_t g = 0; g < q.groups; ++g) {
          std::fill_n(spread + (g / 2) * 8 + (g % 2) * 4, 4, q.dx[r * q.stride + g]);
        }
      }
    }
  };
  if (rows >= 8) {
    WorkerPool::get().parallel_for(rows, part);
  } else {
    part(0, rows);
  }
}

#ifdef SGL_NB_AVX2
// NR rows of xq (row stride k, in pair_halves order) against NC int4 weight rows, two groups
// at a time: row c's groups 2p and 2p + 1 are the 32 bytes at w + c * cs + p * ps.
// out[r * NC + c] = sum_g scale_cg dx_rg (q_c . xq_r)_g + xsum_rg (zero_cg - 8 scale_cg);
// scale, zero (weight rows) and xsum (rows of x) have row stride fs, dx2 (QuantizedRows::
// dx_pairs) 4 fs.
//
// The 32 bytes give, masked, inputs 0-15 of both groups and, shifted, inputs 16-31: the two
// products with x add as 16-bit values (at most 2 x 3810), so one widening sum gives group
// 2p in lanes 0-3 and group 2p + 1 in lanes 4-7, scaled by [f_2p x 4, f_2p+1 x 4],
// f = scale * dx: 11 operations per two groups where one group at a time took 8 (measured
// 1.2-1.3x). Weight row by weight row: its unpacked unit and scales stay in registers while
// the rows of x come from memory, so 8 accumulators, 3 of those and the constants fit in
// the 16 registers. (Computing the factors per block beforehand took a third of the time
// at 400 rows, measured.) The term that does not depend on q goes into the same accumulator
// eight groups at a time before the one horizontal sum.
template <int NR, int NC>
inline void int4_block(const uint8_t* w, int64_t cs, int64_t ps, const int8_t* xq, int64_t k,
                       const float* dx2, int64_t fs, const uint16_t* scale,
                       const uint16_t* zero, const float* xsum, float* out) {
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  // A pair of bf16 scales [s0 | s1 << 16] in every lane -> [s0 x 4, s1 x 4] as fp32.
  const __m256i shift = _mm256_setr_epi32(16, 16, 16, 16, 0, 0, 0, 0);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  if (k < 2 * kGroup) __builtin_unreachable();  // else GCC keeps acc in memory
  for (int64_t p = 0; p < k / (2 * kGroup); ++p) {
    for (int c = 0; c < NC; ++c) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * cs + p * ps));
      const __m256i lo = _mm256_and_si256(b, mask);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
      int32_t pair;
      std::memcpy(&pair, scale + c * fs + 2 * p, sizeof pair);
      const __m256 s2 = _mm256_castsi256_ps(
          _mm256_and_si256(_mm256_sllv_epi32(_mm256_set1_epi32(pair), shift), high));
      for (int r = 0; r < NR; ++r) {
        const auto* xp = reinterpret_cast<const __m256i*>(xq + r * k + p * 2 * kGroup);
        const __m256i sum16 =
            _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256(xp)),
                             _mm256_maddubs_epi16(hi, _mm256_loadu_si256(xp + 1)));
        const __m256i dot = _mm256_madd_epi16(sum16, ones);
        const __m256 f2 = _mm256_mul_ps(s2, _mm256_loadu_ps(dx2 + r * 4 * fs + 8 * p));
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), f2, acc[r][c]);
      }
    }
  }
  for (int64_t g = 0; g < fs; g += 8) {
    for (int c = 0; c < NC; ++c) {
      const __m256 low = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), load8(scale + c * fs + g),
                                          load8(zero + c * fs + g));
      for (int r = 0; r < NR; ++r) {
        acc[r][c] = _mm256_fmadd_ps(low, _mm256_loadu_ps(xsum + r * fs + g), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) out[r * NC + c] = hsum(acc[r][c]);
}

// NR rows of xq against NC int8 weight rows (row c's group g at w + c * cs + g * gs):
// out[r * NC + c] = sum_g dx[r][g] (w_c . xq_r)_g. maddubs takes one unsigned operand: |w|
// times x carrying w's sign (w is never -128).
template <int NR, int NC>
inline void int8_block(const int8_t* w, int64_t cs, int64_t gs, const int8_t* xq, int64_t k,
                       const float* dx, int64_t ds, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  // Weight row by weight row, the rows of x from memory: 8 accumulators and one row's
  // weights in registers (all NC rows' weights spilled accumulators at 4 x 2).
  if (k < kGroup) __builtin_unreachable();  // else GCC keeps acc in memory (cpu_dense_matmul.h)
  for (int64_t g = 0; g < k / kGroup; ++g) {
    for (int c = 0; c < NC; ++c) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * cs + g * gs));
      const __m256i wabs = _mm256_sign_epi8(wv, wv);
      for (int r = 0; r < NR; ++r) {
        const __m256i x =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * k + g * kGroup));
        const __m256i dot =
            _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(x, wv)), ones);
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(dx + r * ds + g),
                                    acc[r][c]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) out[r * NC + c] = hsum(acc[r][c]);
}
#else
template <int NR, int NC>
inline void int4_block(const uint8_t* w, int64_t cs, int64_t ps, const int8_t* xq, int64_t k,
                       const float* dx2, int64_t fs, const uint16_t* scale,
                       const uint16_t* zero, const float* xsum, float* out) {
  for (int r = 0; r < NR; ++r) {
    for (int c = 0; c < NC; ++c) {
      float y = 0.f;
      for (int64_t g = 0; g < k / kGroup; ++g) {
        const uint8_t* b = w + c * cs + (g / 2) * ps + (g % 2) * 16;
        // pair_halves order: inputs 0-15 of the pair's two groups, then inputs 16-31.
        const int8_t* x = xq + r * k + (g / 2) * 2 * kGroup + (g % 2) * 16;
        int32_t dot = 0;
        for (int i = 0; i < 16; ++i) dot += (b[i] & 15) * x[i] + (b[i] >> 4) * x[32 + i];
        const float f = bf16_bits_to_float(scale[c * fs + g]) *
                        dx2[r * 4 * fs + (g / 2) * 8 + (g % 2) * 4];
        y += static_cast<float>(dot) * f;
      }
      for (int64_t g = 0; g < fs; ++g) {
        const float low = bf16_bits_to_float(zero[c * fs + g]) -
                          8.f * bf16_bits_to_float(scale[c * fs + g]);
        y += xsum[r * fs + g] * low;
      }
      out[r * NC + c] = y;
    }
  }
}

template <int NR, int NC>
inline void int8_block(const int8_t* w, int64_t cs, int64_t gs, const int8_t* xq, int64_t k,
                       const float* dx, int64_t ds, float* out) {
  for (int r = 0; r < NR; ++r) {
    for (int c = 0; c < NC; ++c) {
      float y = 0.f;
      for (int64_t g = 0; g < k / kGroup; ++g) {
        int32_t dot = 0;
        for (int i = 0; i < kGroup; ++i) dot += w[c * cs + g * gs + i] * xq[r * k + g * kGroup + i];
        y += static_cast<float>(dot) * dx[r * ds + g];
      }
      out[r * NC + c] = y;
    }
  }
}
#endif

// Where weight row j starts in the interleaved layout: rows of row_bytes, in units of
// unit_bytes (int8: a group, 32 bytes; int4: two groups, 32 bytes).
inline int64_t panel_row_offset(int64_t j, int64_t row_bytes, int64_t unit_bytes) {
  return (j / kRowPanel) * kRowPanel * row_bytes + (j % kRowPanel) * unit_bytes;
}

// Asks for `bytes` from p to be brought into the caches (whole lines, in order).
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o);
}

// int4 weights in our layout against quantized rows (pairs); scale and zero [N, x.stride].
struct Int4Weights {
  const uint8_t* nib;
  const uint16_t *scale, *zero;
  const QuantizedRows& x;

  // The panel holding weight row j0, all of it (see quant_matmul).
  void prefetch_panel(int64_t j0) const {
    prefetch_bytes(nib + panel_row_offset(j0, x.k / 2, kGroup), kRowPanel * x.k / 2);
  }

  template <int NR, int NC>
  void block(int64_t j0, int64_t r0, float* out) const {
    const int64_t s = x.stride;
    constexpr int64_t unit = kGroup;  // two groups of 16 bytes
    int4_block<NR, NC>(nib + panel_row_offset(j0, x.k / 2, unit), unit, kRowPanel * unit,
                       x.xq.data() + r0 * x.k, x.k, x.dx_pairs.data() + r0 * 4 * s, s,
                       scale + j0 * s, zero + j0 * s, x.xsum.data() + r0 * s, out);
  }
  float finish(int64_t, int64_t, float part) const { return part; }
};

// int8 weights (interleaved), a bf16 scale per output row, against quantized rows.
struct Int8Weights {
  const int8_t* w;
  const uint16_t* scale;
  const QuantizedRows& x;

  void prefetch_panel(int64_t j0) const {
    prefetch_bytes(w + panel_row_offset(j0, x.k, kGroup), kRowPanel * x.k);
  }

  template <int NR, int NC>
  void block(int64_t j0, int64_t r0, float* out) const {
    int8_block<NR, NC>(w + panel_row_offset(j0, x.k, kGroup), kGroup, kRowPanel * kGroup,
                       x.xq.data() + r0 * x.k, x.k, x.dx.data() + r0 * x.stride, x.stride, out);
  }
  float finish(int64_t j, int64_t, float part) const {
    return part * bf16_bits_to_float(scale[j]);
  }
};

// w.block<nr, NC> for a run-time nr <= NR (a template instance per count).
template <int NR, int NC, typename Weights>
inline void rows_block(const Weights& w, int64_t nr, int64_t j0, int64_t r0, float* out) {
  if constexpr (NR > 1) {
    if (nr < NR) return rows_block<NR - 1, NC>(w, nr, j0, r0, out);
  }
  w.template block<NR, NC>(j0, r0, out);
}

// y [rows, n] = T(finish(j, r, part)) for every output.
template <int NC, typename T, typename Weights>
void quant_matmul(const Weights& w, int64_t rows, int64_t n, T* y) {
  const int64_t chunk = row_chunk(w.x.k);
  for_each_block<kMaxRowBlock, NC>(rows, n, chunk, [&](int64_t j0, auto width, int64_t r0,
                                                       int64_t nr) {
    constexpr int W = decltype(width)::value;
    // Blocks narrower than a panel read a quarter of each of its 256-byte units (two weight
    // rows of eight): the whole panel asked for at once streams from memory, where the
    // blocks' strided reads did not (int8 at 16 rows: 1.1-1.7x, measured).
    if (W < kRowPanel && j0 % kRowPanel == 0 && r0 % chunk == 0) w.prefetch_panel(j0);
    float part[kMaxRowBlock * W];
    rows_block<kMaxRowBlock, W>(w, nr, j0, r0, part);
    for (int64_t r = 0; r < nr; ++r)
      for (int64_t c = 0; c < W; ++c)
        y[(r0 + r) * n + j0 + c] = T(w.finish(j0 + c, r0 + r, part[r * W + c]));
  });
}

// A whole panel of eight weight rows per block when x has one row (decode at batch 1: the
// activations are loaded once per eight outputs, the weights read as one stream; 1.1-1.3x
// four rows, measured); two otherwise (four rows of x times two: 8 accumulators).
template <typename T, typename Weights>
void quant_matmul_any(const Weights& w, int64_t rows, int64_t n, T* y) {
  if (rows == 1) {
    quant_matmul<8>(w, rows, n, y);
  } else {
    quant_matmul<2>(w, rows, n, y);
  }
}

// Whether w is in the interleaved layout [N / 8, K / inputs, 8 * 32] for x [rows, K]: units
// of 32 bytes holding `inputs` inputs (int8 32, int4 64).
inline bool interleaved(const at::Tensor& w, const at::Tensor& x, int64_t inputs) {
  return x.dim() == 2 && x.size(1) % inputs == 0 && w.dim() == 3 && w.is_contiguous() &&
         w.size(1) == x.size(1) / inputs && w.size(2) == kRowPanel * kGroup;
}

// y = x @ w.T (+ bias), int8 weights interleaved [N / 8, K / 32, 8 * 32] with a bf16 scale
// per row; x bf16 or fp32; into `out` where it fits (output_rows).
inline at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& w,
                              const at::Tensor& scale, const at::Tensor& bias,
                              const at::Tensor& out = {}) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(interleaved(w, x, kGroup), "int8: x [rows, k], k a multiple of 32, and weights "
              "interleaved [n / 8, k / 32, 256]");
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16, "int8 kernel: bf16 scales");
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0) * kRowPanel;
  at::Tensor y = output_rows(out, rows, n, x.options());
  const auto* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr());
  thread_local QuantizedRows q;
  if (x.scalar_type() == at::kBFloat16) {
    quantize_rows(x.data_ptr<c10::BFloat16>(), rows, k, false, q);
    quant_matmul_any(Int8Weights{w.data_ptr<int8_t>(), sp, q}, rows, n,
                     y.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "int8: bf16 or fp32 activations");
    quantize_rows(x.data_ptr<float>(), rows, k, false, q);
    quant_matmul_any(Int8Weights{w.data_ptr<int8_t>(), sp, q}, rows, n, y.data_ptr<float>());
  }
  if (bias.numel()) y.add_(bias);
  return y;
}

// y = x @ w.T (+ bias), int4 weights in our layout (nibbles interleaved [N / 8, K / 32,
// 8 * 16], scale and zero bf16 [N, K/32 rounded up to 8], zeros beyond K/32); x bf16 or fp32;
// into `out` where it fits (output_rows).
inline at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& nib,
                              const at::Tensor& scale, const at::Tensor& zero,
                              const at::Tensor& bias, const at::Tensor& out = {}) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(interleaved(nib, x, 2 * kGroup), "int4: x [rows, k], k a multiple of 64, and "
              "nibbles interleaved [n / 8, k / 64, 256]");
  const int64_t rows = x.size(0), k = x.size(1), n = nib.size(0) * kRowPanel;
  TORCH_CHECK(scale.size(0) == n && scale.size(1) == (k / kGroup + 7) / 8 * 8 &&
              zero.sizes() == scale.sizes(), "int4: scale and zero [N, groups rounded up to 8]");
  at::Tensor y = output_rows(out, rows, n, x.options());
  const auto* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr());
  const auto* zp = reinterpret_cast<const uint16_t*>(zero.data_ptr());
  thread_local QuantizedRows q;
  if (x.scalar_type() == at::kBFloat16) {
    quantize_rows(x.data_ptr<c10::BFloat16>(), rows, k, true, q);
    quant_matmul_any(Int4Weights{nib.data_ptr<uint8_t>(), sp, zp, q}, rows, n,
                     y.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "int4: bf16 or fp32 activations");
    quantize_rows(x.data_ptr<float>(), rows, k, true, q);
    quant_matmul_any(Int4Weights{nib.data_ptr<uint8_t>(), sp, zp, q}, rows, n,
                     y.data_ptr<float>());
  }
  if (bias.numel()) y.add_(bias);
  return y;
}

}  // namespace sgl_nb
