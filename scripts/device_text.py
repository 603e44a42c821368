"""The text question on a GPU (issues 41 and 57): does routing pay on long text, against a control with the same
keys?

    python scripts/device_text.py OUT [--data DIR] [--device cuda|cpu] [--toy] [--budget tokens|time]
                                      [--steps S] [--minutes M] [--seeds S …] [--total M] [--resume REPORT]
                                      [--work DIR] [--set KEY=VALUE …]

`routeformer bench text` rows at 8192 bytes, in bf16 (autocast), the shipped default model (dim 128, depth 4, 4
heads, relative positions, local window 128) and optimiser; five attentions, half of the heads local in each
mixed row:

- ``local``: every head local (window 128);
- ``control``: the matched-keys control, half the heads local and half local with routing's keys per query
  (Longformer heads of window N // k = 90, no dilation, no global token): as many keys as the routing heads, no
  content selection;
- ``local+routing``: the paper's rule (one probe, no balancing, k = round(sqrt(N)) = 91 clusters, 90 keys);
- ``local+moba``: MoBA with Quest's bound, 3 blocks of 30 (routing's 90 keys, plus its own block's), a dense
  warm-up of ``MOBA_WARMUP`` steps on sequences of N / 4;
- ``full``: full attention (SDPA).

``--budget tokens`` (the default): every row the same ``--steps`` (same batch: the same tokens), the cosine over
them, each row capped at ``--minutes`` (a row the cap cuts is marked: not at equal tokens). ``--budget time``:
every row ``--minutes`` of training, the cosine laid over that time (``decay_steps = 0``). Rows run seed by seed
(``--seeds``, default 0 1: every attention of seed 0, then of seed 1), and a row that would end past ``--total``
minutes (default 8.5) from the start is skipped and reported as such, so the whole stays inside one device call.
``--resume REPORT``: the rows a previous report (its report.json, e.g. committed after an earlier GPU session)
holds as done, with the same settings, are kept as they are and not run again; a report of other settings is
refused, naming them. The summary gives each row's mean over the seeds done, its difference from ``local`` and
from ``control`` with the seed spread beside it, and the verdict: routing below the control by more than the
spread. Then, unless ``--no-analyze``, where the gain comes from: for each seed whose routing row and control
trained in this call, ``routeformer analyze RUN routing --baseline CONTROL`` into OUT/analysis-seedS (the keys the
routing heads use beyond the local window, by distance; both models' per-token loss by the distance to the
previous occurrence of the context: a table, a CSV and a figure).

Data: ``--data DIR``, a prepared data set's folder (``routeformer prepare pg19 --from BOOKS`` makes
``~/.cache/routeformer/pg19``); else ``sympy``, the installed SymPy's long source files (a dependency of torch, so
on every machine with torch; held-out documents for validation), prepared into the work folder first. ``OUT``
gets report.md and report.json, written before the first row and again after every row (atomically), so an
interrupted run loses at most the row in progress; the data and the run directories go to ``--work`` (default: a
new temporary folder), not to ``OUT``.

``--toy`` runs the same rows at toy sizes (256 bytes, a 32-wide model, 12 steps a row, the committed SymPy fixture
as the corpus) in a few minutes on the CPU (float32 there unless ``--dtype`` says otherwise: bfloat16 autocast is
several times slower on a CPU): .ci/run runs ``--toy --device cpu`` so that the script cannot rot. The device
check (scripts/device_check.py) comes first: this script is for a GPU on which it passes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # the routeformer beside this script, whether or not it is installed

STEPS = 1_000_000  # bench text's --steps under --budget time: far more than a row reaches, so time ends every row
MOBA_TOP, MOBA_WARMUP = 3, 100  # MoBA's blocks per query, and its dense warm-up's steps (at seq_len / 4)
SIZES = {  # seq_len, the steps of a row (budget tokens), the minutes of a row (its cap, or its budget), the whole
    # run's minutes, --set items
    "gpu": {"seq_len": 8192, "steps": 1200, "minutes": 2.0, "total": 8.5, "sets": []},
    "toy": {"seq_len": 256, "steps": 12, "minutes": 0.5, "total": 10.0,
            "sets": ["dim=32", "depth=2", "batch_size=2", "eval_tokens=512", "log_every=1"]},
}
LABELS = ("local", "control", "local+routing", "local+moba", "full")
clock = time.monotonic  # the run's clock (a test's stand-in advances it)
FIRST_OVERHEAD_S = 45.0  # a row's seconds beyond its training minutes (set-up, final evaluation) before one is seen
ANALYSIS_MINUTES = 1.0  # what one seed's analysis may take (planned; measured on a GPU: not yet)
# The settings a resumed report must share with this run for its rows to stand beside this run's.
RESUMED_SETTINGS = ("seq_len", "budget", "steps_per_row", "minutes_per_row", "dtype", "num_clusters",
                    "routing_window", "sets", "specs")


class ScriptError(ValueError):
    """What the user gave cannot run: one line on stderr, exit status 2."""


@dataclass
class Plan:
    """What every row shares: sizes, budget, data, device, and where things go."""

    out: Path
    work: Path
    device: str
    dtype: str
    seq_len: int
    minutes: float
    total: float
    budget: str = "tokens"  # tokens: every row ``steps`` steps (``minutes`` its cap); time: ``minutes`` each
    steps: int = STEPS
    data_name: str = ""
    data_dir: Path | None = None
    sets: list[str] = field(default_factory=list)

    @property
    def num_clusters(self) -> int:
        return max(1, round(self.seq_len ** 0.5))

    @property
    def routing_window(self) -> int:
        return max(1, self.seq_len // self.num_clusters)  # one probe: N / k keys per query

    @property
    def moba_block(self) -> int:
        return max(1, round(self.routing_window / MOBA_TOP))  # MOBA_TOP blocks: routing's keys per query

    def specs(self) -> dict[str, str]:
        """Each row's bench text attention (the rules spelled out, not taken from whatever default.toml says)."""
        return {"local": "local",
                "control": f"local+longformer@options.longformer.window={self.routing_window}",
                "local+routing": "local+routing@options.routing.probes=1@options.routing.balance=0.0",
                "local+moba": (f"local+moba@options.moba.block={self.moba_block}@options.moba.top_k={MOBA_TOP}"
                               f'@options.moba.score="bound"@options.moba.warmup={MOBA_WARMUP}'
                               f"@options.moba.warmup_len={max(1, self.seq_len // 4)}"),
                "full": "full"}

    def overrides(self, seed: int) -> list[str]:
        """The --set items of a row of seed ``seed``."""
        decay = ["decay_steps=0"] if self.budget == "time" else []  # tokens: bench text decays over the steps
        return [*self.sets, f"seed={seed}", f"device={self.device}", f"precision={self.dtype}", *decay,
                "sample_tokens=0"]


