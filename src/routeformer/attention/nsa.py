"""NSA-style heads, after Native Sparse Attention (Yuan et al. 2025): three branches over the same q, k, v, mixed by
learned gates.

This module is the mechanism's one home: its head kind, options, dense definition and decoding, registered in
``registry.py``; the block selection and its ranges are ``blocks.py`` (shared with MoBA).

Heads. The keys are cut into blocks of ``block`` (the blocks of the selection).

1. compressed: each complete block j becomes one key and one value by learned weights over its positions,
   ck_j = Σ_t a_t k_{j·block+t} and cv_j = Σ_t c_t v_{j·block+t} (a, c: (heads, block), initially the mean); query i
   attends (softmax, scale 1/sqrt(D), no relative positions) to the compressed blocks before its own (j < i // block):
   out_cmp, 0 for a query of the first block; one range of compressed keys per query on the executor's ``ranges``,
   O(N · N / block · D) per head in time, O(N · D) in memory (no (N, N / block) weights kept for the backward).
2. selected: the ``top`` blocks whose compressed keys score highest (q · ck_j: NSA selects by the compressed
   attention's scores; no gradient through the choice), scored and picked for chunks of queries (at most
   ``SELECT_CHUNK`` scores at once, never the whole (N, N / block)), and its own block up to itself, one softmax
   (relative positions apply), through the executor's ``ranges`` (``blocks.selected_attention``):
   O(N · (top + 1) · block · D).
3. window: the last ``window`` keys (a ``Band`` on the executor; relative positions apply): O(N · window · D).

The gates g = sigmoid(q · W_g + b_g) (W_g (heads, D, 3) and b_g (heads, 3), zero at first: every gate 0.5) mix them,
out = g_cmp · out_cmp + g_sel · out_sel + g_win · out_win. The loss reaches a and c through out_cmp, the gates, and
q, k, v through every branch. An optional dense warm-up (``warmup`` optimiser steps of full causal attention, on
sequences of ``warmup_len``; the gates unused) as MoBA's.

Decoding keeps every key and value and, for each block when its last key arrives, its compressed key and value
(``blocks.BlockCache``): a new token costs O(N / block · D + ((top + 1) · block + window) · D) per head (here as
attention over the kept keys under a mask).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..checks import positive_int
from ..executors.inputs import Inputs, check_rel, relative
from ..executors.pieces import Band
from ..executors.ranges import Ranges
from ..executors.relative import RelativePositions
from .blocks import (
    NONE,
    BlockCache,
    BlockDocuments,
    BlockHeads,
    allowed_keys,
    complete_block,
    complete_blocks,
    decoded_tail,
    dense_warmup,
    describe_warmup,
    select_blocks,
    selected_attention,
    selected_mask,
    selection_keys,
    warmup_length,
)
from .decoding import seen
from .full import full_attention
from .kinds.base import HeadKind
from .kinds.common import at_most_seq_len, non_negative_int
from .local import local_mask
from .reference import normalise_scores, reference_attention

SELECT_CHUNK = 1 << 22  # selection scores (elements) scored at once: 16 MiB in float32


def compressed_end(pos: Tensor, block: int) -> Tensor:
    """The compressed blocks j a query at position ``pos`` attends to: j < pos // block (complete, before its own)."""
    return pos // block

BRANCHES = ("compressed", "selected", "window")  # the order of the gates


