"""The run directory before the first step and after the last: every output path probed, one
trainer per directory, the run to resume found by its checkpoint's age, files a killed process
left behind cleaned or repaired, and the lines every run ends with.

All of it runs before a single step is trained: a path that cannot be written costs one line
(exit 2), not an interval of training followed by a traceback at the first save.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
from pathlib import Path

from minigpt.config import UsageError
from minigpt.fileio import atomic_write

LOCK_FILE = ".lock"  # in the run directory; holds the PID of the trainer that owns it
# Pseudo file systems: the kernel's views, never a place for a run's files.
PSEUDO_FS = (Path("/proc"), Path("/sys"), Path("/dev"))
# Two runs whose checkpoints were written closer together than this cannot be told apart by age.
AMBIGUOUS_S = 1.0
STALE_TMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.tmp$")  # minigpt.fileio.tmp_path's names


def _reason(e: OSError) -> str:
    if isinstance(e, PermissionError):
        return "permission denied"
    if e.errno == errno.EROFS:
        return "read-only file system"
    return e.strerror or type(e).__name__


def _pseudo_fs(path: Path) -> Path | None:
    resolved = path.resolve()
    return next((root for root in PSEUDO_FS if resolved == root or root in resolved.parents), None)


def probe_writable(path: str | Path, what: str) -> None:
    """Prove that the file `path` can be written, before any work is done: make its folders,
    write and remove a temporary file beside it. The target itself is never touched, and folders
    the probe made are removed again, so a run refused later leaves nothing behind.
    `what` names the flag, for the message: '--checkpoint-path', 'the token cache'."""
    path = Path(path)
    fix = f"choose a {what} in a folder you can write to"
    root = _pseudo_fs(path)
    if root is not None:
        raise UsageError(f"{what} {path} lies under {root}, a kernel file system; {fix}")
    if path.is_dir():
        raise UsageError(f"{what} {path} is a directory, not a file; {fix}, and name a file in it")
    for parent in path.parents:  # the nearest existing ancestor must be a folder
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise UsageError(f"{what} {path} cannot be written: {parent} is a file, not a folder; {fix}")
            break
    made = [p for p in reversed(path.parents) if not p.exists()]  # outermost first
    probe = path.with_name(f".{path.name}.probe.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"probe")
    except OSError as e:
        raise UsageError(f"{what} {path} cannot be written ({_reason(e)}); {fix}") from None
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:  # a read-only file system refuses even to remove a file that is not there
            pass
        for p in reversed(made):  # innermost first; only the empty folders this probe made
            try:
                p.rmdir()
            except OSError:
                break


def check_out_dir(path: str | Path, what: str = "--out-dir") -> None:
    """An --out-dir that is a file, lies under /proc or /sys, or cannot be written: one line."""
    path = Path(path)
    root = _pseudo_fs(path)
    if root is not None:
        raise UsageError(
            f"{what} {path} lies under {root}, a kernel file system; choose a folder such as runs/NAME"
        )
    if path.exists() and not path.is_dir():
        raise UsageError(f"{what} {path} is a file, not a folder; choose another {what}")
    probe_writable(path / LOCK_FILE, what)


def checkpoint_lock_path(checkpoint: str | Path) -> Path:
    """The lock file of a checkpoint (a file, or a folder of shards): beside it, hidden."""
    checkpoint = Path(checkpoint)
    return checkpoint.with_name(f".{checkpoint.name}.lock")


class _Flock:
    """An exclusive flock on one lock file, with the holder's PID written inside for the message
    a second trainer gets. The kernel drops a flock when its holder exits, however it exits
    (SIGKILL included), so a lock file left by a crash is not a lock: the next trainer takes it.
    Folders the lock had to create are removed again if they are left empty."""

    def __init__(self, path: Path, busy: str):
        self.path, self.busy = path, busy  # busy: the message, with {holder} for the PID
        self.fd: int | None = None
        self.made: list[Path] = []

    def acquire(self) -> None:
        folder = self.path.parent
        self.made = [p for p in [*reversed(folder.parents), folder] if not p.exists()]
        folder.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                self.remove_made()
                raise UsageError(self.busy.format(holder=holder)) from None
            # The holder before us may have removed the file between our open and our flock:
            # then we hold a lock on a deleted file, which guards nothing. Try again.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)  # while still locked: no one can be waiting on this inode
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None
        self.remove_made()

    def remove_made(self) -> None:
        for p in reversed(self.made):  # innermost first, only if the run left them empty
            try:
                p.rmdir()
            except OSError:
                break
        self.made = []


class RunLock:
    """One trainer per run directory, and one per checkpoint: an exclusive flock on
    <out_dir>/.lock and, when the run writes a checkpoint, on .<name>.lock beside it. Two runs
    with different --out-dir but one --checkpoint-path would otherwise both exit 0 while the
    second overwrote the first's weights. Held until the run returns; a crash drops both."""

    def __init__(self, out_dir: str | Path, checkpoint: str | Path | None = None):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_FILE
        self.locks = [
            _Flock(
                self.path,
                f"another trainer (PID {{holder}}) is using {self.out_dir}; wait for it to "
                "finish, or choose another --out-dir",
            )
        ]
        if checkpoint is not None:
            self.locks.append(
                _Flock(
                    checkpoint_lock_path(checkpoint),
                    f"another trainer (PID {{holder}}) writes its checkpoint to {checkpoint}; wait "
                    "for it to finish, or choose another --checkpoint-path",
                )
            )

    def acquire(self) -> RunLock:
        taken: list[_Flock] = []
        try:
            for lock in self.locks:
                lock.acquire()
                taken.append(lock)
        except BaseException:
            for lock in reversed(taken):
                lock.release()
            raise
        return self

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def latest_run(root: str | Path, checkpoint_file: str | Path = Path("checkpoints") / "ckpt.pt") -> Path:
    """The run under `root` whose checkpoint was written last (by its mtime, not its name:
    'runs/long' sorts after 'runs/20261123-...'). Refused when none has one, or when the two
    newest were written within AMBIGUOUS_S of each other."""
    root, depth = Path(root), len(Path(checkpoint_file).parts)
    found = []
    for ckpt in root.glob(f"*/{checkpoint_file}"):
        try:
            found.append((ckpt.stat().st_mtime, ckpt.parents[depth - 1]))
        except OSError:
            continue
    if not found:
        raise UsageError(
            f"--resume: no run in {root}/ has a checkpoint ({checkpoint_file}); "
            "pass --out-dir or --checkpoint-path"
        )
    found.sort(key=lambda t: t[0], reverse=True)
    if len(found) > 1 and found[0][0] - found[1][0] < AMBIGUOUS_S:
        raise UsageError(
            f"--resume: {found[0][1]} and {found[1][1]} saved their checkpoints within "
            f"{AMBIGUOUS_S:g}s of each other; pass --out-dir to say which to continue"
        )
    return found[0][1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def clean_stale_tmp(folder: str | Path) -> list[Path]:
    """Remove the temporary files (.NAME.<pid>.tmp) that a process killed mid-save left in
    `folder`, those whose process is gone; a live process's file is a save in progress."""
    removed = []
    folder = Path(folder)
    if not folder.is_dir():
        return removed
    for p in folder.iterdir():
        m = STALE_TMP.match(p.name)
        if m and p.is_file() and not _alive(int(m["pid"])):
            p.unlink(missing_ok=True)
            removed.append(p)
    return sorted(removed)


def repair_jsonl(path: str | Path, last_step: int | None) -> int:
    """Make a JSON-lines log fit a resume from the checkpoint at `last_step`: drop a partial last
    line (a crash mid-write, which would fuse with the next record), any line that is not a JSON
    object, and records past `last_step` (they are trained again, and no step may appear twice).
    Rewritten atomically, and only when something is dropped. Returns the lines dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    partial = lines.pop()  # b"" when the file ends with a newline
    dropped = 1 if partial.strip() else 0
    kept = []
    for line in lines:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: nested too deep to parse
            dropped += 1
            continue
        if not isinstance(rec, dict):
            dropped += 1
            continue
        step = rec.get("step")
        if last_step is not None and isinstance(step, (int, float)) and step > last_step:
            dropped += 1
            continue
        kept.append(line)
    if dropped:
        atomic_write(path, b"".join(line + b"\n" for line in kept))
    return dropped


def next_steps(
    out_dir: str | Path,
    has_traces: bool,
    has_report: bool,
    *,
    has_checkpoint: bool = True,
    checkpoint: str | Path | None = None,
    trace_dir: str = "traces",
    report_file: str = "report.html",
) -> list[str]:
    """The lines every run ends with: what to open or run next, with this run's paths.
    checkpoint: a --checkpoint-path outside the run directory, which sample.py must be told."""
    out_dir = Path(out_dir)
    lines = [f"  scalars:        tensorboard --logdir {out_dir}"]
    if has_traces:
        lines.append(f"  trace summary:  python -m minigpt.traces {out_dir / trace_dir}")
    if has_report:
        lines.append(f"  report:         {out_dir / report_file}")
    if has_checkpoint:
        where = f"--checkpoint {checkpoint}" if checkpoint else f"--out-dir {out_dir}"
        lines.append(f"  text from it:   python sample.py {where}")
    return ["Next steps:", *lines]
