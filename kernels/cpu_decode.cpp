// One CPU decode step (one new token per request), token ids to logits, in one call; and
// the same layers over an extend's new tokens (DecodeStep::hidden).
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
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <mutex>
#include <numeric>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_dense_matmul.h"
#include "cpu_gated_int4.h"
#include "cpu_layer_ops.h"
#include "cpu_logits.h"
#include "cpu_quant_matmul.h"
#include "cpu_simd.h"
#include "cpu_worker_pool.h"

namespace {

using namespace sgl_nb;

enum LinearKind : int64_t { kDense = 0, kInt8 = 1, kInt4 = 2 };

// Where a decode step's time goes (DecodeStep.phase_seconds): the calling thread's wall
// time between marks, summed over steps. A mark is one clock read (~25 ns, ~250 a step).
enum Phase : int {
  kEmbed, kNorms, kQkv, kRope, kAttention, kOProj, kGateUp, kActivation, kDown, kHead,
  kRefine, kPhases
};
constexpr const char* kPhaseNames[kPhases] = {
    "embedding and rope tables", "norms and residual adds", "qkv matmul", "rope and kv store",
    "attention", "o matmul", "gate_up matmul", "activation", "down matmul", "lm head matmul",
    "lm head refinement"};

// A null `sums` times nothing (an extend: phase_seconds describes decode steps).
class PhaseClock {
 public:
  explicit PhaseClock(std::array<double, kPhases>* sums) : sums_(sums) { restart(); }
  // The time since the last mark (or restart, or since this clock was made) goes to phase p.
  void mark(Phase p) {
    if (sums_ == nullptr) return;
    const auto now = std::chrono::steady_clock::now();
    (*sums_)[p] += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }
  // Time from here on is counted (what came before was marked elsewhere).
  void restart() {
    if (sums_ != nullptr) last_ = std::chrono::steady_clock::now();
  }

 private:
  std::array<double, kPhases>* sums_;
  std::chrono::steady_clock::time_point last_;
};

// One linear layer: its kind and tensors, the bias last (empty when absent):
// dense [weight panels (cpu_dense_matmul.h) or torch's layout, bias]; int8 [weights
// interleaved (cpu_quant_matmul.h) or torch's layout, scales, bias]; int4 [torch packed,
// torch scale_zeros, our nibbles, scale, zero, bias]. Ours wherever the layer holds our layout.
struct LinearSpec {
  int64_t kind;
  std::vector<at::Tensor> t;
  Int4Panels int4{};  // our int4 layout without a bias (with_int4): its checked pointers
};

// l with its Int4Panels filled where it is int4 in our layout and has no bias, so that no
// call checks its tensors again.
LinearSpec with_int4(LinearSpec l) {
  const bool ours = l.kind == kInt4 && l.t.size() == 6 && l.t[2].numel() && !l.t[5].numel();
  if (ours && l.t[2].dim() == 3) {
    l.int4 = int4_panels(l.t[2], l.t[3], l.t[4], l.t[2].size(1) * kGroup);
  }
  return l;
}

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

// Reads each cache line of a task's K rows and V rows (`bytes` each) once, one load after
// another with no arithmetic between, before the task's arithmetic starts. A decode step
// finds them cold (the weights streamed through the caches since), in pool slots that may
// lie anywhere; loads back to back keep many misses in flight at once.
// Software prefetches into L2, 64 keys ahead of the scores (and value rows again 8 ahead),
// left the attention at the mercy of the host's spells: in one process, alternating 256-
// token rounds, the step's attention took 0.311 ms with these loads against 0.514 (medians
// of 10, a 2-core Zen 4); in a standalone loop after 64 MB streamed, 13 us a layer against
// 20 at 174 keys.
template <typename T>
inline void touch_rows(const T* const* k, const T* const* v, int64_t n, int64_t bytes) {
  uint32_t sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    const auto* kr = reinterpret_cast<const unsigned char*>(k[j]);
    const auto* vr = reinterpret_cast<const unsigned char*>(v[j]);
    for (int64_t off = 0; off < bytes; off += 64) sum += kr[off] + vr[off];
  }
  // The sum kept, so that the loads are: an asm barrier costs nothing at run time.
  asm volatile("" : : "r"(sum));
}

// Eight K or V values as fp32, and the dot product / axpy of a head (d % 8 == 0) with them.
#ifdef SGL_NB_AVX2
// Scores of TB tokens' GN query heads each (q[t]: a token's heads, row stride d, fp32)
// against the same NK keys: out[t][g * stride + n]. Each key is widened once for all TB x GN
// heads, and NK keys at a time give the core independent sums to overlap (1 key: GN chains
// of d / 8 dependent multiply-adds); each score is the same sum as a lone dot product (its
// own 8 lanes over d in order, then one horizontal sum, hsum4's whichever group it is in).
template <int TB, int GN, int NK, typename T>
inline void scores_of_keys(const float* const* q, const T* const* k, int64_t d,
                           float* const* out, int64_t stride) {
  constexpr int kAcc = TB * GN * NK;
  __m256 acc[kAcc];  // [t][g][n]
  for (int n = 0; n < NK; ++n) {
    const __m256 kv = load8(k[n]);
    for (int t = 0; t < TB; ++t)
      for (int g = 0; g < GN; ++g)
        acc[(t * GN + g) * NK + n] = _mm256_mul_ps(_mm256_loadu_ps(q[t] + g * d), kv);
  }
  for (int64_t i = 8; i < d; i += 8) {
    for (int n = 0; n < NK; ++n) {
      const __m256 kv = load8(k[n] + i);
      for (int t = 0; t < TB; ++t) {
        for (int g = 0; g < GN; ++g) {
          __m256& a = acc[(t * GN + g) * NK + n];
          a = _mm256_fmadd_ps(_mm256_loadu_ps(q[t] + g * d + i), kv, a);
        }
      }
    }
  }
  if constexpr (NK == 4) {
    for (int t = 0; t < TB; ++t)
      for (int g = 0; g < GN; ++g) {
        const __m256* a = acc + (t * GN + g) * NK;
        _mm_storeu_ps(out[t] + g * stride, hsum4(a[0], a[1], a[2], a[3]));
      }
  } else {
    alignas(16) float lanes[(kAcc + 3) / 4 * 4];
    for (int i = 0; i < kAcc; i += 4) {
      _mm_store_ps(lanes + i, hsum4(acc[i], acc[std::min(i + 1, kAcc - 1)],
                                    acc[std::min(i + 2, kAcc - 1)], acc[std::min(i + 3, kAcc - 1)]));
    }
    for (int t = 0; t < TB; ++t)
      for (int g = 0; g < GN; ++g)
        for (int n = 0; n < NK; ++n) out[t][g * stride + n] = lanes[(t * GN + g) * NK + n];
  }
}

