"""Every shell command in the fenced blocks of the README and of the docs/ pages runs, at toy sizes: its options
are the real ones, its configuration names exist, its settings are accepted. Commands that train get a tiny data
set and a tiny model (appended options override the README's: argparse keeps the last value), in the README's
order inside one folder (so a command may use the run directory an earlier one made). Commands for GPUs are parsed,
and run only where CUDA is; the setup lines run their `routeformer` part (the test command is what is running)."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

import pytest
import torch

from helpers import tiny_text_data, write_mo
from routeformer.cli import build_parser, main
from routeformer.data import prepare
from routeformer.train.config import resolve_config_path

README = Path(__file__).resolve().parents[1] / "README.md"
ROOT = README.parent
FIXTURE_PG19 = ROOT / "tests" / "fixtures" / "pg19"

TOY_MODEL = ["--set", "dim=32", "--set", "depth=1", "--set", "batch_size=2", "--set", "grad_accum=1",
             "--set", "eval_tokens=64", "--set", "eval_every=2", "--set", "sample_tokens=4"]
TOY_TRAIN = ["--max-steps", "2", "--max-minutes", "2", "--set", "seq_len=64", "--set", "options.local.window=16",
             "--set", "options.longformer.window=16", "--set", "options.routing.num_clusters=4",
             "--set", "options.routing.window=8", *TOY_MODEL]
TOY_RECALL = ["--steps", "2", "--seeds", "0", "--eval", "8", "--batch", "4", "--dim", "32"]
TOY_TEXT = ["--steps", "2", "--minutes", "1", *TOY_MODEL]
TOY_TRANSLATE = ["--max-steps", "2", "--max-minutes", "2", "--set", "model.dim=16", "--set", "encoder.depth=1",
                 "--set", "decoder.depth=1", "--set", "batch_size=2", "--set", "eval_every=2", "--set",
                 "eval_tokens=64", "--set", "device=cpu"]


def readme_commands(text: str) -> list[str]:
    """Command lines of the fenced blocks (continuations joined, `for x in a b; do ...; done` kept whole), without
    the usage summaries (`[--option ...]`, `a|b` alternatives)."""
    commands, inside, pending, continued = [], False, "", False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
            continue
        if not inside:
            continue
        stripped = line.strip()
        if not pending and not re.match(r"(\.venv/bin/)?(routeformer|python3?|torchrun|for) ", stripped):
            continue
        # a new line of a loop's body is a new command, unless the line before it continued
        joined_by = "; " if pending.startswith("for ") and not continued and not pending.endswith("do") else " "
        pending = f"{pending}{joined_by}{stripped}" if pending else stripped
        continued = pending.endswith("\\")
        if continued:
            pending = pending[:-1].strip()
            continue
        if pending.startswith("for ") and not pending.endswith("done"):
            continue
        if not re.search(r"\[--|\w\|\w.*\[\.\.\.\]", pending):
            commands.append(pending)
        pending = ""
    return commands


DOCS = sorted((ROOT / "docs").glob("*.md"))
# the README's commands, then the docs pages' (which may use the run directories the README's commands made)
COMMANDS = readme_commands(README.read_text()) + [c for page in DOCS for c in readme_commands(page.read_text())]


def _expand(command: str) -> list[list[str]]:
    """One command line -> the routeformer argv lists it runs ('' for the test command itself)."""
    loop = re.fullmatch(r"for (\w+) in ([^;]+); do (.*?)(?:;)? *done", command)
    if loop:  # the first value is enough at toy sizes
        name, values, body = loop.groups()
        first = values.split()[0]
        return [argv for part in body.split(";") if part.strip()
                for argv in _expand(part.strip().replace(f"${name}", first))]
    argvs = []
    for part in command.split("&&"):
        words = shlex.split(part.split("#")[0])
        if not words:
            continue
        if words[0] in ("routeformer", ".venv/bin/routeformer"):
            argvs.append(words[1:])
        elif words[:2] == ["python", "experiments/routing_variants.py"]:
            argvs.append(["experiments/routing_variants.py", *words[2:]])
        elif words[0] == "torchrun":  # the processes need GPUs; one process runs the same command
            argvs.append(words[words.index("routeformer") + 1:])
    return argvs


def test_the_readme_has_commands_to_run() -> None:
    argvs = [argv for command in COMMANDS for argv in _expand(command)]
    assert ["train"] in argvs  # the main job
    assert any(a[:2] == ["bench", "recall"] for a in argvs) and any(a[:2] == ["bench", "text"] for a in argvs)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("readme")
    line = "def attend(query, keys, values): return softmax(query @ keys.T) @ values  # {}\n"
    tiny_text_data(root, "".join(line.format(i) for i in range(2000)))  # ~150 KB: splits longer than 2048
    return root


@pytest.mark.parametrize("index", range(len(COMMANDS)))
def test_readme_command_runs_at_toy_size(index: int, folder: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(folder)  # run directories (runs/...) land here, and later commands find them
    _run_command(index, folder, monkeypatch)
    capsys.readouterr()


def _made_by(run_dir: str, before: int) -> int | None:
    """The index of the last command before ``before`` that trains into ``run_dir`` (its ``--out``)."""
    for i in reversed(range(before)):
        for argv in _expand(COMMANDS[i]):
            if "--out" in argv and argv[argv.index("--out") + 1] == run_dir and argv[0] == "train":
                return i
    return None


def _run_command(index: int, folder: Path, monkeypatch) -> None:
    """Runs command ``index`` at toy size; a run directory it reads that an earlier command makes is made first
    when this worker has not (pytest-xdist spreads the commands over workers, each with its own folder)."""
    data = ["--data", "tiny", "--data-dir", str(folder / "data")]
    for argv in _expand(COMMANDS[index]):
        if argv[0] in ("analyze", "evaluate", "sample"):
            for run_dir in [argv[1]] + ([argv[argv.index("--baseline") + 1]] if "--baseline" in argv else []):
                maker = _made_by(run_dir, index)
                if not (folder / run_dir).exists() and maker is not None:
                    _run_command(maker, folder, monkeypatch)
        if argv[0] == "experiments/routing_variants.py":
            _run_experiment(argv, monkeypatch)
            continue
        try:
            build_parser().parse_args(argv)  # every option real, every value of the right type
        except SystemExit as stop:  # --version, --help: they print and exit 0
            assert stop.code == 0, f"routeformer {' '.join(argv)}: exit {stop.code}"
            continue
        if "cuda" in argv and not torch.cuda.is_available():
            continue  # a GPU command: parsed above
        if argv[0] == "train" and _config_of(argv) == "translate":  # toy catalogs, prepared as gettext-de
            if not (folder / "data" / "gettext-de").is_dir():
                prepare("gettext", folder / "data", str(_toy_locales(folder / "locale", "de")), lang="de")
            toy = [*argv, "--data-dir", str(folder / "data"), *TOY_TRANSLATE]
        elif argv[0] == "train":
            toy = [*argv, *data, *TOY_TRAIN] + ([] if _sets_rel_clip(argv) else ["--set", "rel_clip=16"])
            if "--out" not in argv:
                toy += ["--out", str(folder / "runs" / f"main-{index}")]
        elif argv[:2] == ["bench", "recall"]:
            toy = [*argv, *TOY_RECALL]
        elif argv[:2] == ["bench", "text"]:
            toy = [*argv, *data, *TOY_TEXT, "--out", str(folder / f"bench-text-{index}")]  # rows of one length
            # and attention repeat across the pages' commands: each command its own folder
        elif argv[:2] == ["prepare", "pg19"]:  # the books are the committed six-book stand-in of the release
            toy = ["prepare", "pg19", "--from", str(FIXTURE_PG19), "--data-dir", str(folder / "data")]
        elif argv[:2] == ["prepare", "gettext"]:  # catalogs of our own: a slim machine may have none
            toy = [*argv, "--from", str(_toy_locales(folder / "locale", argv[argv.index("--lang") + 1])),
                   "--data-dir", str(folder / "data"), "--force"]
        elif argv[0] == "analyze":
            toy = [*argv, "--windows", "2"] if "approximations" in argv else argv
        elif argv[:2] in (["bench", "attention"], ["bench", "model"]):  # a GPU's lengths (64k) at toy size too
            toy = [*argv, "--n", "512", "--repeats", "1"] + (["--positions", "64"] if argv[1] == "model" else [])
        else:
            toy = argv
        toy = _on_the_cpu(toy)
        assert main(toy) == 0, f"README command failed at toy size: routeformer {' '.join(toy)}"


def _toy_locales(root: Path, lang: str) -> Path:
    """A locale folder with three catalogs of ``lang`` that fall in the three splits."""
    for i, name in enumerate(("cat0", "cat10", "cat55")):  # train, test, valid by split_of's hash
        write_mo(root / lang / "LC_MESSAGES" / f"{name}.mo", {f"Message {i}": f"Nachricht {i}", "File": "Datei"})
    return root


DEVICE_OPTION = ("evaluate", "sample", "analyze", "bench attention", "bench model", "bench recall", "bench all")


def _on_the_cpu(argv: list[str]) -> list[str]:
    """A command that names no CUDA device runs on the CPU, also on a machine with a GPU (its "auto" would take the
    GPU, against this test's CPU-made runs): train and bench text by their configuration, the others by --device."""
    if any("cuda" in arg for arg in argv):
        return argv
    if argv[0] == "train" and "--resume" not in argv and _config_of(argv) != "translate" or \
            argv[:2] == ["bench", "text"]:
        return [*argv, "--set", "device=cpu"]
    if " ".join(argv[:2]).startswith(DEVICE_OPTION) and "--device" not in argv:
        return [*argv, "--device", "cpu"]
    return argv


def _config_of(argv: list[str]) -> str | None:
    """The --config a command names, if any."""
    return argv[argv.index("--config") + 1] if "--config" in argv else None


def _sets_rel_clip(argv: list[str]) -> bool:
    """Whether a train command gives rel_clip, by its configuration or a --set (else the toy window of 16 sets it,
    as the one flat setting of both once did)."""
    config = argv[argv.index("--config") + 1] if "--config" in argv else None
    sets = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--set"]
    return any(item.partition("=")[0].strip().removeprefix("model.") == "rel_clip" for item in sets) or \
        "rel_clip" in tomllib.loads(resolve_config_path(config or "default").read_text()).get("model", {})


def _run_experiment(argv: list[str], monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    import runpy

    monkeypatch.setattr(sys, "argv", [str(ROOT / argv[0]), *argv[1:], *TOY_RECALL])
    try:
        runpy.run_path(str(ROOT / argv[0]), run_name="__main__")
    except SystemExit as stop:
        assert stop.code in (0, None), f"{' '.join(argv)} exited with {stop.code}"
