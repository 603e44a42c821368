"""Where each data set comes from and how it becomes token arrays.

    stdlib       the running Python's standard library, *.py files (tests included), sorted by path, as bytes;
                 split 90 / 5 / 5 %. On every machine with Python: the built-in default.
    sympy        long documents: SymPy's *.py files of at least 16 KiB (tests included; SymPy is a dependency of
                 torch, so it is wherever torch is), sorted by path, as bytes; split 90 / 5 / 5 %.
    enwik8       the first 10^8 bytes of a 2006 English Wikipedia dump; split 90M / 5M / 5M bytes; md5 checked.
    text8        10^8 characters of lower-cased Wikipedia text (a–z and space); split 90M / 5M / 5M; md5 checked.
    wikitext103  word level: whitespace tokens of each line plus <eos>, vocabulary from the training split by
                 frequency, <unk> as in the data (the tokenized wikitext-103-v1 archive).
    imagenet64   downsampled ImageNet 64x64 npz batches: each image 12288 bytes in raster order, R G B; train =
                 the training batches but their last 10000 images, valid = those 10000, test = the validation set.
    pg19         PG-19's books from a local copy of DeepMind's release (pg19.py): its train / validation / test
                 folders as the splits, each book followed by the byte 0xFF; streamed, never read whole.
    text         any local text file or folder (files in sorted path order), as bytes; split 90 / 5 / 5 %.
    gettext      English-LANG message pairs from this machine's compiled catalogs (/usr/share/locale, or --from),
                 ``--lang LANG``, stored as gettext-LANG: one document per pair, split by catalog (gettext.py).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import sysconfig
import urllib.request
import zipfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .gettext import prepare_gettext
from .pg19 import prepare_pg19
from .store import (
    BUILT_IN,
    DataError,
    Dataset,
    DatasetMeta,
    atomic_file,
    commit_file,
    default_data_dir,
    split_starts,
    writable_directory,
    write_dataset,
)

ENWIK8 = {"url": "http://mattmahoney.net/dc/enwik8.zip", "member": "enwik8", "size": 100_000_000,
          "md5": ("a1fa5ffddb56f4953e226637dabbb36a",), "document": b"<page>"}
# Published digests of the 10^8 characters of text8 (not of the zip). Both values circulate; any match passes.
TEXT8 = {"url": "http://mattmahoney.net/dc/text8.zip", "member": "text8", "size": 100_000_000,
         "md5": ("3bea1919949baf155f99411df5fada7e", "f26f94c5209bc6159618bad4a559ff81")}
WIKITEXT103_URL = "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip"
IMAGE_BYTES = 64 * 64 * 3
IMAGENET64_VALID = 10_000  # training images held out as the validation split


def _blocks_of(data: np.ndarray, size: int = 1 << 24) -> Iterator[np.ndarray]:
    for start in range(0, len(data), size):
        yield data[start:start + size]


def _split_bytes(data: np.ndarray, train: int, valid: int) -> dict[str, Iterator[np.ndarray]]:
    return {"train": _blocks_of(data[:train]), "valid": _blocks_of(data[train:train + valid]),
            "test": _blocks_of(data[train + valid:])}


def _proportional(data: np.ndarray) -> dict[str, Iterator[np.ndarray]]:
    n = len(data)
    return _split_bytes(data, n * 90 // 100, n * 5 // 100)


def _proportional_starts(lengths: list[int]) -> dict[str, np.ndarray]:
    """Each split's document starts, for documents of ``lengths`` bytes concatenated and split as ``_proportional``
    splits them."""
    n = sum(lengths)
    starts = np.concatenate([[0], np.cumsum(lengths[:-1])]).astype(np.int64)
    train, valid = n * 90 // 100, n * 5 // 100
    bounds = {"train": (0, train), "valid": (train, train + valid), "test": (train + valid, n)}
    return {split: split_starts(starts, lo, hi) for split, (lo, hi) in bounds.items()}


def download(url: str, target: Path, name: str) -> Path:
    """Fetch ``url`` into ``target`` (atomically), with a progress bar; a one-line error tells what to do offline."""
    from tqdm import tqdm

    if target.is_file():
        return target
    writable_directory(target.parent)
    tmp, handle = atomic_file(target)
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            total = int(response.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"downloading {name}") as bar:
                for block in iter(lambda: response.read(1 << 20), b""):
                    handle.write(block)
                    bar.update(len(block))
        commit_file(tmp, handle, target)
    except OSError as err:
        handle.close()
        tmp.unlink(missing_ok=True)
        raise DataError(f"could not download {url} ({getattr(err, 'reason', err)}); fetch it yourself and run "
                        f"`routeformer prepare {name} --from FILE`") from None
    return target


def _read_member(path: Path, member: str) -> bytes:
    """The bytes of ``member`` from a zip archive, or of ``path`` itself when it is not a zip."""
    if not path.is_file():
        raise DataError(f"{path} does not exist")
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            pick = member if member in names else (names[0] if len(names) == 1 else None)
            if pick is None:
                raise DataError(f"{path} holds {names[:5]}, not {member!r}")
            return archive.read(pick)
    return path.read_bytes()


def _verified(data: bytes, spec: dict, name: str, path: Path, skip_checksum: bool) -> np.ndarray:
    if len(data) != spec["size"]:
        raise DataError(f"{path}: {name} must hold {spec['size']} bytes, this holds {len(data)}")
    md5 = hashlib.md5(data).hexdigest()
    if md5 not in spec["md5"] and not skip_checksum:
        raise DataError(f"{path}: md5 {md5} is not the published md5 of {name} ({' or '.join(spec['md5'])}); "
                        f"the file is corrupt or a different version (--skip-checksum accepts it anyway)")
    return np.frombuffer(data, dtype=np.uint8)


def prepare(name: str, data_dir: Path, source: str | None = None, *, dataset_name: str | None = None,
            skip_checksum: bool = False, force: bool = False, lang: str | None = None) -> DatasetMeta:
    """Prepare data set ``name`` into ``data_dir/<dataset_name or name>`` (gettext: ``gettext-<lang>``); an
    existing data set there with other content is replaced only when ``force`` (runs trained on it would otherwise
    be scored on other data). ``lang``: the translation's language, for gettext only."""
    if name not in PREPARERS:
        raise DataError(f"unknown data set {name!r}; known: {', '.join(PREPARERS)}")
    if (lang is not None) != (name == "gettext"):
        raise DataError("--lang LANG is gettext's (the translations' language, e.g. de), and gettext needs it"
                        if name == "gettext" else f"--lang applies to gettext only, not {name}")
    writable_directory(data_dir)
    src = Path(source).expanduser() if source is not None else None
    if src is not None and not src.exists():
        raise DataError(f"--from {src}: no such file or folder")
    if name == "gettext":
        if not lang or not lang.replace("_", "").replace("@", "").isalnum():
            raise DataError(f"--lang must be a locale name such as de or pt_BR, got {lang!r}")
        return prepare_gettext(data_dir / (dataset_name or f"gettext-{lang}"), lang, src, force=force)
    target = data_dir / (dataset_name or name)
    return PREPARERS[name](target, data_dir, src, skip_checksum, force)


