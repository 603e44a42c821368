// The pieces every fused attention kernel shares: matrix products on raw rows, vectorised row operations, the
// per-thread scratch, and the block of query rows against a range of keys (forward and recomputing backward).
//
// A *block* is up to TQ query rows, each with its own interval [a, e) of key sequence indices, against the union of
// those intervals, taken in chunks of at most KC keys with an online softmax (so one block may see any number of
// keys). Rules say which (row, key) pairs inside an interval are masked, how far apart a pair is for relative
// positions, and its additive bias. Products are BLAS calls on rows in place (or gathered by index into scratch when
// the sequence is permuted); the probabilities live in one (TQ, KC) buffer and are never kept: the backward
// recomputes them from q, k and the row's log-sum-exp.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>  // vec_reduce_all (vec.h brings it only with some capabilities)
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// BLAS of the PyTorch build (MKL or OpenBLAS export these Fortran symbols); weak, so that a build without them still
// loads and takes the ATen matmul instead (``has_blas`` tells Python which).
extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*, const int*,
            const float*, const int*, const float*, float*, const int*) __attribute__((weak));
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*, const double*, const int*,
            const double*, const int*, const double*, double*, const int*) __attribute__((weak));
// MKL's thread count for the calling thread (returns the previous one; 0: MKL's global count). Null without MKL.
int MKL_Set_Num_Threads_Local(int) __attribute__((weak));
}

namespace routeformer {

inline bool has_blas() { return sgemm_ != nullptr && dgemm_ != nullptr; }

// ceil(a / b) for a >= 0, b > 0, without the overflow of (a + b - 1) / b for a b taken from an int list
inline int64_t ceil_div(int64_t a, int64_t b) { return a == 0 ? 0 : (a - 1) / b + 1; }

template <typename T>
at::ScalarType scalar_type_of();
template <>
inline at::ScalarType scalar_type_of<float>() { return at::kFloat; }
template <>
inline at::ScalarType scalar_type_of<double>() { return at::kDouble; }

// Row-major C (m, n) = alpha · op(A) · op(B) + beta · C; op(X) = X or Xᵀ (ta, tb), leading dimensions in elements.
template <typename T>
inline void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
                 int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // C = beta · C
    for (int64_t i = 0; i < m; i++)
      for (int64_t j = 0; j < n; j++) c[i * ldc + j] = beta == T(0) ? T(0) : beta * c[i * ldc + j];
    return;
  }
#ifdef ROUTEFORMER_SANITIZE  // the sanitizer build (tests/test_sanitizer.py): loops it sees every read and write of
  for (int64_t i = 0; i < m; i++)
    for (int64_t j = 0; j < n; j++) {
      T acc = 0;
      for (int64_t p = 0; p < k; p++)
        acc += (ta ? a[p * lda + i] : a[i * lda + p]) * (tb ? b[j * ldb + p] : b[p * ldb + j]);
      c[i * ldc + j] = beta == T(0) ? alpha * acc : alpha * acc + beta * c[i * ldc + j];
    }
  return;
#endif
  if (has_blas()) {  // column-major BLAS computes Cᵀ = op(B)ᵀ · op(A)ᵀ
    // On the calling thread alone: the kernels share out their blocks themselves, and MKL, left to its own thread
    // count, splits some products (long inner dimensions: a chunk with its relative table rows) differently at
    // different counts, which changes the bits of the sums.
    const int mkl_threads = MKL_Set_Num_Threads_Local != nullptr ? MKL_Set_Num_Threads_Local(1) : 0;
    const char tA = ta ? 'T' : 'N', tB = tb ? 'T' : 'N';
    const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
    const int LDA = static_cast<int>(ldb), LDB = static_cast<int>(lda), LDC = static_cast<int>(ldc);
    if constexpr (std::is_same_v<T, float>) {
      sgemm_(&tB, &tA, &M, &N, &K, &alpha, b, &LDA, a, &LDB, &beta, c, &LDC);
    } else {
      dgemm_(&tB, &tA, &M, &N, &K, &alpha, b, &LDA, a, &LDB, &beta, c, &LDC);
    }
    if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(mkl_threads);
    return;
  }
  // No BLAS symbols in this build of PyTorch: ATen's matmul on views of the rows.
  auto opts = at::TensorOptions().dtype(scalar_type_of<T>());
  auto A = ta ? at::from_blob(const_cast<T*>(a), {k, m}, {lda, 1}, opts).t()
              : at::from_blob(const_cast<T*>(a), {m, k}, {lda, 1}, opts);
  auto B = tb ? at::from_blob(const_cast<T*>(b), {n, k}, {ldb, 1}, opts).t()
              : at::from_blob(const_cast<T*>(b), {k, n}, {ldb, 1}, opts);
  auto C = at::from_blob(c, {m, n}, {ldc, 1}, opts);
  auto prod = at::mm(A, B);
  if (alpha != T(1)) prod.mul_(alpha);
  if (beta == T(0)) C.copy_(prod);
  else { C.mul_(beta); C.add_(prod); }
}

// exp(x - shift) over n values in place, returning their sum (x = -inf gives 0). float: ATen's vectorised exp_u20.
template <typename T>
inline T exp_shift_sum(T* x, int64_t n, T shift) {
  T sum = 0;
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {
    using Vec = at::vec::Vectorized<float>;
    const Vec vs(shift);
    Vec acc(0.f);
    for (; j + Vec::size() <= n; j += Vec::size()) {
      Vec e = (Vec::loadu(x + j) - vs).exp_u20();
      e.store(x + j);
      acc = acc + e;
    }
    sum = at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, acc);
  }
  for (; j < n; j++) {
    x[j] = std::exp(x[j] - shift);
    sum += x[j];
  }
  return sum;
}

template <typename T>
inline T max_of(const T* x, int64_t n) {
  T m = -std::numeric_limits<T>::infinity();
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {
    using Vec = at::vec::Vectorized<float>;
    if (n >= Vec::size()) {
      Vec acc = Vec::loadu(x);
      for (j = Vec::size(); j + Vec::size() <= n; j += Vec::size()) acc = at::vec::maximum(acc, Vec::loadu(x + j));
      m = at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, acc);
    }
  }
  for (; j < n; j++) m = std::max(m, x[j]);
  return m;
}

template <typename T>
inline T dot(const T* a, const T* b, int64_t n) {
  T s = 0;
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {
    using Vec = at::vec::Vectorized<float>;
    Vec acc(0.f);
    for (; j + Vec::size() <= n; j += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + j), Vec::loadu(b + j), acc);
    s = at::vec::vec_reduce_all<float>([](const Vec& x, const Vec& y) { return x + y; }, acc);
  }
  for (; j < n; j++) s += a[j] * b[j];
  return s;
}

