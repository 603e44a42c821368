// The fused executor's ``ranges``: entry m asks with query row m / merge and attends to the keys [lo_m, hi_m) of the
// key sequence k[key_order]; the ``merge`` entries of a query row are one softmax over the union of their ranges.
//
// Per head, the entries with a non-empty range are sorted by hi (a counting sort: stable, O(M + N)) and cut into
// blocks of at most ``rows_per_block`` consecutive entries (twice as many while they add no key) whose ranges
// together span at most ``span_cap`` keys, so a block is one product of its gathered query rows against one
// stretch of keys, read by index from k and v. With
// packed ``documents`` (the query rows', whose keys the ranges already lie within) a block also ends where its
// entries' document changes: a document's blocks, their spans and every sum's order are then its own, so its results
// are the same bits however the other documents change (as the band and rounds kernels' blocks). Each
// entry's (out, lse) is merged per query row through the log-sum-exp. The backward recomputes every block with its
// query row's merged lse: the union is one softmax, so an entry's probabilities are exp(s - lse of its row).
//
// The drivers (forward over the blocks of all heads, the merge, backward over heads) are common.h's; this file says
// what the entries' blocks, rules and checks are.
#include "checks.h"
#include "common.h"
#include "geometry.h"
#include "ops.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>

namespace routeformer {
namespace {

struct Entries {  // one head's entries in blocks
  std::vector<int64_t> sorted;  // non-empty entries by hi
  std::vector<int64_t> start;   // block b: sorted[start[b] .. start[b + 1])
  int64_t blocks() const { return start.empty() ? 0 : int64_t(start.size()) - 1; }
};

Entries cut_blocks(const int64_t* lo, const int64_t* hi, int64_t M, int64_t N, const RangesGeometry& g,
                   const int64_t* documents) {
  Entries en;
  std::vector<int64_t> count(N + 2, 0);
  for (int64_t m = 0; m < M; m++)
    if (lo[m] < hi[m]) count[hi[m] + 1]++;
  for (int64_t x = 1; x < N + 2; x++) count[x] += count[x - 1];
  en.sorted.resize(count[N + 1]);
  for (int64_t m = 0; m < M; m++)
    if (lo[m] < hi[m]) en.sorted[count[hi[m]]++] = m;
  const int64_t S = static_cast<int64_t>(en.sorted.size());
  for (int64_t s = 0; s < S;) {
    en.start.push_back(s);
    int64_t a = lo[en.sorted[s]], e = hi[en.sorted[s]];
    int64_t t = s + 1;
    // up to rows_per_block entries, and up to twice as many while they add no key to the span (entries of one range,
    // as a cluster's queries reading its window: a larger product that pads nothing)
    for (; t < S && t - s < 2 * g.rows_per_block; t++) {
      const int64_t m = en.sorted[t];
      if (documents != nullptr && documents[m / g.merge] != documents[en.sorted[s] / g.merge]) break;
      const int64_t na = std::min(a, lo[m]), ne = std::max(e, hi[m]);
      if (ne - na > g.span_cap || (t - s >= g.rows_per_block && (na != a || ne != e))) break;
      a = na;
      e = ne;
    }
    s = t;
  }
  en.start.push_back(S);
  return en;
}

// Rules of a block of entries: key validity and relative distances between positions (no bias, no own key).
template <typename T>
struct RangeRules {
  const bool* valid;        // per row of k, or null
  const int64_t* key_order; // null: identity
  const int64_t* key_pos;   // per row of k
  const int64_t* query_pos; // per query row
  const int64_t* qrow;      // the block's rows: their query rows
  int64_t unit_;            // 1: positions are the sequence indices (distance = j - qrow[r]), read affinely
  static constexpr bool has_bias = false;
  int64_t key_row(int64_t j) const { return key_order == nullptr ? j : key_order[j]; }
  bool elementwise(int64_t) const { return valid != nullptr; }
  bool allowed(int64_t, int64_t j) const { return valid[key_row(j)]; }
  int64_t distance(int64_t r, int64_t j) const { return key_pos[key_row(j)] - query_pos[qrow[r]]; }
  T bias(int64_t, int64_t) const { return T(0); }
  int64_t self(int64_t) const { return -1; }
  int64_t unit() const { return unit_; }
};

// Whether a head's distances are unit ones, key index - query row: no key order, and both positions the identity.
// Then the relative tables are read along each row's contiguous stretch of table rows (``RelChunk``'s affine path:
// vector passes) instead of one table index per pair (block selection's heads with relative positions: 1.35x
// faster forward+backward).
bool unit_positions(const int64_t* key_order, const int64_t* key_pos, const int64_t* query_pos, int64_t N,
                    int64_t Nq) {
  if (key_order != nullptr || key_pos == nullptr || query_pos == nullptr) return false;
  for (int64_t j = 0; j < N; j++)
    if (key_pos[j] != j) return false;
  for (int64_t i = 0; i < Nq; i++)
    if (query_pos[i] != i) return false;
  return true;
}

// The geometry with the entries' count it implies (M = Nq · merge per head).
struct Ranges {
  RangesGeometry g;
  int64_t M;
};

// 0 <= lo <= hi <= N for every entry: the kernel reads keys [lo, hi) and counts entries by hi
void check_ranges(const char* op, const at::Tensor& lo, const at::Tensor& hi, int64_t N) {
  const int64_t* a = lo.data_ptr<int64_t>();
  const int64_t* e = hi.data_ptr<int64_t>();
  for (int64_t m = 0, n = lo.numel(); m < n; m++)
    RF_CHECK(a[m] >= 0 && a[m] <= e[m] && e[m] <= N, op, "lo and hi must have 0 <= lo <= hi <= N = ", N,
             ", got lo ", a[m], ", hi ", e[m], " at flat entry ", m);
}

// Everything both directions read: q, k, v, the geometry, the ranges against k's N, the key order, validity and
// positions against the sizes, the relative tables (with both positions).
std::pair<checks::QKV, Ranges> check_call(
    const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lo,
    const at::Tensor& hi, at::IntArrayRef geometry, double scale, const std::optional<at::Tensor>& key_order,
    const std::optional<at::Tensor>& key_valid, const std::optional<at::Tensor>& query_pos,
    const std::optional<at::Tensor>& key_pos, const std::optional<at::Tensor>& key_table,
    const std::optional<at::Tensor>& value_table, const std::optional<at::Tensor>& documents) {
  const auto call = checks::attention<RangesGeometry>(op, q, &k, v, geometry, scale, key_valid);
  const checks::QKV& s = call.s;
  const Ranges z{call.g, checks::product(op, s.Nq, call.g.merge, "Nq * merge")};
  checks::flat(op, lo, "lo", at::kLong, "(B, H, Nq * merge)", {s.B, s.H, z.M});
  checks::flat(op, hi, "hi", at::kLong, "(B, H, Nq * merge)", {s.B, s.H, z.M});
  check_ranges(op, lo, hi, s.N);
  if (key_order.has_value()) {
    checks::flat(op, *key_order, "key_order", at::kLong, "(B, H, N)", {s.B, s.H, s.N});
    checks::permutations(op, *key_order, "key_order");
  }
  checks::positions(op, query_pos, "query_pos", {s.B, s.H, s.Nq});
  checks::positions(op, key_pos, "key_pos", {s.B, s.H, s.N});
  if (documents.has_value()) checks::flat(op, *documents, "documents", at::kLong, "(B, Nq)", {s.B, s.Nq});
  if (checks::tables(op, key_table, value_table, z.g.max_distance, s.D, q.scalar_type()))
    RF_CHECK(query_pos.has_value() && key_pos.has_value(), op, "relative positions need query_pos and key_pos");
  return {s, z};
}

// A head's blocks are its entries cut by ``cut_blocks``; a block row is an entry, its query row the entry's
// (m / merge), its forward slot the entry itself (merged into the query rows afterwards).
template <typename T>
struct RangeLayout {
  checks::QKV s;
  Ranges z;
  Heads<T> heads;
  Rel<T> rel;
  int64_t D;
  T scale;
  const int64_t *lo, *hi, *key_order, *key_pos, *query_pos;
  const int64_t* documents;  // (B, Nq): the query rows' documents, or null
  KeyValid key_valid;
  std::vector<uint8_t> unit_heads;  // with relative tables: per head, whether its distances are unit ones
  using Plan = Entries;

