// Small AVX2 helpers shared by the CPU kernels; without AVX2 only the scalar ones exist.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SGL_NB_AVX2 1
#endif

namespace sgl_nb {

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

// Eight values as fp32 (bf16 widens exactly: its bits are the top half of an fp32's).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::BFloat16* p) {
  return load8(reinterpret_cast<const uint16_t*>(p));
}
#endif

}  // namespace sgl_nb
