"""The Sparse Transformer's strided pattern: the last l positions, and every l-th position before them."""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_split_heads, positive_int
from .executors import Backend, Executor, get_executor, merge_partials
from .grid import columns_key_valid, from_columns, to_columns
from .inputs import check_inputs
from .relative import RelativePositions
from .tiling import Distances, Tiling


def strided_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    stride: int,
    causal: bool = True,
    merged: bool = True,
    scale: float | None = None,
    *,
    key_padding_mask: Tensor | None = None,
    rel_pos: RelativePositions | None = None,
    backend: Backend = "auto",
) -> Tensor:
    """Strided attention with l = stride (Child et al. 2019).

    Causal: A1(i) = {j : max(0, i - l) <= j <= i}, A2(i) = {j <= i : (i - j) mod l = 0}; non-causal: |i - j| <= l
    and every j with (i - j) mod l = 0. ``merged=True``: every head attends to A1 ∪ A2; ``merged=False``: the first
    half of the heads to A1, the second half to A2.

    q, k, v: (B, H, N, D) -> (B, H, N, D). A1 is a band (blocks of l); A2 is attention along the columns of the
    sequence viewed as an (N / l, l) grid (the transpose trick); merged heads combine the two exactly through their
    log-sum-exp, with A2 restricted to rows two or more apart so no key counts twice.
    O(N · (l + N / l) · D) time, O(N · (l + N / l)) memory: O(N^1.5 · D) for l ≈ sqrt(N).
    ``backend``: the executor (``"auto"``: FlexAttention on CUDA, tiles elsewhere; ``"tiles"``; ``"flex"``).
    """
    B, H, N, D, scale, key_valid = check_inputs(q, k, v, scale, key_padding_mask, rel_pos)
    stride = positive_int("stride", stride)
    executor = get_executor(backend, q.device)
    near = {"window": stride + 1, "causal": causal, "scale": scale, "key_valid": key_valid, "rel_pos": rel_pos}
    if merged:
        parts = [
            executor.band(q, k, v, need_lse=True, **near),
            column_attention(q, k, v, stride, causal=causal, gap=2, scale=scale, key_valid=key_valid,
                             rel_pos=rel_pos, need_lse=True, executor=executor),
        ]
        return merge_partials(parts)[0]  # type: ignore[arg-type]
    half = check_split_heads(H)
    a1, _ = executor.band(q[:, :half], k[:, :half], v[:, :half], **near)
    a2, _ = column_attention(q[:, half:], k[:, half:], v[:, half:], stride, causal=causal, gap=0, scale=scale,
                             key_valid=key_valid, rel_pos=rel_pos, executor=executor)
    return torch.cat([a1, a2], dim=1)


def column_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    width: int,
    *,
    causal: bool,
    gap: int,
    scale: float,
    key_valid: Tensor | None,
    rel_pos: RelativePositions | None,
    need_lse: bool = False,
    executor: Executor,
) -> tuple[Tensor, Tensor | None]:
    """Keys in the query's column of the (N / width, width) grid at least ``gap`` rows away (earlier when causal).

    Each column is one dense (R, R) tile, R = ceil(N / width); relative distances are width · (row difference).
    """
    B, _, N, _ = q.shape
    rows = -(-N // width)
    qc, kc, vc = (to_columns(x, width) for x in (q, k, v))  # (B·width, H, R, D)
    r = torch.arange(rows, device=q.device)
    offset = r[None, :] - r[:, None]  # key row - query row
    if causal:
        allow: Tensor | None = offset <= -gap
    else:
        allow = offset.abs() >= gap if gap else None
    out, lse = executor.tiled(
        qc, kc, vc, Tiling.dense(rows, allow=allow), scale=scale,
        key_valid=columns_key_valid(key_valid, B, N, width, q.device),
        rel_pos=rel_pos, distances=Distances(unit=width), need_lse=need_lse,
    )
    return from_columns(out, width, N), None if lse is None else from_columns(lse, width, N)
