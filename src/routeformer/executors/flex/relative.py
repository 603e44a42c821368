"""Shaw's relative positions on FlexAttention: the key term inside the kernel, the value term in a banded pass.

Key term: ``score_mod`` adds q_i · a^K(delta_ij) · scale, read from qa = (q · scale) @ (a^K)ᵀ, (B, H, Nq, 2k + 1),
computed once outside the kernel (its gradient reaches q and the table through FlexAttention's captured-buffer
gradients).

Value term: Σ_j p_ij a^V(clip(delta_ij)) needs the probabilities, which FlexAttention does not return. They are
recomputed from its log-sum-exp, p_ij = exp(s_ij - lse_i), on the keys the pattern's ``frame`` enumerates:

- ``("offsets", lo, hi, complete)``: key j = i + t for t in [lo, hi], one (B, H, N) vector per offset, so memory is
  O(N · (hi - lo + 1)) and products are on shifted views (no gathered copies). With distances unit · t and
  ``complete=False`` only the near keys |delta| < k are enumerated; every other key the query sees is clipped to
  a^V(±k), so the far mass is what the near keys leave (one-sided patterns) or, for two-sided ones, the right
  side's mass comes from a second call restricted to delta >= k (its log-sum-exp).
- ``("all",)``: a single tile (Nq, Nk) of gathered keys, every pair at once (the small tiles of global tokens,
  summary cells and balanced routing clusters).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from ..lse import saw_key
from ..relative import RelativePositions
from .pattern import FlexPattern, Rule


class Terms(NamedTuple):
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


def _weights(scores: Tensor, allowed: Tensor, lse: Tensor) -> Tensor:
    """exp(scores - lse) where allowed, else exactly 0 (no inf · 0 in the gradient); ``lse`` broadcasts against
    the scores and is finite (``_finite``)."""
    return torch.where(allowed, scores.to(lse.dtype) - lse, float("-inf")).exp()


def _finite(lse: Tensor) -> Tensor:
    """lse with the rows that saw no key (lse = neg_inf) at 0: they have no allowed key, and neg_inf would
    overflow exp(s - lse)."""
    return torch.where(saw_key(lse), lse, 0.0)


def value_term(pattern: FlexPattern, q: Tensor, k: Tensor, lse: Tensor, terms: Terms, scale: float,
               right_lse: Callable[[], Tensor]) -> Tensor:
    """Σ_j p_ij a^V(delta_ij): (B, H, Nq, D) in q's dtype, p_ij recomputed from ``lse`` with every term the kernel
    added (``terms``: the key term, the bias). ``right_lse()`` gives the log-sum-exp over the keys with delta >= k
    (only called for two-sided patterns whose frame is not complete)."""
    qa, rel_pos, bias = terms
    B, H, Nq, D = q.shape
    kmax = rel_pos.max_distance
    finite = _finite(lse)
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
        p = _weights(scores, pattern.allowed(bb, hh, i, j), finite[..., None])
        mass = p.new_zeros(B, H, Nq, 2 * kmax + 1).scatter_add(-1, idx, p)
        return (mass @ a_v).to(q.dtype)

    _, lo, hi, complete = pattern.frame
    n = Nq
    i = torch.arange(n, device=q.device).view(1, 1, n)
    probs, rows = [], []
    for t in range(lo, hi + 1):  # one offset at a time: O(N) memory each, products on shifted views
        a, z = max(0, -t), n - max(0, t)  # queries a..z-1 have key i + t in range
        if a >= z:
            continue
        qi, kj = i[..., a:z], i[..., a:z] + t
        d = pattern.delta(b, h, qi, kj).expand(B, H, z - a)
        idx = rel_pos.index(d)
        s = (q[:, :, a:z] * k[:, :, a + t:z + t]).sum(-1) * scale + qa[:, :, a:z].gather(-1, idx[..., None])[..., 0]
        if bias is not None:
            s = s + bias(b, h, qi, kj).to(s.dtype)
        p = _weights(s, pattern.allowed(b, h, qi, kj), finite[:, :, a:z])
        probs.append(torch.nn.functional.pad(p, (a, n - z)))
        rows.append(torch.nn.functional.pad(idx, (a, n - z)))
    out = lse.new_zeros(B, H, n, 2 * kmax + 1)  # mass per table row
    near = lse.new_zeros(B, H, n)
    if probs:  # (none when every key a query may see is beyond the clip)
        p = torch.stack(probs, -1)  # (B, H, N, C)
        out = out.scatter_add(-1, torch.stack(rows, -1), p)
        near = p.sum(-1)
    if not complete:  # keys not enumerated are all at |delta| >= k: rows 0 (left) and 2k (right)
        far = saw_key(lse).to(lse.dtype) - near
        if not pattern.one_sided:
            right = right_lse()
            far_right = _weights(right, saw_key(right), finite)
            out[..., 2 * kmax] += far_right
            far = far - far_right
        out[..., 0] += far
    return (out @ a_v).to(q.dtype)


def own_score(q: Tensor, k: Tensor, qa: Tensor | None, rel_pos: RelativePositions | None, scale: float) -> Tensor:
    """s_ii in the lse dtype: the score of each query's own key (distance 0), for the exclude-self fallback."""
    s = (q * k).sum(-1) * scale
    if qa is not None:
        s = s + qa[..., rel_pos.max_distance]
    return s.to(torch.promote_types(s.dtype, torch.float32))


__all__ = ["Terms", "key_scores", "own_score", "score_mod", "value_term"]