@dataclass(frozen=True)
class NsaOptions:
    """options.nsa: the block size (None: ``blocks.default_block`` for ``top``), the blocks each query selects, the
    sliding window (None: the block), and an optional dense warm-up (steps, and the length of the sequences it
    trains on; None: the model's)."""

    block: int | None = None
    top: int = 2
    window: int | None = None
    warmup: int = 0
    warmup_len: int | None = None

    def __post_init__(self) -> None:
        for name in ("block", "window", "warmup_len"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        positive_int("top", self.top)
        non_negative_int("warmup", self.warmup)


class NsaHeads(BlockHeads):
    """NSA-style heads (see the module). q, k, v: (B, h, N, D) -> (B, h, N, D). The decoding cache keeps every key
    and value and the compressed key and value of each block (``BlockCache``, two summaries)."""

    parts = 2

    def __init__(self, heads: int, head_dim: int, options: NsaOptions) -> None:
        super().__init__(heads, head_dim, options.block, options.warmup)
        self.options = options
        self.top, self.window = options.top, options.window
        b = options.block
        self.key_weights = nn.Parameter(torch.full((heads, b), 1.0 / b))  # a: the compressed key, the mean at first
        self.value_weights = nn.Parameter(torch.full((heads, b), 1.0 / b))  # c: the compressed value
        self.gate_weight = nn.Parameter(torch.zeros(heads, head_dim, len(BRANCHES)))  # W_g: every gate 0.5 at first
        self.gate_bias = nn.Parameter(torch.zeros(heads, len(BRANCHES)))  # b_g

    def summarise(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """The compressed keys and values (B, h, m, D) of the m whole blocks of keys, values (B, h, m · block, D)."""
        B, H, M, D = keys.shape
        shape = (B, H, M // self.block, self.block, D)
        ck = torch.einsum("bhjtd,ht->bhjd", keys.reshape(shape), self.key_weights.to(keys.dtype))
        cv = torch.einsum("bhjtd,ht->bhjd", values.reshape(shape), self.value_weights.to(values.dtype))
        return ck, cv

    def gates(self, q: Tensor) -> Tensor:
        """The three gates (B, h, N, 3) of the queries q (B, h, N, D), in ``BRANCHES`` order."""
        logits = torch.einsum("bhnd,hdc->bhnc", q, self.gate_weight.to(q.dtype))
        return torch.sigmoid(logits + self.gate_bias.to(q.dtype)[:, None])

    def forward(self, q: Tensor, k: Tensor, v: Tensor, rel_pos: RelativePositions | None,
                documents: Tensor | None = None) -> Tensor:
        inputs = self.inputs(q, k, v, documents)
        if self.warming_up:
            return full_attention(inputs, None, self.executor, rel=rel_pos)
        check_rel(rel_pos, q)
        n, b = q.shape[2], self.block
        whole = n // b * b
        ck, cv = self.summarise(k[:, :, :whole], v[:, :, :whole])  # (B, h, N // block, D)
        blocks = None if documents is None else BlockDocuments.of(documents, b)
        tails = None if blocks is None else self._tails(k, v, blocks)
        out_cmp = self._compressed(q, ck, cv, blocks, tails)
        with torch.no_grad():  # the selection is discrete: chosen by the compressed attention's scores
            chosen = self._select(q, ck, blocks, None if tails is None else tails[0].detach())
        out_sel, _ = selected_attention(inputs, chosen, b, self.executor, rel_pos, documents=blocks)
        out_win, _ = self.executor.tiled(inputs, Band(self.window, True), rel=relative(rel_pos))
        g = self.gates(q)
        return g[..., 0:1] * out_cmp + g[..., 1:2] * out_sel + g[..., 2:3] * out_win

    def _tails(self, k: Tensor, v: Tensor, blocks: BlockDocuments) -> tuple[Tensor, Tensor]:
        """Packed documents: the compressed key and value (B, h, nb, D) of each block's last document, from its start
        on (the weights a_s, c_s of its positions s from the start); zeros for a block where no document starts
        after its first position.

        A query's partial first block is a candidate only when the document goes on past the block's end, so the
        document's start is that block's last document start: one weighted sum per block (a pass over the keys, not
        a sum per position), read by the queries whose first block it is. The positions before the start weigh
        exactly 0: no other document's key moves a bit of the sum."""
        B, h, n, D = k.shape
        b = self.block
        nb = n // b
        pos = torch.arange(nb * b, device=k.device)
        begins = (blocks.start[:, :nb * b] == pos) & (pos % b != 0)  # (B, nb · b): a document starts mid-block
        offset = torch.where(begins, pos % b, -1).view(B, nb, b).amax(-1, keepdim=True)  # the last start (-1: none)
        s = torch.arange(b, device=k.device)
        mine = ((s >= offset) & (offset >= 0))[:, None]  # (B, 1, nb, b): the block's last document's positions

        def tail(x: Tensor, weights: Tensor) -> Tensor:  # Σ_{s from the last start} w_s x_{j·block+s}, per block
            w = torch.where(mine, weights.to(x.dtype)[None, :, None, :], 0.0)  # (B, h, nb, b)
            return torch.einsum("bhjs,bhjsd->bhjd", w, complete_blocks(x, b))  # (B, h, nb, D)

        return tail(k, self.key_weights), tail(v, self.value_weights)

    def _compressed(self, q: Tensor, ck: Tensor, cv: Tensor, blocks: BlockDocuments | None,
                    tails: tuple[Tensor, Tensor] | None) -> Tensor:
        """The compressed branch (B, h, N, D): each query over the compressed blocks before its own (zeros where
        there is none), one range of them per query on the executor's ``ranges`` (no (N, N / block) weights).
        Packed documents: the range holds its document's complete blocks, and the partial first block joins the
        softmax as a second entry of the query (``merge=2``): one key, its document's compressed key and value of
        that block (``tails``, laid after the whole blocks' ones), an empty range where it is no candidate."""
        B, h, n, D = q.shape
        nb, b = ck.shape[2], self.block
        if nb == 0:  # no complete block, no candidate: zeros, as sums over the empty compressed keys and values
            return (ck.sum(2, keepdim=True) + cv.sum(2, keepdim=True)).expand_as(q)  # (zero gradients, not none)
        end = compressed_end(torch.arange(n, device=q.device), b).clamp(max=nb)  # (N,): j < end, before its own
        hi = end.view(1, 1, n)
        if blocks is None:
            spans = Ranges(torch.zeros_like(hi), hi, width=nb)
            return self.executor.ranges(Inputs(q, ck, cv, self.scale), spans)[0]
        lo = torch.minimum((blocks.first + blocks.partial)[:, None], hi)  # (B, 1, N): the document's whole blocks
        has_tail = blocks.partial & (blocks.first < end)  # (B, N): a partial first block, a candidate
        tail_lo = (nb + blocks.first.clamp(max=nb - 1))[:, None]  # its key, after the whole blocks'
        lo2 = torch.stack([lo, tail_lo], -1).view(B, 1, 2 * n)  # (B, 1, N · 2): each query's two entries
        hi2 = torch.stack([hi.expand_as(lo), tail_lo + has_tail[:, None]], -1).view(B, 1, 2 * n)
        spans = Ranges(lo2, hi2, width=nb, merge=2, documents=blocks.start)
        keys = Inputs(q, torch.cat([ck, tails[0]], 2), torch.cat([cv, tails[1]], 2), self.scale)
        return self.executor.ranges(keys, spans)[0]

    def _select(self, q: Tensor, ck: Tensor, blocks: BlockDocuments | None, tail_keys: Tensor | None) -> Tensor:
        """The ``top`` blocks of every query by the compressed attention's scores q · ck_j (packed documents: the
        partial first block scored against its document's own compressed key, ``tail_keys`` (B, h, nb, D) from
        ``_tails``), best first: (B, h, N, top) long.
        Scored for chunks of queries, at most ``SELECT_CHUNK`` scores at once (a count of chunks fixed by the
        shapes: no host read)."""
        B, h, n, D = q.shape
        nb, b = ck.shape[2], self.block
        step = max(1, SELECT_CHUNK // max(1, B * h * nb))
        picks = []
        for a in range(0, n, step):
            e = min(n, a + step)
            pos = torch.arange(a, e, device=q.device)
            scores = torch.einsum("bhnd,bhmd->bhnm", q[:, :, a:e], ck).mul_(self.scale)  # (B, h, e - a, nb)
            if blocks is None or nb == 0:
                picks.append(select_blocks(scores, b, self.top, query_pos=pos))
                continue
            part = BlockDocuments(*(x[:, a:e] for x in blocks))
            first = part.first.clamp(max=nb - 1)[:, None, :, None]  # (B, 1, e - a, 1)
            tail_score = (q[:, :, a:e] * tail_keys.gather(2, first.expand(B, h, e - a, D))).sum(-1, keepdim=True)
            column = first.expand(B, h, e - a, 1)  # the partial first block's score, in place (no second copy)
            own = torch.where(part.partial[:, None, :, None], tail_score * self.scale, scores.gather(-1, column))
            scores.scatter_(-1, column, own)
            picks.append(select_blocks(scores, b, self.top, query_pos=pos, allowed=part.candidates(nb, b, pos)))
        return torch.cat(picks, 2) if len(picks) > 1 else picks[0]

    def _compressed_with_tail(self, q: Tensor, scores: Tensor, cv: Tensor, ck_tail: Tensor, cv_tail: Tensor,
                              blocks: BlockDocuments, seen: Tensor) -> tuple[Tensor, Tensor]:
        """The compressed branch over packed documents, for n queries q (B, h, n, D) (the forward's, or a decoding
        step's one): ``scores`` (B, h, n, nb) against the whole blocks' compressed keys, with each query's partial
        first block scored against ``ck_tail`` (B, h, n, D) instead; softmax over the candidates ``seen``; the
        partial block's value ``cv_tail`` added apart, its column zeroed in the product with ``cv`` (B, h, nb, D)
        (no subtraction: a document's output is bit for bit its own). Returns the scores and out_cmp."""
        partial = blocks.partial_column(scores.shape[-1])  # (B, 1, n, nb)
        scores = torch.where(partial, ((q * ck_tail).sum(-1) * self.scale)[..., None], scores)
        weights = normalise_scores(scores, seen)  # (B, h, n, nb), zeros with no candidate
        at_tail = (weights * partial).sum(-1, keepdim=True)  # the partial block's weight (0 where none)
        return scores, torch.where(partial, 0.0, weights) @ cv + at_tail * cv_tail

    # --- meaning, for tests ---------------------------------------------------------------------------------
    def reference(self, q: Tensor, k: Tensor, v: Tensor, rel_pos: RelativePositions | None = None) -> Tensor:
        """The dense O(N²) definition of ``forward``, written apart from it: the compression as an explicit
        (blocks, N) matrix of the weights, the compressed attention as an explicit masked softmax, the selection
        by rank (a candidate block is chosen when fewer than ``top`` candidates score higher), the selected and
        window branches as ``reference_attention`` under ``selected_mask`` and ``local_mask``."""
        n, b = q.shape[2], self.block
        i = torch.arange(n, device=q.device)
        if self.warming_up:
            return reference_attention(Inputs.of(q, k, v), i[None, :] <= i[:, None], rel=rel_pos)
        j = torch.arange(n // b, device=q.device)  # the complete blocks
        offset = i[None, :] - j[:, None] * b  # (blocks, N): key position - block start
        inside = (offset >= 0) & (offset < b)

        def compression(weights: Tensor) -> Tensor:  # (h, blocks, N): weights[h, t] at key j·block + t
            return torch.where(inside, weights.to(q.dtype)[:, offset.clamp(0, b - 1)], 0.0)

        ck, cv = compression(self.key_weights) @ k, compression(self.value_weights) @ v  # (B, h, blocks, D)
        scores = q @ ck.transpose(-1, -2) * self.scale  # (B, h, N, blocks)
        allowed = (j[None, :] + 1) * b - 1 < i[:, None] - i[:, None] % b  # ends before the query's block starts
        masked = scores.detach().masked_fill(~allowed, float("-inf"))
        top = masked.amax(-1, keepdim=True) if masked.shape[-1] else masked.new_zeros(*masked.shape[:-1], 1)
        shifted = torch.where(allowed, scores - torch.where(torch.isfinite(top), top, 0.0), float("-inf"))
        weights = shifted.exp()
        total = weights.sum(-1, keepdim=True)
        out_cmp = weights / torch.where(total > 0, total, 1.0) @ cv

        s = scores.detach()
        higher = ((s[..., None, :] > s[..., :, None]) & allowed[:, None, :]).sum(-1)  # candidates scoring above
        picked = allowed & (higher < self.top)  # (B, h, N, blocks)
        chosen = torch.where(picked, j, NONE)  # every picked block, in the form ``selected_mask`` reads
        out_sel = reference_attention(Inputs.of(q, k, v), selected_mask(chosen, b), rel=rel_pos)
        out_win = reference_attention(Inputs.of(q, k, v), local_mask(n, self.window, device=q.device), rel=rel_pos)

        g = torch.sigmoid(q @ self.gate_weight.to(q.dtype) + self.gate_bias.to(q.dtype)[:, None, :])
        return g[..., 0:1] * out_cmp + g[..., 1:2] * out_sel + g[..., 2:3] * out_win

    # --- decoding -------------------------------------------------------------------------------------------
    def step(self, q: Tensor, cache: BlockCache, t: int, rel_pos: RelativePositions | None,
             since: Tensor | None = None) -> Tensor:
        keys, values, positions = cache.filled()
        if self.warming_up:
            return self.attend(q, keys, values, positions, t, rel_pos, allowed=seen(positions, since))
        ck, cv = cache.before(t)  # the compressed blocks before t's own, (B, h, t // block, D)
        scores = torch.einsum("bhd,bhmd->bhm", q.to(ck.dtype), ck) * self.scale
        at = torch.full((1,), t, device=q.device)
        if since is None:
            out_cmp = torch.einsum("bhm,bhmd->bhd", scores.softmax(-1), cv).to(q.dtype)  # 0 with no block
            scores, allowed = scores[:, :, None], None  # (B, h, 1, m)
        else:  # packed documents: the document's blocks, the partial first one compressed from its own positions
            blocks = BlockDocuments.starting(since[:, None], self.block)
            allowed = blocks.candidates(scores.shape[-1], self.block, at)  # (B, 1, 1, m)
            tail, mine = decoded_tail(cache.store.keys, since, self.block)
            vtail, _ = decoded_tail(cache.store.values, since, self.block)
            a = self.key_weights.to(tail.dtype)[None, :, :, None] * mine  # (B, h, block, 1): from the start on
            c = self.value_weights.to(tail.dtype)[None, :, :, None] * mine
            scores, out_cmp = self._compressed_with_tail(q[:, :, None].to(ck.dtype), scores[:, :, None], cv,
                                                         (a * tail).sum(2, keepdim=True),
                                                         (c * vtail).sum(2, keepdim=True), blocks, allowed)
            out_cmp = out_cmp[:, :, 0].to(q.dtype)
        chosen = select_blocks(scores, self.block, self.top, at, allowed=allowed)
        out_sel = self.attend(q, keys, values, positions, t, rel_pos,
                              allowed=seen(positions, since, allowed_keys(chosen[:, :, 0], self.block, t, positions)))
        out_win = self.attend(q, keys, values, positions, t, rel_pos,
                              allowed=seen(positions, since, positions > t - self.window))
        g = self.gates(q[:, :, None])[:, :, 0]  # (B, h, 3)
        return g[..., 0:1] * out_cmp + g[..., 1:2] * out_sel + g[..., 2:3] * out_win

    def own_repr(self) -> str:
        return f"top={self.top}, window={self.window}"


# --- the head kind: how a model uses it ---


def _complete(o: NsaOptions, config: Any) -> NsaOptions:
    block = complete_block(o.block, o.top, config)
    window = block if o.window is None else o.window
    at_most_seq_len("window", window, config)
    return dataclasses.replace(o, block=block, window=window, warmup_len=warmup_length(o.warmup_len, o.warmup, config))


def keys_per_query(o: NsaOptions, n: int) -> float:
    """Each branch's keys, averaged over the query positions: the compressed blocks scored and attended (the
    selection reuses their scores), the ``top`` selected blocks and the own block (``blocks.selection_keys``
    counts those three), and the window."""
    window = torch.arange(1, n + 1, dtype=torch.float64).clamp(max=o.window).mean()
    return selection_keys(o.block, o.top, n) + float(window)


KIND = HeadKind("nsa", lambda o, heads, head_dim, seed: NsaHeads(heads, head_dim, o), keys_per_query=keys_per_query,
                warmup=dense_warmup, option_type=NsaOptions, complete=_complete, documents=True,
                describe=lambda o: f"block={o.block}, top={o.top}, window={o.window}" + describe_warmup(o),
                summary="NSA-style: compressed blocks, the `top` blocks they score highest with the own block, and "
                        "the last `window` keys, mixed by learned gates")

__all__ = ["BRANCHES", "KIND", "NsaHeads", "NsaOptions"]
