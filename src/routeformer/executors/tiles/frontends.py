"""The tiled executor's entry points: every sparse pattern computed without an N×N matrix.

Queries are cut into blocks of ``block`` rows. Query block b sees the keys of blocks b-back … b+ahead, a *span* of
S = (back + 1 + ahead) · block keys, under a static (block, S) *tile mask* that is the same for every block. That
covers a sliding window (block = window, one block back), the Sparse Transformer's column attention (the same, on
the sequence viewed as a grid and transposed), a block diagonal (no neighbours), and one dense tile (block = N).
Patterns that are unions of such pieces compute each piece with its log-sum-exp and merge them exactly
(``merge_partials``): softmax over a union of disjoint key sets is the lse-weighted mix of the softmaxes.

Cost of one call: O(N · S · D) time, O(N · S) memory for the scores; no (N, N) tensor unless block = N.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..inputs import Inputs, RelTerms
from ..lse import lse_dtype, neg_inf
from ..tiling import KeyRestrictions, Tiling, shift_invariant_mask
from .layout import key_source, key_windows, pad_seq
from .op import tile_attention
from .rel_terms import TileRelTerms


def tiled_attention(
    inputs: Inputs,
    tiling: Tiling,
    *,
    restrict: KeyRestrictions | None = None,
    rel: RelTerms | None = None,
    bias: Tensor | None = None,
    need_lse: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Attention of query blocks to spans of key blocks: softmax(q·kᵀ · scale + rel + bias, masked) · v (+ rel
    values), the tiles executor's ``run`` (``executors.Executor.tiled`` documents the arguments and checks them).

    Time O(Nq · S · D), memory O(Nq · S) for the scores, S keys per span (S = Nk for a single tile); no (Nq, Nk)
    tensor unless one tile holds every key. Relative terms: on the strip of an ``offsets`` tiling with unit
    distances (inside the fused op, no copy), else by the skew of unit distances or gathers of explicit ones.

    Returns:
        out (B, H, Nq, D) with zeros for rows that see no key, and lse (B, H, Nq) in float32 or wider (rows that
        see no key get exactly ``neg_inf(lse.dtype)``, see ``saw_key``) or ``None``.
    """
    q, k, v, scale, key_valid = inputs.q, inputs.k, inputs.v, inputs.scale, inputs.key_valid
    rel_pos, distances = (None, None) if rel is None else (rel.tables, rel.distances)
    if tiling.order is not None or (restrict is not None and restrict.labels is not None):
        raise ValueError("the tiles executor takes Tiling.order and KeyRestrictions.labels through Executor.tiled, "
                         "which lowers them")
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    groups, exclude_self = (None, False) if restrict is None else (restrict.groups, restrict.exclude_self)
    single, rows = tiling.single(Nq), tiling.rows
    n_blocks, T, span = tiling.shape(Nq, Nk)
    block, back, ahead = (Nq, 0, 0) if single else (tiling.block, tiling.back, tiling.ahead)
    padded = 0 if single else n_blocks * block - Nk  # keys past the end of the last block

    # an elementwise op keeps a transposed input's layout
    q = pad_seq((q if scale == 1.0 else q * scale).contiguous(), n_blocks * T - Nq)
    qt = q.view(B, H, n_blocks, T, D)  # (B, H, nb, T, D), contiguous
    if single:
        windows = (B * H, Nk, 0)
        k, v = k.contiguous().view(B * H * Nk, D), v.contiguous().view(B * H * Nk, D)
    else:
        windows = (B * H * n_blocks, block, back + ahead)
        k, v = (key_source(x, n_blocks, block, back, ahead) for x in (k, v))

    def key_spans(x: Tensor) -> Tensor:
        """Per-key values (B, H', Nk) -> (B, H', nb, 1, S): each block's span (False / 0 beyond the keys)."""
        return x[:, :, None, None, :] if single else tiling.key_spans(x)

    def query_rows(x: Tensor) -> Tensor:
        """Per-query values (B, H', Nq) of a self-attention -> (B, H', nb, T, 1)."""
        return x[:, :, None, :, None] if single else tiling.query_rows(x)

    # One boolean mask (broadcastable to (B, H, nb, T, S)) from the tile masks, out-of-range keys and padding.
    static = tiling.static_mask(Nq, Nk, q.device)
    mask = None if static is None else static.view(1, 1, 1, T, span)
    if tiling.tile_mask is not None:
        mask = _and(mask, tiling.tile_mask)
    if not single and rows is None and (back or ahead or padded):  # span columns that are keys: [0, Nk)
        mask = _and(mask, key_spans(q.new_ones(1, 1, Nk, dtype=torch.bool)))
    if key_valid is not None:
        mask = _and(mask, key_spans(key_valid))
    if groups is not None:
        mask = _and(mask, query_rows(groups) == key_spans(groups))
    if exclude_self:
        if mask is None:
            mask = torch.ones(1, 1, 1, block, span, dtype=torch.bool, device=q.device)
        mask = mask.expand(B, H, n_blocks, block, span)
        own_allowed = mask.diagonal(offset=back * block, dim1=-2, dim2=-1)  # (B, H, nb, T): span column r + back·T
        others = mask.sum(-1) > own_allowed.int()  # another key is allowed
        own = shift_invariant_mask(block, back, ahead, lambda d: d == 0, device=q.device)  # that column
        mask = mask & ~(own & others[..., None])

    rel, key_table, value_table, offset = None, None, None, 0
    strip = None if distances is None or distances.unit is None else tiling.strip(Nq, Nk)
    if rel_pos is not None and strip is not None:  # strip column t: span column r + offset + t
        offset, width = strip
        delta = (torch.arange(width, device=q.device) + offset - back * block) * distances.unit
        key_table, value_table = rel_pos.tables(delta, qt.dtype)  # (W, D)
    elif rel_pos is not None:
        rel_delta = distances.delta
        if distances.positions is not None:
            rel_delta = key_spans(distances.positions) - query_rows(distances.positions)  # (B, H, nb, T, S)
        rel = TileRelTerms(rel_pos, qt, T, span, back, distances.unit, rel_delta)
    if rel is None:
        out, lse, _ = tile_attention(qt, k, v, list(windows), mask, key_table, value_table, offset, need_lse,
                                      bias)
        lse = lse if need_lse else None
    else:  # irregular relative distances: plain autograd
        kt, vt = (key_windows(x, windows).view(B, H, n_blocks, span, D) for x in (k, v))
        scores = rel.add_scores(qt @ kt.transpose(-1, -2))
        if bias is not None:
            scores = scores + bias
        if mask is not None:
            scores = scores.masked_fill(~mask, neg_inf(scores.dtype))
        probs = torch.softmax(scores, -1)
        out = probs @ vt + rel.values(probs)
        lse = torch.logsumexp(scores.to(lse_dtype(scores.dtype)), -1) if need_lse else None
    # A row whose every key is masked would average the masked values: zero it, and give it lse = neg_inf exactly
    # (see ``neg_inf``). Only a mask that can leave a real row empty needs the pass: a sliding window (its own key
    # always in range and in its group) and the whole span cannot; padded rows are cut off below.
    if mask is not None and rows is None and _may_empty_rows(tiling, key_valid, Nq, single):
        # (…, nb, T); from the lse when there is one (a masked score is neg_inf of the score dtype, a real one far
        # above half of it), without a pass over the mask
        empty = ~(lse > neg_inf(qt.dtype) / 2) if lse is not None else ~mask.any(-1)
        out = out.masked_fill(empty[..., None], 0.0)
        if lse is not None:
            lse = lse.masked_fill(empty, neg_inf(lse.dtype))
    elif rows is not None and lse is not None and lse.dtype != q.dtype:
        # Rows mode leaves empty rows to the caller, at the lse of their masked scores: about neg_inf of the score
        # dtype, below saw_key's bound in the (wider) lse dtype only when the scores are float32 or wider.
        lse = torch.where(lse > neg_inf(q.dtype) / 2, lse, neg_inf(lse.dtype))

    out = out.reshape(B, H, n_blocks * T, D)[:, :, :Nq]
    if lse is not None:
        lse = lse.reshape(B, H, n_blocks * T)[:, :, :Nq]
    return out, lse


def _may_empty_rows(tiling: Tiling, key_valid: Tensor | None, nq: int, single: bool) -> bool:
    """Whether the masks may leave a query row without a key: padding and per-tile masks may; an ``offsets`` window
    that holds the query's own index (key index - query index = 0), or the whole span, may not; a static mask the
    caller built may, unless, read on the host (CPU masks outside compilation only: no device synchronisation, no
    graph break), it gives every real row a key among the keys in range: one tile (every key in range), or blocks
    without neighbours (the last block holds its first c = nq - (nb - 1) · block keys)."""
    if key_valid is not None or tiling.tile_mask is not None:
        return True
    allow = tiling.allow
    if allow is None:
        return tiling.offsets is not None and not tiling.offsets[0] <= 0 <= tiling.offsets[1]
    if (allow.device.type != "cpu" or torch.compiler.is_compiling()  # no host read while compiling
            or not (single or tiling.back == tiling.ahead == 0)):
        return True
    last = nq - (-(-nq // tiling.block) - 1) * tiling.block  # rows (and keys) of the last block
    return not (bool(allow.any(-1).all()) and (single or bool(allow[:last, :last].any(-1).all())))


def _and(a: Tensor | None, b: Tensor) -> Tensor:
    return b if a is None else a & b
