"""`routeformer prepare`: turn a data set into memory-mapped train/valid/test token arrays."""

from __future__ import annotations

import argparse
from pathlib import Path

from .options import add_data_dir

BLOCK = 1 << 22  # bytes of a split read at a time for the reference points (bincount makes 8 bytes of each)


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Adds the ``prepare`` command to ``commands`` (the top-level sub-parsers)."""
    from ..data import PREPARERS

    prep = commands.add_parser(
        "prepare", help="turn a data set into train/valid/test token arrays",
        description="Prepare a data set once into memory-mapped train.bin / valid.bin / test.bin and meta.json "
        "under DATA_DIR/NAME. stdlib: this Python's standard library (no download); sympy: the installed SymPy's "
        "sources of at least 16 KiB, long documents (no download); enwik8, text8: downloaded "
        "from mattmahoney.net or taken from --from (md5 checked); wikitext103: downloaded or --from (the "
        "wikitext-103-v1 zip or its folder); imagenet64: --from a folder of the 64x64 npz batches; pg19: --from a "
        "local copy of DeepMind's PG-19 release (train/, validation/, test/ of .txt books; each book followed by the "
        "byte 0xFF; no download); text: --from a text file or folder; gettext: --lang LANG, English-LANG message pairs "
        "from this machine's .mo catalogs (/usr/share/locale, or --from a locale folder), as gettext-LANG.")
    prep.add_argument("name", choices=sorted(PREPARERS), metavar="NAME", help=f"one of {', '.join(PREPARERS)}")
    prep.add_argument("--from", dest="source", metavar="PATH", help="a local archive, file or folder to use")
    add_data_dir(prep, "where data sets live (default ~/.cache/routeformer, or $ROUTEFORMER_DATA)")
    prep.add_argument("--name", dest="dataset_name", metavar="NAME", help="store under this name (for text data)")
    prep.add_argument("--lang", metavar="LANG", help="gettext: the translations' language (de, fr, pt_BR, ...)")
    prep.add_argument("--skip-checksum", action="store_true", help="accept enwik8 / text8 whose md5 is not the "
                      "published one")
    prep.add_argument("--force", action="store_true", help="replace a data set of the same name whose content "
                      "differs (default: refuse; runs trained on it would be scored on the new data)")


def cmd_prepare(args: argparse.Namespace) -> int:
    import numpy as np

    from ..data import default_data_dir, prepare

    data_dir = Path(args.data_dir).expanduser() if args.data_dir else default_data_dir()
    meta = prepare(args.name, data_dir, args.source, dataset_name=args.dataset_name,
                   skip_checksum=args.skip_checksum, force=args.force, lang=args.lang)
    where = data_dir / meta.name
    print(f"prepared {meta.name} in {where}: " + ", ".join(f"{s} {n:,}" for s, n in meta.splits.items())
          + f" tokens; vocabulary {meta.vocab_size:,}; metric {meta.metric}")
    pairs = meta.extra.get("pairs")
    if pairs:
        counts = ", ".join(f"{s} {n:,}" for s, n in pairs["pairs"].items())
        print(f"{pairs['source']}-{pairs['target']} pairs: {counts}"
              + f" from {sum(map(len, pairs['catalogs'].values()))} catalogs, split by catalog")
        for name, reason in pairs["skipped"].items():
            print(f"left out {name}: {reason}")
    if meta.kind == "bytes":  # two reference points a model should beat
        import zlib

        from ..data import Dataset

        data = Dataset.open(meta.name, data_dir, verify=False)
        # Read in blocks, not through the memory map: a split can be far larger than memory (PG-19's train is
        # 11 GB), a mapped page stays in the process until unmapped, and bincount widens its input to int64.
        counts = np.zeros(256, dtype=np.int64)
        for block in _blocks(data.directory / "train.bin"):
            counts += np.bincount(np.frombuffer(block, dtype=np.uint8), minlength=256)
        p = counts[counts > 0] / counts.sum()
        packer, packed = zlib.compressobj(9), 0
        for block in _blocks(data.directory / "valid.bin"):
            packed += len(packer.compress(block))
        packed += len(packer.flush())
        print(f"reference points: order-0 entropy {float(-(p * np.log2(p)).sum()):.2f} bits per byte (train), "
              f"zlib -9 {8 * packed / meta.splits['valid']:.2f} bits per byte (valid)")
    return 0


def _blocks(path: Path):
    """The bytes of ``path``, BLOCK at a time."""
    with open(path, "rb") as f:
        yield from iter(lambda: f.read(BLOCK), b"")
