"""Model benchmark: training throughput and memory, and generation time per token, for models of one size.

    routeformer bench model [--n 1024 4096 8192] [--positions 1024 4096 16384]

Models that differ only in their attention: by default all heads full, all heads local, half local and half routing
(``attentions``: any specs of registered kinds; the first is the baseline).
Training: tokens per second of a whole step (forward, backward, AdamW step, k-means update) and its peak memory,
and where a step's time goes (``breakdown``: each component's forward and backward timed alone on the inputs it
gets in the step).
Generation: milliseconds per new token after a prompt of 1k, 4k and 16k tokens (relative positions, so positions
past the training length are fine): local and routing heads keep bounded caches and should stay flat.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..model import TransformerConfig, TransformerLM, local_window
from ..train.config import TrainConfig
from ..train.loop import adamw
from .measure import (
    PeakMemory,
    cpu_pages,
    executor_lines,
    format_table,
    measured_backend,
    median_time,
    memory_trackable,
    merge_fields,
    notes,
    synchronize,
)

MODELS = ("full", "local", "local+routing")  # the default rows


@dataclass(frozen=True)
class ModelBench:
    """What ``bench model`` compares: models of ``dim``, ``depth`` and ``heads`` that differ in their attention
    (``attentions``: presets or specs of registered kinds, the first the baseline), the local heads' ``window`` (and
    rel_clip), on ``backend``'s executor; trained on ``batch`` sequences, timed as the median of ``repeats``; decoding
    timed over ``steps`` tokens; on ``device``."""

    dim: int = 256
    depth: int = 4
    heads: int = 8
    window: int = 256
    batch: int = 1
    repeats: int = 3
    steps: int = 8
    device: str = "cpu"
    attentions: tuple[str, ...] = MODELS
    backend: str = "auto"


def _half_local(heads: int, other: str) -> str:
    return f"local:{heads - heads // 2},{other}:{heads // 2}"


# Named rows beyond plain attention specs: the heads and the settings they need. The kernel heads have no relative
# positions, so their rows use none (a speed benchmark; generation runs past the training length); linear heads
# need a kernel with a feature map.
PRESETS: dict[str, Callable[[int], dict]] = {
    "local+routing": lambda heads: {"attention": _half_local(heads, "routing")},
    "local+lsh": lambda heads: {"attention": _half_local(heads, "lsh"), "positions": "none"},
    "linear-elu": lambda heads: {"attention": "linear", "options": {"linear": {"kernel": "elu"}}, "positions": "none"},
    "performer-favor": lambda heads: {"attention": "performer", "positions": "none"},
}


def model_configs(n: int, bench: ModelBench = ModelBench()) -> dict[str, TransformerConfig]:
    """The models compared at length n, one per row name of ``bench.attentions``: a preset (``PRESETS``) or an
    attention spec of registered kinds; the first is the baseline."""
    b = bench
    common = merge_fields({"vocab_size": 256, "dim": b.dim, "depth": b.depth, "heads": b.heads, "seq_len": n,
                           "backend": b.backend}, local_window(min(b.window, n)))
    return {name: TransformerConfig(**merge_fields(common, PRESETS[name](b.heads) if name in PRESETS
                                                   else {"attention": name}))
            for name in b.attentions}


def train_step(model: TransformerLM, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) + model.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        model.after_optimizer_step()
    return step


def run(ns: list[int], positions: list[int], bench: ModelBench = ModelBench(),
        echo: Callable[[str], None] = print) -> dict[str, list[dict]]:
    """Print the training and the generation tables for each attention spec; return their rows. ``echo``'s notes
    (``measure.Echo``): where the line naming the executor the models run on goes, once their configurations are checked
    (the command line: stderr)."""
    b, dev = bench, torch.device(bench.device)
    configs = {n: model_configs(n, bench) for n in ns}  # checked first
    say = notes(echo)
    if say is not None and ns:
        for line in executor_lines({name: config.describe_executor(dev) for name, config in configs[ns[0]].items()}):
            say(line)
    echo(f"# model benchmark: dim={b.dim}, depth={b.depth}, heads={b.heads}, window={b.window}, batch={b.batch}, "
         f"float32, {dev}, backend {measured_backend(b.backend, dev)}, threads={torch.get_num_threads()}"
         f"{cpu_pages(dev)}, median of {b.repeats}")
    train_rows: list[dict] = []
    for n in ns:
        for i, (name, config) in enumerate(configs[n].items()):
            torch.manual_seed(0)
            model = TransformerLM(config).to(dev).train()
            opt = adamw(model, TrainConfig(lr=1e-4))  # the training loop's own optimizer (fused where it can be)
            tokens = torch.randint(0, 256, (b.batch, n + 1), device=dev)
            step = train_step(model, opt, tokens)
            seconds = median_time(step, b.repeats, dev)
            peak_bytes = None
            if memory_trackable(dev, b.backend):
                with PeakMemory(dev) as peak:
                    step()
                peak_bytes = peak.bytes
            train_rows.append({"n": n, "model": name, "baseline": i == 0,
                               "params": model.num_parameters(), "step_s": seconds,
                               "tokens_per_s": b.batch * n / seconds, "bytes": peak_bytes,
                               "flops_per_token": model.flops_per_token(),
                               "parts": breakdown(model, opt, tokens, b.repeats, dev)})
    echo("")
    echo(training_table(train_rows))
    echo("")
    echo(breakdown_table(train_rows))

    gen_rows: list[dict] = []
    for name, config in model_configs(max(ns), bench).items():
        torch.manual_seed(0)
        model = TransformerLM(config).to(dev).eval()
        row: dict = {"model": name}
        for p in positions:
            row[p] = _ms_per_token(model, p, b.steps, dev)
        gen_rows.append(row)
    echo("")
    echo(generation_table(gen_rows, positions))
    return {"training": train_rows, "generation": gen_rows}


PARTS = ("attention", "feed-forward", "embedding, logits, loss", "optimiser", "per-step hooks")


def breakdown(model: TransformerLM, opt: torch.optim.Optimizer, tokens: torch.Tensor, repeats: int,
              dev: torch.device) -> dict[str, float]:
    """Seconds of each part of a training step (``PARTS``), each timed alone (median of ``repeats``): the attention
    layers (projections, heads, positions) and the feed-forward layers forward + backward on the inputs they get in
    the step, summed over the blocks; the token embedding, final norm, logits and cross-entropy forward + backward;
    the AdamW step; the heads' per-step hooks (routing's k-means update). What a whole step takes beyond their sum
    (residual adds, the blocks' norms, autograd's bookkeeping) is the table's 'other'."""
    inputs: dict[nn.Module, torch.Tensor] = {}

    def keep(module: nn.Module, args: tuple) -> None:
        inputs[module] = args[0].detach()

    parts = [m for block in model.blocks for m in (block.attention, block.ff)]
    hooks = [m.register_forward_pre_hook(keep) for m in parts + [model.norm]]
    train_step(model, opt, tokens)()
    for hook in hooks:
        hook.remove()

    def fwd_bwd(module: nn.Module) -> Callable[[], None]:
        x = inputs[module].clone().requires_grad_(True)

        def call() -> None:
            out = module(x)
            if isinstance(out, tuple):  # attention: (output, auxiliary loss or None)
                out, aux = out
                loss = out.square().mean() + (aux if aux is not None else 0)
            else:
                loss = out.square().mean()
            loss.backward()
        return call

    def ends() -> None:
        x = model.embed(tokens[:, :-1])
        h = inputs[model.norm].clone().requires_grad_(True)
        logits = model.head(model.norm(h))
        (F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) + x.square().mean()).backward()

    def seconds(fn: Callable[[], None]) -> float:
        return median_time(fn, repeats, dev)

    out = {"attention": sum(seconds(fwd_bwd(block.attention)) for block in model.blocks),
           "feed-forward": sum(seconds(fwd_bwd(block.ff)) for block in model.blocks),
           "embedding, logits, loss": seconds(ends),
           "optimiser": seconds(opt.step), "per-step hooks": seconds(model.after_optimizer_step)}
    opt.zero_grad(set_to_none=True)
    return out


