"""Patterns as FlexAttention needs them: an exact rule ``allowed(b, h, i, j)`` (FlexAttention's ``mask_mod``), the
range of keys each block of queries may reach (to build the ``BlockMask`` without evaluating all Nq · Nk pairs),
and the relative distance of a pair.

Every rule is written with tensor operations that broadcast, so the same function is FlexAttention's ``mask_mod``
(scalar indices inside the kernel), the block-mask builder's test over candidate blocks, and the relative value
pass's mask over near keys. Indices past the ends are clamped before any lookup and then refused, because a fused
kernel evaluates ``mask_mod`` on the padding of the last block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

Rule = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass
class FlexPattern:
    """Which keys each query sees, for one FlexAttention call.

    nq, nk: queries and keys. allowed: the exact rule (b, h, i, j) -> bool. reach: (first, last) query index of a
    query block (1-D tensors) -> (lo, hi), the key indices that block may see lie in [lo, hi]. per_head: the rule
    depends on b or h (data masks), so block masks are per (B, H) and never cached. cache_key: identifies a static
    rule for the block-mask cache (None: do not cache). delta: (b, h, i, j) -> relative distance, or None.
    reach and cache_key are read on the host (``blocks.py``): reach is arithmetic, given CPU tensors for the
    tables' width and the queries' device's for the tables.
    frame: how the relative value pass enumerates each query's keys (``relative.value_term``):
    ``("offsets", lo, hi, complete, unit)`` (keys j = i + t for t in [lo, hi]; ``complete=False``: only those, the
    rest being beyond the clip; ``unit``: the distance is unit · t, or None: ``delta`` gives it) or ``("all",)``
    (every key, one tile). one_sided: no allowed pair has delta > 0.
    exclude_self: a query's own key only when it sees no other (applied after the call).
    own: the rule without ``exclude_self`` at (i, i), for that fallback.
    block_mask: the call's ``BlockMask`` where the caller built it from what it knows of the rule (the sorted
    window's intervals, ``windows.py``); None: built from ``reach`` (``blocks.block_mask``).
    labels, unlabelled: where ``allowed`` is ``unlabelled`` (a rule the same for every b and h) and also wants the
    query's and the key's labels equal, labels (B, 1, N) that never decrease along the sequence (packed documents,
    ``KeyRestrictions.sorted_groups``; nq = nk): the block tables then come from ``unlabelled``'s, narrowed by each
    block's first and last label (``blocks._labelled``), not from the pairs.
    """

    nq: int
    nk: int
    allowed: Rule
    reach: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
    per_head: bool
    cache_key: tuple | None
    delta: Rule | None = None
    frame: tuple = ("all",)
    one_sided: bool = False
    exclude_self: bool = False
    own: Rule | None = None
    block_mask: object | None = None
    labels: Tensor | None = None
    unlabelled: Rule | None = None


def lookup(x: Tensor, b: Tensor, h: Tensor, *rest: Tensor) -> Tensor:
    """x[b, h, *rest] for x whose dims may be 1 (broadcast): a size-1 dim is indexed at 0."""
    index = [idx if size > 1 else torch.zeros_like(idx) for size, idx in zip(x.shape, (b, h, *rest), strict=True)]
    return x[tuple(index)]


def data_rule(nq: int, nk: int, key_valid: Tensor | None, groups: Tensor | None) -> Rule:
    """Indices in range, key not padding, same group: the data-dependent part every operation shares."""

    def rule(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        ok = (i < nq) & (j < nk)
        ic, jc = i.clamp(max=nq - 1), j.clamp(max=nk - 1)
        if key_valid is not None:
            ok = ok & lookup(key_valid, b, h, jc)
        if groups is not None:
            ok = ok & (lookup(groups, b, h, ic) == lookup(groups, b, h, jc))
        return ok

    return rule


def without_self(rule: Rule) -> Rule:
    def excluded(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return rule(b, h, i, j) & (i != j)

    return excluded


def index_delta(unit: int) -> Rule:
    def delta(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return (j - i) * unit

    return delta


def positions_delta(positions: Tensor, n: int) -> Rule:
    def delta(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return lookup(positions, b, h, j.clamp(max=n - 1)) - lookup(positions, b, h, i.clamp(max=n - 1))

    return delta
