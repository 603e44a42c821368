"""Compiling the fused CPU kernels at first use, as the ecosystem builds CPU ops (``torch.utils.cpp_extension``).

The C++ sources ship in the package (``csrc/``). The first process that needs them compiles them once into the
user's cache (``$TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``, under ``routeformer/``) and says so in
one line; later processes load the built library. A build's name carries a hash of the sources, every header, the
compile and link flags, the torch and compiler versions, the instruction set and the machine, so a changed source,
another torch or another machine sharing the cache gets its own build.

Instruction sets: one build per capability PyTorch dispatches to (``torch.backends.cpu.get_cpu_capability()``,
which ``ATEN_CPU_CAPABILITY=default|avx2|avx512`` lowers), with that capability's flags and the ``CPU_CAPABILITY``
defines ``at::vec`` selects its implementation by (``Vectorized<float>`` is 16 lanes under AVX512, 8 under AVX2),
never ``-march=native`` (a native build in a shared cache could crash a machine without those instructions). On x86
a build that fails falls back to the next lower capability (a processor that runs one runs those below it), then to
the tiles executor, and one warning says so. Elsewhere (arm64, ...) there is one build, with the DEFAULT flags:
``at::vec`` is then NEON's (``vec128``) on arm64, whose float reductions the kernels call as on x86; a compiler
without OpenMP (macOS' clang) fails that build, and the tiles executor runs, with the warning.

A failed compilation is remembered per build (``failed.txt`` in its folder, with the compiler's log beside it): later
processes warn and fall back without compiling again; removing the folder retries. No compiler or no ninja is not
remembered (cheap to look for again).

``ROUTEFORMER_FUSED``: unset or ``auto``, the above; ``0``, the tiles executor; ``1``, the kernel is required: any
fallback (a lower capability's build, or tiles) is an error naming why, as benchmarks of the kernel want.

Concurrency: an exclusive file lock (``filelock``, a torch dependency; ``flock`` on Unix, released by the kernel if
the process dies) beside the build serialises builders (parallel test workers compile once; the others wait, then
load). A build runs in a private folder and its library is moved into place atomically, so a build killed half-way
leaves no half-written library, and later runs rebuild instead of waiting on a stale lock
(``torch.utils.cpp_extension``'s own baton would wait forever).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from filelock import FileLock

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("ops.cpp", "band.cpp", "ranges.cpp", "rounds.cpp", "activation.cpp", "select.cpp", "route.cpp", "probes.cpp",
           "scan.cpp", "vectors.cpp")
ENV_SWITCH = "ROUTEFORMER_FUSED"  # "0": the tiles executor; "1": the kernel or an error; unset / "auto": fallbacks
SWITCH_VALUES = ("auto", "0", "1")
CAPABILITIES = ("AVX512", "AVX2", "DEFAULT")  # x86's builds, widest first
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
FAILED = "failed.txt"  # in a build's folder: why its compilation failed (the log beside it)
LOG = "build.log"


class FusedKernelUnavailable(UserWarning):
    """The fused CPU kernels could not be built or loaded (the tiles executor runs instead), or only a lower
    capability's build could (it runs instead)."""


class FusedKernelRequired(RuntimeError):
    """``ROUTEFORMER_FUSED=1`` and the kernel of the capability PyTorch dispatches to could not be had."""


def switch() -> str:
    """``ROUTEFORMER_FUSED`` as one of ``auto``, ``0``, ``1`` (unset: ``auto``); anything else is an error."""
    value = os.environ.get(ENV_SWITCH, "auto").strip().lower() or "auto"
    if value not in SWITCH_VALUES:
        raise ValueError(f"{ENV_SWITCH}={os.environ[ENV_SWITCH]!r}: expected one of {', '.join(SWITCH_VALUES)} "
                         f"(0: the tiles executor, 1: the fused kernel or an error, auto: fall back with a warning)")
    return value


