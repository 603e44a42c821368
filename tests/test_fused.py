"""The fused CPU executor beyond what every executor's tests check (patterns, routing, LSH, ranges and the model run
on it through their parametrised backends): gradcheck, results independent of the thread count, what it keeps for the
backward, torch.compile, the calls it hands to the tiles executor, and how its kernels are built and what happens
when they cannot be."""

from __future__ import annotations

import ctypes
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

from helpers import rand_padding, rand_qkv, rand_rel, routing_layer
from routeformer.attention import local_attention
from routeformer.attention.lsh import lsh_attention, lsh_rotations
from routeformer.bench.measure import kept_for_backward
from routeformer.executors import get_executor
from routeformer.executors.fused import FusedKernelUnavailable, KernelBuild, available
from routeformer.executors.fused import build as fused_build
from routeformer.executors.fused.activation import sigmoid_gelu
from routeformer.executors.fused.build import FusedKernelRequired, build_chain, compile_only
from routeformer.executors.inputs import Inputs, relative
from routeformer.executors.ranges import KeyOrder, Ranges
from routeformer.executors.tiling import INDEX, Distances, KeyRestrictions, Tiling

FUSED = get_executor("fused")
REPO = Path(__file__).resolve().parents[1]


def test_the_kernels_are_built_here_on_this_torch_s_blas() -> None:
    """This machine has a compiler: the suite must exercise the kernels, not the fallback; and the kernels find the
    BLAS symbols exactly when this PyTorch build exports them (else they use ATen's matmul)."""
    assert os.environ.get("ROUTEFORMER_FUSED") != "0" and available()
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    assert torch.ops.routeformer_fused.has_blas() == (hasattr(lib, "sgemm_") and hasattr(lib, "dgemm_"))


# --- gradcheck: float64, every value the kernel reads ---------------------------------------------------------


def _gradcheck_cases():
    g = torch.Generator().manual_seed(0)
    N = 11
    order = torch.randperm(N, generator=g).expand(1, 2, N).contiguous()
    groups = torch.randint(0, 3, (1, 2, N), generator=g)
    labels = torch.randint(0, 30, (1, 2, 2, N), generator=g)
    valid = rand_padding(1, N, seed=3)[:, None, :]
    valid[..., -1] = True
    rel = rand_rel(3, 2)
    bias = torch.randn(1, 2, 1, N, N, dtype=torch.float64, generator=g)
    band = Tiling.band(4, N, True)
    return {
        "band": dict(tiling=band),
        "band, relative, unit": dict(tiling=band, rel_pos=rel, distances=Distances(unit=1)),
        "dense, bias, delta": dict(tiling=Tiling.dense(N), bias=bias, rel_pos=rel,
                                   distances=Distances(delta=torch.randint(-3, 4, (1, 1, 1, N, N), generator=g))),
        "order, groups, own key, positions": dict(
            tiling=Tiling(block=3, back=1, offsets=(-3, 0), order=order), rel_pos=rel,
            restrict=KeyRestrictions(groups=groups.sort(-1).values, exclude_self=True),
            distances=Distances(positions=order)),
        "order, positions far apart (per-pair relative terms)": dict(
            tiling=Tiling(block=3, back=1, offsets=(-3, 0), order=order), rel_pos=rand_rel(3, 40),
            distances=Distances(positions=order * 7)),
        "labels (lowered to a tile mask), validity, unsorted groups": dict(
            tiling=Tiling(block=4, back=1, ahead=1, tile_mask=torch.rand(1, 2, 3, 4, 12, generator=g) > 0.3),
            key_valid=valid, restrict=KeyRestrictions(groups=groups, labels=labels, label_window=4)),
    }


