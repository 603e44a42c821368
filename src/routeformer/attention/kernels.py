"""Attention kernels other than the exponential one (Gupta and Berant's value-aware study; Katharopoulos et al.).

Generalised attention normalises a non-negative similarity K over the keys a query sees:
``o_i = Σ_j K(q_i, k_j) v_j / Σ_j K(q_i, k_j)``. ``exp`` (K = exp(s·q·k), softmax) is what every other module
computes; this one adds

- ``poly2``: K = (1 + s·q·k)², s the scale (1/√D by default). Chosen over (s·q·k)² because that one cannot tell q
  from -q (its weights are blind to the sign of the match); (1 + x)² is non-negative, equals 1 at x = 0 like
  exp, and grows with x on the side that matters (x > -1). Its explicit feature map has 1 + D + D(D+1)/2
  entries: φ(x) = [1, √2·x', x'_a·x'_b·(√2 if a < b else 1) for a ≤ b] with x' = √s·x, so φ(q)·φ(k) = (1 + s·q·k)².
- ``elu``: K = φ(q)·φ(k) with φ(x) = elu(x) + 1 (positive, D features). It has no scale (the Linear
  Transformer's form), so ``scale`` must be left at None.

``kernel_attention`` is the exact quadratic form (the full and local heads of a model trained with that kernel);
``linear.py`` computes the same full causal attention in linear time through the feature maps.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import check_scale, positive_int
from ..executors import check_backend
from ..executors.inputs import Inputs

KERNELS = ("exp", "poly2", "elu")
FEATURE_KERNELS = ("poly2", "elu")  # the kernels with a finite feature map


def check_kernel(name: str, kernel: object, allowed: tuple[str, ...] = KERNELS) -> str:
    """``kernel`` if it is one of ``allowed``, else a ValueError naming the argument ``name``."""
    if kernel not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {kernel!r}")
    return kernel  # type: ignore[return-value]


def check_kernel_backend(kernel: str, executor) -> None:
    """The poly2 and elu kernels have one implementation (blocked PyTorch, what the tiles executor and the fused one,
    which hands it what its kernels do not run, stand for): ``executor`` (a name or an executor) must be "auto",
    "tiles" or "fused"; "flex" is refused rather than ignored (FlexAttention normalises with exp)."""
    name = getattr(check_backend(executor), "name", executor)
    if name not in ("auto", "tiles", "fused"):
        raise ValueError(f"executor={executor!r} has no path for kernel={kernel!r}: the poly2 and elu kernels run as "
                         f"blocked PyTorch only; use executor='auto' or 'tiles'")


def kernel_scale(kernel: str, scale: float | None, head_dim: int) -> float:
    """The scale s a kernel uses: poly2 takes one (default 1/√D); elu has none, so a given scale is an error."""
    if kernel == "elu":
        if scale is not None:
            raise ValueError("scale: the elu kernel φ(q)·φ(k) has no scale; leave scale=None")
        return 1.0
    return check_scale(scale, head_dim)


def pairwise(kernel: str, q: Tensor, k: Tensor, scale: float) -> Tensor:
    """K(q_i, k_j) for every pair: q (..., N, D), k (..., M, D) -> (..., N, M), non-negative. O(N·M·D)."""
    if kernel == "poly2":
        return (1.0 + (q @ k.transpose(-1, -2)) * scale).square()
    if kernel == "elu":
        return (F.elu(q) + 1.0) @ (F.elu(k) + 1.0).transpose(-1, -2)
    raise ValueError(f"pairwise: kernel must be 'poly2' or 'elu' (exp is softmax attention), got {kernel!r}")


def feature_dim(kernel: str, head_dim: int) -> int:
    """F, the length of the kernel's feature map for heads of size D."""
    if kernel == "poly2":
        return 1 + head_dim + head_dim * (head_dim + 1) // 2
    if kernel == "elu":
        return head_dim
    raise ValueError(f"kernel {kernel!r} has no finite feature map; use 'poly2' or 'elu'")


