"""Block selection (MoBA's mean key, Quest's bound) as one fused CPU kernel where the kernels are built (float32
and float64 on the CPU), else ``None`` and the caller takes PyTorch's operators (``attention.blocks``): the same
picks, the scores summed in another order (a near-tie may fall the other way)."""

from __future__ import annotations

import torch
from torch import Tensor

from . import op


def fused_select_blocks(q: Tensor, k: Tensor, block: int, top: int, bound: bool,
                        documents: Tensor | None = None) -> Tensor | None:
    """Every query's ``top`` best complete blocks before its own block, best first, -1 where it has fewer: q, k
    (B, H, N, D) -> (B, H, N, top) long, the blocks scored by the bound (``bound``) or q · the mean key. O(N · N /
    block · D / 2) per head, no (N, N / block) tensor. ``documents`` (B, N) ids that never decrease along a row: a
    query chooses among its document's blocks, the partial first one summarised from its document's keys
    (``blocks.BlockDocuments``). ``None`` where k is not q's dtype or device; reached through ``Executor.runner(q)``,
    which decided that the kernels take q."""
    if k.dtype != q.dtype or k.device != q.device:
        return None
    ids = None if documents is None else documents.to(q.device, torch.long).contiguous()
    with torch.no_grad():
        chosen = op.ops().select_blocks(q, k, block, top, bound, ids)  # (B, H, N, min(top, N // block))
    missing = top - chosen.shape[-1]
    return chosen if missing == 0 else torch.cat([chosen, chosen.new_full((*chosen.shape[:3], missing), -1)], -1)