def prepare_builtin(data: str, data_dir: str | Path | None, echo=print) -> None:
    """The data sets this machine holds need no download: ``stdlib`` and ``gettext-LANG`` (this machine's message
    catalogs, ``/usr/share/locale``) are prepared on first use (no-op for other data sets)."""
    lang = data.removeprefix("gettext-") if data.startswith("gettext-") else None
    if data != "stdlib" and not lang:
        return
    where = Path(data_dir).expanduser() if data_dir else default_data_dir()
    try:
        Dataset.open(data, where, verify=False)
    except DataError:
        echo(f"preparing the {data} data set in {where / data} (first use)")
        if lang:
            prepare("gettext", where, lang=lang)
        else:
            prepare("stdlib", where)


def _stdlib(target: Path, data_dir: Path, src: Path | None, skip_checksum: bool,
            force: bool) -> DatasetMeta:
    root = src or Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        if rel.parts and (rel.parts[0] in ("site-packages", "dist-packages") or "__pycache__" in rel.parts):
            dirnames[:] = []
            continue
        dirnames.sort()
        files += [Path(dirpath, f).relative_to(root) for f in filenames if f.endswith(".py")]
    files.sort(key=lambda p: p.as_posix())
    if not files:
        raise DataError(f"no .py files under {root}")
    docs = [(root / f).read_bytes() for f in files]
    blob = b"".join(docs)
    data = np.frombuffer(blob, dtype=np.uint8)
    meta = DatasetMeta(target.name, "bytes", 256, "uint8", {}, {}, source=f"{root} ({len(files)} .py files)",
                       source_checksum=hashlib.sha256(blob).hexdigest(),
                       notes="Python standard library sources in sorted path order; split 90/5/5 %; a document "
                             "per file")
    return write_dataset(target, meta, _proportional(data), force=force,
                         starts=_proportional_starts([len(d) for d in docs if d]))