  RangeLayout(const checks::QKV& s_, const Ranges& z_, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& lo_, const at::Tensor& hi_, double scale_, const std::optional<at::Tensor>& order,
              const std::optional<at::Tensor>& valid, const std::optional<at::Tensor>& qpos,
              const std::optional<at::Tensor>& kpos, const std::optional<at::Tensor>& key_table,
              const std::optional<at::Tensor>& value_table, const std::optional<at::Tensor>& documents_)
      : s(s_), z(z_), heads(q, k, v), rel(Rel<T>::of(key_table, value_table, z_.g.max_distance)), D(s_.D),
        scale(static_cast<T>(scale_)), lo(lo_.data_ptr<int64_t>()), hi(hi_.data_ptr<int64_t>()),
        key_order(order.has_value() ? order->data_ptr<int64_t>() : nullptr),
        key_pos(kpos.has_value() ? kpos->data_ptr<int64_t>() : nullptr),
        query_pos(qpos.has_value() ? qpos->data_ptr<int64_t>() : nullptr),
        documents(documents_.has_value() ? documents_->data_ptr<int64_t>() : nullptr),
        key_valid(KeyValid::of(valid, s_.H)) {
    if (!rel.on()) return;
    unit_heads.resize(s.B * s.H);
    at::parallel_for(0, s.B * s.H, 1, [&](int64_t h0, int64_t h1) {
      for (int64_t bh = h0; bh < h1; bh++)
        unit_heads[bh] = unit_positions(of_head(key_order, bh, s.N), of_head(key_pos, bh, s.N),
                                        of_head(query_pos, bh, s.Nq), s.N, s.Nq);
    });
  }
  static const int64_t* of_head(const int64_t* p, int64_t bh, int64_t n) { return p == nullptr ? nullptr : p + bh * n; }

