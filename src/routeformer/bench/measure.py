"""Timing and peak-memory measurement for benchmarks (never for tests of behaviour)."""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from .. import hugepages
from ..executors import resolve_backend
from ..executors.fused.build import KERNELS, FusedKernelRequired


def merge_fields(*tables: dict) -> dict:
    """TransformerConfig fields, the later tables' winning; their ``options`` merged section by section and field by
    field."""
    out: dict = {}
    options: dict = {}
    for table in tables:
        for key, value in table.items():
            if key == "options":
                for section, settings in value.items():
                    options[section] = {**options.get(section, {}), **settings}
            else:
                out[key] = value
    return {**out, "options": options} if options else out


def cpu_pages(device: torch.device) -> str:
    """``", huge pages on"`` (or off) for a CPU benchmark's header: fresh outputs on 4 KiB pages cost page faults
    that add up to about 40% to the kernels' times at 16k (``hugepages``); empty on other devices."""
    return f", huge pages {hugepages.state()}" if device.type == "cpu" else ""


def measured_backend(backend: str, device: torch.device) -> str:
    """The executor a benchmark's rows run on, and for the fused one its kernel of the capability PyTorch dispatches
    to or an error (as ``ROUTEFORMER_FUSED=1``): fused rows never measure the tiles fallback or a narrower build
    without saying so."""
    name = resolve_backend(backend, device)
    if name == "fused" and device.type == "cpu":
        status = KERNELS.status()
        if status.failures or not status.ok:
            raise FusedKernelRequired(
                f"routeformer bench: the fused rows need the fused kernel's {status.wanted} build, which this process "
                f"does not have ({status.why()}); measure the tiles executor with --backend tiles, or a lower "
                f"capability with ATEN_CPU_CAPABILITY=avx2|default")
    return name


@dataclass(frozen=True)
class Echo:
    """Where a benchmark's lines go: its tables (``table``: called as ``echo(line)``) and its notes on how it runs,
    such as the line naming the attention executor (``note``; none by default): one value, so a benchmark's
    ``run`` takes one ``echo`` (a plain callable is an Echo without notes)."""

    table: Callable[[str], None] = print
    note: Callable[[str], None] | None = None

    def __call__(self, line: str) -> None:
        self.table(line)


def notes(echo: Callable[[str], None]) -> Callable[[str], None] | None:
    """Where ``echo``'s notes go: its ``note`` if it is an ``Echo``, else nowhere."""
    return echo.note if isinstance(echo, Echo) else None


def executor_lines(lines: dict[str, str]) -> list[str]:
    """The banner of a benchmark of several models: row name -> its ``describe_executor`` line, one line per
    distinct line, naming its rows when the rows differ ('attention (full, local): fused C++ kernel (...)')."""
    rows: dict[str, list[str]] = {}
    for name, line in lines.items():
        rows.setdefault(line, []).append(name)
    if len(rows) <= 1:
        return list(rows)
    return [line.replace("attention:", f"attention ({', '.join(names)}):", 1) for line, names in rows.items()]


def memory_trackable(device: torch.device, backend: str) -> bool:
    """Whether ``PeakMemory`` can watch attention run by ``backend`` on ``device``: on CPU its dispatch mode is
    refused by FlexAttention's operator (and a refused trace breaks later flex calls in the process)."""
    return not (device.type == "cpu" and resolve_backend(backend, device) == "flex")


def kept_for_backward(fn: Callable[[], object]) -> int:
    """Bytes of the distinct storages autograd saves for the backward while ``fn()`` runs (through
    ``torch.autograd.graph.saved_tensors_hooks``): inputs, outputs and intermediates the backward will read."""
    seen: dict[tuple[int, str], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[(storage.data_ptr(), str(t.device))] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


class PeakMemory:
    """Peak tensor memory allocated inside a ``with`` block, in bytes above what was live when it began.

    CUDA: the caching allocator's statistics. CPU: PyTorch keeps no CPU allocator statistics, and the process's
    resident-set size hides reuse of freed heap memory, so every tensor storage created inside the block
    (forward, backward, saved activations) is counted from its creation to its release, through a dispatch mode.
    Scratch memory that a kernel allocates and frees internally is not seen on CPU (the fused kernels: per-thread
    (T, KC) score buffers, and the ranges' per-entry partial results, O(N · probes · D)).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.bytes: int | None = None
        self._tracker: _StorageTracker | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._tracker = _StorageTracker().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        elif self._tracker is not None:
            self._tracker.__exit__(*exc)
            self.bytes = self._tracker.peak


class _StorageTracker(TorchDispatchMode):
    """Live and peak bytes of the storages created by the ops run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                if storage not in self._seen:  # views and in-place results share a storage
                    size = storage.nbytes()
                    self._seen[storage] = size
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._release, size)
        return out

    def _release(self, size: int) -> None:
        self.live -= size


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _warm(fn: Callable[[], object], device: torch.device | str, warmup_s: float, max_warmup: int) -> None:
    """Warm-up calls of ``fn``: one, then more until ``warmup_s`` have passed or ``max_warmup`` calls were made."""
    start, calls = time.perf_counter(), 0
    while calls == 0 or (calls < max_warmup and time.perf_counter() - start < warmup_s):
        fn()
        synchronize(device)
        calls += 1


def _timed(fn: Callable[[], object], device: torch.device | str) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def median_time(fn: Callable[[], object], repeats: int, device: torch.device | str, *, warmup_s: float = 1.0,
                max_warmup: int = 10) -> float:
    """Median wall time (s) of ``repeats`` consecutive calls of ``fn``, after warm-up calls: one, then more until
    ``warmup_s`` have passed or ``max_warmup`` calls were made (with huge pages a process's first large allocations
    are slower for some calls: docs/benchmarks.md, "Huge pages").

    Each candidate is timed in its own consecutive runs: interleaving candidates made one pay for the heap state
    another left behind (on CPU, freshly mapped pages for its large buffers), which is not its own cost.
    """
    _warm(fn, device, warmup_s, max_warmup)
    return statistics.median(_timed(fn, device) for _ in range(repeats))


def alternated_median_times(fns: Sequence[Callable[[], object]], repeats: int, device: torch.device | str, *,
                            warmup_s: float = 1.0, max_warmup: int = 10) -> list[float]:
    """Median wall time (s) of each of ``fns``, twins that should cost alike (one mechanism with and without packed
    documents), called in turn ``repeats`` times each after each one's warm-up (``median_time``'s), the order
    reversed every round (a, b, b, a, ...): both pay alike for the process's state at the time (page faults, huge
    pages' compaction), which on a 2-core CPU moved one row of a pair measured after the other by up to 1.7x
    (docs/attention.md, "Packed documents")."""
    for fn in fns:
        _warm(fn, device, warmup_s, max_warmup)
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            times[i].append(_timed(fns[i], device))
    return [statistics.median(t) for t in times]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (right-aligned numbers), readable in a terminal and pasteable into the README."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_number(r[i]) for r in cells[1:]) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        padded = (c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric, strict=True))
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2))
                          for w, num in zip(widths, numeric, strict=True)) + "|"
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def _is_number(text: str) -> bool:
    try:
        float(text.rstrip("×x"))
        return True
    except ValueError:
        return text in ("-", "n/a")