template <typename T>
inline void scale_row(T* x, int64_t n, T f) {
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {
    using Vec = at::vec::Vectorized<float>;
    const Vec vf(f);
    for (; j + Vec::size() <= n; j += Vec::size()) (Vec::loadu(x + j) * vf).store(x + j);
  }
  for (; j < n; j++) x[j] *= f;
}

// y += f · x
template <typename T>
inline void axpy(T* y, const T* x, int64_t n, T f) {
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {
    using Vec = at::vec::Vectorized<float>;
    const Vec vf(f);
    for (; j + Vec::size() <= n; j += Vec::size())
      at::vec::fmadd(Vec::loadu(x + j), vf, Vec::loadu(y + j)).store(y + j);
  }
  for (; j < n; j++) y[j] += f * x[j];
}

// ds = p · (dp - delta), in place in dp
template <typename T>
inline void softmax_grad_row(T* dp, const T* p, int64_t n, T delta) {
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {
    using Vec = at::vec::Vectorized<float>;
    const Vec vd(delta);
    for (; j + Vec::size() <= n; j += Vec::size()) ((Vec::loadu(dp + j) - vd) * Vec::loadu(p + j)).store(dp + j);
  }
  for (; j < n; j++) dp[j] = p[j] * (dp[j] - delta);
}

// Aligned scratch that grows and is reused: one per thread's share of the work.
template <typename T>
struct Buffer {
  T* ptr = nullptr;
  size_t size = 0;
  T* get(size_t n) {
#ifdef ROUTEFORMER_SANITIZE  // exactly n values each time: the sanitizer sees a read or write past what was asked for
    if (n != size) {
      std::free(ptr);
      ptr = nullptr;
      TORCH_CHECK(posix_memalign(reinterpret_cast<void**>(&ptr), 64, std::max<size_t>(n, 1) * sizeof(T)) == 0,
                  "routeformer fused attention: out of memory for ", n, " scratch values");
      size = n;
    }
    return ptr;
#endif
    if (n > size) {
      std::free(ptr);
      size_t bytes = ((n * sizeof(T) + 63) / 64) * 64;
      ptr = static_cast<T*>(std::aligned_alloc(64, bytes));
      TORCH_CHECK(ptr != nullptr, "routeformer fused attention: out of memory for ", n, " scratch values");
      size = n;
    }
    return ptr;
  }
  ~Buffer() { std::free(ptr); }
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

// One (batch, head) of the inputs: rows of q, k, v (last dimension contiguous) and, for a permuted sequence, the
// physical row of every key sequence index.
template <typename T>
struct Head {
  const T* q;
  int64_t q_stride;
  const T* k;
  int64_t k_stride;
  const T* v;
  int64_t v_stride;
  const int64_t* key_order;  // key sequence index -> row of k, v; null: the identity
  int64_t D;
  T scale;
  const T* key_scale = nullptr;  // per row of k: the key is that row times this (LSH's unit keys); null: 1
};

// Relative position tables a^K, a^V (L = 2·max_distance + 1 rows of D), or none.
template <typename T>
struct Rel {
  const T* key = nullptr;
  const T* value = nullptr;
  int64_t max_distance = 0;
  bool on() const { return key != nullptr; }
  static Rel of(const std::optional<at::Tensor>& key_table, const std::optional<at::Tensor>& value_table,
                int64_t max_distance) {
    Rel r;
    if (key_table.has_value()) {
      r.key = key_table->data_ptr<T>();
      r.value = value_table->data_ptr<T>();
      r.max_distance = max_distance;
    }
    return r;
  }
  int64_t index(int64_t distance) const {
    return std::min(std::max(distance, -max_distance), max_distance) + max_distance;
  }
};

// The rows of one block: each row's query (physical row in q), its sequence index (for its own key and distances)
// and its key interval [a, e) in key sequence indices (a >= e: the row sees nothing).
struct Rows {
  int64_t n = 0;
  const int64_t* qrow = nullptr;
  const int64_t* qseq = nullptr;
  const int64_t* a = nullptr;
  const int64_t* e = nullptr;
  bool contiguous = false;  // qrow[r] = qrow[0] + r
};

// The scratch of one thread.
template <typename T>
struct Work {
  Buffer<T> q, dout, k, v, s, dp, dq, kv_grad;
  Buffer<T> m, l, self_score;
  Buffer<int32_t> idx;
  Buffer<uint8_t> self_ok;
};

constexpr int64_t KC = 512;       // keys per chunk: a (TQ, KC) score buffer stays in L2
constexpr int64_t LD = KC + 16;  // its row stride: not a power of two, so rows do not share cache sets

// Per-row results of a forward block (rows of ``Work``): o (n, D) normalised, lse, and whether the row saw only its
// own key (exclude_self).
template <typename T>
struct BlockOut {
  T* o;
  T* lse;
  uint8_t* alone;
};

template <typename T>
inline T neg_inf() { return std::numeric_limits<T>::lowest(); }

// Load the block's query rows (or another tensor's same rows: dout) as a (n, D) matrix: in place when contiguous,
// else gathered into ``buf``. Returns (pointer, leading dimension).
template <typename T>
inline std::pair<const T*, int64_t> load_rows(const T* base, int64_t stride, const Rows& rows, int64_t D,
                                              Buffer<T>& buf) {
  if (rows.contiguous) return {base + rows.qrow[0] * stride, stride};
  T* out = buf.get(rows.n * D);
  for (int64_t r = 0; r < rows.n; r++) std::memcpy(out + r * D, base + rows.qrow[r] * stride, D * sizeof(T));
  return {out, D};
}

// The rules of a kernel: which (row, key) pairs inside a row's interval are kept, how far apart a pair is for
// relative positions, its additive bias and the row's own key. A rules type is a value the blocks below are
// templated over (each kernel's pair loops inline its rules: no virtual call per pair); ``RequireRules`` names
// every member it must have, so a rules type missing one fails to compile with a message naming that member:
//   bool elementwise(int64_t r) const    whether row r needs the per-pair mask pass (allowed) at all
//   bool allowed(int64_t r, int64_t j) const    whether row r keeps key j (read only where elementwise(r))
//   int64_t distance(int64_t r, int64_t j) const    the pair's relative distance (read only with tables)
//   int64_t unit() const    1: distance(r, j) = j - qseq[r] (read affinely: ``RelChunk``), else per pair
//   has_bias (a bool member, static constexpr where fixed), T bias(int64_t r, int64_t j) const
//   int64_t self(int64_t r) const    the key index of row r's own key when it is excluded unless alone, else -1
// (The detection idiom, not a C++20 concept: it compiles under whichever -std cpp_extension passes, C++17 included.)
namespace rules {
#define RF_RULES_MEMBER(NAME, EXPR)                                                  \
  template <typename Rules, typename = void>                                         \
  struct NAME : std::false_type {};                                                  \
  template <typename Rules>                                                          \
  struct NAME<Rules, std::void_t<decltype(EXPR)>> : std::true_type {};
RF_RULES_MEMBER(provides_elementwise, bool(std::declval<const Rules&>().elementwise(int64_t())))
RF_RULES_MEMBER(provides_allowed, bool(std::declval<const Rules&>().allowed(int64_t(), int64_t())))
RF_RULES_MEMBER(provides_distance, int64_t(std::declval<const Rules&>().distance(int64_t(), int64_t())))
RF_RULES_MEMBER(provides_unit, int64_t(std::declval<const Rules&>().unit()))
RF_RULES_MEMBER(provides_has_bias, bool(std::declval<const Rules&>().has_bias))
RF_RULES_MEMBER(provides_bias, std::declval<const Rules&>().bias(int64_t(), int64_t()))
RF_RULES_MEMBER(provides_self, int64_t(std::declval<const Rules&>().self(int64_t())))
#undef RF_RULES_MEMBER
}  // namespace rules

template <typename T, typename Rules>
struct RequireRules {
  static_assert(rules::provides_elementwise<Rules>::value,
                "a rules type needs bool elementwise(int64_t row) const: whether the row needs the per-pair mask");
  static_assert(rules::provides_allowed<Rules>::value,
                "a rules type needs bool allowed(int64_t row, int64_t key) const: whether the row keeps the key");
  static_assert(rules::provides_distance<Rules>::value,
                "a rules type needs int64_t distance(int64_t row, int64_t key) const: the pair's relative distance");
  static_assert(rules::provides_unit<Rules>::value,
                "a rules type needs int64_t unit() const: 1 when distance(r, j) = j - qseq[r], else 0");
  static_assert(rules::provides_has_bias<Rules>::value,
                "a rules type needs a bool has_bias member: whether bias(r, j) is added");
  static_assert(rules::provides_bias<Rules>::value,
                "a rules type needs T bias(int64_t row, int64_t key) const: the pair's additive bias");
  static_assert(rules::provides_self<Rules>::value,
                "a rules type needs int64_t self(int64_t row) const: the row's own key when excluded, else -1");
  static constexpr bool ok = true;
};

// The relative-position table rows of one chunk's pairs. Unit distances (key - query index, a sliding window's) are
// affine in the key index between the clipping points, so a row's pairs read and write a contiguous stretch of table
// rows (two constant ends where clipped): vector passes, no per-pair index. Other distances (per tile entry, between
// positions) store each pair's table row in ``idx`` ((n, LD) int32). Either way only the table rows [u0, u0 + U) the
// chunk uses are multiplied.
template <typename T, typename Rules>
struct RelChunk {
  const Rules& rules;
  const Rel<T>& rel;
  const Rows& rows;
  int64_t c0, c1;
  bool affine;
  int32_t* idx;
  int64_t u0 = 0, U = 0;
  bool direct = false;  // irregular distances spread over many table rows: per-pair products, not (n, U) ones

