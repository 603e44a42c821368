"""Prepared data sets on disk: train.bin / valid.bin / test.bin (flat token arrays, memory-mapped) + meta.json, and
where the source marks documents, <split>.starts.bin: the offset of every document's first token in the split
(int64, increasing, from 0: a split that begins inside a document begins a document there).

A data set lives in ``<data_dir>/<name>/``. Each split is written to a temporary file, fsynced and renamed into
place, with its sha256 computed on the way; ``meta.json`` is written last, so a data set is complete exactly when
its ``meta.json`` exists. Opening checks every split's size (a truncated file is an error naming it) and, for
splits up to 1 GiB, its sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..durable import durable_replace

SPLITS = ("train", "valid", "test")
# the names `routeformer prepare` takes as is
BUILT_IN = ("stdlib", "sympy", "enwik8", "text8", "wikitext103", "imagenet64", "pg19")
FROM_FOLDER = ("imagenet64", "pg19")  # of those, the ones prepared only from a local copy (--from)
METRICS = {"bytes": "bits per byte", "words": "perplexity", "images": "bits per dimension"}
VERIFY_LIMIT = 1 << 30  # splits up to this size are checksummed on open


class DataError(ValueError):
    """A data set is missing, incomplete or corrupt; the message names the file and what to do."""


def default_data_dir() -> Path:
    return Path(os.environ.get("ROUTEFORMER_DATA", "~/.cache/routeformer")).expanduser()


@dataclass
class DatasetMeta:
    """meta.json: what a prepared data set holds and where it came from."""

    name: str
    kind: str  # bytes | words | images
    vocab_size: int
    dtype: str  # numpy dtype of the tokens
    splits: dict[str, int]  # tokens per split
    sha256: dict[str, str]  # of each split file
    source: str
    source_checksum: str | None = None
    sample_length: int | None = None  # tokens per sample (one image), when the data comes in samples
    vocab_file: str | None = None  # words: one token per line, id = line number
    notes: str = ""
    extra: dict = field(default_factory=dict)
    starts: dict[str, int] | None = None  # documents per split (their starts in <split>.starts.bin); None: unmarked

    @property
    def metric(self) -> str:
        return METRICS[self.kind]

    def validate(self) -> None:
        """ValueError when a field read back from meta.json cannot describe a data set."""
        if self.kind not in METRICS:
            raise ValueError(f"kind {self.kind!r} is not one of {', '.join(METRICS)}")
        np.dtype(self.dtype)  # TypeError for a name numpy does not know
        for table in ("splits", "sha256"):
            missing = [s for s in SPLITS if s not in getattr(self, table)]
            if missing:
                raise ValueError(f"{table} lacks {', '.join(missing)}")
        if any(not isinstance(n, int) or n < 0 for n in self.splits.values()):
            raise ValueError(f"split sizes must be non-negative integers, got {self.splits}")
        if not isinstance(self.vocab_size, int) or self.vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive integer, got {self.vocab_size!r}")
        if self.starts is not None:
            if not isinstance(self.starts, dict) or any(s not in self.starts or f"{s}.starts" not in self.sha256
                                                        for s in SPLITS):
                raise ValueError("starts must give every split's document count, its file's sha256 under "
                                 "sha256['<split>.starts']")
            if any(not isinstance(n, int) or n < 1 for n in self.starts.values()):
                raise ValueError(f"starts must be positive document counts, got {self.starts}")


def atomic_file(path: Path) -> tuple[Path, object]:
    """A temporary file beside ``path`` opened for binary writing; finish with ``commit_file``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    return tmp, open(tmp, "wb")  # open() honours the umask, unlike mkstemp


def commit_file(tmp: Path, handle, path: Path) -> None:
    handle.flush()
    os.fsync(handle.fileno())
    handle.close()
    durable_replace(tmp, path)


def write_split(path: Path, chunks: Iterable[np.ndarray], dtype: np.dtype) -> tuple[int, str]:
    """Stream arrays into ``path`` atomically; return (tokens written, sha256)."""
    tmp, handle = atomic_file(path)
    digest, count = hashlib.sha256(), 0
    try:
        for chunk in chunks:
            data = np.ascontiguousarray(chunk, dtype=dtype).tobytes()
            handle.write(data)
            digest.update(data)
            count += len(data) // np.dtype(dtype).itemsize
        commit_file(tmp, handle, path)
    except BaseException:
        handle.close()
        tmp.unlink(missing_ok=True)
        raise
    return count, digest.hexdigest()


