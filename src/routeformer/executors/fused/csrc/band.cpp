// The fused executor's ``tiled``: query blocks against spans of key blocks (a ``tiling.Tiling``), with every mask
// computed from the tiling's values inside the kernel.
//
// A query row i of tiling block t = i / T sees the keys of its span [(t - back)·block, (t + ahead + 1)·block) that lie
// in [0, Nk), narrowed to [i + lo, i + hi] by a sliding window's offsets and, when the groups are sorted (a sequence
// sorted by cluster), to its group's run: an interval per row, so the common cases need no per-pair mask at all. The
// kernel cuts the rows into blocks of ``rows_per_block`` consecutive rows (independent of the tiling's blocks) against
// the union of their intervals. Per pair, where given: the static (T, S) mask, a per-tile mask, key validity, groups
// that are not sorted, the own key, relative distances (unit, per tile entry, or between positions), an additive
// bias. With ``order``, the sequence the tiling runs over is
// q[order], k[order], v[order]: rows are read and written by index, never copied in permuted order.
//
// Parallel over (batch·head, block) forward; backward over batch·head, each head's blocks in order (its key
// gradients are its own: no atomics, the same sums in the same order whatever the thread count).
#include "checks.h"
#include "common.h"
#include "ops.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

namespace routeformer {
namespace {

// int[] geometry, in this order (``fused/executor.py`` writes it)
struct Geometry {
  int64_t block, back, ahead, rows;  // rows: query rows per tile when queries are not at key positions (0: none)
  bool single;
  bool has_offsets;
  int64_t off_lo, off_hi;
  bool exclude_self;
  int64_t unit;  // relative distances (key - query) · unit; 0: given by delta or positions
  int64_t max_distance;
  int64_t rows_per_block;
  bool positions_from_order;  // relative distances between the entries' original positions (order[j] - order[i])
  int64_t n_tiles, T, S;      // the tiles: (n_tiles, T, S) as ``Tiling.shape`` gives them

