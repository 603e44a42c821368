"""Attention: one module per mechanism (its function, its mask, its head kind and options: ``full``, ``local``,
``strided``, ``fixed``, ``longformer``, ``lsh``, ``linear``, ``performer``, and the ``routing`` folder), the dense
definition (``reference``), and the registry of head kinds a model is
built from (``registry.KINDS``; ``register_kind`` adds one; ``kinds/`` holds their base classes).

Every function takes one checked ``Inputs`` value (``Inputs.of(q, k, v, scale=..., key_padding_mask=...)``, q, k, v
(B, H, N, D)), the mechanism's options value whole (``LocalOptions(window=64)``, the same one a model's config holds)
and an executor, and returns (B, H, N, D), like ``torch.nn.functional.scaled_dot_product_attention``:
``local_attention(Inputs.of(q, k, v), LocalOptions(window=64), causal=True, rel=None)``.

Cross-attention (queries of one sequence over a memory's keys and values, another length) takes
``Inputs.cross(q, k, v, key_padding_mask=...)``: ``full_attention``, ``linear_attention`` and ``performer_attention``
non-causal, ``routing_cross_attention`` (``cross_routes``) and ``moba_cross_attention``; the kinds that compare
positions (windows, causal masks, relative positions) refuse such inputs naming those (``inputs.CROSS_KINDS``).
"""

from ..executors import EXECUTORS, Executor, check_backend, get_executor, register_executor, resolve_backend
from ..executors.inputs import Inputs
from ..executors.relative import RelativePositions
from .fixed import FixedOptions, fixed_attention, fixed_mask
from .full import KernelOptions, full_attention, full_mask
from .kernels import KERNELS, kernel_attention
from .kinds import HeadGroup, HeadKind, KeyStore
from .linear import LinearOptions, linear_attention
from .local import LocalOptions, local_attention, local_mask
from .longformer import LongformerOptions, longformer_attention, longformer_mask
from .lsh import LSHOptions, lsh_attention
from .moba import MobaOptions, moba_cross_attention
from .performer import PerformerOptions, orthogonal_features, performer_attention
from .reference import reference_attention, reference_weights
from .registry import KINDS, PATTERNS, Pattern, get_kind, get_pattern, register_kind, unregister_kind
from .routing import (
    CrossRoutes,
    Router,
    RoutingAttention,
    RoutingCache,
    RoutingOptions,
    SphericalKMeans,
    cross_routes,
    routing_cross_attention,
    update_routing,
)
from .strided import StridedOptions, strided_attention, strided_mask

__all__ = [
    "CrossRoutes",
    "EXECUTORS",
    "MobaOptions",
    "cross_routes",
    "moba_cross_attention",
    "routing_cross_attention",
    "FixedOptions",
    "Inputs",
    "KernelOptions",
    "LinearOptions",
    "LocalOptions",
    "LongformerOptions",
    "LSHOptions",
    "PerformerOptions",
    "StridedOptions",
    "Executor",
    "KERNELS",
    "KINDS",
    "PATTERNS",
    "HeadGroup",
    "HeadKind",
    "KeyStore",
    "Pattern",
    "check_backend",
    "RelativePositions",
    "Router",
    "RoutingAttention",
    "RoutingCache",
    "RoutingOptions",
    "SphericalKMeans",
    "fixed_attention",
    "fixed_mask",
    "full_attention",
    "full_mask",
    "get_executor",
    "get_kind",
    "get_pattern",
    "kernel_attention",
    "linear_attention",
    "local_attention",
    "local_mask",
    "longformer_attention",
    "longformer_mask",
    "lsh_attention",
    "orthogonal_features",
    "performer_attention",
    "reference_attention",
    "reference_weights",
    "register_executor",
    "register_kind",
    "resolve_backend",
    "strided_attention",
    "strided_mask",
    "unregister_kind",
    "update_routing",
]
