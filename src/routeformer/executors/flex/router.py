"""The flex executor's router (CUDA): the causal router's discrete part in Triton kernels behind one custom operator,
``routeformer_flex::route``, with the fused CPU router's contract (``executors.routes.Routed``) and no (N, k)
scores tensor.

One call: ``kernels.choose`` (each position's p best clusters by cosine + bias, the best one's cosine, the
clusters' sizes), ``torch.sort`` of the int64 clusters (stable: the order by (cluster, position)) and its inverse,
and with ``observe`` ``kernels.reduce`` (the k-means statistics of the real positions, one program per
(cluster, head) over its runs of the sorted order, in a fixed order: deterministic, no float atomics). The
operator has a fake implementation, so ``torch.compile`` traces through it and a count of operators on the ``meta``
device sees one. Time O(N · k · D) per head for the choice, O(N · D) for the statistics; memory O(N · p).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..routes import Routed, routed_like
from ..rows import inverse_order

REDUCE_ROWS = 64  # sorted positions per step of ``reduce``


def flex_route(r: Tensor, centroids: Tensor, bias: Tensor | None, key_padding_mask: Tensor | None, probes: int,
               observe: bool) -> Routed | None:
    """The flex executor's router (``Executor.route_run``): the unit routing vectors r (B, H, N, D) routed to the
    centroids (H, k, D) plus the bias (H, k), ``probes`` clusters each, with ``observe`` the statistics of the
    positions ``key_padding_mask`` (B, N; True = real) keeps (``executors.routes.Routed``, with the cosines). On
    CUDA (and ``meta``, shapes only) for float32 vectors, those of float32, bfloat16 and float16 models; else None
    and the caller takes PyTorch's operators (the CPU, where flex is for tests; float64 models)."""
    if r.device.type not in ("cuda", "meta") or r.dtype != torch.float32:
        return None
    valid = None if key_padding_mask is None else key_padding_mask.to(torch.bool).contiguous()
    with torch.no_grad():
        return Routed(*torch.ops.routeformer_flex.route(
            r.detach().contiguous(), centroids.to(torch.float32).contiguous(),
            None if bias is None else bias.to(torch.float32).contiguous(), valid, probes, observe))


def launch(r: Tensor, centroids: Tensor, bias: Tensor | None, valid: Tensor | None, probes: int,
           observe: bool) -> tuple[Tensor, ...]:
    """The operator's body (on CUDA; on CPU tensors too under ``TRITON_INTERPRET=1``, for the tests): r (B, H, N, D)
    and centroids (H, k, D) float32, contiguous; bias (H, k) or None; valid (B, N) bool or None ->
    (probes (B, H, N, p), order, inverse, grouped (B, H, N), counts (B, H, k), all int64; sums (H, k, D) and
    weights (H, k) float32, or empty without ``observe``; cosine (B, H, N) float32)."""
    from . import kernels

    B, H, N, D = r.shape
    k = centroids.shape[1]
    dev = r.device
    chosen = torch.empty(B, H, N, probes, dtype=torch.long, device=dev)
    cosine = torch.empty(B, H, N, dtype=torch.float32, device=dev)
    counts = torch.zeros(B, H, k, dtype=torch.int32, device=dev)
    block_d = kernels.block_dim(D)
    grid = lambda tile: (-(-N // tile["BLOCK_N"]), B * H)  # noqa: E731  (the autotuner's tile)
    kernels.choose[grid](r, centroids, centroids if bias is None else bias, chosen, cosine, counts, N, H, k, D,
                         HAS_BIAS=bias is not None, P=probes, P_PAD=kernels.next_pow2(probes), BLOCK_D=block_d)
    grouped, order = torch.sort(chosen[..., 0], dim=-1, stable=True)  # by (cluster, position)
    inverse = inverse_order(order)
    if observe:
        sums = torch.empty(H, k, D, dtype=torch.float32, device=dev)
        weights = torch.empty(H, k, dtype=torch.float32, device=dev)
        starts = (counts.cumsum(-1, dtype=torch.int32) - counts).contiguous()
        kernels.reduce[(k, H)](r, order, starts, counts, sums if valid is None else valid, sums, weights, B, H, N,
                               k, D, HAS_VALID=valid is not None, BLOCK_N=REDUCE_ROWS, BLOCK_D=block_d)
    else:
        sums, weights = r.new_empty(0), r.new_empty(0)
    return chosen, order, inverse, grouped, counts.long(), sums, weights, cosine


@torch.library.custom_op("routeformer_flex::route", mutates_args=(), device_types="cuda")
def _route(r: Tensor, centroids: Tensor, bias: Tensor | None, valid: Tensor | None, probes: int,
           observe: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return launch(r, centroids, bias, valid, probes, observe)


@_route.register_fake
def _(r, centroids, bias, valid, probes, observe):
    return routed_like(r, centroids, probes, observe)


__all__ = ["flex_route", "launch"]
