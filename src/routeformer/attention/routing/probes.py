"""Multi-probe routed attention: every key lives in one cluster, every query looks into several.

A key j is in the cluster c(j) it is routed to. A query i probes p distinct clusters P_1(i), …, P_p(i) (its own
first, unless routing is separate) and attends to the last ``window`` keys j <= i of each: one softmax over the
union. A key has one cluster, so the probes' key sets are disjoint and every key counts once. Which keys query i
sees depends on its own probes and on the clusters of positions <= i only: nothing later can change it.

Computed without an N×N matrix: the keys sorted by (cluster, position) put every cluster's keys side by side in time
order; the keys of probe (i, t) are then the ``window`` sorted keys just before where position i would sit in
cluster P_t(i) (a binary search; the fused executor's ``probes_run`` counts each cluster's keys as the positions
come instead, one pass), a contiguous range, and ``Executor.ranges`` attends each of the N·p entries to
its range. The p partial results merge exactly through their log-sum-exp. Time O(N·p·(window + G)·D + N log N),
memory O(N·p·(window + G)) per head (``ranges.py``: G is the stretch of its blocks, about window / 2).

Shared QK: a query does not see its own key unless it sees no other key at all.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ...executors import Executor, saw_key
from ...executors.inputs import Inputs, refuse_cross, relative
from ...executors.ranges import KeyOrder, Ranges
from ...executors.relative import RelativePositions
from ...executors.tiling import Distances, Tiling
from .options import RoutingOptions
from .sorted_window import ClusterOrder

# sequences up to this length run as one dense masked tile per head on executors without their own ranges (faster
# there; see README)
DENSE_UP_TO = 256
LABELS_COUNTED = 1 << 24  # the fused pass's bound on labels (its per-thread tables)


def probe_ranges(key_clusters: Tensor, probes: Tensor, window: int, sort: ClusterOrder,
                 exclude_self: bool = False) -> tuple[Tensor, Tensor]:
    """The ranges [lo, hi) of the keys sorted by (cluster, position) (``sort``, the keys' ``sort_by_cluster``) that
    every (query, probe) entry sees: each (B, H, N·p), entry i·p + t for query i and probe t. ``exclude_self``: the
    entries of a query's own cluster stop before its own key, which is the last key of their window (the window
    still counts it, as the single-cluster rule does)."""
    N = key_clusters.shape[-1]
    p = probes.shape[-1]
    composite = sort.grouped * N + sort.order  # (B, H, N), increasing
    pos = torch.arange(N, device=probes.device)
    wanted = probes.reshape(*probes.shape[:2], N * p)  # entry i·p + t
    hi = torch.searchsorted(composite, wanted * N + pos.repeat_interleave(p), right=True)  # keys before it, <= i
    if sort.counts is not None:  # the cluster's first sorted key: the sizes of the clusters before it
        first = (sort.counts.cumsum(-1) - sort.counts).gather(-1, wanted)
    else:
        first = torch.searchsorted(composite, wanted * N)
    lo = torch.maximum(first, hi - window)
    if exclude_self:
        own = wanted == key_clusters.repeat_interleave(p, dim=-1)  # the query's own cluster: key i ends its range
        hi = hi - own.long()
    return lo, hi


def probed_window_attention(inputs: Inputs, key_clusters: Tensor, probes: Tensor, options: RoutingOptions, *,
                            sort: ClusterOrder, executor: Executor, rel_pos: RelativePositions | None = None,
                            gates: Tensor | None = None) -> Tensor:
    """Query i attends to the last ``options.window`` keys j <= i of each cluster in ``probes[i]``.

    inputs: the checked q, k, v (B, H, N, D), scale and key validity (B, 1, N) or None; key_clusters: (B, H, N)
    long; probes: (B, H, N, p) long, distinct per query; gates: optional (B, H, N, p): each probed cluster's softmax
    is scaled by its gate instead of the union sharing one softmax -> (B, H, N, D). ``options.shared_qk``: the own
    key left out (see the module). ``sort``: the keys' ``sort_by_cluster`` (the router's, or the layer's); with
    packed ``inputs.documents`` by (document, cluster, position), the probes then looking into the query's own
    document's clusters only.
    """
    refuse_cross(inputs, "routing self-attention (routing_cross_attention reads a memory)")
    documents = inputs.documents
    labelled = documents is not None
    if labelled:  # packed documents: the label is (document, cluster), so that every probe's
        # range lies in the query's own document (``sort`` must be by these labels: the layer's ``_sort``)
        label = documents[:, None, :] * options.num_clusters  # (B, 1, N)
        key_clusters, probes = key_clusters + label, probes + label[..., None]
        inputs = inputs.with_(documents=None)  # held by the ranges now
    q, v, key_valid, window, exclude_self = inputs.q, inputs.v, inputs.key_valid, options.window, options.shared_qk
    B, H, N, D = q.shape
    p = probes.shape[-1]
    runner = executor.runner(q)
    if N <= DENSE_UP_TO and not runner.native_ranges:
        return _dense(inputs, key_clusters, probes, options, executor=executor, rel_pos=rel_pos, gates=gates)
    own_when_alone = exclude_self and key_valid is None  # shared QK: a query that sees no other key sees its own
    # the fused counting pass indexes tables by label, below 2^24: (document, cluster) labels reach N · k at most
    counted = runner.probes_run is not None and (not labelled or N * options.num_clusters < LABELS_COUNTED)
    ranges = None if not counted else runner.probes_run(key_clusters, probes, window, exclude_self, own_when_alone)
    if ranges is None:  # the definition: a search of the sorted keys
        lo, hi = probe_ranges(key_clusters, probes, window, sort, exclude_self)
        ranges = lo, (_own_key_when_alone(lo, hi, key_clusters, probes) if own_when_alone else hi)
    lo, hi = ranges
    # positions only for relative distances (without them a kernel would copy and check two (B, H, N) tensors)
    pos = None if rel_pos is None else torch.arange(N, device=q.device).expand(B, H, N)
    order = KeyOrder(sort.order, sort.inverse)
    if gates is None:  # one softmax over the union of the probes' (disjoint) ranges
        spans = Ranges(lo, hi, window, p, query_pos=pos, key_pos=pos, documents=documents)
        merged, lse = executor.ranges(inputs, spans, order=order, rel_pos=rel_pos, need_lse=True)
    else:  # each probe's softmax apart, scaled by its gate
        spans = Ranges(lo, hi, window, query_pos=None if pos is None else pos.repeat_interleave(p, -1), key_pos=pos,
                       documents=None if documents is None else documents.repeat_interleave(p, -1))
        out, lse = executor.ranges(inputs.with_(q=q.repeat_interleave(p, dim=2)), spans, order=order, rel_pos=rel_pos,
                                   need_lse=True)
        merged = (out.view(B, H, N, p, D) * gates[..., None].to(out.dtype)).sum(3)
        lse = lse.view(B, H, N, p).logsumexp(-1)  # neg_inf + log p where no probe saw a key: still unseen
    if not exclude_self or key_valid is None:
        return merged
    # Shared QK with padding: ranges that hold only padded keys are known after attending. A query that sees no
    # other key sees its own if it is a real key and the query probes its own cluster (first, unless separate).
    own = v if rel_pos is None else v + rel_pos.tables(0, v.dtype)[1]
    probed = probes == key_clusters[..., None]  # (B, H, N, p): which probe, if any, is the own cluster
    if gates is not None:
        own = own * (gates * probed).sum(-1, keepdim=True).to(own.dtype)
    alone = ~saw_key(lse) & key_valid & probed.any(-1)
    return torch.where(alone[..., None], own, merged)


def _own_key_when_alone(lo: Tensor, hi: Tensor, key_clusters: Tensor, probes: Tensor) -> Tensor:
    """Shared QK with every key real: a query whose ranges hold no key sees its own if it probes its own cluster.
    ``probe_ranges`` stopped that cluster's range just before the own key, so the range is empty and starts there:
    its hi moves on by one. Found from the ranges before attending, instead of replacing rows afterwards (two
    (B, H, N, D) selects forward and two backward). Returns the new hi (B, H, N·p)."""
    B, H, N = key_clusters.shape
    p = probes.shape[-1]
    own = probes == key_clusters[..., None]  # (B, H, N, p)
    alone = (hi - lo).view(B, H, N, p).sum(-1) == 0  # (B, H, N)
    return hi + (own & alone[..., None]).view(B, H, N * p).long()


def _dense(inputs: Inputs, key_clusters: Tensor, probes: Tensor, options: RoutingOptions, *, executor: Executor,
           rel_pos: RelativePositions | None, gates: Tensor | None) -> Tensor:
    """Short sequences: one dense (N, N) tile per head under the exact mask (``_window_masks``), O(N²·(p + D))."""
    q, N = inputs.q, inputs.q.shape[2]
    p = probes.shape[-1]
    recent, probed = _window_masks(key_clusters, probes, options.window, inputs.key_valid)
    union = recent & functools.reduce(torch.logical_or, probed)
    own = None
    if options.shared_qk:  # the own key only where the union holds nothing else
        eye = torch.eye(N, dtype=torch.bool, device=q.device)
        own = eye & (union & ~eye).any(-1, keepdim=True)
        union = union & ~own
    idx = torch.arange(N, device=q.device)
    rel = None if rel_pos is None else relative(rel_pos, Distances(delta=idx[None, :] - idx[:, None]))

    def attend(allow: Tensor) -> Tensor:
        out, _ = executor.tiled(inputs, Tiling.dense(N, tile_mask=allow[:, :, None]), rel=rel)
        return out

    if gates is None:
        return attend(union)
    parts = []
    for t in range(p):  # each probe its own softmax, scaled by its gate
        allow = recent & probed[t] if own is None else recent & probed[t] & ~own
        parts.append(attend(allow) * gates[..., t, None].to(q.dtype))
    return sum(parts)


def _window_masks(key_clusters: Tensor, probes: Tensor, window: int,
                  key_valid: Tensor | None = None) -> tuple[Tensor, list[Tensor]]:
    """``probe_masks`` from cumulative counts (no flip and cumsum per probe): ``recent`` (B, H, N, N), key j <= i
    among the last ``window`` keys of its own cluster at position i (and real), and for each probe t, whether j's
    cluster is query i's probe t; probe t's mask is their conjunction.

    members[i, j] counts the keys of j's cluster at positions <= i, so that cluster's keys in [j, i] number
    members[i, j] - members[j, j] + 1."""
    n = key_clusters.shape[-1]
    idx = torch.arange(n, device=key_clusters.device)
    same = key_clusters[..., :, None] == key_clusters[..., None, :]  # (B, H, N, N): m and j share a cluster
    members = same.cumsum(-2, dtype=torch.int32)  # [i, j]: keys of j's cluster at positions <= i
    recent = (members - members.diagonal(dim1=-2, dim2=-1)[..., None, :] < window) & (idx[None, :] <= idx[:, None])
    if key_valid is not None:
        recent = recent & key_valid[..., None, :]
    probed = [key_clusters[..., None, :] == probes[..., t, None] for t in range(probes.shape[-1])]
    return recent, probed


def probed_window_mask(key_clusters: Tensor, probes: Tensor, window: int, exclude_self: bool,
                       key_valid: Tensor | None = None) -> Tensor:
    """The boolean (B, H, N, N) mask of ``probed_window_attention`` (the union over the probes), written from its
    definition (O(N²·p)); ``probe_masks`` gives each probe's."""
    union = probe_masks(key_clusters, probes, window, key_valid).any(2)
    if exclude_self:
        eye = torch.eye(union.shape[-1], dtype=torch.bool, device=union.device)
        union = union & ~(eye & (union & ~eye).any(-1, keepdim=True))
    return union


