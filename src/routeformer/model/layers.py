"""The attention layer with mixed heads, the feed-forward, and the Sparse Transformer's residual block."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention import RelativePositions
from ..attention.registry import KINDS
from ..documents import DocumentSpans
from ..executors import Executor, sigmoid_gelu
from .config import HeadGroupSpec, TransformerConfig


class MixedAttention(nn.Module):
    """Multi-head attention whose heads are split among kinds (e.g. 4 local + 4 routing), one ``HeadGroup`` each.

    x (B, N, dim) -> (B, N, dim). Groups whose keys are their queries (``HeadKind.shares_qk``: routing with shared
    QK) take their queries as keys, so the key projection only covers the other heads. Relative positions (one pair
    of tables per layer) are shared by every head. With ``config.token_shift`` the projections read x with its
    position before mixed in (``shift_half``, ``shift_mix``).
    """

    def __init__(self, config: TransformerConfig, spec: list[HeadGroupSpec], layer: int, causal: bool = True) -> None:
        super().__init__()
        H, D = config.heads, config.head_dim
        self.heads, self.head_dim, self.causal = H, D, causal
        if not causal:
            refuse_non_encoders(spec)
        self.groups = nn.ModuleList((g.kind.build if causal else g.kind.encoder)(g.options, g.heads, D, layer * 131 + i)
                                    for i, g in enumerate(spec))
        self.on_executor = [g.kind.runs_on_executor(g.options) for g in spec]  # the model binds their executor
        self.shares_qk = [g.kind.heads_share_qk(g.options) for g in spec]
        self.refusing_documents = [g.kind.name for g in spec if not g.kind.honours_documents(g.options)]
        self.key_heads = sum(g.heads for g, shared in zip(self.groups, self.shares_qk, strict=True) if not shared)
        self.query = nn.Linear(config.dim, H * D)
        self.key = nn.Linear(config.dim, self.key_heads * D) if self.key_heads else None
        self.value = nn.Linear(config.dim, H * D)
        self.out = nn.Linear(H * D, config.dim)
        self.rel_pos = RelativePositions(D, config.rel_clip) if config.positions == "relative" else None
        self.token_shift = config.token_shift
        # 'learned': the per-channel weight of the position before, 0 at the start (the layer begins as without it)
        self.shift_mix = nn.Parameter(torch.zeros(config.dim)) if config.token_shift == "learned" else None

    def bind(self, executor: Executor) -> None:
        """Hand ``executor`` to the head groups that run on one (``TransformerLM`` resolves its device's)."""
        for group, uses in zip(self.groups, self.on_executor, strict=True):
            if uses:
                group.executor = executor

    def _project_heads(self, x: Tensor) -> list[tuple[Tensor, Tensor, Tensor]]:
        """Per group, its (B, h, N, D) queries, keys and values."""
        B, N, _ = x.shape
        # one product for the three projections (one larger matmul is faster than three small ones)
        layers = [self.query, self.value] + ([self.key] if self.key is not None else [])
        both = F.linear(x, torch.cat([m.weight for m in layers]), torch.cat([m.bias for m in layers]))
        sizes = [m.out_features for m in layers]
        q, v, *k = (y.view(B, N, -1, self.head_dim).transpose(1, 2) for y in both.split(sizes, -1))  # (B, h, N, D)
        k = k[0] if k else None
        # split, not sliced: a slice's backward fills a zero tensor of all the heads per group and adds them up (6
        # fills of (B, H, N, D) per layer); split's is one concatenation. A 2048-byte step of 2 local + 2 moba heads
        # went from 0.855 to 0.728 s (one thread, 2026-11-27; docs/block-selection.md)
        heads = [group.heads for group in self.groups]
        qs, vs = _heads(q, heads), _heads(v, heads)
        ks = iter(_heads(k, [n for n, shared in zip(heads, self.shares_qk, strict=True) if not shared])
                  if k is not None else ())
        return [(qg, qg if shared else next(ks), vg)
                for qg, vg, shared in zip(qs, vs, self.shares_qk, strict=True)]

    def forward(self, x: Tensor, cache: LayerCache | None = None, start: int = 0,
                documents: Tensor | None = None, spans: DocumentSpans | None = None, *,
                key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """(B, N, dim) -> ((B, N, dim), the groups' auxiliary loss (routing: commitment) or None). With ``cache``
        x continues a decoded sequence at position ``start``. ``documents`` (B, N), numbered from 0 in each row
        (``documents.check_documents``): packed documents, every group attending within them and the token shift
        reading nothing across a boundary; with a cache, their ``spans`` instead (``documents.continue_documents``:
        a row may begin a new document at any position, the others untouched). ``key_padding_mask`` (B, N), True =
        a real position: an encoder's (non-causal) padded source, read by no query and counted by no statistic."""
        B, N, _ = x.shape
        if key_padding_mask is not None and self.causal:
            raise ValueError("key_padding_mask: a causal layer needs none (right padding is after every real "
                             "position); it is an encoder's (causal=False)")
        if (documents is not None or spans is not None) and self.refusing_documents:
            raise ValueError(f"documents: {', '.join(sorted(set(self.refusing_documents)))} heads (with these "
                             f"options) do not honour packed documents yet (docs/attention.md, 'Packed documents')")
        if self.token_shift != "none":
            before = cache.before if cache is not None else None
            starts = spans.new if spans is not None else None if documents is None else document_starts(documents)
            x, last = (shift_half(x, before, starts) if self.shift_mix is None
                       else shift_mix(x, before, self.shift_mix, starts))
            if cache is not None:
                cache.before = last
        outs, aux = [], None
        for i, (group, (q, k, v)) in enumerate(zip(self.groups, self._project_heads(x), strict=True)):
            if cache is None:
                padding = {} if key_padding_mask is None else {"key_padding_mask": key_padding_mask}
                outs.append(group(q, k, v, self.rel_pos, **padding) if documents is None
                            else group(q, k, v, self.rel_pos, documents=documents, **padding))
                loss = group.aux_loss()
                if loss is not None:
                    aux = loss if aux is None else aux + loss
            elif spans is None:
                outs.append(group.decode(q, k, v, cache.groups[i], start, self.rel_pos))
            else:
                outs.append(group.decode(q, k, v, cache.groups[i], start, self.rel_pos, spans=spans))
        out = torch.cat(outs, 1).transpose(1, 2).reshape(B, N, self.heads * self.head_dim)
        return self.out(out), aux

    def new_cache(self, batch: int, max_len: int, device, dtype) -> LayerCache:
        return LayerCache([g.new_cache(batch, max_len, device, dtype) for g in self.groups])


def refuse_non_encoders(spec: list[HeadGroupSpec]) -> None:
    """A ValueError where an encoder's (non-causal) layer names a kind without an encoder form (``HeadKind.encoder``),
    naming those that have one."""
    missing = [g.kind.name for g in spec if g.kind.encoder is None]
    if missing:
        able = [name for name, kind in KINDS.items() if kind.encoder is not None]
        raise ValueError(f"encoder: {', '.join(missing)} heads have no non-causal (encoder) form; encoder kinds: "
                         f"{', '.join(able)}")


@dataclass
class LayerCache:
    """The decoding state of one attention layer: one cache per head group, and with ``token_shift`` the last
    position's input channels that the next position reads (``shift_half``, ``shift_mix``)."""

    ROWS: ClassVar[tuple[str, ...]] = ("groups", "before")  # one row per sequence (reorder_rows)

    groups: list
    before: Tensor | None = None


def document_starts(documents: Tensor) -> Tensor:
    """(B, N) bool: the positions that start a document after the row's first (documents (B, N) non-decreasing)."""
    return torch.cat([torch.zeros_like(documents[:, :1], dtype=torch.bool), documents.diff(dim=-1) != 0], dim=-1)


def shift_half(x: Tensor, before: Tensor | None, starts: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x (B, N, dim) with its channels dim // 2 onwards taken from the position before (token_shift 'half'): at t = 0
    from ``before`` (B, 1, dim - dim // 2), zeros when None, and zeros at the ``starts`` (B, N) of packed documents.
    Returns it and the last position's moved channels, the ``before`` of a continuation. O(B N dim)."""
    half = x.shape[-1] // 2
    out, last = _with_predecessor(x[..., half:], before, starts)
    return torch.cat([x[..., :half], out], -1), last


def shift_mix(x: Tensor, before: Tensor | None, mu: Tensor, starts: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x + mu * (x_before - x) for x (B, N, dim), mu (dim,) (token_shift 'learned'), x_before at t = 0 ``before``
    (B, 1, dim), zeros when None, and zeros at the ``starts`` (B, N) of packed documents. Returns it and x's last
    position, the ``before`` of a continuation. O(B N dim)."""
    earlier, last = _with_predecessor(x, before, starts)
    return x + mu * (earlier - x), last


def _with_predecessor(x: Tensor, before: Tensor | None, starts: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x (B, N, c) -> (each position's predecessor (B, N, c), the first's being ``before`` or zeros, zeros where
    ``starts`` (a document's first position: it has no predecessor); x's last)."""
    if before is None:
        before = x.new_zeros(x.shape[0], 1, x.shape[2])
    earlier = torch.cat([before.to(x.dtype), x[:, :-1]], 1)
    if starts is not None:
        earlier = earlier.masked_fill(starts[..., None], 0.0)
    return earlier, x[:, -1:]


class FeedForward(nn.Module):
    """W2 f(W1 x + b1) + b2, ff_mult × wide; f(x) = x·sigmoid(1.702x) (the Sparse Transformer's GELU) or GELU."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        hidden = int(round(config.ff_mult * config.dim))
        self.w1 = nn.Linear(config.dim, hidden)
        self.w2 = nn.Linear(hidden, config.dim)
        self.sigmoid_gelu = config.activation == "sigmoid_gelu"
        self.executor: Executor | None = None  # the model's (``TransformerLM`` binds it): its activation kernel

    def forward(self, x: Tensor) -> Tensor:
        h = self.w1(x)
        h = sigmoid_gelu(h, self.executor) if self.sigmoid_gelu else F.gelu(h)
        return self.w2(h)


class Block(nn.Module):
    """H + a(H) + b(H): a = dropout(attention(norm(H))), b = dropout(ff(norm(H + a(H)))) (pre-norm, Child et al.)."""

    def __init__(self, config: TransformerConfig, spec: list[HeadGroupSpec], layer: int, causal: bool = True) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.dim)
        self.attention = MixedAttention(config, spec, layer, causal)
        self.norm2 = nn.LayerNorm(config.dim)
        self.ff = FeedForward(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, cache: LayerCache | None = None, start: int = 0,
                documents: Tensor | None = None, spans: DocumentSpans | None = None, *,
                key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        a, aux = self.attention(self.norm1(x), cache, start, documents, spans, key_padding_mask=key_padding_mask)
        x = x + self.dropout(a)
        return x + self.dropout(self.ff(self.norm2(x))), aux


def init_weights(module: nn.Module, depth: int) -> None:
    """The Sparse Transformer's initialisation of one block: weights N(0, 0.125/sqrt(d_in)), biases 0, and the
    attention output projection and W2 scaled by 1/sqrt(2 · depth)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.125 / math.sqrt(m.in_features))
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, RelativePositions):
            nn.init.normal_(m.key, std=0.125 / math.sqrt(m.head_dim))
            nn.init.normal_(m.value, std=0.125 / math.sqrt(m.head_dim))
    for m in module.modules():
        if isinstance(m, (MixedAttention, FeedForward)):
            last = m.out if isinstance(m, MixedAttention) else m.w2
            last.weight.data.mul_(1 / math.sqrt(2 * depth))


def _heads(x: Tensor, sizes: list[int]) -> tuple[Tensor, ...]:
    """x (B, H, N, D) cut into groups of ``sizes`` heads along dim 1 (views); one group: x itself."""
    return (x,) if len(sizes) == 1 else x.split(sizes, 1)
