"""LSH heads (Reformer, Kitaev et al. 2020): shared QK, angular LSH with fixed random rotations, and per hash round
the last `lsh_window` positions of the query's bucket; the union over `lsh_rounds` rounds, each key once
(``attention/lsh.py``).

Decoding keeps, per head, round and bucket, a ring of the last `window` keys, values and positions (routing's
``RoutingCache`` with the rounds folded into the heads). A new token is hashed, written to its bucket's ring in
every round, and attends to the union of those rings, deduplicated: O(rounds · window · D + rounds · D ·
buckets/2) per head, whatever its position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import positive_int
from ..decoding import attend_cached
from ..inputs import check_inputs
from ..lsh import default_lsh_settings, lsh_attention, lsh_hash, lsh_mask, lsh_rotations
from ..routing.cache import RoutingCache
from ..routing.sorted_window import drop_own_key, sort_by_cluster
from .base import HeadGroup, HeadKind
from .common import within_seq_len


@dataclass(frozen=True)
class LSHOptions:
    buckets: int  # config.lsh_buckets: buckets per round (even)
    rounds: int  # config.lsh_rounds: hash rounds
    window: int  # config.lsh_window: keys per query per round


@dataclass
class LSHCache:
    """Decoding state of one group of LSH heads: ``rings`` is a ``RoutingCache`` over H·rounds heads (head h,
    round r at h·rounds + r) with one ring of the last ``window`` normalised keys, values and positions per
    bucket. Its tensors have a fixed size: nothing grows with the position."""

    rings: RoutingCache
    heads: int
    rounds: int

    @property
    def length(self) -> int:
        return self.rings.length

    def fill(self, k: Tensor, v: Tensor, hashes: Tensor) -> None:
        """A prompt into an empty cache: k (normalised), v (B, H, n, D); hashes (B, H, rounds, n)."""
        B, H, n, D = k.shape
        R = self.rounds
        fold = (B, H * R, n, D)
        sort = sort_by_cluster(hashes.reshape(B, H * R, n), self.rings.keys.shape[2])
        self.rings.fill(k[:, :, None].expand(B, H, R, n, D).reshape(fold),
                        v[:, :, None].expand(B, H, R, n, D).reshape(fold), sort)

    def step(self, q: Tensor, k: Tensor, v: Tensor, buckets: Tensor, *, scale: float) -> Tensor:
        """Write the token at position ``length`` (k normalised; q, k, v (B, H, D), buckets (B, H, rounds)) to its
        ring in every round and return its output (B, H, D): attention over the union of those rings, each
        position once, its own key only when nothing else is there. O(rounds · window · D) per head."""
        rings, R = self.rings, self.rounds
        B, H, D = q.shape
        t, window = rings.length, rings.keys.shape[3]
        b = torch.arange(B, device=q.device)[:, None]
        h = torch.arange(H * R, device=q.device)[None, :]
        into = buckets.reshape(B, H * R)
        slot = rings.counts[b, h, into] % window  # the oldest entry, once the ring is full
        rings.keys[b, h, into, slot] = k.repeat_interleave(R, 1).to(rings.keys.dtype)
        rings.values[b, h, into, slot] = v.repeat_interleave(R, 1).to(rings.values.dtype)
        rings.positions[b, h, into, slot] = t
        rings.counts[b, h, into] += 1
        rings.length += 1

        keys = rings.keys[b, h, into].view(B, H, R * window, D)
        values = rings.values[b, h, into].view(B, H, R * window, D)
        pos = rings.positions[b, h, into].view(B, H, R * window)
        ranked, by = pos.sort(-1)  # equal positions side by side: keep the first of each
        repeat = torch.cat([torch.zeros_like(ranked[..., :1], dtype=torch.bool), ranked[..., 1:] == ranked[..., :-1]],
                           -1)
        allow = (pos >= 0) & ~torch.zeros_like(repeat).scatter(-1, by, repeat)
        allow = drop_own_key(allow, pos == t)
        return attend_cached(q, keys, values, pos, t, scale=scale, allowed=allow)


class LSHHeads(HeadGroup):
    """LSH heads; the keys are the queries (the model passes them as k), normalised. ``rotations`` (H, rounds, D,
    buckets/2) is a persistent buffer drawn from the build seed, so every rank and a reloaded model agree."""

    def __init__(self, heads: int, head_dim: int, options: LSHOptions, seed: int) -> None:
        super().__init__(heads, head_dim)
        self.options = options
        self.register_buffer("rotations", lsh_rotations(heads, head_dim, options.buckets, options.rounds,
                                                        seed=seed))

    def _kwargs(self) -> dict:
        o = self.options
        return {"buckets": o.buckets, "rounds": o.rounds, "window": o.window, "rotations": self.rotations}

    def forward(self, q, k, v, rel_pos):
        if rel_pos is not None:
            raise ValueError("lsh heads do not support relative positions")
        return lsh_attention(q, v, causal=True, scale=self.scale, backend=self.backend, **self._kwargs())

    def reference_mask(self, q, k):
        return lsh_mask(q, causal=True, **self._kwargs())

    def reference_keys(self, q, k):  # shared QK: the keys are the unit queries
        return F.normalize(q, dim=-1)

    def new_cache(self, batch, max_len, device, dtype):
        o = self.options
        rings = RoutingCache.empty(batch, self.heads * o.rounds, o.buckets, min(o.window, max_len), self.head_dim,
                                   max_len=None, device=device, dtype=dtype)  # the model checks max_len
        return LSHCache(rings, self.heads, o.rounds)

    def decode(self, q, k, v, cache, start, rel_pos):
        check_inputs(q, q, v, self.scale, None)
        hashes = lsh_hash(q, self.rotations)  # (B, H, rounds, n)
        keys = F.normalize(q, dim=-1)
        if cache.length == 0 and q.shape[2] > 1:  # a prompt: one forward, then every bucket's last `window`
            out = self(q, k, v, rel_pos)
            cache.fill(keys, v, hashes)
            return out
        outs = [cache.step(q[:, :, i], keys[:, :, i], v[:, :, i], hashes[..., i], scale=self.scale)
                for i in range(q.shape[2])]
        return torch.stack(outs, 2)


def _options(config: Any, heads: int) -> LSHOptions:
    default_buckets = default_lsh_settings(config.seq_len)[0]
    buckets = positive_int("lsh_buckets", default_buckets if config.lsh_buckets is None else config.lsh_buckets)
    if buckets % 2:
        raise ValueError(f"lsh_buckets must be even (a hash is the argmax over [xR; -xR]), got {buckets}")
    rounds = positive_int("lsh_rounds", config.lsh_rounds)
    if config.lsh_window is None:
        window = max(1, config.seq_len // buckets)
    else:
        positive_int("lsh_window", config.lsh_window)
        window = within_seq_len(config, "lsh_window", "lsh")
    return LSHOptions(buckets, rounds, window)


def _keys_per_query(o: LSHOptions, n: int) -> float:
    return o.rounds * min(o.window, n) + o.rounds * o.buckets / 2  # + hashing: buckets/2 projections per round


KIND = HeadKind(
    "lsh",
    lambda o, heads, head_dim, seed: LSHHeads(heads, head_dim, o, seed),
    keys_per_query=_keys_per_query,
    options=_options,
    shares_qk=lambda o: True,
    relative_positions=False,
    describe=lambda o: f"buckets={o.buckets}, rounds={o.rounds}, w={o.window}",
    summary="shared-QK LSH: per hash round the last `lsh_window` positions of the query's bucket, keys once",
)
