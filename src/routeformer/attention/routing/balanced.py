"""The paper's balanced clusters, for encoders (non-causal): each centroid takes its `window` nearest tokens.

A token may land in several clusters or in none. Definition of what a query i sees:
- i in one or more clusters: the union (as a set) of those clusters' members. Each cluster is computed as its own
  (window, window) tile; a pair (i, j) counts only in the first cluster that holds both, so no key counts twice,
  and the per-cluster results are merged exactly through their log-sum-exp.
- i in no cluster: the members of the cluster of its nearest centroid (its argmax cluster).
- shared QK: i's own key is dropped unless nothing else is left, exactly as in the sorted window.

Cost: the member tiles are k · window² = N · window scores for window = N / k; queries in no cluster are packed
into tiles of `window` queries per cluster, always as many tiles as they can need (``unselected_tile_bound``, at
most N + k · window rows): their count is then known without reading the data on the host (on CUDA that read
waits for the device) and the shapes depend on the sizes alone (FlexAttention compiles once for them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...executors import Executor, neg_inf
from ...executors.inputs import Inputs, RelTerms, refuse_cross
from ...executors.relative import RelativePositions
from ...executors.tiling import Distances, Tiling
from .options import RoutingOptions
from .sorted_window import drop_own_key, sort_by_cluster

_BITS = 63  # cluster memberships packed 63 to an int64 word (bit 63 is the sign)


@torch.no_grad()
def balanced_members(scores: Tensor, window: int, key_padding_mask: Tensor | None) -> Tensor:
    """Members (B, H, k, w) of each cluster, w = min(window, N): the w tokens nearest each centroid, by position.

    scores: (B, H, N, k) cosines of the routing vectors to the centroids (``SphericalKMeans.scores``), the same
    tensor whose argmax gives each token's cluster. Padded tokens are chosen only when fewer than w real tokens exist.
    """
    score = scores.transpose(-1, -2)  # (B, H, k, N)
    if key_padding_mask is not None:
        score = score.masked_fill(~key_padding_mask[:, None, None, :], -3.0)  # cosines are >= -1
    w = min(window, score.shape[-1])
    return score.topk(w, dim=-1).indices.sort(-1).values


def _membership(members: Tensor, n: int) -> Tensor:
    """(B, H, k, N) bool: token n is a member of cluster c."""
    B, H, k, _ = members.shape
    m = torch.zeros(B, H, k, n, dtype=torch.bool, device=members.device)
    return m.scatter_(-1, members, True)


def balanced_mask(members: Tensor, clusters: Tensor, exclude_self: bool, key_valid: Tensor | None) -> Tensor:
    """The boolean (B, H, N, N) mask of ``balanced_attention``, from its definition (O(N² · k))."""
    n = clusters.shape[-1]
    member_of = _membership(members, n)  # (B, H, k, N)
    m = member_of.float()
    union = torch.einsum("bhcn,bhcm->bhnm", m, m) > 0  # i and j share a cluster
    selected = member_of.any(2)  # (B, H, N)
    batch = torch.arange(members.shape[0], device=members.device)[:, None, None]
    head = torch.arange(members.shape[1], device=members.device)[None, :, None]
    nearest = member_of[batch, head, clusters]  # (B, H, N, N): row i = members of i's argmax cluster
    allow = torch.where(selected[..., None], union, nearest)
    if key_valid is not None:
        allow = allow & key_valid[:, :, None, :]
    if exclude_self:
        allow = drop_own_key(allow, torch.eye(n, dtype=torch.bool, device=members.device))
    return allow


def balanced_attention(inputs: Inputs, members: Tensor, clusters: Tensor, options: RoutingOptions, *,
                       executor: Executor, rel_pos: RelativePositions | None = None) -> Tensor:
    """Attention within balanced clusters: inputs, the checked q, k, v (B, H, N, D), scale and key validity;
    members (B, H, k, w); clusters (B, H, N) argmax; ``options.shared_qk``: the own key left out unless alone. The
    cluster tiles run on ``executor``."""
    refuse_cross(inputs, "routing self-attention (routing_cross_attention reads a memory)")
    q, v = inputs.q, inputs.v
    B, H, N, D = q.shape
    flat = members.flatten(2)  # (B, H, k · w)
    selected = torch.zeros(B, H, N, dtype=torch.bool, device=q.device).scatter_(-1, flat, True)  # in any cluster
    valid = None if inputs.key_valid is None else inputs.key_valid.expand(B, H, N)
    inputs = inputs.with_(key_valid=valid)

    # Queries that are members: one (w, w) tile per cluster, merged over clusters per token.
    out, lse = _member_tiles(inputs, members, options.shared_qk, rel_pos, executor)
    if options.shared_qk:  # nothing but itself: attend to itself
        alone = lse < neg_inf(q.dtype) / 2
        own = v if rel_pos is None else v + rel_pos.tables(0, v.dtype)[1]  # the value term of distance 0
        if valid is not None:
            own = own * valid[..., None]
        out = torch.where(alone[..., None], own, out)

    # Queries in no cluster: the members of their nearest centroid's cluster (always run: whether any query is in
    # none would be a host read; with none, every tile is empty and its rows go to the dump slot).
    return _unselected_tiles(out, inputs, (members, clusters, selected), rel_pos, executor)


def _member_tiles(inputs: Inputs, members: Tensor, exclude_self: bool, rel_pos: RelativePositions | None,
                  executor: Executor) -> tuple[Tensor, Tensor]:
    """Every cluster's members against each other, one (w, w) tile per cluster, each pair counted in its first
    common cluster; the partial results merged per token: (out (B, H, N, D), lse (B, H, N))."""
    q, k, v, valid = inputs.q, inputs.k, inputs.v, inputs.key_valid  # valid: (B, H, N) or None
    B, H, N, D = q.shape
    kc, w = members.shape[2:]
    flat = members.reshape(B, H, kc * w)

    def tiles(x: Tensor) -> Tensor:  # (B, H, N, D) -> (B, H·k, w, D)
        return x.gather(2, flat[..., None].expand(B, H, kc * w, D)).view(B, H * kc, w, D)

    first = ~_shared_earlier(members, N)  # (B, H, k, w, w): the pair's first common cluster is this one
    if exclude_self:
        first = first & ~torch.eye(w, dtype=torch.bool, device=q.device)
    kv = None if valid is None else valid.gather(-1, flat).view(B, H * kc, w)
    rel = None
    if rel_pos is not None:
        delta = (members[..., None, :] - members[..., :, None]).view(B, H * kc, 1, w, w)
        rel = RelTerms(rel_pos, Distances(delta=delta))
    o, lse = executor.tiled(Inputs(tiles(q), tiles(k), tiles(v), inputs.scale, kv),
                            Tiling.dense(w, tile_mask=first.view(B, H * kc, 1, w, w)), rel=rel, need_lse=True)
    return _merge_by_token(o.view(B, H, kc * w, D), lse.view(B, H, kc * w), flat, N)


def _shared_earlier(members: Tensor, n: int) -> Tensor:
    """(B, H, k, w, w): members i, j of cluster c also share a cluster c' < c (bit sets of memberships, built from
    the members by one scatter: O(N · words) memory, never a (k, N) membership table)."""
    B, H, kc, w = members.shape
    words = -(-kc // _BITS)
    c = torch.arange(kc, device=members.device)[:, None].expand(kc, w)  # each member's cluster
    at = (members * words + (c // _BITS)).reshape(B, H, kc * w)  # its (token, word)
    bit = torch.bitwise_left_shift(torch.ones_like(c), c % _BITS).reshape(1, 1, kc * w).expand(B, H, -1)
    # a token is in a cluster once and a word's clusters have distinct bits: the sum is the bitwise or
    bits = torch.zeros(B, H, n * words, dtype=torch.long, device=members.device).scatter_add_(-1, at, bit)
    bits = bits.view(B, H, n, words)
    # Bits of the clusters before c, in word t: the low min(max(c - t·bits, 0), bits) bits (built on the device).
    below = (torch.arange(kc, device=members.device)[:, None]
             - _BITS * torch.arange(words, device=members.device)).clamp(0, _BITS)  # (k, words)
    lower = torch.bitwise_left_shift(torch.ones_like(below), below) - 1
    mine = bits.gather(2, members.reshape(B, H, kc * w, 1).expand(-1, -1, -1, words)).view(B, H, kc, w, words)
    earlier = mine & lower[None, None, :, None, :]
    out = torch.zeros(B, H, kc, w, w, dtype=torch.bool, device=members.device)
    for t in range(words):
        out |= (earlier[..., :, None, t] & mine[..., None, :, t]) != 0
    return out


def _merge_by_token(o: Tensor, lse: Tensor, token: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Merge partial results (B, H, P, D) / (B, H, P) of tokens ``token`` (B, H, P) exactly, per token."""
    B, H, P, D = o.shape
    peak = torch.full((B, H, n), float("-inf"), dtype=lse.dtype, device=lse.device)
    peak = peak.scatter_reduce(-1, token, lse.detach(), "amax")
    weight = (lse - peak.gather(-1, token)).exp()  # (B, H, P)
    num = torch.zeros(B, H, n, D, dtype=lse.dtype, device=o.device)
    num = num.scatter_add(2, token[..., None].expand(B, H, P, D), o.to(lse.dtype) * weight[..., None])
    den = torch.zeros(B, H, n, dtype=lse.dtype, device=o.device).scatter_add(-1, token, weight)
    out = num / den.clamp_min(torch.finfo(den.dtype).tiny)[..., None]
    return out.to(o.dtype), peak + den.log()


