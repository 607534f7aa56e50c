"""Files that must survive a crash: written to a temporary name beside the target, flushed to
disk, then renamed into place (a rename within a folder is atomic). A reader sees the old file or
the new one, never half of either."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator


@contextmanager
def atomic_open(path: str | Path, mode: str = "wb") -> Iterator[IO]:
    """open() for writing, with the rename on success; on an error the target is left untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # per process: ranks may share a folder
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: str | Path, data: bytes | str) -> None:
    with atomic_open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
