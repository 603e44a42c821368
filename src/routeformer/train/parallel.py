"""Precision and parallelism: on which processes and device the model trains (train/distributed.py), in which
precision (autocast and the gradient scaler), and in which data-parallel form: replicated by DDP, or its blocks
sharded by FSDP2 (``fsdp``); compiled by ``torch.compile`` when asked, or by default where that pays
(``compile_choice``). Also the collective forms of the states a checkpoint needs from a sharded model and optimizer.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .config import TrainConfig
from .distributed import Processes


def resolve_precision(precision: str, device: torch.device) -> str:
    """What precision ``auto`` is on ``device`` (bfloat16 on CUDA where supported, else float16; float32
    elsewhere); other values as they are."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "float32"


# compile = "auto" compiles a run on a CPU, in one process, when its first steps (eager) say the rest of it would take
# this long or longer. Measured on the main job (2 cores, torch 2.13; docs/training.md): the compiled step takes
# 0.82x the eager one's time and compiling costs about 40 s (less with inductor's cache warm), which an 18% saving
# pays back after about 4 minutes. Not measured with DDP, FSDP or on CUDA: eager there unless compile = true.
AUTO_COMPILE_MINUTES = 5.0


def compile_choice(cfg: TrainConfig, procs: Processes) -> tuple[str, str | None]:
    """How the run compiles its model: "on", "off" or "auto" (decided after its first steps), from ``compile`` and
    where the run is; and a line that says why "auto" is "off" where it would have compiled (no C++ compiler for
    inductor), else None."""
    if cfg.compile != "auto":
        return ("on" if cfg.compile else "off"), None
    if procs.device.type != "cpu" or procs.distributed or cfg.fsdp:
        return "off", None
    missing = _no_inductor_compiler()
    if missing:
        return "off", f"model: eager ({missing}; compile = \"auto\" would compile a long CPU run)"
    return "auto", None


