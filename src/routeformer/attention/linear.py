"""Linear attention (Katharopoulos et al. 2020): a kernel with a feature map, K(q, k) = φ(q)·φ(k), lets the sum over
keys be taken once, o_i = φ(q_i)·(Σ_j φ(k_j) v_jᵀ) / φ(q_i)·(Σ_j φ(k_j)), in O(N·F·D) instead of O(N²·D).

Causal attention needs the sum over j <= i for every i. Materialising every prefix sum is an (N, F, D) tensor per
head; here the sequence is cut into chunks of c: inside a chunk the weights φ(q_i)·φ(k_j) are computed exactly as a
(c, c) lower triangle, across chunks through the state Σ φ(k) vᵀ of the chunks before, one (F, D) state per chunk.
Memory O(N·D + (N/c)·F·D) per head, which the default c >= F keeps O(N·D); time O(N·(c + F)·D).

``feature_attention`` is the shared core (Performer heads feed it their random features); ``linear_attention`` is
the public function for the elu and poly2 kernels. ``LinearState`` is the decoding state: (F, D) and (F,) per head,
the same size at every position.

This module is the mechanism's one home: its functional form, its mask (what it means, for the tests), its head kind
and options, registered in ``registry.py``.

Heads. Linear heads: full causal attention under the elu or poly2 kernel, computed through its feature map in linear
time (``attention/linear.py``). Decoding is a recurrence: one (F, D) state per head, the same cost at every
position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import check_options, positive_int
from ..executors import Backend, get_executor
from ..executors.inputs import Inputs, refuse_cross
from ..executors.tiling import FeatureKernel
from .feature_scan import feature_scan
from .full import full_mask
from .kernels import FEATURE_KERNELS, feature_dim, feature_map, kernel_scale, pairwise
from .kinds.base import HeadGroup, HeadKind, non_causal


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums of N products overflow or lose all precision in half precision: compute those in float32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def default_chunk(features: int) -> int:
    """c of the PyTorch scan and the chunked form: the largest power of two at most F/2, clamped to [64, 512]. A
    power of two divides the usual lengths (no padded copies of the (N, F) feature maps); c ~ F/2 trades the exact
    (c, c) part, c·F work per query, against the per-chunk states, (N/c)·F·D memory (2·N·D at c = F/2); the cap
    bounds the (c, c) part for large F (poly2). Performer's m = 266 at D = 64, fwd+bwd at N = 16384 (H = 8, 2
    threads): c = 128 2.06 s, 256 2.19 s, 266 2.54 s. (An executor's scan kernels choose their own where the caller
    gives none: ``Executor.scan_run``.)"""
    c = 1 << max(0, (max(1, features) // 2).bit_length() - 1)
    return min(512, max(64, c))


def _divide(num: Tensor, den: Tensor) -> Tensor:
    """num / den with rows whose weights sum to 0 (no key) giving zeros and finite gradients."""
    return num / torch.where(den > 0, den, 1.0)[..., None]


def feature_attention(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    chunk: int,
    key_valid: Tensor | None = None,
    intra: Callable[[Callable[[Tensor], Tensor]], Tensor] | None = None,
    documents: Tensor | None = None,
) -> Tensor:
    """o_i = Σ_j φ(q_i)·φ(k_j) v_j / Σ_j φ(q_i)·φ(k_j) over j <= i (causal) or all j.

    phi_q, phi_k: (B, H, N, F); v: (B, H, N, D); key_valid: (B, 1, N) bool or None (padded keys get φ = 0, so they
    leave the numerator and the denominator). ``intra(chunks)`` -> (B, H, C, c, c) computes the within-chunk
    weights from the raw q, k it holds, cut by ``chunks`` ((B, H, N, X) -> (B, H, C, c, X)), when that is cheaper
    than through features (poly2: c·c·D instead of c·c·F); by default they are φ(q)·φ(k). ``documents`` (B, N),
    numbered from 0 per row, or None: packed documents, the sums over i's document only (``_documents_apart``).
    Returns (B, H, N, D) in the dtype of the inputs.
    """
    if key_valid is not None:
        phi_k = phi_k * key_valid[..., None].to(phi_k.dtype)
    if documents is not None:
        return _documents_apart(phi_q, phi_k, v, causal=causal, chunk=chunk, intra=intra, documents=documents,
                                key_valid=key_valid)
    if not causal:
        state = phi_k.transpose(-1, -2) @ v  # (B, H, F, D)
        return _divide(phi_q @ state, (phi_q * phi_k.sum(2, keepdim=True)).sum(-1))
    B, H, N, Fd = phi_q.shape
    D = v.shape[-1]
    pad = (-N) % chunk
    C = (N + pad) // chunk

    def chunks(x: Tensor) -> Tensor:  # (B, H, N, X) -> (B, H, C, c, X); padded rows are zeros, so they add nothing
        return (F.pad(x, (0, 0, 0, pad)) if pad else x).reshape(x.shape[0], x.shape[1], C, chunk, x.shape[-1])

    # v with a column of ones: the denominator Σ φ(q)·φ(k) rides along as the last column of the numerator (one
    # set of products and prefix sums instead of two, and no separate row sums to differentiate)
    ones = torch.ones_like(v[..., :1])
    fq, fk, vc = chunks(phi_q), chunks(phi_k), chunks(torch.cat([v, ones], -1))
    # Σ φ(k) [v, 1]ᵀ of each chunk, then of the chunks strictly before: exclusive prefix sums over chunks (shifting
    # the inclusive sums, not subtracting the chunk's own: (a + b) - b loses a when b is large, and would let a
    # chunk's later positions perturb its earlier ones)
    per_chunk = fk.transpose(-1, -2) @ vc  # (B, H, C, F, D + 1)
    before = F.pad(per_chunk.cumsum(2)[:, :, :-1], (0, 0, 0, 0, 1, 0))
    num = fq @ before  # (B, H, C, c, D + 1)
    if intra is not None:
        weights = intra(chunks)
        if key_valid is not None:
            weights = weights * chunks(key_valid[..., None].to(weights.dtype)).transpose(-1, -2)  # (B, 1, C, 1, c)
    else:
        weights = fq @ fk.transpose(-1, -2)  # (B, H, C, c, c)
    weights = weights * torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    num = num + weights @ vc
    num, den = num[..., :D], num[..., D]
    out = _divide(num, den).reshape(B, H, C * chunk, D)
    return out[:, :, :N]


def _documents_apart(phi_q: Tensor, phi_k: Tensor, v: Tensor, *, causal: bool, chunk: int,
                     intra: Callable[[Callable[[Tensor], Tensor]], Tensor] | None, documents: Tensor,
                     key_valid: Tensor | None) -> Tensor:
    """``feature_attention`` over packed ``documents`` (B, N): the sums run over query i's document only, and a
    document's sums are bit for bit the same whatever the others hold (0/1 factors, no subtraction).

    The chunks in order, as ``feature_scan`` runs them (its module docstring), the state restarting at every
    boundary: the sums over j <= i. Non-causal adds the same scan run from the end, over j > i. ``phi_k`` holds the
    padded keys as zeros already; ``key_valid`` (B, 1, N) masks them out of ``intra``'s raw weights too. Autograd
    keeps each chunk's values: O(N·(c + F)) memory per head, O(N·(c + F)·D) time."""
    vc = torch.cat([v, torch.ones_like(v[..., :1])], -1)  # (B, H, N, D + 1): the denominator rides along
    D = v.shape[-1]
    num = _scan_documents(phi_q, phi_k, vc, documents, chunk, intra, key_valid, reverse=False)
    if not causal:
        num = num + _scan_documents(phi_q, phi_k, vc, documents, chunk, intra, key_valid, reverse=True)
    return _divide(num[..., :D], num[..., D])


