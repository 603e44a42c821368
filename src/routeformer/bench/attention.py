"""Benchmark of every attention pattern against causal full attention, measured in the same run.

    routeformer bench attention [--n 1024 4096 16384] [--window 256] [--repeats 3]

Prints, per sequence length, forward and forward+backward time (median of consecutive runs), peak memory of an
inference forward and of a training forward+backward, and the forward+backward speed-up over ``full``. Peer
implementations run beside ours when installed (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..attention import (
    RelativePositions,
    RoutingAttention,
    fixed_attention,
    full_attention,
    local_attention,
    longformer_attention,
    strided_attention,
)
from .measure import PeakMemory, format_table, median_time

Attend = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass
class Candidate:
    name: str
    settings: str
    attend: Attend


def candidates(n: int, heads: int, head_dim: int, window: int, device: torch.device, dtype: torch.dtype,
               causal: bool = True) -> list[Candidate]:
    """The mechanisms compared at sequence length n, with the settings the papers suggest for it; the first is the
    baseline the others are measured against."""
    stride = max(1, round(math.sqrt(n)))
    clusters = max(1, round(math.sqrt(n)))
    routed = n // clusters  # window = N / k: clusters of the size the paper's balanced routing would give
    routing = RoutingAttention(heads, head_dim, clusters, routed, causal=causal).to(device).train()
    rel = RelativePositions(head_dim, window).to(device=device, dtype=dtype)
    dilation = [1] * (heads - heads // 2) + [2] * (heads // 2)
    found = [
        Candidate("full", "SDPA", lambda q, k, v: full_attention(q, k, v, causal=causal)),
        Candidate("local", f"window={window}", lambda q, k, v: local_attention(q, k, v, window, causal=causal)),
        Candidate("local+rel", f"window={window}, clip={window}",
                  lambda q, k, v: local_attention(q, k, v, window, causal=causal, rel_pos=rel)),
        Candidate("strided", f"stride={stride}, merged",
                  lambda q, k, v: strided_attention(q, k, v, stride, causal=causal)),
        Candidate("strided-split", f"stride={stride}, split",
                  lambda q, k, v: strided_attention(q, k, v, stride, causal=causal, merged=False)),
        Candidate("fixed", "block=128, summary=8, merged",
                  lambda q, k, v: fixed_attention(q, k, v, 128, 8, causal=causal)),
        Candidate("longformer", f"window={window}, dilation 1|2, global [0]",
                  lambda q, k, v: longformer_attention(q, k, v, window, dilation, [0], causal=causal)),
        Candidate("routing", f"k={clusters}, window={routed}, shared QK",
                  lambda q, k, v: routing(q, q, v)),
    ]
    found += _peers(window, causal, heads, head_dim, clusters, routed, device)
    return found


def _peers(window: int, causal: bool, heads: int, head_dim: int, clusters: int, routed: int,
           device: torch.device) -> list[Candidate]:
    """lucidrains' ``local-attention`` and ``routing-transformer`` (PyPI), at our settings, when installed."""
    found = []
    try:
        from local_attention import LocalAttention
    except ImportError:
        pass
    else:
        # exact_windowsize: the same window as ours (i - window <= j <= i) rather than the whole previous block.
        local = LocalAttention(window_size=window, causal=causal, exact_windowsize=True, autopad=True)

        def attend_local(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            B, H, N, D = q.shape
            return local(q.reshape(B * H, N, D), k.reshape(B * H, N, D), v.reshape(B * H, N, D)).view(B, H, N, D)

        found.append(Candidate("local-attention (peer)", f"window={window}, exact", attend_local))
    try:
        from routing_transformer.routing_transformer import KmeansAttention
    except ImportError:
        pass
    else:
        # Its causal routing picks each cluster's members with later tokens (it leaks); timed as it is used.
        kmeans = KmeansAttention(clusters, routed, heads, head_dim, causal=causal, shared_qk=True).to(device).train()
        found.append(Candidate("routing-transformer (peer)", f"k={clusters}, window={routed}, shared QK",
                               lambda q, k, v: kmeans(q, q, v)[0]))
    return found


def run(
    ns: list[int],
    *,
    batch: int = 1,
    heads: int = 8,
    head_dim: int = 64,
    window: int = 256,
    repeats: int = 3,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    causal: bool = True,
    only: list[str] | None = None,
    echo: Callable[[str], None] = print,
) -> list[dict]:
    """Measure every candidate at every length; print one table per length; return the rows."""
    dev = torch.device(device)
    results: list[dict] = []
    echo(f"# attention benchmark: B={batch}, H={heads}, D={head_dim}, {dtype}, {dev}, "
         f"{'causal' if causal else 'non-causal'}, threads={torch.get_num_threads()}, median of {repeats}")
    for n in ns:
        every = candidates(n, heads, head_dim, window, dev, dtype, causal)
        cands = every[:1] + [c for c in every[1:] if only is None or c.name.split(" ")[0] in only]
        gen = torch.Generator(device="cpu").manual_seed(n)
        q, k, v, grad = (torch.randn(batch, heads, n, head_dim, generator=gen).to(dev, dtype) for _ in range(4))
        results += [{"n": n, **row} for row in _measure(cands, q, k, v, grad, repeats, dev)]
        echo("")
        echo(attention_table([r for r in results if r["n"] == n]))
    if len(ns) > 1:
        echo("")
        echo(memory_growth(results))
    return results


def memory_growth(rows: list[dict]) -> str:
    """The exponent b of peak training memory ~ N^b, least-squares over the measured lengths, per mechanism."""
    lines = ["training peak memory ~ N^b, fitted over the lengths above:"]
    for name in dict.fromkeys(r["mechanism"] for r in rows):
        pts = [(math.log(r["n"]), math.log(r["training_bytes"])) for r in rows
               if r["mechanism"] == name and r["training_bytes"]]
        if len({x for x, _ in pts}) < 2:
            continue
        mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        lines.append(f"  {name:<28} b = {slope:.2f}")
    return "\n".join(lines)


def _measure(cands: list[Candidate], q: Tensor, k: Tensor, v: Tensor, grad: Tensor, repeats: int,
             dev: torch.device) -> list[dict]:
    """Time (median of consecutive runs) and peak memory of each candidate on one input."""
    for t in (q, k, v):
        t.requires_grad_(True)

    def forward(c: Candidate) -> Callable[[], object]:
        def call() -> object:
            with torch.no_grad():
                return c.attend(q, k, v)
        return call

    def train_step(c: Candidate) -> Callable[[], object]:
        def call() -> None:
            c.attend(q, k, v).backward(grad)
            q.grad = k.grad = v.grad = None
        return call

    rows = []
    for i, c in enumerate(cands):
        t_fwd = median_time(forward(c), repeats, dev)
        t_both = median_time(train_step(c), repeats, dev)
        with PeakMemory(dev) as inference:
            forward(c)()
        with PeakMemory(dev) as training:
            train_step(c)()
        rows.append({"mechanism": c.name, "baseline": i == 0, "settings": c.settings, "fwd_s": t_fwd,
                     "fwd_bwd_s": t_both, "inference_bytes": inference.bytes, "training_bytes": training.bytes})
    return rows


def attention_table(rows: list[dict]) -> str:
    base = {r["n"]: r["fwd_bwd_s"] for r in rows if r["baseline"]}
    first = next((r["mechanism"] for r in rows if r["baseline"]), "first")

    def mib(b: int | None) -> str:
        return "n/a" if b is None else f"{b / 2**20:.0f}"

    return format_table(
        ["N", "mechanism", "settings", "fwd ms", "fwd+bwd ms", "inference peak MiB", "training peak MiB",
         f"fwd+bwd speed-up vs {first}"],
        [[r["n"], r["mechanism"], r["settings"], f"{r['fwd_s'] * 1e3:.1f}", f"{r['fwd_bwd_s'] * 1e3:.1f}",
          mib(r["inference_bytes"]), mib(r["training_bytes"]), f"{base[r['n']] / r['fwd_bwd_s']:.2f}×"]
         for r in rows],
    )
