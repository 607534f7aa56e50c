"""Files that must survive a crash: written to a temporary name beside the target, flushed to
disk, then renamed into place (a rename within a folder is atomic). A reader sees the old file or
the new one, never half of either.

A full disk (ENOSPC, or a quota: EDQUOT) is a user's problem with a user's fix, so it ends as one
line (DiskFull, a UsageError) that names the file, the space it needed and the space left, and
says the previous file was kept: never three chained tracebacks."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from minigpt.config import UsageError

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(UsageError):
    """No space left (or over quota) while writing a file; the previous file, if any, is whole."""


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def tmp_path(path: Path) -> Path:
    """The temporary name of `path` while it is written: per process, since ranks may share a
    folder. minigpt.runs.clean_stale_tmp() removes the ones a killed process left behind."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def remove(path: Path) -> None:
    """Remove a file if it is there; never raise (a read-only file system refuses even to remove
    a file that does not exist, and that must not hide the error being reported)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def is_disk_full(e: BaseException) -> bool:
    """An OSError for a full disk, or one wrapped by a library (torch.save re-raises the write
    error as a RuntimeError whose message carries the errno text)."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return True
        if isinstance(e, RuntimeError) and any(os.strerror(n) in str(e) for n in DISK_FULL_ERRNOS):
            return True
        e = e.__cause__ or e.__context__
    return False


def disk_full_message(path: Path, need: int | None, existed: bool) -> str:
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        free = f"{format_bytes(shutil.disk_usage(folder).free)} free"
    except OSError:
        free = "free space unknown"
    needs = f"needs about {format_bytes(need)}, " if need else ""
    kept = f"the previous {path.name} was left intact" if existed else "nothing was written"
    return (
        f"no space left on the device while writing {path} ({needs}{free} there); {kept}; "
        "free some space or write elsewhere (--out-dir, --checkpoint-path)"
    )


@contextmanager
def atomic_open(path: str | Path, mode: str = "wb", size_hint: int | None = None) -> Iterator[IO]:
    """open() for writing, with the rename on success; on an error the target is left untouched.
    size_hint: the bytes about to be written, for the message when the disk is full."""
    path = Path(path)
    existed = path.exists()
    tmp = tmp_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        if not is_disk_full(e):
            raise
        remove(tmp)  # before measuring what is free
        raise DiskFull(disk_full_message(path, size_hint, existed)) from None
    finally:
        remove(tmp)


def atomic_write(path: str | Path, data: bytes | str) -> None:
    size = len(data) if isinstance(data, bytes) else len(data.encode("utf-8"))
    with atomic_open(path, "wb" if isinstance(data, bytes) else "w", size_hint=size) as f:
        f.write(data)
