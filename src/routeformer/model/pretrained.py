"""save_pretrained / from_pretrained: model.safetensors + config.json, written atomically."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ..durable import atomic_write
from .config import TransformerConfig

WEIGHTS, CONFIG = "model.safetensors", "config.json"


def save_pretrained(model: nn.Module, directory: str | Path) -> None:
    """Weights and buffers (routing centroids and projections included) to model.safetensors, the config to
    config.json."""
    directory = Path(directory)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    atomic_write(directory / WEIGHTS, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    atomic_write(directory / CONFIG, model.config.save)


def load_config(directory: str | Path, kind: type = TransformerConfig):
    """The config a saved model's config.json holds, as ``kind`` (a config class with ``load``)."""
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: a saved model needs {CONFIG} beside {WEIGHTS}")
    return kind.load(path)


def from_pretrained(cls: type[nn.Module], directory: str | Path,
                    map_location: str | torch.device = "cpu") -> nn.Module:
    """A ``cls`` (its config class ``cls.config_type``, default ``TransformerConfig``) from ``save_pretrained``'s
    files; errors name the file and what does not match."""
    directory = Path(directory)
    config = load_config(directory, getattr(cls, "config_type", TransformerConfig))
    path = directory / WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: a saved model needs {WEIGHTS} beside {CONFIG}")
    try:
        state = load_file(str(path), device=str(map_location))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{path} cannot be read as safetensors (truncated or corrupt?): {err}") from None
    model = cls(config)
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
    if missing or unexpected or wrong:
        details = []
        if missing:
            details.append(f"missing {missing[:5]}{' …' if len(missing) > 5 else ''}")
        if unexpected:
            details.append(f"unexpected {unexpected[:5]}{' …' if len(unexpected) > 5 else ''}")
        if wrong:
            details.append("wrong shapes " + ", ".join(f"{k}: file {tuple(state[k].shape)} vs config "
                                                      f"{tuple(own[k].shape)}" for k in wrong[:5]))
        raise ValueError(f"{path} does not match {directory / CONFIG}: " + "; ".join(details))
    model.load_state_dict(state)
    return model.to(map_location)
