"""Longformer attention: a dilated sliding window plus symmetric global tokens (Beltagy et al. 2020).

This module is the mechanism's one home: its functional form, its mask (what it means, for the tests), its head kind
and options, registered in ``registry.py``.

Heads. Longformer heads: a dilated sliding window (one dilation per head) plus global positions.

Decoding keeps a ring buffer of the (window - 1) · max(dilation) + 1 last keys, or every key when global tokens are
configured; a step gathers each head's `window` dilated positions and the global positions, O((window + G)·D) (a
global query attends to every earlier position, O(t·D)).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..checks import check_options, check_per_head, check_positions, positive_int
from ..executors import Backend, get_executor, merge_partials
from ..executors.grid import columns_key_valid, from_columns, to_columns
from ..executors.inputs import Inputs, check_rel, refuse_cross, relative
from ..executors.pieces import Band, Subset
from ..executors.relative import RelativePositions
from ..executors.tiling import Distances, Tiling
from .decoding import seen
from .kinds.base import HeadGroup, HeadKind
from .kinds.common import at_most_seq_len
from .masks import index_grid


def longformer_attention(
    inputs: Inputs,
    options: LongformerOptions,
    executor: Backend = "auto",
    *,
    causal: bool = False,
    rel: RelativePositions | None = None,
) -> Tensor:
    """Query i attends to j = i + m · dilation for |m| < ``options.window`` (m <= 0 when causal); a global
    position (``options.global_tokens``, each < N) attends to every position and every position attends to it
    (only earlier ones when causal). With packed documents (``inputs.documents``) all of it within the query's
    document: a global token is global to its own document.

    ``inputs``: ``Inputs.of(q, k, v, ...)``, q, k, v (B, H, N, D) -> (B, H, N, D). ``options.dilation`` is an int
    or one per head. The dilated window is a band along the columns of the sequence viewed as a grid of
    ``dilation`` columns; global keys outside a query's band are merged in through their log-sum-exp; global query
    rows are recomputed densely and replace the band rows. O(N · (window + G) · D) time for G global tokens.
    ``executor``: a name or an ``Executor`` (``"auto"``: FlexAttention on CUDA, the fused kernels on the CPU;
    ``"fused"``, ``"tiles"``, ``"flex"``). ``rel``: relative-position tables, or None.
    """
    refuse_cross(inputs, "Longformer's window and global positions")
    options = check_options("options", options, LongformerOptions)
    q, k, v = inputs.q, inputs.k, inputs.v
    B, H, N, D = inputs.shape
    scale, key_valid, documents = inputs.scale, inputs.key_valid, inputs.documents
    window = options.window
    dilations = check_per_head("dilation", options.dilation, H)
    globals_ = check_positions("global_tokens", options.global_tokens, N)
    rel_pos = rel
    check_rel(rel, q)
    g = _device_index(globals_, q.device) if globals_ else None
    if g is not None:  # (N,) whether a position is global, and its row among the global ones (0 elsewhere)
        mask, slots = [False] * N, [0] * N  # on the host: a scatter in the graph is what the merge below avoids
        for i, p in enumerate(globals_):
            mask[p], slots[p] = True, i
        is_global = torch.tensor(mask).to(q.device, non_blocking=True)
        slot = _device_index(slots, q.device)
    executor = get_executor(executor, q.device)
    outs, order = [], []
    for d in sorted(set(dilations)):  # heads sharing a dilation share one grid
        heads = [h for h in range(H) if dilations[h] == d]
        qd, kd, vd = q, k, v
        if len(heads) < H:
            idx = _device_index(heads, q.device)
            qd, kd, vd = (x[:, idx] for x in (q, k, v))
        # the dilated band: a band along the columns of the sequence seen as a grid of d columns
        qc, kc, vc = to_columns(qd, d), to_columns(kd, d), to_columns(vd, d)  # (B·d, h, N/d, D)
        grid = Inputs(qc, kc, vc, scale, columns_key_valid(key_valid, B, N, d, q.device),
                      documents=None if documents is None else to_columns(documents[:, None, :, None], d)[:, 0, :, 0])
        band, band_lse = executor.tiled(grid, Band(window, causal), rel=relative(rel_pos, Distances(unit=d)),
                                        need_lse=g is not None)
        out = from_columns(band, d, N)
        if g is not None:
            pos = torch.arange(N, device=q.device)
            # Every query also sees the global keys its band does not already hold.
            diff = g[None, :] - pos[:, None]  # (N, G): key - query
            steps = torch.div(diff, d, rounding_mode="floor")
            in_band = (diff % d == 0) & (((steps <= 0) & (steps > -window)) if causal else (steps.abs() < window))
            allow = ~in_band & (diff <= 0) if causal else ~in_band
            these = Inputs(qd, kd, vd, scale, key_valid, documents=documents)
            glob, glob_lse = executor.tiled(these, Subset(g, allow), rel=relative(rel_pos), need_lse=True)
            out, _ = merge_partials([(out, from_columns(band_lse, d, N)), (glob, glob_lse)])
            # Global queries see every position (every earlier one when causal): their rows are recomputed whole.
            rows_delta = pos[None, :] - g[:, None]  # (G, N)
            # packed documents: a global query sees every key of its own document (a (B, 1, 1, G, N) tile mask)
            own = None if documents is None else (documents[:, g, None] == documents[:, None, :])[:, None, None]
            rows, _ = executor.tiled(
                these.with_(q=qd[:, :, g], documents=None),
                Tiling.dense(g.shape[0], allow=(rows_delta <= 0) if causal else None, tile_mask=own),
                rel=None if rel_pos is None else relative(rel_pos, Distances(delta=rows_delta)),
            )
            # Placed by a gather and a select, not ``out.index_copy(2, g, rows)``: inductor (CPU, torch 2.13) ran
            # the scatter of index_copy's backward after a fused kernel that reads its result, so compiled models
            # got wrong gradients (pytorch/pytorch#185509, fixed upstream by #185873; tests/test_compile.py).
            out = torch.where(is_global[:, None], rows.index_select(2, slot), out)
        outs.append(out)
        order += heads
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    if order != sorted(order):
        out = out[:, _device_index(sorted(range(H), key=order.__getitem__), q.device)]  # the inverse permutation
    return out


def _device_index(values: list[int], device: torch.device) -> Tensor:
    """A long tensor of ``values`` on ``device``, without waiting for the copy: from pageable host memory a
    non-blocking copy is staged at once, so the host buffer may go (no stream synchronisation on CUDA)."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


