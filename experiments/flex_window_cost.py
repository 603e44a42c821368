"""Where the flex forward of routing's sorted window spends its time, on a GPU (issue 56): one compiled
FlexAttention call on the same sorted q, k, v under four masks, forward and forward+backward:

    python experiments/flex_window_cost.py [N] [--device cuda]      # default N = 65,536; a few compilations

(the device check's routing part runs it as its ``flex-cost`` step).

- ``sliding``: FlexAttention's own sliding window (``create_block_mask`` of the window rule), the baseline;
- ``routing``: the BlockMask and rule the flex executor builds for the paper's rule (k = sqrt(N) random
  clusters, window N / k, shared QK), as ``executors/flex/windows.py`` makes them;
- ``routing tables, causal rule``: the same tables with the rule ``j <= i``: what the rule's own cost is;
- ``sliding, no lse``: the baseline without the log-sum-exp (the executor always asks for it).

The masks are measured in that order, each printed as soon as it is measured: its table row and a ``FLEXROW``
JSON line (flushed), then a ``FLEXCOST`` line with them all; a run stopped at a time limit (each mask compiles a
forward and a backward) keeps the masks it finished, the first ones the ones that matter most.

On an H200 at 64k (2026-11-29, bench attention) routing's forward kernel took 1.03 ms against the sliding
window's 0.235 with about as many key blocks per query block (2.45 partial against 2 partial + 1 full): this
splits that gap between the rule, the tables and the lse. On the CPU it runs FlexAttention compiled by inductor's
CPU backend at small N, the sliding rows only (inductor's CPU lowering asks for block tables N / 128 columns wide,
and the executor's are a few), for the script's own sake: its times say nothing of a GPU."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("n", type=int, nargs="?", default=65536)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

    from routeformer.attention.routing.sorted_window import sort_by_cluster
    from routeformer.executors import Inputs, KeyRestrictions, SortedWindow, get_executor
    from routeformer.executors.flex import windows

    n, dev = args.n, torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    k = round(math.sqrt(n))
    window = n // k
    g = torch.Generator().manual_seed(0)
    q, kk, v = (torch.randn(1, 8, n, 64, generator=g).to(dev, dtype) for _ in range(3))
    clusters = torch.randint(0, k, (1, 8, n), generator=g).to(dev)
    sort = sort_by_cluster(clusters)
    captured = {}

    def capture(pattern, q, k, v, **kw):  # the executor's BlockMask and rule, without attending
        captured["mask"] = pattern.block_mask
        return q, None

    real = windows.attend
    windows.attend = capture
    try:
        get_executor("flex").tiled(Inputs(q, q, v, 0.125, None), SortedWindow(window, True, sort.order, sort.grouped),
                                   restrict=KeyRestrictions(exclude_self=True))
    finally:
        windows.attend = real
    routing = captured["mask"]
    # the same tables (C columns wide, as the executor builds them: from_kv_blocks would expect N / 128) with j <= i
    causal = BlockMask(seq_lengths=(n, n), kv_num_blocks=routing.kv_num_blocks, kv_indices=routing.kv_indices,
                       full_kv_num_blocks=routing.full_kv_num_blocks, full_kv_indices=routing.full_kv_indices,
                       q_num_blocks=routing.q_num_blocks, q_indices=routing.q_indices,
                       full_q_num_blocks=routing.full_q_num_blocks, full_q_indices=routing.full_q_indices,
                       BLOCK_SIZE=routing.BLOCK_SIZE, mask_mod=lambda b, h, i, j: j <= i)

    def rule(b, h, i, j):
        return (j <= i) & (i - j < window)

    sliding = create_block_mask(rule, None, None, n, n, device=dev, _compile=True)
    compiled = torch.compile(flex_attention, dynamic=False)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = [("sliding", sliding, True), ("routing", routing, True), ("routing tables, causal rule", causal, True),
            ("sliding, no lse", sliding, False)]
    if dev.type == "cpu":  # inductor's CPU lowering wants tables N / 128 columns wide: routing's are a few
        rows = [row for row in rows if row[0].startswith("sliding")]
    print(f"N={n}, 8 heads of 64, {dtype}, {dev}; routing k={k}, window={window}", flush=True)
    print("| mask | partial blocks per query block | full | fwd ms | fwd+bwd ms |\n|---|---:|---:|---:|---:|",
          flush=True)
    found = {}
    for name, mask, lse in rows:
        grads = dev.type != "cpu"  # FlexAttention has no backward on the CPU, nor a compiled lse
        lse = lse and grads
        x = [t.detach().clone().requires_grad_(grads) for t in (q, kk, v)]

        def fwd(x=x, mask=mask, lse=lse):
            out = compiled(*x, block_mask=mask, scale=0.125, return_lse=lse)
            return out[0] if lse else out

        times = {"fwd+bwd": float("nan")}
        for label, fn in (("fwd", fwd), ("fwd+bwd", lambda: fwd().sum().backward()))[:2 if grads else 1]:
            for _ in range(2):
                fn()
            sync()
            seen = []
            for _ in range(5):
                start = time.perf_counter()
                fn()
                sync()
                seen.append(time.perf_counter() - start)
            times[label] = statistics.median(seen) * 1e3
        full = 0.0 if mask.full_kv_num_blocks is None else mask.full_kv_num_blocks.float().mean().item()
        partial = mask.kv_num_blocks.float().mean().item()
        print(f"| {name} | {partial:.2f} | {full:.2f} | {times['fwd']:.3f} | {times['fwd+bwd']:.3f} |", flush=True)
        found[name] = {"partial": round(partial, 2), "full": round(full, 2), "fwd_ms": round(times["fwd"], 3),
                       "fwd_bwd_ms": None if math.isnan(times["fwd+bwd"]) else round(times["fwd+bwd"], 3)}
        print("FLEXROW " + json.dumps({"mask": name, **found[name]}), flush=True)  # read if the run is cut
    print("FLEXCOST " + json.dumps(found), flush=True)  # one line for scripts/device_check.py


if __name__ == "__main__":
    main()
