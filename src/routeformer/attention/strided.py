"""The Sparse Transformer's strided pattern: the last l positions, and every l-th position before them.

This module is the mechanism's one home: its functional form, its mask (what it means, for the tests), its head kind
and options, registered in ``registry.py``.

Heads. Strided heads (Sparse Transformer): the last l + 1 positions (A1) and every l-th position back (A2), l =
stride.

Three kinds: 'strided' (A1 ∪ A2 in every head), 'strided_a1' and 'strided_a2' (one set each: the split heads
'strided_a1:4,strided_a2:4', or with one spec per layer the interleaved layers ['strided_a1', 'strided_a2']).

Decoding keeps every key (slot p holds position p; A2 reaches back to the start) and a step slices the query's
column t, t - l, t - 2l, … and the last l + 1 positions, O((l + t/l)·D) (a1: a ring of l + 1, O(l·D); a2: O(t/l·D)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..checks import check_options, check_split_heads, positive_int
from ..executors import Backend, get_executor, merge_partials
from ..executors.inputs import Inputs, check_rel, refuse_cross, relative
from ..executors.pieces import Band, Columns
from ..executors.relative import RelativePositions
from ..lengths import sqrt_len
from .decoding import seen
from .kinds.base import HeadGroup, HeadKind
from .kinds.common import at_most_seq_len
from .local import LocalOptions, local_attention
from .masks import index_grid, split_mask


def strided_attention(
    inputs: Inputs,
    options: StridedOptions,
    executor: Backend = "auto",
    *,
    causal: bool = True,
    merged: bool = True,
    rel: RelativePositions | None = None,
) -> Tensor:
    """Strided attention with l = ``options.stride`` (Child et al. 2019; None: round(sqrt(N))).

    Causal: A1(i) = {j : max(0, i - l) <= j <= i}, A2(i) = {j <= i : (i - j) mod l = 0}; non-causal: |i - j| <= l
    and every j with (i - j) mod l = 0. ``merged=True``: every head attends to A1 ∪ A2; ``merged=False``: the first
    half of the heads to A1, the second half to A2.

    ``inputs``: ``Inputs.of(q, k, v, ...)``, q, k, v (B, H, N, D) -> (B, H, N, D). A1 is a band (blocks of l); A2 is
    attention along the columns of the sequence viewed as an (N / l, l) grid (the transpose trick); merged heads
    combine the two exactly through their log-sum-exp, with A2 restricted to rows two or more apart so no key counts
    twice. O(N · (l + N / l) · D) time, O(N · (l + N / l)) memory: O(N^1.5 · D) for l ≈ sqrt(N).
    ``executor``: a name or an ``Executor`` (``"auto"``: FlexAttention on CUDA, the fused kernels on the CPU;
    ``"fused"``, ``"tiles"``, ``"flex"``). ``rel``: relative-position tables, or None.
    """
    refuse_cross(inputs, "strided attention's pattern")
    options = check_options("options", options, StridedOptions)
    B, H, N, D = inputs.shape
    stride = sqrt_len(N) if options.stride is None else options.stride
    executor = get_executor(executor, inputs.q.device)
    rel = check_rel(rel, inputs.q)
    if merged:
        parts = [
            executor.tiled(inputs, Band(stride + 1, causal), rel=rel, need_lse=True),
            executor.tiled(inputs, Columns(stride, causal, gap=2), rel=rel, need_lse=True),
        ]
        return merge_partials(parts)[0]  # type: ignore[arg-type]
    half = check_split_heads(H)
    a1, _ = executor.tiled(inputs.head_range(0, half), Band(stride + 1, causal), rel=rel)
    a2, _ = executor.tiled(inputs.head_range(half, H), Columns(stride, causal, gap=0), rel=rel)
    return torch.cat([a1, a2], dim=1)


# --- what it means: the mask from its definition (O(N²), sharing no code with the fast path) ---


def strided_mask(
    n: int, stride: int, causal: bool = True, merged: bool = True, heads: int | None = None, *, device=None
) -> Tensor:
    """Sparse Transformer strided pattern, l = stride.

    Causal: A1(i) = {j : max(0, i - l) <= j <= i}, A2(i) = {j <= i : (i - j) mod l = 0}.
    Non-causal: A1(i) = {j : |i - j| <= l}, A2(i) = {j : (i - j) mod l = 0}.
    ``merged``: every head sees A1 ∪ A2; otherwise the first half of the heads A1, the second half A2.
    """
    l = positive_int("stride", stride)
    i, j = index_grid(n, device)
    if causal:
        a1 = (j <= i) & (j >= i - l)
        a2 = (j <= i) & ((i - j) % l == 0)
    else:
        a1 = (i - j).abs() <= l
        a2 = (i - j) % l == 0
    return split_mask(a1, a2, merged, heads)


# --- the head kinds: how a model uses it ---


@dataclass(frozen=True)
class StridedOptions:
    """options.strided (read by strided, strided_a1 and strided_a2): l, at most seq_len; default
    round(sqrt(seq_len))."""

    stride: int | None = None

    def __post_init__(self) -> None:
        if self.stride is not None:
            positive_int("stride", self.stride)


def _complete(o: StridedOptions, config: Any) -> StridedOptions:
    stride = sqrt_len(config.seq_len) if o.stride is None else o.stride
    return StridedOptions(at_most_seq_len("stride", stride, config))


class StridedHeads(HeadGroup):
    """part: 'merged' (A1 ∪ A2), 'a1' (the last l + 1 positions) or 'a2' (every l-th position back)."""

    def __init__(self, heads: int, head_dim: int, options: StridedOptions, part: str) -> None:
        super().__init__(heads, head_dim)
        self.options, self.part = options, part

    @property
    def stride(self) -> int:
        return self.options.stride

    def forward(self, q, k, v, rel_pos, documents=None):
        inputs = self.inputs(q, k, v, documents)
        if self.part == "merged":
            return strided_attention(inputs, self.options, self.executor, rel=rel_pos)
        if self.part == "a1":
            return local_attention(inputs, LocalOptions(self.stride + 1), self.executor, rel=rel_pos)
        return self.executor.tiled(Inputs(q, k, v, self.scale, documents=documents), Columns(self.stride, True, gap=0),
                                   rel=relative(rel_pos))[0]

    def reference_mask(self, q, k):
        a1, a2 = strided_mask(q.shape[2], self.stride, merged=False, heads=2, device=q.device)
        return {"merged": a1 | a2, "a1": a1, "a2": a2}[self.part]

    def store_size(self, max_len):
        return (min(self.stride + 1, max_len), True) if self.part == "a1" else (max_len, False)

    def step(self, q, cache, t, rel_pos, since=None):
        if self.part == "a1":  # the ring holds exactly the last l + 1 positions
            return super().step(q, cache, t, rel_pos, since)
        l = self.stride  # noqa: E741
        near = 0 if self.part == "a2" else max(0, t - l)  # A1: the last l + 1 positions, [near, t]
        column = slice(t % l, t + 1 if self.part == "a2" else near, l)  # t, t - l, … (before `near` when merged)
        keys, values, positions = cache.keys[:, :, column], cache.values[:, :, column], cache.positions[column]
        if self.part == "merged":  # slot p holds position p: both sets are slices
            recent = slice(near, t + 1)
            keys = torch.cat([keys, cache.keys[:, :, recent]], 2)
            values = torch.cat([values, cache.values[:, :, recent]], 2)
            positions = torch.cat([positions, cache.positions[recent]])
        return self.attend(q, keys, values, positions, t, rel_pos, allowed=seen(positions, since))


def _kind(name: str, part: str, keys, summary: str) -> HeadKind:
    return HeadKind(name, lambda o, heads, head_dim, seed: StridedHeads(heads, head_dim, o, part),
                    keys_per_query=keys, option_type=StridedOptions, section="strided", complete=_complete,
                    describe=lambda o: f"stride={o.stride}", summary=summary, documents=True)


KINDS = (
    _kind("strided", "merged", lambda o, n: min(o.stride + 1, n) + n / (2 * o.stride),
          "the last l + 1 positions and every l-th one back (l = stride)"),
    _kind("strided_a1", "a1", lambda o, n: min(o.stride + 1, n), "the last l + 1 positions"),
    _kind("strided_a2", "a2", lambda o, n: n / (2 * o.stride), "every l-th position back"),
)
