// How the CPU matmuls split an output [rows, n] among threads and into register blocks,
// and where they write it (output_rows).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu_worker_pool.h"

namespace sgl_nb {

// The output [rows, n] of a matmul: `out` when it already is one (contiguous, that dtype), else
// a new tensor. A decode step hands each layer's call the buffer the same role used before,
// so that a step allocates no tensor per layer.
inline at::Tensor output_rows(const at::Tensor& out, int64_t rows, int64_t n,
                              const at::TensorOptions& opts) {
  if (out.defined() && out.dim() == 2 && out.size(0) == rows && out.size(1) == n &&
      out.dtype() == opts.dtype() && out.is_contiguous()) {
    return out;
  }
  return at::empty({rows, n}, opts);
}

// How far ahead of its reads a one-row (decode) block asks for the weight stream, a few
// lines at a time as it goes. Left to the hardware prefetchers, the kernels' arithmetic and
// the memory's time add up rather than overlap; asked for 4 KiB ahead, the default model's
// int4 step (its 121 matmuls, in one buffer in step order: runtime/model/weight_arena.py)
// ran 12-18% faster on a 2-core Zen 3, as fast as a plain read of the same bytes (a
// standalone copy of the kernel, medians of 40). Past a matmul's end the requests run on
// into the next one's weights, which follow in that buffer.
constexpr int64_t kStreamAhead = 4096;

// The `lines` cache lines `ahead` bytes past `at`.
inline void stream_ahead(const void* at, int lines, int64_t ahead = kStreamAhead) {
  const char* p = static_cast<const char*>(at) + ahead;
  for (int line = 0; line < lines; ++line) __builtin_prefetch(p + 64 * line);
}

// Rows of x per pass over a thread's weight rows: enough that they (~16 KB) stay in L1
// while a block of weight rows meets all of them.
inline int64_t row_chunk(int64_t row_bytes) {
  return std::max<int64_t>(4, 16384 / row_bytes / 4 * 4);
}

// block(j0, width, r0, nr) for every block of the output: weight rows in blocks of NC,
// split among the threads (a narrower last block goes one weight row at a time, width an
// std::integral_constant of NC or 1); rows of x in chunks of `chunk`, each cut into the
// fewest blocks of at most NR rows, of sizes as even as can be (16 rows and NR = 6: 6, 5, 5
// rather than 6, 6, 4; a block of fewer rows does less work per weight load).
template <int NR, int NC, typename Block>
void for_each_block(int64_t rows, int64_t n, int64_t chunk, const Block& block) {
  const int64_t blocks = (n + NC - 1) / NC;
  WorkerPool::get().parallel_for(blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t c0 = 0; c0 < rows; c0 += chunk) {
      const int64_t len = std::min(chunk, rows - c0), parts = (len + NR - 1) / NR;
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t j0 = b * NC, nc = std::min<int64_t>(NC, n - j0);
        for (int64_t i = 0; i < parts; ++i) {
          const int64_t r0 = c0 + len * i / parts, nr = c0 + len * (i + 1) / parts - r0;
          if (nc == NC) {
            block(j0, std::integral_constant<int, NC>(), r0, nr);
            continue;
          }
          for (int64_t j = j0; j < j0 + nc; ++j) block(j, std::integral_constant<int, 1>(), r0, nr);
        }
      }
    }
  });
}

}  // namespace sgl_nb