// out[t][g][e0 : e0 + 8 NV] = sum_j p[t][g * stride + j] v_j[e0 : ...] over `len` value rows,
// for TB tokens' GN heads each, in registers; each output the same fma chain over j as a
// lone axpy loop. Each value vector is widened once for all TB x GN heads.
template <int TB, int GN, int NV, typename T>
inline void weighted_values(const float* const* p, int64_t stride, const T* const* v,
                            int64_t len, int64_t e0, float* const* out, int64_t d) {
  __m256 o[TB][GN][NV];
  for (int t = 0; t < TB; ++t)
    for (int g = 0; g < GN; ++g)
      for (int m = 0; m < NV; ++m) o[t][g][m] = _mm256_setzero_ps();
  // The weights, then one value vector at a time: at most 12 accumulators (holding all NV
  // value vectors spilled an accumulator on AVX2's 16 registers: 2x slower, measured).
  for (int64_t j = 0; j < len; ++j) {
    __m256 pj[TB][GN];
    for (int t = 0; t < TB; ++t)
      for (int g = 0; g < GN; ++g) pj[t][g] = _mm256_set1_ps(p[t][g * stride + j]);
    for (int m = 0; m < NV; ++m) {
      const __m256 vv = load8(v[j] + e0 + 8 * m);
      for (int t = 0; t < TB; ++t)
        for (int g = 0; g < GN; ++g) o[t][g][m] = _mm256_fmadd_ps(pj[t][g], vv, o[t][g][m]);
    }
  }
  for (int t = 0; t < TB; ++t)
    for (int g = 0; g < GN; ++g)
      for (int m = 0; m < NV; ++m) _mm256_storeu_ps(out[t] + g * d + e0 + 8 * m, o[t][g][m]);
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
template <int TB, int GN, int NK, typename T>
inline void scores_of_keys(const float* const* q, const T* const* k, int64_t d,
                           float* const* out, int64_t stride) {
  for (int t = 0; t < TB; ++t) {
    for (int g = 0; g < GN; ++g) {
      for (int n = 0; n < NK; ++n) {
        float acc = 0.f;
        for (int64_t i = 0; i < d; ++i) acc += q[t][g * d + i] * float(k[n][i]);
        out[t][g * stride + n] = acc;
      }
    }
  }
}
template <int TB, int GN, int NV, typename T>
inline void weighted_values(const float* const* p, int64_t stride, const T* const* v,
                            int64_t len, int64_t e0, float* const* out, int64_t d) {
  for (int t = 0; t < TB; ++t) {
    for (int g = 0; g < GN; ++g) {
      for (int64_t e = e0; e < e0 + 8 * NV; ++e) {
        float o = 0.f;
        for (int64_t j = 0; j < len; ++j) o += p[t][g * stride + j] * float(v[j][e]);
        out[t][g * d + e] = o;
      }
    }
  }
}
#endif

// Decode attention, split like flash-decoding: one task per (request, KV head, chunk of at
// most kChunk of its tokens), whose `group` query heads read each K/V row once; each task
// keeps its running max, exp-sum and unnormalised output, merged per head by the task that
// finishes its (request, KV head) last. The split gives two cores work at batch 1, and a
// request's result does not depend on the rest of the batch.
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

// The tasks of one attention call: query b attends to the slots indices[starts[b]:ends[b]];
// chunks count from starts[b] (the request's first token, or its window's), so a token's
// result is the same in prefill and in any batch. The same for every layer that sees the
// same starts: a decode step plans once per window size, not once per layer (rebuilt per
// layer, the plan took ~0.6 us of each layer's attention).
struct AttentionPlan {
  struct Task {
    int64_t b, kvh, begin, end;
  };
  std::vector<Task> tasks;
  std::vector<int64_t> first;  // (b, kvh)'s tasks: first[i]..first[i + 1]
  // Whole chunks first, then the shorter tails, each thread taking the next task when it
  // is free: contiguous halves were uneven (batch 1 at 300 tokens: 556 keys against 344).
  // Where tokens share their slots (an extend's), by KV head and chunk instead: the tasks
  // that read the same K and V rows follow one another (see attention's touch_rows).
  // Which thread computes a task does not change its bits.
  std::vector<int64_t> order;
  // Runs of order that a thread takes at once: units[u]..units[u + 1]. Two tasks that read
  // the same keys (KV head, begin and end alike: an extend's tokens past the diagonal) make
  // one unit, their scores and weighted sums computed together (scores_of_keys).
  std::vector<int64_t> units;
  int64_t batch = 0, kv_heads = 0;
};

// plan's tasks for starts, ends [batch] over kv_heads KV heads (its vectors reused).
inline void plan_attention(const int64_t* starts, const int64_t* ends, int64_t batch,
                           int64_t kv_heads, AttentionPlan& plan) {
  plan.batch = batch;
  plan.kv_heads = kv_heads;
  plan.tasks.clear();
  plan.first.assign(batch * kv_heads + 1, 0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
      for (int64_t c = starts[b]; c < ends[b]; c += kChunk) {
        plan.tasks.push_back({b, kvh, c, std::min(c + kChunk, ends[b])});
      }
      plan.first[b * kv_heads + kvh + 1] = static_cast<int64_t>(plan.tasks.size());
    }
  }
  const int64_t n = static_cast<int64_t>(plan.tasks.size());
  plan.order.clear();
  for (const bool whole : {true, false}) {
    for (int64_t t = 0; t < n; ++t) {
      const bool full = plan.tasks[t].end - plan.tasks[t].begin == kChunk;
      if (full == whole) plan.order.push_back(t);
    }
  }
  bool shared = false;
  for (int64_t b = 1; b < batch && !shared; ++b) shared = starts[b] == starts[b - 1];
  if (shared) {
    std::stable_sort(plan.order.begin(), plan.order.end(), [&](int64_t a, int64_t c) {
      const AttentionPlan::Task &x = plan.tasks[a], &y = plan.tasks[c];
      return x.kvh != y.kvh ? x.kvh < y.kvh : x.begin < y.begin;
    });
  }
  // Task k joins the unit of k - 1 where that unit holds k - 1 alone and reads the same keys.
  const auto same_keys = [&](int64_t a, int64_t c) {
    const AttentionPlan::Task &x = plan.tasks[plan.order[a]], &y = plan.tasks[plan.order[c]];
    return x.kvh == y.kvh && x.begin == y.begin && x.end == y.end;
  };
  plan.units.clear();
  for (int64_t k = 0; k < n; ++k) {
    if (k == 0 || plan.units.back() != k - 1 || !same_keys(k - 1, k)) plan.units.push_back(k);
  }
  plan.units.push_back(n);
}

// One attention unit's tokens (AttentionPlan::units): per token its group query heads (q,
// row stride d, fp32), its scores' scratch (group x kChunk), and where its partial result
// goes: each head's max and exp-sum (mx, sum) and unnormalised output (out, [group][d]).
template <int TB>
struct UnitTokens {
  const float* q[TB];
  float* scores[TB];
  float *mx[TB], *sum[TB], *out[TB];
};

// The partial results of TB tokens over the same len keys (K rows, V rows). Two tokens at
// once took an extend's attention 44 -> 37 ms a layer (2,048 tokens, the default model's
// shape; builds alternating, medians of 12): each K and V vector is widened once for both.
// `u` by value: taken by reference, its pointers were reloaded in the loops (4% slower).
template <int TB, typename T>
void attend_keys(const UnitTokens<TB> u, const T* const* rows, const T* const* vrows,
                 int64_t len, int64_t group, int64_t d, float softcap) {
  for (int64_t g = 0; g < group; g += 4) {
    head_block(group - g, [&](auto gn) {
      // Keys per block: 12 accumulators for up to three heads a token, else 8.
      constexpr int NK = (gn() <= 3 ? 4 : 2) / TB;
      const float* q[TB];
      float* out[TB];
      for (int i = 0; i < TB; ++i) q[i] = u.q[i] + g * d;
      int64_t j = 0;
      for (; j + NK <= len; j += NK) {
        for (int i = 0; i < TB; ++i) out[i] = u.scores[i] + g * len + j;
        scores_of_keys<TB, gn(), NK>(q, rows + j, d, out, len);
      }
      for (; j < len; ++j) {
        for (int i = 0; i < TB; ++i) out[i] = u.scores[i] + g * len + j;
        scores_of_keys<TB, gn(), 1>(q, rows + j, d, out, len);
      }
    });
  }
  for (int i = 0; i < TB; ++i) {  // a token's scores: [group][len]
    if (softcap > 0.f) soft_cap(u.scores[i], group * len, softcap);
    for (int64_t g = 0; g < group; ++g) {
      std::tie(u.mx[i][g], u.sum[i][g]) = exp_shifted(u.scores[i] + g * len, len);
    }
  }
  for (int64_t g = 0; g < group; g += 4) {
    head_block(group - g, [&](auto gn) {
      // Tokens per pass: with 16 vector registers two tokens' weights and sums spill (an
      // extend's attention 45 -> 49 ms a layer, AVX2 code on a Zen 4): one at a time there.
      // Output columns per pass: 32 (12 accumulators) for up to three heads a token.
      constexpr int VB = kVectorRegisters >= 32 ? TB : 1, NV = (gn() <= 3 ? 4 : 2) / VB;
      const float* p[TB];
      float* o[TB];
      for (int i = 0; i < TB; ++i) {
        p[i] = u.scores[i] + g * len;
        o[i] = u.out[i] + g * d;
      }
      for (int i = 0; i < TB; i += VB) {
        int64_t e = 0;
        for (; e + 8 * NV <= d; e += 8 * NV) {
          weighted_values<VB, gn(), NV>(p + i, len, vrows, len, e, o + i, d);
        }
        for (; e < d; e += 8) weighted_values<VB, gn(), 1>(p + i, len, vrows, len, e, o + i, d);
      }
    });
  }
}

