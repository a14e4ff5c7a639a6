// The small per-token operations between a decoder layer's matmuls in the fused CPU decode
// step (cpu_decode.cpp): RMSNorm, RoPE with the KV store, the gated activations, the
// residual add and the soft-cap. Each is a plain loop over a few thousand numbers and
// rounds where runtime/model/model.py's torch ops round: fp32 arithmetic, results in the
// activation dtype T (float or c10::BFloat16).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_simd.h"
#include "cpu_worker_pool.h"

namespace sgl_nb {

struct Shape {
  int64_t hidden, heads, kv_heads, head_dim, inter;
};

// Where a layer's K or V row for (slot, KV head) starts in its pool buffer, in elements. The
// buffers are [slots, kv_heads, head_dim] views (runtime/kv_pool.py): slot-major storage
// (head = head_dim) or head-major (slot = head_dim), each row's head_dim values adjacent.
struct KvRows {
  int64_t slot, head;
  int64_t at(int64_t s, int64_t h) const { return s * slot + h * head; }
};

// The KvRows of a layer's K and V buffers, checked: [slots, kv_heads, head_dim] of T with
// rows of adjacent values, K's strides V's.
template <typename T>
inline KvRows kv_rows(const at::Tensor& k, const at::Tensor& v, const Shape& s) {
  TORCH_CHECK(k.dim() == 3 && k.size(1) == s.kv_heads && k.size(2) == s.head_dim &&
                  k.stride(2) == 1 && v.sizes() == k.sizes() && v.strides() == k.strides() &&
                  k.scalar_type() == c10::CppTypeToScalarType<T>::value &&
                  v.scalar_type() == k.scalar_type(),
              "KV buffers: K and V [slots, kv_heads, head_dim] alike, rows of adjacent values "
              "in the activations' dtype");
  return {k.stride(0), k.stride(1)};
}

enum class Activation : int64_t { kSilu = 0, kGeluTanh = 1 };  // model_config.Activation

// out[r] = w * T(x[r] / rms(x[r])) over `rows` spans of n values; x is the fp32 residual
// stream or a T projection. out == x is allowed: each value is read before it is written.
template <typename In, typename T>
void rms_norm(const In* x_all, const T* w, T* out_all, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const In* x = x_all + r * n;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) ss += float(x[i]) * float(x[i]);
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    T* o = out_all + r * n;
    for (int64_t i = 0; i < n; ++i) o[i] = T(float(w[i]) * float(T(float(x[i]) * inv)));
  }
}

// One head of d values in fp32: its first `rotary` dims turned by RoPE
// (x * cos + roll(x, rotary / 2) * signed_sin, tables of `rotary` values), the rest as they
// are (partial rotary); cos == nullptr: a layer without RoPE.
template <typename T>
inline void rope_head(const T* x, const float* cos, const float* sin, float* out,
                      int64_t rotary, int64_t d) {
  int64_t i = 0;
  if (cos != nullptr) {
    const int64_t half = rotary / 2;
#ifdef SGL_NB_AVX2
    if (half % 8 == 0) {
      for (; i < half; i += 8) {
        const __m256 lo = load8(x + i), hi = load8(x + half + i);
        _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(cos + i)),
                                                _mm256_mul_ps(hi, _mm256_loadu_ps(sin + i))));
        _mm256_storeu_ps(out + half + i,
                         _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(cos + half + i)),
                                       _mm256_mul_ps(lo, _mm256_loadu_ps(sin + half + i))));
      }
      i = rotary;
    }
#endif
    for (; i < rotary; ++i) {
      out[i] = float(x[i]) * cos[i] + float(x[(i + half) % rotary]) * sin[i];
    }
  }
  for (; i < d; ++i) out[i] = float(x[i]);
}