  // The list checked against q's Nq and k's Nk: values in range, the tiles' geometry within int64 (the kernel
  // computes key indices (t ± reach) · block), and what the kernel assumes of a tiling (``Tiling.check``).
  static Geometry from(const char* op, at::IntArrayRef l, int64_t Nq, int64_t Nk) {
    checks::length(op, l, 13, "geometry");
    Geometry g{l[0], l[1], l[2], l[3], checks::flag(op, l[4], "geometry[4] (single)"),
               checks::flag(op, l[5], "geometry[5] (has_offsets)"), l[6], l[7],
               checks::flag(op, l[8], "geometry[8] (exclude_self)"), l[9], l[10], l[11],
               checks::flag(op, l[12], "geometry[12] (positions_from_order)"), 0, 0, 0};
    checks::at_least(op, g.block, 1, "geometry[0] (block)");
    checks::at_least(op, g.back, 0, "geometry[1] (back)");
    checks::at_least(op, g.ahead, 0, "geometry[2] (ahead)");
    checks::at_least(op, g.rows, 0, "geometry[3] (rows)");
    checks::at_least(op, g.unit, 0, "geometry[9] (unit)");
    checks::at_least(op, g.max_distance, 0, "geometry[10] (max_distance)");
    checks::at_least(op, g.rows_per_block, 1, "geometry[11] (rows_per_block)");
    RF_CHECK(!g.has_offsets || g.off_lo <= g.off_hi, op, "geometry's offsets must have lo <= hi, got (", g.off_lo,
             ", ", g.off_hi, ")");
    const bool single = g.back == 0 && g.ahead == 0 && g.block >= Nq && g.rows == 0;
    RF_CHECK(g.single == single, op, "geometry[4] (single) must be ", int(single), " for block ", g.block, ", back ",
             g.back, ", ahead ", g.ahead, ", rows ", g.rows, " and ", Nq, " queries, got ", int(g.single));
    if (g.single) {
      g.n_tiles = 1;
      g.T = Nq;
      g.S = Nk;
    } else {
      g.n_tiles = ceil_div(g.rows > 0 ? Nk : Nq, g.block);
      g.T = g.rows > 0 ? g.rows : g.block;
      const int64_t reach = checks::sum(op, checks::sum(op, g.n_tiles + 1, g.back, "the tiles' reach"), g.ahead,
                                        "the tiles' reach");
      checks::product(op, reach, g.block, "the tiles' key indices");
      g.S = (g.back + 1 + g.ahead) * g.block;
      if (g.rows > 0) {
        RF_CHECK(Nq == checks::product(op, g.n_tiles, g.rows, "n_tiles * rows"), op, "with rows = ", g.rows,
                 ", q must hold ceil(Nk / block) * rows = ", g.n_tiles * g.rows, " queries, got ", Nq);
      } else {
        RF_CHECK(Nq == Nk, op, "banded tiles need as many keys as queries, got ", Nq, " queries and ", Nk, " keys");
      }
    }
    RF_CHECK(!g.exclude_self || Nq == Nk, op, "exclude_self needs as many keys as queries, got ", Nq, " and ", Nk);
    // Values past the sequence mean the same as the sequence's ends; clipped there, row ± offset and the distances
    // (key - query) · unit stay far inside int64.
    const int64_t far = Nq + Nk + 1;
    g.off_lo = std::clamp(g.off_lo, -far, far);
    g.off_hi = std::clamp(g.off_hi, -far, far);
    if (g.unit > 1) g.unit = std::min(g.unit, std::max<int64_t>(2, g.max_distance + 1));  // |d| >= 1: clipped anyway
    return g;
  }
};

// A tensor broadcast to (B, H, n_tiles, T, S), read by strides (0 where broadcast).
template <typename V>
struct Strided5 {
  const V* p = nullptr;
  int64_t st[5] = {0, 0, 0, 0, 0};
  static Strided5 of(const std::optional<at::Tensor>& t, at::IntArrayRef shape) {
    Strided5 s;
    if (!t.has_value()) return s;
    auto x = t->expand(shape);
    s.p = x.template data_ptr<V>();
    for (int d = 0; d < 5; d++) s.st[d] = x.stride(d);
    return s;
  }
  V at(int64_t b, int64_t h, int64_t t, int64_t r, int64_t c) const {
    return p[b * st[0] + h * st[1] + t * st[2] + r * st[3] + c * st[4]];
  }
};

// Everything of one call that the rules read, for all heads.
template <typename T>
struct Call {
  Geometry g;
  int64_t B, H, Nq, Nk, T_, S, n_tiles;
  const bool* allow = nullptr;        // (T, S)
  Strided5<bool> tile_mask;
  const bool* key_valid = nullptr;    // (B, Hv, Nk)
  int64_t valid_heads = 1;
  const int64_t* groups = nullptr;    // (B, H, N)
  Strided5<int64_t> delta;
  const int64_t* positions = nullptr; // (B, H, N)
  Strided5<T> bias;
  std::vector<uint8_t> groups_sorted;  // per head: groups non-decreasing, so a group is one run of the sequence
  std::vector<int64_t> run_lo, run_hi; // per head and position: the run of its group
};

template <typename T>
struct BandRules {
  const Call<T>& c;
  int64_t b, h;
  const int64_t* qseq;  // the block's rows
  bool per_pair;        // some per-pair mask applies
  bool has_bias;
  const int64_t* groups;
  const int64_t* positions;
  const bool* valid;

