"""Checks of the paths a tool is given, before it opens any: a name longer than the file system
takes fails deep inside open() or mkdir() as "[Errno 36] File name too long", a line that names
no flag. The tools (report, compare, traces, snapshot) and sample.py say it in their own words.
Standard library only."""

from __future__ import annotations

import os

from minigpt.errors import UsageError

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


def check_names(*given: tuple[str | os.PathLike | None, str]) -> None:
    """Each (path, flag) given: one line naming the flag for a path too long to open; None skipped."""
    for path, flag in given:
        if path is not None and (problem := name_problem(path)):
            raise UsageError(f"{flag}: the path {problem}; choose a shorter one")
