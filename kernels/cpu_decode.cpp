// One CPU decode step (one new token per request), token ids to logits, in one call.
//
// Why: at batch 1 the weight matmuls of the default model take 4-17 ms per step, while the
// ~35 small torch ops per layer around them cost ~12 ms more in Python and dispatch, and
// the ~40 around the layers (embedding, RoPE tables, the final norm, the LM head) ~0.5 ms.
// Here the matmuls are the kernels the torch path calls (cpu_quant_matmul.h for int8/int4,
// cpu_dense_matmul.h for fp32/bf16) and everything between them (RMSNorm, RoPE, the KV
// store, paged attention, SiLU, the residual adds) is a plain loop over a few thousand
// numbers.
//
// The arithmetic follows runtime/model/model.py: an fp32 residual stream; RMSNorm in fp32 whose
// result is rounded to the activation dtype T before the weight multiply; RoPE tables
// computed in fp32 and rounded to T; attention scores, softmax and the weighted sum in
// fp32; the LM head as linear.LogitsHead computes it.
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <mutex>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_dense_matmul.h"
#include "cpu_logits.h"
#include "cpu_quant_matmul.h"
#include "cpu_simd.h"
#include "cpu_worker_pool.h"

namespace {

using namespace sgl_nb;

enum LinearKind : int64_t { kDense = 0, kInt8 = 1, kInt4 = 2 };

// One linear layer: its kind and tensors, the bias last (empty when absent):
// dense [weight panels (cpu_dense_matmul.h) or torch's layout, bias]; int8 [weights
// interleaved (cpu_quant_matmul.h) or torch's layout, scales, bias]; int4 [torch packed,
// torch scale_zeros, our nibbles, scale, zero, bias]. Ours wherever the layer holds our layout.
struct LinearSpec {
  int64_t kind;
  std::vector<at::Tensor> t;
};

// y = l(x); our kernels write into `out` where it fits (output_rows).
at::Tensor run_linear(const LinearSpec& l, const at::Tensor& x, const at::Tensor& out = {}) {
  const at::Tensor& bias = l.t.back();
  switch (l.kind) {
    case kDense:
      if (dense_kernel_takes(l.t[0])) return dense_linear(x, l.t[0], bias, out);
      return at::linear(x, l.t[0], bias.numel() ? c10::optional<at::Tensor>(bias) : c10::nullopt);
    case kInt8:
      if (l.t[0].dim() == 3) return int8_linear(x, l.t[0], l.t[1], bias, out);
      {
        at::Tensor y = at::_weight_int8pack_mm(x, l.t[0], l.t[1]);
        if (bias.numel()) y.add_(bias);
        return y;
      }
    case kInt4:
      if (l.t[2].numel()) return int4_linear(x, l.t[2], l.t[3], l.t[4], bias, out);
      {
        at::Tensor y = at::_weight_int4pack_mm_for_cpu(x, l.t[0], kGroup, l.t[1]);
        if (bias.numel()) y.add_(bias);
        return y;
      }
    default:
      TORCH_CHECK(false, "unknown linear kind ", l.kind);
  }
}

// out[r] = w * T(h[r] / rms(h[r])), h fp32 [rows, n].
template <typename T>
void rms_norm(const float* h, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = h + r * n;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    T* o = out + r * n;
    for (int64_t i = 0; i < n; ++i) o[i] = T(float(w[i]) * float(T(x[i] * inv)));
  }
}

struct Shape {
  int64_t hidden, heads, kv_heads, head_dim, inter;
};

// x * cos + roll(x, D/2) * signed_sin, one head of D values, in fp32.
template <typename T>
inline void rope_head(const T* x, const float* cos, const float* sin, float* out, int64_t d) {
  const int64_t half = d / 2;
  int64_t i = 0;
#ifdef SGL_NB_AVX2
  for (; half % 8 == 0 && i < half; i += 8) {
    const __m256 lo = load8(x + i), hi = load8(x + half + i);
    _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(cos + i)),
                                            _mm256_mul_ps(hi, _mm256_loadu_ps(sin + i))));
    _mm256_storeu_ps(out + half + i,
                     _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(cos + half + i)),
                                   _mm256_mul_ps(lo, _mm256_loadu_ps(sin + half + i))));
  }
  if (i == half) return;
#endif
  for (; i < d; ++i) out[i] = float(x[i]) * cos[i] + float(x[(i + half) % d]) * sin[i];
}

