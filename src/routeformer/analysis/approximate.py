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
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention.lsh import default_lsh_settings, lsh_hash, lsh_rotations
from ..attention.performer import orthogonal_features, performer_features
from ..executors.relative import RelativePositions
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


def feature_weights(call: HeadCall, m: int, seed: int) -> Tensor:
    """Performer's estimate of the softmax weights with m orthogonal random features, normalised over the allowed
    keys. With relative positions each pair's key is k_j + a^K_ij, so the key features are per pair
    (``relative_feature_scores``)."""
    group = call.group
    if group.kernel != "exp":
        raise ValueError(f"random features estimate the exponential kernel only; layer {call.layer}'s "
                         f"{call.kind} heads use kernel {group.kernel!r}")
    q, k = call.q, group.reference_keys(call.q, call.k)
    h, D = q.shape[1], q.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    projection = orthogonal_features(h, m, D, generator=gen, device=q.device, dtype=q.dtype)
    phi_q = performer_features(q, projection, group.scale, query=True)  # (B, h, N, m)
    if call.rel_pos is None:
        phi_k = performer_features(k, projection, group.scale, query=False)
        weights = phi_q @ phi_k.transpose(-1, -2)
    else:
        weights = relative_feature_scores(phi_q, k, projection, group.scale, call.rel_pos,
                                          seen=call.allowed.flatten(0, 1).any(0))
    return renormalise(weights * call.allowed)


