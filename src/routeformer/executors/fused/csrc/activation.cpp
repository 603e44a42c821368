// The Sparse Transformer's GELU, f(x) = x · sigmoid(1.702 x), forward and backward in one pass each (PyTorch's
// expression takes five elementwise passes and keeps two tensors). Not attention, but on the main job's step it is
// a tenth of the time once attention is fused, so it lives with the other CPU kernels.
#include "checks.h"
#include "common.h"
#include "ops.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty_like.h>

namespace routeformer {
namespace {

constexpr double kSharp = 1.702;

template <typename T>
void forward_range(const T* x, T* y, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    using Vec = at::vec::Vectorized<float>;
    const Vec one(1.f), minus_sharp(-static_cast<float>(kSharp));
    for (; i + Vec::size() <= n; i += Vec::size()) {
      const Vec v = Vec::loadu(x + i);
      (v / (one + (v * minus_sharp).exp_u20())).store(y + i);
    }
  }
  for (; i < n; i++) y[i] = x[i] / (T(1) + std::exp(-T(kSharp) * x[i]));
}

// d/dx x·s(ax) = s + a·x·s·(1 - s), s = sigmoid(ax)
template <typename T>
void backward_range(const T* g, const T* x, T* dx, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    using Vec = at::vec::Vectorized<float>;
    const Vec one(1.f), sharp(static_cast<float>(kSharp)), minus_sharp(-static_cast<float>(kSharp));
    for (; i + Vec::size() <= n; i += Vec::size()) {
      const Vec v = Vec::loadu(x + i);
      const Vec s = one / (one + (v * minus_sharp).exp_u20());
      (Vec::loadu(g + i) * (s + sharp * v * s * (one - s))).store(dx + i);
    }
  }
  for (; i < n; i++) {
    const T s = T(1) / (T(1) + std::exp(-T(kSharp) * x[i]));
    dx[i] = g[i] * (s + T(kSharp) * x[i] * s * (T(1) - s));
  }
}


}  // namespace

at::Tensor fused_sigmoid_gelu(const at::Tensor& x_) {
  checks::floating("sigmoid_gelu", x_, "x");
  const auto x = x_.contiguous();
  auto y = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "routeformer_sigmoid_gelu", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, x.numel(), 1 << 15, [&](int64_t a, int64_t b) { forward_range(xp + a, yp + a, b - a); });
  });
  return y;
}

at::Tensor fused_sigmoid_gelu_backward(const at::Tensor& grad_, const at::Tensor& x_) {
  const char* op = "sigmoid_gelu_backward";
  checks::floating(op, x_, "x");
  checks::dtype(op, grad_, "grad", x_.scalar_type());  // read elementwise beside x: the same shape and dtype
  checks::shape(op, grad_, "grad", "x's shape", x_.sizes());
  const auto x = x_.contiguous();
  const auto grad = grad_.contiguous();
  auto dx = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "routeformer_sigmoid_gelu_backward", [&] {
    const scalar_t* gp = grad.data_ptr<scalar_t>();
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* dp = dx.data_ptr<scalar_t>();
    at::parallel_for(0, x.numel(), 1 << 15,
                     [&](int64_t a, int64_t b) { backward_range(gp + a, xp + a, dp + a, b - a); });
  });
  return dx;
}

}  // namespace routeformer
