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
// The drivers (forward over the blocks of all heads, backward over heads) are common.h's; this file says what a
// tiling's blocks, rules and checks are.
#include "checks.h"
#include "common.h"
#include "geometry.h"
#include "ops.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

namespace routeformer {
namespace {

// The geometry (``BandGeometry``) checked against q's Nq and k's Nk, with the tiles it makes: values in range, the
// tiles' geometry within int64 (the kernel computes key indices (t ± reach) · block), and what the kernel assumes of
// a tiling (``Tiling.check``).
struct Band {
  BandGeometry g;
  int64_t n_tiles, T, S;  // the tiles: (n_tiles, T, S) as ``Tiling.shape`` gives them

  static Band of(const char* op, BandGeometry g, int64_t Nq, int64_t Nk) {
    RF_CHECK(!g.has_offsets || g.off_lo <= g.off_hi, op, "geometry's offsets must have off_lo <= off_hi, got (",
             g.off_lo, ", ", g.off_hi, ")");
    RF_CHECK(g.window > 0 || !g.causal, op, "geometry's causal flag names a window's side: causal without a window");
    // A sliding window comes as itself, and its offsets are derived here: offsets beside it would be a second
    // statement of the same thing that could disagree.
    RF_CHECK(g.window == 0 || !g.has_offsets, op, "geometry gives a window (", g.window, ") and offsets (", g.off_lo,
             ", ", g.off_hi, "): a window's offsets are its own");
    if (g.window > 0) {
      g.has_offsets = true;
      g.off_lo = 1 - g.window;
      g.off_hi = g.causal ? 0 : g.window - 1;
    }
    Band t{g, 0, 0, 0};
    const bool single = g.back == 0 && g.ahead == 0 && g.block >= Nq && g.rows == 0;
    RF_CHECK(g.single == single, op, "geometry[4] (single) must be ", int(single), " for block ", g.block, ", back ",
             g.back, ", ahead ", g.ahead, ", rows ", g.rows, " and ", Nq, " queries, got ", int(g.single));
    if (g.single) {
      t.n_tiles = 1;
      t.T = Nq;
      t.S = Nk;
    } else {
      t.n_tiles = ceil_div(g.rows > 0 ? Nk : Nq, g.block);
      t.T = g.rows > 0 ? g.rows : g.block;
      const int64_t reach = checks::sum(op, checks::sum(op, t.n_tiles + 1, g.back, "the tiles' reach"), g.ahead,
                                        "the tiles' reach");
      checks::product(op, reach, g.block, "the tiles' key indices");
      t.S = (g.back + 1 + g.ahead) * g.block;
      if (g.rows > 0) {
        RF_CHECK(Nq == checks::product(op, t.n_tiles, g.rows, "n_tiles * rows"), op, "with rows = ", g.rows,
                 ", q must hold ceil(Nk / block) * rows = ", t.n_tiles * g.rows, " queries, got ", Nq);
      } else {
        RF_CHECK(Nq == Nk, op, "banded tiles need as many keys as queries, got ", Nq, " queries and ", Nk, " keys");
      }
    }
    RF_CHECK(!g.exclude_self || Nq == Nk, op, "exclude_self needs as many keys as queries, got ", Nq, " and ", Nk);
    // Values past the sequence mean the same as the sequence's ends; clipped there, row ± offset and the distances
    // (key - query) · unit stay far inside int64.
    const int64_t far = Nq + Nk + 1;
    t.g.off_lo = std::clamp(g.off_lo, -far, far);
    t.g.off_hi = std::clamp(g.off_hi, -far, far);
    if (g.unit > 1) t.g.unit = std::min(g.unit, std::max<int64_t>(2, g.max_distance + 1));  // |d| >= 1: clipped
    return t;
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
  Band band;
  int64_t B, H, Nq, Nk;
  const bool* allow = nullptr;        // (T, S)
  Strided5<bool> tile_mask;
  KeyValid key_valid;
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
  const BandGeometry& g;
  int64_t b, h;
  const int64_t* qseq;  // the block's rows
  bool per_pair;        // some per-pair mask applies
  bool has_bias;
  const int64_t* groups;
  const int64_t* positions;
  const bool* valid;

  BandRules(const Call<T>& call, int64_t bh, const int64_t* rows_seq)
      : c(call), g(call.band.g), b(bh / call.H), h(bh % call.H), qseq(rows_seq) {
    groups = c.groups == nullptr ? nullptr : c.groups + bh * c.Nk;
    const bool grouped = groups != nullptr && !c.groups_sorted[bh];
    positions = c.positions == nullptr ? nullptr : c.positions + bh * c.Nk;
    valid = c.key_valid.of_head(bh);
    per_pair = c.allow != nullptr || c.tile_mask.p != nullptr || valid != nullptr || grouped;
    if (!grouped) groups = nullptr;
    has_bias = c.bias.p != nullptr;
  }
  int64_t tile(int64_t i) const { return g.single ? 0 : i / c.band.T; }
  int64_t col(int64_t i, int64_t j) const {  // span column of key j in row i's tile
    return g.single ? j : j - (tile(i) - g.back) * g.block;
  }
  bool elementwise(int64_t) const { return per_pair; }
  bool allowed(int64_t r, int64_t j) const {
    const int64_t i = qseq[r];
    if (valid != nullptr && !valid[j]) return false;
    if (groups != nullptr && groups[i] != groups[j]) return false;
    if (c.allow != nullptr && !c.allow[(i - tile(i) * c.band.T) * c.band.S + col(i, j)]) return false;
    if (c.tile_mask.p != nullptr && !c.tile_mask.at(b, h, tile(i), i - tile(i) * c.band.T, col(i, j))) return false;
    return true;
  }
  int64_t distance(int64_t r, int64_t j) const {
    const int64_t i = qseq[r];
    if (g.unit > 0) return (j - i) * g.unit;
    if (positions != nullptr) return positions[j] - positions[i];
    return c.delta.at(b, h, tile(i), i - tile(i) * c.band.T, col(i, j));
  }
  T bias(int64_t r, int64_t j) const {
    const int64_t i = qseq[r];
    return c.bias.at(b, h, tile(i), i - tile(i) * c.band.T, col(i, j));
  }
  int64_t self(int64_t r) const { return g.exclude_self ? qseq[r] : -1; }
  int64_t unit() const { return g.unit; }
};

// The interval of key indices row i may see (a >= e: none).
template <typename T>
inline std::pair<int64_t, int64_t> interval(const Call<T>& c, int64_t bh, int64_t i) {
  const BandGeometry& g = c.band.g;
  int64_t a = 0, e = c.Nk;
  if (!g.single) {
    const int64_t t = i / c.band.T;
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

// Every optional tensor against the checked geometry (see ``Call`` for how each is read); the relative tables'
// source of distances: exactly one of unit, delta, positions and the order's positions with the tables (the rules
// read the first of them, and delta unchecked when none), none without.
void check_tensors(const char* op, const checks::QKV& s, const Band& t, const std::optional<at::Tensor>& allow,
                   const std::optional<at::Tensor>& tile_mask, const std::optional<at::Tensor>& groups,
                   const std::optional<at::Tensor>& order, const std::optional<at::Tensor>& key_table,
                   const std::optional<at::Tensor>& value_table, const std::optional<at::Tensor>& delta,
                   const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& bias,
                   at::ScalarType dtype) {
  const BandGeometry& g = t.g;
  const std::vector<int64_t> shape5 = {s.B, s.H, t.n_tiles, t.T, t.S}, per_key = {s.B, s.H, s.N};
  const char* tiles = "(B, H, n_tiles, T, S)";
  if (allow.has_value()) checks::flat(op, *allow, "allow", at::kBool, "(T, S)", {t.T, t.S});
  if (tile_mask.has_value()) checks::broadcastable(op, *tile_mask, "tile_mask", at::kBool, tiles, shape5);
  // groups, the order and positions are read at query and key indices alike: self-attention only
  for (const auto& [x, name] : {std::pair{&groups, "groups"}, {&order, "order"}, {&positions, "positions"}}) {
    if (!x->has_value()) continue;
    RF_CHECK(s.Nq == s.N, op, name, " needs as many keys as queries, got ", s.Nq, " queries and ", s.N, " keys");
    checks::flat(op, **x, name, at::kLong, "(B, H, N)", per_key);
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
Call<T> make_call(const at::Tensor& q, const at::Tensor& k, const Band& t, const std::optional<at::Tensor>& allow,
                  const std::optional<at::Tensor>& tile_mask, const std::optional<at::Tensor>& key_valid,
                  const std::optional<at::Tensor>& groups, const std::optional<at::Tensor>& delta,
                  const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& order) {
  Call<T> c;
  c.band = t;
  c.B = q.size(0);
  c.H = q.size(1);
  c.Nq = q.size(2);
  c.Nk = k.size(2);
  std::vector<int64_t> shape5 = {c.B, c.H, t.n_tiles, t.T, t.S};
  if (allow.has_value()) c.allow = allow->data_ptr<bool>();
  c.tile_mask = Strided5<bool>::of(tile_mask, shape5);
  c.key_valid = KeyValid::of(key_valid, c.H);
  if (groups.has_value()) c.groups = groups->data_ptr<int64_t>();
  c.delta = Strided5<int64_t>::of(delta, shape5);
  if (positions.has_value()) c.positions = positions->data_ptr<int64_t>();
  if (t.g.positions_from_order) c.positions = order->data_ptr<int64_t>();
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

// A head's blocks: consecutive rows [x · rows_per_block, (x + 1) · rows_per_block) of the sequence, read through the
// order (null: the identity); a row's forward slot is its query row. Where the groups are sorted (a sequence sorted
// by cluster, or by document), a block also ends where a group's run does: a block's key span is then its own
// group's, whatever the other groups hold, so a group's results (a packed document's) are the same bits however
// the others change.
template <typename T>
struct BandLayout {
  const Call<T>& c;
  Heads<T> heads;
  Rel<T> rel;
  int64_t D;
  const int64_t* order;
  T scale;
  struct Plan {
    int64_t n = 0;
    std::vector<int64_t> starts;  // sorted groups: every block's first row, then Nq; else empty (arithmetic)
    int64_t blocks() const { return n; }
  };

  Plan plan(int64_t bh) const {
    const int64_t per_block = c.band.g.rows_per_block;
    if (c.groups == nullptr || !c.groups_sorted[bh]) return {ceil_div(c.Nq, per_block), {}};
    Plan p;
    const int64_t* run_end = c.run_hi.data() + bh * c.Nk;
    // r + min(per_block, Nq - r): a rows_per_block near INT64_MAX must not wrap
    for (int64_t r = 0; r < c.Nq; r = std::min(r + std::min(per_block, c.Nq - r), run_end[r])) p.starts.push_back(r);
    p.n = static_cast<int64_t>(p.starts.size());
    p.starts.push_back(c.Nq);
    return p;
  }
  template <typename F>
  void block(int64_t bh, const Plan& p, int64_t x, BlockRows& s, F&& f) const {
    const int64_t per_block = c.band.g.rows_per_block;
    const int64_t r0 = p.starts.empty() ? x * per_block : p.starts[x];
    const int64_t n = p.starts.empty() ? std::min(per_block, c.Nq - r0) : p.starts[x + 1] - r0;
    s.resize(n);
    const int64_t* ord = order == nullptr ? nullptr : order + bh * c.Nq;
    for (int64_t r = 0; r < n; r++) {
      s.seq[r] = r0 + r;
      s.qrow[r] = ord == nullptr ? r0 + r : ord[r0 + r];
      std::tie(s.a[r], s.e[r]) = interval(c, bh, r0 + r);
      s.slot[r] = bh * c.Nq + s.qrow[r];
    }
    s.bind(n, false, ord == nullptr);
    f(heads.head(bh, order == nullptr ? nullptr : order + bh * c.Nk, scale), BandRules<T>(c, bh, s.rows.qseq));
  }
};

// Everything both directions read: q, k, v, the geometry against their sizes, the optional tensors against the
// geometry.
std::pair<checks::QKV, Band> check_call(
    const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef geometry,
    double scale, const std::optional<at::Tensor>& allow, const std::optional<at::Tensor>& tile_mask,
    const std::optional<at::Tensor>& key_valid, const std::optional<at::Tensor>& groups,
    const std::optional<at::Tensor>& order, const std::optional<at::Tensor>& key_table,
    const std::optional<at::Tensor>& value_table, const std::optional<at::Tensor>& delta,
    const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& bias) {
  const auto call = checks::attention<BandGeometry>(op, q, &k, v, geometry, scale, key_valid);
  const Band t = Band::of(op, call.g, call.s.Nq, call.s.N);
  check_tensors(op, call.s, t, allow, tile_mask, groups, order, key_table, value_table, delta, positions, bias,
                q.scalar_type());
  return {call.s, t};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_band_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef geometry, double scale,
    const std::optional<at::Tensor>& allow, const std::optional<at::Tensor>& tile_mask,
    const std::optional<at::Tensor>& key_valid, const std::optional<at::Tensor>& groups,
    const std::optional<at::Tensor>& order, const std::optional<at::Tensor>& key_table,
    const std::optional<at::Tensor>& value_table, const std::optional<at::Tensor>& delta,
    const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& bias) {
  const auto checked = check_call("band_forward", q, k, v, geometry, scale, allow, tile_mask, key_valid, groups, order,
                                  key_table, value_table, delta, positions, bias);
  const checks::QKV& s = checked.first;
  const Band& t = checked.second;
  auto out = at::empty({s.B, s.H, s.Nq, s.D}, q.options());
  auto lse = at::empty({s.B, s.H, s.Nq}, q.options());
  auto alone = t.g.exclude_self ? at::zeros({s.B, s.H, s.Nq}, q.options().dtype(at::kBool))
                                : at::empty({0}, q.options().dtype(at::kBool));
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "routeformer_band_forward", [&] {
    using T = scalar_t;
    const Call<T> c = make_call<T>(q, k, t, allow, tile_mask, key_valid, groups, delta, positions, bias, order);
    const BandLayout<T> layout{c, Heads<T>(q, k, v), Rel<T>::of(key_table, value_table, t.g.max_distance), s.D,
                               order.has_value() ? order->data_ptr<int64_t>() : nullptr, static_cast<T>(scale)};
    forward_blocks(layout, s.B * s.H,
                   Slots<T>{out.data_ptr<T>(), lse.data_ptr<T>(),
                            t.g.exclude_self ? alone.data_ptr<bool>() : nullptr});
  });
  return {out, lse, alone};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_band_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& alone,
    at::IntArrayRef geometry, double scale, const std::optional<at::Tensor>& allow,
    const std::optional<at::Tensor>& tile_mask, const std::optional<at::Tensor>& key_valid,
    const std::optional<at::Tensor>& groups, const std::optional<at::Tensor>& order,
    const std::optional<at::Tensor>& key_table, const std::optional<at::Tensor>& value_table,
    const std::optional<at::Tensor>& delta, const std::optional<at::Tensor>& positions,
    const std::optional<at::Tensor>& bias, std::array<bool, 3> output_mask) {
  const char* op = "band_backward";
  const auto checked = check_call(op, q, k, v, geometry, scale, allow, tile_mask, key_valid, groups, order,
                                  key_table, value_table, delta, positions, bias);
  const checks::QKV& s = checked.first;
  const Band& t = checked.second;
  checks::backward(op, grad_out, grad_lse, out, lse, &alone, t.g.exclude_self, s, q.scalar_type());
  auto go = grad_out.contiguous();
  auto o = out.contiguous();
  // each query row is in one block: its dq rows are stored, not added
  GradTensors grads(q, s.N, Needs::of(output_mask), key_table, /*dq_once=*/true);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "routeformer_band_backward", [&] {
    using T = scalar_t;
    const Call<T> c = make_call<T>(q, k, t, allow, tile_mask, key_valid, groups, delta, positions, bias, order);
    const BandLayout<T> layout{c, Heads<T>(q, k, v), Rel<T>::of(key_table, value_table, t.g.max_distance), s.D,
                               order.has_value() ? order->data_ptr<int64_t>() : nullptr, static_cast<T>(scale)};
    backward_blocks(layout, s.B * s.H,
                    grads.io<T>(go, o, lse, grad_lse, t.g.exclude_self ? alone.data_ptr<bool>() : nullptr),
                    [](int64_t, const Grads<T>&) {});
  });
  return grads.result();
}

}  // namespace routeformer