def _mahoney(spec_name: str, name: str):
    def prepare_one(target: Path, data_dir: Path, src: Path | None, skip_checksum: bool,
                    force: bool) -> DatasetMeta:
        spec = globals()[spec_name]
        path = src or download(spec["url"], data_dir / "downloads" / Path(spec["url"]).name, name)
        data = _verified(_read_member(path, spec["member"]), spec, name, path, skip_checksum)
        meta = DatasetMeta(target.name, "bytes", 256, "uint8", {}, {}, source=str(path),
                           source_checksum="md5:" + hashlib.md5(data.tobytes()).hexdigest(),
                           notes="split 90M / 5M / 5M bytes as in the literature")
        size = spec["size"]  # 10^8: 90M / 5M / 5M
        train, valid = size * 9 // 10, size // 20
        starts = None
        if spec.get("document") is not None:  # enwik8: a Wikipedia page begins at every <page>
            starts = _marked_starts(data, spec["document"], {"train": (0, train), "valid": (train, train + valid),
                                                             "test": (train + valid, len(data))})
        return write_dataset(target, meta, _split_bytes(data, train, valid), force=force, starts=starts)
    return prepare_one


def _marked_starts(data: np.ndarray, marker: bytes, bounds: dict[str, tuple[int, int]]) -> dict[str, np.ndarray]:
    """Each split's document starts where every document begins with ``marker`` (what comes before the first one is
    a document too), the splits the byte ranges ``bounds`` (``split_starts``)."""
    found = [m.start() for m in re.finditer(re.escape(marker), data.tobytes())]
    starts = np.asarray(sorted({0, *found}), dtype=np.int64)
    return {split: split_starts(starts, lo, hi) for split, (lo, hi) in bounds.items()}


def _wikitext103(target: Path, data_dir: Path, src: Path | None, skip_checksum: bool,
                 force: bool) -> DatasetMeta:
    path = src or download(WIKITEXT103_URL, data_dir / "downloads" / "wikitext-103-v1.zip", "wikitext103")
    texts = {}
    for split in ("train", "valid", "test"):
        texts[split] = _wikitext_file(path, f"wiki.{split}.tokens")
    counts = Counter(token for line in texts["train"] for token in _words(line))
    vocab = [token for token, _ in counts.most_common()]
    index = {token: i for i, token in enumerate(vocab)}
    unk = index.get("<unk>")

    def encode(lines: list[str], split: str) -> Iterator[np.ndarray]:
        missing = 0
        for start in range(0, len(lines), 20000):
            ids = []
            for line in lines[start:start + 20000]:
                if _is_title(line):  # an article starts with its title: its first token's place, counted as written
                    starts[split].append(written[split] + len(ids))
                for token in _words(line):
                    i = index.get(token, unk)
                    if i is None:
                        missing += 1
                        continue
                    ids.append(i)
            written[split] += len(ids)
            yield np.asarray(ids, dtype=np.uint32)
        if missing:
            raise DataError(f"{split} holds {missing} tokens outside the training vocabulary and no <unk> token")

    meta = DatasetMeta(target.name, "words", len(vocab), "uint32", {}, {}, source=str(path),
                       source_checksum="sha256:" + _file_sha256(path) if path.is_file() else None,
                       notes="whitespace tokens of every line + <eos>; vocabulary from train, by frequency")
    # every article's first token, filled as the splits are encoded (write_dataset reads a split's starts after
    # writing it); tokens before a split's first title are a document too
    starts: dict[str, list[int]] = {split: [0] for split in texts}
    written = dict.fromkeys(texts, 0)
    return write_dataset(target, meta, {s: encode(texts[s], s) for s in texts}, vocab=vocab, force=force,
                         starts=lambda split: np.asarray(sorted(set(starts[split])), dtype=np.int64))


