// Causal attention through features (elu linear attention, Performer's FAVOR+) as one scan over chunks per head,
// forward and recomputing backward: the definition is attention/feature_scan.py (its equations in its docstring),
// which runs the same scan as a dozen PyTorch operators per chunk. Here a chunk's features are computed into
// per-thread scratch where they are used, the products are BLAS calls on those rows, and the (F, D + 1) state of the
// chunks before stays in cache: no (N, F) tensor, nothing per chunk allocated.
//
// Per chunk c of n rows, with S = Σ φ(k) [v, 1]ᵀ over the chunks before (F, D + 1):
//   forward   [num | den] = tril(φ(q_c) φ(k_c)ᵀ) [v_c | 1] + φ(q_c) S,   S += φ(k_c)ᵀ [v_c | 1],   o = num / den
//   backward  g = [do / den | -Σ_D(do·o) / den],  A = tril(g [v_c | 1]ᵀ):  dφ(q) = A φ(k) + g S_cᵀ,
//             dφ(k) = Aᵀ φ(q) + [v_c | 1] Gᵀ,  d[v | 1] = tril(φ(q) φ(k)ᵀ)ᵀ g + φ(k) G
// (S_c the states before each chunk from a first pass in order, G = Σ φ(q)ᵀ g over the later chunks, a pass in
// reverse). Features: φ(x) = elu(x) + 1 without a projection; with one (H, m, D), Performer's leak-free shifts
// (attention/performer.py): a query's exp(√s w·x + |w|²/2 - max_r(.) - ln(m)/2), a key's
// exp(√s w·x - |w|²/2 - s|x|²/2 - ln(m)/2). The projection gets no gradient.
//
// Each (batch, head) is one task, its chunks in order on one thread: the same bits for every thread count. With
// packed documents ((B, N) ids that never decrease along a row) each document is a sequence of its own: its chunks
// start at its first row, the state at zero, so that its sums are those it has alone, bit for bit.
#include "checks.h"
#include "common.h"
#include "ops.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cmath>
#include <vector>

namespace routeformer {
namespace {

// The feature map of one head: elu + 1 (w null) or Performer's (w: (m, D) rows of the projection).
template <typename T>
struct Features {
  const T* w = nullptr;  // (F, D) or null
  const T* half_w = nullptr;  // (F,): |w_r|² / 2
  int64_t F = 0, D = 0;
  T root = 1;  // √s
  T log_half = 0;  // ln(m) / 2

  // phi (n, F), rows ``ld`` apart, of rows x (n, D); ``query`` chooses the shift; ``valid`` (n) or null: a padded
  // key's features are 0
  void operator()(const T* x, int64_t n, bool query, const bool* valid, T* phi, int64_t ld) const {
    using Vec = at::vec::Vectorized<T>;
    if (w == nullptr) {
      const Vec one(T(1)), zero(T(0));
      for (int64_t r = 0; r < n; r++) {
        const T* xr = x + r * D;
        T* out = phi + r * ld;
        int64_t i = 0;
        for (; i + Vec::size() <= D; i += Vec::size()) {
          const Vec v = Vec::loadu(xr + i);
          Vec::blendv(v.exp(), v + one, v > zero).store(out + i);
        }
        for (; i < D; i++) out[i] = xr[i] > T(0) ? xr[i] + T(1) : std::exp(xr[i]);
      }
    } else {
      gemm<T>(false, true, n, F, D, root, x, D, w, D, T(0), phi, ld);  // √s x · wᵀ
      for (int64_t r = 0; r < n; r++) {
        T* row = phi + r * ld;
        if (query) {
          axpy(row, half_w, F, T(1));
          exp_shift_sum(row, F, max_of(row, F) + log_half);
        } else {
          axpy(row, half_w, F, T(-1));
          exp_shift_sum(row, F, T(0.5) * root * root * dot(x + r * D, x + r * D, D) + log_half);
        }
      }
    }
    if (valid != nullptr)
      for (int64_t r = 0; r < n; r++)
        if (!valid[r]) std::fill(phi + r * ld, phi + r * ld + F, T(0));
  }

