"""Performer heads (FAVOR+): softmax attention estimated with positive orthogonal random features in linear time
(``attention/performer.py``), causal without a leak. The features are a buffer drawn from the layer's seed, so
every rank and a reloaded checkpoint hold the same; ``redraw()`` draws the next set (the trainer calls it every
``redraw_every`` optimiser steps through ``after_optimizer_step``). Decoding keeps one (m, D) state per head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..checks import positive_int
from ..linear import default_chunk, feature_attention
from ..performer import default_features, orthogonal_features, performer_attention, performer_features
from .base import HeadKind
from .linear import FeatureHeads


@dataclass(frozen=True)
class PerformerOptions:
    features: int  # config.features: m
    redraw_every: int  # config.redraw_every: optimiser steps between draws, 0 = never


class PerformerHeads(FeatureHeads):
    def __init__(self, heads: int, head_dim: int, options: PerformerOptions, seed: int) -> None:
        super().__init__(heads, head_dim)
        self.num_features, self.redraw_every, self.seed = options.features, options.redraw_every, seed
        self.register_buffer("draws", torch.zeros((), dtype=torch.long))  # sets drawn so far, saved with the model
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))  # optimiser steps seen (when not told)
        self.register_buffer("projection", self._draw(0))

    def _draw(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)  # the same on every rank
        return orthogonal_features(self.heads, self.num_features, self.head_dim, generator=generator)

    @torch.no_grad()
    def redraw(self) -> None:
        """Replace the random features by the next set of this layer's sequence (deterministic in seed and count)."""
        self.draws += 1
        self.projection.copy_(self._draw(int(self.draws)))

    def after_optimizer_step(self, step, group):
        self.steps += 1
        count = int(self.steps) if step is None else step
        if self.redraw_every and count % self.redraw_every == 0:
            self.redraw()
            return True
        return False

    def forward(self, q, k, v, rel_pos):
        return performer_attention(q, k, v, causal=True, scale=self.scale, projection=self.projection)

    def features(self, x, query):
        return performer_features(x, self.projection, self.scale, query=query)

    def reference(self, q, k, v, rel_pos=None):
        """The quadratic form of the same estimate: weights φ(q_i)·φ(k_j) over j <= i, normalised (one chunk)."""
        n = q.shape[2]
        return feature_attention(self.features(q, True), self.features(k, False), v, causal=True, chunk=n)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, features={self.num_features}, redraw_every={self.redraw_every}"


def _options(config: Any, heads: int) -> PerformerOptions:
    features = default_features(config.head_dim) if config.features is None else positive_int("features",
                                                                                                 config.features)
    every = config.redraw_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(f"redraw_every must be a non-negative integer (0: never), got {every!r}")
    return PerformerOptions(features, every)


KIND = HeadKind("performer", lambda o, heads, head_dim, seed: PerformerHeads(heads, head_dim, o, seed),
                keys_per_query=lambda o, n: 1.5 * o.features + min(n, default_chunk(o.features)) / 2,
                options=_options, relative_positions=False, executor=False,
                describe=lambda o: f"m={o.features}" + (f", redraw every {o.redraw_every}" if o.redraw_every else ""),
                summary="softmax estimated by positive orthogonal random features, in linear time")