def writable_directory(path: Path) -> Path:
    """Create ``path`` if needed and check it can be written, with an error that names it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise DataError(f"cannot write to {path}: {err.strerror or err}; choose another --data-dir") from None
    return path


def write_dataset(directory: Path, meta: DatasetMeta, splits: dict[str, Iterable[np.ndarray]],
                  vocab: list[str] | None = None, *, force: bool = False,
                  starts: dict[str, np.ndarray] | Callable[[str], np.ndarray] | None = None) -> DatasetMeta:
    """Write the splits and vocabulary into a staging folder, then move the finished data set into place.
    ``starts``: each split's document starts (``split_starts``), written as <split>.starts.bin; given as a function
    of the split's name, it is asked once the split is written (starts found while its tokens stream).

    A data set already in ``directory`` stays untouched until the new one is complete, and for good unless its
    splits are the same or ``force``: a DataError names the splits that would change.
    """
    staging = directory.with_name(f".{directory.name}.staging")
    # A prepare killed outright (SIGKILL, a power cut) leaves its staging folder with partial .tmp files, which would
    # otherwise move into place with the next data set (PG-19's train split alone is 11 GB).
    shutil.rmtree(staging, ignore_errors=True)
    staging = writable_directory(staging)
    try:
        for split in SPLITS:
            count, digest = write_split(staging / f"{split}.bin", splits[split], np.dtype(meta.dtype))
            meta.splits[split], meta.sha256[split] = count, digest
            if count == 0:
                raise DataError(f"the {split} split of {meta.name} came out empty; the source is too small")
            if starts is not None:
                found = starts(split) if callable(starts) else starts[split]
                check_starts(found, count, f"the {split} split's document starts")
                meta.starts = meta.starts or {}
                meta.starts[split], meta.sha256[f"{split}.starts"] = write_split(
                    staging / f"{split}.starts.bin", [found], np.dtype(np.int64))
        if vocab is not None:
            meta.vocab_file = "vocab.txt"
            tmp, handle = atomic_file(staging / "vocab.txt")
            handle.write("".join(f"{token}\n" for token in vocab).encode())
            commit_file(tmp, handle, staging / "vocab.txt")
        tmp, handle = atomic_file(staging / "meta.json")
        handle.write((json.dumps(asdict(meta), indent=2) + "\n").encode())
        commit_file(tmp, handle, staging / "meta.json")
        changed = [] if force else _changed_splits(directory, meta)
        if changed:
            raise DataError(f"data set {meta.name!r} in {directory.parent} already exists with other content "
                            f"({', '.join(changed)} would change), and runs trained on it would then be scored on "
                            f"the new data; give it another --name, or pass --force to replace it")
    except BaseException:  # a half-written data set never replaces the old one, nor lingers
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if directory.exists():  # replace the old data set only now that the new one is whole
        old = directory.with_name(f".{directory.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(directory, old)
        os.replace(staging, directory)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, directory)
    return meta


def check_starts(starts: np.ndarray, n: int, what: str) -> None:
    """A DataError unless ``starts`` are document starts in a sequence of ``n`` tokens: int64, increasing, from 0."""
    if starts.dtype != np.int64 or starts.ndim != 1 or len(starts) == 0 or starts[0] != 0 \
            or bool((np.diff(starts) <= 0).any()) or starts[-1] >= n:
        raise DataError(f"{what} must be increasing int64 offsets from 0, below the split's {n} tokens")


def split_starts(starts: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The document starts (int64, increasing) of the tokens [lo, hi) of a sequence whose documents start at
    ``starts``, counted from lo; a part that begins inside a document begins one at 0."""
    inside = starts[(starts > lo) & (starts < hi)] - lo
    return np.concatenate([np.zeros(1, dtype=np.int64), inside.astype(np.int64)])