  RelChunk(const Rules& rules_, const Rel<T>& rel_, const Rows& rows_, int64_t c0_, int64_t c1_, int32_t* idx_)
      : rules(rules_), rel(rel_), rows(rows_), c0(c0_), c1(c1_), affine(rules_.unit() == 1), idx(idx_) {
    if (!rel.on()) return;
    int64_t lo = std::numeric_limits<int64_t>::max(), hi = -1;
    for (int64_t r = 0; r < rows.n; r++) {
      const int64_t a = std::max(rows.a[r], c0), e = std::min(rows.e[r], c1);
      if (a >= e) continue;
      if (affine) {  // u grows with the key index
        lo = std::min(lo, rel.index(a - rows.qseq[r]));
        hi = std::max(hi, rel.index(e - 1 - rows.qseq[r]));
        continue;
      }
      int32_t* row = idx + r * LD;
      for (int64_t j = a; j < e; j++) {
        const int64_t u = rel.index(rules.distance(r, j));
        row[j - c0] = static_cast<int32_t>(u);
        lo = std::min(lo, u);
        hi = std::max(hi, u);
      }
    }
    if (hi >= lo) {
      u0 = lo;
      U = hi - lo + 1;
    }
    direct = !affine && U > 2 * (c1 - c0);
  }
  // the table row of pair (r, local column j), for direct mode
  const int32_t* row_index(int64_t r) const { return idx + r * LD; }
  // Local key columns [a, e) of row r split at the clipping points: [a, m0) clipped below, [m0, m1) unclipped
  // (table row j + c0 - i + K), [m1, e) clipped above.
  void split(int64_t r, int64_t a, int64_t e, int64_t& m0, int64_t& m1) const {
    const int64_t i = rows.qseq[r], K = rel.max_distance;
    m0 = std::min(std::max(i - K - c0, a), e);
    m1 = std::min(std::max(i + K + 1 - c0, m0), e);
  }
  // row[j] += vals[u(r, j) - u0] for local columns [a, e)
  void gather_add(int64_t r, T* row, int64_t a, int64_t e, const T* vals) const {
    if (!affine) {
      const int32_t* ir = idx + r * LD;
      for (int64_t j = a; j < e; j++) row[j] += vals[ir[j] - u0];
      return;
    }
    int64_t m0, m1;
    split(r, a, e, m0, m1);
    const int64_t K = rel.max_distance, shift = c0 - rows.qseq[r] + K - u0;
    for (int64_t j = a; j < m0; j++) row[j] += vals[-u0];
    axpy(row + m0, vals + m0 + shift, m1 - m0, T(1));
    for (int64_t j = m1; j < e; j++) row[j] += vals[2 * K - u0];
  }
  // out[u(r, j) - u0] += src[j] for local columns [a, e)
  void scatter_add(int64_t r, const T* src, int64_t a, int64_t e, T* out) const {
    if (!affine) {
      const int32_t* ir = idx + r * LD;
      for (int64_t j = a; j < e; j++) out[ir[j] - u0] += src[j];
      return;
    }
    int64_t m0, m1;
    split(r, a, e, m0, m1);
    const int64_t K = rel.max_distance, shift = c0 - rows.qseq[r] + K - u0;
    T below = 0, above = 0;
    for (int64_t j = a; j < m0; j++) below += src[j];
    for (int64_t j = m1; j < e; j++) above += src[j];
    if (m0 > a) out[-u0] += below;
    axpy(out + m0 + shift, src + m0, m1 - m0, T(1));
    if (e > m1) out[2 * K - u0] += above;
  }
};

// The keys (or values) of one chunk as the right-hand side of a product: rows [c0, c0 + nc) of a head in place (no
// key order, no relative tables), else copied into ``buf``: the chunk's rows (gathered by the key order) and, when
// ``table`` is given, the U table rows [u0, u0 + U) after them, so that one product yields both q·kᵀ and q·a^Kᵀ
// (or p·v and the value term). Returns (pointer, leading dimension).
template <typename T>
inline std::pair<const T*, int64_t> chunk_operand(const T* base, int64_t stride, const int64_t* order, int64_t c0,
                                                  int64_t nc, int64_t D, const T* table, int64_t u0, int64_t U,
                                                  Buffer<T>& buf, const T* row_scale = nullptr) {
  if (order == nullptr && table == nullptr && row_scale == nullptr) return {base + c0 * stride, stride};
  T* out = buf.get((nc + U) * D);
  for (int64_t j = 0; j < nc; j++) {
    const int64_t row = order == nullptr ? c0 + j : order[c0 + j];
    std::memcpy(out + j * D, base + row * stride, D * sizeof(T));
    if (row_scale != nullptr) scale_row(out + j * D, D, row_scale[row]);
  }
  if (table != nullptr) std::memcpy(out + nc * D, table + u0 * D, U * D * sizeof(T));
  return {out, D};
}

// Add (nc + U, D) key-side gradient rows: the first nc to rows [c0, c0 + nc) of ``dk`` (through the key order), the
// rest to the table rows [u0, u0 + U).
template <typename T>
inline void add_key_rows(const T* src, int64_t nc, int64_t D, const int64_t* order, int64_t c0, T* dk, T* dtable,
                         int64_t u0, int64_t U) {
  for (int64_t j = 0; j < nc; j++) axpy(dk + (order == nullptr ? c0 + j : order[c0 + j]) * D, src + j * D, D, T(1));
  if (dtable != nullptr) axpy(dtable + u0 * D, src + nc * D, U * D, T(1));
}

// The per-pair terms of row r's scores on local columns [a, e) of a chunk starting at key c0: the relative key
// term (from the table columns after the chunk's own nc when ``ext``, else per pair when direct), the bias, and
// the per-pair masks (a masked pair's score becomes -inf). ``qrow``: the row's query.
template <typename T, typename Rules>
inline void add_pair_terms(const Rules& rules, const RelChunk<T, Rules>& rc, const Rel<T>& rel, const Head<T>& h,
                           const T* qrow, int64_t r, T* row, int64_t a, int64_t e, int64_t c0, int64_t nc, bool ext) {
  if (ext) rc.gather_add(r, row, a, e, row + nc);
  if (rc.direct) {
    const int32_t* ir = rc.row_index(r);
    for (int64_t j = a; j < e; j++) row[j] += h.scale * dot(qrow, rel.key + ir[j] * h.D, h.D);
  }
  if (rules.has_bias)
    for (int64_t j = a; j < e; j++) row[j] += rules.bias(r, j + c0);
  if (rules.elementwise(r))
    for (int64_t j = a; j < e; j++)
      if (!rules.allowed(r, j + c0)) row[j] = -std::numeric_limits<T>::infinity();
}

// The relative tables' gradients from per-head partials (2, heads, L, D), summed over heads in a fixed order: the
// same bits whatever the thread count; empty tensors without relative positions.
inline std::pair<at::Tensor, at::Tensor> table_grads(const at::Tensor& partials, bool has_rel) {
  if (!has_rel) return {at::empty({0}, partials.options()), at::empty({0}, partials.options())};
  return {partials[0].sum(0), partials[1].sum(0)};
}

inline int64_t row_stride(int64_t columns) { return ((columns + 15) / 16) * 16 + 16; }  // off powers of two

// The index of the greatest of s[0, n) above ``floor`` (the lowest of equal ones), ``none`` where none is above it.
// Two vector passes: the greatest (four lanes' chains, a NaN never taken: compare-and-blend, not max), then the first
// index equal to it. A scalar pass keeping (best, index) without branches is a chain of dependent compares, and the
// insertion's compare would mispredict about ln(n) times a row; at N = 16384 and 128 clusters the scalar pass took
// ~7 ms of the router's 18 (docs/benchmarks.md).
template <typename T>
inline int64_t first_max(const T* s, int64_t n, T floor, int64_t none) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t L = Vec::size();
  T top = floor;
  int64_t j = 0;
  Vec best[4] = {Vec(floor), Vec(floor), Vec(floor), Vec(floor)};
  for (; j + 4 * L <= n; j += 4 * L) {
    for (int u = 0; u < 4; u++) {
      const Vec x = Vec::loadu(s + j + u * L);
      best[u] = Vec::blendv(best[u], x, x > best[u]);
    }
  }
  for (; j + L <= n; j += L) {
    const Vec x = Vec::loadu(s + j);
    best[0] = Vec::blendv(best[0], x, x > best[0]);
  }
  for (int u = 1; u < 4; u++) best[0] = Vec::blendv(best[0], best[u], best[u] > best[0]);
  T lanes[L];
  best[0].store(lanes);
  for (int64_t l = 0; l < L; l++) top = lanes[l] > top ? lanes[l] : top;
  for (; j < n; j++) top = s[j] > top ? s[j] : top;
  if (!(top > floor)) return none;
  const Vec wanted(top);
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    const int mask = ~(Vec::loadu(s + i) == wanted).zero_mask() & ((int64_t(1) << L) - 1);
    if (mask != 0) return i + __builtin_ctz(mask);
  }
  for (; i < n; i++)
    if (s[i] == top) return i;
  return none;  // unreachable: top is one of s
}

