"""What each approximation of attention would output in place of a trained head (Gupta and Berant 2021, §3-4).

Every method takes a head group's exact attention (its weights α (B, h, N, N) over the keys it sees, the values
u_ij each key offers, the exact output o = Σ_j α_ij u_ij) and returns weights w (B, h, N, N) whose output
Σ_j w_ij u_ij replaces o. All methods stay within the keys the head sees (every earlier key for a full head, the
routed ones for a routing head), so a causal model never scores with a later key.

- exact: w = α (must reproduce the model's own loss).
- ovo (optimal-v-oblivious-r): the r largest α_ij, renormalised.
- ova (optimal-v-aware-r): the point nearest o among convex combinations of at most r values u_ij. r = 1 and
  r >= D + 1 are exact (argmin_j |u_ij - o|; Carathéodory); for 1 < r <= D the problem is NP-hard in general and
  the result is the best feasible point of several candidates (module ``ova_weights``), an upper bound on the
  optimal error that is never above OVO-r's or OVA-1's.
- sliding (sliding-window-r): the r most recent keys, the kernel normalised over them.
- lsh (LSH-r): angular LSH on the unit queries and keys (Reformer's h(x) = argmax([xR; -xR]), ``rounds`` rounds,
  round(√N) buckets); per round a query keeps the r most recent keys in its bucket (the sorted window of
  ``lsh_attention``), the rounds' sets are joined, and the kernel is normalised over them. A query whose bucket holds no
  key keeps its most recent key.
- features (random features, r = m): Performer's positive orthogonal random features estimate exp(s·q·k)
  (exponential-kernel models only, as in the paper), normalised over the keys the head sees.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention.lsh import default_lsh_settings, lsh_hash, lsh_rotations
from ..attention.performer import orthogonal_features, performer_features
from .heads import HeadCall, PairValues

METHODS = ("exact", "ovo", "ova", "sliding", "lsh", "features")
LABELS = {"exact": "exact", "ovo": "optimal-v-oblivious", "ova": "optimal-v-aware", "sliding": "sliding-window",
          "lsh": "LSH", "features": "random features"}


@dataclass(frozen=True)
class Method:
    """One approximation: ``name`` (one of METHODS) with its ``r`` (keys, or features; None for exact)."""

    name: str
    r: int | None = None

    def __post_init__(self) -> None:
        if self.name not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.name!r}")
        if (self.r is None) != (self.name == "exact"):
            raise ValueError(f"{self.name}: " + ("exact takes no r" if self.name == "exact" else "needs r"))
        if self.r is not None and (not isinstance(self.r, int) or self.r < 1):
            raise ValueError(f"r must be a positive integer, got {self.r!r}")

    @property
    def label(self) -> str:
        return LABELS[self.name] + ("" if self.r is None else f"-{self.r}")


@dataclass
class HeadApproximation:
    """A head group's substitute output (B, h, N, D), its weights (B, h, N, N) and what is known of it."""

    output: Tensor
    weights: Tensor
    exact: Tensor  # the head group's own output o (B, h, N, D)
    keys: Tensor  # (B, h, N): keys per query the substitute needs (OVA at r >= D + 1: min(keys seen, D + 1))
    upper_bound: bool = False  # ova for 1 < r <= D: a feasible point, not proven optimal


# method name -> (call, r, lsh_rounds, seed) -> weights (B, h, N, N)
_WEIGHTS = {
    "exact": lambda call, r, rounds, seed: call.weights,
    "ovo": lambda call, r, rounds, seed: top_r(call.weights, r),
    "sliding": lambda call, r, rounds, seed: call.restricted(last_r(call.allowed, r)),
    "lsh": lambda call, r, rounds, seed: call.restricted(lsh_keep(call, r, rounds, seed)),
    "features": lambda call, r, rounds, seed: feature_weights(call, r, seed),
    "ova": lambda call, r, rounds, seed: ova_weights(call.weights, call.output, call.values, r, allowed=call.allowed),
}


@torch.no_grad()
def approximate(call: HeadCall, method: Method, *, lsh_rounds: int = 1, seed: int = 0) -> HeadApproximation:
    """``method`` applied to the head group of ``call`` (on its own q, k, v). ``seed`` draws LSH rotations and
    random features (different per layer and group, the same on every call)."""
    if call.q.dtype in (torch.float16, torch.bfloat16):  # the solvers and projections need float32's range
        call = dataclasses.replace(call, q=call.q.float(), k=call.k.float(), v=call.v.float())
    seed = seed + 7919 * call.layer + 104_729 * call.first_head
    weights = _WEIGHTS[method.name](call, method.r, lsh_rounds, seed)
    r, D = method.r or 0, call.v.shape[-1]
    keys = (weights > 0).sum(-1)
    if method.name == "ova" and r > D:  # α itself; Carathéodory: D + 1 of its values give the same point
        keys = keys.clamp_max(D + 1)
    bound = method.name == "ova" and 1 < r <= D and bool((call.allowed.sum(-1) > r).any())
    return HeadApproximation(call.values.combine(weights), weights, call.output, keys, bound)


