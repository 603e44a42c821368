"""The tiled executor: blocked PyTorch attention that runs everywhere (CPU training, GPU fallback).

- ``frontends.py``: ``tiled_attention``, the executor's one operation (a ``tiling.Tiling`` of query blocks against
  spans of key blocks).
- ``op.py``: the fused ``routeformer::tile_attention`` custom operator and its backward.
- ``layout.py``: the key layout: key rows, overlapping span views, per-key spans for masks, padding.
- ``rel_terms.py``: the relative-position terms of tilings the fused op's strip form does not cover (``TileRelTerms``).
"""

from .frontends import tiled_attention

__all__ = ["tiled_attention"]
