// The fused executor's ``rounds`` (LSH): rounds, each a sliding window over its own sorted order within groups
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
// is read, their gradient taken back to q at the end: no keys tensor. The drivers (forward over the blocks of all
// heads and rounds, the merge, backward over heads) are common.h's; this file says what the rounds' blocks, rules
// and checks are, and what a backward adds after a head's last block.
#include "checks.h"
#include "common.h"
#include "geometry.h"
#include "ops.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>

namespace routeformer {
namespace {

// |a - b| < w for any int64 labels a, b (w > 0): the difference taken in unsigned, where it cannot overflow
inline bool closer_than(int64_t a, int64_t b, int64_t w) {
  const uint64_t d = a >= b ? static_cast<uint64_t>(a) - static_cast<uint64_t>(b)
                            : static_cast<uint64_t>(b) - static_cast<uint64_t>(a);
  return d < static_cast<uint64_t>(w);
}

// Rules of one round's block: key validity, the own key left to the merge (not causal), the pairs an earlier round
// holds (no relative positions, no bias).
template <typename T>
struct RoundRules {
  const int64_t* order;   // this round's: sorted index -> position
  const int64_t* labels;  // (rounds, N) by position
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

// A head's blocks: each round's sorted indices in blocks of at most rows_per_block, round after round, a block ending
// where a run of its round's groups (buckets, or (document, bucket)) ends: a block's key span is then its own
// group's whatever the other groups hold, so a packed document's results are the same bits however the others
// change (as the band kernel's blocks). A block row is a sorted index, its query row the position there, its
// forward slot that position in its round's results.
template <typename T>
struct RoundLayout {
  Heads<T> heads;
  Rel<T> rel;  // none
  int64_t D, N, n_rounds;
  RoundsGeometry g;
  T scale;
  const T* key_scale;  // (B·H·N): scale / |q_j| for unit keys, or null (k given; the score scale is ``scale``)
  const int64_t *order, *groups, *labels;  // (B, H, rounds, N)
  KeyValid key_valid;
  struct Plan {
    std::vector<int64_t> round, start, end;  // every block's round and sorted rows [start, end)
    int64_t blocks() const { return static_cast<int64_t>(start.size()); }
  };

