"""Performer attention (Choromanski et al. 2021, FAVOR+): softmax attention estimated with positive orthogonal
random features, in linear time.

exp(q'·k') = E_w[exp(w·q' - |q'|²/2) · exp(w·k' - |k'|²/2)] for w ~ N(0, I), with q' = √s·q, k' = √s·k (s the
scale, 1/√D by default), so m features w_1..w_m give φ(x)_r = exp(w_r·x - |x|²/2)/√m and φ(q)·φ(k) ≈ exp(s·q·k),
an unbiased estimate whose variance falls as m grows. Rows of W are drawn orthogonal in blocks of D (QR of a
Gaussian matrix) and rescaled to the norms of independent Gaussian vectors (``orthogonal_features``).

Stabilisation without a leak. The exponentials overflow unless shifted. Subtracting one maximum taken over every
key of the sequence (the reference code, performer-pytorch issue 82) makes each output depend on later keys.
Here the shifts are chosen so that no key's features depend on any other position:
- a key gets exp(w_r·k' - |k'|²/2 - |w_r|²/2) = exp(-|k' - w_r|²/2), at most 1, a function of k' alone;
- a query gets exp(w_r·q' + |w_r|²/2 - max_r(w_r·q' + |w_r|²/2)), at most 1, a function of q' alone.
The per-feature factors exp(∓|w_r|²/2) cancel in every product φ(q)·φ(k), and the query's own factor cancels
between numerator and denominator, so the attention weights are exactly those of FAVOR+. Features are computed in
float32 for half-precision inputs (no NaN). A key whose k' lies farther than ~13 (float32) from every w_r gets
all-zero features and no weight, as under any fixed shift.

This module is the mechanism's one home: its functional form, its mask (what it means, for the tests), its head kind
and options, registered in ``registry.py``.

Heads. Performer heads (FAVOR+): softmax attention estimated with positive orthogonal random features in linear time
(``attention/performer.py``), causal without a leak. The features are a buffer drawn from the layer's seed, so every
rank and a reloaded checkpoint hold the same; ``redraw()`` draws the next set (the trainer calls it every
``redraw_every`` optimiser steps through ``after_optimizer_step``). Decoding keeps one (m, D) state per head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..checks import check_options, positive_int
from ..executors import Backend, get_executor
from ..executors.inputs import Inputs, refuse_cross
from ..executors.tiling import FeatureKernel
from .feature_scan import feature_scan
from .kinds.base import HeadKind, non_causal
from .kinds.common import non_negative_int
from .linear import FeatureHeads, compute_dtype, cross_over_documents, default_chunk, feature_attention


def default_features(head_dim: int) -> int:
    """m = round(D · ln D) (the Performer paper's suggestion), at least D."""
    return max(head_dim, round(head_dim * math.log(head_dim))) if head_dim > 1 else 1


def orthogonal_features(heads: int, features: int, head_dim: int, *, generator: torch.Generator | None = None,
                        device=None, dtype: torch.dtype = torch.float32) -> Tensor:
    """(heads, m, D) random feature rows: orthogonal within each block of D rows, each row's norm that of an
    independent D-dimensional Gaussian vector (so each row alone is N(0, I)). Drawn on the CPU from ``generator``
    (the same rows on every rank for the same seed), then moved to ``device``."""
    positive_int("features", features)
    blocks = []
    for _ in range(math.ceil(features / head_dim)):
        gaussian = torch.randn(heads, head_dim, head_dim, generator=generator, dtype=torch.float64)
        blocks.append(torch.linalg.qr(gaussian).Q.transpose(-1, -2))  # rows orthonormal
    rows = torch.cat(blocks, 1)[:, :features]  # (H, m, D)
    norms = torch.randn(heads, features, head_dim, generator=generator, dtype=torch.float64).norm(dim=-1)
    return (rows * norms[..., None]).to(device=device, dtype=dtype)


def performer_features(x: Tensor, projection: Tensor, scale: float, *, query: bool) -> Tensor:
    """φ(x): (B, H, N, D) -> (B, H, N, m) with the leak-free shifts of the module docstring. projection: (H, m, D).

    The exponent of every feature comes out of one matmul over x widened by constant columns (a key's
    -|x|²/2 and each row's ±|w_r|²/2 - ln(m)/2 ride along), and the exponential is taken in place: two passes over
    the (B, H, N, m) features instead of six."""
    w = projection.to(x.dtype)
    m = w.shape[-2]
    x = x * math.sqrt(scale)
    half_w = 0.5 * w.square().sum(-1, keepdim=True)  # (H, m, 1): |w_r|²/2
    ones = torch.ones_like(x[..., :1])
    if query:  # w_r·x + |w_r|²/2, less its largest over r (per query: cancels in the ratio) and ln(m)/2
        logits = torch.cat([x, ones], -1) @ torch.cat([w, half_w], -1).transpose(-1, -2)  # (B, H, N, m)
        shift = logits.detach().amax(-1, keepdim=True) + 0.5 * math.log(m)
        return logits.sub_(shift).exp_()
    # w_r·x - |w_r|²/2 - |x|²/2 - ln(m)/2 <= -ln(m)/2: nothing to stabilise, nothing that depends on another position
    widened = torch.cat([x, ones, -0.5 * x.square().sum(-1, keepdim=True)], -1)  # (B, H, N, D + 2)
    rows = torch.cat([w, -half_w - 0.5 * math.log(m), torch.ones_like(half_w)], -1)  # (H, m, D + 2)
    return (widened @ rows.transpose(-1, -2)).exp_()


@dataclass(frozen=True)
class PerformerFeatures:
    """``performer_features`` of one projection with its derivative (``feature_scan.FeatureMap``). The shifts are
    constants of each row (the query's cancels in num / den; the key's -|k'|²/2 is differentiated): with
    dL = dφ ⊙ φ, dq = √s · dL W and dk = √s · (dL W - k' Σ_r dL_r). The projection W gets no gradient."""

    projection: Tensor  # (H, m, D)
    scale: float

    def __call__(self, x: Tensor, query: bool) -> Tensor:
        return performer_features(x, self.projection, self.scale, query=query)

    def grad(self, x: Tensor, phi: Tensor, dphi: Tensor, query: bool) -> Tensor:
        root = math.sqrt(self.scale)
        dlogits = dphi * phi  # (B, H, c, m)
        dx = dlogits @ self.projection.to(x.dtype)  # (B, H, c, D): d(w_r · x')
        if not query:
            dx -= (root * x) * dlogits.sum(-1, keepdim=True)
        return dx * root


def performer_attention(
    inputs: Inputs,
    options: PerformerOptions | None = None,
    executor: Backend = "auto",
    *,
    causal: bool = True,
    projection: Tensor | None = None,
    generator: torch.Generator | None = None,
    chunk: int | None = None,
) -> Tensor:
    """Softmax attention estimated by FAVOR+ (module docstring). ``inputs``: ``Inputs.of(q, k, v, ...)``, q, k, v
    (B, H, N, D) -> (B, H, N, D).

    ``projection`` (H, m, D) gives the random features (``orthogonal_features``); without it, ``options.features``
    rows (default ``default_features(D)``) are drawn from ``generator`` (``options.redraw_every`` is the heads'
    business, not read here). Causal: a scan over chunks of ``chunk`` rows with a recomputing backward
    (``feature_scan.py``, on the ``executor``'s scan kernels where it has them), O(N·(c + m)·D) time,
    O(N·(D + m)) memory per head, autograd keeping q, k, v and the output (a projection that asks for a gradient
    takes ``feature_attention``'s autograd path, which keeps the (N, m) features and the (N/c, m, D) chunk states);
    non-causal O(N·m·D). Padded keys (the inputs' key padding
    mask) leave the numerator and the denominator. Packed ``inputs.documents``: every sum over the query's own
    document (the scan restarts at each boundary; non-causal, one state per document).
    """
    if causal:
        refuse_cross(inputs, "causal=True")
    if inputs.cross_documents is not None:
        return cross_over_documents(inputs, lambda x: performer_attention(
            x, options, executor, causal=True, projection=projection, generator=generator, chunk=chunk))
    options = PerformerOptions() if options is None else check_options("options", options, PerformerOptions)
    features = options.features
    q, k, v = inputs.q, inputs.k, inputs.v
    B, H, N, D = inputs.shape
    s, key_valid, documents = inputs.scale, inputs.key_valid, inputs.documents
    if projection is None:
        m = default_features(D) if features is None else features
        projection = orthogonal_features(H, m, D, generator=generator, device=q.device)
    elif features is not None:
        raise ValueError("give either projection or options.features, not both")
    elif not isinstance(projection, Tensor) or projection.dim() != 3 or projection.shape[0] != H \
            or projection.shape[2] != D:
        raise ValueError(f"projection must have shape (H, m, D) = ({H}, m, {D}), got "
                         f"{tuple(getattr(projection, 'shape', ()))}")
    chunk = None if chunk is None else positive_int("chunk", chunk)
    dtype = q.dtype
    q, k, v = (x.to(compute_dtype(dtype)) for x in (q, k, v))
    if causal and not projection.requires_grad:  # the scan keeps 4x q's bytes for the backward, autograd's 15x
        projection = projection.to(q.dtype)
        run = get_executor(executor, q.device).runner(q).scan_run  # the executor's kernels, where it has them
        kernel = FeatureKernel(projection, s)
        if run is None:
            out = None
        else:  # (documents only where there are some: an executor written before them takes six arguments)
            out = run(q, k, v, kernel, chunk, key_valid) if documents is None else \
                run(q, k, v, kernel, chunk, key_valid, documents)
        if out is None:
            chunk = default_chunk(projection.shape[1]) if chunk is None else chunk
            out = feature_scan(q, k, v, PerformerFeatures(projection, s), chunk, key_valid, documents)
        return out.to(dtype)
    chunk = default_chunk(projection.shape[1]) if chunk is None else chunk
    phi_q = performer_features(q, projection, s, query=True)
    phi_k = performer_features(k, projection, s, query=False)
    return feature_attention(phi_q, phi_k, v, causal=causal, chunk=chunk, key_valid=key_valid,
                             documents=documents).to(dtype)


# --- the head kind: how a model uses it ---


@dataclass(frozen=True)
class PerformerOptions:
    """options.performer: random features m (default round(head_dim · ln head_dim)) and the optimiser steps between
    draws of new ones (0: never)."""

    features: int | None = None
    redraw_every: int = 0

    def __post_init__(self) -> None:
        if self.features is not None:
            positive_int("features", self.features)
        non_negative_int("redraw_every", self.redraw_every)


class PerformerHeads(FeatureHeads):
    def __init__(self, heads: int, head_dim: int, options: PerformerOptions, seed: int) -> None:
        super().__init__(heads, head_dim)
        self.num_features, self.redraw_every, self.seed = options.features, options.redraw_every, seed
        self.register_buffer("draws", torch.zeros((), dtype=torch.long))  # sets drawn so far, saved with the model
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))  # optimiser steps seen (when not told)
        self.register_buffer("projection", self._draw(0))

    def _draw(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)  # the same on every rank
        return orthogonal_features(self.heads, self.num_features, self.head_dim, generator=generator)

    @torch.no_grad()
    def redraw(self) -> None:
        """Replace the random features by the next set of this layer's sequence (deterministic in seed and count)."""
        self.draws += 1
        self.projection.copy_(self._draw(int(self.draws)))

    def after_optimizer_step(self, step, group):
        self.steps += 1
        count = int(self.steps) if step is None else step
        if self.redraw_every and count % self.redraw_every == 0:
            self.redraw()
            return True
        return False

    def forward(self, q, k, v, rel_pos, documents=None, key_padding_mask=None):
        valid = None if key_padding_mask is None else key_padding_mask[:, None, :]
        return performer_attention(Inputs(q, k, v, self.scale, valid, documents=documents), None, self.executor,
                                   causal=self.causal, projection=self.projection)

    def features(self, x, query):
        return performer_features(x, self.projection, self.scale, query=query)

    def reference(self, q, k, v, rel_pos=None):
        """The quadratic form of the same estimate: weights φ(q_i)·φ(k_j) over j <= i, normalised (one chunk)."""
        n = q.shape[2]
        return feature_attention(self.features(q, True), self.features(k, False), v, causal=True, chunk=n)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, features={self.num_features}, redraw_every={self.redraw_every}"


def _complete(o: PerformerOptions, config: Any) -> PerformerOptions:
    return o if o.features is not None else PerformerOptions(default_features(config.head_dim), o.redraw_every)


KIND = HeadKind("performer", lambda o, heads, head_dim, seed: PerformerHeads(heads, head_dim, o, seed),
                encoder=lambda o, heads, head_dim, seed: non_causal(PerformerHeads(heads, head_dim, o, seed)),
                keys_per_query=lambda o, n: 1.5 * o.features + min(n, default_chunk(o.features)) / 2,
                option_type=PerformerOptions, complete=_complete, relative_positions=False, documents=True,
                describe=lambda o: f"m={o.features}" + (f", redraw every {o.redraw_every}" if o.redraw_every else ""),
                summary="softmax estimated by positive orthogonal random features, in linear time")
