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

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ..relative import RelativePositions
from .layout import _key_source, _pad_seq, _span, _windows
from .op import _tile_attention, lse_dtype, neg_inf
from .relative import _RelTerms


class KeyRestrictions(NamedTuple):
    """Per-entry labels of a self-attention sequence (as many keys as queries) that narrow what the tile mask
    allows, and where its entries sit. Routing's band over its cluster-sorted sequence uses them; so may any
    self-attention over a reordered or segmented sequence.

    groups: optional integer (B, H, N): a query sees only keys of its own group.
    exclude_self: a query does not see the key at its own index unless no other key is allowed (shared-QK
        attention, where q_i·k_i would dominate).
    positions: optional integer (B, H, N): the original position of every entry of a sequence given in a permuted
        order; relative distances (with ``rel_pos``) are taken between these positions, with gathers, instead of
        between indices.
    """

    groups: Tensor | None = None
    exclude_self: bool = False
    positions: Tensor | None = None


def tiled_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    block: int,
    back: int = 0,
    ahead: int = 0,
    allow: Tensor | None = None,
    tile_mask: Tensor | None = None,
    scale: float,
    key_valid: Tensor | None = None,
    restrict: KeyRestrictions | None = None,
    rel_pos: RelativePositions | None = None,
    rel_unit: int | None = None,
    rel_delta: Tensor | None = None,
    rel_band: tuple[int, int] | None = None,
    empty_rows: bool = False,
    need_lse: bool = False,
    rows: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Attention of query blocks to spans of key blocks: softmax(q·kᵀ · scale + rel, masked) · v (+ rel values).

    Time O(Nq · S · D), memory O(Nq · S) for the scores, S = (back + 1 + ahead) · block keys per query block (S = Nk
    for a single tile); no (Nq, Nk) tensor unless one tile holds every key.

    Args:
        q: (B, H, Nq, D); k, v: (B, H, Nk, D). Nk may differ from Nq only for a single tile
            (``back == ahead == 0`` and ``block >= Nq``).
        block: rows per query block (and keys per key block).
        back, ahead: neighbouring key blocks each query block sees.
        allow: static tile mask (block, S), True = may attend; ``None`` allows the whole span. In a single tile
            S = Nk; otherwise span column s of query block b is key index (b - back) · block + s.
        tile_mask: optional bool broadcastable to (B, H, n_blocks, block, S), ANDed with ``allow``: a mask that
            differs between tiles.
        key_valid: optional bool (B, 1 or H, Nk), False removes the key (padding).
        restrict: optional ``KeyRestrictions`` (self-attention only): groups, the query's own key, original
            positions for the relative distances.
        rel_pos: optional relative position tables, with the position distance of every tile entry given by
            ``rel_unit`` (shift-invariant tiles: delta = rel_unit · (key index - query index)) and, optionally,
            ``rel_band = (offset, width)``: every key a row r may see lies in span columns
            [r + offset, r + offset + width), which lets the relative terms be computed on that strip alone;
            or ``rel_delta`` (any integer tensor broadcastable to (B, H, n_blocks, block, S), computed with
            gathers), or ``restrict.positions`` (distances between given positions, with gathers).
        empty_rows: ``allow`` may leave a query row without any key (declared by the caller, who built it).
        need_lse: also return the log-sum-exp of each row's scores, for ``merge_partials``.
        rows: query rows per block when the queries are not the keys' own positions: q then holds exactly
            n_blocks · rows queries (n_blocks = ceil(Nk / block)), whose block b sees key blocks b - back … b + ahead
            (a layout the caller chose, e.g. the queries whose keys end in each key block); masks are (rows, S),
            and ``restrict``, ``rel_unit`` and ``rel_band``, which read query positions, do not apply. The caller
            owns the mask: ``tile_mask`` is required and must keep out every span column beyond the keys, and a row
            it leaves without a key is not zeroed (its lse lies below ``neg_inf(lse.dtype) / 2``, put at
            ``neg_inf(lse.dtype)`` for half-precision scores, so ``saw_key`` is False, and its output is finite and
            meaningless: the caller discards it, as ``ranges`` does).

    Returns:
        out (B, H, Nq, D) with zeros for rows that see no key, and lse (B, H, Nq) in float32 or wider (rows that
        see no key get exactly ``neg_inf(lse.dtype)``, see ``saw_key``) or ``None``.
    """
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    groups, exclude_self, positions = (None, False, None) if restrict is None else restrict
    single = back == 0 and ahead == 0 and block >= Nq and rows is None
    if single:
        block, n_blocks, span = Nq, 1, Nk
    elif rows is not None:
        n_blocks, span = -(-Nk // block), (back + 1 + ahead) * block
        if Nq != n_blocks * rows:
            raise ValueError(f"with rows={rows}, q must hold ceil(Nk / block) · rows = {n_blocks * rows} queries, "
                             f"got {Nq}")
        if restrict is not None or rel_unit is not None or rel_band is not None:
            raise ValueError("with rows, queries are not at key positions: restrict, rel_unit and rel_band do not "
                             "apply (give distances as rel_delta)")
        if tile_mask is None:
            raise ValueError("with rows, the caller gives the tile mask (it keeps out the columns beyond the keys)")
    else:
        if Nk != Nq:
            raise ValueError(f"banded tiles need as many keys as queries, got {Nq} queries and {Nk} keys")
        n_blocks, span = -(-Nq // block), (back + 1 + ahead) * block
    T = rows or block  # query rows per tile
    padded = 0 if single else n_blocks * block - Nk  # keys past the end of the last block
    if allow is not None and tuple(allow.shape) != (T, span):
        raise ValueError(f"tile mask must have shape {(T, span)}, got {tuple(allow.shape)}")

    # an elementwise op keeps a transposed input's layout
    q = _pad_seq((q if scale == 1.0 else q * scale).contiguous(), n_blocks * T - Nq)
    qt = q.view(B, H, n_blocks, T, D)  # (B, H, nb, T, D), contiguous
    if single:
        windows = (B * H, Nk, 0)
        k, v = k.contiguous().view(B * H * Nk, D), v.contiguous().view(B * H * Nk, D)
    else:
        windows = (B * H * n_blocks, block, back + ahead)
        k, v = (_key_source(x, n_blocks, block, back, ahead) for x in (k, v))

    def key_spans(x: Tensor) -> Tensor:
        """Per-key values (B, H', nb·T) (already padded to whole blocks) -> (B, H', nb, 1, S): each block's span."""
        return x[:, :, None, None, :] if single else _span(x, n_blocks, block, back, ahead)[:, :, :, None, :]

    # One boolean mask (broadcastable to (B, H, nb, T, S)) from the tile mask, out-of-range keys and padding.
    mask = None if allow is None else allow.view(1, 1, 1, T, span)
    if tile_mask is not None:
        mask = _and(mask, tile_mask)
    if not single and rows is None and (back or ahead or padded):  # span columns that are keys: [0, Nk)
        mask = _and(mask, key_spans(_pad_seq(q.new_ones(1, 1, Nk, dtype=torch.bool), padded)))
    if key_valid is not None:
        mask = _and(mask, key_spans(_pad_seq(key_valid, padded)))
    if groups is not None:
        groups = _pad_seq(groups, padded)
        mask = _and(mask, groups.view(B, H, n_blocks, block, 1) == key_spans(groups))
    if exclude_self:
        if Nk != Nq:
            raise ValueError("exclude_self needs self-attention (as many keys as queries)")
        if mask is None:
            mask = torch.ones(1, 1, 1, block, span, dtype=torch.bool, device=q.device)
        mask = mask.expand(B, H, n_blocks, block, span)
        own_allowed = mask.diagonal(offset=back * block, dim1=-2, dim2=-1)  # (B, H, nb, T): span column r + back·T
        others = mask.sum(-1) > own_allowed.int()  # another key is allowed
        own = shift_invariant_mask(block, back, ahead, lambda d: d == 0, device=q.device)  # that column
        mask = mask & ~(own & others[..., None])

    if rel_pos is not None and positions is not None:
        positions = _pad_seq(positions, padded)
        rel_delta = key_spans(positions) - positions.view(B, H, n_blocks, block, 1)  # (B, H, nb, T, S): key - query
    rel, key_table, value_table, offset = None, None, None, 0
    if rel_pos is not None:
        if (rel_unit is None) == (rel_delta is None):
            raise ValueError("relative positions need exactly one of rel_unit and rel_delta")
        if rel_unit is not None and rel_band is not None:  # strip column t: span column r + offset + t
            offset, width = rel_band
            delta = (torch.arange(width, device=q.device) + offset - back * block) * rel_unit
            key_table, value_table = rel_pos.tables(delta, qt.dtype)  # (W, D)
        else:
            rel = _RelTerms(rel_pos, qt, T, span, back, rel_unit, rel_delta)
    if rel is None:
        out, lse, _ = _tile_attention(qt, k, v, list(windows), mask, key_table, value_table, offset, need_lse)
        lse = lse if need_lse else None
    else:  # irregular relative distances: plain autograd
        kt, vt = (_windows(x, windows).view(B, H, n_blocks, span, D) for x in (k, v))
        scores = rel.add_scores(qt @ kt.transpose(-1, -2))
        if mask is not None:
            scores = scores.masked_fill(~mask, neg_inf(scores.dtype))
        probs = torch.softmax(scores, -1)
        out = probs @ vt + rel.values(probs)
        lse = torch.logsumexp(scores.to(lse_dtype(scores.dtype)), -1) if need_lse else None
    # A row whose every key is masked would average the masked values: zero it, and give it lse = neg_inf exactly
    # (see ``neg_inf``). Only data-dependent masks (padding, per-tile masks) or a static mask with an empty row can
    # empty a real row; out-of-range keys and groups cannot (a query always has its own key in range and in its
    # group), and padded rows are cut off below.
    if mask is not None and rows is None and (key_valid is not None or tile_mask is not None or empty_rows):
        empty = ~mask.any(-1)  # (…, nb, T)
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