// Keep the ``t`` best (score, index) pairs seen so far in ``best`` / ``o`` (``kept`` of them, best first), offered v
// at index j in increasing j: v displaces only a strictly smaller score, so of equal scores the lower index stays
// first, as passes of max with each winner masked pick them (select.cpp's blocks).
template <typename T>
inline void keep_best(T v, int64_t j, int64_t t, int64_t& kept, T* best, int64_t* o) {
  if (kept == t && !(v > best[t - 1])) return;
  int64_t p = std::min(kept, t - 1);
  while (p > 0 && v > best[p - 1]) {
    best[p] = best[p - 1];
    o[p] = o[p - 1];
    p--;
  }
  best[p] = v;
  o[p] = j;
  kept = std::min(kept + 1, t);
}

// Forward of one block: softmax(q·kᵀ·scale + rel + bias, masked) · v (+ the relative value term) per row, with the
// rows' results in ``out``, under ``rules`` (``RequireRules`` lists what they provide).
//
// With relative positions on a stretch of U table rows, the rows ride along in the products: scores and q·a^K come
// out of one (n, nc + U) product, the value term and p·v out of one (n, D) product over nc + U columns (the
// probabilities summed per table row after the chunk's own). Irregular distances over many table rows instead take
// per-pair products (``RelChunk::direct``).
template <typename T, typename Rules>
void forward_block(const Head<T>& h, const Rel<T>& rel, const Rules& rules, const Rows& rows, Work<T>& w,
                   BlockOut<T> out) {
  static_assert(RequireRules<T, Rules>::ok);
  const int64_t n = rows.n, D = h.D;
  if (n == 0) return;
  int64_t kmin = std::numeric_limits<int64_t>::max(), kmax = std::numeric_limits<int64_t>::min();
  for (int64_t r = 0; r < n; r++)
    if (rows.a[r] < rows.e[r]) {
      kmin = std::min(kmin, rows.a[r]);
      kmax = std::max(kmax, rows.e[r]);
    }
  T* m = w.m.get(n);
  T* l = w.l.get(n);
  T* o = out.o;
  T* self_score = w.self_score.get(n);
  uint8_t* self_ok = w.self_ok.get(n);
  const T minus_inf = -std::numeric_limits<T>::infinity();
  for (int64_t r = 0; r < n; r++) {
    m[r] = minus_inf;
    l[r] = 0;
    self_ok[r] = 0;
  }
  std::fill(o, o + n * D, T(0));
  if (kmin < kmax) {
    auto [qp, ldq] = load_rows(h.q, h.q_stride, rows, D, w.q);
    int32_t* idx = rel.on() && rules.unit() != 1 ? w.idx.get(n * LD) : nullptr;
    for (int64_t c0 = kmin; c0 < kmax; c0 += KC) {
      const int64_t c1 = std::min(c0 + KC, kmax), nc = c1 - c0;
      const RelChunk<T, Rules> rc(rules, rel, rows, c0, c1, idx);
      const bool ext = rel.on() && rc.U > 0 && !rc.direct;  // the table rows ride along in the products
      const int64_t U = ext ? rc.U : 0, u0 = rc.u0, W = nc + U;
      const int64_t ld = ext ? row_stride(W) : LD;
      T* s = w.s.get(n * ld);
      auto [kp, ldk] = chunk_operand(h.k, h.k_stride, h.key_order, c0, nc, D, ext ? rel.key : nullptr, u0, U, w.k,
                                     h.key_scale);
      auto [vp, ldv] = chunk_operand(h.v, h.v_stride, h.key_order, c0, nc, D, ext ? rel.value : nullptr, u0, U,
                                     w.v);
      gemm<T>(false, true, n, W, D, h.scale, qp, ldq, kp, ldk, T(0), s, ld);  // (n, nc) scores | (n, U) q·a^K
      for (int64_t r = 0; r < n; r++) {
        T* row = s + r * ld;
        const int64_t a = std::max(rows.a[r], c0) - c0, e = std::min(rows.e[r], c1) - c0;
        if (a >= e) {
          std::fill(row, row + W, T(0));
          continue;
        }
        add_pair_terms(rules, rc, rel, h, qp + r * ldq, r, row, a, e, c0, nc, ext);
        const int64_t own = rules.self(r) - c0;
        if (own >= a && own < e) {  // the own key, kept aside: the row takes it only if it sees nothing else
          if (row[own] != minus_inf) {
            self_ok[r] = 1;
            self_score[r] = row[own];
          }
          row[own] = minus_inf;
        }
        const T mx = max_of(row + a, e - a);
        if (mx == minus_inf) {
          std::fill(row, row + W, T(0));
          continue;
        }
        const T m_new = std::max(m[r], mx);
        const T alpha = m[r] == minus_inf ? T(0) : std::exp(m[r] - m_new);
        std::fill(row, row + a, T(0));
        std::fill(row + e, row + W, T(0));  // and the table columns, for the probabilities summed per table row
        const T sum = exp_shift_sum(row + a, e - a, m_new);
        if (ext) rc.scatter_add(r, row, a, e, row + nc);
        if (alpha != T(1)) scale_row(o + r * D, D, alpha);
        l[r] = l[r] * alpha + sum;
        m[r] = m_new;
      }
      gemm<T>(false, false, n, D, W, T(1), s, ld, vp, ldv, T(1), o, D);  // o += p · v (+ Σ_j p_ij a^V_ij)
      if (rc.direct) {
        for (int64_t r = 0; r < n; r++) {
          const int64_t a = std::max(rows.a[r], c0) - c0, e = std::min(rows.e[r], c1) - c0;
          const int32_t* ir = rc.row_index(r);
          const T* row = s + r * ld;
          for (int64_t j = a; j < e; j++)
            if (row[j] != T(0)) axpy(o + r * D, rel.value + ir[j] * D, D, row[j]);
        }
      }
    }
  }
  for (int64_t r = 0; r < n; r++) {
    T* orow = o + r * D;
    if (out.alone != nullptr) out.alone[r] = 0;
    if (l[r] > T(0)) {
      scale_row(orow, D, T(1) / l[r]);
      out.lse[r] = m[r] + std::log(l[r]);
    } else if (self_ok[r]) {  // nothing else in view: the own key alone
      const int64_t own = rules.self(r);
      const int64_t krow = h.key_order == nullptr ? own : h.key_order[own];
      std::memcpy(orow, h.v + krow * h.v_stride, D * sizeof(T));
      if (rel.on()) axpy(orow, rel.value + rel.index(rules.distance(r, own)) * D, D, T(1));
      out.lse[r] = self_score[r];
      if (out.alone != nullptr) out.alone[r] = 1;
    } else {
      out.lse[r] = neg_inf<T>();  // zeros, and the lse every executor gives a row without a key
    }
  }
}

