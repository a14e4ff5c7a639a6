// int4 and int8 weight-only matmuls on the CPU, y = x @ w.T, for one row (decode) or many
// (prefill, batched decode): the same kernel at every size.
//
// int4 weights in groups of 32 inputs: w = q * scale + min, q in 0..15, scale and min in
// fp16: GGUF's Q4_1 block {d, m} as the file holds it (Q4_0's w = d (q - 8) is min = -8 d,
// exact in fp16), so a GGUF's Q4_0 / Q4_1 weights are computed with as they are; our own
// quantization of other weights keeps the same two values per group. Our own layout: per
// row, 16 bytes per group, byte i holding input i in its low nibble and input i + 16 in its
// high one (ggml's block order), so that one shift and one mask give the group's 32 values
// in order; scale and min [N, G] beside it, G rounded up to 8 with zeros (whole vectors
// only: a scalar tail of 2 groups at K = 576 cost a third of the time, measured).
//
// int8 weights: [N, K] values with an fp32 scale per output row (our own quantization) or
// an fp16 scale per group of 32 inputs [N, K / 32] (GGUF's Q8_0 blocks).
//
// Both keep the weight rows interleaved in panels of 8 rows by units of 32 bytes (int8: one
// group; int4: two groups, so K must be a multiple of 64), [N / 8][K bytes / 32][8][32]
// (`interleave_rows` in runtime/model/linear.py packs them at load): a block of up to 8 weight
// rows then reads one sequential stream. With each row apart, a block read 4-8 short
// streams of K bytes and the hardware prefetcher never got going: at one row of x, int8
// streamed 10-12 GB/s from memory, interleaved 19-24 (measured).
//
// Two paths, by the activations' dtype. bf16: as llama.cpp does on CPUs without wider
// integer dot products, each row of x is quantized per group of 32 to int8 (xq * dx,
// dx = max|x| / 127), so that one group of one output is a u8 x s8 dot product (maddubs):
// y = sum_g scale_g dx_g (q . xq)_g + min_g sum_g(x). fp32: the exact path (FloatRows,
// below), x as it is, the weights turned to fp32 in registers: y differs from x @ w.T with
// the dequantized weight by fp32 rounding only.
//
// Blocks of up to 4 rows of x times NC weight rows share their loads: each weight group is
// loaded (int4: and unpacked) once per block. Every output is the same sequence of
// operations whatever block it falls in (its own accumulator, groups in order, one
// horizontal sum), so a row's result never depends on the other rows: a request decodes to
// the same bits in any batch, and prefill computes the bits decode would.
//
// Where the build has AVX-512 VNNI (-march=native on such a CPU), the bf16 path's blocks
// take dpbusd (u8 x s8 summed by 4 bytes into int32, one instruction for maddubs + add +
// madd), two weight rows per 512-bit register. The integers are the AVX2 kernels' and the
// float part is theirs lane for lane, so the bits are the same (quant_isa switches between
// them for the tests). On a 2-core Sapphire Rapids VM, in cache on one core: 1.45x (int4)
// and 1.75x (Q8_0) the AVX2 kernels at one row of x, 1.25-1.45x at 4 to 64; streaming from
// memory on two threads at one row, 1.1x (int4 layers) and 1.25-1.3x (the Q8_0 LM head):
// compute and memory time add up per core (measured).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_simd.h"
#include "cpu_tiles.h"
#include "cpu_worker_pool.h"

namespace sgl_nb {

constexpr int64_t kGroup = 32;
constexpr int64_t kRowPanel = 8;  // weight rows per interleaved panel
// Rows of x per block: 4 (8 accumulators with 2 weight rows; 5 or 6 spill, measured slower).
constexpr int kMaxRowBlock = 4;

// An fp16 value (its bits) as fp32, exactly.
inline float half_bits_to_float(uint16_t v) {
#ifdef __F16C__
  return _cvtsh_ss(v);
#else
  return c10::detail::fp16_ieee_to_fp32_value(v);
#endif
}

#ifdef SGL_NB_AVX2
// Eight fp16 values as fp32.
inline __m256 load8_half(const uint16_t* p) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float f[8];
  for (int i = 0; i < 8; ++i) f[i] = half_bits_to_float(p[i]);
  return _mm256_loadu_ps(f);
#endif
}

// The two fp16 values at p as [p0 x 4, p1 x 4] in fp32: the factors of int4_block's pair of
// groups.
inline __m256 spread_half_pair(const uint16_t* p) {
#ifdef __F16C__
  int32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  const __m128i spread = _mm_shuffle_epi8(
      _mm_cvtsi32_si128(pair), _mm_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3));
  return _mm256_cvtph_ps(spread);
#else
  const float a = half_bits_to_float(p[0]), b = half_bits_to_float(p[1]);
  return _mm256_setr_ps(a, a, a, a, b, b, b, b);
