"""No lost work, no tracebacks: output paths probed before the first step, one trainer per run
directory, the newest run resumed, files left by a killed process cleaned or repaired, a full
disk reported in one line, hand-made checkpoints refused by field, and the token cache verified."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY, bench_main

import train_minimal
from minigpt.config import UsageError
from minigpt.core import data, tokens
from minigpt.core.checkpoint import latest_run, load_checkpoint, repair_jsonl, rng_state, save_checkpoint
from minigpt.core.finish import next_steps
from minigpt.core.guards import (
    check_checkpoint_path,
    check_out_dir,
    clean_stale_tmp,
    describe_intact,
    probe_writable,
)
from minigpt.core.model import GPT, GPTConfig
from minigpt.core.progress import Progress, progress_enabled
from minigpt.core.runs import lock_folder
from minigpt.errors import Fault
from minigpt.fileio import DiskFull, atomic_write

ROOT = Path(__file__).resolve().parents[1]


def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


# ---------------------------------------------------------------------------- write probes


def test_probe_refuses_kernel_file_systems_and_file_parents(tmp_path):
    with pytest.raises(UsageError) as e:
        probe_writable("/proc/x/ckpt.pt", "--checkpoint-path")
    assert "/proc" in one_line(e) and "--checkpoint-path" in str(e.value)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UsageError) as e:
        probe_writable(tmp_path / "afile" / "sub" / "ckpt.pt", "--checkpoint-path")
    assert f"{tmp_path / 'afile'} is a file" in one_line(e)
    with pytest.raises(UsageError) as e:
        probe_writable(tmp_path, "--memory-snapshot-path")
    assert "is a directory" in one_line(e)


def test_probe_leaves_nothing_behind(tmp_path):
    probe_writable(tmp_path / "a" / "b" / "ckpt.pt", "--checkpoint-path")
    assert list(tmp_path.iterdir()) == []  # the folders it made and its temporary file are gone
    (tmp_path / "ckpt.pt").write_bytes(b"old")
    probe_writable(tmp_path / "ckpt.pt", "--checkpoint-path")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
    assert (tmp_path / "ckpt.pt").read_bytes() == b"old"  # the target itself is never touched


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_probe_refuses_a_read_only_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(UsageError) as e:
            probe_writable(ro / "ckpt.pt", "--checkpoint-path")
        assert "permission denied" in one_line(e)
    finally:
        ro.chmod(0o755)


def test_out_dir_that_is_a_file_or_under_proc(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UsageError, match="is a file"):
        check_out_dir(tmp_path / "afile")
    with pytest.raises(UsageError, match="/proc"):
        check_out_dir("/proc/self/run")
    check_out_dir(tmp_path / "run")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------- one trainer per run

HOLDER = """
import sys, time
from pathlib import Path
from minigpt.core.runs import lock_folder
Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
lock_folder(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(60)
"""


def start_holder(out_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out_dir)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_trainer_is_refused_in_one_line(tmp_path, capsys):
    """The folder itself is flock'ed (no lock file a link or a FIFO could stand in for)."""
    run = tmp_path / "run"
    proc = start_holder(run)
    try:
        with pytest.raises(UsageError) as e:
            lock_folder(run)
        assert one_line(e) == f"another trainer is using {run}; wait for it, or use another --out-dir"
        flags = ["--preset", "tiny", "--use-toy-data", "--num-steps", "1", "--out-dir", str(run)]
        assert train_minimal.cli(flags) == 2
        assert capsys.readouterr().err.strip() == f"error: {e.value}"
        assert list(run.iterdir()) == []  # the refused trainer wrote nothing, and no lock file
    finally:
        proc.kill()
        proc.wait()


def test_a_refused_trainer_removes_no_temporary_file(tmp_path):
    """Files named as a killed save's are removed only by the trainer that holds the folder's lock:
    the holder's own save in progress may look like one (its process in another PID namespace)."""
    run = tmp_path / "run"
    proc = start_holder(run)
    try:
        saving = run / "checkpoints" / ".ckpt.pt.999999.tmp"
        saving.parent.mkdir(parents=True)
        saving.write_bytes(b"half a checkpoint")
        flags = ["--preset", "tiny", "--use-toy-data", "--num-steps", "1", "--out-dir", str(run)]
        assert train_minimal.cli(flags) == 2
        assert saving.read_bytes() == b"half a checkpoint"
    finally:
        proc.kill()
        proc.wait()


def test_the_lock_of_a_killed_trainer_is_gone_with_it(tmp_path):
    run = tmp_path / "run"
    proc = start_holder(run)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    fd = lock_folder(run)  # the kernel released the flock with its holder
    try:
        with pytest.raises(UsageError, match="another trainer is using"):
            lock_folder(run)
    finally:
        os.close(fd)
    assert list(run.iterdir()) == []


def test_a_run_refused_after_making_its_folder_leaves_nothing(tmp_path, capsys):
    """The folders a run made for itself go again when it ends before writing in them (here: too
    little text for the sequence)."""
    text = tmp_path / "short.txt"
    text.write_text("Hello world")
    out = tmp_path / "runs" / "new"
    flags = ["--preset", "tiny", "--train-data", str(text), "--num-steps", "1", "--out-dir", str(out)]
    assert train_minimal.cli(flags) == 2
    assert "--seq-len 64 needs 65" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.txt"]


# ---------------------------------------------------------------------------- which run to resume


def make_run(root: Path, name: str, mtime: float) -> Path:
    ckpt = root / name / "checkpoints" / "ckpt.pt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"x")
    os.utime(ckpt, (mtime, mtime))
    return root / name


def test_resume_takes_the_newest_checkpoint_not_the_last_name(tmp_path):
    now = time.time()
    make_run(tmp_path, "long", now - 3600)
    newest = make_run(tmp_path, "20261123-101010", now)
    assert latest_run(tmp_path) == newest


def test_resume_refuses_when_ambiguous_or_empty(tmp_path):
    now = time.time()
    make_run(tmp_path, "a", now)
    make_run(tmp_path, "b", now - 0.2)
    with pytest.raises(UsageError) as e:
        latest_run(tmp_path)
    assert "--out-dir" in one_line(e) and "a" in str(e.value)
    with pytest.raises(UsageError, match="no run"):
        latest_run(tmp_path / "empty")


# ---------------------------------------------------------------------------- left by a killed process


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporary_files_are_removed_live_ones_kept(tmp_path):
    stale = tmp_path / f".ckpt.pt.{dead_pid()}.tmp"
    live = tmp_path / f".ckpt.pt.{os.getpid()}.tmp"
    other = tmp_path / "ckpt.pt"
    for p in (stale, live, other):
        p.write_bytes(b"x")
    assert clean_stale_tmp(tmp_path) == [stale]
    assert live.exists() and other.exists() and not stale.exists()
    assert clean_stale_tmp(tmp_path / "missing") == []


def test_jsonl_repair_drops_a_partial_line_and_steps_past_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (10, 20, 30)) + '{"step": 4')
    assert repair_jsonl(path, last_step=20) == 2
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [10, 20]
    assert path.read_text().endswith("\n")
    before = path.read_bytes()
    assert repair_jsonl(path, last_step=20) == 0 and path.read_bytes() == before
    assert repair_jsonl(tmp_path / "missing.jsonl", 5) == 0


