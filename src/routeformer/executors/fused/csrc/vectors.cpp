// The router's routing vectors (attention/routing/router.py): each position's vector x made a unit vector and turned
// by its head's fixed orthonormal W_R, r = x / max(||x||, eps) · W_R, and the backward of that map.
//
// The PyTorch form is F.normalize then an einsum: a norm pass, a division pass and a batched product forward, and
// five or six passes over (B, H, N, D) backward (the division's and the norm's gradients, the product's). At 16k
// positions, 8 heads, D = 64 they took ~20 ms forward and ~60 ms backward of a training step whose attention kernels
// take ~130 ms. Here a task takes a run of a head's rows: their norms and unit vectors into scratch, one product with
// W_R into r; backward one product with W_Rᵀ and one pass per row. Each row's sums are the same for every thread
// count (a task's rows are fixed by the shape alone, and each product is on the calling thread).
//
// Backward, for g = ∂L/∂r: u = g · W_Rᵀ (the gradient at the unit vector n = x / s, s = ||x||), then
//   s >= eps: ∂L/∂x = (u - n (n · u)) / s   (the division by the norm, and the norm's own gradient)
//   s <  eps: ∂L/∂x = u / eps               (the clamped denominator is a constant: x = 0 included)
// as autograd gives it for x / clamp_min(||x||, eps) (clamp_min passes the gradient where ||x|| >= eps).
#include "checks.h"
#include "common.h"
#include "ops.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cmath>

namespace routeformer {
namespace {

constexpr int64_t kRowsPerTask = 128;  // a task's rows: 128 · D values of scratch (32 KiB at D = 64, float32)

struct Shape {
  int64_t B, H, N, D;
};

Shape check(const char* op, const at::Tensor& x, const at::Tensor& projection, double eps) {
  checks::floating(op, x, "x");
  checks::rows(op, x, "x", x.scalar_type());
  const Shape s{x.size(0), x.size(1), x.size(2), x.size(3)};
  checks::flat(op, projection, "projection", x.scalar_type(), "(H, D, D)", {s.H, s.D, s.D});
  RF_CHECK(std::isfinite(eps) && eps > 0, op, "eps must be positive and finite, got ", eps);
  return s;
}

// The tasks of a shape: every (b, h) in runs of kRowsPerTask rows, f(b, h, first, last, scratch) with (last - first,
// D) values of scratch, one buffer per thread's share of the tasks.
template <typename T, typename F>
void for_each_run(const Shape& s, F&& f) {
  const int64_t runs = ceil_div(s.N, kRowsPerTask);
  at::parallel_for(0, s.B * s.H * runs, 1, [&](int64_t t0, int64_t t1) {
    Buffer<T> scratch;
    for (int64_t t = t0; t < t1; t++) {
      const int64_t bh = t / runs, first = (t % runs) * kRowsPerTask, last = std::min(s.N, first + kRowsPerTask);
      f(bh / s.H, bh % s.H, first, last, scratch.get((last - first) * s.D));
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> fused_route_vectors(const at::Tensor& x, const at::Tensor& projection,
                                                       double eps) {
  const Shape s = check("route_vectors", x, projection, eps);
  auto r = at::empty({s.B, s.H, s.N, s.D}, x.options());
  auto norm = at::empty({s.B, s.H, s.N}, x.options());
  if (r.numel() == 0) return {r, norm.zero_()};  // D = 0: every norm is 0
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "routeformer_route_vectors", [&] {
    using T = scalar_t;
    const T floor = static_cast<T>(eps);
    const T* xp = x.data_ptr<T>();
    const T* wp = projection.data_ptr<T>();
    T* rp = r.data_ptr<T>();
    T* np = norm.data_ptr<T>();
    const int64_t D = s.D;
    for_each_run<T>(s, [&](int64_t b, int64_t h, int64_t first, int64_t last, T* unit) {  // unit: (rows, D)
      const int64_t bh = b * s.H + h;
      for (int64_t i = first; i < last; i++) {
        const T* row = xp + b * x.stride(0) + h * x.stride(1) + i * x.stride(2);
        const T norm_i = std::sqrt(dot(row, row, D));
        np[bh * s.N + i] = norm_i;
        const T d = std::max(norm_i, floor);
        T* u = unit + (i - first) * D;
        for (int64_t e = 0; e < D; e++) u[e] = row[e] / d;
      }
      gemm<T>(false, false, last - first, D, D, T(1), unit, D, wp + h * D * D, D, T(0), rp + (bh * s.N + first) * D,
              D);
    });
  });
  return {r, norm};
}

at::Tensor fused_route_vectors_backward(const at::Tensor& grad_r, const at::Tensor& x, const at::Tensor& norm,
                                        const at::Tensor& projection, double eps) {
  const char* op = "route_vectors_backward";
  const Shape s = check(op, x, projection, eps);
  checks::flat(op, grad_r, "grad_r", x.scalar_type(), "(B, H, N, D)", {s.B, s.H, s.N, s.D});
  checks::flat(op, norm, "norm", x.scalar_type(), "(B, H, N)", {s.B, s.H, s.N});
  auto grad_x = at::empty({s.B, s.H, s.N, s.D}, x.options());
  if (grad_x.numel() == 0) return grad_x;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "routeformer_route_vectors_backward", [&] {
    using T = scalar_t;
    const T floor = static_cast<T>(eps);
    const T* xp = x.data_ptr<T>();
    const T* wp = projection.data_ptr<T>();
    const T* gp = grad_r.data_ptr<T>();
    const T* np = norm.data_ptr<T>();
    T* out = grad_x.data_ptr<T>();
    const int64_t D = s.D;
    for_each_run<T>(s, [&](int64_t b, int64_t h, int64_t first, int64_t last, T* unit_grad) {  // u = g · W_Rᵀ
      const int64_t bh = b * s.H + h;
      gemm<T>(false, true, last - first, D, D, T(1), gp + (bh * s.N + first) * D, D, wp + h * D * D, D, T(0),
              unit_grad, D);
      for (int64_t i = first; i < last; i++) {
        const T* row = xp + b * x.stride(0) + h * x.stride(1) + i * x.stride(2);
        const T* u = unit_grad + (i - first) * D;
        T* g = out + (bh * s.N + i) * D;
        const T norm_i = np[bh * s.N + i];
        if (norm_i >= floor) {  // (u - n (n · u)) / s with n = x / s: (u - x (x · u) / s²) / s
          const T along = dot(row, u, D) / (norm_i * norm_i);
          for (int64_t e = 0; e < D; e++) g[e] = (u[e] - row[e] * along) / norm_i;
        } else {
          for (int64_t e = 0; e < D; e++) g[e] = u[e] / floor;
        }
      }
    });
  });
  return grad_x;
}

}  // namespace routeformer
