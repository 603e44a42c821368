"""The tiled executor: how every sparse pattern is computed without an N×N matrix.

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

import torch
import torch.nn.functional as F
from torch import Tensor

from .relative import RelativePositions


def neg_inf(dtype: torch.dtype) -> float:
    """The score given to masked entries: finite, so an all-masked row stays NaN-free, yet exp(it - max) == 0.

    Also the lse ``tiled_attention`` returns, exactly, for a row that sees no key: ``neg_inf(lse.dtype)``, with lse
    in float32 or wider, so it lies below ``neg_inf(d) / 2`` for the dtype d of any input, and ``merge_partials``
    gives such a part weight 0 (or, merging only empty parts, keeps the merged lse there).
    """
    return torch.finfo(dtype).min


def saw_key(lse: Tensor) -> Tensor:
    """Rows of an lse from ``tiled_attention`` (or merged from them) that saw at least one key."""
    return lse > neg_inf(lse.dtype) / 2


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """lse is kept in float32 or wider: merging half-precision lse values would cost more than the softmax."""
    return torch.promote_types(dtype, torch.float32)


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


# The fused tile attention is a custom operator: opaque to torch.compile, whose functionalisation cannot follow the
# in-place writes through strided views that make it memory-lean. Forward and backward are ops of their own.

@torch.library.custom_op("routeformer::tile_attention", mutates_args=())
def _tile_attention(qt: Tensor, k: Tensor, v: Tensor, windows: list[int], mask: Tensor | None,
                    key_table: Tensor | None, value_table: Tensor | None, offset: int,
                    need_lse: bool) -> tuple[Tensor, Tensor, Tensor]:
    """softmax(q·kᵀ + rel) · v over tiles, holding two (…, T, S) buffers per step instead of five.

    Returns (out (B, H, nb, T, D), lse (B, H, nb, T) or empty, probs). Queries come as tiles (B, H, nb, T, D),
    computed as X = B·H·nb batched matmuls; keys and values as ``_key_source`` rows whose spans ``_windows`` views
    without a copy. Forward computes the scores, adds the relative-position strip, masks and normalises them in one
    buffer and keeps only the probabilities. Relative positions (optional) come in strip form: ``key_table`` and
    ``value_table`` (W, D) hold a^K and a^V of strip column t, the strip of row r starting at span column
    r + ``offset``; every strip product is a bmm on a strided view.
    """
    lead, (T, D) = qt.shape[:3], qt.shape[3:]
    q3 = qt.reshape(-1, T, D)  # (X, T, D)
    tiles = q3.shape[0]
    kt, vt = _windows(k, windows), _windows(v, windows)  # (X, S, D) views, no copy
    scores = torch.bmm(q3, kt.transpose(1, 2))  # (X, T, S)
    width = 0 if key_table is None else key_table.shape[0]
    if key_table is not None:  # s_ij += q_i·a^K_ij on the strip
        _strip(scores, offset, width).baddbmm_(q3, key_table.T.expand(tiles, -1, -1))
    if mask is not None:
        scores.view(*lead, T, -1).masked_fill_(~mask, neg_inf(scores.dtype))
    peak = scores.amax(-1) if need_lse else None
    probs = _softmax_(scores)
    out = torch.bmm(probs, vt)  # (X, T, D)
    if value_table is not None:  # o_i += Σ_j p_ij a^V_ij
        out.baddbmm_(_strip(probs, offset, width), value_table.expand(tiles, -1, -1))
    acc = _lse_dtype(scores.dtype)
    if need_lse:  # lse = max(s) - log(max(p)): no second pass of exponentials
        lse = (peak.to(acc) - probs.amax(-1).to(acc).log()).view(*lead, T)
    else:
        lse = q3.new_empty(0, dtype=acc)
    return out.view(*lead, T, D), lse, probs


@_tile_attention.register_fake
def _(qt, k, v, windows, mask, key_table, value_table, offset, need_lse):
    lead, (T, D) = qt.shape[:3], qt.shape[3:]
    tiles, block, reach = windows
    acc = _lse_dtype(qt.dtype)
    lse = qt.new_empty(*lead, T, dtype=acc) if need_lse else qt.new_empty(0, dtype=acc)
    return qt.new_empty(*lead, T, D), lse, qt.new_empty(tiles, T, (reach + 1) * block)


@torch.library.custom_op("routeformer::tile_attention_backward", mutates_args=())
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
    kt, vt = _windows(k, windows), _windows(v, windows)
    width = 0 if key_table is None else key_table.shape[0]
    acc = _lse_dtype(out.dtype)
    grad_p = torch.bmm(grad3, vt.transpose(1, 2))  # (X, T, S)
    if value_table is not None:
        _strip(grad_p, offset, width).baddbmm_(grad3, value_table.T.expand(tiles, -1, -1))
    row = (grad3.to(acc) * out3.to(acc)).sum(-1, keepdim=True)  # Σ_j p_ij dp_ij
    if grad_lse is not None and grad_lse.numel():  # d lse / d s = p
        row = row - grad_lse.reshape(tiles, T, 1).to(acc)
    grad_s = grad_p.sub_(row).mul_(probs)  # ds = p ∘ (dp - row), in place
    grad_q = torch.bmm(grad_s, kt)
    grad_k = _fold(torch.bmm(grad_s.transpose(1, 2), q3), windows)
    grad_v = _fold(torch.bmm(probs.transpose(1, 2), grad3), windows)
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
    qt, k, v, windows, mask, key_table, value_table, offset, need_lse = inputs
    out, _, probs = output
    ctx.save_for_backward(qt, k, v, probs, out, key_table, value_table)
    ctx.windows, ctx.offset = windows, offset


def _tile_backward(ctx, grad_out, grad_lse, grad_probs):
    qt, k, v, probs, out, key_table, value_table = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    gq, gk, gv, gkey, gvalue = _tile_attention_backward(grad_out, grad_lse, qt, k, v, probs, out, key_table,
                                                        value_table, ctx.windows, ctx.offset)
    return (gq, gk, gv, None, None, gkey if key_table is not None else None,
            gvalue if value_table is not None else None, None, None)


_tile_attention.register_autograd(_tile_backward, setup_context=_tile_setup)


def _key_source(x: Tensor, n_blocks: int, block: int, back: int, ahead: int) -> Tensor:
    """Rows (back·T + X·T + ahead·T, D) of x (B, H, N, D): each head padded to nb·T, all heads flattened, then
    back·T rows before and ahead·T after. Span s of global block g is then row g·T + s: one stride for all tiles,
    so ``_windows`` is a view bmm reads directly. Spans that reach into a neighbouring head read finite values that
    the in-range mask removes."""
    B, H, N, D = x.shape
    if n_blocks * block == N and not (back or ahead):
        return x.contiguous().view(B * H * N, D)  # row r at r · D; no copy when x is contiguous
    return _KeyRows.apply(x, n_blocks, block, back, ahead)


class _KeyRows(torch.autograd.Function):
    """``_key_source`` with padding: x written once into a zeroed buffer; the gradient is a view of the rows'."""

    @staticmethod
    def forward(x: Tensor, n_blocks: int, block: int, back: int, ahead: int) -> Tensor:
        B, H, N, D = x.shape
        rows = x.new_zeros((back + B * H * n_blocks + ahead) * block, D)
        rows[back * block:(back + B * H * n_blocks) * block].view(B, H, n_blocks * block, D)[:, :, :N] = x
        return rows

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, n_blocks, block, back, ahead = inputs
        ctx.shape, ctx.n_blocks, ctx.block, ctx.back = x.shape, n_blocks, block, back

    @staticmethod
    def backward(ctx, grad: Tensor):
        B, H, N, D = ctx.shape
        T, nb = ctx.block, ctx.n_blocks
        body = grad[ctx.back * T:(ctx.back + B * H * nb) * T].reshape(B, H, nb * T, D)
        return body[:, :, :N], None, None, None, None


