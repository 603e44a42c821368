"""The tiled executor: blocked PyTorch attention that runs everywhere (CPU training, GPU fallback).

- ``frontends.py``: what callers use: ``tiled_attention`` and its sliding-window shape ``band_attention`` (the
  block diagonal and key subsets every executor derives from its ``tiled``: ``executors.Executor``),
  ``merge_partials``, ``shift_invariant_mask``, ``band_tiling``.
- ``op.py``: the fused ``routeformer::tile_attention`` custom operator and its backward; the lse conventions
  (``neg_inf``, ``saw_key``).
- ``layout.py``: the key layout: key rows, overlapping span views, per-key spans for masks, padding.
- ``relative.py``: the relative-position terms of tilings the fused op's strip form does not cover.
"""

from .frontends import (
    KeyRestrictions,
    band_attention,
    band_tiling,
    merge_partials,
    shift_invariant_mask,
    tiled_attention,
)
from .op import _tile_attention, lse_dtype, neg_inf, saw_key

__all__ = [
    "KeyRestrictions",
    "lse_dtype",
    "_tile_attention",
    "band_attention",
    "band_tiling",
    "merge_partials",
    "neg_inf",
    "saw_key",
    "shift_invariant_mask",
    "tiled_attention",
]