def _no_inductor_compiler() -> str | None:
    """Why inductor cannot build its C++ kernels here (no compiler), or None."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        compiler = get_cpp_compiler()
    except Exception as err:  # noqa: BLE001 - whatever stops the search is the reason
        return f"torch.compile finds no C++ compiler: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
    return None if shutil.which(compiler) else f"torch.compile finds no C++ compiler ({compiler!r})"


def pin_inductor_isa() -> None:
    """Make the vector instruction set torch.compile's CPU code is generated for part of inductor's cache key, by
    setting ``cpp.simdlen`` to the width of the one it picks (the same set is then picked); a width set before is kept.

    Why: inductor's FX graph cache (torch 2.13) reuses C++ generated under another ``ATEN_CPU_CAPABILITY``. Code
    generated for AVX2 (loops of 8 floats) and reused by a process on AVX-512 is compiled there with 16-float vectors:
    its full-width stores run 8 floats past the buffers, a heap corruption ("malloc(): unaligned tcache chunk
    detected", met by tests/test_compile.py on this project's machine after a run of the AVX2 build); the other way
    round, loops of 16 over vectors of 8 would leave elements unwritten (not examined). With the width in the
    configuration the two never share an entry."""
    from torch._inductor import config, cpu_vec_isa

    if config.cpp.simdlen is None:
        config.cpp.simdlen = cpu_vec_isa.pick_vec_isa().bit_width()


class Parallelism:
    def __init__(self, procs: Processes, cfg: TrainConfig) -> None:
        self.procs = procs
        if cfg.fsdp and not procs.distributed:
            raise ValueError("fsdp shards the model across the processes of torchrun; this run was not started by "
                             "torchrun (start it with torchrun --nproc-per-node N, 1 included, or drop --fsdp)")
        self.sharded = cfg.fsdp
        self.compile, self.compile_note = compile_choice(cfg, procs)
        dev = procs.device
        self.precision = choice = resolve_precision(cfg.precision, dev)
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(choice)
        # A new context manager at each call: forward passes of training, evaluation and sampling run under it.
        self.autocast: Callable[[], contextlib.AbstractContextManager] = \
            (lambda: torch.autocast(dev.type, dtype=dtype)) if dtype else contextlib.nullcontext
        self.scaler = torch.amp.GradScaler(dev.type, enabled=choice == "float16")

    @property
    def device(self) -> torch.device:
        return self.procs.device

    def wrap(self, core: nn.Module) -> nn.Module:
        """``core`` (already on the device) in its data-parallel form, the module training calls forward on.

        FSDP2 shards ``core`` in place (each block, then the rest), so its parameters become this rank's shards;
        DDP wraps it. ``core`` stays the module to evaluate, sample and checkpoint."""
        model: nn.Module = core
        if self.sharded:
            from torch.distributed.fsdp import fully_shard

            for block in core.blocks:
                fully_shard(block)
            fully_shard(core)
        elif self.procs.distributed:
            from torch.nn.parallel import DistributedDataParallel

            # Buffers are not broadcast: the k-means statistics each rank gathers are its own until the
            # all-reduce of after_optimizer_step(), which keeps the centroids identical.
            model = DistributedDataParallel(
                core, device_ids=[self.procs.device.index] if self.procs.device.type == "cuda" else None,
                broadcast_buffers=False)
        return model

    def compiled(self, model: nn.Module) -> nn.Module:
        """``model`` compiled by torch.compile when the run compiles (``compile`` true), else ``model``."""
        return _compile(model) if self.compile == "on" else model

    def training_forward(self, model: nn.Module, compiled_from: int | None, first_step: int) -> TrainingForward:
        """What the loop calls forward on: ``model`` (the data-parallel form), compiled as the run says: from this
        invocation's first step ``first_step`` if the checkpoint's progress says the run compiled (``compiled_from``,
        a resumed run), else from the run's second step (``compile`` true) or when "auto" decides."""
        fixed = self.procs.device.type == "cpu"
        if self.compile == "off":
            return TrainingForward(model, "off")
        if compiled_from is not None:
            return TrainingForward(model, "on", first_step, auto=self.compile == "auto", fixed_order=fixed)
        if self.compile == "on":
            return TrainingForward(model, "on", max(first_step, 2), fixed_order=fixed)
        return TrainingForward(model, "auto", auto=True, fixed_order=fixed)

    def full_state(self, core: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """The whole model and optimizer states (sharded ones gathered to the CPU, every rank taking part)."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return (get_model_state_dict(core, options=options),
                    get_optimizer_state_dict(core, optimizer, options=options))
        return core.state_dict(), optimizer.state_dict()

    def load_optimizer_state(self, core: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """A whole optimizer state (as :meth:`full_state` returns it) into ``optimizer``, sharded if the model is."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(core, optimizer, state, options=StateDictOptions(full_state_dict=True))
        else:
            optimizer.load_state_dict(state)

    def describe(self) -> str:
        ddp = " with DDP" if self.procs.distributed and not self.sharded else ""
        return f"{self.procs.world} process(es){ddp} on {self.procs.device}, {self.precision}"


class TrainingForward:
    """The training forward: ``model`` (B, N) tokens -> (B, N, V) logits, through its torch.compile form from the
    step ``start`` on (``mode`` "on"), never ("off"), or from the step after :meth:`decide` chose to ("auto").

    A run's first step runs eagerly: it holds one-time changes of the model's Python state (k-means seeds its
    centroids from it, and a flag flips after its update), on which torch.compile would guard and compile the model a
    second time (16 s more on the main job). ``auto`` (compile = "auto"): a compile error in the forward goes back to
    eager mode for the rest of the run and says so once (``say``; nothing of the step had run: the forward is compiled
    before it runs); with compile = true it is raised. ``fixed_order`` (a CPU run): the loop runs inside
    :meth:`reproducible`.
    """

    def __init__(self, model: nn.Module, mode: str, start: int = 2, *, auto: bool = False,
                 fixed_order: bool = False) -> None:
        self.model, self.mode, self.start, self.auto, self.fixed_order = model, mode, start, auto, fixed_order
        self.say: Callable[[str], None] = lambda line: None  # the loop's progress bar, on the main process
        self.compiled: nn.Module | None = _compile(model) if mode == "on" else None
        self.compiled_at: int | None = None  # the step of the first compiled forward (it holds the compilation)

    @property
    def undecided(self) -> bool:
        """Whether "auto" has still to choose (:meth:`decide`)."""
        return self.mode == "auto"

    def decide(self, step: int, eager_seconds_left: float) -> bool:
        """"auto"'s choice after ``step``: compile from the next step if the rest of the run would take
        ``AUTO_COMPILE_MINUTES`` or longer eagerly (``eager_seconds_left``). Returns whether it compiles."""
        if eager_seconds_left < AUTO_COMPILE_MINUTES * 60:
            self.mode = "off"
            return False
        self.mode, self.start, self.compiled = "on", step + 1, _compile(self.model)
        self.say(f"compiling the model with torch.compile (about a minute, once): the rest of the run would take "
                 f"{eager_seconds_left / 60:.0f} min eagerly (compile = \"auto\" compiles CPU runs with "
                 f"{AUTO_COMPILE_MINUTES:g} min or more to go; --set compile=false keeps them eager)")
        return True

    def __call__(self, tokens: torch.Tensor, step: int, documents: torch.Tensor | None = None) -> torch.Tensor:
        inputs = {} if documents is None else {"documents": documents}
        if self.compiled is None or step < self.start:
            return self.model(tokens, **inputs)
        if self.compiled_at is None:
            self.compiled_at = step
        try:
            return self.compiled(tokens, **inputs)
        except torch._dynamo.exc.BackendCompilerFailed as err:
            if not self.auto:
                raise
            self.mode, self.compiled = "off", None
            cause = getattr(err, "inner_exception", err)
            first = (str(cause).strip().splitlines() or [""])[0]
            self.say(f"warning: torch.compile failed, training eagerly from here (compile = \"auto\"; "
                     f"--set compile=false skips it): {type(cause).__name__}: {first}")
            return self.model(tokens, **inputs)

    def eager(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The data-parallel model's own forward on ``inputs``, never compiled: an encoder-decoder run's batches of
        pairs, whose lengths change every step."""
        return self.model(*inputs)

    @contextlib.contextmanager
    def reproducible(self) -> Iterator[None]:
        """Where this forward may be compiled on a CPU (``fixed_order``): PyTorch's deterministic algorithms while
        the loop runs (warnings only; the setting before is restored after). Inductor then leaves accumulating
        index_put, index_add and scatter_add (the embedding's gradient, the k-means statistics where PyTorch adds
        them) to ATen's kernels, which add in a fixed order, instead of generating atomic adds across threads, whose
        order, and so the last bits, varies from run to run: a resumed compiled run would not be the uninterrupted
        one (measured, before the fused router took the statistics: it differed at the 20th step)."""
        if self.mode == "off" or not self.fixed_order:
            yield
            return
        before = torch.are_deterministic_algorithms_enabled()
        warn = torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(before, warn_only=warn)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """DDP's no_sync (gradients kept local for an accumulating micro-batch); a no-op without DDP."""
        no_sync = getattr(self.model, "no_sync", None)
        return no_sync() if no_sync is not None else contextlib.nullcontext()


def _compile(model: nn.Module) -> nn.Module:
    """torch.compile(model), its vector width pinned (``pin_inductor_isa``)."""
    pin_inductor_isa()
    return torch.compile(model)
