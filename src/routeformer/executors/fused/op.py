"""The fused operators' Python side: fake implementations (so ``torch.compile`` traces models through them),
registered once the library is loaded, and their autograd as ``torch.autograd.Function`` s (``BandFunction``,
``RangesFunction``, ``RoundsFunction``, ``FeatureScanFunction``, ``RouteVectorsFunction``, ``sigmoid_gelu``):
``torch.library.register_autograd`` costs about 90 µs of argument handling per call, a tenth of a small attention
call.

``routeformer_fused::band_forward`` returns (out, lse, alone): out (B, H, Nq, D) in the queries' own order, lse
(B, H, Nq) in the queries' dtype, and alone (B, H, Nq) bool (the rows that saw only their own key under
exclude_self; empty otherwise). What the backward keeps is q, k, v, out, lse and alone, O(N · D) per head, plus the
call's small index tensors: the probabilities are recomputed (``band_backward``), never stored.
``ranges_forward`` returns the merged (out, lse) of query rows, ``rounds_forward`` LSH's merged (out, lse, alone);
their backwards recompute likewise.
"""

from __future__ import annotations

import functools
import threading

import torch
from torch import Tensor

from ..routes import routed_like
from .geometry import BandGeometry, check_fields

_OPTIONAL_BAND = ("allow", "tile_mask", "key_valid", "groups", "order", "key_table", "value_table", "delta",
                  "positions", "bias")
_OPTIONAL_RANGES = ("key_order", "key_valid", "query_pos", "key_pos", "key_table", "value_table", "documents")
_EXCLUDE_SELF = BandGeometry.index("exclude_self")  # band_forward returns alone (B, H, Nq) under it, else empty
_registered = threading.Lock()
_done: list[bool] = []


def ops():
    return torch.ops.routeformer_fused


def register() -> None:
    """Fake implementations and autograd of the loaded operators (once per process), after checking that the
    library's geometries have the fields of ``geometry.py``'s."""
    with _registered:
        if _done:
            return
        check_fields()
        _register()
        _done.append(True)


def _zeros_like_or_none(grad: Tensor | None, like: Tensor) -> Tensor:
    return torch.zeros_like(like) if grad is None else grad


def _contiguous(grad: Tensor | None) -> Tensor | None:
    """The kernels read gradients as contiguous rows (autograd may hand them over as strided views)."""
    return None if grad is None else grad.contiguous()


def once_differentiable(what: str):
    """A backward computed by the kernels, which are not themselves differentiable: under ``create_graph=True`` its
    gradients carry a node that raises, naming the operator, if anything differentiates them again (as
    ``torch.autograd.function.once_differentiable``, but also when only the saved inputs require grad, where that
    decorator would let the second-order terms drop silently)."""

    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            with torch.no_grad():
                outputs = backward(ctx, *grads)
            if not torch.is_grad_enabled():
                return outputs
            if not any(isinstance(x, Tensor) and x.requires_grad for x in (*grads, *ctx.saved_tensors)):
                return outputs
            single = isinstance(outputs, Tensor)
            outputs = (outputs,) if single else outputs
            present = [x for x in outputs if isinstance(x, Tensor)]
            error = torch._C._functions.DelayedError(
                f"routeformer: the fused CPU kernel's {what} backward is not differentiable: no double backward "
                f"(create_graph=True) through it, nor through the tiles executor; reference_attention, the dense "
                f"definition, is twice differentiable".encode(), len(present))
            aliases = error(*[x.detach().requires_grad_() for x in present])
            wrapped = iter((aliases,) if isinstance(aliases, Tensor) else aliases)
            result = tuple(next(wrapped) if isinstance(x, Tensor) else x for x in outputs)
            return result[0] if single else result

        return wrapper

    return decorate


