"""Issue 73's CPU goal, like for like: routing cross-attention against routing self-attention, forward + backward.

    python experiments/cross_routing_speed.py [--n 16384] [--heads 8] [--head-dim 64] [--repeats 5] [--rows R ...]

The bench's `routing` row shares queries and keys (the paper's shared QK: k is never read, no gradient reaches it,
one routing call). Cross-attention cannot share them: its keys are another sequence's. So beside the shared row
this times self-routing with separate keys (gradients to q, k and v, both sides routed), the like-for-like control,
and cross-routing (N queries over a memory of N keys, one probe, k = round(sqrt(N)) centroids, windows of N / k),
optionally with the fused ranges operator's blocks of R rows (``Ranges.rows``; default: the operator's choice).
Each row is timed in turn within every repeat (alternated), B = 1, float32, the fused executor, large tensors on
huge pages (set THP_MEM_ALLOC_ENABLE=1 as the command line does); medians and every time are printed. Results:
docs/attention.md, "Cross-attention".
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

import routeformer.attention.routing.cross as routing_cross
from routeformer.attention import Inputs, cross_routes, routing_cross_attention
from routeformer.attention.routing import RoutingAttention, RoutingOptions
from routeformer.executors import get_executor
from routeformer.executors.ranges import Ranges
from routeformer.lengths import sqrt_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="*", default=[], help="cross rows with blocks of R entries too")
    args = parser.parse_args()
    if os.environ.get("THP_MEM_ALLOC_ENABLE") != "1":
        print("note: THP_MEM_ALLOC_ENABLE is not 1: fresh gradients are zero-filled on small pages (slower)")
    n, H, D = args.n, args.heads, args.head_dim
    C = sqrt_len(n)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, n, D, requires_grad=True) for _ in range(3))
    centroids = torch.randn(H, C, D)

    def self_routing(shared: bool) -> Callable[[], torch.Tensor]:
        layer = RoutingAttention(H, D, RoutingOptions(num_clusters=C, window=n // C, probes=1, balance=0.0,
                                                      shared_qk=shared)).train()
        layer.executor = get_executor("fused", q.device)
        return (lambda: layer(q, q, v)) if shared else (lambda: layer(q, k, v))

    def cross(rows: int | None) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            routing_cross.Ranges = Ranges if rows is None else _with_rows(rows)
            try:
                return routing_cross_attention(Inputs.cross(q, k, v), cross_routes(q, k, centroids), None, "fused")
            finally:
                routing_cross.Ranges = Ranges
        return run

    rows = {f"self-routing, shared QK (the bench's row; k unused), window {n // C}": self_routing(True),
            "self-routing, separate keys (the like-for-like control)": self_routing(False),
            f"cross-routing, 1 probe, window {-(-n // C)}": cross(None)}
    rows.update({f"cross-routing, blocks of {r} rows": cross(r) for r in args.rows})
    for run in rows.values():  # warm-up: the kernels built, the pages touched
        _step(run)
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.repeats):
        for name, run in rows.items():
            times[name].append(_step(run))
    control = statistics.median(times["self-routing, separate keys (the like-for-like control)"])
    print(f"N = {n}, H = {H}, D = {D}, k = {C}, {torch.get_num_threads()} threads, forward + backward, ms")
    print("| row | median | / separate-keys control | every repeat |\n|---|--:|--:|---|")
    for name, ts in times.items():
        median = statistics.median(ts)
        print(f"| {name} | {median * 1e3:.1f} | {median / control:.2f}x | {', '.join(f'{t * 1e3:.0f}' for t in ts)} |")


def _with_rows(rows: int) -> Callable[..., Ranges]:
    def make(*args, **kwargs) -> Ranges:
        return Ranges(*args, **{**kwargs, "rows": rows})
    return make


def _step(run: Callable[[], torch.Tensor]) -> float:
    start = time.perf_counter()
    out = run()
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