// RoPE on q and k, k and v into the pool at out_loc, q (scaled, fp32) into qf.
template <typename T>
void rope_and_store(const T* qkv, const float* cos, const float* sin, const int64_t* out_loc,
                    T* kbuf, T* vbuf, float* qf, int64_t batch, const Shape& s, float scale) {
  const int64_t d = s.head_dim, width = (s.heads + 2 * s.kv_heads) * d;
  thread_local std::vector<float> rotated;
  std::vector<float>& r = rotated;
  r.resize(d);
  for (int64_t b = 0; b < batch; ++b) {
    const T* row = qkv + b * width;
    for (int64_t h = 0; h < s.heads + s.kv_heads; ++h) {
      rope_head(row + h * d, cos + b * d, sin + b * d, r.data(), d);
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
        T* k = kbuf + (out_loc[b] * s.kv_heads + (h - s.heads)) * d;
#ifdef SGL_NB_AVX2
        for (; i < d; i += 8) store8(k + i, _mm256_loadu_ps(r.data() + i));
#endif
        for (; i < d; ++i) k[i] = T(r[i]);
      }
    }
    const T* v = row + (s.heads + s.kv_heads) * d;
    std::copy(v, v + s.kv_heads * d, vbuf + out_loc[b] * s.kv_heads * d);
  }
}

// Eight K or V values as fp32, and the dot product / axpy of a head (d % 8 == 0) with them.
#ifdef SGL_NB_AVX2
// Scores of GN query heads (row stride d, fp32) against NK keys: out[g * stride + n]. Each
// key is widened once for all GN heads, and NK keys at a time give the core independent
// sums to overlap (1 key: GN chains of d / 8 dependent multiply-adds); each score is the
// same sum as a lone dot product (its own 8 lanes over d in order, then one horizontal sum).
template <int GN, int NK, typename T>
inline void scores_of_keys(const float* q, const T* const* k, int64_t d, float* out,
                           int64_t stride) {
  __m256 acc[GN][NK];
  for (int n = 0; n < NK; ++n) {
    const __m256 kv = load8(k[n]);
    for (int g = 0; g < GN; ++g) acc[g][n] = _mm256_mul_ps(_mm256_loadu_ps(q + g * d), kv);
  }
  for (int64_t i = 8; i < d; i += 8) {
    for (int n = 0; n < NK; ++n) {
      const __m256 kv = load8(k[n] + i);
      for (int g = 0; g < GN; ++g)
        acc[g][n] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * d + i), kv, acc[g][n]);
    }
  }
  // One horizontal sum for four keys (hsum4: the same order for each, whatever NK is).
  for (int g = 0; g < GN; ++g) {
    const __m128 sums = hsum4(acc[g][0], acc[g][std::min(1, NK - 1)],
                              acc[g][std::min(2, NK - 1)], acc[g][std::min(3, NK - 1)]);
    if constexpr (NK == 4) {
      _mm_storeu_ps(out + g * stride, sums);
    } else {
      alignas(16) float lanes[4];
      _mm_store_ps(lanes, sums);
      for (int n = 0; n < NK; ++n) out[g * stride + n] = lanes[n];
    }
  }
}

