"""Executors: how attention over a pattern of key blocks is computed, apart from what the pattern means.

The mechanisms (``routeformer.attention``) say which keys each query sees; an executor computes it without an N×N
matrix. This package is the lower layer: it imports nothing from the mechanisms.

- ``base.py``: ``Executor`` (one operation, ``tiled``, over a piece; ``ranges`` built on it), the ``FEATURES`` an
  executor declares, the registry ``EXECUTORS``; ``interface.py``: the backends registered, names resolved
  (``get_executor``); ``pieces.py``: the pieces ``tiled`` takes besides a ``Tiling`` (band, block diagonal, key
  subset, grid columns).
- ``inputs.py``: the checked inputs value; ``relative.py``: the relative-position tables.
- ``tiling.py``: the values that describe a call (``Tiling``, ``KeyRestrictions``, ``Distances``).
- ``lse.py``: the log-sum-exp conventions and ``merge_partials``.
- ``ranges.py``: per-query key ranges as tiles of ``tiled``; ``lowering.py``: sequence orders and labels as tile
  masks for executors that do not read them natively; ``rows.py``: row gathers and row dot products.
- ``activation.py``: the Sparse Transformer's GELU (fused where the kernels are built).
- the backends: ``fused/`` (C++ CPU kernels, compiled at first use), ``tiles/`` (blocked PyTorch, everywhere),
  ``flex/`` (FlexAttention, for CUDA).
"""

from .activation import sigmoid_gelu
from .inputs import Inputs, check_inputs
from .interface import (
    EXECUTORS,
    FEATURES,
    Backend,
    Executor,
    check_backend,
    describe_backend,
    get_executor,
    register_executor,
    resolve_backend,
)
from .lse import lse_dtype, merge_partials, neg_inf, saw_key
from .pieces import Band, BlockDiagonal, Columns, SortedWindow, Subset
from .relative import RelativePositions
from .tiling import INDEX, Distances, KeyRestrictions, Tiling, Window

__all__ = [
    "Band",
    "BlockDiagonal",
    "Columns",
    "EXECUTORS",
    "FEATURES",
    "INDEX",
    "Backend",
    "Distances",
    "Executor",
    "Inputs",
    "KeyRestrictions",
    "RelativePositions",
    "SortedWindow",
    "Subset",
    "Tiling",
    "Window",
    "check_backend",
    "check_inputs",
    "describe_backend",
    "get_executor",
    "lse_dtype",
    "merge_partials",
    "neg_inf",
    "register_executor",
    "resolve_backend",
    "saw_key",
    "sigmoid_gelu",
]
