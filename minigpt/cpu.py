"""CPU-only set-up: make glibc's malloc keep the big blocks it frees.

A training step allocates and frees the same large tensors every step (at the default preset the
logits and their gradient are 8 x 256 x 50304 floats, 412 MB each). glibc serves blocks above its
mmap threshold (at most 32 MB) with a fresh mmap and hands them back to the kernel with munmap
when they are freed. Every step then touches hundreds of MB of brand-new pages, and the kernel
zero-fills each 4 KiB page on its first touch: page faults, not arithmetic, become a large part of
the step (on the 2-core CPU of benchmarks/results, keeping the blocks gave 1.74x tokens/s with
bf16 autocast in cpu-small.md, and 1.38x in fp32 and 1.64x with AMP for the bare loop of
cpu-nanogpt-shape.md). Telling malloc never to use mmap for big blocks and never
to trim the heap keeps the freed blocks for the next step, as PyTorch's CUDA caching allocator does
on a GPU. The price: the process keeps its peak memory instead of returning it to the system.

jemalloc or tcmalloc through LD_PRELOAD do the same (Intel's PyTorch CPU tuning guide recommends
them); this needs no extra library. Only glibc has mallopt: elsewhere it is a no-op, said so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4


def keep_freed_memory() -> str:
    """Apply the setting; return a line for the log saying what was done."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "CPU allocator: left as is (not glibc)"
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    if not ok:
        return "CPU allocator: mallopt refused the setting; left as is"
    return ("CPU allocator: glibc malloc keeps freed blocks (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=2 GiB): "
            "no page faults on each step's big tensors; --no-keep-freed-memory to compare")


def _glibc():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def bounded_freed_memory(mmap_threshold: int = 2**30, trim_threshold: int = 256 * 2**20) -> str:
    """glibc serves blocks up to `mmap_threshold` from its heap, where freed blocks are reused
    without page faults, and gives the heap's free top back to the system above `trim_threshold`.
    Setting the threshold also stops glibc from moving it on its own (at most 32 MiB)."""
    libc = _glibc()
    if libc is None:
        return "CPU allocator: left as is (not glibc)"
    if not (libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1
            and libc.mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1):
        return "CPU allocator: mallopt refused the setting; left as is"
    return (f"CPU allocator: glibc malloc, blocks up to {mmap_threshold // 2**20} MiB from the heap, "
            f"trimmed above {trim_threshold // 2**20} MiB")
