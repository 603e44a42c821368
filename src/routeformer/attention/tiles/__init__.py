"""The tiled executor: blocked PyTorch attention that runs everywhere (CPU training, GPU fallback).

- ``frontends.py``: ``tiled_attention``, the executor's one operation (a ``tiling.Tiling`` of query blocks against
  spans of key blocks), and ``merge_partials``.
- ``op.py``: the fused ``routeformer::tile_attention`` custom operator and its backward; the lse conventions
  (``neg_inf``, ``saw_key``).
- ``layout.py``: the key layout: key rows, overlapping span views, per-key spans for masks, padding.
- ``relative.py``: the relative-position terms of tilings the fused op's strip form does not cover.
"""

from .frontends import merge_partials, tiled_attention
from .op import _tile_attention, lse_dtype, neg_inf, saw_key

__all__ = [
    "lse_dtype",
    "_tile_attention",
    "merge_partials",
    "neg_inf",
    "saw_key",
    "tiled_attention",
]