// The pool rows rope_and_store will write (each request's new K and V at out_loc), asked
// for as the layer starts: the weights streamed since have evicted them, and a store that
// misses waits on the line. The layer's norm and qkv matmul then cover those misses: the
// step's RoPE and KV store 0.037 -> 0.017 ms, the step 2.72 -> 2.69 (int4 one stream,
// alternating in one process on a 2-core Zen 4, medians of 10).
template <typename T>
void prefetch_new_kv(const int64_t* out_loc, T* kbuf, T* vbuf, const KvRows& kv, int64_t batch,
                     const Shape& s) {
  const int64_t bytes = s.head_dim * static_cast<int64_t>(sizeof(T));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      const char* k = reinterpret_cast<const char*>(kbuf + kv.at(out_loc[b], h));
      const char* v = reinterpret_cast<const char*>(vbuf + kv.at(out_loc[b], h));
      for (int64_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch(k + off, /*write=*/1);
        __builtin_prefetch(v + off, /*write=*/1);
      }
    }
  }
}

// Calls part(begin, end) over [0, rows): at once below kRowsToSplit rows (a decode step's,
// where a job costs more than the loop), else split among the threads (an extend's tokens;
// each row's result is its own).
constexpr int64_t kRowsToSplit = 8;
template <typename F>
inline void over_rows(int64_t rows, const F& part) {
  if (rows < kRowsToSplit) return part(0, rows);
  WorkerPool::get().parallel_for(rows, part);
}

// rms_norm of each of `rows` rows (over_rows).
template <typename In, typename T>
void rms_norm_rows(const In* x, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  over_rows(rows, [&](int64_t r0, int64_t r1) {
    rms_norm<In, T>(x + r0 * n, w, out + r0 * n, r1 - r0, n, eps);
  });
}

// rope_and_store's rows [b0, b1).
template <typename T>
void rope_rows(const T* qkv, const float* cos, const float* sin, int64_t rotary,
               const int64_t* out_loc, T* kbuf, T* vbuf, const KvRows& kv, float* qf,
               int64_t b0, int64_t b1, const Shape& s, float scale) {
  const int64_t d = s.head_dim, width = (s.heads + 2 * s.kv_heads) * d;
  thread_local std::vector<float> rotated;  // this thread's own
  std::vector<float>& r = rotated;
  r.resize(d);
  for (int64_t b = b0; b < b1; ++b) {
    const T* row = qkv + b * width;
    const float* cb = cos == nullptr ? nullptr : cos + b * rotary;
    const float* sb = sin == nullptr ? nullptr : sin + b * rotary;
    for (int64_t h = 0; h < s.heads + s.kv_heads; ++h) {
      rope_head(row + h * d, cb, sb, r.data(), rotary, d);
      // The torch path rounds the rotated q/k to T before attention reads them (d % 8 == 0).
      int64_t i = 0;
      if (h < s.heads) {
        float* q = qf + (b * s.heads + h) * d;
#ifdef SGL_NB_AVX2
        for (; i < d; i += 8) {
          const __m256 x = round_to(T(), _mm256_loadu_ps(r.data() + i));
          _mm256_storeu_ps(q + i, _mm256_mul_ps(x, _mm256_set1_ps(scale)));
        }
#endif
        for (; i < d; ++i) q[i] = float(T(r[i])) * scale;
      } else {
        T* k = kbuf + kv.at(out_loc[b], h - s.heads);
#ifdef SGL_NB_AVX2
        for (; i < d; i += 8) store8(k + i, _mm256_loadu_ps(r.data() + i));
#endif
        for (; i < d; ++i) k[i] = T(r[i]);
      }
    }
    const T* v = row + (s.heads + s.kv_heads) * d;
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      std::copy(v + h * d, v + (h + 1) * d, vbuf + kv.at(out_loc[b], h));
    }
  }
}

// RoPE on q and k, k and v into the pool at out_loc, q (scaled, fp32) into qf. cos and sin
// are [batch, rotary] (nullptr: no RoPE in this layer). Rows as over_rows splits them.
template <typename T>
void rope_and_store(const T* qkv, const float* cos, const float* sin, int64_t rotary,
                    const int64_t* out_loc, T* kbuf, T* vbuf, const KvRows& kv, float* qf,
                    int64_t batch, const Shape& s, float scale) {
  over_rows(batch, [&](int64_t b0, int64_t b1) {
    rope_rows(qkv, cos, sin, rotary, out_loc, kbuf, vbuf, kv, qf, b0, b1, s, scale);
  });
}

