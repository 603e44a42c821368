"""Performer's causal attention as a scan over chunks with a recomputing backward: O(N·(D + m)) memory per head.

``feature_attention`` (attention/linear.py) computes every chunk at once: the (N, m) query and key features, the
per-chunk states Σ φ(k) [v, 1]ᵀ and their prefix sums, (N/c)·m·(D + 1) floats, all kept by autograd for the
backward (496 MiB at N = 16384, H = 8, m = 266: 15x q's bytes). Here one (m, D + 1) state per head runs along the
chunks, the features of a chunk are computed where they are used, and the backward recomputes them: autograd keeps
q, k, v, the output and the denominators (4x q's bytes and a row per position).

Forward, per chunk c (rows in order, S the state of the chunks before):
    [num | den] = φ(q_c) S + tril(φ(q_c) φ(k_c)ᵀ) [v_c | 1],    S += φ(k_c)ᵀ [v_c | 1],    o = num / den
Backward, with g = [do / den | -Σ_D(do·o) / den] (B, H, N, D + 1) and A_c = tril(g_c [v_c | 1]ᵀ):
    dφ(q_c) = g_c S_cᵀ + A_c φ(k_c),   dφ(k_c) = A_cᵀ φ(q_c) + [v_c | 1] G_cᵀ,
    d[v_c | 1] = tril(φ(q_c) φ(k_c)ᵀ)ᵀ g_c + φ(k_c) G_c
with S_c the forward's states (a pass in order keeps them) and G_c = Σ over later chunks φ(q)ᵀ g (a pass in reverse)
and through the features (performer.py's shifts are constants of each row: the query's cancels in num / den, the
key's -|k'|²/2 is differentiated): with dL = dφ ⊙ φ, dq = √s · dL W; dk = √s · (dL W - k' Σ_r dL_r).

Time: the backward recomputes the key features twice and the query features once; it keeps the (N/c, m, D + 1)
states while it runs (autograd's way keeps them from the forward on, with the (N, m) features). Measured at
N = 16384, H = 8, D = 64, m = 266, c = 128 (2 cores, float32, alternated): fwd+bwd 0.95-1.01 s against 1.68-1.77 s
for autograd's way, kept 129 MiB against 496. The projection W gets no gradient (a buffer drawn at random);
``performer_attention`` takes autograd's path when it asks for one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

Features = Callable[..., Tensor]  # performer_features: (x (B, H, c, D), w (H, m, D), scale, *, query) -> (B, H, c, m)


def _feature_grad(x: Tensor, phi: Tensor, dphi: Tensor, w: Tensor, scale: float, query: bool) -> Tensor:
    """d/dx of Σ dphi ⊙ φ(x) for the chunk x (B, H, c, D) with features phi (B, H, c, m)."""
    root = math.sqrt(scale)
    dlogits = dphi * phi  # (B, H, c, m)
    dx = dlogits @ w.to(x.dtype)  # (B, H, c, D): d(w_r · x')
    if not query:  # the key's -|x'|²/2
        dx = dx - (root * x) * dlogits.sum(-1, keepdim=True)
    return dx * root


def _chunks(n: int, chunk: int) -> list[slice]:
    return [slice(start, min(start + chunk, n)) for start in range(0, n, chunk)]


def _with_ones(v: Tensor) -> Tensor:
    return torch.cat([v, torch.ones_like(v[..., :1])], -1)  # (B, H, c, D + 1): the denominator rides along


class _PerformerScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, w: Tensor, scale: float, chunk: int,
                key_valid: Tensor | None, features: Features) -> Tensor:
        B, H, N, D = q.shape
        m = w.shape[1]
        out = torch.empty_like(v)
        den = q.new_empty(B, H, N)
        state = q.new_zeros(B, H, m, D + 1)  # Σ φ(k) [v, 1]ᵀ over the chunks before
        for rows in _chunks(N, chunk):
            fq = features(q[:, :, rows], w, scale, query=True)  # (B, H, c, m)
            fk = _key_features(features, k, w, scale, key_valid, rows)
            vc = _with_ones(v[:, :, rows])
            num = fq @ state + (fq @ fk.transpose(-1, -2)).tril_() @ vc  # (B, H, c, D + 1)
            state += fk.transpose(-1, -2) @ vc
            d = num[..., D]
            den[:, :, rows] = d
            out[:, :, rows] = num[..., :D] / torch.where(d > 0, d, 1.0)[..., None]
        ctx.save_for_backward(q, k, v, w, out, den, key_valid)
        ctx.scale, ctx.chunk, ctx.features = scale, chunk, features
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout: Tensor):
        q, k, v, w, out, den, key_valid = ctx.saved_tensors
        scale, chunk, features = ctx.scale, ctx.chunk, ctx.features
        B, H, N, D = q.shape
        m = w.shape[1]
        # o = num / den, or num where den is not positive (feature_attention's _divide: a row without a key)
        keyed = den > 0
        inv = 1.0 / torch.where(keyed, den, 1.0)
        dden = torch.where(keyed, -(dout * out).sum(-1) * inv, 0.0)
        g = torch.cat([dout * inv[..., None], dden[..., None]], -1)  # (B, H, N, D + 1)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        spans = _chunks(N, chunk)
        # In order, the states before each chunk ((N/c)·m·(D + 1) floats, for this pass only: a third of the (N, m)
        # features' bytes at c = 128, m = 266, D = 64); then in reverse, everything else with each chunk's features
        # computed once.
        states, state = [], q.new_zeros(B, H, m, D + 1)
        for rows in spans:
            states.append(state.clone())
            state += _key_features(features, k, w, scale, key_valid, rows).transpose(-1, -2) @ _with_ones(v[:, :, rows])
        later = q.new_zeros(B, H, m, D + 1)  # Σ φ(q)ᵀ g over the chunks after
        for rows, before in zip(reversed(spans), reversed(states), strict=True):
            fq = features(q[:, :, rows], w, scale, query=True)  # (B, H, c, m)
            fk = _key_features(features, k, w, scale, key_valid, rows)
            vc = _with_ones(v[:, :, rows])
            gc = g[:, :, rows]
            a = (gc @ vc.transpose(-1, -2)).tril_()  # (B, H, c, c): d tril(φ(q) φ(k)ᵀ)
            dfq = gc @ before.transpose(-1, -2) + a @ fk  # (B, H, c, m)
            dfk = a.transpose(-1, -2) @ fq + vc @ later.transpose(-1, -2)
            dvc = (fq @ fk.transpose(-1, -2)).tril_().transpose(-1, -2) @ gc + fk @ later  # (B, H, c, D + 1)
            later += fq.transpose(-1, -2) @ gc
            dq[:, :, rows] = _feature_grad(q[:, :, rows], fq, dfq, w, scale, True)
            dk[:, :, rows] = _feature_grad(k[:, :, rows], fk, dfk, w, scale, False)  # padded: fk = 0, none
            dv[:, :, rows] = dvc[..., :D]
        return dq, dk, dv, None, None, None, None, None


def _key_features(features: Features, k: Tensor, w: Tensor, scale: float, key_valid: Tensor | None,
                  rows: slice) -> Tensor:
    fk = features(k[:, :, rows], w, scale, query=False)
    return fk if key_valid is None else fk * key_valid[:, :, rows, None].to(fk.dtype)  # padded keys: no weight


def performer_scan(q: Tensor, k: Tensor, v: Tensor, projection: Tensor, scale: float, chunk: int,
                   key_valid: Tensor | None, features: Features) -> Tensor:
    """Causal FAVOR+ attention (performer.py) by a scan over chunks of ``chunk`` rows with a recomputing backward.

    q, k, v: (B, H, N, D) in the compute dtype; projection (H, m, D), no gradient; key_valid (B, 1, N) bool or
    None; ``features``: performer.py's ``performer_features`` (passed in: that module imports this one). Returns
    (B, H, N, D). O(N·(c + m)·D) time forward and backward; autograd keeps q, k, v, the output and
    (B, H, N) denominators.
    """
    return _PerformerScan.apply(q, k, v, projection, scale, chunk, key_valid, features)
