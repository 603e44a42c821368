"""Full heads: every earlier key, the O(N²·D) baseline, under the model's kernel (``TransformerConfig.kernel``:
softmax, or the poly2 / elu kernels of ``attention/kernels.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..full import full_attention
from ..masks import full_mask
from .base import HeadGroup, HeadKind
from .common import exp_kernel


@dataclass(frozen=True)
class KernelOptions:
    kernel: str = "exp"  # config.kernel


class FullHeads(HeadGroup):
    """Decoding keeps every position; a step reads the filled part, O(t·D)."""

    def __init__(self, heads: int, head_dim: int, kernel: str = "exp") -> None:
        super().__init__(heads, head_dim)
        self.kernel = kernel

    def forward(self, q, k, v, rel_pos):
        return full_attention(q, k, v, causal=True, rel_pos=rel_pos, kernel=self.kernel, backend=self.backend)

    def reference_mask(self, q, k):
        return full_mask(q.shape[2], device=q.device)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, kernel={self.kernel}"


def kernel_options(config: Any, heads: int) -> KernelOptions:
    return KernelOptions(config.kernel)


def describe_kernel(options: KernelOptions) -> str:
    return "-" if options.kernel == "exp" else f"kernel={options.kernel}"


KIND = HeadKind("full", lambda o, heads, head_dim, seed: FullHeads(heads, head_dim, o.kernel),
                keys_per_query=lambda options, n: (n + 1) / 2, options=kernel_options, reads_kernel=True,
                relative_positions=exp_kernel, executor=exp_kernel, describe=describe_kernel,
                summary="every earlier key")