#endif
}
#endif

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
// out[r * NC + c] = sum_g scale_cg dx_rg (q_c . xq_r)_g + xsum_rg min_cg; scale, min (fp16,
// weight rows) and xsum (rows of x) have row stride fs, dx2 (QuantizedRows::dx_pairs) 4 fs.
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
                       const uint16_t* min, const float* xsum, float* out) {
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  if (k < 2 * kGroup) __builtin_unreachable();  // else GCC keeps acc in memory
  for (int64_t p = 0; p < k / (2 * kGroup); ++p) {
    if constexpr (NC == kRowPanel) stream_ahead(w + p * ps, 4);
    for (int c = 0; c < NC; ++c) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * cs + p * ps));
      const __m256i lo = _mm256_and_si256(b, mask);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
      const __m256 s2 = spread_half_pair(scale + c * fs + 2 * p);
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
      const __m256 low = load8_half(min + c * fs + g);
      for (int r = 0; r < NR; ++r) {
        acc[r][c] = _mm256_fmadd_ps(low, _mm256_loadu_ps(xsum + r * fs + g), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) out[r * NC + c] = hsum(acc[r][c]);
}

// NR rows of xq against NC int8 weight rows (row c's group g at w + c * cs + g * gs):
// out[r * NC + c] = sum_g dx[r][g] (w_c . xq_r)_g, and with Blocks each group also times
// its weight scale (fp16, row c's at ws + c * wss). maddubs takes one unsigned operand: |w|
// times x carrying w's sign (w is never -128).
template <int NR, int NC, bool Blocks>
inline void int8_block(const int8_t* w, int64_t cs, int64_t gs, const int8_t* xq, int64_t k,
                       const float* dx, int64_t ds, const uint16_t* ws, int64_t wss,
                       float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  // Weight row by weight row, the rows of x from memory: 8 accumulators and one row's
  // weights in registers (all NC rows' weights spilled accumulators at 4 x 2).
  if (k < kGroup) __builtin_unreachable();  // else GCC keeps acc in memory (cpu_dense_matmul.h)
  for (int64_t g = 0; g < k / kGroup; ++g) {
    if constexpr (NC == kRowPanel) stream_ahead(w + g * gs, 4);
    for (int c = 0; c < NC; ++c) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * cs + g * gs));
      const __m256i wabs = _mm256_sign_epi8(wv, wv);
      __m256 d = _mm256_set1_ps(1.f);
      if constexpr (Blocks) d = _mm256_set1_ps(half_bits_to_float(ws[c * wss + g]));
      for (int r = 0; r < NR; ++r) {
        const __m256i x =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * k + g * kGroup));
        const __m256i dot =
            _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(x, wv)), ones);
        __m256 f = _mm256_broadcast_ss(dx + r * ds + g);
        if constexpr (Blocks) f = _mm256_mul_ps(f, d);
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), f, acc[r][c]);
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
                       const uint16_t* min, const float* xsum, float* out) {
  for (int r = 0; r < NR; ++r) {
    for (int c = 0; c < NC; ++c) {
      float y = 0.f;
      for (int64_t g = 0; g < k / kGroup; ++g) {
        const uint8_t* b = w + c * cs + (g / 2) * ps + (g % 2) * 16;
        // pair_halves order: inputs 0-15 of the pair's two groups, then inputs 16-31.
        const int8_t* x = xq + r * k + (g / 2) * 2 * kGroup + (g % 2) * 16;
        int32_t dot = 0;
        for (int i = 0; i < 16; ++i) dot += (b[i] & 15) * x[i] + (b[i] >> 4) * x[32 + i];
        const float f = half_bits_to_float(scale[c * fs + g]) *
                        dx2[r * 4 * fs + (g / 2) * 8 + (g % 2) * 4];
        y += static_cast<float>(dot) * f;
      }
      for (int64_t g = 0; g < fs; ++g) y += xsum[r * fs + g] * half_bits_to_float(min[c * fs + g]);
      out[r * NC + c] = y;
    }
  }
}

template <int NR, int NC, bool Blocks>
inline void int8_block(const int8_t* w, int64_t cs, int64_t gs, const int8_t* xq, int64_t k,
                       const float* dx, int64_t ds, const uint16_t* ws, int64_t wss,
                       float* out) {
  for (int r = 0; r < NR; ++r) {
    for (int c = 0; c < NC; ++c) {
      float y = 0.f;
      for (int64_t g = 0; g < k / kGroup; ++g) {
        int32_t dot = 0;
        for (int i = 0; i < kGroup; ++i) dot += w[c * cs + g * gs + i] * xq[r * k + g * kGroup + i];
        float f = dx[r * ds + g];
        if constexpr (Blocks) f *= half_bits_to_float(ws[c * wss + g]);
        y += static_cast<float>(dot) * f;
      }
      out[r * NC + c] = y;
    }
  }
}
#endif

