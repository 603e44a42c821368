"""The sanitizer target (slow): the fused kernels built with AddressSanitizer and UndefinedBehaviorSanitizer
(``helpers.SANITIZE_FLAGS``: ``-fsanitize=address,undefined -fno-omit-frame-pointer -g -O1``, vector indexing checked,
and under ``ROUTEFORMER_SANITIZE`` the products as plain loops and scratch of exactly the size asked for, so that no
access hides inside BLAS or a rounded-up allocation), and the fused-kernel tests run against that build in a process
of their own: ``tests/test_fused.py`` (the build's tests are ``tests/test_build.py``), the fused cases of
``tests/test_ranges.py``, ``tests/test_lsh.py``, the fused feature scan's (``tests/test_fused_scan.py``), the fused
router's (``tests/test_fused_route.py``, ``tests/test_fused_vectors.py``) and the default-suite part of
``tests/test_fused_coverage.py`` (less its thread-count tests on six heads: those on one head run the same code).

That process has the sanitizers' runtimes preloaded (``LD_PRELOAD``: ASan must be the first library loaded, before
torch), ``ROUTEFORMER_TEST_SANITIZE=1`` (``conftest.py`` puts the sanitized build in place of the kernels, under a name
of its own: the operators' namespace is the same, so the normal build must not be loaded there) and
``ROUTEFORMER_FUSED=1`` (no fallback: a build that does not load is an error, not a pass on the tiles executor). Leak
detection is off (Python keeps its objects to the end by design); any other report aborts the process.

Run it with ``python -m pytest -m slow tests/test_sanitizer.py -n 0`` (GCC's sanitizer runtimes, Linux; the first
run compiles the sanitized build, a few minutes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import SANITIZE, sanitized
from routeformer.executors.fused import KERNELS, KernelBuild
from routeformer.executors.fused.build import compiler

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GCC on Linux")]

REPO = Path(__file__).resolve().parents[1]
# the same code as their (1, 1) cases on more heads, three quarters of the run's time under the sanitizers
SLOWEST = tuple(f"test_fused_coverage.py::test_the_same_bits_at_one_to_four_threads[2-3-{kind}]"
                for kind in ("band", "lsh", "ranges"))
REPORTS = ("ERROR: AddressSanitizer", "runtime error:")  # ASan's and UBSan's


def runtimes() -> str:
    """LD_PRELOAD for the sanitizers: the compiler's libasan and libubsan (ASan first)."""
    paths = []
    for name in ("libasan.so", "libubsan.so"):
        path = subprocess.run([compiler(), f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        assert os.path.isabs(path) and os.path.exists(path), f"{compiler()} has no {name} (GCC's sanitizer runtimes)"
        paths.append(path)
    return ":".join(paths)


def sanitized_run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Python with ``args`` under the sanitizers, their reports on its stderr."""
    preload = ":".join(filter(None, [runtimes(), os.environ.get("LD_PRELOAD")]))
    env = {**os.environ, "LD_PRELOAD": preload, SANITIZE: "1", "ROUTEFORMER_FUSED": "1",
           "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1", "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


FAULTS = r"""
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include <climits>
at::Tensor past_the_end(const at::Tensor& x) {  // writes one value past its output
  auto y = at::empty_like(x);
  float* p = y.data_ptr<float>();
  for (int64_t i = 0; i <= x.numel(); i++) p[i] = 1;
  return y;
}
int64_t overflow(int64_t n) { int big = INT_MAX - 1; big += static_cast<int>(n); return big; }  // signed overflow
TORCH_LIBRARY(routeformer_test_faults, m) {
  m.def("past_the_end(Tensor x) -> Tensor", &past_the_end);
  m.def("overflow(int n) -> int", &overflow);
}
"""

CALL = """
import torch
from pathlib import Path
from routeformer.executors.fused import KernelBuild
from helpers import sanitized
build = sanitized(KernelBuild("routeformer_test_faults", (Path({source!r}),), root=Path({root!r})))
assert build.load() is None
print("RESULT", {call}, flush=True)
"""


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> Path:
    """The faulty library's source, in a folder its build goes beside (built by the first test, loaded by the next)."""
    source = tmp_path_factory.mktemp("faults") / "faults.cpp"
    source.write_text(FAULTS)
    return source


@pytest.mark.parametrize("call, report", [("torch.ops.routeformer_test_faults.past_the_end(torch.ones(5))",
                                           "ERROR: AddressSanitizer: heap-buffer-overflow"),
                                          ("torch.ops.routeformer_test_faults.overflow(3)",
                                           "runtime error: signed integer overflow")])
def test_the_sanitizers_report_faults_here(call: str, report: str, faults: Path) -> None:
    """The target has teeth: a library built as the kernels are, writing past its output (ASan) or overflowing an
    int (UBSan), under the same preload and options, aborts with the sanitizer's report."""
    code = CALL.format(source=str(faults), root=str(faults.parent / "cache"), call=call)
    run = sanitized_run(["-c", f"import sys; sys.path.insert(0, 'tests')\n{code}"], timeout=600)
    assert run.returncode != 0 and "RESULT" not in run.stdout, run.stdout + run.stderr[-4000:]
    assert report in run.stderr, run.stderr[-4000:]


def test_the_fused_kernels_under_address_and_undefined_behaviour_sanitizers() -> None:
    """No report, every test passing, and the library that ran instrumented."""
    build: KernelBuild = sanitized(KERNELS)
    # -s: a report goes to stderr as it is written (pytest's capture would swallow one that aborts the process)
    args = ["-m", "pytest", "-n", "0", "-q", "-s", "tests/test_fused.py", "tests/test_ranges.py",
            "tests/test_lsh.py", "tests/test_fused_coverage.py", "tests/test_fused_scan.py",
            "tests/test_feature_scan.py", "tests/test_fused_route.py", "tests/test_fused_vectors.py",
            "-k", "not tiles and not flex",
            *[f"--deselect=tests/{name}" for name in SLOWEST]]
    run = sanitized_run(args, timeout=3000)
    output = run.stdout + run.stderr
    at = min((output.find(report) for report in REPORTS if report in output), default=-1)
    assert at < 0, output[at:at + 20000]  # the report: the access's stack, and the allocation's
    assert run.returncode == 0, output[-6000:]
    summary = re.search(r"(\d+) passed", run.stdout)
    assert summary and int(summary.group(1)) >= 50 and "failed" not in run.stdout.splitlines()[-1], output[-3000:]
    library = build.folder() / f"{build.name()}.so"  # the build that ran is instrumented
    assert library.exists() and b"__asan_report" in library.read_bytes() and b"__ubsan_handle" in library.read_bytes()
