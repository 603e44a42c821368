// The fused executor's ``ranges``: entry m asks with query row m / merge and attends to the keys [lo_m, hi_m) of the
// key sequence k[key_order]; the ``merge`` entries of a query row are one softmax over the union of their ranges.
//
// Per head, the entries with a non-empty range are sorted by hi (a counting sort: stable, O(M + N)) and cut into
// blocks of at most ``rows_per_block`` consecutive entries whose ranges together span at most ``span_cap`` keys, so a
// block is one product of its gathered query rows against one stretch of keys, read by index from k and v. Each
// entry's (out, lse) is merged per query row through the log-sum-exp. The backward recomputes every block with its
// query row's merged lse: the union is one softmax, so an entry's probabilities are exp(s - lse of its row).
//
// Forward parallel over (head, block); backward over heads, each head's blocks in order.
#include "checks.h"
#include "common.h"
#include "ops.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

namespace routeformer {
namespace {

struct Entries {  // one head's entries in blocks
  std::vector<int64_t> sorted;  // non-empty entries by hi
  std::vector<int64_t> start;   // block b: sorted[start[b] .. start[b + 1])
};

Entries cut_blocks(const int64_t* lo, const int64_t* hi, int64_t M, int64_t N, int64_t rows_per_block,
                   int64_t span_cap) {
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
    for (; t < S && t - s < rows_per_block; t++) {
      const int64_t m = en.sorted[t];
      const int64_t na = std::min(a, lo[m]), ne = std::max(e, hi[m]);
      if (ne - na > span_cap) break;
      a = na;
      e = ne;
    }
    s = t;
  }
  en.start.push_back(S);
  return en;
}

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

struct Sizes {
  int64_t B, H, Nq, N, D, M, merge, rows_per_block, span_cap, max_distance;
};

// 0 <= lo <= hi <= N for every entry: the kernel reads keys [lo, hi) and counts entries by hi
void check_ranges(const char* op, const at::Tensor& lo, const at::Tensor& hi, int64_t N) {
  const int64_t* a = lo.data_ptr<int64_t>();
  const int64_t* e = hi.data_ptr<int64_t>();
  for (int64_t m = 0, n = lo.numel(); m < n; m++)
    RF_CHECK(a[m] >= 0 && a[m] <= e[m] && e[m] <= N, op, "lo and hi must have 0 <= lo <= hi <= N = ", N,
             ", got lo ", a[m], ", hi ", e[m], " at flat entry ", m);
}

// Everything both directions read: q, k, v, the setup list, the ranges against k's N, the key order, validity and
// positions against the sizes, the relative tables (with both positions).
Sizes check_call(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lo,
                 const at::Tensor& hi, at::IntArrayRef setup, double scale,
                 const std::optional<at::Tensor>& key_order, const std::optional<at::Tensor>& key_valid,
                 const std::optional<at::Tensor>& query_pos, const std::optional<at::Tensor>& key_pos,
                 const std::optional<at::Tensor>& key_table, const std::optional<at::Tensor>& value_table) {
  const checks::QKV s = checks::qkv(op, q, k, v);
  checks::finite(op, scale, "scale");
  checks::length(op, setup, 4, "setup");
  checks::at_least(op, setup[0], 1, "setup[0] (merge)");
  checks::at_least(op, setup[1], 1, "setup[1] (rows_per_block)");
  checks::at_least(op, setup[2], 1, "setup[2] (span_cap)");
  const Sizes z{s.B, s.H, s.Nq, s.N, s.D, checks::product(op, s.Nq, setup[0], "Nq * merge"), setup[0], setup[1],
                setup[2], setup[3]};
  checks::flat(op, lo, "lo", at::kLong, "(B, H, Nq * merge)", {z.B, z.H, z.M});
  checks::flat(op, hi, "hi", at::kLong, "(B, H, Nq * merge)", {z.B, z.H, z.M});
  check_ranges(op, lo, hi, z.N);
  if (key_order.has_value()) {
    checks::flat(op, *key_order, "key_order", at::kLong, "(B, H, N)", {z.B, z.H, z.N});
    checks::permutations(op, *key_order, "key_order");
  }
  checks::key_valid(op, key_valid, z.B, z.H, z.N);
  checks::positions(op, query_pos, "query_pos", {z.B, z.H, z.Nq});
  checks::positions(op, key_pos, "key_pos", {z.B, z.H, z.N});
  if (checks::tables(op, key_table, value_table, z.max_distance, z.D, q.scalar_type()))
    RF_CHECK(query_pos.has_value() && key_pos.has_value(), op, "relative positions need query_pos and key_pos");
  return z;
}

template <typename T>
struct RangeCall {
  Sizes z;
  const T *q, *k, *v;
  int64_t qs[3], ks[3], vs[3];  // strides of batch, head, row
  const int64_t *lo, *hi, *key_order, *key_pos, *query_pos;
  const bool* valid;
  int64_t valid_heads;
  Rel<T> rel;
  T scale;
  std::vector<uint8_t> unit_heads;  // with relative tables: per head, whether its distances are unit ones