def test_jsonl_repair_without_a_checkpoint_keeps_whole_records(tmp_path):
    path = tmp_path / "stragglers.jsonl"
    path.write_text('{"step": 10}\nnot json\n{"step": 20}\n')
    assert repair_jsonl(path, last_step=None) == 1
    assert path.read_text() == '{"step": 10}\n{"step": 20}\n'


def test_next_steps_name_this_runs_paths(tmp_path):
    lines = next_steps(tmp_path, has_traces=True, has_report=True)
    text = "\n".join(lines)
    assert f"tensorboard --logdir {tmp_path}" in text
    assert f"python -m minigpt traces {tmp_path / 'traces'}" in text
    assert str(tmp_path / "report.html") in text and f"python sample.py --out-dir {tmp_path}" in text
    custom = "\n".join(next_steps(tmp_path, False, False, checkpoint="/data/ckpt.pt"))
    assert "python sample.py --checkpoint /data/ckpt.pt" in custom
    quiet = "\n".join(next_steps(tmp_path, has_traces=False, has_report=False, has_checkpoint=False))
    assert "minigpt.analysis.traces" not in quiet and "report" not in quiet and "sample.py" not in quiet


# ---------------------------------------------------------------------------- a full disk


def test_full_disk_is_one_line_and_the_old_file_survives(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    atomic_write(path, "old")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("minigpt.fileio.os.fsync", full)
    with pytest.raises(DiskFull) as e:
        atomic_write(path, "new" * 1000)
    msg = one_line(e)
    assert str(path) in msg and "needs about 2.9 KiB" in msg and "free there" in msg and "left intact" in msg
    assert e.value.__suppress_context__  # printed alone: no chained tracebacks
    assert isinstance(e.value, Fault)  # a fault of the machine: the trainer's cli() exits 1
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_full_disk_during_a_checkpoint_save(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"w": torch.zeros(10)})
    monkeypatch.setattr(
        "minigpt.fileio.os.fsync",
        lambda fd: (_ for _ in ()).throw(OSError(errno.EDQUOT, "Disk quota exceeded")),
    )
    with pytest.raises(DiskFull) as e:
        save_checkpoint(path, {"w": torch.zeros(1 << 20)})  # 4 MiB of float32
    assert "needs about 4.0 MiB" in one_line(e)
    assert torch.load(path, weights_only=True)["w"].shape == (10,)


