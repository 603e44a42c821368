"""The registry of cross-attention kinds: heads of a decoder layer that read a memory (an encoder's output).

Each kind's cross form lives in its mechanism's module (``full_attention`` and ``linear_attention`` /
``performer_attention`` non-causal, ``routing/cross.py``, ``moba.py``); here is one entry each: how to build its
heads from typed options, read from a seq2seq config's ``[cross.options.<name>]``. A cross head group maps
``Inputs.cross(q, k, v, key_padding_mask=...)`` (q (B, h, Nq, D), the memory (B, h, Nk, D)) to (B, h, Nq, D); it
has ``aux_loss`` and ``after_optimizer_step`` (routing's k-means), an ``executor`` the model sets, and for decoding
``prepare(k, key_padding_mask)`` (what it keeps of the memory once: routing's clusters and sort) and
``decode(inputs, prepared)`` (new queries over it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..checks import check_scale, positive_int
from ..executors import Backend
from ..executors.inputs import CROSS_KINDS, Inputs
from ..lengths import sqrt_len
from .full import full_attention
from .kernels import feature_map, kernel_scale
from .kinds.base import read_typed_options
from .kinds.common import non_negative_int
from .linear import LinearOptions, linear_attention
from .moba import MobaOptions, moba_cross_attention
from .performer import (
    PerformerOptions,
    default_features,
    orthogonal_features,
    performer_attention,
    performer_features,
)
from .routing.cross import RoutedCrossHeads


@dataclass(frozen=True)
class RoutingCrossOptions:
    """cross.options.routing: C centroids per head over the memory's keys (None: round(sqrt(the source length))),
    the clusters each query reads, the keys a cluster's window holds (None: ceil(Nk / C) of each row's real keys),
    the k-means decay, the commitment weight and the optimiser steps of full cross-attention before routing
    (``warmup``; the lookup task needs it, docs/model.md)."""

    num_clusters: int | None = None
    probes: int = 1
    window: int | None = None
    decay: float = 0.999
    commitment: float = 1e-4
    warmup: int = 0

    def __post_init__(self) -> None:
        non_negative_int("warmup", self.warmup)
        for name in ("num_clusters", "window"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        positive_int("probes", self.probes)
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {self.decay!r}")


class CrossGroup(nn.Module):
    """Cross heads of a kind computed by one function (``attend(inputs, executor)``), with no state of their own."""

    def __init__(self, heads: int, attend: Callable[[Inputs, Backend], Tensor]) -> None:
        super().__init__()
        self.heads, self._attend = heads, attend
        self.executor: Backend = "auto"

    def forward(self, inputs: Inputs) -> Tensor:
        return self._attend(inputs, self.executor)

    def prepare(self, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None) -> Any:
        """What decoding keeps of the memory besides its keys and values: nothing for these heads."""
        return None

    def decode(self, inputs: Inputs, prepared: None) -> Tensor:
        """New queries over the memory (decoding): the forward's rows."""
        return self._attend(inputs, self.executor)

    def aux_loss(self) -> Tensor | None:
        return None

    def after_optimizer_step(self, step: int | None = None, group: dist.ProcessGroup | None = None) -> bool:
        return False

    def replicated_state(self) -> dict[str, Tensor]:
        return {}