// softcap > 0: the scores (q comes scaled) are soft-capped before the softmax.
template <typename T>
void attention(const AttentionPlan& plan, const float* qf, const T* kbuf, const T* vbuf,
               const KvRows& kv, const int64_t* indices, T* out, const Shape& s,
               float softcap = 0.f) {
  TORCH_CHECK(plan.kv_heads == s.kv_heads, "attention: a plan for another model's KV heads");
  const int64_t d = s.head_dim, group = s.heads / s.kv_heads, batch = plan.batch;
  using Task = AttentionPlan::Task;
  const std::vector<Task>& tasks = plan.tasks;
  const std::vector<int64_t>& first = plan.first;
  const std::vector<int64_t>& order = plan.order;
  // Scratch kept per calling thread (a decode step calls this once per layer), bound to
  // references: the workers must see the caller's vectors, not their own thread_locals.
  thread_local std::vector<float> mx_list, sum_list, acc_list;
  // Per (b, kvh): its tasks not done. A line each: the two threads count down different
  // heads at once (attention 0.352 -> 0.344 ms a step with the pad, alternating in one process).
  struct alignas(64) Left {
    std::atomic<int64_t> tasks{0};
  };
  thread_local std::vector<Left> left_list;
  const int64_t n = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};
  std::vector<float>& mx = mx_list;
  std::vector<float>& sum = sum_list;
  std::vector<float>& acc = acc_list;
  mx.resize(n * group);
  sum.resize(n * group);
  acc.resize(n * group * d);
  std::vector<Left>& left = left_list;
  if (static_cast<int64_t>(left.size()) < batch * s.kv_heads) {
    left = std::vector<Left>(batch * s.kv_heads);
  }
  for (int64_t i = 0; i < batch * s.kv_heads; ++i) {
    left[i].tasks.store(first[i + 1] - first[i], std::memory_order_relaxed);
  }
  // Request b's KV head kvh: its tasks' partial results merged into its `group` heads of
  // out, in task order (the same sums whichever thread merges). Merged where its last task
  // ends, on that task's thread: the merge of a decode step's heads ran on the caller alone
  // after the tasks (on a prompt's 46 tokens, most of the attention's time).
  const auto merge = [&](int64_t i) {
    thread_local std::vector<float> merged;  // this thread's own
    std::vector<float>& o = merged;
    o.resize(d);
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
  };
  for (int64_t i = 0; i < batch * s.kv_heads; ++i) {
    if (first[i + 1] == first[i]) merge(i);  // no keys: no task will
  }
  // An extend's tokens read the same K and V rows, chunk by chunk (the plan's order): a
  // thread loads a chunk's lines ahead of its arithmetic once, for its first task there,
  // then only the rows a later token adds. Touched again for each token, a 2048-token
  // prompt's attention took 1.74 s against 1.49 (its time to first token 2.71 -> 2.48 s; 1024
  // tokens 0.42 -> 0.36 s of attention; int4, a 2-core Zen 4, alternating in one process).
  const uint64_t call = next_call_id();
  struct Touched {
    uint64_t call = 0;               // next_call_id's (a call is one layer's buffers)
    const int64_t* slots = nullptr;  // the chunk's first entry of indices
    int64_t kvh = -1, rows = 0;
  };
  WorkerPool::get().parallel_for(n, [&](int64_t, int64_t) {
    thread_local std::vector<float> scores;  // this thread's own
    thread_local std::vector<const T*> rows, vrows;  // the task's K rows and V rows
    thread_local Touched touched_here;
    Touched& touched = touched_here;
    scores.resize(2 * group * kChunk);  // a unit's tokens: two at most
    rows.resize(kChunk);
    vrows.resize(kChunk);
    // The unit's tasks ts[0..TB), each its token's heads, over the same len keys.
    const auto run = [&](auto tokens, const int64_t* ts, int64_t len) {
      constexpr int TB = decltype(tokens)::value;
      UnitTokens<TB> u;
      for (int i = 0; i < TB; ++i) {
        const Task& x = tasks[ts[i]];
        u.q[i] = qf + (x.b * s.heads + x.kvh * group) * d;
        u.scores[i] = scores.data() + i * group * kChunk;
        u.mx[i] = mx.data() + ts[i] * group;
        u.sum[i] = sum.data() + ts[i] * group;
        u.out[i] = acc.data() + ts[i] * group * d;
      }
      attend_keys<TB>(u, rows.data(), vrows.data(), len, group, d, softcap);
      for (int i = 0; i < TB; ++i) {
        // acq_rel: the last task's thread sees the other tasks' partial results.
        const Task& x = tasks[ts[i]];
        const int64_t h = x.b * s.kv_heads + x.kvh;
        if (left[h].tasks.fetch_sub(1, std::memory_order_acq_rel) == 1) merge(h);
      }
    };
    const int64_t units = static_cast<int64_t>(plan.units.size()) - 1;
    for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < units;) {
      const int64_t k = plan.units[u];
      const Task& task = tasks[order[k]];
      const int64_t len = task.end - task.begin;
      for (int64_t j = 0; j < len; ++j) {
        const int64_t at = kv.at(indices[task.begin + j], task.kvh);
        rows[j] = kbuf + at;
        vrows[j] = vbuf + at;
      }
      const int64_t* slots = indices + task.begin;
      if (touched.call != call || touched.slots != slots || touched.kvh != task.kvh) {
        touched = {call, slots, task.kvh, 0};
      }
      if (len > touched.rows) {
        touch_rows(rows.data() + touched.rows, vrows.data() + touched.rows, len - touched.rows,
                   d * static_cast<int64_t>(sizeof(T)));
        touched.rows = len;
      }
      if (plan.units[u + 1] - k == 2) {
        run(std::integral_constant<int, 2>(), order.data() + k, len);
      } else {
        run(std::integral_constant<int, 1>(), order.data() + k, len);
      }
    }
  });
}

enum class QKNorm : int64_t { kNone = 0, kPerHead = 1, kWhole = 2 };  // model_config.QKNorm

// What a model family changes from Llama's layer (runtime/model/model_config.py's fields),
// as the step reads it; each default is Llama's behaviour. Per-layer lists hold one entry
// per layer (two for norm pairs), an empty tensor where that layer has none; an empty list
// means no layer has any.
struct Family {
  std::vector<int64_t> windows;         // sliding window per layer, 0: none
  double attn_softcap = 0.0;            // attention scores' soft-cap, 0: none
  std::vector<at::Tensor> post_norms;   // per layer: on attention's output, on the MLP's
  int64_t qk_norm = 0;                  // QKNorm
  std::vector<at::Tensor> qk_norms;     // per layer: q's, k's
  std::vector<at::Tensor> inv_freqs;    // each RoPE's fp32 inverse frequencies [rotary / 2]
  std::vector<int64_t> rope_of_layer;   // index into inv_freqs, -1: the layer has no RoPE
  int64_t rotary_dim = 0;               // dims of each head that rotate, 0: head_dim
  int64_t activation = 0;               // Activation of the gated MLPs (and the experts')
  double embed_scale = 1.0, residual_scale = 1.0, logits_scaling = 1.0, final_softcap = 0.0;
  // Mixture-of-experts MLPs: per layer the router [experts, hidden] in T (empty: a dense
  // MLP) and each expert's gate_up and down linears, as the kinds and tensors of LinearSpec.
  std::vector<at::Tensor> routers;
  std::vector<std::vector<int64_t>> expert_kinds;
  std::vector<std::vector<std::vector<at::Tensor>>> expert_tensors;
  int64_t top_k = 0;
  bool norm_topk_prob = false;
};

// One MoE layer as the step runs it (runtime/model/moe.py's block, step for step).
struct Experts {
  at::Tensor router;
  std::vector<LinearSpec> linears;  // expert e: gate_up at 2e, down at 2e + 1
};

// One forward's rows as raw pointers, checked by the entry point that took them from its
// tensors: ids, positions and out_loc [batch] int64; row b attends to the slots
// indices[first[b]:ends[b]], its own new slot (out_loc[b]) last. A decode step's rows are
// requests, an extend's the new tokens of one.
struct StepRows {
  const int64_t *ids, *positions, *out_loc, *first, *ends, *indices;
  int64_t batch;
};

// A step's alternatives for the token picker (runtime/sampler.py's TopK): each row's best
// entries after the refinement and its logsumexp, the bits top_logits gives for that row.
struct StepTop {
  RowTop best;
  double* lse = nullptr;  // [rows]
};

// logits_ahead's: logits, tokens taken, and the rows' alternatives (ids, values, logsumexp).
using AheadTop = std::tuple<std::vector<std::vector<int64_t>>, std::vector<std::vector<float>>,
                            std::vector<double>>;
using AheadResult = std::tuple<at::Tensor, at::Tensor, std::optional<AheadTop>>;

class DecodeStep {
 public:
  // Per layer: the norm weights before attention and before the MLP (norms; empty: none)
  // and the qkv, o, gate_up and down linears (kinds, tensors as LinearSpec; a MoE layer's
  // gate_up and down are empty). Around them: the embedding [vocab, hidden] and final norm
  // in T, the LM head as a LinearSpec and, when its best `refine` candidates are recomputed
  // (linear.LogitsHead), its bf16 rows head16 (else empty). `family`: the rest.
  DecodeStep(std::vector<at::Tensor> norms, std::vector<int64_t> kinds,
             std::vector<std::vector<at::Tensor>> tensors, at::Tensor embed,
             at::Tensor final_norm, int64_t head_kind, std::vector<at::Tensor> head_tensors,
             at::Tensor head16, int64_t refine, int64_t heads, int64_t kv_heads,
             int64_t head_dim, double eps, Family family)
      : norms_(std::move(norms)), embed_(std::move(embed)), final_norm_(std::move(final_norm)),
        head_{head_kind, std::move(head_tensors)}, head16_(std::move(head16)),
        refine_(refine), eps_(static_cast<float>(eps)), f_(std::move(family)) {
    const int64_t layers = static_cast<int64_t>(norms_.size()) / 2;
    TORCH_CHECK(static_cast<int64_t>(kinds.size()) == 4 * layers, "4 linears per layer");
    shape_ = {embed_.size(1), heads, kv_heads, head_dim, 0};
    for (size_t i = 0; i < kinds.size(); ++i) {
      linears_.push_back(with_int4({kinds[i], tensors[i]}));
    }
    head_ = with_int4(std::move(head_));
    dtype_ = embed_.scalar_type();
    TORCH_CHECK(head_dim % 8 == 0, "the fused CPU decode takes head_dim % 8 == 0");
    TORCH_CHECK(dtype_ == at::kFloat || dtype_ == at::kBFloat16,
                "the fused CPU decode takes float32 or bfloat16 activations");
    TORCH_CHECK(embed_.is_contiguous(), "embedding: contiguous [vocab, hidden] in T");
    check_family(layers);
    const auto take = [&](const at::Tensor& w) {
      TORCH_CHECK(!w.numel() || (w.scalar_type() == dtype_ && w.is_contiguous() &&
                                 w.numel() == shape_.hidden),
                  "norm weights: empty, or [hidden] contiguous in the activations' dtype");
      norm_weights_.push_back(w.numel() ? w.data_ptr() : nullptr);
    };
    for (const at::Tensor& w : norms_) take(w);
    take(final_norm_);
    if (head16_.numel()) {
      TORCH_CHECK(head16_.scalar_type() == at::kBFloat16 && head16_.is_contiguous() &&
                      head16_.dim() == 2 && head16_.size(1) == shape_.hidden,
                  "the head's refinement rows: [vocab, hidden] contiguous bfloat16");
      head16_bits_ = reinterpret_cast<const uint16_t*>(head16_.data_ptr());
      head16_rows_ = head16_.size(0);
    }
  }

