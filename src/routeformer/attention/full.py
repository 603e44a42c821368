"""Full (dense) attention: the O(N²) baseline every sparse pattern is measured against.

This module is the mechanism's one home: its functional form, its mask (what it means, for the tests), its head kind
and options, registered in ``registry.py``.

Heads. Full heads: every earlier key, the O(N²·D) baseline, under the model's kernel (``TransformerConfig.kernel``:
softmax, or the poly2 / elu kernels of ``attention/kernels.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import check_options
from ..executors import Backend, get_executor, merge_partials, saw_key
from ..executors.inputs import Inputs, check_rel, refuse_cross
from ..executors.pieces import Band, BlockDiagonal
from ..executors.ranges import document_ranges
from ..executors.relative import RelativePositions
from ..executors.tiling import Tiling
from .kernels import check_kernel, check_kernel_backend, kernel_attention
from .kinds.base import HeadGroup, HeadKind, non_causal
from .kinds.common import exp_kernel
from .masks import index_grid, per_head_mask


def full_attention(
    inputs: Inputs,
    options: KernelOptions | None = None,
    executor: Backend = "auto",
    *,
    causal: bool = True,
    rel: RelativePositions | None = None,
) -> Tensor:
    """Dense softmax attention over every key (j <= i when causal).

    ``inputs``: ``Inputs.of(q, k, v, scale=..., key_padding_mask=...)``, q, k, v (B, H, N, D) -> (B, H, N, D);
    or cross-attention's ``Inputs.cross(q, k, v, ...)``, q (B, H, Nq, D) over a memory (B, H, Nk, D), with
    ``causal=False`` and no ``rel`` (positions of two sequences are not comparable).
    ``options.kernel`` (default ``KernelOptions()``, 'exp'): 'exp' (softmax, below), or 'poly2' / 'elu', which
    normalise those kernels instead (``kernels.kernel_attention``: O(N²·D) in blocks; no relative positions; elu
    takes no scale). ``executor``: a name or an ``Executor`` (``"auto"``: FlexAttention on CUDA, the fused kernels
    on the CPU; ``"fused"``, ``"tiles"``, ``"flex"``). ``rel``: relative-position tables, or None.

    Runs through ``scaled_dot_product_attention`` (fused kernels where the backend has them). With ``rel`` the
    scores are explicit, O(N²) memory: keys farther than the clipping distance k all share the table rows of
    distance ±k, so attention splits exactly into a band of |i - j| <= k (the relative terms computed on the band)
    and the far keys, whose relative terms are one constant per query on the scores and one vector on the outputs;
    the two merge through their log-sum-exp. O(N²·D) time.
    """
    options = KernelOptions() if options is None else check_options("options", options, KernelOptions)
    if inputs.is_cross and (causal or rel is not None or options.kernel != "exp"):
        refuse_cross(inputs, "causal=True" if causal else "relative positions" if rel is not None else
                     f"full attention's {options.kernel} kernel (linear attention takes it across two sequences)")
    if inputs.cross_documents is not None:  # each query over its own document's run of the memory
        docs = inputs.cross_documents
        return get_executor(executor, inputs.q.device).ranges(inputs, document_ranges(docs.queries, docs.memory))[0]
    if options.kernel != "exp":
        check_kernel_backend(options.kernel, executor)
        return kernel_attention(inputs, options.kernel, causal=causal, rel=rel)
    terms = check_rel(rel, inputs.q)
    q, k, v = inputs.q, inputs.k, inputs.v
    B, H, N, D = inputs.shape
    scale, key_valid = inputs.scale, inputs.key_valid
    executor = get_executor(executor, q.device)
    if rel is not None:
        if rel.max_distance + 1 < N:
            # clipped at k < N - 1: the band |i - j| <= k with the relative terms, and the far keys (j < i - k, and
            # j > i + k when non-causal) with the constant terms of distance ∓k
            clip = rel.max_distance
            parts = [executor.tiled(inputs, Band(clip + 1, causal), rel=terms, need_lse=True)]
            # the far keys of one dense tile, as key - query offsets: no (N, N) mask for an executor that reads them
            sides = [(-1, (-(N - 1), -clip - 1))] + ([] if causal else [(1, (clip + 1, N - 1))])
            for sign, offsets in sides:
                out, lse = executor.tiled(inputs, Tiling(block=N, offsets=offsets), need_lse=True)
                a_key, a_value = rel.tables(sign * clip, q.dtype)  # (D,) each: the table's first or last row
                shift = (q @ a_key) * scale  # (B, H, N): q_i · a^K of every far key, one constant per query
                has_key = saw_key(lse)  # rows without a far key have lse = neg_inf exactly, whatever q's dtype
                out = out + a_value * has_key[..., None]  # Σ_j α_ij a^V over far keys = a^V (weights sum to 1)
                parts.append((out, torch.where(has_key, lse + shift.to(lse.dtype), lse)))  # empty rows: neg_inf
            return merge_partials(parts)[0]
        return executor.tiled(inputs, BlockDiagonal(N, causal), rel=terms)[0]
    if inputs.documents is not None:  # packed documents: one tile of key groups, no (B, N, N) mask in PyTorch
        return executor.tiled(inputs, BlockDiagonal(N, causal))[0]
    if key_valid is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    allow = key_valid[:, :, None, :]  # (B, 1, 1, N)
    if causal:
        allow = allow & torch.ones(N, N, dtype=torch.bool, device=q.device).tril()
    has_key = allow.any(-1, keepdim=True)  # (B, 1, N, 1)
    # SDPA may return NaN for a row with no key on some backends: give such rows key 0, then zero them.
    first = torch.arange(k.shape[2], device=q.device) == 0
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allow | (~has_key & first), scale=scale)
    return out.masked_fill(~has_key, 0.0)


# --- what it means: the mask from its definition (O(N²), sharing no code with the fast path) ---


def full_mask(n: int, causal: bool = True, heads: int | None = None, *, device=None) -> Tensor:
    """Every key (j <= i when causal)."""
    i, j = index_grid(n, device)
    return per_head_mask((j <= i) if causal else torch.ones(i.shape[0], j.shape[1], dtype=torch.bool, device=device),
                     heads)


# --- the head kind: how a model uses it ---


@dataclass(frozen=True)
class KernelOptions:
    """options.full (and options.local's kernel): the similarity normalised, 'exp' (softmax), 'poly2' or 'elu'."""

    kernel: str = "exp"

    def __post_init__(self) -> None:
        check_kernel("kernel", self.kernel)


class FullHeads(HeadGroup):
    """Decoding keeps every position; a step reads the filled part, O(t·D)."""

    def __init__(self, heads: int, head_dim: int, options: KernelOptions) -> None:
        super().__init__(heads, head_dim)
        self.options = options

    @property
    def kernel(self) -> str:
        return self.options.kernel

    def forward(self, q, k, v, rel_pos, documents=None, key_padding_mask=None):
        return full_attention(self.inputs(q, k, v, documents, key_padding_mask), self.options, self.executor,
                              causal=self.causal, rel=rel_pos)

    def reference_mask(self, q, k):
        return full_mask(q.shape[2], device=q.device)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, kernel={self.kernel}"


def describe_kernel(options: KernelOptions) -> str:
    return "-" if options.kernel == "exp" else f"kernel={options.kernel}"


KIND = HeadKind("full", lambda o, heads, head_dim, seed: FullHeads(heads, head_dim, o),
                keys_per_query=lambda options, n: (n + 1) / 2, option_type=KernelOptions,
                relative_positions=exp_kernel, on_executor=exp_kernel, describe=describe_kernel,
                summary="every earlier key", documents=True,
                encoder=lambda o, heads, head_dim, seed: non_causal(FullHeads(heads, head_dim, o)))