def relative_feature_scores(phi_q: Tensor, k: Tensor, projection: Tensor, scale: float, rel_pos: RelativePositions,
                            seen: Tensor | None = None) -> Tensor:
    """Σ_r φ_r(q_i) φ_r(k_j + a^K_ij) for every pair (i, j): phi_q (B, h, N, m) the queries' features, k (B, h, N, D)
    the keys, projection (h, m, D) -> (B, h, N, N), with φ of keys as ``performer_features(..., query=False)``.
    ``seen`` (N, N) bool: the pairs wanted (default all); the others may come back 0.

    a^K_ij = a_d depends on d = clip(j - i) only: one value per diagonal j - i = d inside the clip distance, and
    one for each corner beyond. The key features' exponent at x = √s (k_j + a_d),
    w_r·x - |w_r|²/2 - ln(m)/2 - |x|²/2, splits into a term of j (the features' exponent of √s k_j), a term of
    (d, r) (√s w_r·a_d) and a term of (j, d) (-s k_j·a_d - s|a_d|²/2), each a small product: a diagonal's features
    are then two additions and one exp per entry instead of the widened (D + 2)-long product of every pair's own
    key, and only the diagonals with a wanted pair are computed (a causal head's half, a local head's band). A
    corner's keys k_j + a_{±clip} are the same for every query: one matrix product."""
    B, h, N, m = phi_q.shape
    clip = rel_pos.max_distance
    root = math.sqrt(scale)
    w = projection.to(k.dtype)  # (h, m, D)
    x = k * root  # (B, h, N, D)
    table = rel_pos.key.detach().to(k.dtype) * root  # (2·clip + 1, D): √s a_d in row d + clip
    # performer_features' key exponent of √s k_j (B, h, N, m), the position's part (h, 2·clip + 1, m) and the
    # cross term (B, h, N, 2·clip + 1): their sum is the exponent of √s (k_j + a_d)
    own = (x @ w.transpose(-1, -2) - 0.5 * w.square().sum(-1)[:, None, :]
           - 0.5 * x.square().sum(-1, keepdim=True) - 0.5 * math.log(m))
    position = (table @ w.transpose(-1, -2))[None, :, None]  # (1, h, 1, 2·clip + 1, m)
    cross = -(x @ table.T) - 0.5 * table.square().sum(-1)

    def exponent(keys: slice, row: int) -> Tensor:  # of the keys k_j + a_d, j in ``keys``, d in ``row``: (B, h, n, m)
        return own[:, :, keys] + position[:, :, :, row] + cross[:, :, keys, row, None]

    pos = torch.arange(N, device=k.device)
    offsets = pos[None, :] - pos[:, None]  # (N, N): j - i
    wanted = torch.zeros(2 * N - 1, dtype=torch.bool, device=k.device)  # the offsets j - i + N - 1 of wanted pairs
    wanted[(offsets if seen is None else offsets[seen]).flatten() + N - 1] = True
    used: list[bool] = wanted.tolist()
    scores = phi_q.new_zeros(B, h, N, N)
    inner = min(clip, N)
    for d in range(1 - inner, inner):  # the diagonals j - i = d with their own a_d
        if used[d + N - 1]:
            lo, hi = max(0, -d), min(N, N - d)  # its queries i; their keys are i + d
            features = exponent(slice(lo + d, hi + d), d + clip).exp_()
            scores.diagonal(d, -2, -1).copy_((phi_q[:, :, lo:hi] * features).sum(-1))
    # the corners: j - i <= -clip (a_{-clip}) and j - i >= clip (a_clip), one key per j in each; their blocks also
    # hold diagonals' pairs, which the triangle adds 0 to
    if clip < N:
        if any(used[:N - clip]):  # queries i >= clip, keys j <= i - clip
            phi_k = exponent(slice(0, N - clip), 0).exp_()
            scores[:, :, clip:, :N - clip] += (phi_q[:, :, clip:] @ phi_k.transpose(-1, -2)).tril()
        if any(used[N - 1 + clip:]):  # queries i < N - clip, keys j >= i + clip
            phi_k = exponent(slice(clip, N), 2 * clip).exp_()
            scores[:, :, :N - clip, clip:] += (phi_q[:, :, :N - clip] @ phi_k.transpose(-1, -2)).triu()
    return scores


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
    # +inf on the keys a query may not use, 0 elsewhere: added to a score it excludes the key, as masked_fill would,
    # at a tenth of the cost per greedy step (masked_fill with a (B, h, N, N) mask is slow on the CPU)
    blocked = torch.zeros_like(alpha).masked_fill_(~allowed, float("inf"))
    norms = values.square_norms()
    nearest = (norms - 2 * values.dots(o) + blocked).argmin(-1, keepdim=True)
    single = torch.zeros_like(alpha).scatter(-1, nearest, 1.0) * (count > 0)
    if r == 1:
        best = single
    else:
        # A row whose query sees at most r keys keeps α (feasible, hence exact), so only the others are fitted: all
        # of a routing head's rows at r >= its window, and the first r rows of every causal head.
        rows = count[..., 0] > r  # (B, h, N)
        if not bool(rows.any()):
            return alpha
        ovo = top_r(alpha, r)
        candidates = [ovo, _refit_support(ovo, o, values, iterations, rows, r),
                      _greedy(single, o, values, blocked, r, iterations, rows)]
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


def _refit_support(w: Tensor, o: Tensor, values: PairValues, iterations: int, rows: Tensor, size: int) -> Tensor:
    """The weights on w's non-zero keys (at most ``size`` a row) that bring the output nearest o (projected gradient
    from w), on ``rows`` (B, h, N) bool; the other rows keep w. ``size`` is the fit's width whatever the rows hold:
    its rounding depends on it, and a width read off the rows would let a later query's keys change an earlier
    query's rounding (a causal analysis must not)."""
    idx, start = _support(w, max(size, 1))  # rows with fewer keys get zero-weight entries: kept at zero
    valid = start > 0
    rows = rows & valid.any(-1)  # a row without weight has nothing to refit
    fitted = start.clone()
    fitted[rows] = _simplex_fit(values.gather(idx)[rows], o[rows], start[rows], iterations, valid=valid[rows])
    return torch.zeros_like(w).scatter(-1, idx, fitted)


