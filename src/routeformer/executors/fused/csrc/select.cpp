// Block selection in one pass (MoBA, Lu et al. 2025; the bound score of Quest, Tang et al. 2024): every query's
// ``top`` best complete blocks before its own, best first. The PyTorch form (attention/blocks.py) builds the
// (B, H, N, N / block) score tensor, masks the blocks that are not candidates and takes passes of max: seven
// operators and three temporaries of that size per call, 4-5 ms of a 2048-token layer on one thread. Here each
// query scores only its candidates (j < i / block: half the blocks on average) and keeps only its picks (a few values on the stack).
//
// Forward only: the selection is discrete (the loss reaches it through the attention only), so there is no
// backward. Each query's picks depend on its own row and the block summaries alone, so the result is the same for
// every thread count.
//
// Packed documents ((B, N) ids that never decrease along a row): a query's candidates are the blocks from the one
// holding its document's start on, and that block, when it begins in another document, is scored by the summary of
// its document's keys only (computed once per document, attention/blocks.py's BlockDocuments).
#include "checks.h"
#include "common.h"
#include "ops.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/full.h>

#include <limits>
#include <vector>

namespace routeformer {
namespace {

constexpr int64_t kNone = -1;  // blocks.NONE: a slot with no block (fewer candidates than top)

// Per channel over n rows (``k_stride`` apart, n >= 1), in vectors of channels: the least and the greatest value
// (bound) or the sum (mean, in ``first``), into ``first`` and ``second`` (D each).
template <typename T>
void reduce_rows(const T* rows, int64_t k_stride, int64_t n, int64_t D, bool bound, T* first, T* second) {
  using Vec = at::vec::Vectorized<T>;
  int64_t d = 0;
  for (; d + Vec::size() <= D; d += Vec::size()) {
    Vec a = Vec::loadu(rows + d), b = a;
    for (int64_t r = 1; r < n; r++) {
      const Vec x = Vec::loadu(rows + r * k_stride + d);
      if (bound) {
        a = at::vec::minimum(a, x);
        b = at::vec::maximum(b, x);
      } else {
        a = a + x;
      }
    }
    a.store(first + d);
    b.store(second + d);
  }
  for (; d < D; d++) {
    T a = rows[d], b = a;
    for (int64_t r = 1; r < n; r++) {
      const T x = rows[r * k_stride + d];
      if (bound) {
        a = std::min(a, x);
        b = std::max(b, x);
      } else {
        a += x;
      }
    }
    first[d] = a;
    second[d] = b;
  }
}

// Per channel over the block's rows: the least value and the width greatest - least (bound) or the mean (mean),
// reduced along the rows in vectors of channels (``reduce_rows``), then stored channel-major (D, stride) so that a
// query's scores of consecutive blocks are one vector: lo[d * stride + j]. ``first``, ``second``: D scratch values
// each.
template <typename T>
void summarise(const T* k, int64_t k_stride, int64_t block, int64_t nb, int64_t D, bool bound, T* lo, T* hi,
               int64_t stride, T* first, T* second) {
  for (int64_t j = 0; j < nb; j++) {
    reduce_rows(k + j * block * k_stride, k_stride, block, D, bound, first, second);
    for (int64_t d = 0; d < D; d++) {
      if (bound) {
        lo[d * stride + j] = first[d];
        hi[d * stride + j] = second[d] - first[d];  // the width hi - lo, as the score reads it
      } else {
        lo[d * stride + j] = first[d] / T(block);
      }
    }
  }
}

// The scores of ``R`` consecutive queries for blocks [0, n), the blocks in the vector's lanes: q · mean
// (``w`` null), or the bound Σ_d max(q_d · lo_d, q_d · hi_d) = q⁺ · (hi - lo) + q · lo, the largest q · x over the
// block's box (``w``: hi - lo). Rows of ``s``: ``stride`` (n rounded up to whole vectors, as the summaries).
template <typename T, int R>
void scores(const T* q, int64_t q_stride, const T* lo, const T* w, int64_t stride, int64_t n, int64_t D, T* s) {
  if constexpr (std::is_same_v<T, float>) {
    using Vec = at::vec::Vectorized<float>;
    for (int64_t j = 0; j < n; j += Vec::size()) {  // the summaries' rows are padded to whole vectors
      Vec acc[R];
      for (int r = 0; r < R; r++) acc[r] = Vec(0.f);
      for (int64_t d = 0; d < D; d++) {
        const Vec l = Vec::loadu(lo + d * stride + j);
        if (w) {
          const Vec width = Vec::loadu(w + d * stride + j);
          for (int r = 0; r < R; r++) {
            // q⁺ by a vector max: the scalar x > 0 ? x : 0 compiled to a branch that missed half the time (4x slower)
            const Vec x(q[r * q_stride + d]);
            acc[r] = at::vec::fmadd(at::vec::maximum(x, Vec(0.f)), width, at::vec::fmadd(x, l, acc[r]));
          }
        } else {
          for (int r = 0; r < R; r++) acc[r] = at::vec::fmadd(Vec(q[r * q_stride + d]), l, acc[r]);
        }
      }
      for (int r = 0; r < R; r++) acc[r].store(s + r * stride + j);
    }
  } else {
    for (int r = 0; r < R; r++) {
      for (int64_t j = 0; j < n; j++) {
        T total = 0;
        for (int64_t d = 0; d < D; d++) {
          const T x = q[r * q_stride + d];
          total += x * lo[d * stride + j] + (w ? std::max(x, T(0)) * w[d * stride + j] : T(0));
        }
        s[r * stride + j] = total;
      }
    }
  }
}

// The ``t`` best of the scores s[0, n), best first, into ``o`` (the rest left as they are); ties keep the lower
// block first, as passes of max do; a NaN or -inf score is never picked.
template <typename T>
void pick(const T* s, int64_t n, int64_t t, T* best, int64_t* o) {
  if (t == 1) {
    o[0] = first_max(s, n, -std::numeric_limits<T>::infinity(), kNone);
    return;
  }
  int64_t kept = 0;
  for (int64_t j = 0; j < n; j++) {
    if (s[j] > -std::numeric_limits<T>::infinity()) keep_best(s[j], j, t, kept, best, o);
  }
}

// The summary of one partial block's rows [from, to) of k (rows ``k_stride`` apart): the least value and the width
// (bound) or the mean (mean) per channel, into lo and hi (D each).
template <typename T>
void summarise_rows(const T* k, int64_t k_stride, int64_t from, int64_t to, int64_t D, bool bound, T* lo, T* hi) {
  reduce_rows(k + from * k_stride, k_stride, to - from, D, bound, lo, hi);
  for (int64_t d = 0; d < D; d++) {
    if (bound) {
      hi[d] -= lo[d];  // the width hi - lo, as the score reads it
    } else {
      lo[d] /= T(to - from);
      hi[d] = T(0);
    }
  }
}

}  // namespace

at::Tensor fused_select_blocks(const at::Tensor& q, const at::Tensor& k, int64_t block, int64_t top, bool bound,
                               const std::optional<at::Tensor>& documents) {
  const char* op = "select_blocks";
  checks::floating(op, q, "q");
  checks::rows(op, q, "q", q.scalar_type());
  checks::rows(op, k, "k", q.scalar_type());
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3);
  checks::shape(op, k, "k", "(B, H, N, D) like q", {B, H, N, D});
  checks::at_least(op, block, 1, "block");
  checks::at_least(op, top, 1, "top");
  const int64_t nb = N / block;
  // each position's document's first position (packed documents), else none; and the partial first blocks to
  // summarise: tail[b * N + p] numbers the starts p of row b that begin inside a complete block (-1 elsewhere)
  std::vector<int64_t> starts, tail;
  int64_t tails = 0;  // the most such starts in a row
  if (documents.has_value()) {
    checks::dtype(op, *documents, "documents", at::kLong);
    RF_CHECK(documents->dim() == 2 && documents->size(0) == B && documents->size(1) == N, op,
             "documents must be (B, N) = (", B, ", ", N, "), got ", checks::dims(documents->sizes()));
    checks::contiguous(op, *documents, "documents");
    const int64_t* ids = documents->data_ptr<int64_t>();
    starts.resize(B * N);
    tail.assign(B * N, -1);
    for (int64_t b = 0; b < B; b++) {
      int64_t count = 0;
      for (int64_t i = 0; i < N; i++) {
        const bool begins = i == 0 || ids[b * N + i] != ids[b * N + i - 1];
        starts[b * N + i] = begins ? i : starts[b * N + i - 1];
        if (begins && i % block != 0 && i / block < nb) tail[b * N + i] = count++;
      }
      tails = std::max(tails, count);
    }
  }
  // min(top, nb) picks: more than there are blocks would be NONE everywhere (the caller pads to top)
  const int64_t t = std::min(top, nb);
  auto chosen = at::full({B, H, N, t}, kNone, q.options().dtype(at::kLong));
  if (t == 0 || B * H * N == 0) return chosen;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "routeformer_select_blocks", [&] {
    using T = scalar_t;
    // the summaries, (B, H, D, stride) twice (bound: lo and hi - lo; mean: the mean in lo), each row padded to whole
    // vectors
    constexpr int64_t lanes = at::vec::Vectorized<float>::size();
    const int64_t stride = (nb + lanes - 1) / lanes * lanes;
    std::vector<T> lo(B * H * D * stride, T(0)), hi(bound ? B * H * D * stride : 0, T(0));
    // with documents, the partial first blocks' summaries (lo, width): (B, H, tails, D) each
    std::vector<T> tail_lo(B * H * tails * D), tail_hi(tail_lo.size());
    const T* kbase = k.data_ptr<T>();
    const T* qbase = q.data_ptr<T>();
    at::parallel_for(0, B * H, 1, [&](int64_t h0, int64_t h1) {
      std::vector<T> first(D), second(D);
      for (int64_t x = h0; x < h1; x++) {
        const T* kp = kbase + (x / H) * k.stride(0) + (x % H) * k.stride(1);
        T* l = lo.data() + x * D * stride;
        summarise(kp, k.stride(2), block, nb, D, bound, l, bound ? hi.data() + x * D * stride : l, stride, first.data(),
                  second.data());
        if (starts.empty()) continue;
        const int64_t* slot = tail.data() + (x / H) * N;
        for (int64_t p = 0; p < N; p++) {
          if (slot[p] < 0) continue;  // not a start inside a complete block
          const int64_t at = (x * tails + slot[p]) * D;
          summarise_rows(kp, k.stride(2), p, (p / block + 1) * block, D, bound, tail_lo.data() + at,
                         tail_hi.data() + at);
        }
      }
    });
    int64_t* out = chosen.data_ptr<int64_t>();
    const int64_t groups = nb + 1;  // query blocks that have candidates: 1 … nb (and the rows past nb · block)
    // one task: a query block's rows of one head (they share their candidates)
    at::parallel_for(0, B * H * groups, 1, [&](int64_t c0, int64_t c1) {
      std::vector<T> best(t), s(4 * stride);
      for (int64_t c = c0; c < c1; c++) {
        const int64_t x = c / groups, own = c % groups;
        const int64_t candidates = std::min(own, nb);
        if (candidates == 0) continue;
        const T* qp = qbase + (x / H) * q.stride(0) + (x % H) * q.stride(1);
        const T* l = lo.data() + x * D * stride;
        const T* w = bound ? hi.data() + x * D * stride : nullptr;
        const int64_t end = own == nb ? N : (own + 1) * block;
        constexpr int R = 4;  // queries scored together: each summary vector loaded once for four
        int64_t i = own * block;
        // packed documents: the blocks before the document's are no candidates, its partial first block is scored
        // by its own keys
        auto within = [&](int64_t i, T* row) {
          if (starts.empty()) return;
          const int64_t p = starts[(x / H) * N + i], first_block = p / block;
          for (int64_t j = 0; j < std::min(first_block, candidates); j++) row[j] = -std::numeric_limits<T>::infinity();
          if (p % block == 0 || first_block >= candidates) return;
          const int64_t at = (x * tails + tail[(x / H) * N + p]) * D;
          const T *tl = tail_lo.data() + at, *tw = tail_hi.data() + at;
          const T* qi = qp + i * q.stride(2);
          T total = 0;
          for (int64_t d = 0; d < D; d++) total += qi[d] * tl[d] + (bound ? std::max(qi[d], T(0)) * tw[d] : T(0));
          row[first_block] = total;
        };
        for (; i + R <= end; i += R) {
          scores<T, R>(qp + i * q.stride(2), q.stride(2), l, w, stride, candidates, D, s.data());
          for (int r = 0; r < R; r++) {
            within(i + r, s.data() + r * stride);
            pick(s.data() + r * stride, candidates, t, best.data(), out + (x * N + i + r) * t);
          }
        }
        for (; i < end; i++) {
          scores<T, 1>(qp + i * q.stride(2), q.stride(2), l, w, stride, candidates, D, s.data());
          within(i, s.data());
          pick(s.data(), candidates, t, best.data(), out + (x * N + i) * t);
        }
      }
    });
  });
  return chosen;
}

}  // namespace routeformer
