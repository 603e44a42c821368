"""Sizes derived from the sequence length that several layers share, each written once."""

from __future__ import annotations

import math


def sqrt_len(n: int) -> int:
    """round(√n), at least 1: the O(N^1.5) choice, n / sqrt_len(n) ≈ sqrt_len(n) (routing's clusters, the strided
    pattern's step, LSH's buckets, the factorized positions' grid width, the attention benchmark's settings)."""
    return max(1, round(math.sqrt(n)))
