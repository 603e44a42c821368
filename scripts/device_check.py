#!/usr/bin/env python3
"""The device check: what routeformer does on a GPU, in three parts of under 9 minutes each, written to a report.

    python scripts/device_check.py OUT --part check         # on one CUDA GPU: tests and training, under 9 minutes
    python scripts/device_check.py OUT --part bench         # on one CUDA GPU: the attention benchmark, under 9
    python scripts/device_check.py OUT --part cpu           # the README's test suite on the GPU machine's host
    python scripts/device_check.py OUT --part routing       # on one CUDA GPU: routing's kernels tested, then timed
                                                            # at 64k and 256k and profiled at 64k (issue 56)
    python scripts/device_check.py OUT                      # all three parts, one after the other (~25 minutes)
    python scripts/device_check.py OUT --toy --device cpu   # every step at toy sizes on the CPU (CI)

Writes OUT/report.md and OUT/report.json (and each step's whole output under OUT/logs/): the versions (Python,
PyTorch, CUDA, cuDNN, Triton, the GPU, the CPU, ``routeformer env --no-build``), then one subprocess per step, each
with its own time limit, recorded as pass, fail or timeout with its seconds, the numbers parsed from it and the
tail of its output:

1. tests: ``pytest -m cuda tests/test_cuda.py tests/test_flex.py`` on the device (``ROUTEFORMER_TEST_DEVICE``);
2. bench-N: ``routeformer bench attention`` at 16k and 64k (toy: 256, 512): local, routing with the paper's rule
   and with two probes, LSH, beside full attention held to SDPA's flash and cuDNN backends and FlexAttention's own
   sliding window; ms forward+backward and peak memory;
3. train: a 1-minute ``routeformer train`` at 4096 with local and routing heads in bfloat16: tokens/s at steady
   state, the first step's seconds (compilation), the recompilations dynamo logs (TORCH_LOGS=recompiles);
4. ddp, fsdp: a one-process ``torchrun`` training a few steps (NCCL on CUDA, gloo on the CPU), with DDP and with
   FSDP2 (``--fsdp``), as a user would start it;
5. profile (part bench): ``torch.profiler`` of local and routing forward+backward at 16k, the costliest operators;
6. suite (part cpu; not at toy sizes): the README's test command on the host's CPU, the failures named;
7. part routing: the flex executor's Triton kernels against PyTorch first (routing-kernels), the benchmark at 64k
   and 256k, the profile at 64k (local, routing, two probes), routing's device tests (routing-tests), and
   ``experiments/flex_window_cost.py`` at 64k (flex-cost: routing's flex forward against the sliding window's).

A failing step never stops the check, and the report is rewritten after every step, so an interrupted check keeps
what it measured. A step cut by its time limit keeps what it measured too: each measuring step prints a line per
measurement as soon as it is taken (pytest's per-test lines, bench attention's ``measured ...`` lines, PROFILE and
FLEXROW lines), and the numbers are read from those when the step's JSON never came. As each step ends the check
prints its status, seconds and numbers on stdout (flushed), so that the last lines of its output say what was
measured so far. Exit status: 0 when every step passed, 1 when one failed or ran out of time, 2 for a usage error.
docs/gpu.md says what each number means and what the goals are.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAIL_CHARS = 3000  # of each step's output, in the report (the whole output is in OUT/logs/)
# The forward+backward ratios the goals name (docs/gpu.md): name -> (row, row it is divided by).
RATIOS = {"local / flex-sliding": ("local", "flex-sliding (direct)"), "routing / local": ("routing", "local"),
          "routing-p2 / local": ("routing-p2", "local")}
BENCH_ROWS = ["local", "routing", "routing-p2", "lsh", "sdpa-flash", "sdpa-cudnn"]  # beside full (SDPA's choice)

# Printed by the versions step as one JSON line; run in a subprocess so that this process never holds a CUDA
# context (its memory) while the steps run.
VERSIONS = r"""
import json, platform, sys
import torch
out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
       "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
       "cuda_available": torch.cuda.is_available(), "cpu_threads": torch.get_num_threads()}
try:
    import triton
    out["triton"] = triton.__version__
except ImportError:
    out["triton"] = None
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    out.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory_gib=round(p.total_memory / 2**30, 1),
               gpu_count=torch.cuda.device_count(), bf16=torch.cuda.is_bf16_supported())
