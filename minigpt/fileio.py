"""What goes wrong with files, said in one line: a full disk (ENOSPC, or a quota: EDQUOT) names
the file, the space it needed and the space left, and says the previous file was kept (DiskFull, a
fault: exit status 1); a name too long for the file system; a file that must not be read (a FIFO,
a device, one past its reader's limit) or replaced. Loaded when a failure happens, or by the tools.
The atomic write itself is minigpt.config's."""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import stat
import sys
from pathlib import Path

from minigpt import config
from minigpt.errors import Fault, UsageError

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# The flags that send a file elsewhere, named by a full disk's message: the trainer's by default;
# a tool that writes where its own flag says (report --out, compare --html) names that flag.
ELSEWHERE = "--out-dir, --checkpoint-path"


class DiskFull(Fault):
    """No space left (or over quota) while writing a file; the previous file, if any, is whole."""


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


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


def disk_full_message(path: Path, need: int | None, existed: bool, elsewhere: str = ELSEWHERE) -> str:
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
        f"free some space or write elsewhere ({elsewhere})"
    )


def atomic_write(path: str | Path, data, elsewhere: str = ELSEWHERE, need: int | None = None) -> None:
    """minigpt.config.atomic_write, its folder made, a full disk said in one line (DiskFull).
    `data`: bytes, text, or a function that writes to the open file (torch.save), which writes
    about `need` bytes (the message's figure)."""
    path = Path(path)
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        config.atomic_write(path, data)
    except (OSError, RuntimeError) as e:
        if not is_disk_full(e):
            raise
        size = len(data) if isinstance(data, (bytes, str)) else need
        raise DiskFull(disk_full_message(path, size, existed, elsewhere)) from None


def disk_full_line(e: BaseException) -> str | None:
    """The trainer's one line for a full disk met anywhere (a log line, metrics.jsonl), or None."""
    if not is_disk_full(e):
        return None
    where = Path(getattr(e, "filename", None) or ".")
    return disk_full_message(where, None, where.exists())


# ---------------------------------------------------------------------------- names too long
# A name longer than the file system takes fails deep inside open() or mkdir() as "[Errno 36] File
# name too long", a line that names no flag: the trainer, the tools and sample.py say it in their
# own words, before they open anything.
NAME_MAX = 255  # bytes in one path component on Linux's file systems (ext4, xfs, tmpfs, btrfs)
PATH_MAX = 4096  # bytes in a whole path handed to the kernel


def name_problem(path: str | os.PathLike) -> str | None:
    """What makes `path` one the kernel refuses for its length (ENAMETOOLONG), described; None
    when it is not too long."""
    text = os.fsencode(os.fspath(path))
    if len(text) >= PATH_MAX:
        return f"is {len(text):,} bytes long, past the {PATH_MAX:,} a path may have"
    longest = max(text.split(b"/"), key=len)
    if len(longest) > NAME_MAX:
        shown = os.fsdecode(longest[:24])
        return f"has a name of {len(longest)} bytes ({shown}...), past the {NAME_MAX} a file name may have"
    return None


def path_arg(text: str) -> Path:
    """argparse's type for a path: an empty one is refused (Path("") would be the current folder)."""
    if not text:
        raise argparse.ArgumentTypeError("is empty; name a path")
    return Path(text)


def check_names(*given: tuple[str | os.PathLike | None, str]) -> None:
    """Each (path, flag) given: one line naming the flag for a path too long to open; None skipped."""
    for path, flag in given:
        if path is not None and (problem := name_problem(path)):
            raise UsageError(f"{flag}: the path {problem}; choose a shorter one")


def display_path(path: str | Path) -> str:
    """A path as a log line shows it: under the home folder as ~/..., so that a log reads the same
    for every user and on every machine."""
    path = Path(path)
    try:
        return f"~/{path.relative_to(Path.home())}"
    except (ValueError, RuntimeError):  # RuntimeError: no home folder known
        return str(path)


def write_cache(path: str | Path, text: str, env: str = "MINIGPT_CACHE_DIR") -> bool:
    """Write a cache file (measured rates: what costs time to make, never what a run needs) or,
    where it cannot be written (the cache folder a file, under /proc, read-only, full), say so in
    one line on stderr and go on: the measurements are used anyway, and made again next time.
    Returns whether it was written."""
    try:
        atomic_write(path, text, f"${env}")
        return True
    except (OSError, DiskFull) as e:
        folder = Path(path).parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        if not folder.is_dir():
            why = f"{folder} is a file, not a folder"
        else:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        print(
            f"warning: cannot write the cache {path} ({why}); the figures are used but measured "
            f"again next time: set ${env} to a folder you can write",
            file=sys.stderr,
            flush=True,
        )
        return False


class WouldOverwrite(UsageError):
    """An output path that names a file the tool did not write: a run's config, its metrics, a
    checkpoint, anyone's file. Replacing it takes an explicit --force."""


def check_may_replace(
    path: str | Path,
    marker: bytes,
    flag: str,
    tool: str,
    force: bool = False,
    fix: str = "name another file, or add --force to replace it",
) -> None:
    """Before a tool writes `path` (its own flag `flag`): refuse to replace an existing file that
    does not begin with `marker` (what the tool's own output begins with: its earlier output may be
    replaced), unless `force`. Never replaced, even with force: a folder or a device (a rename
    over /dev/null would replace the device itself)."""
    path = Path(path)
    try:
        st = os.stat(path)  # follows a link: what the link points at is what would be lost
    except FileNotFoundError:
        return
    except OSError as e:
        raise WouldOverwrite(f"{flag} {path} cannot be checked ({e.strerror}); name another file") from None
    if not stat.S_ISREG(st.st_mode):
        raise WouldOverwrite(f"{flag} {path} is {file_kind(st.st_mode)}; name a regular file to write")
    if force:
        return
    try:
        with open(path, "rb") as f:
            head = f.read(len(marker))
    except OSError:
        head = b""
    if head != marker:
        raise WouldOverwrite(f"{flag} {path} exists and was not written by {tool}; {fix}")


class UnreadableFile(UsageError):
    """A file that must not be read: not a regular file (a FIFO blocks, /dev/zero never ends),
    or larger than its reader's limit."""


def file_kind(mode: int) -> str:
    """What a path that is not a regular file is, for a one-line refusal."""
    return (
        "a directory"
        if stat.S_ISDIR(mode)
        else "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a character device"
        if stat.S_ISCHR(mode)
        else "a block device"
        if stat.S_ISBLK(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "not a regular file"
    )


def read_bounded(path: str | Path, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes, else UnreadableFile (one line). The
    file is opened non-blocking and checked through its descriptor (fstat), so a FIFO is refused
    rather than waited on and a link to /dev/zero is refused rather than read for ever; no more
    than limit + 1 bytes are read even if the file grows meanwhile."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise UnreadableFile(f"{path} cannot be read ({e.strerror or type(e).__name__})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnreadableFile(f"{path} is {file_kind(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise UnreadableFile(
                f"{path} is {format_bytes(st.st_size)}, above the {format_bytes(limit)} this reader takes"
            )
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    except OSError as e:
        raise UnreadableFile(f"{path} cannot be read ({e.strerror or type(e).__name__})") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise UnreadableFile(f"{path} grew past {format_bytes(limit)} while it was read")
    return data