@dataclass
class Row:
    label: str
    spec: str
    seed: int
    status: str = "planned"  # planned | running | done | failed | skipped | interrupted
    steps: int | None = None
    train_minutes: float | None = None
    wall_s: float | None = None
    tokens_per_s: float | None = None
    first_log_s: float | None = None  # elapsed seconds at the first logged step: the compilation shows here
    peak_gib: float | None = None
    valid: float | None = None
    unit: str | None = None
    heads: str | None = None
    note: str = ""
    run_dir: str | None = None  # where it trained (in the work folder: not carried by --resume)


@dataclass
class Analysis:
    """``routeformer analyze RUN routing --baseline CONTROL`` of one seed's routing row against its control."""

    seed: int
    status: str = "planned"  # done | failed | skipped
    out: str = ""
    seconds: float | None = None
    note: str = ""


def plan_rows(seeds: list[int], specs: dict[str, str]) -> list[Row]:
    """Every attention of the first seed, then of the next: an interrupted or time-cut run still compares the
    attentions on one seed."""
    return [Row(label, specs[label], seed) for seed in seeds for label in LABELS]


def fits(elapsed_s: float, minutes: float, overhead_s: float, total: float) -> bool:
    """Whether a row of ``minutes`` training plus ``overhead_s`` started ``elapsed_s`` into the run ends inside
    ``total`` minutes."""
    return elapsed_s + minutes * 60 + overhead_s <= total * 60


