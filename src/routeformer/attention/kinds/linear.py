"""Linear heads: full causal attention under the elu or poly2 kernel, computed through its feature map in linear time
(``attention/linear.py``). Decoding is a recurrence: one (F, D) state per head, the same cost at every position."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..kernels import FEATURE_KERNELS, feature_dim, feature_map, kernel_scale
from ..linear import LinearState, default_chunk, linear_attention
from ..masks import full_mask
from .base import HeadGroup, HeadKind


@dataclass(frozen=True)
class LinearOptions:
    kernel: str  # config.kernel: 'elu' or 'poly2'
    features: int  # F of the kernel at config.head_dim


class FeatureHeads(HeadGroup):
    """Heads computed as φ(q)·φ(k) through features: decoding keeps Σ φ(k) vᵀ and Σ φ(k) (``LinearState``).
    Subclasses give ``features(x, query)`` and ``num_features``."""

    num_features: int

    def features(self, x, query: bool):
        raise NotImplementedError

    def new_cache(self, batch, max_len, device, dtype):
        return LinearState.empty(batch, self.heads, self.num_features, self.head_dim, device=device, dtype=dtype)

    def keep(self, cache, k, v, positions, start):
        cache.add(self.features(k.to(cache.kv.dtype), query=False), v)

    def step(self, q, cache, t, rel_pos):
        return cache.read(self.features(q[:, :, None].to(cache.kv.dtype), query=True))[:, :, 0].to(q.dtype)


class LinearHeads(FeatureHeads):
    def __init__(self, heads: int, head_dim: int, kernel: str) -> None:
        super().__init__(heads, head_dim)
        self.kernel = kernel
        self.num_features = feature_dim(kernel, head_dim)

    def forward(self, q, k, v, rel_pos):
        return linear_attention(q, k, v, causal=True, scale=self.kernel_scale, kernel=self.kernel)

    def reference_mask(self, q, k):  # the meaning: full causal attention under the kernel (the base reference)
        return full_mask(q.shape[2], device=q.device)

    def features(self, x, query):
        return feature_map(self.kernel, x, kernel_scale(self.kernel, self.kernel_scale, self.head_dim))

    def extra_repr(self) -> str:
        return f"heads={self.heads}, kernel={self.kernel}, features={self.num_features}"


def _options(config: Any, heads: int) -> LinearOptions:
    kernel = config.kernel
    if kernel not in FEATURE_KERNELS:
        raise ValueError(f"kernel={kernel!r}: linear heads need kernel='elu' or 'poly2' (the exponential kernel has no "
                         "finite feature map; performer heads estimate it)")
    return LinearOptions(kernel, feature_dim(kernel, config.head_dim))


def _keys_per_query(o: LinearOptions, n: int) -> float:
    return o.features + min(n, default_chunk(o.features)) / 2  # read + write the (F, D) state; the exact chunk


KIND = HeadKind("linear", lambda o, heads, head_dim, seed: LinearHeads(heads, head_dim, o.kernel),
                keys_per_query=_keys_per_query, options=_options, relative_positions=False, reads_kernel=True,
                executor=False,
                describe=lambda o: f"kernel={o.kernel}, F={o.features}",
                summary="every earlier key under the elu or poly2 kernel, in linear time")