def _is_title(line: str) -> bool:
    """A WikiText article's title line, ' = Title = ' (a section's heading has two or more '=' a side)."""
    text = line.strip()
    return text.startswith("= ") and text.endswith(" =") and not text.startswith("= =") and len(text) > 4


def _words(line: str) -> list[str]:
    return line.split() + ["<eos>"]


def _wikitext_file(path: Path, name: str) -> list[str]:
    if path.is_dir():
        found = sorted(path.rglob(name))
        if not found:
            raise DataError(f"{path} holds no {name}")
        return found[0].read_text(encoding="utf-8").split("\n")[:-1]
    if not zipfile.is_zipfile(path):
        raise DataError(f"{path} is neither a wikitext-103 zip archive nor a folder")
    with zipfile.ZipFile(path) as archive:
        members = [m for m in archive.namelist() if m.endswith("/" + name) or m == name]
        if not members:
            raise DataError(f"{path} holds no {name}")
        return archive.read(members[0]).decode("utf-8").split("\n")[:-1]


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _imagenet64(target: Path, data_dir: Path, src: Path | None, skip_checksum: bool,
                force: bool) -> DatasetMeta:
    if src is None:
        raise DataError("ImageNet 64x64 needs a login to download: fetch the npz batches (Imagenet64_train_*.zip "
                        "and Imagenet64_val.zip) from image-net.org and run `routeformer prepare imagenet64 "
                        "--from FOLDER`")
    batches = _npz_batches(src)
    train_files = [b for b in batches if "train" in b[0]]
    val_files = [b for b in batches if "val" in b[0]]
    if not train_files or not val_files:
        raise DataError(f"{src} must hold train_data_batch_* and val_data npz batches (found "
                        f"{[name for name, _ in batches][:6]})")
    held_out = globals()["IMAGENET64_VALID"]
    total_train = sum(_images(load)[0].shape[0] for _, load in train_files)
    if total_train <= held_out:
        raise DataError(f"{src}: {total_train} training images, need more than {held_out}")
    keep = total_train - held_out

    def stream(files, start: int, stop: int) -> Iterator[np.ndarray]:
        seen = 0
        for _, load in files:
            images = _images(load)[0]
            lo, hi = max(start - seen, 0), min(stop - seen, len(images))
            if lo < hi:
                yield _raster(images[lo:hi])
            seen += len(images)

    meta = DatasetMeta(target.name, "images", 256, "uint8", {}, {}, source=str(src), sample_length=IMAGE_BYTES,
                       notes=f"64x64 RGB images, 12288 bytes each in raster order (R G B per pixel); valid = the "
                             f"last {held_out} training images, test = the validation batch")
    splits = {"train": stream(train_files, 0, keep), "valid": stream(train_files, keep, total_train),
              "test": stream(val_files, 0, 1 << 62)}
    return write_dataset(target, meta, splits, force=force)


def _npz_batches(src: Path) -> list[tuple[str, object]]:
    """(name, loader) of every npz batch in a folder, a zip archive, or a folder of zip archives."""
    found: list[tuple[str, object]] = []
    paths = sorted(src.rglob("*")) if src.is_dir() else [src]
    for path in paths:
        if path.is_file() and zipfile.is_zipfile(path) and path.suffix != ".npz":
            with zipfile.ZipFile(path) as archive:
                members = sorted(m for m in archive.namelist() if "data" in Path(m).name)
            found += [(Path(m).name, lambda p=path, m=m: np.load(io.BytesIO(zipfile.ZipFile(p).read(m))))
                      for m in members]
        elif path.is_file() and ("data" in path.name):
            found.append((path.name, lambda p=path: np.load(p)))
    return sorted(found, key=lambda item: _batch_key(item[0]))


def _batch_key(name: str) -> tuple[str, int]:
    """train_data_batch_2 before train_data_batch_10: sort by the name without digits, then by the number."""
    digits = "".join(c for c in name if c.isdigit())
    return ("".join(c for c in name if not c.isdigit()), int(digits) if digits else 0)