def dispatched_capability() -> str:
    """The instruction set PyTorch dispatches its own CPU kernels to (``ATEN_CPU_CAPABILITY`` can lower it)."""
    return torch.backends.cpu.get_cpu_capability()


def build_chain(capability: str | None = None) -> tuple[str, ...]:
    """The builds to try, in order: on x86 the dispatched capability, then each lower one; elsewhere DEFAULT's."""
    cap = capability or dispatched_capability()
    if X86 and cap in CAPABILITIES:
        return CAPABILITIES[CAPABILITIES.index(cap):]
    return ("DEFAULT",)


def capability_flags(capability: str | None = None) -> list[str]:
    """Compiler flags of one capability: the instruction sets and the ``CPU_CAPABILITY`` defines ``at::vec``
    selects its implementation by (as ATen's own build sets them)."""
    cap = capability or build_chain()[0]
    if cap == "AVX512":
        return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY=AVX512",
                "-DCPU_CAPABILITY_AVX512"]
    if cap == "AVX2":
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"]  # vec's portable (or NEON) implementation


def cache_root() -> Path:
    """Where builds go: $TORCH_EXTENSIONS_DIR (as torch's own builds), else ~/.cache/torch_extensions."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root) / "routeformer"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "torch_extensions" / "routeformer"


def compiler() -> str:
    return os.environ.get("CXX", "c++")


def compiler_version(cxx: str | None = None) -> str:
    """The compiler's first ``--version`` line (once per compiler and process: every build name hashes it)."""
    return _version_of(cxx or compiler())