@pytest.mark.parametrize("case", sorted(_gradcheck_cases()))
def test_gradcheck_of_the_tiled_operation(case: str) -> None:
    kw = _gradcheck_cases()[case]
    q, k, v = rand_qkv(1, 2, 11, 3, seed=4)
    tables = [kw["rel_pos"].key, kw["rel_pos"].value] if "rel_pos" in kw else []

    def f(q, k, v, *tables):
        rest = dict(kw)
        rel = relative(rest.pop("rel_pos", None), rest.pop("distances", INDEX))
        inputs = Inputs(q, k, v, 0.7, rest.pop("key_valid", None))
        out, lse = FUSED.tiled(inputs, rest.pop("tiling"), rel=rel, need_lse=True, **rest)
        return out, lse.where(lse > -1e300, 0.0)  # the lse of a row without keys is a constant

    assert torch.autograd.gradcheck(f, (q, k, v, *tables))


def test_gradcheck_of_ranges() -> None:
    g = torch.Generator().manual_seed(1)
    N, Nq, merge, width = 13, 7, 2, 4
    q, _, _ = rand_qkv(1, 2, Nq, 3, seed=2)
    _, k, v = rand_qkv(1, 2, N, 3, seed=3)
    hi = torch.randint(0, N + 1, (1, 2, Nq * merge), generator=g)
    lo = (hi - torch.randint(0, width + 1, hi.shape, generator=g)).clamp_min(0)
    lo[..., 1::2], hi[..., 1::2] = lo[..., 1::2].clamp_max(0), hi[..., 1::2].clamp_max(0)  # disjoint: 2nd empty
    order = torch.randperm(N, generator=g).expand(1, 2, N).contiguous()
    rel = rand_rel(3, 3)
    pos = torch.arange(N).expand(1, 2, N)

    def f(q, k, v, a, b):
        spans = Ranges(lo, hi, width, merge, query_pos=pos[..., :Nq], key_pos=pos)
        out, lse = FUSED.ranges(Inputs(q, k, v, 0.6), spans, order=KeyOrder(order, order.argsort(-1)), rel_pos=rel,
                                need_lse=True)
        return out, lse.where(lse > -1e300, 0.0)

    assert torch.autograd.gradcheck(f, (q, k, v, rel.key, rel.value))


# --- the same bits at one and two threads ---------------------------------------------------------------------


def _thread_cases():
    B, H, N, D = 2, 3, 300, 16
    q, k, v = rand_qkv(B, H, N, D, dtype=torch.float32, seed=5)
    rel = rand_rel(D, 40, dtype=torch.float32)
    layer = routing_layer(H, D, 6, 20, probes=2, balance=0.01)
    return (q, k, v), {
        "local+rel": lambda q, k, v: local_attention(q, k, v, 50, rel_pos=rel, backend="fused"),
        "routing, two probes": lambda q, k, v: layer(q, q, v),
        "lsh": lambda q, k, v: lsh_attention(q, v, buckets=8, rounds=2, window=30,
                                             rotations=lsh_rotations(H, D, 8, 2), backend="fused"),
    }, rel


@pytest.mark.parametrize("name", ["local+rel", "routing, two probes", "lsh"])
def test_results_are_the_same_bits_at_one_and_two_threads(name: str) -> None:
    """Forward and gradients: every head's key gradients are summed by one thread in a fixed order (no atomics)."""
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            (q, k, v), cases, rel = _thread_cases()
            out = cases[name](q, k, v)
            leaves = [q, k, v] + ([rel.key, rel.value] if name == "local+rel" else [])
            grads = torch.autograd.grad(out, leaves, torch.ones_like(out).cumsum(-1).sin(), allow_unused=True)
            results.append([out.detach(), *[g for g in grads if g is not None]])
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


# --- memory, compile, hand-offs -------------------------------------------------------------------------------


