// The checks every fused operator makes of its arguments before its kernel reads them: the kernels index raw
// pointers with the sizes, strides, int lists and index values they are given, so a call that breaks any of them
// must be refused here, with an error that names the operator and the argument, never read out of bounds.
//
// Every helper takes the operator's name (``op``: "band_forward", ...) and the argument's; errors read
// "routeformer_fused.<op>: <argument> must be ..., got ...". The checks are O(inputs) once per call: a pass over
// the index tensors, none over the float data.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace routeformer {
namespace checks {

// "(2, 4, 128)"
inline std::string dims(at::IntArrayRef s) {
  std::ostringstream o;
  o << "(";
  for (size_t i = 0; i < s.size(); i++) o << (i ? ", " : "") << s[i];
  o << (s.size() == 1 ? ",)" : ")");
  return o.str();
}

#define RF_CHECK(cond, op, ...) TORCH_CHECK(cond, "routeformer_fused.", op, ": ", __VA_ARGS__)

inline void cpu(const char* op, const at::Tensor& t, const char* name) {
  RF_CHECK(t.defined(), op, name, " is required, got None");
  RF_CHECK(t.device().is_cpu(), op, name, " must be a CPU tensor, got one on ", t.device());
}

inline void dtype(const char* op, const at::Tensor& t, const char* name, at::ScalarType want) {
  cpu(op, t, name);
  RF_CHECK(t.scalar_type() == want, op, name, " must be ", want, ", got ", t.scalar_type());
}

// ``symbols`` spells the expected shape for the reader ("(B, H, N)"); ``want`` is its value.
inline void shape(const char* op, const at::Tensor& t, const char* name, const char* symbols, at::IntArrayRef want) {
  RF_CHECK(t.sizes() == want, op, name, " must be ", symbols, " = ", dims(want), ", got ", dims(t.sizes()));
}

inline void contiguous(const char* op, const at::Tensor& t, const char* name) {
  RF_CHECK(t.is_contiguous(), op, name, " must be contiguous (it is read as one flat array), got strides ",
           dims(t.strides()));
}

// A tensor read as a flat array: CPU, this dtype, exactly this shape, contiguous.
inline void flat(const char* op, const at::Tensor& t, const char* name, at::ScalarType want, const char* symbols,
                 at::IntArrayRef sizes) {
  dtype(op, t, name, want);
  shape(op, t, name, symbols, sizes);
  contiguous(op, t, name);
}

// q, k, v and the like: 4-D rows read in place and handed to BLAS as a matrix with leading dimension stride(2),
// so the last dimension is contiguous and rows do not overlap (BLAS needs ld >= max(1, D), and an int).
inline void rows(const char* op, const at::Tensor& t, const char* name, at::ScalarType want) {
  dtype(op, t, name, want);
  RF_CHECK(t.dim() == 4, op, name, " must be 4-D (B, H, N, D), got ", t.dim(), "-D ", dims(t.sizes()));
  RF_CHECK(t.stride(3) == 1 || t.size(3) <= 1, op, name, " must have a contiguous last dimension, got strides ",
           dims(t.strides()));
  RF_CHECK(t.size(2) == 0 || (t.stride(2) >= std::max<int64_t>(1, t.size(3)) && t.stride(2) <= INT_MAX), op, name,
           " rows must not overlap (stride(2) >= D, and below 2^31), got strides ", dims(t.strides()), " for shape ",
           dims(t.sizes()));
}

inline void floating(const char* op, const at::Tensor& t, const char* name) {
  cpu(op, t, name);
  RF_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, op, name,
           " must be float32 or float64, got ", t.scalar_type());
}

// Sizes of q (B, H, Nq, D) and k, v (B, H, N, D), which must agree on B, H and D (k and v on N too).
struct QKV {
  int64_t B, H, Nq, N, D;
};