  Plan plan(int64_t bh) const {
    return cut_blocks(lo + bh * z.M, hi + bh * z.M, z.M, s.N, z.g,
                      documents == nullptr ? nullptr : documents + (bh / s.H) * s.Nq);
  }
  template <typename F>
  void block(int64_t bh, const Plan& en, int64_t b, BlockRows& rows, F&& f) const {
    const int64_t s0 = en.start[b], n = en.start[b + 1] - s0;
    rows.resize(n);
    for (int64_t r = 0; r < n; r++) {
      const int64_t m = en.sorted[s0 + r];
      rows.qrow[r] = m / z.g.merge;
      rows.a[r] = lo[bh * z.M + m];
      rows.e[r] = hi[bh * z.M + m];
      rows.slot[r] = bh * z.M + m;
    }
    rows.bind(n, /*seq_is_qrow=*/true, false);  // a row's sequence index is its query row's (unit distances only)
    const int64_t* korder = of_head(key_order, bh, s.N);
    f(heads.head(bh, korder, scale),
      RangeRules<T>{key_valid.of_head(bh), korder, of_head(key_pos, bh, s.N), of_head(query_pos, bh, s.Nq),
                    rows.rows.qrow, unit_heads.empty() ? 0 : int64_t(unit_heads[bh])});
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> fused_ranges_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lo, const at::Tensor& hi,
    at::IntArrayRef geometry, double scale, const std::optional<at::Tensor>& key_order,
    const std::optional<at::Tensor>& key_valid, const std::optional<at::Tensor>& query_pos,
    const std::optional<at::Tensor>& key_pos, const std::optional<at::Tensor>& key_table,
    const std::optional<at::Tensor>& value_table, const std::optional<at::Tensor>& documents) {
  const auto checked = check_call("ranges_forward", q, k, v, lo, hi, geometry, scale, key_order, key_valid,
                                  query_pos, key_pos, key_table, value_table, documents);
  const checks::QKV& s = checked.first;
  const Ranges& z = checked.second;
  auto out = at::empty({s.B, s.H, s.Nq, s.D}, q.options());
  auto lse = at::empty({s.B, s.H, s.Nq}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "routeformer_ranges_forward", [&] {
    using T = scalar_t;
    const RangeLayout<T> layout(s, z, q, k, v, lo, hi, scale, key_order, key_valid, query_pos, key_pos, key_table,
                                value_table, documents);
    const int64_t BH = s.B * s.H, merge = z.g.merge;
    // each entry's (out, lse); an entry with an empty range keeps lse = neg_inf
    auto eo = at::empty({BH * z.M, s.D}, q.options());
    auto el = at::full({BH * z.M}, neg_inf<T>(), q.options());
    forward_blocks(layout, BH, Slots<T>{eo.data_ptr<T>(), el.data_ptr<T>()});
    // query row i (of all heads): its merge entries i · merge + t
    merge_slots(BH * s.Nq, merge, [merge](int64_t i, int64_t t) { return i * merge + t; }, eo.data_ptr<T>(),
                el.data_ptr<T>(), s.D, out.data_ptr<T>(), lse.data_ptr<T>(), [](int64_t, T*) {});
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_ranges_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& lo, const at::Tensor& hi,
    at::IntArrayRef geometry, double scale, const std::optional<at::Tensor>& key_order,
    const std::optional<at::Tensor>& key_valid, const std::optional<at::Tensor>& query_pos,
    const std::optional<at::Tensor>& key_pos, const std::optional<at::Tensor>& key_table,
    const std::optional<at::Tensor>& value_table, const std::optional<at::Tensor>& documents,
    std::array<bool, 3> output_mask) {
  const char* op = "ranges_backward";
  const auto checked = check_call(op, q, k, v, lo, hi, geometry, scale, key_order, key_valid, query_pos, key_pos,
                                  key_table, value_table, documents);
  const checks::QKV& s = checked.first;
  const Ranges& z = checked.second;
  checks::backward(op, grad_out, grad_lse, out, lse, nullptr, false, s, q.scalar_type());
  auto go = grad_out.contiguous();
  auto o = out.contiguous();
  // a query row's merge entries may fall in different blocks: their dq rows are added
  GradTensors grads(q, s.N, Needs::of(output_mask), key_table, /*dq_once=*/false);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "routeformer_ranges_backward", [&] {
    using T = scalar_t;
    const RangeLayout<T> layout(s, z, q, k, v, lo, hi, scale, key_order, key_valid, query_pos, key_pos, key_table,
                                value_table, documents);
    backward_blocks(layout, s.B * s.H, grads.io<T>(go, o, lse, grad_lse, nullptr), [](int64_t, const Grads<T>&) {});
  });
  return grads.result();
}

}  // namespace routeformer
