// The causal router's discrete part in one pass (attention/routing/router.py): from the unit routing vectors r and
// the centroids, each position's ``p`` best clusters by cosine plus the balancing bias (best first; the first is the
// key's cluster), the sequence sorted by (cluster, position) by a counting sort (order, inverse, the sorted entries'
// clusters, the cluster sizes), and, for a training forward, the k-means statistics of the real positions (per head
// and cluster: the sum of their vectors and their number, which is also the cluster's load for the bias).
//
// The PyTorch form builds the (B, H, N, k) score tensor, takes p passes of argmax over it, sorts with argsort and
// adds the statistics with index_add: at N = 16384, k = 128 four temporaries of N · k per head and an N log N sort.
// Here a position's scores live on the stack (clusters in the vector lanes, four positions per pass, as the block
// selection of select.cpp), the sort is two passes over N, and the statistics are reduced per head in the order
// (b, n), so the result is the same for every thread count. Forward only: the choice is discrete. The commitment
// loss, which has a gradient, is PyTorch's from each position's cosine to its own centroid, which this pass returns
// (the best score less the bias: kmeans.py's SphericalKMeans.commitment).
#include "checks.h"
#include "common.h"
#include "ops.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <limits>
#include <vector>

namespace routeformer {
namespace {

// The scores of ``R`` consecutive positions to the ``k`` centroids (stored channel-major: mu[d * stride + c], rows
// padded to whole vectors), plus the bias (``bias``: stride values, zero past k, or null), into s (R rows of stride).
template <typename T, int R>
void cluster_scores(const T* r, int64_t r_stride, const T* mu, const T* bias, int64_t stride, int64_t D, T* s) {
  using Vec = at::vec::Vectorized<T>;
  for (int64_t c = 0; c < stride; c += Vec::size()) {
    Vec acc[R];
    for (int i = 0; i < R; i++) acc[i] = bias ? Vec::loadu(bias + c) : Vec(T(0));
    for (int64_t d = 0; d < D; d++) {
      const Vec m = Vec::loadu(mu + d * stride + c);
      for (int i = 0; i < R; i++) acc[i] = at::vec::fmadd(Vec(r[i * r_stride + d]), m, acc[i]);
    }
    for (int i = 0; i < R; i++) acc[i].store(s + i * stride + c);
  }
}

// The ``p`` best of s[0, k), best first, into ``o``: p passes of argmax (``first_max``: vector passes), each winner
// masked to -inf and put back after (``saved``: p values), so ties keep the lower cluster first. A pass that finds no
// score above -inf (NaN or -inf scores only) takes the lowest cluster not chosen yet, as keeping the p best in one
// pass of insertions would (and cluster 0 for one probe). Keeping the p best by insertion in one pass mispredicts
// its compares: with two probes it took 35.6 ms of a 16k training step against 21.0 for one (docs/benchmarks.md).
template <typename T>
void best_clusters(T* s, int64_t k, int64_t p, T* saved, int64_t* o) {
  const T floor = -std::numeric_limits<T>::infinity();
  for (int64_t t = 0; t < p; t++) {
    int64_t at = first_max(s, k, floor, int64_t(-1));
    if (at < 0) {  // the lowest cluster not chosen yet
      at = 0;
      for (bool taken = true; taken; at += taken ? 1 : 0) {
        taken = false;
        for (int64_t u = 0; u < t; u++) taken = taken || o[u] == at;
      }
    }
    o[t] = at;
    saved[t] = s[at];
    s[at] = floor;
  }
  for (int64_t t = p - 1; t >= 0; t--) s[o[t]] = saved[t];
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_route(
    const at::Tensor& r, const at::Tensor& centroids, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& key_valid, int64_t probes, bool observe) {
  const char* op = "route";
  checks::floating(op, r, "r");
  checks::rows(op, r, "r", r.scalar_type());
  const int64_t B = r.size(0), H = r.size(1), N = r.size(2), D = r.size(3);
  checks::dtype(op, centroids, "centroids", r.scalar_type());
  RF_CHECK(centroids.dim() == 3 && centroids.size(0) == H && centroids.size(2) == D && centroids.size(1) >= 1, op,
           "centroids must be (H, k, D) = (", H, ", k >= 1, ", D, "), got ", checks::dims(centroids.sizes()));
  const int64_t k = centroids.size(1);
  checks::contiguous(op, centroids, "centroids");
  if (bias.has_value()) checks::flat(op, *bias, "bias", r.scalar_type(), "(H, k)", {H, k});
  checks::key_valid(op, key_valid, B, 1, N);
  checks::at_least(op, probes, 1, "probes");
  RF_CHECK(probes <= k, op, "probes (", probes, ") must be at most the number of clusters k (", k, ")");
  const auto longs = r.options().dtype(at::kLong);
  auto chosen = at::empty({B, H, N, probes}, longs);
  auto order = at::empty({B, H, N}, longs), inverse = at::empty({B, H, N}, longs);
  auto grouped = at::empty({B, H, N}, longs);
  auto counts = at::zeros({B, H, k}, longs);
  auto sums = at::zeros(observe ? at::IntArrayRef{H, k, D} : at::IntArrayRef{0}, r.options());
  auto weights = at::zeros(observe ? at::IntArrayRef{H, k} : at::IntArrayRef{0}, r.options());
  auto cosine = at::empty({B, H, N}, r.options());
  if (B * H * N == 0) return {chosen, order, inverse, grouped, counts, sums, weights, cosine};
  AT_DISPATCH_FLOATING_TYPES(r.scalar_type(), "routeformer_route", [&] {
    using T = scalar_t;
    using Vec = at::vec::Vectorized<T>;
    const int64_t stride = (k + Vec::size() - 1) / Vec::size() * Vec::size();
    // centroids channel-major per head (H, D, stride) and the bias padded (H, stride) with zeros: the padding lanes
    // score 0 and are never read (the picks look at [0, k) only)
    std::vector<T> mu(H * D * stride, T(0)), b(bias.has_value() ? H * stride : 0, T(0));
    const T* cp = centroids.data_ptr<T>();
    for (int64_t h = 0; h < H; h++) {
      for (int64_t c = 0; c < k; c++) {
        for (int64_t d = 0; d < D; d++) mu[(h * D + d) * stride + c] = cp[(h * k + c) * D + d];
        if (bias.has_value()) b[h * stride + c] = bias->data_ptr<T>()[h * k + c];
      }
    }
    const T* rp = r.data_ptr<T>();
    int64_t* out = chosen.data_ptr<int64_t>();
    T* cos = cosine.data_ptr<T>();
    const int64_t rows_per_task = 64;  // positions of one (b, h) a task scores
    const int64_t tasks_per_row = (N + rows_per_task - 1) / rows_per_task;
    at::parallel_for(0, B * H * tasks_per_row, 1, [&](int64_t t0, int64_t t1) {
      std::vector<T> s(4 * stride), saved(probes);
      for (int64_t t = t0; t < t1; t++) {
        const int64_t x = t / tasks_per_row, first = (t % tasks_per_row) * rows_per_task;
        const int64_t last = std::min(N, first + rows_per_task), h = x % H;
        const T* base = rp + (x / H) * r.stride(0) + h * r.stride(1);
        const T* m = mu.data() + h * D * stride;
        const T* bh = bias.has_value() ? b.data() + h * stride : nullptr;
        // the picks of position n from its scores sc, and its cosine to its own (first) cluster: the score less
        // the bias
        auto pick = [&](T* sc, int64_t n) {
          int64_t* o = out + (x * N + n) * probes;
          best_clusters(sc, k, probes, saved.data(), o);
          cos[x * N + n] = sc[o[0]] - (bh ? bh[o[0]] : T(0));
        };
        int64_t i = first;
        for (; i + 4 <= last; i += 4) {
          cluster_scores<T, 4>(base + i * r.stride(2), r.stride(2), m, bh, stride, D, s.data());
          for (int j = 0; j < 4; j++) pick(s.data() + j * stride, i + j);
        }
        for (; i < last; i++) {
          cluster_scores<T, 1>(base + i * r.stride(2), r.stride(2), m, bh, stride, D, s.data());
          pick(s.data(), i);
        }
      }
    });
    // the counting sort by (cluster, position) of every (b, h): sizes, first sorted index of each cluster, then
    // the positions in order (so each cluster's are ascending, as argsort of cluster · N + position gives)
    int64_t* ord = order.data_ptr<int64_t>();
    int64_t* inv = inverse.data_ptr<int64_t>();
    int64_t* grp = grouped.data_ptr<int64_t>();
    int64_t* cnt = counts.data_ptr<int64_t>();
    at::parallel_for(0, B * H, 1, [&](int64_t x0, int64_t x1) {
      std::vector<int64_t> next(k);
      for (int64_t x = x0; x < x1; x++) {
        int64_t* size = cnt + x * k;
        for (int64_t n = 0; n < N; n++) size[out[(x * N + n) * probes]]++;
        for (int64_t c = 0, start = 0; c < k; c++) {
          next[c] = start;
          start += size[c];
        }
        for (int64_t n = 0; n < N; n++) {
          const int64_t c = out[(x * N + n) * probes], at = next[c]++;
          ord[x * N + at] = n;
          inv[x * N + n] = at;
          grp[x * N + at] = c;
        }
      }
    });
    if (!observe) return;
    // the statistics of the real positions, one head per task, added in the order (b, n): the same sums for every
    // thread count
    const bool* valid = key_valid.has_value() ? key_valid->data_ptr<bool>() : nullptr;
    T* sp = sums.data_ptr<T>();
    T* wp = weights.data_ptr<T>();
    at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
      for (int64_t h = h0; h < h1; h++) {
        for (int64_t bb = 0; bb < B; bb++) {
          const T* base = rp + bb * r.stride(0) + h * r.stride(1);
          for (int64_t n = 0; n < N; n++) {
            if (valid && !valid[bb * N + n]) continue;
            const int64_t c = out[((bb * H + h) * N + n) * probes];
            T* acc = sp + (h * k + c) * D;
            const T* v = base + n * r.stride(2);
            int64_t d = 0;
            for (; d + Vec::size() <= D; d += Vec::size()) (Vec::loadu(acc + d) + Vec::loadu(v + d)).store(acc + d);
            for (; d < D; d++) acc[d] += v[d];
            wp[h * k + c] += T(1);
          }
        }
      }
    });
  });
  return {chosen, order, inverse, grouped, counts, sums, weights, cosine};
}

}  // namespace routeformer
