"""What each pattern means: the boolean mask (True = query i may attend to key j) written from its definition.

These are deliberately naive O(N²) comparisons of index grids, sharing no code with the fast executors: the
tests hold each executor to ``reference_attention(q, k, v, <pattern>_mask(...))``. Figures and analysis use them
too. Each returns (N, N), or (H, N, N) when the pattern differs between heads (or ``heads`` is given).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .checks import check_per_head, check_positions, check_split_heads, positive_int


def _grid(n: int, device: torch.device | str | None) -> tuple[Tensor, Tensor]:
    n = positive_int("n", n)
    idx = torch.arange(n, device=device)
    return idx[:, None], idx[None, :]  # i (query) down, j (key) across


def _per_head(mask: Tensor, heads: int | None) -> Tensor:
    if heads is None:
        return mask
    return mask.expand(positive_int("heads", heads), *mask.shape[-2:]).clone()


def _split(first: Tensor, second: Tensor, merged: bool, heads: int | None) -> Tensor:
    first, second = torch.broadcast_tensors(first, second)
    if merged:
        return _per_head(first | second, heads)
    if heads is None:
        raise ValueError("merged=False gives different heads different patterns: pass heads=")
    half = check_split_heads(positive_int("heads", heads))
    return torch.stack([first] * half + [second] * half)


def full_mask(n: int, causal: bool = True, heads: int | None = None, *, device=None) -> Tensor:
    """Every key (j <= i when causal)."""
    i, j = _grid(n, device)
    return _per_head((j <= i) if causal else torch.ones(i.shape[0], j.shape[1], dtype=torch.bool, device=device),
                     heads)


def local_mask(n: int, window: int, causal: bool = True, heads: int | None = None, *, device=None) -> Tensor:
    """Causal: i - window < j <= i. Non-causal: |i - j| < window."""
    window = positive_int("window", window)
    i, j = _grid(n, device)
    mask = ((j <= i) & (j > i - window)) if causal else ((i - j).abs() < window)
    return _per_head(mask, heads)


def strided_mask(
    n: int, stride: int, causal: bool = True, merged: bool = True, heads: int | None = None, *, device=None
) -> Tensor:
    """Sparse Transformer strided pattern, l = stride.

    Causal: A1(i) = {j : max(0, i - l) <= j <= i}, A2(i) = {j <= i : (i - j) mod l = 0}.
    Non-causal: A1(i) = {j : |i - j| <= l}, A2(i) = {j : (i - j) mod l = 0}.
    ``merged``: every head sees A1 ∪ A2; otherwise the first half of the heads A1, the second half A2.
    """
    l = positive_int("stride", stride)
    i, j = _grid(n, device)
    if causal:
        a1 = (j <= i) & (j >= i - l)
        a2 = (j <= i) & ((i - j) % l == 0)
    else:
        a1 = (i - j).abs() <= l
        a2 = (i - j) % l == 0
    return _split(a1, a2, merged, heads)


def fixed_mask(
    n: int,
    block: int,
    summary: int,
    causal: bool = True,
    merged: bool = True,
    heads: int | None = None,
    *,
    device=None,
) -> Tensor:
    """Sparse Transformer fixed pattern, l = block, c = summary.

    A1(i) = {j : floor(j / l) = floor(i / l)}, A2(i) = {j : j mod l >= l - c}, both intersected with j <= i when
    causal. ``merged`` as in ``strided_mask``.
    """
    l, c = positive_int("block", block), positive_int("summary", summary)
    if c > l:
        raise ValueError(f"summary must be at most block, got summary={c} > block={l}")
    i, j = _grid(n, device)
    a1 = (j // l) == (i // l)
    a2 = (j % l) >= (l - c)
    if causal:
        a1, a2 = a1 & (j <= i), a2 & (j <= i)
    return _split(a1, a2, merged, heads)


def longformer_mask(
    n: int,
    window: int,
    dilation: int | Sequence[int] | Tensor = 1,
    global_tokens: Sequence[int] | Tensor | None = None,
    causal: bool = False,
    heads: int | None = None,
    *,
    device=None,
) -> Tensor:
    """Longformer: dilated sliding window plus symmetric global tokens.

    Query i sees j = i + m · dilation for |m| < window (m <= 0 when causal); a global position g sees every j
    (j <= g when causal) and is seen by every i (i >= g when causal). With one dilation per head the mask is
    (H, N, N).
    """
    window = positive_int("window", window)
    per_head = isinstance(dilation, (list, tuple, Tensor)) or heads is not None
    if per_head:
        n_heads = heads if heads is not None else len(dilation)  # type: ignore[arg-type]
        dilations = check_per_head("dilation", dilation, positive_int("heads", n_heads))
    else:
        dilations = [positive_int("dilation", dilation)]
    globals_ = check_positions("global_tokens", global_tokens, positive_int("n", n))
    i, j = _grid(n, device)
    is_global = torch.zeros(n, dtype=torch.bool, device=device)
    is_global[globals_] = True
    diff = j - i
    glob = is_global[:, None] | is_global[None, :]
    if causal:
        glob = glob & (j <= i)
    masks = []
    for d in dilations:
        m = torch.div(diff, d, rounding_mode="floor")
        band = (diff % d == 0) & ((m <= 0) & (m > -window) if causal else (m.abs() < window))
        masks.append(band | glob)
    return torch.stack(masks) if per_head else masks[0]
