"""Local (sliding-window) attention, computed in blocks of ``window``.

This module is the mechanism's one home: its functional form, its mask (what it means, for the tests), its head kind
and options, registered in ``registry.py``.

Heads. Local heads: the last `window` positions, under the model's kernel (``TransformerConfig.kernel``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ..checks import check_options, positive_int
from ..executors import Backend, get_executor
from ..executors.inputs import Inputs, check_rel, refuse_cross
from ..executors.pieces import Band
from ..executors.relative import RelativePositions
from .kernels import check_kernel, check_kernel_backend, kernel_attention
from .kinds.base import HeadGroup, HeadKind, non_causal
from .kinds.common import at_most_seq_len, exp_kernel
from .masks import index_grid, per_head_mask


def local_attention(
    inputs: Inputs,
    options: LocalOptions,
    executor: Backend = "auto",
    *,
    causal: bool = True,
    rel: RelativePositions | None = None,
) -> Tensor:
    """Sliding-window attention of ``options.window`` keys: causal, query i sees i - window < j <= i; non-causal,
    |i - j| < window.

    ``inputs``: ``Inputs.of(q, k, v, scale=..., key_padding_mask=...)``, q, k, v (B, H, N, D) -> (B, H, N, D).
    ``options.kernel``: 'exp' (softmax), or 'poly2' / 'elu' (``kernels.kernel_attention``, blocks of 256 queries;
    no relative positions; one implementation: ``executor`` "flex" is refused). ``executor``: a name or an
    ``Executor`` (``"auto"``: FlexAttention on CUDA, the fused kernels on the CPU; ``"fused"``, ``"tiles"``,
    ``"flex"``). ``rel``: Shaw et al.'s relative-position tables, or None.

    The sequence is cut into blocks of ``window`` queries (half a window from 128 up); each block attends to its
    own keys and those of the blocks before it that the window reaches (and after it when non-causal) under a
    static mask. O(N · window · D) time, O(N · window) memory, relative positions included; any N.
    """
    refuse_cross(inputs, "local attention's window")
    options = check_options("options", options, LocalOptions)
    if options.kernel != "exp":
        check_kernel_backend(options.kernel, executor)
        return kernel_attention(inputs, options.kernel, causal=causal, window=options.window, rel=rel)
    terms = check_rel(rel, inputs.q)
    out, _ = get_executor(executor, inputs.q.device).tiled(inputs, Band(options.window, causal), rel=terms)
    return out


# --- what it means: the mask from its definition (O(N²), sharing no code with the fast path) ---


def local_mask(n: int, window: int, causal: bool = True, heads: int | None = None, *, device=None) -> Tensor:
    """Causal: i - window < j <= i. Non-causal: |i - j| < window."""
    window = positive_int("window", window)
    i, j = index_grid(n, device)
    mask = ((j <= i) & (j > i - window)) if causal else ((i - j).abs() < window)
    return per_head_mask(mask, heads)


# --- the head kind: how a model uses it ---


@dataclass(frozen=True)
class LocalOptions:
    """options.local: keys per query (at most seq_len) and the kernel ('exp', 'poly2' or 'elu')."""

    window: int = 128
    kernel: str = "exp"

    def __post_init__(self) -> None:
        positive_int("window", self.window)
        check_kernel("kernel", self.kernel)


class LocalHeads(HeadGroup):
    """Decoding keeps a ring buffer of exactly the window, O(window·D)."""

    def __init__(self, heads: int, head_dim: int, options: LocalOptions) -> None:
        super().__init__(heads, head_dim)
        self.options = options

    @property
    def window(self) -> int:
        return self.options.window

    @property
    def band(self) -> int:  # type: ignore[override]
        return self.options.window

    @property
    def kernel(self) -> str:
        return self.options.kernel

    def forward(self, q, k, v, rel_pos, documents=None, key_padding_mask=None):
        return local_attention(self.inputs(q, k, v, documents, key_padding_mask), self.options, self.executor,
                               causal=self.causal, rel=rel_pos)

    def reference_mask(self, q, k):
        return local_mask(q.shape[2], self.window, device=q.device)

    def store_size(self, max_len):
        return min(self.window, max_len), True  # the ring holds exactly the window

    def extra_repr(self) -> str:
        return f"heads={self.heads}, window={self.window}, kernel={self.kernel}"


def _complete(o: LocalOptions, config: Any) -> LocalOptions:
    at_most_seq_len("window", o.window, config)
    return o


KIND = HeadKind("local", lambda o, heads, head_dim, seed: LocalHeads(heads, head_dim, o),
                keys_per_query=lambda o, n: min(o.window, n), option_type=LocalOptions, complete=_complete,
                relative_positions=exp_kernel, on_executor=exp_kernel,
                describe=lambda o: f"window={o.window}" + ("" if o.kernel == "exp" else f", kernel={o.kernel}"),
                summary="the last `window` positions", documents=True,
                encoder=lambda o, heads, head_dim, seed: non_causal(LocalHeads(heads, head_dim, o)))
