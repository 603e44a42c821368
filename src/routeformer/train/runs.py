"""Reading a run directory back: its configuration, its weights and its data, for evaluate and sample."""

from __future__ import annotations

import math
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from ..data import DataError, Dataset, DatasetMeta
from ..model import TransformerConfig, TransformerLM
from ..model.seq2seq import Seq2SeqLM
from .config import RunConfig, TrainConfig
from .distributed import resolve_device
from .rundir import data_changes, read_data_record
from .seq2seq_config import Seq2SeqRun, is_seq2seq, seq2seq_run


def read_run_config(run_dir: Path) -> RunConfig | Seq2SeqRun:
    """The run configuration saved in ``run_dir``/config.toml (an encoder-decoder run's where it has [encoder]). A
    saved file may be in the old flat spelling of the kinds' settings (``window``, ``num_clusters``, ...): it is
    migrated as a saved config.json is (``TransformerConfig.from_dict(..., saved=True)``)."""
    path = run_dir / "config.toml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {run_dir} is not a routeformer run directory")
    try:
        raw = tomllib.loads(path.read_text())
        if is_seq2seq(raw):
            return seq2seq_run(raw, str(path), saved=True)
        return RunConfig(TransformerConfig.from_dict(raw["model"], saved=True), TrainConfig(**raw["train"]))
    except (tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path} is not a valid run configuration: {err}") from None


def load_run(run_dir: Path, which: str = "best", data_dir: str | None = None,
             device: str = "cpu") -> tuple[TransformerLM | Seq2SeqLM, RunConfig | Seq2SeqRun, Dataset, str]:
    """The model (best or last weights), the run configuration and the data set it was trained on; an
    encoder-decoder run's model is a ``Seq2SeqLM``."""
    run = read_run_config(run_dir)
    weights = run_dir / "best" if which == "best" and (run_dir / "best" / "model.safetensors").is_file() else run_dir
    if which == "best" and weights == run_dir:
        which = "last"
    seq2seq = isinstance(run, Seq2SeqRun)
    model = (Seq2SeqLM if seq2seq else TransformerLM).from_pretrained(weights, map_location=device).eval()
    data = Dataset.open(run.train.data, data_dir if data_dir is not None else run.train.data_dir)
    vocab = model.config.decoder.vocab_size if seq2seq else model.config.vocab_size
    if vocab != data.meta.vocab_size:
        raise DataError(f"{weights / 'model.safetensors'} has a vocabulary of {vocab} tokens but "
                        f"data set {data.meta.name!r} in {data.directory} has {data.meta.vocab_size}: wrong data for "
                        f"this checkpoint")
    if not seq2seq:
        check_sample_layout(model.config, data.meta)
    recorded = read_data_record(run_dir)
    changed = "" if recorded is None else data_changes(recorded, data.meta)
    if changed:
        print(f"warning: data set {data.meta.name!r} in {data.directory} is not the one {run_dir} trained on "
              f"({changed}): its scores are not comparable with the run's", file=sys.stderr)
    return model, run, data, which


def check_sample_layout(model: TransformerConfig, meta: DatasetMeta) -> None:
    """Factorized image positions embed a token by its row, column and channel, counted from the window start:
    they are right only if every window is exactly one sample (image) of the data."""
    if model.positions != "factorized" or model.image_shape is None:
        return
    size = math.prod(model.image_shape)
    if meta.sample_length != size or model.seq_len != size:
        what = (f"samples of {meta.sample_length} tokens" if meta.sample_length else "no sample structure")
        raise DataError(f"factorized positions of image_shape {model.image_shape} need seq_len = {size} and data "
                        f"in samples of {size} tokens; seq_len is {model.seq_len} and data set {meta.name!r} has "
                        f"{what}")


def pick_device(device: str) -> str:
    """A device name this machine can run on (``auto``: the GPU if there is one); a ValueError otherwise."""
    return str(resolve_device(device))
