"""PG-19 (Rae et al. 2019, the Routing Transformer's long-book corpus) from a local copy of DeepMind's release, at
byte level.

The release is a folder of ``train/``, ``validation/`` and ``test/`` (one book per ``<id>.txt`` file, 28,602 / 50 /
100 books, the train folder about 11 GB) and ``metadata.csv`` (book id, title, publication date, link). Its splits are
kept as they are (``validation`` becomes ``valid``); each split is its books in sorted file-name order, every book
followed by the separator byte 0xFF. That byte never occurs in UTF-8 text, so in a release of UTF-8 books it marks
exactly the books' ends, and the model sees where one book stops and the next begins. A book that is not valid
UTF-8 is stored as its bytes all the same (a warning names it and says whether it holds 0xFF itself).

Nothing is downloaded, and nothing is held whole in memory: each book is read in blocks and streamed into the
split files (``store.write_dataset``: a staging folder, ``meta.json`` last), so an interrupted prepare leaves no
data set that looks complete.
"""

from __future__ import annotations

import codecs
import csv
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .store import DataError, DatasetMeta, write_dataset

FOLDERS = {"train": "train", "valid": "validation", "test": "test"}  # our split: the release's folder
SEPARATOR = 0xFF  # after every book: not a byte of any UTF-8 text
BLOCK = 1 << 24  # bytes read at a time from a book
SHOWN = 5  # book names a warning lists


def prepare_pg19(target: Path, data_dir: Path, src: Path | None, skip_checksum: bool, force: bool) -> DatasetMeta:
    """PG-19 from the release folder ``src`` into ``target`` (``skip_checksum``: unused, the release publishes no
    checksum). DataError when a split folder is missing or holds no books."""
    if src is None:
        raise DataError("pg19 is not downloaded by routeformer (11 GB): copy DeepMind's release (the train/, "
                        "validation/ and test/ folders of the deepmind-gutenberg bucket, and metadata.csv) to a "
                        "folder and run `routeformer prepare pg19 --from FOLDER`")
    if not src.is_dir():
        raise DataError(f"--from {src}: pg19 takes the folder of the PG-19 release (train/, validation/ and test/ of "
                        f".txt books), not a file")
    books = {split: _books(src, folder) for split, folder in FOLDERS.items()}  # every error before any writing
    listed = _listed_ids(src / "metadata.csv")
    stats: dict[str, dict] = {}
    extra = {"separator": SEPARATOR, "books": stats}
    if listed is not None:
        unlisted = sorted(p.stem for files in books.values() for p in files if p.stem not in listed)
        prepared = sum(len(files) for files in books.values())
        extra["metadata"] = (f"metadata.csv lists {len(listed)} books; {len(unlisted) or 'none'} of the {prepared} "
                             f"prepared books {'is' if len(unlisted) == 1 else 'are'} not among them")
        if unlisted:
            warnings.warn(f"pg19: {len(unlisted)} books are not in {src / 'metadata.csv'} (prepared all the same): "
                          f"{', '.join(unlisted[:SHOWN])}{' …' if len(unlisted) > SHOWN else ''}", stacklevel=2)
    counts = ", ".join(f"{len(books[s])} {FOLDERS[s]}" for s in FOLDERS)
    meta = DatasetMeta(target.name, "bytes", 256, "uint8", {}, {}, source=f"{src} (PG-19: {counts} books)",
                       notes="PG-19 books, the release's splits (validation = valid), each split its books in sorted "
                             "file-name order, every book followed by the byte 0xFF (never in UTF-8 text)",
                       extra=extra)
    total = sum(p.stat().st_size for files in books.values() for p in files)
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, desc="preparing pg19", disable=None) as bar:
        # Each split's stream fills stats[split] as it ends; write_dataset writes meta.json (with extra) only after
        # it has consumed every split, so the counts are in it.
        streams = {split: _book_bytes(files, stats.setdefault(split, {}), bar.update) for split, files in books.items()}
        return write_dataset(target, meta, streams, force=force, starts=lambda split: _book_starts(books[split]))


def _book_starts(books: list[Path]) -> np.ndarray:
    """Where each book of a split begins: after the books before it, each followed by the separator byte (the sizes
    as ``_book_bytes`` read them, asked once they are written)."""
    sizes = [p.stat().st_size + 1 for p in books]
    return np.concatenate([[0], np.cumsum(sizes[:-1])]).astype(np.int64)


def _books(src: Path, folder: str) -> list[Path]:
    """The .txt books of ``src/folder`` in sorted name order; DataError when the folder is missing or holds no
    book with any bytes."""
    where = src / folder
    if not where.is_dir():
        present = sorted(p.name for p in src.iterdir() if p.is_dir())
        raise DataError(f"{src} has no {folder}/ folder (it holds {present or 'no folders'}): pg19 --from takes the "
                        f"PG-19 release's folder, with train/, validation/ and test/ of .txt books, one book a file")
    books = sorted((p for p in where.iterdir() if p.is_file() and p.suffix == ".txt" and not p.name.startswith(".")),
                   key=lambda p: p.name)
    if not books:
        raise DataError(f"{where} holds no .txt books: the {folder} split would be empty")
    if not any(p.stat().st_size for p in books):
        raise DataError(f"the {len(books)} books in {where} are all empty: the {folder} split would hold no text")
    return books


def _listed_ids(path: Path) -> set[str] | None:
    """The book ids (first column) of metadata.csv, or None when there is none."""
    if not path.is_file():
        return None
    try:
        with open(path, newline="", encoding="utf-8") as f:
            return {row[0].strip() for row in csv.reader(f) if row}
    except (UnicodeDecodeError, csv.Error) as err:
        raise DataError(f"{path} cannot be read as the release's CSV ({err}); remove it or replace it with the "
                        f"release's metadata.csv") from None


def _book_bytes(books: list[Path], stats: dict, progress) -> Iterator[np.ndarray]:
    """The bytes of ``books``, each followed by the separator, in blocks; ``stats`` gets the books, their bytes and
    the names of those that are not UTF-8 (and of those holding the separator byte) when the stream ends."""
    separator = np.array([SEPARATOR], dtype=np.uint8)
    not_utf8, holding_separator, size = [], [], 0
    for path in books:
        decoder = codecs.getincrementaldecoder("utf-8")()  # strict: finds the books that are not UTF-8
        utf8, holds = True, False
        with open(path, "rb") as f:
            for block in iter(lambda f=f: f.read(BLOCK), b""):
                if utf8:
                    try:
                        decoder.decode(block)
                    except UnicodeDecodeError:
                        utf8 = False
                holds = holds or bytes([SEPARATOR]) in block
                size += len(block)
                progress(len(block))
                yield np.frombuffer(block, dtype=np.uint8)
        if utf8:
            try:
                decoder.decode(b"", final=True)  # a book that ends inside a character
            except UnicodeDecodeError:
                utf8 = False
        if not utf8:
            not_utf8.append(path.name)
        if holds:
            holding_separator.append(path.name)
        yield separator
    stats.update(books=len(books), bytes=size, not_utf8=not_utf8, holding_separator=holding_separator)
    if not_utf8:
        where = books[0].parent
        warnings.warn(f"pg19: {len(not_utf8)} books in {where} are not valid UTF-8 and are stored as their bytes: "
                      f"{', '.join(not_utf8[:SHOWN])}{' …' if len(not_utf8) > SHOWN else ''}"
                      + (f"; {len(holding_separator)} of them hold the separator byte 0xFF, which the model will read "
                         f"as a book's end ({', '.join(holding_separator[:SHOWN])})" if holding_separator else ""),
                      stacklevel=2)
