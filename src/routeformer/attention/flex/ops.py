"""The flex executor's two operations, ``tiled`` and ``band``, with the tiled executor's signatures and results
(``executors.Executor`` builds the block diagonal and key subsets from ``tiled``).

Each operation turns its arguments into one ``FlexPattern`` and runs ``attend``: one FlexAttention call (plus, with
relative positions, the banded value pass and, for two-sided patterns with clipped distances, a second call for the
right side's mass), then the exclude-self fallback.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..relative import RelativePositions
from ..tiles import KeyRestrictions, saw_key
from .blocks import block_mask
from .call import flex_call
from .pattern import FlexPattern, data_rule, full_range, index_delta, lookup, positions_delta, without_self
from .relative import key_scores, own_score, score_mod, value_term


def attend(pattern: FlexPattern, q: Tensor, k: Tensor, v: Tensor, *, scale: float,
           rel_pos: RelativePositions | None, need_lse: bool) -> tuple[Tensor, Tensor | None]:
    """Attention of q (B, H, Nq, D) to k, v (B, H, Nk, D) under ``pattern`` -> (out, lse or None)."""
    B, H = q.shape[:2]
    mod, qa = None, None
    if rel_pos is not None:
        qa = key_scores(q, rel_pos, scale)
        mod = score_mod(qa, pattern.delta, rel_pos.max_distance, pattern.nq)
    out, lse = flex_call(q, k, v, block_mask=block_mask(pattern, B, H, q.device), scale=scale, score_mod=mod)
    if rel_pos is not None:
        out = out + value_term(pattern, q, k, lse, qa, rel_pos, scale, lambda: _right_lse(pattern, q, k, v, mod,
                                                                                             rel_pos, scale))
    if pattern.exclude_self:
        out, lse = _own_key_fallback(pattern, q, k, v, out, lse, qa, rel_pos, scale)
    return out, lse if need_lse else None


def _right_lse(pattern: FlexPattern, q, k, v, mod, rel_pos: RelativePositions, scale: float) -> Tensor:
    """Log-sum-exp over the keys at distance >= max_distance (the right side's clipped keys)."""
    far, delta = pattern.allowed, pattern.delta

    def allowed(b, h, i, j):
        return far(b, h, i, j) & (delta(b, h, i, j) >= rel_pos.max_distance)

    right = FlexPattern(pattern.nq, pattern.nk, allowed, pattern.reach, pattern.per_head,
                        None if pattern.cache_key is None else (*pattern.cache_key, "right", rel_pos.max_distance))
    return flex_call(q, k, v, block_mask=block_mask(right, q.shape[0], q.shape[1], q.device), scale=scale,
                     score_mod=mod)[1]


def _own_key_fallback(pattern, q, k, v, out, lse, qa, rel_pos, scale):
    """Shared-QK attention: a query that saw no other key attends to its own key alone (if it may)."""
    B, H, N, _ = q.shape
    b = torch.arange(B, device=q.device).view(B, 1, 1)
    h = torch.arange(H, device=q.device).view(1, H, 1)
    i = torch.arange(N, device=q.device).view(1, 1, N)
    alone = ~saw_key(lse) & pattern.own(b, h, i, i).expand(B, H, N)
    own = v if rel_pos is None else v + rel_pos.tables(0, v.dtype)[1]  # the value term of distance 0
    out = torch.where(alone[..., None], own, out)
    lse = torch.where(alone, own_score(q, k, qa, rel_pos, scale).to(lse.dtype), lse)
    return out, lse


def _finish(pattern_args: dict, rule, exclude: bool) -> dict:
    if exclude:
        pattern_args.update(own=rule, allowed=without_self(rule), exclude_self=True)
    else:
        pattern_args.update(allowed=rule)
    return pattern_args


def _offsets(lo: int, hi: int, unit: int, rel_pos: RelativePositions | None, by_index: bool) -> tuple:
    """The value pass's frame for keys at offsets [lo, hi] of their query: only the near ones when distances are
    ``unit`` times the offset and the clip is nearer than the reach."""
    if rel_pos is None or not by_index:
        return ("offsets", lo, hi, True)
    m = (rel_pos.max_distance - 1) // unit
    if -m <= lo and hi <= m:
        return ("offsets", lo, hi, True)
    return ("offsets", max(lo, -m), min(hi, m), False)


def _tile_offsets(allow: Tensor | None, T: int, S: int, back: int) -> tuple[int, int]:
    """Smallest and largest key index - query index of the tile entries ``allow`` (T, S) permits (all without it);
    (0, -1) when it permits none. One host read of two numbers when ``allow`` is given."""
    d = torch.arange(S)[None, :] - back * T - torch.arange(T)[:, None]  # (T, S), on the host
    if allow is None:
        return int(d.min()), int(d.max())
    d = d.to(allow.device)
    big = T + S
    lo, hi = torch.stack([torch.where(allow, d, big).min(), torch.where(allow, d, -big).max()]).tolist()
    return (0, -1) if lo > hi else (lo, hi)


def band(q: Tensor, k: Tensor, v: Tensor, *, window: int, causal: bool, scale: float,
         key_valid: Tensor | None = None, restrict: KeyRestrictions | None = None,
         rel_pos: RelativePositions | None = None, rel_unit: int = 1,
         need_lse: bool = False) -> tuple[Tensor, Tensor | None]:
    """``tiles.band_attention`` on FlexAttention: causal i - window < j <= i, else |i - j| < window."""
    n = q.shape[2]
    groups, exclude, positions = (None, False, None) if restrict is None else restrict
    data = data_rule(n, n, key_valid, groups)

    def rule(b, h, i, j):
        d = j - i
        return ((d <= 0) & (d > -window) if causal else d.abs() < window) & data(b, h, i, j)

    def reach(first, last):
        return first - (window - 1), last + (0 if causal else window - 1)

    by_index = positions is None
    delta = index_delta(rel_unit) if by_index else positions_delta(positions, n)
    per_head = key_valid is not None or groups is not None or positions is not None
    frame = _offsets(-(window - 1), 0 if causal else window - 1, rel_unit, rel_pos, by_index)
    args = dict(nq=n, nk=n, reach=reach, per_head=per_head, cache_key=None if per_head else ("band", window, causal),
                delta=delta, frame=frame, one_sided=causal)
    return attend(FlexPattern(**_finish(args, rule, exclude)), q, k, v, scale=scale, rel_pos=rel_pos,
                  need_lse=need_lse)


def tiled(q: Tensor, k: Tensor, v: Tensor, *, block: int, back: int = 0, ahead: int = 0,
          allow: Tensor | None = None, tile_mask: Tensor | None = None, scale: float,
          key_valid: Tensor | None = None, restrict: KeyRestrictions | None = None,
          rel_pos: RelativePositions | None = None, rel_unit: int | None = None, rel_delta: Tensor | None = None,
          rel_band: tuple[int, int] | None = None, empty_rows: bool = False,
          need_lse: bool = False, rows: int | None = None) -> tuple[Tensor, Tensor | None]:
    """``tiles.tiled_attention`` on FlexAttention: query block b (``rows`` queries, default ``block``) sees key
    blocks b - back … b + ahead under the tile mask (one tile of every key when back = ahead = 0 and block >= Nq).
    ``rel_band`` and ``empty_rows`` only steer the tiled executor's work and change nothing here."""
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    groups, exclude, positions = (None, False, None) if restrict is None else restrict
    single = back == 0 and ahead == 0 and block >= Nq and rows is None
    if rows is not None:
        if Nq != -(-Nk // block) * rows:
            raise ValueError(f"with rows={rows}, q must hold ceil(Nk / block) · rows = {-(-Nk // block) * rows} "
                             f"queries, got {Nq}")
        if restrict is not None or rel_unit is not None or rel_band is not None:
            raise ValueError("with rows, queries are not at key positions: restrict, rel_unit and rel_band do not "
                             "apply (give distances as rel_delta)")
    elif not single and Nk != Nq:
        raise ValueError(f"banded tiles need as many keys as queries, got {Nq} queries and {Nk} keys")
    T, S = (Nq, Nk) if single else (rows or block, (back + 1 + ahead) * block)  # query rows, span of keys
    if allow is not None and tuple(allow.shape) != (T, S):
        raise ValueError(f"tile mask must have shape {(T, S)}, got {tuple(allow.shape)}")
    if rel_pos is not None and (rel_unit is None) == (rel_delta is None) and positions is None:
        raise ValueError("relative positions need exactly one of rel_unit and rel_delta")
    data = data_rule(Nq, Nk, key_valid, groups)
    n_tiles = 1 if single else -(-Nq // T)
    tile_mask, rel_delta = (None if x is None else x.view(*(1,) * (5 - x.dim()), *x.shape)
                            for x in (tile_mask, rel_delta))

    def cell(i, j):  # (tile, row, span column) of a pair
        if single:
            return torch.zeros_like(i), i, j
        tile = i // T
        return tile, i - tile * T, j - (tile - back) * block

    def rule(b, h, i, j):
        tile, r, s = cell(i, j)
        ok = data(b, h, i, j) & (s >= 0) & (s < S)
        r, s = r.clamp(0, T - 1), s.clamp(0, S - 1)
        if allow is not None:
            ok = ok & allow[r, s]
        if tile_mask is not None:
            ok = ok & lookup(tile_mask, b, h, tile.clamp(0, n_tiles - 1), r, s)
        return ok

    def reach(first, last):
        if single:
            return full_range(Nk)(first, last)
        return (first // T - back) * block, (last // T + ahead + 1) * block - 1

    delta = None
    frame: tuple = ("all",)
    if positions is not None:
        delta = positions_delta(positions, Nq)
    elif rel_delta is not None:
        def delta(b, h, i, j):
            tile, r, s = cell(i, j)
            return lookup(rel_delta, b, h, tile.clamp(0, n_tiles - 1), r.clamp(0, T - 1), s.clamp(0, S - 1))
    elif rel_unit is not None:
        delta = index_delta(rel_unit)
    one_sided = False
    if rel_pos is not None and rel_delta is None and Nq == Nk:  # offsets of the keys a tile may hold
        lo, hi = _tile_offsets(allow, T, S, back if not single else 0)
        frame = _offsets(lo, hi, rel_unit or 1, rel_pos, positions is None)
        one_sided = positions is None and hi <= 0
    per_head = key_valid is not None or groups is not None or tile_mask is not None or positions is not None
    cacheable = not per_head and allow is None and rel_delta is None
    args = dict(nq=Nq, nk=Nk, reach=reach, per_head=per_head,
                cache_key=("tiled", single, T, block, back, ahead) if cacheable else None, delta=delta, frame=frame,
                one_sided=one_sided)
    return attend(FlexPattern(**_finish(args, rule, exclude)), q, k, v, scale=scale, rel_pos=rel_pos,
                  need_lse=need_lse)


__all__ = ["attend", "band", "tiled"]
