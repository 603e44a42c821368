"""`routeformer env`: the environment, for bug reports: versions, the processor capability, the compiler, the fused
kernel's builds and which attention executor runs where (in the spirit of ``python -m torch.utils.collect_env``)."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import warnings
from pathlib import Path


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Adds the ``env`` command to ``commands`` (the top-level sub-parsers)."""
    env = commands.add_parser(
        "env", help="versions, compiler, the fused kernel's builds and the executors (paste it into bug reports)",
        description="Print what decides how attention runs here, one 'key: value' line each: the routeformer, "
        "Python, platform and torch versions (CUDA and GPUs), the CPU capability torch dispatches to "
        "(ATEN_CPU_CAPABILITY lowers it), the fused kernel's build chain, the compiler, ninja, OpenMP threads, BLAS, "
        "whether large tensors are on huge pages (THP_MEM_ALLOC_ENABLE, which the command line sets), "
        "ROUTEFORMER_FUSED, the kernel cache ($TORCH_EXTENSIONS_DIR) and each capability's build in it (built, "
        "failed with the remembered reason and log, or not built). Then it loads the kernel as the first attention "
        "call would (compiling it if needed, about a minute) and says what it got, and for the CPU (and CUDA when "
        "there is a GPU) which executor 'auto' is and the line train, evaluate, sample and bench begin with. Exits "
        "0 whether or not the kernel can be had: it reports.")
    env.add_argument("--no-build", action="store_true",
                     help="only look: report the cache as it is, compile and load nothing")


def cmd_env(args: argparse.Namespace) -> int:
    rows = collect(build=not args.no_build)
    width = max(len(key) for key, _ in rows) + 2
    for key, value in rows:
        print(f"{key + ':':<{width}}{value}")
    return 0


def collect(*, build: bool = True) -> list[tuple[str, str]]:
    """The (key, value) lines of ``routeformer env``, in order; ``build``: load the fused kernel (compiling it if
    needed) and describe the executors as they resolve, else only look at the cache."""
    import torch
    from torch.utils import cpp_extension

    from .. import __version__, hugepages
    from ..executors import EXECUTORS
    from ..executors.fused import build as fb

    rows: list[tuple[str, str]] = [
        ("routeformer", f"{__version__} ({Path(__file__).resolve().parents[1]})"),
        ("python", f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})"),
        ("platform", platform.platform()),
        ("machine", f"{platform.machine()}, {_processor()}, {os.cpu_count()} logical cores"),
        ("torch", f"{torch.__version__} ({Path(torch.__file__).parent})"),
        ("cuda", _cuda(torch)),
        ("cpu capability", fb.dispatched_capability()),
        ("ATEN_CPU_CAPABILITY", os.environ.get("ATEN_CPU_CAPABILITY", "unset")),
        ("build chain", ", ".join(fb.build_chain())),
        ("compiler", _compiler(fb)),
        ("ninja", f"available ({shutil.which('ninja') or 'ninja'})" if cpp_extension.is_ninja_available()
         else "not installed (pip install ninja): the kernel cannot be built"),
        ("openmp threads", f"{torch.get_num_threads()} (torch.get_num_threads(); OMP_NUM_THREADS="
                           f"{os.environ.get('OMP_NUM_THREADS', 'unset')}; OpenMP "
                           f"{'available' if torch.backends.openmp.is_available() else 'not available'} in torch)"),
    ]
    blas = f"torch: MKL {'available' if torch.backends.mkl.is_available() else 'not available'}"
    rows.append(("blas", blas))  # the kernel's half is filled in once it is loaded
    rows.append(("huge pages", hugepages.describe()))
    try:
        switch = fb.switch()
        rows.append((fb.ENV_SWITCH, switch + ("" if fb.ENV_SWITCH in os.environ else " (unset)")))
    except ValueError as error:
        switch = None
        rows.append((fb.ENV_SWITCH, f"invalid: {error}"))
    where = "$TORCH_EXTENSIONS_DIR" if os.environ.get("TORCH_EXTENSIONS_DIR") else "default; TORCH_EXTENSIONS_DIR unset"
    rows.append(("kernel cache", f"{fb.cache_root()} ({where})"))
    states = {}
    for cap in fb.build_chain():
        states[cap] = _guard(lambda cap=cap: fb.KERNELS.state(cap))
        rows.append((f"build {cap}", states[cap]))
    if not build:
        rows.append(("loaded", "not tried (--no-build)"))
    elif switch is None:
        rows.append(("loaded", f"no: {fb.ENV_SWITCH} is invalid"))
    else:
        loaded, has_blas = _load(torch, fb)
        rows.append(("loaded", loaded))
        if has_blas is not None:
            rows[rows.index(("blas", blas))] = ("blas", blas + "; the kernel's products: " + (
                "the BLAS of the torch build (sgemm/dgemm)" if has_blas else "ATen's matmul (no BLAS symbols)"))
    rows.append(("executors", ", ".join(EXECUTORS) + " (auto: flex on cuda, fused on the cpu, else tiles)"))
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        if build and switch is not None:
            rows += _usable(device)
        else:
            rows.append((f"auto on {device}", _foreseen(device, switch, states, fb)))
    return rows


