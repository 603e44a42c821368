"""Online spherical k-means: it finds planted centres, updates once per step, and agrees across ranks."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from helpers import rand_padding, rand_qkv, routing_layer
from routeformer.attention import RoutingAttention, SphericalKMeans, update_routing


def test_recovers_well_separated_planted_centres() -> None:
    g = torch.Generator().manual_seed(0)
    H, k, D, per = 2, 5, 16, 300
    centres = F.normalize(torch.randn(H, k, D, generator=g), dim=-1)
    points = centres.repeat_interleave(per, dim=1) + 0.05 * torch.randn(H, k * per, D, generator=g)
    r = F.normalize(points[:, torch.randperm(k * per, generator=g)], dim=-1)[None]  # (1, H, N, D)
    km = SphericalKMeans(H, D, k, decay=0.5)
    km.train()
    for _ in range(5):
        km.observe(r, km.assign(r))
        km.update()
    assert bool(km.initialized)
    cos = torch.einsum("hkd,hcd->hkc", km.centroids, centres)  # learned x planted
    assert (cos.max(1).values > 0.99).all(), "every planted centre has a centroid on it"
    assert all(len(set(cos[h].argmax(1).tolist())) == k for h in range(H)), "one centroid per centre"
    assert torch.allclose(km.centroids.norm(dim=-1), torch.ones(H, k))


def test_evaluation_observes_nothing_and_an_empty_update_changes_nothing() -> None:
    layer = routing_layer(2, 8, 3, 4).eval()
    q, _, v = rand_qkv(1, 2, 20, 8, dtype=torch.float32, grad=False)
    before = layer.routing.kmeans.centroids.clone()
    layer(q, q, v)
    assert layer.routing.kmeans.pending_counts.sum() == 0
    layer.update()
    assert torch.equal(layer.routing.kmeans.centroids, before)


def test_an_empty_update_after_seeding_changes_nothing_and_reads_nothing_on_the_host() -> None:
    """Once seeded, the update selects on the device whether anything was observed (no host read, which would
    wait for the device on CUDA); a step that observed nothing leaves every statistic as it was, bit for bit."""
    from routeformer.testing import host_reads

    layer = routing_layer(2, 8, 3, 4, balance=0.1, warmup=5).train()
    q, _, v = rand_qkv(1, 2, 20, 8, dtype=torch.float32, grad=False)
    layer(q, q, v)
    layer.update()  # the seeding
    layer(q, q, v)
    layer.update()  # one EMA step, so that the centroids are the EMA's own
    km = layer.routing.kmeans
    state = {name: x.clone() for name, x in layer.state_dict().items()}
    with host_reads() as reads:
        layer.update()  # nothing observed since the last one
    assert reads.found == []
    for name, x in layer.state_dict().items():
        if name.endswith("steps"):
            assert int(x) == int(state[name]) + 1 == layer.routing.updates
        else:
            assert torch.equal(x, state[name]), name
    layer(q, q, v)
    with host_reads() as reads:
        layer.update()
    assert reads.found == [] and not torch.equal(km.ema_counts, state["routing.kmeans.ema_counts"])


def test_initialisation_sees_every_micro_batch_of_the_first_step() -> None:
    """Gradient accumulation: seeding from two micro-batches equals seeding from their concatenation."""
    g = torch.Generator().manual_seed(3)
    r = F.normalize(torch.randn(4, 2, 30, 8, generator=g), dim=-1)  # (B, H, N, D)
    whole, split = SphericalKMeans(2, 8, 5), SphericalKMeans(2, 8, 5)
    whole.train(), split.train()
    whole.observe(r, whole.assign(r))
    for part in r.chunk(2):
        split.observe(part, split.assign(part))
    whole.update(), split.update()
    assert bool(split.initialized)
    torch.testing.assert_close(split.centroids, whole.centroids, rtol=0, atol=1e-6)
    only_first = SphericalKMeans(2, 8, 5).train()
    only_first.observe(r[:2], only_first.assign(r[:2]))
    only_first.update()
    assert not torch.allclose(only_first.centroids, whole.centroids, atol=1e-3)  # the test can tell them apart


def test_empty_clusters_keep_their_centroid() -> None:
    km = SphericalKMeans(1, 4, 3, decay=0.9)
    km.train()
    r = F.normalize(torch.randn(1, 1, 50, 4), dim=-1)
    km.observe(r, km.assign(r))
    km.update()  # initialisation
    stale = km.centroids[0, 2].clone()
    for _ in range(3):
        km.observe(r, torch.zeros(1, 1, 50, dtype=torch.long))  # everything to cluster 0
        km.update()
    assert torch.allclose(km.centroids[0, 2], stale) and torch.isfinite(km.centroids).all()


def _step(layer: RoutingAttention, q: torch.Tensor, v: torch.Tensor, use_checkpoint, padding=None) -> None:
    if use_checkpoint is None:
        out = layer(q, q, v, key_padding_mask=padding)
    else:
        out = checkpoint(lambda a, b: layer(a, a, b, key_padding_mask=padding), q, v, use_reentrant=use_checkpoint)
    (out.square().mean() + layer.commitment_loss).backward()


@pytest.mark.parametrize("reentrant", [False, True])
def test_update_applied_once_per_step_under_activation_checkpointing(reentrant: bool) -> None:
    torch.manual_seed(0)
    plain, ckpt = routing_layer(2, 8, 4, 4, balance=0.1), routing_layer(2, 8, 4, 4, balance=0.1)
    padding = torch.rand(2, 30) > 0.2
    for step in range(3):
        q, _, v = rand_qkv(2, 2, 30, 8, dtype=torch.float32, seed=step)
        _step(plain, q, v, None, padding)
        _step(ckpt, q.detach().clone().requires_grad_(), v.detach().clone().requires_grad_(), reentrant, padding)
        assert ckpt.routing.kmeans.pending_counts.sum() == 2 * int(padding.sum())  # heads × real tokens, once
        torch.testing.assert_close(ckpt.routing.kmeans.pending_counts, plain.routing.kmeans.pending_counts, rtol=0,
                                   atol=0)
        assert torch.equal(ckpt.routing.pending_load, plain.routing.pending_load)  # the cluster loads too
        update_routing(plain)
        update_routing(ckpt)
        assert torch.equal(plain.routing.kmeans.centroids, ckpt.routing.kmeans.centroids)
        assert torch.equal(plain.routing.bias, ckpt.routing.bias)


# Routing with every piece of state that must agree between ranks: centroids, the balancing bias, the warm-up count.
SYNCED = {"decay": 0.9, "probes": 2, "balance": 0.05, "warmup": 2}


def _worker(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    layer = routing_layer(2, 8, 4, 6, **SYNCED)  # the same initial state on every rank
    data = []
    for step in range(4):
        q, _, v = rand_qkv(2, 2, 40, 8, dtype=torch.float32, seed=100 * rank + step)  # each rank its own batch
        data.append((q.detach(), v.detach()))
        if step == 3 and rank == 0:
            torch.save(layer.state_dict(), out + ".before")
        _step(layer, q, v, None)
        layer.update()
    state = {k: v for k, v in layer.state_dict().items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, {"state": state, "last": data[-1]})
    if rank == 0:
        torch.save(gathered, out)
    dist.barrier()
    dist.destroy_process_group()


def test_two_gloo_processes_keep_centroids_and_bias_bit_identical(tmp_path) -> None:
    out = str(tmp_path / "result.pt")
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), out), nprocs=2, join=True)
    results = torch.load(out)
    a, b = (r["state"] for r in results)
    for name in ("kmeans.centroids", "kmeans.ema_sums", "kmeans.ema_counts", "kmeans.initialized", "bias", "steps"):
        name = f"routing.{name}"
        assert torch.equal(a[name], b[name]), f"{name} differs between ranks"
    assert a["routing.bias"].abs().sum() > 0 and int(a["routing.steps"]) == 4
    # The last update used the statistics of both ranks: a single process on both batches gets the same centroids
    # and, from the loads of both, the same bias.
    single = routing_layer(2, 8, 4, 6, **SYNCED)
    single.load_state_dict(torch.load(out + ".before"))
    q = torch.cat([r["last"][0] for r in results])
    v = torch.cat([r["last"][1] for r in results])
    single(q, q, v)
    single.update()
    torch.testing.assert_close(single.routing.kmeans.centroids, a["routing.kmeans.centroids"], rtol=1e-6, atol=1e-6)
    assert torch.equal(single.routing.bias, a["routing.bias"])


def test_the_commitment_gradient_at_r_is_its_cosine_forms() -> None:
    """At r the commitment's gradient is that of the loss it returns, mean (2 - 2 r · μ_c) over the real positions,
    as autograd gives it (float64; r not unit, so that the squared distance's gradient would differ)."""
    B, H, N, D, k = 2, 3, 20, 8, 5
    g = torch.Generator().manual_seed(3)
    r = torch.randn(B, H, N, D, generator=g, dtype=torch.float64, requires_grad=True)
    km = SphericalKMeans(H, D, k).double()
    km.centroids.copy_(F.normalize(torch.randn(H, k, D, generator=g, dtype=torch.float64), dim=-1))
    keys = torch.randint(0, k, (B, H, N), generator=g)
    valid = rand_padding(B, N, seed=4)
    mu = km.centroids[torch.arange(H)[None, :, None], keys]
    (got,) = torch.autograd.grad(km.commitment(r, keys, valid), r)
    weight = valid[:, None, :].double().expand(B, H, N)
    want_loss = ((2 - 2 * (r * mu).sum(-1)) * weight).sum() / weight.sum()
    (want,) = torch.autograd.grad(want_loss, r)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)