  // dx (n, D) = d/dx Σ dphi ⊙ φ(x), given phi = φ(x) (rows ``ld`` apart); dphi (n, F) is overwritten
  void grad(const T* x, const T* phi, int64_t ld, T* dphi, int64_t n, bool query, T* dx) const {
    using Vec = at::vec::Vectorized<T>;
    if (w == nullptr) {  // 1 where x > 0, else exp(x) = φ(x)
      const Vec one(T(1)), zero(T(0));
      for (int64_t r = 0; r < n; r++) {
        const T *xr = x + r * D, *pr = phi + r * ld, *gr = dphi + r * F;
        T* out = dx + r * D;
        int64_t i = 0;
        for (; i + Vec::size() <= D; i += Vec::size())
          (Vec::loadu(gr + i) * Vec::blendv(Vec::loadu(pr + i), one, Vec::loadu(xr + i) > zero)).store(out + i);
        for (; i < D; i++) out[i] = gr[i] * (xr[i] > T(0) ? T(1) : pr[i]);
      }
      return;
    }
    // dL = dφ ⊙ φ; dx = √s dL W, and a key's -s|x|²/2 adds -s x Σ_r dL_r
    for (int64_t r = 0; r < n; r++) {
      T* gr = dphi + r * F;
      const T* pr = phi + r * ld;
      int64_t i = 0;
      for (; i + Vec::size() <= F; i += Vec::size()) (Vec::loadu(gr + i) * Vec::loadu(pr + i)).store(gr + i);
      for (; i < F; i++) gr[i] *= pr[i];
    }
    gemm<T>(false, false, n, D, F, root, dphi, F, w, D, T(0), dx, D);
    if (!query)
      for (int64_t r = 0; r < n; r++) {
        T sum = 0;
        for (int64_t f = 0; f < F; f++) sum += dphi[r * F + f];
        axpy(dx + r * D, x + r * D, D, -root * root * sum);
      }
  }
};

// rows of v (n, D) with a column of ones, rows ``ld`` apart: (n, D + 1)
template <typename T>
void with_ones(const T* v, int64_t n, int64_t D, T* out, int64_t ld) {
  for (int64_t r = 0; r < n; r++) {
    std::copy(v + r * D, v + (r + 1) * D, out + r * ld);
    out[r * ld + D] = T(1);
  }
}

// zero the strictly upper (``upper``) or strictly lower triangle of an (n, n) matrix with leading dimension ld, and
// columns [n, c) of its rows: a chunk shorter than c multiplies zeros there
template <typename T>
void triangle(T* a, int64_t n, int64_t c, int64_t ld, bool upper) {
  for (int64_t r = 0; r < n; r++) {
    if (upper)
      std::fill(a + r * ld + r + 1, a + r * ld + c, T(0));
    else {
      std::fill(a + r * ld, a + r * ld + r, T(0));
      std::fill(a + r * ld + n, a + r * ld + c, T(0));
    }
  }
}

// b (cols, rows) = aᵀ of a (rows, cols), leading dimensions lda, ldb
template <typename T>
void transpose(const T* a, int64_t rows, int64_t cols, int64_t lda, T* b, int64_t ldb) {
  for (int64_t r = 0; r < rows; r++)
    for (int64_t j = 0; j < cols; j++) b[j * ldb + r] = a[r * lda + j];
}

struct Sizes {
  int64_t B, H, N, D, F, chunk, valid_heads;
};

template <typename T>
Features<T> features_of(const std::optional<at::Tensor>& projection, const at::Tensor& half, int64_t h,
                        const Sizes& s, double scale) {
  Features<T> f;
  f.F = s.F;
  f.D = s.D;
  if (projection.has_value()) {
    f.w = projection->data_ptr<T>() + h * s.F * s.D;
    f.half_w = half.data_ptr<T>() + h * s.F;
    f.root = static_cast<T>(std::sqrt(scale));
    f.log_half = static_cast<T>(0.5 * std::log(static_cast<double>(s.F)));
  }
  return f;
}

Sizes check(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
            const std::optional<at::Tensor>& key_valid, const std::optional<at::Tensor>& projection, int64_t chunk,
            double scale) {
  checks::floating(op, q, "q");
  RF_CHECK(q.dim() == 4, op, "q must be 4-D (B, H, N, D), got ", checks::dims(q.sizes()));
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3);
  checks::flat(op, q, "q", q.scalar_type(), "(B, H, N, D)", {B, H, N, D});
  checks::flat(op, k, "k", q.scalar_type(), "(B, H, N, D) like q", {B, H, N, D});
  checks::flat(op, v, "v", q.scalar_type(), "(B, H, N, D) like q", {B, H, N, D});
  checks::key_valid(op, key_valid, B, H, N);
  checks::at_least(op, chunk, 1, "chunk");
  checks::finite(op, scale, "scale");
  int64_t F = D;
  if (projection.has_value()) {
    RF_CHECK(projection->dim() == 3, op, "projection must be (H, m, D), got ", checks::dims(projection->sizes()));
    F = projection->size(1);
    checks::flat(op, *projection, "projection", q.scalar_type(), "(H, m, D)", {H, F, D});
    checks::at_least(op, F, 1, "the projection's m");
    RF_CHECK(scale > 0, op, "scale must be positive, got ", scale);
  }
  return Sizes{B, H, N, D, F, std::min(chunk, std::max<int64_t>(N, 1)),
               key_valid.has_value() ? key_valid->size(1) : 0};
}

// |w_r|² / 2 per head and row: (H, m), or an empty tensor without a projection
at::Tensor half_norms(const std::optional<at::Tensor>& projection, const at::Tensor& like) {
  if (!projection.has_value()) return at::empty({0}, like.options());
  return projection->square().sum(-1).mul_(0.5).contiguous();
}

// fn(r0, sub) for every document of the row of (batch, head) bh: its first row r0 and its sizes (N its length,
// the chunk at most that); one call over the whole row without documents
template <typename Fn>
void each_document(const std::optional<at::Tensor>& documents, const Sizes& s, int64_t bh, const Fn& fn) {
  if (!documents.has_value()) {
    fn(int64_t(0), s);
    return;
  }
  const int64_t* ids = documents->data_ptr<int64_t>() + (bh / s.H) * s.N;
  for (int64_t r0 = 0; r0 < s.N;) {
    int64_t r1 = r0 + 1;
    while (r1 < s.N && ids[r1] == ids[r0]) r1++;
    Sizes sub = s;
    sub.N = r1 - r0;
    sub.chunk = std::min(s.chunk, sub.N);
    fn(r0, sub);
    r0 = r1;
  }
}

void check_documents(const char* op, const std::optional<at::Tensor>& documents, const Sizes& s) {
  if (!documents.has_value()) return;
  checks::dtype(op, *documents, "documents", at::kLong);
  RF_CHECK(documents->dim() == 2 && documents->size(0) == s.B && documents->size(1) == s.N, op,
           "documents must be (B, N) = (", s.B, ", ", s.N, "), got ", checks::dims(documents->sizes()));
  checks::contiguous(op, *documents, "documents");
}

const bool* valid_rows(const std::optional<at::Tensor>& key_valid, const Sizes& s, int64_t bh) {
  if (!key_valid.has_value()) return nullptr;
  const int64_t b = bh / s.H, h = bh % s.H;
  return key_valid->data_ptr<bool>() + (b * s.valid_heads + (s.valid_heads == 1 ? 0 : h)) * s.N;
}

// fn(bh, scratch) for every (batch, head) bh: the heads shared out among the threads, each head's chunks in order on
// one thread (the same bits for every thread count), one scratch vector for each thread's share.
template <typename T, typename Fn>
void each_head(int64_t heads, const Fn& fn) {
  at::parallel_for(0, heads, 1, [&](int64_t h0, int64_t h1) {
    std::vector<T> scratch;
    for (int64_t bh = h0; bh < h1; bh++) fn(bh, scratch);
  });
}

// Products that share an output are one product of operands side by side: [num | den] = [A | φ(q)] · [[v | 1]; S]
// (c + F inner), with the chunk's rows at the front of each operand and the state behind them at a fixed place (a
// chunk shorter than c leaves zeros between): three BLAS calls a chunk instead of four, and longer inner products.
template <typename T>
void forward_head(const T* q, const T* k, const T* v, const bool* valid, const Features<T>& fm, const Sizes& s,
                  T* out, T* den, std::vector<T>& scratch) {
  const int64_t c = s.chunk, D = s.D, F = s.F, E = D + 1, L = c + F;
  scratch.assign(c * L + L * E + c * F + c * E, T(0));
  T *x = scratch.data(), *y = x + c * L, *fk = y + L * E, *num = fk + c * F;
  T* state = y + c * E;  // rows [c, c + F) of y: Σ φ(k) [v, 1]ᵀ over the chunks before, zero at first
  for (int64_t r0 = 0; r0 < s.N; r0 += c) {
    const int64_t n = std::min(c, s.N - r0);
    fm(q + r0 * D, n, true, nullptr, x + c, L);  // x = [A | φ(q)]
    fm(k + r0 * D, n, false, valid == nullptr ? nullptr : valid + r0, fk, F);
    with_ones(v + r0 * D, n, D, y, E);  // y = [[v | 1]; S]
    if (n < c) std::fill(y + n * E, y + c * E, T(0));
    gemm<T>(false, true, n, n, F, T(1), x + c, L, fk, F, T(0), x, L);  // A = φ(q) φ(k)ᵀ
    triangle(x, n, c, L, true);
    gemm<T>(false, false, n, E, L, T(1), x, L, y, E, T(0), num, E);
    gemm<T>(true, false, F, E, n, T(1), fk, F, y, E, T(1), state, E);
    for (int64_t r = 0; r < n; r++) {
      const T d = num[r * E + D];
      den[r0 + r] = d;
      T* o = out + (r0 + r) * D;
      std::copy(num + r * E, num + r * E + D, o);
      scale_row(o, D, d > T(0) ? T(1) / d : T(1));  // a row without a key: its numerator, 0
    }
  }
}

// The backward's products likewise side by side, each chunk's rows first, the state or its transpose behind:
//   dφ(q) = [A | g] · [φ(k); S_cᵀ],   dφ(k) = [Aᵀ | [v | 1]] · [φ(q); Gᵀ],   d[v | 1] = [Pᵀ | φ(k)] · [g; G]
// with A = tril(g [v | 1]ᵀ), P = tril(φ(q) φ(k)ᵀ), S_c the state before the chunk (kept transposed from a first pass
// in order) and G = Σ φ(q)ᵀ g over the later chunks: six BLAS calls a chunk (and one in the first pass).
template <typename T>
void backward_head(const T* dout, const T* q, const T* k, const T* v, const T* out, const T* den, const bool* valid,
                   const Features<T>& fm, const Sizes& s, T* dq, T* dk, T* dv, std::vector<T>& scratch) {
  const int64_t c = s.chunk, D = s.D, F = s.F, E = D + 1, C = ceil_div(s.N, c), LE = c + E, LF = c + F;
  const int64_t kept = C * E * F;
  scratch.assign(kept + 2 * (c * LE + LE * F) + c * LF + LF * E + 2 * c * F, T(0));
  T* states = scratch.data();  // (C, E, F): S_cᵀ
  T *g1 = states + kept, *b1 = g1 + c * LE, *g2 = b1 + LE * F, *b2 = g2 + c * LE, *g3 = b2 + LE * F,
    *b3 = g3 + c * LF, *dfq = b3 + LF * E, *dfk = dfq + c * F;
  T *fk = b1, *fq = b2, *later = b3 + c * E, *later_t = b2 + c * F;  // φ(k), φ(q) (c, F); G (F, E); Gᵀ (E, F)
  T *vc = g2 + c, *g = g1 + c;  // [v | 1] and g (n, E), rows LE apart
  // In order: the state before each chunk, transposed (chunk 0's stays zero)
  for (int64_t ci = 0; ci + 1 < C; ci++) {
    const int64_t r0 = ci * c, n = std::min(c, s.N - r0);
    fm(k + r0 * D, n, false, valid == nullptr ? nullptr : valid + r0, fk, F);
    with_ones(v + r0 * D, n, D, vc, LE);
    T* next = states + (ci + 1) * E * F;
    if (ci > 0) std::copy(states + ci * E * F, states + (ci + 1) * E * F, next);
    gemm<T>(true, false, E, F, n, T(1), vc, LE, fk, F, ci > 0 ? T(1) : T(0), next, F);
  }
  // In reverse: everything else, each chunk's features computed once
  for (int64_t ci = C - 1; ci >= 0; ci--) {
    const int64_t r0 = ci * c, n = std::min(c, s.N - r0);
    const bool* vrows = valid == nullptr ? nullptr : valid + r0;
    fm(q + r0 * D, n, true, nullptr, fq, F);
    fm(k + r0 * D, n, false, vrows, fk, F);
    if (n < c) {  // rows [n, c) of the operands' chunk parts: zeros
      std::fill(fq + n * F, fq + c * F, T(0));
      std::fill(fk + n * F, fk + c * F, T(0));
    }
    with_ones(v + r0 * D, n, D, vc, LE);
    for (int64_t r = 0; r < n; r++) {  // g = [do / den | -Σ(do·o) / den]; a row that saw no key: [do | 0]
      const T d = den[r0 + r];
      const T* gr = dout + (r0 + r) * D;
      T* row = g + r * LE;
      if (d > T(0)) {
        const T inv = T(1) / d;
        for (int64_t j = 0; j < D; j++) row[j] = gr[j] * inv;
        row[D] = -dot(gr, out + (r0 + r) * D, D) * inv;
      } else {
        std::copy(gr, gr + D, row);
        row[D] = T(0);
      }
    }
    std::copy(states + ci * E * F, states + (ci + 1) * E * F, b1 + c * F);  // b1 = [φ(k); S_cᵀ]
    gemm<T>(false, true, n, n, E, T(1), g, LE, vc, LE, T(0), g1, LE);  // g1 = [A | g]
    triangle(g1, n, c, LE, true);
    gemm<T>(false, false, n, F, LE, T(1), g1, LE, b1, F, T(0), dfq, F);
    transpose(g1, n, c, LE, g2, LE);  // g2 = [Aᵀ | [v | 1]]
    gemm<T>(false, false, n, F, LE, T(1), g2, LE, b2, F, T(0), dfk, F);  // b2 = [φ(q); Gᵀ]
    gemm<T>(false, true, n, n, F, T(1), fk, F, fq, F, T(0), g3, LF);  // g3 = [Pᵀ | φ(k)]
    triangle(g3, n, c, LF, false);
    for (int64_t r = 0; r < n; r++) {
      std::copy(fk + r * F, fk + (r + 1) * F, g3 + r * LF + c);
      std::copy(g + r * LE, g + r * LE + E, b3 + r * E);  // b3 = [g; G]
    }
    if (n < c) std::fill(b3 + n * E, b3 + c * E, T(0));
    T* dvc = g1;  // A is read: its rows hold d[v | 1] now
    gemm<T>(false, false, n, E, LF, T(1), g3, LF, b3, E, T(0), dvc, E);
    for (int64_t r = 0; r < n; r++) std::copy(dvc + r * E, dvc + r * E + D, dv + (r0 + r) * D);
    gemm<T>(true, false, F, E, n, T(1), fq, F, b3, E, T(1), later, E);  // G += φ(q)ᵀ g
    transpose(later, F, E, E, later_t, F);
    fm.grad(q + r0 * D, fq, F, dfq, n, true, dq + r0 * D);
    if (vrows != nullptr)
      for (int64_t r = 0; r < n; r++)
        if (!vrows[r]) std::fill(dfk + r * F, dfk + (r + 1) * F, T(0));
    fm.grad(k + r0 * D, fk, F, dfk, n, false, dk + r0 * D);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> fused_feature_scan_forward(const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& v,
                                                              const std::optional<at::Tensor>& key_valid,
                                                              const std::optional<at::Tensor>& projection,
                                                              const std::optional<at::Tensor>& documents,
                                                              int64_t chunk, double scale) {
  const char* op = "feature_scan_forward";
  const Sizes s = check(op, q, k, v, key_valid, projection, chunk, scale);
  check_documents(op, documents, s);
  auto out = at::empty_like(q);
  auto den = at::empty({s.B, s.H, s.N}, q.options());
  const auto half = half_norms(projection, q);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "routeformer_feature_scan_forward", [&] {
    const int64_t rows = s.N * s.D;
    each_head<scalar_t>(s.B * s.H, [&](int64_t bh, std::vector<scalar_t>& scratch) {
      const auto fm = features_of<scalar_t>(projection, half, bh % s.H, s, scale);
      const bool* valid = valid_rows(key_valid, s, bh);
      each_document(documents, s, bh, [&](int64_t r0, const Sizes& sub) {
        const int64_t at = bh * rows + r0 * s.D;
        forward_head(q.data_ptr<scalar_t>() + at, k.data_ptr<scalar_t>() + at, v.data_ptr<scalar_t>() + at,
                     valid == nullptr ? nullptr : valid + r0, fm, sub, out.data_ptr<scalar_t>() + at,
                     den.data_ptr<scalar_t>() + bh * s.N + r0, scratch);
      });
    });
  });
  return {out, den};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_feature_scan_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& den, const std::optional<at::Tensor>& key_valid, const std::optional<at::Tensor>& projection,
    const std::optional<at::Tensor>& documents, int64_t chunk, double scale) {
  const char* op = "feature_scan_backward";
  const Sizes s = check(op, q, k, v, key_valid, projection, chunk, scale);
  check_documents(op, documents, s);
  checks::flat(op, grad_out, "grad_out", q.scalar_type(), "(B, H, N, D) like q", {s.B, s.H, s.N, s.D});
  checks::flat(op, out, "out", q.scalar_type(), "(B, H, N, D) like q", {s.B, s.H, s.N, s.D});
  checks::flat(op, den, "den", q.scalar_type(), "(B, H, N)", {s.B, s.H, s.N});
  auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  const auto half = half_norms(projection, q);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "routeformer_feature_scan_backward", [&] {
    const int64_t rows = s.N * s.D;
    each_head<scalar_t>(s.B * s.H, [&](int64_t bh, std::vector<scalar_t>& scratch) {
      const auto fm = features_of<scalar_t>(projection, half, bh % s.H, s, scale);
      const bool* valid = valid_rows(key_valid, s, bh);
      each_document(documents, s, bh, [&](int64_t r0, const Sizes& sub) {
        const int64_t at = bh * rows + r0 * s.D;
        backward_head(grad_out.data_ptr<scalar_t>() + at, q.data_ptr<scalar_t>() + at, k.data_ptr<scalar_t>() + at,
                      v.data_ptr<scalar_t>() + at, out.data_ptr<scalar_t>() + at,
                      den.data_ptr<scalar_t>() + bh * s.N + r0, valid == nullptr ? nullptr : valid + r0, fm, sub,
                      dq.data_ptr<scalar_t>() + at, dk.data_ptr<scalar_t>() + at, dv.data_ptr<scalar_t>() + at,
                      scratch);
      });
    });
  });
  return {dq, dk, dv};
}

}  // namespace routeformer