def renormalise(w: Tensor) -> Tensor:
    """Rows scaled to sum to 1; rows without weight stay 0."""
    total = w.sum(-1, keepdim=True)
    return w / torch.where(total > 0, total, 1.0)


def top_r(alpha: Tensor, r: int) -> Tensor:
    """OVO-r: the r largest weights of each row, renormalised. (B, h, N, N) -> (B, h, N, N)."""
    r = min(r, alpha.shape[-1])
    top, idx = alpha.topk(r, dim=-1)
    return renormalise(torch.zeros_like(alpha).scatter(-1, idx, top))


def last_r(allowed: Tensor, r: int) -> Tensor:
    """The r most recent allowed keys of each row (bool, same shape): allowed keys with at most r allowed keys at
    or after them."""
    from_right = allowed.flip(-1).cumsum(-1).flip(-1)
    return allowed & (from_right <= r)


def lsh_keep(call: HeadCall, r: int, rounds: int, seed: int) -> Tensor:
    """The keys LSH-r keeps (module docstring): (B, h, N, N) bool."""
    q, k, allowed = call.q, call.k, call.allowed
    h, D, N = q.shape[1], q.shape[-1], q.shape[2]
    buckets = default_lsh_settings(N)[0]
    rotations = lsh_rotations(h, D, buckets, rounds, seed=seed)
    hq = lsh_hash(F.normalize(q.float(), dim=-1), rotations)  # (B, h, rounds, N)
    hk = lsh_hash(F.normalize(k.float(), dim=-1), rotations)
    keep = torch.zeros_like(allowed)
    for i in range(rounds):
        keep |= last_r(allowed & (hq[:, :, i, :, None] == hk[:, :, i, None, :]), r)
    empty = ~keep.any(-1, keepdim=True)
    return keep | (empty & last_r(allowed, 1))


def feature_weights(call: HeadCall, m: int, seed: int, chunk: int = 16) -> Tensor:
    """Performer's estimate of the softmax weights with m orthogonal random features, normalised over the allowed
    keys. With relative positions each pair's key is k_j + a^K_ij, so the key features are per pair (computed
    ``chunk`` queries at a time)."""
    group = call.group
    if group.kernel != "exp":
        raise ValueError(f"random features estimate the exponential kernel only; layer {call.layer}'s "
                         f"{call.kind} heads use kernel {group.kernel!r}")
    q, k = call.q, group.reference_keys(call.q, call.k)
    B, h, N, D = q.shape
    gen = torch.Generator().manual_seed(seed)
    projection = orthogonal_features(h, m, D, generator=gen, device=q.device, dtype=q.dtype)
    phi_q = performer_features(q, projection, group.scale, query=True)  # (B, h, N, m)
    if call.rel_pos is None:
        phi_k = performer_features(k, projection, group.scale, query=False)
        weights = phi_q @ phi_k.transpose(-1, -2)
    else:
        pos = torch.arange(N, device=q.device)
        rows = []
        for start in range(0, N, chunk):
            i = pos[start:start + chunk]
            a_key, _ = call.rel_pos.tables(pos[None, :] - i[:, None], q.dtype)  # (c, N, D)
            keys = (k[:, :, None] + a_key).flatten(2, 3)  # (B, h, c·N, D)
            phi = performer_features(keys, projection, group.scale, query=False).view(B, h, len(i), N, m)
            rows.append(torch.einsum("bhcm,bhcnm->bhcn", phi_q[:, :, start:start + chunk], phi))
        weights = torch.cat(rows, 2)
    return renormalise(weights * call.allowed)


# --- optimal-v-aware-r ---------------------------------------------------------------------------------------------

def ova_weights(alpha: Tensor, o: Tensor, values: PairValues, r: int, iterations: int = 60, *,
                allowed: Tensor | None = None) -> Tensor:
    """OVA-r weights (B, h, N, N): at most r non-zero per row, non-negative, summing to 1, whose output is the
    nearest to ``o`` this algorithm finds (module docstring).

    ``allowed`` (B, h, N, N) bool: the keys a query may use (default α > 0).
    r = 1: the value nearest o. r >= D + 1, or a row with at most r keys: α itself (exact; by Carathéodory some
    D + 1 of its values give the same point, not computed here). Otherwise the best,
    per row, of: OVO-r's weights; OVO-r's keys with weights refitted by projected gradient on the simplex; and
    greedy fully-corrective selection (Frank-Wolfe vertices added one at a time from the OVA-1 point, all weights
    refitted after each). Cost O(N² · (D + r)) per head plus O(N · r² · iterations) for the refits."""
    D = o.shape[-1]
    allowed = alpha > 0 if allowed is None else allowed
    count = allowed.sum(-1, keepdim=True)  # (B, h, N, 1)
    if r > D:
        return alpha
    norms = values.square_norms()
    nearest = (norms - 2 * values.dots(o)).masked_fill(~allowed, float("inf")).argmin(-1, keepdim=True)
    single = torch.zeros_like(alpha).scatter(-1, nearest, 1.0) * (count > 0)
    if r == 1:
        best = single
    else:
        ovo = top_r(alpha, r)
        candidates = [ovo, _refit_support(ovo, o, values, iterations), _greedy(single, o, values, allowed, r,
                                                                               iterations)]
        best = _pick_nearest(candidates, o, values)
    return torch.where(count <= r, alpha, best)