def _scan_documents(phi_q: Tensor, phi_k: Tensor, vc: Tensor, documents: Tensor, chunk: int,
                    intra: Callable[[Callable[[Tensor], Tensor]], Tensor] | None, key_valid: Tensor | None,
                    reverse: bool) -> Tensor:
    """Σ φ(q_i)·φ(k_j) [v_j, 1] over the keys j of i's document with j <= i (``reverse``: j > i), chunk by chunk
    in that direction, the carried state holding the keys of the document the next chunk continues: (B, H, N, E)."""
    N = vc.shape[2]
    starts = list(range(0, N, chunk))
    outs: list[Tensor] = []
    state, carried = None, None  # the state, and the document it belongs to (B,)
    for start in reversed(starts) if reverse else starts:
        rows = slice(start, min(start + chunk, N))
        c = rows.stop - rows.start
        fq, fk, vr, dc = phi_q[:, :, rows], phi_k[:, :, rows], vc[:, :, rows], documents[:, rows]
        if intra is not None:  # the raw q, k of these rows, as one chunk: (B, H, 1, c, c)
            weights = intra(lambda x, rows=rows: x[:, :, rows][:, :, None])[:, :, 0]
            if key_valid is not None:
                weights = weights * key_valid[:, :, None, rows].to(weights.dtype)
        else:
            weights = fq @ fk.transpose(-1, -2)  # (B, H, c, c)
        order = torch.ones(c, c, dtype=torch.bool, device=vc.device)
        order = order.triu(1) if reverse else order.tril()
        allow = order & (dc[:, :, None] == dc[:, None, :])[:, None]  # (B, 1, c, c)
        num = (weights * allow.to(weights.dtype)) @ vr
        edge = dc[:, 0] if reverse else dc[:, -1]  # the document the state goes on with
        add = (fk * (dc == edge[:, None])[:, None, :, None].to(fk.dtype)).transpose(-1, -2) @ vr
        if state is None:
            state = add
        else:
            num = num + (fq @ state) * (dc == carried[:, None])[:, None, :, None].to(num.dtype)
            state = state * (edge == carried)[:, None, None, None].to(state.dtype) + add
        carried = edge
        outs.append(num)
    return torch.cat(outs[::-1] if reverse else outs, 2)


