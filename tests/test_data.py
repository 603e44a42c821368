"""Data sets: every source prepared from a tiny stand-in the test builds itself; nothing downloads."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import period
from routeformer.data import (
    BatchSampler,
    DataError,
    Dataset,
    RepeatCurriculum,
    eval_windows,
    prepare,
    sources,
    window_batches,
)


def test_stdlib_from_a_folder_sorted_python_files_only(tmp_path) -> None:
    root = tmp_path / "lib"
    for rel, text in {"b.py": "B" * 500, "a/z.py": "Z" * 300, "a/y.txt": "no", "site-packages/x.py": "no",
                      "a/__pycache__/c.py": "no", "test/t.py": "T" * 200}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    meta = prepare("stdlib", tmp_path / "data", str(root))
    data = Dataset.open("stdlib", tmp_path / "data")
    whole = np.concatenate([np.asarray(data.split(s)) for s in ("train", "valid", "test")]).tobytes()
    assert whole == ("Z" * 300 + "B" * 500 + "T" * 200).encode()  # a/z.py, b.py, test/t.py
    assert meta.splits == {"train": 900, "valid": 50, "test": 50} and meta.kind == "bytes"


def test_the_real_stdlib(tmp_path) -> None:
    """The built-in default: this Python's standard library, tests included."""
    import sysconfig

    meta = prepare("stdlib", tmp_path)
    total = sum(meta.splits.values())
    assert total > 1_000_000 and meta.splits["train"] == total * 90 // 100
    tests = sorted((Path(sysconfig.get_paths()["stdlib"]) / "test").glob("test_*.py"))
    if not tests:
        pytest.skip("this Python ships without its test package")
    data = Dataset.open("stdlib", tmp_path)
    whole = b"".join(np.asarray(data.split(s)).tobytes() for s in ("train", "valid", "test"))
    assert tests[len(tests) // 2].read_bytes() in whole  # a test module, whole, in the corpus


def _mahoney_standin(tmp_path: Path, monkeypatch, name: str, size: int = 2000) -> tuple[Path, bytes]:
    rng = np.random.default_rng(0)
    data = bytes(rng.integers(0, 256, size, dtype=np.uint8)) if name == "enwik8" else bytes(
        rng.choice(list(b" abcdefghijklmnopqrstuvwxyz"), size).astype(np.uint8))
    spec = dict(getattr(sources, name.upper()))
    spec.update(size=size, md5=(hashlib.md5(data).hexdigest(),))
    monkeypatch.setattr(sources, name.upper(), spec)
    archive = tmp_path / f"{name}.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr(name, data)
    return archive, data


@pytest.mark.parametrize("name", ["enwik8", "text8"])
def test_mahoney_data_from_a_zip_and_from_the_raw_file(name: str, tmp_path, monkeypatch) -> None:
    archive, data = _mahoney_standin(tmp_path, monkeypatch, name)
    meta = prepare(name, tmp_path / "data", str(archive))
    assert meta.splits == {"train": 1800, "valid": 100, "test": 100}  # 90 / 5 / 5 of the size, as 90M / 5M / 5M
    ds = Dataset.open(name, tmp_path / "data")
    assert np.asarray(ds.split("valid")).tobytes() == data[1800:1900]
    raw = tmp_path / name
    raw.write_bytes(data)
    assert prepare(name, tmp_path / "data2", str(raw)).splits == meta.splits


def test_enwik8_records_where_every_page_starts_and_text8_none(tmp_path, monkeypatch) -> None:
    """enwik8's documents are its Wikipedia pages: each starts at a '<page>' (the header before the first is one
    too), cut where the splits are cut; text8 has no markup and marks none."""
    rng = np.random.default_rng(1)
    data = bytearray(rng.choice(list(b"abcdefgh "), 2000).astype(np.uint8).tobytes())
    for at in (300, 1200, 1850, 1990):
        data[at:at + 6] = b"<page>"
    data = bytes(data)
    spec = dict(sources.ENWIK8)
    spec.update(size=2000, md5=(hashlib.md5(data).hexdigest(),))
    monkeypatch.setattr(sources, "ENWIK8", spec)
    raw = tmp_path / "enwik8"
    raw.write_bytes(data)
    prepare("enwik8", tmp_path / "data", str(raw))
    ds = Dataset.open("enwik8", tmp_path / "data")
    assert ds.starts("train").tolist() == [0, 300, 1200]
    assert ds.starts("valid").tolist() == [0, 50]  # 1850 - 1800: the split begins inside the page before
    assert ds.starts("test").tolist() == [0, 90]
    (tmp_path / "t8").mkdir()
    archive, _ = _mahoney_standin(tmp_path / "t8", monkeypatch, "text8")
    prepare("text8", tmp_path / "data", str(archive))
    assert Dataset.open("text8", tmp_path / "data").starts("train") is None


def test_mahoney_checksum_and_size_are_verified(tmp_path, monkeypatch) -> None:
    archive, data = _mahoney_standin(tmp_path, monkeypatch, "enwik8")
    bad = tmp_path / "bad"
    bad.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    with pytest.raises(DataError, match="md5 .* is not the published md5 of enwik8"):
        prepare("enwik8", tmp_path / "data", str(bad))
    assert prepare("enwik8", tmp_path / "data", str(bad), skip_checksum=True).splits["train"] == 1800
    short = tmp_path / "short"
    short.write_bytes(data[:-1])
    with pytest.raises(DataError, match="must hold 2000 bytes"):
        prepare("enwik8", tmp_path / "data", str(short), skip_checksum=True)


def test_download_goes_through_urlopen_and_offline_says_what_to_do(tmp_path, monkeypatch) -> None:
    archive, _ = _mahoney_standin(tmp_path, monkeypatch, "enwik8")
    payload = archive.read_bytes()

    class Response(io.BytesIO):
        headers = {"Content-Length": str(len(payload))}

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    seen = []
    monkeypatch.setattr(sources.urllib.request, "urlopen", lambda url, timeout: seen.append(url) or Response(payload))
    prepare("enwik8", tmp_path / "data")
    assert seen == [sources.ENWIK8["url"]] and (tmp_path / "data" / "downloads" / "enwik8.zip").is_file()

    def offline(url, timeout):
        raise OSError("network unreachable")

    monkeypatch.setattr(sources.urllib.request, "urlopen", offline)
    with pytest.raises(DataError, match=r"could not download .*routeformer prepare text8 --from FILE"):
        prepare("text8", tmp_path / "data")


def _wikitext_zip(tmp_path: Path) -> Path:
    texts = {"train": "the cat sat\n\nthe <unk> ran\n", "valid": "the dog sat\n", "test": "cat ran\n"}
    archive = tmp_path / "wikitext-103-v1.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for split, text in texts.items():
            z.writestr(f"wikitext-103/wiki.{split}.tokens", text)
    return archive


def test_wikitext103_word_level(tmp_path) -> None:
    meta = prepare("wikitext103", tmp_path / "data", str(_wikitext_zip(tmp_path)))
    ds = Dataset.open("wikitext103", tmp_path / "data")
    vocab = ds.vocab()
    assert meta.kind == "words" and ds.meta.metric == "perplexity" and meta.dtype == "uint32"
    assert vocab[:2] == ["<eos>", "the"]  # by frequency: 3 line ends, 2 "the"
    assert set(vocab) == {"<eos>", "the", "cat", "sat", "<unk>", "ran"} and meta.vocab_size == 6
    words = [vocab[i] for i in ds.split("valid")]
    assert words == ["the", "<unk>", "sat", "<eos>"]  # "dog" is not in the training vocabulary
    assert [vocab[i] for i in ds.split("train")][:4] == ["the", "cat", "sat", "<eos>"]


def test_wikitext103_records_where_every_article_starts(tmp_path) -> None:
    """An article starts at its title line ' = Title = ' (a section's ' = = Heading = = ' does not), counted in
    tokens; what comes before a split's first title is a document too."""
    texts = {"train": " = Cats = \n the cat sat \n = = Food = = \n the <unk> ate \n = Dogs = \n the dog ran \n",
             "valid": " the end \n = Birds = \n birds sat \n", "test": " = Fish = \n fish ran \n"}
    archive = tmp_path / "wikitext-103-v1.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for split, text in texts.items():
            z.writestr(f"wikitext-103/wiki.{split}.tokens", text)
    prepare("wikitext103", tmp_path / "data", str(archive))
    ds = Dataset.open("wikitext103", tmp_path / "data")
    vocab = ds.vocab()
    train = [vocab[i] for i in ds.split("train")]
    assert ds.starts("train").tolist() == [0, train.index("Dogs") - 1]  # '=' 'Dogs' '=': the title's first token
    assert train[ds.starts("train")[1]:][:3] == ["=", "Dogs", "="]
    assert ds.starts("valid").tolist() == [0, 3] and ds.starts("test").tolist() == [0]


def test_imagenet64_raster_order_and_splits(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(sources, "IMAGENET64_VALID", 3)
    rng = np.random.default_rng(0)
    batches = {"train_data_batch_1": 5, "train_data_batch_2": 4, "val_data": 2}
    arrays = {}
    folder = tmp_path / "imagenet64"
    folder.mkdir()
    for name, n in batches.items():
        arrays[name] = rng.integers(0, 256, (n, 12288), dtype=np.uint8)
        np.savez(folder / f"{name}.npz", data=arrays[name], labels=np.zeros(n))
    meta = prepare("imagenet64", tmp_path / "data", str(folder))
    assert meta.splits == {"train": 6 * 12288, "valid": 3 * 12288, "test": 2 * 12288}
    assert meta.sample_length == 12288 and meta.metric == "bits per dimension"
    ds = Dataset.open("imagenet64", tmp_path / "data")
    first = arrays["train_data_batch_1"][0].reshape(3, 64, 64)  # channel planes
    image = np.asarray(ds.split("train")[:12288]).reshape(64, 64, 3)  # raster order, R G B per pixel
    assert np.array_equal(image[10, 20], first[:, 10, 20])
    held = np.asarray(ds.split("valid")[:12288])
    assert np.array_equal(held, arrays["train_data_batch_2"][1].reshape(3, 64, 64).transpose(1, 2, 0).reshape(-1))


def test_batches_of_data_in_samples_start_at_a_sample() -> None:
    tokens = np.arange(10 * 12, dtype=np.uint16)  # ten samples of 12 tokens
    sampler = BatchSampler(tokens, 12, 64, seed=0, align=12)
    starts = {int(o) for step in range(1, 20) for o in sampler.offsets(step)}
    assert starts <= set(range(0, 9 * 12, 12))  # every window starts at a sample; the last has no next token
    assert len(starts) == 9  # and every sample that fits is drawn
    assert (sampler.batch(1)[:, 0] % 12 == 0).all()


def test_text_folder(tmp_path) -> None:
    folder = tmp_path / "notes"
    (folder / "b").mkdir(parents=True)
    (folder / "b" / "x.txt").write_text("X" * 100)
    (folder / "a.txt").write_text("A" * 100)
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("not text " * 30)  # hidden folders and files are not text
    (folder / ".notes.swp").write_text("swap " * 30)
    prepare("text", tmp_path / "data", str(folder), dataset_name="notes")
    ds = Dataset.open("notes", tmp_path / "data")
    assert np.asarray(ds.split("train")).tobytes() == b"A" * 100 + b"X" * 80


def test_missing_dataset_names_the_prepare_command(tmp_path) -> None:
    with pytest.raises(DataError, match=f"routeformer prepare enwik8 --data-dir {tmp_path}"):
        Dataset.open("enwik8", tmp_path)
    with pytest.raises(DataError, match=f"routeformer prepare text --from PATH --name mynotes --data-dir {tmp_path}"):
        Dataset.open("mynotes", tmp_path)  # a name of the user's own: prepared from their files


@pytest.mark.parametrize("change, fragment", [
    (lambda m: m["splits"].pop("test"), "splits lacks test"), (lambda m: m.update(dtype="uint9"), "uint9"),
    (lambda m: m.update(kind="sounds"), "kind 'sounds'"), (lambda m: m.pop("sha256"), "sha256"),
])
def test_a_wrong_meta_json_is_a_one_line_error(tmp_path, change, fragment: str) -> None:
    prepare("text", tmp_path, str(_small_text(tmp_path)), dataset_name="notes")
    path = tmp_path / "notes" / "meta.json"
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))
    with pytest.raises(DataError, match=f"meta.json is corrupt.*{fragment}"):
        Dataset.open("notes", tmp_path)