def feature_map(kernel: str, x: Tensor, scale: float) -> Tensor:
    """φ(x): (..., D) -> (..., F) with φ(q)·φ(k) = K(q, k) (module docstring)."""
    if kernel == "elu":
        return F.elu(x) + 1.0
    if kernel != "poly2":
        raise ValueError(f"kernel {kernel!r} has no finite feature map; use 'poly2' or 'elu'")
    D = x.shape[-1]
    x = x * math.sqrt(scale)
    rows, cols = torch.triu_indices(D, D, device=x.device)  # a <= b, D(D+1)/2 pairs
    root2 = torch.full((), math.sqrt(2.0), dtype=x.dtype, device=x.device)
    weight = torch.where(rows == cols, torch.ones_like(root2), root2)
    second = x[..., rows] * x[..., cols] * weight  # (..., D(D+1)/2)
    return torch.cat([torch.ones_like(x[..., :1]), math.sqrt(2.0) * x, second], -1)


def kernel_attention(
    inputs: Inputs,
    kernel: str,
    *,
    causal: bool = True,
    window: int | None = None,
    rel: object | None = None,
    block: int = 256,
) -> Tensor:
    """Exact attention under ``kernel`` ('poly2' or 'elu'): o_i = Σ_j K(q_i, k_j) v_j / Σ_j K(q_i, k_j).

    ``inputs``: ``Inputs.of(q, k, v, ...)``, q, k, v (B, H, N, D) -> (B, H, N, D); elu takes no scale (an
    ``Inputs.of(..., scale=s)`` is refused). Keys j of query i: j <= i when causal (all when not); with ``window``,
    only i - window < j (and |i - j| < window when non-causal), as ``local_attention``; with packed
    ``inputs.documents``, only keys of i's document. Rows with no key (every key padded) or a zero sum output zeros. Computed in blocks of ``block`` queries, in float32 for half inputs:
    O(N²·D) time (O(N·(window + block)·D) with a window), O(block·N) extra memory.
    """
    q, k, v = inputs.q, inputs.k, inputs.v
    B, H, N, D = inputs.shape
    key_valid = inputs.key_valid
    check_kernel("kernel", kernel, FEATURE_KERNELS)
    if rel is not None:
        raise ValueError(f"rel: relative positions are defined for the exponential kernel only, not {kernel!r}")
    s = kernel_scale(kernel, inputs.chosen_scale, D)
    block = positive_int("block", block)
    if window is not None:
        window = positive_int("window", window)
    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):  # (1 + x)² and sums of N of them overflow half precision
        q, k, v = q.float(), k.float(), v.float()
    idx = torch.arange(N, device=q.device)
    outs = []
    for start in range(0, N, block):
        end = min(start + block, N)
        lo = 0 if window is None else max(0, start - window + 1)
        hi = end if causal else (N if window is None else min(N, end + window - 1))
        i, j = idx[start:end, None], idx[None, lo:hi]
        allow = (j <= i) if causal else torch.ones(end - start, hi - lo, dtype=torch.bool, device=q.device)
        if window is not None:
            allow = allow & ((i - j).abs() < window)
        if key_valid is not None:
            allow = allow & key_valid[:, :, None, lo:hi]  # (B, 1, c, m)
        if inputs.documents is not None:  # packed documents: the query's own only
            docs = inputs.documents
            allow = allow & (docs[:, start:end, None] == docs[:, None, lo:hi])[:, None]
        weights = pairwise(kernel, q[:, :, start:end], k[:, :, lo:hi], s).masked_fill(~allow, 0.0)
        total = weights.sum(-1, keepdim=True)  # (B, H, c, 1)
        # a row without weight outputs zeros; the where keeps its gradient finite
        outs.append((weights @ v[:, :, lo:hi]) / torch.where(total > 0, total, 1.0))
    return torch.cat(outs, 2).to(dtype)


def attend_cached_kernel(q: Tensor, keys: Tensor, values: Tensor, kernel: str, scale: float,
                         allowed: Tensor | None = None) -> Tensor:
    """One decoding step under ``kernel``: q (B, H, D) against cached keys/values (B, H, M, D), ``allowed`` an
    optional bool mask broadcastable to (B, H, M) -> (B, H, D); zeros when no key has weight. O(M·D) per head."""
    weights = pairwise(kernel, q[:, :, None].to(keys.dtype), keys, scale)[:, :, 0]  # (B, H, M)
    if allowed is not None:
        weights = weights.masked_fill(~allowed, 0.0)
    total = weights.sum(-1, keepdim=True)
    out = (weights[..., None, :] @ values)[:, :, 0] / torch.where(total > 0, total, 1.0)
    return out.to(q.dtype)