def resumed(path: Path, rows: list[Row], settings_: dict) -> int:
    """Marks the rows that the report at ``path`` holds as done, with its numbers and a note; ScriptError when its
    settings differ from ``settings_`` in one of ``RESUMED_SETTINGS`` (named). Returns how many were taken."""
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ScriptError(f"--resume {path}: not a report.json ({err})") from None
    theirs = earlier.get("settings", {})
    differ = [f"{key} {theirs.get(key)!r} there, {settings_.get(key)!r} here" for key in RESUMED_SETTINGS
              if theirs.get(key) != settings_.get(key)]
    if differ:
        raise ScriptError(f"--resume {path}: its rows ran with other settings: {'; '.join(differ)}")
    done = {(r["label"], r["seed"]): r for r in earlier.get("rows", []) if r.get("status") == "done"}
    taken = 0
    for row in rows:
        kept = done.get((row.label, row.seed))
        if kept is not None:
            for name, value in kept.items():
                if hasattr(row, name) and name != "run_dir":  # its run directory stayed on the other machine
                    setattr(row, name, value)
            row.note = (row.note + "; " if row.note else "") + f"from {path.name} ({earlier['machine'].get('commit')})"
            taken += 1
    return taken


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        plan = make_plan(args)
    except ScriptError as err:
        print(f"device_text: error: {err}", file=sys.stderr)
        return 2
    from routeformer.train.signals import Interrupted

    # SIGTERM (a time limit's kill) ends the run as Ctrl-C does: inside training at a step boundary (the trainer's
    # own handler, then Interrupted), elsewhere at once (KeyboardInterrupt); either way the report is written
    signal.signal(signal.SIGTERM, _stop)
    rows = plan_rows(args.seeds, plan.specs())
    report = {"title": title(plan), "machine": machine(plan.device), "settings": settings(plan, argv),
              "rows": rows}
    if args.resume:
        try:
            taken = resumed(Path(args.resume).expanduser(), rows, report["settings"])
        except ScriptError as err:
            print(f"device_text: error: {err}", file=sys.stderr)
            return 2
        print(f"device_text: {taken} row(s) from {args.resume}", file=sys.stderr)
    write_report(plan.out, report)
    start, overheads = clock(), []  # each finished row's seconds beyond its training minutes
    for row in rows:
        if row.status == "done":  # resumed
            continue
        elapsed = clock() - start
        overhead = max(overheads) if overheads else FIRST_OVERHEAD_S
        if not fits(elapsed, plan.minutes, overhead, plan.total):
            row.status = "skipped"
            row.note = (f"would end past --total {plan.total:g} min ({elapsed / 60:.1f} min used, "
                        f"{plan.minutes:g} + {overhead / 60:.1f} min a row)")
            write_report(plan.out, report)
            continue
        row.status = "running"
        write_report(plan.out, report)
        began = clock()
        try:
            run_row(row, plan)
            row.status = "done"
        except (KeyboardInterrupt, Interrupted):  # Ctrl-C, SIGTERM: the finished rows are in the report
            row.status, row.note = "interrupted", "interrupted (Ctrl-C or SIGTERM)"
            row.wall_s = clock() - began
            write_report(plan.out, report)
            print(f"device_text: interrupted; the report of the rows before is in {plan.out}", file=sys.stderr)
            return 130
        except Exception as err:  # a row that fails (out of memory, a compile error) must not lose the others
            traceback.print_exc()
            row.status, row.note = "failed", f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            _free_device(plan.device)
        row.wall_s = clock() - began
        if row.status == "done":
            overheads.append(max(0.0, row.wall_s - plan.minutes * 60))
        write_report(plan.out, report)
    if args.analyze:
        report["analyses"] = analyse(rows, plan, start, lambda: write_report(plan.out, report))
    print(render_markdown(report))
    failed = any(r.status == "failed" for r in rows) or any(a.status == "failed" for a in report.get("analyses", []))
    return 1 if failed else 0  # the report says which and why


def analyse(rows: list[Row], plan: Plan, start: float, written: Callable[[], None]) -> list[Analysis]:
    """Where routing's gain comes from (issue 57, item 2): for every seed whose routing row and control both
    trained in this call, ``routeformer analyze`` of the routing run against the control (the keys the routing
    heads use beyond the local window, by distance; the per-token loss of both by the distance to the previous
    occurrence of the context: a table, a CSV and a figure) into OUT/analysis-seedS, when it fits ``--total``."""
    from routeformer.cli import main as routeformer

    found = {(r.label, r.seed): r for r in rows if r.status == "done" and r.run_dir and Path(r.run_dir).is_dir()}
    analyses = []
    for seed in sorted({r.seed for r in rows}):
        routed, control = found.get(("local+routing", seed)), found.get(("control", seed))
        if routed is None or control is None:
            continue
        job = Analysis(seed, out=str(plan.out / f"analysis-seed{seed}"))
        analyses.append(job)
        if not fits(clock() - start, ANALYSIS_MINUTES, 0, plan.total):
            job.status, job.note = "skipped", f"would end past --total {plan.total:g} min"
            continue
        began = clock()
        argv = ["analyze", routed.run_dir, "routing", "--baseline", control.run_dir, "--out", job.out, "--device",
                plan.device, "--windows", "2" if plan.seq_len <= 1024 else "16", "--data-dir", str(plan.data_dir)]
        try:
            code = routeformer(argv)
            job.status = "done" if code == 0 else "failed"
            job.note = "" if code == 0 else f"exit {code}"
        except Exception as err:  # an analysis that fails must not lose the rows' report
            traceback.print_exc()
            job.status, job.note = "failed", f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        job.seconds = clock() - began
        written()
    return analyses