def unselected_tile_bound(n: int, num_clusters: int, w: int) -> int:
    """The most tiles of w queries the queries in no cluster can need, from the sizes alone: the members of one
    cluster are w tokens that are selected, so at most U = n - w are in none; U_c of them in cluster c take
    ceil(U_c / w) <= floor(U_c / w) + [U_c > 0] tiles, at most floor(U / w) + min(k, U) in all."""
    unselected = max(0, n - w)
    return max(1, unselected // w + min(num_clusters, unselected))


def _unselected_tiles(out: Tensor, inputs: Inputs, clustering: tuple[Tensor, Tensor, Tensor],
                      rel_pos: RelativePositions | None, executor: Executor) -> Tensor:
    """Queries in no cluster, packed into tiles of w queries that share an argmax cluster, against its members,
    written into ``out`` (B, H, N, D). ``clustering``: the members (B, H, k, w), every token's argmax cluster
    (B, H, N) and whether it is a member of any (B, H, N). As many tiles as there can be
    (``unselected_tile_bound``), not as there are: their number is then no host read of a device tensor, and the
    shapes, which FlexAttention compiles for, depend on the sizes alone."""
    q, k, v, valid = inputs.q, inputs.k, inputs.v, inputs.key_valid  # valid: (B, H, N) or None
    members, clusters, selected = clustering
    B, H, N, D = q.shape
    kc, w = members.shape[2:]
    group = torch.where(selected, kc, clusters)  # unselected tokens by cluster; selected ones last (sentinel k)
    order, _, grouped, rank, counts = sort_by_cluster(group, kc + 1)  # rank: within the cluster's unselected queries
    counts = counts[..., :kc]
    n_tiles = -(-counts // w)  # (B, H, k)
    tile_end = n_tiles.cumsum(-1)
    total = unselected_tile_bound(N, kc, w)
    live = grouped < kc
    g = grouped.clamp_max(kc - 1)
    slot = (tile_end - n_tiles).gather(-1, g) * w + rank  # (B, H, N) in the packed layout
    slot = torch.where(live, slot, total * w)  # selected tokens go to a dump slot
    query = torch.full((B, H, total * w + 1), N, dtype=torch.long, device=q.device)
    query = query.scatter(-1, slot, order)[..., : total * w].view(B, H, total, w)  # token of each slot (N = empty)
    tile_cluster = torch.searchsorted(tile_end, torch.arange(total, device=q.device).expand(B, H, total).contiguous(),
                                      right=True).clamp_max(kc - 1)
    keys = members.gather(2, tile_cluster[..., None].expand(B, H, total, w))  # (B, H, T, w)

    qpad = torch.cat([q, q.new_zeros(B, H, 1, D)], 2)
    qt = qpad.gather(2, query.reshape(B, H, total * w, 1).expand(-1, -1, -1, D)).view(B, H * total, w, D)
    flat_keys = keys.reshape(B, H, total * w, 1).expand(-1, -1, -1, D)
    kt = k.gather(2, flat_keys).view(B, H * total, w, D)
    vt = v.gather(2, flat_keys).view(B, H * total, w, D)
    kv = None if valid is None else valid.gather(-1, keys.reshape(B, H, total * w)).view(B, H * total, w)
    rel = None
    if rel_pos is not None:
        rel = RelTerms(rel_pos, Distances(delta=(keys[..., None, :] - query[..., :, None]).view(B, H * total, 1, w, w)))
    o, _ = executor.tiled(Inputs(qt, kt, vt, inputs.scale, kv), Tiling.dense(w), rel=rel)
    dest = torch.cat([out, out.new_zeros(B, H, 1, D)], 2)
    dest = dest.scatter(2, query.reshape(B, H, total * w, 1).expand(-1, -1, -1, D), o.reshape(B, H, total * w, D))
    return dest[:, :, :N]


def balanced_over_documents(inputs: Inputs, scores: Tensor, clusters: Tensor, options: RoutingOptions, *,
                            window: int, executor: Executor, rel_pos: RelativePositions | None = None) -> Tensor:
    """``balanced_attention`` over packed documents (``inputs.documents`` (B, N), numbered from 0 per row): every
    document as if alone, its clusters' members the ``min(window, length)`` of its own tokens nearest each
    centroid. scores (B, H, N, k), clusters (B, H, N): the router's, over the row as it is (the k-means statistics
    do not depend on the packing). -> (B, H, N, D).

    The documents of the whole batch are laid out as a batch of their own, in tiers of similar lengths (the
    lengths' powers of two) each padded to its longest, so the padded work is less than twice the real. Their
    lengths are one host read (on CUDA a wait for the device): balanced routing is an encoder's, not a training
    step's inner loop."""
    q = inputs.q
    B, H, N, D = q.shape
    documents = inputs.documents
    lengths = torch.zeros(B, N, dtype=torch.long, device=q.device).scatter_add_(
        1, documents, torch.ones_like(documents))  # (B, N): each document's length, 0 past the row's last
    starts = lengths.cumsum(1) - lengths
    rows, ids = lengths.nonzero(as_tuple=True)
    spans = torch.stack([rows, starts[rows, ids], lengths[rows, ids]], 1).tolist()  # the one host read
    valid = None if inputs.key_valid is None else inputs.key_valid.expand(B, H, N)
    out = q.new_zeros(B * N, H, D)
    tiers: dict[int, list[list[int]]] = {}
    for span in spans:
        tiers.setdefault(max(span[2] - 1, 0).bit_length(), []).append(span)
    for tier in tiers.values():
        length = max(n for _, _, n in tier)
        at = torch.tensor([b * N + s for b, s, _ in tier], device=q.device)[:, None] + torch.arange(length,
                                                                                               device=q.device)
        real = torch.arange(length, device=q.device) < torch.tensor([n for _, _, n in tier], device=q.device)[:, None]
        at = torch.where(real, at, 0)  # (T, L): the flat position of every slot, padding reading position 0
        kept = real[:, None, :] if valid is None else real[:, None, :] & _tier(valid, at)
        part = Inputs(_tier(q, at), _tier(inputs.k, at), _tier(inputs.v, at), inputs.scale, kept)
        members = balanced_members(_tier(scores, at), window, kept.all(1))
        o = balanced_attention(part, members, _tier(clusters, at), options, executor=executor, rel_pos=rel_pos)
        out = out.index_put((at[real],), o.movedim(2, 1)[real])
    return out.view(B, N, H, D).movedim(1, 2)


def _tier(x: Tensor, at: Tensor) -> Tensor:
    """(B, H, N, ...) -> (T, H, L, ...): the positions ``at`` (T, L) of the flattened (B · N) sequence."""
    B, H, N = x.shape[:3]
    return x.movedim(2, 1).reshape(B * N, H, *x.shape[3:])[at].movedim(1, 2)