TB_FULL = """
import errno, os, sys
from tensorboard.summary.writer.record_writer import RecordWriter
import train_minimal

written, real = [], RecordWriter.write

def write(self, data):
    written.append(data)
    if len(written) > 3:  # the file header and a few scalars fit; then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real(self, data)

RecordWriter.write = write
sys.exit(train_minimal.cli(sys.argv[1:]))
"""


def test_full_disk_under_tensorboard_ends_the_run_in_one_line(tmp_path):
    """TensorBoard writes from its own thread: its failure must not print that thread's traceback
    beside the trainer's one line (a process of its own: Python's thread hook, not pytest's)."""
    out = tmp_path / "run"
    flags = [*TINY, "--num-steps", "4", "--log-interval", "1", "--peak-tflops", "1", "--out-dir", str(out)]
    done = subprocess.run([sys.executable, "-c", TB_FULL, *flags], capture_output=True, text=True, cwd=ROOT)
    err = done.stderr
    assert done.returncode == 1, err  # a fault of the machine
    assert err.startswith("error: no space left") and len(err.strip().splitlines()) == 1, err
    assert str(out / "tb") in err and "Traceback" not in err and "Exception in thread" not in err


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a tmpfs needs root")
def test_full_disk_on_a_real_tmpfs(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)]).returncode:
        pytest.skip("mount refused")
    try:
        save_checkpoint(disk / "ckpt.pt", {"w": torch.zeros(10)})
        with pytest.raises(DiskFull) as e:
            save_checkpoint(disk / "ckpt.pt", {"w": torch.zeros(1 << 20)})
        assert str(disk / "ckpt.pt") in one_line(e) and "previous ckpt.pt was left intact" in str(e.value)
        assert torch.load(disk / "ckpt.pt", weights_only=True)["w"].shape == (10,)
        assert [p.name for p in disk.iterdir()] == ["ckpt.pt"]  # no temporary file left
    finally:
        subprocess.run(["umount", str(disk)])


# ---------------------------------------------------------------------------- hand-made checkpoints


def good_state() -> dict:
    cfg = GPTConfig(vocab_size=64, max_position_embeddings=16, n_layers=1, n_heads=2, d_model=16, d_ff=32)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters())
    from dataclasses import asdict

    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scaler": {},
        "step": 5,
        "data_position": 5,
        "rng": rng_state(),
        "rng_per_rank": [rng_state()],
        "config": {},
        "model_config": asdict(cfg),
    }