def _windows(x: Tensor, windows: tuple[int, int, int]) -> Tensor:
    """Spans (X, S, D) of key rows x from ``_key_source``, S = (reach + 1) · block, as an overlapping view.

    ``windows = (X, block, reach)``: X tiles, whose spans start ``block`` rows apart (a single tile over Nk keys
    has block = Nk and reach = 0)."""
    tiles, block, reach = windows
    D = x.shape[-1]
    return x.as_strided((tiles, (reach + 1) * block, D), (block * D, D, 1))  # keeps x's own storage offset


def _fold(grad: Tensor, windows: tuple[int, int, int]) -> Tensor:
    """Gradient of ``_windows``: the overlapping spans (X, S, D) summed back into key rows."""
    tiles, block, reach = windows
    D = grad.shape[-1]
    out = grad.new_zeros(tiles + reach, block, D)
    for o in range(reach + 1):
        out[o:o + tiles] += grad[:, o * block:(o + 1) * block]
    return out.view((tiles + reach) * block, D)


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
    groups: Tensor | None = None,
    exclude_self: bool = False,
    rel_pos: RelativePositions | None = None,
    rel_unit: int | None = None,
    rel_delta: Tensor | None = None,
    rel_positions: Tensor | None = None,
    rel_band: tuple[int, int] | None = None,
    empty_rows: bool = False,
    need_lse: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Attention of query blocks to spans of key blocks.

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
        groups: optional integer (B, H, N) (self-attention only): a query sees only keys of its own group.
        exclude_self: (self-attention only) a query does not see the key at its own index unless no other key is
            allowed (shared-QK attention, where q_i·k_i would dominate).
        rel_pos: optional relative position tables, with the position distance of every tile entry given by
            ``rel_unit`` (shift-invariant tiles: delta = rel_unit · (key index - query index)) and, optionally,
            ``rel_band = (offset, width)``: every key a row r may see lies in span columns
            [r + offset, r + offset + width), which lets the relative terms be computed on that strip alone;
            or ``rel_delta`` (any integer tensor broadcastable to (B, H, n_blocks, block, S), computed with
            gathers), or ``rel_positions`` (B, H, N) (self-attention: the position of every sequence entry, for
            sequences in a permuted order; distances are taken between those positions, with gathers).
        empty_rows: ``allow`` may leave a query row without any key (declared by the caller, who built it).
        need_lse: also return the log-sum-exp of each row's scores, for ``merge_partials``.

    Returns:
        out (B, H, Nq, D) with zeros for rows that see no key, and lse (B, H, Nq) in float32 or wider (rows that
        see no key get exactly ``neg_inf(lse.dtype)``, see ``saw_key``) or ``None``.
    """
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    single = back == 0 and ahead == 0 and block >= Nq
    if single:
        block, n_blocks, span = Nq, 1, Nk
    else:
        if Nk != Nq:
            raise ValueError(f"banded tiles need as many keys as queries, got {Nq} queries and {Nk} keys")
        n_blocks, span = -(-Nq // block), (back + 1 + ahead) * block
    padded = n_blocks * block - Nq
    if allow is not None and tuple(allow.shape) != (block, span):
        raise ValueError(f"tile mask must have shape {(block, span)}, got {tuple(allow.shape)}")

    q = _pad_seq((q * scale).contiguous(), padded)  # an elementwise op keeps a transposed input's layout
    qt = q.view(B, H, n_blocks, block, D)  # (B, H, nb, T, D), contiguous
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
    mask = None if allow is None else allow.view(1, 1, 1, block, span)
    if tile_mask is not None:
        mask = _and(mask, tile_mask)
    if not single and (back or ahead or padded):  # span columns that are real key indices in [0, Nq)
        mask = _and(mask, key_spans(_pad_seq(q.new_ones(1, 1, Nq, dtype=torch.bool), padded)))
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

    if rel_pos is not None and rel_positions is not None:
        positions = _pad_seq(rel_positions, padded)
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
            rel = _RelTerms(rel_pos, qt, block, span, back, rel_unit, rel_delta)
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
        lse = torch.logsumexp(scores.to(_lse_dtype(scores.dtype)), -1) if need_lse else None
    # A row whose every key is masked would average the masked values: zero it, and give it lse = neg_inf exactly
    # (see ``neg_inf``). Only data-dependent masks (padding, per-tile masks) or a static mask with an empty row can
    # empty a real row; out-of-range keys and groups cannot (a query always has its own key in range and in its
    # group), and padded rows are cut off below.
    if mask is not None and (key_valid is not None or tile_mask is not None or empty_rows):
        empty = ~mask.any(-1)  # (…, nb, T)
        out = out.masked_fill(empty[..., None], 0.0)
        if lse is not None:
            lse = lse.masked_fill(empty, neg_inf(lse.dtype))

    out = out.reshape(B, H, n_blocks * block, D)[:, :, :Nq]
    if lse is not None:
        lse = lse.reshape(B, H, n_blocks * block)[:, :, :Nq]
    return out, lse


def merge_partials(parts: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Merge attention over disjoint key sets: [(out_i, lse_i)] each (B, H, N, D), (B, H, N) -> (out, lse).

    softmax over the union = Σ_i exp(lse_i - lse) · softmax_i, with lse = logsumexp_i(lse_i). Exact; computed in
    the lse dtype (float32 or wider) and returned in the dtype of the outputs.
    """
    lse = torch.logsumexp(torch.stack([part_lse for _, part_lse in parts]), 0)  # (B, H, N)
    out = sum(o.to(lse.dtype) * (part_lse - lse).exp()[..., None] for o, part_lse in parts)
    return out.to(parts[0][0].dtype), lse


