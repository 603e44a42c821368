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


class _FeatureScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, fmap: FeatureMap, chunk: int,
                key_valid: Tensor | None) -> Tensor:
        B, H, N, D = q.shape
        out = torch.empty_like(v)
        den = q.new_empty(B, H, N)
        state = None  # Σ φ(k) [v, 1]ᵀ over the chunks before: (B, H, F, D + 1)
        for rows in _chunk_slices(N, chunk):
            fq = fmap(q[:, :, rows], query=True)  # (B, H, c, F)
            fk = _keys(fmap, k, key_valid, rows)
            vc = _with_ones(v[:, :, rows])
            num = (fq @ fk.transpose(-1, -2)).tril_() @ vc  # (B, H, c, D + 1)
            if state is None:
                state = fk.transpose(-1, -2) @ vc
            else:
                num += fq @ state
                state += fk.transpose(-1, -2) @ vc
            d = num[..., D]
            den[:, :, rows] = d
            out[:, :, rows] = num[..., :D] / torch.where(d > 0, d, 1.0)[..., None]
        ctx.save_for_backward(q, k, v, out, den, key_valid)
        ctx.fmap, ctx.chunk = fmap, chunk
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout: Tensor):
        q, k, v, out, den, key_valid = ctx.saved_tensors
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
        # c = 128, m = 266, D = 64 a third of the (N, m) features' bytes); then in reverse, everything else with each
        # chunk's features computed once.
        states: list[Tensor | None] = []
        total = None
        for rows in spans:
            states.append(total)
            add = _keys(fmap, k, key_valid, rows).transpose(-1, -2) @ _with_ones(v[:, :, rows])  # (B, H, F, D + 1)
            total = add if total is None else total + add  # a new tensor: the list keeps the one before
        later = None  # Σ φ(q)ᵀ g over the chunks after: (B, H, F, D + 1)
        for rows, before in zip(reversed(spans), reversed(states), strict=True):
            fq = fmap(q[:, :, rows], query=True)  # (B, H, c, F)
            fk = _keys(fmap, k, key_valid, rows)
            vc = _with_ones(v[:, :, rows])
            gc = g[:, :, rows]
            a = (gc @ vc.transpose(-1, -2)).tril_()  # (B, H, c, c): d tril(φ(q) φ(k)ᵀ)
            dfq = a @ fk  # (B, H, c, F)
            if before is not None:
                dfq += gc @ before.transpose(-1, -2)
            dfk = a.transpose(-1, -2) @ fq
            dvc = (fq @ fk.transpose(-1, -2)).tril_().transpose(-1, -2) @ gc  # (B, H, c, D + 1)
            if later is None:
                later = fq.transpose(-1, -2) @ gc
            else:
                dfk += vc @ later.transpose(-1, -2)
                dvc += fk @ later
                later += fq.transpose(-1, -2) @ gc
            dq[:, :, rows] = fmap.grad(q[:, :, rows], fq, dfq, query=True)
            if key_valid is not None:  # a padded key's features are the constant 0
                dfk *= key_valid[:, :, rows, None].to(dfk.dtype)
            dk[:, :, rows] = fmap.grad(k[:, :, rows], fk, dfk, query=False)
            dv[:, :, rows] = dvc[..., :D]
        return dq, dk, dv, None, None, None


def feature_scan(q: Tensor, k: Tensor, v: Tensor, fmap: FeatureMap, chunk: int,
                 key_valid: Tensor | None = None) -> Tensor:
    """o_i = Σ_{j<=i} φ(q_i)·φ(k_j) v_j / Σ_{j<=i} φ(q_i)·φ(k_j) (a row without a key: its numerator, 0) by a scan over
    chunks of ``chunk`` rows with a recomputing backward.

    q, k, v: (B, H, N, D) in the compute dtype; ``fmap`` the feature map with its derivative (no gradient for its
    own parameters); key_valid (B, 1, N) bool or None. Returns (B, H, N, D). O(N·(c + F)·D) time forward and
    backward; autograd keeps q, k, v, the output and (B, H, N) denominators. The definition that an executor's
    kernels (``Executor.scan_run``: the fused one's on the CPU) stand in for: the mechanisms ask the executor first.
    """
    return _FeatureScan.apply(q, k, v, fmap, chunk, key_valid)