def cross_over_documents(inputs: Inputs, causal_attend: Callable[[Inputs], Tensor]) -> Tensor:
    """Non-causal cross-attention of a feature map over packed ``inputs.cross_documents``, as the same map's causal
    self-attention over one merged sequence: each document's memory, then its queries (a stable sort of the
    positions by (document, side)), the queries' own positions padding. A query's causal sums then run over its
    own document's whole memory and nothing else, in linear time, on the scan kernels that causal attention uses,
    each document's sums restarting at its boundary (bit for bit what the document gives alone).

    ``causal_attend`` maps the merged ``Inputs.of`` (B, H, Nk + Nq, D, with its padding and documents) to its
    output; returns the queries' rows (B, H, Nq, D). O((Nq + Nk) · D) extra memory."""
    queries, memory = inputs.cross_documents
    q, k, v = inputs.q, inputs.k, inputs.v
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    side = torch.cat([memory * 2, queries * 2 + 1], 1)  # (B, Nk + Nq): a document's memory sorts before its queries
    order = side.argsort(dim=1, stable=True)  # (B, Nk + Nq): the merged sequence's positions in [memory, queries]
    where = order.argsort(dim=1)[:, Nk:]  # (B, Nq): each query's place in the merged sequence
    real = torch.ones(B, Nk, dtype=torch.bool, device=q.device) if inputs.key_valid is None \
        else inputs.key_valid[:, 0]
    real = torch.cat([real, torch.zeros(B, Nq, dtype=torch.bool, device=q.device)], 1).gather(1, order)

    def merged(at_memory: Tensor, at_queries: Tensor) -> Tensor:  # (B, H, Nk, D), (B, H, Nq, D) -> (B, H, N', D)
        both = torch.cat([at_memory, at_queries], 2)
        return both.gather(2, order[:, None, :, None].expand(B, H, Nk + Nq, both.shape[-1]))

    # zeros where the merged sequence's rows are never read: queries at memory positions (their rows are dropped),
    # keys and values at query positions (padding)
    out = causal_attend(Inputs.of(merged(q.new_zeros(B, H, Nk, D), q), merged(k, k.new_zeros(B, H, Nq, D)),
                                  merged(v, v.new_zeros(B, H, Nq, v.shape[-1])),
                                  scale=inputs.scale if inputs.scale_given else None, key_padding_mask=real,
                                  documents=side.gather(1, order) // 2))
    return out.gather(2, where[:, None, :, None].expand(B, H, Nq, out.shape[-1]))


class EluFeatures:
    """φ(x) = elu(x) + 1 with its derivative (``feature_scan.FeatureMap``): 1 where x > 0, else exp(x) = φ(x)."""

    def __call__(self, x: Tensor, query: bool) -> Tensor:
        return F.elu(x) + 1.0

    def grad(self, x: Tensor, phi: Tensor, dphi: Tensor, query: bool) -> Tensor:
        return dphi * torch.where(x > 0, 1.0, phi)


def linear_attention(
    inputs: Inputs,
    options: LinearOptions | None = None,
    executor: Backend = "auto",
    *,
    causal: bool = True,
    chunk: int | None = None,
) -> Tensor:
    """Full attention under ``options.kernel``, 'elu' (default) or 'poly2' (``kernels.py``), in linear time.

    ``inputs``: ``Inputs.of(q, k, v, ...)``, q, k, v (B, H, N, D) -> (B, H, N, D); equal to
    ``kernel_attention(inputs, kernel)`` (the quadratic form) up to rounding. Non-causal O(N·F·D); causal in chunks
    of ``chunk`` (default: the executor's scan kernels' own, else ``default_chunk(F)``), O(N·(c + F)·D) time and
    O(N·D + (N/c)·F·D) memory per head. F = D for elu, 1 + D + D(D+1)/2 for poly2. The scale: poly2's s (default
    1/√D); elu has none (a given one is refused). Half-precision inputs are computed in float32 and returned in
    their dtype. Causal elu attention runs on the ``executor``'s scan kernels where it has them (``feature_scan``).
    Packed ``inputs.documents``: every sum over the query's own document (the scan restarts at each boundary).
    """
    if causal:
        refuse_cross(inputs, "causal=True")
    if inputs.cross_documents is not None:
        return cross_over_documents(inputs, lambda x: linear_attention(x, options, executor, causal=True, chunk=chunk))
    options = LinearOptions() if options is None else check_options("options", options, LinearOptions)
    documents = inputs.documents
    kernel = options.kernel
    B, H, N, D = inputs.shape
    key_valid = inputs.key_valid
    _check_features(options, D)
    s = kernel_scale(kernel, inputs.chosen_scale, D)
    chunk = None if chunk is None else positive_int("chunk", chunk)
    dtype = inputs.q.dtype
    q, k, v = (x.to(compute_dtype(dtype)) for x in (inputs.q, inputs.k, inputs.v))
    if causal and kernel == "elu":  # the scan keeps 4x q's bytes for the backward (feature_scan.py)
        fmap = EluFeatures()
        run = get_executor(executor, q.device).runner(q).scan_run  # the executor's kernels, where it has them
        kernel = FeatureKernel()  # no projection: elu's
        if run is None:
            out = None
        else:  # (documents only where there are some: an executor written before them takes six arguments)
            out = run(q, k, v, kernel, chunk, key_valid) if documents is None else \
                run(q, k, v, kernel, chunk, key_valid, documents)
        if out is None:
            out = feature_scan(q, k, v, fmap, default_chunk(D) if chunk is None else chunk, key_valid, documents)
        return out.to(dtype)
    chunk = default_chunk(feature_dim(kernel, D)) if chunk is None else chunk
    phi_q, phi_k = feature_map(kernel, q, s), feature_map(kernel, k, s)
    intra = (lambda chunks: pairwise(kernel, chunks(q), chunks(k), s)) if kernel == "poly2" else None
    out = feature_attention(phi_q, phi_k, v, causal=causal, chunk=chunk, key_valid=key_valid, intra=intra,
                            documents=documents)
    return out.to(dtype)


@dataclass
class LinearState:
    """The decoding state of linear heads: Σ φ(k) vᵀ (B, H, F, D) and Σ φ(k) (B, H, F) over the positions so far.
    The same size at every position: a step costs O(F·D) per head."""

    ROWS: ClassVar[tuple[str, ...]] = ("kv", "norm")  # one row per sequence (reorder_rows)

    kv: Tensor
    norm: Tensor
    count: int = 0

    @classmethod
    def empty(cls, batch: int, heads: int, features: int, head_dim: int, *, device, dtype) -> LinearState:
        dtype = compute_dtype(dtype)
        return cls(torch.zeros(batch, heads, features, head_dim, device=device, dtype=dtype),
                   torch.zeros(batch, heads, features, device=device, dtype=dtype))

    def restart(self, rows: Tensor) -> None:
        """Empty the sums of the ``rows`` (B,) bool (a packed row beginning a new document), the others as they
        are (a 0/1 factor: exact)."""
        keep = (~rows).to(self.kv.dtype)
        self.kv = self.kv * keep[:, None, None, None]
        self.norm = self.norm * keep[:, None, None]

    def add(self, phi_k: Tensor, v: Tensor) -> None:
        """Take in the keys' features (B, H, n, F) and values (B, H, n, D)."""
        self.kv = self.kv + phi_k.transpose(-1, -2) @ v.to(self.kv.dtype)
        self.norm = self.norm + phi_k.sum(2)
        self.count += phi_k.shape[2]

    def read(self, phi_q: Tensor) -> Tensor:
        """Outputs (B, H, n, D) of queries whose features are (B, H, n, F), over every key taken in."""
        return _divide(phi_q @ self.kv, (phi_q @ self.norm[..., None])[..., 0])


# --- the head kind: how a model uses it ---


@dataclass(frozen=True)
class LinearOptions:
    """options.linear: the kernel, 'elu' or 'poly2' (the exponential kernel has no finite feature map; Performer
    heads estimate it). ``features`` (F) follows from the kernel and head_dim; the config fills it in."""

    kernel: str = "elu"
    features: int | None = None

    def __post_init__(self) -> None:
        if self.kernel not in FEATURE_KERNELS:
            raise ValueError(f"kernel={self.kernel!r}: linear heads need kernel='elu' or 'poly2' (the exponential "
                             "kernel has no finite feature map; performer heads estimate it)")


class FeatureHeads(HeadGroup):
    """Heads computed as φ(q)·φ(k) through features: decoding keeps Σ φ(k) vᵀ and Σ φ(k) (``LinearState``).
    Subclasses give ``features(x, query)`` and ``num_features``."""

    num_features: int

    def features(self, x, query: bool):
        raise NotImplementedError

    def new_cache(self, batch, max_len, device, dtype):
        return LinearState.empty(batch, self.heads, self.num_features, self.head_dim, device=device, dtype=dtype)

    def keep(self, cache, k, v, positions, start, since=None):
        phi = self.features(k.to(cache.kv.dtype), query=False)  # (B, H, n, F)
        if since is not None:  # packed documents: a row's sums hold its document's keys only
            cache.restart(since == start)  # rows whose document begins here drop the sums of the ones before
            phi = phi * (positions[None, :] >= since[:, None])[:, None, :, None].to(phi.dtype)
        cache.add(phi, v)

    def step(self, q, cache, t, rel_pos, since=None):
        return cache.read(self.features(q[:, :, None].to(cache.kv.dtype), query=True))[:, :, 0].to(q.dtype)


class LinearHeads(FeatureHeads):
    def __init__(self, heads: int, head_dim: int, options: LinearOptions) -> None:
        super().__init__(heads, head_dim)
        self.options = options
        self.num_features = feature_dim(options.kernel, head_dim)

    @property
    def kernel(self) -> str:
        return self.options.kernel

    def forward(self, q, k, v, rel_pos, documents=None, key_padding_mask=None):
        # poly2 heads score at self.scale, elu heads at none
        valid = None if key_padding_mask is None else key_padding_mask[:, None, :]
        return linear_attention(Inputs(q, k, v, self.scale, valid, scale_given=self.kernel != "elu",
                                       documents=documents), self.options, self.executor, causal=self.causal)

    def reference_mask(self, q, k):  # the meaning: full causal attention under the kernel (the base reference)
        return full_mask(q.shape[2], device=q.device)

    def features(self, x, query):
        return feature_map(self.kernel, x, kernel_scale(self.kernel, self.kernel_scale, self.head_dim))

    def extra_repr(self) -> str:
        return f"heads={self.heads}, kernel={self.kernel}, features={self.num_features}"


def _check_features(o: LinearOptions, head_dim: int) -> int:
    """F of ``o.kernel`` at ``head_dim``: ``o.features`` must be it or None."""
    features = feature_dim(o.kernel, head_dim)
    if o.features not in (None, features):
        raise ValueError(f"features ({o.features}) follows from the kernel and head_dim (F = {features} for "
                         f"{o.kernel!r} at head_dim {head_dim}); leave it out")
    return features


def _complete(o: LinearOptions, config: Any) -> LinearOptions:
    return LinearOptions(o.kernel, _check_features(o, config.head_dim))


def _keys_per_query(o: LinearOptions, n: int) -> float:
    return o.features + min(n, default_chunk(o.features)) / 2  # read + write the (F, D) state; the exact chunk


KIND = HeadKind("linear", lambda o, heads, head_dim, seed: LinearHeads(heads, head_dim, o),
                encoder=lambda o, heads, head_dim, seed: non_causal(LinearHeads(heads, head_dim, o)),
                keys_per_query=_keys_per_query, option_type=LinearOptions, complete=_complete, relative_positions=False,
                documents=True,
                on_executor=lambda o: o.kernel == "elu",  # the feature scan's kernels (poly2: PyTorch's operators)
                describe=lambda o: f"kernel={o.kernel}, F={o.features}",
                summary="every earlier key under the elu or poly2 kernel, in linear time")