class FeatureCross(CrossGroup):
    """Cross heads of a feature map φ (linear's kernels, Performer's FAVOR+): decoding builds the memory's sums
    S = Σ_j φ(k_j) v_jᵀ (F, D) and z = Σ_j φ(k_j) (F,) once over its real keys (``prepare``), and a new query costs
    O(F · D): φ(q) S / φ(q) · z, zeros where that is 0."""

    def features(self, x: Tensor, query: bool) -> Tensor:
        raise NotImplementedError

    def prepare(self, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        acc = torch.promote_types(k.dtype, torch.float32)
        phi = self.features(k.to(acc), False)  # (B, h, Nk, F)
        if key_padding_mask is not None:
            phi = phi * key_padding_mask[:, None, :, None].to(phi.dtype)
        return phi.transpose(-1, -2) @ v.to(acc), phi.sum(2)  # (B, h, F, D), (B, h, F)

    def decode(self, inputs: Inputs, prepared: tuple[Tensor, Tensor]) -> Tensor:
        sums, total = prepared
        phi = self.features(inputs.q.to(sums.dtype), True)  # (B, h, n, F)
        den = (phi * total[:, :, None]).sum(-1, keepdim=True)
        return ((phi @ sums) / torch.where(den > 0, den, 1.0)).to(inputs.q.dtype)


class LinearCross(FeatureCross):
    """Linear cross heads: the elu or poly2 kernel over the whole memory (``linear_attention``, non-causal)."""

    def __init__(self, heads: int, head_dim: int, options: LinearOptions) -> None:
        super().__init__(heads, lambda x, ex: linear_attention(x, options, ex, causal=False))
        self.kernel, self.kernel_scale = options.kernel, kernel_scale(options.kernel, None, head_dim)

    def features(self, x: Tensor, query: bool) -> Tensor:
        return feature_map(self.kernel, x, self.kernel_scale)


class PerformerCross(FeatureCross):
    """Performer cross heads: FAVOR+ with a projection drawn once from the layer's seed (a buffer, saved)."""

    def __init__(self, heads: int, head_dim: int, options: PerformerOptions, seed: int) -> None:
        if options.redraw_every:
            raise ValueError("cross.options.performer.redraw_every: cross heads draw their features once")
        super().__init__(heads, self._performer)
        m = default_features(head_dim) if options.features is None else options.features
        self.register_buffer("projection", orthogonal_features(heads, m, head_dim,
                                                               generator=torch.Generator().manual_seed(seed)))
        self.scale = check_scale(None, head_dim)

    def _performer(self, inputs: Inputs, executor: Backend) -> Tensor:
        return performer_attention(inputs, None, executor, causal=False, projection=self.projection)

    def features(self, x: Tensor, query: bool) -> Tensor:
        return performer_features(x, self.projection, self.scale, query=query)


@dataclass(frozen=True)
class CrossKind:
    """A cross-attention kind: its name, its options' type (None: none) and how to build its heads (options,
    heads, head_dim, the memory's length, seed)."""

    name: str
    option_type: type | None
    build: Callable[[Any, int, int, int, int], nn.Module]

    def read_options(self, given: Any) -> Any:
        """``given`` (a mapping, an ``option_type`` instance or None) as the typed options; errors name
        ``cross.options.<name>`` and its fields."""
        return read_typed_options(self.option_type, given, f"cross.options.{self.name}", f"{self.name} cross heads")


def _routing(o: RoutingCrossOptions, heads: int, head_dim: int, memory: int, seed: int) -> nn.Module:
    clusters = sqrt_len(memory) if o.num_clusters is None else o.num_clusters
    return RoutedCrossHeads(heads, head_dim, clusters, probes=o.probes, window=o.window, decay=o.decay,
                            commitment=o.commitment, warmup=o.warmup)


CROSS: dict[str, CrossKind] = {k.name: k for k in (
    CrossKind("full", None, lambda o, heads, d, n, seed: CrossGroup(heads, lambda x, ex: full_attention(
        x, None, ex, causal=False))),
    CrossKind("routing", RoutingCrossOptions, _routing),
    CrossKind("moba", MobaOptions, lambda o, heads, d, n, seed: CrossGroup(heads, lambda x, ex: moba_cross_attention(
        x, o, ex))),
    CrossKind("performer", PerformerOptions, lambda o, heads, d, n, seed: PerformerCross(heads, d, o, seed)),
    CrossKind("linear", LinearOptions, lambda o, heads, d, n, seed: LinearCross(heads, d, o)),
)}
assert tuple(CROSS) == CROSS_KINDS, "the refusals name the kinds registered here"


def get_cross_kind(name: str) -> CrossKind:
    """The cross-attention kind called ``name``; a ValueError names those there are."""
    try:
        return CROSS[name]
    except KeyError:
        raise ValueError(f"cross: unknown kind {name!r}; cross-attention kinds: {', '.join(CROSS)}") from None


__all__ = ["CROSS", "CrossGroup", "CrossKind", "FeatureCross", "LinearCross", "PerformerCross", "RoutingCrossOptions",
           "get_cross_kind"]
