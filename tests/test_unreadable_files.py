"""Every file a run reads, broken in three ways (random bytes, cut in half, a well-formed file of the wrong content),
read by the command that reads it: exit status 2 and one line that names the file, never a traceback. Also the
data a run trained on, replaced under it: `prepare` refuses without --force, `--resume` refuses, `evaluate` warns."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from helpers import tiny_model_toml, tiny_text_data
from routeformer.cli import main
from routeformer.data import prepare

CONFIG = tiny_model_toml(depth=1) + """
[train]
device = "cpu"  # a CPU test, also on a machine with a GPU
data = "tiny"
batch_size = 2
max_steps = 2
eval_every = 2
eval_tokens = 64
log_every = 1
sample_tokens = 0
"""


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """A prepared data set and a finished two-step run on it."""
    root = tmp_path_factory.mktemp("unreadable")
    data = tiny_text_data(root, "".join(f"{i}: def f(x): return x * {i}\n" for i in range(200)))
    (root / "tiny.toml").write_text(CONFIG)
    run = root / "run"
    assert main(["train", "--config", str(root / "tiny.toml"), "--data-dir", str(data), "--out", str(run)]) == 0
    return {"root": root, "data": data, "run": run}


def _wrong_content(name: str, original: bytes) -> bytes:
    """A file that parses as its format but cannot be what the run needs."""
    if name.endswith(".json"):
        return b'["a list", "not an object"]'
    if name.endswith(".toml"):
        return b'model = 3\ntrain = "x"\n'
    if name == "checkpoint.pt":
        import io

        buffer = io.BytesIO()
        torch.save([1, 2, 3], buffer)
        return buffer.getvalue()
    if name.endswith(".safetensors"):
        from safetensors.torch import save

        return save({"not_a_weight": torch.zeros(3)})
    return os.urandom(len(original))  # a split: the same size, other tokens


BREAKS = {
    "random bytes": lambda name, original: os.urandom(max(64, len(original) // 3)),
    "cut in half": lambda name, original: original[:len(original) // 2],
    "wrong content": _wrong_content,
}

# file (relative to the run or data folder) -> the command that reads it
READERS = {
    "run/checkpoint.pt": ["train", "--resume", "{run}"],
    "run/model.safetensors": ["evaluate", "{run}", "--checkpoint", "last"],
    "run/config.json": ["evaluate", "{run}", "--checkpoint", "last"],
    "run/config.toml": ["evaluate", "{run}"],
    "data/tiny/meta.json": ["evaluate", "{run}"],
    "data/tiny/train.bin": ["evaluate", "{run}"],
    "data/tiny/valid.bin": ["evaluate", "{run}"],
    "data/tiny/test.bin": ["evaluate", "{run}", "--split", "test"],
}


@pytest.mark.parametrize("how", list(BREAKS))
@pytest.mark.parametrize("where", list(READERS))
def test_a_broken_file_is_a_one_line_error_naming_it(made, tmp_path, capsys, where: str, how: str) -> None:
    run, data = tmp_path / "run", tmp_path / "data"
    shutil.copytree(made["run"], run)
    shutil.copytree(made["data"], data)
    path = tmp_path / where
    path.write_bytes(BREAKS[how](path.name, path.read_bytes()))
    argv = [a.format(run=run) for a in READERS[where]]
    if argv[0] == "evaluate":
        argv += ["--data-dir", str(data), "--device", "cpu"]
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, f"{where}, {how}: exit {code}\n{err}"
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("routeformer: error: "), err
    assert "Traceback" not in err
    assert path.name in lines[0], f"the error does not name {path.name}: {lines[0]}"


def test_a_run_keeps_the_data_it_trained_on(made, tmp_path, capsys) -> None:
    run, data = tmp_path / "run", tmp_path / "data"
    shutil.copytree(made["data"], data)
    assert main(["train", "--config", str(made["root"] / "tiny.toml"), "--data-dir", str(data), "--out",
                 str(run)]) == 0
    assert (run / "data.json").is_file()
    other = tmp_path / "other"
    other.mkdir()
    (other / "b.py").write_text("".join(f"print({i} ** 2)  # something else entirely\n" for i in range(300)))
    capsys.readouterr()
    # the same content again is no change; other content under the same name is refused without --force
    corpus = made["root"] / "corpus"
    assert main(["prepare", "text", "--from", str(corpus), "--name", "tiny", "--data-dir", str(data)]) == 0
    assert main(["prepare", "text", "--from", str(other), "--name", "tiny", "--data-dir", str(data)]) == 2
    err = capsys.readouterr().err
    assert "already exists with other content" in err and "--force" in err and err.count("\n") == 1
    assert main(["evaluate", str(run), "--data-dir", str(data), "--device", "cpu"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(["prepare", "text", "--from", str(other), "--name", "tiny", "--data-dir", str(data), "--force"]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(run), "--data-dir", str(data), "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "warning: data set 'tiny'" in err and "is not the one" in err and "train.bin" in err
    assert main(["train", "--resume", str(run), "--max-steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "--resume refuses" in err and err.count("\n") == 1


def test_run_files_keep_the_permissions_of_the_umask(made) -> None:
    want = 0o666 & ~_umask()
    for path in made["run"].rglob("*"):
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) == want, path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_prepare_without_a_data_set_there_writes_it(tmp_path) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.py").write_text("x = 1\n" * 400)
    meta = prepare("text", tmp_path / "d", str(tmp_path / "c"), dataset_name="fresh")
    assert meta.name == "fresh" and (tmp_path / "d" / "fresh" / "meta.json").is_file()