def _small_text(tmp_path: Path) -> Path:
    path = tmp_path / "small.txt"
    path.write_text("hello routing world\n" * 20)
    return path


def test_truncated_and_corrupt_files_are_named(tmp_path) -> None:
    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "f.txt").write_bytes(bytes(range(256)) * 4)
    prepare("text", tmp_path / "data", str(folder))
    train = tmp_path / "data" / "text" / "train.bin"
    data = train.read_bytes()
    train.write_bytes(data[:-1])
    with pytest.raises(DataError, match=f"{train} holds .* truncated"):
        Dataset.open("text", tmp_path / "data")
    train.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    with pytest.raises(DataError, match=f"{train} does not match its checksum"):
        Dataset.open("text", tmp_path / "data")
    (tmp_path / "data" / "text" / "meta.json").write_text("{broken")
    with pytest.raises(DataError, match="meta.json is corrupt"):
        Dataset.open("text", tmp_path / "data")


def test_unwritable_data_dir_is_named(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(DataError, match=f"cannot write to {blocker / 'data'}"):
        prepare("stdlib", blocker / "data")


def test_a_failed_prepare_keeps_the_previous_data_set(tmp_path) -> None:
    good = tmp_path / "good.txt"
    good.write_bytes(b"g" * 1000)
    prepare("text", tmp_path / "data", str(good))
    tiny = tmp_path / "tiny.txt"
    tiny.write_bytes(b"x" * 10)
    with pytest.raises(DataError, match="at least 100"):
        prepare("text", tmp_path / "data", str(tiny))
    assert np.asarray(Dataset.open("text", tmp_path / "data").split("train")).tobytes() == b"g" * 900


def test_a_prepare_that_fails_while_writing_keeps_the_previous_data_set(tmp_path, monkeypatch) -> None:
    good = tmp_path / "good.txt"
    good.write_bytes(b"g" * 1000)
    prepare("text", tmp_path / "data", str(good))
    other = tmp_path / "other.txt"
    other.write_bytes(b"o" * 1000)

    def failing(data):
        splits = sources._split_bytes(data, 900, 50)

        def broken():  # the valid split fails half-way, after train.bin is written: as a full disk would
            yield np.frombuffer(b"o" * 10, dtype=np.uint8)
            raise OSError(28, "No space left on device")

        return {**splits, "valid": broken()}

    monkeypatch.setattr(sources, "_proportional", failing)
    with pytest.raises(OSError, match="No space left"):
        prepare("text", tmp_path / "data", str(other))
    data = Dataset.open("text", tmp_path / "data")  # the old set, whole: sizes and checksums verified
    assert np.asarray(data.split("train")).tobytes() == b"g" * 900
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["text"]  # no staging folder left behind


def test_batches_are_a_function_of_seed_and_step_and_ranks_split_them() -> None:
    tokens = np.arange(10_000) % 251
    one = BatchSampler(tokens, 16, 8, seed=3)
    assert torch.equal(one.batch(5), one.batch(5)) and not torch.equal(one.batch(5), one.batch(6))
    assert torch.equal(one.batch(5)[:, 1:], one.batch(5)[:, :-1] + 1 - 251 * (one.batch(5)[:, :-1] == 250))
    ranks = [BatchSampler(tokens, 16, 8, seed=3, share=(r, 2)) for r in range(2)]
    micro = [ranks[r].batch(5, m, 2) for r in range(2) for m in range(2)]
    assert torch.equal(torch.cat(micro), one.batch(5))  # the global batch, split over ranks and micro-batches


def test_a_curriculum_of_repeats_makes_early_rows_their_own_beginning_over_and_over() -> None:
    """repeat_steps: in steps 1..steps each row is, with probability share, its first L tokens (L in [seq_len / 8,
    seq_len / 2]) repeated; the others and every later step are the plain sampler's rows. The tokens never repeat
    within 251, so a plain row has no period."""
    tokens = np.arange(20_000) % 251
    plain = BatchSampler(tokens, 64, 32, seed=3)
    taught = BatchSampler(tokens, 64, 32, seed=3, repeats=RepeatCurriculum(steps=10, share=0.5))
    repeated, periods, patterns = 0, set(), set()
    for step in range(1, 11):
        mine, theirs = taught.batch(step), plain.batch(step)
        assert torch.equal(taught.batch(step), mine)  # a function of (seed, step)
        patterns.add(tuple((mine != theirs).any(1).tolist()))
        for row, original in zip(mine, theirs, strict=True):
            if torch.equal(row, original):
                assert period(row, range(1, 64)) is None
                continue
            length = period(row, range(1, 65))
            assert length is not None and 8 <= length <= 32, length
            assert torch.equal(row[:length], original[:length])  # the row's own beginning
            repeated, periods = repeated + 1, periods | {length}
    assert 0.4 < repeated / 320 < 0.6 and len(periods) > 10  # about half the rows, many lengths
    assert len(patterns) == 10  # which rows repeat is drawn anew each step
    for step in (11, 12, 500):
        assert torch.equal(taught.batch(step), plain.batch(step))
    every = BatchSampler(tokens, 64, 32, seed=3, repeats=RepeatCurriculum(steps=10, share=1.0))
    assert all(period(row, range(8, 33)) for row in every.batch(10))


def test_the_repeats_are_drawn_over_the_global_batch() -> None:
    """Two processes with two micro-batches each see together the rows one process sees."""
    tokens = np.arange(10_000) % 251
    curriculum = RepeatCurriculum(steps=5, share=0.5)
    one = BatchSampler(tokens, 16, 8, seed=3, repeats=curriculum)
    ranks = [BatchSampler(tokens, 16, 8, seed=3, share=(r, 2), repeats=curriculum) for r in range(2)]
    for step in (1, 5):
        micro = [ranks[r].batch(step, m, 2) for r in range(2) for m in range(2)]
        assert torch.equal(torch.cat(micro), one.batch(step))
    assert not torch.equal(one.batch(1), BatchSampler(tokens, 16, 8, seed=3).batch(1))


def test_a_curriculum_of_no_steps_or_no_rows_is_refused() -> None:
    """No curriculum is None, not a curriculum of 0 steps: one way to say it."""
    for steps, share in ((0, 0.5), (3, 0.0), (3, 1.5)):
        with pytest.raises(ValueError, match="needs steps >= 1 and share in"):
            RepeatCurriculum(steps, share)


def test_images_refuse_a_curriculum_of_repeats() -> None:
    with pytest.raises(DataError, match="repeat_steps is a curriculum for text.*samples of 12 tokens"):
        BatchSampler(np.zeros(1000), 12, 4, seed=0, align=12, repeats=RepeatCurriculum(steps=5, share=0.5))


def test_sampler_rejects_impossible_requests() -> None:
    with pytest.raises(DataError, match="fewer than seq_len"):
        BatchSampler(np.zeros(10), 16, 4, seed=0)
    with pytest.raises(DataError, match="divisible by the number of processes"):
        BatchSampler(np.zeros(100), 8, 3, seed=0, share=(0, 2))


@given(n=st.integers(2, 300), seq=st.integers(1, 40), stride_frac=st.floats(0.01, 1.0))
def test_evaluation_windows_score_every_prediction_once(n: int, seq: int, stride_frac: float) -> None:
    stride = max(1, round(seq * stride_frac))
    windows = eval_windows(n, seq, stride)
    tokens = np.arange(n)
    targets = []
    for rows, mask, documents in window_batches(tokens, windows, seq, batch=7):
        assert documents is None
        targets += rows[:, 1:][mask].tolist()
    assert sorted(targets) == list(range(1, n))  # prediction of token t for t = 1 … n - 1, each once
    if stride < seq:
        for _start, first in windows[1:]:
            assert first >= seq - stride  # every scored prediction has at least seq - stride of context


FIXTURE_SYMPY = Path(__file__).parent / "fixtures" / "sympy"


def test_sympy_long_documents_from_the_committed_fixture(tmp_path) -> None:
    """The second text corpus: .py files of at least 16 KiB only, in sorted path order, split 90/5/5 %."""
    files = sorted(FIXTURE_SYMPY.rglob("*.py"), key=lambda p: p.relative_to(FIXTURE_SYMPY).as_posix())
    long = [f for f in files if f.stat().st_size >= 16 * 1024]
    assert 0 < len(long) < len(files)  # the fixture holds a short file the corpus leaves out
    meta = prepare("sympy", tmp_path / "data", str(FIXTURE_SYMPY))
    data = Dataset.open("sympy", tmp_path / "data")
    whole = b"".join(np.asarray(data.split(s)).tobytes() for s in ("train", "valid", "test"))
    assert whole == b"".join(f.read_bytes() for f in long)
    sizes = sorted(f.stat().st_size for f in long)
    assert f"median {int(np.median(sizes))} bytes" in meta.source and meta.kind == "bytes"
    assert meta.splits["train"] == len(whole) * 90 // 100


def test_the_real_sympy_matches_the_documented_checksum(tmp_path) -> None:
    """The installed SymPy as the corpus; for the version the docs name, the sha256 and median they give."""
    sympy = pytest.importorskip("sympy")
    meta = prepare("sympy", tmp_path)
    assert sum(meta.splits.values()) > 1_000_000
    median = int(meta.source.split("median ")[1].split()[0])
    assert median >= 4 * 4096  # long documents: four times the study's longest context
    docs = (Path(__file__).resolve().parents[1] / "docs" / "text-study.md").read_text()
    if f"SymPy {sympy.__version__}" in docs:
        assert meta.source_checksum in docs and f"{median:,} bytes" in docs


FIXTURE_PG19 = Path(__file__).parent / "fixtures" / "pg19"
PG19_SPLITS = {"train": "train", "valid": "validation", "test": "test"}


def _pg19_books(root: Path, folder: str) -> list[bytes]:
    return [p.read_bytes() for p in sorted((root / folder).glob("*.txt"), key=lambda p: p.name)]


def _split_bytes(name: str, data_dir: Path) -> dict[str, bytes]:
    data = Dataset.open(name, data_dir)
    return {s: np.asarray(data.split(s)).tobytes() for s in ("train", "valid", "test")}


def test_pg19_keeps_the_release_splits_and_ends_every_book_with_0xff(tmp_path) -> None:
    """Each split is its folder's books in file-name order, each followed by the byte 0xFF, which no UTF-8 book holds:
    the model sees every book's end, and nothing else looks like one."""
    meta = prepare("pg19", tmp_path / "data", str(FIXTURE_PG19))
    splits = _split_bytes("pg19", tmp_path / "data")
    for split, folder in PG19_SPLITS.items():
        books = _pg19_books(FIXTURE_PG19, folder)
        assert len(books) >= 1 and all(b"\xff" not in book for book in books)
        assert splits[split] == b"".join(book + b"\xff" for book in books), split  # not re-split, not reordered
        assert splits[split].split(b"\xff")[:-1] == books and splits[split].count(b"\xff") == len(books)
        assert meta.extra["books"][split] == {"books": len(books), "bytes": sum(map(len, books)), "not_utf8": [],
                                              "holding_separator": []}
    assert len(_pg19_books(FIXTURE_PG19, "train")) == 3 and len(_pg19_books(FIXTURE_PG19, "validation")) == 2
    assert "—".encode() in splits["train"]  # UTF-8 text as its bytes (the em dash of 90003.txt: 3 bytes)
    assert meta.kind == "bytes" and meta.vocab_size == 256 and meta.extra["separator"] == 0xFF
    assert meta.extra["metadata"] == "metadata.csv lists 6 books; none of the 6 prepared books are not among them"
    assert "3 train, 2 validation, 1 test books" in meta.source and "0xFF" in meta.notes
    data = Dataset.open("pg19", tmp_path / "data")
    for split, folder in PG19_SPLITS.items():  # every book is a document, starting after the one before's 0xFF
        books = _pg19_books(FIXTURE_PG19, folder)
        assert data.starts(split).tolist() == [sum(len(b) + 1 for b in books[:i]) for i in range(len(books))]


def test_pg19_reads_books_in_blocks_and_takes_other_bytes_as_they_are(tmp_path, monkeypatch) -> None:
    """PG-19's train split is 11 GB: books are streamed in blocks of at most pg19.BLOCK bytes. A book that is not
    UTF-8 (Latin-1 here, whose ÿ is the byte 0xFF) is stored as its bytes, with a warning that names it."""
    from routeformer.data import pg19

    root = tmp_path / "release"
    shutil.copytree(FIXTURE_PG19, root)
    latin = "Le garçon ÿ était — déjà parti.\n".encode("latin-1", errors="replace") * 20
    (root / "train" / "90007.txt").write_bytes(latin)  # not in metadata.csv either
    monkeypatch.setattr(pg19, "BLOCK", 64)
    sizes: list[int] = []
    real = pg19._book_bytes

    def recording(books, stats, progress):
        for chunk in real(books, stats, progress):
            sizes.append(len(chunk))
            yield chunk

    monkeypatch.setattr(pg19, "_book_bytes", recording)
    with pytest.warns(UserWarning) as caught:
        meta = prepare("pg19", tmp_path / "data", str(root))
    messages = [str(w.message) for w in caught]
    assert any("1 books are not in" in m and "90007" in m for m in messages), messages
    assert any("not valid UTF-8" in m and "90007.txt" in m and "hold the separator byte 0xFF" in m
               for m in messages), messages
    assert max(sizes) == 64 and sum(sizes) == sum(meta.splits.values())
    train = _split_bytes("pg19", tmp_path / "data")["train"]
    assert train == b"".join(b + b"\xff" for b in _pg19_books(root, "train")) and latin in train
    assert meta.extra["books"]["train"]["not_utf8"] == ["90007.txt"]
    assert meta.extra["books"]["train"]["holding_separator"] == ["90007.txt"]
    assert "1 of the 7 prepared books is not among them" in meta.extra["metadata"]


def test_pg19_errors_name_the_folder_and_nothing_is_written(tmp_path) -> None:
    data = tmp_path / "data"
    with pytest.raises(DataError, match="pg19 is not downloaded by routeformer.*prepare pg19 --from FOLDER"):
        prepare("pg19", data)
    with pytest.raises(DataError, match="not a file"):
        prepare("pg19", data, str(FIXTURE_PG19 / "metadata.csv"))
    root = tmp_path / "release"
    shutil.copytree(FIXTURE_PG19, root)
    shutil.rmtree(root / "validation")
    with pytest.raises(DataError, match=f"{root} has no validation/ folder"):
        prepare("pg19", data, str(root))
    (root / "validation").mkdir()
    (root / "validation" / "notes.md").write_text("not a book")
    with pytest.raises(DataError, match=f"{root / 'validation'} holds no .txt books: the validation split would be "
                                        "empty"):
        prepare("pg19", data, str(root))
    (root / "validation" / "1.txt").write_bytes(b"")
    with pytest.raises(DataError, match="are all empty"):
        prepare("pg19", data, str(root))
    (root / "metadata.csv").write_bytes(b"\xff\xfe not csv")
    (root / "validation" / "1.txt").write_bytes(b"a book")
    with pytest.raises(DataError, match="metadata.csv cannot be read"):
        prepare("pg19", data, str(root))
    assert list(data.iterdir()) == []  # every error before anything is written
    with pytest.raises(DataError, match=f"routeformer prepare pg19 --from FOLDER --data-dir {data}"):
        Dataset.open("pg19", data)


def test_an_interrupted_pg19_prepare_leaves_nothing_that_looks_complete(tmp_path, monkeypatch) -> None:
    """Ctrl-C while the valid split is written (train.bin already whole): no data set, no staging folder."""
    from routeformer.data import pg19

    real = pg19._book_bytes

    def interrupted(books, stats, progress):
        stream = real(books, stats, progress)
        yield next(stream)
        if books[0].parent.name == "validation":
            raise KeyboardInterrupt
        yield from stream

    monkeypatch.setattr(pg19, "_book_bytes", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare("pg19", tmp_path / "data", str(FIXTURE_PG19))
    assert list((tmp_path / "data").iterdir()) == []
    with pytest.raises(DataError, match="is not prepared"):
        Dataset.open("pg19", tmp_path / "data")
    # killed outright instead (no cleanup ran): the staging folder keeps a partial file; the next prepare drops it
    monkeypatch.setattr(pg19, "_book_bytes", real)
    (tmp_path / "data" / ".pg19.staging").mkdir()
    (tmp_path / "data" / ".pg19.staging" / ".train.bin.99999.tmp").write_bytes(b"partial" * 100)
    prepare("pg19", tmp_path / "data", str(FIXTURE_PG19))
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["pg19"]
    assert sorted(p.name for p in (tmp_path / "data" / "pg19").iterdir()) == [
        "meta.json", "test.bin", "test.starts.bin", "train.bin", "train.starts.bin", "valid.bin", "valid.starts.bin"]


def test_pg19_prepared_from_the_command_line_trains_and_evaluates(tmp_path, capsys) -> None:
    """`routeformer prepare pg19 --from DIR`, then two training steps of a tiny model on it and its evaluation on
    the test split."""
    from routeformer.cli import main

    data = tmp_path / "data"
    assert main(["prepare", "pg19", "--from", str(FIXTURE_PG19), "--data-dir", str(data)]) == 0
    out = capsys.readouterr().out
    assert f"prepared pg19 in {data / 'pg19'}: train 3,434, valid 1,837, test 1,087 tokens" in out
    assert "reference points: order-0 entropy" in out
    run = tmp_path / "run"
    assert main(["train", "--data", "pg19", "--data-dir", str(data), "--out", str(run), "--max-steps", "2",
                 "--set", "seq_len=64", "--set", "dim=32", "--set", "depth=1", "--set", "batch_size=2",
                 "--set", "eval_every=2", "--set", "eval_tokens=128", "--set", "sample_tokens=4",
                 "--set", "options.local.window=16", "--set", "rel_clip=16", "--set", "options.routing.num_clusters=4",
                 "--set", "options.routing.window=16", "--set", "device=cpu"]) == 0
    assert json.loads((run / "data.json").read_text())["name"] == "pg19"
    capsys.readouterr()
    assert main(["evaluate", str(run), "--split", "test", "--device", "cpu"]) == 0
    assert "bits per byte" in capsys.readouterr().out


def test_pg19_prepare_holds_a_few_blocks_in_memory_whatever_the_books_size(tmp_path, monkeypatch, capsys) -> None:
    """A 24 MB release through `routeformer prepare pg19` (the store and the reference points it prints) with 1 MB
    blocks: the peak of Python's and numpy's allocations stays a few blocks, never near the books' size (PG-19's
    train split is 11 GB)."""
    import tracemalloc

    from routeformer.cli import main
    from routeformer.cli import prepare as prepare_command
    from routeformer.data import pg19

    root = tmp_path / "release"
    text = b"".join(book for book in _pg19_books(FIXTURE_PG19, "train"))
    for folder, count in (("train", 6), ("validation", 1), ("test", 1)):
        (root / folder).mkdir(parents=True)
        for i in range(count):
            (root / folder / f"{i}.txt").write_bytes(text * (3_000_000 // len(text)))  # 3 MB a book
    size = sum(p.stat().st_size for p in root.rglob("*.txt"))
    assert size > 23_000_000
    monkeypatch.setattr(pg19, "BLOCK", 1 << 20)
    monkeypatch.setattr(prepare_command, "BLOCK", 1 << 18)  # bincount widens a block eightfold
    tracemalloc.start()
    try:
        assert main(["prepare", "pg19", "--from", str(root), "--data-dir", str(tmp_path / "data")]) == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "reference points" in capsys.readouterr().out
    # a block read, its copy written, its text decoded (UTF-8 check), the reference points' block widened: ~7 MB
    assert peak < 8 << 20 < size / 2.5, f"prepare held {peak:,} bytes at once for {size:,} bytes of books"


def test_prepare_records_where_each_document_starts_in_every_split(tmp_path) -> None:
    """A document per file (issue 71): the starts of each split, counted from the split's first token; a split that
    begins inside a file begins a document there. Written out for 3 files of 500, 300 and 200 bytes split 900/50/50."""
    root = tmp_path / "lib"
    for rel, text in {"a.py": "A" * 500, "b.py": "B" * 300, "c.py": "C" * 200}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    for name in ("stdlib", "text"):
        prepare(name, tmp_path / "data", str(root), dataset_name=f"docs-{name}")
        data = Dataset.open(f"docs-{name}", tmp_path / "data")
        assert data.starts("train").tolist() == [0, 500, 800]  # a.py, b.py, then c.py's first 100 bytes
        assert data.starts("valid").tolist() == [0] and data.starts("test").tolist() == [0]  # inside c.py
        assert data.meta.starts == {"train": 3, "valid": 1, "test": 1}
    prepare("text", tmp_path / "data", str(root / "a.py"), dataset_name="one")
    assert Dataset.open("one", tmp_path / "data").starts("train").tolist() == [0]


def test_a_data_set_prepared_before_documents_were_recorded_still_opens(tmp_path) -> None:
    prepare("text", tmp_path, str(_small_text(tmp_path)), dataset_name="old")
    path = tmp_path / "old" / "meta.json"
    meta = json.loads(path.read_text())
    meta.pop("starts")
    for split in ("train", "valid", "test"):
        meta["sha256"].pop(f"{split}.starts")
        (tmp_path / "old" / f"{split}.starts.bin").unlink()
    path.write_text(json.dumps(meta))
    data = Dataset.open("old", tmp_path)
    assert data.starts("train") is None and len(data.split("train")) == 360


def test_missing_and_corrupt_document_starts_are_named(tmp_path) -> None:
    prepare("text", tmp_path, str(_small_text(tmp_path)), dataset_name="notes")
    starts = tmp_path / "notes" / "valid.starts.bin"
    good = starts.read_bytes()
    starts.write_bytes(good[:-1])
    with pytest.raises(DataError, match=f"{starts} is missing or holds other than the 1 document starts"):
        Dataset.open("notes", tmp_path)
    starts.write_bytes(bytes([good[0] ^ 1]) + good[1:])
    with pytest.raises(DataError, match=f"{starts} does not match its checksum"):
        Dataset.open("notes", tmp_path)
    starts.unlink()
    with pytest.raises(DataError, match=f"{starts} is missing"):
        Dataset.open("notes", tmp_path)


def test_document_starts_that_cannot_be_are_refused_before_anything_is_written(tmp_path) -> None:
    from routeformer.data.store import DatasetMeta, write_dataset

    meta = DatasetMeta("bad", "bytes", 256, "uint8", {}, {}, source="test")
    splits = {s: [np.zeros(10, dtype=np.uint8)] for s in ("train", "valid", "test")}
    starts = {"train": np.array([0, 5], dtype=np.int64), "valid": np.array([1], dtype=np.int64),
              "test": np.array([0], dtype=np.int64)}
    with pytest.raises(DataError, match="the valid split's document starts must be increasing int64 offsets from 0"):
        write_dataset(tmp_path / "bad", meta, splits, starts=starts)
    assert not (tmp_path / "bad").exists()


def test_training_rows_carry_their_documents_cut_and_repeated_rows_included() -> None:
    """The document of every token of a row, from the split's starts (issue 71): tokens t hold t, documents start at
    0, 10, 25 and 40 of 60 tokens; cut rows keep their pieces' ids; a row of repeated text is one document."""
    tokens = np.arange(60)
    starts = np.array([0, 10, 25, 40], dtype=np.int64)
    sampler = BatchSampler(tokens, 16, 4, seed=1, documents=starts)
    rows, documents, scored = sampler.rows(3)
    assert torch.equal(rows, sampler.batch(3)) and scored is None  # every prediction counts
    want = torch.tensor([[sum(int(t) >= s for s in starts) - 1 for t in row] for row in rows])
    assert torch.equal(documents, want)
    cut, cut_documents, _ = sampler.rows(3, length=8)
    assert torch.equal(cut_documents, torch.tensor([[sum(int(t) >= s for s in starts) - 1 for t in row]
                                                    for row in cut]))
    taught = BatchSampler(tokens, 16, 4, seed=1, documents=starts, repeats=RepeatCurriculum(steps=5, share=1.0))
    repeated, repeated_documents, _ = taught.rows(2)
    assert not torch.equal(repeated, sampler.batch(2)) and int(repeated_documents.abs().sum()) == 0
    assert BatchSampler(tokens, 16, 4, seed=1).rows(3).documents is None


def test_evaluation_windows_carry_their_documents() -> None:
    """Windows of 8 + 1 tokens of a split of 20 whose documents start at 0, 6 and 15: ids written out."""
    windows = eval_windows(20, 8)
    batches = list(window_batches(np.arange(20), windows, 8, batch=2, starts=np.array([0, 6, 15], dtype=np.int64)))
    documents = torch.cat([b[2] for b in batches[:1]])
    assert documents.tolist() == [[0, 0, 0, 0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 2, 2]]
    assert batches[1][2].tolist() == [[2, 2, 2, 2]]  # the last window: tokens 16 … 19


def test_first_fit_puts_each_item_in_the_lowest_bin_with_room() -> None:
    """Worked by hand, capacity 8: 5 -> bin 0 (room 3), 4 -> bin 1 (room 4), 3 -> bin 0 (room 0), 2 -> bin 1; then
    8 opens bin 2, 3 -> bin 3 (no room before it), 6 -> bin 4, 2 -> bin 1 (room 2 -> 0), 5 -> bin 3 (room 0), 1 ->
    bin 4 (room 2 -> 1)."""
    from routeformer.data import first_fit

    assert first_fit(np.array([5, 4, 3, 2]), 8).tolist() == [0, 1, 0, 1]
    assert first_fit(np.array([5, 4, 3, 2, 8, 3, 6, 2, 5, 1]), 8).tolist() == [0, 1, 0, 1, 2, 3, 4, 1, 3, 4]
    with pytest.raises(ValueError, match=r"every length must be in \[1, capacity=8\], got 1 … 9"):
        first_fit(np.array([1, 9]), 8)


def _packed_split() -> tuple[np.ndarray, np.ndarray]:
    """A split whose token t is t (no two equal), with documents of 1, 3, 40, 7, 17, 2, 25 and 5 tokens."""
    lengths = [1, 3, 40, 7, 17, 2, 25, 5]
    return np.arange(sum(lengths)), np.cumsum([0, *lengths[:-1]]).astype(np.int64)


def test_packed_rows_hold_whole_documents_each_prediction_once_and_within_its_document() -> None:
    """pack = "documents" (issue 71): rows of 12 tokens. A document of up to 12 tokens is one piece, a longer one
    pieces of 12 every 11; every token but a document's first is a scored target exactly once over all rows, and
    only from its own document; the rest of a row is padding, a document of its own, never scored."""
    from routeformer.data import PackedRows

    tokens, starts = _packed_split()
    packed = PackedRows(tokens, starts, 12, seed=0)
    rows = packed.rows(list(range(len(packed))))
    owner = np.searchsorted(starts, tokens, side="right") - 1  # each token's document in the split
    targets: list[int] = []
    for row, documents, scored in zip(rows.tokens.tolist(), rows.documents.tolist(), rows.scored.tolist(), strict=True):
        assert documents == sorted(documents) and documents[0] == 0
        for j in range(11):
            same = documents[j] == documents[j + 1]
            if scored[j]:
                assert same and row[j + 1] == row[j] + 1 and owner[row[j]] == owner[row[j + 1]]
                targets.append(row[j + 1])
            else:  # the end of a piece or padding
                assert not same or row[j + 1] == 0
    firsts = set(starts.tolist())
    assert sorted(targets) == [t for t in tokens.tolist() if t not in firsts]  # each once, none a document's first
    # pieces: 3; 12, 12, 12, 7 (the 40-token document, every 11); 7; 12, 6; 2; 12, 12, 3; 5 (the 1-token none)
    assert sorted(packed.sizes.tolist()) == sorted([3, 12, 12, 12, 7, 7, 12, 6, 2, 12, 12, 3, 5])
    assert len(packed) < len(packed.sizes)  # short pieces share rows


def test_packed_rows_are_a_function_of_the_seed_drawn_by_step_cut_and_repeated() -> None:
    from routeformer.data import PackedRows

    tokens, starts = _packed_split()
    packed = PackedRows(tokens, starts, 17, seed=4)
    sampler = BatchSampler(tokens, 16, 4, seed=1, documents=packed)
    again = BatchSampler(tokens, 16, 4, seed=1, documents=PackedRows(tokens, starts, 17, seed=4))
    assert all(torch.equal(a, b) for a, b in zip(sampler.rows(3), again.rows(3), strict=True))
    ranks = [BatchSampler(tokens, 16, 4, seed=1, documents=packed, share=(r, 2)) for r in range(2)]
    assert torch.equal(torch.cat([ranks[r].rows(3).scored for r in range(2)]), sampler.rows(3).scored)
    whole, cut = sampler.rows(3), sampler.rows(3, length=8)  # cut into rows of 8 + 1: the same predictions
    assert torch.equal(cut.scored, whole.scored.reshape(8, 8))
    assert torch.equal(cut.tokens[:, :-1], whole.tokens[:, :-1].reshape(8, 8))
    taught = BatchSampler(tokens, 16, 4, seed=1, documents=packed,
                          repeats=RepeatCurriculum(steps=5, share=1.0))
    repeated = taught.rows(2)  # a row of repeated text: one document, every prediction counting
    assert int(repeated.documents.abs().sum()) == 0 and bool(repeated.scored.all())
    with pytest.raises(DataError, match=r"packed rows of 17 tokens for rows of seq_len \+ 1 = 13"):
        BatchSampler(tokens, 12, 4, seed=1, documents=packed)
