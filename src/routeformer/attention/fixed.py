"""The Sparse Transformer's fixed pattern: attend within your block, and to the summary cells of every block."""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_split_heads, positive_int
from .executors import Backend, get_executor, lse_dtype, merge_partials, neg_inf
from .inputs import check_inputs
from .relative import RelativePositions


def fixed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block: int,
    summary: int,
    causal: bool = True,
    merged: bool = True,
    scale: float | None = None,
    *,
    key_padding_mask: Tensor | None = None,
    rel_pos: RelativePositions | None = None,
    backend: Backend = "auto",
) -> Tensor:
    """Fixed attention with l = block, c = summary (Child et al. 2019).

    A1(i) = {j : floor(j / l) = floor(i / l)}, A2(i) = {j : j mod l >= l - c}, both intersected with j <= i when
    causal. ``merged=True``: every head attends to A1 ∪ A2; ``merged=False``: the first half of the heads to A1,
    the second half to A2.

    q, k, v: (B, H, N, D) -> (B, H, N, D). A1 is a block-diagonal tiling; A2 gathers the N·c/l summary keys once
    and attends to them (merged heads: those of other blocks only, so no key counts twice), the two combined
    through their log-sum-exp. O(N · (l + N·c/l) · D) time, O(N · (l + N·c/l)) memory.
    ``backend``: the executor (``"auto"``: FlexAttention on CUDA, tiles elsewhere; ``"tiles"``; ``"flex"``).
    """
    B, H, N, D, scale, key_valid = check_inputs(q, k, v, scale, key_padding_mask, rel_pos)
    block, summary = positive_int("block", block), positive_int("summary", summary)
    if summary > block:
        raise ValueError(f"summary must be at most block, got summary={summary} > block={block}")
    common = {"causal": causal, "scale": scale, "key_valid": key_valid, "rel_pos": rel_pos,
              "executor": get_executor(backend, q.device)}
    if merged:
        parts = [
            _within_block(q, k, v, block, need_lse=True, **common),
            _summaries(q, k, v, block, summary, other_blocks=True, need_lse=True, **common),
        ]
        return merge_partials(parts)[0]  # type: ignore[arg-type]
    half = check_split_heads(H)
    a1, _ = _within_block(q[:, :half], k[:, :half], v[:, :half], block, **common)
    a2, _ = _summaries(q[:, half:], k[:, half:], v[:, half:], block, summary, other_blocks=False, **common)
    return torch.cat([a1, a2], dim=1)


def _within_block(q, k, v, block, *, causal, scale, key_valid, rel_pos, executor, need_lse=False):
    """A1: attention within blocks of ``block`` positions (the executor's block diagonal)."""
    return executor.block_diagonal(q, k, v, block, causal=causal, scale=scale, key_valid=key_valid,
                                         rel_pos=rel_pos, need_lse=need_lse)


def summary_count(n: int, block: int, summary: int) -> int:
    """How many summary cells (j mod block >= block - summary) lie before position n."""
    return n // block * summary + max(0, n % block - (block - summary))


def _summaries(q, k, v, block, summary, *, other_blocks, causal, scale, key_valid, rel_pos, executor,
               need_lse=False):
    """Attention to the summary positions (j mod l >= l - c), of other blocks only when ``other_blocks``."""
    B, H, N, D = q.shape
    pos = torch.arange(N, device=q.device)
    count = summary_count(N, block, summary)
    m = torch.arange(count, device=q.device)
    cells = m // summary * block + (block - summary) + m % summary  # (M,), ascending
    if count == 0:  # the sequence ends before the first summary cell
        acc = lse_dtype(q.dtype)
        return q.new_zeros(B, H, N, D), torch.full((B, H, N), neg_inf(acc), dtype=acc, device=q.device)
    i, j = pos[:, None], cells[None, :]
    if other_blocks:
        allow = (j // block < i // block) if causal else (j // block != i // block)
    else:
        allow = (j <= i) if causal else None
    return executor.subset(q, k, v, cells, allow, scale=scale, key_valid=key_valid, rel_pos=rel_pos,
                                 need_lse=need_lse)
