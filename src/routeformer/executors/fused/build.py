"""Compiling the fused CPU kernels at first use, as the ecosystem builds CPU ops (``torch.utils.cpp_extension``).

The C++ sources ship in the package (``csrc/``). The first process that needs them compiles them once into the
user's cache (``$TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``, under ``routeformer/``) and says so in
one line; later processes load the built library. The build's name carries a hash of the sources, the flags, the
torch and compiler versions and the processor capability PyTorch reports, so a changed source, another torch or
another machine sharing the cache gets its own build. Flags come from that capability
(``torch.backends.cpu.get_cpu_capability()``), never ``-march=native``: ``at::vec`` needs the matching
``CPU_CAPABILITY`` defines, and a native build in a shared cache could crash a machine without those instructions.

Concurrency: an exclusive ``flock`` on a lock file beside the build serialises builders (parallel test workers
compile once; the others wait, then load). A build runs in a private folder and its library is moved into place
atomically, so a build killed half-way leaves no half-written library, and its lock dies with its process: later
runs rebuild instead of waiting on a stale lock file (``torch.utils.cpp_extension``'s own baton would wait forever).

No compiler, no ninja, or a compile or load error: one warning, and the executor hands every call to the tiles
executor. ``ROUTEFORMER_FUSED=0`` forces the tiles executor.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("ops.cpp", "band.cpp", "ranges.cpp", "rounds.cpp", "activation.cpp")
HEADERS = ("common.h",)
ENV_SWITCH = "ROUTEFORMER_FUSED"  # "0": use the tiles executor on the CPU


class FusedKernelUnavailable(UserWarning):
    """The fused CPU kernels could not be built or loaded; the tiles executor runs instead."""


def capability_flags(capability: str | None = None) -> list[str]:
    """Compiler flags for the processor capability PyTorch dispatches to (``get_cpu_capability``): the instruction
    sets and the ``CPU_CAPABILITY`` defines ``at::vec`` selects its implementation by."""
    cap = capability or torch.backends.cpu.get_cpu_capability()
    if cap == "AVX512":
        return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY=AVX512",
                "-DCPU_CAPABILITY_AVX512"]
    if cap == "AVX2":
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return ["-DCPU_CAPABILITY=DEFAULT"]  # vec's portable scalar implementation


def cache_root() -> Path:
    """Where builds go: $TORCH_EXTENSIONS_DIR (as torch's own builds), else ~/.cache/torch_extensions."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root) / "routeformer"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "torch_extensions" / "routeformer"


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return "unknown"


@dataclass
class KernelBuild:
    """One C++ library built at first use: its sources, flags and cache folder (the package's kernels are
    ``KERNELS``; tests build small ones of their own)."""

    prefix: str
    sources: tuple[Path, ...]
    headers: tuple[Path, ...] = ()
    root: Path | None = None
    extra_cflags: tuple[str, ...] = ("-O3", "-fopenmp")
    what: str = "the fused CPU attention kernel"
    _state: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def flags(self) -> list[str]:
        return [*self.extra_cflags, *capability_flags()]

    def name(self) -> str:
        """prefix_<hash of sources, headers, flags, torch, compiler, capability, machine>."""
        h = hashlib.sha256()
        for path in (*self.sources, *self.headers):
            h.update(path.name.encode())
            h.update(path.read_bytes())
        for part in (*self.flags(), torch.__version__, _compiler_version(_compiler()),
                     torch.backends.cpu.get_cpu_capability(), platform.machine()):
            h.update(part.encode())
        return f"{self.prefix}_{h.hexdigest()[:16]}"

    def load(self) -> str | None:
        """Build (if needed) and load the library once per process: None when loaded, else why it is not (and a
        warning said so, once)."""
        with self._lock:
            if "result" not in self._state:
                self._state["result"] = self._load()
                if self._state["result"] is not None:
                    warnings.warn(f"routeformer: {self.what} is not available ({self._state['result']}); using "
                                  f"the tiles executor", FusedKernelUnavailable, stacklevel=3)
            return self._state["result"]

    def _load(self) -> str | None:
        if os.environ.get(ENV_SWITCH, "1") == "0":
            return f"{ENV_SWITCH}=0"
        try:
            name = self.name()
            folder = (self.root or cache_root()) / name
            library = folder / f"{name}.so"
            if library.exists():
                torch.ops.load_library(str(library))
            else:
                return self._build(name, folder, library)
        except Exception as error:  # a load error, or a cache we cannot write: the tiles executor instead
            return f"{type(error).__name__}: {_first_lines(str(error))}"
        return None

    def _build(self, name: str, folder: Path, library: Path) -> str | None:
        """Compile into a private folder, load, and move the library into place, under an exclusive lock; None on
        success (or when another process built it meanwhile: then loaded from there), else the reason."""
        from torch.utils import cpp_extension

        if shutil.which(_compiler()) is None:
            return f"no C++ compiler ({_compiler()!r} not found; set CXX)"
        if not cpp_extension.is_ninja_available():
            return "ninja is not installed (pip install ninja)"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder.parent / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies
            try:
                if library.exists():  # built by another process while this one waited
                    torch.ops.load_library(str(library))
                    return None
                for stale in folder.glob("build-*"):  # left by a build that was killed: nobody else holds the lock
                    shutil.rmtree(stale, ignore_errors=True)
                work = Path(tempfile.mkdtemp(prefix="build-", dir=folder))
                print(f"routeformer: compiling {self.what} into {folder} (once, about a minute)", file=sys.stderr,
                      flush=True)
                try:
                    built = _compile_and_load(name, [str(s) for s in self.sources], self.flags(), work)
                except Exception as error:  # the build folder stays, for its log and build.ninja
                    return f"compile error: {_compiler_errors(str(error))} (build folder: {work})"
                os.replace(built, library)  # the loaded mapping stays valid
                shutil.rmtree(work, ignore_errors=True)
                return None
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _compile_and_load(name: str, sources: list[str], cflags: list[str], work: Path) -> Path:
    """Compile and link ``sources`` into ``work/name.so`` with cpp_extension's ninja build and load it (its
    operators register with the dispatcher)."""
    from torch.utils import cpp_extension

    cpp_extension.load(name=name, sources=sources, extra_cflags=cflags, extra_ldflags=["-fopenmp"],
                       extra_include_paths=[str(Path(sources[0]).parent)], build_directory=str(work), verbose=False,
                       with_cuda=False, is_python_module=False)
    return work / f"{name}.so"


def _compiler_errors(text: str, n: int = 3) -> str:
    """The compiler's own error lines of a failed build's output (else its first lines)."""
    errors = [line.strip() for line in text.splitlines() if "error" in line and not line.lstrip().startswith(
        ("c++ ", "g++ ", "FAILED", "[", "ninja"))]
    return " | ".join(errors[:n]) if errors else _first_lines(text)


def _first_lines(text: str, n: int = 6) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[:n]) + (" | …" if len(lines) > n else "")


KERNELS = KernelBuild("routeformer_fused", tuple(CSRC / s for s in SOURCES), tuple(CSRC / h for h in HEADERS))
