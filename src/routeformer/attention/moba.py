"""MoBA, mixture of block attention (Lu et al. 2025): each query selects the ``top_k`` earlier blocks of keys it
scores highest (by their mean key, MoBA's gate, or by Quest's bound, ``score = "bound"``), and attends to them and to
its own block up to itself.

This module is the mechanism's one home: its head kind, options and decoding, registered in ``registry.py``; the
selection and its ranges are ``blocks.py`` (shared with the NSA-style kind).

Heads. The keys are cut into blocks of ``block``. Query i scores every complete block before its own by q_i · mean
key (MoBA's parameter-free gate: the loss trains the selection only through the keys' and queries' use in the
attention; ``score = "bound"``: the upper bound of q_i · k over the block's per-channel key ranges,
``blocks.block_scores``, which does not average one matching key away among filler) and takes its ``top_k`` best,
then one softmax over their keys and its own block's keys j <= i: causal by construction. Per query (top_k + 1) ·
block keys at most, plus N / block block scores: O(N · (top_k · block + N / block) · D) per head, O(N^1.5 · D) with
block ~ sqrt(N). An optional dense warm-up (``warmup`` optimiser steps of full causal attention, on sequences of
``warmup_len``) is the recipe routing's recall study found decisive. On the CPU (float32, float64, the kernels
built) the selection is one fused pass that scores each query's candidate blocks only, without the (N, N / block)
scores (``executors/fused/selection.py``); elsewhere PyTorch's operators (``blocks.select_blocks``).

Decoding keeps every key and value (a selected block may be any earlier one) and what each block is scored by (its
mean key, or its least and greatest key values), written once when its last key arrives: a new token costs O(N /
block · D + (top_k + 1) · block · D) per head.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..checks import check_options, positive_int
from ..documents import CrossDocuments
from ..executors import Backend, get_executor
from ..executors.inputs import Inputs, check_rel
from ..executors.ranges import Ranges
from ..executors.relative import RelativePositions
from .blocks import (
    BlockCache,
    BlockDocuments,
    BlockHeads,
    allowed_keys,
    block_bounds,
    block_means,
    block_scores,
    block_tail_bounds,
    block_tail_means,
    complete_block,
    decoded_summary,
    decoded_tail,
    default_block,
    dense_warmup,
    describe_warmup,
    scores_within_documents,
    select_blocks,
    selected_attention,
    selected_mask,
    selection_keys,
    warmup_length,
)
from .decoding import seen
from .full import full_attention
from .kinds.base import HeadKind
from .kinds.common import non_negative_int

SCORES = ("mean", "bound")  # how a block is scored: MoBA's mean key, or Quest's bound (``blocks.block_scores``)


@dataclass(frozen=True)
class MobaOptions:
    """options.moba: the block size (None: ``default_block``), the blocks each query selects, how a block is scored
    ('mean': q · its mean key, MoBA's; 'bound': an upper bound of q · k over its keys, Quest's), and an optional
    dense warm-up (steps, and the length of the sequences it trains on; None: the model's)."""

    block: int | None = None
    top_k: int = 3
    score: str = "mean"
    warmup: int = 0
    warmup_len: int | None = None

    def __post_init__(self) -> None:
        if self.block is not None:
            positive_int("block", self.block)
        positive_int("top_k", self.top_k)
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {', '.join(map(repr, SCORES))}, got {self.score!r}")
        non_negative_int("warmup", self.warmup)
        if self.warmup_len is not None:
            positive_int("warmup_len", self.warmup_len)


class MobaHeads(BlockHeads):
    """Block-selecting heads (see the module). q, k, v: (B, h, N, D) -> (B, h, N, D). The decoding cache keeps
    what each block is scored by (``BlockCache``): its mean key, or its keys' per-channel least and greatest values."""

    def __init__(self, heads: int, head_dim: int, options: MobaOptions) -> None:
        super().__init__(heads, head_dim, options.block, options.warmup)
        self.options = options
        self.top_k, self.score = options.top_k, options.score
        self.parts = 1 if self.score == "mean" else 2

    def summarise(self, keys: Tensor, values: Tensor) -> tuple[Tensor, ...]:
        if self.score == "mean":
            return (block_means(keys, self.block),)
        return block_bounds(keys, self.block)

    def select(self, q: Tensor, k: Tensor, documents: Tensor | None = None) -> Tensor:
        """(B, h, N, top_k) long: every query's selected blocks, best first (``blocks.NONE`` for missing ones).
        ``documents`` (B, N), numbered from 0 per row: packed documents, a query choosing among its own document's
        blocks, the partial first one summarised by its document's keys only (``blocks.BlockDocuments``)."""
        select_run = self.executor.runner(q).select_run
        picks = (q, k, self.block, self.top_k, self.score == "bound")
        if select_run is None:
            chosen = None
        else:  # (documents only where there are some: an executor written before them takes five arguments)
            chosen = select_run(*picks) if documents is None else select_run(*picks, documents)
        if chosen is not None:  # the executor's kernel (the fused CPU one): no (B, h, N, N // block) scores
            return chosen
        scores = block_scores(q, self.summarise(k, k), self.score)  # (B, h, N, N // block)
        if documents is None:
            return select_blocks(scores, self.block, self.top_k)
        blocks = BlockDocuments.of(documents, self.block)
        tail = (block_tail_means(k, self.block, blocks),) if self.score == "mean" else \
            block_tail_bounds(k, self.block, blocks)
        scores = scores_within_documents(scores, q, tail, self.score, blocks)
        return select_blocks(scores, self.block, self.top_k, allowed=blocks.candidates(scores.shape[-1], self.block))

    def forward(self, q: Tensor, k: Tensor, v: Tensor, rel_pos: RelativePositions | None,
                documents: Tensor | None = None) -> Tensor:
        inputs = self.inputs(q, k, v, documents)
        if self.warming_up:
            return full_attention(inputs, None, self.executor, rel=rel_pos)
        check_rel(rel_pos, q)
        blocks = None if documents is None else BlockDocuments.of(documents, self.block)
        with torch.no_grad():  # the selection is discrete: the loss reaches it only through the attention
            chosen = self.select(q, k, documents)
        out, _ = selected_attention(inputs, chosen, self.block, self.executor, rel_pos, documents=blocks)
        return out

    def reference_mask(self, q: Tensor, k: Tensor) -> Tensor:
        n = q.shape[2]
        if self.warming_up:
            return torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        return selected_mask(self.select(q, k), self.block)

    def reach(self, q: Tensor, k: Tensor, rows: Tensor, cols: Tensor, sources: Tensor) -> dict[str, Tensor]:
        """How often the key at ``sources`` is seen by the query at (``rows``, ``cols``) ('in_window': in a
        selected block or its own block's causal part; mean over heads), the recall benchmark's diagnostic."""
        if self.warming_up:
            return {}
        chosen = self.select(q, k)[rows, :, cols]  # (S, H, top_k)
        home = (sources // self.block)[:, None]  # (S, 1): the needed key's block
        own = (home == (cols // self.block)[:, None]) & (sources <= cols)[:, None]
        seen = (chosen == home[..., None]).any(-1) | own
        return {"in_window": seen.float().mean()}

    # --- decoding -------------------------------------------------------------------------------------------
    def step(self, q: Tensor, cache: BlockCache, t: int, rel_pos: RelativePositions | None,
             since: Tensor | None = None) -> Tensor:
        keys, values, positions = cache.filled()
        if self.warming_up:
            return self.attend(q, keys, values, positions, t, rel_pos, allowed=seen(positions, since))
        summary = cache.before(t)  # the complete blocks before t's own
        qt = q[:, :, None].to(summary[0].dtype)
        scores = block_scores(qt, summary, self.score)  # (B, h, 1, m)
        at = torch.full((1,), t, device=q.device)
        allowed = None
        if since is not None:  # packed documents: the document's blocks, its partial first one scored by its keys
            blocks = BlockDocuments.starting(since[:, None], self.block)
            allowed = blocks.candidates(scores.shape[-1], self.block, at)
            tail = decoded_summary(*decoded_tail(cache.store.keys, since, self.block), self.score)
            scores = scores_within_documents(scores, qt, tuple(x[:, :, None] for x in tail), self.score, blocks)
        chosen = select_blocks(scores, self.block, self.top_k, at, allowed=allowed)[:, :, 0]
        return self.attend(q, keys, values, positions, t, rel_pos,
                           allowed=seen(positions, since, allowed_keys(chosen, self.block, t, positions)))

    def own_repr(self) -> str:
        return f"top_k={self.top_k}, score={self.score}"


# --- cross-attention: queries of one sequence over a memory's blocks ---


def memory_blocks(key_valid: Tensor, block: int, documents: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The blocks of a memory's keys: ``block`` keys each, counted from the row's start or, with packed
    ``documents`` (B, Nk, numbered from 0), from each document's start (a document's blocks are those it has
    alone). ``key_valid`` (B, Nk) bool. Returns each key's block (B, Nk) long, numbered along the row, and each
    block's first and one-past-last key (B, nb); a row with fewer blocks than nb ends in empty ones (first = Nk,
    last = 0). O(B · Nk)."""
    B, Nk = key_valid.shape
    j = torch.arange(Nk, device=key_valid.device)
    if documents is None:
        offset = j.expand(B, Nk)
    else:  # each key's distance from its document's first key
        first = torch.ones_like(documents, dtype=torch.bool)
        first[:, 1:] = documents[:, 1:] != documents[:, :-1]
        offset = j - torch.where(first, j, 0).cummax(1).values
    of = (offset % block == 0).long().cumsum(1) - 1  # (B, Nk): a block begins every block keys of a document
    nb = int(of[:, -1].max()) + 1
    lo = torch.full((B, nb), Nk, dtype=torch.long, device=j.device).scatter_reduce(1, of, j.expand(B, Nk), "amin")
    hi = torch.zeros(B, nb, dtype=torch.long, device=j.device).scatter_reduce(1, of, j.expand(B, Nk) + 1, "amax")
    return of, lo, hi


def moba_cross_attention(inputs: Inputs, options: MobaOptions | None = None, executor: Backend = "auto") -> Tensor:
    """Queries over the ``top_k`` blocks of a memory they score highest, one softmax over their keys (the whole
    memory is visible: every block a candidate, the last one perhaps shorter, no own block).

    ``inputs``: ``Inputs.cross(q, k, v, key_padding_mask=..., documents=...)``, q (B, H, Nq, D) against the memory
    k, v (B, H, Nk, D). ``options``: ``block`` (None: ``default_block(Nk, top_k)``), ``top_k``, ``score`` ('mean'
    or 'bound', each over a block's real keys only; a block of padding alone is no candidate); ``warmup`` belongs
    to heads and is refused here. Packed ``cross_documents``: the blocks are counted from each memory document's
    start and a query's candidates are its own document's (with a given ``block``, a document reads as it does
    alone). Returns (B, H, Nq, D); gradients reach q, k and v (not the choice). Time O(Nq · (Nk / block + top_k ·
    block) · D) per head; the (Nq, Nk / block) scores are made.
    """
    o = MobaOptions() if options is None else check_options("options", options, MobaOptions)
    if o.warmup:
        raise ValueError(f"options.warmup ({o.warmup}) is a model's heads' option (steps of dense attention); "
                         f"moba_cross_attention takes none")
    q, k = inputs.q, inputs.k
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    block = min(Nk, default_block(Nk, o.top_k) if o.block is None else o.block)
    real = torch.ones(B, Nk, dtype=torch.bool, device=k.device) if inputs.key_valid is None else inputs.key_valid[:, 0]
    documents = inputs.cross_documents
    of, lo, hi = memory_blocks(real, block, None if documents is None else documents.memory)
    nb = lo.shape[1]
    with torch.no_grad():  # the choice is discrete: the loss reaches it only through the attention
        into = of[:, None, :, None].expand(B, H, Nk, D)  # (B, H, Nk, D): each key's block
        inside = real[:, None, :, None]
        count = torch.zeros(B, nb, dtype=torch.long, device=k.device).scatter_add(1, of, real.long())[:, None]
        if o.score == "mean":
            sums = k.new_zeros(B, H, nb, D).scatter_add(2, into, torch.where(inside, k, 0.0))
            summary: tuple[Tensor, ...] = (sums / count[..., None].clamp(min=1),)
        else:  # a block of padding alone gets a finite box (no candidate anyway)
            empty = (count == 0)[..., None]
            summary = tuple(k.new_zeros(B, H, nb, D).scatter_reduce(2, into, torch.where(inside, k, fill), how,
                                                                    include_self=False).masked_fill(empty, 0.0)
                            for fill, how in ((float("inf"), "amin"), (float("-inf"), "amax")))
        scores = block_scores(q, summary, o.score)  # (B, H, Nq, nb)
        allowed = (count > 0)[:, :, None, :]  # (B, 1, 1, nb)
        if documents is not None:  # a query's candidates: its own document's blocks
            block_document = documents.memory.gather(1, lo.clamp(max=Nk - 1))  # (B, nb)
            allowed = allowed & (documents.queries[:, None, :, None] == block_document[:, None, None, :])
        chosen = select_blocks(scores, block, o.top_k, allowed=allowed)
    pick = chosen.clamp(min=0).flatten(2)  # (B, H, Nq * top): each chosen block's keys, empty for none
    none = (chosen < 0).flatten(2)
    first = lo[:, None].expand(B, H, nb).gather(2, pick).masked_fill(none, 0)
    last = hi[:, None].expand(B, H, nb).gather(2, pick).masked_fill(none, 0)
    spans = Ranges(first, last, width=block, merge=chosen.shape[-1])
    return get_executor(executor, q.device).ranges(inputs, spans)[0]


def moba_cross_mask(q: Tensor, k: Tensor, options: MobaOptions, key_padding_mask: Tensor | None = None,
                    documents: CrossDocuments | None = None) -> Tensor:
    """What ``moba_cross_attention`` means, written apart from it: (B, H, Nq, Nk) bool. Key j's block is the keys
    of its document (``documents``, numbered from 0 on both sides; None: one a row) whose distance from the
    document's first key, divided by ``block``, is j's; each block's summary from that explicit (blocks, Nk)
    membership of its real keys, and a block chosen when it is of the query's document and fewer than ``top_k``
    such candidate blocks score higher. O(Nq · Nk + Nk²) memory."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    block = min(Nk, default_block(Nk, options.top_k) if options.block is None else options.block)
    j = torch.arange(Nk, device=k.device)
    real = torch.ones(B, Nk, dtype=torch.bool, device=k.device) if key_padding_mask is None else key_padding_mask
    doc = torch.zeros(B, Nk, dtype=torch.long, device=k.device) if documents is None else documents.memory
    query_doc = torch.zeros(B, Nq, dtype=torch.long, device=k.device) if documents is None else documents.queries
    same_doc = doc[:, :, None] == doc[:, None, :]  # (B, Nk, Nk)
    start = torch.where(same_doc, j, Nk).amin(-1)  # (B, Nk): the first key of each key's document
    index = (j - start) // block  # (B, Nk): the block within the document
    same_block = same_doc & (index[:, :, None] == index[:, None, :])
    # one block per key that begins one (its row of same_block); the other rows are empty, no candidates
    member = same_block & ((j - start) % block == 0)[:, :, None] & real[:, None, :]  # (B, Nk blocks, Nk)
    if options.score == "mean":
        weights = member.to(k.dtype) / member.sum(-1, keepdim=True).clamp(min=1)
        scores = q @ (weights[:, None] @ k).transpose(-1, -2)  # (B, H, Nq, nb)
    else:
        inside = member[:, None, :, :, None]  # (B, 1, nb, Nk, 1)
        lo = torch.where(inside, k[:, :, None], float("inf")).amin(3)
        hi = torch.where(inside, k[:, :, None], float("-inf")).amax(3)
        scores = torch.maximum(q[:, :, :, None] * lo[:, :, None], q[:, :, :, None] * hi[:, :, None]).sum(-1)
    candidate = member.any(-1)[:, None, None, :] & (query_doc[:, :, None] == doc[:, None, :])[:, None]
    s = scores.masked_fill(~candidate, float("-inf"))  # (B, H, Nq, nb)
    higher = ((s[..., None, :] > s[..., :, None]) & candidate[..., None, :]).sum(-1)  # candidates scoring above
    picked = candidate & (higher < options.top_k)  # (B, H, Nq, nb)
    return (picked.to(k.dtype) @ member[:, None].to(k.dtype)) > 0


# --- the head kind: how a model uses it ---


def _complete(o: MobaOptions, config: Any) -> MobaOptions:
    return dataclasses.replace(o, block=complete_block(o.block, o.top_k, config),
                               warmup_len=warmup_length(o.warmup_len, o.warmup, config))


def keys_per_query(o: MobaOptions, n: int) -> float:
    """Selected keys (top_k blocks of an average query, its own block half full) plus the blocks it scores (a
    'bound' summary is two vectors)."""
    return selection_keys(o.block, o.top_k, n, summaries=1 if o.score == "mean" else 2)


def _describe(o: MobaOptions) -> str:
    score = "" if o.score == "mean" else f", score={o.score}"
    return f"block={o.block}, top_k={o.top_k}{score}" + describe_warmup(o)


KIND = HeadKind("moba", lambda o, heads, head_dim, seed: MobaHeads(heads, head_dim, o), keys_per_query=keys_per_query,
                warmup=dense_warmup, option_type=MobaOptions, complete=_complete, documents=True,
                describe=_describe, summary="the `top_k` earlier blocks the query scores highest (by their mean key, "
                "or Quest's bound), and its own block")

__all__ = ["KIND", "MobaHeads", "MobaOptions", "default_block"]
