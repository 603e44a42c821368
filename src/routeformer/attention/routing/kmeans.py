"""Online spherical k-means: the centroids that route queries and keys (Roy et al. 2020, Bottou and Bengio 1995).

The forward pass only *observes*: in training mode it adds per-cluster sums and counts of the routing vectors it
assigned to pending statistics. Centroids move only in ``update()``, an explicit step the trainer calls after
``optimizer.step()``. So:
- activation recomputation cannot count a batch twice (a forward that runs inside a backward pass, which is what
  recomputation is, observes nothing);
- evaluation never moves centroids (it observes nothing);
- under ``torch.distributed`` the pending statistics are all-reduced before the update, so every rank applies the
  same arithmetic to the same numbers and the centroids stay bit-identical.

Update (exponential moving average of sums and counts, decay λ):
    S_c ← λ S_c + (1 - λ) Σ_{r assigned to c} r,      n_c ← λ n_c + (1 - λ) |{r assigned to c}|,
    μ_c = normalise(S_c / (n_c + ε)).
For unit-norm centroids only the direction of S_c matters; ε (the smoothing constant) keeps the division finite.
Empty clusters: a cluster that receives no vector keeps its centroid (its EMA sum shrinks, its direction does not
change), so it stays available to later batches; it is never re-seeded.
Initialisation: the first ``update()`` seeds the centroids from a sample of the routing vectors of every training
forward since construction (evenly spaced within each forward, gathered from every rank in rank order) by greedy
k-means++ and a few spherical Lloyd iterations, with a fixed seed, then broadcasts rank 0's result. Because the
loader gives rank r rows [r·B/W, (r+1)·B/W) of the global batch, micro-batch-major within a rank, the sample is the
same whether a step's batch runs as W processes or as W micro-batches of one process. Until then the centroids are
random unit vectors.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...checks import positive_int

_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
# Forwards whose samples are kept for initialisation (a bound, should update() never be called).
MAX_SAMPLE_PARTS = 256


def recomputing() -> bool:
    """True inside a backward pass: a forward run there is activation recomputation (both checkpoint flavours).

    Uses the autograd engine's current graph task (-1 outside backward), which PyTorch's own checkpointing
    relies on. Under torch.compile the check is skipped: compiled recomputation does not replay the statistics'
    in-place updates.
    """
    if torch.compiler.is_compiling():
        return False
    if _graph_task_id is None:  # pragma: no cover - a PyTorch without it: recomputation cannot be detected
        warnings.warn("routeformer: this PyTorch cannot tell recomputation apart; k-means statistics may be "
                      "counted twice under activation checkpointing", stacklevel=2)
        return False
    return _graph_task_id() != -1


class SphericalKMeans(nn.Module):
    """k unit centroids per head, learned online; ``centroids`` is (H, k, D).

    Args:
        heads, dim, num_clusters: H, D, k.
        decay: λ of the moving averages (0.999 as in the paper).
        eps: smoothing constant of the counts.
        init_iters: spherical Lloyd iterations after k-means++ seeding.
        init_samples: routing vectors per head kept from each training forward before the first update, to seed the
            centroids.
    """

    def __init__(self, heads: int, dim: int, num_clusters: int, decay: float = 0.999, eps: float = 1e-6,
                 init_iters: int = 10, init_samples: int = 4096) -> None:
        super().__init__()
        heads, dim = positive_int("heads", heads), positive_int("dim", dim)
        num_clusters = positive_int("num_clusters", num_clusters)
        if not 0.0 <= float(decay) < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        self.decay, self.eps = float(decay), float(eps)
        self.init_iters = int(init_iters)
        self.init_samples = positive_int("init_samples", init_samples)
        gen = torch.Generator().manual_seed(0)
        start = nn.functional.normalize(torch.randn(heads, num_clusters, dim, generator=gen), dim=-1)
        self.register_buffer("centroids", start)  # (H, k, D), unit norm
        self.register_buffer("ema_sums", start.clone())  # (H, k, D)
        self.register_buffer("ema_counts", torch.ones(heads, num_clusters))  # (H, k)
        self.register_buffer("initialized", torch.tensor(False))
        # Statistics observed since the last update; not saved with the model.
        self.register_buffer("pending_sums", torch.zeros(heads, num_clusters, dim), persistent=False)
        self.register_buffer("pending_counts", torch.zeros(heads, num_clusters), persistent=False)
        # Samples for initialisation, one (H, m, D) part and its (m,) validity per training forward before the first
        # update. A python mirror of `initialized` lets the forward decide without reading a tensor (no graph break
        # under torch.compile).
        self._sample_parts: list[tuple[Tensor, Tensor]] = []
        self._ready = False

    # H, D and k are the centroids' shape, kept nowhere else
    @property
    def heads(self) -> int:
        return self.centroids.shape[0]

    @property
    def num_clusters(self) -> int:
        return self.centroids.shape[1]

    @property
    def dim(self) -> int:
        return self.centroids.shape[2]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._ready = bool(self.initialized)
        if self._ready:
            self._sample_parts.clear()

    @torch.no_grad()
    def scores(self, r: Tensor, clusters: slice = slice(None)) -> Tensor:
        """Cosine of each unit routing vector to each centroid (or to the centroids ``clusters``, a slice of them):
        r (B, H, N, D) -> (B, H, N, k), float32 or wider."""
        acc = torch.promote_types(r.dtype, torch.float32)
        with torch.autocast(r.device.type, enabled=False):
            return torch.einsum("bhnd,hkd->bhnk", r.detach().to(acc), self.centroids[:, clusters].to(acc))

    def assign(self, r: Tensor) -> Tensor:
        """Nearest centroid (largest cosine) of each unit routing vector: r (B, H, N, D) -> (B, H, N) long."""
        return self.scores(r).argmax(-1)

    def commitment(self, r: Tensor, clusters: Tensor, valid: Tensor | None = None,
                   cosine: Tensor | None = None) -> Tensor:
        """Mean over positions of ||r - sg(μ_c)||² (scalar), the commitment term, for unit r and μ_c as 2 - 2 cos(r,
        μ_c); ``valid`` (B, N) excludes padding. ``cosine`` (B, H, N): each vector's cosine to its centroid where a
        router's kernel gave it (``executors.routes.Routed``), else r · μ_c here. One form for every router: on a
        float32-orthonormal W_R, ||r - μ||² and 2 - 2 cos differ by ~1e-7 relative, and the paths would disagree.

        The gradient at r is that form's own, -2 μ_c w / Σw; at the queries it is the squared distance's (the two
        differ along r, which the normalisation before W_R drops). The forward keeps no (B, H, N, D) tensor (a
        kernel's cosines make it a (B, H, N) pass), nor does the backward need r."""
        if cosine is None:
            with torch.no_grad():
                H = self.heads
                mu = self.centroids[torch.arange(H, device=r.device)[None, :, None], clusters]  # (B, H, N, D)
                acc = torch.promote_types(r.dtype, torch.float32)
                cosine = (r.to(acc) * mu.to(acc)).sum(-1)
        return _Commitment.apply(r, self.centroids.detach(), clusters, cosine.detach(), valid)

    def counting(self) -> bool:
        """Whether a forward now counts towards the next update: training mode, and not a recomputation."""
        return self.training and not recomputing()

    @torch.no_grad()
    def observe(self, r: Tensor, clusters: Tensor, valid: Tensor | None = None) -> None:
        """Add the statistics of one training forward: r (B, H, N, D) unit vectors, clusters (B, H, N)."""
        if not self.counting():
            return
        B, H, N, D = r.shape
        r = r.to(self.pending_sums.dtype)
        flat = (torch.arange(H, device=r.device)[None, :, None] * self.num_clusters + clusters)  # (B, H, N)
        weight = (torch.ones(B, H, N, device=r.device, dtype=r.dtype) if valid is None
                  else valid[:, None, :].to(r.dtype).expand(B, H, N))
        self.pending_counts.view(-1).index_add_(0, flat.reshape(-1), weight.reshape(-1))
        self.pending_sums.view(-1, D).index_add_(0, flat.reshape(-1), (r * weight[..., None]).reshape(-1, D))
        if not self._ready and len(self._sample_parts) < MAX_SAMPLE_PARTS:
            self._keep_samples(r, valid)

    @torch.no_grad()
    def add_reduced(self, r: Tensor, sums: Tensor, counts: Tensor, valid: Tensor | None = None) -> None:
        """``observe`` with the statistics reduced elsewhere (the fused router): sums (H, k, D) and counts (H, k) of
        the real positions of r (B, H, N, D) (``valid`` (B, N)); r and valid are kept as samples until the first
        update."""
        if not self.counting():
            return
        self.pending_sums += sums.to(self.pending_sums.dtype)
        self.pending_counts += counts.to(self.pending_counts.dtype)
        if not self._ready and len(self._sample_parts) < MAX_SAMPLE_PARTS:
            self._keep_samples(r.to(self.pending_sums.dtype), valid)

    def _keep_samples(self, r: Tensor, valid: Tensor | None) -> None:
        """Keep up to ``init_samples`` routing vectors per head of this forward, evenly spaced over its batch."""
        B, H, N, D = r.shape
        total = B * N
        count = min(self.init_samples, total)
        pick = torch.arange(count, device=r.device) * total // count
        per_head = r.permute(1, 0, 2, 3).reshape(H, total, D)
        kept = torch.ones_like(pick, dtype=torch.bool) if valid is None else valid.reshape(-1)[pick]
        self._sample_parts.append((per_head[:, pick].to(self.pending_sums.dtype), kept))

    @torch.no_grad()
    def update(self, group: dist.ProcessGroup | None = None) -> None:
        """Apply the observed statistics (all-reduced across ranks when torch.distributed is initialised).

        Once initialised, no host read of a device tensor (on CUDA none waits for the device): a step that observed
        nothing leaves the state as it is by a selection on the device. Until then the first step with statistics
        is found by reading their total (the seeding, once, reads its samples on the host anyway)."""
        distributed = dist.is_available() and dist.is_initialized()
        if distributed:
            dist.all_reduce(self.pending_sums, group=group)
            dist.all_reduce(self.pending_counts, group=group)
        total = self.pending_counts.sum()
        if self._ready:  # the Python mirror of `initialized`: the same on every rank
            seen = total > 0  # the same value on every rank after the all-reduce
            # Nothing observed: every pending weight was 0, so the statistics are 0 and only the decay must not act.
            keep = torch.where(seen, self.decay, 1.0).to(self.ema_counts.dtype)
            self.ema_counts.mul_(keep).add_(self.pending_counts, alpha=1 - self.decay)
            self.ema_sums.mul_(keep).add_(self.pending_sums, alpha=1 - self.decay)
            means = self.ema_sums / (self.ema_counts[..., None] + self.eps)
            alive = (self.ema_sums.norm(dim=-1, keepdim=True) > 0) & seen
            self.centroids.copy_(torch.where(alive, nn.functional.normalize(means, dim=-1), self.centroids))
        elif float(total) > 0:  # the same value on every rank after the all-reduce
            samples, kept = self._gathered_samples(group) if distributed else self._local_samples()
            self._initialise(samples[:, kept], total)
            if distributed:
                dist.broadcast(self.centroids, src=0, group=group)
            self._sample_parts.clear()
        self.pending_sums.zero_()
        self.pending_counts.zero_()

    def _local_samples(self) -> tuple[Tensor, Tensor]:
        """This process's samples (H, S, D) and their validity (S,), in the order they were observed."""
        if not self._sample_parts:
            return self.pending_sums[:, :0], torch.zeros(0, dtype=torch.bool, device=self.pending_sums.device)
        return (torch.cat([part for part, _ in self._sample_parts], dim=1),
                torch.cat([kept for _, kept in self._sample_parts]))

    def _gathered_samples(self, group: dist.ProcessGroup | None) -> tuple[Tensor, Tensor]:
        """Every rank's samples and their validity, concatenated in rank order."""
        samples, kept = self._local_samples()
        world = dist.get_world_size(group)
        sizes = [torch.zeros(1, dtype=torch.long, device=kept.device) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([kept.numel()], device=kept.device), group=group)
        longest = int(max(sizes))  # all_gather needs equal shapes: pad to the longest, mark the padding invalid
        padded = samples.new_zeros(self.heads, longest, self.dim)
        padded[:, : kept.numel()] = samples
        mask = kept.new_zeros(longest)
        mask[: kept.numel()] = kept
        parts = [torch.zeros_like(padded) for _ in range(world)]
        valid = [torch.zeros_like(mask) for _ in range(world)]
        dist.all_gather(parts, padded, group=group)
        dist.all_gather(valid, mask, group=group)
        return torch.cat(parts, dim=1), torch.cat(valid)

    def _initialise(self, samples: Tensor, total: Tensor) -> None:
        """k-means++ seeding and spherical Lloyd iterations on samples (H, S, D); EMA state scaled to one step."""
        if samples.shape[1] == 0:
            return
        centroids = spherical_kmeans(samples, self.num_clusters, self.init_iters)
        share = total / (self.heads * self.num_clusters)  # the average count of one cluster in one step
        self.centroids.copy_(centroids)
        self.ema_sums.copy_(centroids * share)
        self.ema_counts.fill_(float(share))
        self.initialized.fill_(True)
        self._ready = True

    def extra_repr(self) -> str:
        return f"heads={self.heads}, dim={self.dim}, num_clusters={self.num_clusters}, decay={self.decay}"


def spherical_kmeans(x: Tensor, k: int, iters: int, seed: int = 0) -> Tensor:
    """Batch spherical k-means: x (H, S, D) unit vectors -> centroids (H, k, D), fixed seed.

    Seeding is greedy k-means++ (as in scikit-learn): each new centre is the best, by the potential it leaves, of
    2 + ln k candidates drawn in proportion to the squared distance to the nearest centre so far; plain k-means++
    too often puts two seeds in one tight cluster. Then ``iters`` spherical Lloyd iterations. With fewer samples
    than clusters the remaining centroids are random unit vectors.
    """
    H, S, D = x.shape
    gen = torch.Generator().manual_seed(seed)
    heads = torch.arange(H, device=x.device)
    centroids = nn.functional.normalize(torch.randn(H, k, D, generator=gen), dim=-1).to(x)
    first = torch.randint(S, (H,), generator=gen).to(x.device)
    centroids[:, 0] = x[heads, first]
    dist2 = (2 - 2 * (x * centroids[:, :1]).sum(-1)).clamp_min(0)  # (H, S): squared chord distance
    tries = 2 + int(math.log(k))
    for c in range(1, min(k, S)):
        probs = dist2 / dist2.sum(-1, keepdim=True).clamp_min(1e-12)
        cand = torch.multinomial(probs.cpu().double() + 1e-30, tries, replacement=True, generator=gen).to(x.device)
        cand_d2 = (2 - 2 * torch.einsum("hsd,htd->hts", x, x[heads[:, None], cand])).clamp_min(0)  # (H, tries, S)
        potential = torch.minimum(dist2[:, None], cand_d2).sum(-1)  # (H, tries)
        best = potential.argmin(-1)
        centroids[:, c] = x[heads, cand[heads, best]]
        dist2 = torch.minimum(dist2, cand_d2[heads, best])
    for _ in range(iters):
        assign = torch.einsum("hsd,hkd->hsk", x, centroids).argmax(-1)  # (H, S)
        onehot = nn.functional.one_hot(assign, k).to(x.dtype)  # (H, S, k)
        sums = onehot.transpose(1, 2) @ x  # (H, k, D), a matmul: the same bits on every rank
        filled = onehot.sum(1)[..., None] > 0
        centroids = torch.where(filled, nn.functional.normalize(sums, dim=-1), centroids)
    return centroids


class _Commitment(torch.autograd.Function):
    """``SphericalKMeans.commitment``: the loss from the cosines, mean (2 - 2 r · μ_c), and its own gradient at r,
    -2 μ_c w / Σw. The squared distance's, 2 (r - μ_c) w / Σw, differs from it by 2 r w / Σw, which never reaches q:
    r is the unit vector x / |x| turned by W_R (orthonormal), and the normalisation's backward drops what lies along
    x / |x| (test_kmeans checks q's gradient against the distance's under autograd). So r is not kept for the
    backward (at 65,536 positions and 8 heads, 128 MiB of float32 a routing layer no longer holds), and the backward
    is one pass over (B, H, N, D) after gathering the centroids by row (``index_select``: at 16k positions and 8
    heads 3.0 ms against 5-7 for indexing by (head, cluster) pairs, docs/benchmarks.md)."""

    @staticmethod
    def forward(ctx, r, centroids, clusters, cosine, valid):  # type: ignore[override]
        err = 2.0 - 2.0 * cosine.to(torch.promote_types(cosine.dtype, torch.float32))  # (B, H, N)
        if valid is None:
            weight, total = None, err.numel()
            loss = err.mean()
        else:
            weight = valid[:, None, :].to(err.dtype)  # (B, 1, N)
            total = (weight.sum() * err.shape[1]).clamp_min(1.0)
            loss = (err * weight).sum() / total
        ctx.save_for_backward(centroids, clusters, weight)
        ctx.twice_share = 2.0 / total  # a number, or a 0-d tensor with padding
        ctx.shape, ctx.dtype = r.shape, r.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        centroids, clusters, weight = ctx.saved_tensors
        H, k, D = centroids.shape
        rows = (torch.arange(0, H * k, k, device=clusters.device)[None, :, None] + clusters).reshape(-1)  # (B·H·N,)
        mu = centroids.reshape(H * k, D).index_select(0, rows).view(ctx.shape)  # (B, H, N, D), a fresh tensor
        acc = torch.promote_types(ctx.dtype, torch.float32)
        per_position = grad * -ctx.twice_share  # the distance's -2 on μ_c, and the mean's (or weighted sum's)
        if weight is not None:
            per_position = (per_position * weight)[..., None]  # (B, 1, N, 1): 0 on padding
        return mu.to(acc).mul_(per_position).to(ctx.dtype), None, None, None, None
