// int4 and int8 weight-only matmuls on the CPU, y = x @ w.T, for one row (decode) or many
// (prefill, batched decode): the same kernel at every size.
//
// int4 weights in groups of 32 inputs: w = q * scale + min, q in 0..15, scale and min in
// fp16: GGUF's Q4_1 block {d, m} as the file holds it (Q4_0's w = d (q - 8) is min = -8 d,
// exact in fp16), so a GGUF's Q4_0 / Q4_1 weights are computed with as they are; our own
// quantization of other weights keeps the same two values per group. A row's group is 16
// bytes, byte i holding input i in its low nibble and input i + 16 in its high one (ggml's
// block order). Our layout takes panels of 8 weight rows, and per panel and group 128 bytes
// in four units of 32: unit u holds bytes 4u..4u+3 of each of the 8 rows (row c's at 4c),
// [N / 8][G][4][8][4]; scale and min fp16 [N / 8][G][8]. So each 32-bit lane of a unit is
// one weight row: the kernel sums a group for 8 rows at once, in 16-bit lanes, and scales
// it with 8 adjacent scales, with no horizontal sum (int4_panel).
//
// int8 weights: [N, K] values with an fp32 scale per output row (our own quantization) or
// an fp16 scale per group of 32 inputs [N, K / 32] (GGUF's Q8_0 blocks). Their rows are
// interleaved in panels of 8 rows by units of 32 bytes (one group), [N / 8][K / 32][8][32]
// (`interleave_rows` in runtime/model/linear.py packs them at load).
//
// Either way a block of up to 8 weight rows then reads one sequential stream. With each row
// apart, a block read 4-8 short streams of K bytes and the hardware prefetcher never got
// going: at one row of x, int8 streamed 10-12 GB/s from memory, interleaved 19-24
// (measured).
//
// Two paths, by the activations' dtype. bf16: as llama.cpp does on CPUs without wider
// integer dot products, each row of x is quantized per group of 32 to int8 (xq * dx,
// dx = max|x| / 127), so that one group of one output is a u8 x s8 dot product (maddubs):
// y = sum_g scale_g dx_g (q . xq)_g + min_g sum_g(x). fp32: the exact path (FloatRows,
// below), x as it is, the weights turned to fp32 in registers: y differs from x @ w.T with
// the dequantized weight by fp32 rounding only.
//
// Blocks of up to 4 rows of x times NC weight rows (int4: a panel, or two from 8 rows of x
// with AVX-512 VNNI: int4_panel_pair) share their loads: each weight unit is loaded (int4:
// and unpacked) once per block. Every output is the same sequence of operations whatever
// block it falls in (its own accumulator or lane, groups in order), so a row's result never
// depends on the other rows: a request decodes to the same bits in any batch, and prefill
// computes the bits decode would.
//
// Where the build has AVX-512 VNNI (-march=native on such a CPU), the int8 bf16 path's
// blocks take dpbusd (u8 x s8 summed by 4 bytes into int32, one instruction for maddubs +
// add + madd), two weight rows per 512-bit register. The integers are the AVX2 kernels' and
// the float part is theirs lane for lane, so the bits are the same (quant_isa switches
// between them for the tests). On a 2-core Sapphire Rapids VM, in cache on one core: 1.75x
// (Q8_0) the AVX2 kernel at one row of x, 1.25-1.45x at 4 to 64; streaming from memory on
// two threads at one row, 1.25-1.3x (the Q8_0 LM head) (measured). int4 takes int4_panel
// on every CPU with AVX2.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
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
  // int4 where kSpreadRows: each 4 bytes of xq repeated in 8 lanes, [rows, k / 4, 8], as
  // int4_panel multiplies them.
  std::vector<int32_t> spread;
};

// Whether int4_panel loads x's bytes from QuantizedRows.spread (written once per call, 8x
// xq's size) or broadcasts them from xq. Each way it is one load per 4 bytes and the same
// integers, so the same bits. On a Zen 1 (AVX2 only) broadcasting took the kernel 1.13x
// its time in cache. On a Zen 4 (AVX-512) it was 1.1-1.6x faster at 1-64 rows (in cache,
// one and two threads), and the int4 decode step 15% shorter, its matmuls 0.16-0.26 ms
// fewer (alternating in one process): the spread (12 KB at K = 1536) was written cold
// each call and crowded the weights' lines out of L1.
#if defined(SGL_NB_AVX2) && !defined(__AVX512F__)
constexpr bool kSpreadRows = true;
#else
constexpr bool kSpreadRows = false;
#endif

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