def _greedy(single: Tensor, o: Tensor, values: PairValues, blocked: Tensor, r: int, iterations: int,
            rows: Tensor) -> Tensor:
    """Fully-corrective Frank-Wolfe from one vertex: r - 1 times add the key whose value most decreases the
    distance to o along the gradient, then refit every weight on the support. ``blocked`` (B, h, N, N): +inf on
    the keys a query may not use, else 0. Only ``rows`` (B, h, N) bool are fitted (the others come back without
    weight; ``ova_weights`` keeps α there).

    The support of the R fitted rows lives in slots of preallocated (r, R, ...) tensors, rows last as
    ``_fit_columns`` takes them: a step adds its key's value, one row and column of the Gram matrix and one entry
    of u · o, instead of gathering every value and rebuilding the Gram matrix."""
    idx, _ = _support(single, 1)  # (B, h, N, 1): the OVA-1 key
    target = o[rows]  # (R, D)
    R, D = target.shape
    u = o.new_empty(r, R, D)  # the support's values u_b
    gram = o.new_empty(r, r, R)  # u_a · u_b (symmetric: gram[b] is column b)
    linear = o.new_empty(r, R)  # u_b · o
    weights = o.new_zeros(r, R)
    weights[0] = 1.0

    def add(slot: int, key: Tensor) -> None:  # key (B, h, N, 1) into ``slot``
        u[slot] = values.gather(key)[rows][:, 0]
        dots = (u[:slot + 1] * u[slot]).sum(-1)  # (slot + 1, R)
        gram[slot, :slot + 1] = dots
        gram[:slot + 1, slot] = dots
        linear[slot] = (u[slot] * target).sum(-1)

    add(0, idx)
    gradient = torch.zeros_like(o)  # x - o on the fitted rows, 0 elsewhere (their keys are never used)
    for t in range(1, r):
        x = weights[0, :, None] * u[0]  # the current point (R, D)
        for b in range(1, t):
            x.addcmul_(weights[b, :, None], u[b])
        gradient[rows] = x - target
        scores = values.dots(gradient).add_(blocked)
        scores.scatter_(-1, idx, float("inf"))  # keys already in the support
        new = scores.argmin(-1, keepdim=True)
        new = torch.where(torch.isinf(scores.gather(-1, new)), idx[..., :1], new)  # no key left: repeat one
        idx = torch.cat([idx, new], -1)
        add(t, new)
        weights[:t + 1] = _fit_columns(gram[:t + 1, :t + 1], linear[:t + 1], weights[:t + 1], iterations)
    full = o.new_zeros(*rows.shape, r)
    full[rows] = weights.T
    return torch.zeros_like(single).scatter_add(-1, idx, full)


def _simplex_fit(u: Tensor, o: Tensor, start: Tensor, iterations: int, valid: Tensor | None = None) -> Tensor:
    """argmin over the simplex of |Σ_t w_t u_t - o|² by projected gradient from ``start`` (feasible), step 1/L
    with L >= the largest eigenvalue of the Gram matrix (its largest absolute row sum, Gershgorin), keeping the best
    iterate. Entries where ``valid`` is False stay 0 (a row with none keeps ``start``). u (..., t, D), o (..., D),
    start and valid (..., t) -> (..., t)."""
    shape, t = start.shape, start.shape[-1]
    u, o, start = u.reshape(-1, t, u.shape[-1]), o.reshape(-1, o.shape[-1]), start.reshape(-1, t)
    gram = u @ u.transpose(-1, -2)  # (R, t, t)
    linear = (u @ o[..., None])[..., 0]  # (R, t)
    excluded = None
    if valid is not None:
        valid = valid.reshape(-1, t)
        # sorts below every valid entry, and its sums stay finite; added, it swamps the step (|step| << its ulp)
        excluded = (~valid).T.to(start.dtype) * (torch.finfo(start.dtype).min / (4 * t))
    best = _fit_columns(gram.permute(2, 1, 0), linear.T, start.T, iterations, excluded).T
    if valid is not None:
        best = torch.where(valid.any(-1, keepdim=True), best, start)
    return best.reshape(shape)


