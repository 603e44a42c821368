"""The value-aware study's experiment on any run: evaluate the model with the output of every attention head of the
chosen layers replaced by an approximation (``approximate.py``), for each method and r, beside the model's own
evaluation on the same windows."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..model import TransformerLM
from ..train.distributed import Processes
from ..train.evaluation import Scoring, evaluate, metric
from .approximate import HeadApproximation, Method, approximate
from .heads import HeadCall, hooked


@dataclass
class ApproximationResult:
    """One row of the table: the split's mean NLL (nats) and metric with ``method`` substituted, the mean relative
    output error |õ - o| / |o| over every substituted head and position, and the mean number of keys per query
    with non-zero weight (None for random features, which weigh every key)."""

    method: Method
    loss: float
    value: float
    relative_error: float
    keys_per_query: float | None
    upper_bound: bool


class _Tally:
    """Running sums of what the substituted heads did in one evaluation."""

    def __init__(self) -> None:
        self.error, self.rows, self.keys, self.bound = 0.0, 0, 0.0, False

    def add(self, approx: HeadApproximation) -> None:
        norm = approx.exact.norm(dim=-1)  # (B, h, N)
        real = norm > 0
        self.error += float(((approx.output - approx.exact).norm(dim=-1)[real] / norm[real]).sum())
        self.rows += int(real.sum())
        self.keys += float(approx.keys[real].float().sum())
        self.bound |= approx.upper_bound


class _FirstLayer:
    """The head calls of the first substituted layer, shared by every method's evaluation: below that layer the
    model is untouched, so each method gives it the same q, k and v, and a call whose inputs equal a kept call's
    bit for bit is answered by the kept one, with the scores, mask, weights and output it computed (a quarter of
    the per-call work on a four-layer model). Keeps calls until they hold ``budget`` attention entries (B·h·N² each,
    about 9 bytes an entry once computed): all of them at the default 32 windows, the first ones with
    ``--all-windows``."""

    def __init__(self, layer: int, budget: int = 2**24) -> None:
        self.layer, self.budget = layer, budget
        self.calls: list[HeadCall] = []

    def share(self, call: HeadCall) -> HeadCall:
        if call.layer != self.layer:
            return call
        for kept in self.calls:
            if (kept.first_head == call.first_head and kept.rel_pos is call.rel_pos and torch.equal(kept.q, call.q)
                    and torch.equal(kept.k, call.k) and torch.equal(kept.v, call.v)):
                return kept
        size = call.q.shape[:3].numel() * call.q.shape[2]
        if size <= self.budget:
            self.budget -= size
            self.calls.append(call)
        return call


@dataclass(frozen=True)
class Substitute:
    """Where and how the heads' outputs are replaced: the layers (None: every one), LSH's rounds and the seed of
    the methods that draw (LSH's rotations, random features)."""

    layers: list[int] | None = None
    lsh_rounds: int = 1
    seed: int = 0


def approximation_table(model: TransformerLM, tokens: np.ndarray, kind: str, methods: list[Method], *,
                        batch: int = 8, max_windows: int | None = 32, how: Substitute = Substitute(),
                        progress: Callable[[str], None] | None = None) -> tuple[float, list[ApproximationResult]]:
    """(the model's own metric on the windows, one result per method). Windows: ``max_windows`` evenly spaced
    non-overlapping windows of seq_len tokens of ``tokens`` (None: all of them), the windows ``evaluate`` scores.
    ``kind`` is the data's kind ('bytes', 'words', 'images'), which names the metric; ``how``: the layers replaced
    and the methods' settings."""
    layers = how.layers
    procs = Processes(0, 1, 0, next(model.parameters()).device)  # one process, on the model's device
    seq_len = model.config.seq_len

    def score() -> float:
        total, count = evaluate(model, tokens, Scoring(seq_len, batch, max_windows=max_windows), procs)
        return total / max(count, 1)

    own = metric(kind, score())
    results = []
    first = _FirstLayer(0 if layers is None else min(layers))
    for method in methods:
        tally = _Tally()

        def replace(call: HeadCall, _own, method=method, tally=tally) -> Tensor:
            approx = approximate(first.share(call), method, lsh_rounds=how.lsh_rounds, seed=how.seed)
            tally.add(approx)
            return approx.output.to(call.v.dtype)

        with hooked(model, replace, layers):
            loss = score()
        keys = None if method.name == "features" else tally.keys / max(tally.rows, 1)
        results.append(ApproximationResult(method, loss, metric(kind, loss), tally.error / max(tally.rows, 1), keys,
                                           tally.bound))
        if progress is not None:
            progress(f"{method.label}: {results[-1].value:.4f}")
    return own, results


def methods_for(names: list[str], rs: list[int], features_ok: bool) -> list[Method]:
    """exact, then each method at each r (random features only where ``features_ok``: exponential-kernel models)."""
    out = [Method("exact")]
    for name in names:
        if name == "exact" or (name == "features" and not features_ok):
            continue
        out.extend(Method(name, r) for r in rs)
    return out


def format_table(own: float, results: list[ApproximationResult], unit: str) -> str:
    """The results as an aligned text table, with the model's own evaluation on the first line."""
    lines = [f"model's own evaluation on these windows: {own:.4f} {unit}",
             f"{'method':<34} {unit:>16} {'rel. error':>11} {'keys/query':>11}"]
    for res in results:
        label = res.method.label + (" (upper bound)" if res.upper_bound else "")
        keys = "all" if res.keys_per_query is None else f"{res.keys_per_query:.1f}"
        value = f"{res.value:.4f}" if math.isfinite(res.value) else "inf"
        lines.append(f"{label:<34} {value:>16} {res.relative_error:>11.4f} {keys:>11}")
    return "\n".join(lines)


def write_csv(results: list[ApproximationResult], path, unit: str) -> None:
    import csv

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "r", "upper_bound", "loss_nats", unit.replace(" ", "_"), "relative_error",
                    "keys_per_query"])
        for res in results:
            w.writerow([res.method.name, res.method.r or "", int(res.upper_bound), f"{res.loss:.6f}",
                        f"{res.value:.6f}", f"{res.relative_error:.6f}",
                        "" if res.keys_per_query is None else f"{res.keys_per_query:.3f}"])
