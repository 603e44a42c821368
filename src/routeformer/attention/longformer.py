"""Longformer attention: a dilated sliding window plus symmetric global tokens (Beltagy et al. 2020)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .checks import check_per_head, check_positions, positive_int
from .executors import Backend, get_executor, merge_partials
from .grid import columns_key_valid, from_columns, to_columns
from .inputs import check_inputs
from .relative import RelativePositions
from .tiling import Distances, Tiling


def longformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    dilation: int | Sequence[int] | Tensor = 1,
    global_tokens: Sequence[int] | Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    *,
    key_padding_mask: Tensor | None = None,
    rel_pos: RelativePositions | None = None,
    backend: Backend = "auto",
) -> Tensor:
    """Query i attends to j = i + m · dilation for |m| < window (m <= 0 when causal); a global position attends
    to every position and every position attends to it (only earlier ones when causal).

    q, k, v: (B, H, N, D) -> (B, H, N, D). ``dilation`` is an int or one per head. The dilated window is a band
    along the columns of the sequence viewed as a grid of ``dilation`` columns; global keys outside a query's band
    are merged in through their log-sum-exp; global query rows are recomputed densely and replace the band rows.
    O(N · (window + G) · D) time for G global tokens.
    ``backend``: the executor (``"auto"``: FlexAttention on CUDA, tiles elsewhere; ``"tiles"``; ``"flex"``).
    """
    B, H, N, D, scale, key_valid = check_inputs(q, k, v, scale, key_padding_mask, rel_pos)
    window = positive_int("window", window)
    dilations = check_per_head("dilation", dilation, H)
    globals_ = check_positions("global_tokens", global_tokens, N)
    g = _index(globals_, q.device) if globals_ else None
    executor = get_executor(backend, q.device)
    outs, order = [], []
    for d in sorted(set(dilations)):  # heads sharing a dilation share one grid
        heads = [h for h in range(H) if dilations[h] == d]
        qkv = (q, k, v)
        if len(heads) < H:
            idx = _index(heads, q.device)
            qkv = tuple(x[:, idx] for x in qkv)
        outs.append(_dilated(*qkv, window, d, g, causal=causal, scale=scale, key_valid=key_valid,
                             rel_pos=rel_pos, executor=executor))
        order += heads
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    if order != sorted(order):
        out = out[:, _index(sorted(range(H), key=order.__getitem__), q.device)]  # the inverse permutation
    return out


def _index(values: list[int], device: torch.device) -> Tensor:
    """A long tensor of ``values`` on ``device``, without waiting for the copy: from pageable host memory a
    non-blocking copy is staged at once, so the host buffer may go (no stream synchronisation on CUDA)."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def _dilated(q, k, v, window, dilation, g, *, causal, scale, key_valid, rel_pos, executor):
    """Dilated band of (B, H, N, D) inputs, plus the global positions ``g`` (G,) (long, on q's device) or None."""
    B, H, N, D = q.shape
    qc, kc, vc = (to_columns(x, dilation) for x in (q, k, v))  # (B·d, H, N/d, D)
    band, band_lse = executor.band(
        qc, kc, vc, window=window, causal=causal, scale=scale,
        key_valid=columns_key_valid(key_valid, B, N, dilation, q.device),
        rel_pos=rel_pos, distances=Distances(unit=dilation), need_lse=g is not None,
    )
    out = from_columns(band, dilation, N)
    if g is None:
        return out

    pos = torch.arange(N, device=q.device)
    # Every query also sees the global keys its band does not already hold.
    diff = g[None, :] - pos[:, None]  # (N, G): key - query
    steps = torch.div(diff, dilation, rounding_mode="floor")
    in_band = (diff % dilation == 0) & (((steps <= 0) & (steps > -window)) if causal else (steps.abs() < window))
    allow = ~in_band & (diff <= 0) if causal else ~in_band
    glob, glob_lse = executor.subset(q, k, v, g, allow, scale=scale, key_valid=key_valid,
                                           rel_pos=rel_pos, need_lse=True)
    out, _ = merge_partials([(out, from_columns(band_lse, dilation, N)), (glob, glob_lse)])

    # Global queries see every position (every earlier one when causal): their rows are recomputed whole.
    rows_delta = pos[None, :] - g[:, None]  # (G, N)
    rows, _ = executor.tiled(
        q[:, :, g], k, v, Tiling.dense(g.shape[0], allow=(rows_delta <= 0) if causal else None), scale=scale,
        key_valid=key_valid, rel_pos=rel_pos, distances=None if rel_pos is None else Distances(delta=rows_delta),
    )
    return out.index_copy(2, g, rows)
