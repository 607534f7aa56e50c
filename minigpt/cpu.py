"""CPU-only set-up: which malloc serves the step's big tensors, and how much it keeps.

A training step allocates and frees the same large tensors every step (at the default preset the
logits and their gradient are 8 x 256 x 50304 floats, 412 MB each). glibc serves blocks above its
mmap threshold (at most 32 MB) with a fresh mmap and hands them back with munmap when freed: every
step touches hundreds of MB of new pages the kernel zero-fills, and page faults become a large part
of the step. benchmarks/results/cpu-allocator.md measures the trainer itself under each choice,
evaluations included, as peak RSS against the allocator's true peak and tokens/s:

- tcmalloc (LD_PRELOAD) was the fastest and kept 1.35x the true peak; jemalloc 1.21x, a little
  slower. run_under_preferred_allocator() re-executes the trainer under the first installed.
- Without them, keep_freed_memory(): glibc serves blocks up to 1 GiB from its heap, where a freed
  block is reused without page faults, trims the heap's top above 256 MiB, and
  release_freed_memory() gives its free blocks back around evaluations, whose other shapes split
  the kept blocks (the heap grew to 3.6x the true peak at the first evaluation without it; 2x with).
- glibc's defaults (--no-keep-freed-memory) kept 1.24x at ~0.75x the speed.

Only glibc has mallopt and malloc_trim: elsewhere they are no-ops, said so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4


# What keep_freed_memory() applies without tcmalloc or jemalloc: big blocks from glibc's heap, where
# a freed block is reused without page faults, and the heap's free top given back above 256 MiB
# (benchmarks/results/cpu-allocator.md: 1.28x glibc's defaults' tokens/s, 2x the true peak resident).
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


# The preference, by benchmarks/results/cpu-allocator.md (the trainer itself, evaluations included):
# tcmalloc and jemalloc kept peak RSS within 1.5x of the allocator's true peak, no glibc setting that
# ran as fast did (glibc's defaults did, at ~0.75x the tokens/s). Re-executing under one of them is
# what torch's own CPU launcher (torch.backends.xeon.run_cpu) does with LD_PRELOAD.
PREFERRED = ("tcmalloc", "jemalloc")
NO_PRELOAD_ENV = "MINIGPT_MALLOC"  # =glibc: stay on glibc's malloc (the allocator benchmark sets it)


def preload_command(argv: list[str], env: dict, exists=None) -> tuple[list[str], dict] | None:
    """The (command, environment) that runs this same process under the preferred allocator, or None
    when it should run as it is: not Linux, a GPU's driver present (the choice is for CPU runs), one
    already preloaded, none installed, glibc asked for ($MINIGPT_MALLOC=glibc, or
    --no-keep-freed-memory on the command line or in $MINIGPT_ARGS), or this is the re-executed
    process."""
    import os
    import sys

    exists = exists or os.path.exists
    flags = [*argv, *env.get("MINIGPT_ARGS", "").split()]
    if platform.system() != "Linux" or exists("/dev/nvidiactl"):
        return None
    if env.get(NO_PRELOAD_ENV) == "glibc" or "--no-keep-freed-memory" in flags:
        return None
    if preloaded_allocator() or env.get("LD_PRELOAD"):
        return None
    lib = next((PRELOADS[n] for n in PREFERRED if exists(PRELOADS[n])), None)
    if lib is None:
        return None
    return [sys.executable, *sys.orig_argv[1:]], {**env, "LD_PRELOAD": lib, NO_PRELOAD_ENV: "preloaded"}


def run_under_preferred_allocator(argv: list[str]) -> None:
    """CPU runs: replace this process (same pid, same arguments) by one with the preferred malloc
    preloaded; a running process cannot swap its malloc. Returns when there is nothing to do."""
    import os

    if (cmd := preload_command(argv, dict(os.environ))) is not None:
        os.execve(cmd[0][0], cmd[0], cmd[1])


def preload_hint() -> str | None:
    """What to install when no preferred allocator is there (the trainer then keeps glibc's heap)."""
    import os

    if preloaded_allocator() or any(os.path.exists(PRELOADS[n]) for n in PREFERRED):
        return None
    return (
        "tcmalloc kept peak RSS within 1.5x of the allocator's peak at glibc's best speed "
        "(benchmarks/results/cpu-allocator.md); apt-get install libtcmalloc-minimal4 and the trainer "
        "uses it"
    )


def keep_freed_memory() -> str:
    """Apply the setting; return a line for the log saying what was done."""
    preloaded = preloaded_allocator()
    if preloaded:
        return f"CPU allocator: {preloaded} (LD_PRELOAD); glibc's settings left alone"
    return bounded_freed_memory(MMAP_THRESHOLD, TRIM_THRESHOLD, give_back_at_evaluations=True)


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
    their big tensors land on fresh pages: without this, the main job's RSS grew to 3.6x the
    allocator's true peak at its first evaluation (benchmarks/results/cpu-allocator.md)."""
    libc = _glibc() if _release_at_evaluation else None
    return bool(libc is not None and libc.malloc_trim(0))


def _glibc():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def bounded_freed_memory(
    mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD, give_back_at_evaluations=False
) -> str:
    """glibc serves blocks up to `mmap_threshold` from its heap, where freed blocks are reused
    without page faults, and gives the heap's free top back to the system above `trim_threshold`;
    with `give_back_at_evaluations`, release_freed_memory() gives its free blocks back too. Setting
    the threshold also stops glibc from moving it on its own (at most 32 MiB)."""
    global _release_at_evaluation
    libc = _glibc()
    if libc is None:
        return "CPU allocator: left as is (not glibc)"
    if not (
        libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1
        and libc.mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1
    ):
        return "CPU allocator: mallopt refused the setting; left as is"
    _release_at_evaluation = give_back_at_evaluations
    return (
        f"CPU allocator: glibc malloc keeps freed blocks up to {mmap_threshold // 2**20} MiB in its heap "
        f"(trimmed above {trim_threshold // 2**20} MiB"
        + ("; given back around evaluations" if give_back_at_evaluations else "")
        + "): no page faults on each step's big tensors; --no-keep-freed-memory to compare"
    )