// x [rows, k] into q (its vectors reused: no allocation once they have grown); with
// `spread`, q.spread too.
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, QuantizedRows& q, bool spread = false) {
  q.rows = rows;
  q.k = k;
  q.groups = k / kGroup;
  q.stride = (q.groups + 7) / 8 * 8;
  q.xq.resize(rows * k);
  q.dx.assign(rows * q.stride, 0.f);
  q.xsum.assign(rows * q.stride, 0.f);
#ifdef SGL_NB_AVX2
  if (spread) q.spread.resize(rows * k / 4 * 8);
#endif
  auto part = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t g = 0; g < q.groups; ++g) {
        quantize_group(x + r * k + g * kGroup, q.xq.data() + r * k + g * kGroup,
                       q.dx.data() + r * q.stride + g, q.xsum.data() + r * q.stride + g);
      }
#ifdef SGL_NB_AVX2
      for (int64_t i = 0; spread && i < k / 4; ++i) {
        int32_t word;
        std::memcpy(&word, q.xq.data() + r * k + 4 * i, sizeof word);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.spread.data() + (r * k / 4 + i) * 8),
                            _mm256_set1_epi32(word));
      }
#endif
    }
  };
  if (rows >= 8) {
    WorkerPool::get().parallel_for(rows, part);
  } else {
    part(0, rows);
  }
}

#ifdef SGL_NB_AVX2
// One group's float part for a panel's 8 weight rows (lanes), the same in both int4
// kernels' paths: acc + dot * (scale * dx) + min * xsum, in this order.
inline __m256 add_group(__m256 acc, __m256 dot, __m256 scale, float dx, __m256 min, float xsum) {
  acc = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale, _mm256_set1_ps(dx)), acc);
  return _mm256_fmadd_ps(min, _mm256_set1_ps(xsum), acc);
}

// A panel's scales and mins (16 bytes a group each, 1/8 of its nibbles' bytes) asked for as
// far ahead in groups as stream_ahead asks for the nibbles, a line per 4 groups. Left to
// the hardware prefetchers, the int4 decode step took 1-2% longer (a step apart, alternating
// in one process, medians of 680, measured on a 2-core Zen 4).
inline void int4_scales_ahead(const uint16_t* scale, const uint16_t* min, int64_t g) {
  if (g % 4) return;
  stream_ahead(scale + g * kRowPanel, 1, kStreamAhead / 8);
  stream_ahead(min + g * kRowPanel, 1, kStreamAhead / 8);
}

// Row r of x's 4-byte words i and i + 4 (its group's low and high nibbles' inputs for
// unit i % 8) in all 8 lanes.
struct XWords {
  __m256i lo, hi;
};
inline XWords spread_x(const QuantizedRows& q, int64_t r, int64_t i) {
  if constexpr (kSpreadRows) {
    const auto* x = reinterpret_cast<const __m256i*>(q.spread.data() + (r * q.k / 4 + i) * 8);
    return {_mm256_loadu_si256(x), _mm256_loadu_si256(x + 4)};
  }
  int32_t lo, hi;
  std::memcpy(&lo, q.xq.data() + r * q.k + 4 * i, sizeof lo);
  std::memcpy(&hi, q.xq.data() + r * q.k + 4 * (i + 4), sizeof hi);
  return {_mm256_set1_epi32(lo), _mm256_set1_epi32(hi)};
}