@pytest.mark.parametrize(
    "field, value",
    [
        ("step", "5"),
        ("step", True),
        ("model", [1, 2]),
        ("model", {"w": "not a tensor"}),
        ("data_position", -1),
        ("optimizer", {"state": 1}),
        ("rng", {"torch": 3}),
        ("config", "x"),
        ("model_config", {"vocab_size": "64"}),
        ("rng_per_rank", "x"),
    ],
)
def test_wrong_field_types_are_refused_by_name(tmp_path, field, value):
    state = good_state()
    save_checkpoint(tmp_path / "ok.pt", state)
    assert load_checkpoint(tmp_path / "ok.pt")["step"] == 5
    state[field] = value
    save_checkpoint(tmp_path / "bad.pt", state)
    with pytest.raises(UsageError) as e:
        load_checkpoint(tmp_path / "bad.pt")
    assert f"'{field}'" in one_line(e) and "malformed" in str(e.value)


def test_a_directory_as_the_checkpoint_gets_one_message(tmp_path):
    messages = set()
    for resume in (True, False):
        with pytest.raises(UsageError) as e:
            check_checkpoint_path(tmp_path, resume)
        messages.add(one_line(e))
    with pytest.raises(UsageError) as e:
        load_checkpoint(tmp_path)
    messages.add(one_line(e))
    assert len(messages) == 1 and "is a directory" in messages.pop()


def test_intact_is_claimed_only_when_a_checkpoint_exists(tmp_path):
    assert describe_intact(tmp_path / "ckpt.pt") == "no checkpoint had been written yet"
    (tmp_path / "ckpt.pt").write_bytes(b"x")
    expected = f"the last good checkpoint ({tmp_path / 'ckpt.pt'}) was left intact"
    assert describe_intact(tmp_path / "ckpt.pt") == expected


# ---------------------------------------------------------------------------- the token cache


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv(data.CACHE_ENV, str(folder))
    return folder


def text_file(tmp_path: Path, text: str = "one two three four five six seven") -> Path:
    path = tmp_path / "a.txt"
    path.write_text(text)
    return path


def tokens_of(path: Path):
    return np.asarray(tokens.load_files([str(path)], "--train-data", "gpt2", say=False))


@pytest.mark.parametrize("damage", ["truncate", "flip", "count", "garbage", "id past the vocabulary"])
def test_a_damaged_cached_file_is_tokenised_again(tmp_path, cache, capsys, damage):
    path = text_file(tmp_path)
    good = tokens_of(path).tolist()
    (cached,) = (cache / "tokens").iterdir()
    raw = bytearray(cached.read_bytes())
    if damage == "truncate":
        raw = raw[:-2]
    elif damage == "flip":
        raw[-1] ^= 0xFF  # the last id's high byte: 3598 (" seven") becomes 61710, past the vocabulary
    elif damage == "count":
        raw[16] ^= 0xFF  # the count in the header: it no longer matches the size
    elif damage == "garbage":
        raw = bytearray(b"\0" * len(raw))
    else:
        raw[-2:] = b"\xff\xff"  # id 65535, past GPT-2's 50,257: the embedding would fail on it
    cached.write_bytes(bytes(raw))
    capsys.readouterr()
    assert tokens_of(path).tolist() == good
    assert "not this text's tokens" in capsys.readouterr().err
    again = tokens.load_files([str(path)], "--train-data", "gpt2", False)
    assert isinstance(again.parts[0], np.memmap)  # repaired in place: read from the cache again


@pytest.mark.parametrize("how", ["a file", "full"])
def test_an_unwritable_or_full_cache_falls_back_to_memory(tmp_path, cache, capsys, monkeypatch, how):
    path = text_file(tmp_path)
    if how == "a file":
        cache.write_text("not a folder")
    else:
        full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr("minigpt.fileio.os.fsync", lambda fd: (_ for _ in ()).throw(full))
    ids = tokens_of(path)
    assert data.gpt2_tokenizer().decode(ids.tolist()) == path.read_text()
    err = capsys.readouterr().err
    assert "no token cache in" in err and "$MINIGPT_CACHE_DIR" in err and len(err.strip().splitlines()) == 1


