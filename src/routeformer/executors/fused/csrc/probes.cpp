// The key ranges of multi-probe routing (attention/routing/probes.py's ``probe_ranges``) in one pass per head: in the
// keys sorted by (cluster, position), entry i·p + t of query i and its probe c = P_t(i) sees the sorted keys
// [lo, hi) with hi = first[c] + (the keys of cluster c at positions <= i) and lo = max(first[c], hi - window),
// first[c] the cluster's first sorted index. Walking the positions in order and counting each key's cluster as it
// comes gives every hi without a search: PyTorch's form is a binary search of all N·p entries in the sorted keys and
// ten elementwise passes over them (19 ms of a two-probe forward at N = 16384, H = 8; docs/benchmarks.md).
//
// ``exclude_self`` stops the entries of a query's own cluster before its own key (the window still counts it);
// ``own_when_alone`` then gives a query whose entries hold no key its own key back (hi + 1 on its own cluster's
// entry), as ``_own_key_when_alone`` does for shared QK without padding.
#include "checks.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <vector>

namespace routeformer {

std::tuple<at::Tensor, at::Tensor> fused_probe_ranges(const at::Tensor& key_clusters, const at::Tensor& probes,
                                                      int64_t window, bool exclude_self, bool own_when_alone) {
  const char* op = "probe_ranges";
  checks::cpu(op, key_clusters, "key_clusters");
  checks::cpu(op, probes, "probes");
  RF_CHECK(key_clusters.dim() == 3, op, "key_clusters must be (B, H, N), got ", checks::dims(key_clusters.sizes()));
  const int64_t B = key_clusters.size(0), H = key_clusters.size(1), N = key_clusters.size(2);
  RF_CHECK(probes.dim() == 4 && probes.size(3) >= 1, op, "probes must be (B, H, N, p >= 1), got ",
           checks::dims(probes.sizes()));
  const int64_t p = probes.size(3);
  checks::flat(op, key_clusters, "key_clusters", at::kLong, "(B, H, N)", {B, H, N});
  checks::flat(op, probes, "probes", at::kLong, "(B, H, N, p)", {B, H, N, p});
  checks::at_least(op, window, 1, "window");
  RF_CHECK(own_when_alone ? exclude_self : true, op, "own_when_alone gives back the key exclude_self left out: it needs "
           "exclude_self");
  const int64_t* kc = key_clusters.data_ptr<int64_t>();
  const int64_t* pr = probes.data_ptr<int64_t>();
  // the tables' size: one past the greatest key cluster (a probed cluster past it holds no key: lo = hi = N); ids
  // index per-thread tables, so they are bounded (k-means ids are below the number of clusters)
  constexpr int64_t kLimit = int64_t(1) << 24;
  int64_t k = 1;
  for (int64_t x = 0, n = key_clusters.numel(); x < n; x++) {
    RF_CHECK(kc[x] >= 0 && kc[x] < kLimit, op, "key_clusters must be in [0, 2^24), got ", kc[x], " at flat index ",
             x);
    k = std::max(k, kc[x] + 1);
  }
  for (int64_t x = 0, n = probes.numel(); x < n; x++)
    RF_CHECK(pr[x] >= 0, op, "probes must be >= 0, got ", pr[x], " at flat index ", x);
  auto lo = at::empty({B, H, N * p}, key_clusters.options());
  auto hi = at::empty({B, H, N * p}, key_clusters.options());
  int64_t* lp = lo.data_ptr<int64_t>();
  int64_t* hp = hi.data_ptr<int64_t>();
  at::parallel_for(0, B * H, 1, [&](int64_t x0, int64_t x1) {
    std::vector<int64_t> first(k + 1), seen(k);
    for (int64_t x = x0; x < x1; x++) {
      const int64_t* own = kc + x * N;
      const int64_t* wanted = pr + x * N * p;
      int64_t* a = lp + x * N * p;
      int64_t* e = hp + x * N * p;
      std::fill(first.begin(), first.end(), 0);
      std::fill(seen.begin(), seen.end(), 0);
      for (int64_t i = 0; i < N; i++) first[own[i] + 1]++;
      for (int64_t c = 0; c < k; c++) first[c + 1] += first[c];
      for (int64_t i = 0; i < N; i++) {
        seen[own[i]]++;
        int64_t keys = 0;
        for (int64_t t = 0; t < p; t++) {
          const int64_t c = wanted[i * p + t], m = i * p + t;
          if (c >= k) {  // no key in that cluster
            a[m] = e[m] = N;
            continue;
          }
          const int64_t end = first[c] + seen[c];
          a[m] = std::max(first[c], end - window);
          e[m] = end - (exclude_self && c == own[i] ? 1 : 0);
          keys += e[m] - a[m];
        }
        if (!own_when_alone || keys != 0) continue;
        for (int64_t t = 0; t < p; t++) e[i * p + t] += wanted[i * p + t] == own[i] ? 1 : 0;
      }
    }
  });
  return {lo, hi};
}

}  // namespace routeformer