def shift_invariant_mask(block: int, back: int, ahead: int, rule, *, device: torch.device | None = None) -> Tensor:
    """Tile mask (block, S) on ``device`` from ``rule(delta)`` with delta = key index - query index (a LongTensor)."""
    span = (back + 1 + ahead) * block
    delta = torch.arange(span, device=device)[None, :] - back * block - torch.arange(block, device=device)[:, None]
    return rule(delta)


def block_diagonal_attention(q: Tensor, k: Tensor, v: Tensor, block: int, *, causal: bool, scale: float,
                             key_valid: Tensor | None, rel_pos: RelativePositions | None,
                             need_lse: bool = False) -> tuple[Tensor, Tensor | None]:
    """Attention within blocks of ``block`` positions (j <= i too when causal); block >= N is one dense tile."""
    size = min(block, q.shape[2])
    allow = torch.ones(size, size, dtype=torch.bool, device=q.device).tril() if causal else None
    return tiled_attention(q, k, v, block=size, allow=allow, scale=scale, key_valid=key_valid, rel_pos=rel_pos,
                           rel_unit=1, need_lse=need_lse)


def subset_attention(q: Tensor, k: Tensor, v: Tensor, key_idx: Tensor, allow: Tensor | None, *, scale: float,
                     key_valid: Tensor | None, rel_pos: RelativePositions | None,
                     need_lse: bool = False) -> tuple[Tensor, Tensor | None]:
    """Every query against the keys at positions ``key_idx`` (M,) only, under ``allow`` (N, M) (rows may be empty).

    One dense (N, M) tile of the gathered keys; relative distances key_idx[m] - i, by gathers.
    """
    N = q.shape[2]
    delta = None if rel_pos is None else key_idx[None, :] - torch.arange(N, device=q.device)[:, None]
    return tiled_attention(
        q, k[:, :, key_idx], v[:, :, key_idx], block=N, allow=allow, scale=scale,
        key_valid=None if key_valid is None else key_valid[:, :, key_idx], rel_pos=rel_pos, rel_delta=delta,
        empty_rows=True, need_lse=need_lse,
    )


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
    groups: Tensor | None = None,
    exclude_self: bool = False,
    rel_pos: RelativePositions | None = None,
    rel_unit: int = 1,
    rel_positions: Tensor | None = None,
    need_lse: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Sliding window over the sequence order of q, k, v: causal i - window < j <= i, else |i - j| < window.

    ``groups``, ``exclude_self`` and ``rel_positions`` as in ``tiled_attention`` (routing attends in a sorted
    order, within clusters, at distances between original positions); otherwise distances are ``rel_unit`` times
    the index difference.
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
    by_positions = rel_positions is not None
    return tiled_attention(
        q, k, v, block=block, back=back, ahead=ahead, allow=allow, scale=scale, key_valid=key_valid,
        groups=groups, exclude_self=exclude_self, rel_pos=rel_pos, rel_unit=None if by_positions else rel_unit,
        rel_positions=rel_positions, rel_band=band if back * block >= window - 1 and not by_positions else None,
        need_lse=need_lse,
    )