// Rows r0..r0 + NR - 1 of q against one panel of 8 int4 weight rows in our layout (w: the
// panel's first byte; scale, min: its [G][8]): out[r * 8 + c] = sum_g scale_cg dx_rg
// (q_cg . xq_rg)_g + min_cg xsum_rg.
//
// A unit's 32-bit lane c holds row c's inputs 4u..4u+3 (low nibbles) and 16+4u..16+4u+3
// (high), so x's 4 bytes for each, in all lanes (spread), and maddubs give each row's
// products, summed in pairs. A group's four units add as 16-bit values (at most 4 x 2 x 2
// products of 15 x 127: 30480 < 32767) before one widening sum: per unit a mask, a shift, a
// mask, 2 maddubs and 2 adds, where the layout of one row per unit took 11 operations plus a
// horizontal sum per output. Zen 1 runs maddubs on one pipe and a 256-bit one takes it 2
// cycles: those 4 cycles per 32 bytes are the kernel's floor there. In cache on one core,
// 3.2 ns per 32 bytes against 4.4-4.7 (K = 576, 1536; a standalone copy of both), and the
// engine's int4 one stream 1.1-1.3x (measured on a 2-core Zen 1: docs/benchmarks.md).
//
// With Vnni (AVX-512 VNNI on ymm) each unit and row takes two dpbusd (low and high nibbles,
// each its own int32 chain) where AVX2 takes two maddubs and two 16-bit adds, and the
// group's madd goes. Lane c of a group's int32 sum is the same integer either way (no 16-bit
// sum saturates), and the float part is shared, so the bits are the same. Measured on a
// 2-core Zen 4, K = 576 and 1536, in cache, one and two threads: 1.2-1.3x at 4 to 46 rows
// of x (prefill, batched decode), 1.06-1.17x at 1 and 2.
template <int NR, bool Vnni = false>
inline void int4_panel(const uint8_t* w, const QuantizedRows& q, int64_t r0,
                       const uint16_t* scale, const uint16_t* min, float* out) {
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t fs = q.stride;
  const float *dx = q.dx.data() + r0 * fs, *xsum = q.xsum.data() + r0 * fs;
  __m256 acc[NR];
  for (auto& a : acc) a = _mm256_setzero_ps();
  const int64_t groups = q.k / kGroup;
  if (groups < 1) __builtin_unreachable();  // else GCC keeps acc in memory
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * kRowPanel * kGroup / 2;
    stream_ahead(wg, 2);
    int4_scales_ahead(scale, min, g);
    // Row r's group sum so far: AVX2's 16-bit sums in lo[r]; VNNI's int32 chains in both.
    __m256i lo[NR], hi[NR];
    for (int r = 0; r < NR; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + u * kGroup));
      const __m256i wlo = _mm256_and_si256(b, mask);
      const __m256i whi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
      for (int r = 0; r < NR; ++r) {
        const XWords x = spread_x(q, r0 + r, g * 8 + u);
        if constexpr (Vnni) {
#ifdef SGL_NB_AVX512_VNNI
          lo[r] = _mm256_dpbusd_epi32(lo[r], wlo, x.lo);
          hi[r] = _mm256_dpbusd_epi32(hi[r], whi, x.hi);
#endif
        } else {
          lo[r] = _mm256_add_epi16(lo[r], _mm256_add_epi16(_mm256_maddubs_epi16(wlo, x.lo),
                                                           _mm256_maddubs_epi16(whi, x.hi)));
        }
      }
    }
    const __m256 s = load8_half(scale + g * kRowPanel), m = load8_half(min + g * kRowPanel);
    for (int r = 0; r < NR; ++r) {
      const __m256i sum32 = Vnni ? _mm256_add_epi32(lo[r], hi[r]) : _mm256_madd_epi16(lo[r], ones);
      acc[r] = add_group(acc[r], _mm256_cvtepi32_ps(sum32), s, dx[r * fs + g], m, xsum[r * fs + g]);
    }
  }
  for (int r = 0; r < NR; ++r) _mm256_storeu_ps(out + r * kRowPanel, acc[r]);
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
// Byte i of row c's group in a panel's group block (see the layout at the top).
inline uint8_t panel_byte(const uint8_t* wg, int64_t c, int64_t i) {
  return wg[(i / 4) * kGroup + c * 4 + i % 4];
}

