"""The run directory's guards for what a fresh folder cannot hold: a folder used before (its files
of the wrong kind, the temporary files a killed save left), a --checkpoint-path of its own (a lock
beside it), a path under a kernel file system, and the one line for a folder that cannot be
written. RunDir (minigpt/core/runs.py) loads them when one of those is the case, or when its folder
cannot be made or locked."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import stat
from pathlib import Path

from minigpt import config as paths
from minigpt.config import UsageError, open_run_file

PSEUDO_FS = (Path("/proc"), Path("/sys"), Path("/dev"))  # the kernel's views: never a place for a run

SHARDED_META = "minigpt_sharded.json"  # a sharded checkpoint's world size and tp, written by rank 0
STALE_TMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.tmp$")  # minigpt.config.atomic_write's names


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
            if not parent.exists():  # a link to nothing: mkdir would say "File exists"
                where = f"{parent} is a link to {os.readlink(parent)}, which does not exist"
                raise UsageError(f"{what} {path} cannot be written: {where}; {fix}")
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
        remove_empty(made)  # only the empty folders this probe made


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
    probe_writable(path / paths.CONFIG_FILE, what)


# What a run keeps in its directory, by the kind of path it must be: a file at a folder's name (or
# a folder at a file's) would end a resumed run in a traceback halfway into its start.
RUN_FILES = (paths.CONFIG_FILE, paths.LOG_FILE, paths.METRICS_FILE, paths.STRAGGLERS_FILE, paths.REPORT_FILE)
APPENDED = (paths.LOG_FILE, paths.METRICS_FILE, paths.STRAGGLERS_FILE)  # opened O_APPEND, never renamed
RUN_FOLDERS = (
    paths.TENSORBOARD_DIR,
    paths.TRACE_DIR,
    *(Path(p).parts[0] for p in (paths.SNAPSHOT_FILE, paths.MEMORY_TRACE_DIR, paths.CHECKPOINT_FILE)),
)


def check_run_files(out_dir: str | Path) -> None:
    """Every file and folder the run will write that is already there has the kind it must have
    (a regular file, a folder): else one line naming it, before anything is touched. A file the
    run appends to is neither a link nor a file with another name (a hard link, `cp -al`):
    open_run_file would refuse it only at the first log line, after the start-up's work.
    config.json and report.html are renamed into place, over a link; a link to a folder for tb/ or
    checkpoints/ is the user's choice, said in the log, a link to nothing one line."""
    out_dir = Path(out_dir)
    for name in APPENDED:
        try:
            st = os.lstat(out_dir / name)
        except OSError:
            continue
        if stat.S_ISLNK(st.st_mode):
            raise UsageError(f"{out_dir / name} {paths.LINK}")
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            raise UsageError(
                f"{out_dir / name} is a hard link ({st.st_nlink} names): the run would append to the other "
                "file too; replace it by a copy, or use another --out-dir"
            )
    for name, want in [*((n, "file") for n in RUN_FILES), *((n, "folder") for n in RUN_FOLDERS)]:
        path = out_dir / name
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:  # not there (made when needed), or a link to nothing
            if want == "folder" and path.is_symlink():  # mkdir would fail on it with "File exists"
                raise UsageError(
                    f"{path} is a link to {os.readlink(path)}, which does not exist, where the run keeps "
                    f"its {name} (folder); make that folder, remove the link, or choose another --out-dir"
                ) from None
            continue
        except OSError:  # not reachable (the probes say why)
            continue
        if not (stat.S_ISREG(mode) if want == "file" else stat.S_ISDIR(mode)):
            from minigpt.fileio import file_kind

            kind = "a file" if stat.S_ISREG(mode) else file_kind(mode)
            kind = f"a link to {kind}" if path.is_symlink() else kind
            raise UsageError(
                f"{path} is {kind}, where the run keeps its {name} ({want}); "
                "move it away, or choose another --out-dir"
            )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def clean_stale_tmp(folder: str | Path, name: str | None = None) -> list[Path]:
    """Remove the temporary files (.NAME.<pid>.tmp; of `name` alone, if given) that a process
    killed mid-save left in `folder`, those whose process is gone; a live process's file is a save
    in progress."""
    removed = []
    folder = Path(folder)
    if not folder.is_dir():
        return removed
    for p in folder.iterdir():
        m = STALE_TMP.match(p.name)
        if m and (name is None or m["name"] == name) and p.is_file() and not _alive(int(m["pid"])):
            p.unlink(missing_ok=True)
            removed.append(p)
    return sorted(removed)


