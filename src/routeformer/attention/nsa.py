"""NSA-style heads, after Native Sparse Attention (Yuan et al. 2025): three branches over the same q, k, v, mixed by
learned gates.

This module is the mechanism's one home: its head kind, options, dense definition and decoding, registered in
``registry.py``; the block selection and its ranges are ``blocks.py`` (shared with MoBA).

Heads. The keys are cut into blocks of ``block`` (the blocks of the selection).

1. compressed: each complete block j becomes one key and one value by learned weights over its positions,
   ck_j = Σ_t a_t k_{j·block+t} and cv_j = Σ_t c_t v_{j·block+t} (a, c: (heads, block), initially the mean); query i
   attends (softmax, scale 1/sqrt(D), no relative positions) to the compressed blocks before its own (j < i // block):
   out_cmp, 0 for a query of the first block. Dense over the blocks: O(N · N / block · D) per head.
2. selected: the ``top`` blocks whose compressed keys score highest (q · ck_j: NSA selects by the compressed
   attention's scores; no gradient through the choice), and its own block up to itself, one softmax (relative
   positions apply), through the executor's ``ranges`` (``blocks.selected_attention``): O(N · (top + 1) · block · D).
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
from ..executors.relative import RelativePositions
from .blocks import (
    NONE,
    BlockCache,
    BlockDocuments,
    BlockHeads,
    allowed_keys,
    candidate_blocks,
    complete_block,
    decoded_tail,
    dense_warmup,
    describe_warmup,
    reversed_cumsum,
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
        scores = torch.einsum("bhnd,bhmd->bhnm", q, ck) * self.scale  # (B, h, N, N // block)
        blocks = None if documents is None else BlockDocuments.of(documents, b)
        if blocks is None:
            seen = candidate_blocks(torch.arange(n, device=q.device), ck.shape[2], b)  # complete blocks before own
            out_cmp = normalise_scores(scores, seen) @ cv  # zeros for the queries of the first block
        else:
            scores, out_cmp, seen = self._compressed_within_documents(q, k, v, scores, cv, blocks)
        with torch.no_grad():  # the selection is discrete: chosen by the compressed attention's scores
            chosen = select_blocks(scores.detach(), b, self.top, allowed=None if blocks is None else seen)
        out_sel, _ = selected_attention(inputs, chosen, b, self.executor, rel_pos, documents=blocks)
        out_win, _ = self.executor.tiled(inputs, Band(self.window, True), rel=relative(rel_pos))
        g = self.gates(q)
        return g[..., 0:1] * out_cmp + g[..., 1:2] * out_sel + g[..., 2:3] * out_win

    def _compressed_within_documents(self, q: Tensor, k: Tensor, v: Tensor, scores: Tensor, cv: Tensor,
                                     blocks: BlockDocuments) -> tuple[Tensor, Tensor, Tensor]:
        """Packed documents: each query's compressed attention over its own document's complete blocks before its
        own, the partial first block compressed from its document's keys and values only (the weights a_t, c_t of
        its positions t from the start on). Returns the scores (the partial block's replaced), out_cmp and the
        candidates (B, 1, N, nb). The partial block's value is added apart, its column of the weights zeroed in
        the product (no subtraction, so a document's output is bit for bit its own)."""
        b = self.block
        nb = scores.shape[-1]

        def tail(x: Tensor, weights: Tensor) -> Tensor:  # Σ_{t from the start} w_t x_{j·block+t}, per query
            w = weights.to(x.dtype)[None, :, None, :, None]  # (1, h, 1, block, 1)
            return blocks.suffixes(x, b, lambda parts: reversed_cumsum(parts * w))

        seen = blocks.candidates(nb, b)
        scores, out_cmp = self._compressed_with_tail(q, scores, cv, tail(k, self.key_weights),
                                                     tail(v, self.value_weights), blocks, seen)
        return scores, out_cmp, seen

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
