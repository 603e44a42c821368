"""Reformer-style LSH attention (Kitaev et al. 2020), causal without a leak and exact over several hash rounds.

Shared QK, as in Reformer: the keys are the queries normalised to unit length, k_j = q_j / |q_j|. Each of
``rounds`` hash rounds puts every position in one of ``buckets`` buckets by angular LSH, bucket = argmax([xR; -xR])
for a fixed random rotation R (D, buckets/2) per head and round.

What a query sees (``lsh_mask``): per round r, the sequence is sorted by (bucket, position) and query i sees the
entries of its own bucket at most ``window - 1`` places before it in that order (causal: the last ``window``
positions j <= i of its bucket, i itself included), or less than ``window`` places away on either side
(non-causal): the sorted-window rule of routing (``routing/sorted_window.py``) with the hash buckets as clusters.
Unlike Reformer's fixed chunks of the sorted sequence, what i sees depends only on positions <= i (later tokens
would shift chunk boundaries), and nothing wraps around. The query attends to the UNION of its rounds' windows,
each key counted once; its own key only when no other key is visible in any round (its output is then v_i);
padded keys never.

Exact once-counting: each round is attended on its own (query blocks of the sorted sequence against the sorted
keys of the band) with the additive score bias -log(c_ij), c_ij the number of rounds whose window holds j for i
(same bucket in that round and the rank gap in its window). The rounds' softmaxes are then merged by their
log-sum-exps (``merge_partials``): Σ_r Σ_{j in W_r(i)} exp(s_ij - log c_ij) = Σ_{j in ∪W_r(i)} exp(s_ij), the
softmax over the union. Reformer's -log(number of rounds with the same bucket) is an approximation of this.

Cost per head: O(rounds · N · window · D) for the attention, O(rounds² · N · window) for the counts,
O(rounds · N · D · buckets/2) for hashing, O(rounds · N log N) for sorting; memory O(rounds · N · window) for the
scores (no N×N tensor).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .checks import positive_int
from .executors import lse_dtype, merge_partials, neg_inf
from .inputs import check_inputs
from .routing.sorted_window import drop_own_key, permute_seq, sort_by_cluster, sorted_window_mask
from .tiles import band_tiling

__all__ = ["default_lsh_settings", "lsh_attention", "lsh_hash", "lsh_mask", "lsh_rotations"]


def default_lsh_settings(n: int) -> tuple[int, int]:
    """(buckets, window) for length n: buckets = round(sqrt(n)) rounded up to an even number (at least 2), window =
    n // buckets, the mean bucket size, so the cost is O(N^1.5) like routing's."""
    buckets = max(2, round(math.sqrt(n)))
    buckets += buckets % 2
    return buckets, max(1, n // buckets)


def lsh_rotations(heads: int, head_dim: int, buckets: int, rounds: int, *, seed: int = 0) -> Tensor:
    """Random rotations R (heads, rounds, head_dim, buckets/2), float32 on the CPU, from a generator seeded by
    ``seed`` (the same values on every machine and every call)."""
    heads, head_dim, rounds = (positive_int(n, x) for n, x in (("heads", heads), ("head_dim", head_dim),
                                                                ("rounds", rounds)))
    buckets = _check_buckets(buckets)
    gen = torch.Generator().manual_seed(int(seed))
    return torch.randn(heads, rounds, head_dim, buckets // 2, generator=gen)


def lsh_hash(x: Tensor, rotations: Tensor) -> Tensor:
    """Angular LSH buckets: argmax([xR; -xR]) per head and round. x (B, H, N, D), rotations (H, rounds, D,
    buckets/2) -> (B, H, rounds, N) long in [0, buckets). Computed in float32 or wider, outside autocast; no
    gradient. O(N · D · buckets/2) per head and round."""
    if not isinstance(x, Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"x must be a floating (B, H, N, D) tensor, got {getattr(x, 'shape', type(x).__name__)}")
    H, D = x.shape[1], x.shape[3]
    if (not isinstance(rotations, Tensor) or rotations.dim() != 4 or not rotations.is_floating_point()
            or rotations.shape[0] != H or rotations.shape[2] != D):
        raise ValueError(f"rotations must be a floating (H, rounds, D, buckets/2) tensor with H={H}, D={D}, got "
                         f"{getattr(rotations, 'shape', type(rotations).__name__)}")
    acc = torch.promote_types(x.dtype, torch.float32)
    with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
        proj = torch.einsum("bhnd,hrdk->bhrnk", x.to(acc), rotations.to(device=x.device, dtype=acc))
        return torch.cat([proj, -proj], -1).argmax(-1)


def lsh_mask(q: Tensor, *, buckets: int, rounds: int, window: int, causal: bool = True,
             key_padding_mask: Tensor | None = None, rotations: Tensor | None = None, seed: int = 0) -> Tensor:
    """The boolean (B, H, N, N) mask of ``lsh_attention`` with the same arguments, from its definition (O(N²)):
    the union over rounds of ``sorted_window_mask`` of each round's buckets, less padded keys, less the query's
    own key unless it is the only key left."""
    hashes, valid = _prepare(q, q, buckets, rounds, window, None, key_padding_mask, rotations, seed)[:2]
    allow = torch.zeros(*hashes.shape[:2], hashes.shape[-1], hashes.shape[-1], dtype=torch.bool, device=q.device)
    for r in range(hashes.shape[2]):
        allow = allow | sorted_window_mask(hashes[:, :, r], window, causal, exclude_self=False)
    if valid is not None:
        allow = allow & valid[:, :, None, :]
    return drop_own_key(allow, torch.eye(q.shape[2], dtype=torch.bool, device=q.device))


def lsh_attention(
    q: Tensor,
    v: Tensor,
    *,
    buckets: int,
    rounds: int,
    window: int,
    causal: bool = True,
    scale: float | None = None,
    key_padding_mask: Tensor | None = None,
    rotations: Tensor | None = None,
    seed: int = 0,
) -> Tensor:
    """LSH attention with shared QK: softmax(q_i · k_j · scale) over the union of the rounds' windows, with the
    keys k_j = q_j / |q_j| (the queries normalised to unit length, as in Reformer).

    Args:
        q, v: (B, H, N, D) queries (also the keys, normalised) and values.
        buckets: hash buckets per round, a positive even integer.
        rounds: hash rounds; a query sees the union of its windows over them, each key once.
        window: per round, the entries of the query's bucket it sees: causal, the last ``window`` positions
            j <= i of the bucket (i itself included, then dropped unless it is the only key); non-causal, those
            less than ``window`` places from i in the bucket's order.
        causal: see only positions <= i (leak-free: what i sees depends only on positions <= i).
        scale: score scale, None for 1/sqrt(D).
        key_padding_mask: (B, N) bool, True = a real key; padded keys are never attended.
        rotations: (H, rounds, D, buckets/2) random rotations of the hash; None draws them with ``lsh_rotations``
            from ``seed``.

    Returns:
        (B, H, N, D) in the dtype of q; zeros for a query that sees no key (only possible with padding). Exact
        (float64 in, float64 throughout) against ``reference_attention(q, q/|q|, v, lsh_mask(...))``.
        Time O(rounds · N · window · D + rounds² · N · window + rounds · N · D · buckets/2), memory
        O(rounds · N · window) per head.
    """
    hashes, valid, scale = _prepare(q, v, buckets, rounds, window, scale, key_padding_mask, rotations, seed)
    B, H, N, D = q.shape
    R = hashes.shape[2]
    block, back, ahead = band_tiling(window, N, causal)
    nb = -(-N // block)
    S = (back + 1 + ahead) * block
    pad_front, pad_back = back * block, nb * block - N + ahead * block

    # Per round, the sequence sorted by (bucket, position); rounds folded into the heads for the gathers.
    flat = hashes.reshape(B, H * R, N)
    order, inverse, grouped = sort_by_cluster(flat)[:3]  # (B, H·R, N)
    expand = (B, H, R, N, D)
    qs = permute_seq(q[:, :, None].expand(expand).reshape(B, H * R, N, D), order, inverse).view(expand)
    vs = permute_seq(v[:, :, None].expand(expand).reshape(B, H * R, N, D), order, inverse).view(expand)
    ks = F.normalize(qs, dim=-1)

    def spans(x: Tensor, value: float | int = 0) -> Tensor:
        """Sorted per-entry values (B, H, R, N) -> (B, H, R, nb, S): the keys each query block sees."""
        return F.pad(x, (pad_front, pad_back), value=value).unfold(-1, S, block)

    def rows(x: Tensor, value: float | int = 0) -> Tensor:
        """Sorted per-entry values (B, H, R, N) -> (B, H, R, nb, block, 1): each query's."""
        return F.pad(x, (0, nb * block - N), value=value).view(B, H, R, nb, block, 1)

    # Static tile geometry: the sorted index gap (query - key) of tile entry (row t, column c), and the own key.
    t = torch.arange(block, device=q.device)[:, None]
    c = torch.arange(S, device=q.device)[None, :]
    gap = t + back * block - c  # (block, S)
    own = gap == 0

    # c_ij: the rounds whose window holds j for i, from each round's buckets and sorted indices, gathered into
    # every round's sorted order (entries past the ends get bucket -1: in no window).
    sorted_index = inverse.view(B, H, R, N)  # position -> its sorted index, per round
    into = order.view(B, H, R, N)  # the position of every round's sorted entries
    count = torch.zeros(B, H, R, nb, block, S, dtype=torch.int32, device=q.device)
    for r2 in range(R):
        bucket2 = hashes[:, :, r2, None, :].expand(B, H, R, N).gather(-1, into)
        index2 = sorted_index[:, :, r2, None, :].expand(B, H, R, N).gather(-1, into)
        same = rows(bucket2, -1) == spans(bucket2, -1)[..., None, :]
        d = rows(index2) - spans(index2)[..., None, :]
        count += same & ((d >= 0) & (d < window) if causal else d.abs() < window)
    # The round's own window: same bucket, sorted gap in the window (its term of count).
    grouped = grouped.view(B, H, R, N)
    window_mask = rows(grouped, -1) == spans(grouped, -1)[..., None, :]
    window_mask = window_mask & ((gap >= 0) & (gap < window) if causal else gap.abs() < window)
    allow = window_mask
    if valid is not None:
        key_valid = valid.expand(B, H, N)[:, :, None, :].expand(B, H, R, N).gather(-1, into)
        allow = allow & spans(key_valid, False)[..., None, :]

    # The own key: only when no other key is visible in any round.
    others = (allow & ~own).any(-1).view(B, H, R, nb * block)[..., :N]  # sorted order, per round
    others = others.gather(-1, sorted_index).any(2, keepdim=True).expand(B, H, R, N)  # by position, any round
    others = others.gather(-1, into)  # back into each round's sorted order
    allow = allow & ~(own & rows(others, False))

    qt = F.pad(qs * scale, (0, 0, 0, nb * block - N)).view(B, H, R, nb, block, D)
    kt = F.pad(ks, (0, 0, pad_front, pad_back)).unfold(3, S, block)  # (B, H, R, nb, D, S)
    vt = F.pad(vs, (0, 0, pad_front, pad_back)).unfold(3, S, block)
    scores = qt @ kt - torch.log(count.clamp_min(1).to(qt.dtype))
    scores = scores.masked_fill(~allow, neg_inf(scores.dtype))
    seen = allow.any(-1)  # (B, H, R, nb, block)
    lse = torch.logsumexp(scores.to(lse_dtype(scores.dtype)), -1).masked_fill(~seen, neg_inf(lse_dtype(q.dtype)))
    probs = torch.softmax(scores, -1)
    out = (probs @ vt.transpose(-1, -2)).masked_fill(~seen[..., None], 0.0)  # (B, H, R, nb, block, D)

    out = out.view(B, H * R, nb * block, D)[:, :, :N]
    out = permute_seq(out, inverse, order).view(B, H, R, N, D)
    lse = lse.view(B, H * R, nb * block)[:, :, :N].gather(-1, inverse).view(B, H, R, N)
    return merge_partials([(out[:, :, r], lse[:, :, r]) for r in range(R)])[0]


def _check_buckets(buckets: object) -> int:
    buckets = positive_int("buckets", buckets)
    if buckets % 2:
        raise ValueError(f"buckets must be a positive even integer (argmax over [xR; -xR]), got {buckets}")
    return buckets


def _prepare(q: Tensor, v: Tensor, buckets: int, rounds: int, window: int, scale: float | None,
             key_padding_mask: Tensor | None, rotations: Tensor | None, seed: int):
    """Validate the arguments; -> (hashes (B, H, rounds, N), key_valid (B, 1, N) or None, scale)."""
    buckets = _check_buckets(buckets)
    rounds = positive_int("rounds", rounds)
    positive_int("window", window)
    if isinstance(q, Tensor) and isinstance(v, Tensor) and q.shape != v.shape:
        raise ValueError(f"q and v must have the same shape (B, H, N, D), got q {tuple(q.shape)}, "
                         f"v {tuple(v.shape)}")
    _, H, _, D, scale, valid = check_inputs(q, q, v, scale, key_padding_mask)
    if rotations is None:
        rotations = lsh_rotations(H, D, buckets, rounds, seed=seed).to(q.device)
    elif not isinstance(rotations, Tensor) or tuple(rotations.shape) != (H, rounds, D, buckets // 2):
        raise ValueError(f"rotations must have shape (H, rounds, D, buckets/2) = {(H, rounds, D, buckets // 2)}, "
                         f"got {tuple(getattr(rotations, 'shape', ()))}")
    return lsh_hash(q, rotations), valid, scale
