"""CPU-only set-up: make glibc's malloc keep the big blocks it frees.

A training step allocates and frees the same large tensors every step (at the default preset the
logits and their gradient are 8 x 256 x 50304 floats, 412 MB each). glibc serves blocks above its
mmap threshold (at most 32 MB) with a fresh mmap and hands them back to the kernel with munmap
when they are freed. Every step then touches hundreds of MB of brand-new pages, and the kernel
zero-fills each 4 KiB page on its first touch: page faults, not arithmetic, become a large part of
the step (on the 2-core CPU of benchmarks/results, keeping the blocks gave 1.74x tokens/s with
bf16 autocast in cpu-small.md, and 1.38x in fp32 and 1.64x with AMP for the bare loop of
cpu-nanogpt-shape.md). Raising the mmap threshold to 1 GiB serves the big blocks from the heap,
where a freed block is reused by the next step, as PyTorch's CUDA caching allocator does on a GPU;
a trim threshold of 256 MiB still gives the heap's free top back. The price is memory the process
keeps: benchmarks/results/cpu-allocator.md measures peak RSS against the step's true peak for this
setting, the older never-map-never-trim one (never_return_memory), glibc's defaults, and jemalloc
and tcmalloc through LD_PRELOAD (Intel's PyTorch CPU tuning guide recommends them). A running
process cannot change its malloc: preload_hint() gives the command that starts under jemalloc.
Only glibc has mallopt: elsewhere it is a no-op, said so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4


# What keep_freed_memory() applies (benchmarks/results/cpu-allocator.md): big blocks from glibc's
# heap, where a freed block is reused without page faults, and the heap's free top given back
# above 256 MiB. Never mapping and never trimming (the older setting) kept ~1.6-1.7x the step's true
# peak resident; this keeps ~1.5x at the same speed. glibc's defaults keep ~1.2x but ran ~18% slower.
MMAP_THRESHOLD = 2**30
TRIM_THRESHOLD = 256 * 2**20
LIBDIR = "/usr/lib/x86_64-linux-gnu"
PRELOADS = {"jemalloc": f"{LIBDIR}/libjemalloc.so.2", "tcmalloc": f"{LIBDIR}/libtcmalloc_minimal.so.4"}


def preloaded_allocator() -> str | None:
    """ "jemalloc" or "tcmalloc" when one was loaded through LD_PRELOAD, else None."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return None
    return next((name for name in PRELOADS if f"lib{name}" in maps), None)


def preload_hint(argv: list[str]) -> str | None:
    """The command that runs the same job under jemalloc, when it is installed and not in use: in
    benchmarks/results/cpu-allocator.md it was the fastest setting and kept the least resident.
    A running process cannot swap its malloc, so the trainer prints this rather than re-executing."""
    import os
    import shlex
    import sys

    if preloaded_allocator() or not os.path.exists(PRELOADS["jemalloc"]):
        return None
    return f"LD_PRELOAD={PRELOADS['jemalloc']} {shlex.join([os.path.basename(sys.executable), *argv])}"


def keep_freed_memory() -> str:
    """Apply the setting; return a line for the log saying what was done."""
    preloaded = preloaded_allocator()
    global _release_at_evaluation
    if preloaded:
        return f"CPU allocator: {preloaded} (LD_PRELOAD); glibc's settings left alone"
    line = bounded_freed_memory(MMAP_THRESHOLD, TRIM_THRESHOLD)
    _release_at_evaluation = line.startswith("CPU allocator: glibc malloc keeps")
    return line.replace("; --no-keep", ", given back around evaluations; --no-keep")


def never_return_memory() -> str:
    """The older setting: glibc never maps a block afresh and never trims its heap (fastest on
    a quiet machine, and the process keeps its peak resident for good)."""
    libc = _glibc()
    if libc is None:
        return "CPU allocator: left as is (not glibc)"
    ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    if not ok:
        return "CPU allocator: mallopt refused the setting; left as is"
    return (
        "CPU allocator: glibc malloc keeps freed blocks (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=2 GiB): "
        "no page faults on each step's big tensors; --no-keep-freed-memory to compare"
    )


# Set by keep_freed_memory(): the kept heap is given back around evaluations (release_freed_memory).
_release_at_evaluation = False


def release_freed_memory() -> bool:
    """Under keep_freed_memory(), give the pages of every free block in glibc's heap back to the
    system (malloc_trim(0)); True when some were. The kept heap serves a training step's regular
    pattern well, but an evaluation's other shapes split its big free blocks for small ones, so
    their big tensors land on fresh pages: without this, the default main job's RSS grew from 2.4
    to 5.9 GiB at its first evaluation (benchmarks/results/cpu-allocator.md measures it)."""
    libc = _glibc() if _release_at_evaluation else None
    return bool(libc is not None and libc.malloc_trim(0))


def _glibc():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def bounded_freed_memory(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> str:
    """glibc serves blocks up to `mmap_threshold` from its heap, where freed blocks are reused
    without page faults, and gives the heap's free top back to the system above `trim_threshold`.
    Setting the threshold also stops glibc from moving it on its own (at most 32 MiB)."""
    libc = _glibc()
    if libc is None:
        return "CPU allocator: left as is (not glibc)"
    if not (
        libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1
        and libc.mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1
    ):
        return "CPU allocator: mallopt refused the setting; left as is"
    return (
        f"CPU allocator: glibc malloc keeps freed blocks up to {mmap_threshold // 2**20} MiB in its heap "
        f"(trimmed above {trim_threshold // 2**20} MiB): no page faults on each step's big tensors; "
        "--no-keep-freed-memory to compare"
    )