template <int NR>
inline void int4_panel(const uint8_t* w, const QuantizedRows& q, int64_t r0,
                       const uint16_t* scale, const uint16_t* min, float* out) {
  const int64_t k = q.k, fs = q.stride;
  const int8_t* xq = q.xq.data() + r0 * k;
  const float *dx = q.dx.data() + r0 * fs, *xsum = q.xsum.data() + r0 * fs;
  for (int r = 0; r < NR; ++r) {
    for (int64_t c = 0; c < kRowPanel; ++c) {
      float y = 0.f;
      for (int64_t g = 0; g < k / kGroup; ++g) {
        const uint8_t* wg = w + g * kRowPanel * kGroup / 2;
        const int8_t* x = xq + r * k + g * kGroup;
        int32_t dot = 0;
        for (int i = 0; i < 16; ++i) {
          dot += (panel_byte(wg, c, i) & 15) * x[i] + (panel_byte(wg, c, i) >> 4) * x[16 + i];
        }
        y += static_cast<float>(dot) * (half_bits_to_float(scale[g * kRowPanel + c]) * dx[r * fs + g]);
        y += half_bits_to_float(min[g * kRowPanel + c]) * xsum[r * fs + g];
      }
      out[r * kRowPanel + c] = y;
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
// Blocks of NR rows of x against 2H int8 weight rows with AVX-512 VNNI: one zmm holds two
// weight rows' 32-byte units (rows 2h, 2h + 1 are 64 adjacent bytes of the panel), x's 32
// bytes are broadcast to both halves, and dpbusd gives in one instruction the int32 lanes
// that maddubs, add and madd give (lane i: the sum over bytes 4i..4i+3, exact either way).
// The float part is the AVX2 kernel's lane for lane: the same cvt, the same factor
// scale x dx, the same fma into each output's 8 lanes (one half of a zmm), and hsum on
// each half, so the two paths give the same bits. The factors of 8 groups are computed at
// once, [row 2h's 8 x dx, row 2h + 1's 8 x dx], and each group takes its lanes with one
// permute.

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

#ifdef SGL_NB_AVX512_VNNI
// Rows of x from which int4 blocks take two panels at once (int4_panel_pair). A block then
// reads two streams of weights, which a decode's few rows, bound by memory, do not gain
// from (two panels a block at one row: 26-27 GB/s against 36-38, measured); from 8 rows
// on the arithmetic, not memory, sets an int4 matmul's pace.
constexpr int64_t kPanelPairRows = 8;

// int4_panel<NR, true> on two adjacent panels (16 weight rows; the second's nibbles, scales
// and mins right after the first's) in one zmm per row of x: lanes 0-7 the first panel's
// rows, 8-15 the second's, out [NR][16]. Each x word broadcast then serves 16 weight rows
// where it served 8, and each dpbusd does twice the work: half the instructions per
// multiply-add. Each lane's integers and float operations are int4_panel's, so the bits
// are the same. In cache on one core of a 2-core Zen 4, 48 rows of x: 1.5x int4_panel at
// K = 576, N = 3072, 1.36x at K = 1536, N = 576 (same outputs bit for bit).
template <int NR>
inline void int4_panel_pair(const uint8_t* w, const QuantizedRows& q, int64_t r0,
                            const uint16_t* scale, const uint16_t* min, float* out) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const int64_t groups = q.k / kGroup, fs = q.stride;
  const uint8_t* w2 = w + kRowPanel * q.k / 2;
  const uint16_t *scale2 = scale + groups * kRowPanel, *min2 = min + groups * kRowPanel;
  const float *dx = q.dx.data() + r0 * fs, *xsum = q.xsum.data() + r0 * fs;
  const int8_t* xq = q.xq.data() + r0 * q.k;
  __m512 acc[NR];
  for (auto& a : acc) a = _mm512_setzero_ps();
  if (groups < 1) __builtin_unreachable();  // else GCC keeps acc in memory
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t at = g * kRowPanel * kGroup / 2;
    __m512i lo[NR], hi[NR];
    for (int r = 0; r < NR; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      const __m512i b = _mm512_inserti64x4(
          _mm512_castsi256_si512(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + at + u * kGroup))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w2 + at + u * kGroup)), 1);
      const __m512i wlo = _mm512_and_si512(b, mask);
      const __m512i whi = _mm512_and_si512(_mm512_srli_epi16(b, 4), mask);
      for (int r = 0; r < NR; ++r) {
        int32_t xl, xh;  // x's words for unit u's low and high nibbles, as spread_x's
        std::memcpy(&xl, xq + r * q.k + 4 * (g * 8 + u), sizeof xl);
        std::memcpy(&xh, xq + r * q.k + 4 * (g * 8 + u + 4), sizeof xh);
        lo[r] = _mm512_dpbusd_epi32(lo[r], wlo, _mm512_set1_epi32(xl));
        hi[r] = _mm512_dpbusd_epi32(hi[r], whi, _mm512_set1_epi32(xh));
      }
    }
    const int64_t at8 = g * kRowPanel;
    const __m512 s = join_halves(load8_half(scale + at8), load8_half(scale2 + at8));
    const __m512 m = join_halves(load8_half(min + at8), load8_half(min2 + at8));
    for (int r = 0; r < NR; ++r) {  // add_group's operations, in its order
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(lo[r], hi[r]));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(s, _mm512_set1_ps(dx[r * fs + g])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * fs + g]), acc[r]);
    }
  }
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(out + r * 2 * kRowPanel, acc[r]);
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
  // int4: x [rows, k] times 2^(-8 (i mod 4)) at input i (see int4_panel_exact).
  std::vector<float> xs;
};

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

