"""gettext: parallel text from compiled message catalogs, English source and a translation, with no download.

Every Linux machine with translated programs holds their catalogs as ``/usr/share/locale/LANG/LC_MESSAGES/*.mo``:
each an English message (``msgid``) and its translation (``msgstr``). Read with the standard library's
``gettext.GNUTranslations`` (which decodes each catalog by the charset its header names):

- kept: messages with a translation; a message's context (``msgctxt``) is dropped and a plural entry gives its
  singular and first form; the header entry (empty ``msgid``) is not a message;
- split by catalog, so that no catalog's messages are in two splits: the catalogs sorted by name and each put in a
  split by a hash of its name (about 10 % test, 10 % valid, the rest train; a split left empty takes the last
  catalog of train, in order, so every split holds one);
- a catalog that does not read (its header names a charset its messages are not in) is left out and named in
  ``meta.extra["pairs"]["skipped"]`` with the reason, as ``prepare`` prints;
- deduplicated: a source seen before (in the same split, or for valid and test in train, and for test in valid) is
  dropped with its translation, so no source is scored that was trained on.

Stored as bytes, one document per pair: the source's UTF-8, the byte 0 (``SEPARATOR``: no message holds one, a
catalog's strings end at it), the translation's UTF-8; the documents' starts mark the pairs
(``Dataset.starts``), ``meta.extra["pairs"]`` the languages, separator, catalogs and counts, and
``read_pairs(dataset, split)`` gives them back as (source, target) byte strings.
"""

from __future__ import annotations

import gettext as stdlib_gettext
import hashlib
from pathlib import Path

import numpy as np

from .store import SPLITS, DataError, Dataset, DatasetMeta, write_dataset

LOCALES = Path("/usr/share/locale")
SEPARATOR = 0  # the byte between a pair's source and its translation
SOURCE_LANGUAGE = "en"  # msgids are English by gettext's convention


def catalogs(root: Path, lang: str) -> list[Path]:
    """The ``.mo`` catalogs of ``lang`` under the locale folder ``root`` (``root/LANG/LC_MESSAGES/*.mo``), or in
    ``root`` itself when it holds ``.mo`` files; sorted by name. A DataError names the folder when there are none."""
    for folder in (root / lang / "LC_MESSAGES", root):
        found = sorted(folder.glob("*.mo"), key=lambda p: p.name) if folder.is_dir() else []
        if found:
            return found
    raise DataError(f"no .mo catalogs for language {lang!r} in {root / lang / 'LC_MESSAGES'} or {root}; give "
                    f"--from a locale folder (LANG/LC_MESSAGES/*.mo inside) or a folder of .mo files")


def read_catalog(path: Path) -> list[tuple[str, str]]:
    """(English message, translation) pairs of one compiled catalog, in the catalog's order (see the module:
    contexts dropped, a plural's singular and first form, untranslated messages and the header left out). A
    DataError names the file when it is not a catalog."""
    try:
        with open(path, "rb") as f:
            catalog = stdlib_gettext.GNUTranslations(f)._catalog  # the parsed, decoded messages
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise DataError(f"{path}: not a readable .mo catalog ({err})") from None
    pairs = []
    for key, text in catalog.items():
        if isinstance(key, tuple):  # (singular, form index): the first form translates the singular
            key, form = key
            if form != 0:
                continue
        message = key.rpartition("\x04")[2]  # "context\x04message": the message alone
        if message and text:
            pairs.append((message, text))
    return pairs


def split_of(name: str) -> str:
    """The split a catalog's messages go to, from a hash of its file name: about 10 % test, 10 % valid."""
    bucket = hashlib.sha256(name.encode()).digest()[0] % 10
    return "test" if bucket == 0 else "valid" if bucket == 1 else "train"


def prepare_gettext(target: Path, lang: str, root: Path | None = None, *, force: bool = False) -> DatasetMeta:
    """Prepare ``lang``'s catalogs under ``root`` (default ``/usr/share/locale``) as the pairs data set ``target``
    (see the module). O(total message bytes)."""
    root = LOCALES if root is None else root
    files = catalogs(root, lang)
    chosen: dict[str, list[Path]] = {s: [] for s in SPLITS}
    for path in files:
        chosen[split_of(path.name)].append(path)
    for split in ("valid", "test"):  # every split holds a catalog: the last of train's, in order, where empty
        if not chosen[split]:
            if len(chosen["train"]) < 2:
                raise DataError(f"{len(files)} catalog(s) of {lang!r} in {root}: need at least 3 to split by catalog")
            chosen[split].append(chosen["train"].pop())
    seen: set[str] = set()
    skipped: dict[str, str] = {}  # catalogs that do not read (a charset its header misnames): named, not fatal
    blobs: dict[str, bytes] = {}
    starts: dict[str, np.ndarray] = {}
    counts: dict[str, int] = {}
    for split in SPLITS:  # train first: valid and test drop the sources it holds, test those valid holds
        parts, offsets, at = [], [], 0
        for path in chosen[split]:
            try:
                messages = read_catalog(path)
            except DataError as err:
                skipped[path.name] = str(err).partition(": ")[2]
                continue
            for message, text in messages:
                if message in seen:
                    continue
                seen.add(message)
                pair = message.encode() + bytes([SEPARATOR]) + text.encode()
                offsets.append(at)
                parts.append(pair)
                at += len(pair)
        if not parts:
            raise DataError(f"the {split} split of {lang!r}'s catalogs ({', '.join(p.name for p in chosen[split])}) "
                            f"holds no translated message")
        blobs[split], starts[split], counts[split] = b"".join(parts), np.asarray(offsets, dtype=np.int64), len(parts)
    digest = hashlib.sha256(b"".join(blobs[s] for s in SPLITS)).hexdigest()
    meta = DatasetMeta(target.name, "bytes", 256, "uint8", {}, {},
                       source=f"{root} ({lang}: {len(files)} .mo catalogs)", source_checksum=digest,
                       notes=f"{SOURCE_LANGUAGE}-{lang} message pairs, one document each: source, byte "
                             f"{SEPARATOR}, translation; split by catalog, sources deduplicated",
                       extra={"pairs": {"source": SOURCE_LANGUAGE, "target": lang, "separator": SEPARATOR,
                                        "pairs": counts,
                                        "catalogs": {s: [p.name for p in chosen[s] if p.name not in skipped]
                                                     for s in SPLITS},
                                        "skipped": skipped}})
    return write_dataset(target, meta, {s: [np.frombuffer(blobs[s], dtype=np.uint8)] for s in SPLITS},
                         force=force, starts=starts)


def read_pairs(dataset: Dataset, split: str) -> list[tuple[bytes, bytes]]:
    """The (source, target) byte strings of a pairs data set's ``split``, in order. A DataError where the data set
    holds no pairs (``prepare gettext`` makes one)."""
    pairs = dataset.meta.extra.get("pairs")
    if not pairs:
        raise DataError(f"data set {dataset.meta.name!r} holds no sentence pairs; prepare one with "
                        f"`routeformer prepare gettext --lang de`")
    data = np.asarray(dataset.split(split)).tobytes()
    bounds = [*dataset.starts(split).tolist(), len(data)]
    separator = bytes([pairs["separator"]])
    out = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        source, _, target = data[a:b].partition(separator)
        out.append((source, target))
    return out
