"""Block selection: the piece MoBA (Lu et al. 2025) and NSA (Yuan et al. 2025) share.

The keys are cut into blocks of ``block`` positions. A query at position i scores the *complete blocks before its
own* (j < i // block, so every key of a candidate lies before the query's block: causal by construction) by some
score of the kind's (MoBA: q · the block's mean key; NSA: its compressed attention), takes its ``top`` best, and
attends to their keys and to its own block's keys up to itself, one softmax over the union. Selected blocks are
contiguous key ranges, so the attention is ``Executor.ranges`` with ``top + 1`` entries per query (the own block
last), each at most ``block`` keys wide: O(N · (top + 1) · block · D) time per head on every executor.

Selection has a fixed shape whatever the data: a query with fewer than ``top`` candidates (the first blocks) gets
empty ranges for the missing ones (``NONE``), so no shape, and no compiled graph, depends on the content.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..executors import Executor
from ..executors.inputs import Inputs
from ..executors.ranges import Ranges
from ..executors.relative import RelativePositions

NONE = -1  # a selection slot with no block (fewer complete earlier blocks than ``top``)


def complete_blocks(k: Tensor, block: int) -> Tensor:
    """The keys of every complete block: (B, H, N, D) -> (B, H, N // block, block, D), a view."""
    B, H, N, D = k.shape
    nb = N // block
    return k[:, :, :nb * block].reshape(B, H, nb, block, D)


def block_means(k: Tensor, block: int) -> Tensor:
    """The mean key of every complete block: (B, H, N, D) -> (B, H, N // block, D). O(N · D)."""
    return complete_blocks(k, block).mean(3)


def summarise(blocks: Tensor, score: str) -> Tensor:
    """What a block is scored by, from its keys (..., block, D): 'mean', its mean key (..., D) (MoBA); 'bound', its
    keys' least and greatest value in every channel (..., 2D) (Quest, Tang et al. 2024)."""
    if score == "mean":
        return blocks.mean(-2)
    return torch.cat([blocks.amin(-2), blocks.amax(-2)], -1)


def block_scores(q: Tensor, summaries: Tensor, score: str) -> Tensor:
    """Every query's score of every block: q (B, H, Nq, D), ``summarise``'s summaries (B, H, nb, D or 2D) -> (B, H,
    Nq, nb). 'mean': q · mean key. 'bound': max over the block's box of q · k = Σ_d max(q_d · lo_d, q_d · hi_d) =
    q⁺ · hi - q⁻ · lo, an upper bound of the query's best score in the block, so one matching key among filler is
    not averaged away. O(Nq · nb · D)."""
    summaries = summaries.to(q.dtype)
    if score == "mean":
        return torch.einsum("bhnd,bhmd->bhnm", q, summaries)
    lo, hi = summaries.chunk(2, -1)
    return (torch.einsum("bhnd,bhmd->bhnm", q.clamp(min=0), hi)
            - torch.einsum("bhnd,bhmd->bhnm", (-q).clamp(min=0), lo))


def candidates(query_pos: Tensor, blocks: int, block: int) -> Tensor:
    """(Nq, blocks) bool: whether the query at position i (``query_pos`` (Nq,)) may select block j, i.e.
    j < i // block (complete, and before its own)."""
    return torch.arange(blocks, device=query_pos.device)[None, :] < (query_pos // block)[:, None]


def select_blocks(scores: Tensor, block: int, top: int, query_pos: Tensor | None = None) -> Tensor:
    """The ``top`` best candidate blocks of every query by ``scores`` (B, H, Nq, nb), best first; ``NONE`` where the
    query has fewer candidates. ``query_pos``: the queries' positions (Nq,) (default 0 … Nq - 1, a forward).
    Returns (B, H, Nq, top) long. O(Nq · nb) per head."""
    B, H, Nq, nb = scores.shape
    pos = torch.arange(Nq, device=scores.device) if query_pos is None else query_pos
    allowed = candidates(pos, nb, block)  # (Nq, nb)
    chosen = torch.full((B, H, Nq, top), NONE, dtype=torch.long, device=scores.device)
    if nb == 0:
        return chosen
    t = min(top, nb)
    masked = scores.masked_fill(~allowed, float("-inf"))
    values, index = masked.topk(t, dim=-1)
    chosen[..., :t] = torch.where(torch.isfinite(values), index, NONE)
    return chosen


def selected_ranges(chosen: Tensor, block: int, n: int) -> Ranges:
    """The key ranges of the selection ``chosen`` (B, H, N, top): each chosen block's keys [j·block, (j+1)·block),
    an empty range for ``NONE``, and last the query's own block up to itself [i // block · block, i + 1). merge =
    top + 1, width = block; positions for relative distances."""
    B, H, N, top = chosen.shape
    i = torch.arange(N, device=chosen.device)
    start = chosen.clamp(min=0) * block
    lo = torch.where(chosen >= 0, start, 0)
    hi = torch.where(chosen >= 0, start + block, 0)
    own_lo = (i // block * block).expand(B, H, N)[..., None]
    own_hi = (i + 1).expand(B, H, N)[..., None]
    lo = torch.cat([lo, own_lo], -1).flatten(2)  # (B, H, N · (top + 1)): entry m asks with query m // (top + 1)
    hi = torch.cat([hi, own_hi], -1).flatten(2)
    pos = i.expand(1, 1, N)
    return Ranges(lo, hi, width=min(block, n), merge=top + 1, query_pos=pos, key_pos=pos)


def selected_attention(inputs: Inputs, chosen: Tensor, block: int, executor: Executor,
                       rel_pos: RelativePositions | None, need_lse: bool = False) -> tuple[Tensor, Tensor | None]:
    """Every query over the keys of its chosen blocks and of its own block up to itself (one softmax), on
    ``executor``'s ``ranges``. inputs: q, k, v (B, H, N, D); chosen (B, H, N, top) -> out (B, H, N, D) and the lse
    (B, H, N) when ``need_lse``."""
    return executor.ranges(inputs, selected_ranges(chosen, block, inputs.k.shape[2]), rel_pos=rel_pos,
                           need_lse=need_lse)


def selected_mask(chosen: Tensor, block: int) -> Tensor:
    """The definition of the selection's pattern, (B, H, N, N) bool, O(N²): key j is seen by query i when j's block
    is one of i's chosen, or when j is in i's block and j <= i."""
    B, H, N, top = chosen.shape
    i = torch.arange(N, device=chosen.device)
    key_block = i // block  # (N,)
    picked = (chosen[..., None] == key_block).any(-2)  # (B, H, N, N): key j's block among query i's chosen
    own = (key_block[None, :] == key_block[:, None]) & (i[None, :] <= i[:, None])
    return picked | own


def allowed_keys(chosen: Tensor, block: int, t: int, positions: Tensor) -> Tensor:
    """Decoding: which cached keys (at ``positions`` (M,)) the query at ``t`` sees given its selection ``chosen``
    (B, H, top): (B, H, M) bool, the row t of ``selected_mask``."""
    key_block = positions // block
    picked = (chosen[..., None] == key_block).any(-2) & (positions >= 0)
    return picked | ((key_block == t // block) & (positions <= t) & (positions >= 0))


__all__ = ["NONE", "allowed_keys", "block_means", "block_scores", "complete_blocks", "summarise", "candidates", "select_blocks", "selected_attention",
           "selected_mask", "selected_ranges"]