print("VERSIONS " + json.dumps(out))
"""


# Profiles local, routing and routing-p2 forward+backward (3 steps after 2 warm ones, which compile) at length
# argv[1] on device argv[2]: each row's operator table (by device self time on CUDA, by CPU self time as well: a
# launch- or sync-bound row shows there) goes to the log, and one PROFILE line with its top operators to the report.
PROFILE = r"""
import json, sys
import torch
from torch.profiler import ProfilerActivity, profile
from routeformer.bench.attention import AttentionBench, candidates, selected
n, dev = int(sys.argv[1]), torch.device(sys.argv[2])
cuda = dev.type == "cuda"
dtype = torch.bfloat16 if cuda else torch.float32
heads, head_dim, window = (8, 64, 256) if n > 1024 else (2, 16, 32)
gen = torch.Generator().manual_seed(0)
q, k, v, grad = (torch.randn(1, heads, n, head_dim, generator=gen).to(dev, dtype) for _ in range(4))
for t in (q, k, v):
    t.requires_grad_(True)
sync = torch.cuda.synchronize if cuda else (lambda: None)
bench = AttentionBench(heads=heads, head_dim=head_dim, window=window, device=str(dev), dtype=dtype)
for c in selected(candidates(n, bench), ["local", "routing", "routing-p2"])[1:]:
    for _ in range(2):
        c.attend(q, k, v).backward(grad)
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(3):
            c.attend(q, k, v).backward(grad)
        sync()
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(f"== {c.name} ({c.settings}): 3 steps forward+backward, by {key}")
    print(events.table(sort_by=key, row_limit=25))
    if cuda:
        print(f"== {c.name}: by self_cpu_time_total")
        print(events.table(sort_by="self_cpu_time_total", row_limit=15))
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:5]
    # host waits (a .item(), a device-to-host copy, a data-dependent shape), less the final sync() above
    syncs = sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize")) - 1
    print("PROFILE " + json.dumps({"row": c.name, "ms_per_step": round(sum(getattr(e, key) for e in events) / 3e3, 3),
          "top_ms_per_step": {e.key[:60]: round(getattr(e, key) / 3e3, 3) for e in top},
          "sync_calls_per_step": syncs / 3 if cuda else None}))
