// The fused executor's ``rounds`` (LSH): R rounds, each a sliding window over its own sorted order within groups
// (hash buckets), a pair that an earlier round's window holds left to that round, the rounds' disjoint key sets
// merged into one softmax, and the query's own key only when no round shows it anything else.
//
// Round r of head h sorts the positions by (bucket, position): ``order`` (B, H, R, N) gives the position at each
// sorted index, ``groups`` (B, H, R, N) the bucket there (non-decreasing). A query at sorted index i sees the
// sorted indices [i - (window - 1), i) of its bucket when causal ([i - (window - 1), i + window) but not i when
// not), except pairs whose ``labels`` (B, H, R, N, by position) of an earlier round differ by less than
// ``window``. Each round's (out, lse) per position, then the merge; the backward recomputes each round with the
// merged lse. q, k, v are read by index through the order: no permuted copies. Without k, the keys are Reformer's
// shared-QK keys, the queries at unit length times the score scale (k_j = scale · q_j / |q_j|), made as each chunk
// is read, their gradient taken back to q at the end: no keys tensor. Forward parallel over (head, round, block),
// backward over heads.
#include "checks.h"
#include "common.h"
#include "ops.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

namespace routeformer {
namespace {

struct Setup {
  int64_t window, rows_per_block;
  bool causal;
  static Setup from(const char* op, at::IntArrayRef s) {
    checks::length(op, s, 3, "setup");
    checks::at_least(op, s[0], 1, "setup[0] (window)");
    checks::at_least(op, s[1], 1, "setup[1] (rows_per_block)");
    return {s[0], s[1], checks::flag(op, s[2], "setup[2] (causal)")};
  }
};

// |a - b| < w for any int64 labels a, b (w > 0): the difference taken in unsigned, where it cannot overflow
inline bool closer_than(int64_t a, int64_t b, int64_t w) {
  const uint64_t d = a >= b ? static_cast<uint64_t>(a) - static_cast<uint64_t>(b)
                            : static_cast<uint64_t>(b) - static_cast<uint64_t>(a);
  return d < static_cast<uint64_t>(w);
}

template <typename T>
struct RoundRules {
  const int64_t* order;   // this round's: sorted index -> position
  const int64_t* labels;  // (R, N) by position
  const bool* valid;      // by position, or null
  const int64_t* qseq;    // the block's rows (sorted indices)
  int64_t round, N, window;
  bool causal;
  static constexpr bool has_bias = false;
  bool elementwise(int64_t) const { return valid != nullptr || round > 0 || !causal; }
  bool allowed(int64_t r, int64_t j) const {
    const int64_t pi = order[qseq[r]], pj = order[j];
    if (!causal && pj == pi) return false;  // the own key: only when alone in every round (the merge decides)
    if (valid != nullptr && !valid[pj]) return false;
    for (int64_t x = 0; x < round; x++)
      if (closer_than(labels[x * N + pi], labels[x * N + pj], window)) return false;
    return true;
  }
  int64_t distance(int64_t, int64_t) const { return 0; }
  T bias(int64_t, int64_t) const { return T(0); }
  int64_t self(int64_t) const { return -1; }
  int64_t unit() const { return 0; }
};

struct Sizes {
  int64_t B, H, R, N, D;
};

template <typename T>
struct RoundCall {
  Sizes z;
  Setup st;
  const T *q, *k, *v;
  int64_t qs[3], ks[3], vs[3];
  const int64_t *order, *groups, *labels;
  const bool* valid;
  int64_t valid_heads;
  T scale;
  const T* key_scale;  // (B·H·N): scale / |q_j| for unit keys, or null (k given; the score scale is `scale`)