// out[g][e0 : e0 + 8 NV] = sum_j p[g * stride + j] v_j[e0 : ...] over `len` value rows,
// for GN heads, in registers; each output the same fma chain over j as a lone axpy loop.
template <int GN, int NV, typename T>
inline void weighted_values(const float* p, int64_t stride, const T* const* v, int64_t len,
                            int64_t e0, float* out, int64_t d) {
  __m256 o[GN][NV];
  for (int g = 0; g < GN; ++g)
    for (int m = 0; m < NV; ++m) o[g][m] = _mm256_setzero_ps();
  // GN weights, then one value vector at a time: 3 x 4 accumulators + 3 + 1 fill the 16
  // registers (holding all NV value vectors spilled an accumulator: 2x slower, measured).
  for (int64_t j = 0; j < len; ++j) {
    __m256 pj[GN];
    for (int g = 0; g < GN; ++g) pj[g] = _mm256_set1_ps(p[g * stride + j]);
    for (int m = 0; m < NV; ++m) {
      const __m256 vv = load8(v[j] + e0 + 8 * m);
      for (int g = 0; g < GN; ++g) o[g][m] = _mm256_fmadd_ps(pj[g], vv, o[g][m]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int m = 0; m < NV; ++m) _mm256_storeu_ps(out + g * d + e0 + 8 * m, o[g][m]);
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

// s[j] = exp(s[j] - max); returns (max, sum).
inline std::pair<float, float> exp_shifted(float* s, int64_t len) {
  // The max eight lanes at a time: one scalar chain of maxima was 13% of the attention.
  __m256 lanes = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(s + i));
  alignas(32) float part[8];
  _mm256_store_ps(part, lanes);
  float m = *std::max_element(part, part + 8);
  for (; i < len; ++i) m = std::max(m, s[i]);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = hsum(acc);
  for (; j < len; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  return {m, sum};
}
#else
inline std::pair<float, float> exp_shifted(float* s, int64_t len) {
  float m = -std::numeric_limits<float>::infinity(), sum = 0.f;
  for (int64_t j = 0; j < len; ++j) m = std::max(m, s[j]);
  for (int64_t j = 0; j < len; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  return {m, sum};
}
template <int GN, int NK, typename T>
inline void scores_of_keys(const float* q, const T* const* k, int64_t d, float* out,
                           int64_t stride) {
  for (int g = 0; g < GN; ++g) {
    for (int n = 0; n < NK; ++n) {
      float acc = 0.f;
      for (int64_t i = 0; i < d; ++i) acc += q[g * d + i] * float(k[n][i]);
      out[g * stride + n] = acc;
    }
  }
}
template <int GN, int NV, typename T>
inline void weighted_values(const float* p, int64_t stride, const T* const* v, int64_t len,
                            int64_t e0, float* out, int64_t d) {
  for (int g = 0; g < GN; ++g) {
    for (int64_t e = e0; e < e0 + 8 * NV; ++e) {
      float o = 0.f;
      for (int64_t j = 0; j < len; ++j) o += p[g * stride + j] * float(v[j][e]);
      out[g * d + e] = o;
    }
  }
}
#endif

// s[j] = cap * tanh(s[j] / cap) (Gemma 2's attention logit soft-cap), tanh written as
// 1 - 2 / (exp(2x) + 1): finite for any score (an exp of inf gives 1), and the same formula
// in the vector and the scalar loop.
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

template <typename T>
inline void prefetch_rows(const T* const* rows, int64_t n, int64_t bytes) {
  for (int64_t j = 0; j < n; ++j) {
    const char* row = reinterpret_cast<const char*>(rows[j]);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + off);
  }
}

// Decode attention, split like flash-decoding: one task per (request, KV head, chunk of at
// most kChunk of its tokens), whose `group` query heads read each K/V row once; each task
// keeps its running max, exp-sum and unnormalised output, merged per head afterwards. The
// split gives two cores work at batch 1, and a request's result does not depend on the rest
// of the batch.
constexpr int64_t kChunk = 128;

// f(std::integral_constant<int, min(left, 4)>): up to four query heads at a time.
template <typename F>
inline void head_block(int64_t left, const F& f) {
  switch (std::min<int64_t>(left, 4)) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    default: f(std::integral_constant<int, 4>()); break;
  }
}

// Query b attends to the slots indices[starts[b]:ends[b]]; chunks count from starts[b] (the
// request's first token, or its window's), so a token's result is the same in prefill and
// in any batch. softcap > 0: the scores (q comes scaled) are soft-capped before the softmax.
template <typename T>
void attention(const float* qf, const T* kbuf, const T* vbuf, const int64_t* starts,
               const int64_t* ends, const int64_t* indices, T* out, int64_t batch,
               const Shape& s, float softcap = 0.f) {
  const int64_t d = s.head_dim, group = s.heads / s.kv_heads;
  struct Task { int64_t b, kvh, begin, end; };
  // Scratch kept per calling thread (a decode step calls this once per layer), bound to
  // references: the workers must see the caller's vectors, not their own thread_locals.
  thread_local std::vector<Task> task_list;
  thread_local std::vector<int64_t> first_list, order_list;
  thread_local std::vector<float> mx_list, sum_list, acc_list, merged;
  std::vector<Task>& tasks = task_list;
  std::vector<int64_t>& first = first_list;  // tasks of (b, kvh): first[i]..first[i + 1]
  tasks.clear();
  first.assign(batch * s.kv_heads + 1, 0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t kvh = 0; kvh < s.kv_heads; ++kvh) {
      for (int64_t c = starts[b]; c < ends[b]; c += kChunk) {
        tasks.push_back({b, kvh, c, std::min(c + kChunk, ends[b])});
      }
      first[b * s.kv_heads + kvh + 1] = static_cast<int64_t>(tasks.size());
    }
  }
  const int64_t n = static_cast<int64_t>(tasks.size());
  // Whole chunks first, then the shorter tails, each thread taking the next task when it
  // is free: contiguous halves were uneven (batch 1 at 300 tokens: 556 keys against 344).
  // Which thread computes a task does not change its bits.
  std::vector<int64_t>& order = order_list;
  order.resize(n);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_partition(order.begin(), order.end(), [&](int64_t t) {
    return tasks[t].end - tasks[t].begin == kChunk;
  });
  std::atomic<int64_t> next{0};
  std::vector<float>& mx = mx_list;
  std::vector<float>& sum = sum_list;
  std::vector<float>& acc = acc_list;
  mx.resize(n * group);
  sum.resize(n * group);
  acc.resize(n * group * d);
  WorkerPool::get().parallel_for(n, [&](int64_t, int64_t) {
    thread_local std::vector<float> scores;  // this thread's own
    thread_local std::vector<const T*> rows, vrows;  // the task's K rows and V rows
    scores.resize(group * kChunk);
    rows.resize(kChunk);
    vrows.resize(kChunk);
    for (int64_t k; (k = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      const int64_t t = order[k];
      const Task& task = tasks[t];
      const int64_t len = task.end - task.begin;
      const float* q = qf + (task.b * s.heads + task.kvh * group) * d;
      for (int64_t j = 0; j < len; ++j) {
        const int64_t at = (indices[task.begin + j] * s.kv_heads + task.kvh) * d;
        rows[j] = kbuf + at;
        vrows[j] = vbuf + at;
      }
      // The rows sit in scattered slots, out of the hardware prefetcher's reach, and a
      // decode step finds them cold (the weights streamed through the cache since).
      prefetch_rows(rows.data(), len, d * sizeof(T));
      prefetch_rows(vrows.data(), len, d * sizeof(T));
      for (int64_t g = 0; g < group; g += 4) {
        head_block(group - g, [&](auto gn) {
          // Keys per block: 12 accumulators for up to three heads, 8 for four.
          constexpr int NK = gn() <= 3 ? 4 : 2;
          float* out = scores.data() + g * len;
          int64_t j = 0;
          for (; j + NK <= len; j += NK) {
            scores_of_keys<gn(), NK>(q + g * d, rows.data() + j, d, out + j, len);
          }
          for (; j < len; ++j) {
            scores_of_keys<gn(), 1>(q + g * d, rows.data() + j, d, out + j, len);
          }
        });
      }
      if (softcap > 0.f) soft_cap(scores.data(), group * len, softcap);
      for (int64_t g = 0; g < group; ++g) {
        const auto [m, l] = exp_shifted(scores.data() + g * len, len);
        mx[t * group + g] = m;
        sum[t * group + g] = l;
      }
      float* o = acc.data() + t * group * d;
      for (int64_t g = 0; g < group; g += 4) {
        head_block(group - g, [&](auto gn) {
          // Output columns per pass: 32 (12 accumulators) for up to three heads, else 16.
          constexpr int NV = gn() <= 3 ? 4 : 2;
          const float* p = scores.data() + g * len;
          int64_t e = 0;
          for (; e + 8 * NV <= d; e += 8 * NV) {
            weighted_values<gn(), NV>(p, len, vrows.data(), len, e, o + g * d, d);
          }
          for (; e + 16 <= d; e += 16) {
            weighted_values<gn(), 2>(p, len, vrows.data(), len, e, o + g * d, d);
          }
          if (e < d) weighted_values<gn(), 1>(p, len, vrows.data(), len, e, o + g * d, d);
        });
      }
    }
  });
  std::vector<float>& o = merged;
  o.resize(d);
  for (int64_t i = 0; i < batch * s.kv_heads; ++i) {
    const int64_t b = i / s.kv_heads, kvh = i % s.kv_heads;
    for (int64_t g = 0; g < group; ++g) {
      float m = -std::numeric_limits<float>::infinity(), l = 0.f;
      for (int64_t t = first[i]; t < first[i + 1]; ++t) m = std::max(m, mx[t * group + g]);
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t t = first[i]; t < first[i + 1]; ++t) {
        const float w = std::exp(mx[t * group + g] - m);
        l += w * sum[t * group + g];
        const float* a = acc.data() + (t * group + g) * d;
        for (int64_t e = 0; e < d; ++e) o[e] += w * a[e];
      }
      T* dst = out + (b * s.heads + kvh * group + g) * d;
      for (int64_t e = 0; e < d; ++e) dst[e] = T(o[e] / l);
    }
  }
}

// out = T(T(silu(gate)) * up), rounded as the torch path rounds it; gu [rows, 2 * inter].
// Rows split among the threads when there are several (at batch 16 the scalar loop took
// 7 ms of a 66 ms step).
template <typename T>
void silu_mul(const T* gu, T* out, int64_t rows, int64_t inter) {
  const auto part = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gu + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
      int64_t i = 0;
#ifdef SGL_NB_AVX2
      const __m256 one = _mm256_set1_ps(1.f);
      for (; i + 8 <= inter; i += 8) {
        const __m256 x = load8(g + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
        const __m256 silu = round_to(T(), _mm256_div_ps(x, _mm256_add_ps(one, e)));
        store8(o + i, _mm256_mul_ps(silu, load8(u + i)));
      }
#endif
      for (; i < inter; ++i) {
        const float x = float(g[i]);
        o[i] = T(float(T(x / (1.f + std::exp(-x)))) * float(u[i]));
      }
    }
  };
  if (rows == 1) return part(0, 1);
  WorkerPool::get().parallel_for(rows, part);
}