class _RelTerms:
    """The two relative-position terms of one tiling: q_i·a^K_ij on the scores and Σ_j p_ij a^V_ij on the output.

    Three ways, from fastest to most general:
    - strip (``rel_band``, handled by ``tiled_attention`` itself, not here): a sliding window's keys lie on a strip
      of the tile whose column t is at distance (t + offset - back·T) · unit for every row, so both terms are
      batched matmuls of q and p against the (W, D) tables on a strided view of the tile (inside the fused
      ``routeformer::tile_attention`` op), with no copy.
    - skew (``rel_unit`` alone): distance depends only on s - r, so the L = S + T - 1 distances of a tile are
      enumerated once, queries multiply that extended table, and a strided view picks row r's entries
      (Transformer-XL's relative shift); the value term is the transposed operation.
    - gather (``rel_delta``): queries multiply the whole table and each entry is gathered (scattered back for the
      value term). Used where distances are irregular (summary cells, global tokens).
    """

    def __init__(self, rel_pos: RelativePositions, qt: Tensor, block: int, span: int, back: int,
                 unit: int | None, delta: Tensor | None) -> None:
        """Skew with ``unit``, else gather with ``delta`` (exactly one is given)."""
        self.qt, self.block, self.span = qt, block, span
        self.index: Tensor | None = None
        dtype, device = qt.dtype, qt.device
        if unit is not None:  # extended column u: span column s = u - (T - 1) + r
            first = -(block - 1) - back * block
            delta = (torch.arange(span + block - 1, device=device) + first) * unit
            self.key_table, self.value_table = rel_pos.tables(delta, dtype)  # (L, D)
        else:
            self.key_table, self.value_table = rel_pos.key.to(dtype), rel_pos.value.to(dtype)  # (2k+1, D)
            self.index = rel_pos.index(delta.to(device))

    def _skew(self, x: Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """size, stride, offset of the view V[..., r, s] = X[..., r, s + T - 1 - r] of X (..., T, L), contiguous and
        starting its storage (a fresh result, as both callers' are)."""
        T, S = self.block, self.span
        return (*x.shape[:-1], S), (*x.stride()[:-2], S + T - 2, 1), T - 1

    def add_scores(self, scores: Tensor) -> Tensor:
        """scores (B, H, nb, T, S) plus q_i·a^K_ij (skew or gather)."""
        qa = self.qt @ self.key_table.T  # (B, H, nb, T, L) or (B, H, nb, T, 2k+1): fresh, contiguous, offset 0
        if self.index is None:
            return scores + qa.as_strided(*self._skew(qa))
        return scores + qa.gather(-1, self.index.expand(*qa.shape[:-1], self.index.shape[-1]))

    def values(self, probs: Tensor) -> Tensor:
        """Σ_j p_ij a^V_ij for probs (B, H, nb, T, S) -> (B, H, nb, T, D) (skew or gather)."""
        if self.index is None:
            ext = probs.new_zeros(*probs.shape[:-1], self.span + self.block - 1)
            ext = torch.as_strided_scatter(ext, probs, *self._skew(ext))
        else:
            ext = probs.new_zeros(*probs.shape[:-1], self.value_table.shape[0])
            ext = ext.scatter_add(-1, self.index.expand_as(probs), probs)
        return ext @ self.value_table


def _and(a: Tensor | None, b: Tensor) -> Tensor:
    return b if a is None else a & b


def _pad_seq(x: Tensor, extra: int) -> Tensor:
    """Pad dim 2 (the sequence) of x with ``extra`` zeros (False for bool) after it."""
    if extra == 0:
        return x
    pad = x.new_zeros(*x.shape[:2], extra, *x.shape[3:])
    return torch.cat([x, pad], dim=2)


def _span(x: Tensor, n_blocks: int, block: int, back: int, ahead: int) -> Tensor:
    """(B, H, nb·T) -> (B, H, nb, S): for each block, blocks b-back … b+ahead (zeros beyond the ends), a view of
    x padded with back·T zeros before and ahead·T after."""
    if back == 0 and ahead == 0:
        return x.view(*x.shape[:2], n_blocks, block)
    return F.pad(x, (back * block, ahead * block)).unfold(2, (back + 1 + ahead) * block, block)
