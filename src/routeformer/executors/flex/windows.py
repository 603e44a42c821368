"""The sorted window (``pieces.SortedWindow``: routing's paper rule) on FlexAttention, from one key interval per
query.

In the sequence sorted by (cluster, position) the keys a query sees are one interval [lo_s, hi_s] of sorted
indices whose bounds never decrease (``SortedWindow.intervals``). So the rule inside the kernel (``mask_mod``) is two
comparisons against per-row bounds, and the ``BlockMask`` is C = ceil((window - 1) / 128) + 1 key blocks wide (twice
the reach + 1 when not causal), built from the bounds of each block's first and last rows by a fixed number of
operations whatever N is (``blocks.interval_block_mask``), kv-major and q-major. Laid out as a band restricted to
groups instead, the generic builder evaluates the rule on every candidate pair, in chunks: ~870 operators for a
forward at N = 65,536 (issue 56), its time bound by launching them.

Shared QK: with every key real, the own key is left out of the interval itself wherever an earlier key is in the
window (hi_s = s - 1), so no pass follows the kernel; with padding, which keys are real decides whether a query is
alone, so the rule leaves the diagonal out and the executor's own-key fallback (``ops.attend``) runs after. LSH's
rounds (``own_key=False``, and the pairs earlier rounds hold as ``KeyRestrictions.labels``): the labels are two
more comparisons per earlier round in the rule, and no block is full.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..inputs import Inputs, RelTerms
from ..lowering import from_order, to_order
from ..pieces import SortedWindow
from ..tiling import KeyRestrictions
from . import blocks
from .ops import attend
from .pattern import FlexPattern, lookup, positions_delta
from .rows import moved


@torch.compiler.disable  # under a compiled model: see ops.py's docstring
def sorted_window(inputs: Inputs, piece: SortedWindow, *, restrict: KeyRestrictions | None, rel: RelTerms | None,
                  bias: Tensor | None, need_lse: bool) -> tuple[Tensor, Tensor | None]:
    """The flex executor's ``SortedWindow`` (``Executor.tiled`` documents the arguments and checked them, the
    restrictions as laid out: ``groups`` is the piece's ``grouped``). Time O(N · (window + 128) · D) in the kernel,
    O(N · window / 128) for the block tables."""
    if bias is not None:
        raise ValueError("the flex executor's SortedWindow takes no bias")
    if rel is not None and rel.distances.positions is None:
        raise ValueError("relative distances in a SortedWindow are between positions (Distances.positions: the "
                         "sorted entries' own)")
    exclude_self = restrict is not None and restrict.exclude_self
    ordered, inverse = to_order(inputs, piece.order, piece.inverse, kernel=moved)
    q, k, v, valid = ordered.q, ordered.k, ordered.v, ordered.key_valid
    B, H, N, _ = q.shape
    # Shared QK, every key real: the own key out of the interval itself. With padding (or two-sided): the diagonal
    # out in the rule, and the fallback after the kernel gives a query that saw no real key its own. Without its
    # own key at all (LSH's rounds): out of a causal interval, out of a two-sided one by the rule.
    trimmed = exclude_self and valid is None and piece.causal
    fallback = exclude_self and not trimmed
    lo, hi = piece.intervals(own_when_alone=trimmed)
    no_diagonal = fallback or (not piece.own_key and not piece.causal)
    held = [] if restrict is None or restrict.labels is None else \
        [restrict.labels[:, :, x].contiguous() for x in range(restrict.labels.shape[2])]
    label_window = 0 if restrict is None else restrict.label_window

    # The rule reads one int32 bound per row where the other follows from it (causal: hi_s is s, s - 1, or s - 1
    # unless the row is alone, as ``SortedWindow.intervals`` makes it; test_flex_windows holds the two together),
    # and skips the index checks where N fills whole blocks: the kernel evaluates it on every pair of a partial
    # block, so each load and comparison here is paid ~window times per row.
    lo32, hi32 = lo.to(torch.int32), None if piece.causal else hi.to(torch.int32)
    ragged = N % blocks.BLOCK != 0  # the last block's padding is evaluated too: clamp and test the indices

    def within(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        ic = i.clamp(max=N - 1) if ragged else i
        first = lookup(lo32, b, h, ic)
        if not piece.causal:
            ok = (first <= j) & (j <= lookup(hi32, b, h, ic))
        elif not piece.own_key:  # hi = s - 1
            ok = (first <= j) & (j < i)
        elif trimmed:  # hi = s - 1 where an earlier key is in the window (first < s), else s
            ok = (first <= j) & ((j < i) | ((j == i) & (first == i)))
        else:  # hi = s
            ok = (first <= j) & (j <= i)
        if ragged:
            ok = ok & (i < N) & (j < N)
        return ok if valid is None else ok & lookup(valid, b, h, j.clamp(max=N - 1) if ragged else j)

    def allowed(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        ok = within(b, h, i, j)
        if no_diagonal:
            ok = ok & (i != j)
        ic, jc = i.clamp(max=N - 1), j.clamp(max=N - 1)
        for labels in held:  # a pair an earlier call holds (LSH's earlier rounds) is left to it
            ok = ok & ((lookup(labels, b, h, ic) - lookup(labels, b, h, jc)).abs() >= label_window)
        return ok

    block = blocks.BLOCK
    nb = -(-N // block)
    reach = math.ceil((piece.window - 1) / block)
    span = piece.window - 1

    def key_reach(first: Tensor, last: Tensor) -> tuple[Tensor, Tensor]:  # the band's, for the generic builder
        return first - span, last + (0 if piece.causal else span)

    whole = None
    if held:  # the labels may leave out a pair anywhere: no block is full, the rule tests every one
        whole = torch.zeros(1, 1, nb, dtype=torch.bool, device=q.device)
    elif valid is not None:  # a key block with a padded key is never full: the rule must test its keys
        whole = F.pad(valid, (0, nb * block - N), value=True).view(*valid.shape[:2], nb, block).all(-1)
    mask = blocks.interval_block_mask(lo, hi, (reach, 0 if piece.causal else reach), allowed,
                                      diagonal=not no_diagonal, key_blocks_whole=whole, block=block)
    pattern = FlexPattern(
        nq=N, nk=N, allowed=allowed, reach=key_reach, per_head=True, cache_key=None,
        delta=None if rel is None else positions_delta(rel.distances.positions, N),
        frame=("offsets", -span, 0 if piece.causal else span, True, None), one_sided=piece.causal,
        exclude_self=fallback, own=within if fallback else None, block_mask=mask)
    out, lse = attend(pattern, q, k, v, scale=ordered.scale, rel_pos=None if rel is None else rel.tables,
                      need_lse=need_lse or fallback)
    return from_order(out, lse if need_lse else None, piece.order, inverse, kernel=moved)


__all__ = ["sorted_window"]