  const int64_t* order_of(int64_t bh, int64_t r) const { return order + (bh * z.R + r) * z.N; }
  Head<T> head(int64_t bh, int64_t r) const {
    const int64_t b = bh / z.H, h = bh % z.H;
    return Head<T>{q + b * qs[0] + h * qs[1], qs[2], k + b * ks[0] + h * ks[1], ks[2],
                   v + b * vs[0] + h * vs[1], vs[2], order_of(bh, r), z.D, key_scale == nullptr ? scale : T(1),
                   key_scale == nullptr ? nullptr : key_scale + bh * z.N};
  }
  RoundRules<T> rules(int64_t bh, int64_t r, const int64_t* qseq) const {
    const int64_t b = bh / z.H, h = bh % z.H;
    return RoundRules<T>{order_of(bh, r), labels + bh * z.R * z.N,
                         valid == nullptr ? nullptr
                                          : valid + (b * valid_heads + (valid_heads == 1 ? 0 : h)) * z.N,
                         qseq, r, z.N, st.window, st.causal};
  }
  int64_t blocks() const { return ceil_div(z.N, st.rows_per_block); }
  // block x of round r of head bh: sorted indices, query rows (positions), intervals
  void rows_of(int64_t bh, int64_t r, int64_t x, std::vector<int64_t>& seq, std::vector<int64_t>& qrow,
               std::vector<int64_t>& a, std::vector<int64_t>& e, Rows& rows) const {
    const int64_t* ord = order_of(bh, r);
    const int64_t* gr = groups + (bh * z.R + r) * z.N;
    const int64_t r0 = x * st.rows_per_block, n = std::min(st.rows_per_block, z.N - r0);
    seq.resize(n);
    qrow.resize(n);
    a.resize(n);
    e.resize(n);
    for (int64_t i = 0; i < n; i++) {
      const int64_t s = r0 + i;
      seq[i] = s;
      qrow[i] = ord[s];
      int64_t lo = std::max<int64_t>(0, s - (st.window - 1));
      while (lo < s && gr[lo] != gr[s]) lo++;  // the bucket's run (groups sorted): at most window steps
      int64_t hi = s;
      if (!st.causal) {
        hi = s + std::min(st.window, z.N - s);  // not s + window: window may be any positive int64
        while (hi > s + 1 && gr[hi - 1] != gr[s]) hi--;
      }
      a[i] = lo;
      e[i] = hi;
    }
    rows.n = n;
    rows.qrow = qrow.data();
    rows.qseq = seq.data();
    rows.a = a.data();
    rows.e = e.data();
    rows.contiguous = false;
  }
};

constexpr double kNormEps = 1e-12;  // F.normalize's: a row shorter than this is divided by it instead

// scale / max(|q_j|, eps) of every row (B·H·N), the unit keys' multipliers
template <typename T>
std::vector<T> unit_key_scales(const at::Tensor& q, double scale) {
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3);
  std::vector<T> out(B * H * N);
  const T* p = q.data_ptr<T>();
  at::parallel_for(0, B * H, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t bh = h0; bh < h1; bh++)
      for (int64_t i = 0; i < N; i++) {
        const T* row = p + (bh / H) * q.stride(0) + (bh % H) * q.stride(1) + i * q.stride(2);
        out[bh * N + i] = T(scale) / std::max(std::sqrt(dot(row, row, D)), T(kNormEps));
      }
  });
  return out;
}

template <typename T>
RoundCall<T> make_call(const at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& v,
                       const at::Tensor& order, const at::Tensor& groups, const at::Tensor& labels,
                       const std::optional<at::Tensor>& key_valid, const Setup& st, double scale,
                       const std::vector<T>& key_scale) {
  RoundCall<T> c;
  c.z = {q.size(0), q.size(1), order.size(2), q.size(2), q.size(3)};
  c.st = st;
  const at::Tensor& kk = k.has_value() ? *k : q;
  c.q = q.data_ptr<T>();
  c.k = kk.data_ptr<T>();
  c.v = v.data_ptr<T>();
  for (int d = 0; d < 3; d++) {
    c.qs[d] = q.stride(d);
    c.ks[d] = kk.stride(d);
    c.vs[d] = v.stride(d);
  }
  c.key_scale = k.has_value() ? nullptr : key_scale.data();
  c.order = order.data_ptr<int64_t>();
  c.groups = groups.data_ptr<int64_t>();
  c.labels = labels.data_ptr<int64_t>();
  c.valid = key_valid.has_value() ? key_valid->data_ptr<bool>() : nullptr;
  c.valid_heads = key_valid.has_value() ? key_valid->size(1) : 1;
  c.scale = static_cast<T>(scale);
  return c;
}