@functools.cache
def _version_of(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return "unknown"


def _remembered(folder: Path) -> str | None:
    """The reason a build's compilation failed, as remembered in its folder, or None."""
    marker = folder / FAILED
    return marker.read_text().strip() if marker.exists() else None


@dataclass(frozen=True)
class BuildStatus:
    """What this process has of one kernel library: the capability of the build it loaded (None: none), the
    capability PyTorch dispatches to, and why a build did not load (in the order tried), with their logs."""

    loaded: str | None
    wanted: str
    failures: tuple[tuple[str, str], ...] = ()  # (capability, why)
    library: Path | None = None

    @property
    def ok(self) -> bool:
        return self.loaded is not None

    def why(self) -> str:
        """The failures, one clause each: 'AVX512: compile error: ... (log: ...)'."""
        return "; ".join(f"{cap}: {reason}" for cap, reason in self.failures)


@dataclass
class KernelBuild:
    """One C++ library built at first use: its sources, flags and cache folder (the package's kernels are
    ``KERNELS``; tests build small ones of their own)."""

    prefix: str
    sources: tuple[Path, ...]
    headers: tuple[Path, ...] = ()
    root: Path | None = None
    extra_cflags: tuple[str, ...] = ("-O3", "-fopenmp")
    extra_ldflags: tuple[str, ...] = ("-fopenmp",)
    what: str = "the fused CPU attention kernel"
    _state: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def flags(self, capability: str | None = None) -> list[str]:
        return [*self.extra_cflags, *capability_flags(capability)]

    def name(self, capability: str | None = None) -> str:
        """prefix_<hash of sources, headers, compile and link flags, torch, compiler, capability, machine>."""
        cap = capability or build_chain()[0]
        h = hashlib.sha256()
        for path in (*self.sources, *self.headers):
            h.update(path.name.encode())
            h.update(path.read_bytes())
        for part in (*self.flags(cap), "|", *self.extra_ldflags, torch.__version__, compiler_version(), cap,
                     platform.machine()):
            h.update(part.encode())
        return f"{self.prefix}_{h.hexdigest()[:16]}"

    def folder(self, capability: str | None = None) -> Path:
        return (self.root or cache_root()) / self.name(capability)

    def state(self, capability: str | None = None) -> str:
        """What the cache holds of one capability's build, without building or loading anything: 'built: <library>',
        'failed: <the remembered reason, with its log>; remembered in <failed.txt>' or 'not built (<its folder>)'."""
        cap = capability or build_chain()[0]
        folder = self.folder(cap)
        library = folder / f"{self.name(cap)}.so"
        if library.exists():
            return f"built: {library}"
        failed = _remembered(folder)
        if failed is not None:
            return f"failed: {failed}; remembered in {folder / FAILED}"
        return f"not built ({folder})"

    def load(self) -> str | None:
        """Build (if needed) and load the library once per process: None when a build is loaded (the dispatched
        capability's, or on x86 a lower one's), else why none is; a warning says so once. Under
        ``ROUTEFORMER_FUSED=1`` anything but the dispatched capability's build is ``FusedKernelRequired``."""
        status = self.status()
        return None if status.ok else (status.why() or "not loaded")

    def status(self) -> BuildStatus:
        """The build this process loaded (building and loading it on first call), as a ``BuildStatus``."""
        with self._lock:
            if "status" not in self._state:
                self._state["status"] = self._resolve()
                self._say(self._state["status"])
            status: BuildStatus = self._state["status"]
        if switch() == "1" and (status.failures or not status.ok):
            hint = _retry_hint(status)
            raise FusedKernelRequired(f"routeformer: {ENV_SWITCH}=1 but {self.what} for {status.wanted} could not "
                                      f"be had ({status.why()})" + (f"; {hint}" if hint else ""))
        return status

    def _resolve(self) -> BuildStatus:
        mode = switch()
        chain = build_chain()
        if mode == "0":
            return BuildStatus(None, chain[0], ((chain[0], f"{ENV_SWITCH}=0"),))
        failures: list[tuple[str, str]] = []
        for cap in chain:
            why = self._load_one(cap)
            if why is None:
                return BuildStatus(cap, chain[0], tuple(failures), self.folder(cap) / f"{self.name(cap)}.so")
            failures.append((cap, why))
            if mode == "1" or why.startswith(("no C++ compiler", "ninja")):  # nothing lower can do better
                break
        return BuildStatus(None, chain[0], tuple(failures))

    def _say(self, status: BuildStatus) -> None:
        if not status.failures:
            return
        if switch() == "1":
            return  # status() raises instead
        if status.ok:
            msg = (f"routeformer: {self.what}'s {status.wanted} build is not available ({status.why()}); using its "
                   f"{status.loaded} build, with narrower vectors")
        else:
            msg = f"routeformer: {self.what} is not available ({status.why()}); using the tiles executor"
        hint = _retry_hint(status)
        warnings.warn(msg + (f"; {hint}" if hint else ""), FusedKernelUnavailable, stacklevel=4)

    def _load_one(self, cap: str) -> str | None:
        """Load one capability's build, compiling it first if needed: None when loaded, else why not."""
        try:
            name = self.name(cap)
            folder = self.folder(cap)
            library = folder / f"{name}.so"
            if library.exists():
                torch.ops.load_library(str(library))
                return None
            failed = _remembered(folder)
            if failed is not None:
                return failed + " (remembered)"
            return self._build(cap, name, folder, library)
        except Exception as error:  # a load error, or a cache we cannot write: the next build, or tiles
            return f"{type(error).__name__}: {_first_lines(str(error))}"

    def _build(self, cap: str, name: str, folder: Path, library: Path) -> str | None:
        """Compile into a private folder, load, and move the library into place, under an exclusive lock; None on
        success (or when another process built it meanwhile: then loaded from there), else the reason (remembered
        in the folder when the compiler failed)."""
        from torch.utils import cpp_extension

        if shutil.which(compiler()) is None:
            return f"no C++ compiler ({compiler()!r} not found; set CXX)"
        if not _ninja_on_path() or not cpp_extension.is_ninja_available():
            return "ninja is not installed (pip install ninja)"
        folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder.parent / f"{name}.lock")):
            if library.exists():  # built by another process while this one waited
                torch.ops.load_library(str(library))
                return None
            failed = _remembered(folder)  # failed in another process while this one waited
            if failed is not None:
                return failed + " (remembered)"
            for stale in folder.glob("build-*"):  # left by a build that was killed: nobody else holds the lock
                shutil.rmtree(stale, ignore_errors=True)
            work = Path(tempfile.mkdtemp(prefix="build-", dir=folder))
            print(f"routeformer: compiling {self.what} ({cap}) into {folder} (once, about a minute)",
                  file=sys.stderr, flush=True)
            try:
                built = _compile_and_load(name, [str(s) for s in self.sources], self.flags(cap),
                                          list(self.extra_ldflags), work)
            except Exception as error:
                log = folder / LOG
                log.write_text(str(error))
                reason = f"compile error: {_compiler_errors(str(error))} (log: {log})"
                (folder / FAILED).write_text(reason)
                shutil.rmtree(work, ignore_errors=True)
                return reason
            os.replace(built, library)  # the loaded mapping stays valid
            shutil.rmtree(work, ignore_errors=True)
            return None


