// Small AVX2 helpers shared by the CPU kernels; without AVX2 only the scalar ones exist.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SGL_NB_AVX2 1
#endif
// AVX-512 with the u8 x s8 dot product (dpbusd): cpu_quant_matmul.h's one-row kernels.
#if defined(SGL_NB_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define SGL_NB_AVX512_VNNI 1
#endif

namespace sgl_nb {

// Vector registers the compiler may use: AVX-512's encoding reaches 32 (ymm too), AVX2's 16.
#ifdef __AVX512F__
constexpr int kVectorRegisters = 32;
#else
constexpr int kVectorRegisters = 16;
#endif

// Asks for `bytes` from p to be brought into the caches (whole lines, in order).
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o);
}

inline float bf16_bits_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// A weight value as fp32: fp32 as is, bf16 (its bits) widened.
inline float widen(float v) { return v; }
inline float widen(uint16_t v) { return bf16_bits_to_float(v); }

#ifdef SGL_NB_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#ifdef SGL_NB_AVX512_VNNI
// The lower and upper 256 bits of v (AVX512F alone: no DQ's extractf32x8).
inline __m256 lower_half(__m512 v) { return _mm512_castps512_ps256(v); }
inline __m256 upper_half(__m512 v) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}
// lo in the lower 256 bits, hi in the upper (AVX512F alone: no DQ's insertf32x8).
inline __m512 join_halves(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)),
                                             _mm256_castps_pd(hi), 1));
}
#endif

// Four sums of eight lanes in one __m128, each added as ((v0+v1)+(v2+v3))+((v4+v5)+(v6+v7))
// whichever of the four it is: pass a vector twice for fewer sums and get the same bits.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// fp32 lanes rounded to bf16 as c10::BFloat16 rounds (nearest even; a NaN stays a NaN),
// left as fp32 bit patterns.
inline __m256i bf16_rounded_bits(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  r = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(nan));
}

// v rounded to T and widened back: float(T(v)) on each lane.
inline __m256 round_to(float, __m256 v) { return v; }
inline __m256 round_to(c10::BFloat16, __m256 v) {
  return _mm256_castsi256_ps(bf16_rounded_bits(v));
}

// T(v) stored to eight values at p.
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i r = _mm256_srli_epi32(bf16_rounded_bits(v), 16);
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// Eight values as fp32 (bf16 widens exactly: its bits are the top half of an fp32's).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::BFloat16* p) {
  return load8(reinterpret_cast<const uint16_t*>(p));
}

// exp on 8 lanes (Cephes' expf: 2^k times a degree-5 polynomial on |r| <= ln2 / 2, about
// 1 ulp); std::exp, one call per score, cost more than the rest of the attention.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

}  // namespace sgl_nb
