"""The flex executor's one operation, ``tiled``, with the tiled executor's signature and results
(the band, block diagonal, key subsets and columns come to it as tilings, ``executors.pieces``).

It turns its arguments into one ``FlexPattern`` and runs ``attend``: one FlexAttention call (plus, with
relative positions, the banded value pass and, for two-sided patterns with clipped distances, a second call for the
right side's mass), then the exclude-self fallback.

Under a compiled model (``compile = true``) ``tiled`` and ``flex_ranges`` are not traced into the model's graph
(``torch.compiler.disable``): the flex call compiles on its own, with static shapes, as in an eager model. Traced,
the block masks' data-dependent sizes turned symbolic after a recompilation, and inductor's FlexAttention lowering
failed on the symbolic integers the mask and score functions capture ("'ShapeAsConstantBuffer' object has no
attribute 'dtype'", torch 2.11, H200).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..inputs import Inputs, RelTerms
from ..lse import saw_key
from ..relative import RelativePositions
from ..tiling import KeyRestrictions, Tiling
from .blocks import block_mask
from .call import flex_call
from .pattern import FlexPattern, Rule, data_rule, index_delta, lookup, positions_delta, without_self
from .score_terms import ScoreTerms, key_scores, own_score, score_mod, value_term


def attend(pattern: FlexPattern, q: Tensor, k: Tensor, v: Tensor, *, scale: float,
           rel_pos: RelativePositions | None, need_lse: bool, bias: Rule | None = None) -> tuple[Tensor, Tensor | None]:
    """Attention of q (B, H, Nq, D) to k, v (B, H, Nk, D) under ``pattern`` -> (out, lse or None); ``bias``:
    (b, h, i, j) -> an additive score term. The ``BlockMask`` is the pattern's own where it has one, else built
    from its reach (``blocks.block_mask``). The kernel's ``score_mod`` adds the relative key term and the bias; the
    passes that recompute scores outside the kernel (the relative value term, the own-key fallback) add both too."""
    B, H = q.shape[:2]
    qa = None if rel_pos is None else key_scores(q, rel_pos, scale)
    mod = None if qa is None and bias is None else score_mod(qa, pattern.delta, rel_pos, pattern.nq, bias)
    mask = block_mask(pattern, B, H, q.device) if pattern.block_mask is None else pattern.block_mask
    out, lse = flex_call(q, k, v, block_mask=mask, scale=scale, score_mod=mod)
    if rel_pos is not None:
        out = out + value_term(pattern, q, k, lse, ScoreTerms(qa, rel_pos, bias), scale,
                               lambda: _right_lse(pattern, q, k, v, mod, rel_pos, scale))
    if pattern.exclude_self:
        out, lse = _own_key_fallback(pattern, (q, k, v), out, lse, ScoreTerms(qa, rel_pos, bias), scale)
    return out, lse if need_lse else None


def _right_lse(pattern: FlexPattern, q, k, v, mod, rel_pos: RelativePositions, scale: float) -> Tensor:
    """Log-sum-exp over the keys at distance >= max_distance (the right side's clipped keys)."""
    far, delta = pattern.allowed, pattern.delta

    def allowed(b, h, i, j):
        return far(b, h, i, j) & (delta(b, h, i, j) >= rel_pos.max_distance)

    unlabelled = None
    if pattern.labels is not None:
        near = pattern.unlabelled

        def unlabelled(b, h, i, j):
            return near(b, h, i, j) & (delta(b, h, i, j) >= rel_pos.max_distance)

    right = FlexPattern(pattern.nq, pattern.nk, allowed, pattern.reach, pattern.per_head,
                        None if pattern.cache_key is None else (*pattern.cache_key, "right", rel_pos.max_distance),
                        labels=pattern.labels, unlabelled=unlabelled)
    return flex_call(q, k, v, block_mask=block_mask(right, q.shape[0], q.shape[1], q.device), scale=scale,
                     score_mod=mod)[1]


def _own_key_fallback(pattern: FlexPattern, qkv: tuple[Tensor, Tensor, Tensor], out: Tensor, lse: Tensor,
                      terms: ScoreTerms, scale: float) -> tuple[Tensor, Tensor]:
    """Shared-QK attention: a query that saw no other key attends to its own key alone (if it may): its output is
    v_i (+ a^V(0)), its lse the own score with the key term of distance 0 and the bias at (i, i)."""
    q, k, v = qkv
    B, H, N, _ = q.shape
    b = torch.arange(B, device=q.device).view(B, 1, 1)
    h = torch.arange(H, device=q.device).view(1, H, 1)
    i = torch.arange(N, device=q.device).view(1, 1, N)
    alone = ~saw_key(lse) & pattern.own(b, h, i, i).expand(B, H, N)
    rel_pos = terms.rel_pos
    own = v if rel_pos is None else v + rel_pos.tables(0, v.dtype)[1]  # the value term of distance 0
    out = torch.where(alone[..., None], own, out)
    s = own_score(q, k, terms.qa, rel_pos, scale)
    if terms.bias is not None:
        s = s + terms.bias(b, h, i, i).to(s.dtype)
    lse = torch.where(alone, s.to(lse.dtype), lse)
    return out, lse


def _finish(pattern_args: dict, rule, exclude: bool) -> dict:
    if exclude:
        pattern_args.update(own=rule, allowed=without_self(rule), exclude_self=True)
    else:
        pattern_args.update(allowed=rule)
    return pattern_args


def _offsets(lo: int, hi: int, unit: int, rel_pos: RelativePositions | None, by_index: bool) -> tuple:
    """The value pass's frame for keys at offsets [lo, hi] of their query (``FlexPattern.frame``): only the near
    ones when distances are ``unit`` times the offset and the clip is nearer than the reach."""
    if rel_pos is None or not by_index:
        return ("offsets", lo, hi, True, None)
    m = (rel_pos.max_distance - 1) // unit
    if -m <= lo and hi <= m:
        return ("offsets", lo, hi, True, unit)
    return ("offsets", max(lo, -m), min(hi, m), False, unit)


def _tile_offsets(tiling: Tiling, nq: int, nk: int) -> tuple[int, int]:
    """Smallest and largest key index - query index of the tile entries (every entry of the tile, whatever
    ``allow`` permits: reading the offsets it permits would be a host read of a device tensor at every call, so a
    mask narrower than its tile enumerates offsets it never allows, at no cost to the results). Host arithmetic on
    the tiling's sizes (``Tiling.index_offsets``: s - base - r for row r and span column s)."""
    _, T, S = tiling.shape(nq, nk)
    base = 0 if tiling.single(nq) else tiling.back * tiling.block
    return -base - (T - 1), S - 1 - base


@torch.compiler.disable  # under a compiled model: see the module's docstring
def tiled(inputs: Inputs, tiling: Tiling, *, restrict: KeyRestrictions | None = None, rel: RelTerms | None = None,
          bias: Tensor | None = None, need_lse: bool = False) -> tuple[Tensor, Tensor | None]:
    """``tiles.tiled_attention`` on FlexAttention: query block b sees key blocks b - back … b + ahead under the
    tiling's masks, as one exact rule (``executors.Executor.tiled`` documents and checks the arguments). ``bias``
    is added in the kernel's ``score_mod`` and wherever scores are recomputed (``attend``)."""
    q, k, v, scale, key_valid = inputs.q, inputs.k, inputs.v, inputs.scale, inputs.key_valid
    rel_pos, distances = (None, None) if rel is None else (rel.tables, rel.distances)
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    groups, exclude = (None, False) if restrict is None else (restrict.groups, restrict.exclude_self)
    single = tiling.single(Nq)
    n_tiles, T, S = tiling.shape(Nq, Nk)
    allow, offsets = tiling.allow, tiling.offsets
    tile_mask, rel_delta, bias = (None if x is None else x.view(*(1,) * (5 - x.dim()), *x.shape)
                                  for x in (tiling.tile_mask, None if distances is None else distances.delta, bias))
    positioned = distances is not None and distances.positions is not None
    # packed documents (groups that never decrease, one per batch row) and nothing else per row or head: the block
    # tables are the static pattern's, narrowed by each block's documents (``blocks._labelled``)
    labels = groups if (groups is not None and restrict.sorted_groups and groups.shape[1] == 1 and Nq == Nk
                        and key_valid is None and tile_mask is None and bias is None and not positioned
                        and (rel_delta is None or rel_delta.shape[:2] == (1, 1))) else None

    def cell(i, j):  # (tile, row, span column) of a pair, clamped for lookups
        tile, r, s = tiling.cell(i, j, Nq)
        return tile.clamp(0, n_tiles - 1), r.clamp(0, T - 1), s.clamp(0, S - 1)

    def rule_of(data):
        def rule(b, h, i, j):
            s = tiling.cell(i, j, Nq)[2]
            ok = data(b, h, i, j) & (s >= 0) & (s < S)
            tile, r, s = cell(i, j)
            if allow is not None:
                ok = ok & allow[r, s]
            if offsets is not None:
                ok = ok & (j - i >= offsets[0]) & (j - i <= offsets[1])
            if tile_mask is not None:
                ok = ok & lookup(tile_mask, b, h, tile, r, s)
            return ok

        return rule

    rule = rule_of(data_rule(Nq, Nk, key_valid, groups))

    def reach(first, last):
        lo, hi = tiling.key_reach(first, last, Nq, Nk)
        if offsets is not None:
            lo, hi = torch.maximum(lo, first + offsets[0]), torch.minimum(hi, last + offsets[1])
        return lo, hi

    delta = None
    frame: tuple = ("all",)
    by_index = distances is not None and distances.unit is not None
    if positioned:
        delta = positions_delta(distances.positions, Nq)
    elif rel_delta is not None:
        def delta(b, h, i, j):
            return lookup(rel_delta, b, h, *cell(i, j))
    elif by_index:
        delta = index_delta(distances.unit)
    one_sided = False
    if rel_pos is not None and rel_delta is None and Nq == Nk:  # offsets of the keys a tile may hold
        lo, hi = offsets if offsets is not None else _tile_offsets(tiling, Nq, Nk)
        frame = _offsets(lo, hi, distances.unit if by_index else 1, rel_pos, by_index)
        one_sided = hi <= 0
    extra = None
    if bias is not None:
        def extra(b, h, i, j):
            return lookup(bias, b, h, *cell(i, j))
    per_head = (key_valid is not None or groups is not None or tile_mask is not None or positioned
                or bias is not None)
    cacheable = (not per_head or labels is not None) and allow is None and rel_delta is None
    cache_key = ("tiled", single, T, tiling.block, tiling.back, tiling.ahead, offsets) if cacheable else None
    args = dict(nq=Nq, nk=Nk, reach=reach, per_head=per_head, cache_key=cache_key, delta=delta, frame=frame,
                one_sided=one_sided)
    if labels is not None:
        unlabelled = rule_of(data_rule(Nq, Nk, None, None))
        args.update(labels=labels, unlabelled=without_self(unlabelled) if exclude else unlabelled)
    return attend(FlexPattern(**_finish(args, rule, exclude)), q, k, v, scale=scale, rel_pos=rel_pos,
                  need_lse=need_lse, bias=extra)


__all__ = ["attend", "tiled"]
