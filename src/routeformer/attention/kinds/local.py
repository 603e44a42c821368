"""Local heads: the last `window` positions, under the model's kernel (``TransformerConfig.kernel``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..local import local_attention
from ..masks import local_mask
from .base import HeadGroup, HeadKind
from .common import exp_kernel, within_seq_len


@dataclass(frozen=True)
class LocalOptions:
    window: int  # config.window: keys per query
    kernel: str = "exp"  # config.kernel


class LocalHeads(HeadGroup):
    """Decoding keeps a ring buffer of exactly the window, O(window·D)."""

    def __init__(self, heads: int, head_dim: int, window: int, kernel: str = "exp") -> None:
        super().__init__(heads, head_dim)
        self.window, self.kernel = window, kernel

    def forward(self, q, k, v, rel_pos):
        return local_attention(q, k, v, self.window, causal=True, rel_pos=rel_pos, kernel=self.kernel,
                               backend=self.backend)

    def reference_mask(self, q, k):
        return local_mask(q.shape[2], self.window, device=q.device)

    def store_size(self, max_len):
        return min(self.window, max_len), True  # the ring holds exactly the window

    def extra_repr(self) -> str:
        return f"heads={self.heads}, window={self.window}, kernel={self.kernel}"


def _options(config: Any, heads: int) -> LocalOptions:
    return LocalOptions(within_seq_len(config, "window", "local"), config.kernel)


KIND = HeadKind("local", lambda o, heads, head_dim, seed: LocalHeads(heads, head_dim, o.window, o.kernel),
                keys_per_query=lambda o, n: min(o.window, n), options=_options, reads_kernel=True,
                relative_positions=exp_kernel, executor=exp_kernel,
                describe=lambda o: f"window={o.window}" + ("" if o.kernel == "exp" else f", kernel={o.kernel}"),
                summary="the last `window` positions")