#ifdef SGL_NB_AVX512_VNNI
// Blocks of NR rows of x against 2H weight rows with AVX-512 VNNI: one zmm holds two
// weight rows' 32-byte units (rows 2h, 2h + 1 are 64 adjacent bytes of the panel), x's 32
// bytes are broadcast to both halves, and dpbusd gives in one instruction the int32 lanes
// that maddubs, add and madd give (lane i: the sum over bytes 4i..4i+3, exact either way).
// The float part is the AVX2 kernel's lane for lane: the same cvt, the same factor
// scale x dx, the same fma into each output's 8 lanes (one half of a zmm), and hsum on
// each half, so the two paths give the same bits. The factors of 8 groups are computed at
// once, [row 2h's 8 x dx, row 2h + 1's 8 x dx], and each pair of groups takes its lanes
// with one permute (AVX2 spends 4 operations per row and pair on them, multiply included).

// Eight fp16 values of row a and eight of row b as fp32 [a0..a7, b0..b7]; lanes outside
// `m` are zero and not read (the end of a weight row may be the end of the tensor).
inline __m512 load_half_rows(const uint16_t* a, const uint16_t* b, __mmask8 m) {
  const __m128i ha = _mm_maskz_loadu_epi16(m, a), hb = _mm_maskz_loadu_epi16(m, b);
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(ha), hb, 1));
}

// Eight fp32 values in both halves.
inline __m512 broadcast8(const float* p) {
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
}

// 32 bytes in both halves.
inline __m512i broadcast32(const void* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
}

// out[r * 2H + c] = the sum of acc[r][c / 2]'s half c % 2 (weight rows 2h, 2h + 1 per
// zmm), summed as the AVX2 kernels sum.
template <int NR, int H>
inline void store_halves(const __m512 (&acc)[NR][H], float* out) {
  for (int r = 0; r < NR; ++r) {
    for (int h = 0; h < H; ++h) {
      out[r * 2 * H + 2 * h] = hsum(lower_half(acc[r][h]));
      out[r * 2 * H + 2 * h + 1] = hsum(upper_half(acc[r][h]));
    }
  }
}

// The high nibble of each byte: one GFNI affine (a bit matrix shifting each byte right by 4)
// where a shift of 16-bit lanes and a mask take two (the int4 kernel 1.1x, measured).
inline __m512i high_nibbles(__m512i b) {
#ifdef __GFNI__
  return _mm512_gf2p8affine_epi64_epi8(b, _mm512_set1_epi64(0x1020408000000000), 0);
#else
  return _mm512_and_si512(_mm512_srli_epi16(b, 4), _mm512_set1_epi8(0x0F));
#endif
}

// int4_block<NR, 2 H> (its arguments, dx per group: QuantizedRows::dx, row stride fs; the
// weight rows are 2H adjacent rows of a panel). Per two weight rows, a row of x and two
// groups: mask, high_nibbles, 2 dpbusd, cvt, permute, fma, where AVX2 takes 14 operations
// per weight row (1.45x in cache on one core at one row of x, measured).
template <int NR, int H>
inline void int4_block_vnni(const uint8_t* w, int64_t ps, const int8_t* xq, int64_t k,
                            const float* dx, int64_t fs, const uint16_t* scale,
                            const uint16_t* min, const float* xsum, float* out) {
  const __m512i mask = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi32(2);
  __m512 acc[NR][H];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  const int64_t pairs = k / (2 * kGroup);
  for (int64_t g0 = 0; g0 < 2 * pairs; g0 += 8) {
    __m512 f[NR][H];
    for (int r = 0; r < NR; ++r) {
      const __m512 d = broadcast8(dx + r * fs + g0);
      for (int h = 0; h < H; ++h) {
        f[r][h] = _mm512_mul_ps(
            load_half_rows(scale + 2 * h * fs + g0, scale + (2 * h + 1) * fs + g0, 0xFF), d);
      }
    }
    // Pair p's factors: [f_2p x 4, f_2p+1 x 4] of each row, as int4_block's s2 x dx2.
    __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 8, 8, 8, 8, 9, 9, 9, 9);
    for (int64_t p = g0 / 2; p < std::min(pairs, g0 / 2 + 4); ++p) {
      if constexpr (2 * H == kRowPanel) stream_ahead(w + p * ps, 4);
      for (int h = 0; h < H; ++h) {
        const __m512i b = _mm512_loadu_si512(w + p * ps + 2 * h * kGroup);
        const __m512i lo = _mm512_and_si512(b, mask), hi = high_nibbles(b);
        for (int r = 0; r < NR; ++r) {
          const int8_t* x = xq + r * k + p * 2 * kGroup;
          __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, broadcast32(x));
          dot = _mm512_dpbusd_epi32(dot, hi, broadcast32(x + kGroup));
          acc[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                      _mm512_permutexvar_ps(pick, f[r][h]), acc[r][h]);
        }
      }
      pick = _mm512_add_epi32(pick, two);
    }
  }
  for (int64_t g = 0; g < fs; g += 8) {
    for (int h = 0; h < H; ++h) {
      const __m512 low = load_half_rows(min + 2 * h * fs + g, min + (2 * h + 1) * fs + g, 0xFF);
      for (int r = 0; r < NR; ++r) {
        acc[r][h] = _mm512_fmadd_ps(low, broadcast8(xsum + r * fs + g), acc[r][h]);
      }
    }
  }
  store_halves(acc, out);
}