def _changed_splits(directory: Path, meta: DatasetMeta) -> list[str]:
    """The split files of the data set in ``directory`` whose checksum differs from ``meta``'s (all of them when
    its meta.json cannot be read; none when there is no data set there)."""
    path = directory / "meta.json"
    if not path.is_file():
        return []
    try:
        old = json.loads(path.read_text())["sha256"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return [f"{split}.bin" for split in SPLITS]
    return [f"{split}.bin" for split in SPLITS if not isinstance(old, dict) or old.get(split) != meta.sha256[split]]


class Dataset:
    """A prepared data set: ``dataset.split("train")`` is a read-only memory-mapped token array."""

    def __init__(self, directory: Path, meta: DatasetMeta) -> None:
        self.directory, self.meta = directory, meta
        self._arrays: dict[str, np.ndarray] = {}

    @classmethod
    def open(cls, name: str, data_dir: str | Path | None = None, verify: bool = True) -> Dataset:
        directory = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
        directory = directory / name
        meta_path = directory / "meta.json"
        dir_arg = "" if data_dir is None else f" --data-dir {Path(data_dir).expanduser()}"
        command = (f"routeformer prepare {name}{' --from FOLDER' if name in FROM_FOLDER else ''}{dir_arg}"
                   if name in BUILT_IN else f"routeformer prepare gettext --lang {name[8:]}{dir_arg}"
                   if name.startswith("gettext-") else f"routeformer prepare text --from PATH --name {name}{dir_arg}")
        if not meta_path.is_file():
            raise DataError(f"data set {name!r} is not prepared in {directory.parent}: run `{command}` first")
        try:
            meta = DatasetMeta(**json.loads(meta_path.read_text()))
            meta.validate()
        except (json.JSONDecodeError, TypeError, ValueError, KeyError) as err:
            raise DataError(f"{meta_path} is corrupt ({err}); prepare the data set again with `{command}`") from None
        dataset = cls(directory, meta)
        for split in SPLITS:
            dataset._check(split, verify)
        return dataset

    def _check(self, split: str, verify: bool) -> None:
        path = self.directory / f"{split}.bin"
        itemsize = np.dtype(self.meta.dtype).itemsize
        want = self.meta.splits[split] * itemsize
        if not path.is_file():
            raise DataError(f"{path} is missing; prepare the data set again")
        size = path.stat().st_size
        if size != want:
            raise DataError(f"{path} holds {size} bytes but meta.json says {want}: the file is truncated or was "
                            f"changed; prepare the data set again")
        self._check_file(path, self.meta.sha256[split], verify)
        if self.meta.starts is not None:
            path = self.directory / f"{split}.starts.bin"
            if not path.is_file() or path.stat().st_size != self.meta.starts[split] * 8:
                raise DataError(f"{path} is missing or holds other than the {self.meta.starts[split]} document starts "
                                f"meta.json says; prepare the data set again")
            self._check_file(path, self.meta.sha256[f"{split}.starts"], verify)

    def _check_file(self, path: Path, sha256: str, verify: bool) -> None:
        if verify and path.stat().st_size <= VERIFY_LIMIT:
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    digest.update(block)
            if digest.hexdigest() != sha256:
                raise DataError(f"{path} does not match its checksum in meta.json: the file is corrupt; prepare "
                                f"the data set again")

    def split(self, name: str) -> np.ndarray:
        if name not in SPLITS:
            raise DataError(f"unknown split {name!r}; splits are {', '.join(SPLITS)}")
        if name not in self._arrays:
            path = self.directory / f"{name}.bin"
            self._arrays[name] = np.memmap(path, dtype=np.dtype(self.meta.dtype), mode="r")
        return self._arrays[name]

    def starts(self, name: str) -> np.ndarray | None:
        """The offsets of the split's documents' first tokens (int64, increasing, from 0), or None where the data
        set marks no documents (one prepared before they were recorded, or a source without them)."""
        self.split(name)  # the split's name checked
        if self.meta.starts is None:
            return None
        key = f"{name}.starts"
        if key not in self._arrays:
            self._arrays[key] = np.fromfile(self.directory / f"{name}.starts.bin", dtype=np.int64)
        return self._arrays[key]

    def vocab(self) -> list[str] | None:
        if self.meta.vocab_file is None:
            return None
        return (self.directory / self.meta.vocab_file).read_text().split("\n")[:-1]

    def encode(self, text: bytes) -> np.ndarray:
        """Text as this data set's tokens (int64): its bytes, or for word data its words (unknown ones as <unk>);
        a DataError when nothing is left."""
        if not text:
            raise DataError("the text is empty")
        if self.meta.kind != "words":
            return np.frombuffer(text, dtype=np.uint8).astype(np.int64)
        index = {w: i for i, w in enumerate(self.vocab() or [])}
        unk = index.get("<unk>", 0)
        ids = [index.get(w, unk) for w in text.decode("utf-8", errors="replace").split()]
        if not ids:
            raise DataError("the text holds no words")
        return np.asarray(ids, dtype=np.int64)
