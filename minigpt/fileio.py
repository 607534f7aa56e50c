"""Files read and written beside the run: bounded reads (a file is never read past its checked
size), caches of measured rates, and a tool's output that must not replace a file it did not
write. How a file is written whole (and a full disk's one line) is minigpt/core/runs.py's."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from minigpt.core.runs import DiskFull, format_bytes
from minigpt.errors import UsageError


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
        from minigpt.core.runs import atomic_write

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
