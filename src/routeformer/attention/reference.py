"""The dense reference: the definition every fast path is tested against.

It is written to be obviously right, not fast: it builds the full (B, H, N, N) score matrix, and with relative
positions the literal (N, N, D) tensors a^K_ij and a^V_ij of Shaw et al.'s two equations.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..checks import check_scale
from ..executors.inputs import Inputs, check_inputs, check_rel
from ..executors.relative import RelativePositions
from .kernels import check_kernel, kernel_scale, pairwise


def reference_weights(
    q: Tensor,
    k: Tensor,
    mask: Tensor,
    scale: float | None = None,
    *,
    key_padding_mask: Tensor | None = None,
    rel_pos: RelativePositions | None = None,
    kernel: str = "exp",
    bias: Tensor | None = None,
) -> Tensor:
    """The attention weights α_ij of ``reference_attention`` (same arguments, no values): (B, H, N, N), each row
    summing to 1 over the allowed keys, or all zeros when no key is allowed (or, for 'poly2' / 'elu', when every
    allowed key has zero weight). O(N²·D) time, O(N²) memory (O(N²·D) with ``rel_pos``: the literal tables)."""
    if kernel != "exp":  # the kernel and its scale are checked first
        kernel_scale(check_kernel("kernel", kernel), scale, q.shape[-1])
    B, H, N, D = check_inputs(q, k, k, scale, key_padding_mask, rel_pos).shape  # validation only
    allowed = _check_mask(mask, B, H, N, q)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, None, :]
    scores = reference_scores(q, k, scale, rel_pos=rel_pos, kernel=kernel, bias=bias)
    return normalise_scores(scores, allowed.expand(B, H, N, N), kernel)


def reference_scores(q: Tensor, k: Tensor, scale: float | None = None, *, rel_pos: RelativePositions | None = None,
                     kernel: str = "exp", bias: Tensor | None = None) -> Tensor:
    """What ``reference_weights`` normalises, before any mask: (B, H, N, N). For softmax the logits
    s·q_i·k_j (+ s·q_i·a^K_ij with ``rel_pos``, + ``bias``); for 'poly2' / 'elu' the kernel K(q_i, k_j) itself.
    Analysis computes them once per head group and normalises them under several masks (``normalise_scores``).
    O(N²·D) time, O(N²) memory (O(N²·D) with ``rel_pos``: the literal tables)."""
    N = q.shape[2]
    if kernel != "exp":
        if rel_pos is not None:
            raise ValueError(f"rel_pos: relative positions are defined for the exponential kernel only, not {kernel!r}")
        if bias is not None:
            raise ValueError(f"bias: an additive score term is defined for the exponential kernel only, not {kernel!r}")
        return pairwise(kernel, q, k, kernel_scale(check_kernel("kernel", kernel), scale, q.shape[-1]))
    scale = check_scale(scale, q.shape[-1])
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, H, N, N)
    if rel_pos is not None:
        pos = torch.arange(N, device=q.device)
        a_key = rel_pos.key.to(q.dtype)[rel_pos.index(pos[None, :] - pos[:, None])]  # (N, N, D): a^K only
        # Σ_d q_id a^K_ijd as one contraction: a (B, H, N, N, D) product made analysis slow (allocation)
        scores = scores + torch.einsum("bhid,ijd->bhij", q, a_key) * scale
    if bias is not None:
        scores = scores + bias
    return scores


def normalise_scores(scores: Tensor, allowed: Tensor, kernel: str = "exp") -> Tensor:
    """``reference_scores`` (B, H, N, N) made weights over the ``allowed`` keys (bool, broadcast to the scores):
    each row sums to 1 over them, or is all zeros when none is allowed (for 'poly2' / 'elu' also when every allowed
    key has zero weight). O(N²)."""
    if kernel != "exp":
        weights = scores.masked_fill(~allowed, 0.0)
        total = weights.sum(-1, keepdim=True)
        return weights / torch.where(total > 0, total, 1.0)
    has_key = allowed.any(-1, keepdim=True)  # (B, H, N, 1)
    # A row with no allowed key would be softmax(-inf, ..., -inf) = NaN; give it finite scores and zero it after.
    scores = scores.masked_fill(~allowed & has_key, float("-inf")).masked_fill(~has_key, 0.0)
    return scores.softmax(-1) * has_key


def reference_attention(
    inputs: Inputs,
    mask: Tensor,
    *,
    rel: RelativePositions | None = None,
    kernel: str = "exp",
    bias: Tensor | None = None,
) -> Tensor:
    """Dense masked attention: softmax, or with ``kernel`` 'poly2' / 'elu' the generalised form
    o_i = Σ_j K(q_i, k_j) v_j / Σ_j K(q_i, k_j) over the allowed j (``kernels.py``; no ``rel``, no scale for elu).

    Args:
        inputs: ``Inputs.of(q, k, v, scale=..., key_padding_mask=...)``: q, k, v (B, H, N, D); the scale (None:
            1/sqrt(D)); a (B, N) key padding mask, True = a real key, False removes key j from every query.
        mask: bool, (N, N), (H, N, N) or (B, H, N, N); ``mask[..., i, j]`` True means query i may attend to key j.
        rel: optional relative position tables; adds q_i·a^K_ij to the scores and Σ_j α_ij a^V_ij to
            the outputs, with a^K_ij, a^V_ij materialised as (N, N, D) tensors.
        bias: optional additive score term broadcastable to (B, H, N, N) (exponential kernel only).

    Returns:
        (B, H, N, D). A query row with no allowed key outputs zeros. Computes in the dtype of q (float64 in,
        float64 throughout). O(N²·D) time and memory (O(N²·D) extra with ``rel``). The weights alone are
        ``reference_weights``.
    """
    q, k, v = inputs.q, inputs.k, inputs.v
    check_rel(rel, q)
    valid = inputs.key_valid
    if valid is not None and valid.shape[1] != 1:
        raise ValueError(f"reference_attention takes one key validity per batch row (B, 1, N), as Inputs.of makes "
                         f"it, got {tuple(valid.shape)}")
    padding = None if valid is None else valid[:, 0]  # (B, N)
    probs = reference_weights(q, k, mask, inputs.chosen_scale, key_padding_mask=padding,
                              rel_pos=rel, kernel=kernel, bias=bias)
    out = probs @ v  # (B, H, N, D)
    if rel is not None:
        _, a_value = _literal_tables(rel, q.shape[2], q)
        out = out + torch.einsum("bhij,ijd->bhid", probs, a_value)  # Σ_j α_ij a^V_ijd
    return out


def _check_mask(mask: Tensor, B: int, H: int, N: int, q: Tensor) -> Tensor:
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor (True = may attend), got {getattr(mask, 'dtype', mask)!r}")
    shapes = {2: (N, N), 3: (H, N, N), 4: (B, H, N, N)}
    if mask.dim() not in shapes or tuple(mask.shape) != shapes[mask.dim()]:
        raise ValueError(
            f"mask must have shape (N, N), (H, N, N) or (B, H, N, N) with B={B}, H={H}, N={N}, "
            f"got {tuple(mask.shape)}"
        )
    if mask.device != q.device:
        raise ValueError(f"mask is on {mask.device} but q is on {q.device}")
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask


def reference_cross_attention(inputs: Inputs, mask: Tensor | None = None, kernel: str = "exp") -> Tensor:
    """Dense cross-attention, the definition its fast paths are tested against: queries q (B, H, Nq, D) over a
    memory k, v (B, H, Nk, D) (``Inputs.cross``), each query over the keys ``mask`` allows ((B, H, Nq, Nk) bool or
    broadcastable; None: every key) that are real (the memory's padding) and of the query's own document (packed
    ``cross_documents``, numbered alike on both sides): softmax of s·q·k, or the kernel K(q, k) normalised for
    'poly2' / 'elu'. A query with no allowed key gives zeros. O(Nq·Nk·D) time, O(Nq·Nk) memory."""
    q, k, v = inputs.q, inputs.k, inputs.v
    B, H, Nq, _ = q.shape
    allowed = torch.ones(B, H, Nq, k.shape[2], dtype=torch.bool, device=q.device)
    if mask is not None:
        allowed = allowed & mask
    if inputs.cross_documents is not None:
        queries, memory = inputs.cross_documents
        allowed = allowed & (queries[:, None, :, None] == memory[:, None, None, :])
    if inputs.key_valid is not None:
        allowed = allowed & inputs.key_valid[:, :, None, :]
    if kernel == "exp":
        scores = (q @ k.transpose(-1, -2)) * inputs.scale
    else:
        scores = pairwise(kernel, q, k, kernel_scale(check_kernel("kernel", kernel), inputs.chosen_scale, q.shape[-1]))
    return normalise_scores(scores, allowed, kernel) @ v


def _literal_tables(rel_pos: RelativePositions, n: int, q: Tensor) -> tuple[Tensor, Tensor]:
    """a^K_ij and a^V_ij as (N, N, D) tensors, exactly as in the paper's equations."""
    pos = torch.arange(n, device=q.device)
    return rel_pos.tables(pos[None, :] - pos[:, None], q.dtype)  # rows of clip(j - i, k)
