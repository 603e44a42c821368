"""``ranges`` on FlexAttention: every (query, range) entry is one row of a single FlexAttention call.

Multi-probe routing (``Executor.ranges``) gives each query ``merge`` entries, each a contiguous range [lo, hi) of
the keys sorted by cluster. Here the keys are put in that order once, the entries are sorted by where their range
starts (so that a block of 128 entries reads a few blocks of keys: a cluster's entries sit together), and one
FlexAttention call computes every entry, its ``mask_mod`` the range test ``lo_e <= j < hi_e`` (and the key's
validity), its ``BlockMask`` the key blocks each block of entries touches, found on the device by a difference array
over key blocks (no host read, no O(N²) tensor: the block table is (M / 128) x (N / 128), as FlexAttention's own).
The entries of a query row are then merged from their log-sum-exps as one softmax (``ranges.merge_parts``).

Every shape depends on (B, H, N, merge, width) alone, never on the data, so the compiled kernel is built once per
sequence length. Relative positions: the key term inside the kernel (``score_mod``, from positions), the value term
by recomputing each entry's probabilities from the log-sum-exp over its (at most ``width``) keys, gathered for
chunks of entries whose size bounds the memory, each chunk recomputed in the backward (``checkpoint``): memory
O(M · (2k + 1) + chunk · width · D), time O(M · width · D).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..inputs import Inputs
from ..ranges import KeyOrder, RangePart, Ranges, merge_parts
from ..relative import RelativePositions
from ..rows import gather_rows, inverse_order, move_rows
from .blocks import BLOCK, ordered_blocks
from .call import flex_call
from .rows import moved
from .score_terms import finite_lse, relative_value_weights

CHUNK = 1 << 24  # elements of gathered keys in one chunk of the relative value pass (64 MiB in float32)


@torch.compiler.disable  # under a compiled model: see flex/ops.py's docstring
def flex_ranges(inputs: Inputs, spans: Ranges, *, order: KeyOrder | None = None,
                rel_pos: RelativePositions | None = None, need_lse: bool = False) -> tuple[Tensor, Tensor | None]:
    """The flex executor's ``ranges`` (``ranges.range_attention`` documents the arguments and results; they come
    checked and broadcast to (B, H, ·) by ``Executor.ranges``). ``stretch`` and ``rows`` (the tiles' shapes) do not
    apply: FlexAttention blocks by 128.

    Time O(M · (width + 128) · D) in the kernel for M = Nq · merge entries, memory O(M · D) (plus the relative
    value pass, see the module)."""
    q, k, v, scale, key_valid = inputs.q, inputs.k, inputs.v, inputs.scale, inputs.key_valid
    lo, hi, width, merge, query_pos, key_pos, _, _, _ = spans
    B, H, N, D = k.shape
    Nq, M = q.shape[2], lo.shape[-1]
    if order is not None:  # the keys in the order the ranges index: one copy, then ranges are index intervals
        k = move_rows(k, order.order, order.inverse, unreached=False, kernel=moved)
        v = move_rows(v, order.order, order.inverse, unreached=False, kernel=moved)
        key_valid = None if key_valid is None else key_valid.expand(B, H, N).gather(-1, order.order)
        key_pos = None if key_pos is None else key_pos.gather(-1, order.order)
    # Entries by where their range starts: a block of them then reads few key blocks (an entry's range is a run of
    # its cluster's keys, and the entries of one cluster start close together).
    by_start = lo.argsort(dim=-1, stable=True)  # (B, H, M): the entry in each slot
    first, last = lo.gather(-1, by_start).contiguous(), hi.gather(-1, by_start).contiguous()
    rows = by_start // merge  # (B, H, M): each slot's query row
    qe = _Spread.apply(q, rows, by_start, merge)  # (B, H, M, D)
    valid = None if key_valid is None else key_valid.expand(B, H, N).contiguous()

    def allowed(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        ic, jc = i.clamp(max=M - 1), j.clamp(max=N - 1)  # the kernel evaluates the last blocks' padding too
        ok = (i < M) & (j < N) & (first[b, h, ic] <= j) & (j < last[b, h, ic])
        return ok if valid is None else ok & valid[b, h, jc]

    mod, qa, slot_pos, key_at = None, None, None, None
    if rel_pos is not None:
        kmax = rel_pos.max_distance
        qa = (qe * scale) @ rel_pos.key.to(q.dtype).T  # (B, H, M, 2k + 1): column d + k the key term of distance d
        slot_pos = query_pos.gather(-1, rows).contiguous()  # (B, H, M)
        key_at = key_pos.expand(B, H, N).contiguous()

        def mod(score: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            ic, jc = i.clamp(max=M - 1), j.clamp(max=N - 1)
            d = (key_at[b, h, jc] - slot_pos[b, h, ic]).clamp(-kmax, kmax) + kmax
            return score + qa[b, h, ic, d].to(score.dtype)

    mask = range_block_mask(first, last, N, allowed, BLOCK)
    out, lse = flex_call(qe, k, v, block_mask=mask, scale=scale, score_mod=mod)  # (B, H, M, D), (B, H, M)
    if rel_pos is not None:
        terms = _Terms(qe, k, first, last, slot_pos, key_at, valid, qa, rel_pos, scale, width)
        out = out + _value_term(terms, lse)
    return merge_parts([RangePart(out, lse, by_start)], merge, Nq, need_lse, kernel=moved)


class _Spread(torch.autograd.Function):
    """Query rows laid out in slots: slot s holds row ``rows[s]`` = by_start[s] // merge, every row in ``merge``
    slots (M = Nq · merge). The gradient comes back without a scatter-add: the slots' gradients put in entry order
    (by the inverse of ``by_start``, a permutation) and summed over each row's ``merge`` entries, both ways by the
    flex row kernel where it takes the tensors (CUDA), else PyTorch's gather."""

    @staticmethod
    def forward(ctx, q: Tensor, rows: Tensor, by_start: Tensor, merge: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(by_start)
        ctx.merge = merge
        return gather_rows(q, rows, moved)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        (by_start,) = ctx.saved_tensors
        B, H, M, D = grad.shape
        entries = gather_rows(grad, inverse_order(by_start), moved)  # (B, H, M, D): entry e in row e
        return entries.view(B, H, M // ctx.merge, ctx.merge, D).sum(3), None, None, None


def range_block_mask(first: Tensor, last: Tensor, n_keys: int, mask_mod, block: int):
    """The ``BlockMask`` of rows whose keys are [first, last) (B, H, M) each: the key blocks each block of ``block``
    rows touches, every one partial (``mask_mod`` decides inside). A difference array over key blocks per row block,
    one cumulative sum: no host read and (M / block) x (N / block) memory, the size of the mask itself."""
    from torch.nn.attention.flex_attention import BlockMask

    B, H, M = first.shape
    nqb, nkb = -(-M // block), -(-n_keys // block)
    dev = first.device
    some = (last > first).to(torch.int32)
    row_block = (torch.arange(M, device=dev) // block) * (nkb + 1)  # each row's block, as an offset
    diff = torch.zeros(B, H, nqb * (nkb + 1), dtype=torch.int32, device=dev)
    diff.scatter_add_(-1, (row_block + first.clamp(0, n_keys - 1) // block).expand(B, H, M), some)
    diff.scatter_add_(-1, (row_block + (last - 1).clamp(0, n_keys - 1) // block + 1).expand(B, H, M), -some)
    touched = diff.view(B, H, nqb, nkb + 1).cumsum(-1)[..., :nkb] > 0  # (B, H, nqb, nkb)
    kv_num, kv_idx = ordered_blocks(touched, torch.arange(nkb, device=dev).expand(nqb, nkb), nkb)  # touched ones first
    return BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=(block, block), mask_mod=mask_mod,
                                    seq_lengths=(M, n_keys))


class _Terms(NamedTuple):
    """What the relative value pass reads, per slot (entry in range-start order): its query row, its keys'
    interval [first, last), its position and key-term row qa; the keys in range order with their validity and
    positions."""

    qe: Tensor
    k: Tensor
    first: Tensor
    last: Tensor
    slot_pos: Tensor
    key_at: Tensor
    valid: Tensor | None
    qa: Tensor
    rel_pos: RelativePositions
    scale: float
    width: int


def _value_term(t: _Terms, lse: Tensor) -> Tensor:
    """Σ_j p_ej a^V(clip(pos_j - pos_e)) for every slot: (B, H, M, D) in q's dtype. Chunks of slots, each with its
    keys gathered (chunk, width, D) and recomputed in the backward, so memory stays O(chunk · width · D)."""
    B, H, M, D = t.qe.shape
    finite = finite_lse(lse)
    step = max(1, CHUNK // (B * H * max(t.width, 1) * D))
    parts = []
    for a in range(0, M, step):  # a count fixed by the shapes (no host read)
        b = min(M, a + step)
        args = (t.qe[:, :, a:b], t.qa[:, :, a:b], finite[:, :, a:b], t.k, t.rel_pos.value)
        if torch.is_grad_enabled() and any(x.requires_grad for x in args):
            parts.append(checkpoint(_chunk, t, a, b, *args, use_reentrant=False))
        else:
            parts.append(_chunk(t, a, b, *args))
    return torch.cat(parts, 2) if len(parts) > 1 else parts[0]


def _chunk(t: _Terms, a: int, b: int, qe: Tensor, qa: Tensor, finite: Tensor, k: Tensor, a_value: Tensor) -> Tensor:
    """The value term of slots a..b-1: their keys first + c for c < width, those below last (and valid) counted."""
    B, H, m, D = qe.shape
    N = k.shape[2]
    kmax = t.rel_pos.max_distance
    j = t.first[:, :, a:b, None] + torch.arange(t.width, device=qe.device)  # (B, H, m, W)
    inside = j < t.last[:, :, a:b, None]
    jc = j.clamp_max(N - 1).view(B, H, -1)
    keys = gather_rows(k, jc).view(B, H, m, t.width, D)
    idx = t.rel_pos.index(t.key_at.gather(-1, jc).view(B, H, m, t.width) - t.slot_pos[:, :, a:b, None])
    s = torch.einsum("bhmd,bhmwd->bhmw", qe, keys) * t.scale + qa.gather(-1, idx)
    if t.valid is not None:
        inside = inside & t.valid.gather(-1, jc).view(B, H, m, t.width)
    p = relative_value_weights(s, inside, finite[..., None])  # (B, H, m, W), exactly 0 outside
    mass = p.new_zeros(B, H, m, 2 * kmax + 1).scatter_add(-1, idx, p)
    return (mass @ a_value.to(mass.dtype)).to(qe.dtype)


__all__ = ["flex_ranges", "range_block_mask"]
