"""The flex executor's block selection (CUDA): MoBA's choice of each query's best earlier blocks in a
Triton kernel (``kernels.select``) behind one custom operator, ``routeformer_flex::select_blocks``, with the fused
CPU kernel's contract (``fused.selection.fused_select_blocks``) and no (B, H, N, N / block) scores tensor.

A block's score is a product of two vectors: MoBA's q · the block's mean key, and Quest's bound Σ_d max(q_d · lo_d,
q_d · hi_d) = [q⁺, q] · [hi - lo, lo] (``attention.blocks.block_scores``), so the summaries are made here with
PyTorch's operators (O(N · D)) and the kernel takes the best ``top`` products per query. Time O(N · N / block · D /
2) per head, memory O(N · top).
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK_N = 64  # queries per program
BLOCK_K = 32  # blocks scored at once


def flex_select_blocks(q: Tensor, k: Tensor, block: int, top: int, bound: bool,
                       documents: Tensor | None = None) -> Tensor | None:
    """Every query's ``top`` best complete blocks before its own, best first, -1 where it has fewer: q, k
    (B, H, N, D) -> (B, H, N, top) long, scored in float32 by the bound (``bound``) or q · the mean key
    (``Executor.select_run``). On CUDA (and ``meta``, shapes only) without packed ``documents``; else None (the
    caller's PyTorch operators, which take documents)."""
    if q.device.type not in ("cuda", "meta") or documents is not None:
        return None
    B, H, N, D = k.shape
    nb = N // block
    with torch.no_grad():
        keys = k[:, :, : nb * block].float().view(B, H, nb, block, D)
        qf = q.float()
        if bound:
            lo, hi = keys.amin(3), keys.amax(3)
            scoring, summary = torch.cat([qf.clamp(min=0), qf], -1), torch.cat([hi - lo, lo], -1)
        else:
            scoring, summary = qf, keys.mean(3)
        return torch.ops.routeformer_flex.select_blocks(scoring.contiguous(), summary.contiguous(), block, top)


def launch(scoring: Tensor, summary: Tensor, block: int, top: int) -> Tensor:
    """The operator's body (on CUDA; on CPU tensors under ``TRITON_INTERPRET=1``, for the tests): scoring
    (B, H, N, D') and summary (B, H, nb, D') float32 contiguous -> (B, H, N, top) long."""
    from . import kernels

    B, H, N, D = scoring.shape
    nb = summary.shape[2]
    chosen = torch.empty(B, H, N, top, dtype=torch.long, device=scoring.device)
    kernels.select[(-(-N // BLOCK_N), B * H)](scoring, summary, chosen, N, nb, D, block, TOP=top,
                                              TOP_PAD=kernels.next_pow2(top), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                              BLOCK_D=kernels.block_dim(D))
    return chosen


@torch.library.custom_op("routeformer_flex::select_blocks", mutates_args=(), device_types="cuda")
def _select_blocks(scoring: Tensor, summary: Tensor, block: int, top: int) -> Tensor:
    return launch(scoring, summary, block, top)


@_select_blocks.register_fake
def _(scoring, summary, block, top):
    B, H, N, _ = scoring.shape
    return scoring.new_empty(B, H, N, top, dtype=torch.long)


__all__ = ["flex_select_blocks", "launch"]
