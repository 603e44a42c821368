"""Reading a run's configuration file, whichever model it trains: a language model's ([model], [train]:
``config``) or an encoder-decoder model's ([encoder], [decoder], [cross], [train]: ``seq2seq_config``)."""

from __future__ import annotations

from pathlib import Path

from . import config
from .seq2seq_config import Seq2SeqRun, is_seq2seq, seq2seq_run


def load_run_config(path: str | Path | None = None, overrides: list[str] | None = None,
                    extra: dict | None = None) -> config.RunConfig | Seq2SeqRun:
    """Read a TOML configuration (default: the shipped default.toml), apply ``--set`` overrides and ``extra`` (the
    command line's [train] values). A file with [encoder], [decoder] or [cross] tables is an encoder-decoder
    run."""
    file, raw = config.read_config_file(path)
    if is_seq2seq(raw):
        return seq2seq_run(raw, str(file), overrides, extra)
    return config.load_run_config(file, overrides, extra)


__all__ = ["load_run_config"]
