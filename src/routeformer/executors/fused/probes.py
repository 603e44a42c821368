"""Multi-probe routing's key ranges (``Executor.probes_run``) as one fused CPU pass where the kernels are built, else
``None`` and the caller takes PyTorch's operators (``attention.routing.probes.probe_ranges``, the definition): the
same ranges, integers only, so equal to the definition bit for bit."""

from __future__ import annotations

import torch
from torch import Tensor

from . import op
from .executor import built


def fused_probe_ranges(key_clusters: Tensor, probes: Tensor, window: int, exclude_self: bool,
                       own_when_alone: bool) -> tuple[Tensor, Tensor] | None:
    """The ranges [lo, hi) of the keys sorted by (cluster, position) that every (query, probe) entry sees, each
    (B, H, N·p) long, entry i·p + t for query i and probe t: key_clusters (B, H, N) long, probes (B, H, N, p) long.
    ``exclude_self``: a query's own cluster's entry stops before its own key; ``own_when_alone``: a query whose
    entries then hold no key gets it back. O(N·p + k) per head, no search. ``None`` where the kernels do not take
    the call (off the CPU, not built, or ids not int64)."""
    if key_clusters.device.type != "cpu" or probes.device != key_clusters.device or not built():
        return None
    if key_clusters.dtype != torch.long or probes.dtype != torch.long:
        return None
    return op.ops().probe_ranges(key_clusters.contiguous(), probes.contiguous(), window, exclude_self,
                                 own_when_alone)