  BandRules(const Call<T>& call, int64_t bh, const int64_t* rows_seq)
      : c(call), b(bh / call.H), h(bh % call.H), qseq(rows_seq) {
    groups = c.groups == nullptr ? nullptr : c.groups + bh * c.Nk;
    const bool grouped = groups != nullptr && !c.groups_sorted[bh];
    positions = c.positions == nullptr ? nullptr : c.positions + bh * c.Nk;
    valid = c.key_valid == nullptr ? nullptr
                                   : c.key_valid + (b * c.valid_heads + (c.valid_heads == 1 ? 0 : h)) * c.Nk;
    per_pair = c.allow != nullptr || c.tile_mask.p != nullptr || valid != nullptr || grouped;
    if (!grouped) groups = nullptr;
    has_bias = c.bias.p != nullptr;
  }
  int64_t tile(int64_t i) const { return c.g.single ? 0 : i / c.T_; }
  int64_t col(int64_t i, int64_t j) const {  // span column of key j in row i's tile
    return c.g.single ? j : j - (tile(i) - c.g.back) * c.g.block;
  }
  bool elementwise(int64_t) const { return per_pair; }
  bool allowed(int64_t r, int64_t j) const {
    const int64_t i = qseq[r];
    if (valid != nullptr && !valid[j]) return false;
    if (groups != nullptr && groups[i] != groups[j]) return false;
    if (c.allow != nullptr && !c.allow[(i - tile(i) * c.T_) * c.S + col(i, j)]) return false;
    if (c.tile_mask.p != nullptr && !c.tile_mask.at(b, h, tile(i), i - tile(i) * c.T_, col(i, j))) return false;
    return true;
  }
  int64_t distance(int64_t r, int64_t j) const {
    const int64_t i = qseq[r];
    if (c.g.unit > 0) return (j - i) * c.g.unit;
    if (positions != nullptr) return positions[j] - positions[i];
    return c.delta.at(b, h, tile(i), i - tile(i) * c.T_, col(i, j));
  }
  T bias(int64_t r, int64_t j) const {
    const int64_t i = qseq[r];
    return c.bias.at(b, h, tile(i), i - tile(i) * c.T_, col(i, j));
  }
  int64_t self(int64_t r) const { return c.g.exclude_self ? qseq[r] : -1; }
  int64_t unit() const { return c.g.unit; }
};

// The interval of key indices row i may see (a >= e: none).
template <typename T>
inline std::pair<int64_t, int64_t> interval(const Call<T>& c, int64_t bh, int64_t i) {
  const Geometry& g = c.g;
  int64_t a = 0, e = c.Nk;
  if (!g.single) {
    const int64_t t = i / c.T_;
    a = std::max(a, (t - g.back) * g.block);
    e = std::min(e, (t + g.ahead + 1) * g.block);
  }
  if (g.has_offsets) {
    a = std::max(a, i + g.off_lo);
    e = std::min(e, i + g.off_hi + 1);
  }
  if (c.groups != nullptr && c.groups_sorted[bh]) {
    a = std::max(a, c.run_lo[bh * c.Nk + i]);
    e = std::min(e, c.run_hi[bh * c.Nk + i]);
  }
  return {a, e};
}

// Every tensor argument against the checked geometry (see ``Call`` for how each is read); the relative tables'
// source of distances: exactly one of unit, delta, positions and the order's positions with the tables (the rules
// read the first of them, and delta unchecked when none), none without.
void check_tensors(const char* op, const checks::QKV& s, const Geometry& g, const std::optional<at::Tensor>& allow,
                   const std::optional<at::Tensor>& tile_mask, const std::optional<at::Tensor>& key_valid,
                   const std::optional<at::Tensor>& groups, const std::optional<at::Tensor>& order,
                   const std::optional<at::Tensor>& key_table, const std::optional<at::Tensor>& value_table,
                   const std::optional<at::Tensor>& delta, const std::optional<at::Tensor>& positions,
                   const std::optional<at::Tensor>& bias, at::ScalarType dtype) {
  const std::vector<int64_t> shape5 = {s.B, s.H, g.n_tiles, g.T, g.S}, per_key = {s.B, s.H, s.N};
  const char* tiles = "(B, H, n_tiles, T, S)";
  if (allow.has_value()) checks::flat(op, *allow, "allow", at::kBool, "(T, S)", {g.T, g.S});
  if (tile_mask.has_value()) checks::broadcastable(op, *tile_mask, "tile_mask", at::kBool, tiles, shape5);
  checks::key_valid(op, key_valid, s.B, s.H, s.N);
  // groups, the order and positions are read at query and key indices alike: self-attention only
  for (const auto& [t, name] : {std::pair{&groups, "groups"}, {&order, "order"}, {&positions, "positions"}}) {
    if (!t->has_value()) continue;
    RF_CHECK(s.Nq == s.N, op, name, " needs as many keys as queries, got ", s.Nq, " queries and ", s.N, " keys");
    checks::flat(op, **t, name, at::kLong, "(B, H, N)", per_key);
  }
  if (order.has_value()) checks::permutations(op, *order, "order");
  checks::positions(op, positions, "positions", per_key);
  if (delta.has_value()) checks::broadcastable(op, *delta, "delta", at::kLong, tiles, shape5);
  if (bias.has_value()) checks::broadcastable(op, *bias, "bias", dtype, tiles, shape5);
  const bool rel = checks::tables(op, key_table, value_table, g.max_distance, s.D, dtype);
  const int sources = int(g.unit > 0) + int(delta.has_value()) + int(positions.has_value()) +
                      int(g.positions_from_order);
  RF_CHECK(sources <= 1 && (!rel || sources == 1), op, "the relative tables need exactly one source of distances ",
           "(unit > 0, delta, positions or positions_from_order) and none comes without them, got ", sources,
           rel ? " with the tables" : " without tables");
  RF_CHECK(!g.positions_from_order || order.has_value(), op, "positions_from_order needs an order");
}

// Pointers and strides of the checked arguments.
template <typename T>
Call<T> make_call(const at::Tensor& q, const at::Tensor& k, const Geometry& g, const std::optional<at::Tensor>& allow,
                  const std::optional<at::Tensor>& tile_mask, const std::optional<at::Tensor>& key_valid,
                  const std::optional<at::Tensor>& groups, const std::optional<at::Tensor>& delta, const std::optional<at::Tensor>& positions,
                  const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& order) {
  Call<T> c;
  c.g = g;
  c.B = q.size(0);
  c.H = q.size(1);
  c.Nq = q.size(2);
  c.Nk = k.size(2);
  c.n_tiles = g.n_tiles;
  c.T_ = g.T;
  c.S = g.S;
  std::vector<int64_t> shape5 = {c.B, c.H, c.n_tiles, c.T_, c.S};
  if (allow.has_value()) c.allow = allow->data_ptr<bool>();
  c.tile_mask = Strided5<bool>::of(tile_mask, shape5);
  if (key_valid.has_value()) {
    c.key_valid = key_valid->data_ptr<bool>();
    c.valid_heads = key_valid->size(1);
  }
  if (groups.has_value()) c.groups = groups->data_ptr<int64_t>();
  c.delta = Strided5<int64_t>::of(delta, shape5);
  if (positions.has_value()) c.positions = positions->data_ptr<int64_t>();
  if (g.positions_from_order) c.positions = order->data_ptr<int64_t>();
  c.bias = Strided5<T>::of(bias, shape5);
  if (c.groups != nullptr) {  // sorted groups: each group one run, its bounds per position
    const int64_t N = c.Nk, BH = c.B * c.H;
    c.groups_sorted.assign(BH, 0);
    c.run_lo.resize(BH * N);
    c.run_hi.resize(BH * N);
    at::parallel_for(0, BH, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t bh = b0; bh < b1; bh++) {
        const int64_t* gr = c.groups + bh * N;
        bool sorted = true;
        for (int64_t i = 1; i < N && sorted; i++) sorted = gr[i - 1] <= gr[i];
        c.groups_sorted[bh] = sorted;
        if (!sorted) continue;
        int64_t* lo = c.run_lo.data() + bh * N;
        int64_t* hi = c.run_hi.data() + bh * N;
        for (int64_t i = 0; i < N;) {
          int64_t j = i;
          while (j < N && gr[j] == gr[i]) j++;
          for (int64_t x = i; x < j; x++) {
            lo[x] = i;
            hi[x] = j;
          }
          i = j;
        }
      }
    });
  }
  return c;
}

