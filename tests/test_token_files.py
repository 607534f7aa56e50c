"""--train-data/--val-data as nanoGPT's and llm.c's users bring them: `.bin` files of raw uint16 ids
and llm.c's shards, written here the way those projects' scripts write them, read memory-mapped
and refused in one line where their size or header lies; and text files tokenised in pieces whose
ids are the whole text's."""

import io
import resource

import numpy as np
import pytest
from conftest import TINY, fails
from hypothesis import given, settings
from hypothesis import strategies as st

import train_minimal
from minigpt.config import EOT, GPT2_VOCAB, UsageError, parse_args
from minigpt.core import data, tokens
from minigpt.core.data import builtin_split, gpt2_tokenizer
from minigpt.core.tokens import load_files, user_tokens

RUN = [a for a in TINY if a != "--use-toy-data"] + ["--peak-tflops", "1", "--no-report", "--num-steps", "2"]


def nanogpt_bin(path, ids) -> None:
    """As nanoGPT's data/openwebtext/prepare.py writes train.bin: np.memmap of dtype uint16, no header."""
    arr = np.memmap(path, dtype=np.uint16, mode="w+", shape=(len(ids),))
    arr[:] = ids
    arr.flush()


def llmc_shard(path, ids, count=None, version=1, magic=20240520) -> None:
    """As llm.c's dev/data/data_common.py write_datafile: 256 int32 (magic, version, token count),
    then the ids as uint16."""
    header = np.zeros(256, dtype=np.int32)
    header[:3] = magic, version, len(ids) if count is None else count
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(ids, dtype=np.uint16).tobytes())


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(data.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def corpus() -> np.ndarray:
    return np.asarray(data.builtin_tokens()[0][:20_000])


def test_a_nanogpt_bin_and_llmc_shards_read_as_the_ids_written(tmp_path, corpus):
    nanogpt_bin(tmp_path / "train.bin", corpus)
    folder = tmp_path / "fineweb10B"
    folder.mkdir()
    for k, part in enumerate(np.array_split(corpus, 3)):
        llmc_shard(folder / f"fineweb_train_{k:06d}.bin", part)
    llmc_shard(folder / "fineweb_val_000000.bin", corpus[:100])
    whole = load_files([str(tmp_path / "train.bin")], "--train-data", "gpt2", say=False)
    assert isinstance(whole.parts[0], np.memmap) and np.array_equal(whole, corpus)  # mapped, not copied
    pattern = load_files([str(folder / "fineweb_train_*.bin")], "--train-data", "gpt2", say=False)
    joined = np.concatenate([np.append(p, EOT) for p in np.array_split(corpus, 3)])[:-1]
    assert np.array_equal(pattern, joined)  # shards in order, an <|endoftext|> between two
    with pytest.raises(
        UsageError, match=r"validation files \(fineweb_val_000000\.bin\): e\.g\. --train-data '"
    ):
        load_files([str(folder)], "--train-data", "gpt2", say=False)  # llm.c's folder: never its val shard
    (folder / "fineweb_val_000000.bin").unlink()
    everything = load_files([str(folder)], "--train-data", "gpt2", say=False)  # a folder: all its shards
    assert np.array_equal(everything, joined)
    nanogpt = tmp_path / "shakespeare"  # nanoGPT's prepare.py: train.bin and val.bin side by side
    nanogpt.mkdir()
    for name in ("train.bin", "val.bin"):
        nanogpt_bin(nanogpt / name, corpus[:100])
    with pytest.raises(UsageError, match=rf"--val-data '{nanogpt}/\*val\*\.bin'"):
        load_files([str(nanogpt)], "--train-data", "gpt2", say=False)
    (nanogpt / "val.bin").rename(nanogpt / "test.bin")  # held out too; '*val*.bin' would miss it
    with pytest.raises(UsageError, match=r"files \(test\.bin\): give --train-data and --val-data their"):
        load_files([str(nanogpt)], "--train-data", "gpt2", say=False)
    (nanogpt / "test.bin").rename(nanogpt / "retrieval_interval.bin")  # a split is a word of the name
    assert len(load_files([str(nanogpt)], "--train-data", "gpt2", say=False)) == 201  # two files, no split


def test_a_run_trains_and_validates_on_token_files(tmp_path, corpus, capsys):
    nanogpt_bin(tmp_path / "train.bin", corpus)
    llmc_shard(tmp_path / "val.bin", corpus[:2000])
    out = tmp_path / "run"
    args = [*RUN, "--train-data", str(tmp_path / "train.bin"), "--val-data", str(tmp_path / "val.bin")]
    assert train_minimal.cli([*args, "--out-dir", str(out)]) == 0
    log = (out / "train.log").read_text()
    assert "20,000 training tokens, 2,000 validation" in log and "val " in log


@pytest.mark.parametrize(
    "write, says",
    [
        (lambda p: p.write_bytes(b"\x01\x02\x03"), "3 bytes are not uint16 ids"),
        (lambda p: p.write_bytes(b""), "0 bytes are not uint16 ids"),
        (lambda p: llmc_shard(p, range(100), count=10**6), "says 1,000,000 tokens, its 1,224 bytes hold 100"),
        (lambda p: llmc_shard(p, range(100), count=-5), "header says -5 tokens: empty or damaged"),
        (lambda p: llmc_shard(p, range(100), count=0), "header says 0 tokens: empty or damaged"),
        (lambda p: llmc_shard(p, range(100), version=2), "version 2; version 1 (uint16 ids) is read"),
        (lambda p: llmc_shard(p, [], count=10), "its header says 10 tokens"),
    ],
    ids=["odd size", "empty", "header too long", "negative count", "zero count", "uint32 shard", "no ids"],
)
def test_a_token_file_whose_size_or_header_lies_is_one_line(tmp_path, capsys, write, says):
    path = tmp_path / "train.bin"
    write(path)
    before = path.read_bytes()
    msg = fails(capsys, *RUN, "--train-data", str(path), "--out-dir", str(tmp_path / "r"))
    assert says in msg and "--train-data" in msg and str(path) in msg
    assert path.read_bytes() == before and not (tmp_path / "r").exists()  # refused before the run's folder


def test_ids_past_the_vocabulary_are_one_line_naming_the_file(tmp_path, corpus, capsys):
    bad = corpus.copy()
    bad[5000:] = 60_000  # past GPT-2's 50,257: the embedding would index out of its table
    nanogpt_bin(tmp_path / "train.bin", bad)
    msg = fails(capsys, *RUN, "--train-data", str(tmp_path / "train.bin"), "--out-dir", str(tmp_path / "r"))
    assert "train.bin holds id 60,000, past the tokenizer's 50,257" in msg
    log = (
        (tmp_path / "r" / "train.log").read_text().splitlines()
    )  # found in the loop: the log says why it ended
    assert log[-1].endswith(f"error: {msg.strip().removeprefix('error: ')}"), log[-3:]
    ids = load_files([str(tmp_path / "train.bin")], "--train-data", "gpt2", False)
    with pytest.raises(UsageError):
        np.asarray(ids[4990:5010])  # a window that reaches the bad ids
    assert np.asarray(ids[:5000]).max() < GPT2_VOCAB  # one before them: trains


@pytest.mark.parametrize("what", ["pattern", "folder"])
def test_a_pattern_or_folder_with_no_token_file_is_one_line(tmp_path, capsys, what):
    (tmp_path / "empty").mkdir()
    arg = str(tmp_path / "nothing_*.bin") if what == "pattern" else str(tmp_path / "empty")
    msg = fails(capsys, *RUN, "--train-data", arg, "--out-dir", str(tmp_path / "r"))
    assert ("matches no file" if what == "pattern" else "holds no .bin token files") in msg


def test_a_10_gb_token_file_is_mapped_not_read(tmp_path):
    """Mapped, not read: a sparse 10 GiB file (no disk used) is ready after a header's read. The
    kernel's counts, not a clock: the bytes read through read() stay under a megabyte, and the
    process's peak resident memory grows by less than a gigabyte (a copy of the ids would be 10)."""
    big = tmp_path / "huge.bin"
    with open(big, "wb") as f:
        f.truncate(10 << 30)
    cfg = parse_args(["--train-data", str(big)])
    rchar = lambda: int(open("/proc/self/io").read().split("rchar:")[1].split()[0])  # noqa: E731
    peak_rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10  # noqa: E731 (KiB on Linux)
    before, peak_before = rchar(), peak_rss()
    train, val, _ = user_tokens(cfg, is_main=True)
    window = np.asarray(train[4_000_000_000:4_000_000_065])
    assert len(train) + len(val) == 5 << 30 and window.shape == (65,)
    assert rchar() - before < 1 << 20, rchar() - before
    assert peak_rss() - peak_before < 1 << 30, peak_rss() - peak_before


# ---------------------------------------------------------------------------- text, streamed


def stream(text: str, piece: int, monkeypatch) -> np.ndarray:
    monkeypatch.setattr(tokens, "PIECE", piece)
    out, raw = io.BytesIO(), text.encode()
    tokens.tokenise(io.BytesIO(raw), out, "t.txt", len(raw), gpt2_tokenizer(), say=False)
    return np.frombuffer(out.getvalue(), "<u2")


@pytest.mark.parametrize("piece", [257, 4096, 1 << 20])
def test_a_text_tokenised_in_pieces_has_the_whole_texts_ids(piece, monkeypatch):
    text = builtin_split(pieces=1)[0][:300_000] + "\n中文。\n\u00a0x  y\u3000z 'll it's\r\n\tend  \n"
    assert stream(text, piece, monkeypatch).tolist() == gpt2_tokenizer().encode_ordinary(text)


@settings(max_examples=200, deadline=None)
@given(st.text(st.sampled_from(list("ab1 \n\t.'s\u00a0\u3000é中🙂\r")), max_size=400), st.integers(1, 64))
def test_any_text_in_any_pieces_has_the_whole_texts_ids(text, piece):
    with pytest.MonkeyPatch.context() as mp:
        assert stream(text, piece, mp).tolist() == gpt2_tokenizer().encode_ordinary(text)


def test_a_big_text_is_said_as_it_goes_and_cached(tmp_path, cache, monkeypatch, capsys):
    monkeypatch.setattr(tokens, "PIECE", 1 << 14)
    monkeypatch.setattr(tokens, "SAY_EVERY_S", 0.0)
    text = tmp_path / "big.txt"
    text.write_text(builtin_split(pieces=1)[0][:200_000])
    ids = load_files([str(text)], "--train-data", "gpt2", say=True)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"note: tokenising {text} with gpt2, once")
    progress = [line for line in err if line.startswith(f"tokenising {text}: ")]
    assert len(progress) > 5 and progress[-1].split(": ")[1].startswith("100% of 0 MiB")
    assert isinstance(ids.parts[0], np.memmap) and len(list((cache / "tokens").glob("*.tok"))) == 1
    load_files([str(text)], "--train-data", "gpt2", say=True)
    assert capsys.readouterr().err == ""  # the second time: the cache, silently


def test_a_text_that_is_not_utf8_is_one_line_with_its_offset(tmp_path, cache, capsys):
    text = tmp_path / "latin1.txt"
    text.write_bytes(b"plain words " * 100 + "café".encode("latin-1"))
    msg = fails(capsys, *RUN, "--train-data", str(text), "--out-dir", str(tmp_path / "r"))
    assert "is not UTF-8 text (near byte 1,203)" in msg
    assert not list((cache / "tokens").glob("*")) if cache.exists() else True  # no half-written cache
