// The fused CPU attention operators, registered with PyTorch's dispatcher as ``torch.ops.routeformer_fused.*``
// (their fake implementations and autograd formulas are registered from Python, ``fused/op.py``).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "common.h"
#include "geometry.h"
#include "ops.h"

namespace routeformer {

bool fused_has_blas() { return has_blas(); }

// The float lanes of at::vec in this build (16 under AVX512, 8 under AVX2 and DEFAULT's 32-byte emulation, 4 with
// NEON): what the build's CPU_CAPABILITY defines selected.
int64_t fused_vector_width() { return at::vec::Vectorized<float>::size(); }

// The field names of an operator's geometry ("band", "ranges" or "rounds"), in the list's order: Python compares them
// with its dataclasses' once when the library loads (``fused/geometry.py``).
std::vector<std::string> fused_geometry_fields(c10::string_view which) {
  if (which == "band") return BandGeometry::names();
  if (which == "ranges") return RangesGeometry::names();
  if (which == "rounds") return RoundsGeometry::names();
  TORCH_CHECK(false, "routeformer_fused.geometry_fields: which must be band, ranges or rounds, got ", which);
}

}  // namespace routeformer

TORCH_LIBRARY(routeformer_fused, m) {
  m.def(
      "band_forward(Tensor q, Tensor k, Tensor v, int[] geometry, float scale, Tensor? allow, Tensor? tile_mask, "
      "Tensor? key_valid, Tensor? groups, Tensor? order, Tensor? key_table, Tensor? value_table, "
      "Tensor? delta, Tensor? positions, Tensor? bias) -> (Tensor, Tensor, Tensor)");
  m.def(
      "band_backward(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor alone, int[] geometry, float scale, Tensor? allow, Tensor? tile_mask, Tensor? key_valid, "
      "Tensor? groups, Tensor? order, Tensor? key_table, Tensor? value_table, Tensor? delta, "
      "Tensor? positions, Tensor? bias, bool[3] output_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "ranges_forward(Tensor q, Tensor k, Tensor v, Tensor lo, Tensor hi, int[] geometry, float scale, "
      "Tensor? key_order, Tensor? key_valid, Tensor? query_pos, Tensor? key_pos, Tensor? key_table, "
      "Tensor? value_table, Tensor? documents) -> (Tensor, Tensor)");
  m.def(
      "ranges_backward(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor lo, Tensor hi, int[] geometry, float scale, Tensor? key_order, Tensor? key_valid, Tensor? query_pos, "
      "Tensor? key_pos, Tensor? key_table, Tensor? value_table, Tensor? documents, bool[3] output_mask) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "rounds_forward(Tensor q, Tensor? k, Tensor v, Tensor order, Tensor groups, Tensor labels, Tensor? key_valid, "
      "int[] geometry, float scale) -> (Tensor, Tensor, Tensor)");
  m.def(
      "rounds_backward(Tensor grad_out, Tensor q, Tensor? k, Tensor v, Tensor out, Tensor lse, Tensor alone, "
      "Tensor order, Tensor groups, Tensor labels, Tensor? key_valid, int[] geometry, float scale, "
      "bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  m.def("sigmoid_gelu(Tensor x) -> Tensor");
  m.def("sigmoid_gelu_backward(Tensor grad, Tensor x) -> Tensor");
  m.def("select_blocks(Tensor q, Tensor k, int block, int top, bool bound, Tensor? documents) -> Tensor");
  m.def(
      "route(Tensor r, Tensor centroids, Tensor? bias, Tensor? key_valid, int probes, bool observe) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "probe_ranges(Tensor key_clusters, Tensor probes, int window, bool exclude_self, bool own_when_alone) -> "
      "(Tensor, Tensor)");
  m.def(
      "feature_scan_forward(Tensor q, Tensor k, Tensor v, Tensor? key_valid, Tensor? projection, "
      "Tensor? documents, int chunk, float scale) -> (Tensor, Tensor)");
  m.def(
      "feature_scan_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor den, "
      "Tensor? key_valid, Tensor? projection, Tensor? documents, int chunk, float scale) -> (Tensor, Tensor, "
      "Tensor)");
  m.def("route_vectors(Tensor x, Tensor projection, float eps) -> (Tensor, Tensor)");
  m.def("route_vectors_backward(Tensor grad_r, Tensor x, Tensor norm, Tensor projection, float eps) -> Tensor");
  m.def("has_blas() -> bool", &routeformer::fused_has_blas);
  m.def("vector_width() -> int", &routeformer::fused_vector_width);
  m.def("geometry_fields(str which) -> str[]", &routeformer::fused_geometry_fields);
}

TORCH_LIBRARY_IMPL(routeformer_fused, CPU, m) {
  m.impl("band_forward", &routeformer::fused_band_forward);
  m.impl("band_backward", &routeformer::fused_band_backward);
  m.impl("ranges_forward", &routeformer::fused_ranges_forward);
  m.impl("ranges_backward", &routeformer::fused_ranges_backward);
  m.impl("rounds_forward", &routeformer::fused_rounds_forward);
  m.impl("rounds_backward", &routeformer::fused_rounds_backward);
  m.impl("sigmoid_gelu", &routeformer::fused_sigmoid_gelu);
  m.impl("sigmoid_gelu_backward", &routeformer::fused_sigmoid_gelu_backward);
  m.impl("select_blocks", &routeformer::fused_select_blocks);
  m.impl("route", &routeformer::fused_route);
  m.impl("probe_ranges", &routeformer::fused_probe_ranges);
  m.impl("feature_scan_forward", &routeformer::fused_feature_scan_forward);
  m.impl("feature_scan_backward", &routeformer::fused_feature_scan_backward);
  m.impl("route_vectors", &routeformer::fused_route_vectors);
  m.impl("route_vectors_backward", &routeformer::fused_route_vectors_backward);
}
