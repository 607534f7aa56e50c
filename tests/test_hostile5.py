"""The fifth hostile round (issue 47): run files and folders that are links to files elsewhere, FIFOs
where a cache or a lock is opened, text tokenised in pieces, a token cache filed under another
text's name, a --resume that changes the run, consoles that die (stdout closed, a pipe closed
early, /dev/full), a rank lost mid-collective, messages that named the other program's flags, and
the smaller ones (SIGHUP, HOME empty, a cache that cannot be written). Each ends in its one line
(exit 2 for a user's mistake, 1 for a fault) or the right behaviour; nothing outside the run
directory is written and nothing is lost. COUNTS says how many inputs each group tries
(tests/test_hostile.py adds them up)."""

import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, TINY
from test_nothing_lost import FAST, copy_run, one_line_exit_2, tree

import sample
import train_minimal
from minigpt.config import UsageError, parse_args
from minigpt.core import data as data_module
from minigpt.core import tokens
from minigpt.core.checkpoint import CHECKSUM_KEY, save_checkpoint
from minigpt.core.guards import SHARDED_META, check_sharded_path, sharded_flags
from minigpt.instruments import peak
from minigpt.instruments.mfu import resolve_amp

WAIT_S = 30  # an open() that blocks (a FIFO) is a failure after this long, not a hung test


@contextlib.contextmanager
def no_hang(seconds: float = WAIT_S):
    """SIGALRM after `seconds`: a blocking open() of a FIFO fails the test instead of hanging it."""

    def hung(signum, frame):
        raise AssertionError(f"blocked for {seconds} s (an open() of a FIFO?)")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def status_and_err(capsys, argv: list[str], on_step=None) -> tuple[int, str]:
    with no_hang():
        status = train_minimal.cli(argv, on_step)
    return status, capsys.readouterr().err


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under `root` (files by their bytes, links by their target, FIFOs and folders by
    their kind): what a run must leave as it was."""
    out = {}
    for p in sorted(root.rglob("*")):
        mode = os.lstat(p).st_mode
        if stat.S_ISLNK(mode):
            out[str(p)] = "link " + os.readlink(p)
        elif stat.S_ISREG(mode):
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[str(p)] = "fifo" if stat.S_ISFIFO(mode) else "dir"
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """One tiny run of 2 steps with its checkpoint, on toy data."""
    out = tmp_path_factory.mktemp("hostile5") / "run"
    assert train_minimal.cli([*FAST, "--num-steps", "2", "--log-interval", "1", "--out-dir", str(out)]) == 0
    return out


def outside(tmp_path: Path) -> Path:
    """Files of the user's elsewhere, which no run may write: a file, a FIFO, a folder with a file."""
    where = tmp_path / "outside"
    (where / "dir").mkdir(parents=True)
    (where / "victim.txt").write_text("the user's own file\n")
    (where / "dir" / "kept.txt").write_text("kept\n")
    os.mkfifo(where / "fifo")
    return where


# ---------------------------------------------------------------------------- 1. links in the run directory

APPENDED = ["train.log", "metrics.jsonl", "stragglers.jsonl"]  # opened O_APPEND: a link is refused
RENAMED = ["config.json", "report.html"]  # renamed into place: the link is replaced, never followed
TARGETS = {
    "a file outside": lambda o: o / "victim.txt",
    "a link to nothing": lambda o: o / "nothing-here",
    "a FIFO outside": lambda o: o / "fifo",
    "a folder outside": lambda o: o / "dir",
    "/dev/null": lambda o: Path("/dev/null"),
}


def expected_refusal(name: str, target: str) -> bool:
    """A link is refused where the run appends (it would write through it), or where what it
    points at is not a file (a FIFO, a folder): config.json there would end the start halfway."""
    return name in APPENDED or target in ("a FIFO outside", "a folder outside", "/dev/null")


@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("name", APPENDED + RENAMED)
def test_a_run_file_that_is_a_link_is_never_written_through(capsys, run, tmp_path, name, target, resume):
    where = outside(tmp_path)
    out = copy_run(run, tmp_path) if resume else tmp_path / "run"
    out.mkdir(exist_ok=True)
    (out / name).unlink(missing_ok=True)
    (out / name).symlink_to(TARGETS[target](where))
    before = snapshot(where)
    argv = [*FAST, "--num-steps", "3" if resume else "2", "--out-dir", str(out), *["--resume"] * resume]
    status, err = status_and_err(capsys, argv)
    assert snapshot(where) == before  # nothing outside written, nothing made at a link to nothing
    if expected_refusal(name, target):
        lines = err.strip().splitlines()
        assert status == 2 and len(lines) == 1 and "Traceback" not in err, err
        assert str(out / name) in lines[0] and "link" in lines[0], lines[0]
    else:
        assert status == 0, err
        if name == "config.json":  # replaced by the run's own file
            assert not (out / name).is_symlink() and json.loads((out / name).read_text())["config"]


# tb/ or checkpoints/ a link to a folder: the user's choice, said in the log; to nothing or to a
# file it cannot hold the run's files: one line before any work.
FOLDERS = ["tb", "traces", "snapshots", "memory_trace", "checkpoints"]
BAD_FOLDER_TARGETS = ["a link to nothing", "a file outside", "a FIFO outside"]