// int8_block<NR, 2 H, Blocks> (the weight rows: 2H adjacent rows of a panel). dpbusd
// multiplies unsigned by signed bytes: w + 128 (w with its top bit flipped) times x is
// w . x + 128 sum(x), so each row of x's accumulator starts at -128 sum(x) per lane,
// computed once per group for its H zmm (the sign trick, |w| times x carrying w's sign,
// costs 3 operations per zmm). 1.8x AVX2 in cache on one core at one row of x, measured.
template <int NR, int H, bool Blocks>
inline void int8_block_vnni(const int8_t* w, int64_t gs, const int8_t* xq, int64_t k,
                            const float* dx, int64_t ds, const uint16_t* ws, int64_t wss,
                            float* out) {
  const __m512i flip = _mm512_set1_epi8(-128), zero = _mm512_setzero_si512();
  __m512 acc[NR][H];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  const int64_t groups = k / kGroup;
  for (int64_t g0 = 0; g0 < groups; g0 += 8) {
    __m512 f[NR][H];
    if constexpr (Blocks) {
      const auto m = static_cast<__mmask8>((1u << std::min<int64_t>(8, groups - g0)) - 1);
      for (int r = 0; r < NR; ++r) {
        const __m512 d = broadcast8(dx + r * ds + g0);
        for (int h = 0; h < H; ++h) {
          f[r][h] = _mm512_mul_ps(d, load_half_rows(ws + 2 * h * wss + g0,
                                                    ws + (2 * h + 1) * wss + g0, m));
        }
      }
    }
    // Group g's factors: [d_2h,g x dx_g x 8, d_2h+1,g x dx_g x 8], as int8_block's f.
    __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8);
    for (int64_t g = g0; g < std::min(groups, g0 + 8); ++g) {
      __m512i x[NR], start[NR];
      for (int r = 0; r < NR; ++r) {
        x[r] = broadcast32(xq + r * k + g * kGroup);
        start[r] = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, flip, x[r]));
      }
      if constexpr (2 * H == kRowPanel) stream_ahead(w + g * gs, 4);
      for (int h = 0; h < H; ++h) {
        const __m512i b = _mm512_xor_si512(_mm512_loadu_si512(w + g * gs + 2 * h * kGroup), flip);
        for (int r = 0; r < NR; ++r) {
          const __m512i dot = _mm512_dpbusd_epi32(start[r], b, x[r]);
          const __m512 fr =
              Blocks ? _mm512_permutexvar_ps(pick, f[r][h]) : _mm512_set1_ps(dx[r * ds + g]);
          acc[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), fr, acc[r][h]);
        }
      }
      pick = _mm512_add_epi32(pick, _mm512_set1_epi32(1));
    }
  }
  store_halves(acc, out);
}
#endif

// Which instruction set the bf16 paths' kernels use: by default the widest this
// build has; a test switches between them in one build (they give the same bits).
enum class QuantIsa : int { kScalar, kAvx2, kAvx512Vnni };

// This build's, widest first.
inline std::vector<QuantIsa> built_quant_isas() {
#if defined(SGL_NB_AVX512_VNNI)
  return {QuantIsa::kAvx512Vnni, QuantIsa::kAvx2};
#elif defined(SGL_NB_AVX2)
  return {QuantIsa::kAvx2};
#else
  return {QuantIsa::kScalar};
#endif
}

inline std::atomic<QuantIsa>& quant_isa() {
  static std::atomic<QuantIsa> isa{built_quant_isas().front()};
  return isa;
}

inline std::string quant_isa_name(QuantIsa isa) {
  constexpr const char* kNames[] = {"scalar", "avx2", "avx512_vnni"};
  return kNames[static_cast<int>(isa)];
}

inline std::vector<std::string> quant_isa_names() {
  std::vector<std::string> names;
  for (QuantIsa isa : built_quant_isas()) names.push_back(quant_isa_name(isa));
  return names;
}

inline void set_quant_isa(const std::string& name) {
  for (QuantIsa isa : built_quant_isas()) {
    if (name == quant_isa_name(isa)) return quant_isa().store(isa);
  }
  std::string known;
  for (const auto& n : quant_isa_names()) known += (known.empty() ? "" : ", ") + n;
  TORCH_CHECK(false, "quantized kernels: no instruction set '", name, "' in this build (",
              known, ")");
}

