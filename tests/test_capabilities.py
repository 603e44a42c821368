"""The fused kernels on every instruction set PyTorch dispatches to on x86 (DEFAULT, AVX2, AVX512).

Each capability this processor can run: the kernel is built with that capability's flags (``ATEN_CPU_CAPABILITY``
lowers what PyTorch and our build use), loaded as required (``ROUTEFORMER_FUSED=1``: no fallback can pass), its
vectors are as wide as the capability's, and the fused executor's tests run on it in a process of their own. The
capability this process runs is the rest of the suite's. Each capability this processor cannot run: every source
compiles with its flags (a compile error in any variant fails the suite), and the AVX-512 objects use 512-bit
registers.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from routeformer.executors.fused import build
from routeformer.executors.fused.build import CAPABILITIES, KERNELS, compile_only

REPO = Path(__file__).resolve().parents[1]
X86_ONLY = pytest.mark.skipif(not build.X86, reason="the capabilities are x86's; elsewhere one DEFAULT build")
ARM64_CXX = "aarch64-linux-gnu-g++"  # Debian's g++-aarch64-linux-gnu (.ci/run installs it where it can)
LANES = {"AVX512": 16, "AVX2": 8, "DEFAULT": 8}  # float lanes of at::vec's Vectorized<float> under each
# The fused executor's tests: its own, every executor test of ranges, LSH and the executors parametrised with it,
# and the fused block selection's (how the kernels are built, tests/test_build.py, does not depend on the capability).
FUSED_TESTS = ["tests/test_fused.py", "tests/test_fused_coverage.py", "tests/test_ranges.py", "tests/test_lsh.py",
               "tests/test_executors.py", "tests/test_moba.py", "tests/test_fused_route.py", "tests/test_fused_scan.py",
               "tests/test_feature_scan.py", "tests/test_fused_vectors.py", "-k", "fused"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "PYTEST_XDIST_WORKER",
                                                             "PYTEST_XDIST_WORKER_COUNT", "PYTEST_ADDOPTS")}
    return {**env, **extra}


@functools.cache
def hardware_capability() -> str:
    """The widest capability this processor runs: what PyTorch picks with ATEN_CPU_CAPABILITY unset."""
    run = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         capture_output=True, text=True, env=_env(), check=True)
    return run.stdout.strip()


def runnable(cap: str) -> bool:
    top = hardware_capability()
    return top in CAPABILITIES and CAPABILITIES.index(cap) >= CAPABILITIES.index(top)


CHECK = """
import torch
from routeformer.executors.fused import available, KERNELS
assert available()
status = KERNELS.status()
print("LOADED", status.loaded, status.wanted, torch.ops.routeformer_fused.vector_width())
"""


def _build_and_load(cap: str) -> dict[str, str]:
    """Build ``cap``'s kernels as required (``ROUTEFORMER_FUSED=1``) in a process of its own, load them and check
    the capability and vector width it reports; the environment that runs it."""
    env = _env(ATEN_CPU_CAPABILITY=cap.lower(), ROUTEFORMER_FUSED="1")
    check = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, cwd=REPO,
                           timeout=600)
    assert check.returncode == 0, check.stderr[-3000:]
    assert f"LOADED {cap} {cap} {LANES[cap]}" in check.stdout
    if cap == "AVX512":
        assert _has_512_bit_code(KERNELS.folder(cap) / f"{KERNELS.name(cap)}.so")
    return env


@X86_ONLY
def test_the_dispatched_capability_builds_and_loads_as_required() -> None:
    _build_and_load(torch.backends.cpu.get_cpu_capability())


# Slow (CI's slow line runs it): every other capability this processor runs built as required, loaded, and the
# fused executor's tests run again under it (the dispatched one's build runs them in the rest of the suite); each
# about 70 s of a worker to build and 30-100 s to test on 2 cores, a fresh clone's suite 9:03 with them.
@pytest.mark.slow
@X86_ONLY
@pytest.mark.parametrize("cap", CAPABILITIES)
def test_every_capability_runs_the_fused_executor_tests(cap: str) -> None:
    if not runnable(cap):
        pytest.skip(f"this processor cannot run {cap}: test_every_capability_compiles checks its build")
    if cap == torch.backends.cpu.get_cpu_capability():
        pytest.skip("the rest of the suite runs the fused executor's tests on the dispatched build")
    env = _build_and_load(cap)
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *FUSED_TESTS],
                           capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout and " failed" not in tests.stdout


# Slow (CI's slow line runs it): compiling the kernels for a capability this processor cannot run took 113 s of a
# worker for AVX-512 on the AMD EPYC (2026-12-06), the default suite's longest test, which held a fresh clone's
# suite at 8:28.
@pytest.mark.slow
@X86_ONLY
@pytest.mark.parametrize("cap", CAPABILITIES)
def test_every_capability_compiles(cap: str, tmp_path: Path) -> None:
    """Where the processor cannot run a capability, its build is still compiled (objects only, never loaded)."""
    if runnable(cap):
        pytest.skip(f"{cap} runs here: test_every_capability_runs_the_fused_executor_tests builds it")
    result = compile_only(KERNELS, cap, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    if cap == "AVX512":
        assert _has_512_bit_code(tmp_path / "band.o")


def _has_512_bit_code(path: Path) -> bool:
    """Whether the kernel's own loops use 512-bit vectors (zmm registers), where objdump can tell."""
    if not shutil.which("objdump"):
        return True
    return "zmm" in subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)], capture_output=True,
                                   text=True).stdout


@X86_ONLY
def test_the_loaded_build_is_the_dispatched_capability_s() -> None:
    """This process's kernel: the capability PyTorch dispatches to, with its vector width, never a fallback."""
    status = KERNELS.status()
    assert status.loaded == torch.backends.cpu.get_cpu_capability() and not status.failures
    assert torch.ops.routeformer_fused.vector_width() == LANES[status.loaded]


@pytest.mark.slow  # about a minute of compiling
@pytest.mark.skipif(shutil.which(ARM64_CXX) is None, reason=f"no {ARM64_CXX} (a cross compiler) here")
def test_the_arm64_build_compiles_with_neon_vectors(tmp_path: Path) -> None:
    """On arm64 the one build has the DEFAULT flags, and at::vec is NEON's there: the sources compile for it (objects
    only, with the x86 wheel's headers: no arm64 machine runs it here) and their loops use 4-lane float vectors."""
    result = compile_only(KERNELS, "DEFAULT", tmp_path, cxx=ARM64_CXX)
    assert result.returncode == 0, result.stderr[-4000:]
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    if objdump:
        assert ".4s" in subprocess.run([objdump, "-d", str(tmp_path / "band.o")], capture_output=True,
                                       text=True).stdout