// Where a backward block's key gradients go: rows of dk, dv in place (no key order) or through scratch and an
// addition by index; and the relative tables' gradients (L, D) each. A null dk (with its dkey) or dv (with its
// dvalue), or dq false, is a gradient nobody needs (autograd's needs_input_grad): its products are skipped.
template <typename T>
struct Grads {
  T* dk;
  T* dv;
  T* dkey;    // null without relative positions
  T* dvalue;
  bool dq = true;
};

// The backward operators' output_mask (q; k or its table; v or its table), as autograd's needs_input_grad.
struct Needs {
  bool q, k, v;
  static Needs of(std::array<bool, 3> mask) { return {mask[0], mask[1], mask[2]}; }
};

// Backward of one block, recomputing the probabilities from q, k and the rows' lse. Rows take, per row: lse
// (``lse[r]``), delta = dout·out - dlse, whether the row saw only its own key (``alone``), and dout rows (gathered
// like q). Adds the key gradients into ``g`` and returns the rows' query gradient in w.dq (n, D), scaled. With the
// table rows riding along (see ``forward_block``), five products per chunk whatever the relative terms.
template <typename T, typename Rules>
void backward_block(const Head<T>& h, const Rel<T>& rel, const Rules& rules, const Rows& rows, const T* dout_base,
                    int64_t dout_stride, const T* lse, const T* delta, const uint8_t* alone, Work<T>& w,
                    const Grads<T>& g) {
  static_assert(RequireRules<T, Rules>::ok);
  const int64_t n = rows.n, D = h.D;
  T* dq = w.dq.get(n * D);
  std::fill(dq, dq + n * D, T(0));
  if (n == 0) return;
  int64_t kmin = std::numeric_limits<int64_t>::max(), kmax = std::numeric_limits<int64_t>::min();
  for (int64_t r = 0; r < n; r++)
    if (rows.a[r] < rows.e[r] && lse[r] != neg_inf<T>()) {
      kmin = std::min(kmin, rows.a[r]);
      kmax = std::max(kmax, rows.e[r]);
    }
  if (kmin >= kmax) return;
  auto [qp, ldq] = load_rows(h.q, h.q_stride, rows, D, w.q);
  auto [dop, ldo] = load_rows(dout_base, dout_stride, rows, D, w.dout);
  int32_t* idx = rel.on() && rules.unit() != 1 ? w.idx.get(n * LD) : nullptr;
  const T minus_inf = -std::numeric_limits<T>::infinity();
  for (int64_t c0 = kmin; c0 < kmax; c0 += KC) {
    const int64_t c1 = std::min(c0 + KC, kmax), nc = c1 - c0;
    const RelChunk<T, Rules> rc(rules, rel, rows, c0, c1, idx);
    const bool ext = rel.on() && rc.U > 0 && !rc.direct;
    const int64_t U = ext ? rc.U : 0, u0 = rc.u0, W = nc + U;
    const int64_t ld = ext ? row_stride(W) : LD;
    T* s = w.s.get(n * ld);
    T* dp = w.dp.get(n * ld);
    auto [kp, ldk] = chunk_operand(h.k, h.k_stride, h.key_order, c0, nc, D, ext ? rel.key : nullptr, u0, U, w.k,
                                   h.key_scale);
    auto [vp, ldv] = chunk_operand(h.v, h.v_stride, h.key_order, c0, nc, D, ext ? rel.value : nullptr, u0, U, w.v);
    gemm<T>(false, true, n, W, D, h.scale, qp, ldq, kp, ldk, T(0), s, ld);
    for (int64_t r = 0; r < n; r++) {  // the probabilities again: exp(s - lse) where allowed
      T* row = s + r * ld;
      const int64_t a = std::max(rows.a[r], c0) - c0, e = std::min(rows.e[r], c1) - c0;
      if (a >= e || lse[r] == neg_inf<T>()) {
        std::fill(row, row + W, T(0));
        continue;
      }
      add_pair_terms(rules, rc, rel, h, qp + r * ldq, r, row, a, e, c0, nc, ext);
      const int64_t own = rules.self(r) - c0;
      if (own >= a && own < e && !alone[r]) row[own] = minus_inf;
      std::fill(row, row + a, T(0));
      std::fill(row + e, row + W, T(0));
      exp_shift_sum(row + a, e - a, lse[r]);
      if (ext) rc.scatter_add(r, row, a, e, row + nc);  // the probabilities summed per table row
    }
    // dv (and d a^V) += [p | p per table row]ᵀ · dout
    T* dkv = nullptr;
    if (g.dv == nullptr) {
    } else if (h.key_order == nullptr && !ext) {
      gemm<T>(true, false, nc, D, n, T(1), s, ld, dop, ldo, T(1), g.dv + c0 * D, D);
    } else {
      dkv = w.kv_grad.get(W * D);
      gemm<T>(true, false, W, D, n, T(1), s, ld, dop, ldo, T(0), dkv, D);
      add_key_rows(dkv, nc, D, h.key_order, c0, g.dv, ext ? g.dvalue : nullptr, u0, U);
    }
    const bool need_ds = g.dq || g.dk != nullptr;  // the scores' gradient feeds dq and dk only
    if (need_ds) gemm<T>(false, true, n, W, D, T(1), dop, ldo, vp, ldv, T(0), dp, ld);  // dp = dout · [v | a^V]ᵀ
    for (int64_t r = 0; r < n; r++) {
      T* dpr = dp + r * ld;
      const int64_t a = std::max(rows.a[r], c0) - c0, e = std::min(rows.e[r], c1) - c0;
      if (need_ds && ext && a < e) rc.gather_add(r, dpr, a, e, dpr + nc);  // dp_ij += dout_i · a^V_ij
      if (rc.direct && a < e && lse[r] != neg_inf<T>()) {  // the same per pair, and d a^V += p_ij dout_i
        const int32_t* ir = rc.row_index(r);
        const T* row = s + r * ld;
        const T* dor = dop + r * ldo;
        for (int64_t j = a; j < e; j++) {
          if (need_ds) dpr[j] += dot(dor, rel.value + ir[j] * D, D);
          if (g.dvalue != nullptr && row[j] != T(0)) axpy(g.dvalue + ir[j] * D, dor, D, row[j]);
        }
      }
      if (!need_ds) continue;
      softmax_grad_row(dpr, s + r * ld, nc, delta[r]);  // ds, in dp
      if (ext) {  // ds summed per table row, after the chunk's own columns
        std::fill(dpr + nc, dpr + W, T(0));
        if (a < e && lse[r] != neg_inf<T>()) rc.scatter_add(r, dpr, a, e, dpr + nc);
      }
    }
    if (!need_ds) continue;
    if (g.dq) gemm<T>(false, false, n, D, W, T(1), dp, ld, kp, ldk, T(1), dq, D);  // dq += [ds | ..] · [k | a^K]
    if (g.dk == nullptr) {
    } else if (h.key_order == nullptr && !ext) {
      gemm<T>(true, false, nc, D, n, h.scale, dp, ld, qp, ldq, T(1), g.dk + c0 * D, D);
    } else {
      dkv = w.kv_grad.get(W * D);
      gemm<T>(true, false, W, D, n, h.scale, dp, ld, qp, ldq, T(0), dkv, D);
      add_key_rows(dkv, nc, D, h.key_order, c0, g.dk, ext ? g.dkey : nullptr, u0, U);
    }
    if (rc.direct) {  // dq_i += ds_ij a^K_ij, d a^K += scale · ds_ij q_i, per pair
      for (int64_t r = 0; r < n; r++) {
        const int64_t a = std::max(rows.a[r], c0) - c0, e = std::min(rows.e[r], c1) - c0;
        if (a >= e || lse[r] == neg_inf<T>()) continue;
        const int32_t* ir = rc.row_index(r);
        const T* dsr = dp + r * ld;
        for (int64_t j = a; j < e; j++) {
          if (dsr[j] == T(0)) continue;
          if (g.dq) axpy(dq + r * D, rel.key + ir[j] * D, D, dsr[j]);
          if (g.dkey != nullptr) axpy(g.dkey + ir[j] * D, qp + r * ldq, D, h.scale * dsr[j]);
        }
      }
    }
  }
  scale_row(dq, n * D, h.scale);
}