template <typename T>
void add_into(float* h, const T* delta, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) h[i] += float(delta[i]);
}

class DecodeStep {
 public:
  // Per layer: input and post-attention norm weights (norms) and the qkv, o, gate_up and
  // down linears (kinds, tensors as LinearSpec). Around them: the embedding [vocab, hidden]
  // and final norm in T, the RoPE inverse frequencies (fp32 [head_dim / 2]), the LM head as
  // a LinearSpec and, when its best `refine` candidates are recomputed (linear.LogitsHead),
  // its bf16 rows head16 (else empty).
  DecodeStep(std::vector<at::Tensor> norms, std::vector<int64_t> kinds,
             std::vector<std::vector<at::Tensor>> tensors, at::Tensor embed,
             at::Tensor inv_freq, at::Tensor final_norm, int64_t head_kind,
             std::vector<at::Tensor> head_tensors, at::Tensor head16, int64_t refine,
             int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : norms_(std::move(norms)), embed_(std::move(embed)), inv_freq_(std::move(inv_freq)),
        final_norm_(std::move(final_norm)), head_{head_kind, std::move(head_tensors)},
        head16_(std::move(head16)), refine_(refine), eps_(static_cast<float>(eps)) {
    const int64_t layers = static_cast<int64_t>(norms_.size()) / 2;
    TORCH_CHECK(static_cast<int64_t>(kinds.size()) == 4 * layers, "4 linears per layer");
    for (size_t i = 0; i < kinds.size(); ++i) linears_.push_back({kinds[i], tensors[i]});
    shape_ = {norms_[0].numel(), heads, kv_heads, head_dim, 0};
    dtype_ = norms_[0].scalar_type();
    TORCH_CHECK(head_dim % 8 == 0, "the fused CPU decode takes head_dim % 8 == 0");
    TORCH_CHECK(dtype_ == at::kFloat || dtype_ == at::kBFloat16,
                "the fused CPU decode takes float32 or bfloat16 activations");
    TORCH_CHECK(embed_.scalar_type() == dtype_ && embed_.is_contiguous() &&
                embed_.size(1) == shape_.hidden, "embedding: contiguous [vocab, hidden] in T");
    TORCH_CHECK(inv_freq_.scalar_type() == at::kFloat && inv_freq_.numel() == head_dim / 2,
                "inv_freq: float32 [head_dim / 2]");
  }

  // Per layer, the sliding window of its attention (0: none), and the attention logit
  // soft-cap of every layer (0: none): the kernels' window and softcap (kernels/__init__.py).
  void set_attention(std::vector<int64_t> windows, double softcap) {
    TORCH_CHECK(static_cast<int64_t>(windows.size()) == static_cast<int64_t>(norms_.size()) / 2,
                "set_attention: one window per layer");
    for (int64_t w : windows) TORCH_CHECK(w >= 0, "set_attention: a window must be >= 0");
    TORCH_CHECK(softcap >= 0, "set_attention: the softcap must be >= 0");
    std::lock_guard<std::mutex> lock(busy_);
    windows_ = std::move(windows);
    softcap_ = static_cast<float>(softcap);
  }

  // Logits, fp32 [B, vocab], of one new token per request: ids and positions [B] int64,
  // request b's KV slots kv_indices[kv_indptr[b]:kv_indptr[b + 1]] (the new token's last,
  // at out_loc[b]).
  at::Tensor logits(const at::Tensor& ids, const at::Tensor& positions,
                    const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                    const at::Tensor& out_loc, const std::vector<at::Tensor>& k_bufs,
                    const std::vector<at::Tensor>& v_bufs, double scale) {
    TORCH_CHECK(ids.dim() == 1 && positions.sizes() == ids.sizes() &&
                out_loc.sizes() == ids.sizes() && kv_indptr.numel() == ids.numel() + 1,
                "decode: ids, positions and out_loc [B], kv_indptr [B + 1]");
    pybind11::gil_scoped_release no_gil;  // other Python threads run during the step
    std::lock_guard<std::mutex> lock(busy_);
    if (dtype_ == at::kFloat) {
      return step<float>(ids, positions, kv_indptr, kv_indices, out_loc, k_bufs, v_bufs, scale);
    }
    return step<c10::BFloat16>(ids, positions, kv_indptr, kv_indices, out_loc, k_bufs, v_bufs,
                               scale);
  }

 private:
  template <typename T>
  at::Tensor step(const at::Tensor& ids_in, const at::Tensor& positions_in,
                  const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                  const at::Tensor& out_loc, const std::vector<at::Tensor>& k_bufs,
                  const std::vector<at::Tensor>& v_bufs, double scale) {
    const at::Tensor ids = ids_in.to(at::kLong).contiguous();
    const at::Tensor positions = positions_in.to(at::kLong).contiguous();
    const int64_t batch = ids.size(0), n = shape_.hidden, vocab = embed_.size(0);
    at::Tensor h = at::empty({batch, n}, embed_.options().dtype(at::kFloat));
    const int64_t* id = ids.data_ptr<int64_t>();
    const T* e = embed_.data_ptr<T>();
    float* hp = h.data_ptr<float>();
    for (int64_t b = 0; b < batch; ++b) {
      TORCH_CHECK(id[b] >= 0 && id[b] < vocab, "token id ", id[b], " outside the vocabulary");
      for (int64_t i = 0; i < n; ++i) hp[b * n + i] = float(e[id[b] * n + i]);
    }
    auto [cos, sin] = rope_tables<T>(positions);
    run<T>(h, cos, sin, kv_indptr, kv_indices, out_loc, k_bufs, v_bufs, scale);
    at::Tensor hn = at::empty({batch, n}, embed_.options());
    rms_norm<T>(h.data_ptr<float>(), final_norm_.data_ptr<T>(), hn.data_ptr<T>(), batch, n,
                eps_);
    at::Tensor logits = run_linear(head_, hn).to(at::kFloat).contiguous();
    if (head16_.numel()) refine_top_logits(logits, hn, head16_, refine_);
    return logits;
  }

  // cos and signed sin [B, head_dim] as runtime/model/model.py's rope_tables gives them (fp32
  // angles, the tables rounded to T), widened to fp32.
  template <typename T>
  std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& positions) const {
    const int64_t batch = positions.size(0), d = shape_.head_dim, half = d / 2;
    at::Tensor cos = at::empty({batch, d}, inv_freq_.options());
    at::Tensor sin = at::empty({batch, d}, inv_freq_.options());
    const int64_t* pos = positions.data_ptr<int64_t>();
    const float* f = inv_freq_.data_ptr<float>();
    float* c = cos.data_ptr<float>();
    float* sn = sin.data_ptr<float>();
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < half; ++i) {
        const float angle = static_cast<float>(pos[b]) * f[i];
        c[b * d + i] = c[b * d + half + i] = float(T(std::cos(angle)));
        sn[b * d + half + i] = float(T(std::sin(angle)));
        sn[b * d + i] = -sn[b * d + half + i];
      }
    }
    return {cos, sin};
  }

  // The decoder layers over h, the fp32 residual stream [B, hidden], in place.
  template <typename T>
  void run(at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
           const at::Tensor& kv_indptr, const at::Tensor& kv_indices, const at::Tensor& out_loc,
           const std::vector<at::Tensor>& k_bufs, const std::vector<at::Tensor>& v_bufs,
           double scale) {
    const int64_t batch = h.size(0), n = shape_.hidden, layers = norms_.size() / 2;
    Shape s = shape_;
    const auto opts = h.options().dtype(dtype_);
    at::Tensor xn = at::empty({batch, n}, opts);
    at::Tensor attn = at::empty({batch, s.heads * s.head_dim}, opts);
    at::Tensor qf = at::empty({batch, s.heads * s.head_dim}, h.options());
    at::Tensor act;
    float* hp = h.data_ptr<float>();
    const int64_t* indptr = kv_indptr.data_ptr<int64_t>();
    const int64_t* indices = kv_indices.data_ptr<int64_t>();
    // Each request's first visible slot per window: its own first slot, or its last `w`.
    std::vector<std::pair<int64_t, std::vector<int64_t>>> window_starts;
    for (int64_t w : windows_) {
      if (w == 0 || std::any_of(window_starts.begin(), window_starts.end(),
                                [&](const auto& ws) { return ws.first == w; })) {
        continue;
      }
      std::vector<int64_t> starts(batch);
      for (int64_t b = 0; b < batch; ++b) starts[b] = std::max(indptr[b], indptr[b + 1] - w);
      window_starts.emplace_back(w, std::move(starts));
    }
    const auto starts_of = [&](int64_t l) -> const int64_t* {
      const int64_t w = windows_.empty() ? 0 : windows_[l];
      for (const auto& ws : window_starts) {
        if (ws.first == w) return ws.second.data();
      }
      return indptr;
    };
    // Each role's output buffer serves every layer (and the next steps at this batch size).
    at::Tensor& qkv = outs_[0];
    at::Tensor& o = outs_[1];
    at::Tensor& gu = outs_[2];
    at::Tensor& down = outs_[3];
    for (int64_t l = 0; l < layers; ++l) {
      rms_norm<T>(hp, norms_[2 * l].data_ptr<T>(), xn.data_ptr<T>(), batch, n, eps_);
      qkv = run_linear(linears_[4 * l], xn, qkv);
      rope_and_store<T>(qkv.data_ptr<T>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                        out_loc.data_ptr<int64_t>(), k_bufs[l].data_ptr<T>(),
                        v_bufs[l].data_ptr<T>(), qf.data_ptr<float>(), batch, s,
                        static_cast<float>(scale));
      attention<T>(qf.data_ptr<float>(), k_bufs[l].data_ptr<T>(), v_bufs[l].data_ptr<T>(),
                   starts_of(l), indptr + 1, indices, attn.data_ptr<T>(), batch, s, softcap_);
      o = run_linear(linears_[4 * l + 1], attn, o);
      add_into<T>(hp, o.data_ptr<T>(), batch * n);
      rms_norm<T>(hp, norms_[2 * l + 1].data_ptr<T>(), xn.data_ptr<T>(), batch, n, eps_);
      gu = run_linear(linears_[4 * l + 2], xn, gu);
      const int64_t inter = gu.size(1) / 2;
      if (!act.defined()) act = at::empty({batch, inter}, opts);
      silu_mul<T>(gu.data_ptr<T>(), act.data_ptr<T>(), batch, inter);
      down = run_linear(linears_[4 * l + 3], act, down);
      add_into<T>(hp, down.data_ptr<T>(), batch * n);
    }
  }

  std::vector<at::Tensor> norms_;  // input and post-attention norm weights, per layer
  std::vector<int64_t> windows_;   // per layer, 0: none; empty: no layer has one
  float softcap_ = 0.f;
  std::vector<LinearSpec> linears_;  // qkv, o, gate_up, down, per layer
  at::Tensor embed_, inv_freq_, final_norm_;
  at::Tensor outs_[4];  // the qkv, o, gate_up and down outputs of the last step
  std::mutex busy_;     // outs_ serve one step at a time
  LinearSpec head_;
  at::Tensor head16_;
  int64_t refine_;
  float eps_;
  Shape shape_;
  at::ScalarType dtype_;
};