def _ninja_on_path() -> bool:
    """Whether ``ninja`` is on PATH, adding this Python's scripts folder (where ``pip install ninja``, a dependency,
    puts it) when it is there and PATH does not have it: a venv's programs run without activating it
    (``.venv/bin/routeformer``), and cpp_extension looks for ninja on PATH only."""
    if shutil.which("ninja"):
        return True
    scripts = sysconfig.get_path("scripts")
    if scripts and shutil.which("ninja", path=scripts):
        os.environ["PATH"] = os.pathsep.join(p for p in (os.environ.get("PATH", ""), scripts) if p)
        return True
    return False


def _retry_hint(status: BuildStatus) -> str:
    """How to try a remembered failed build again, when one was remembered."""
    if "(remembered)" in status.why() or "compile error" in status.why():
        return "to compile again, remove the build folders named in the logs"
    return ""


def _compile_and_load(name: str, sources: list[str], cflags: list[str], ldflags: list[str], work: Path) -> Path:
    """Compile and link ``sources`` into ``work/name.so`` with cpp_extension's ninja build and load it (its
    operators register with the dispatcher)."""
    from torch.utils import cpp_extension

    cpp_extension.load(name=name, sources=sources, extra_cflags=cflags, extra_ldflags=ldflags,
                       extra_include_paths=[str(Path(sources[0]).parent)], build_directory=str(work), verbose=False,
                       with_cuda=False, is_python_module=False)
    return work / f"{name}.so"


def compile_only(build: KernelBuild, capability: str, out: Path, cxx: str | None = None) -> subprocess.CompletedProcess:
    """Compile (no link, no load) every source of ``build`` with one capability's flags into ``out``: how a
    capability this processor cannot run is still checked to build (and, with a cross compiler as ``cxx``, another
    architecture). Include paths and the ABI define as cpp_extension's."""
    from torch.utils import cpp_extension

    out.mkdir(parents=True, exist_ok=True)
    includes = [f"-I{p}" for p in (*cpp_extension.include_paths(), str(build.sources[0].parent))]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    errors = []
    for source in build.sources:
        cmd = [cxx or compiler(), "-c", str(source), "-o", str(out / (source.stem + ".o")), "-std=c++20", "-fPIC", abi,
               *includes, *build.flags(capability)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            errors.append(run.stderr)
    return subprocess.CompletedProcess(["compile_only", capability], int(bool(errors)), "", "\n".join(errors))


def _compiler_errors(text: str, n: int = 3) -> str:
    """The compiler's own error lines of a failed build's output (else its first lines)."""
    errors = [line.strip() for line in text.splitlines() if "error" in line and not line.lstrip().startswith(
        ("c++ ", "g++ ", "FAILED", "[", "ninja"))]
    return " | ".join(errors[:n]) if errors else _first_lines(text)


def _first_lines(text: str, n: int = 6) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[:n]) + (" | …" if len(lines) > n else "")


KERNELS = KernelBuild("routeformer_fused", tuple(CSRC / s for s in SOURCES), tuple(sorted(CSRC.glob("*.h"))))