// k null: the keys are made from q's own rows (LSH's shared-QK keys), and v must be (B, H, Nq, D) like q.
inline QKV qkv(const char* op, const at::Tensor& q, const at::Tensor* k, const at::Tensor& v) {
  floating(op, q, "q");
  rows(op, q, "q", q.scalar_type());
  if (k == nullptr) {
    rows(op, v, "v", q.scalar_type());
    const QKV s{q.size(0), q.size(1), q.size(2), q.size(2), q.size(3)};
    shape(op, v, "v", "(B, H, N, D) like q", {s.B, s.H, s.N, s.D});
    return s;
  }
  rows(op, *k, "k", q.scalar_type());
  rows(op, v, "v", q.scalar_type());
  const QKV s{q.size(0), q.size(1), q.size(2), k->size(2), q.size(3)};
  shape(op, *k, "k", "(B, H, N, D) with q's B, H, D", {s.B, s.H, s.N, s.D});
  shape(op, v, "v", "(B, H, N, D) like k", {s.B, s.H, s.N, s.D});
  return s;
}

inline void finite(const char* op, double x, const char* name) {
  RF_CHECK(std::isfinite(x), op, name, " must be finite, got ", x);
}

inline void at_least(const char* op, int64_t x, int64_t low, const char* name) {
  RF_CHECK(x >= low, op, name, " must be >= ", low, ", got ", x);
}

// a · b, refused where it overflows int64 (int lists can hold anything)
inline int64_t product(const char* op, int64_t a, int64_t b, const char* what) {
  int64_t p = 0;
  RF_CHECK(!__builtin_mul_overflow(a, b, &p), op, what, " overflows int64 (", a, " * ", b, ")");
  return p;
}

inline int64_t sum(const char* op, int64_t a, int64_t b, const char* what) {
  int64_t s = 0;
  RF_CHECK(!__builtin_add_overflow(a, b, &s), op, what, " overflows int64 (", a, " + ", b, ")");
  return s;
}

// A tensor read by strides after ``expand(want)``: CPU, this dtype, and broadcastable to ``want`` (each of its
// trailing dimensions 1 or equal), so that the expansion cannot fail half-way or read beyond it.
inline void broadcastable(const char* op, const at::Tensor& t, const char* name, at::ScalarType want_dtype,
                          const char* symbols, at::IntArrayRef want) {
  dtype(op, t, name, want_dtype);
  bool ok = t.dim() <= static_cast<int64_t>(want.size());
  for (int64_t d = 1; ok && d <= t.dim(); d++) {
    const int64_t a = t.size(t.dim() - d), b = want[want.size() - d];
    ok = a == b || a == 1;
  }
  RF_CHECK(ok, op, name, " must broadcast to ", symbols, " = ", dims(want), ", got ", dims(t.sizes()));
}

// Key validity (B, 1 or H, N) bool, contiguous: the kernels index it per (batch, head or 0, key row).
inline void key_valid(const char* op, const std::optional<at::Tensor>& t, int64_t B, int64_t H, int64_t N) {
  if (!t.has_value()) return;
  dtype(op, *t, "key_valid", at::kBool);
  RF_CHECK(t->dim() == 3 && t->size(0) == B && (t->size(1) == 1 || t->size(1) == H) && t->size(2) == N, op,
           "key_valid must be (B, 1 or H, N) = (", B, ", 1 or ", H, ", ", N, "), got ", dims(t->sizes()));
  contiguous(op, *t, "key_valid");
}

// Every row (the last dimension, n entries) of a contiguous int64 tensor a permutation of 0 .. n-1: entries in
// range, each once (one pass with a seen-bitmap per row).
inline void permutations(const char* op, const at::Tensor& t, const char* name) {
  const int64_t n = t.dim() == 0 ? 1 : t.size(-1);
  if (t.numel() == 0 || n == 0) return;
  const int64_t* p = t.data_ptr<int64_t>();
  const int64_t rows = t.numel() / n;
  std::vector<uint8_t> seen(n);
  for (int64_t r = 0; r < rows; r++) {
    std::fill(seen.begin(), seen.end(), 0);
    for (int64_t i = 0; i < n; i++) {
      const int64_t x = p[r * n + i];
      RF_CHECK(x >= 0 && x < n, op, name, " must hold a permutation of 0 .. ", n - 1, " in each row, got ", x,
               " at flat row ", r, ", index ", i);
      RF_CHECK(!seen[x], op, name, " must hold a permutation of 0 .. ", n - 1, " in each row, got ", x,
               " twice in flat row ", r);
      seen[x] = 1;
    }
  }
}