"""
PROFILE_N = {False: 16384, True: 512}  # toy: on the CPU in the CI


@dataclass
class Step:
    """One subprocess of the check and what it gave. ``parse(output, out_dir)`` reads its numbers (the output, and
    any file the step wrote under the check's folder); it may raise, which is recorded, never fatal. ``writes``: the
    files ``parse`` reads, removed before the step runs (a check run again into the same folder, or another part's
    step of the same name, would otherwise have a step cut by its limit read the earlier run's file)."""

    name: str
    what: str
    argv: list[str]
    limit_s: float
    env: dict[str, str] = field(default_factory=dict)
    parse: Callable[[str, Path], dict] | None = None
    writes: tuple[Path, ...] = ()
    status: str = "not run"  # pass | fail | timeout | interrupted | not run
    seconds: float | None = None
    returncode: int | None = None
    numbers: dict = field(default_factory=dict)
    tail: str = ""

    def record(self) -> dict:
        """The step as the JSON report holds it."""
        kept = asdict(self)
        del kept["parse"]
        return {**kept, "writes": [str(path) for path in self.writes], "command": " ".join(self.argv)}


@dataclass(frozen=True)
class Mode:
    """Where the check runs and at which sizes."""

    device: str  # cuda | cpu
    toy: bool
    out: Path

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


# --- the steps ---------------------------------------------------------------------------------------------------

def python(*args: str) -> list[str]:
    return [sys.executable, *args]


PARTS = {"check": ("versions", "env", "prepare", "tests", "train", "ddp", "fsdp"),
         "bench": ("versions", "env", "bench", "profile"),  # bench: the benchmark's steps, one per length
         "cpu": ("versions", "env", "suite"),  # the default test suite on the GPU machine's host processor
         # routing at GPU speed (issue 56): its kernels' tests on the device, the benchmark at 64k and 256k,
         # the profile at 64k
         "routing": ("versions", "routing", "bench", "profile", "flex")}
ROUTING_LENGTHS = (65536, 262144)  # the routing part's: where its goals are (16k: the bench part)
ROUTING_ROWS = ["local", "routing", "routing-p2", "sdpa-cudnn"]  # beside full and FlexAttention's sliding window
GOAL_ROWS = {65536: ["lsh", "moba"]}  # the routing part's rows at the length their goals name (<= 3x local at 64k)


def plan(mode: Mode, part: str = "all") -> list[Step]:
    """The steps in order (of ``part``: 'check', 'bench', 'cpu', 'routing' or 'all'). On a GPU the limits of each
    part add up to under 9 minutes, so that either fits a 15-minute loan of a GPU with its start-up. The limits were
    set from the first runs on an H200 (2026-11-27 and -29), where FlexAttention's compilation took most of every
    step: tests ~130 s with 8 workers, the first training step 24 s, torchrun's first step 17 s, a FlexAttention
    row of the benchmark ~20 s at a new length (its forward without gradients, with them, its backward: bench-16384
    measured five such rows in 103 s), each compiled again at every length (static shapes).

    The routing part (530 s in all on a GPU: 10 s left of the 540 for the check's own start and the SIGTERM grace
    of a step cut at the end) cannot give every step the margin it would like; its limits, in the order it runs:

    - versions 20 s: Python starts, imports torch and Triton and opens one CUDA context (a few seconds);
    - routing-kernels 110 s (was 70): 24 tests in one process, each Triton kernel compiled at its first shape (the
      router's ``choose`` autotuned per (k, D), the row mover per dtype), and five tests of whole layers that
      compile FlexAttention's forward and backward at small lengths (~20 s each): the tests every later number
      hangs on, so the largest margin;
    - bench-65536 120 s (was 110): six FlexAttention rows (flex-sliding, local, routing, routing-p2, lsh, moba) of
      ~20 s each, beside SDPA's, at times of a few ms; the third run measured them all, and a leak table since
      dropped, within its limit of 150 s;
    - bench-262144 90 s (unchanged): four FlexAttention rows compiled again at 256k, full's 0.6-s steps;
    - profile 40 s (was 50): local, routing and routing-p2 at 64k, the shapes bench-65536 has just compiled, so
      inductor's caches on disk serve its compilations: what is left is the start, tracing and three profiled
      steps a row;
    - routing-tests 70 s (was 120): 11 tests on 8 workers, each compiling FlexAttention at 2048 (the check part
      runs them all again in its tests step, 180 s);
    - flex-cost 80 s (was 60): four masks, each a compiled forward and backward at 64k (sliding, routing, routing's
      tables with a causal rule, then the sliding window without the lse, the least needed, last).

    A step cut by its limit keeps the rows it printed (bench, profile, flex-cost) and its tests' lines, so a limit
    that proves short loses a step's last rows, not the step."""
    out, toy = mode.out, mode.toy
    # The training steps' data: stdlib (30 MB); at toy sizes the README as a text data set, whose validation split
    # (1.5 kB) the final evaluation scores in a moment on the CPU (stdlib's 1.6 MB take a minute there).
    name = "readme" if toy else "stdlib"
    data = ["--data", name, "--data-dir", str(out / "data")]
    source = ["text", "--from", str(ROOT / "README.md"), "--name", name, "--force"] if toy else ["stdlib"]
    steps = [
        Step("versions", "Python, PyTorch, CUDA, cuDNN, Triton, the GPU", python("-c", VERSIONS), 20,
             parse=parse_versions),
        Step("env", "routeformer env --no-build: the executors and the fused CPU kernel's builds",
             python("-m", "routeformer", "env", "--no-build"), 15),
        Step("prepare", f"the {name} data set the training steps read",
             python("-m", "routeformer", "prepare", *source, "--data-dir", str(out / "data")), 15),
        test_step(mode),
    ]
    routing = part == "routing"
    if routing:  # the kernels against PyTorch first: a wrong kernel's timings mean nothing
        steps.append(kernel_test_step(mode))
    for n in (256, 512) if toy else (ROUTING_LENGTHS if routing else (16384, 65536)):
        steps.append(bench_step(mode, n, routing))
    profile_n = 65536 if routing and not toy else PROFILE_N[toy]
    steps.append(Step("profile", f"torch.profiler of local, routing and routing-p2 forward+backward at N={profile_n}: "
                      "the operators that take the time", python("-c", PROFILE, str(profile_n), mode.device),
                      40 if routing and not toy else 60, parse=parse_profile))
    if routing:  # then the device tests (the longest step, compiling FlexAttention for each test), and where
        # routing's flex forward loses to the sliding window's (its rule, its tables, the lse)
        steps.append(routing_test_step(mode))
        steps.append(Step("flex-cost", "experiments/flex_window_cost.py: routing's flex forward on its tables and "
                          "rule, beside FlexAttention's sliding window", python(
                              str(ROOT / "experiments" / "flex_window_cost.py"), "512" if toy else "65536",
                              "--device", mode.device), 80 if mode.cuda else 60, parse=parse_flex_cost))
    steps.append(Step(
        "train", "routeformer train: local + routing heads, " + ("toy sizes, float32" if toy else
                                                                 "seq_len 4096, bfloat16, 1 minute of "
                                                                 "steps, then the final evaluation"),
        python("-m", "routeformer", "train", *data, "--out", str(out / "runs" / "train"),
               "--max-minutes", "1", "--max-steps", "40" if toy else "100000",
               *train_settings(mode, seq_len=64 if toy else 4096)),
        120 if toy else 150, env={"TORCH_LOGS": "recompiles"}, parse=parse_train))  # 1 min of steps + evaluation
    for sharding in ("ddp", "fsdp"):
        steps.append(Step(
            sharding, f"torchrun --nproc_per_node 1, {'NCCL' if mode.cuda else 'gloo'}, "
                      f"{'DDP' if sharding == 'ddp' else 'FSDP2 (--fsdp)'}: a few training steps",
            python("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m", "routeformer",
                   "train", *data, "--out", str(out / "runs" / sharding), "--max-steps", "5" if toy else "10",
                   *(["--fsdp"] if sharding == "fsdp" else []), *train_settings(mode, seq_len=64 if toy else 1024)),
            60 if toy else 80, env={"NCCL_DEBUG": "INFO"} if mode.cuda else {},
            parse=parse_torchrun if mode.cuda else lambda output, out: without(parse_torchrun(output, out), "nccl")))
    if not toy:  # CI runs the suite itself; on a GPU machine its host is another x86 processor
        steps.append(suite_step(mode))
    names = {name for p, names in PARTS.items() if part in ("all", p) for name in names}
    return [step for step in steps if step.name.split("-")[0] in names]


def test_step(mode: Mode) -> Step:
    """The device tests and FlexAttention's CUDA tests. The project's pytest options are replaced (they need
    pytest-xdist, which a GPU machine may lack); on a GPU 8 workers compile FlexAttention's kernels side by side."""
    argv = python("-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-m", "cuda", "-v", "-rfE",
                  "--junitxml", str(mode.out / "tests.xml"), "tests/test_cuda.py", "tests/test_flex.py")
    try:
        import xdist  # noqa: F401
    except ImportError:
        pass
    else:
        argv += ["-n", "8" if mode.cuda else "2"]
    return Step("tests", f"pytest -m cuda on {mode.device} (the device tests, FlexAttention's CUDA tests)", argv,
                600 if not mode.cuda else 180, env={"ROUTEFORMER_TEST_DEVICE": mode.device}, parse=parse_tests)


def kernel_test_step(mode: Mode) -> Step:
    """The flex executor's Triton kernels (the router, block selection, the row mover) against PyTorch on the
    device, in one process (no workers to start), each failure's traceback in the log as it happens."""
    argv = python("-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-p", "no:xdist", "-v", "-rfE",
                  "--tb=short", "--junitxml", str(mode.out / "routing-kernels.xml"), "tests/test_flex_router.py",
                  "tests/test_flex_rows.py")
    env = {"ROUTEFORMER_TEST_DEVICE": mode.device, **({} if mode.cuda else {"TRITON_INTERPRET": "1"})}
    return Step("routing-kernels", f"the flex executor's Triton kernels against PyTorch on {mode.device}", argv,
                110 if mode.cuda else 300, env=env, parse=parse_tests)


def routing_test_step(mode: Mode) -> Step:
    """The device tests of routing (compiled FlexAttention on the interval block tables against float64 on the CPU,
    training, decoding, no host synchronisation, no recompilation on new data)."""
    argv = python("-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-v", "-rfE", "--junitxml",
                  str(mode.out / "routing-tests.xml"), "tests/test_cuda.py", "-k",
                  "router or routing or kernels or sync or compilation")
    try:
        import xdist  # noqa: F401
    except ImportError:
        pass
    else:
        argv += ["-n", "8" if mode.cuda else "2"]
    return Step("routing-tests", f"routing's device tests on {mode.device}", argv, 70 if mode.cuda else 300,
                env={"ROUTEFORMER_TEST_DEVICE": mode.device}, parse=parse_tests)


def suite_step(mode: Mode) -> Step:
    """The README's test command (the project's pytest options: not slow) on the host's CPU, the GPU hidden as on a
    CPU machine, 8 workers of 2 threads (16 workers of 16 threads each crawled through a third of it in 200 s on
    the H200's 16-core host, 2026-11-27)."""
    argv = python("-m", "pytest", "-q", "-rfE", "-n", "8", "--junitxml", str(mode.out / "suite.xml"))
    return Step("suite", "the README's test command on the host's CPU, 8 workers of 2 threads", argv, 420,
                env={"OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": ""},
                parse=lambda output, out: parse_junit(out / "suite.xml"), writes=(mode.out / "suite.xml",))


def bench_step(mode: Mode, n: int, routing: bool = False) -> Step:
    """``routeformer bench attention`` at N = n; ``routing``: the routing part's rows and limits (``plan`` says what
    they allow for). Its numbers come from the JSON the benchmark writes at its end, or, for a run cut by its limit,
    from the ``measured ...`` line it prints for each row as soon as the row is measured."""
    dtype = "bfloat16" if mode.cuda else "float32"  # SDPA's flash and cuDNN backends take half precision only
    json_path = mode.out / f"bench-{n}.json"
    size = ["--heads", "2", "--head-dim", "16", "--window", "32", "--repeats", "1"] if mode.toy else ["--repeats", "3"]
    rows = ROUTING_ROWS + GOAL_ROWS.get(n, []) if routing else BENCH_ROWS
    if routing:  # no leak table (its compilations at N = 1024 took most of a step; the device tests check leaks)
        limit = 80 if n <= 16384 else (120 if n <= 65536 else 90)
        size += ["--leak-n", "0"]
    else:
        limit = 200 if n <= 16384 else 240
    return Step(f"bench-{n}", f"routeformer bench attention at N={n}, {dtype}",
                python("-m", "routeformer", "bench", "attention", "--device", mode.device, "--dtype", dtype,
                       "--n", str(n), *size, "--only", *(rows if mode.cuda else rows[:3]),
                       "--json", str(json_path)),
                120 if mode.toy else limit, parse=lambda output, out: parse_bench(json_path, output),
                writes=(json_path,))


def train_settings(mode: Mode, seq_len: int) -> list[str]:
    """--set options of the training steps: half local, half routing heads (the shipped default.toml's routing
    rule, the paper's), one log row per step, no periodic evaluation, no sample. On a GPU lr 2e-3 with 50 warm-up
    steps: at the default 6e-3 with 10 this 12.5M-parameter model in bfloat16 diverged (nan from step ~105, H200)."""
    toy = mode.toy
    settings = {"seq_len": seq_len, "dim": 32 if toy else 512, "depth": 1 if toy else 4, "heads": 2 if toy else 8,
                "attention": '"local:1,routing:1"' if toy else '"local:4,routing:4"', "batch_size": 4 if toy else 8,
                "options.local.window": 16 if toy else 256, "options.routing.num_clusters": 4 if toy else 64,
                "options.routing.window": 8 if toy else 64, "precision": '"bfloat16"' if mode.cuda else '"float32"',
                "device": f'"{mode.device}"', "log_every": 1, "eval_every": 100000, "eval_tokens": 4096,
                "sample_tokens": 0, "warmup_steps": 10 if toy else 50, **({} if toy else {"lr": 2e-3})}
    return [word for key, value in settings.items() for word in ("--set", f"{key}={value}")]


# --- reading the numbers -------------------------------------------------------------------------------------------

def parse_versions(output: str, out: Path) -> dict:
    line = next(line for line in output.splitlines() if line.startswith("VERSIONS "))
    found = json.loads(line.removeprefix("VERSIONS "))
    found["cpu"] = cpu_model()
    return found


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} logical cores"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical cores"


TEST_LINE = re.compile(r"(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)|"
                       r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S+::\S+)")


def parse_tests(output: str, out: Path) -> dict:
    """Counts per outcome and the tests that failed, from pytest's verbose lines (with or without xdist; a run cut
    short by its time limit still has the lines of the tests that finished)."""
    outcome: dict[str, str] = {}
    for match in TEST_LINE.finditer(output):
        test = match.group(1) or match.group(4)
        outcome[test] = (match.group(2) or match.group(3)).lower()
    counts: dict[str, int] = {}
    for result in outcome.values():
        counts[result] = counts.get(result, 0) + 1
    summary = re.findall(r"=+ (.*(?:passed|failed|error|skipped|deselected).* in [\d.]+s.*) =+", output)
    return {"counts": counts, "failed": sorted(t for t, r in outcome.items() if r in ("failed", "error")),
            "summary": summary[-1] if summary else None}


def parse_junit(path: Path) -> dict:
    """Counts per outcome and the failed tests from pytest's junit XML (``-q`` prints no per-test lines)."""
    import xml.etree.ElementTree as ET
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failed = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            failed.append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {"counts": counts, "failed": failed}


def parse_profile(output: str, out: Path) -> dict:
    """Per profiled row: the five operators with the most device (CUDA) or CPU self time, and the host
    synchronisations per step (cudaStreamSynchronize and cudaDeviceSynchronize calls, the profile's own last one
    left out)."""
    found: dict = {}
    for line in output.splitlines():
        if line.startswith("PROFILE "):
            row = json.loads(line.removeprefix("PROFILE "))
            found[row.pop("row")] = row
    return found


def parse_flex_cost(output: str, out: Path) -> dict:
    """The experiment's FLEXCOST line: per mask, its partial and full key blocks per query block, ms forward and
    forward+backward; from a run cut before that line, the FLEXROW line it printed for each mask it measured."""
    lines = output.splitlines()
    line = next((x for x in reversed(lines) if x.startswith("FLEXCOST ")), None)
    if line is not None:
        return json.loads(line.removeprefix("FLEXCOST "))
    found = {}
    for x in lines:
        if x.startswith("FLEXROW "):
            row = json.loads(x.removeprefix("FLEXROW "))
            found[row.pop("mask")] = row
    if not found:
        raise ValueError("no FLEXCOST line and no FLEXROW line in the output")
    return found


# bench attention's line per row, on stderr as soon as the row is measured (its memory since issue 72; its note,
# if any, after the seconds)
MEASURED = re.compile(r"measured (.+?) at N=(\d+): fwd ([\d.]+|n/a), fwd\+bwd ([\d.]+|n/a) ms"
                      r"(?:, inference ([\d.]+|n/a) MiB, training ([\d.]+|n/a) MiB)?(?: \(\d+ s(?:, ([^\n]*))?\))?")


def parse_bench(path: Path, output: str = "") -> dict:
    """Per mechanism: ms forward, ms forward+backward, peak MiB (inference, training), and the note; with the
    ratios the goals name (docs/gpu.md) where both rows were measured. A run stopped before its JSON was written
    (its time limit), or whose JSON cannot be read, leaves the rows it measured in its ``measured ...`` lines:
    those are read then, each marked as read from the log."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return parse_measured(output, f"{path}: {type(e).__name__}")
    return _bench_rows(table)


def parse_measured(output: str, why: str = "no JSON") -> dict:
    """The rows of bench attention's ``measured ...`` lines in ``output`` (the last of a mechanism measured twice),
    with the ratios; ``why``: the reason the JSON was not read, for the message when no row was measured."""
    rows = {}
    n = None
    for m in MEASURED.finditer(output):
        n = int(m[2])
        rows[m[1]] = {"fwd_ms": _number(m[3]), "fwd_bwd_ms": _number(m[4]), "inference_mib": _number(m[5]),
                      "training_mib": _number(m[6]),
                      "note": "read from the log (no JSON)" + (f"; {m[7]}" if m[7] else "")}
    if not rows:
        raise FileNotFoundError(f"{why} (and no measured row in the output)")
    found: dict = {"n": n, "rows": rows}
    _ratios(found)
    return found


def _bench_rows(table: dict) -> dict:
    """parse_bench's numbers from the benchmark's JSON."""
    rows = {}
    for row in table["rows"]:
        rows[row["mechanism"]] = {
            "fwd_ms": None if row["fwd_s"] is None else round(row["fwd_s"] * 1e3, 3),
            "fwd_bwd_ms": None if row["fwd_bwd_s"] is None else round(row["fwd_bwd_s"] * 1e3, 3),
            "inference_mib": None if row["inference_bytes"] is None else round(row["inference_bytes"] / 2**20, 1),
            "training_mib": None if row["training_bytes"] is None else round(row["training_bytes"] / 2**20, 1),
            "note": row["note"] or None}
    found = {"n": table["rows"][0]["n"] if table["rows"] else None, "rows": rows}
    _ratios(found)
    return found


def _number(text: str | None) -> float | None:
    return None if text in (None, "n/a") else float(text)


def _ratios(found: dict) -> None:
    """The ratios of forward+backward times the goals name, where both rows were measured."""
    rows = found["rows"]
    for name, (a, b) in RATIOS.items():
        x, y = (rows.get(r, {}).get("fwd_bwd_ms") for r in (a, b))
        if x and y:
            found[name] = round(x / y, 2)


def parse_train(output: str, out: Path) -> dict:
    """From the run's metrics.jsonl (one row per step): steps, the first step's seconds (compilation included),
    tokens/s at steady state (median over the second half of the steps), the last training loss; from the output:
    the validation score and dynamo's recompilations (TORCH_LOGS=recompiles) and recompile-limit hits."""
    rows = [json.loads(line) for line in (out / "runs" / "train" / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    train = [r for r in rows if r.get("split") == "train"]
    found: dict = {"steps": train[-1]["step"] if train else 0,
                   "recompiles": output.count("Recompiling function"),
                   "recompile_limit_hits": output.count("torch._dynamo hit config.")}
    if train:
        found["first_step_s"] = round(train[0]["elapsed_s"], 2)
        steady = sorted(r["tokens_per_s"] for r in train[len(train) // 2:])
        found["steady_tokens_per_s"] = round(steady[len(steady) // 2])
        found["last_train_loss"] = round(train[-1]["loss"], 4)
    found.update(validation(output))
    return found


def parse_torchrun(output: str, out: Path) -> dict:
    found = {"nccl_lines": output.count("NCCL INFO")}
    stopped = re.search(r"stopped after (\d+) steps", output)
    if stopped:
        found["steps"] = int(stopped.group(1))
    found.update(validation(output))
    return found


def without(numbers: dict, prefix: str) -> dict:
    return {key: value for key, value in numbers.items() if not key.startswith(prefix)}


def validation(output: str) -> dict:
    match = re.search(r"validation ([\w ]+): ([\d.]+)", output)
    return {f"validation ({match.group(1)})": float(match.group(2))} if match else {}


# --- running -------------------------------------------------------------------------------------------------------

def run_step(step: Step, mode: Mode, deadline: float) -> None:
    """Run ``step`` in its own process group (so that a time limit ends its workers too), its output to
    OUT/logs/NAME.log; record status, seconds, numbers and the output's tail."""
    limit = min(step.limit_s, max(1.0, deadline - time.monotonic()))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **step.env,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    log = mode.out / "logs" / f"{step.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    for path in step.writes:  # an earlier run's file is never read as this one's
        path.unlink(missing_ok=True)
    start = time.monotonic()
    header = f"$ {' '.join(step.argv)}\n"  # the log's first line; the report shows the command apart
    with open(log, "w") as sink:
        sink.write(header)
        sink.flush()
        child = subprocess.Popen(step.argv, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            step.returncode = child.wait(timeout=limit)
            step.status = "pass" if step.returncode == 0 else "fail"
        except subprocess.TimeoutExpired:
            stop(child)
            step.status = "timeout"
        except KeyboardInterrupt:
            stop(child)
            step.status = "interrupted"
            raise
        finally:
            step.seconds = round(time.monotonic() - start, 1)
            output = log.read_text(errors="replace")[len(header):]
            step.tail = settled(output)[-TAIL_CHARS:]
            if step.status == "timeout":
                step.tail += f"\n[device check: stopped at its time limit of {limit:.0f} s]"
            if step.parse is not None:
                try:
                    step.numbers = step.parse(output, mode.out)
                except Exception as e:  # a step that failed early leaves nothing to read: say so, go on
                    step.numbers = {"unread": f"{type(e).__name__}: {e}"}


LINE_CHARS = 400  # of each line ``progress`` prints (the whole numbers are in the report)


def progress(step: Step) -> list[str]:
    """What the check prints on its stdout as ``step`` ends: its status, seconds and limit, then its numbers, a
    line per top-level entry (a line per row for a table of rows, such as the benchmark's), each as compact JSON
    and cut at LINE_CHARS, so that the last lines of the check's output say what was measured so far."""
    lines = [f"device check: {step.name}: {step.status} in {step.seconds} s (limit {step.limit_s:.0f} s)"]
    for key, value in step.numbers.items():
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            lines += [f"  {key} | {row}: {json.dumps(v, separators=(', ', ': '))}" for row, v in value.items()]
        else:
            lines.append(f"  {key}: {json.dumps(value, separators=(', ', ': '))}")
    return [line if len(line) <= LINE_CHARS else line[:LINE_CHARS - 3] + "..." for line in lines]


def settled(output: str) -> str:
    """``output`` as a terminal would leave it: of the lines a progress bar redraws (carriage returns), the last."""
    lines = []
    for line in output.split("\n"):
        drawn = [part for part in line.split("\r") if part.strip()]
        lines.append(drawn[-1] if drawn else "")
    return "\n".join(lines)


def stop(child: subprocess.Popen) -> None:
    """End ``child``'s process group: SIGTERM, then SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        try:
            child.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# --- the report ------------------------------------------------------------------------------------------------------

def report(mode: Mode, steps: list[Step], started: str, elapsed: float) -> dict:
    versions = next((s.numbers for s in steps if s.name == "versions"), {})
    return {"started": started, "seconds": round(elapsed, 1), "device": mode.device, "toy": mode.toy,
            "versions": versions, "steps": [s.record() for s in steps]}


def markdown(table: dict) -> str:
    """The report as markdown: the versions, a summary row per step, then each step's numbers and output tail."""
    lines = [f"# routeformer device check ({table['device']}{', toy sizes' if table['toy'] else ''})", "",
             f"Started {table['started']}, {table['seconds']} s so far. Written by scripts/device_check.py; "
             "docs/gpu.md says what the numbers mean.", "", "## Versions", ""]
    env = next((s for s in table["steps"] if s["name"] == "env"), None)
    lines += [f"- {key}: {value}" for key, value in table["versions"].items()]
    if env and env["tail"]:
        lines += ["", "`routeformer env --no-build`:", "", "```", env["tail"].strip(), "```"]
    lines += ["", "## Steps", "", "| step | status | seconds | what |", "|---|---|---:|---|"]
    lines += [f"| {s['name']} | {s['status']} | {'' if s['seconds'] is None else s['seconds']} | {s['what']} |"
              for s in table["steps"]]
    for s in table["steps"]:
        if s["name"] in ("versions", "env") or s["status"] == "not run":
            continue
        lines += ["", f"### {s['name']}: {s['status']}", "", f"`{s['command']}` (limit {s['limit_s']:.0f} s, exit "
                  f"{s['returncode']})", ""]
        if s["numbers"]:
            lines += ["```json", json.dumps(s["numbers"], indent=1), "```", ""]
        lines += ["Output (tail):", "", "```", s["tail"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def write(out: Path, table: dict) -> None:
    """report.json and report.md, each replaced whole (an interruption leaves the previous version)."""
    for name, text in (("report.json", json.dumps(table, indent=1) + "\n"), ("report.md", markdown(table))):
        partial = out / f".{name}.partial"
        partial.write_text(text)
        partial.replace(out / name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder for report.md, report.json, the logs and the runs")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="default cuda")
    parser.add_argument("--toy", action="store_true", help="toy sizes (with --device cpu: CI, a few minutes)")
    parser.add_argument("--part", choices=["all", *PARTS], default="all",
                        help="check: versions, tests, training, torchrun; bench: versions, the attention benchmark "
                             "at 16k and 64k; cpu: the README's test suite on the host; routing: routing's kernels "
                             "tested, the benchmark at 64k and 256k, the profile at 64k, the device tests, the flex "
                             "forward's cost; all (default): check, "
                             "bench and cpu")
    parser.add_argument("--budget-s", type=float, default=None, metavar="S",
                        help="stop after S seconds in all: a step is cut at the budget and the later ones are not "
                             "run (a GPU loan shorter than the part's limits; default: the sum of the limits)")
    args = parser.parse_args(argv)
    if args.device == "cpu" and not args.toy:
        parser.error("--device cpu runs the toy sizes only (add --toy): the full sizes are GPU sizes")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: this PyTorch sees no CUDA device (run --toy --device cpu instead)")
    mode = Mode(args.device, args.toy, args.out.resolve())
    mode.out.mkdir(parents=True, exist_ok=True)
    steps = plan(mode, args.part)
    started, start = time.strftime("%Y-%m-%d %H:%M:%S"), time.monotonic()
    deadline = start + min(sum(s.limit_s for s in steps), args.budget_s or float("inf"))
    try:
        for step in steps:
            if deadline - time.monotonic() < 5:  # no time left for it: recorded as "not run"
                continue
            print(f"device check: {step.name} ({step.what}) ...", file=sys.stderr, flush=True)
            run_step(step, mode, deadline)
            write(mode.out, report(mode, steps, started, time.monotonic() - start))
            print("\n".join(progress(step)), flush=True)
    except KeyboardInterrupt:
        write(mode.out, report(mode, steps, started, time.monotonic() - start))
        print(f"device check: interrupted; the report so far is in {mode.out}", file=sys.stderr)
        return 130
    failed = [s.name for s in steps if s.status != "pass"]
    print(f"device check: {len(steps) - len(failed)}/{len(steps)} steps passed"
          + (f"; not passed: {', '.join(failed)}" if failed else "") + f"; report: {mode.out / 'report.md'}",
          file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