def test_the_commitment_is_the_centroid_distance_with_its_gradient_at_q() -> None:
    """mean (2 - 2 cos) over the real positions equals mean ||r - μ_c||² for unit vectors, whether the cosines are
    given (a router kernel's) or computed, and its analytic backward gives q the gradient autograd gives it through
    the distance (they differ at r by a multiple of r, which the normalisation drops)."""
    B, H, N, D, k = 2, 3, 20, 8, 5
    g = torch.Generator().manual_seed(8)
    q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64, requires_grad=True)
    proj = torch.linalg.qr(torch.randn(H, D, D, generator=g, dtype=torch.float64))[0]
    km = SphericalKMeans(H, D, k).double()
    km.centroids.copy_(F.normalize(torch.randn(H, k, D, generator=g, dtype=torch.float64), dim=-1))
    valid = rand_padding(B, N, seed=9)
    grads, losses = [], []
    for way in ("given", "computed", "distance"):
        r = torch.einsum("bhnd,hde->bhne", F.normalize(q, dim=-1), proj)
        keys = torch.einsum("bhnd,hkd->bhnk", r, km.centroids).argmax(-1)
        mu = km.centroids[torch.arange(H)[None, :, None], keys]
        if way == "given":
            loss = km.commitment(r, keys, valid, (r * mu).sum(-1).detach())
        elif way == "computed":
            loss = km.commitment(r, keys, valid)
        else:
            err = (r - mu).square().sum(-1)
            weight = valid[:, None, :].double().expand_as(err)
            loss = (err * weight).sum() / weight.sum()
        losses.append(loss.detach())
        grads.append(torch.autograd.grad(loss, q)[0])
    for i in (0, 1):
        torch.testing.assert_close(losses[i], losses[2], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grads[i], grads[2], rtol=1e-9, atol=1e-12)