// ---- the operators' drivers -------------------------------------------------------------------------------------
//
// band.cpp, ranges.cpp and rounds.cpp differ in how they cut a head's query rows into blocks, in their rules, and in
// where a block's results go; everything else is here. Each describes its blocking as a *layout*, a type with:
//   Rel<T> rel; int64_t D    the relative tables (or none) and the head size
//   Plan plan(int64_t bh) const    a head's blocks (``Plan::blocks()`` of them), made once per head and direction
//   void block(int64_t bh, const Plan&, int64_t b, BlockRows& s, F&& f) const    fills block b's rows into ``s``
//       (with each row's forward slot) and calls f(head, rules) with the block's Head<T> and rules
// A forward writes each block row's (out, lse) to its slot; where several slots belong to one query row (ranges'
// entries, LSH's rounds), ``merge_slots`` merges them. A backward takes heads in parallel and each head's blocks in
// order (a head's key gradients are its own: no atomics, the same sums whatever the thread count).

// Key validity (B, 1 or H, N) bool as the kernels read it (checks::key_valid): one (batch, head)'s keys by key row.
struct KeyValid {
  const bool* p = nullptr;
  int64_t heads = 1, H = 1, N = 0;
  static KeyValid of(const std::optional<at::Tensor>& t, int64_t H) {
    KeyValid k;
    if (!t.has_value()) return k;
    k.p = t->data_ptr<bool>();
    k.heads = t->size(1);
    k.H = H;
    k.N = t->size(2);
    return k;
  }
  // head bh's row of validity (a head dimension of 1 stands for all), or null where every key is valid
  const bool* of_head(int64_t bh) const {
    if (p == nullptr) return nullptr;
    const int64_t b = bh / H, h = bh % H;
    return p + (b * heads + (heads == 1 ? 0 : h)) * N;
  }
};

