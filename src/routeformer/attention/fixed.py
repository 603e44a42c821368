"""The Sparse Transformer's fixed pattern: attend within your block, and to the summary cells of every block.

This module is the mechanism's one home: its functional form, its mask (what it means, for the tests), its head kind
and options, registered in ``registry.py``.

Heads. Fixed heads (Sparse Transformer): the own block of l = block positions (A1) and the last c = summary
positions of every block (A2).

Three kinds: 'fixed' (A1 ∪ A2), 'fixed_a1' and 'fixed_a2' (one set each), as for strided heads.

Decoding keeps one buffer holding a ring of the current block beside the summary cells so far; a step reads the
block and the earlier blocks' summary cells as one slice, O((l + t·c/l)·D) (a1: O(l·D); a2: O(t·c/l·D)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..checks import check_options, check_split_heads, positive_int
from ..executors import Backend, Executor, get_executor, merge_partials
from ..executors.inputs import Inputs, check_rel, refuse_cross, relative
from ..executors.pieces import BlockDiagonal, Subset
from ..executors.ranges import Ranges
from ..executors.relative import RelativePositions
from .decoding import seen
from .kinds.base import HeadGroup, HeadKind, KeyStore
from .kinds.common import at_most_seq_len
from .masks import index_grid, split_mask


def fixed_attention(
    inputs: Inputs,
    options: FixedOptions,
    executor: Backend = "auto",
    *,
    causal: bool = True,
    merged: bool = True,
    rel: RelativePositions | None = None,
) -> Tensor:
    """Fixed attention with l = ``options.block``, c = ``options.summary`` (Child et al. 2019).

    A1(i) = {j : floor(j / l) = floor(i / l)}, A2(i) = {j : j mod l >= l - c}, both intersected with j <= i when
    causal. ``merged=True``: every head attends to A1 ∪ A2; ``merged=False``: the first half of the heads to A1,
    the second half to A2.

    ``inputs``: ``Inputs.of(q, k, v, ...)``, q, k, v (B, H, N, D) -> (B, H, N, D). A1 is a block-diagonal tiling;
    A2 gathers the N·c/l summary keys once and attends to them (merged heads: those of other blocks only, so no key
    counts twice), the two combined through their log-sum-exp. O(N · (l + N·c/l) · D) time, O(N · (l + N·c/l))
    memory. ``executor``: a name or an ``Executor`` (``"auto"``: FlexAttention on CUDA, the fused kernels on the
    CPU; ``"fused"``, ``"tiles"``, ``"flex"``). ``rel``: relative-position tables, or None.
    """
    refuse_cross(inputs, "fixed attention's blocks")
    options = check_options("options", options, FixedOptions)
    block = options.block
    q = inputs.q
    B, H, N, D = inputs.shape
    executor = get_executor(executor, q.device)
    terms = check_rel(rel, q)
    if merged:
        parts = [executor.tiled(inputs, BlockDiagonal(block, causal), rel=terms, need_lse=True)]
        cells, allow, spans = summary_call(inputs, options, other_blocks=True, causal=causal,
                                           ranges=executor.native_ranges)
        if cells.numel():  # A2 without a summary cell before N attends to no key; called here, not through
            # summary_attention: one frame less from the model to the kernel
            parts.append(executor.tiled(inputs, Subset(cells, allow), rel=terms, need_lse=True) if spans is None
                         else executor.ranges(inputs.keys_at(cells), spans, rel_pos=rel, need_lse=True))
        return merge_partials(parts)[0]  # type: ignore[arg-type]
    half = check_split_heads(H)
    a1, _ = executor.tiled(inputs.head_range(0, half), BlockDiagonal(block, causal), rel=terms)
    a2 = summary_attention(inputs.head_range(half, H), options, executor, other_blocks=False, causal=causal,
                           rel=rel)[0]
    return torch.cat([a1, a2], dim=1)


def summary_attention(inputs: Inputs, options: FixedOptions, executor: Executor, *, other_blocks: bool, causal: bool,
                      rel: RelativePositions | None = None, need_lse: bool = False) -> tuple[Tensor, Tensor | None]:
    """A2: every query against the summary cells (j mod l >= l - c; of other blocks only when ``other_blocks``;
    earlier ones when causal) -> (out (B, H, N, D), lse (B, H, N) or None); zeros (lse -inf) where no cell is.
    Computed as ``summary_call`` says, on ``executor``."""
    q = inputs.q
    cells, allow, spans = summary_call(inputs, options, other_blocks=other_blocks, causal=causal,
                                       ranges=executor.native_ranges)
    if not cells.numel():
        B, H, N, D = inputs.shape
        return q.new_zeros(B, H, N, D), (q.new_full((B, H, N), float("-inf")) if need_lse else None)
    if spans is None:
        return executor.tiled(inputs, Subset(cells, allow), rel=check_rel(rel, q), need_lse=need_lse)
    return executor.ranges(inputs.keys_at(cells), spans, rel_pos=rel, need_lse=need_lse)


def summary_call(inputs: Inputs, options: FixedOptions, *, other_blocks: bool, causal: bool,
                 ranges: bool) -> tuple[Tensor, Tensor | None, Ranges | None]:
    """How A2 is computed: the summary cells (M,) (``summary_keys``: none where no cell lies before N, attention
    to no key), which of them each query sees, (N, M) or None, and None: one dense (N, M) tile of the N·c/l cells
    gathered once (``Subset``), O(N · M · D). With packed documents and ``ranges`` (an executor that computes key
    ranges itself: fused, flex), the third is a query's cells as one or two ranges of them within its document
    (``summary_ranges``, for ``Executor.ranges`` over ``inputs.keys_at(cells)``), O(Σ_docs L_d · M_d · D) for M_d
    cells in a document of L_d positions: documents cut the work instead of masking a dense tile."""
    q = inputs.q
    N = q.shape[2]
    block, summary = options.block, options.summary
    cells, allow = summary_keys(N, block, summary, other_blocks=other_blocks, causal=causal, device=q.device)
    if inputs.documents is None or not ranges or not cells.numel():
        return cells, allow, None
    return cells, allow, summary_ranges(inputs.documents, cells, block, summary, other_blocks=other_blocks,
                                        causal=causal)


def summary_ranges(documents: Tensor, cells: Tensor, block: int, summary: int, *, other_blocks: bool,
                   causal: bool) -> Ranges:
    """The summary cells of each query's document as ranges of ``cells`` (M,) (``summary_keys``' order, whose
    positions the ranges' distances are taken from): documents (B, N) numbered from 0 per row -> ``Ranges``
    (B, 1, N · merge): merge 1, the cells before the query's own block (``other_blocks``, causal) or up to the
    query (causal); merge 2, those before and those after its own block (``other_blocks``, not causal); merge 1,
    all of its document's (neither). A fixed number of operations on (B, N) integers."""
    N = documents.shape[1]
    pos = torch.arange(N, device=documents.device)
    ids = documents.contiguous()
    first, end = torch.searchsorted(ids, ids), torch.searchsorted(ids, ids, right=True)  # each document's [first, end)

    def before(p: Tensor) -> Tensor:  # cells at positions < p: summary_count, elementwise
        return p // block * summary + (p % block - (block - summary)).clamp_min(0)

    lo, hi = before(first), before(end)  # (B, N): the document's cells
    own = pos // block * block  # the own block's first position
    if other_blocks and causal:
        bounds = [(lo, torch.minimum(hi, before(own)))]
    elif other_blocks:
        bounds = [(lo, torch.minimum(hi, before(own))), (torch.maximum(lo, before((own + block).clamp_max(N))), hi)]
    elif causal:
        bounds = [(lo, torch.minimum(hi, before(pos + 1)))]
    else:
        bounds = [(lo, hi)]
    lo = torch.stack([a for a, _ in bounds], -1).flatten(-2)  # (B, N · merge)
    hi = torch.stack([torch.maximum(a, e) for a, e in bounds], -1).flatten(-2)  # an empty range where none is left
    return Ranges(lo[:, None], hi[:, None], width=cells.shape[0], merge=len(bounds), query_pos=pos[None, None],
                  key_pos=cells[None, None])