def _register() -> None:
    lib = "routeformer_fused::"

    @torch.library.register_fake(lib + "band_forward")
    def _(q, k, v, geometry, scale, allow, tile_mask, key_valid, groups, order, key_table, value_table, delta,
          positions, bias):
        B, H, Nq, D = q.shape
        alone = q.new_empty((B, H, Nq) if geometry[_EXCLUDE_SELF] else (0,), dtype=torch.bool)
        return q.new_empty(B, H, Nq, D), q.new_empty(B, H, Nq), alone

    @torch.library.register_fake(lib + "band_backward")
    def _(grad_out, grad_lse, q, k, v, out, lse, alone, geometry, scale, allow, tile_mask, key_valid, groups, order,
          key_table, value_table, delta, positions, bias, output_mask):
        return _grad_shapes(q, k, key_table, output_mask)

    @torch.library.register_fake(lib + "ranges_forward")
    def _(q, k, v, lo, hi, geometry, scale, key_order, key_valid, query_pos, key_pos, key_table, value_table,
          documents):
        B, H, Nq, D = q.shape
        return q.new_empty(B, H, Nq, D), q.new_empty(B, H, Nq)

    @torch.library.register_fake(lib + "ranges_backward")
    def _(grad_out, grad_lse, q, k, v, out, lse, lo, hi, geometry, scale, key_order, key_valid, query_pos, key_pos,
          key_table, value_table, documents, output_mask):
        return _grad_shapes(q, k, key_table, output_mask)

    @torch.library.register_fake(lib + "rounds_forward")
    def _(q, k, v, order, groups, labels, key_valid, geometry, scale):
        B, H, N, D = q.shape
        return q.new_empty(B, H, N, D), q.new_empty(B, H, N), q.new_empty(B, H, N, dtype=torch.bool)

    @torch.library.register_fake(lib + "rounds_backward")
    def _(grad_out, q, k, v, out, lse, alone, order, groups, labels, key_valid, geometry, scale, output_mask):
        need_q, need_k, need_v = output_mask
        return (q.new_empty(q.shape if need_q else (0,)),
                q.new_empty(0) if k is None or not need_k else k.new_empty(k.shape),
                v.new_empty(v.shape if need_v else (0,)))

    @torch.library.register_fake(lib + "sigmoid_gelu")
    def _(x):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake(lib + "sigmoid_gelu_backward")
    def _(grad, x):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake(lib + "select_blocks")
    def _(q, k, block, top, bound, documents):
        B, H, N, _ = q.shape
        return q.new_empty(B, H, N, min(top, N // block), dtype=torch.long)

    @torch.library.register_fake(lib + "route")
    def _(r, centroids, bias, key_valid, probes, observe):
        return routed_like(r, centroids, probes, observe)

    @torch.library.register_fake(lib + "probe_ranges")
    def _(key_clusters, probes, window, exclude_self, own_when_alone):
        B, H, N, p = probes.shape
        return probes.new_empty(B, H, N * p), probes.new_empty(B, H, N * p)

    @torch.library.register_fake(lib + "feature_scan_forward")
    def _(q, k, v, key_valid, projection, documents, chunk, scale):
        return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:3])

    @torch.library.register_fake(lib + "feature_scan_backward")
    def _(grad_out, q, k, v, out, den, key_valid, projection, documents, chunk, scale):
        return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))

    @torch.library.register_fake(lib + "route_vectors")
    def _(x, projection, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(x.shape[:3])

    @torch.library.register_fake(lib + "route_vectors_backward")
    def _(grad_r, x, norm, projection, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)


def _grad_shapes(q: Tensor, k: Tensor, key_table: Tensor | None, output_mask: list[bool]):
    need_q, need_k, need_v = output_mask
    table = (0,) if key_table is None else tuple(key_table.shape)
    return (q.new_empty(q.shape if need_q else (0,)), k.new_empty(k.shape if need_k else (0,)),
            k.new_empty(k.shape if need_v else (0,)), q.new_empty(table), q.new_empty(table))


def _output_mask(ctx, first_optional: int, names: tuple[str, ...]) -> list[bool]:
    """The backward operators' output_mask from autograd's needs_input_grad: q; k or the key table; v or the value
    table (a table's gradient comes out of the same products as its side's)."""
    needs = ctx.needs_input_grad
    table = {name: needs[first_optional + i] for i, name in enumerate(names) if name in ("key_table", "value_table")}
    return [needs[0], needs[1] or table.get("key_table", False), needs[2] or table.get("value_table", False)]


def _grads(ctx, dq: Tensor, dk: Tensor, dv: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """q, k, v's gradients where autograd asked for them (the operator leaves the others empty)."""
    needs = ctx.needs_input_grad
    return dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None


def _optional_grads(ctx, first_optional: int, names: tuple[str, ...], optional: list, dkey: Tensor,
                    dvalue: Tensor) -> list[Tensor | None]:
    """The gradients of the optional inputs: the relative tables' where given and asked for, none for the rest."""
    tables = {"key_table": dkey, "value_table": dvalue}
    needs = ctx.needs_input_grad[first_optional:]
    return [tables[name] if name in tables and x is not None and need else None
            for name, x, need in zip(names, optional, needs, strict=True)]


class BandFunction(torch.autograd.Function):
    """``band_forward`` with its gradient: ``BandFunction.apply(*distinct(q, k, v, geometry, scale, *optional))`` ->
    (out, lse, alone); the optional tensors in ``_OPTIONAL_BAND`` order. Called by the fused executor itself (no
    wrapper in between: one frame less from the model to the kernel)."""

    @staticmethod
    def forward(ctx, q, k, v, geometry, scale, *optional):  # type: ignore[override]
        out, lse, alone = ops().band_forward(q, k, v, geometry, scale, *optional)
        ctx.geometry, ctx.scale = geometry, scale
        ctx.save_for_backward(q, k, v, out, lse, alone, *optional)
        ctx.mark_non_differentiable(alone)
        ctx.set_materialize_grads(False)
        return out, lse, alone

    @staticmethod
    @once_differentiable("band")
    def backward(ctx, grad_out, grad_lse, grad_alone):  # type: ignore[override]
        q, k, v, out, lse, alone, *optional = ctx.saved_tensors
        dq, dk, dv, dkey, dvalue = ops().band_backward(_zeros_like_or_none(grad_out, out), _contiguous(grad_lse), q,
                                                       k, v, out, lse, alone, ctx.geometry, ctx.scale, *optional,
                                                       _output_mask(ctx, 5, _OPTIONAL_BAND))
        return (*_grads(ctx, dq, dk, dv), None, None, *_optional_grads(ctx, 5, _OPTIONAL_BAND, optional, dkey, dvalue))


class RangesFunction(torch.autograd.Function):
    """``ranges_forward`` with its gradient: ``RangesFunction.apply(*distinct(q, k, v, lo, hi, geometry, scale,
    *optional))`` -> (out, lse); the optional tensors in ``_OPTIONAL_RANGES`` order."""

    @staticmethod
    def forward(ctx, q, k, v, lo, hi, geometry, scale, *optional):  # type: ignore[override]
        out, lse = ops().ranges_forward(q, k, v, lo, hi, geometry, scale, *optional)
        ctx.geometry, ctx.scale = geometry, scale
        ctx.save_for_backward(q, k, v, out, lse, lo, hi, *optional)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @once_differentiable("ranges")
    def backward(ctx, grad_out, grad_lse):  # type: ignore[override]
        q, k, v, out, lse, lo, hi, *optional = ctx.saved_tensors
        dq, dk, dv, dkey, dvalue = ops().ranges_backward(_zeros_like_or_none(grad_out, out), _contiguous(grad_lse),
                                                         q, k, v, out, lse, lo, hi, ctx.geometry, ctx.scale, *optional,
                                                         _output_mask(ctx, 7, _OPTIONAL_RANGES))
        return (*_grads(ctx, dq, dk, dv), None, None, None, None,
                *_optional_grads(ctx, 7, _OPTIONAL_RANGES, optional, dkey, dvalue))


class RoundsFunction(torch.autograd.Function):
    """``rounds_forward`` with its gradient: ``Rounds.apply(*distinct(q, k, v, order, groups, labels, key_valid,
    geometry, scale))`` -> (out, lse, alone); lse and alone take none. k None: the keys are scale · q / |q|
    (shared-QK unit keys), made inside the kernel; order, groups and labels are the rounds' (``HashRounds``)."""

    @staticmethod
    def forward(ctx, q, k, v, order, groups, labels, key_valid, geometry, scale):  # type: ignore[override]
        out, lse, alone = ops().rounds_forward(q, k, v, order, groups, labels, key_valid, geometry, scale)
        ctx.geometry, ctx.scale = geometry, scale
        ctx.save_for_backward(q, k, v, out, lse, alone, order, groups, labels, key_valid)
        ctx.mark_non_differentiable(lse, alone)
        ctx.set_materialize_grads(False)
        return out, lse, alone

    @staticmethod
    @once_differentiable("LSH rounds")
    def backward(ctx, grad_out, grad_lse, grad_alone):  # type: ignore[override]
        q, k, v, out, lse, alone, order, groups, labels, key_valid = ctx.saved_tensors
        dq, dk, dv = ops().rounds_backward(_zeros_like_or_none(grad_out, out), q, k, v, out, lse, alone, order,
                                           groups, labels, key_valid, ctx.geometry, ctx.scale,
                                           list(ctx.needs_input_grad[:3]))
        dq, dk, dv = _grads(ctx, dq, dk, dv)
        return dq, None if k is None else dk, dv, None, None, None, None, None, None


class FeatureScanFunction(torch.autograd.Function):
    """Causal attention through features (``fused.scan``): (q, k, v, key_valid, projection, documents, chunk,
    scale) -> out; the backward recomputes the features from q, k, v, the output and the denominators."""

    @staticmethod
    def forward(ctx, q, k, v, key_valid, projection, documents, chunk, scale):  # type: ignore[override]
        out, den = ops().feature_scan_forward(q, k, v, key_valid, projection, documents, chunk, scale)
        ctx.chunk, ctx.scale = chunk, scale
        ctx.save_for_backward(q, k, v, out, den, key_valid, projection, documents)
        return out

    @staticmethod
    @once_differentiable("feature scan")
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, den, key_valid, projection, documents = ctx.saved_tensors
        dq, dk, dv = ops().feature_scan_backward(grad_out.contiguous(), q, k, v, out, den, key_valid, projection,
                                                 documents, ctx.chunk, ctx.scale)
        return dq, dk, dv, None, None, None, None, None


class RouteVectorsFunction(torch.autograd.Function):
    """The router's unit routing vectors (``fused.vectors``): (x, projection, eps) -> r = x / max(||x||, eps) · W_R;
    the backward keeps x and the (B, H, N) norms (the projection is fixed: no gradient)."""

    @staticmethod
    def forward(ctx, x, projection, eps):  # type: ignore[override]
        r, norm = ops().route_vectors(x, projection, eps)
        ctx.eps = eps
        ctx.save_for_backward(x, norm, projection)
        return r

    @staticmethod
    @once_differentiable("routing vectors")
    def backward(ctx, grad_r):  # type: ignore[override]
        x, norm, projection = ctx.saved_tensors
        return ops().route_vectors_backward(grad_r.contiguous(), x, norm, projection, ctx.eps), None, None

class _SigmoidGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.save_for_backward(x)
        return ops().sigmoid_gelu(x)

    @staticmethod
    @once_differentiable("sigmoid GELU")
    def backward(ctx, grad):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return ops().sigmoid_gelu_backward(grad, x)


def distinct(*args):
    """The arguments with every repeated tensor (k is q under shared QK, positions is the order) given as a view of
    itself: torch.compile does not trace an autograd.Function that takes one tensor twice; a view's gradient flows
    back to the tensor as usual."""
    seen: list[Tensor] = []  # compared by identity with `is`, not id(): dynamo before 2.13 cannot trace id()
    out = []
    for a in args:
        if isinstance(a, Tensor):
            if any(a is b for b in seen):
                a = a.view(a.shape)
            seen.append(a)
        out.append(a)
    return out


def sigmoid_gelu(x: Tensor) -> Tensor:
    """x · sigmoid(1.702 x) with its gradient (float32 or float64 CPU tensors)."""
    return _SigmoidGelu.apply(x)

