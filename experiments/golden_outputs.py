"""Golden outputs: every built-in kind's forward, gradients and decoding, and every functional pattern's, on one
executor (default tiles), saved to one file, so that a refactor can be checked to change no bit (issue 23, item 5),
or another executor to agree within rounding (issue 32); every kind in float32 and float64, and 20 training steps
of each (issue 34).

    python experiments/golden_outputs.py save before.pt      # on the commit before the change
    python experiments/golden_outputs.py save after.pt       # on the commit after it
    python experiments/golden_outputs.py compare before.pt after.pt
    python experiments/golden_outputs.py save fused.pt fused # the same entries on the fused executor
    python experiments/golden_outputs.py rounding before.pt fused.pt

``compare`` lists every entry that differs (with its largest difference) and exits 1 if any does. ``rounding``
lists every entry's largest difference relative to the largest magnitude of its tensor (at least a thousandth of
the entry's largest) and exits 1 if any exceeds rounding (1e-4 in float32, 1e-10 in float64). Each entry is
computed in a fresh generator state, so the set of entries may grow without changing the others.
"""

from __future__ import annotations

import sys

import torch

from routeformer.attention import Inputs, LSHOptions, RelativePositions
from routeformer.attention.lsh import lsh_attention
from routeformer.attention.registry import KINDS, PATTERNS
from routeformer.attention.routing import RoutingAttention, RoutingOptions
from routeformer.executors import get_executor
from routeformer.model import TransformerConfig, TransformerLM

PATTERN_PARAMS = {
    "full": {},
    "local": {"window": 40},
    "strided": {"stride": 8, "merged": True},
    "fixed": {"block": 16, "summary": 4, "merged": True},
    "longformer": {"window": 8, "dilation": [1, 2, 3, 1], "global_tokens": [0, 50]},
}


def _inputs(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=dtype).requires_grad_() for _ in range(3)]