// torch's gelu(approximate="tanh"): 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), with
// tanh(y) = 1 - 2 / (exp(2y) + 1) (finite for any y; the same formula in both loops).
constexpr float kGeluBeta = 0.7978845608028654f, kGeluKappa = 0.044715f;

inline float gelu_tanh(float x) {
  const float y = kGeluBeta * (x + kGeluKappa * (x * x * x));
  return 0.5f * x * (1.f + (1.f - 2.f / (std::exp(2.f * y) + 1.f)));
}

// o[i] = T(T(act(g[i])) * u[i]) for i < n, rounded as the torch path rounds it: 8 lanes at a
// time, then one by one. An output's bits depend on its index modulo 8 only through which
// loop computes it, so spans that start at multiples of 8 give act_mul's bits.
template <typename T>
inline void act_span(const T* g, const T* u, T* o, int64_t n, Activation act) {
  int64_t i = 0;
#ifdef SGL_NB_AVX2
  const __m256 one = _mm256_set1_ps(1.f), two = _mm256_set1_ps(2.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = load8(g + i);
    __m256 a;
    if (act == Activation::kSilu) {
      a = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
    } else {
      const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
      const __m256 y = _mm256_mul_ps(
          _mm256_set1_ps(kGeluBeta),
          _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(kGeluKappa), x3)));
      const __m256 e = exp8(_mm256_mul_ps(two, y));
      const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
      a = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, t));
    }
    store8(o + i, _mm256_mul_ps(round_to(T(), a), load8(u + i)));
  }
#endif
  for (; i < n; ++i) {
    const float x = float(g[i]);
    const float a = act == Activation::kSilu ? x / (1.f + std::exp(-x)) : gelu_tanh(x);
    o[i] = T(float(T(a)) * float(u[i]));
  }
}

// out = T(T(act(gate)) * up) over gu [rows, 2 * inter] (act_span per row). Rows split among
// the threads when there are several (at batch 16 the scalar loop took 7 ms of a 66 ms step).
template <typename T>
void act_mul(const T* gu, T* out, int64_t rows, int64_t inter, Activation act) {
  const auto part = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      act_span(gu + r * 2 * inter, gu + r * 2 * inter + inter, out + r * inter, inter, act);
    }
  };
  if (rows == 1) return part(0, 1);
  WorkerPool::get().parallel_for(rows, part);
}

// h += delta (T), or h += T(delta * scale) where the block's output is scaled (Granite's
// residual multiplier: the torch path scales in T, then adds to the fp32 stream).
template <typename T>
void add_into(float* h, const T* delta, int64_t n, float scale = 1.f) {
  if (scale == 1.f) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) h[i] += float(delta[i]);
    return;
  }
  for (int64_t i = 0; i < n; ++i) h[i] += float(T(float(delta[i]) * scale));
}

// s -> cap * tanh(s / cap) as 1 - 2 / (exp(2x) + 1): finite for any score (an exp of inf
// gives 1), and the same formula in the vector and the scalar loop.
inline void soft_cap(float* s, int64_t len, float cap) {
  const float twice_inv = 2.f / cap;
  int64_t i = 0;
#ifdef SGL_NB_AVX2
  const __m256 one = _mm256_set1_ps(1.f), two = _mm256_set1_ps(2.f);
  for (; i + 8 <= len; i += 8) {
    const __m256 e = exp8(_mm256_mul_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(twice_inv)));
    const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
    _mm256_storeu_ps(s + i, _mm256_mul_ps(t, _mm256_set1_ps(cap)));
  }
#endif
  for (; i < len; ++i) s[i] = cap * (1.f - 2.f / (std::exp(s[i] * twice_inv) + 1.f));
}

}  // namespace sgl_nb