  const int64_t* of_round(const int64_t* p, int64_t bh, int64_t round) const {
    return p + (bh * n_rounds + round) * N;
  }
  Plan plan(int64_t bh) const {
    Plan p;
    for (int64_t round = 0; round < n_rounds; round++) {
      const int64_t* gr = of_round(groups, bh, round);
      for (int64_t r = 0; r < N;) {
        const int64_t cap = r + std::min(g.rows_per_block, N - r);  // not r + rows_per_block: no wrap
        int64_t e = r + 1;
        while (e < cap && gr[e] == gr[r]) e++;
        p.round.push_back(round);
        p.start.push_back(r);
        p.end.push_back(e);
        r = e;
      }
    }
    return p;
  }
  template <typename F>
  void block(int64_t bh, const Plan& p, int64_t b, BlockRows& s, F&& f) const {
    const int64_t round = p.round[b];
    const int64_t* ord = of_round(order, bh, round);
    const int64_t* gr = of_round(groups, bh, round);
    const int64_t r0 = p.start[b], n = p.end[b] - r0;
    s.resize(n);
    for (int64_t i = 0; i < n; i++) {
      const int64_t at = r0 + i;
      s.seq[i] = at;
      s.qrow[i] = ord[at];
      int64_t lo = std::max<int64_t>(0, at - (g.window - 1));
      while (lo < at && gr[lo] != gr[at]) lo++;  // the bucket's run (groups sorted): at most window steps
      int64_t hi = at;
      if (!g.causal) {
        hi = at + std::min(g.window, N - at);  // not at + window: window may be any positive int64
        while (hi > at + 1 && gr[hi - 1] != gr[at]) hi--;
      }
      s.a[i] = lo;
      s.e[i] = hi;
      s.slot[i] = (bh * n_rounds + round) * N + ord[at];
    }
    s.bind(n, false, false);
    f(heads.head(bh, ord, key_scale == nullptr ? scale : T(1), key_scale == nullptr ? nullptr : key_scale + bh * N),
      RoundRules<T>{ord, labels + bh * n_rounds * N, key_valid.of_head(bh), s.rows.qseq, round, N, g.window,
                    g.causal});
  }
};

// Everything both directions read: q, k (or none), v of one shape, the geometry, the rounds' order (permutations),
// groups (sorted) and labels (B, H, rounds, N), the validity. Returns the sizes and the geometry.
checks::Attention<RoundsGeometry> check_call(const char* op, const at::Tensor& q, const std::optional<at::Tensor>& k,
                                             const at::Tensor& v, const at::Tensor& order, const at::Tensor& groups,
                                             const at::Tensor& labels, const std::optional<at::Tensor>& key_valid,
                                             at::IntArrayRef geometry, double scale) {
  const auto call = checks::attention<RoundsGeometry>(op, q, k.has_value() ? &*k : nullptr, v, geometry, scale,
                                                      key_valid);
  const checks::QKV& s = call.s;
  RF_CHECK(s.N == s.Nq, op, "k must have q's N rows (the rounds sort queries and keys alike), got ", s.N,
           " keys and ", s.Nq, " queries");
  checks::dtype(op, order, "order", at::kLong);
  RF_CHECK(order.dim() == 4 && order.size(2) >= 1, op, "order must be (B, H, R, N) with R >= 1 rounds, got ",
           checks::dims(order.sizes()));
  const std::vector<int64_t> shape = {s.B, s.H, order.size(2), s.N};
  checks::flat(op, order, "order", at::kLong, "(B, H, R, N)", shape);
  checks::flat(op, groups, "groups", at::kLong, "(B, H, R, N)", shape);
  checks::flat(op, labels, "labels", at::kLong, "(B, H, R, N)", shape);
  checks::permutations(op, order, "order");
  check_sorted(op, groups, "groups");
  return call;
}

template <typename T>
RoundLayout<T> layout_of(const at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& v,
                         const at::Tensor& order, const at::Tensor& groups, const at::Tensor& labels,
                         const std::optional<at::Tensor>& key_valid, const checks::Attention<RoundsGeometry>& call,
                         double scale, const std::vector<T>& key_scale) {
  const checks::QKV& s = call.s;
  return RoundLayout<T>{Heads<T>(q, k.has_value() ? *k : q, v), Rel<T>(), s.D, s.N, order.size(2), call.g,
                        static_cast<T>(scale),
                        k.has_value() ? nullptr : key_scale.data(), order.data_ptr<int64_t>(),
                        groups.data_ptr<int64_t>(), labels.data_ptr<int64_t>(), KeyValid::of(key_valid, s.H)};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_rounds_forward(
    const at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& v, const at::Tensor& order,
    const at::Tensor& groups, const at::Tensor& labels, const std::optional<at::Tensor>& key_valid,
    at::IntArrayRef geometry, double scale) {
  const auto call = check_call("rounds_forward", q, k, v, order, groups, labels, key_valid, geometry, scale);
  const int64_t B = call.s.B, H = call.s.H, N = call.s.N, D = call.s.D, n_rounds = order.size(2);
  auto out = at::empty({B, H, N, D}, q.options());
  auto lse = at::empty({B, H, N}, q.options());
  auto alone = at::zeros({B, H, N}, q.options().dtype(at::kBool));
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "routeformer_rounds_forward", [&] {
    using T = scalar_t;
    const std::vector<T> unit = k.has_value() ? std::vector<T>() : unit_key_scales<T>(q, scale);
    const RoundLayout<T> layout = layout_of<T>(q, k, v, order, groups, labels, key_valid, call, scale, unit);
    const int64_t BH = B * H;
    auto eo = at::empty({BH * n_rounds * N, D}, q.options());  // each round's result, by position
    auto el = at::empty({BH * n_rounds * N}, q.options());
    forward_blocks(layout, BH, Slots<T>{eo.data_ptr<T>(), el.data_ptr<T>()});
    bool* alone_p = alone.data_ptr<bool>();
    // position i % N of head i / N: its rounds' results; nothing in any round: the own key, if it is a real key
    merge_slots(
        BH * N, n_rounds, [&](int64_t i, int64_t t) { return ((i / N) * n_rounds + t) * N + i % N; },
        eo.data_ptr<T>(), el.data_ptr<T>(), D, out.data_ptr<T>(), lse.data_ptr<T>(), [&](int64_t i, T* orow) {
          const int64_t bh = i / N, pos = i % N;
          const bool* valid = layout.key_valid.of_head(bh);
          if (valid != nullptr && !valid[pos]) return;
          std::memcpy(orow, layout.heads.v_row(bh, pos), D * sizeof(T));
          alone_p[i] = true;
        });
  });
  return {out, lse, alone};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_rounds_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& alone, const at::Tensor& order,
    const at::Tensor& groups, const at::Tensor& labels, const std::optional<at::Tensor>& key_valid,
    at::IntArrayRef geometry, double scale, std::array<bool, 3> output_mask) {
  const char* op = "rounds_backward";
  Needs need = Needs::of(output_mask);
  if (!k.has_value()) need.k = need.q;  // the unit keys' gradient is taken back to q
  const auto call = check_call(op, q, k, v, order, groups, labels, key_valid, geometry, scale);
  checks::backward(op, grad_out, std::nullopt, out, lse, &alone, true, call.s, q.scalar_type());
  const int64_t N = call.s.N, D = call.s.D;
  auto go = grad_out.contiguous();
  auto o = out.contiguous();
  // a position's rounds fall in different blocks: its dq rows are added
  GradTensors grads(q, N, need, std::nullopt, /*dq_once=*/false);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "routeformer_rounds_backward", [&] {
    using T = scalar_t;
    const std::vector<T> unit = k.has_value() ? std::vector<T>() : unit_key_scales<T>(q, scale);
    const RoundLayout<T> layout = layout_of<T>(q, k, v, order, groups, labels, key_valid, call, scale, unit);
    const T* go_p = go.data_ptr<T>();
    const bool* alone_p = alone.data_ptr<bool>();
    T* dq_p = need.q ? grads.dq.data_ptr<T>() : nullptr;
    // the rows alone in every round took only their own value; the blocks saw no own key (self = -1)
    backward_blocks(layout, call.s.B * call.s.H, grads.io<T>(go, o, lse, std::nullopt, nullptr),
                    [&](int64_t bh, const Grads<T>& g) {
      if (need.v)
        for (int64_t i = 0; i < N; i++)  // a position alone in every round outputs its own value
          if (alone_p[bh * N + i]) axpy(g.dv + i * D, go_p + (bh * N + i) * D, D, T(1));
      if (!k.has_value() && need.q) {  // unit keys k_j = c_j q_j, c_j = scale / |q_j|: dq_j += c_j (g - (g·u_j) u_j)
        for (int64_t i = 0; i < N; i++) {
          const T* qr = layout.heads.q_row(bh, i);
          T* gk = g.dk + i * D;
          const T cj = unit[bh * N + i];
          const T norm2 = dot(qr, qr, D);
          T* dqr = dq_p + (bh * N + i) * D;
          if (std::sqrt(norm2) > T(kNormEps)) axpy(gk, qr, D, -dot(gk, qr, D) / norm2);  // g - (g·u) u, in g
          axpy(dqr, gk, D, cj);
        }
      }
    });
  });
  if (!k.has_value()) grads.dk = at::empty({0}, q.options());  // taken back to q
  return {grads.dq, grads.dk, grads.dv};
}

}  // namespace routeformer