  // y = l(x) into `out`, made [rows, n] where it does not fit: an int4 linear on its
  // checked pointers (LinearSpec::int4) where x has its width, any other through run_linear
  // (which names a wrong width).
  template <typename T>
  static void linear(const LinearSpec& l, const at::Tensor& x, at::Tensor& out) {
    if (l.int4.nib == nullptr || x.size(1) != l.int4.k) {
      out = run_linear(l, x, out);
      return;
    }
    const int64_t rows = x.size(0);
    out = output_rows(out, rows, l.int4.n, x.options());
    int4_matmul(x.data_ptr<T>(), rows, l.int4, out.data_ptr<T>());
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
    const at::Tensor id = ids.to(at::kLong).contiguous();
    const at::Tensor pos = positions.to(at::kLong).contiguous();
    const at::Tensor loc = out_loc.to(at::kLong).contiguous();
    const at::Tensor ip = kv_indptr.to(at::kLong).contiguous();
    const at::Tensor kv = kv_indices.to(at::kLong).contiguous();
    const int64_t batch = ids.numel();
    const int64_t* p = ip.data_ptr<int64_t>();
    const StepRows rows{id.data_ptr<int64_t>(), pos.data_ptr<int64_t>(), loc.data_ptr<int64_t>(),
                        p, p + 1, kv.data_ptr<int64_t>(), batch};
    pybind11::gil_scoped_release no_gil;  // other Python threads run during the step
    std::lock_guard<std::mutex> lock(busy_);
    const c10::InferenceMode normal_tensors(false);  // see outs_
    phases_ = &phase_s_;
    at::Tensor logits = at::empty({batch, embed_.size(0)}, kv.options().dtype(at::kFloat));
    if (dtype_ == at::kFloat) {
      step<float>(rows, k_bufs, v_bufs, scale, logits.data_ptr<float>());
    } else {
      step<c10::BFloat16>(rows, k_bufs, v_bufs, scale, logits.data_ptr<float>());
    }
    return logits;
  }

  // An extend's residual stream after the last layer, fp32 [R, hidden], at `rows` [R] of
  // its new tokens (before the final norm: the model's LM head goes on from there). ids,
  // positions and out_loc [T] int64; token t attends to kv_indices[first[t]:ends[t]], its
  // own slot out_loc[t] last. The decode step's own code on T rows: a token gets the same
  // bits in a prompt, in a pass that verifies drafts and in a decode step.
  at::Tensor hidden(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& first,
                    const at::Tensor& ends, const at::Tensor& kv_indices,
                    const at::Tensor& out_loc, const std::vector<at::Tensor>& k_bufs,
                    const std::vector<at::Tensor>& v_bufs, double scale,
                    const at::Tensor& rows) {
    const int64_t tokens = ids.numel();
    TORCH_CHECK(ids.dim() == 1 && positions.sizes() == ids.sizes() &&
                out_loc.sizes() == ids.sizes() && first.sizes() == ids.sizes() &&
                ends.sizes() == ids.sizes(), "extend: ids, positions, out_loc, first and ends [T]");
    const at::Tensor f = first.to(at::kLong).contiguous(), e = ends.to(at::kLong).contiguous();
    const at::Tensor r = rows.to(at::kLong).contiguous();
    const int64_t *fp = f.data_ptr<int64_t>(), *ep = e.data_ptr<int64_t>();
    for (int64_t t = 0; t < tokens; ++t) {
      TORCH_CHECK(0 <= fp[t] && fp[t] < ep[t] && ep[t] <= kv_indices.numel(),
                  "extend: token ", t, " sees no slot or slots past kv_indices");
    }
    const int64_t* rp = r.data_ptr<int64_t>();
    for (int64_t i = 0; i < r.numel(); ++i) {
      TORCH_CHECK(0 <= rp[i] && rp[i] < tokens, "extend: row ", rp[i], " is not a new token");
    }
    pybind11::gil_scoped_release no_gil;
    std::lock_guard<std::mutex> lock(busy_);
    const c10::InferenceMode normal_tensors(false);  // see outs_
    phases_ = nullptr;
    const at::Tensor id = ids.to(at::kLong).contiguous();
    const at::Tensor pos = positions.to(at::kLong).contiguous();
    const at::Tensor kv = kv_indices.to(at::kLong).contiguous();
    const at::Tensor loc = out_loc.to(at::kLong).contiguous();
    const StepRows step_rows{id.data_ptr<int64_t>(), pos.data_ptr<int64_t>(),
                             loc.data_ptr<int64_t>(), fp, ep, kv.data_ptr<int64_t>(), tokens};
    if (dtype_ == at::kFloat) return extend_hidden<float>(step_rows, k_bufs, v_bufs, scale, r);
    return extend_hidden<c10::BFloat16>(step_rows, k_bufs, v_bufs, scale, r);
  }