def routed_pairs(key_clusters: Tensor, probes: Tensor, window: int, num_clusters: int) -> Tensor:
    """The boolean (B, H, N, N) union of ``probe_masks`` (before the own-key rule): j <= i, key j's cluster among
    the query's probes, and fewer than ``window`` keys of that cluster in (j, i]. From prefix counts per cluster:
    O(N²·p) time and O(N²) memory (``probe_masks`` keeps (p, N, N) counts), for the hand-over's dense penalty."""
    n = key_clusters.shape[-1]
    # (B, H, N, k): keys of c at <= i (a comparison, not F.one_hot: that reads the clusters' range on the host)
    member = key_clusters[..., None] == torch.arange(num_clusters, device=key_clusters.device)
    count = member.cumsum(2, dtype=torch.int32)
    own = count.gather(-1, key_clusters[..., None])[..., 0]  # (B, H, N): key j's rank in its cluster, from 1
    later = count.gather(-1, key_clusters[:, :, None, :].expand(*key_clusters.shape[:2], n, n))  # [i, j]: c_j at <= i
    probed = (key_clusters[:, :, None, :, None] == probes[:, :, :, None, :]).any(-1)  # (B, H, N, N)
    idx = torch.arange(n, device=key_clusters.device)
    return probed & (idx[None, :] <= idx[:, None]) & (later - own[:, :, None, :] < window)


def probe_masks(key_clusters: Tensor, probes: Tensor, window: int, key_valid: Tensor | None = None) -> Tensor:
    """(B, H, p, N, N): for each probe t, the last ``window`` keys j <= i of cluster probes[i, t] (padded keys hold
    their place in the window and are then removed), from the definition."""
    n = key_clusters.shape[-1]
    idx = torch.arange(n, device=key_clusters.device)
    earlier = idx[None, :] <= idx[:, None]  # (N, N): j <= i
    member = key_clusters[:, :, None, None, :] == probes.permute(0, 1, 3, 2)[..., None]  # (B, H, p, N, N)
    member = member & earlier
    newer = member.flip(-1).cumsum(-1).flip(-1)  # [.., i, j]: members m of the cluster with j <= m <= i
    allow = member & (newer <= window)
    if key_valid is not None:
        allow = allow & key_valid[:, :, None, None, :]
    return allow


__all__ = ["probe_masks", "probe_ranges", "probed_window_attention", "probed_window_mask", "routed_pairs"]
