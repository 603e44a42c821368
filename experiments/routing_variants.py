"""Experiments: variants of the routing rule, measured by ``routeformer bench recall``.

    python experiments/routing_variants.py --tasks mqar --attention "local:2,routing_cb:2@options.routing.probes=2" ...

Registers five head kinds (``register_kind``, as a user would) and runs ``routeformer bench recall`` with the
remaining arguments. Three are routing heads (the library's rule and options: probes, bias, warm-up) with one
change each, computed densely (explicit (N, N) masks per head, O(N²): experiments at N = 128, not
implementations); the fourth is a baseline. All are leak-free by construction, which the script checks before it
trains.

- ``routing_cb``, a compressed branch: queries also attend, in the same softmax, to one summary per cluster, the
  mean key and mean value of the keys routed to that cluster at earlier positions (causal prefix means, NSA's
  compressed branch over k-means clusters instead of blocks). The summaries give the query projection a gradient
  from every cluster, not only from the keys it was routed to.
- ``routing_sel``, selection by the compressed branch: as ``routing_cb``, but a query probes the p clusters whose
  summary keys score highest (q · mean key), NSA's selection over k-means clusters; the compressed branch trains
  those scores, and the keys are still routed by k-means.
- ``full_cur``, the baseline for a warm-up at a shorter length: full attention trained on the same curriculum
  (the first ``options.routing.warmup`` steps on sequences of ``warmup_len``, through the same ``Warmup`` hook), so
  that routing's short warm-up is compared with full attention given the same short sequences first.
- ``routing_blend``, the hand-over as a blend: during ``options.routing.handover`` steps after the warm-up the
  output is (1 - a) · dense + a · routed, a growing linearly to 1, instead of the library's penalty on the unrouted
  keys.
- ``routing_ad``, attention-distilled routing: during the dense warm-up each query's routing scores are trained to
  predict where its dense attention goes, a cross-entropy between softmax(τ · (cos(r_q, μ) + b)) over the clusters
  and the attention mass each cluster's keys receive (SeerAttention distils attention into a block gate the same
  way). The weight is ``--distill-weight`` (default 1), τ = 10; the loss joins the commitment loss.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch
import torch.nn.functional as F

from routeformer.attention import HeadKind, register_kind
from routeformer.attention.full import KIND as FULL
from routeformer.attention.kinds.base import Warmup
from routeformer.attention.routing import RoutingAttention
from routeformer.attention.routing.kind import KIND as ROUTING
from routeformer.attention.routing.probes import probe_masks
from routeformer.executors import Inputs

DISTILL_WEIGHT = 1.0  # the weight of routing_ad's loss (--distill-weight)
DISTILL_SHARPNESS = 10.0


def summaries(q, k, v, keys, num_clusters, shared):
    """Per cluster, the mean key and value of the keys routed to it at positions j < i (shared QK) or j <= i:
    (B, H, N, k, D) each, and whether the cluster has any such key (B, H, N, k)."""
    member = F.one_hot(keys, num_clusters).to(q.dtype)  # (B, H, N, k)
    count = member.cumsum(2)
    sum_k = torch.einsum("bhnc,bhnd->bhncd", member, k).cumsum(2)
    sum_v = torch.einsum("bhnc,bhnd->bhncd", member, v).cumsum(2)
    if shared:  # exclusive prefix: the own key is not in its cluster's summary
        count = count - member
        sum_k = sum_k - member[..., None] * k[:, :, :, None]
        sum_v = sum_v - member[..., None] * v[:, :, :, None]
    scale = 1 / count.clamp_min(1)[..., None]
    return sum_k * scale, sum_v * scale, count > 0


class CompressedRouting(RoutingAttention):
    """Routing with a compressed branch; ``select``: the probes are the clusters whose summary keys score highest
    (q · mean key, NSA's selection), not the nearest centroids."""

    select = False

    def forward(self, q, k, v, rel_pos):
        if self.warming_up:
            return super().forward(q, k, v, rel_pos)
        routes = self.routing.routes(q, k, None, observe=True)  # the k-means statistics, bias loads, commitment
        B, H, N, D = q.shape
        eye = torch.eye(N, dtype=torch.bool, device=q.device)
        mean_k, mean_v, has = summaries(q, k, v, routes.keys, self.num_clusters, self.shared_qk)
        c = torch.einsum("bhid,bhicd->bhic", q, mean_k) * self.scale
        c = c.masked_fill(~has, float("-inf"))
        probes = c.detach().topk(self.probes, -1).indices if self.select else routes.probes
        allow = probe_masks(routes.keys, probes, self.window).any(2)  # (B, H, N, N)
        if self.shared_qk:
            allow = allow & ~eye
        s = (q @ k.transpose(-1, -2)) * self.scale
        if rel_pos is not None:
            idx = torch.arange(N, device=q.device)
            a_k, a_v = rel_pos.tables(idx[None, :] - idx[:, None], q.dtype)  # (N, N, D)
            s = s + torch.einsum("bhid,ijd->bhij", q, a_k) * self.scale
        s = s.masked_fill(~allow, float("-inf"))
        scores = torch.cat([s, c], -1)
        seen = torch.isfinite(scores).any(-1, keepdim=True)
        p = torch.where(seen, scores, 0.0).softmax(-1) * seen
        pr, ps = p[..., :N], p[..., N:]
        out = pr @ v + torch.einsum("bhic,bhicd->bhid", ps, mean_v)
        if rel_pos is not None:
            out = out + torch.einsum("bhij,ijd->bhid", pr, a_v)
        if self.shared_qk:  # nothing else in view: the own key, as the library's rule
            own = v if rel_pos is None else v + rel_pos.tables(0, v.dtype)[1]
            out = torch.where(seen, out, own)
        return out


class SelectedRouting(CompressedRouting):
    select = True


class DistilledRouting(RoutingAttention):
    def forward(self, q, k, v, rel_pos):
        out = super().forward(q, k, v, rel_pos)
        self._distill = None
        if self.training and self.warming_up:  # the dense attention is the routing's target
            with torch.no_grad():
                N = q.shape[2]
                s = (q @ k.transpose(-1, -2)) * self.scale
                if rel_pos is not None:
                    idx = torch.arange(N, device=q.device)
                    a_k, _ = rel_pos.tables(idx[None, :] - idx[:, None], q.dtype)
                    s = s + torch.einsum("bhid,ijd->bhij", q, a_k) * self.scale
                allow = torch.ones(N, N, dtype=torch.bool, device=q.device).tril()
                if self.shared_qk:  # as the warm-up attends: not the own key, but at position 0
                    allow = allow & ~(torch.eye(N, dtype=torch.bool, device=q.device)
                                      & (torch.arange(N, device=q.device) > 0)[:, None])
                p = s.masked_fill(~allow, float("-inf")).softmax(-1)
                keys = self.routing.routes(q, k).keys  # (B, H, N) each key's cluster
                mass = p @ F.one_hot(keys, self.num_clusters).to(p.dtype)  # (B, H, N, k)
            rq, _ = self.routing.query_and_key_vectors(q, k)
            logits = torch.einsum("bhnd,hkd->bhnk", rq, self.routing.kmeans.centroids.to(rq.dtype))
            if self.routing.bias is not None:
                logits = logits + self.routing.bias[:, None, :].to(rq.dtype)
            self._distill = DISTILL_WEIGHT * -(mass * (DISTILL_SHARPNESS * logits).log_softmax(-1)).sum(-1).mean()
        return out

    def aux_loss(self):
        loss = super().aux_loss()
        if getattr(self, "_distill", None) is not None:
            loss = self._distill if loss is None else loss + self._distill
        return loss


class BlendedRouting(RoutingAttention):
    """The hand-over as a blend of outputs instead of a penalty: during ``options.self.handover`` steps after the
    warm-up, (1 - a) · dense + a · routed, a = (s + 1) / handover at hand-over step s; routed before and after."""

    def forward(self, q, k, v, rel_pos):
        if not self.handing_over:
            return super().forward(q, k, v, rel_pos)
        steps = self._steps
        a = (steps - self.warmup + 1) / self.handover
        try:
            # the routed forward (it observes the routing once)
            self.routing._steps = self.warmup + self.handover
            routed = super().forward(q, k, v, rel_pos)
        finally:
            self.routing._steps = steps
        dense = self._dense(Inputs(q, k, v, self.scale), rel_pos)
        return (1 - a) * dense + a * routed


def _leak_check() -> None:
    """Changing the tokens after t changes no output at or before t."""
    from routeformer import TransformerConfig, TransformerLM

    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=40, dim=32, depth=2, heads=4, seq_len=64, rel_clip=4,
                               attention="local:2,routing_cb:2", options={"local": {"window": 4}, "routing": {
                                   "num_clusters": 4, "window": 6, "probes": 2, "balance": 0.01}})
    for kind in ("routing_cb", "routing_ad", "routing_sel", "full_cur", "routing_blend"):
        model = TransformerLM(replace(config, attention=f"local:2,{kind}:2")).double().eval()
        if kind == "routing_blend":  # in its hand-over
            model = TransformerLM(replace(config, attention=f"local:2,{kind}:2", options={
                **config.options, "routing": replace(config.options["routing"], handover=3)})).double().eval()
            model.after_optimizer_step()
        tokens = torch.randint(0, 40, (2, 64))
        for t in (0, 20, 62):
            other = tokens.clone()
            other[:, t + 1:] = torch.randint(0, 40, other[:, t + 1:].shape)
            gap = (model(tokens)[:, :t + 1] - model(other)[:, :t + 1]).abs().max()
            assert gap == 0, f"{kind} leaks into position {t}: {gap}"