// Whether the blocks take the AVX-512 VNNI kernels, read once per matmul.
inline bool vnni_enabled() {
  return quant_isa().load(std::memory_order_relaxed) == QuantIsa::kAvx512Vnni;
}

// fp32 activations, as they are: the exact path. Each output is the fp32 dot product of x
// with the dequantized weight, rearranged as y = sum_g scale_g (q_g . x_g) + sum_g min_g
// sum(x_g), so that it differs from the fp32 model's matmul by fp32 rounding in another
// order only. (Rounding x to int8, the path above, moves a logit of the default model by up
// to ~1, which turns greedy output at its near-ties.)
struct FloatRows {
  int64_t rows = 0, k = 0, groups = 0, stride = 0;
  const float* x = nullptr;
  std::vector<float> xsum;  // per row and group of 32, [rows, stride], zero beyond
  // int4 (pairs): each row in int4_block_exact's order, [rows, k] (see lane_order).
  std::vector<float> xp;
};

// Inputs of groups 2p and 2p + 1 (64 values at x) in the order int4_block_exact multiplies
// them: its 32 weight bytes read as eight int32 lanes (lanes 0-3: group 2p's bytes, 4-7:
// group 2p + 1's), vector v = 2 m + h holds in lane j the nibble h (0: low, 1: high) of
// byte m of the lane, masked in place: input 4 (j % 4) + m + 16 h of its group, times
// 2^(8 m). So x goes in times 2^(-8 m): exact, and no weight byte is shuffled.
inline void lane_order(const float* x, float* out) {
  constexpr float kUnscale[4] = {1.f, 0x1p-8f, 0x1p-16f, 0x1p-24f};
  for (int m = 0; m < 4; ++m) {
    for (int h = 0; h < 2; ++h) {
      for (int j = 0; j < 8; ++j) {
        out[(2 * m + h) * 8 + j] = x[(j / 4) * kGroup + 4 * (j % 4) + m + 16 * h] * kUnscale[m];
      }
    }
  }
}

// The sum of a group's 32 values (in a fixed order, whatever the batch).
inline float group_sum(const float* x) {
#ifdef SGL_NB_AVX2
  const __m256 a = _mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8));
  const __m256 b = _mm256_add_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24));
  return hsum(_mm256_add_ps(a, b));
#else
  float s = 0.f;
  for (int64_t i = 0; i < kGroup; ++i) s += x[i];
  return s;
#endif
}

inline void float_rows(const float* x, int64_t rows, int64_t k, bool pairs, FloatRows& f) {
  f.rows = rows;
  f.k = k;
  f.groups = k / kGroup;
  f.stride = (f.groups + 7) / 8 * 8;
  f.x = x;
  f.xsum.assign(rows * f.stride, 0.f);
  if (pairs) f.xp.resize(rows * k);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < f.groups; ++g) {
      f.xsum[r * f.stride + g] = group_sum(x + r * k + g * kGroup);
    }
    for (int64_t i = 0; pairs && i + 2 * kGroup <= k; i += 2 * kGroup) {
      lane_order(x + r * k + i, f.xp.data() + r * k + i);
    }
  }
}

