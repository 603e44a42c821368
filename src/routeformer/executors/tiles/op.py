"""The fused tile operator ``routeformer::tile_attention`` (forward and backward).

One call computes softmax(q·kᵀ + rel) · v for X = B·H·nb query tiles (T, D) against spans (S, D) of key rows that
``layout.key_windows`` views without a copy: O(X · T · S · D) time, two (X, T, S) buffers. It is a ``torch.library``
custom operator, opaque to torch.compile, whose functionalisation cannot follow the in-place writes through strided
views that make it memory-lean; forward and backward are ops of their own.

Its lse follows the executors' conventions (``lse.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..lse import lse_dtype, neg_inf
from ..rows import rowdot
from .layout import fold_windows, key_windows


def _strip(x: Tensor, offset: int, width: int) -> Tensor:
    """View x[b, r, r + offset + t] (X, T, width) of a contiguous (..., T, S) tile: a sliding window's keys.

    Rows of one tile step by S + 1, tiles by T·S, so the view spans every tile without a copy and feeds bmm.
    """
    T, S = x.shape[-2:]
    start = x.reshape(-1)[offset:]  # the view begins `offset` elements in; as_strided keeps that start
    return start.as_strided((x.numel() // (T * S), T, width), (T * S, S + 1, 1))


def _softmax_(scores: Tensor) -> Tensor:
    """Softmax over the last dim, in place where the kernel is known to allow it (CPU), else into a new tensor."""
    if scores.device.type == "cpu":
        return torch.ops.aten._softmax.out(scores, -1, False, out=scores)
    return torch.softmax(scores, -1)


# The schemas are written out: torch before 2.7 cannot infer one from ``Tensor | None`` and ``list[int]``.
@torch.library.custom_op("routeformer::tile_attention", mutates_args=(), schema=(
    "(Tensor qt, Tensor k, Tensor v, SymInt[] windows, Tensor? mask, Tensor? key_table, Tensor? value_table, "
    "SymInt offset, bool need_lse, Tensor? bias=None) -> (Tensor, Tensor, Tensor)"))
def tile_attention(qt: Tensor, k: Tensor, v: Tensor, windows: list[int], mask: Tensor | None,
                    key_table: Tensor | None, value_table: Tensor | None, offset: int,
                    need_lse: bool, bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """softmax(q·kᵀ + rel + bias) · v over tiles, holding two (…, T, S) buffers per step instead of five.

    Returns (out (B, H, nb, T, D), lse (B, H, nb, T) or empty, probs). Queries come as tiles (B, H, nb, T, D),
    computed as X = B·H·nb batched matmuls; keys and values as ``key_source`` rows whose spans ``key_windows`` views
    without a copy. Forward computes the scores, adds the relative-position strip, masks and normalises them in one
    buffer and keeps only the probabilities. Relative positions (optional) come in strip form: ``key_table`` and
    ``value_table`` (W, D) hold a^K and a^V of strip column t, the strip of row r starting at span column
    r + ``offset``; every strip product is a bmm on a strided view. ``bias`` (optional, broadcastable to
    (B, H, nb, T, S)) is an additive per-pair term without a gradient.
    """
    lead, (T, D) = qt.shape[:3], qt.shape[3:]
    q3 = qt.reshape(-1, T, D)  # (X, T, D)
    tiles = q3.shape[0]
    kt, vt = key_windows(k, windows), key_windows(v, windows)  # (X, S, D) views, no copy
    scores = torch.bmm(q3, kt.transpose(1, 2))  # (X, T, S)
    width = 0 if key_table is None else key_table.shape[0]
    if key_table is not None:  # s_ij += q_i·a^K_ij on the strip
        _strip(scores, offset, width).baddbmm_(q3, key_table.T.expand(tiles, -1, -1))
    if bias is not None:
        scores.view(*lead, T, -1).add_(bias)
    if mask is not None:
        scores.view(*lead, T, -1).masked_fill_(~mask, neg_inf(scores.dtype))
    peak = scores.amax(-1) if need_lse else None
    probs = _softmax_(scores)
    out = torch.bmm(probs, vt)  # (X, T, D)
    if value_table is not None:  # o_i += Σ_j p_ij a^V_ij
        out.baddbmm_(_strip(probs, offset, width), value_table.expand(tiles, -1, -1))
    acc = lse_dtype(scores.dtype)
    if need_lse:  # lse = max(s) - log(max(p)): no second pass of exponentials
        lse = (peak.to(acc) - probs.amax(-1).to(acc).log()).view(*lead, T)
    else:
        lse = q3.new_empty(0, dtype=acc)
    return out.view(*lead, T, D), lse, probs


@tile_attention.register_fake
def _(qt, k, v, windows, mask, key_table, value_table, offset, need_lse, bias=None):
    lead, (T, D) = qt.shape[:3], qt.shape[3:]
    tiles, block, reach = windows
    acc = lse_dtype(qt.dtype)
    lse = qt.new_empty(*lead, T, dtype=acc) if need_lse else qt.new_empty(0, dtype=acc)
    return qt.new_empty(*lead, T, D), lse, qt.new_empty(tiles, T, (reach + 1) * block)


@torch.library.custom_op("routeformer::tile_attention_backward", mutates_args=(), schema=(
    "(Tensor grad_out, Tensor? grad_lse, Tensor qt, Tensor k, Tensor v, Tensor probs, Tensor out, Tensor? key_table, "
    "Tensor? value_table, SymInt[] windows, SymInt offset) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"))
def _tile_attention_backward(grad_out: Tensor, grad_lse: Tensor | None, qt: Tensor, k: Tensor, v: Tensor,
                             probs: Tensor, out: Tensor, key_table: Tensor | None, value_table: Tensor | None,
                             windows: list[int], offset: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of q, k, v and of the relative tables (empty when absent).

    Uses Σ_j p_ij dp_ij = do_i · o_i (as FlashAttention does) to turn dp into ds in place; masked entries have p = 0,
    so their gradient is zero without the mask.
    """
    lead, (T, D) = qt.shape[:3], qt.shape[3:]
    q3 = qt.reshape(-1, T, D)
    tiles = q3.shape[0]
    out3, grad3 = out.reshape(tiles, T, D), grad_out.reshape(tiles, T, D)
    kt, vt = key_windows(k, windows), key_windows(v, windows)
    width = 0 if key_table is None else key_table.shape[0]
    acc = lse_dtype(out.dtype)
    grad_p = torch.bmm(grad3, vt.transpose(1, 2))  # (X, T, S)
    if value_table is not None:
        _strip(grad_p, offset, width).baddbmm_(grad3, value_table.T.expand(tiles, -1, -1))
    row = rowdot(grad3.to(acc), out3.to(acc))[..., None]  # Σ_j p_ij dp_ij
    if grad_lse is not None and grad_lse.numel():  # d lse / d s = p
        row = row - grad_lse.reshape(tiles, T, 1).to(acc)
    grad_s = grad_p.sub_(row).mul_(probs)  # ds = p ∘ (dp - row), in place
    grad_q = torch.bmm(grad_s, kt)
    grad_k = fold_windows(torch.bmm(grad_s.transpose(1, 2), q3), windows)
    grad_v = fold_windows(torch.bmm(probs.transpose(1, 2), grad3), windows)
    grad_key, grad_value = qt.new_empty(0), qt.new_empty(0)  # two tensors: outputs may not alias
    if key_table is not None:
        strip = _strip(grad_s, offset, width)
        grad_q.baddbmm_(strip, key_table.expand(tiles, -1, -1))
        grad_key = torch.bmm(strip.transpose(1, 2), q3).sum(0)
    if value_table is not None:
        grad_value = torch.bmm(_strip(probs, offset, width).transpose(1, 2), grad3).sum(0)
    return grad_q.view(*lead, T, D), grad_k, grad_v, grad_key, grad_value


