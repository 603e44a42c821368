"""Reaching into a trained model's heads: what each head group sees in a forward (``capture``), and running the
model with every head group's output replaced by another function of its own queries, keys and values
(``substitute``). Everything here is dense, O(N²) per head: analysis runs at the model's ``seq_len``, not at 64k.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from ..attention import HeadGroup, RelativePositions
from ..attention.reference import normalise_scores
from ..model import TransformerLM


@dataclass
class HeadCall:
    """One head group's inputs in one forward: q, k, v (B, h, N, D) and the layer's relative positions.

    ``first_head`` is the index of the group's first head among the layer's heads (heads are numbered across
    groups in the order of the config's ``attention`` spec)."""

    layer: int
    kind: str  # the registry name of the group's kind ('local', 'routing', ...)
    group: HeadGroup
    first_head: int
    q: Tensor
    k: Tensor
    v: Tensor
    rel_pos: RelativePositions | None

    @property
    def heads(self) -> range:
        return range(self.first_head, self.first_head + self.group.heads)

    @functools.cached_property
    def allowed(self) -> Tensor:
        """The keys each query of the group may see, (B, h, N, N) bool, from the kind's ``reference_mask`` (so a key
        whose weight underflows to 0 still counts as seen)."""
        with torch.no_grad():
            mask = self.group.reference_mask(self.q, self.k)
        if mask is None:
            raise ValueError(f"layer {self.layer}: {self.kind} heads are not a mask over attention, so they have no "
                             f"attention weights to analyse")
        B, h, N, _ = self.q.shape
        return mask.expand(B, h, N, N)

    @functools.cached_property
    def weights(self) -> Tensor:
        """The exact attention weights (B, h, N, N) of the group, under ``allowed``."""
        return self.restricted(self.allowed)

    @functools.cached_property
    def scores(self) -> Tensor:
        """The group's logits (kernel values for 'poly2' / 'elu') before any mask, (B, h, N, N): O(N²·D) to compute
        (with relative positions the dominant cost of analysis), so computed once per call and normalised under
        every mask an approximation asks for."""
        with torch.no_grad():
            return self.group.reference_scores(self.q, self.k, self.rel_pos)

    @torch.no_grad()
    def restricted(self, keep: Tensor) -> Tensor:
        """The group's kernel normalised over the keys in ``keep`` (B, h, N, N) only, computed from the scores (a
        kept key counts even where its weight among all keys underflows to 0): the group's ``reference_weights``
        under ``keep``, bit for bit, in O(N²) given ``scores``."""
        return normalise_scores(self.scores, keep, self.group.kernel)

    @functools.cached_property
    def values(self) -> PairValues:
        """The value each key offers each query (``PairValues``)."""
        return PairValues(self.v, self.rel_pos)

    @functools.cached_property
    def output(self) -> Tensor:
        """The group's exact output o = Σ_j α_ij u_ij, (B, h, N, D)."""
        return self.values.combine(self.weights)


class PairValues:
    """The value each key j offers query i: u_ij = v_j + a^V_ij (Shaw et al.'s value term; v_j without relative
    positions). v: (B, h, N, D). Nothing (N, N, D) is built: a^V_ij has only 2k + 1 distinct rows."""

    def __init__(self, v: Tensor, rel_pos: RelativePositions | None) -> None:
        self.v, self.rel_pos = v, rel_pos
        N = v.shape[2]
        if rel_pos is not None:
            pos = torch.arange(N, device=v.device)
            self.index = rel_pos.index(pos[None, :] - pos[:, None])  # (N, N): table row of j - i
            self.table = rel_pos.value.detach().to(v.dtype)  # (2k + 1, D)

    def combine(self, weights: Tensor) -> Tensor:
        """Σ_j w_ij u_ij: weights (B, h, N, N) -> (B, h, N, D)."""
        out = weights @ self.v
        if self.rel_pos is not None:
            binned = weights.new_zeros(*weights.shape[:-1], self.table.shape[0])  # (B, h, N, 2k + 1)
            binned.scatter_add_(-1, self.index.expand_as(weights), weights)
            out = out + binned @ self.table
        return out

    def dots(self, g: Tensor) -> Tensor:
        """u_ij · g_i for every pair: g (B, h, N, D) -> (B, h, N, N)."""
        out = g @ self.v.transpose(-1, -2)
        if self.rel_pos is not None:
            out = out + torch.gather(g @ self.table.T, -1, self.index.expand_as(out))
        return out

    def square_norms(self) -> Tensor:
        """|u_ij|² for every pair: (B, h, N, N) (broadcast over i without relative positions)."""
        norms = self.v.square().sum(-1)[:, :, None, :]  # (B, h, 1, N)
        if self.rel_pos is None:
            return norms
        table = self.table
        cross = torch.gather(self.v @ table.T, -1, self.index.T.expand(*self.v.shape[:2], -1, -1))  # (B, h, j, i)
        return norms + 2 * cross.transpose(-1, -2) + table.square().sum(-1)[self.index]

    def gather(self, keys: Tensor) -> Tensor:
        """u_ij for chosen keys: keys (B, h, N, t) long -> (B, h, N, t, D)."""
        B, h, N, t = keys.shape
        D = self.v.shape[-1]
        out = torch.gather(self.v, 2, keys.reshape(B, h, N * t, 1).expand(-1, -1, -1, D)).view(B, h, N, t, D)
        if self.rel_pos is not None:
            rows = torch.gather(self.index.expand(B, h, N, N), -1, keys)  # (B, h, N, t)
            out = out + self.table[rows]
        return out


@contextlib.contextmanager
def hooked(model: TransformerLM, replace: Callable[[HeadCall, Callable[[], Tensor]], Tensor],
           layers: list[int] | None = None) -> Iterator[None]:
    """Within the block, the forward of every head group in ``layers`` (default all) returns
    ``replace(call, own)``: ``call`` its inputs, ``own()`` its own output. The model's code is untouched; the
    groups' ``forward`` is restored on exit."""
    patched = []
    try:
        for layer, (block, specs) in enumerate(zip(model.blocks, model.config.head_groups(), strict=True)):
            if layers is not None and layer not in layers:
                continue
            first = 0
            for group, spec in zip(block.attention.groups, specs, strict=True):
                group.forward = _wrapper(group, layer, spec.kind.name, first, replace)
                patched.append(group)
                first += group.heads
        yield
    finally:
        for group in patched:
            del group.forward


def _wrapper(group: HeadGroup, layer: int, kind: str, first: int, replace):
    own_forward = type(group).forward

    def forward(q, k, v, rel_pos, **given):  # the key padding and documents a layer may give pass through
        call = HeadCall(layer, kind, group, first, q, k, v, rel_pos)
        return replace(call, lambda: own_forward(group, q, k, v, rel_pos, **given))

    return forward


@torch.no_grad()
def capture(model: TransformerLM, tokens: Tensor, layers: list[int] | None = None) -> list[HeadCall]:
    """Run ``model`` on (B, N) tokens (evaluation mode, moved to the model's device) and return every head group's
    inputs, in layer order."""
    calls: list[HeadCall] = []

    def keep(call: HeadCall, own: Callable[[], Tensor]) -> Tensor:
        calls.append(call)
        return own()

    was_training = model.training
    model.eval()
    try:
        with hooked(model, keep, layers):
            model(tokens.to(next(model.parameters()).device))
    finally:
        model.train(was_training)
    return calls


def check_layers(model: TransformerLM, layers: list[int] | None) -> list[int]:
    """``layers`` (default every layer) after checking each exists; a ValueError names the one that does not."""
    depth = len(model.blocks)
    if layers is None:
        return list(range(depth))
    if not layers:
        raise ValueError(f"no layers given: choose among 0..{depth - 1}")
    for layer in layers:
        if not 0 <= layer < depth:
            raise ValueError(f"layer {layer} does not exist: the model has layers 0..{depth - 1}")
    return sorted(set(layers))