def _usable(device: str) -> list[tuple[str, str]]:
    """What ``auto`` resolves to on ``device`` and the banner line of a command that runs there."""
    from ..executors import describe_backend, resolve_backend

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # said in the 'loaded' line already
        return [(f"auto on {device}", _guard(lambda: resolve_backend("auto", device))),
                (f"banner on {device}", _guard(lambda: describe_backend("auto", device)))]


def _foreseen(device: str, switch: str | None, states: dict[str, str], fb) -> str:
    """What ``auto`` would resolve to on ``device``, from the cache alone (``--no-build``: nothing is loaded)."""
    if device != "cpu":
        return "flex" if device == "cuda" else "tiles"
    if switch is None:
        return f"not known: {fb.ENV_SWITCH} is invalid"
    if switch == "0":
        return f"tiles ({fb.ENV_SWITCH}=0)"
    chain = fb.build_chain()
    for cap in chain:  # as the loader walks it: a failed build falls back to the next
        if cap != chain[0] and switch == "1":
            return f"an error: {fb.ENV_SWITCH}=1 and the {chain[0]} build failed"
        if states[cap].startswith("built"):
            return f"fused, its {cap} build (built; not loaded: --no-build)"
        if not states[cap].startswith("failed"):
            from torch.utils import cpp_extension

            if shutil.which(fb.compiler()) is None:
                return f"tiles: no build of the fused kernel, and no C++ compiler to make one ({fb.compiler()!r})"
            if not cpp_extension.is_ninja_available():
                return "tiles: no build of the fused kernel, and no ninja to make one (pip install ninja)"
            return f"fused once its {cap} build compiles (the first attention call), else tiles (--no-build)"
    return "tiles (every build failed; remove their folders to compile again)"


def _load(torch, fb) -> tuple[str, bool | None]:
    """Load the fused kernel as the first attention call does: ('AVX512, 16-lane vectors (<library>)' or 'no: why',
    whether its products call BLAS, None when not loaded)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fb.FusedKernelUnavailable)  # said here instead
            status = fb.KERNELS.status()
    except fb.FusedKernelRequired as error:
        return f"no: {str(error).removeprefix('routeformer: ')}", None
    except Exception as error:  # env reports whatever goes wrong
        return f"no: {type(error).__name__}: {error}", None
    if not status.ok:
        return f"no: {status.why()}", None
    ops = torch.ops.routeformer_fused
    line = f"{status.loaded}, {ops.vector_width()}-lane vectors ({status.library})"
    if status.failures:
        line += f"; not its {status.wanted} build: {status.why()}"
    return line, bool(ops.has_blas())


def _guard(fn) -> str:
    try:
        return str(fn())
    except Exception as error:  # env reports whatever goes wrong
        return f"error: {type(error).__name__}: {error}"


def _processor() -> str:
    """The processor's model name (Linux' /proc/cpuinfo), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "processor unknown"


def _cuda(torch) -> str:
    if torch.version.cuda is None:
        return "none (a CPU build of torch)"
    if not torch.cuda.is_available():
        return f"{torch.version.cuda}, no GPU visible"
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append(f"{i}: {props.name} ({props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor})")
    return f"{torch.version.cuda}; {'; '.join(gpus)}"


def _compiler(fb) -> str:
    cxx = fb.compiler()
    found = shutil.which(cxx)
    if found is None:
        return f"{cxx} not found ({'$CXX' if 'CXX' in os.environ else 'set CXX'}): the kernel cannot be built"
    return f"{cxx} ({found}): {fb.compiler_version(cxx)}"