  // Up to `steps` decode steps in one call, each request's next token its greedy pick (the
  // first largest logit, the first NaN if any: numpy's argmax, runtime/sampler.py's greedy
  // rule). Request b's KV slots kv_indices[kv_indptr[b]:kv_indptr[b + 1]] end with the
  // `steps` slots of its new tokens; step s sees the range up to its own new slot. The
  // steps end early once every request's pick is one of stop_ids, or once interrupt() has
  // been called since interrupts() returned `mark` (new work for the caller to schedule).
  // Returns the logits of the steps run, fp32 [done, B, vocab], the tokens steps 1 ...
  // done - 1 took, [done - 1, B] int64, and (where `alternatives` > 0 and the refinement
  // can give them: refines_last, alternatives <= its candidates + 1) each row's
  // alternatives as top_logits gives them, rows in [done][B] order, else None. Why: at
  // batch 1 the engine's Python between two steps costs as much as the attention of all
  // layers; the caller checks each pick as it checks any draft.
  AheadResult logits_ahead(
      const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& kv_indptr,
      const at::Tensor& kv_indices, const std::vector<at::Tensor>& k_bufs,
      const std::vector<at::Tensor>& v_bufs, double scale, int64_t steps,
      const std::vector<int64_t>& stop_ids, int64_t mark, int64_t alternatives) {
    const int64_t batch = ids.numel();
    TORCH_CHECK(ids.dim() == 1 && positions.sizes() == ids.sizes() &&
                kv_indptr.numel() == batch + 1 && steps >= 1,
                "decode ahead: ids and positions [B], kv_indptr [B + 1], steps >= 1");
    const at::Tensor indptr = kv_indptr.to(at::kLong).contiguous();
    const at::Tensor indices = kv_indices.to(at::kLong).contiguous();
    const int64_t* ip = indptr.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) {
      TORCH_CHECK(ip[b + 1] - ip[b] >= steps && ip[b + 1] <= indices.numel(),
                  "decode ahead: request ", b, " has fewer KV slots than steps");
    }
    const auto stopped = [&](const int64_t* picks) {
      for (int64_t b = 0; b < batch; ++b) {
        if (std::find(stop_ids.begin(), stop_ids.end(), picks[b]) == stop_ids.end()) return false;
      }
      return true;
    };
    pybind11::gil_scoped_release no_gil;
    std::lock_guard<std::mutex> lock(busy_);
    const c10::InferenceMode normal_tensors(false);  // see outs_
    phases_ = &phase_s_;
    const auto opts = indptr.options();
    const int64_t vocab = embed_.size(0);
    at::Tensor logits = at::empty({steps, batch, vocab}, opts.dtype(at::kFloat));
    at::Tensor tokens = at::empty({steps, batch}, opts);
    at::Tensor step_ids = ids.to(at::kLong).clone();
    at::Tensor pos = positions.to(at::kLong).clone();
    // Step s's KV ranges, filled in place (each range without the slots of later steps).
    at::Tensor sp = at::empty({batch + 1}, opts), si = at::empty_like(indices);
    at::Tensor out = at::empty({batch}, opts);
    const int64_t* all = indices.data_ptr<int64_t>();
    int64_t *range_ip = sp.data_ptr<int64_t>(), *range_slots = si.data_ptr<int64_t>();
    int64_t *last_slots = out.data_ptr<int64_t>(), *step_pos = pos.data_ptr<int64_t>();
    float* logits_out = logits.data_ptr<float>();
    int64_t* token_out = tokens.data_ptr<int64_t>();
    int64_t* step_id = step_ids.data_ptr<int64_t>();
    const StepRows rows{step_id, step_pos, last_slots, range_ip, range_ip + 1, range_slots,
                        batch};
    const int64_t k = alternatives > 0 && refines_last() && alternatives <= refine_ + 1
                          ? std::min(alternatives, vocab) : 0;
    std::vector<int64_t> top_ids(steps * batch * k);
    std::vector<float> top_values(top_ids.size());
    std::vector<double> top_lse(k ? steps * batch : 0);
    // The refinement ranks each row's best entries anyway; the pick comes from them where
    // nothing changes the logits after it (refine_top_logits), else from a pass of its own.
    const bool picked_by_refine = refines_last();
    int64_t done = steps;
    for (int64_t s = 0; s < steps; ++s) {
      ahead_ranges(ip, all, batch, steps - 1 - s, range_ip, range_slots, last_slots);
      // Raw pointers from here to the next step: a tensor op costs microseconds here,
      // where the step's weight reads have left the dispatcher's data out of cache.
      int64_t* picks = token_out + s * batch;  // the last step's: not returned
      int64_t* refine_picks = picked_by_refine ? picks : nullptr;
      float* step_logits = logits_out + s * batch * vocab;
      const StepTop top{{k, top_ids.data() + s * batch * k, top_values.data() + s * batch * k},
                        top_lse.data() + s * batch};
      const StepTop* step_top = k ? &top : nullptr;
      if (dtype_ == at::kFloat) {
        step<float>(rows, k_bufs, v_bufs, scale, step_logits, refine_picks, step_top);
      } else {
        step<c10::BFloat16>(rows, k_bufs, v_bufs, scale, step_logits, refine_picks, step_top);
      }
      if (s + 1 == steps) break;
      if (interrupts_.load(std::memory_order_acquire) != mark) {
        done = s + 1;
        break;
      }
      if (!picked_by_refine) first_argmax(step_logits, batch, vocab, picks);
      if (stopped(picks)) {
        done = s + 1;
        break;
      }
      std::copy(picks, picks + batch, step_id);
      for (int64_t b = 0; b < batch; ++b) ++step_pos[b];
    }
    std::optional<AheadTop> alts;
    if (k) {
      AheadTop a;
      auto& [a_ids, a_values, a_lse] = a;
      for (int64_t i = 0; i < done * batch; ++i) {
        a_ids.emplace_back(top_ids.begin() + i * k, top_ids.begin() + (i + 1) * k);
        a_values.emplace_back(top_values.begin() + i * k, top_values.begin() + (i + 1) * k);
      }
      a_lse.assign(top_lse.begin(), top_lse.begin() + done * batch);
      alts = std::move(a);
    }
    return {logits.slice(0, 0, done), tokens.slice(0, 0, done - 1), std::move(alts)};
  }

  // Ends a logits_ahead in progress (or the next one, given an earlier mark) after its
  // current step; from any thread (logits_ahead runs without the GIL).
  void interrupt() { interrupts_.fetch_add(1, std::memory_order_release); }
  int64_t interrupts() const { return interrupts_.load(std::memory_order_acquire); }

  // Seconds spent in each phase over the steps since the last call, by name; then zeroes.
  std::vector<std::pair<std::string, double>> phase_seconds() {
    std::lock_guard<std::mutex> lock(busy_);
    std::vector<std::pair<std::string, double>> out;
    for (int p = 0; p < kPhases; ++p) out.emplace_back(kPhaseNames[p], phase_s_[p]);
    phase_s_.fill(0.0);
    return out;
  }

 private:
  // Into p, dst and last: the kv_indptr, kv_indices and out_loc (each range's last slot) of
  // one step of a decode ahead, each request's range without its last `later` slots (those
  // of the steps after it), from all of them (ip, all).
  static void ahead_ranges(const int64_t* ip, const int64_t* all, int64_t batch, int64_t later,
                           int64_t* p, int64_t* dst, int64_t* last) {
    p[0] = 0;
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t n = ip[b + 1] - ip[b] - later;
      std::copy(all + ip[b], all + ip[b] + n, dst + p[b]);
      p[b + 1] = p[b] + n;
      last[b] = all[ip[b] + n - 1];
    }
  }

  // top.lse of each of the rows, given their best entries: logsumexp's blocks on the step's
  // threads (each core mostly on the half of the row its part of the head wrote), then
  // their sum per row on this one. In the token picker's top_logits it took ~17 us a token,
  // most of it reading the rows back from memory after the later steps' weight reads.
  void logsumexps(const float* logits, int64_t batch, int64_t vocab, const StepTop& top) {
    const int64_t blocks = exp_blocks(vocab), k = top.best.k;
    exp_sums_.resize(batch * blocks);
    float* sums = exp_sums_.data();
    WorkerPool::get().parallel_for(batch * blocks, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t t = i / blocks;
        sums[i] = exp_block_sum(logits + t * vocab, vocab, top.best.values[t * k], i % blocks);
      }
    });
    for (int64_t t = 0; t < batch; ++t) {
      top.lse[t] = logsumexp_of_blocks(logits + t * vocab, vocab, top.best.values[t * k],
                                       [&](int64_t j) { return sums[t * blocks + j]; });
    }
  }

  // Whether the head's refinement gives the logits their last change (the picks it ranks
  // are then the rows' argmax): no Granite scaling nor final soft-cap after it.
  bool refines_last() const {
    return head16_.numel() && f_.logits_scaling == 1.0 && f_.final_softcap <= 0;
  }

  // Per row of rows [B, vocab] (fp32), numpy's argmax into tokens [B]: the first largest
  // logit, or the first NaN. Blocks of the row on the step's threads (each block's
  // largest and where it first is, two vectorised passes), then the first block holding
  // the row's: the head's threads wrote the row, half of it in the other core's cache, and
  // one thread over all of it took ~35 us a step against ~20 (measured, int4 at batch 1).
  static void first_argmax(const float* rows, int64_t batch, int64_t vocab, int64_t* tokens) {
    constexpr int64_t kBlock = 4096;
    const int64_t blocks = (vocab + kBlock - 1) / kBlock;
    struct Best { float peak; int64_t at; bool nan; };
    std::vector<Best> best(blocks);
    for (int64_t b = 0; b < batch; ++b) {
      const float* r = rows + b * vocab;
      WorkerPool::get().parallel_for(blocks, [&](int64_t begin, int64_t end) {
        for (int64_t k = begin; k < end; ++k) {
          const int64_t lo = k * kBlock, hi = std::min(lo + kBlock, vocab);
          float peak = -std::numeric_limits<float>::infinity();
          int nans = 0;
#pragma omp simd reduction(max : peak) reduction(+ : nans)
          for (int64_t i = lo; i < hi; ++i) {
            peak = std::max(peak, r[i]);  // a NaN never replaces it: counted apart
            nans += r[i] != r[i];
          }
          int64_t at = lo;  // a block of -inf only: its first, as numpy's whole row
          while (at < hi && !(nans ? r[at] != r[at] : r[at] == peak)) ++at;
          best[k] = {peak, at, nans > 0};
        }
      });
      int64_t pick = -1;
      for (int64_t k = 0; k < blocks && pick < 0; ++k) {
        if (best[k].nan) pick = best[k].at;
      }
      if (pick < 0) {
        int64_t top = 0;
        for (int64_t k = 1; k < blocks; ++k) {
          if (best[k].peak > best[top].peak) top = k;
        }
        pick = best[top].at;
      }
      tokens[b] = pick;
    }
  }

  void check_family(int64_t layers) {
    const auto per_layer = [&](size_t n, size_t each, const char* what) {
      TORCH_CHECK(n == 0 || n == static_cast<size_t>(layers * each), "family: ", what,
                  " must have ", each, " per layer");
    };
    per_layer(f_.windows.size(), 1, "windows");
    per_layer(f_.post_norms.size(), 2, "post_norms");
    per_layer(f_.qk_norms.size(), 2, "qk_norms");
    per_layer(f_.routers.size(), 1, "routers");
    for (int64_t w : f_.windows) TORCH_CHECK(w >= 0, "family: a window must be >= 0");
    TORCH_CHECK(f_.attn_softcap >= 0 && f_.final_softcap >= 0, "family: soft-caps >= 0");
    TORCH_CHECK(f_.qk_norm >= 0 && f_.qk_norm <= 2, "family: qk_norm 0, 1 or 2");
    TORCH_CHECK(f_.qk_norm == 0 || !f_.qk_norms.empty(), "family: qk_norm without weights");
    TORCH_CHECK(f_.activation == 0 || f_.activation == 1, "family: activation 0 or 1");
    if (f_.rotary_dim == 0) f_.rotary_dim = shape_.head_dim;
    TORCH_CHECK(f_.rotary_dim % 2 == 0 && f_.rotary_dim <= shape_.head_dim,
                "family: rotary_dim even and at most head_dim");
    for (const at::Tensor& inv : f_.inv_freqs) {
      TORCH_CHECK(inv.scalar_type() == at::kFloat && inv.is_contiguous() &&
                  inv.numel() == f_.rotary_dim / 2, "inv_freqs: float32 [rotary_dim / 2]");
      inv_freqs_.push_back(inv.data_ptr<float>());
    }
    if (f_.rope_of_layer.empty()) f_.rope_of_layer.assign(layers, f_.inv_freqs.empty() ? -1 : 0);
    TORCH_CHECK(static_cast<int64_t>(f_.rope_of_layer.size()) == layers,
                "family: rope_of_layer must have 1 per layer");
    for (int64_t r : f_.rope_of_layer) {
      TORCH_CHECK(r >= -1 && r < static_cast<int64_t>(f_.inv_freqs.size()),
                  "family: rope_of_layer indexes inv_freqs (-1: none)");
    }
    for (size_t l = 0; l < f_.routers.size(); ++l) {
      Experts e{f_.routers[l], {}};
      if (e.router.numel()) {
        const auto& k = f_.expert_kinds.at(l);
        const auto& t = f_.expert_tensors.at(l);
        TORCH_CHECK(k.size() == t.size() && static_cast<int64_t>(k.size()) == 2 * e.router.size(0),
                    "family: two expert linears per router row");
        TORCH_CHECK(f_.top_k >= 1 && f_.top_k <= e.router.size(0), "family: 1 <= top_k <= experts");
        for (size_t i = 0; i < k.size(); ++i) e.linears.push_back({k[i], t[i]});
      }
      moe_.push_back(std::move(e));
    }
    f_.expert_tensors.clear();  // held once, in moe_
    for (int64_t l = 0; l < layers; ++l) {
      const bool experts = !moe_.empty() && moe_[l].router.numel();
      TORCH_CHECK(experts || linears_[4 * l + 2].t[0].numel(), "layer ", l,
                  " has neither a dense MLP nor experts");
    }
  }

  // The residual stream, fp32 [B, hidden], of rows' token ids (checked against the
  // vocabulary before anything is written), in scratch_, and there the RoPE tables of their
  // positions.
  template <typename T>
  at::Tensor& embedded(const StepRows& rows) {
    const int64_t batch = rows.batch, n = shape_.hidden, vocab = embed_.size(0);
    const int64_t* id = rows.ids;
    for (int64_t b = 0; b < batch; ++b) {
      TORCH_CHECK(id[b] >= 0 && id[b] < vocab, "token id ", id[b], " outside the vocabulary");
    }
    Scratch& sc = scratch(batch);
    const T* e = embed_.data_ptr<T>();
    float* hp = sc.h.data_ptr<float>();
    const float embed_scale = static_cast<float>(f_.embed_scale);
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < n; ++i) hp[b * n + i] = float(e[id[b] * n + i]);
      if (embed_scale != 1.f) {
        for (int64_t i = 0; i < n; ++i) hp[b * n + i] *= embed_scale;
      }
    }
    for (size_t r = 0; r < inv_freqs_.size(); ++r) {
      rope_tables<T>(rows.positions, batch, inv_freqs_[r], sc.cos[r], sc.sin[r]);
    }
    return sc.h;
  }

  // The residual stream after the last layer at `picked` of the rows (a copy: scratch_
  // serves the next forward).
  template <typename T>
  at::Tensor extend_hidden(const StepRows& rows, const std::vector<at::Tensor>& k_bufs,
                           const std::vector<at::Tensor>& v_bufs, double scale,
                           const at::Tensor& picked) {
    at::Tensor& h = embedded<T>(rows);
    run<T>(rows, k_bufs, v_bufs, scale);
    return h.index_select(0, picked);
  }

  // rows' logits, fp32 [batch, vocab], into `logits`; where `picks` is given, each row's
  // greedy pick there (refine_rows'), and where `top` is, its alternatives (only where the
  // refinement gives the logits their last change: refines_last).
  template <typename T>
  void step(const StepRows& rows, const std::vector<at::Tensor>& k_bufs,
            const std::vector<at::Tensor>& v_bufs, double scale, float* logits,
            int64_t* picks = nullptr, const StepTop* top = nullptr) {
    PhaseClock clock(phases_);
    at::Tensor& h = embedded<T>(rows);
    const int64_t batch = rows.batch, n = shape_.hidden, vocab = embed_.size(0);
    clock.mark(kEmbed);
    run<T>(rows, k_bufs, v_bufs, scale);
    clock.restart();
    at::Tensor& hn = scratch(batch).hn;
    const auto* final_norm = static_cast<const T*>(norm_weights_.back());
    rms_norm_rows<float, T>(h.data_ptr<float>(), final_norm, hn.data_ptr<T>(), batch, n, eps_);
    clock.mark(kNorms);
    if (head_.int4.nib != nullptr && head_.int4.k == n) {
      int4_matmul(hn.data_ptr<T>(), batch, head_.int4, RoundedTo<T>{logits});
    } else {
      linear<T>(head_, hn, outs_[5]);
      widen_logits<T>(outs_[5], logits);
    }
    clock.mark(kHead);
    if (head16_bits_ != nullptr) {
      TORCH_CHECK(vocab == head16_rows_, "refine: a row per logit");
      refine_rows(logits, batch, vocab, hn.data_ptr<T>(), head16_bits_, n, refine_, picks,
                  top != nullptr ? top->best : RowTop{});
      if (top != nullptr) logsumexps(logits, batch, vocab, *top);
    }
    clock.mark(kRefine);
    // As model.py's _logits: divided by Granite's scaling, then Gemma's final soft-cap.
    if (f_.logits_scaling != 1.0 || f_.final_softcap > 0) {
      at::Tensor l = at::from_blob(logits, {batch, vocab}, at::TensorOptions().dtype(at::kFloat));
      if (f_.logits_scaling != 1.0) l.div_(f_.logits_scaling);
      if (f_.final_softcap > 0) l.div_(f_.final_softcap).tanh_().mul_(f_.final_softcap);
    }
  }

  // The head's output y [B, vocab] in T as fp32 into `into`, by a loop of ours: ATen's copy_
  // splits those ~50k values over OpenMP's threads, whose team then spins on the other core
  // while the next step's matmuls want it (the int4 step 2.80 -> 2.76 ms, its matmuls each a
  // little faster; alternating in one process, medians of 10, a 2-core Zen 4).
  template <typename T>
  static void widen_logits(const at::Tensor& y_in, float* into) {
    const at::Tensor y = y_in.contiguous();
    const int64_t n = y.numel();
    if (y.scalar_type() != c10::CppTypeToScalarType<T>::value) {
      at::from_blob(into, y.sizes(), at::TensorOptions().dtype(at::kFloat)).copy_(y);
      return;
    }
    using Bits = std::conditional_t<std::is_same_v<T, float>, float, uint16_t>;
    const auto* src = static_cast<const Bits*>(y.data_ptr());
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) into[i] = widen(src[i]);
  }

  // cos and signed sin [B, rotary] as runtime/model/model.py's rope_tables gives them (fp32
  // angles, the tables rounded to T), widened to fp32: of positions [batch] and inv_freq
  // [rotary / 2], into cos and sin.
  template <typename T>
  void rope_tables(const int64_t* pos, int64_t batch, const float* f, at::Tensor& cos,
                   at::Tensor& sin) const {
    const int64_t d = f_.rotary_dim, half = d / 2;
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
  }

  // Each row's first visible slot per distinct window: first[b], or the last `w` before
  // ends[b]; layers without a window start at `first`.
  std::vector<std::pair<int64_t, std::vector<int64_t>>> window_starts(const int64_t* first,
                                                                      const int64_t* ends,
                                                                      int64_t batch) const {
    std::vector<std::pair<int64_t, std::vector<int64_t>>> out;
    for (int64_t w : f_.windows) {
      if (w == 0 || std::any_of(out.begin(), out.end(),
                                [&](const auto& ws) { return ws.first == w; })) {
        continue;
      }
      std::vector<int64_t> starts(batch);
      for (int64_t b = 0; b < batch; ++b) starts[b] = std::max(first[b], ends[b] - w);
      out.emplace_back(w, std::move(starts));
    }
    return out;
  }

  // q and k of each row of qkv [B, (heads + 2 kv_heads) * head_dim] normed in place, per
  // head or over the whole projection (OLMo 2), before RoPE.
  template <typename T>
  void qk_norm(T* qkv, int64_t batch, int64_t l) const {
    const Shape& s = shape_;
    const int64_t d = s.head_dim, width = (s.heads + 2 * s.kv_heads) * d;
    const bool whole = f_.qk_norm == static_cast<int64_t>(QKNorm::kWhole);
    const T* qw = f_.qk_norms[2 * l].data_ptr<T>();
    const T* kw = f_.qk_norms[2 * l + 1].data_ptr<T>();
    for (int64_t b = 0; b < batch; ++b) {
      T* q = qkv + b * width;
      T* k = q + s.heads * d;
      rms_norm<T, T>(q, qw, q, whole ? 1 : s.heads, whole ? s.heads * d : d, eps_);
      rms_norm<T, T>(k, kw, k, whole ? 1 : s.kv_heads, whole ? s.kv_heads * d : d, eps_);
    }
  }

  // x (a block's output [B, hidden] in T) through its post-norm where the layer has one,
  // then into the residual stream.
  template <typename T>
  void add_block(float* hp, at::Tensor& x, const at::Tensor& post_norm, int64_t batch) const {
    const int64_t n = shape_.hidden;
    if (post_norm.defined() && post_norm.numel()) {
      rms_norm<T, T>(x.data_ptr<T>(), post_norm.data_ptr<T>(), x.data_ptr<T>(), batch, n, eps_);
    }
    add_into<T>(hp, x.data_ptr<T>(), batch * n, static_cast<float>(f_.residual_scale));
  }

  // h normed by norm weights `norm` (norm_weights_) into xn, or (none there) only rounded
  // to T.
  template <typename T>
  void pre_norm(const float* hp, int64_t norm, at::Tensor& xn, int64_t batch) const {
    const int64_t n = shape_.hidden;
    T* out = xn.data_ptr<T>();
    const T* w = static_cast<const T*>(norm_weights_[norm]);
    if (w != nullptr) return rms_norm_rows<float, T>(hp, w, out, batch, n, eps_);
    for (int64_t i = 0; i < batch * n; ++i) out[i] = T(hp[i]);
  }

  // Asks for norm weights `norm` (past the last layer's, the final norm's) ahead of the
  // matmul before them: the weight stream evicts them from one step to the next, and read
  // cold they held up each norm (the step's norms 0.066 -> 0.047 ms with their pointers
  // taken once, in norm_weights_; alternating in one process).
  template <typename T>
  void prefetch_norm(int64_t norm) const {
    const void* w = norm_weights_[norm];
    if (w != nullptr) prefetch_bytes(w, shape_.hidden * static_cast<int64_t>(sizeof(T)));
  }

  // act(gate) * up, then down, over the rows of xn: the dense MLP's path and each expert's.
  // A decode step's few rows take int4 panels' halves in one pass (int4_gated; its time is
  // gate_up's). An extend's do not: on the bench prompt's 46 tokens that made the first
  // token 28.2 -> 31.7 ms (medians of 15, alternating in one process; the block's two
  // panels and x's rows crowd L1 where the arithmetic, not memory, sets the pace).
  template <typename T>
  at::Tensor gated_mlp(const LinearSpec& gate_up, const LinearSpec& down, const at::Tensor& x,
                       at::Tensor& gu, at::Tensor& act, at::Tensor& out) {
    PhaseClock clock(phases_);
    const auto activation = static_cast<Activation>(f_.activation);
    const int64_t rows = x.size(0);
    if (gated_panels(gate_up.int4) && x.size(1) == gate_up.int4.k && rows < kRowsToSplit) {
      act = output_rows(act, rows, gate_up.int4.n / 2, x.options());
      int4_gated(x.data_ptr<T>(), rows, gate_up.int4, activation, act.data_ptr<T>());
      clock.mark(kGateUp);
    } else {
      linear<T>(gate_up, x, gu);
      clock.mark(kGateUp);
      const int64_t inter = gu.size(1) / 2;
      act = output_rows(act, rows, inter, x.options());
      act_mul<T>(gu.data_ptr<T>(), act.data_ptr<T>(), rows, inter, activation);
      clock.mark(kActivation);
    }
    linear<T>(down, act, out);
    clock.mark(kDown);
    return out;
  }

  // runtime/model/moe.py's MoE.__call__ in the same ops: router logits in T, softmax in
  // fp32, top-k (renormalised when norm_topk_prob), the weights back in T; each chosen
  // expert's output times its weight added in ascending expert order, tokens ascending
  // within an expert (in bf16 each add rounds, so the order is the result's).
  template <typename T>
  at::Tensor moe(const Experts& m, const at::Tensor& x) {
    const at::Tensor probs = at::softmax(at::linear(x, m.router), -1, at::kFloat);
    auto [weights, chosen] = probs.topk(f_.top_k, -1);
    if (f_.norm_topk_prob) weights = weights / weights.sum(-1, true);
    const at::Tensor slot_weights = weights.to(x.scalar_type()).reshape({-1});
    const at::Tensor flat = chosen.reshape({-1}).contiguous();
    const int64_t* e = flat.data_ptr<int64_t>();
    std::vector<int64_t> order(flat.numel());
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return e[a] < e[b]; });
    at::Tensor out = at::zeros_like(x);
    at::Tensor gu, act, y;
    const auto idx = at::TensorOptions().dtype(at::kLong);
    for (size_t start = 0; start < order.size();) {
      size_t end = start;
      std::vector<int64_t> rows, slots;
      for (; end < order.size() && e[order[end]] == e[order[start]]; ++end) {
        rows.push_back(order[end] / f_.top_k);
        slots.push_back(order[end]);
      }
      const int64_t expert = e[order[start]];
      const at::Tensor r = at::tensor(rows, idx);
      y = gated_mlp<T>(m.linears[2 * expert], m.linears[2 * expert + 1], x.index_select(0, r),
                       gu, act, y);
      const at::Tensor w = slot_weights.index_select(0, at::tensor(slots, idx));
      out.index_add_(0, r, y * w.unsqueeze(1));
      start = end;
    }
    return out;
  }

  // The decoder layers over h, the fp32 residual stream [B, hidden], in place. Row b
  // attends to the slots indices[first[b]:ends[b]] (its own new slot, out_loc[b], last):
  // a decode step's rows each a request, an extend's each a new token of one.
  template <typename T>
  void run(const StepRows& rows, const std::vector<at::Tensor>& k_bufs,
           const std::vector<at::Tensor>& v_bufs, double scale) {
    const int64_t batch = rows.batch, n = shape_.hidden, layers = norms_.size() / 2;
    const Shape& s = shape_;
    Scratch& sc = scratch(batch);
    at::Tensor& xn = sc.xn;
    at::Tensor& attn = sc.attn;
    at::Tensor& qf = sc.qf;
    float* hp = sc.h.data_ptr<float>();
    const int64_t *first = rows.first, *ends = rows.ends, *indices = rows.indices;
    const int64_t* out_loc = rows.out_loc;
    const auto starts = window_starts(first, ends, batch);
    // plans_[0]: the whole ranges; plans_[1 + i]: window starts[i]'s.
    plans_.resize(1 + starts.size());
    plan_attention(first, ends, batch, s.kv_heads, plans_[0]);
    for (size_t i = 0; i < starts.size(); ++i) {
      plan_attention(starts[i].second.data(), ends, batch, s.kv_heads, plans_[1 + i]);
    }
    const auto plan_of = [&](int64_t l) -> const AttentionPlan& {
      const int64_t w = f_.windows.empty() ? 0 : f_.windows[l];
      for (size_t i = 0; i < starts.size(); ++i) {
        if (starts[i].first == w) return plans_[1 + i];
      }
      return plans_[0];
    };
    const at::Tensor none;
    const auto post = [&](int64_t i) -> const at::Tensor& {
      return f_.post_norms.empty() ? none : f_.post_norms[i];
    };
    // Each role's output buffer serves every layer (and the next steps at this batch size).
    at::Tensor& qkv = outs_[0];
    at::Tensor& o = outs_[1];
    at::Tensor& gu = outs_[2];
    at::Tensor& down = outs_[3];
    at::Tensor& act = outs_[4];
    for (int64_t l = 0; l < layers; ++l) {
      PhaseClock clock(phases_);
      const KvRows kv = kv_rows<T>(k_bufs[l], v_bufs[l], s);
      T* const kbuf = k_bufs[l].data_ptr<T>();
      T* const vbuf = v_bufs[l].data_ptr<T>();
      prefetch_new_kv<T>(out_loc, kbuf, vbuf, kv, batch, s);
      pre_norm<T>(hp, 2 * l, xn, batch);
      clock.mark(kNorms);
      prefetch_norm<T>(2 * l + 1);
      linear<T>(linears_[4 * l], xn, qkv);
      clock.mark(kQkv);
      if (f_.qk_norm) qk_norm<T>(qkv.data_ptr<T>(), batch, l);
      const int64_t r = f_.rope_of_layer[l];
      rope_and_store<T>(qkv.data_ptr<T>(), r < 0 ? nullptr : sc.cos[r].data_ptr<float>(),
                        r < 0 ? nullptr : sc.sin[r].data_ptr<float>(), f_.rotary_dim,
                        out_loc, kbuf, vbuf, kv, qf.data_ptr<float>(),
                        batch, s, static_cast<float>(scale));
      clock.mark(kRope);
      attention<T>(plan_of(l), qf.data_ptr<float>(), kbuf, vbuf, kv, indices,
                   attn.data_ptr<T>(), s, static_cast<float>(f_.attn_softcap));
      clock.mark(kAttention);
      linear<T>(linears_[4 * l + 1], attn, o);
      clock.mark(kOProj);
      add_block<T>(hp, o, post(2 * l), batch);
      pre_norm<T>(hp, 2 * l + 1, xn, batch);
      clock.mark(kNorms);
      prefetch_norm<T>(2 * l + 2);
      if (!moe_.empty() && moe_[l].router.numel()) {
        at::Tensor y = moe<T>(moe_[l], xn);
        clock.restart();
        add_block<T>(hp, y, post(2 * l + 1), batch);
      } else {
        down = gated_mlp<T>(linears_[4 * l + 2], linears_[4 * l + 3], xn, gu, act, down);
        clock.restart();
        add_block<T>(hp, down, post(2 * l + 1), batch);
      }
      clock.mark(kNorms);
    }
  }

  std::vector<at::Tensor> norms_;    // before attention and before the MLP, per layer
  // norms_' data, then final_norm_'s (nullptr: no norm there), taken once: a tensor's
  // metadata is as cold as its data by the time a step comes back to it.
  std::vector<const void*> norm_weights_;
  std::vector<LinearSpec> linears_;  // qkv, o, gate_up, down, per layer
  at::Tensor embed_, final_norm_;
  // The qkv, o, gate_up, down, activation and LM head outputs of the last step, updated in
  // place by the next (a bias added): made as normal tensors whatever the caller's mode, as
  // ATen refuses in-place updates of an inference tensor outside inference mode.
  at::Tensor outs_[6];
  std::array<double, kPhases> phase_s_{};  // seconds per Phase since phase_seconds()
  // Where the running call's phases are timed, set by each entry point under busy_:
  // phase_s_ in decode steps, nowhere in an extend.
  std::array<double, kPhases>* phases_ = &phase_s_;
  std::mutex busy_;     // outs_ serve one step at a time
  std::atomic<int64_t> interrupts_{0};  // interrupt() calls so far
  LinearSpec head_;
  at::Tensor head16_;
  const uint16_t* head16_bits_ = nullptr;  // its data, taken once (null: no refinement)
  int64_t head16_rows_ = 0;
  int64_t refine_;
  float eps_;
  Family f_;
  std::vector<Experts> moe_;  // per layer where any layer is MoE (else empty)
  std::vector<AttentionPlan> plans_;  // run's, per window size (see there)
  std::vector<float> exp_sums_;       // logsumexps' blocks
  // A forward's own buffers, kept for the next one of as many rows (a decode step's for the
  // next step): each at::empty cost ~1 us once the weight stream had left the allocator's
  // data out of cache. Normal tensors, as outs_.
  struct Scratch {
    int64_t rows = -1;
    at::Tensor h, hn, xn, attn, qf;  // residual (fp32), final norm, layer norm, attention, q
    std::vector<at::Tensor> cos, sin;  // per inv_freqs_
  };
  Scratch scratch_;
  std::vector<const float*> inv_freqs_;  // f_.inv_freqs' data, taken once

  // scratch_ for `rows` rows (re-made when their count changes).
  Scratch& scratch(int64_t rows) {
    Scratch& sc = scratch_;
    if (sc.rows == rows) return sc;
    const Shape& s = shape_;
    const auto f32 = embed_.options().dtype(at::kFloat), t = embed_.options().dtype(dtype_);
    sc.h = at::empty({rows, s.hidden}, f32);
    sc.hn = at::empty({rows, s.hidden}, t);
    sc.xn = at::empty({rows, s.hidden}, t);
    sc.attn = at::empty({rows, s.heads * s.head_dim}, t);
    sc.qf = at::empty({rows, s.heads * s.head_dim}, f32);
    sc.cos.clear();
    sc.sin.clear();
    for (size_t r = 0; r < inv_freqs_.size(); ++r) {
      sc.cos.push_back(at::empty({rows, f_.rotary_dim}, f32));
      sc.sin.push_back(at::empty({rows, f_.rotary_dim}, f32));
    }
    sc.rows = rows;
    return sc;
  }
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
  const KvRows kv = kv_rows<T>(k_buffer, v_buffer, s);
  at::Tensor qf = q.to(at::kFloat).contiguous();
  at::Tensor idx = kv_indices.to(at::kLong).contiguous();
  at::Tensor out = at::empty(q.sizes(), k_buffer.options());
  pybind11::gil_scoped_release no_gil;
  // Blocks of queries bound the per-task scratch (tokens x KV heads x chunks of the context).
  constexpr int64_t kBlock = 64;
  AttentionPlan plan;
  for (int64_t b0 = 0; b0 < tokens; b0 += kBlock) {
    const int64_t n = std::min(kBlock, tokens - b0), row = heads * s.head_dim;
    plan_attention(starts.data() + b0, ends.data() + b0, n, kv_heads, plan);
    attention<T>(plan, qf.data_ptr<float>() + b0 * row, k_buffer.data_ptr<T>(),
                 v_buffer.data_ptr<T>(), kv, idx.data_ptr<int64_t>(),
                 out.data_ptr<T>() + b0 * row, s, softcap);
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
                          std::vector<std::vector<at::Tensor>>, at::Tensor, at::Tensor, int64_t,
                          std::vector<at::Tensor>, at::Tensor, int64_t, int64_t, int64_t,
                          int64_t, double, Family>())
      .def("logits", &DecodeStep::logits)
      .def("logits_ahead", &DecodeStep::logits_ahead)
      .def("hidden", &DecodeStep::hidden)
      .def("interrupt", &DecodeStep::interrupt)
      .def("interrupts", &DecodeStep::interrupts)
      .def("phase_seconds", &DecodeStep::phase_seconds);
  pybind11::class_<Family>(m, "Family")
      .def(pybind11::init<>())
      .def_readwrite("windows", &Family::windows)
      .def_readwrite("attn_softcap", &Family::attn_softcap)
      .def_readwrite("post_norms", &Family::post_norms)
      .def_readwrite("qk_norm", &Family::qk_norm)
      .def_readwrite("qk_norms", &Family::qk_norms)
      .def_readwrite("inv_freqs", &Family::inv_freqs)
      .def_readwrite("rope_of_layer", &Family::rope_of_layer)
      .def_readwrite("rotary_dim", &Family::rotary_dim)
      .def_readwrite("activation", &Family::activation)
      .def_readwrite("embed_scale", &Family::embed_scale)
      .def_readwrite("residual_scale", &Family::residual_scale)
      .def_readwrite("logits_scaling", &Family::logits_scaling)
      .def_readwrite("final_softcap", &Family::final_softcap)
      .def_readwrite("routers", &Family::routers)
      .def_readwrite("expert_kinds", &Family::expert_kinds)
      .def_readwrite("expert_tensors", &Family::expert_tensors)
      .def_readwrite("top_k", &Family::top_k)
      .def_readwrite("norm_topk_prob", &Family::norm_topk_prob);
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
  // Returns each row's pick after the refinement (numpy's argmax of the updated row).
  m.def("refine_top_logits", [](at::Tensor logits, const at::Tensor& h, const at::Tensor& w,
                                int64_t r) {
    std::vector<int64_t> picks(logits.dim() == 2 ? logits.size(0) : 0);
    pybind11::gil_scoped_release no_gil;
    refine_top_logits(logits, h, w, r, picks.data());
    return picks;
  });
  m.def("top_logits", [](const at::Tensor& rows, int64_t k) {
    pybind11::gil_scoped_release no_gil;
    return top_logits(rows, k);
  }, "each row's k best logits (ids, values: best first; ties the lower id) and logsumexp");
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
  m.def("int4_gated", [](const at::Tensor& x_in, const at::Tensor& nib, const at::Tensor& scale,
                         const at::Tensor& zero, int64_t activation) {
    const at::Tensor x = x_in.contiguous();
    TORCH_CHECK(x.dim() == 2, "int4_gated: x [rows, k]");
    TORCH_CHECK(activation == 0 || activation == 1, "int4_gated: activation 0 or 1");
    const Int4Panels w = int4_panels(nib, scale, zero, x.size(1));
    TORCH_CHECK(gated_panels(w), "int4_gated: gate_up's halves in whole panels");
    at::Tensor out = at::empty({x.size(0), w.n / 2}, x.options());
    pybind11::gil_scoped_release no_gil;
    const auto act = static_cast<Activation>(activation);
    if (x.scalar_type() == at::kBFloat16) {
      int4_gated(x.data_ptr<c10::BFloat16>(), x.size(0), w, act, out.data_ptr<c10::BFloat16>());
    } else {
      TORCH_CHECK(x.scalar_type() == at::kFloat, "int4_gated: bf16 or fp32 activations");
      int4_gated(x.data_ptr<float>(), x.size(0), w, act, out.data_ptr<float>());
    }
    return out;
  }, "act(gate) * up of an int4 gate_up linear in one pass (the fused step's MLP half)");
  m.def("kernel_isa", [] { return quant_isa_name(quant_isa().load()); },
        "the instruction set the bf16 int4/int8 kernels use now");
  m.def("kernel_isas", &quant_isa_names, "the ones this build has, widest (the default) first");
  m.def("set_isa", &set_quant_isa, "use one of kernel_isas() (they give the same bits)");
}