def test_a_local_call_keeps_o_of_n_d_for_its_backward() -> None:
    """q, k, v, out and the lse: about 4× the bytes of q, whatever the window (the tiles executor keeps each tile's
    probabilities: O(N · window))."""
    q, k, v = rand_qkv(1, 4, 2048, 32, dtype=torch.float32)
    bytes_q = q.numel() * 4
    fused = kept_for_backward(lambda: local_attention(q, k, v, 256, backend="fused"))
    tiles = kept_for_backward(lambda: local_attention(q, k, v, 256, backend="tiles"))
    assert fused <= 5 * bytes_q < tiles


def test_compiles_into_one_graph_forward_and_backward() -> None:
    q, k, v = rand_qkv(1, 2, 40, 8, dtype=torch.float32, seed=2)
    rel = rand_rel(8, 6, dtype=torch.float32)

    def f(q, k, v):
        return local_attention(q, k, v, 7, rel_pos=rel, backend="fused")

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out, ref = compiled(q, k, v), f(q, k, v)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), q)[0], torch.autograd.grad(ref.sum(), q)[0],
                               rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_other_dtypes_go_to_the_tiles_executor(dtype: torch.dtype) -> None:
    q, k, v = (x.to(dtype) for x in rand_qkv(1, 2, 30, 8, grad=False))
    order = torch.randperm(30).expand(1, 2, 30)
    tiling = Tiling(block=5, back=1, offsets=(-5, 0), order=order)
    out, _ = FUSED.tiled(Inputs(q, k, v, 0.3), tiling)
    ref, _ = get_executor("tiles").tiled(Inputs(q, k, v, 0.3), tiling)
    assert out.dtype == dtype and torch.equal(out, ref)


# --- building -------------------------------------------------------------------------------------------------

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
from routeformer.attention import local_attention
from routeformer.executors import resolve_backend
q = torch.randn(1, 2, 40, 8)
for _ in range(3):
    local_attention(q, q, q, 5)  # the default: fused, or tiles with one warning
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