def test_only_regular_files_are_data(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, kind in ((Path("/dev/zero"), "character device"), (fifo, "FIFO")):
        with pytest.raises(UsageError) as e:
            tokens_of(path)  # would read forever, or block, if opened
        assert kind in one_line(e) and "--train-data" in str(e.value)


# ---------------------------------------------------------------------------- the progress bar


class Stream:
    def __init__(self, tty: bool):
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_bar_only_on_a_terminal_on_rank_0_outside_ci():
    tty = (Stream(True), Stream(True))
    assert progress_enabled(0, tty, {})
    assert not progress_enabled(1, tty, {})
    assert not progress_enabled(0, tty, {"CI": "true"})
    assert not progress_enabled(0, (Stream(True), Stream(False)), {})  # stderr into a pipe or a file
    assert not progress_enabled(None, tty, {"RANK": "3"})  # torchrun's rank


def test_progress_bar_draws_when_enabled_and_clears_before_log_lines():
    import io
    import logging

    buf = io.StringIO()
    log = logging.getLogger("test_progress")  # not under "minigpt": an earlier run's console is not its
    bar = Progress(10, enabled=True, file=buf).attach(log)
    bar.update(3)
    assert "/10" in buf.getvalue() and "%|" in buf.getvalue()
    cleared = []
    bar.bar.clear = lambda *a, **k: cleared.append(1)
    log.warning("a log line")
    assert cleared  # the bar was cleared before the record reached the console
    bar.close()
    assert not log.filters
    off = Progress(10, enabled=False)
    off.update(5), off.clear(), off.close()
    assert not off.enabled


PROGRESS_RUN = """
from minigpt.core.progress import Progress, progress_enabled
with Progress(20, progress_enabled(), desc="steps") as bar:
    for _ in range(20):
        bar.update()
print("done")
"""


def test_a_piped_run_prints_no_bar_and_a_terminal_gets_one():
    import fcntl
    import pty
    import struct
    import termios

    env = {k: v for k, v in os.environ.items() if k not in ("CI", "RANK")}
    env.update(PYTHONPATH=str(ROOT), TERM="xterm")
    piped = subprocess.run([sys.executable, "-c", PROGRESS_RUN], capture_output=True, text=True, env=env)
    assert piped.stdout == "done\n" and piped.stderr == ""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a real terminal's size
    proc = subprocess.Popen([sys.executable, "-c", PROGRESS_RUN], stdout=follower, stderr=follower, env=env)
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    proc.wait()
    os.close(leader)
    assert b"steps" in out and b"/20" in out and b"done" in out


# ---------------------------------------------------------------------------- benchmarks/ablation.py


def ablation(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ablation.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def results_prefix() -> str:
    common = __import__("runpy").run_path(str(ROOT / "benchmarks" / "common.py"))
    return common["device_slug"](common["machine"]())


@pytest.mark.parametrize("flags, name", [([], "tiny"), (["--seq-len", "8"], "tiny-seq-len-8")])
def test_ablation_never_overwrites_results_unless_forced(tmp_path, monkeypatch, capsys, flags, name):
    existing = tmp_path / f"{results_prefix()}-{name}.json"
    existing.write_text('{"committed": true}')
    result = bench_main(
        monkeypatch, capsys, "ablation.py", "--preset", "tiny", *flags, "--out-dir", str(tmp_path)
    )
    err = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(err) == 1 and str(existing) in err[0] and "--force" in err[0]
    assert existing.read_text() == '{"committed": true}'


@pytest.mark.parametrize("content", [None, "not json", '{"meta": {}}', "[1, 2]"])
def test_ablation_render_of_a_bad_file_is_one_line(tmp_path, monkeypatch, capsys, content):
    path = tmp_path / "cpu-x.json"
    if content is not None:
        path.write_text(content)
    result = bench_main(monkeypatch, capsys, "ablation.py", "--render", str(path))
    err = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(err) == 1 and "Traceback" not in result.stderr, result.stderr


@pytest.mark.slow  # runs the trainer once
def test_ablation_failing_variant_is_one_line(tmp_path):
    result = ablation(
        "--preset",
        "tiny",
        "--use-toy-data",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--n-heads",
        "3",
        "--out-dir",
        str(tmp_path),
    )
    err = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(err) == 1 and "variant failed" in err[0], result.stderr
    assert list(tmp_path.iterdir()) == []