@_tile_attention_backward.register_fake
def _(grad_out, grad_lse, qt, k, v, probs, out, key_table, value_table, windows, offset):
    # the real op returns fresh contiguous tensors
    return (qt.new_empty(qt.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            qt.new_empty(0) if key_table is None else key_table.new_empty(key_table.shape),
            qt.new_empty(0) if value_table is None else value_table.new_empty(value_table.shape))


def _tile_setup(ctx, inputs, output) -> None:
    qt, k, v, windows, mask, key_table, value_table, offset, need_lse, bias = inputs
    out, _, probs = output
    ctx.save_for_backward(qt, k, v, probs, out, key_table, value_table)
    ctx.windows, ctx.offset = windows, offset
    ctx.set_materialize_grads(False)  # no (X, T, S) zeros for the probabilities' gradient, which nothing uses


def _tile_backward(ctx, grad_out, grad_lse, grad_probs):
    qt, k, v, probs, out, key_table, value_table = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    gq, gk, gv, gkey, gvalue = _tile_attention_backward(grad_out, grad_lse, qt, k, v, probs, out, key_table,
                                                        value_table, ctx.windows, ctx.offset)
    return (gq, gk, gv, None, None, gkey if key_table is not None else None,
            gvalue if value_table is not None else None, None, None, None)


tile_attention.register_autograd(_tile_backward, setup_context=_tile_setup)