// The blocks of one head: consecutive rows [r0, r1) of the sequence.
inline int64_t n_blocks(int64_t nq, int64_t rows_per_block) { return ceil_div(nq, rows_per_block); }

template <typename T>
Head<T> head_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t bh, int64_t H,
                const int64_t* order, T scale) {
  const int64_t b = bh / H, h = bh % H;
  return Head<T>{q.data_ptr<T>() + b * q.stride(0) + h * q.stride(1), q.stride(2),
                 k.data_ptr<T>() + b * k.stride(0) + h * k.stride(1), k.stride(2),
                 v.data_ptr<T>() + b * v.stride(0) + h * v.stride(1), v.stride(2),
                 order == nullptr ? nullptr : order + bh * k.size(2), q.size(3), scale};
}

// Fill the rows of block x of head bh: sequence indices, query rows (by order), intervals. Returns the row count.
template <typename T>
int64_t block_rows(const Call<T>& c, int64_t bh, int64_t x, const int64_t* order, std::vector<int64_t>& seq,
                   std::vector<int64_t>& qrow, std::vector<int64_t>& a, std::vector<int64_t>& e, Rows& rows) {
  const int64_t R = c.g.rows_per_block;
  const int64_t r0 = x * R, n = std::min(R, c.Nq - r0);
  seq.resize(n);
  qrow.resize(n);
  a.resize(n);
  e.resize(n);
  const int64_t* ord = order == nullptr ? nullptr : order + bh * c.Nq;
  for (int64_t r = 0; r < n; r++) {
    seq[r] = r0 + r;
    qrow[r] = ord == nullptr ? r0 + r : ord[r0 + r];
    auto [lo, hi] = interval(c, bh, r0 + r);
    a[r] = lo;
    e[r] = hi;
  }
  rows.n = n;
  rows.qrow = qrow.data();
  rows.qseq = seq.data();
  rows.a = a.data();
  rows.e = e.data();
  rows.contiguous = ord == nullptr;
  return n;
}