// q, k, v's rows (B, H, N, D), last dimension contiguous, by their strides: one (batch, head) as a ``Head``.
template <typename T>
struct Heads {
  const T *q, *k, *v;
  int64_t qs[3], ks[3], vs[3];  // strides of batch, head, row
  int64_t H, D;
  Heads(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_)
      : q(q_.data_ptr<T>()), k(k_.data_ptr<T>()), v(v_.data_ptr<T>()), H(q_.size(1)), D(q_.size(3)) {
    for (int d = 0; d < 3; d++) {
      qs[d] = q_.stride(d);
      ks[d] = k_.stride(d);
      vs[d] = v_.stride(d);
    }
  }
  // head bh with the key order (null: the identity), the score scale and the keys' row scales (null: 1)
  Head<T> head(int64_t bh, const int64_t* key_order, T scale, const T* key_scale = nullptr) const {
    const int64_t b = bh / H, h = bh % H;
    return Head<T>{q + b * qs[0] + h * qs[1], qs[2], k + b * ks[0] + h * ks[1], ks[2], v + b * vs[0] + h * vs[1],
                   vs[2], key_order, D, scale, key_scale};
  }
  const T* q_row(int64_t bh, int64_t i) const { return q + (bh / H) * qs[0] + (bh % H) * qs[1] + i * qs[2]; }
  const T* v_row(int64_t bh, int64_t i) const { return v + (bh / H) * vs[0] + (bh % H) * vs[1] + i * vs[2]; }
};

// One block's rows as a layout fills them: the sequence index, query row and key interval of each row, its forward
// slot (where its out and lse go), and the ``Rows`` view the blocks read.
struct BlockRows {
  std::vector<int64_t> seq, qrow, a, e, slot;
  Rows rows;
  void resize(int64_t n) {
    seq.resize(n);
    qrow.resize(n);
    a.resize(n);
    e.resize(n);
    slot.resize(n);
  }
  // the view; ``seq_is_qrow``: a row's sequence index is its query row (ranges' entries), else ``seq``
  void bind(int64_t n, bool seq_is_qrow, bool contiguous) {
    rows.n = n;
    rows.qrow = qrow.data();
    rows.qseq = seq_is_qrow ? qrow.data() : seq.data();
    rows.a = a.data();
    rows.e = e.data();
    rows.contiguous = contiguous;
  }
};

// Where a forward's block rows go: (slots, D) out, (slots) lse, and (slots) alone, or null where no row can be alone.
template <typename T>
struct Slots {
  T* out;
  T* lse;
  bool* alone = nullptr;
};

// Every block of every head, in parallel over the blocks of all heads laid end to end; the heads' plans first, in
// parallel over heads.
template <typename T, typename Layout>
void forward_blocks(const Layout& layout, int64_t BH, Slots<T> to) {
  using Plan = decltype(layout.plan(int64_t()));
  const int64_t D = layout.D;
  std::vector<Plan> plans(BH);
  at::parallel_for(0, BH, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t bh = h0; bh < h1; bh++) plans[bh] = layout.plan(bh);
  });
  std::vector<int64_t> first(BH + 1, 0);
  for (int64_t bh = 0; bh < BH; bh++) first[bh + 1] = first[bh] + plans[bh].blocks();
  at::parallel_for(0, first[BH], 1, [&](int64_t x0, int64_t x1) {
    Work<T> w;
    BlockRows s;
    Buffer<T> ob, lb;
    Buffer<uint8_t> ab;
    int64_t bh = std::upper_bound(first.begin(), first.end(), x0) - first.begin() - 1;
    for (int64_t x = x0; x < x1; x++) {
      while (x >= first[bh + 1]) bh++;
      layout.block(bh, plans[bh], x - first[bh], s, [&](const Head<T>& head, const auto& rules) {
        const int64_t n = s.rows.n;
        BlockOut<T> bo{ob.get(n * D), lb.get(n), to.alone == nullptr ? nullptr : ab.get(n)};
        forward_block(head, layout.rel, rules, s.rows, w, bo);
        for (int64_t r = 0; r < n; r++) {
          const int64_t at = s.slot[r];
          std::memcpy(to.out + at * D, bo.o + r * D, D * sizeof(T));
          to.lse[at] = bo.lse[r];
          if (to.alone != nullptr) to.alone[at] = bo.alone[r];
        }
      });
    }
  });
}

// The (out, lse) of ``count`` slots of one query row (slot t at index part(t); lse = neg_inf: the slot saw
// nothing) merged through the log-sum-exp into one softmax over their disjoint keys: orow and the returned lse
// (zeros and neg_inf when no slot saw anything).
template <typename T, typename Part>
inline T merge_row(int64_t count, Part part, const T* slot_out, const T* slot_lse, int64_t D, T* orow) {
  T top = neg_inf<T>();
  for (int64_t t = 0; t < count; t++) top = std::max(top, slot_lse[part(t)]);
  std::fill(orow, orow + D, T(0));
  if (top == neg_inf<T>()) return neg_inf<T>();
  T total = 0;
  for (int64_t t = 0; t < count; t++) {
    const int64_t at = part(t);
    if (slot_lse[at] == neg_inf<T>()) continue;
    const T wt = std::exp(slot_lse[at] - top);
    total += wt;
    axpy(orow, slot_out + at * D, D, wt);
  }
  scale_row(orow, D, T(1) / total);
  return top + std::log(total);
}

