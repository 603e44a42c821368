"""Local heads: the last `window` positions, under the model's kernel (``TransformerConfig.kernel``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..kernels import kernel_attention
from ..local import local_attention
from ..masks import local_mask
from .base import HeadKind
from .common import within_seq_len
from .full import FullHeads


@dataclass(frozen=True)
class LocalOptions:
    window: int  # config.window: keys per query
    kernel: str = "exp"  # config.kernel


class LocalHeads(FullHeads):
    """Decoding keeps a ring buffer of exactly the window, O(window·D)."""

    def __init__(self, heads: int, head_dim: int, window: int, kernel: str = "exp") -> None:
        super().__init__(heads, head_dim, kernel)
        self.window = window

    def forward(self, q, k, v, rel_pos):
        if self.kernel != "exp":
            return kernel_attention(q, k, v, self.kernel, causal=True, scale=self.kernel_scale, window=self.window)
        return local_attention(q, k, v, self.window, causal=True, rel_pos=rel_pos)

    def reference_mask(self, q, k):
        return local_mask(q.shape[2], self.window, device=q.device)

    def reference(self, q, k, v, rel_pos=None):
        if self.kernel != "exp":
            return kernel_attention(q, k, v, self.kernel, causal=True, scale=self.kernel_scale, window=self.window,
                                    block=q.shape[2])
        return super(FullHeads, self).reference(q, k, v, rel_pos)

    def store_size(self, max_len):
        return min(self.window, max_len), True  # the ring holds exactly the window

    def extra_repr(self) -> str:
        return f"heads={self.heads}, window={self.window}, kernel={self.kernel}"


def _options(config: Any, heads: int) -> LocalOptions:
    return LocalOptions(within_seq_len(config, "window", "local"), getattr(config, "kernel", "exp"))


KIND = HeadKind("local", lambda o, heads, head_dim, seed: LocalHeads(heads, head_dim, o.window, o.kernel),
                keys_per_query=lambda o, n: min(o.window, n), options=_options, reads_kernel=True,
                relative_positions=lambda o: o.kernel == "exp",
                describe=lambda o: f"window={o.window}" + ("" if o.kernel == "exp" else f", kernel={o.kernel}"),
                summary="the last `window` positions")