def test_a_compile_error_is_a_warning_that_quotes_the_compiler(tmp_path: Path, monkeypatch) -> None:
    _one_capability(monkeypatch)
    build = _tiny(tmp_path, "routeformer_test_broken", TINY.replace("x.mul(2)", "x * undefined_name"))
    with pytest.warns(FusedKernelUnavailable, match="undefined_name"):
        assert "compile error" in build.load()


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
        print("IMPORTED", build.switch())
    """)
    assert run.returncode == 0 and "IMPORTED auto" in run.stdout, run.stderr


def test_compile_only_checks_a_capability_without_loading_it(tmp_path: Path) -> None:
    good = _tiny(tmp_path, "routeformer_test_compile_only")
    bad = _tiny(tmp_path, "routeformer_test_compile_only_bad", TINY.replace("x.mul(2)", "x * undefined_name"))
    cap = fused_build.CAPABILITIES[0] if fused_build.X86 else "DEFAULT"
    assert compile_only(good, cap, tmp_path / "good").returncode == 0
    assert (tmp_path / "good" / "routeformer_test_compile_only.o").exists()
    result = compile_only(bad, cap, tmp_path / "bad")
    assert result.returncode != 0 and "undefined_name" in result.stderr


def test_bench_fused_rows_refuse_anything_but_the_dispatched_build(tmp_path: Path, monkeypatch) -> None:
    from routeformer.bench import measure

    chain = build_chain()
    broken_at_top = f"#if defined(CPU_CAPABILITY_{chain[0]})\n#error this capability's build is broken\n#endif\n"
    build = _tiny(tmp_path, "routeformer_test_bench", broken_at_top + TINY)
    monkeypatch.setattr(measure, "KERNELS", build)
    with pytest.warns(FusedKernelUnavailable), pytest.raises(FusedKernelRequired, match="--backend tiles"):
        measure.measured_backend("fused", torch.device("cpu"))
    assert measure.measured_backend("tiles", torch.device("cpu")) == "tiles"


# --- autograd -------------------------------------------------------------------------------------------------


def _double_backward_cases():
    q, k, v = rand_qkv(1, 2, 40, 8, seed=6)
    order = torch.randperm(40).expand(1, 2, 40).contiguous()
    hi = torch.arange(1, 41).expand(1, 2, 40).contiguous()
    return (q, k, v), {
        "band": lambda q, k, v: local_attention(q, k, v, 5, backend="fused"),
        "ranges": lambda q, k, v: FUSED.ranges(Inputs(q, k, v, 0.3), Ranges((hi - 6).clamp_min(0), hi, 6, 1),
                                               order=KeyOrder(order, order.argsort(-1)))[0],
        "LSH rounds": lambda q, k, v: lsh_attention(q, v, buckets=4, rounds=2, window=6,
                                                    rotations=lsh_rotations(2, 8, 4, 2), backend="fused"),
        "sigmoid GELU": lambda q, k, v: sigmoid_gelu(q),
    }


@pytest.mark.parametrize("name", ["band", "ranges", "LSH rounds", "sigmoid GELU"])
def test_double_backward_is_an_error_naming_the_kernel(name: str) -> None:
    """create_graph=True: the first gradients are right (as without it), and differentiating them again raises,
    also when only the inputs (not the incoming gradient) require grad; before, the second-order terms dropped."""
    (q, k, v), cases = _double_backward_cases()
    out = cases[name](q, k, v)
    plain = torch.autograd.grad(out.sum(), q, retain_graph=True)[0]
    first = torch.autograd.grad(out.sum(), q, create_graph=True)[0]  # the incoming gradient needs no grad
    assert torch.equal(first.detach(), plain) and first.requires_grad
    with pytest.raises(RuntimeError, match=f"fused CPU kernel's {name} backward is not differentiable"):
        first.pow(2).sum().backward()


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


class _MaskRecorder:
    """Stands in for torch.ops.routeformer_fused: records each backward's output_mask and its gradients' sizes."""

    def __init__(self) -> None:
        self.seen: list[tuple[list[bool], list[int]]] = []

    def __getattr__(self, name: str):
        op = getattr(torch.ops.routeformer_fused, name)
        if not name.endswith("_backward"):
            return op

        def recorded(*args):
            result = op(*args)
            self.seen.append((list(args[-1]), [t.numel() for t in result[:3]]))
            return result

        return recorded


@pytest.mark.parametrize("wanted", ["q", "k", "v", "qv"])
@pytest.mark.parametrize("name", ["band", "ranges", "LSH rounds"])
def test_only_the_gradients_autograd_asks_for_are_computed(name: str, wanted: str, monkeypatch) -> None:
    """The backward operators get autograd's needs_input_grad as their output_mask and leave the other gradients
    empty (their products skipped); what is computed is the same bits as with every gradient."""
    from routeformer.executors.fused import op as fused_op

    if name == "LSH rounds" and wanted == "k":
        pytest.skip("LSH's keys are made from q inside the kernel: no k")
    (q, k, v), cases = _double_backward_cases()
    grad = torch.randn(1, 2, 40, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    full = torch.autograd.grad(cases[name](q, k, v), (q, k, v), grad, allow_unused=True)
    recorder = _MaskRecorder()
    monkeypatch.setattr(fused_op, "ops", lambda: recorder)
    inputs = [x.detach().requires_grad_(n in wanted) for n, x in zip("qkv", (q, k, v), strict=True)]
    asked = [x for x in inputs if x.requires_grad]
    some = torch.autograd.grad(cases[name](*inputs), asked, grad)
    mask = [n in wanted for n in "qkv"]
    assert recorder.seen and all(m == mask for m, _ in recorder.seen)
    for m, sizes in recorder.seen:
        assert [size > 0 for size in sizes[:3]][::2] == [m[0], m[2]]  # dq, dv: computed exactly when asked
        if name != "LSH rounds":
            assert (sizes[1] > 0) == m[1]
    for got, n in zip(some, [n for n in "qkv" if n in wanted], strict=True):
        assert torch.equal(got, full["qkv".index(n)])