def _stop(signum, frame) -> None:
    raise KeyboardInterrupt


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", metavar="OUT", help="folder for report.md and report.json")
    parser.add_argument("--data", metavar="DIR", help="a prepared data set's folder (e.g. ~/.cache/routeformer/pg19; "
                        "default: sympy, prepared into the work folder)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the rows train (default cuda)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        help="the rows' autocast precision (default: bfloat16 on cuda; float32 on cpu, where "
                        "bfloat16 autocast is several times slower)")
    parser.add_argument("--toy", action="store_true", help="toy sizes (256 bytes, a 32-wide model, 12 steps a row, "
                        "the committed SymPy fixture): the whole in a few minutes on the CPU")
    parser.add_argument("--budget", choices=("tokens", "time"), default="tokens",
                        help="tokens (default): every row --steps steps, at most --minutes; time: every row --minutes")
    parser.add_argument("--steps", type=int, help="steps a row under --budget tokens (default 1200; --toy 12)")
    parser.add_argument("--minutes", type=float, help="training minutes a row: its cap under --budget tokens, its "
                        "budget under time (default 2; --toy 0.5)")
    parser.add_argument("--total", type=float, help="skip the rows that would end later than this many minutes "
                        "from the start (default 8.5; --toy 10)")
    parser.add_argument("--resume", metavar="REPORT", help="a previous run's report.json: its done rows (same "
                        "settings) are kept, not run again")
    parser.add_argument("--no-analyze", dest="analyze", action="store_false",
                        help="skip the analysis of each seed's routing run against its control (OUT/analysis-seedS)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], metavar="SEED",
                        help="seeds, run one after the other (default 0 1)")
    parser.add_argument("--work", metavar="DIR", help="where the data and the run directories go (default: a new "
                        "temporary folder)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a [model] or [train] field for every row, as bench text's --set")
    return parser.parse_args(argv)


