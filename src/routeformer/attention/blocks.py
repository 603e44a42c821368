"""Block selection: the piece MoBA (Lu et al. 2025) and NSA (Yuan et al. 2025) share.

The keys are cut into blocks of ``block`` positions. A query at position i scores the *complete blocks before its
own* (j < i // block, so every key of a candidate lies before the query's block: causal by construction) by some
score of the kind's (MoBA: q · the block's mean key; NSA: its compressed attention), takes its ``top`` best, and
attends to their keys and to its own block's keys up to itself, one softmax over the union. Selected blocks are
contiguous key ranges, so the attention is ``Executor.ranges`` with ``top + 1`` entries per query (the own block
last), each at most ``block`` keys wide: O(N · (top + 1) · block · D) time per head on every executor.

Selection has a fixed shape whatever the data: a query with fewer than ``top`` candidates (the first blocks) gets
empty ranges for the missing ones (``NONE``), so no shape, and no compiled graph, depends on the content.

The kinds also share their heads' frame (``BlockHeads``: the block, an optional dense warm-up counted in optimiser
steps, the decoding cache ``BlockCache`` of every key plus per-block summaries), the completion of their options'
warm-up length, and the count of the keys a selection costs (``selection_keys``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..executors import Executor
from ..executors.inputs import Inputs
from ..executors.ranges import Ranges
from ..executors.relative import RelativePositions
from .kinds.base import HeadGroup, KeyStore, Warmup
from .kinds.common import at_most_seq_len

NONE = -1  # a selection slot with no block (fewer complete earlier blocks than ``top``)
# Up to this many picks, ``select_blocks`` takes passes of max rather than ``topk``: on the CPU topk of 1-3 among 32
# blocks (B = 4, H = 2, N = 2048) took 5.7-13.9 ms, max 1.1 ms, one thread (2026-11-27).
PASSES_OF_MAX = 4


def complete_blocks(k: Tensor, block: int) -> Tensor:
    """The keys of every complete block: (B, H, N, D) -> (B, H, N // block, block, D), a view."""
    B, H, N, D = k.shape
    nb = N // block
    return k[:, :, :nb * block].reshape(B, H, nb, block, D)


def block_means(k: Tensor, block: int) -> Tensor:
    """The mean key of every complete block: (B, H, N, D) -> (B, H, N // block, D). O(N · D)."""
    return complete_blocks(k, block).mean(3)


def block_bounds(k: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """The least and the greatest key value in every channel of every complete block (Quest, Tang et al. 2024):
    (B, H, N, D) -> two (B, H, N // block, D). O(N · D)."""
    blocks = complete_blocks(k, block)
    return blocks.amin(3), blocks.amax(3)


def block_scores(q: Tensor, summary: tuple[Tensor, ...], score: str) -> Tensor:
    """Every query's score of every block: q (B, H, Nq, D) and the blocks' summary -> (B, H, Nq, nb).

    'mean' (summary: the mean keys): q · mean key, MoBA's. 'bound' (summary: ``block_bounds``): the largest q · x
    over the box of the block's per-channel key ranges, Σ_d max(q_d · lo_d, q_d · hi_d) = q⁺ · hi - q⁻ · lo, an
    upper bound of the query's best score in the block, so one matching key among filler is not averaged away.
    O(Nq · nb · D)."""
    if score == "mean":
        (means,) = summary
        return torch.einsum("bhnd,bhmd->bhnm", q, means.to(q.dtype))
    lo, hi = (x.to(q.dtype) for x in summary)
    # q⁺ · hi - q⁻ · lo with q⁻ = q⁺ - q is q⁺ · (hi - lo) + q · lo: one product over 2D channels, not two
    return torch.einsum("bhnd,bhmd->bhnm", torch.cat([q.clamp(min=0), q], -1), torch.cat([hi - lo, lo], -1))


def candidate_blocks(query_pos: Tensor, blocks: int, block: int) -> Tensor:
    """(Nq, blocks) bool: whether the query at position i (``query_pos`` (Nq,)) may select block j, i.e.
    j < i // block (complete, and before its own)."""
    return torch.arange(blocks, device=query_pos.device)[None, :] < (query_pos // block)[:, None]


def select_blocks(scores: Tensor, block: int, top: int, query_pos: Tensor | None = None,
                  allowed: Tensor | None = None) -> Tensor:
    """The ``top`` best candidate blocks of every query by ``scores`` (B, H, Nq, nb), best first; ``NONE`` where the
    query has fewer candidates. ``query_pos``: the queries' positions (Nq,) (default 0 … Nq - 1, a forward);
    ``allowed``: the candidates, broadcastable to the scores (default ``candidate_blocks``; packed documents:
    ``BlockDocuments.candidates``). Returns (B, H, Nq, top) long. O(Nq · nb) per head."""
    B, H, Nq, nb = scores.shape
    pos = torch.arange(Nq, device=scores.device) if query_pos is None else query_pos
    if allowed is None:
        allowed = candidate_blocks(pos, nb, block)  # (Nq, nb)
    chosen = torch.full((B, H, Nq, top), NONE, dtype=torch.long, device=scores.device)
    if nb == 0:
        return chosen
    t = min(top, nb)
    masked = scores.masked_fill(~allowed, float("-inf"))
    if t > PASSES_OF_MAX:
        values, index = masked.topk(t, dim=-1)
        chosen[..., :t] = torch.where(torch.isfinite(values), index, NONE)
        return chosen
    picks = []  # t passes of max, each removing its pick (out of place, as torch.compile wants)
    for n in range(t):
        value, best = masked.max(-1, keepdim=True)
        picks.append(torch.where(torch.isfinite(value), best, NONE))
        if n + 1 < t:
            masked = masked.scatter(-1, best, float("-inf"))
    chosen[..., :t] = torch.cat(picks, -1)
    return chosen


def selected_ranges(chosen: Tensor, block: int, n: int, start: Tensor | None = None) -> Ranges:
    """The key ranges of the selection ``chosen`` (B, H, N, top): each chosen block's keys [j·block, (j+1)·block),
    an empty range for ``NONE``, and last the query's own block up to itself [i // block · block, i + 1). merge =
    top + 1, width = block; positions for relative distances. ``start`` (B, N): packed documents, each query's
    document's first position; every range then begins there at the earliest (``BlockDocuments``)."""
    B, H, N, top = chosen.shape
    i = torch.arange(N, device=chosen.device)
    first = chosen.clamp(min=0) * block
    lo = torch.where(chosen >= 0, first, 0)
    hi = torch.where(chosen >= 0, first + block, 0)
    own_lo = (i // block * block).expand(B, H, N)[..., None]
    if start is not None:  # a range never reaches before the query's document (hi > start: its blocks end after)
        lo = torch.maximum(lo, start[:, None, :, None]).minimum(hi)
        own_lo = torch.maximum(own_lo, start[:, None, :, None])
    own_hi = (i + 1).expand(B, H, N)[..., None]
    lo = torch.cat([lo, own_lo], -1).flatten(2)  # (B, H, N · (top + 1)): entry m asks with query m // (top + 1)
    hi = torch.cat([hi, own_hi], -1).flatten(2)
    pos = i.expand(1, 1, N)
    # Kernel blocks of 64 entries spanning up to block + max(8, block / 4) keys: the entries sorted by hi gather
    # each key block's selections and its own queries together. Against the defaults (rows from the width: 16 at
    # block 64), forward+backward on the fused executor, one thread, B = 4, H = 2, D = 32 (2026-11-27): N 2048,
    # block 64, top 1: 20.2-23.6 -> 17.6-19.2 ms (local, window 128: 16.1-17.9); block 32, top 2: 23.8-37.9 ->
    # 18.6-20.0; N 128, block 8, top 3: 2.5 -> 1.4-2.1.
    return Ranges(lo, hi, width=min(block, n), merge=top + 1, query_pos=pos, key_pos=pos,
                  stretch=max(8, block // 4), rows=64, documents=start)


def selected_attention(inputs: Inputs, chosen: Tensor, block: int, executor: Executor,
                       rel_pos: RelativePositions | None, need_lse: bool = False,
                       documents: BlockDocuments | None = None) -> tuple[Tensor, Tensor | None]:
    """Every query over the keys of its chosen blocks and of its own block up to itself (one softmax), on
    ``executor``'s ``ranges``. inputs: q, k, v (B, H, N, D); chosen (B, H, N, top) -> out (B, H, N, D) and the lse
    (B, H, N) when ``need_lse``. ``documents``: the inputs' packed documents as blocks see them (the selection must
    have been made among ``documents.candidates``); the ranges then hold them."""
    if documents is not None:
        spans = selected_ranges(chosen, block, inputs.k.shape[2], documents.start)
        inputs = inputs.with_(documents=None)  # held by the ranges now
    else:
        spans = selected_ranges(chosen, block, inputs.k.shape[2])
    return executor.ranges(inputs, spans, rel_pos=rel_pos, need_lse=need_lse)


class BlockDocuments(NamedTuple):
    """Packed documents as block selection sees them. The blocks stay where they are (every ``block`` positions of
    the row); a query selects among the complete blocks before its own that hold keys of its document, the first of
    them perhaps partly (it began in another document): that one is scored by, and reads, its own document's keys
    only.

    start: (B, N) long, the first position of each position's document; first: (B, N) long, the first block a
    query may select (the block holding its start); partial: (B, N) bool, whether that block begins in another
    document."""

    start: Tensor
    first: Tensor
    partial: Tensor

    @classmethod
    def of(cls, documents: Tensor, block: int) -> BlockDocuments:
        """From (B, N) ids that never decrease along a row (``check_documents``'s)."""
        ids = documents.contiguous()
        return cls.starting(torch.searchsorted(ids, ids), block)  # where each position's id first occurs

    @classmethod
    def starting(cls, start: Tensor, block: int) -> BlockDocuments:
        """From each query's document's first position, (B, n) long (decoding: ``since[:, None]``)."""
        return cls(start, start // block, start % block != 0)

    def candidates(self, blocks: int, block: int, positions: Tensor | None = None) -> Tensor:
        """(B, 1, n, blocks) bool: the blocks each query (at ``positions`` (n,), default 0 … n - 1) may select, its
        document's first … its own block - 1."""
        j = torch.arange(blocks, device=self.start.device)
        i = torch.arange(self.start.shape[1], device=self.start.device) if positions is None else positions
        return ((j >= self.first[..., None]) & (j < (i // block)[:, None]))[:, None]

    def partial_column(self, blocks: int) -> Tensor:
        """(B, 1, n, blocks) bool: the entry of each query's partial first block (none where it is whole)."""
        j = torch.arange(blocks, device=self.start.device)
        return ((j == self.first[..., None]) & self.partial[..., None])[:, None]

    def suffixes(self, x: Tensor, block: int, reduce: Callable[[Tensor], Tensor]) -> Tensor:
        """For every query, ``reduce`` of its document's keys in its first block, x (B, H, N, D) -> (B, H, N, D):
        ``reduce`` maps the whole blocks (B, H, nb, block, D) to each position's value over the positions from it to
        its block's end (a reversed cumulative sum, min, max: every value from the document's own keys only), read at
        the query's document start. Queries whose first block is not a complete one get a value never used."""
        B, H, N, D = x.shape
        nb = N // block
        if nb == 0:
            return x.new_zeros(B, H, N, D)
        tails = reduce(complete_blocks(x, block)).reshape(B, H, nb * block, D)
        at = self.start.clamp(max=nb * block - 1)[:, None, :, None].expand(B, H, N, D)
        return tails.gather(2, at)


def decoded_tail(keys: Tensor, since: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """Decoding over packed documents: each row's first block of its document, from the document's start on.
    keys: (B, H, capacity, D) kept in position order (slot = position); since (B,) the rows' documents' first
    positions. Returns that block's keys (B, H, block, D) and which of them are the document's (B, 1, block, 1)
    bool. A row whose document begins at a block's start gets the whole block."""
    B, H, capacity, D = keys.shape
    first = since // block  # (B,)
    offsets = torch.arange(block, device=keys.device)
    slots = (first[:, None] * block + offsets).clamp(max=capacity - 1)  # (B, block)
    tail = keys.gather(2, slots[:, None, :, None].expand(B, H, block, D))
    mine = (slots >= since[:, None])[:, None, :, None]
    return tail, mine


def decoded_summary(tail: Tensor, mine: Tensor, score: str) -> tuple[Tensor, ...]:
    """``decoded_tail``'s block summarised over the document's keys (B, H, D) each, as ``block_scores`` reads a
    summary: the mean key ('mean'), or the least and greatest values ('bound')."""
    if score == "mean":
        return ((tail * mine).sum(2) / mine.sum(2).clamp(min=1).to(tail.dtype),)
    return tail.masked_fill(~mine, float("inf")).amin(2), tail.masked_fill(~mine, float("-inf")).amax(2)


def reversed_cumsum(blocks: Tensor) -> Tensor:
    """(…, block, D) -> the sums from each position to the block's end, added from the end (only later keys)."""
    return blocks.flip(-2).cumsum(-2).flip(-2)


def block_tail_means(keys: Tensor, block: int, documents: BlockDocuments) -> Tensor:
    """Each query's partial first block's mean key over its document's keys there (``BlockDocuments.suffixes``)."""
    sums = documents.suffixes(keys, block, reversed_cumsum)
    count = block - documents.start % block  # (B, N) keys from the start to the block's end
    return sums / count[:, None, :, None].to(sums.dtype)


def block_tail_bounds(keys: Tensor, block: int, documents: BlockDocuments) -> tuple[Tensor, Tensor]:
    """Each query's partial first block's least and greatest key values over its document's keys there."""
    lo = documents.suffixes(keys, block, lambda b: b.flip(-2).cummin(-2).values.flip(-2))
    hi = documents.suffixes(keys, block, lambda b: b.flip(-2).cummax(-2).values.flip(-2))
    return lo, hi


def scores_within_documents(scores: Tensor, q: Tensor, tail: tuple[Tensor, ...], score: str,
                            documents: BlockDocuments) -> Tensor:
    """``scores`` (B, H, n, nb) of queries q (B, H, n, D) with each query's partial first block scored by its
    document's keys there (``tail``: that block's summary per query, (B, H, n, D) each, as ``block_scores`` reads
    them: the same formula, one block per query)."""
    if score == "mean":
        (means,) = tail
        own = (q * means.to(q.dtype)).sum(-1)
    else:
        lo, hi = (x.to(q.dtype) for x in tail)
        own = (q.clamp(min=0) * (hi - lo) + q * lo).sum(-1)
    return torch.where(documents.partial_column(scores.shape[-1]), own[..., None], scores)


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


# --- what block-selecting kinds share: their heads' frame, decoding cache, options and cost ---


class BlockCache:
    """Decoding state of block-selecting heads: every key and value (``KeyStore``: a selected block may be any
    earlier one) and ``parts`` summaries of each complete block (B, H, max_len // block, D) each (MoBA: its mean key;
    NSA: its compressed key and value), written once, when the block's last key is kept.

    ``summarise(keys, values)``: keys and values of whole blocks (B, H, m · block, D) -> ``parts`` tensors
    (B, H, m, D), the same function the heads' forward applies, so that a step sees what the forward saw."""

    ROWS: ClassVar[tuple[str, ...]] = ("store", "summaries")  # one row per sequence (reorder_rows)

    def __init__(self, store: KeyStore, block: int, summarise: Callable[[Tensor, Tensor], tuple[Tensor, ...]],
                 parts: int) -> None:
        B, H, capacity, D = store.keys.shape
        self.store, self.block, self.summarise = store, block, summarise
        self.summaries = tuple(store.keys.new_zeros(B, H, capacity // block, D) for _ in range(parts))

    @property
    def count(self) -> int:
        return self.store.count

    def add(self, k: Tensor, v: Tensor, positions: Tensor) -> None:
        before = self.store.count
        self.store.add(k, v, positions)
        b = self.block
        first, last = before // b, self.store.count // b  # the blocks these positions completed
        if last > first:
            span = slice(first * b, last * b)
            made = self.summarise(self.store.keys[:, :, span], self.store.values[:, :, span])
            for kept, new in zip(self.summaries, made, strict=True):
                kept[:, :, first:last] = new.to(kept.dtype)

    def before(self, t: int) -> tuple[Tensor, ...]:
        """The summaries of the complete blocks before position t's own, (B, H, t // block, D) each."""
        return tuple(s[:, :, :t // self.block] for s in self.summaries)

    def filled(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.store.filled()


class BlockHeads(HeadGroup):
    """What block-selecting heads share: their ``block``, an optional dense warm-up (full causal attention for the
    first ``warmup`` optimiser steps) and their decoding cache (``BlockCache`` of the ``parts`` summaries their
    ``summarise`` makes of each block). Subclasses write ``forward``, ``summarise`` and ``step``."""

    parts = 1  # summaries per block the decoding cache keeps

    def __init__(self, heads: int, head_dim: int, block: int, warmup: int) -> None:
        super().__init__(heads, head_dim)
        self.block, self.warmup = block, warmup
        # optimiser steps taken, for the warm-up; a buffer so that a saved run resumes in the same phase, and a Python
        # mirror so that a forward decides its mode without reading a tensor (on CUDA: without waiting for the device)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self._steps = 0

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._steps = int(self.steps)

    @property
    def warming_up(self) -> bool:
        """Whether the heads still attend to every earlier key (their first ``warmup`` optimiser steps)."""
        return self._steps < self.warmup

    def after_optimizer_step(self, step: int | None, group: dist.ProcessGroup | None) -> bool:
        if self._steps >= self.warmup:
            return False
        self.steps.add_(1)
        self._steps += 1
        return True

    def own_repr(self) -> str:
        """The kind's own settings for ``extra_repr`` ('top_k=3, score=mean')."""
        return ""

    def extra_repr(self) -> str:
        warmup = f", warmup={self.warmup}" if self.warmup else ""
        return (f"heads={self.heads}, block={self.block}, {self.own_repr()}{warmup}, "
                f"executor={self.executor.name}")

    def summarise(self, keys: Tensor, values: Tensor) -> tuple[Tensor, ...]:
        """The ``parts`` summaries (B, H, m, D) of the m whole blocks of ``keys``, ``values`` (B, H, m · block, D)."""
        raise NotImplementedError

    def new_cache(self, batch: int, max_len: int, device, dtype) -> BlockCache:
        store = KeyStore.empty(batch, self.heads, max_len, self.head_dim, ring=False, device=device, dtype=dtype)
        return BlockCache(store, self.block, self.summarise, self.parts)


def default_block(seq_len: int, top: int) -> int:
    """The block that gives routing's default cost, top · block ≈ 2 · sqrt(seq_len) selected keys per query."""
    return max(1, min(seq_len, round(2 * math.sqrt(seq_len) / top)))


def complete_block(block: int | None, top: int, config: Any) -> int:
    """options' ``block`` against the model: ``default_block`` when None, and at most seq_len."""
    return at_most_seq_len("block", default_block(config.seq_len, top) if block is None else block, config)


def warmup_length(length: int | None, warmup: int, config: Any) -> int | None:
    """options' ``warmup_len`` checked against the model: it must divide seq_len; None without a warm-up (it has
    nothing to set then)."""
    if length is not None and (length > config.seq_len or config.seq_len % length):
        raise ValueError(f"warmup_len ({length}) must divide seq_len ({config.seq_len}): the warm-up trains on each "
                         f"sequence cut into pieces that long")
    return length if warmup else None


def dense_warmup(o: Any) -> Warmup:
    """The warm-up phase of options with ``warmup`` and ``warmup_len``: every earlier key, (n + 1) / 2 per query."""
    return Warmup(o.warmup, lambda n: (n + 1) / 2, o.warmup_len)


def describe_warmup(o: Any) -> str:
    """', warm-up=S[ at length L]' for options with a warm-up, else ''."""
    if not o.warmup:
        return ""
    return f", warm-up={o.warmup}" + (f" at length {o.warmup_len}" if o.warmup_len is not None else "")


def selection_keys(block: int, top: int, n: int, summaries: int = 1) -> float:
    """Keys per query of a selection at context n, averaged over the query positions: the ``top`` blocks of an
    average query (fewer for the first), its own block (half full on average), and the complete earlier blocks'
    ``summaries`` vectors each it scores."""
    earlier = torch.arange(n, dtype=torch.float64) // block  # complete blocks before each query's own
    return float(earlier.clamp(max=top).mean() * block + (min(block, n) + 1) / 2 + summaries * earlier.mean())


__all__ = ["NONE", "BlockCache", "BlockHeads", "allowed_keys", "block_bounds", "block_means", "block_scores",
           "candidate_blocks", "complete_block", "complete_blocks", "default_block", "dense_warmup",
           "describe_warmup", "select_blocks", "selected_attention", "selected_mask", "selected_ranges",
           "selection_keys", "warmup_length"]