register_kind(HeadKind(
    "routing_cb", lambda o, heads, head_dim, seed: CompressedRouting(heads, head_dim, o, seed=seed),
    keys_per_query=lambda o, n: ROUTING.keys_per_query(o, n) + o.num_clusters,  # + one summary per cluster
    warmup=ROUTING.warmup, option_type=ROUTING.option_type, section="routing", complete=ROUTING.complete,
    shares_qk=ROUTING.shares_qk, describe=ROUTING.describe,
    summary="routing heads that also attend to the causal mean key and value of every cluster"), replace=True)

register_kind(HeadKind(
    "routing_sel", lambda o, heads, head_dim, seed: SelectedRouting(heads, head_dim, o, seed=seed),
    keys_per_query=lambda o, n: ROUTING.keys_per_query(o, n) + o.num_clusters,  # + one summary per cluster
    warmup=ROUTING.warmup, option_type=ROUTING.option_type, section="routing", complete=ROUTING.complete,
    shares_qk=ROUTING.shares_qk, describe=ROUTING.describe,
    summary="routing heads that probe the clusters whose mean key scores highest, with the compressed branch"),
    replace=True)

register_kind(HeadKind(
    "routing_ad", lambda o, heads, head_dim, seed: DistilledRouting(heads, head_dim, o, seed=seed),
    keys_per_query=ROUTING.keys_per_query, warmup=ROUTING.warmup, option_type=ROUTING.option_type,
    section="routing", complete=ROUTING.complete, shares_qk=ROUTING.shares_qk, describe=ROUTING.describe,
    summary="routing heads whose query routing learns from the dense attention during the warm-up"), replace=True)