def make_plan(args: argparse.Namespace) -> Plan:
    """The rows' shared settings, the data prepared or checked; ScriptError when they cannot run."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ScriptError("--device cuda: torch sees no CUDA device here; use --device cpu (with --toy for toy sizes)")
    size = SIZES["toy" if args.toy else "gpu"]
    minutes = args.minutes if args.minutes is not None else size["minutes"]
    total = args.total if args.total is not None else size["total"]
    steps = args.steps if args.steps is not None else size["steps"]
    if not (minutes > 0 and total > 0 and steps > 0):
        raise ScriptError(f"--minutes, --total and --steps must be positive, got {minutes}, {total} and {steps}")
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work).expanduser() if args.work else Path(tempfile.mkdtemp(prefix="device-text-"))
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    plan = Plan(out, work, args.device, dtype, size["seq_len"], minutes, total, budget=args.budget,
                steps=steps if args.budget == "tokens" else STEPS, sets=[*size["sets"], *args.sets])
    plan.data_name, plan.data_dir = data(args, work)
    return plan


def data(args: argparse.Namespace, work: Path) -> tuple[str, Path]:
    """(data set name, data folder): the prepared set --data names, checked, or sympy prepared in ``work``."""
    from routeformer.data import DataError, Dataset, prepare

    if args.data is not None:
        where = Path(args.data).expanduser().resolve()
        try:
            Dataset.open(where.name, where.parent, verify=False)
        except DataError as err:
            raise ScriptError(f"--data {args.data}: not a prepared data set ({err})") from None
        return where.name, where.parent
    source = str(ROOT / "tests" / "fixtures" / "sympy") if args.toy else None  # toy: 48 KB, not 20 MB
    prepare("sympy", work / "data", source)
    return "sympy", work / "data"


def run_row(row: Row, plan: Plan) -> None:
    """Train and score ``row`` with bench text; fill in its numbers."""
    import torch

    from routeformer.bench import text
    from routeformer.bench.measure import Echo

    out = plan.work / "runs" / f"seed{row.seed}" / row.label.replace("+", "-")
    cuda = plan.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    def note(line: str) -> None:  # the executor's line, as the command line prints it: on stderr
        print(line, file=sys.stderr, flush=True)

    bench = text.TextBench(seq_len=plan.seq_len, minutes=plan.minutes, steps=plan.steps, num_clusters=plan.num_clusters,
                           routing_window=plan.routing_window, data=plan.data_name, data_dir=str(plan.data_dir),
                           out=str(out), overrides=tuple(plan.overrides(row.seed)))
    result = text.run([row.spec], bench, Echo(print, note))[0]
    row.steps, row.train_minutes, row.valid, row.unit, row.heads = (result["steps"], result["minutes"],
                                                                    result["valid"], result["unit"], result["heads"])
    trained = [d for d in out.iterdir() if (d / "metrics.jsonl").is_file()]
    row.run_dir = str(trained[0]) if len(trained) == 1 else None
    if plan.budget == "tokens" and row.steps < plan.steps:
        row.note = f"cut by the {plan.minutes:g}-minute cap at {row.steps} of {plan.steps} steps: not at equal tokens"
    if cuda:
        row.peak_gib = torch.cuda.max_memory_allocated() / 2**30
    logged = [json.loads(line) for run_dir in out.iterdir() if (run_dir / "metrics.jsonl").is_file()
              for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in logged if r.get("split") == "train" and "tokens_per_s" in r]
    if speeds:
        row.first_log_s = next(r["elapsed_s"] for r in logged if r.get("split") == "train")
        row.tokens_per_s = statistics.median(speeds[1:] or speeds)  # the first holds the compilation


def _free_device(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def title(plan: Plan) -> str:
    budget = (f"{plan.steps:,} steps a row (at most {plan.minutes:g} minutes)" if plan.budget == "tokens"
              else f"{plan.minutes:g} training minutes a row")
    return (f"bench text at {plan.seq_len} bytes on {plan.data_name}: local, the matched-keys control, local + "
            f"routing (the paper's rule), local + MoBA (bound) and full attention, {budget}, {plan.dtype}")


def machine(device: str) -> dict:
    import torch

    import routeformer

    info = {"routeformer": routeformer.__version__, "commit": _commit(), "python": platform.python_version(),
            "torch": torch.__version__, "device": device, "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, cuda=torch.version.cuda, capability=f"{props.major}.{props.minor}",
                    gpu_memory_gib=round(props.total_memory / 2**30, 1))
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def _commit() -> str | None:
    """The checkout's commit, when it is a git checkout (a copy of the tree may not be)."""
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def settings(plan: Plan, argv: list[str] | None) -> dict:
    from routeformer.data import Dataset

    meta = Dataset.open(plan.data_name, plan.data_dir, verify=False).meta
    return {"command": " ".join(["python", "scripts/device_text.py", *(sys.argv[1:] if argv is None else argv)]),
            "seq_len": plan.seq_len, "budget": plan.budget,
            "steps_per_row": plan.steps if plan.budget == "tokens" else None, "minutes_per_row": plan.minutes,
            "total_minutes": plan.total, "dtype": plan.dtype, "num_clusters": plan.num_clusters,
            "routing_window": plan.routing_window, "probes": 1, "sets": plan.sets, "specs": plan.specs(),
            "data": {"name": plan.data_name, "source": meta.source, "splits": meta.splits},
            "work": str(plan.work)}


def summary(rows: list[Row]) -> list[str]:
    """Each row's mean over the seeds done, beside local and the control: the difference of the means and the seed
    spread (the larger of the two rows' ranges over the seeds both have); then the verdict on the question: routing
    below the matched-keys control by more than the spread, on two seeds or more."""
    done: dict[str, dict[int, float]] = {}
    for r in rows:
        if r.status == "done" and r.valid is not None and math.isfinite(r.valid):
            done.setdefault(r.label, {})[r.seed] = r.valid
    lines = []
    for label in LABELS:
        if label not in done:
            continue
        values = done[label]
        parts = [f"{label}: {statistics.mean(values.values()):.3f} bits per byte (seeds {sorted(values)})"]
        for base in ("local", "control"):
            if base != label and base in done:
                compared = _compared(done, label, base)
                if compared is not None:
                    diff, spread, seeds = compared
                    parts.append(f"− {base} {diff:+.3f} (spread {spread:.3f}, seeds {seeds})")
        lines.append(", ".join(parts))
    compared = _compared(done, "local+routing", "control") if "local+routing" in done and "control" in done else None
    if compared is None or len(compared[2]) < 2:
        seeds = 0 if compared is None else len(compared[2])
        lines.append(f"goal (local + routing below the matched-keys control by more than the seed spread): not "
                     f"judged, {seeds} seed(s) with both rows; it needs two")
        return lines
    diff, spread, seeds = compared
    verdict = "met" if -diff > spread else "not met"
    lines.append(f"goal (local + routing below the matched-keys control by more than the seed spread): {verdict}: "
                 f"local + routing − control {diff:+.3f} bits per byte (mean over seeds {seeds}), seed spread "
                 f"{spread:.3f}")
    return lines