// Every query row i < n merged from its slots part(i, t), t < count, into out and lse; ``unseen(i, orow)`` for each
// row no slot showed anything (orow zeros, lse neg_inf).
template <typename T, typename Part, typename Unseen>
void merge_slots(int64_t n, int64_t count, Part part, const T* slot_out, const T* slot_lse, int64_t D, T* out,
                 T* lse, Unseen unseen) {
  at::parallel_for(0, n, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
      T* orow = out + i * D;
      lse[i] = merge_row(count, [&](int64_t t) { return part(i, t); }, slot_out, slot_lse, D, orow);
      if (lse[i] == neg_inf<T>()) unseen(i, orow);
    }
  });
}

// What a backward reads and writes, by query row of all heads (BH · Nq rows; dout and out contiguous): the
// gradients dq (null: not needed; ``dq_once``: each query row is in one block, so its rows are stored, else added),
// dk, dv (null: not needed) and the tables' per-head partials (2, BH, L, D) (null without tables or not needed).
template <typename T>
struct BackwardIO {
  const T* dout;
  const T* out;
  const T* lse;
  const T* dlse;         // null: no lse gradient
  const bool* alone;     // null: no row was alone
  T* dq;
  bool dq_once;
  T* dk;
  T* dv;
  T* dkey;               // (BH, L, D): head bh's rows at bh · L · D
  T* dvalue;
  int64_t Nq, Nk, L;
};

// Every head's blocks in order, heads in parallel; ``finish(bh, grads)`` after a head's last block.
template <typename T, typename Layout, typename Finish>
void backward_blocks(const Layout& layout, int64_t BH, const BackwardIO<T>& io, Finish finish) {
  const int64_t D = layout.D, Nq = io.Nq, Nk = io.Nk;
  at::parallel_for(0, BH, 1, [&](int64_t h0, int64_t h1) {
    Work<T> w;
    BlockRows s;
    Buffer<T> lb, db, dlt;
    Buffer<uint8_t> ab;
    for (int64_t bh = h0; bh < h1; bh++) {
      const int64_t row0 = bh * Nq;
      T* delta = dlt.get(Nq);  // dout·out - dlse per query row
      for (int64_t i = 0; i < Nq; i++)
        delta[i] = dot(io.dout + (row0 + i) * D, io.out + (row0 + i) * D, D) -
                   (io.dlse == nullptr ? T(0) : io.dlse[row0 + i]);
      const Grads<T> g{io.dk == nullptr ? nullptr : io.dk + bh * Nk * D,
                       io.dv == nullptr ? nullptr : io.dv + bh * Nk * D,
                       io.dkey == nullptr ? nullptr : io.dkey + bh * io.L * D,
                       io.dvalue == nullptr ? nullptr : io.dvalue + bh * io.L * D, io.dq != nullptr};
      const auto plan = layout.plan(bh);
      for (int64_t b = 0, nb = plan.blocks(); b < nb; b++) {
        layout.block(bh, plan, b, s, [&](const Head<T>& head, const auto& rules) {
          const int64_t n = s.rows.n;
          const int64_t* qrow = s.rows.qrow;
          T* lr = lb.get(n);
          T* dr = db.get(n);
          uint8_t* al = ab.get(n);
          for (int64_t r = 0; r < n; r++) {
            lr[r] = io.lse[row0 + qrow[r]];
            dr[r] = delta[qrow[r]];
            al[r] = io.alone == nullptr ? 0 : io.alone[row0 + qrow[r]];
          }
          backward_block(head, layout.rel, rules, s.rows, io.dout + row0 * D, D, lr, dr, al, w, g);
          if (io.dq == nullptr) return;
          for (int64_t r = 0; r < n; r++) {
            T* to = io.dq + (row0 + qrow[r]) * D;
            if (io.dq_once) std::memcpy(to, w.dq.ptr + r * D, D * sizeof(T));
            else axpy(to, w.dq.ptr + r * D, D, T(1));
          }
        });
      }
      finish(bh, g);
    }
  });
}

// A backward's outputs: dq, dk, dv (empty where not needed) and the tables' per-head partials (2, BH, L, D), summed
// in head order at the end (``table_grads``). dq is zeroed unless each query row is stored once.
struct GradTensors {
  at::Tensor dq, dk, dv, tables;
  Needs need;
  bool dq_once, has_tables;
  int64_t BH, Nq, Nk, D, L;
  GradTensors(const at::Tensor& q, int64_t Nk_, Needs need_, const std::optional<at::Tensor>& key_table,
              bool dq_once_)
      : need(need_), dq_once(dq_once_), has_tables(key_table.has_value()), BH(q.size(0) * q.size(1)),
        Nq(q.size(2)), Nk(Nk_), D(q.size(3)), L(key_table.has_value() ? key_table->size(0) : 0) {
    const int64_t B = q.size(0), H = q.size(1);
    const std::vector<int64_t> q_shape = need.q ? std::vector<int64_t>{B, H, Nq, D} : std::vector<int64_t>{0};
    dq = dq_once ? at::empty(q_shape, q.options()) : at::zeros(q_shape, q.options());
    dk = at::zeros(need.k ? at::IntArrayRef{B, H, Nk, D} : at::IntArrayRef{0}, q.options());
    dv = at::zeros(need.v ? at::IntArrayRef{B, H, Nk, D} : at::IntArrayRef{0}, q.options());
    tables = at::zeros({2, BH, std::max<int64_t>(L, 1), D}, q.options());
  }
  // the backward's view: dout and out contiguous (B, H, Nq, D), lse and dlse (B, H, Nq), alone (B, H, Nq) or null
  template <typename T>
  BackwardIO<T> io(const at::Tensor& dout, const at::Tensor& out, const at::Tensor& lse,
                   const std::optional<at::Tensor>& dlse, const bool* alone) {
    return BackwardIO<T>{dout.data_ptr<T>(), out.data_ptr<T>(), lse.data_ptr<T>(),
                         dlse.has_value() ? dlse->data_ptr<T>() : nullptr, alone,
                         need.q ? dq.data_ptr<T>() : nullptr, dq_once,
                         need.k ? dk.data_ptr<T>() : nullptr, need.v ? dv.data_ptr<T>() : nullptr,
                         has_tables && need.k ? tables.data_ptr<T>() : nullptr,
                         has_tables && need.v ? tables.data_ptr<T>() + BH * L * D : nullptr, Nq, Nk, L};
  }
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> result() const {
    auto [dkey, dvalue] = table_grads(tables, has_tables);
    return {dq, dk, dv, dkey, dvalue};
  }
};

}  // namespace routeformer