def _pick_nearest(candidates: list[Tensor], o: Tensor, values: PairValues) -> Tensor:
    """Per row, the candidate weights whose output is nearest o."""
    errors = torch.stack([(values.combine(w) - o).square().sum(-1) for w in candidates])  # (C, B, h, N)
    pick = errors.argmin(0)[..., None]  # (B, h, N, 1)
    best = candidates[0]
    for i, w in enumerate(candidates[1:], 1):
        best = torch.where(pick == i, w, best)
    return best


def _support(w: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """The (at most) ``size`` largest entries of each row: (indices, weights), each (B, h, N, size)."""
    top, idx = w.topk(min(size, w.shape[-1]), dim=-1)
    return idx, top


def _refit_support(w: Tensor, o: Tensor, values: PairValues, iterations: int) -> Tensor:
    """The weights on w's non-zero keys that bring the output nearest o (projected gradient from w)."""
    size = int((w > 0).sum(-1).max())
    idx, start = _support(w, max(size, 1))  # rows with fewer keys get zero-weight entries: kept at zero
    fitted = _simplex_fit(values.gather(idx), o, start, iterations, valid=start > 0)
    return torch.zeros_like(w).scatter(-1, idx, fitted)


def _greedy(single: Tensor, o: Tensor, values: PairValues, allowed: Tensor, r: int, iterations: int) -> Tensor:
    """Fully-corrective Frank-Wolfe from one vertex: r - 1 times add the key whose value most decreases the
    distance to o along the gradient, then refit every weight on the support."""
    idx, weights = _support(single, 1)  # (B, h, N, 1)
    u = values.gather(idx)  # (B, h, N, t, D): the support's values
    for _ in range(r - 1):
        x = (weights[..., None] * u).sum(-2)  # current point (B, h, N, D)
        scores = values.dots(x - o).masked_fill(~allowed, float("inf"))
        scores = scores.scatter(-1, idx, float("inf"))  # keys already in the support
        new = scores.argmin(-1, keepdim=True)
        new = torch.where(torch.isinf(scores.gather(-1, new)), idx[..., :1], new)  # no key left: repeat one
        idx, u = torch.cat([idx, new], -1), torch.cat([u, values.gather(new)], -2)
        weights = _simplex_fit(u, o, torch.cat([weights, torch.zeros_like(new, dtype=o.dtype)], -1), iterations)
    return torch.zeros_like(single).scatter_add(-1, idx, weights)


def _simplex_fit(u: Tensor, o: Tensor, start: Tensor, iterations: int, valid: Tensor | None = None) -> Tensor:
    """argmin over the simplex of |Σ_t w_t u_t - o|² by projected gradient from ``start`` (feasible), step 1/L
    with L >= the largest eigenvalue of the Gram matrix (its largest absolute row sum, Gershgorin), keeping the best
    iterate. Entries where ``valid`` is False stay 0 (a row with none keeps ``start``). u (..., t, D), o (..., D),
    start and valid (..., t) -> (..., t)."""
    gram = u @ u.transpose(-1, -2)  # (..., t, t)
    linear = (u @ o[..., None])[..., 0]  # (..., t)
    lipschitz = gram.abs().sum(-1).amax(-1, keepdim=True).clamp_min(1e-12)
    excluded = torch.finfo(start.dtype).min / (4 * start.shape[-1])  # sorts last; their sums stay finite

    def objective(gw: Tensor, w: Tensor) -> Tensor:  # |u w - o|² - |o|², given gw = gram w
        return (gw * w).sum(-1) - 2 * (linear * w).sum(-1)

    # gram w serves both the objective at w and the next step's gradient: one small batched product per iteration
    w = best = start
    gw = (gram @ w[..., None])[..., 0]
    best_value = objective(gw, start)
    for _ in range(iterations):
        grad = gw - linear
        step = w - grad / lipschitz
        w = project_simplex(step) if valid is None else project_simplex(step.masked_fill(~valid, excluded)) * valid
        gw = (gram @ w[..., None])[..., 0]
        value = objective(gw, w)
        better = value < best_value
        best = torch.where(better[..., None], w, best)
        best_value = torch.where(better, value, best_value)
    return best if valid is None else torch.where(valid.any(-1, keepdim=True), best, start)


def project_simplex(x: Tensor) -> Tensor:
    """Euclidean projection of each row (last dim) onto {w >= 0, Σ w = 1} (sort-based, Held et al.)."""
    t = x.shape[-1]
    sorted_x = x.sort(-1, descending=True).values
    cumulative = sorted_x.cumsum(-1) - 1
    ks = torch.arange(1, t + 1, device=x.device, dtype=x.dtype)
    active = sorted_x - cumulative / ks > 0
    rho = active.to(torch.long).cumsum(-1).argmax(-1, keepdim=True)  # last active index
    theta = cumulative.gather(-1, rho) / (rho + 1).to(x.dtype)
    return (x - theta).clamp_min(0)