#ifdef SGL_NB_AVX2
// NR rows of x (in lane_order, row stride k) against NC int4 weight rows laid out as
// int4_block's: out[r * NC + c] = sum_g scale_cg (q_cg . x_rg) + sum_g min_cg xsum_rg. Per
// two groups: 32 weight bytes, one shift, eight masks, eight conversions to fp32 (exact:
// at most 4 bits times a power of 2), and per row of x eight multiply-adds and one by
// [scale_2p x 4, scale_2p+1 x 4]. No shuffle: widening bytes to int32 lanes (vpmovzxbd)
// takes the one shuffle port of Intel's cores, and bound this path at 1.4-2.9x the bf16
// path's time at one row (measured); with masks it is 1.3-1.9x.
template <int NR, int NC>
inline void int4_block_exact(const uint8_t* w, int64_t cs, int64_t ps, const float* xp,
                             int64_t k, int64_t fs, const uint16_t* scale,
                             const uint16_t* min, const float* xsum, float* out) {
  __m256 acc[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  if (k < 2 * kGroup) __builtin_unreachable();
  for (int64_t p = 0; p < k / (2 * kGroup); ++p) {
    if constexpr (NC == kRowPanel) stream_ahead(w + p * ps, 4);
    for (int c = 0; c < NC; ++c) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * cs + p * ps));
      const __m256i bh = _mm256_srli_epi32(b, 4);
      const __m256 s2 = spread_half_pair(scale + c * fs + 2 * p);
      __m256 a[NR];
      for (int v = 0; v < 8; ++v) {
        const __m256i mask = _mm256_set1_epi32(0xF << (8 * (v / 2)));
        const __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(v % 2 ? bh : b, mask));
        for (int r = 0; r < NR; ++r) {
          const __m256 xv = _mm256_loadu_ps(xp + r * k + p * 2 * kGroup + 8 * v);
          a[r] = v ? _mm256_fmadd_ps(q, xv, a[r]) : _mm256_mul_ps(q, xv);
        }
      }
      for (int r = 0; r < NR; ++r) acc[r][c] = _mm256_fmadd_ps(a[r], s2, acc[r][c]);
    }
  }
  for (int64_t g = 0; g < fs; g += 8) {
    for (int c = 0; c < NC; ++c) {
      const __m256 low = load8_half(min + c * fs + g);
      for (int r = 0; r < NR; ++r) {
        acc[r][c] = _mm256_fmadd_ps(low, _mm256_loadu_ps(xsum + r * fs + g), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) out[r * NC + c] = hsum(acc[r][c]);
}

// NR rows of x against NC int8 weight rows (row c's group g at w + c * cs + g * gs), each
// group's dot product times its fp16 scale (Blocks, row c's at ws + c * wss) or not (a row
// scale, applied after): out[r * NC + c] = sum_g d_cg (w_cg . x_rg).
template <int NR, int NC, bool Blocks>
inline void int8_block_exact(const int8_t* w, int64_t cs, int64_t gs, const float* x,
                             int64_t k, const uint16_t* ws, int64_t wss, float* out) {
  __m256 acc[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  if (k < kGroup) __builtin_unreachable();
  for (int64_t g = 0; g < k / kGroup; ++g) {
    for (int c = 0; c < NC; ++c) {
      const int8_t* wg = w + c * cs + g * gs;
      __m256 wv[4];
      for (int i = 0; i < 4; ++i) {
        wv[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wg + 8 * i))));
      }
      const __m256 d = Blocks ? _mm256_set1_ps(half_bits_to_float(ws[c * wss + g]))
                              : _mm256_setzero_ps();
      for (int r = 0; r < NR; ++r) {
        const float* xg = x + r * k + g * kGroup;
        if constexpr (Blocks) {
          __m256 a = _mm256_mul_ps(wv[0], _mm256_loadu_ps(xg));
          for (int i = 1; i < 4; ++i) a = _mm256_fmadd_ps(wv[i], _mm256_loadu_ps(xg + 8 * i), a);
          acc[r][c] = _mm256_fmadd_ps(a, d, acc[r][c]);
        } else {
          for (int i = 0; i < 4; ++i) {
            acc[r][c] = _mm256_fmadd_ps(wv[i], _mm256_loadu_ps(xg + 8 * i), acc[r][c]);
          }
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) out[r * NC + c] = hsum(acc[r][c]);
}
#else
template <int NR, int NC>
inline void int4_block_exact(const uint8_t* w, int64_t cs, int64_t ps, const float* xp,
                             int64_t k, int64_t fs, const uint16_t* scale,
                             const uint16_t* min, const float* xsum, float* out) {
  for (int r = 0; r < NR; ++r) {
    for (int c = 0; c < NC; ++c) {
      float y = 0.f;
      for (int64_t p = 0; p < k / (2 * kGroup); ++p) {
        const uint8_t* b = w + c * cs + p * ps;
        const float* x = xp + r * k + p * 2 * kGroup;
        float dot[2] = {0.f, 0.f};  // groups 2p, 2p + 1 (lanes 0-3, 4-7 of lane_order)
        for (int v = 0; v < 8; ++v) {
          const int m = v / 2, h = v % 2;
          for (int j = 0; j < 8; ++j) {
            const int q = (b[4 * j + m] >> (4 * h)) & 15;
            dot[j / 4] += std::ldexp(static_cast<float>(q), 8 * m) * x[8 * v + j];
          }
        }
        y += dot[0] * half_bits_to_float(scale[c * fs + 2 * p]) +
             dot[1] * half_bits_to_float(scale[c * fs + 2 * p + 1]);
      }
      for (int64_t g = 0; g < fs; ++g) y += xsum[r * fs + g] * half_bits_to_float(min[c * fs + g]);
      out[r * NC + c] = y;
    }
  }
}

template <int NR, int NC, bool Blocks>
inline void int8_block_exact(const int8_t* w, int64_t cs, int64_t gs, const float* x,
                             int64_t k, const uint16_t* ws, int64_t wss, float* out) {
  for (int r = 0; r < NR; ++r) {
    for (int c = 0; c < NC; ++c) {
      float y = 0.f;
      for (int64_t g = 0; g < k / kGroup; ++g) {
        float dot = 0.f;
        for (int i = 0; i < kGroup; ++i) {
          dot += static_cast<float>(w[c * cs + g * gs + i]) * x[r * k + g * kGroup + i];
        }
        y += Blocks ? dot * half_bits_to_float(ws[c * wss + g]) : dot;
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

// int4 weights in our layout against quantized rows (pairs); scale and min fp16 [N, x.stride].
struct Int4Weights {
  const uint8_t* nib;
  const uint16_t *scale, *min;
  const QuantizedRows& x;

  // The panel holding weight row j0, all of it (see quant_matmul).
  void prefetch_panel(int64_t j0) const {
    prefetch_bytes(nib + panel_row_offset(j0, x.k / 2, kGroup), kRowPanel * x.k / 2);
  }

  bool vnni = vnni_enabled();

  template <int NR, int NC>
  void block(int64_t j0, int64_t r0, float* out) const {
    const int64_t s = x.stride;
    constexpr int64_t unit = kGroup;  // two groups of 16 bytes
#ifdef SGL_NB_AVX512_VNNI
    if constexpr (NC % 2 == 0) {
      if (vnni) {
        return int4_block_vnni<NR, NC / 2>(nib + panel_row_offset(j0, x.k / 2, unit),
                                           kRowPanel * unit, x.xq.data() + r0 * x.k, x.k,
                                           x.dx.data() + r0 * s, s, scale + j0 * s, min + j0 * s,
                                           x.xsum.data() + r0 * s, out);
      }
    }
#endif
    int4_block<NR, NC>(nib + panel_row_offset(j0, x.k / 2, unit), unit, kRowPanel * unit,
                       x.xq.data() + r0 * x.k, x.k, x.dx_pairs.data() + r0 * 4 * s, s,
                       scale + j0 * s, min + j0 * s, x.xsum.data() + r0 * s, out);
  }
  float finish(int64_t, int64_t, float part) const { return part; }
};

// int8 weights (interleaved) against quantized rows, with an fp32 scale per output row
// (row_scale) or an fp16 scale per group of 32 inputs (block_scale [N, K / 32]; row_scale
// null).
struct Int8Weights {
  const int8_t* w;
  const float* row_scale;
  const uint16_t* block_scale;
  const QuantizedRows& x;

  void prefetch_panel(int64_t j0) const {
    prefetch_bytes(w + panel_row_offset(j0, x.k, kGroup), kRowPanel * x.k);
  }

  bool vnni = vnni_enabled();

  template <int NR, int NC>
  void block(int64_t j0, int64_t r0, float* out) const {
    const int8_t* wj = w + panel_row_offset(j0, x.k, kGroup);
    const float* dx = x.dx.data() + r0 * x.stride;
    const int8_t* xq = x.xq.data() + r0 * x.k;
#ifdef SGL_NB_AVX512_VNNI
    if constexpr (NC % 2 == 0) {
      if (vnni && !row_scale) {
        return int8_block_vnni<NR, NC / 2, true>(wj, kRowPanel * kGroup, xq, x.k, dx, x.stride,
                                                 block_scale + j0 * x.groups, x.groups, out);
      }
      if (vnni) {
        return int8_block_vnni<NR, NC / 2, false>(wj, kRowPanel * kGroup, xq, x.k, dx, x.stride,
                                                  nullptr, 0, out);
      }
    }
#endif
    if (!row_scale) {
      int8_block<NR, NC, true>(wj, kGroup, kRowPanel * kGroup, xq, x.k, dx, x.stride,
                               block_scale + j0 * x.groups, x.groups, out);
    } else {
      int8_block<NR, NC, false>(wj, kGroup, kRowPanel * kGroup, xq, x.k, dx, x.stride, nullptr,
                                0, out);
    }
  }
  float finish(int64_t j, int64_t, float part) const {
    return row_scale ? part * row_scale[j] : part;
  }
};

// int4 weights in our layout against fp32 rows as they are (the exact path).
struct Int4WeightsExact {
  const uint8_t* nib;
  const uint16_t *scale, *min;
  const FloatRows& x;

  void prefetch_panel(int64_t j0) const {
    prefetch_bytes(nib + panel_row_offset(j0, x.k / 2, kGroup), kRowPanel * x.k / 2);
  }

  template <int NR, int NC>
  void block(int64_t j0, int64_t r0, float* out) const {
    const int64_t s = x.stride;
    int4_block_exact<NR, NC>(nib + panel_row_offset(j0, x.k / 2, kGroup), kGroup,
                             kRowPanel * kGroup, x.xp.data() + r0 * x.k, x.k, s,
                             scale + j0 * s, min + j0 * s, x.xsum.data() + r0 * s, out);
  }
  float finish(int64_t, int64_t, float part) const { return part; }
};

// int8 weights (interleaved) against fp32 rows as they are, scales as Int8Weights'.
struct Int8WeightsExact {
  const int8_t* w;
  const float* row_scale;
  const uint16_t* block_scale;
  const FloatRows& x;

  void prefetch_panel(int64_t j0) const {
    prefetch_bytes(w + panel_row_offset(j0, x.k, kGroup), kRowPanel * x.k);
  }

  template <int NR, int NC>
  void block(int64_t j0, int64_t r0, float* out) const {
    const int8_t* wj = w + panel_row_offset(j0, x.k, kGroup);
    if (!row_scale) {
      int8_block_exact<NR, NC, true>(wj, kGroup, kRowPanel * kGroup, x.x + r0 * x.k, x.k,
                                     block_scale + j0 * x.groups, x.groups, out);
    } else {
      int8_block_exact<NR, NC, false>(wj, kGroup, kRowPanel * kGroup, x.x + r0 * x.k, x.k,
                                      nullptr, 0, out);
    }
  }
  float finish(int64_t j, int64_t, float part) const {
    return row_scale ? part * row_scale[j] : part;
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

// y = x @ w.T (+ bias), int8 weights interleaved [N / 8, K / 32, 8 * 32] with an fp32 scale
// per row [N] or an fp16 scale per group [N, K / 32]; x bf16 (rounded to int8) or fp32 (the
// exact path); into `out` where it fits (output_rows).
inline at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& w,
                              const at::Tensor& scale, const at::Tensor& bias,
                              const at::Tensor& out = {}) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(interleaved(w, x, kGroup), "int8: x [rows, k], k a multiple of 32, and weights "
              "interleaved [n / 8, k / 32, 256]");
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0) * kRowPanel;
  const bool blocks = scale.dim() == 2;
  TORCH_CHECK(scale.is_contiguous() &&
                  (blocks ? scale.scalar_type() == at::kHalf && scale.size(0) == n &&
                                scale.size(1) == k / kGroup
                          : scale.scalar_type() == at::kFloat && scale.dim() == 1 &&
                                scale.size(0) == n),
              "int8 kernel: fp32 scales [N] or fp16 scales [N, K / 32]");
  at::Tensor y = output_rows(out, rows, n, x.options());
  const float* rs = blocks ? nullptr : scale.data_ptr<float>();
  const auto* bs = blocks ? reinterpret_cast<const uint16_t*>(scale.data_ptr()) : nullptr;
  thread_local QuantizedRows q;
  if (x.scalar_type() == at::kBFloat16) {
    quantize_rows(x.data_ptr<c10::BFloat16>(), rows, k, false, q);
    quant_matmul_any(Int8Weights{w.data_ptr<int8_t>(), rs, bs, q}, rows, n,
                     y.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "int8: bf16 or fp32 activations");
    thread_local FloatRows f;
    float_rows(x.data_ptr<float>(), rows, k, false, f);
    quant_matmul_any(Int8WeightsExact{w.data_ptr<int8_t>(), rs, bs, f}, rows, n,
                     y.data_ptr<float>());
  }
  if (bias.numel()) y.add_(bias);
  return y;
}

// y = x @ w.T (+ bias), int4 weights in our layout (nibbles interleaved [N / 8, K / 32,
// 8 * 16], scale and min fp16 [N, K/32 rounded up to 8], zeros beyond K/32); x bf16 or fp32;
// into `out` where it fits (output_rows).
inline at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& nib,
                              const at::Tensor& scale, const at::Tensor& min,
                              const at::Tensor& bias, const at::Tensor& out = {}) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(interleaved(nib, x, 2 * kGroup), "int4: x [rows, k], k a multiple of 64, and "
              "nibbles interleaved [n / 8, k / 64, 256]");
  const int64_t rows = x.size(0), k = x.size(1), n = nib.size(0) * kRowPanel;
  TORCH_CHECK(scale.size(0) == n && scale.size(1) == (k / kGroup + 7) / 8 * 8 &&
                  min.sizes() == scale.sizes() && scale.is_contiguous() && min.is_contiguous() &&
                  scale.scalar_type() == at::kHalf && min.scalar_type() == at::kHalf,
              "int4: scale and min fp16 [N, groups rounded up to 8]");
  at::Tensor y = output_rows(out, rows, n, x.options());
  const auto* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr());
  const auto* mp = reinterpret_cast<const uint16_t*>(min.data_ptr());
  thread_local QuantizedRows q;
  if (x.scalar_type() == at::kBFloat16) {
    quantize_rows(x.data_ptr<c10::BFloat16>(), rows, k, true, q);
    quant_matmul_any(Int4Weights{nib.data_ptr<uint8_t>(), sp, mp, q}, rows, n,
                     y.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "int4: bf16 or fp32 activations");
    thread_local FloatRows f;
    float_rows(x.data_ptr<float>(), rows, k, true, f);
    quant_matmul_any(Int4WeightsExact{nib.data_ptr<uint8_t>(), sp, mp, f}, rows, n,
                     y.data_ptr<float>());
  }
  if (bias.numel()) y.add_(bias);
  return y;
}

}  // namespace sgl_nb
