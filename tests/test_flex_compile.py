"""The flex executor's Triton kernels compiled for GPUs on this CPU machine: Triton's compiler runs without a GPU
(its NVIDIA backend and ptxas ship in the wheel), so a kernel the interpreter runs but the compiler refuses (a
global that is not a ``tl.constexpr``, an operation the interpreter allows and the GPU's lowering does not) fails
here, not on a loaned GPU. For an H200 (sm_90a: the tensor cores the scores use, TF32 in three passes) and an
A100 (sm_80), every tile the autotuner may pick, within the shared memory those GPUs give one program.

Skipped without Triton, and in the interpreter's own process (``TRITON_INTERPRET=1``: the kernels are then the
interpreter's, not the compiler's).

Twice: with the newest Triton (this environment's) and with the one the GPU machines' PyTorch carries (torch 2.11:
Triton 3.6), which ``.ci/run`` installs beside it (``pip install --no-deps --target .triton-3.6 triton==3.6.0``);
the slow test below runs this file again in a process that imports that one, and checks that it did."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs Triton's compiler (the triton extra), outside TRITON_INTERPRET=1")

TARGETS = {"H200": (90, 227 * 1024), "A100": (80, 163 * 1024)}  # capability, shared memory per program (bytes)
ROOT = Path(__file__).resolve().parents[1]
DEVICE_TRITON = ("3.6.0", ROOT / ".triton-3.6")  # the GPU image's (torch 2.11's), and where .ci/run installs it
EXPECT = "ROUTEFORMER_EXPECT_TRITON"  # set by that test: the Triton version the process must have imported


def test_the_triton_this_process_was_asked_to_compile_with() -> None:
    """Where a run asks for a Triton version (the slow test below), the one imported is that one: the compile
    tests then spoke for it."""
    import triton

    want = os.environ.get(EXPECT)
    if want is None:
        pytest.skip(f"no Triton version asked for ({EXPECT})")
    assert triton.__version__ == want, (triton.__version__, triton.__file__)


def _compile(kernel, signature: dict, constexprs: dict, capability: int):
    """``kernel`` (a jit function, or an autotuner's) compiled to a cubin for ``capability``; signature: argument ->
    Triton type, constexprs: argument -> value."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.autotuner import Autotuner

    fn = kernel.fn if isinstance(kernel, Autotuner) else kernel
    names = fn.arg_names
    sig = {name: signature.get(name, "constexpr") for name in names}
    source = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", capability, 32))


@pytest.mark.parametrize("gpu", sorted(TARGETS))
def test_the_router_compiles_at_every_tile_on_the_tensor_cores(gpu: str) -> None:
    """Every tile on an H200 (the loaned GPU), the first on an A100."""
    from routeformer.executors.flex import kernels

    capability, shared = TARGETS[gpu]
    signature = {"R": "*fp32", "C": "*fp32", "BIAS": "*fp32", "PROBES": "*i64", "COSINE": "*fp32", "COUNTS": "*i32",
                 "N": "i32", "H": "i32", "K": "i32", "D": "i32"}
    assert len(kernels.CHOOSE_TILES) > 1  # the compiler's list, not the interpreter's single tile
    for rows, clusters, warps in kernels.CHOOSE_TILES if gpu == "H200" else kernels.CHOOSE_TILES[:1]:
        del warps  # the number of warps is a launch option; the code is the same
        out = _compile(kernels.choose, signature, {"HAS_BIAS": True, "P": 2, "P_PAD": 2, "BLOCK_N": rows,
                                                   "BLOCK_K": clusters, "BLOCK_D": 64}, capability)
        assert out.metadata.shared <= shared, (rows, clusters, out.metadata.shared)
        assert ".tf32" in out.asm["ptx"]  # the scores on the tensor cores in TF32 passes, not float32 FMA


@pytest.mark.parametrize("gpu", sorted(TARGETS))
def test_the_statistics_selection_and_row_kernels_compile(gpu: str) -> None:
    from routeformer.executors.flex import kernels, router, rows, selection

    capability, shared = TARGETS[gpu]
    compiled = [
        _compile(kernels.reduce, {"R": "*fp32", "ORDER": "*i64", "STARTS": "*i32", "COUNTS": "*i32", "VALID": "*i1",
                                  "SUMS": "*fp32", "WEIGHTS": "*fp32", "B": "i32", "H": "i32", "N": "i32", "K": "i32",
                                  "D": "i32"},
                 {"HAS_VALID": True, "BLOCK_N": router.REDUCE_ROWS, "BLOCK_D": 64}, capability),
        _compile(kernels.select, {"Q": "*fp32", "S": "*fp32", "CHOSEN": "*i64", "N": "i32", "NB": "i32", "D": "i32",
                                  "BLOCK": "i32"},
                 {"TOP": 3, "TOP_PAD": 4, "BLOCK_N": selection.BLOCK_N, "BLOCK_K": selection.BLOCK_K,
                  "BLOCK_D": 128}, capability),
    ]
    for dtype, scale in (("bf16", 1.0), ("fp32", 0.125), ("fp64", 0.5)):
        compiled.append(_compile(kernels.move, {"X": f"*{dtype}", "INDEX": "*i64", "OUT": f"*{dtype}", "H": "i32",
                                                "N": "i32", "M": "i32", "D": "i32", "SB": "i64", "SH": "i64",
                                                "SN": "i64", "SD": "i64"},
                                 {"SCALE": scale, "BLOCK_M": rows.ROWS, "BLOCK_D": 64}, capability))
    assert all(c.metadata.shared <= shared for c in compiled)


@pytest.mark.slow
def test_the_kernels_compile_with_the_gpu_images_triton_too() -> None:
    """This file's compile tests again, in a process that imports the GPU image's Triton (3.6, for torch 2.11)
    from ``.triton-3.6`` ahead of this environment's: a kernel that only the newest Triton lowers fails here."""
    version, folder = DEVICE_TRITON
    if not (folder / "triton" / "__init__.py").is_file():
        pytest.skip(f"Triton {version} is not installed in {folder} (pip install --no-deps --target {folder} "
                    f"triton=={version}; .ci/run does)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT / "src")]), EXPECT: version}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-m",
                          "not slow", __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "5 passed" in run.stdout, run.stdout[-2000:]  # the version check and the four compile tests, none skipped