def describe_intact(path: str | Path) -> str:
    """What a run that stops on an error leaves behind, for its last line: the claim that a good
    checkpoint survives is made only when there is one."""
    path = Path(path)
    if path.is_file():
        return f"the last good checkpoint ({path}) was left intact"
    return "no checkpoint had been written yet"


def directory_message(path: Path) -> str:
    return (
        f"checkpoint path {path} is a directory, not a checkpoint file; point --checkpoint-path at a "
        f"file (for example {path / 'ckpt.pt'})"
    )


def check_checkpoint_path(path: str | Path, resume: bool) -> None:
    """Before anything is built: the one message for each way the checkpoint path can be wrong
    (a directory gets the same line with or without --resume)."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(directory_message(path))
    if resume and not path.is_file():
        if written_with := sharded_flags(sharded_checkpoint_dir(path)):
            flags, world = written_with
            raise UsageError(
                f"{sharded_checkpoint_dir(path)} holds a sharded checkpoint, written by {world} ranks with "
                f"{flags}, not the one file {path}: add {flags} to resume it (under torchrun)"
            )
        raise UsageError(
            f"no checkpoint at {path} to resume from; train without --resume first, "
            "or point --checkpoint-path at one"
        )
    if not resume and path.exists():
        raise UsageError(
            f"{path} already exists; pass --resume to continue that run, "
            "or choose another --out-dir / --checkpoint-path"
        )


def check_paths(run) -> None:
    """Every output path of `run` (a RunDir) checked before any work: the folder, the files an
    earlier run left in it, the checkpoint's path (a folder of shards under --fsdp/--tp)."""
    from minigpt.fileio import check_names

    check_names((run.path, "--out-dir"), (run.checkpoint, "--checkpoint-path"))  # past 4,096 bytes
    if run.sharded:
        one_file, run.checkpoint = run.checkpoint, sharded_checkpoint_dir(run.checkpoint)
        check_sharded_path(run.checkpoint, run.cfg.resume, one_file)
    else:
        check_checkpoint_path(run.checkpoint, run.cfg.resume)
    if run.dist_info.is_main:
        check_out_dir(run.path)
        check_run_files(run.path)
        if run.saves:
            probe_writable(
                run.checkpoint / SHARDED_META if run.sharded else run.checkpoint, "--checkpoint-path"
            )


def guard_used(run, held) -> None:
    """Once the folder is locked: a --checkpoint-path of its own gets a lock beside it (two runs
    must not overwrite each other's weights), then what a killed earlier run left (a save's
    temporary files, in the folder and beside the checkpoint) is no live trainer's, and goes,
    said in the log's first lines."""
    if run.cfg.checkpoint_path and (run.saves or run.cfg.resume):
        lock_checkpoint(run.checkpoint, held)
    stale = clean_stale_tmp(run.path) + clean_stale_tmp(run.checkpoint.parent, run.checkpoint.name)
    run.said += [f"Cleaned up after an earlier run: removed {p}, a save killed midway" for p in stale]
    for d in (
        paths.TENSORBOARD_DIR,
        "checkpoints",
    ):  # a link the user made in the folder: the run writes there
        if (run.path / d).is_symlink():
            run.said.append(f"{d}/ is a link: what the run keeps there goes to {(run.path / d).resolve()}")


