"""Causal attention through features (Performer, linear) as a scan over chunks with a recomputing backward:
O(N·(D + F)) memory per head.

``feature_attention`` (attention/linear.py) computes every chunk at once: the (N, F) query and key features, the
per-chunk states Σ φ(k) [v, 1]ᵀ and their prefix sums, (N/c)·F·(D + 1) floats, all kept by autograd for the
backward (Performer: 496 MiB at N = 16384, H = 8, m = 266, 15x q's bytes). Here one (F, D + 1) state per head runs
along the chunks, the features of a chunk are computed where they are used, and the backward recomputes them:
autograd keeps q, k, v, the output and the denominators (4x q's bytes and a row per position).

Forward, per chunk c (rows in order, S the state of the chunks before):
    [num | den] = φ(q_c) S + tril(φ(q_c) φ(k_c)ᵀ) [v_c | 1],    S += φ(k_c)ᵀ [v_c | 1],    o = num / den
Backward, with g = [do / den | -Σ_D(do·o) / den] (B, H, N, D + 1) and A_c = tril(g_c [v_c | 1]ᵀ):
    dφ(q_c) = g_c S_cᵀ + A_c φ(k_c),   dφ(k_c) = A_cᵀ φ(q_c) + [v_c | 1] G_cᵀ,
    d[v_c | 1] = tril(φ(q_c) φ(k_c)ᵀ)ᵀ g_c + φ(k_c) G_c
with S_c the forward's states (a pass in order keeps them) and G_c = Σ over later chunks φ(q)ᵀ g (a pass in
reverse); the feature map turns dφ into dq, dk (``FeatureMap.grad``).

Time: the backward recomputes the key features twice and the query features once; it keeps the (N/c, F, D + 1)
states while it runs (autograd's way keeps them from the forward on, with the (N, F) features). Measured for
Performer at N = 16384, H = 8, D = 64, m = 266, c = 128 (2 cores, float32, alternated): fwd+bwd 0.95-1.01 s against
1.68-1.77 s for autograd's way, kept 129 MiB against 496. The feature maps' own parameters (Performer's projection)
get no gradient: callers take autograd's way when one asks for it.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class FeatureMap(Protocol):
    """φ and its derivative, for rows of one chunk: x (B, H, c, D) -> (B, H, c, F)."""

    def __call__(self, x: Tensor, query: bool) -> Tensor: ...

    def grad(self, x: Tensor, phi: Tensor, dphi: Tensor, query: bool) -> Tensor:
        """d/dx of Σ dphi ⊙ φ(x), given phi = φ(x) (the features a row's shift, if any, treats as constant)."""
        ...


def _chunk_slices(n: int, chunk: int) -> list[slice]:
    return [slice(start, min(start + chunk, n)) for start in range(0, n, chunk)]


def _with_ones(v: Tensor) -> Tensor:
    return torch.cat([v, torch.ones_like(v[..., :1])], -1)  # (B, H, c, D + 1): the denominator rides along


def _keys(fmap: FeatureMap, k: Tensor, key_valid: Tensor | None, rows: slice) -> Tensor:
    fk = fmap(k[:, :, rows], query=False)  # (B, H, c, F)
    return fk if key_valid is None else fk * key_valid[:, :, rows, None].to(fk.dtype)  # padded keys: no weight


def _same_document(documents: Tensor | None, rows: slice) -> Tensor | None:
    """(B, 1, c, c) 0/1 in no dtype yet: rows i, j of the chunk in one document; None without documents."""
    if documents is None:
        return None
    dc = documents[:, rows]
    return (dc[:, :, None] == dc[:, None, :])[:, None]


def _rows_in(documents: Tensor | None, rows: slice, doc: Tensor | None) -> Tensor | None:
    """(B, 1, c, 1) bool: the chunk's rows in document ``doc`` (B,) of each row; None without documents (every row)."""
    if documents is None or doc is None:
        return None
    return (documents[:, rows] == doc[:, None])[:, None, :, None]


def _masked(x: Tensor, mask: Tensor | None) -> Tensor:
    """x times a 0/1 mask (exact: a kept value is multiplied by 1), or x without one."""
    return x if mask is None else x * mask.to(x.dtype)


class _FeatureScan(torch.autograd.Function):
    """The scan; with packed ``documents`` (B, N) the state restarts at every boundary: a chunk's rows read the
    state only in the document the chunk continues, and the state carried on holds the chunk's last document's
    keys only (a 0/1 factor, so a document's sums are bit for bit those it has alone in the same chunks)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, fmap: FeatureMap, chunk: int,
                key_valid: Tensor | None, documents: Tensor | None) -> Tensor:
        B, H, N, D = q.shape
        out = torch.empty_like(v)
        den = q.new_empty(B, H, N)
        state = None  # Σ φ(k) [v, 1]ᵀ over the chunks before (of the last row's document): (B, H, F, D + 1)
        before = None  # (B,) the document of the row before the chunk
        for rows in _chunk_slices(N, chunk):
            fq = fmap(q[:, :, rows], query=True)  # (B, H, c, F)
            fk = _keys(fmap, k, key_valid, rows)
            vc = _with_ones(v[:, :, rows])
            num = _masked((fq @ fk.transpose(-1, -2)).tril_(), _same_document(documents, rows)) @ vc
            last = None if documents is None else documents[:, rows.stop - 1]
            add = _masked(fk, _rows_in(documents, rows, last)).transpose(-1, -2) @ vc
            if state is None:
                state = add
            else:
                num += _masked(fq @ state, _rows_in(documents, rows, before))
                if documents is None:
                    state += add
                else:  # carried on only where the chunk ends in the document it began with
                    state = _masked(state, (last == before)[:, None, None, None]) + add
            before = last
            d = num[..., D]
            den[:, :, rows] = d
            out[:, :, rows] = num[..., :D] / torch.where(d > 0, d, 1.0)[..., None]
        ctx.save_for_backward(q, k, v, out, den, key_valid, documents)
        ctx.fmap, ctx.chunk = fmap, chunk
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout: Tensor):
        q, k, v, out, den, key_valid, documents = ctx.saved_tensors
        fmap, chunk = ctx.fmap, ctx.chunk
        D = q.shape[-1]
        # o = num / den, or num where den is not positive (feature_attention's _divide: a row without a key)
        keyed = den > 0
        inv = 1.0 / torch.where(keyed, den, 1.0)
        dden = torch.where(keyed, -(dout * out).sum(-1) * inv, 0.0)
        g = torch.cat([dout * inv[..., None], dden[..., None]], -1)  # (B, H, N, D + 1)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        spans = _chunk_slices(q.shape[2], chunk)
        # In order, the states before each chunk ((N/c)·F·(D + 1) floats, for this pass only: for Performer at
        # c = 128, m = 266, D = 64 a third of the (N, m) features' bytes), by the forward's rule; then in reverse,
        # everything else with each chunk's features computed once.
        states: list[Tensor | None] = []
        total, previous = None, None
        for rows in spans:
            states.append(total)
            last = None if documents is None else documents[:, rows.stop - 1]
            add = _masked(_keys(fmap, k, key_valid, rows), _rows_in(documents, rows, last)).transpose(-1, -2) \
                @ _with_ones(v[:, :, rows])  # (B, H, F, D + 1)
            if total is None:
                total = add
            else:  # a new tensor: the list keeps the one before
                total = total + add if documents is None else \
                    _masked(total, (last == previous)[:, None, None, None]) + add
            previous = last
        later = None  # Σ φ(q)ᵀ g over the chunks after (of the next chunk's first document): (B, H, F, D + 1)
        after = None  # (B,) the document of the row after the chunk
        for index, rows in reversed(list(enumerate(spans))):
            before = states[index]
            fq = fmap(q[:, :, rows], query=True)  # (B, H, c, F)
            fk = _keys(fmap, k, key_valid, rows)
            vc = _with_ones(v[:, :, rows])
            gc = g[:, :, rows]
            same = _same_document(documents, rows)
            a = _masked((gc @ vc.transpose(-1, -2)).tril_(), same)  # (B, H, c, c): d tril(φ(q) φ(k)ᵀ)
            dfq = a @ fk  # (B, H, c, F)
            if before is not None:
                reads = _rows_in(documents, rows, None if documents is None else documents[:, rows.start - 1])
                dfq += _masked(gc @ before.transpose(-1, -2), reads)
            dfk = a.transpose(-1, -2) @ fq
            dvc = _masked((fq @ fk.transpose(-1, -2)).tril_(), same).transpose(-1, -2) @ gc  # (B, H, c, D + 1)
            first = None if documents is None else documents[:, rows.start]
            adds = _masked(fq, _rows_in(documents, rows, first)).transpose(-1, -2) @ gc
            if later is None:
                later = adds
            else:
                read = _rows_in(documents, rows, after)  # the rows whose keys the later chunks' queries see
                dfk += _masked(vc @ later.transpose(-1, -2), read)
                dvc += _masked(fk @ later, read)
                if documents is None:
                    later += adds
                else:  # carried back only where the chunk begins in the document the next one begins with
                    later = _masked(later, (first == after)[:, None, None, None]) + adds
            after = first
            dq[:, :, rows] = fmap.grad(q[:, :, rows], fq, dfq, query=True)
            if key_valid is not None:  # a padded key's features are the constant 0
                dfk *= key_valid[:, :, rows, None].to(dfk.dtype)
            dk[:, :, rows] = fmap.grad(k[:, :, rows], fk, dfk, query=False)
            dv[:, :, rows] = dvc[..., :D]
        return dq, dk, dv, None, None, None, None


def feature_scan(q: Tensor, k: Tensor, v: Tensor, fmap: FeatureMap, chunk: int,
                 key_valid: Tensor | None = None, documents: Tensor | None = None) -> Tensor:
    """o_i = Σ_{j<=i} φ(q_i)·φ(k_j) v_j / Σ_{j<=i} φ(q_i)·φ(k_j) (a row without a key: its numerator, 0) by a scan over
    chunks of ``chunk`` rows with a recomputing backward.

    q, k, v: (B, H, N, D) in the compute dtype; ``fmap`` the feature map with its derivative (no gradient for its
    own parameters); key_valid (B, 1, N) bool or None; documents (B, N) packed documents numbered from 0 per row
    (``check_documents``) or None: the sums then run over j <= i of i's document only. Returns (B, H, N, D).
    O(N·(c + F)·D) time forward and backward; autograd keeps q, k, v, the output and (B, H, N) denominators. The
    definition that an executor's kernels (``Executor.scan_run``: the fused one's on the CPU, documents too)
    stand in for: the mechanisms ask the executor first.
    """
    return _FeatureScan.apply(q, k, v, fmap, chunk, key_valid, documents)