def breakdown_table(rows: list[dict]) -> str:
    """Milliseconds per step of each part (``breakdown``), the rest of the step ('other') and the whole step."""
    def ms(t: float) -> str:
        return f"{t * 1e3:.1f}"

    return format_table(
        ["N", "breakdown: model", *(f"{p} ms" for p in PARTS), "other ms", "step ms"],
        [[r["n"], r["model"], *(f"{ms(r['parts'][p])} ({r['parts'][p] / r['step_s']:.0%})" for p in PARTS),
          ms(r["step_s"] - sum(r["parts"].values())), ms(r["step_s"])] for r in rows])


@torch.no_grad()
def _ms_per_token(model: TransformerLM, position: int, steps: int, dev: torch.device) -> float:
    """Median time of one cached decoding step after a prompt of ``position`` tokens."""
    prompt = torch.randint(0, 256, (1, position), device=dev)
    cache = model.new_cache(1, position + steps + 1)
    logits = model(prompt, cache)
    times = []
    token = logits[:, -1:].argmax(-1)
    for _ in range(steps + 1):
        synchronize(dev)
        start = time.perf_counter()
        token = model(token, cache)[:, -1:].argmax(-1)
        synchronize(dev)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def training_table(rows: list[dict]) -> str:
    base = {r["n"]: r["tokens_per_s"] for r in rows if r["baseline"]}
    first = next((r["model"] for r in rows if r["baseline"]), "first")
    return format_table(
        ["N", "model", "params", "step ms", "tokens/s", "peak MiB", "MFLOP/token", f"throughput vs {first}"],
        [[r["n"], r["model"], f"{r['params'] / 1e6:.2f}M", f"{r['step_s'] * 1e3:.0f}", f"{r['tokens_per_s']:.0f}",
          "n/a" if r["bytes"] is None else f"{r['bytes'] / 2**20:.0f}", f"{r['flops_per_token'] / 1e6:.0f}",
          f"{r['tokens_per_s'] / base[r['n']]:.2f}×"] for r in rows],
    )


def generation_table(rows: list[dict], positions: list[int]) -> str:
    return format_table(["model"] + [f"ms/token at {p}" for p in positions],
                        [[r["model"]] + [f"{r[p]:.1f}" for p in positions] for r in rows])