def lock_checkpoint(path: Path, held) -> None:
    """An exclusive flock on .NAME.lock beside the checkpoint until the run returns. Its holder
    removes it while it still holds it; a trainer that opened it meanwhile finds another file at
    the name once it holds the lock, and locks that one instead."""
    lock = path.with_name(f".{path.name}.lock")
    made = [p for p in reversed(lock.parents) if not p.exists()]
    lock.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = hold_lock(lock, path)
    except BaseException:
        remove_empty(made)
        raise

    def release() -> None:
        lock.unlink(missing_ok=True)  # while held: no one else holds this file meanwhile
        os.close(fd)
        remove_empty(made)

    held.callback(release)


def hold_lock(lock: Path, path: Path) -> int:
    while True:
        try:
            fd = open_run_file(lock, os.O_RDWR)
        except UsageError:  # a link, a folder, a FIFO at its name
            raise UsageError(
                f"{lock}, the lock beside --checkpoint-path {path}, is not a plain file this run can "
                "open; remove it, or choose another --checkpoint-path"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UsageError(
                f"another trainer writes its checkpoint to {path}; wait for it, or choose another "
                "--checkpoint-path"
            ) from None
        try:
            if os.stat(lock, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # removed (or replaced) by its last holder as it let go: lock what is there now


def remove_empty(made: list[Path]) -> None:
    """The folders made for a file (outermost first), innermost first, while they are empty."""
    for folder in reversed(made):
        try:
            folder.rmdir()
        except OSError:
            break


def sharded_checkpoint_dir(path: str | Path) -> Path:
    """Where a sharded checkpoint goes for a --checkpoint-path (default checkpoints/ckpt.pt): the
    same name without its suffix, a folder (checkpoints/ckpt/)."""
    return Path(path).with_suffix("")


def sharded_flags(folder: Path) -> tuple[str, int] | None:
    """(the flags, the world size) a sharded checkpoint at `folder` (or its `.old`) was written
    with, read off its meta: --tp N for its tensor-parallel degree, --fsdp where it sharded over data
    too (or alone); None where no readable meta is there."""
    for where in (folder, folder.with_name(folder.name + ".old")):
        try:  # O_NONBLOCK, a regular file, 64 KiB at most: a FIFO or /dev/zero is no meta
            with open(os.open(where / SHARDED_META, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
                meta = json.loads(f.read(1 << 16)) if stat.S_ISREG(os.fstat(f.fileno()).st_mode) else None
            world, tp = int(meta["world_size"]), int(meta["tp"])
        except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError):
            continue
        if world >= 1 and tp >= 1:
            return " ".join(["--fsdp"] * (tp == 1 or world > tp) + [f"--tp {tp}"] * (tp > 1)), world
    return None


def check_sharded_path(folder: str | Path, resume: bool, one_file: Path | None = None) -> None:
    """Before anything is built, as check_checkpoint_path for one file: --resume needs a sharded
    checkpoint there (`one_file`: the checkpoint of one file the same flags would name without
    --fsdp/--tp, said where it is the one there), a new run must not overwrite one."""
    folder = Path(folder)
    old = folder.with_name(folder.name + ".old")  # a crash between save_sharded's two renames
    found = (folder / SHARDED_META).is_file() or (old / SHARDED_META).is_file()
    if folder.exists() and not folder.is_dir():
        raise UsageError(
            f"sharded checkpoint path {folder} is a file; --fsdp/--tp write a folder of shards "
            "there: choose another --checkpoint-path"
        )
    if resume and not found and one_file is not None and Path(one_file).is_file():
        raise UsageError(
            f"{one_file} is a checkpoint of one file, written without --fsdp/--tp, not a sharded one "
            f"({folder}/): resume it without --fsdp/--tp"
        )
    if resume and not found:
        raise UsageError(
            f"no sharded checkpoint at {folder} to resume from; train without --resume first, "
            "or point --checkpoint-path at one (a checkpoint of one file resumes without "
            "--fsdp/--tp)"
        )
    if not resume and found:
        raise UsageError(
            f"{folder} already holds a checkpoint; pass --resume to continue that run, "
            "or choose another --out-dir / --checkpoint-path"
        )
