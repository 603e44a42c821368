"""The command line: help text and the attention benchmark at toy sizes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import banner, executor_named
from routeformer.attention import PATTERNS
from routeformer.cli import main
from routeformer.executors import describe_backend, resolve_backend
from routeformer.executors.fused.build import build_chain


def test_bench_attention_prints_a_table_for_every_pattern(capsys) -> None:
    assert main(["bench", "attention", "--n", "64", "96", "--repeats", "1", "--heads", "2", "--head-dim", "8",
                 "--window", "16", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    # the line naming the executor, on stderr (stdout keeps the tables), once
    assert banner(captured.err) == describe_backend("auto", "cpu") and captured.err.count("attention: ") == 1
    assert banner(captured.err).startswith(executor_named()) and "attention: " not in out
    for n in ("64", "96"):
        rows = [line for line in out.splitlines() if line.startswith(f"| {n} ") or line.startswith(f"|  {n} ")]
        names = {row.split("|")[2].strip() for row in rows}
        assert set(PATTERNS) <= names, names
    assert "speed-up vs full" in out and "1.00×" in out
    assert "routing" in names and "training peak memory ~ N^b" in out


def test_bench_attention_writes_its_rows_as_json(tmp_path: Path, capsys) -> None:
    """--json: the settings and the rows the table prints (scripts/device_check.py reads them)."""
    import json

    path = tmp_path / "new" / "rows.json"
    assert main(["bench", "attention", "--n", "64", "--repeats", "1", "--heads", "2", "--head-dim", "8", "--window",
                 "16", "--only", "local", "--backend", "tiles", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    table = json.loads(path.read_text())
    assert table["suite"] == "attention" and table["settings"]["backend"] == "tiles"
    assert table["settings"]["heads"] == 2 and table["settings"]["dtype"] == "float32"
    assert [(row["n"], row["mechanism"]) for row in table["rows"]] == [(64, "full"), (64, "local")]
    for row in table["rows"]:
        assert row["fwd_bwd_s"] > 0 and f"{row['fwd_bwd_s'] * 1e3:.1f}" in out  # the table's number
        assert row["training_bytes"] > 0


def test_bench_rejects_bad_sizes(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "attention", "--n", "0"])
    assert "positive integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "attention", "--leak-n", "-1"])
    assert "--leak-n: must be an integer >= 0, got -1" in capsys.readouterr().err


@pytest.mark.parametrize("leak_n, table", [(None, True), (0, False)])
def test_bench_attention_leak_table_at_the_length_asked(leak_n: int | None, table: bool, capsys) -> None:
    """--leak-n 0: no causal leak table (the device check's routing part skips its compilations); by default one."""
    extra = [] if leak_n is None else ["--leak-n", str(leak_n)]
    assert main(["bench", "attention", "--n", "64", "--repeats", "1", "--heads", "2", "--head-dim", "8", "--window",
                 "16", "--only", "local", "--backend", "tiles", *extra]) == 0
    assert ("causal leak at N=" in capsys.readouterr().out) == table


def test_python_m_routeformer_runs_the_command_line() -> None:
    done = subprocess.run([sys.executable, "-m", "routeformer", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "usage: routeformer" in done.stdout


@pytest.mark.parametrize("args", [*([cmd, "--help"] for cmd in ("prepare", "train", "evaluate", "sample", "bench",
                                                                "env")),
                                  ["bench", "attention", "--help"], ["bench", "model", "--help"],
                                  ["bench", "recall", "--help"], ["bench", "text", "--help"]])
def test_help(args: list[str], capsys) -> None:
    """Every subcommand has --help (in this process: a process each took 4 s of the suite)."""
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code == 0 and f"usage: routeformer {' '.join(args[:-1])}" in capsys.readouterr().out


def test_bench_model_prints_training_and_generation_tables(capsys) -> None:
    assert main(["bench", "model", "--n", "64", "128", "--positions", "32", "96", "--dim", "32", "--depth", "1",
                 "--heads", "4", "--window", "16", "--repeats", "1", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert banner(captured.err) == describe_backend("auto", "cpu") and captured.err.count("attention: ") == 1
    for name in ("full", "local", "local+routing"):
        assert f"| {name} " in out
    assert "tokens/s" in out and "ms/token at 32" in out and "ms/token at 96" in out


def test_the_banner_names_the_executor_asked_for(capsys) -> None:
    assert main(["bench", "attention", "--n", "64", "--repeats", "1", "--heads", "2", "--head-dim", "8", "--window",
                 "16", "--only", "local", "--backend", "tiles", "--device", "cpu"]) == 0
    assert banner(capsys.readouterr().err) == "attention: tiles (asked for)"


def test_the_banner_says_tiles_where_the_fused_kernel_does_not_run() -> None:
    """The fused executor hands calls off the CPU, and in dtypes other than float32 / float64, to tiles: the line
    says so (for a float32 call on the CPU it names the kernel, as the banner tests above check)."""
    from routeformer import TransformerConfig

    assert describe_backend("fused", "meta") == ("attention: tiles (fused asked for, but its kernels run on the CPU "
                                                 "only, not meta)")
    assert describe_backend("tiles", "cpu", torch.bfloat16) == "attention: tiles (asked for)"
    if resolve_backend("auto", "cpu") == "fused":
        assert describe_backend("auto", "cpu", torch.bfloat16) == ("attention: tiles (the fused kernel takes "
                                                                   "float32 and float64, not bfloat16)")
        assert describe_backend("auto", "cpu", torch.float64) == describe_backend("auto", "cpu")
    local = TransformerConfig(dim=32, heads=2, depth=1, attention="local", options={"local": {"window": 8}})
    assert local.describe_executor("cpu") == describe_backend("auto", "cpu")
    linear = TransformerConfig(dim=32, heads=2, depth=1, attention="linear", positions="absolute")
    assert linear.describe_executor("cpu") == describe_backend("auto", "cpu")  # elu's scan: the executor's kernels
    poly2 = TransformerConfig(dim=32, heads=2, depth=1, attention="linear", positions="absolute",
                              options={"linear": {"kernel": "poly2"}})
    assert poly2.describe_executor("cpu") == "attention: no executor (the linear heads compute their own way)"


def _env(*args: str, **env: str) -> tuple[dict[str, str], subprocess.CompletedProcess]:
    """`routeformer env ARGS` in a process of its own (the environment ``env`` added): its 'key: value' lines as a
    dict, and the process."""
    done = subprocess.run([sys.executable, "-m", "routeformer", "env", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    column = lines[0].index(lines[0].split(":", 1)[1].strip())  # the values are aligned
    rows = {}
    for line in lines:
        key, _, value = line.partition(":")
        assert line[column - 1] == " " and line[column] != " " and value.strip() == line[column:], line
        rows[key] = value.strip()
    return rows, done


def test_env_reports_this_installation() -> None:
    from routeformer import __version__
    from routeformer.executors import EXECUTORS
    from routeformer.executors.fused.build import KERNELS, cache_root

    rows, _ = _env(OMP_NUM_THREADS="1")  # a thread count of its own (a test worker's is its share of the cores)
    assert rows["routeformer"].startswith(f"{__version__} (")
    assert rows["torch"].startswith(f"{torch.__version__} (")
    assert rows["python"].startswith(f"{sys.version_info.major}.{sys.version_info.minor}.")
    assert rows["cpu capability"] == torch.backends.cpu.get_cpu_capability()
    assert rows["ATEN_CPU_CAPABILITY"] == os.environ.get("ATEN_CPU_CAPABILITY", "unset")
    assert rows["build chain"] == ", ".join(build_chain())
    assert rows["openmp threads"].startswith("1 ") and "OMP_NUM_THREADS=1" in rows["openmp threads"]
    assert rows["blas"].startswith(f"torch: MKL {'available' if torch.backends.mkl.is_available() else 'not'}")
    assert rows["ROUTEFORMER_FUSED"].split()[0] == os.environ.get("ROUTEFORMER_FUSED", "auto")
    assert rows["kernel cache"].startswith(f"{cache_root()} (")
    assert rows["cuda"].startswith(torch.version.cuda or "none (a CPU build of torch)")
    assert rows["executors"].startswith(", ".join(EXECUTORS))
    # what this process resolves, the env process reports: the kernel it loaded, auto and the banner
    status = KERNELS.status()
    if status.ok:
        assert rows[f"build {status.loaded}"] == f"built: {status.library}"
        width = torch.ops.routeformer_fused.vector_width()
        assert rows["loaded"] == f"{status.loaded}, {width}-lane vectors ({status.library})"
        assert "the kernel's products" in rows["blas"]
    else:
        assert rows["loaded"] == f"no: {status.why()}"
    assert rows["auto on cpu"] == resolve_backend("auto", "cpu")
    assert rows["banner on cpu"] == describe_backend("auto", "cpu")
    assert ("auto on cuda" in rows) == torch.cuda.is_available()


@pytest.mark.slow  # the default suite's slowest (2026-12-07, 13-27 s a worker): CI's slow line runs it
def test_env_reports_a_failed_build_and_looks_without_building(tmp_path) -> None:
    """In an empty cache with a compiler that fails: --no-build compiles nothing; env tries, fails, says why and
    exits 0; the failures are remembered, and a later --no-build shows each build as failed with its reason and log."""
    cache = tmp_path / "cache"
    cxx = tmp_path / "c++"  # answers --version and -v (torch 2.6 asks it); compiling fails with a compiler error
    cxx.write_text('#!/bin/sh\ncase "$*" in *--version*|-v) echo "failing-c++ 1.0"; exit 0;; esac\n'
                   'echo "kernel.cpp:1:1: error: this compiler always fails" >&2\nexit 1\n')
    cxx.chmod(0o755)
    env = {"TORCH_EXTENSIONS_DIR": str(cache), "CXX": str(cxx), "ROUTEFORMER_FUSED": "auto"}
    chain = build_chain()

    rows, done = _env("--no-build", **env)
    assert not cache.exists() and "compiling" not in done.stderr  # nothing built, not even a folder
    assert all(rows[f"build {cap}"].startswith(f"not built ({cache / 'routeformer'}") for cap in chain)
    assert rows["loaded"] == "not tried (--no-build)" and "banner on cpu" not in rows
    assert rows["auto on cpu"].startswith(f"fused once its {chain[0]} build compiles")
    assert rows["compiler"] == f"{cxx} ({cxx}): failing-c++ 1.0"

    rows, done = _env(**env)
    assert rows["loaded"].startswith(f"no: {chain[0]}: compile error: kernel.cpp:1:1: error: this compiler always "
                                     f"fails"), rows["loaded"]
    assert all(f"{cap}: compile error" in rows["loaded"] for cap in chain)  # x86 falls back, build by build
    assert rows["auto on cpu"] == "tiles"
    assert rows["banner on cpu"].startswith(f"attention: tiles (fused kernel unavailable: {chain[0]}: compile error")

    rows, _ = _env("--no-build", **env)
    for cap in chain:
        state = rows[f"build {cap}"]
        assert state.startswith("failed: compile error: kernel.cpp:1:1: error: this compiler always fails"), state
        log, failed = state.split("(log: ")[1].split(")")[0], state.split("remembered in ")[1]
        assert Path(log).is_file() and Path(failed).is_file() and Path(failed).name == "failed.txt"
    assert rows["auto on cpu"].startswith("tiles (every build failed")


def test_env_without_a_compiler_says_so_and_builds_nothing(tmp_path) -> None:
    missing = tmp_path / "no-such-c++"
    rows, _ = _env(TORCH_EXTENSIONS_DIR=str(tmp_path / "cache"), CXX=str(missing), ROUTEFORMER_FUSED="auto")
    assert rows["compiler"].startswith(f"{missing} not found")
    assert rows["loaded"] == f"no: {build_chain()[0]}: no C++ compiler ({str(missing)!r} not found; set CXX)"
    assert rows["banner on cpu"].startswith("attention: tiles (fused kernel unavailable:")
    assert not any(p.suffix == ".so" for p in (tmp_path / "cache").rglob("*"))