template <typename T>
at::Tensor attention_op(const at::Tensor& q, const at::Tensor& k_buffer,
                        const at::Tensor& v_buffer, const std::vector<int64_t>& starts,
                        const std::vector<int64_t>& ends, const at::Tensor& kv_indices,
                        float softcap) {
  const int64_t tokens = q.size(0), heads = q.size(1), kv_heads = k_buffer.size(1);
  const Shape s{0, heads, kv_heads, q.size(2), 0};
  at::Tensor qf = q.to(at::kFloat).contiguous();
  at::Tensor idx = kv_indices.to(at::kLong).contiguous();
  at::Tensor out = at::empty(q.sizes(), k_buffer.options());
  pybind11::gil_scoped_release no_gil;
  // Blocks of queries bound the per-task scratch (tokens x KV heads x chunks of the context).
  constexpr int64_t kBlock = 64;
  for (int64_t b0 = 0; b0 < tokens; b0 += kBlock) {
    const int64_t n = std::min(kBlock, tokens - b0), row = heads * s.head_dim;
    attention<T>(qf.data_ptr<float>() + b0 * row, k_buffer.data_ptr<T>(),
                 v_buffer.data_ptr<T>(), starts.data() + b0, ends.data() + b0,
                 idx.data_ptr<int64_t>(), out.data_ptr<T>() + b0 * row, n, s, softcap);
  }
  return out;
}