at::Tensor lse_like(const at::Tensor& q) {
  return at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
}

// Everything both directions read: q, k, v, the geometry against their sizes, the optional tensors against the
// geometry. Returns the geometry.
Geometry check_call(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    at::IntArrayRef geometry, double scale, const std::optional<at::Tensor>& allow,
                    const std::optional<at::Tensor>& tile_mask, const std::optional<at::Tensor>& key_valid,
                    const std::optional<at::Tensor>& groups, const std::optional<at::Tensor>& order,
                    const std::optional<at::Tensor>& key_table, const std::optional<at::Tensor>& value_table,
                    const std::optional<at::Tensor>& delta, const std::optional<at::Tensor>& positions,
                    const std::optional<at::Tensor>& bias) {
  const checks::QKV s = checks::qkv(op, q, k, v);
  checks::finite(op, scale, "scale");
  const Geometry g = Geometry::from(op, geometry, s.Nq, s.N);
  check_tensors(op, s, g, allow, tile_mask, key_valid, groups, order, key_table, value_table, delta, positions, bias,
                q.scalar_type());
  return g;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_band_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef geometry, double scale,
    const std::optional<at::Tensor>& allow, const std::optional<at::Tensor>& tile_mask,
    const std::optional<at::Tensor>& key_valid, const std::optional<at::Tensor>& groups,
    const std::optional<at::Tensor>& order, const std::optional<at::Tensor>& key_table, const std::optional<at::Tensor>& value_table,
    const std::optional<at::Tensor>& delta, const std::optional<at::Tensor>& positions,
    const std::optional<at::Tensor>& bias) {
  const Geometry g = check_call("band_forward", q, k, v, geometry, scale, allow, tile_mask, key_valid, groups, order,
                                key_table, value_table, delta, positions, bias);
  const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2), D = q.size(3);
  auto out = at::empty({B, H, Nq, D}, q.options());
  auto lse = lse_like(q);
  auto alone = g.exclude_self ? at::zeros({B, H, Nq}, q.options().dtype(at::kBool))
                              : at::empty({0}, q.options().dtype(at::kBool));
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "routeformer_band_forward", [&] {
    using T = scalar_t;
    const Call<T> c =
        make_call<T>(q, k, g, allow, tile_mask, key_valid, groups, delta, positions, bias, order);
    const auto rel = Rel<T>::of(key_table, value_table, g.max_distance);
    const int64_t* ord = order.has_value() ? order->data_ptr<int64_t>() : nullptr;
    const int64_t nbk = n_blocks(Nq, g.rows_per_block);
    T* out_p = out.data_ptr<T>();
    T* lse_p = lse.data_ptr<T>();
    bool* alone_p = g.exclude_self ? alone.data_ptr<bool>() : nullptr;
    at::parallel_for(0, B * H * nbk, 1, [&](int64_t x0, int64_t x1) {
      Work<T> w;
      std::vector<int64_t> seq, qrow, a, e;
      Buffer<T> ob, lb;
      Buffer<uint8_t> ab;
      Rows rows;
      for (int64_t x = x0; x < x1; x++) {
        const int64_t bh = x / nbk;
        const int64_t n = block_rows(c, bh, x % nbk, ord, seq, qrow, a, e, rows);
        const Head<T> hd = head_of<T>(q, k, v, bh, H, ord, static_cast<T>(scale));
        BlockOut<T> bo{ob.get(n * D), lb.get(n), alone_p == nullptr ? nullptr : ab.get(n)};
        forward_block(hd, rel, BandRules<T>(c, bh, rows.qseq), rows, w, bo);
        for (int64_t r = 0; r < n; r++) {
          const int64_t at_row = bh * Nq + qrow[r];
          std::memcpy(out_p + at_row * D, bo.o + r * D, D * sizeof(T));
          lse_p[at_row] = bo.lse[r];
          if (alone_p != nullptr) alone_p[at_row] = bo.alone[r];
        }
      }
    });
  });
  return {out, lse, alone};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_band_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& alone,
    at::IntArrayRef geometry, double scale, const std::optional<at::Tensor>& allow,
    const std::optional<at::Tensor>& tile_mask, const std::optional<at::Tensor>& key_valid,
    const std::optional<at::Tensor>& groups, const std::optional<at::Tensor>& order,
    const std::optional<at::Tensor>& key_table,
    const std::optional<at::Tensor>& value_table, const std::optional<at::Tensor>& delta,
    const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& bias,
    std::array<bool, 3> output_mask) {
  const char* op = "band_backward";
  const Needs need = Needs::of(output_mask);
  const Geometry g = check_call(op, q, k, v, geometry, scale, allow, tile_mask, key_valid, groups, order, key_table,
                                value_table, delta, positions, bias);
  const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2), Nk = k.size(2), D = q.size(3);
  checks::grads(op, grad_out, grad_lse, out, lse, {B, H, Nq, Nk, D}, q.scalar_type());
  checks::dtype(op, alone, "alone", at::kBool);
  if (g.exclude_self) checks::flat(op, alone, "alone", at::kBool, "(B, H, Nq)", {B, H, Nq});
  auto go = grad_out.contiguous();
  auto o = out.contiguous();
  auto dq = at::empty(need.q ? at::IntArrayRef{B, H, Nq, D} : at::IntArrayRef{0}, q.options());
  auto dk = at::zeros(need.k ? at::IntArrayRef{B, H, Nk, D} : at::IntArrayRef{0}, q.options());
  auto dv = at::zeros(need.v ? at::IntArrayRef{B, H, Nk, D} : at::IntArrayRef{0}, q.options());
  const bool has_rel = key_table.has_value();
  const int64_t L = has_rel ? key_table->size(0) : 0;
  auto dtab = at::zeros({2, B * H, std::max<int64_t>(L, 1), D}, q.options());  // per head, summed in head order
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "routeformer_band_backward", [&] {
    using T = scalar_t;
    const Call<T> c =
        make_call<T>(q, k, g, allow, tile_mask, key_valid, groups, delta, positions, bias, order);
    const auto rel = Rel<T>::of(key_table, value_table, g.max_distance);
    const int64_t* ord = order.has_value() ? order->data_ptr<int64_t>() : nullptr;
    const int64_t nbk = n_blocks(Nq, g.rows_per_block);
    const T* go_p = go.data_ptr<T>();
    const T* o_p = o.data_ptr<T>();
    const T* lse_p = lse.data_ptr<T>();
    const T* glse_p = grad_lse.has_value() ? grad_lse->data_ptr<T>() : nullptr;
    const bool* alone_p = g.exclude_self ? alone.data_ptr<bool>() : nullptr;
    T* dq_p = need.q ? dq.data_ptr<T>() : nullptr;
    at::parallel_for(0, B * H, 1, [&](int64_t h0, int64_t h1) {
      Work<T> w;
      std::vector<int64_t> seq, qrow, a, e;
      Buffer<T> lb, db;
      Buffer<uint8_t> ab;
      Rows rows;
      for (int64_t bh = h0; bh < h1; bh++) {
        const Head<T> hd = head_of<T>(q, k, v, bh, H, ord, static_cast<T>(scale));
        Grads<T> gr{need.k ? dk.data_ptr<T>() + bh * Nk * D : nullptr,
                    need.v ? dv.data_ptr<T>() + bh * Nk * D : nullptr,
                    has_rel && need.k ? dtab.data_ptr<T>() + bh * L * D : nullptr,
                    has_rel && need.v ? dtab.data_ptr<T>() + (B * H + bh) * L * D : nullptr, need.q};
        for (int64_t x = 0; x < nbk; x++) {
          const int64_t n = block_rows(c, bh, x, ord, seq, qrow, a, e, rows);
          T* lr = lb.get(n);
          T* dr = db.get(n);
          uint8_t* al = ab.get(n);
          for (int64_t r = 0; r < n; r++) {
            const int64_t at_row = bh * Nq + qrow[r];
            lr[r] = lse_p[at_row];
            dr[r] = dot(go_p + at_row * D, o_p + at_row * D, D) - (glse_p == nullptr ? T(0) : glse_p[at_row]);
            al[r] = alone_p == nullptr ? 0 : alone_p[at_row];
          }
          backward_block(hd, rel, BandRules<T>(c, bh, rows.qseq), rows, go_p + bh * Nq * D, D, lr, dr, al, w, gr);
          if (need.q)
            for (int64_t r = 0; r < n; r++)
              std::memcpy(dq_p + (bh * Nq + qrow[r]) * D, w.dq.ptr + r * D, D * sizeof(T));
        }
      }
    });
  });
  auto [dkey, dvalue] = table_grads(dtab, has_rel);
  return {dq, dk, dv, dkey, dvalue};
}

}  // namespace routeformer