inline void float_rows(const float* x, int64_t rows, int64_t k, bool int4, FloatRows& f) {
  f.rows = rows;
  f.k = k;
  f.groups = k / kGroup;
  f.stride = (f.groups + 7) / 8 * 8;
  f.x = x;
  f.xsum.assign(rows * f.stride, 0.f);
  constexpr float kUnscale[4] = {1.f, 0x1p-8f, 0x1p-16f, 0x1p-24f};
  if (int4) f.xs.resize(rows * k);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < f.groups; ++g) {
      f.xsum[r * f.stride + g] = group_sum(x + r * k + g * kGroup);
    }
    for (int64_t i = 0; int4 && i < k; ++i) f.xs[r * k + i] = x[r * k + i] * kUnscale[i % 4];
  }
}

#ifdef SGL_NB_AVX2
// Rows r0..r0 + NR - 1 of f (FloatRows::xs) against one panel of 8 int4 weight rows in our
// layout (int4_panel's other arguments): out[r * 8 + c] = sum_g scale_cg (q_cg . x_rg)_g +
// min_cg xsum_rg. Byte m of a unit's lane, masked in place (and shifted by 4 for its high
// nibble), is q times 2^(8 m), exactly in fp32, and x comes in times 2^(-8 m), so no byte
// is moved: per unit one shift, eight masks and conversions, and per row of x eight
// multiply-adds, in two chains (low and high nibbles) added at the group's end.
template <int NR>
inline void int4_panel_exact(const uint8_t* w, const FloatRows& f, int64_t r0,
                             const uint16_t* scale, const uint16_t* min, float* out) {
  const int64_t k = f.k, fs = f.stride;
  const float *xs = f.xs.data() + r0 * k, *xsum = f.xsum.data() + r0 * fs;
  __m256 acc[NR];
  for (auto& a : acc) a = _mm256_setzero_ps();
  const int64_t groups = k / kGroup;
  if (groups < 1) __builtin_unreachable();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * kRowPanel * kGroup / 2;
    stream_ahead(wg, 2);
    int4_scales_ahead(scale, min, g);
    __m256 low[NR], high[NR];
    for (int r = 0; r < NR; ++r) low[r] = high[r] = _mm256_setzero_ps();
    for (int u = 0; u < 4; ++u) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + u * kGroup));
      const __m256i bh = _mm256_srli_epi32(b, 4);