def summary_count(n: int, block: int, summary: int) -> int:
    """How many summary cells (j mod block >= block - summary) lie before position n."""
    return n // block * summary + max(0, n % block - (block - summary))


def summary_keys(n: int, block: int, summary: int, *, other_blocks: bool, causal: bool,
                 device: torch.device) -> tuple[Tensor, Tensor | None]:
    """A2's keys for the executor's ``subset``: the summary positions (j mod l >= l - c), (M,) ascending, and which
    of them each of the n queries sees, (n, M) bool or None for all (of other blocks only when ``other_blocks``)."""
    pos = torch.arange(n, device=device)
    count = summary_count(n, block, summary)
    m = torch.arange(count, device=device)
    cells = m // summary * block + (block - summary) + m % summary  # (M,), ascending
    i, j = pos[:, None], cells[None, :]
    if other_blocks:
        allow = (j // block < i // block) if causal else (j // block != i // block)
    else:
        allow = (j <= i) if causal else None
    return cells, allow


# --- what it means: the mask from its definition (O(N²), sharing no code with the fast path) ---


def fixed_mask(
    n: int,
    block: int,
    summary: int,
    causal: bool = True,
    merged: bool = True,
    heads: int | None = None,
    *,
    device=None,
) -> Tensor:
    """Sparse Transformer fixed pattern, l = block, c = summary.

    A1(i) = {j : floor(j / l) = floor(i / l)}, A2(i) = {j : j mod l >= l - c}, both intersected with j <= i when
    causal. ``merged`` as in ``strided_mask``.
    """
    l, c = positive_int("block", block), positive_int("summary", summary)
    if c > l:
        raise ValueError(f"summary must be at most block, got summary={c} > block={l}")
    i, j = index_grid(n, device)
    a1 = (j // l) == (i // l)
    a2 = (j % l) >= (l - c)
    if causal:
        a1, a2 = a1 & (j <= i), a2 & (j <= i)
    return split_mask(a1, a2, merged, heads)


# --- the head kinds: how a model uses it ---


@dataclass(frozen=True)
class FixedOptions:
    """options.fixed (read by fixed, fixed_a1 and fixed_a2): the block l (at most seq_len) and the summary cells
    c <= l at the end of each block."""

    block: int = 128
    summary: int = 8

    def __post_init__(self) -> None:
        positive_int("block", self.block)
        positive_int("summary", self.summary)
        if self.summary > self.block:
            raise ValueError(f"summary ({self.summary}) must be at most block ({self.block})")


def _complete(o: FixedOptions, config: Any) -> FixedOptions:
    at_most_seq_len("block", o.block, config)
    return o


@dataclass
class FixedCache:
    """Fixed heads' decoding state: one buffer of [a ring of the current block | the summary cells in order];
    ``block`` and ``summary`` are stores over its two parts (views; None when the part needs none)."""

    ROWS: ClassVar[tuple[str, ...]] = ("keys", "values")  # per sequence (reorder_rows); block, summary: views

    keys: Tensor
    values: Tensor
    positions: Tensor
    block: KeyStore | None
    summary: KeyStore | None


class FixedHeads(HeadGroup):
    """part: 'merged' (A1 ∪ A2), 'a1' (the own block) or 'a2' (summary cells)."""

    def __init__(self, heads: int, head_dim: int, options: FixedOptions, part: str) -> None:
        super().__init__(heads, head_dim)
        self.options, self.part = options, part

    @property
    def block(self) -> int:
        return self.options.block

    @property
    def summary(self) -> int:
        return self.options.summary

    def forward(self, q, k, v, rel_pos, documents=None):
        if self.part == "merged":
            return fixed_attention(self.inputs(q, k, v, documents), self.options, self.executor, rel=rel_pos)
        if self.part == "a1":
            return self.executor.tiled(Inputs(q, k, v, self.scale, documents=documents),
                                       BlockDiagonal(self.block, True), rel=relative(rel_pos))[0]
        return summary_attention(Inputs(q, k, v, self.scale, documents=documents), self.options, self.executor,
                                 other_blocks=False, causal=True, rel=rel_pos)[0]

    def reference_mask(self, q, k):
        a1, a2 = fixed_mask(q.shape[2], self.block, self.summary, merged=False, heads=2, device=q.device)
        return {"merged": a1 | a2, "a1": a1, "a2": a2}[self.part]

    def new_cache(self, batch, max_len, device, dtype):
        own = 0 if self.part == "a2" else min(self.block, max_len)
        cells = 0 if self.part == "a1" else max(1, summary_count(max_len, self.block, self.summary))
        joint = KeyStore.empty(batch, self.heads, own + cells, self.head_dim, ring=False, device=device, dtype=dtype)

        def part(slots: slice, ring: bool) -> KeyStore:
            return KeyStore(joint.keys[:, :, slots], joint.values[:, :, slots], joint.positions[slots], ring)

        return FixedCache(joint.keys, joint.values, joint.positions, part(slice(0, own), True) if own else None,
                          part(slice(own, None), False) if cells else None)

    def keep(self, cache, k, v, positions, start, since=None):
        if cache.block is not None:
            cache.block.add(k, v, positions)
        if cache.summary is not None:
            first_cell = self.block - self.summary
            if positions.numel() == 1:  # decided on the host: no device sync per token
                if start % self.block >= first_cell:
                    cache.summary.add(k, v, positions)
            else:
                cells = positions % self.block >= first_cell
                cache.summary.add(k[:, :, cells], v[:, :, cells], positions[cells])

    def step(self, q, cache, t, rel_pos, since=None):
        if self.part == "a2":  # the summary cells so far, the own block's included
            keys, values, positions = cache.summary.filled()
            return self.attend(q, keys, values, positions, t, rel_pos, allowed=seen(positions, since))
        first = t - t % self.block  # the own block starts here
        if self.part == "a1":
            keys, values, positions = cache.block.filled()
            return self.attend(q, keys, values, positions, t, rel_pos,
                               allowed=seen(positions, since, positions >= first))
        # merged: the block ring and the earlier blocks' summary cells (the own block's are in A1) are one slice
        own = cache.block.capacity
        m = own + summary_count(first, self.block, self.summary)
        positions = cache.positions[:m]
        allowed = positions >= first  # in the ring: the own block (empty slots hold -1)
        allowed[own:] = True
        return self.attend(q, cache.keys[:, :, :m], cache.values[:, :, :m], positions, t, rel_pos,
                           allowed=seen(positions, since, allowed))


def _kind(name: str, part: str, keys, summary: str) -> HeadKind:
    return HeadKind(name, lambda o, heads, head_dim, seed: FixedHeads(heads, head_dim, o, part),
                    keys_per_query=keys, option_type=FixedOptions, section="fixed", complete=_complete,
                    describe=lambda o: f"block={o.block}, summary={o.summary}",
                    summary=summary, documents=True)


KINDS = (
    _kind("fixed", "merged", lambda o, n: min(o.block, n) / 2 + n * o.summary / (2 * o.block),
          "the own block and the summary cells of every block"),
    _kind("fixed_a1", "a1", lambda o, n: min(o.block, n) / 2, "the own block"),
    _kind("fixed_a2", "a2", lambda o, n: n * o.summary / (2 * o.block), "the summary cells of every block"),
)
