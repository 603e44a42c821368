"""Incremental decoding for causal routing: one ring buffer of the last `window` keys and values per cluster.

The causal forward lets position t attend to the most recent `window` keys j <= t of each cluster it probes. After
writing key t into its cluster's ring buffer, the buffers hold exactly those keys, so a new token costs O(k · D) to
route plus O(p · window · D) to attend over its p probed clusters, per head, whatever its position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from ...checks import positive_int
from ...executors.relative import RelativePositions
from ..decoding import Cached, attend_cached
from .sorted_window import ClusterOrder, drop_own_key


class TokenRoute(NamedTuple):
    """Where one decoded token goes: its key's cluster (B, H), the clusters its query probes (B, H, p), and their
    gates (B, H, p) (each probe's softmax scaled by its gate instead of one softmax over the union) or None."""

    key_cluster: Tensor
    probes: Tensor
    gates: Tensor | None = None


@dataclass
class RoutingCache:
    """Decoding state of one routing layer.

    keys, values: (B, H, k, window, D); positions: (B, H, k, window), -1 for an empty slot; counts: (B, H, k)
    tokens written to each cluster so far; length: positions decoded so far; max_len: the declared maximum, or
    None when the owner checks it (a model's ``ModelCache`` checks once for every layer).
    """

    ROWS: ClassVar[tuple[str, ...]] = ("keys", "values", "positions", "counts")  # one row per sequence (reorder_rows)

    keys: Tensor
    values: Tensor
    positions: Tensor
    counts: Tensor
    length: int
    max_len: int | None

    @classmethod
    def empty(cls, batch: int, heads: int, clusters: int, window: int, head_dim: int, *, max_len: int | None,
              device: torch.device | str, dtype: torch.dtype) -> RoutingCache:
        batch = positive_int("batch", batch)
        max_len = None if max_len is None else positive_int("max_len", max_len)
        shape = (batch, heads, clusters, window)
        return cls(
            keys=torch.zeros(*shape, head_dim, device=device, dtype=dtype),
            values=torch.zeros(*shape, head_dim, device=device, dtype=dtype),
            positions=torch.full(shape, -1, dtype=torch.long, device=device),
            counts=torch.zeros(shape[:3], dtype=torch.long, device=device),
            length=0,
            max_len=max_len,
        )

    def check(self, n: int) -> None:
        """Raise unless ``n`` more positions fit the declared ``max_len``."""
        if self.max_len is not None and self.length + n > self.max_len:
            raise ValueError(f"max_len: positions up to {self.length + n - 1} are past the declared maximum of this "
                             f"cache (max_len={self.max_len}); create the cache with a larger max_len")

    def fill(self, k: Tensor, v: Tensor, sort: ClusterOrder) -> None:
        """Fill an empty cache with a whole prompt at once: k, v (B, H, n, D); ``sort``: the prompt's
        ``sort_by_cluster(key clusters, num_clusters)`` (with rank and counts).

        Each cluster keeps its last ``window`` keys, each in the ring slot (rank within the cluster) mod window, the
        slot ``step`` would have written it to."""
        if self.length:
            raise ValueError("fill needs an empty cache")
        B, H, n, D = k.shape
        self.check(n)
        window = self.keys.shape[3]
        order, grouped, rank, counts = sort.order, sort.grouped, sort.rank, sort.counts
        keep = rank >= counts.gather(-1, grouped) - window  # the last `window` of each cluster
        b = torch.arange(B, device=k.device)[:, None, None].expand_as(order)[keep]
        h = torch.arange(H, device=k.device)[None, :, None].expand_as(order)[keep]
        c, slot, pos = grouped[keep], (rank % window)[keep], order[keep]
        self.keys[b, h, c, slot] = k[b, h, pos].to(self.keys.dtype)
        self.values[b, h, c, slot] = v[b, h, pos].to(self.values.dtype)
        self.positions[b, h, c, slot] = pos
        self.counts.copy_(counts)
        self.length = n

    def step(self, q: Tensor, k: Tensor, v: Tensor, route: TokenRoute, *, scale: float, exclude_self: bool,
             rel_pos: RelativePositions | None, since: Tensor | None = None) -> Tensor:
        """Write the token at position ``length`` and return its output. q, k, v (B, H, D); ``route``: the buffer
        its key joins, the buffers its query reads and their gates. ``exclude_self``: shared QK, the own key only
        when alone. ``since`` (B,): packed documents, each row's document's first position; the rings' entries
        before it are not seen (a ring holds its cluster's last keys, so those of the document are its newest: the
        last ``window`` of the cluster within the document). The caller checks ``max_len``."""
        key_cluster, probes, gates = route
        B, H, D = q.shape
        if tuple(k.shape) != (B, H, D) or self.keys.shape[:2] != (B, H) or self.keys.shape[-1] != D:
            raise ValueError(f"decoding tensors of shape {tuple(q.shape)} do not fit a cache for "
                             f"(B, H, D) = {(*self.keys.shape[:2], self.keys.shape[-1])}")
        t, window = self.length, self.keys.shape[3]
        b = torch.arange(B, device=q.device)[:, None]
        h = torch.arange(H, device=q.device)[None, :]
        slot = self.counts[b, h, key_cluster] % window  # (B, H): the oldest entry, once the buffer is full
        self.keys[b, h, key_cluster, slot] = k.to(self.keys.dtype)
        self.values[b, h, key_cluster, slot] = v.to(self.values.dtype)
        self.positions[b, h, key_cluster, slot] = t
        self.counts[b, h, key_cluster] += 1
        self.length += 1

        p = probes.shape[-1]
        b, h = b[..., None], h[..., None]
        keys, values = self.keys[b, h, probes].flatten(2, 3), self.values[b, h, probes].flatten(2, 3)  # (B, H, p·w, D)
        pos = self.positions[b, h, probes].flatten(2, 3)  # (B, H, p·w)
        allow = pos >= 0 if since is None else pos >= since[:, None, None]
        if exclude_self:
            allow = drop_own_key(allow, pos == t)
        if gates is None:
            return attend_cached(q, Cached(keys, values, pos), t, scale=scale, allowed=allow, rel_pos=rel_pos)
        parts = [attend_cached(q, Cached(keys[:, :, s], values[:, :, s], pos[:, :, s]), t, scale=scale,
                               allowed=allow[:, :, s], rel_pos=rel_pos) * gates[:, :, i, None].to(q.dtype)
                 for i, s in enumerate(slice(j * window, (j + 1) * window) for j in range(p))]
        return sum(parts)