def _grads(out: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    grads = torch.autograd.grad((out * weights).sum(), leaves, allow_unused=True)
    return [torch.zeros(0) if g is None else g for g in grads]


def patterns(results: dict, backend: str) -> None:
    for dtype in (torch.float32, torch.float64):
        for name, params in PATTERN_PARAMS.items():
            for causal in (True, False):
                for rel in (None, 24):
                    q, k, v = _inputs(0, (2, 4, 131, 8), dtype)
                    pad = torch.ones(2, 131, dtype=torch.bool)
                    pad[1, 120:] = False
                    rp = None
                    if rel is not None:
                        torch.manual_seed(3)
                        rp = RelativePositions(8, rel).to(dtype)
                    out = PATTERNS[name].run(Inputs.of(q, k, v, key_padding_mask=pad), backend, causal=causal,
                                             rel=rp, **params)
                    leaves = [q, k, v] + ([rp.key, rp.value] if rp is not None else [])
                    key = f"pattern/{name}/causal={causal}/rel={rel}/{dtype}"
                    results[key] = [out.detach(), *_grads(out, leaves)]
        for causal in (True, False):
            q, _, v = _inputs(1, (2, 4, 300, 16), dtype)
            out = lsh_attention(Inputs.of(q, q, v), LSHOptions(buckets=8, rounds=2, window=24), backend, causal=causal)
            results[f"lsh/causal={causal}/{dtype}"] = [out.detach(), *_grads(out, [q, v])]


def routing_layer(results: dict, backend: str) -> None:
    for probes, balance in ((1, 0.0), (2, 0.01)):
        for n in (200, 300):
            torch.manual_seed(0)
            layer = RoutingAttention(4, 16, RoutingOptions(num_clusters=4, window=24, probes=probes, balance=balance))
            layer.executor = get_executor(backend)
            layer.train()
            q, k, v = _inputs(2, (2, 4, n, 16), torch.float32)
            out = layer(q, k, v)
            results[f"routing_layer/p={probes}/n={n}"] = [out.detach(), *_grads(out, [q, k, v])]


def _model(name: str, positions: str, backend: str, dtype: torch.dtype) -> TransformerLM | None:
    """A small model of one kind (seed 0), on ``backend`` where the kind runs on an executor; None for a kind that
    takes no relative positions."""
    base = dict(vocab_size=32, dim=32, depth=2, heads=2, seq_len=300, attention=name, positions=positions)
    try:
        cfg = TransformerConfig(**base, backend=backend)
    except ValueError:  # a kind without relative positions, or one that runs on no executor
        try:
            cfg = TransformerConfig(**base)
        except ValueError:
            return None
    torch.manual_seed(0)
    model = TransformerLM(cfg).to(dtype)
    with torch.no_grad():
        model.head.weight.normal_(std=0.5)
    return model


def kinds(results: dict, backend: str) -> None:
    for dtype in (torch.float32, torch.float64):
        for name in KINDS:
            for positions in ("relative", "absolute"):
                model = _model(name, positions, backend, dtype)
                if model is None:
                    continue
                tokens = torch.randint(0, 32, (2, 300), generator=torch.Generator().manual_seed(5))
                model.train()
                logits = model(tokens)
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
                loss = loss + model.aux_loss
                loss.backward()
                grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
                model.eval()
                with torch.no_grad():
                    full = model(tokens)
                    cache = model.new_cache(2, 300)
                    parts = [model(tokens[:, :40], cache)]
                    parts += [model(tokens[:, i:i + 1], cache) for i in range(40, 60)]
                    parts.append(model(tokens[:, 60:], cache))
                suffix = "" if dtype == torch.float32 else f"/{dtype}"
                results[f"kind/{name}/{positions}{suffix}"] = [logits.detach(), *grads, full, torch.cat(parts, 1)]


def training(results: dict, backend: str, steps: int = 20) -> None:
    """20 optimiser steps of every kind (AdamW, the k-means step after each): the losses and the final state."""
    for dtype in (torch.float32, torch.float64):
        for name in KINDS:
            model = _model(name, "relative", backend, dtype) or _model(name, "absolute", backend, dtype)
            if model is None:
                continue
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
            gen = torch.Generator().manual_seed(7)
            losses = []
            model.train()
            for step in range(steps):
                tokens = torch.randint(0, 32, (2, 300), generator=gen)
                logits = model(tokens)
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
                (loss + model.aux_loss).backward()
                optimizer.step()
                optimizer.zero_grad()
                model.after_optimizer_step(step)
                losses.append(loss.detach())
            state = [t.detach().clone() for t in model.state_dict().values()]
            results[f"train/{name}/{dtype}"] = [torch.stack(losses), *state]


def save(path: str, backend: str = "tiles") -> None:
    results: dict = {}
    patterns(results, backend)
    routing_layer(results, backend)
    kinds(results, backend)
    training(results, backend)
    torch.save(results, path)
    print(f"{len(results)} entries -> {path}")


def compare(before: str, after: str) -> int:
    a, b = torch.load(before), torch.load(after)
    bad = 0
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            print(f"{key}: only in {'after' if key not in a else 'before'}")
            bad += 1
            continue
        worst = 0.0
        same = len(a[key]) == len(b[key])
        for x, y in zip(a[key], b[key], strict=False):
            if x.shape != y.shape:
                same = False
                continue
            if not torch.equal(x, y):
                same = False
                worst = max(worst, (x.double() - y.double()).abs().max().item())
        if not same:
            print(f"{key}: differs (largest difference {worst:.3g})")
            bad += 1
    print(f"{len(set(a) | set(b))} entries, {bad} differ")
    return 1 if bad else 0


def rounding(before: str, after: str) -> int:
    a, b = torch.load(before), torch.load(after)
    bad = 0
    for key in sorted(set(a) & set(b)):
        worst = 0.0
        tensors = [(x, y) for x, y in zip(a[key], b[key], strict=True) if x.numel() and x.is_floating_point()]
        top = max(x.double().abs().max().item() for x, _ in tensors)
        for x, y in tensors:
            # relative to the tensor's own magnitude, or to the entry's for a gradient that is zero up to rounding
            # (the key projection's bias: a constant added to every score of a row changes no softmax)
            scale = max(x.double().abs().max().item(), 1e-3 * top, 1e-300)
            worst = max(worst, (x.double() - y.double()).abs().max().item() / scale)
        limit = 1e-10 if a[key][0].dtype == torch.float64 else 1e-4
        flag = "" if worst <= limit else "  <- over rounding"
        bad += bool(flag)
        print(f"{key}: {worst:.2e}{flag}")
    print(f"{len(set(a) & set(b))} entries, {bad} over rounding")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) in (3, 4) and sys.argv[1] == "save":
        save(*sys.argv[2:])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    elif len(sys.argv) == 4 and sys.argv[1] == "rounding":
        sys.exit(rounding(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
