// The fused CPU operators, as ops.cpp registers them (``torch.ops.routeformer_fused.*``); each is defined in the
// file of its kind: band.cpp (a Tiling), ranges.cpp (multi-probe routing), rounds.cpp (LSH), activation.cpp, select.cpp
// (block selection), route.cpp (the causal router's choice), probes.cpp (multi-probe routing's key ranges), scan.cpp
// (causal attention through features), vectors.cpp (the router's unit routing vectors).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace routeformer {

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_band_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef geometry, double scale,
    const std::optional<at::Tensor>& allow, const std::optional<at::Tensor>& tile_mask,
    const std::optional<at::Tensor>& key_valid, const std::optional<at::Tensor>& groups,
    const std::optional<at::Tensor>& order, const std::optional<at::Tensor>& key_table,
    const std::optional<at::Tensor>& value_table, const std::optional<at::Tensor>& delta,
    const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& bias);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_band_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& alone,
    at::IntArrayRef geometry, double scale, const std::optional<at::Tensor>& allow,
    const std::optional<at::Tensor>& tile_mask, const std::optional<at::Tensor>& key_valid,
    const std::optional<at::Tensor>& groups, const std::optional<at::Tensor>& order,
    const std::optional<at::Tensor>& key_table,
    const std::optional<at::Tensor>& value_table, const std::optional<at::Tensor>& delta,
    const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& bias,
    std::array<bool, 3> output_mask);

std::tuple<at::Tensor, at::Tensor> fused_ranges_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lo, const at::Tensor& hi,
    at::IntArrayRef geometry, double scale, const std::optional<at::Tensor>& key_order,
    const std::optional<at::Tensor>& key_valid, const std::optional<at::Tensor>& query_pos,
    const std::optional<at::Tensor>& key_pos, const std::optional<at::Tensor>& key_table,
    const std::optional<at::Tensor>& value_table, const std::optional<at::Tensor>& documents);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_ranges_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& lo, const at::Tensor& hi,
    at::IntArrayRef geometry, double scale, const std::optional<at::Tensor>& key_order,
    const std::optional<at::Tensor>& key_valid, const std::optional<at::Tensor>& query_pos,
    const std::optional<at::Tensor>& key_pos, const std::optional<at::Tensor>& key_table,
    const std::optional<at::Tensor>& value_table, const std::optional<at::Tensor>& documents,
    std::array<bool, 3> output_mask);

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_rounds_forward(
    const at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& v, const at::Tensor& order,
    const at::Tensor& groups, const at::Tensor& labels, const std::optional<at::Tensor>& key_valid,
    at::IntArrayRef geometry, double scale);

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_rounds_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& alone, const at::Tensor& order,
    const at::Tensor& groups, const at::Tensor& labels, const std::optional<at::Tensor>& key_valid,
    at::IntArrayRef geometry, double scale, std::array<bool, 3> output_mask);

std::vector<std::string> fused_geometry_fields(c10::string_view which);

at::Tensor fused_sigmoid_gelu(const at::Tensor& x);
at::Tensor fused_sigmoid_gelu_backward(const at::Tensor& grad, const at::Tensor& x);

at::Tensor fused_select_blocks(const at::Tensor& q, const at::Tensor& k, int64_t block, int64_t top, bool bound,
                               const std::optional<at::Tensor>& documents);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_route(
    const at::Tensor& r, const at::Tensor& centroids, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& key_valid, int64_t probes, bool observe);

std::tuple<at::Tensor, at::Tensor> fused_probe_ranges(const at::Tensor& key_clusters, const at::Tensor& probes,
                                                      int64_t window, bool exclude_self, bool own_when_alone);

std::tuple<at::Tensor, at::Tensor> fused_feature_scan_forward(const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& v,
                                                              const std::optional<at::Tensor>& key_valid,
                                                              const std::optional<at::Tensor>& projection,
                                                              const std::optional<at::Tensor>& documents,
                                                              int64_t chunk, double scale);

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_feature_scan_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& den, const std::optional<at::Tensor>& key_valid, const std::optional<at::Tensor>& projection,
    const std::optional<at::Tensor>& documents, int64_t chunk, double scale);

std::tuple<at::Tensor, at::Tensor> fused_route_vectors(const at::Tensor& x, const at::Tensor& projection,
                                                       double eps);
at::Tensor fused_route_vectors_backward(const at::Tensor& grad_r, const at::Tensor& x, const at::Tensor& norm,
                                        const at::Tensor& projection, double eps);

bool fused_has_blas();

}  // namespace routeformer