def merge_partials(parts: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Merge attention over disjoint key sets: [(out_i, lse_i)] each (B, H, N, D), (B, H, N) -> (out, lse).

    softmax over the union = Σ_i exp(lse_i - lse) · softmax_i, with lse = logsumexp_i(lse_i). Exact; computed in
    the lse dtype (float32 or wider) and returned in the dtype of the outputs. O(P · N · D) for P parts. A key
    in several parts counts once per part (softmax over the multiset union: its score is raised by log(count)).
    """
    lse = torch.logsumexp(torch.stack([part_lse for _, part_lse in parts]), 0)  # (B, H, N)
    out = sum(o.to(lse.dtype) * (part_lse - lse).exp()[..., None] for o, part_lse in parts)
    return out.to(parts[0][0].dtype), lse


def shift_invariant_mask(block: int, back: int, ahead: int, rule, *, device: torch.device | None = None) -> Tensor:
    """Tile mask (block, S) on ``device`` from ``rule(delta)`` with delta = key index - query index (a LongTensor)."""
    span = (back + 1 + ahead) * block
    delta = torch.arange(span, device=device)[None, :] - back * block - torch.arange(block, device=device)[:, None]
    return rule(delta)


def band_tiling(window: int, n: int, causal: bool) -> tuple[int, int, int]:
    """(block, back, ahead) for a sliding window: blocks of queries, each with as many neighbouring key blocks as
    the window reaches.

    Block: ``window`` below 128, else half a window (a span of 1.5 windows instead of 2: a quarter fewer scores,
    with matmuls still large enough; measured faster on CPU for windows >= 128, slower below).
    """
    block = min(window if window < 128 else -(-window // 2), n)
    n_blocks = -(-n // block)
    reach = min(math.ceil((window - 1) / block), n_blocks - 1)
    return block, reach, 0 if causal else reach


def band_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    window: int,
    causal: bool,
    scale: float,
    key_valid: Tensor | None = None,
    restrict: KeyRestrictions | None = None,
    rel_pos: RelativePositions | None = None,
    rel_unit: int = 1,
    need_lse: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Sliding window over the sequence order of q, k, v: causal i - window < j <= i, else |i - j| < window.

    q, k, v: (B, H, N, D); key_valid: (B, 1 or H, N) or None -> out (B, H, N, D) and lse (B, H, N) or None, as in
    ``tiled_attention``. Relative distances are ``rel_unit`` times the index difference, or, with
    ``restrict.positions``, taken between those positions (``restrict``: ``KeyRestrictions``, as routing uses to
    attend in a sorted order, within clusters). Queries in blocks of ``band_tiling``: time O(N · window · D),
    memory O(N · window).
    """
    n = q.shape[2]
    block, back, ahead = band_tiling(window, n, causal)
    if causal:
        allow = shift_invariant_mask(block, back, ahead, lambda d: (d <= 0) & (d > -window), device=q.device)
    else:
        allow = shift_invariant_mask(block, back, ahead, lambda d: d.abs() < window, device=q.device)
    # Row r of a tile may see span columns r + back·block - (window - 1) onwards: window of them when causal,
    # 2·window - 1 otherwise. back·block >= window - 1 keeps that strip inside the tile.
    band = (back * block - (window - 1), window if causal else 2 * window - 1)
    by_positions = restrict is not None and restrict.positions is not None
    return tiled_attention(
        q, k, v, block=block, back=back, ahead=ahead, allow=allow, scale=scale, key_valid=key_valid,
        restrict=restrict, rel_pos=rel_pos, rel_unit=None if by_positions else rel_unit,
        rel_band=band if back * block >= window - 1 and not by_positions else None, need_lse=need_lse,
    )


def _and(a: Tensor | None, b: Tensor) -> Tensor:
    return b if a is None else a & b