register_kind(HeadKind(
    "routing_blend", lambda o, heads, head_dim, seed: BlendedRouting(heads, head_dim, o, seed=seed),
    keys_per_query=ROUTING.keys_per_query, warmup=ROUTING.warmup, option_type=ROUTING.option_type,
    section="routing", complete=ROUTING.complete, shares_qk=ROUTING.shares_qk, describe=ROUTING.describe,
    summary="routing heads whose hand-over blends the dense and the routed outputs"), replace=True)

# full_cur reads the routing section (options.routing.warmup and warmup_len), so that a row sets its curriculum with
# the same words as a routing row's warm-up.
register_kind(HeadKind(
    "full_cur", lambda o, heads, head_dim, seed: FULL.build(FULL.option_type(), heads, head_dim, seed),
    keys_per_query=lambda o, n: FULL.keys_per_query(FULL.option_type(), n),
    warmup=lambda o: Warmup(o.warmup, lambda n: (n + 1) / 2, o.warmup_len), option_type=ROUTING.option_type,
    section="routing", complete=ROUTING.complete,
    describe=lambda o: f"curriculum: {o.warmup} steps at length {o.warmup_len}",
    summary="full attention trained first on shorter sequences (options.routing.warmup steps at warmup_len)"),
    replace=True)

if __name__ == "__main__":
    from routeformer.cli import main

    args = sys.argv[1:]
    if "--distill-weight" in args:
        at = args.index("--distill-weight")
        DISTILL_WEIGHT = float(args[at + 1])
        del args[at:at + 2]
    _leak_check()
    sys.exit(main(["bench", "recall", *args]))