// window > 0: each query sees only the last `window` of its slots (it sits at the last one).
at::Tensor attention_dispatch(const at::Tensor& q, const at::Tensor& k_buffer,
                              const at::Tensor& v_buffer, std::vector<int64_t>& starts,
                              const std::vector<int64_t>& ends, const at::Tensor& kv_indices,
                              int64_t window, double softcap) {
  TORCH_CHECK(q.size(2) % 8 == 0 && q.size(1) % k_buffer.size(1) == 0, "attention: shapes");
  TORCH_CHECK(window >= 0 && softcap >= 0, "attention: window and softcap must be >= 0");
  if (window > 0) {
    for (size_t i = 0; i < starts.size(); ++i) starts[i] = std::max(starts[i], ends[i] - window);
  }
  const float cap = static_cast<float>(softcap);
  if (k_buffer.scalar_type() == at::kFloat) {
    return attention_op<float>(q, k_buffer, v_buffer, starts, ends, kv_indices, cap);
  }
  TORCH_CHECK(k_buffer.scalar_type() == at::kBFloat16, "attention: fp32 or bf16 KV");
  return attention_op<c10::BFloat16>(q, k_buffer, v_buffer, starts, ends, kv_indices, cap);
}

// One query per request: q [B, Hq, D], already scaled -> [B, Hq, D] in the KV dtype.
at::Tensor decode_attention_op(const at::Tensor& q, const at::Tensor& k_buffer,
                               const at::Tensor& v_buffer, const at::Tensor& kv_indptr,
                               const at::Tensor& kv_indices, int64_t window, double softcap) {
  at::Tensor p = kv_indptr.to(at::kLong).contiguous();
  const int64_t* ip = p.data_ptr<int64_t>();
  std::vector<int64_t> starts(ip, ip + q.size(0)), ends(ip + 1, ip + q.size(0) + 1);
  return attention_dispatch(q, k_buffer, v_buffer, starts, ends, kv_indices, window, softcap);
}

