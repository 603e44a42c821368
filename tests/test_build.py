"""How the fused CPU kernels are built and what happens when they cannot be: the switch, no compiler, no ninja, a
compile error (remembered with its log), a library that does not load, a lower capability's build as the fallback,
``ROUTEFORMER_FUSED=1`` as an error, the build's name, concurrent and killed builds, ``compile_only``, import without
fcntl, and the benchmarks' fused rows. Independent of the capability the kernels run on (tests/test_capabilities.py
runs the kernels' own tests under each)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from routeformer.executors.fused import FusedKernelUnavailable, KernelBuild
from routeformer.executors.fused import build as fused_build
from routeformer.executors.fused.build import FusedKernelRequired, build_chain, compile_only

REPO = Path(__file__).resolve().parents[1]


TINY = """
#include <ATen/core/Tensor.h>
#include <torch/library.h>
at::Tensor twice(const at::Tensor& x) { return x.mul(2); }
TORCH_LIBRARY(NAMESPACE, m) { m.def("twice(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(NAMESPACE, CPU, m) { m.impl("twice", &twice); }
"""


def _tiny(tmp_path: Path, namespace: str, body: str = TINY) -> KernelBuild:
    source = tmp_path / f"{namespace}.cpp"
    source.write_text(body.replace("NAMESPACE", namespace))
    return KernelBuild(namespace, (source,), root=tmp_path / "cache", what=f"the test library {namespace}")


def _python(code: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, cwd=REPO)


RESOLVE = """
import warnings
warnings.simplefilter("always")
import torch
from routeformer.attention import Inputs, LocalOptions, local_attention
from routeformer.executors import resolve_backend
q = torch.randn(1, 2, 40, 8)
for _ in range(3):
    local_attention(Inputs.of(q, q, q), LocalOptions(5))  # the default: fused, or tiles with one warning
print("RESOLVED", resolve_backend("auto", "cpu"))
"""


def test_the_switch_forces_the_tiles_executor_with_one_warning() -> None:
    run = _python(RESOLVE, {"ROUTEFORMER_FUSED": "0"})
    assert run.returncode == 0, run.stderr
    assert "RESOLVED tiles" in run.stdout
    assert run.stderr.count("FusedKernelUnavailable") == 1 and "ROUTEFORMER_FUSED=0" in run.stderr


def test_no_compiler_means_the_tiles_executor_with_one_warning(tmp_path: Path) -> None:
    run = _python(RESOLVE, {"CXX": str(tmp_path / "no-such-compiler"), "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    assert "RESOLVED tiles" in run.stdout
    assert run.stderr.count("FusedKernelUnavailable") == 1 and "no C++ compiler" in run.stderr


def test_no_ninja_is_named(tmp_path: Path, monkeypatch) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    build = _tiny(tmp_path, "routeformer_test_noninja")
    with pytest.warns(FusedKernelUnavailable, match="ninja is not installed"):
        assert build.load() is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: a second call says nothing
        assert build.load() is not None


def _one_capability(monkeypatch) -> str:
    """Builds of this test try the dispatched capability only (a broken source fails the same in every one)."""
    top = build_chain()[0]
    monkeypatch.setattr(fused_build, "build_chain", lambda capability=None: (top,))
    return top


@pytest.mark.slow  # the default suite's slowest (2026-12-07, 13-27 s a worker): CI's slow line runs it
def test_a_compile_error_is_a_warning_that_quotes_the_compiler(tmp_path: Path, monkeypatch) -> None:
    _one_capability(monkeypatch)
    build = _tiny(tmp_path, "routeformer_test_broken", TINY.replace("x.mul(2)", "x * undefined_name"))
    with pytest.warns(FusedKernelUnavailable, match="undefined_name"):
        assert "compile error" in build.load()


@pytest.mark.slow  # the default suite's slowest (2026-12-07, 13-27 s a worker): CI's slow line runs it
def test_a_library_that_does_not_load_is_a_warning(tmp_path: Path) -> None:
    build = _tiny(tmp_path, "routeformer_test_garbage")
    name = build.name()
    (tmp_path / "cache" / name).mkdir(parents=True)
    (tmp_path / "cache" / name / f"{name}.so").write_bytes(b"not a library")
    with pytest.warns(FusedKernelUnavailable, match="OSError"):
        status = build.status()
    chain = build_chain()  # the next lower capability's build is tried (and builds), if there is one
    assert status.failures[0][0] == chain[0] and status.loaded == (chain[1] if len(chain) > 1 else None)


BUILD = """
import sys
from pathlib import Path
import torch
from routeformer.executors.fused.build import KernelBuild
build = KernelBuild({namespace!r}, (Path({source!r}),), root=Path({root!r}), what="the test library")
print("LOADED" if build.load() is None else "FAILED", flush=True)
print(torch.ops.{namespace}.twice(torch.ones(2)).tolist(), flush=True)
"""


def _builder(build: KernelBuild) -> str:
    return BUILD.format(namespace=build.prefix, source=str(build.sources[0]), root=str(build.root))


@pytest.mark.slow  # a build of its own, 20-40 s: CI's slow line runs it
def test_parallel_builders_compile_once_and_a_killed_build_does_not_block_the_next(tmp_path: Path) -> None:
    """Two processes at once: one compiles, the other waits on the lock and loads its library. Then a build killed
    half-way (its lock dies with it, its private folder stays): the next process builds and loads, in bounded
    time."""
    build = _tiny(tmp_path, "routeformer_test_parallel")
    both = [subprocess.Popen([sys.executable, "-c", _builder(build)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=REPO) for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in both]
    assert all(p.returncode == 0 for p in both), outputs
    assert all("LOADED" in out and "[2.0, 2.0]" in out for out, _ in outputs)
    assert sum(err.count("compiling the test library") for _, err in outputs) == 1

    killed = _tiny(tmp_path, "routeformer_test_killed")
    victim = subprocess.Popen([sys.executable, "-c", _builder(killed)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO)
    folder = killed.root / killed.name()
    deadline = time.monotonic() + 120
    while not any(folder.glob("build-*")) and time.monotonic() < deadline:  # it is compiling
        time.sleep(0.2)
    assert any(folder.glob("build-*")), "the build never started"
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    assert not (folder / f"{killed.name()}.so").exists()
    start = time.monotonic()
    after = _python(_builder(killed), timeout=300)
    assert after.returncode == 0 and "LOADED" in after.stdout, after.stderr
    assert time.monotonic() - start < 240


@pytest.mark.slow  # the default suite's slowest (2026-12-07, 13-27 s a worker): CI's slow line runs it
def test_a_failed_compilation_is_remembered_with_its_log(tmp_path: Path, monkeypatch, capsys) -> None:
    """The next process (a new KernelBuild of the same sources) warns with the remembered reason and its log and
    compiles nothing; removing the build folder, as the warning says, compiles again."""
    _one_capability(monkeypatch)
    body = TINY.replace("x.mul(2)", "x * undefined_name")
    with pytest.warns(FusedKernelUnavailable, match="remove the build folders"):
        first = _tiny(tmp_path, "routeformer_test_remembered", body).load()
    assert "compiling the test library" in capsys.readouterr().err
    folder = _tiny(tmp_path, "routeformer_test_remembered", body).folder()
    log = folder / fused_build.LOG
    assert f"(log: {log})" in first and "undefined_name" in log.read_text()
    with pytest.warns(FusedKernelUnavailable, match="remembered"):
        again = _tiny(tmp_path, "routeformer_test_remembered", body).load()
    assert "compiling" not in capsys.readouterr().err and "undefined_name" in again
    shutil.rmtree(folder)
    with pytest.warns(FusedKernelUnavailable, match="compile error"):
        _tiny(tmp_path, "routeformer_test_remembered", body).load()
    assert "compiling the test library" in capsys.readouterr().err


@pytest.mark.slow  # a build of its own, 20-40 s: CI's slow line runs it
def test_a_failed_build_falls_back_to_the_next_lower_capability_with_one_warning(tmp_path: Path) -> None:
    chain = build_chain()
    if len(chain) < 2:
        pytest.skip(f"{chain[0]} has no lower capability to fall back to")
    broken_at_top = f"#if defined(CPU_CAPABILITY_{chain[0]})\n#error this capability's build is broken\n#endif\n"
    build = _tiny(tmp_path, "routeformer_test_lower", broken_at_top + TINY)
    with pytest.warns(FusedKernelUnavailable) as caught:
        status = build.status()
    assert len(caught) == 1 and f"using its {chain[1]} build" in str(caught[0].message)
    assert status.loaded == chain[1] and status.failures[0][0] == chain[0] and build.load() is None
    assert torch.ops.routeformer_test_lower.twice(torch.ones(2)).tolist() == [2.0, 2.0]


def test_required_means_an_error_instead_of_a_fallback(tmp_path: Path, monkeypatch) -> None:
    chain = build_chain()
    monkeypatch.setenv("ROUTEFORMER_FUSED", "1")
    broken_at_top = f"#if defined(CPU_CAPABILITY_{chain[0]})\n#error this capability's build is broken\n#endif\n"
    build = _tiny(tmp_path, "routeformer_test_required", broken_at_top + TINY)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an error, not a warning and a fallback
        with pytest.raises(FusedKernelRequired, match=f"ROUTEFORMER_FUSED=1 .*{chain[0]}.*broken"):
            build.load()
    assert not any(build.folder(cap).exists() for cap in chain[1:])  # nothing lower was even tried


def test_required_with_no_compiler_fails_the_first_attention_call(tmp_path: Path) -> None:
    run = _python(RESOLVE, {"ROUTEFORMER_FUSED": "1", "CXX": str(tmp_path / "no-such-compiler"),
                            "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert run.returncode != 0 and "FusedKernelRequired" in run.stderr and "no C++ compiler" in run.stderr
    assert "RESOLVED" not in run.stdout


def test_the_switch_takes_only_its_values(monkeypatch) -> None:
    monkeypatch.setenv("ROUTEFORMER_FUSED", "yes")
    with pytest.raises(ValueError, match="ROUTEFORMER_FUSED='yes': expected one of auto, 0, 1"):
        fused_build.switch()
    for value, meaning in (("", "auto"), ("AUTO", "auto"), ("0", "0"), ("1", "1")):
        monkeypatch.setenv("ROUTEFORMER_FUSED", value)
        assert fused_build.switch() == meaning


def test_the_build_name_covers_every_header_the_flags_and_the_capability(tmp_path: Path) -> None:
    assert {h.name for h in fused_build.KERNELS.headers} == {h.name for h in fused_build.CSRC.glob("*.h")}
    header = tmp_path / "extra.h"
    header.write_text("// one\n")
    build = _tiny(tmp_path, "routeformer_test_hash")
    with_header = KernelBuild(build.prefix, build.sources, (header,), root=build.root)
    names = {build.name(), with_header.name()}
    header.write_text("// two\n")
    names |= {with_header.name(), KernelBuild(build.prefix, build.sources, root=build.root,
                                              extra_ldflags=("-fopenmp", "-lm")).name()}
    names |= {build.name(cap) for cap in fused_build.CAPABILITIES}
    assert len(names) == 4 + len(fused_build.CAPABILITIES) - 1  # build.name() is its dispatched capability's


def test_import_works_without_fcntl() -> None:
    """As on Windows: the build lock is filelock's, not fcntl's."""
    run = _python("""
        import sys
        sys.modules["fcntl"] = None  # import fcntl raises ImportError
        import routeformer
        from routeformer.executors.fused import build
        print("IMPORTED", build.FileLock.__name__)
    """)
    assert run.returncode == 0 and "IMPORTED" in run.stdout, run.stderr


@pytest.mark.slow  # a build of its own, 20-40 s: CI's slow line runs it
def test_compile_only_checks_a_capability_without_loading_it(tmp_path: Path) -> None:
    good = _tiny(tmp_path, "routeformer_test_compile_only")
    bad = _tiny(tmp_path, "routeformer_test_compile_only_bad", TINY.replace("x.mul(2)", "x * undefined_name"))
    cap = fused_build.CAPABILITIES[0] if fused_build.X86 else "DEFAULT"
    assert compile_only(good, cap, tmp_path / "good").returncode == 0
    assert (tmp_path / "good" / "routeformer_test_compile_only.o").exists()
    result = compile_only(bad, cap, tmp_path / "bad")
    assert result.returncode != 0 and "undefined_name" in result.stderr


@pytest.mark.slow  # the default suite's slowest (2026-12-07, 13-27 s a worker): CI's slow line runs it
def test_bench_fused_rows_refuse_anything_but_the_dispatched_build(tmp_path: Path, monkeypatch) -> None:
    from routeformer.bench import measure

    chain = build_chain()
    broken_at_top = f"#if defined(CPU_CAPABILITY_{chain[0]})\n#error this capability's build is broken\n#endif\n"
    build = _tiny(tmp_path, "routeformer_test_bench", broken_at_top + TINY)
    monkeypatch.setattr(measure, "KERNELS", build)
    with pytest.warns(FusedKernelUnavailable), pytest.raises(FusedKernelRequired, match="--backend tiles"):
        measure.measured_backend("fused", torch.device("cpu"))
    assert measure.measured_backend("tiles", torch.device("cpu")) == "tiles"



def test_ninja_is_found_in_this_python_s_scripts_folder_without_an_activated_venv(tmp_path: Path, monkeypatch) -> None:
    """``pip install ninja`` (a dependency) puts it beside this Python's scripts, which ``.venv/bin/routeformer``
    does not put on PATH; the build looks there too."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "ninja").write_text("#!/bin/sh\necho 1.13.0\n")
    (scripts / "ninja").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(fused_build.sysconfig, "get_path", lambda name: str(scripts))
    assert fused_build._ninja_on_path() and os.environ["PATH"].endswith(str(scripts))
    monkeypatch.setattr(fused_build.sysconfig, "get_path", lambda name: str(tmp_path / "empty"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert not fused_build._ninja_on_path()
