"""Experiment: routing heads with a compressed branch, measured by ``routeformer bench recall``.

    python experiments/compressed_branch.py --tasks mqar --attention "local:2,routing_cb:2@routing_probes=2" ...

Registers the head kind ``routing_cb`` (``register_kind``, as a user would) and runs ``routeformer bench recall``
with the remaining arguments. A ``routing_cb`` head is a routing head (the library's rule and options: probes,
bias, warm-up) whose queries also attend, in the same softmax, to one summary per cluster: the mean key and mean
value of the keys routed to that cluster at earlier positions (causal prefix means, NSA's compressed branch over
k-means clusters instead of blocks). The summaries give the query projection a gradient from every cluster, not
only from the keys it was routed to. Computed densely (explicit (N, N) mask and (N, k) summaries per head, O(N²):
an experiment at N = 128, not an implementation); leak-free by construction (every sum runs over j < i, or
j <= i without shared QK), which the script checks before it trains.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from routeformer.attention import HeadKind, register_kind
from routeformer.attention.kinds.routing import KIND as ROUTING
from routeformer.attention.kinds.routing import RoutingHeads
from routeformer.attention.routing.probes import probe_masks


class CompressedRouting(RoutingHeads):
    def forward(self, q, k, v, rel_pos):
        routing = self.routing
        if routing.warming_up:
            return super().forward(q, k, v, rel_pos)
        routes = routing.routes(q, k, None, observe=True)  # the k-means statistics, bias loads, commitment
        B, H, N, D = q.shape
        eye = torch.eye(N, dtype=torch.bool, device=q.device)
        allow = probe_masks(routes.keys, routes.probes, routing.window).any(2)  # (B, H, N, N)
        if routing.shared_qk:
            allow = allow & ~eye
        # Summaries: per cluster, the mean of the keys (values) at positions j < i (shared QK) or j <= i.
        member = F.one_hot(routes.keys, routing.num_clusters).to(q.dtype)  # (B, H, N, k)
        count = member.cumsum(2)
        sum_k = torch.einsum("bhnc,bhnd->bhncd", member, k).cumsum(2)  # (B, H, N, k, D)
        sum_v = torch.einsum("bhnc,bhnd->bhncd", member, v).cumsum(2)
        if routing.shared_qk:  # exclusive prefix: the own key is not in its cluster's summary
            count, sum_k, sum_v = count - member, sum_k - member[..., None] * k[:, :, :, None], \
                sum_v - member[..., None] * v[:, :, :, None]
        has = count > 0
        mean_k = sum_k / count.clamp_min(1)[..., None]
        mean_v = sum_v / count.clamp_min(1)[..., None]
        s = (q @ k.transpose(-1, -2)) * self.scale
        if rel_pos is not None:
            idx = torch.arange(N, device=q.device)
            a_k, a_v = rel_pos.tables(idx[None, :] - idx[:, None], q.dtype)  # (N, N, D)
            s = s + torch.einsum("bhid,ijd->bhij", q, a_k) * self.scale
        s = s.masked_fill(~allow, float("-inf"))
        c = torch.einsum("bhid,bhicd->bhic", q, mean_k) * self.scale
        c = c.masked_fill(~has, float("-inf"))
        scores = torch.cat([s, c], -1)
        seen = torch.isfinite(scores).any(-1, keepdim=True)
        p = torch.where(seen, scores, 0.0).softmax(-1) * seen
        pr, ps = p[..., :N], p[..., N:]
        out = pr @ v + torch.einsum("bhic,bhicd->bhid", ps, mean_v)
        if rel_pos is not None:
            out = out + torch.einsum("bhij,ijd->bhid", pr, a_v)
        if routing.shared_qk:  # nothing else in view: the own key, as the library's rule
            own = v if rel_pos is None else v + rel_pos.tables(0, v.dtype)[1]
            out = torch.where(seen, out, own)
        return out


def _leak_check() -> None:
    """Changing the tokens after t changes no output at or before t."""
    from routeformer import TransformerConfig, TransformerLM

    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=40, dim=32, depth=2, heads=4, seq_len=64, window=4, num_clusters=4,
                               routing_window=6, attention="local:2,routing_cb:2", routing_probes=2,
                               routing_balance=0.01)
    model = TransformerLM(config).double().eval()
    tokens = torch.randint(0, 40, (2, 64))
    for t in (0, 20, 62):
        other = tokens.clone()
        other[:, t + 1:] = torch.randint(0, 40, other[:, t + 1:].shape)
        gap = (model(tokens)[:, :t + 1] - model(other)[:, :t + 1]).abs().max()
        assert gap == 0, f"routing_cb leaks into position {t}: {gap}"


register_kind(HeadKind(
    "routing_cb", lambda o, heads, head_dim, seed: CompressedRouting(heads, head_dim, o, seed),
    keys_per_query=lambda o, n: ROUTING.keys_per_query(o, n) + o.num_clusters,  # + one summary per cluster
    warmup=ROUTING.warmup, options=ROUTING.options, shares_qk=ROUTING.shares_qk, describe=ROUTING.describe,
    summary="routing heads that also attend to the causal mean key and value of every cluster"), replace=True)

if __name__ == "__main__":
    from routeformer.cli import main

    _leak_check()
    sys.exit(main(["bench", "recall", *sys.argv[1:]]))