# --- what it means: the mask from its definition (O(N²), sharing no code with the fast path) ---


def longformer_mask(
    n: int,
    window: int,
    dilation: int | Sequence[int] | Tensor = 1,
    global_tokens: Sequence[int] | Tensor | None = None,
    causal: bool = False,
    heads: int | None = None,
    *,
    device=None,
) -> Tensor:
    """Longformer: dilated sliding window plus symmetric global tokens.

    Query i sees j = i + m · dilation for |m| < window (m <= 0 when causal); a global position g sees every j
    (j <= g when causal) and is seen by every i (i >= g when causal). With one dilation per head the mask is
    (H, N, N).
    """
    window = positive_int("window", window)
    per_head = isinstance(dilation, (list, tuple, Tensor)) or heads is not None
    if per_head:
        n_heads = heads if heads is not None else len(dilation)  # type: ignore[arg-type]
        dilations = check_per_head("dilation", dilation, positive_int("heads", n_heads))
    else:
        dilations = [positive_int("dilation", dilation)]
    globals_ = check_positions("global_tokens", global_tokens, positive_int("n", n))
    i, j = index_grid(n, device)
    is_global = torch.zeros(n, dtype=torch.bool, device=device)
    is_global[globals_] = True
    diff = j - i
    glob = is_global[:, None] | is_global[None, :]
    if causal:
        glob = glob & (j <= i)
    masks = []
    for d in dilations:
        m = torch.div(diff, d, rounding_mode="floor")
        band = (diff % d == 0) & ((m <= 0) & (m > -window) if causal else (m.abs() < window))
        masks.append(band | glob)
    return torch.stack(masks) if per_head else masks[0]


# --- the head kind: how a model uses it ---


@dataclass(frozen=True)
class LongformerOptions:
    """options.longformer: the window (keys per query, at most seq_len), the dilation (one for every head, or a list
    with one per Longformer head of a layer) and the global positions (in [0, seq_len))."""

    window: int = 128
    dilation: int | tuple[int, ...] = 1
    global_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        positive_int("window", self.window)
        for name in ("dilation", "global_tokens"):  # a functional caller's tensor of them
            value = getattr(self, name)
            if isinstance(value, Tensor):
                object.__setattr__(self, name, value.tolist() if value.dim() else value.item())
        if isinstance(self.dilation, (list, tuple)):
            object.__setattr__(self, "dilation", tuple(positive_int(f"dilation[{i}]", d)
                                                       for i, d in enumerate(self.dilation)))
        else:
            positive_int("dilation", self.dilation)
        if not isinstance(self.global_tokens, (list, tuple)):
            raise ValueError(f"global_tokens must be a list of positions, got {self.global_tokens!r}")
        for i, g in enumerate(self.global_tokens):
            if isinstance(g, bool) or not isinstance(g, int) or g < 0:
                raise ValueError(f"global_tokens[{i}] must be a non-negative integer, got {g!r}")
        object.__setattr__(self, "global_tokens", tuple(self.global_tokens))

    def dilations(self, heads: int) -> list[int]:
        """One dilation per head of a group of ``heads``."""
        return list(self.dilation) if isinstance(self.dilation, tuple) else [self.dilation] * heads


