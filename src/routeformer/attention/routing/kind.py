"""The routing head kind (Roy et al. 2020): its registry entry, and its options completed against the model. The
heads themselves are ``RoutingAttention`` (``layer.py``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ...lengths import sqrt_len
from ..kinds.base import HeadKind, Warmup
from ..kinds.common import at_most_seq_len
from .layer import RoutingAttention
from .options import RoutingOptions, default_routing_window


def _complete(o: RoutingOptions, config: Any) -> RoutingOptions:
    k = sqrt_len(config.seq_len) if o.num_clusters is None else o.num_clusters
    if k > config.seq_len:
        raise ValueError(f"num_clusters ({k}) is larger than seq_len ({config.seq_len})")
    window = default_routing_window(config.seq_len, k, o.probes) if o.window is None else o.window
    at_most_seq_len("window", window, config)
    length = o.warmup_len
    if length is not None:
        if length > config.seq_len or config.seq_len % length:
            raise ValueError(f"warmup_len ({length}) must divide seq_len ({config.seq_len}): the warm-up trains on "
                             f"each sequence cut into pieces that long")
        # Without a warm-up it has nothing to set (as a learning-rate warm-up's settings with none): a configuration
        # that ships a warm-up stays usable with `--set options.routing.warmup=0`, and the heads describe none.
        length = length if o.warmup else None
    return dataclasses.replace(o, num_clusters=k, window=window, warmup_len=length)


def _keys_per_query(o: RoutingOptions, n: int) -> float:
    return o.probes * min(o.window, n) + o.num_clusters  # + routing each token to k centroids


def _warmup(o: RoutingOptions) -> tuple[Warmup, ...]:
    # every earlier key, and still the routing (the k-means and the bias learn all along); the hand-over at the
    # model's length
    dense = lambda n: (n + 1) / 2 + o.num_clusters  # noqa: E731
    warmup = Warmup(o.warmup, dense, o.warmup_len)
    return (warmup, Warmup(o.warmup + o.handover, dense)) if o.handover else (warmup,)


def _describe(o: RoutingOptions) -> str:
    text = f"k={o.num_clusters}, w={o.window}"
    for name, value, default in (("p", o.probes, 1), ("bias", o.balance, 0.0), ("warm-up", o.warmup, 0)):
        if value != default:
            text += f", {name}={value:g}"
    if o.warmup_len is not None:
        text += f" at length {o.warmup_len}"
    if o.handover:
        text += f", hand-over={o.handover}"
    return text + (", separate" if o.separate else "") + (", gate" if o.gate else "")


KIND = HeadKind(
    "routing",
    lambda o, heads, head_dim, seed: RoutingAttention(heads, head_dim, o, seed=seed),
    keys_per_query=_keys_per_query,
    warmup=_warmup,
    option_type=RoutingOptions,
    complete=_complete,
    shares_qk=lambda o: o.shared_qk,
    describe=_describe,
    summary="the last `window` keys of each of the `probes` k-means clusters the query probes",
    documents=True,
    # the paper's balanced clusters (each centroid's `window` nearest keys): the whole sequence is visible
    encoder=lambda o, heads, head_dim, seed: RoutingAttention(heads, head_dim, o, causal=False, seed=seed),
)