def _compared(done: dict[str, dict[int, float]], label: str, base: str) -> tuple[float, float, list[int]] | None:
    """(mean of label − mean of base, the larger range over those seeds, the seeds) over the seeds both have."""
    seeds = sorted(set(done[label]) & set(done[base]))
    if not seeds:
        return None
    a, b = [done[label][s] for s in seeds], [done[base][s] for s in seeds]
    return statistics.mean(a) - statistics.mean(b), max(max(a) - min(a), max(b) - min(b)), seeds


def render_markdown(report: dict) -> str:
    machine_ = report["machine"]
    where = (f"{machine_['gpu']} (CUDA {machine_['cuda']}, capability {machine_['capability']})"
             if machine_["device"] == "cuda" else f"CPU {machine_['cpu']}, {machine_['threads']} threads")
    s = report["settings"]
    lines = [f"# {report['title']}", "",
             f"{machine_['date']}; {where}; torch {machine_['torch']}, Python {machine_['python']}, routeformer "
             f"{machine_['routeformer']} ({machine_['commit'] or 'commit unknown'}).",
             f"Data: `{s['data']['name']}`, {s['data']['source']}; splits {s['data']['splits']} bytes. Routing: "
             f"k = {s['num_clusters']}, {s['routing_window']} keys per cluster, 1 probe, no balancing; the control "
             f"and MoBA at the same keys. Each row: "
             + (f"{s['steps_per_row']:,} steps, the cosine over them, at most {s['minutes_per_row']:g} minutes"
                if s["budget"] == "tokens" else
                f"{s['minutes_per_row']:g} minutes of training (compilation included), the cosine over that time")
             + f", then the whole validation split; rows past {s['total_minutes']:g} minutes are skipped. "
             f"Extra settings: {s['sets'] or 'none'}.", "",
             f"`{s['command']}`", "",
             "| row | seed | status | steps | train min | row s | tokens/s | first log s | peak GiB | valid | note |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in report["rows"]:
        lines.append(f"| {r.label} | {r.seed} | {r.status} | {_cell(r.steps, ',')} | {_cell(r.train_minutes, '.2f')} "
                     f"| {_cell(r.wall_s, '.0f')} | {_cell(r.tokens_per_s, ',.0f')} | {_cell(r.first_log_s, '.1f')} "
                     f"| {_cell(r.peak_gib, '.2f')} | {_cell(r.valid, '.3f')} | {r.note.replace('|', '/')} |")
    lines += ["", "## Summary", ""] + [f"- {line}" for line in summary(report["rows"])]
    analyses = report.get("analyses", [])
    if analyses:
        lines += ["", "## Where the gain comes from", "",
                  "`routeformer analyze RUN routing --baseline CONTROL` of each seed's routing run against its "
                  "control:",
                  ""] + [f"- seed {a.seed}: {a.status}" + (f", {a.seconds:.0f} s" if a.seconds is not None else "")
                         + f": `{a.out}`" + (f" ({a.note})" if a.note else "") for a in analyses]
    return "\n".join(lines) + "\n"


def _cell(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def write_report(out: Path, report: dict) -> None:
    """report.json and report.md, each replaced whole (a temporary file renamed): an interruption leaves the last
    complete version."""
    data = {**report, "rows": [asdict(r) for r in report["rows"]], "summary": summary(report["rows"]),
            "analyses": [asdict(a) for a in report.get("analyses", [])]}
    for name, body in (("report.json", json.dumps(data, indent=2) + "\n"), ("report.md", render_markdown(report))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(body)
        os.replace(tmp, out / name)


if __name__ == "__main__":
    sys.exit(main())