class LongformerHeads(HeadGroup):
    def __init__(self, heads: int, head_dim: int, options: LongformerOptions) -> None:
        super().__init__(heads, head_dim)
        self.options = options
        self.dilation, self.global_tokens = list(options.dilations(heads)), sorted(options.global_tokens)
        self._is_global = set(self.global_tokens)
        d = torch.tensor(self.dilation, dtype=torch.long)[:, None]  # (h, 1): one dilation per head
        # Decoding index tensors, built once (they follow the module's device; not saved).
        self.register_buffer("_dilation", d, persistent=False)
        self.register_buffer("_offsets", torch.arange(options.window) * d, persistent=False)  # (h, window): t - offset
        self.register_buffer("_globals", torch.tensor(self.global_tokens, dtype=torch.long), persistent=False)

    @property
    def window(self) -> int:
        return self.options.window

    def _present(self, n: int) -> list[int]:
        return [g for g in self.global_tokens if g < n]  # a shorter sequence holds fewer of them

    def forward(self, q, k, v, rel_pos, documents=None):
        present = self._present(q.shape[2])
        options = self.options if len(present) == len(self.global_tokens) else \
            dataclasses.replace(self.options, global_tokens=tuple(present))
        return longformer_attention(self.inputs(q, k, v, documents), options, self.executor, causal=True,
                                    rel=rel_pos)

    def reference_mask(self, q, k):
        return longformer_mask(q.shape[2], self.window, self.dilation, self._present(q.shape[2]), causal=True,
                               device=q.device)

    def store_size(self, max_len):
        if self.global_tokens:  # a global position attends to everything before it
            return max_len, False
        return min((self.window - 1) * max(self.dilation) + 1, max_len), True

    def step(self, q, cache, t, rel_pos, since=None):
        if t in self._is_global:  # a global query sees every earlier position
            return super().step(q, cache, t, rel_pos, since)
        positions = t - self._offsets  # (h, window): t, t - d, …, t - (window - 1)·d of each head
        allowed = positions >= 0
        positions = positions.clamp_min(0)
        if self.global_tokens:  # and every earlier global position not already in the head's band
            gap = t - self._globals  # (G,)
            in_band = (gap % self._dilation == 0) & (gap // self._dilation < self.window)  # (h, G)
            positions = torch.cat([positions, self._globals.clamp_max(t).expand(len(self.dilation), -1)], 1)
            allowed = torch.cat([allowed, (gap >= 0) & ~in_band], 1)
        slots = positions % cache.capacity if cache.ring else positions  # a ring holds the whole band
        B, _, _, D = cache.keys.shape
        index = slots[None, :, :, None].expand(B, -1, -1, D)
        return self.attend(q, cache.keys.gather(2, index), cache.values.gather(2, index),
                           positions[None].expand(B, -1, -1), t, rel_pos,
                           allowed=seen(positions[None].expand(B, -1, -1), since, allowed))


def _listed(dilation: int | tuple[int, ...]) -> int | list[int]:
    return list(dilation) if isinstance(dilation, tuple) else dilation


def _complete(o: LongformerOptions, config: Any) -> LongformerOptions:
    at_most_seq_len("window", o.window, config)
    bad = [g for g in o.global_tokens if g >= config.seq_len]
    if bad:
        raise ValueError(f"global_tokens must lie in [0, seq_len={config.seq_len}), got {bad}")
    if isinstance(o.dilation, tuple):
        for layer, spec in enumerate(config.layer_specs()):
            heads = dict(spec).get("longformer")
            if heads is not None and heads != len(o.dilation):
                raise ValueError(f"dilation gives {len(o.dilation)} values but layer {layer} has {heads} "
                                 f"longformer heads")
    return o


KIND = HeadKind(
    "longformer",
    lambda o, heads, head_dim, seed: LongformerHeads(heads, head_dim, o),
    keys_per_query=lambda o, n: min(o.window, n) + len(o.global_tokens),
    option_type=LongformerOptions,
    complete=_complete,
    describe=lambda o: f"window={o.window}, dilation={_listed(o.dilation)}, global={list(o.global_tokens)}",
    summary="a dilated window plus global positions",
    documents=True,
)