// Every row of a contiguous int64 tensor non-decreasing: a round's buckets in sorted order, each one run (the
// kernel finds a query's run by stepping from it while the bucket stays the same).
void check_sorted(const char* op, const at::Tensor& t, const char* name) {
  const int64_t n = t.size(-1);
  const int64_t* p = t.data_ptr<int64_t>();
  for (int64_t r = 0, rows = n == 0 ? 0 : t.numel() / n; r < rows; r++)
    for (int64_t i = 1; i < n; i++)
      RF_CHECK(p[r * n + i - 1] <= p[r * n + i], op, name, " must be non-decreasing along each round, got ",
               p[r * n + i - 1], " before ", p[r * n + i], " at flat row ", r, ", index ", i);
}

// Everything both directions read: q, k (or none), v of one shape, the setup list, the rounds' order (permutations),
// groups (sorted) and labels (B, H, R, N), the validity. Returns the setup.
Setup check_call(const char* op, const at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& v,
                 const at::Tensor& order, const at::Tensor& groups, const at::Tensor& labels,
                 const std::optional<at::Tensor>& key_valid, at::IntArrayRef setup, double scale) {
  checks::floating(op, q, "q");
  checks::rows(op, q, "q", q.scalar_type());
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3);
  if (k.has_value()) {
    checks::rows(op, *k, "k", q.scalar_type());
    checks::shape(op, *k, "k", "(B, H, N, D) like q", {B, H, N, D});
  }
  checks::rows(op, v, "v", q.scalar_type());
  checks::shape(op, v, "v", "(B, H, N, D) like q", {B, H, N, D});
  checks::finite(op, scale, "scale");
  const Setup st = Setup::from(op, setup);
  checks::dtype(op, order, "order", at::kLong);
  RF_CHECK(order.dim() == 4 && order.size(2) >= 1, op, "order must be (B, H, R, N) with R >= 1 rounds, got ",
           checks::dims(order.sizes()));
  const std::vector<int64_t> shape = {B, H, order.size(2), N};
  checks::flat(op, order, "order", at::kLong, "(B, H, R, N)", shape);
  checks::flat(op, groups, "groups", at::kLong, "(B, H, R, N)", shape);
  checks::flat(op, labels, "labels", at::kLong, "(B, H, R, N)", shape);
  checks::permutations(op, order, "order");
  check_sorted(op, groups, "groups");
  checks::key_valid(op, key_valid, B, H, N);
  return st;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_rounds_forward(
    const at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& v, const at::Tensor& order,
    const at::Tensor& groups, const at::Tensor& labels, const std::optional<at::Tensor>& key_valid,
    at::IntArrayRef setup, double scale) {
  const Setup st = check_call("rounds_forward", q, k, v, order, groups, labels, key_valid, setup, scale);
  const int64_t B = q.size(0), H = q.size(1), R = order.size(2), N = q.size(2), D = q.size(3);
  auto out = at::empty({B, H, N, D}, q.options());
  auto lse = at::empty({B, H, N}, q.options());
  auto alone = at::zeros({B, H, N}, q.options().dtype(at::kBool));
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "routeformer_rounds_forward", [&] {
    using T = scalar_t;
    const std::vector<T> unit = k.has_value() ? std::vector<T>() : unit_key_scales<T>(q, scale);
    const RoundCall<T> c = make_call<T>(q, k, v, order, groups, labels, key_valid, st, scale, unit);
    const int64_t nbk = c.blocks(), BH = B * H;
    auto eo = at::empty({BH * R * N, D}, q.options());  // each round's result, by position
    auto el = at::empty({BH * R * N}, q.options());
    T* eo_p = eo.data_ptr<T>();
    T* el_p = el.data_ptr<T>();
    at::parallel_for(0, BH * R * nbk, 1, [&](int64_t x0, int64_t x1) {
      Work<T> w;
      std::vector<int64_t> seq, qrow, a, e;
      Buffer<T> ob, lb;
      Rows rows;
      for (int64_t x = x0; x < x1; x++) {
        const int64_t bh = x / (R * nbk), r = (x / nbk) % R;
        c.rows_of(bh, r, x % nbk, seq, qrow, a, e, rows);
        BlockOut<T> bo{ob.get(rows.n * D), lb.get(rows.n), nullptr};
        forward_block(c.head(bh, r), Rel<T>(), c.rules(bh, r, rows.qseq), rows, w, bo);
        for (int64_t i = 0; i < rows.n; i++) {
          const int64_t at_row = (bh * R + r) * N + qrow[i];
          std::memcpy(eo_p + at_row * D, bo.o + i * D, D * sizeof(T));
          el_p[at_row] = bo.lse[i];
        }
      }
    });
    T* out_p = out.data_ptr<T>();
    T* lse_p = lse.data_ptr<T>();
    bool* alone_p = alone.data_ptr<bool>();
    at::parallel_for(0, BH * N, 256, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; i++) {  // position i of head bh = i / N: its rounds merged
        const int64_t bh = i / N, pos = i % N;
        T top = neg_inf<T>();
        for (int64_t r = 0; r < R; r++) top = std::max(top, el_p[(bh * R + r) * N + pos]);
        T* orow = out_p + i * D;
        std::fill(orow, orow + D, T(0));
        lse_p[i] = neg_inf<T>();
        if (top == neg_inf<T>()) {  // nothing in any round: the own key, if it is a real key
          const RoundRules<T> rr = c.rules(bh, 0, nullptr);
          if (rr.valid == nullptr || rr.valid[pos]) {
            const int64_t b = bh / H, h = bh % H;
            std::memcpy(orow, c.v + b * c.vs[0] + h * c.vs[1] + pos * c.vs[2], D * sizeof(T));
            alone_p[i] = true;
          }
          continue;
        }
        T total = 0;
        for (int64_t r = 0; r < R; r++) {
          const T lt = el_p[(bh * R + r) * N + pos];
          if (lt == neg_inf<T>()) continue;
          const T wt = std::exp(lt - top);
          total += wt;
          axpy(orow, eo_p + ((bh * R + r) * N + pos) * D, D, wt);
        }
        scale_row(orow, D, T(1) / total);
        lse_p[i] = top + std::log(total);
      }
    });
  });
  return {out, lse, alone};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_rounds_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& alone, const at::Tensor& order,
    const at::Tensor& groups, const at::Tensor& labels, const std::optional<at::Tensor>& key_valid,
    at::IntArrayRef setup, double scale, std::array<bool, 3> output_mask) {
  const char* op = "rounds_backward";
  Needs need = Needs::of(output_mask);
  if (!k.has_value()) need.k = need.q;  // the unit keys' gradient is taken back to q
  const Setup st = check_call(op, q, k, v, order, groups, labels, key_valid, setup, scale);
  const int64_t B = q.size(0), H = q.size(1), R = order.size(2), N = q.size(2), D = q.size(3);
  checks::grads(op, grad_out, std::nullopt, out, lse, {B, H, N, N, D}, q.scalar_type());
  checks::flat(op, alone, "alone", at::kBool, "(B, H, N)", {B, H, N});
  auto go = grad_out.contiguous();
  auto o = out.contiguous();
  auto dq = at::zeros(need.q ? at::IntArrayRef{B, H, N, D} : at::IntArrayRef{0}, q.options());
  auto dk = at::zeros(need.k ? at::IntArrayRef{B, H, N, D} : at::IntArrayRef{0}, q.options());
  auto dv = at::zeros(need.v ? at::IntArrayRef{B, H, N, D} : at::IntArrayRef{0}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "routeformer_rounds_backward", [&] {
    using T = scalar_t;
    const std::vector<T> unit = k.has_value() ? std::vector<T>() : unit_key_scales<T>(q, scale);
    const RoundCall<T> c = make_call<T>(q, k, v, order, groups, labels, key_valid, st, scale, unit);
    const int64_t nbk = c.blocks();
    const T* go_p = go.data_ptr<T>();
    const T* o_p = o.data_ptr<T>();
    const T* lse_p = lse.data_ptr<T>();
    const bool* alone_p = alone.data_ptr<bool>();
    T* dq_p = need.q ? dq.data_ptr<T>() : nullptr;
    at::parallel_for(0, B * H, 1, [&](int64_t h0, int64_t h1) {
      Work<T> w;
      std::vector<int64_t> seq, qrow, a, e;
      Buffer<T> lb, db, dlt;
      Buffer<uint8_t> ab;
      Rows rows;
      for (int64_t bh = h0; bh < h1; bh++) {
        T* delta = dlt.get(N);
        for (int64_t i = 0; i < N; i++)
          delta[i] = dot(go_p + (bh * N + i) * D, o_p + (bh * N + i) * D, D);
        Grads<T> gr{need.k ? dk.data_ptr<T>() + bh * N * D : nullptr,
                    need.v ? dv.data_ptr<T>() + bh * N * D : nullptr, nullptr, nullptr, need.q};
        for (int64_t r = 0; r < R; r++) {
          for (int64_t x = 0; x < nbk; x++) {
            c.rows_of(bh, r, x, seq, qrow, a, e, rows);
            T* lr = lb.get(rows.n);
            T* dr = db.get(rows.n);
            uint8_t* al = ab.get(rows.n);
            for (int64_t i = 0; i < rows.n; i++) {
              lr[i] = lse_p[bh * N + qrow[i]];
              dr[i] = delta[qrow[i]];
              al[i] = 0;
            }
            backward_block(c.head(bh, r), Rel<T>(), c.rules(bh, r, rows.qseq), rows, go_p + bh * N * D, D, lr, dr,
                           al, w, gr);
            if (need.q)
              for (int64_t i = 0; i < rows.n; i++) axpy(dq_p + (bh * N + qrow[i]) * D, w.dq.ptr + i * D, D, T(1));
          }
        }
        if (need.v)
          for (int64_t i = 0; i < N; i++)  // a position alone in every round outputs its own value
            if (alone_p[bh * N + i]) axpy(gr.dv + i * D, go_p + (bh * N + i) * D, D, T(1));
        if (!k.has_value() && need.q) {  // unit keys k_j = c_j q_j, c_j = scale / |q_j|: dq_j += c_j (g - (g·u_j) u_j)
          const int64_t b = bh / H, h = bh % H;
          for (int64_t i = 0; i < N; i++) {
            const T* qr = c.q + b * c.qs[0] + h * c.qs[1] + i * c.qs[2];
            T* g = gr.dk + i * D;
            const T cj = unit[bh * N + i];
            const T norm2 = dot(qr, qr, D);
            T* dqr = dq_p + (bh * N + i) * D;
            if (std::sqrt(norm2) > T(kNormEps)) axpy(g, qr, D, -dot(g, qr, D) / norm2);  // g - (g·u) u, in g
            axpy(dqr, g, D, cj);
          }
        }
      }
    });
  });
  if (!k.has_value()) dk = at::empty({0}, q.options());  // taken back to q
  return {dq, dk, dv};
}

}  // namespace routeformer
