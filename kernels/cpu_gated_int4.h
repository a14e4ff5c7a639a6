// A gated MLP's first half on int4 panels: x @ gate_up.T and act(gate) * up in one pass,
// the activation on the matmul's threads.
//
// Why: in a decode step the activation ran on the calling thread alone between the gate_up
// and down matmuls (~1.6 us a layer on a Zen 4), with the other thread idle, and it read
// the half of gate_up's output that the other core wrote. Here a block computes the panel
// of 8 gate outputs and the panel of the same 8 up outputs, then their activation: the
// columns split among the threads as the matmul's do.
#pragma once

#include <cstdint>

#include "cpu_layer_ops.h"
#include "cpu_quant_matmul.h"
#include "cpu_tiles.h"

namespace sgl_nb {

// Whether int4_gated takes gate_up: the gate's rows fill whole panels (inter % 8 == 0), so
// that no panel holds both gate and up rows.
inline bool gated_panels(const Int4Panels& gate_up) {
  return gate_up.nib != nullptr && gate_up.n % (2 * kRowPanel) == 0;
}

// out [rows, inter] = T(T(act(gate)) * up), gate and up the two halves of x [rows, k] @
// gate_up.T rounded to T: the bits of int4_matmul then act_mul (a block's 8 columns start
// at a multiple of 8, where act_mul's lanes do).
template <typename T>
void int4_gated(const T* x, int64_t rows, const Int4Panels& w, Activation act, T* out) {
  const int64_t inter = w.n / 2;
  using One = std::integral_constant<int, 1>;
  using Max = std::integral_constant<int, kMaxRowBlock>;
  // Rows r0..r0 + nr - 1 (nr <= NR) at columns j0..j0 + 7 of out.
  const auto block = [&](auto max_rows, const auto& weights, int64_t j0, int64_t r0, int64_t nr) {
    constexpr int NR = decltype(max_rows)::value;
    float gate[NR * kRowPanel], up[NR * kRowPanel];
    rows_block<NR, kRowPanel>(weights, nr, j0, r0, gate);
    rows_block<NR, kRowPanel>(weights, nr, inter + j0, r0, up);
    for (int64_t r = 0; r < nr; ++r) {
      T g[kRowPanel], u[kRowPanel];
      for (int64_t c = 0; c < kRowPanel; ++c) {
        g[c] = T(weights.finish(j0 + c, r0 + r, gate[r * kRowPanel + c]));
        u[c] = T(weights.finish(inter + j0 + c, r0 + r, up[r * kRowPanel + c]));
      }
      act_span(g, u, out + (r0 + r) * inter + j0, kRowPanel, act);
    }
  };
  if (rows == 1) {
    return int4_row_panels(
        x, w, inter / kRowPanel, kRowPanel * w.k, [&](const auto& weights, int64_t p0, int64_t p1) {
          for (int64_t p = p0; p < p1; ++p) block(One{}, weights, p * kRowPanel, 0, 1);
        });
  }
  with_int4_rows(x, rows, w, [&](const auto& weights) {
    for_each_block<kMaxRowBlock, kRowPanel>(
        rows, inter, row_chunk(w.k),
        [&](int64_t j0, auto, int64_t r0, int64_t nr) { block(Max{}, weights, j0, r0, nr); });
  });
}

}  // namespace sgl_nb
