"""Attention: one module per mechanism (its function, its mask, its head kind and options: ``full``, ``local``,
``strided``, ``fixed``, ``longformer``, ``lsh``, ``linear``, ``performer``, and the ``routing`` folder), the dense
definition (``reference``), and the registry of head kinds a model is
built from (``registry.KINDS``; ``register_kind`` adds one; ``kinds/`` holds their base classes).

Every function takes and returns (B, H, N, D) tensors, like ``torch.nn.functional.scaled_dot_product_attention``.
"""

from ..executors import EXECUTORS, Executor, check_backend, get_executor, register_executor, resolve_backend
from ..executors.relative import RelativePositions
from .fixed import fixed_attention, fixed_mask
from .full import full_attention, full_mask
from .kernels import KERNELS, kernel_attention
from .kinds import HeadGroup, HeadKind, KeyStore
from .linear import linear_attention
from .local import local_attention, local_mask
from .longformer import longformer_attention, longformer_mask
from .lsh import lsh_attention
from .performer import orthogonal_features, performer_attention
from .reference import reference_attention, reference_weights
from .registry import KINDS, PATTERNS, Pattern, get_kind, get_pattern, register_kind, unregister_kind
from .routing import Router, RoutingAttention, RoutingCache, RoutingOptions, SphericalKMeans, update_routing
from .strided import strided_attention, strided_mask

__all__ = [
    "EXECUTORS",
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