def _fit_columns(gram: Tensor, linear: Tensor, start: Tensor, iterations: int,
                 excluded: Tensor | None = None) -> Tensor:
    """``_simplex_fit`` on R rows laid out last: gram (t, t, R) with gram[b] the Gram matrix's column b, linear
    u_b · o (t, R), start (t, R) -> (t, R); ``excluded`` (t, R): a huge negative number where an entry must stay 0,
    else 0.

    Rows last because the rows are many (B·h·N) and the support small (t <= r): every operation is then one
    vectorised pass over R contiguous numbers per entry, with no sort and no bool tensor (PyTorch's comparisons
    into bool and ``where`` cost ten times an addition at this size), so the 60 iterations' few dozen operations
    stay cheap."""
    gram, linear, w = gram.contiguous(), linear.contiguous(), start.contiguous()
    lipschitz = _rows_sum(gram.abs()).amax(0).clamp_min(1e-12)  # (R,)

    def gram_times(w: Tensor) -> Tensor:  # (t, R): Σ_b gram[:, b] w_b, one multiply-add per column
        out = gram[0] * w[0]
        for b in range(1, len(w)):
            out.addcmul_(gram[b], w[b])
        return out

    def objective(gw: Tensor, w: Tensor) -> Tensor:  # |u w - o|² - |o|², given gw = gram w: (R,)
        return _rows_sum(gw * w) - 2 * _rows_sum(linear * w)

    # gram w serves both the objective at w and the next step's gradient
    gw = gram_times(w)
    best, best_value = w, objective(gw, w)
    theta = torch.full_like(lipschitz, -math.inf)  # the projection's threshold, carried to the next iteration
    for _ in range(iterations):
        step = w - (gw - linear) / lipschitz
        if excluded is not None:
            step = step + excluded
        w, theta = _project_columns(step, theta)
        gw = gram_times(w)
        value = objective(gw, w)
        best = torch.lerp(best, w, (value < best_value).to(w.dtype))  # weight 0 or 1: exactly best or w
        best_value = torch.minimum(value, best_value)
    return best


def _rows_sum(x: Tensor) -> Tensor:
    """x (t, ...) summed over its first dimension one row after the other: each column's sum in the same order
    whatever the number of columns and its place among them (``sum(0)`` vectorises across columns, and a column in
    a vector's tail is added in another order: the columns are the rows of every query, so a later query's keys
    would change an earlier query's rounding, which a causal analysis must not)."""
    out = x[0].clone()
    for row in x[1:]:
        out.add_(row)
    return out


def _project_columns(x: Tensor, theta: Tensor) -> tuple[Tensor, Tensor]:
    """``project_simplex`` of each column of x (t, R), and the thresholds θ (R,) with projection max(x - θ, 0).

    θ is the root of Σ_t max(x_t - θ, 0) = 1, found by Newton's method (Michelot's: θ = (Σ of the entries above
    θ - 1) / their count) from ``theta``, the previous iteration's root, clamped into [max x - 1, max x - 1/t],
    which holds the root and keeps an entry above θ. From above the root, one step lands at or below it; from
    below, each step drops the entries under θ and the count only falls, so it stops when the count stops
    changing (at most t + 2 steps). After the first two steps an entry once dropped stays dropped, which rounding
    could otherwise undo (and cycle). Near convergence the previous root is a step or two away: a projection costs
    a few passes over x instead of a sort of every row."""
    t = x.shape[0]
    top = x.amax(0)
    theta = torch.minimum(torch.maximum(theta, top - 1), top - 1 / t)
    count = None
    kept = torch.empty_like(x)  # 1.0 where an entry is above θ (compared into floats: bool tensors are slow here)
    moving = torch.ones_like(theta)  # 1.0 for the columns still taking steps: each stops by its own count, so
    # that a column's steps (and rounding) never depend on the other columns (the other queries)
    for step in range(t + 3):
        above = (x - theta).clamp_min_(0)
        if step >= 2:  # below the root from the second step on: the entries above it only shrink
            above *= kept
        total = _rows_sum(above)
        new = torch.gt(above, 0, out=kept).sum(0)  # whole numbers: exact in any order
        theta = theta + moving * ((total - 1) / new)
        if count is not None:
            moving = moving * torch.ne(new, count).to(moving.dtype)  # its count stopped changing: done
            if not bool(moving.any()):
                break
        count = new
    return (x - theta).clamp_min_(0), theta


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