// Every value of a contiguous int64 tensor in [low, high].
inline void values_in(const char* op, const at::Tensor& t, const char* name, int64_t low, int64_t high,
                      const char* why) {
  const int64_t* p = t.data_ptr<int64_t>();
  for (int64_t i = 0, n = t.numel(); i < n; i++)
    RF_CHECK(p[i] >= low && p[i] <= high, op, name, " must lie in [", low, ", ", high, "] (", why, "), got ", p[i],
             " at flat index ", i);
}

// Positions are only subtracted (distance = key position - query position): bounded so the difference fits.
constexpr int64_t kPositionLimit = int64_t(1) << 62;

inline void positions(const char* op, const std::optional<at::Tensor>& t, const char* name, at::IntArrayRef sizes) {
  if (!t.has_value()) return;
  flat(op, *t, name, at::kLong, "(B, H, N)", sizes);
  values_in(op, *t, name, -kPositionLimit, kPositionLimit, "their differences must fit in int64");
}

// The relative-position tables a^K, a^V: both or neither, q's dtype, (L, D) contiguous with L = 2·max_distance + 1
// (the kernels clip distances to ±max_distance and read row distance + max_distance), L below 2^31 (int32 row
// indices). Returns whether they are given.
inline bool tables(const char* op, const std::optional<at::Tensor>& key, const std::optional<at::Tensor>& value,
                   int64_t max_distance, int64_t D, at::ScalarType want) {
  at_least(op, max_distance, 0, "max_distance");
  RF_CHECK(key.has_value() == value.has_value(), op, "key_table and value_table come together, got only ",
           key.has_value() ? "key_table" : "value_table");
  if (!key.has_value()) return false;
  RF_CHECK(max_distance < (int64_t(1) << 30), op, "max_distance must be below 2^30, got ", max_distance);
  const int64_t L = 2 * max_distance + 1;
  flat(op, *key, "key_table", want, "(L, D), L = 2 * max_distance + 1,", {L, D});
  flat(op, *value, "value_table", want, "(L, D), L = 2 * max_distance + 1,", {L, D});
  return true;
}

// grad_out and out (B, H, Nq, D), read through a contiguous copy; lse and grad_lse (B, H, Nq), read in place.
inline void grads(const char* op, const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse,
                  const at::Tensor& out, const at::Tensor& lse, const QKV& s, at::ScalarType want) {
  const std::vector<int64_t> rows4 = {s.B, s.H, s.Nq, s.D}, rows3 = {s.B, s.H, s.Nq};
  dtype(op, grad_out, "grad_out", want);
  shape(op, grad_out, "grad_out", "(B, H, Nq, D)", rows4);
  dtype(op, out, "out", want);
  shape(op, out, "out", "(B, H, Nq, D)", rows4);
  flat(op, lse, "lse", want, "(B, H, Nq)", rows3);
  if (grad_lse.has_value()) flat(op, *grad_lse, "grad_lse", want, "(B, H, Nq)", rows3);
}

// What every attention operator reads alike, checked alike: q, k (null: keys made from q's rows), v; a finite scale;
// its geometry list, each field by name (``Geometry::parse``, geometry.h); key validity (B, 1 or H, N).
template <typename Geometry>
struct Attention {
  QKV s;
  Geometry g;
};

template <typename Geometry>
inline Attention<Geometry> attention(const char* op, const at::Tensor& q, const at::Tensor* k, const at::Tensor& v,
                                     at::IntArrayRef geometry, double scale,
                                     const std::optional<at::Tensor>& key_valid) {
  const QKV s = qkv(op, q, k, v);
  finite(op, scale, "scale");
  const Geometry g = Geometry::parse(op, geometry);
  checks::key_valid(op, key_valid, s.B, s.H, s.N);
  return {s, g};
}

// A backward's own arguments: the gradients against the forward's outputs, and ``alone`` (bool; (B, H, Nq) where
// ``read``: the rows that saw only their own key, read per query row).
inline void backward(const char* op, const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse,
                     const at::Tensor& out, const at::Tensor& lse, const at::Tensor* alone, bool read, const QKV& s,
                     at::ScalarType want) {
  grads(op, grad_out, grad_lse, out, lse, s, want);
  if (alone == nullptr) return;
  dtype(op, *alone, "alone", at::kBool);
  if (read) flat(op, *alone, "alone", at::kBool, "(B, H, Nq)", {s.B, s.H, s.Nq});
}

}  // namespace checks
}  // namespace routeformer
