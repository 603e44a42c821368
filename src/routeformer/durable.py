"""Writing files so that a crash at any moment leaves the old version or the new one, never a torn one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def durable_replace(tmp: str | Path, path: Path) -> None:
    """Rename the (already fsynced) ``tmp`` over ``path`` and fsync the folder, so the rename itself survives."""
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[str], object]) -> None:
    """Write through ``write(tmp_path)`` to a temporary file beside ``path``, fsync it, then rename it over
    ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    try:
        write(tmp)
        # mkstemp makes 0600 files, and so do writers that create the file anew (safetensors): give the file the
        # permissions the user's umask gives any other
        os.chmod(tmp, 0o666 & ~umask)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        durable_replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