  Head<T> head(int64_t bh) const {
    const int64_t b = bh / z.H, h = bh % z.H;
    return Head<T>{q + b * qs[0] + h * qs[1], qs[2], k + b * ks[0] + h * ks[1], ks[2], v + b * vs[0] + h * vs[1],
                   vs[2], key_order == nullptr ? nullptr : key_order + bh * z.N, z.D, scale};
  }
  RangeRules<T> rules(int64_t bh, const int64_t* qrow) const {
    const int64_t b = bh / z.H, h = bh % z.H;
    const int64_t* korder = key_order == nullptr ? nullptr : key_order + bh * z.N;
    const int64_t* kpos = key_pos == nullptr ? nullptr : key_pos + bh * z.N;
    const int64_t* qpos = query_pos == nullptr ? nullptr : query_pos + bh * z.Nq;
    return RangeRules<T>{valid == nullptr ? nullptr : valid + (b * valid_heads + (valid_heads == 1 ? 0 : h)) * z.N,
                         korder, kpos, qpos, qrow, unit_heads.empty() ? 0 : int64_t(unit_heads[bh])};
  }
  Entries entries(int64_t bh) const {
    return cut_blocks(lo + bh * z.M, hi + bh * z.M, z.M, z.N, z.rows_per_block, z.span_cap);
  }
  // block b of a head's entries as rows
  void rows_of(const Entries& en, int64_t bh, size_t b, std::vector<int64_t>& qrow, std::vector<int64_t>& a,
               std::vector<int64_t>& e, Rows& rows) const {
    const int64_t s0 = en.start[b], n = en.start[b + 1] - s0;
    qrow.resize(n);
    a.resize(n);
    e.resize(n);
    for (int64_t r = 0; r < n; r++) {
      const int64_t m = en.sorted[s0 + r];
      qrow[r] = m / z.merge;
      a[r] = lo[bh * z.M + m];
      e[r] = hi[bh * z.M + m];
    }
    rows.n = n;
    rows.qrow = qrow.data();
    rows.qseq = qrow.data();  // a row's sequence index is its query row's (read by unit distances only)
    rows.a = a.data();
    rows.e = e.data();
    rows.contiguous = false;
  }
};

template <typename T>
RangeCall<T> make_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lo,
                       const at::Tensor& hi, const Sizes& z, double scale, const std::optional<at::Tensor>& key_order,
                       const std::optional<at::Tensor>& key_valid, const std::optional<at::Tensor>& query_pos,
                       const std::optional<at::Tensor>& key_pos, const std::optional<at::Tensor>& key_table,
                       const std::optional<at::Tensor>& value_table) {
  RangeCall<T> c;
  c.z = z;
  c.q = q.data_ptr<T>();
  c.k = k.data_ptr<T>();
  c.v = v.data_ptr<T>();
  for (int d = 0; d < 3; d++) {
    c.qs[d] = q.stride(d);
    c.ks[d] = k.stride(d);
    c.vs[d] = v.stride(d);
  }
  c.lo = lo.data_ptr<int64_t>();
  c.hi = hi.data_ptr<int64_t>();
  c.key_order = key_order.has_value() ? key_order->data_ptr<int64_t>() : nullptr;
  c.valid = key_valid.has_value() ? key_valid->data_ptr<bool>() : nullptr;
  c.valid_heads = key_valid.has_value() ? key_valid->size(1) : 1;
  c.query_pos = query_pos.has_value() ? query_pos->data_ptr<int64_t>() : nullptr;
  c.key_pos = key_pos.has_value() ? key_pos->data_ptr<int64_t>() : nullptr;
  c.rel = Rel<T>::of(key_table, value_table, z.max_distance);
  c.scale = static_cast<T>(scale);
  if (c.rel.on()) {
    c.unit_heads.resize(z.B * z.H);
    at::parallel_for(0, z.B * z.H, 1, [&](int64_t h0, int64_t h1) {
      for (int64_t bh = h0; bh < h1; bh++)
        c.unit_heads[bh] = unit_positions(c.key_order == nullptr ? nullptr : c.key_order + bh * z.N,
                                          c.key_pos == nullptr ? nullptr : c.key_pos + bh * z.N,
                                          c.query_pos == nullptr ? nullptr : c.query_pos + bh * z.Nq, z.N, z.Nq);
    });
  }
  return c;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> fused_ranges_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lo, const at::Tensor& hi,
    at::IntArrayRef setup, double scale, const std::optional<at::Tensor>& key_order,
    const std::optional<at::Tensor>& key_valid, const std::optional<at::Tensor>& query_pos,
    const std::optional<at::Tensor>& key_pos, const std::optional<at::Tensor>& key_table,
    const std::optional<at::Tensor>& value_table) {
  const Sizes z = check_call("ranges_forward", q, k, v, lo, hi, setup, scale, key_order, key_valid, query_pos,
                             key_pos, key_table, value_table);
  auto out = at::empty({z.B, z.H, z.Nq, z.D}, q.options());
  auto lse = at::empty({z.B, z.H, z.Nq}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "routeformer_ranges_forward", [&] {
    using T = scalar_t;
    const RangeCall<T> c = make_call<T>(q, k, v, lo, hi, z, scale, key_order, key_valid, query_pos, key_pos,
                                        key_table, value_table);
    const int64_t BH = z.B * z.H, D = z.D;
    std::vector<Entries> heads(BH);
    at::parallel_for(0, BH, 1, [&](int64_t h0, int64_t h1) {
      for (int64_t bh = h0; bh < h1; bh++) heads[bh] = c.entries(bh);
    });
    std::vector<int64_t> first(BH + 1, 0);  // blocks of all heads laid end to end
    for (int64_t bh = 0; bh < BH; bh++) first[bh + 1] = first[bh] + int64_t(heads[bh].start.size()) - 1;
    // each entry's (out, lse); an entry with an empty range keeps lse = neg_inf
    auto eo = at::empty({BH * z.M, D}, q.options());
    auto el = at::full({BH * z.M}, neg_inf<T>(), q.options());
    T* eo_p = eo.data_ptr<T>();
    T* el_p = el.data_ptr<T>();
    at::parallel_for(0, first[BH], 1, [&](int64_t x0, int64_t x1) {
      Work<T> w;
      std::vector<int64_t> qrow, a, e;
      Buffer<T> ob, lb;
      Rows rows;
      int64_t bh = std::upper_bound(first.begin(), first.end(), x0) - first.begin() - 1;
      for (int64_t x = x0; x < x1; x++) {
        while (x >= first[bh + 1]) bh++;
        const Entries& en = heads[bh];
        c.rows_of(en, bh, x - first[bh], qrow, a, e, rows);
        BlockOut<T> bo{ob.get(rows.n * D), lb.get(rows.n), nullptr};
        forward_block(c.head(bh), c.rel, c.rules(bh, qrow.data()), rows, w, bo);
        for (int64_t r = 0; r < rows.n; r++) {
          const int64_t m = bh * z.M + en.sorted[en.start[x - first[bh]] + r];
          std::memcpy(eo_p + m * D, bo.o + r * D, D * sizeof(T));
          el_p[m] = bo.lse[r];
        }
      }
    });
    T* out_p = out.data_ptr<T>();
    T* lse_p = lse.data_ptr<T>();
    const int64_t p = z.merge;
    at::parallel_for(0, BH * z.Nq, 256, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; i++) {  // query row i (of all heads): its p entries, merged
        T top = neg_inf<T>();
        for (int64_t t = 0; t < p; t++) top = std::max(top, el_p[i * p + t]);
        T* orow = out_p + i * D;
        std::fill(orow, orow + D, T(0));
        if (top == neg_inf<T>()) {
          lse_p[i] = neg_inf<T>();
          continue;
        }
        T total = 0;
        for (int64_t t = 0; t < p; t++) {
          const T lt = el_p[i * p + t];
          if (lt == neg_inf<T>()) continue;
          const T wt = std::exp(lt - top);
          total += wt;
          axpy(orow, eo_p + (i * p + t) * D, D, wt);
        }
        scale_row(orow, D, T(1) / total);
        lse_p[i] = top + std::log(total);
      }
    });
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_ranges_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& lo, const at::Tensor& hi,
    at::IntArrayRef setup, double scale, const std::optional<at::Tensor>& key_order,
    const std::optional<at::Tensor>& key_valid, const std::optional<at::Tensor>& query_pos,
    const std::optional<at::Tensor>& key_pos, const std::optional<at::Tensor>& key_table,
    const std::optional<at::Tensor>& value_table, std::array<bool, 3> output_mask) {
  const Needs need = Needs::of(output_mask);
  const char* op = "ranges_backward";
  const Sizes z = check_call(op, q, k, v, lo, hi, setup, scale, key_order, key_valid, query_pos, key_pos, key_table,
                             value_table);
  checks::grads(op, grad_out, grad_lse, out, lse, {z.B, z.H, z.Nq, z.N, z.D}, q.scalar_type());
  auto go = grad_out.contiguous();
  auto o = out.contiguous();
  auto dq = at::zeros(need.q ? at::IntArrayRef{z.B, z.H, z.Nq, z.D} : at::IntArrayRef{0}, q.options());
  auto dk = at::zeros(need.k ? at::IntArrayRef{z.B, z.H, z.N, z.D} : at::IntArrayRef{0}, q.options());
  auto dv = at::zeros(need.v ? at::IntArrayRef{z.B, z.H, z.N, z.D} : at::IntArrayRef{0}, q.options());
  const bool has_rel = key_table.has_value();
  const int64_t L = has_rel ? key_table->size(0) : 1;
  auto dtab = at::zeros({2, z.B * z.H, L, z.D}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "routeformer_ranges_backward", [&] {
    using T = scalar_t;
    const RangeCall<T> c = make_call<T>(q, k, v, lo, hi, z, scale, key_order, key_valid, query_pos, key_pos,
                                        key_table, value_table);
    const int64_t BH = z.B * z.H, D = z.D;
    const T* go_p = go.data_ptr<T>();
    const T* o_p = o.data_ptr<T>();
    const T* lse_p = lse.data_ptr<T>();
    const T* glse_p = grad_lse.has_value() ? grad_lse->data_ptr<T>() : nullptr;
    T* dq_p = need.q ? dq.data_ptr<T>() : nullptr;
    at::parallel_for(0, BH, 1, [&](int64_t h0, int64_t h1) {
      Work<T> w;
      std::vector<int64_t> qrow, a, e;
      Buffer<T> lb, db, dlt;
      Buffer<uint8_t> ab;
      Rows rows;
      for (int64_t bh = h0; bh < h1; bh++) {
        T* delta = dlt.get(z.Nq);  // dout·out - dlse per query row
        for (int64_t i = 0; i < z.Nq; i++) {
          const int64_t at_row = bh * z.Nq + i;
          delta[i] = dot(go_p + at_row * D, o_p + at_row * D, D) - (glse_p == nullptr ? T(0) : glse_p[at_row]);
        }
        const Entries en = c.entries(bh);
        Grads<T> gr{need.k ? dk.data_ptr<T>() + bh * z.N * D : nullptr,
                    need.v ? dv.data_ptr<T>() + bh * z.N * D : nullptr,
                    has_rel && need.k ? dtab.data_ptr<T>() + bh * L * D : nullptr,
                    has_rel && need.v ? dtab.data_ptr<T>() + (BH + bh) * L * D : nullptr, need.q};
        for (size_t b = 0; b + 1 < en.start.size(); b++) {
          c.rows_of(en, bh, b, qrow, a, e, rows);
          const int64_t n = rows.n;
          T* lr = lb.get(n);
          T* dr = db.get(n);
          uint8_t* al = ab.get(n);
          for (int64_t r = 0; r < n; r++) {
            lr[r] = lse_p[bh * z.Nq + qrow[r]];
            dr[r] = delta[qrow[r]];
            al[r] = 0;
          }
          backward_block(c.head(bh), c.rel, c.rules(bh, qrow.data()), rows, go_p + bh * z.Nq * D, D, lr, dr, al,
                         w, gr);
          if (need.q)
            for (int64_t r = 0; r < n; r++) axpy(dq_p + (bh * z.Nq + qrow[r]) * D, w.dq.ptr + r * D, D, T(1));
        }
      }
    });
  });
  auto [dkey, dvalue] = table_grads(dtab, has_rel);
  return {dq, dk, dv, dkey, dvalue};
}

}  // namespace routeformer