#pragma GCC unroll 4
      for (int m = 0; m < 4; ++m) {
        const __m256i mask = _mm256_set1_epi32(0xF << (8 * m));
        const __m256 ql = _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
        const __m256 qh = _mm256_cvtepi32_ps(_mm256_and_si256(bh, mask));
        for (int r = 0; r < NR; ++r) {
          const float* x = xs + r * k + g * kGroup + 4 * u + m;
          low[r] = _mm256_fmadd_ps(ql, _mm256_broadcast_ss(x), low[r]);
          high[r] = _mm256_fmadd_ps(qh, _mm256_broadcast_ss(x + 16), high[r]);
        }
      }
    }
    const __m256 s = load8_half(scale + g * kRowPanel), m = load8_half(min + g * kRowPanel);
    for (int r = 0; r < NR; ++r) {
      acc[r] = add_group(acc[r], _mm256_add_ps(low[r], high[r]), s, 1.f, m, xsum[r * fs + g]);
    }
  }
  for (int r = 0; r < NR; ++r) _mm256_storeu_ps(out + r * kRowPanel, acc[r]);
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
template <int NR>
inline void int4_panel_exact(const uint8_t* w, const FloatRows& f, int64_t r0,
                             const uint16_t* scale, const uint16_t* min, float* out) {
  const int64_t k = f.k, fs = f.stride;
  const float *xr = f.x + r0 * k, *xsum = f.xsum.data() + r0 * fs;  // x as it is
  for (int r = 0; r < NR; ++r) {
    for (int64_t c = 0; c < kRowPanel; ++c) {
      float y = 0.f;
      for (int64_t g = 0; g < k / kGroup; ++g) {
        const uint8_t* wg = w + g * kRowPanel * kGroup / 2;
        const float* x = xr + r * k + g * kGroup;
        float dot = 0.f;
        for (int i = 0; i < 16; ++i) {
          const uint8_t b = panel_byte(wg, c, i);
          dot += (b & 15) * x[i] + (b >> 4) * x[16 + i];
        }
        y += dot * half_bits_to_float(scale[g * kRowPanel + c]);
        y += half_bits_to_float(min[g * kRowPanel + c]) * xsum[r * fs + g];
      }
      out[r * kRowPanel + c] = y;
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

// Where weight row j starts in the int8 interleaved layout: rows of row_bytes, in units of
// unit_bytes (a group, 32 bytes).
inline int64_t panel_row_offset(int64_t j, int64_t row_bytes, int64_t unit_bytes) {
  return (j / kRowPanel) * kRowPanel * row_bytes + (j % kRowPanel) * unit_bytes;
}

// out[r * NC + c] for weight rows j0..j0 + NC - 1 from panel(p0, out8), which computes the
// whole panel at row p0 into out8 [NR][8]: directly where the block is a panel (N is a
// multiple of 8, so every int4 block is), else through a copy.
template <int NR, int NC, typename Panel>
inline void panel_columns(int64_t j0, float* out, const Panel& panel) {
  const int64_t p0 = j0 / kRowPanel * kRowPanel;
  if constexpr (NC == kRowPanel) {
    if (p0 == j0) return panel(p0, out);
  }
  float all[NR * kRowPanel];
  panel(p0, all);
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) out[r * NC + c] = all[r * kRowPanel + j0 - p0 + c];
}

// int4 weights in our layout, scale and min fp16 [N / 8][G][8], against quantized rows
// (QuantizedRows: int4_panel) or fp32 rows as they are (FloatRows: int4_panel_exact).
template <typename Rows>
struct Int4Weights {
  const uint8_t* nib;
  const uint16_t *scale, *min;
  const Rows& x;
  bool vnni = vnni_enabled();

  // The panel holding weight row j0, all of it (see quant_matmul).
  void prefetch_panel(int64_t j0) const {
    prefetch_bytes(nib + j0 / kRowPanel * kRowPanel * x.k / 2, kRowPanel * x.k / 2);
  }

  template <int NR, int NC>
  void block(int64_t j0, int64_t r0, float* out) const {
    if constexpr (NC == 2 * kRowPanel) {
      pair_block<NR>(j0, r0, out);
    } else {
      panel_block<NR, NC>(j0, r0, out);
    }
  }

  // Two panels from j0, a panel's first row (int4_matmul's choice: AVX-512 VNNI only).
  template <int NR>
  void pair_block(int64_t j0, int64_t r0, float* out) const {
#ifdef SGL_NB_AVX512_VNNI
    if constexpr (std::is_same_v<Rows, QuantizedRows>) {
      return int4_panel_pair<NR>(nib + j0 * x.k / 2, x, r0, scale + j0 * x.groups,
                                 min + j0 * x.groups, out);
    }
#endif
    TORCH_CHECK(false, "int4: panel pairs take quantized rows on AVX-512 VNNI");
  }

  template <int NR, int NC>
  void panel_block(int64_t j0, int64_t r0, float* out) const {
    panel_columns<NR, NC>(j0, out, [&](int64_t p0, float* o) {
      const uint8_t* w = nib + p0 * x.k / 2;
      if constexpr (std::is_same_v<Rows, QuantizedRows>) {
#ifdef SGL_NB_AVX512_VNNI
        if (vnni) {
          return int4_panel<NR, true>(w, x, r0, scale + p0 * x.groups, min + p0 * x.groups, o);
        }
#endif
        int4_panel<NR>(w, x, r0, scale + p0 * x.groups, min + p0 * x.groups, o);
      } else {
        int4_panel_exact<NR>(w, x, r0, scale + p0 * x.groups, min + p0 * x.groups, o);
      }
    });
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

// Where quant_matmul puts its outputs: T values (a T*), or fp32 of T-rounded values, the bits
// of T widened (a step's logits, written where they are read: no pass of their own to widen
// them, each core's outputs in its own cache).
template <typename T>
struct RoundedTo {
  float* p;
};
template <typename T>
inline void put(T* y, int64_t i, float v) { y[i] = T(v); }
template <typename T>
inline void put(RoundedTo<T> y, int64_t i, float v) { y.p[i] = float(T(v)); }

// Rows r0..r0 + nr - 1 (nr <= NR) of y [rows, n] at columns j0..j0 + W - 1: w's block
// there, finished and put as y takes it.
template <int NR, int W, typename Weights, typename Y>
inline void put_block(const Weights& w, int64_t nr, int64_t j0, int64_t r0, int64_t n, Y y) {
  float part[NR * W];
  rows_block<NR, W>(w, nr, j0, r0, part);
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t c = 0; c < W; ++c)
      put(y, (r0 + r) * n + j0 + c, w.finish(j0 + c, r0 + r, part[r * W + c]));
}

// y [rows, n] = finish(j, r, part) for every output, put as y takes it.
template <int NC, typename Y, typename Weights>
void quant_matmul(const Weights& w, int64_t rows, int64_t n, Y y) {
  const int64_t chunk = row_chunk(w.x.k);
  for_each_block<kMaxRowBlock, NC>(rows, n, chunk, [&](int64_t j0, auto width, int64_t r0,
                                                       int64_t nr) {
    constexpr int W = decltype(width)::value;
    // Blocks narrower than a panel read a quarter of each of its 256-byte units (two weight
    // rows of eight): the whole panel asked for at once streams from memory, where the
    // blocks' strided reads did not (int8 at 16 rows: 1.1-1.7x, measured).
    if (W < kRowPanel && j0 % kRowPanel == 0 && r0 % chunk == 0) w.prefetch_panel(j0);
    put_block<kMaxRowBlock, W>(w, nr, j0, r0, n, y);
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
    quantize_rows(x.data_ptr<c10::BFloat16>(), rows, k, q);
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

// An int4 linear in our layout (int4_linear's nibbles, scale and min) as pointers and sizes,
// for callers that checked the tensors once and call it again and again: each at::Tensor
// accessor of a call touches metadata that a decode step's weight stream has evicted.
struct Int4Panels {
  const uint8_t* nib = nullptr;  // null: not an int4 linear in our layout
  const uint16_t* scale = nullptr;
  const uint16_t* min = nullptr;
  int64_t n = 0, k = 0;
};

// x's rows as the int4 kernels take them: fp32 as they are (the exact path), else quantized.
template <typename T>
using Int4Rows = std::conditional_t<std::is_same_v<T, float>, FloatRows, QuantizedRows>;

template <typename T>
void prepare_int4_rows(const T* x, int64_t rows, int64_t k, Int4Rows<T>& out) {
  if constexpr (std::is_same_v<T, float>) {
    float_rows(x, rows, k, true, out);
  } else {
    quantize_rows(x, rows, k, out, /*spread=*/kSpreadRows);
  }
}

// fn(weights): w over x [rows, k] (bf16 or fp32) as the int4 kernels take it, x's rows
// prepared first.
template <typename T, typename F>
void with_int4_rows(const T* x, int64_t rows, const Int4Panels& w, const F& fn) {
  thread_local Int4Rows<T> prepared;
  prepare_int4_rows(x, rows, w.k, prepared);
  fn(Int4Weights<Int4Rows<T>>{w.nib, w.scale, w.min, prepared});
}

// Decode at batch 1: fn(weights, p0, p1) over items [0, items) of `item_bytes` of nibbles
// each (a panel, or a gate and an up panel), split among the threads, x prepared for the
// kernels by each thread itself (thread_local, once per call) rather than by the caller
// before the job. Why, measured on a 2-core Zen 4 over the default model's 121 int4
// matmuls (a standalone copy, in spells where a plain read of the weights found 90-99
// GB/s): 44 GB/s through int4_matmul's blocks; 57 with the same panels walked in halves on
// x prepared once; 50-52 with x prepared by the caller at each call, the other core then
// reading what it wrote; 52-54 in the pool's chunks of 1/16 of a part (each claim is a
// locked instruction, which the loads behind it likely wait for). Chunks here hold 32 KB
// or more (128 KB, or one per thread: within noise).
template <typename T, typename F>
void int4_row_panels(const T* x, const Int4Panels& w, int64_t items, int64_t item_bytes,
                     const F& fn) {
  const uint64_t call = next_call_id();
  WorkerPool::get().parallel_for(items, [&](int64_t p0, int64_t p1) {
    thread_local Int4Rows<T> rows;
    thread_local uint64_t prepared_for = 0;
    if (prepared_for != call) {
      prepare_int4_rows(x, 1, w.k, rows);
      prepared_for = call;
    }
    fn(Int4Weights<Int4Rows<T>>{w.nib, w.scale, w.min, rows}, p0, p1);
  }, std::max<int64_t>(1, 32768 / item_bytes));
}

// y [1, n] = x [1, k] @ w.T: int4_matmul's one-row path (int4_row_panels), the same
// kernels and so the same bits as its blocks.
template <typename T, typename Y>
void int4_row(const T* x, const Int4Panels& w, Y y) {
  int4_row_panels(x, w, w.n / kRowPanel, kRowPanel * w.k / 2,
                  [&](const auto& weights, int64_t p0, int64_t p1) {
                    for (int64_t j0 = p0 * kRowPanel; j0 < p1 * kRowPanel; j0 += kRowPanel)
                      put_block<1, kRowPanel>(weights, 1, j0, 0, w.n, y);
                  });
}

// y [rows, n] = x [rows, k] @ w.T, x bf16 or fp32, y T* or RoundedTo<T> (int4_linear's
// kernels).
template <typename T, typename Y>
void int4_matmul(const T* x, int64_t rows, const Int4Panels& w, Y y) {
  if (rows == 1) return int4_row(x, w, y);
  with_int4_rows(x, rows, w, [&](const auto& weights) {
#ifdef SGL_NB_AVX512_VNNI
    if constexpr (std::is_same_v<std::decay_t<decltype(weights)>, Int4Weights<QuantizedRows>>) {
      if (weights.vnni && rows >= kPanelPairRows && w.n % (2 * kRowPanel) == 0) {
        return quant_matmul<2 * kRowPanel>(weights, rows, w.n, y);
      }
    }
#endif
    quant_matmul<kRowPanel>(weights, rows, w.n, y);
  });
}

// The pointers of int4 weights in our layout (nibbles [N / 8, K / 32, 128], scale and min
// fp16 [N / 8, K / 32, 8]) for x [rows, k], checked.
inline Int4Panels int4_panels(const at::Tensor& nib, const at::Tensor& scale,
                              const at::Tensor& min, int64_t k) {
  TORCH_CHECK(k % kGroup == 0 && nib.dim() == 3 && nib.is_contiguous() &&
                  nib.size(1) == k / kGroup && nib.size(2) == kRowPanel * kGroup / 2,
              "int4: x [rows, k], k a multiple of 32, and nibbles in panels [n / 8, k / 32, "
              "128]");
  TORCH_CHECK(scale.dim() == 3 && scale.size(0) == nib.size(0) && scale.size(1) == k / kGroup &&
                  scale.size(2) == kRowPanel && min.sizes() == scale.sizes() &&
                  scale.is_contiguous() && min.is_contiguous() &&
                  scale.scalar_type() == at::kHalf && min.scalar_type() == at::kHalf,
              "int4: scale and min fp16 in panels [n / 8, k / 32, 8]");
  return {nib.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scale.data_ptr()),
          reinterpret_cast<const uint16_t*>(min.data_ptr()), nib.size(0) * kRowPanel, k};
}

// y = x @ w.T (+ bias), int4 weights in our layout (int4_panels); x bf16 or fp32; into `out`
// where it fits (output_rows). A block is a whole panel at any number of rows of x
// (int4_panel: its 8 weight rows are the lanes).
inline at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& nib,
                              const at::Tensor& scale, const at::Tensor& min,
                              const at::Tensor& bias, const at::Tensor& out = {}) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2, "int4: x [rows, k]");
  const Int4Panels w = int4_panels(nib, scale, min, x.size(1));
  const int64_t rows = x.size(0);
  at::Tensor y = output_rows(out, rows, w.n, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    int4_matmul(x.data_ptr<c10::BFloat16>(), rows, w, y.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "int4: bf16 or fp32 activations");
    int4_matmul(x.data_ptr<float>(), rows, w, y.data_ptr<float>());
  }
  if (bias.numel()) y.add_(bias);
  return y;
}

}  // namespace sgl_nb
