"""The generic checks every head kind must pass, exposed for users' own kinds (``check_kind``).

- reference: the group's forward equals its dense definition (``HeadGroup.reference``: softmax attention under its
  ``reference_mask``, or the kind's own quadratic definition) in float64, outputs and gradients of q, k, v and the
  relative-position tables;
- leak: in a small model, changing the tokens after position t changes no logit at or before t;
- decode: decoding with the cache (a prompt, then one token at a time, then a chunk) reproduces the full forward's
  logits;
- train: a training step runs (the auxiliary loss is finite, gradients reach every projection) and the per-step
  hook runs.

Everything is float64 on the CPU, at a small size, in a few seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import RelativePositions
from .attention.registry import get_kind
from .model import TransformerConfig, TransformerLM


@dataclass
class KindReport:
    """Largest absolute differences found by ``check_kind`` (each within its tolerance)."""

    reference: float
    reference_grad: float
    leak: float
    decode: float


def check_kind(name: str, *, seq_len: int = 48, heads: int = 2, head_dim: int = 8, positions: str = "relative",
               seed: int = 0, tolerance: float = 1e-9, **config) -> KindReport:
    """Run the generic checks on the registered kind ``name``; raises AssertionError naming the failed check.

    ``config``: further ``TransformerConfig`` fields (``rel_clip=8``, ``options={"mine": {...}}``, ...). The model
    has 2 layers whose heads are all of this kind, ``seq_len`` positions, and the given ``positions``.
    ``tolerance``: the largest absolute difference accepted in float64.
    """
    kind = get_kind(name)
    cfg = TransformerConfig(vocab_size=32, dim=heads * head_dim, depth=2, heads=heads, seq_len=seq_len,
                            attention=name, positions=positions, **config)
    gen = torch.Generator().manual_seed(seed)
    report = KindReport(*_reference(cfg, kind, gen, tolerance), _leak(cfg, gen, tolerance),
                        _decode(cfg, gen, tolerance))
    _train_step(cfg)
    return report


def _fail(check: str, name: str, detail: str) -> AssertionError:
    return AssertionError(f"{name} heads fail the {check} check: {detail}")


def _reference(cfg: TransformerConfig, kind, gen: torch.Generator, tolerance: float) -> tuple[float, float]:
    group_spec = cfg.head_groups()[0][0]
    group = kind.build(group_spec.options, cfg.heads, cfg.head_dim, 0).double().eval()
    rel = RelativePositions(cfg.head_dim, cfg.rel_clip).double() if cfg.positions == "relative" else None
    if rel is not None:
        with torch.no_grad():
            rel.key.normal_(generator=gen)
            rel.value.normal_(generator=gen)
    shape = (2, cfg.heads, cfg.seq_len, cfg.head_dim)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    shared = kind.heads_share_qk(group_spec.options)
    results = []
    for attend in (group, group.reference):
        out = attend(q, q if shared else k, v, rel)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
        leaves = [q, v] + ([] if shared else [k]) + ([rel.key, rel.value] if rel is not None else [])
        grads = torch.autograd.grad((out * weights).sum(), leaves, allow_unused=True)
        results.append((out.detach(), grads))
    (out, grads), (ref, ref_grads) = results
    err = (out - ref).abs().max().item()
    if not err <= tolerance:
        raise _fail("reference", kind.name, f"forward differs from the dense definition by {err:.3g}")
    grad_err = 0.0
    for g, r in zip(grads, ref_grads, strict=True):
        g = torch.zeros_like(r) if g is None else g
        r = torch.zeros_like(g) if r is None else r
        grad_err = max(grad_err, (g - r).abs().max().item())
    if not grad_err <= tolerance:
        raise _fail("reference", kind.name, f"gradients differ from the dense definition's by {grad_err:.3g}")
    return err, grad_err


def _model(cfg: TransformerConfig) -> TransformerLM:
    torch.manual_seed(0)
    model = TransformerLM(cfg).double()
    with torch.no_grad():  # the paper's init zeroes the logit weights: nothing would reach the output
        model.head.weight.normal_(std=0.5)
    return model.eval()


def _tokens(cfg: TransformerConfig, gen: torch.Generator, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=gen)


@torch.no_grad()
def _leak(cfg: TransformerConfig, gen: torch.Generator, tolerance: float) -> float:
    model, tokens = _model(cfg), _tokens(cfg, gen)
    base = model(tokens)
    worst = 0.0
    for t in sorted({0, cfg.seq_len // 3, cfg.seq_len // 2, cfg.seq_len - 2}):
        changed = tokens.clone()
        changed[:, t + 1:] = torch.randint(0, cfg.vocab_size, changed[:, t + 1:].shape, generator=gen)
        diff = (model(changed)[:, :t + 1] - base[:, :t + 1]).abs().max().item()
        if not diff <= tolerance:
            raise _fail("leak", cfg.attention, f"changing the tokens after position {t} changes the logits at or "
                                               f"before it by {diff:.3g}")
        worst = max(worst, diff)
    return worst


@torch.no_grad()
def _decode(cfg: TransformerConfig, gen: torch.Generator, tolerance: float) -> float:
    model, tokens = _model(cfg), _tokens(cfg, gen)
    full = model(tokens)
    cache = model.new_cache(tokens.shape[0], cfg.seq_len)
    prompt, chunk = max(2, cfg.seq_len // 4), cfg.seq_len - 4
    parts = [model(tokens[:, :prompt], cache)]
    parts += [model(tokens[:, i:i + 1], cache) for i in range(prompt, chunk)]
    parts.append(model(tokens[:, chunk:], cache))
    err = (torch.cat(parts, 1) - full).abs().max().item()
    if not err <= tolerance:
        raise _fail("decode", cfg.attention, f"decoding with the cache differs from the full forward by {err:.3g}")
    return err


def _train_step(cfg: TransformerConfig) -> None:
    model = _model(cfg).train()
    tokens = _tokens(cfg, torch.Generator().manual_seed(2))
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) + model.aux_loss
    if not torch.isfinite(loss):
        raise _fail("train", cfg.attention, f"the training loss is {loss.item()}")
    loss.backward()
    for name, p in model.named_parameters():
        if "query" in name and (p.grad is None or not torch.isfinite(p.grad).all()):
            raise _fail("train", cfg.attention, f"no finite gradient reaches {name}")
    model.after_optimizer_step(0)
