"""Shaw's relative positions on FlexAttention: the key term inside the kernel, the value term in a banded pass.

Key term: ``score_mod`` adds q_i · a^K(delta_ij) · scale, read from qa = (q · scale) @ (a^K)ᵀ, (B, H, Nq, 2k + 1),
computed once outside the kernel (its gradient reaches q and the table through FlexAttention's captured-buffer
gradients).

Value term: Σ_j p_ij a^V(clip(delta_ij)) needs the probabilities, which FlexAttention does not return. They are
recomputed from its log-sum-exp, p_ij = exp(s_ij - lse_i), on the keys the pattern's ``frame`` enumerates:

- ``("offsets", lo, hi, complete, unit)``: key j = i + t for t in [lo, hi], C = hi - lo + 1 of them: blocks of
  queries against windows of keys that are strided views of the padded keys, one batched product per chunk of
  blocks and the band of each block's scores read by a skew (``_offsets_mass``): memory O(N · C), a number of
  kernels that does not grow with C (a loop per offset took about ten per offset, a thousand per layer and step
  at windows of 128-256). With distances unit · t the table row of each column is the same for every query, so
  the key term is one column gather and the mass per row one product; ``complete=False``: only the near keys
  |delta| < k are enumerated; every other key the query sees is clipped to a^V(±k), so the far mass is what the
  near keys leave (one-sided patterns) or, for two-sided ones, the right side's mass comes from a second call
  restricted to delta >= k (its log-sum-exp).
- ``("all",)``: a single tile (Nq, Nk) of gathered keys, every pair at once (the small tiles of global tokens,
  summary cells and balanced routing clusters).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..lse import saw_key
from ..relative import RelativePositions
from .pattern import FlexPattern, Rule

_CHUNK = 1 << 24  # scores of the offsets frame computed at once


class ScoreTerms(NamedTuple):
    """The additive score terms besides q·k · scale, for the passes that recompute scores outside the kernel:
    qa (B, H, Nq, 2k + 1) the relative key term per distance (``key_scores``) and its tables ``rel_pos`` (None
    without relative positions), ``bias`` (b, h, i, j) -> a per-pair term (or None)."""

    qa: Tensor | None
    rel_pos: RelativePositions | None
    bias: Rule | None


def key_scores(q: Tensor, rel_pos: RelativePositions, scale: float) -> Tensor:
    """qa = (q · scale) @ (a^K)ᵀ: (B, H, Nq, 2k + 1), column d + k the key term of distance d."""
    return (q * scale) @ rel_pos.key.to(q.dtype).T


def score_mod(qa: Tensor | None, delta: Rule | None, rel_pos: RelativePositions | None, nq: int,
              bias: Rule | None) -> Callable:
    """FlexAttention ``score_mod`` adding the relative key term of the pair's distance (qa from ``key_scores``;
    None: no relative positions) and the per-pair ``bias`` (None: none)."""
    if qa is None:
        def add_bias(score: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            return score + bias(b, h, i, j).to(score.dtype)

        return add_bias
    max_distance = rel_pos.max_distance

    def add_key_term(score: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        d = delta(b, h, i, j).clamp(-max_distance, max_distance) + max_distance
        return score + qa[b, h, i.clamp(max=nq - 1), d].to(score.dtype)

    if bias is None:
        return add_key_term

    def add_both(score: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return add_key_term(score, b, h, i, j) + bias(b, h, i, j).to(score.dtype)

    return add_both


def relative_value_weights(scores: Tensor, allowed: Tensor, lse: Tensor) -> Tensor:
    """exp(scores - lse) where allowed, else exactly 0 (no inf · 0 in the gradient); ``lse`` broadcasts against
    the scores and is finite (``finite_lse``)."""
    return torch.where(allowed, scores.to(lse.dtype) - lse, float("-inf")).exp()


def finite_lse(lse: Tensor) -> Tensor:
    """lse with the rows that saw no key (lse = neg_inf) at 0: they have no allowed key, and neg_inf would
    overflow exp(s - lse)."""
    return torch.where(saw_key(lse), lse, 0.0)


def value_term(pattern: FlexPattern, q: Tensor, k: Tensor, lse: Tensor, terms: ScoreTerms, scale: float,
               right_lse: Callable[[], Tensor]) -> Tensor:
    """Σ_j p_ij a^V(delta_ij): (B, H, Nq, D) in q's dtype, p_ij recomputed from ``lse`` with every term the kernel
    added (``terms``: the key term, the bias). ``right_lse()`` gives the log-sum-exp over the keys with delta >= k
    (only called for two-sided patterns whose frame is not complete)."""
    qa, rel_pos, bias = terms
    B, H, Nq, D = q.shape
    kmax = rel_pos.max_distance
    finite = finite_lse(lse)
    a_v = rel_pos.value.to(lse.dtype)  # (2k + 1, D)
    b = torch.arange(B, device=q.device).view(B, 1, 1)
    h = torch.arange(H, device=q.device).view(1, H, 1)
    if pattern.frame[0] == "all":
        Nk = k.shape[2]
        i = torch.arange(Nq, device=q.device).view(1, 1, Nq, 1)
        j = torch.arange(Nk, device=q.device).view(1, 1, 1, Nk)
        bb, hh = b[..., None], h[..., None]
        idx = rel_pos.index(pattern.delta(bb, hh, i, j)).expand(B, H, Nq, Nk)
        scores = (q * scale) @ k.transpose(-1, -2) + qa.gather(-1, idx)
        if bias is not None:
            scores = scores + bias(bb, hh, i, j).to(scores.dtype)
        p = relative_value_weights(scores, pattern.allowed(bb, hh, i, j), finite[..., None])
        mass = p.new_zeros(B, H, Nq, 2 * kmax + 1).scatter_add(-1, idx, p)
        return (mass @ a_v).to(q.dtype)

    _, lo, hi, complete, unit = pattern.frame
    out, near = _offsets_mass(pattern, q * scale, k, finite, terms, (lo, hi, unit))
    if not complete:  # keys not enumerated are all at |delta| >= k: rows 0 (left) and 2k (right)
        far = saw_key(lse).to(lse.dtype) - near
        if not pattern.one_sided:
            right = right_lse()
            far_right = relative_value_weights(right, saw_key(right), finite)
            out[..., 2 * kmax] += far_right
            far = far - far_right
        out[..., 0] += far
    return (out @ a_v).to(q.dtype)


def _offsets_mass(pattern: FlexPattern, qs: Tensor, k: Tensor, finite: Tensor, terms: ScoreTerms,
                  frame: tuple[int, int, int | None]) -> tuple[Tensor, Tensor]:
    """The "offsets" frame: (mass (B, H, N, 2k + 1) of each query's probabilities per table row, their sum
    (B, H, N)), both in the lse dtype, over the keys j = i + t, lo <= t <= hi (``frame`` = (lo, hi, unit): unit
    the distance per offset when distances are by index, else None).

    Query blocks of T rows against windows of W = T + C - 1 keys (C = hi - lo + 1), the windows strided views of
    the padded keys (``unfold``): one batched product per chunk of blocks gives (T, W) scores, whose band row r,
    columns r … r + C - 1 (key i + lo + c in column c), is read by a skew (flatten, pad by T, view as rows of
    W + 1). A fixed number of kernels per chunk, chunks of at most ``_CHUNK`` scores: memory O(chunk · (W + D)).
    """
    qa, rel_pos, bias = terms
    lo, hi, unit = frame
    B, H, n, D = qs.shape
    rows_out = 2 * rel_pos.max_distance + 1
    C = hi - lo + 1
    if C <= 0:  # every key a query may see is beyond the clip: none enumerated
        return finite.new_zeros(B, H, n, rows_out), finite.new_zeros(B, H, n)
    T = max(16, min(C, 128))
    W = T + C - 1
    nb = -(-n // T)
    left = max(0, -lo)
    windows = F.pad(k, (0, 0, left, max(0, nb * T + hi - n)))[:, :, lo + left:].unfold(2, W, T)  # (B, H, ≥nb, D, W)
    qs, qa, finite = (F.pad(x, (0, 0, 0, nb * T - n) if x.dim() == 4 else (0, nb * T - n)) for x in (qs, qa, finite))
    dev = qs.device
    b = torch.arange(B, device=dev).view(B, 1, 1, 1)
    h = torch.arange(H, device=dev).view(1, H, 1, 1)
    c = torch.arange(C, device=dev)
    onehot = None
    if unit is not None:  # the distance is unit · (lo + c) for every query: one table row per column
        col_idx = rel_pos.index(unit * (lo + c))
        # (C, 2k + 1): the mass per table row is one product (a comparison, not F.one_hot: that reads the indices'
        # range on the host)
        onehot = (col_idx[:, None] == torch.arange(rows_out, device=dev)).to(finite.dtype)
    step = max(1, _CHUNK // (B * H * T * W))
    masses, nears = [], []
    for b0 in range(0, nb, step):  # chunks of query blocks: bounded memory, a fixed number of kernels each
        b1 = min(b0 + step, nb)
        cb = b1 - b0
        scores = qs[:, :, b0 * T:b1 * T].view(B, H, cb, T, D) @ windows[:, :, b0:b1]  # (B, H, cb, T, W)
        band = F.pad(scores.flatten(-2), (0, T)).view(B, H, cb, T, W + 1)[..., :C].reshape(B, H, cb * T, C)
        i = torch.arange(b0 * T, b1 * T, device=dev).view(1, 1, -1, 1)
        j = i + lo + c
        inside = (i < n) & (j >= 0) & (j < n)
        ic, jc = i.clamp(max=n - 1), j.clamp(0, n - 1)
        band = band.to(finite.dtype)
        rows_qa = qa[:, :, b0 * T:b1 * T]
        if onehot is not None:
            band = band + rows_qa.index_select(-1, col_idx).to(band.dtype)
        else:
            idx = rel_pos.index(pattern.delta(b, h, ic, jc)).expand(B, H, cb * T, C)
            band = band + rows_qa.gather(-1, idx).to(band.dtype)
        if bias is not None:
            band = band + bias(b, h, ic, jc).to(band.dtype)
        p = relative_value_weights(band, pattern.allowed(b, h, ic, jc) & inside, finite[:, :, b0 * T:b1 * T, None])
        masses.append(p @ onehot if onehot is not None
                      else p.new_zeros(B, H, cb * T, rows_out).scatter_add(-1, idx, p))
        nears.append(p.sum(-1))
    mass = torch.cat(masses, 2) if len(masses) > 1 else masses[0]
    near = torch.cat(nears, 2) if len(nears) > 1 else nears[0]
    return mass[:, :, :n], near[:, :, :n]


def own_score(q: Tensor, k: Tensor, qa: Tensor | None, rel_pos: RelativePositions | None, scale: float) -> Tensor:
    """s_ii in the lse dtype: the score of each query's own key (distance 0), for the exclude-self fallback."""
    s = (q * k).sum(-1) * scale
    if qa is not None:
        s = s + qa[..., rel_pos.max_distance]
    return s.to(torch.promote_types(s.dtype, torch.float32))


__all__ = ["ScoreTerms", "key_scores", "own_score", "score_mod", "value_term"]