// New tokens against their request's cached prefix and themselves, causal: q [T, Hq, D].
at::Tensor extend_attention_op(const at::Tensor& q, const at::Tensor& k_buffer,
                               const at::Tensor& v_buffer, const at::Tensor& qo_indptr,
                               const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                               int64_t window, double softcap) {
  at::Tensor qo = qo_indptr.to(at::kLong).contiguous(), kv = kv_indptr.to(at::kLong).contiguous();
  const int64_t* qp = qo.data_ptr<int64_t>();
  const int64_t* kp = kv.data_ptr<int64_t>();
  std::vector<int64_t> starts, ends;
  for (int64_t b = 0; b + 1 < qo.numel(); ++b) {
    const int64_t q_len = qp[b + 1] - qp[b], prefix = kp[b + 1] - kp[b] - q_len;
    for (int64_t i = 0; i < q_len; ++i) {
      starts.push_back(kp[b]);
      ends.push_back(kp[b] + prefix + i + 1);
    }
  }
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == q.size(0), "extend: qo_indptr vs q");
  return attention_dispatch(q, k_buffer, v_buffer, starts, ends, kv_indices, window, softcap);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecodeStep>(m, "DecodeStep")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<int64_t>,
                          std::vector<std::vector<at::Tensor>>, at::Tensor, at::Tensor,
                          at::Tensor, int64_t, std::vector<at::Tensor>, at::Tensor, int64_t,
                          int64_t, int64_t, int64_t, double>())
      .def("logits", &DecodeStep::logits)
      .def("set_attention", &DecodeStep::set_attention);
  m.def("set_num_threads", [](int64_t n) { WorkerPool::get().threads.store(n); },
        "threads of this module's kernels (0: torch's setting)");
  m.def("stop_workers", [] {
    pybind11::gil_scoped_release no_gil;
    WorkerPool::get().stop();
  }, "stop and join the kernels' worker threads (a later call starts new ones)");
  // window 0: none; softcap 0: none.
  m.def("decode_attention", &decode_attention_op, pybind11::arg("q"), pybind11::arg("k_buffer"),
        pybind11::arg("v_buffer"), pybind11::arg("kv_indptr"), pybind11::arg("kv_indices"),
        pybind11::arg("window") = 0, pybind11::arg("softcap") = 0.0);
  m.def("dense_linear", [](const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
    pybind11::gil_scoped_release no_gil;
    return dense_linear(x, w, bias);
  });
  m.def("extend_attention", &extend_attention_op, pybind11::arg("q"), pybind11::arg("k_buffer"),
        pybind11::arg("v_buffer"), pybind11::arg("qo_indptr"), pybind11::arg("kv_indptr"),
        pybind11::arg("kv_indices"), pybind11::arg("window") = 0, pybind11::arg("softcap") = 0.0);
  m.def("refine_top_logits", [](at::Tensor logits, const at::Tensor& h, const at::Tensor& w,
                                int64_t r) {
    pybind11::gil_scoped_release no_gil;
    refine_top_logits(logits, h, w, r);
  });
  m.def("int8_linear", [](const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                          const at::Tensor& bias) {
    pybind11::gil_scoped_release no_gil;
    return int8_linear(x, w, scale, bias);
  });
  m.def("int4_linear", [](const at::Tensor& x, const at::Tensor& nib, const at::Tensor& scale,
                          const at::Tensor& zero, const at::Tensor& bias) {
    pybind11::gil_scoped_release no_gil;
    return int4_linear(x, nib, scale, zero, bias);
  });
}