def _images(load) -> tuple[np.ndarray]:
    with load() as npz:
        data = npz["data"]
    if data.ndim != 2 or data.shape[1] != IMAGE_BYTES:
        raise DataError(f"an ImageNet 64x64 batch must hold 'data' of shape (n, {IMAGE_BYTES}), got {data.shape}")
    return (data,)


def _raster(images: np.ndarray) -> np.ndarray:
    """(n, 3·64·64) channel planes -> (n · 12288,) raster order, R G B per pixel."""
    return images.reshape(-1, 3, 64, 64).transpose(0, 2, 3, 1).reshape(-1).astype(np.uint8)


SYMPY_MIN_BYTES = 16 * 1024  # long documents: 4x the longest context of the text study (4096)


def _sympy(target: Path, data_dir: Path, src: Path | None, skip_checksum: bool,
           force: bool) -> DatasetMeta:
    version = "given with --from"
    if src is None:
        try:
            import sympy
        except ImportError:
            raise DataError("the sympy data set reads the installed SymPy package (a dependency of torch): "
                            "pip install sympy, or give --from PATH") from None
        src, version = Path(sympy.__file__).parent, f"SymPy {sympy.__version__}"
    files = sorted((p for p in src.rglob("*.py") if "__pycache__" not in p.parts
                    and p.stat().st_size >= SYMPY_MIN_BYTES), key=lambda p: p.relative_to(src).as_posix())
    if not files:
        raise DataError(f"no .py files of at least {SYMPY_MIN_BYTES} bytes under {src}")
    docs = [f.read_bytes() for f in files]
    blob = b"".join(docs)
    median = int(np.median([len(d) for d in docs]))
    meta = DatasetMeta(target.name, "bytes", 256, "uint8", {}, {},
                       source=f"{src} ({version}, {len(files)} .py files of >= {SYMPY_MIN_BYTES} bytes, median "
                              f"{median} bytes)",
                       source_checksum=hashlib.sha256(blob).hexdigest(),
                       notes="long documents: SymPy's sources of at least 16 KiB in sorted path order; split 90/5/5 %; "
                             "a document per file")
    return write_dataset(target, meta, _proportional(np.frombuffer(blob, dtype=np.uint8)), force=force,
                         starts=_proportional_starts([len(d) for d in docs]))


def _hidden(relative: Path) -> bool:
    """A dot-file or anything inside a dot-folder (.git, .venv, …): not part of a text corpus."""
    return any(part.startswith(".") for part in relative.parts)


def _text(target: Path, data_dir: Path, src: Path | None, skip_checksum: bool,
          force: bool) -> DatasetMeta:
    if src is None:
        raise DataError("the text data set needs --from PATH (a text file or a folder of them)")
    files = sorted((p for p in src.rglob("*") if p.is_file() and not _hidden(p.relative_to(src))),
                   key=lambda p: p.as_posix()) if src.is_dir() else [src]
    if not files:
        raise DataError(f"{src} holds no files")
    docs = [f.read_bytes() for f in files]
    blob = b"".join(docs)
    if len(blob) < 100:
        raise DataError(f"{src} holds {len(blob)} bytes; need at least 100 to split 90/5/5")
    meta = DatasetMeta(target.name, "bytes", 256, "uint8", {}, {}, source=f"{src} ({len(files)} files)",
                       source_checksum=hashlib.sha256(blob).hexdigest(),
                       notes="bytes, split 90/5/5 %; a document per file")
    return write_dataset(target, meta, _proportional(np.frombuffer(blob, dtype=np.uint8)), force=force,
                         starts=_proportional_starts([len(d) for d in docs if d]))


PREPARERS = {
    "stdlib": _stdlib,
    "sympy": _sympy,
    "enwik8": _mahoney("ENWIK8", "enwik8"),
    "text8": _mahoney("TEXT8", "text8"),
    "wikitext103": _wikitext103,
    "imagenet64": _imagenet64,
    "pg19": prepare_pg19,
    "text": _text,
    "gettext": lambda *args: None,  # prepared by ``prepare`` itself: it needs the language (gettext.py)
}
assert set(PREPARERS) - {"text", "gettext"} == set(BUILT_IN), "the data sets prepared by name alone"