@pytest.mark.parametrize("target", BAD_FOLDER_TARGETS)
@pytest.mark.parametrize("name", FOLDERS)
def test_a_run_folder_that_is_a_link_to_no_folder_is_one_line(capsys, tmp_path, name, target):
    where = outside(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    (out / name).symlink_to(TARGETS[target](where))
    before = snapshot(where)
    status, err = status_and_err(capsys, [*FAST, "--num-steps", "2", "--out-dir", str(out)])
    line = one_line_exit_2_err(status, err)
    assert str(out / name) in line and "Errno" not in line, line
    assert snapshot(where) == before


def one_line_exit_2_err(status: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("name, flags", [("checkpoints", []), ("tb", [])])
def test_a_run_folder_linked_to_a_folder_elsewhere_is_said_in_the_log(tmp_path, name, flags):
    where = tmp_path / "elsewhere"
    where.mkdir()
    out = tmp_path / "run"
    out.mkdir()
    (out / name).symlink_to(where)
    assert train_minimal.cli([*FAST, *flags, "--num-steps", "2", "--out-dir", str(out)]) == 0
    log = (out / "train.log").read_text()
    assert f"{name}/ is a link: what the run keeps there goes to {where}" in log, log
    assert any(where.iterdir())  # the user meant it: the run wrote there, and said so


@pytest.mark.parametrize("name", APPENDED)
def test_a_run_file_with_a_second_name_is_refused(capsys, tmp_path, name):
    where = outside(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    os.link(where / "victim.txt", out / name)
    before = snapshot(where)
    status, err = status_and_err(capsys, [*FAST, "--num-steps", "2", "--out-dir", str(out)])
    assert "hard link" in one_line_exit_2_err(status, err)
    assert snapshot(where) == before


# The run folder itself is flock'ed: a .lock the user (or an older minigpt) left is nobody's lock.
LOCK_LEFTOVERS = {
    "a link to a file outside": lambda o, p: p.symlink_to(o / "victim.txt"),
    "a FIFO": lambda o, p: os.mkfifo(p),
    "a link to a FIFO outside": lambda o, p: p.symlink_to(o / "fifo"),
    "a folder": lambda o, p: p.mkdir(),
    "a link to nothing": lambda o, p: p.symlink_to(o / "nothing-here"),
}


@pytest.mark.parametrize("what", list(LOCK_LEFTOVERS))
def test_a_lock_file_left_in_the_run_folder_truncates_nothing(capsys, run, tmp_path, what):
    where = outside(tmp_path)
    out = copy_run(run, tmp_path)
    LOCK_LEFTOVERS[what](where, out / ".lock")
    before = snapshot(where)
    status, err = status_and_err(capsys, [*FAST, "--resume", "--num-steps", "3", "--out-dir", str(out)])
    assert status == 0 and "Traceback" not in err, err
    assert snapshot(where) == before


# The lock beside a --checkpoint-path of its own (.NAME.lock): a link or a FIFO there is one line.
CHECKPOINT_LOCKS = {
    "a link to a file outside": lambda o, p: p.symlink_to(o / "victim.txt"),
    "a link to nothing": lambda o, p: p.symlink_to(o / "nothing-here"),
    "a FIFO": lambda o, p: os.mkfifo(p),
    "a link to a FIFO outside": lambda o, p: p.symlink_to(o / "fifo"),
    "a folder": lambda o, p: p.mkdir(),
}


@pytest.mark.parametrize("what", list(CHECKPOINT_LOCKS))
def test_the_lock_beside_a_checkpoint_path_is_never_a_link_or_a_fifo(capsys, tmp_path, what):
    where = outside(tmp_path)
    ckpt = tmp_path / "weights" / "ckpt.pt"
    ckpt.parent.mkdir()
    CHECKPOINT_LOCKS[what](where, ckpt.parent / ".ckpt.pt.lock")
    before = snapshot(where)
    argv = [*FAST, "--num-steps", "2", "--out-dir", str(tmp_path / "run"), "--checkpoint-path", str(ckpt)]
    status, err = status_and_err(capsys, argv)
    line = one_line_exit_2_err(status, err)
    assert ".ckpt.pt.lock" in line and "Errno" not in line, line
    assert snapshot(where) == before and not ckpt.exists()


def test_a_checkpoint_path_that_is_a_link_is_replaced_not_written_through(capsys, run, tmp_path):
    """--resume from a checkpoint reached through a link: it is read, and the save renames over the
    link; the file it pointed at (another run's) keeps its bytes. A link to nothing: the save is the
    run's own file; nothing is made where it pointed. A link to a file, without --resume: the
    'already exists' line."""
    where = outside(tmp_path)
    theirs = where / "their-ckpt.pt"
    theirs.write_bytes((run / "checkpoints" / "ckpt.pt").read_bytes())
    before = snapshot(where)
    for k, (points_at, resume, want) in enumerate(
        [(theirs, True, 0), (where / "nothing-here.pt", False, 0), (theirs, False, 2)]
    ):
        ckpt = tmp_path / f"mine{k}" / "ckpt.pt"
        ckpt.parent.mkdir()
        ckpt.symlink_to(points_at)
        argv = [
            *FAST,
            "--num-steps",
            "3",
            "--out-dir",
            str(tmp_path / f"run{k}"),
            "--checkpoint-path",
            str(ckpt),
        ]
        status, err = status_and_err(capsys, [*argv, *["--resume"] * resume])
        assert status == want, err
        if want == 2:
            assert "already exists" in one_line_exit_2_err(status, err)
        else:
            assert not ckpt.is_symlink() and ckpt.is_file()
        assert snapshot(where) == before


# ---------------------------------------------------------------------------- 2. FIFOs at cache paths

PEAK_CACHE_DAMAGE = {
    "a FIFO": lambda p, o: os.mkfifo(p),
    "a link to a FIFO outside": lambda p, o: p.symlink_to(o / "fifo"),
    "a folder": lambda p, o: p.mkdir(),
    "a link to a file outside": lambda p, o: p.symlink_to(o / "victim.txt"),
    "a link to nothing": lambda p, o: p.symlink_to(o / "nothing-here"),
    "/dev/zero": lambda p, o: p.symlink_to("/dev/zero"),
    "a sparse 10 GiB file": lambda p, o: open(p, "wb").truncate(10 << 30),  # noqa: SIM115
    "not JSON": lambda p, o: p.write_text("{not json"),
    "a JSON list": lambda p, o: p.write_text("[1, 2]"),
    "an entry of junk": lambda p, o: p.write_text('{"cpu": {"best": "fast"}}'),
    "nested 100,000 deep": lambda p, o: p.write_text("[" * 100_000 + "]" * 100_000),
}


@pytest.fixture
def quick_peak(monkeypatch, tmp_path):
    """The peak measured in milliseconds, into a cache folder of this test's own."""
    monkeypatch.setattr(peak, "SIZES", (64,))
    monkeypatch.setattr(peak, "CALLS_S", 0.01)
    monkeypatch.setattr(peak, "UNWRITABLE", set())
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(cache))
    return cache


@pytest.mark.parametrize("what", list(PEAK_CACHE_DAMAGE))
def test_the_peak_cache_is_never_waited_on_nor_written_through(capsys, tmp_path, quick_peak, what):
    where = outside(tmp_path)
    PEAK_CACHE_DAMAGE[what](quick_peak / peak.PEAK_CACHE_FILE, where)
    before = snapshot(where)
    argv = [*TINY, "--no-report", "--num-steps", "2", "--out-dir", str(tmp_path / "run")]
    status, err = status_and_err(capsys, argv)
    assert status == 0 and "Traceback" not in err, err
    assert snapshot(where) == before
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["peak_flops"] > 0, config


def test_a_cache_folder_that_cannot_be_written_is_said_once(capsys, tmp_path, monkeypatch, quick_peak):
    """Two dtypes measured (a CPU whose bf16 is not native), a cache that cannot be made: one note."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(peak, "peak_dtypes", lambda device: ("bf16", "fp32"))
    argv = [*TINY, "--no-report", "--num-steps", "2", "--out-dir", str(tmp_path / "run")]
    status, err = status_and_err(capsys, argv)
    assert status == 0, err
    assert err.count("the MFU peak is not cached") == 1, err


HOMES = {"HOME empty": "", "HOME unset": None}


@pytest.mark.parametrize("home", list(HOMES))
def test_an_empty_home_is_the_accounts_home_not_the_root(monkeypatch, home):
    import pwd

    monkeypatch.delenv("MINIGPT_CACHE_DIR", raising=False)
    if HOMES[home] is None:
        monkeypatch.delenv("HOME", raising=False)
    else:
        monkeypatch.setenv("HOME", HOMES[home])
    want = Path(pwd.getpwuid(os.getuid()).pw_dir, ".cache", "minigpt")
    assert data_module.cache_dir() == want and str(data_module.cache_dir()) != "/.cache/minigpt"


def test_a_cache_dir_given_wins_over_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", "")
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path))
    assert data_module.cache_dir() == tmp_path


# ---------------------------------------------------------------------------- 2-3. the token cache

TRAIN_TEXT = "The quick brown fox jumps over the lazy dog. " * 40 + "Training text ends here.\n"
VAL_TEXT = "Held-out words about a different subject, colourless green ideas. " * 30 + "Validation.\n"


@pytest.fixture
def texts(tmp_path, monkeypatch):
    """A training and a validation text, and a token cache of this test's own."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(cache))
    train, val = tmp_path / "train.txt", tmp_path / "val.txt"
    train.write_text(TRAIN_TEXT)
    val.write_text(VAL_TEXT)
    return train, val, cache / "tokens"


def ids_of(path: Path) -> list[int]:
    return list(np.asarray(tokens.load_files([str(path)], "--train-data", "gpt2", True)))


def cache_file(folder: Path, stem: str) -> Path:
    (found,) = folder.glob(f"{stem}-*.tok")
    return found


# What is put at the training text's cache file, once both texts are cached: each is ignored (the
# text tokenised again, its own ids), and nothing it points at is written.
TOKEN_CACHE_DAMAGE = {
    "the validation text's cache copied over it": lambda t, v, o: shutil.copyfile(v, t),
    "a link to the validation text's cache": lambda t, v, o: (t.unlink(), t.symlink_to(v)),
    "a link to a file outside": lambda t, v, o: (t.unlink(), t.symlink_to(o / "victim.txt")),
    "a link to nothing": lambda t, v, o: (t.unlink(), t.symlink_to(o / "nothing-here")),
    "a FIFO": lambda t, v, o: (t.unlink(), os.mkfifo(t)),
    "a link to a FIFO outside": lambda t, v, o: (t.unlink(), t.symlink_to(o / "fifo")),
    "a folder": lambda t, v, o: (t.unlink(), t.mkdir()),
    "its header's count cut by one": lambda t, v, o: edit_header(t, count=-1),
    "its key's last byte flipped": lambda t, v, o: edit_header(t, flip=True),
    "cut short": lambda t, v, o: t.write_bytes(t.read_bytes()[:-2]),
    "an id past the vocabulary": lambda t, v, o: t.write_bytes(t.read_bytes()[:-2] + b"\xff\xff"),
    "empty": lambda t, v, o: t.write_bytes(b""),
}


def edit_header(path: Path, count: int = 0, flip: bool = False) -> None:
    raw = bytearray(path.read_bytes())
    magic, n, key = data_module.HEADER.unpack(raw[: data_module.HEADER.size])
    key = key[:-1] + bytes([key[-1] ^ 1]) if flip else key
    raw[: data_module.HEADER.size] = data_module.HEADER.pack(magic, n + count, key)
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("what", list(TOKEN_CACHE_DAMAGE))
def test_a_token_cache_is_bound_to_its_own_text(capsys, tmp_path, texts, what):
    train, val, folder = texts
    want, val_ids = ids_of(train), ids_of(val)
    assert want != val_ids
    where = outside(tmp_path)
    TOKEN_CACHE_DAMAGE[what](cache_file(folder, "train"), cache_file(folder, "val"), where)
    before = snapshot(where)
    capsys.readouterr()
    with no_hang():
        got = ids_of(train)
    err = capsys.readouterr().err
    assert got == want, what  # never the held-out text's ids, nor a damaged file's
    assert snapshot(where) == before
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 1, err


def test_a_run_on_a_cache_copied_from_the_validation_text_trains_on_its_own_text(capsys, tmp_path, texts):
    train, val, folder = texts
    flags = [*FAST, "--train-data", str(train), "--val-data", str(val), "--num-steps", "1"]
    flags = [f for f in flags if f != "--use-toy-data"]
    assert train_minimal.cli([*flags, "--out-dir", str(tmp_path / "a")]) == 0
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    shutil.copyfile(cache_file(folder, "val"), cache_file(folder, "train"))
    capsys.readouterr()
    assert train_minimal.cli([*flags, "--out-dir", str(tmp_path / "b")]) == 0
    assert "is not this text's tokens" in capsys.readouterr().err
    log = (tmp_path / "b" / "train.log").read_text()
    assert f"Data: {train}; {len(ids_of(train)):,} training tokens" in log, log
    assert json.loads((tmp_path / "b" / "config.json").read_text())["params"] == config["params"]


# Text tokenised in pieces: the whole text's ids, and a line on how far it got (every 10 s; every
# piece here), whether or not stderr is a terminal.
STREAMED = {
    "ascii words": "word " * 40_000,
    "no spaces at all": "x" * 200_000,
    "lines of unicode": "naïve café — 東京 🙂\n" * 8_000,
    "one long line of digits": "1234567890" * 20_000,
    "paragraphs": ("A paragraph of text.\n\n" * 5 + "  indented\tand tabbed  \n") * 2_000,
    "CRLF lines": "a line\r\n" * 25_000,
    "two-byte characters across every piece's end": "é" * 100_000 + " é\n" * 10_000,
    "emoji words": "🙂 🚀x " * 20_000,
}


@pytest.mark.parametrize("what", list(STREAMED))
def test_text_is_tokenised_in_pieces_with_the_whole_texts_ids_and_says_how_far(capsys, monkeypatch, what):
    monkeypatch.setattr(tokens, "PIECE", 1 << 14)
    monkeypatch.setattr(tokens, "SAY_EVERY_S", 0.0)
    raw = STREAMED[what].encode()
    out = io.BytesIO()
    enc = tokens.encoding("gpt2")
    count = tokens.tokenise(io.BytesIO(raw), out, "big.txt", len(raw), enc, say=True)
    ids = np.frombuffer(out.getvalue(), "<u2").tolist()
    assert count == len(ids) and ids == enc.encode_ordinary(raw.decode()), what
    err = capsys.readouterr().err
    assert "tokenising big.txt: " in err and "MiB" in err, err


@pytest.mark.slow
def test_a_large_text_is_tokenised_in_bounded_memory(tmp_path):
    """64 MiB of text in a fresh process: resident memory stays a few hundred MiB, not the 15x of
    the text that tokenising it whole took (issue 47: 4.82 GB for 315 MB)."""
    big = tmp_path / "big.txt"
    line = "The quick brown fox jumps over the lazy dog; colourless green ideas sleep furiously.\n"
    with open(big, "w") as f:
        for _ in range((64 << 20) // len(line)):
            f.write(line)
    code = textwrap.dedent(
        f"""
        import resource, sys
        from minigpt.core import tokens
        ids = tokens.load_files([{str(big)!r}], "--train-data", "gpt2", True)
        print(len(ids), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        """
    )
    env = {**os.environ, "MINIGPT_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    count, rss_kib = map(int, result.stdout.split())
    assert count > 10_000_000 and rss_kib < 1 << 20, (count, rss_kib)  # under 1 GiB


# ------------------------------------------------------------------ 4. a --resume that changes the run

NATIVE_BF16 = resolve_amp(parse_args(TINY), "cpu")[0] == "bf16"
# (the flags of the resume, what the refusal names): each changes what the run is
CHANGES = [
    (["--batch-size", "4"], "--batch-size 8 -> 4"),
    (["--grad-accum-steps", "2"], "--grad-accum-steps 1 -> 2"),
    (["--lr", "2e-2"], "--lr 0.01 -> 0.02"),
    (["--min-lr", "1e-4"], "--min-lr"),
    (["--lr-scheduler", "linear"], "--lr-scheduler 'cosine' -> 'linear'"),
    (["--warmup-steps", "1"], "--warmup-steps"),
    (["--weight-decay", "0.2"], "--weight-decay"),
    (["--grad-clip", "0.5"], "--grad-clip"),
    (["--seed", "7"], "--seed"),
    (["--data-seed", "7"], "--data-seed"),
    (["--dropout", "0.1"], "--dropout 0.0 -> 0.1"),
    (["--chunked-loss"], "--chunked-loss False -> True"),
    # the precision as this CPU resolves it: AMP is on by default where bf16 is native
    (["--no-amp"], "--amp/--amp-dtype: bf16 -> fp32") if NATIVE_BF16 else (["--amp"], "fp32 -> bf16"),
    (["--lr", "2e-2", "--seed", "9"], "--seed 1337 -> 9; --lr 0.01 -> 0.02"),
]


@pytest.mark.parametrize("flags, named", CHANGES, ids=[" ".join(f) for f, _ in CHANGES])
def test_a_resume_that_changes_the_run_is_refused_in_one_line(capsys, run, tmp_path, flags, named):
    out = copy_run(run, tmp_path)
    before = tree(out)
    status, err = status_and_err(
        capsys, [*FAST, *flags, "--resume", "--num-steps", "3", "--out-dir", str(out)]
    )
    line = one_line_exit_2_err(status, err)
    assert "this --resume changes the run" in line and named in line and "--allow-changes" in line, line
    assert tree(out) == before  # nothing cut, nothing rewritten


@pytest.mark.parametrize("flags, named", CHANGES, ids=[" ".join(f) for f, _ in CHANGES])
def test_allow_changes_continues_and_records_each_change(capsys, run, tmp_path, flags, named):
    out = copy_run(run, tmp_path)
    argv = [*FAST, *flags, "--resume", "--allow-changes", "--num-steps", "3", "--out-dir", str(out)]
    status, err = status_and_err(capsys, argv)
    assert status == 0, err
    recorded = json.loads((out / "config.json").read_text())["config"]["changed_on_resume"]
    assert any(c.startswith("at step 2: ") and named.split(";")[0] in c for c in recorded), recorded
    assert "changed (--allow-changes): " in (out / "train.log").read_text()


# A resume that continues the same run: what it gives differently changes how the run is watched or
# how long it goes, not what it is. Each goes on without --allow-changes, and records no change.
SAME_RUN = [
    ["--num-steps", "4"],
    ["--log-interval", "2"],
    ["--eval-interval", "1"],
    ["--eval-iters", "2"],
    ["--save-interval", "1"],
    ["--lr", "1e-2"],  # the value it had, given again
    ["--seed", "1337"],  # the default, given
    ["--amp"] if NATIVE_BF16 else ["--no-amp"],  # what the default resolved to, given
    ["--amp-dtype", "bf16"],  # the dtype it resolved to, or one --no-amp leaves unused
    ["--min-lr", "1e-3"],  # --lr / 10, as it was derived
    ["--no-stage-timing"],
    ["--no-comm-profile"],
]


@pytest.mark.parametrize("flags", SAME_RUN, ids=[" ".join(f) for f in SAME_RUN])
def test_a_resume_of_the_same_run_needs_no_allow_changes(capsys, run, tmp_path, flags):
    out = copy_run(run, tmp_path)
    argv = [*FAST, "--num-steps", "3", *flags, "--resume", "--out-dir", str(out)]
    status, err = status_and_err(capsys, argv)
    assert status == 0, err
    assert json.loads((out / "config.json").read_text())["config"]["changed_on_resume"] == []


def with_world(run: Path, tmp_path: Path, world: int) -> Path:
    """The run's checkpoint as a job of `world` ranks would have saved it (one RNG state a rank),
    with its checksum."""
    out = copy_run(run, tmp_path)
    ckpt = out / "checkpoints" / "ckpt.pt"
    state = torch.load(ckpt, weights_only=True)
    state.pop(CHECKSUM_KEY)
    state["rng_per_rank"] = (
        [state["rng_per_rank"][0]] * world if state.get("rng_per_rank") else [None] * world
    )
    save_checkpoint(ckpt, state)
    return out


@pytest.mark.parametrize("allow", [False, True], ids=["refused", "allowed"])
def test_a_resume_on_another_world_size_is_a_change(capsys, run, tmp_path, allow):
    out = with_world(run, tmp_path, 2)
    argv = [*FAST, "--resume", "--num-steps", "3", "--out-dir", str(out), *["--allow-changes"] * allow]
    status, err = status_and_err(capsys, argv)
    if not allow:
        assert "world size 2 -> 1" in one_line_exit_2_err(status, err)
    else:
        assert status == 0, err
        recorded = json.loads((out / "config.json").read_text())["config"]["changed_on_resume"]
        assert recorded == ["at step 2: world size 2 -> 1"], recorded


@pytest.fixture(scope="module")
def text_run(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A tiny run of 2 steps on a text file of its own (GPT-2's tokenizer), and another text."""
    where = tmp_path_factory.mktemp("hostile5-text")
    train, other = where / "train.txt", where / "other.txt"
    train.write_text(TRAIN_TEXT * 3)
    other.write_text(VAL_TEXT * 3)
    out = where / "run"
    assert (
        train_minimal.cli(
            [*text_flags(), "--train-data", str(train), "--num-steps", "2", "--out-dir", str(out)]
        )
        == 0
    )
    return out, train, other


def text_flags() -> list[str]:
    return [f for f in FAST if f != "--use-toy-data"]


# (how the data flags are given on resume, refused without --allow-changes?)
DATA_RESUMES = {
    "another --train-data": (lambda t, o, d: ["--train-data", str(o)], True),
    "a --val-data added": (lambda t, o, d: ["--val-data", str(o)], True),
    "--max-tokens": (lambda t, o, d: ["--max-tokens", "1000"], True),
    "two files for one": (lambda t, o, d: ["--train-data", str(t), str(o)], True),
    "the same file, relative": (lambda t, o, d: ["--train-data", os.path.relpath(t)], False),
    "the same file, through a link": (lambda t, o, d: ["--train-data", str(link(d, t))], False),
    "the same file, with ./ and ..": (
        lambda t, o, d: ["--train-data", f"{t.parent}/./../{t.parent.name}/{t.name}"],
        False,
    ),
}


def link(folder: Path, target: Path) -> Path:
    (folder / "link.txt").symlink_to(target)
    return folder / "link.txt"


@pytest.mark.parametrize("what", list(DATA_RESUMES))
def test_a_resume_on_other_data_is_a_change_the_same_data_is_not(capsys, text_run, tmp_path, what):
    run_dir, train, other = text_run
    out = copy_run(run_dir, tmp_path)
    given, changes = DATA_RESUMES[what]
    given = given(train, other, tmp_path)
    given = given if "--train-data" in given else ["--train-data", str(train), *given]
    argv = [*text_flags(), *given, "--resume", "--num-steps", "3", "--out-dir", str(out)]
    status, err = status_and_err(capsys, argv)
    if changes:
        line = one_line_exit_2_err(status, err)
        assert "this --resume changes the run" in line and "--allow-changes" in line, line
    else:
        assert status == 0, err


# ---------------------------------------------------------------------------- 5. dead consoles

TRAIN = [sys.executable, str(ROOT / "train_minimal.py")]
# (the shell's redirection of the trainer's output): the run goes on, its files whole, no traceback
CONSOLES = {
    "stdout closed": "1>&-",
    "stdout to /dev/full": "1>/dev/full",
    "stdout into a pipe closed after one line": "| head -1 >/dev/null",
    "stderr to /dev/full": "2>/dev/full",
    "stdout and stderr to /dev/full": "1>/dev/full 2>&1",
    "stdout closed, stderr into a pipe closed at once": "2>&1 1>&- | true",
}


def shell_run(argv: list[str], redirect: str, tmp_path: Path, timeout: float = 120) -> tuple[int, str]:
    """argv run by sh with `redirect` applied; the trainer's stderr kept in a file where the
    redirection leaves it alone. Returns (the trainer's exit status, its stderr)."""
    err = tmp_path / "stderr.txt"
    quoted = " ".join(f"'{a}'" for a in argv)
    status_file = tmp_path / "status"
    script = f"({quoted} 2>{err} {redirect}; echo $? > {status_file})" if "2>" not in redirect else ""
    if "|" in redirect:  # the trainer's status, not the pipe's last command's
        left, right = redirect.split("|", 1)
        script = f"( {quoted} 2>{err} {left}; echo $? > {status_file} ) | {right}"
    elif "2>" in redirect:
        script = f"{quoted} {redirect}; echo $? > {status_file}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(["sh", "-c", script], cwd=ROOT, timeout=timeout, env=env, capture_output=True)
    return int(status_file.read_text()), err.read_text() if err.exists() else ""


@pytest.mark.parametrize("what", list(CONSOLES))
def test_a_dead_console_is_dropped_and_the_run_keeps_its_files(tmp_path, what):
    out = tmp_path / "run"
    argv = [*TRAIN, *FAST, "--num-steps", "4", "--log-interval", "1", "--out-dir", str(out)]
    status, err = shell_run(argv, CONSOLES[what], tmp_path)
    assert status == 0, err
    for word in ("Traceback", "Logging error", "Exception ignored", "BrokenPipeError", "Errno 28"):
        assert word not in err, err
    log = (out / "train.log").read_text()
    assert "Training started" in log and "Training finished" in log, log
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4
    assert (out / "checkpoints" / "ckpt.pt").is_file()


SAMPLE = [sys.executable, str(ROOT / "sample.py")]
# (the redirection, sample.py's status): a reader that had enough is quiet, a full disk one line
SAMPLE_CONSOLES = {
    "stdout to /dev/full": ("1>/dev/full", 1),
    "stdout into a pipe closed after one line": ("| head -1 >/dev/null", 0),
    "stdout into a pipe closed at once": ("| true", 0),
    "stdout closed": ("1>&-", 0),
}


@pytest.mark.parametrize("what", list(SAMPLE_CONSOLES))
def test_sample_into_a_dead_console_is_one_line_or_quiet(run, tmp_path, what):
    argv = [*SAMPLE, "--out-dir", str(run), "--max-new-tokens", "3", "--num-samples", "3", "--device", "cpu"]
    redirect, want = SAMPLE_CONSOLES[what]
    status, err = shell_run(argv, redirect, tmp_path)
    assert status == want, err
    for word in ("Traceback", "Exception ignored", "BrokenPipeError"):
        assert word not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == (
        ["error: the samples cannot be written to stdout (No space left on device); redirect it"]
        if want
        else []
    ), err


def closed_pipe():
    read, write = os.pipe()
    os.close(read)
    return open(write, "w")  # noqa: SIM115


def closed_file():
    f = open(os.devnull, "w")  # noqa: SIM115
    f.close()
    return f


# sys.stdout as a dead console is: each write (and flush) fails, the run's own log file goes on.
DEAD_STREAMS = {
    "a pipe whose reader is gone": closed_pipe,
    "/dev/full": lambda: open("/dev/full", "w"),  # noqa: SIM115
    "/dev/full, unbuffered": lambda: open("/dev/full", "w", buffering=1),  # noqa: SIM115
    "a closed file (a library closed sys.stdout)": closed_file,
}


# In a process of its own the trainer drops each of these (test_a_dead_console_...); given a stream
# object of its own as sys.stdout, too: Console.handleError swaps in /dev/null without flushing the
# dead stream again (setStream would).
@pytest.mark.parametrize("make", list(DEAD_STREAMS.values()), ids=list(DEAD_STREAMS))
def test_the_log_goes_on_in_the_file_when_the_console_dies(capsys, tmp_path, monkeypatch, make):
    monkeypatch.setattr(sys, "stdout", make())
    out = tmp_path / "run"
    status = train_minimal.cli([*FAST, "--num-steps", "3", "--log-interval", "1", "--out-dir", str(out)])
    err = capsys.readouterr().err
    assert status == 0 and "Logging error" not in err and "Traceback" not in err, err
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    assert "Training finished" in (out / "train.log").read_text()


# ---------------------------------------------------------------------------- 6. a rank lost mid-collective

# What a surviving rank's collective raised (gloo, NCCL, c10d) when its peer died or stopped: each is
# the one line of a lost rank, exit 1 (test_ddp.py runs the real stopped rank under torchrun).
LOST_RANK_ERRORS = [
    "Application timeout caused pair closure",
    "Got the following error when running the callback: RuntimeError: Application timeout caused pair "
    "closure",
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242",
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection reset by peer",
    "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation to complete",
    "[gloo/transport/tcp/unbound_buffer.cc:134] Timed out waiting 20000ms for send operation to complete",
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:446] writev [127.0.0.1]:4242: Broken pipe",
    "NCCL communicator was aborted on rank 0.",
    "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE)",
    "c10d::allreduce_: Socket Timeout",
]


@pytest.mark.parametrize("message", LOST_RANK_ERRORS)
def test_a_collective_that_fails_on_a_lost_rank_is_its_one_line(tmp_path, monkeypatch, message):
    from test_ddp import ranks_of_a_job

    from minigpt.core.distributed import LostRank

    ranks = ranks_of_a_job(tmp_path, monkeypatch, answering=[0])
    with pytest.raises(LostRank) as e, ranks:
        raise RuntimeError(message)
    line = str(e.value)
    assert "\n" not in line and line.startswith("rank 0: lost rank 1"), line
    assert isinstance(e.value, train_minimal.Fault)  # a fault of the machine: exit 1


# ------------------------------------------------------------------ 7. messages that point the right way


def sharded_meta(folder: Path, world: int, tp: int) -> None:
    folder.mkdir(parents=True)
    (folder / SHARDED_META).write_text(json.dumps({"world_size": world, "tp": tp}))


# (where the meta is, world size, tp, the flags the line must name)
SHARDED = [
    ("ckpt", 2, 1, "--fsdp"),
    ("ckpt", 2, 2, "--tp 2"),
    ("ckpt", 4, 2, "--fsdp --tp 2"),
    ("ckpt", 8, 4, "--fsdp --tp 4"),
    ("ckpt.old", 2, 1, "--fsdp"),  # a crash between save_sharded's two renames
    ("ckpt.old", 2, 2, "--tp 2"),
]


@pytest.mark.parametrize("where, world, tp, named", SHARDED, ids=[f"{w}-{n}-{t}" for w, n, t, _ in SHARDED])
def test_a_sharded_checkpoint_resumed_without_its_flags_names_them(capsys, tmp_path, where, world, tp, named):
    out = tmp_path / "run"
    sharded_meta(out / "checkpoints" / where, world, tp)
    status, err = status_and_err(capsys, [*FAST, "--resume", "--num-steps", "3", "--out-dir", str(out)])
    line = one_line_exit_2_err(status, err)
    assert f"add {named} to resume it" in line and "train without --resume" not in line, line


SHARDED_META_DAMAGE = {
    "a FIFO": lambda f: os.mkfifo(f),
    "not JSON": lambda f: f.write_text("{"),
    "world_size a string": lambda f: f.write_text('{"world_size": "two", "tp": 1}'),
    "tp zero": lambda f: f.write_text('{"world_size": 2, "tp": 0}'),
    "a JSON list": lambda f: f.write_text("[2, 1]"),
    "a link to /dev/zero": lambda f: f.symlink_to("/dev/zero"),
}


@pytest.mark.parametrize("what", list(SHARDED_META_DAMAGE))
def test_a_damaged_sharded_meta_gives_the_plain_no_checkpoint_line(capsys, tmp_path, what):
    out = tmp_path / "run"
    (out / "checkpoints" / "ckpt").mkdir(parents=True)
    SHARDED_META_DAMAGE[what](out / "checkpoints" / "ckpt" / SHARDED_META)
    with no_hang():
        assert sharded_flags(out / "checkpoints" / "ckpt") is None
    status, err = status_and_err(capsys, [*FAST, "--resume", "--num-steps", "3", "--out-dir", str(out)])
    assert "no checkpoint at" in one_line_exit_2_err(status, err)


def test_a_one_file_checkpoint_resumed_as_a_sharded_one_says_drop_the_flags(tmp_path):
    ckpt = tmp_path / "checkpoints" / "ckpt.pt"
    ckpt.parent.mkdir()
    ckpt.write_bytes(b"a checkpoint")
    with pytest.raises(UsageError) as e:
        check_sharded_path(tmp_path / "checkpoints" / "ckpt", True, ckpt)
    assert "resume it without --fsdp/--tp" in str(e.value)


def sample_targets(tmp_path: Path, run: Path) -> dict:
    """What a user gives sample.py's --checkpoint or --out-dir that is no checkpoint of theirs."""
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    os.mkfifo(tmp_path / "fifo.pt")
    (tmp_path / "dangling.pt").symlink_to(tmp_path / "nothing-here")
    (tmp_path / "folder-link").symlink_to(run)
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    sharded_meta(tmp_path / "sharded" / "checkpoints" / "ckpt", 2, 1)
    return {
        "--checkpoint README.md": ["--checkpoint", str(ROOT / "README.md")],
        "--checkpoint a folder (/tmp)": ["--checkpoint", "/tmp"],
        "--checkpoint a run folder": ["--checkpoint", str(run)],
        "--checkpoint a link to a run folder": ["--checkpoint", str(tmp_path / "folder-link")],
        "--checkpoint the checkpoints folder": ["--checkpoint", str(run / "checkpoints")],
        "--checkpoint no such file": ["--checkpoint", str(tmp_path / "missing.pt")],
        "--checkpoint a link to nothing": ["--checkpoint", str(tmp_path / "dangling.pt")],
        "--checkpoint an empty file": ["--checkpoint", str(tmp_path / "empty")],
        "--checkpoint a text file": ["--checkpoint", str(tmp_path / "notes.txt")],
        "--checkpoint a FIFO": ["--checkpoint", str(tmp_path / "fifo.pt")],
        "--checkpoint /dev/null": ["--checkpoint", "/dev/null"],
        "--checkpoint /dev/zero": ["--checkpoint", "/dev/zero"],
        "--checkpoint config.json": ["--checkpoint", str(run / "config.json")],
        "--checkpoint metrics.jsonl": ["--checkpoint", str(run / "metrics.jsonl")],
        "--checkpoint another torch file": ["--checkpoint", str(tmp_path / "other.pt")],
        "--checkpoint a sharded checkpoint's folder": [
            "--checkpoint",
            str(tmp_path / "sharded" / "checkpoints" / "ckpt"),
        ],
        "--out-dir a folder without a checkpoint": ["--out-dir", str(tmp_path)],
        "--out-dir a file": ["--out-dir", str(tmp_path / "notes.txt")],
        "--out-dir no such folder": ["--out-dir", str(tmp_path / "missing")],
        "--out-dir a sharded run": ["--out-dir", str(tmp_path / "sharded")],
    }


SAMPLE_WRONG = [
    "--checkpoint README.md",
    "--checkpoint a folder (/tmp)",
    "--checkpoint a run folder",
    "--checkpoint a link to a run folder",
    "--checkpoint the checkpoints folder",
    "--checkpoint no such file",
    "--checkpoint a link to nothing",
    "--checkpoint an empty file",
    "--checkpoint a text file",
    "--checkpoint a FIFO",
    "--checkpoint /dev/null",
    "--checkpoint /dev/zero",
    "--checkpoint config.json",
    "--checkpoint metrics.jsonl",
    "--checkpoint another torch file",
    "--checkpoint a sharded checkpoint's folder",
    "--out-dir a folder without a checkpoint",
    "--out-dir a file",
    "--out-dir no such folder",
    "--out-dir a sharded run",
]


@pytest.mark.parametrize("what", SAMPLE_WRONG)
def test_sample_names_its_own_flags_for_a_wrong_checkpoint(capsys, run, tmp_path, what):
    argv = sample_targets(tmp_path, run)[what]
    with no_hang():
        status = sample.cli([*argv, "--max-new-tokens", "2", "--device", "cpu"])
    line = one_line_exit_2(capsys, status)
    for trainers in ("--resume", "--checkpoint-path", "train without"):
        assert trainers not in line, line


# ---------------------------------------------------------------------------- 8. signals


def signal_at(signum: int, at: int):
    def on_step(step: int) -> None:
        if step == at:
            os.kill(os.getpid(), signum)

    return on_step


STOPS = [(s, at) for s in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT) for at in (2, 3)]


@pytest.mark.parametrize("signum, at", STOPS, ids=[f"{signal.Signals(s).name}-at-{a}" for s, a in STOPS])
def test_a_closed_terminal_saves_and_stops_as_sigterm_does(capsys, tmp_path, signum, at):
    """SIGHUP (the terminal closed) like SIGTERM and SIGINT: the step in flight finishes, the
    checkpoint is saved, one line says how to continue, 128 + the signal; the resume then finishes."""
    if signal.getsignal(signum) == signal.SIG_IGN:  # nohup: the trainer rightly leaves it ignored
        pytest.skip(f"{signal.Signals(signum).name} is ignored in this process (started under nohup)")
    out = tmp_path / "run"
    argv = [*FAST, "--num-steps", "5", "--log-interval", "1", "--out-dir", str(out)]
    status, err = status_and_err(capsys, argv, signal_at(signum, at))
    assert status == 128 + signum, err
    log = (out / "train.log").read_text()
    assert f"Stopped by {signal.Signals(signum).name} after step {at}" in log, log
    assert torch.load(out / "checkpoints" / "ckpt.pt", weights_only=True)["step"] == at
    assert train_minimal.cli([*argv, "--resume"]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 5


# ---------------------------------------------------------------------------- the count

COUNTS = {
    "run files that are links, fresh and resumed (1)": 2 * len(APPENDED + RENAMED) * len(TARGETS),
    "run folders that are links to no folder, or to a folder elsewhere (1)": len(FOLDERS)
    * len(BAD_FOLDER_TARGETS)
    + 2,
    "run files with a second name (hard links) (1)": len(APPENDED),
    "a .lock left in the run folder, the lock beside --checkpoint-path (1, 8)": len(LOCK_LEFTOVERS)
    + len(CHECKPOINT_LOCKS),
    "a --checkpoint-path that is a link (1)": 3,
    "the peak cache: FIFOs, links, bombs; a cache that cannot be written; HOME (2, 8)": len(PEAK_CACHE_DAMAGE)
    + 1
    + len(HOMES)
    + 1,
    "a token cache of another text or damaged; a run on a copied one (3)": len(TOKEN_CACHE_DAMAGE) + 1,
    "texts tokenised in pieces, with progress; a large text's memory (2)": len(STREAMED) + 1,
    "a --resume that changes the run: refused, then allowed and recorded (4)": 2 * len(CHANGES),
    "a --resume of the same run given differently (4)": len(SAME_RUN),
    "a --resume on another world size, other data or the same data (4)": 2 + len(DATA_RESUMES),
    "dead consoles: the trainer, sample.py, the log's stream (5)": len(CONSOLES)
    + len(SAMPLE_CONSOLES)
    + len(DEAD_STREAMS),
    "a collective failing on a lost rank (6)": len(LOST_RANK_ERRORS),
    "sharded checkpoints resumed without their flags, damaged metas, the reverse (7)": len(SHARDED)
    + len(SHARDED_META_DAMAGE)
    + 1,
    "sample.py given what is no checkpoint (7)": len(SAMPLE_WRONG),
    "SIGHUP, SIGTERM, SIGINT mid-run, then --resume (8)": len(STOPS),
}


def test_the_counts_add_up_to_what_this_file_tries():
    assert all(n > 0 for n in COUNTS.values())
    assert sum(COUNTS.values()) >= 206  # issue 47: from 1,244 to at least 1,450 in all
