"""The flex executor: every pattern as FlexAttention calls (one fused kernel per piece on CUDA).

- ``pattern.py``: a pattern as an exact rule (``mask_mod``), the key range of each query block, relative distances.
- ``blocks.py``: ``BlockMask`` from that range (O(N · reach), cached for static patterns).
- ``call.py``: one FlexAttention call in the executors' lse conventions (compiled on CUDA, the dense eager operator
  on CPU, where FlexAttention has no backward: correctness only).
- ``score_terms.py``: the score terms besides q·k (``ScoreTerms``): Shaw's key term as ``score_mod``; the value
  term from the log-sum-exp in a banded pass.
- ``ranges.py``: ``ranges`` (multi-probe routing): every (query, range) entry one row of one call, the block mask
  from the ranges on the device, shapes fixed by N.
- ``ops.py``: ``tiled``, the executor's one operation, with the tiled executor's signature (``tiling.Tiling``).
- ``router.py``, ``selection.py`` (their Triton kernels in ``kernels.py``): the causal router and MoBA's
  block selection on CUDA, one custom operator each, no (N, k) or (N, N / block) scores.
- ``windows.py``: the sorted window (routing's paper rule) from one key interval per query: block tables a few
  key blocks wide, built by a fixed number of operations.
"""

from .ops import tiled
from .ranges import flex_ranges
from .router import flex_route
from .selection import flex_select_blocks
from .windows import sorted_window

__all__ = ["flex_ranges", "flex_route", "flex_select_blocks", "sorted_window", "tiled"]
