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

``host_reads`` records, on any device, every operation that reads a tensor's values on the host (on CUDA each one
waits for the device: a host synchronisation), with the Python frames that asked for it.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

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


# --- host reads ---------------------------------------------------------------------------------------------------

# Operators whose result depends on tensor values the host must see first (the size of their output, or a Python
# value): on CUDA each waits for the device.
READING_OPS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select", "_unique",
                         "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive", "equal",
                         "allclose", "bincount"})
_BOOL_INDEXED = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})  # a bool index is a nonzero
_PYTHON_READS = ("tolist", "numpy")  # Tensor methods that read values without dispatching an operator
_TORCH = str(Path(torch.__file__).parent)


def _in_package(frame: traceback.FrameSummary) -> bool:
    path = frame.filename.replace("\\", "/")
    return "/routeformer/" in path and not path.endswith("/routeformer/testing.py")


@dataclass(frozen=True)
class HostRead:
    """One read of tensor values on the host: ``what`` read them (``aten.nonzero``, ``Tensor.tolist``, ...) and
    ``stack``, the Python frames that asked for it (innermost last)."""

    what: str
    stack: tuple[traceback.FrameSummary, ...]  # ends at the caller: torch's own frames below it left out

    def _frame(self) -> traceback.FrameSummary:
        """The innermost frame inside the routeformer package (else the innermost)."""
        return ([f for f in self.stack if _in_package(f)] or list(self.stack))[-1]

    @property
    def function(self) -> str:
        """'path/in/package.py:function' of the innermost routeformer frame that asked."""
        f = self._frame()
        return f"{f.filename.replace(chr(92), '/').rsplit('/routeformer/', 1)[-1]}:{f.name}"

    def __str__(self) -> str:
        return f"{self.what} at {self.function} line {self._frame().lineno}"


@dataclass
class HostReads:
    """The reads ``host_reads`` recorded, in order."""

    found: list[HostRead] = field(default_factory=list)

    def report(self) -> str:
        """One line per read, with the routeformer frames that led to it."""
        lines = []
        for read in self.found:
            chain = " <- ".join(f"{f.name}:{f.lineno}" for f in reversed(read.stack) if _in_package(f))
            lines.append(f"{read} ({chain})")
        return "\n".join(lines)


class _Recorder(TorchDispatchMode):
    supports_higher_order_operators = True  # HOPs run as they are, unobserved: the mode is off in __torch_dispatch__

    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.reads, self.paused = reads, 0

    def note(self, what: str) -> None:
        if not self.paused:
            stack = traceback.extract_stack()
            while stack and (stack[-1].filename.startswith(_TORCH) or stack[-1].filename == __file__):
                stack.pop()  # the dispatch machinery and this recorder: the stack ends at the caller
            self.reads.found.append(HostRead(what, tuple(stack)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.OpOverload):
            name = func.overloadpacket.__name__
            if name in READING_OPS or (name == "repeat_interleave" and isinstance(args[0], torch.Tensor)
                                       and kwargs.get("output_size") is None
                                       and (len(args) < 3 or args[2] is None) and func._overloadname == "Tensor"):
                self.note(f"aten.{name}")
            elif name in _BOOL_INDEXED and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                               for i in (args[1] if len(args) > 1 else ()) if i is not None):
                self.note(f"aten.{name} with a bool index")
        return func(*args, **kwargs)


@contextlib.contextmanager
def host_reads(unobserved: tuple[tuple[object, str], ...] = ()) -> Iterator[HostReads]:
    """Record every read of tensor values on the host inside the block (``HostReads.found``): the operators of
    ``READING_OPS`` (``.item()``, ``int(t)``, ``bool(t)``, ``nonzero``, ``unique``, ...), ``repeat_interleave``
    with a tensor of repeats and no output size, indexing with a bool tensor, and ``Tensor.tolist`` / ``.numpy``,
    each with its Python stack; forward and backward alike (the mode is thread-local state that autograd carries).

    Where tensors live on CUDA each such read waits for the device; on the CPU nothing waits, so a test on the CPU
    finds the reads a CUDA run would synchronise on, along with reads of tensors that stay on the host by design
    (which the caller then names as such). ``unobserved``: (owner, attribute) pairs, functions run with the
    recorder off (e.g. ``FLEX_EAGER``, FlexAttention's eager operator on CPU, which torch.compile cannot trace
    with a dispatch mode on and which the GPU compiles instead). Higher-order operators (FlexAttention's
    backward) run unobserved too.
    """
    reads = HostReads()
    recorder = _Recorder(reads)
    saved: list[tuple[object, str, object, bool]] = []

    def patch(owner: object, name: str, make) -> None:
        own = name in vars(owner)
        original = getattr(owner, name)
        saved.append((owner, name, original, own))
        setattr(owner, name, make(original))

    def reading(what: str):
        def make(original):
            def method(self, *args, **kwargs):
                recorder.note(what)
                recorder.paused += 1
                try:
                    return original(self, *args, **kwargs)
                finally:
                    recorder.paused -= 1
            return method
        return make

    def silent(original):
        def run(*args, **kwargs):
            recorder.paused += 1
            try:
                with torch.utils._python_dispatch._disable_current_modes():
                    return original(*args, **kwargs)
            finally:
                recorder.paused -= 1
        return run

    try:
        for name in _PYTHON_READS:
            patch(torch.Tensor, name, reading(f"Tensor.{name}"))
        for owner, name in unobserved:
            patch(owner, name, silent)
        with recorder:
            yield reads
    finally:
        for owner, name, original, own in reversed(saved):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


def _flex_eager() -> tuple[tuple[object, str], ...]:
    from .executors.flex import call

    return ((call, "_eager"),)


FLEX_EAGER = _flex_eager()  # FlexAttention's dense eager operator, the flex executor's CPU path (``host_reads``)
