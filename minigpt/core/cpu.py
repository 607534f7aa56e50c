"""CPU-only set-up: which malloc serves the step's big tensors, and how much it keeps.

A training step allocates and frees the same large tensors every step (at the default preset the
logits and the loss's gradient are 8 x 256 x 50304 values each). An allocator that gives them back
to the system between steps makes the kernel zero-fill every page again on its first touch: page
faults, not arithmetic, become a large part of the step. One that keeps every freed page holds more
than the step needs. benchmarks/results/cpu-allocator.md measures the trainer itself under each
choice, evaluations included (page faults and CPU seconds per step, tokens/s, peak RSS against the
allocator's true peak), on the machine it names; the choice here follows it:

- mimalloc, the libmimalloc.so of pip's cmeel-mimalloc (requirements.txt), preloaded by
  run_under_preferred_allocator() with MIMALLOC_ENV: it keeps big blocks apart from small ones,
  and a freed page stays committed for longer than a step, so each step reuses the last one's
  pages.
- glibc can't do both. Its heap is one region that grows at the top: a big block freed under a
  live small one is either kept as a hole (no faults, but the holes add up) or its pages are given
  back (and fault in again). keep_freed_memory() applies the compromise below for a machine
  without a preloadable malloc; preload_hint() says what to install.
- tcmalloc and jemalloc (Debian packages, not installed by the README) are used when mimalloc is
  missing.

Only glibc has mallopt and malloc_trim: elsewhere they are no-ops, said so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4


# What keep_freed_memory() applies without a preloadable malloc: big blocks from glibc's heap, where
# a freed block is reused without page faults, and the heap's free top given back above 256 MiB
# (benchmarks/results/cpu-allocator.md sets it beside glibc's defaults).
MMAP_THRESHOLD = 2**30
TRIM_THRESHOLD = 256 * 2**20
LIBDIR = "/usr/lib/x86_64-linux-gnu"
PRELOADS = {"jemalloc": f"{LIBDIR}/libjemalloc.so.2", "tcmalloc": f"{LIBDIR}/libtcmalloc_minimal.so.4"}
MIMALLOC_DIST = "cmeel-mimalloc"  # the PyPI package (requirements.txt) that ships libmimalloc.so


def mimalloc_library() -> str | None:
    """The libmimalloc.so that pip installed with cmeel-mimalloc, or None. Found through the
    package's own file list, so it works in any venv or prefix."""
    from importlib import metadata

    try:
        files = metadata.distribution(MIMALLOC_DIST).files or []
    except metadata.PackageNotFoundError:
        return None
    lib = next((f for f in files if f.name == "libmimalloc.so"), None)
    return None if lib is None else str(lib.locate())


def preloaded_allocator() -> str | None:
    """ "jemalloc", "tcmalloc" or "mimalloc" when one was loaded through LD_PRELOAD, else None."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return None
    return next((name for name in (*PRELOADS, "mimalloc") if f"lib{name}" in maps), None)


# The preference, by benchmarks/results/cpu-allocator.md (the trainer itself, evaluations included;
# page faults and CPU seconds per step, peak RSS against the allocator's true peak): mimalloc first,
# because requirements.txt installs it (cmeel-mimalloc), so a fresh machine, every developer's and the
# README's first command all take the same path; tcmalloc and jemalloc where mimalloc is missing.
# Re-executing under one of them is what torch's own CPU launcher (torch.backends.xeon.run_cpu) does
# with LD_PRELOAD.
PREFERRED = ("mimalloc", "tcmalloc", "jemalloc")
# mimalloc's options for the trainer, where the user set none. MIMALLOC_PURGE_DELAY is how long (ms)
# a freed page stays committed before mimalloc gives it back to the system: its default (1 s in
# mimalloc 3.4) can be shorter than a step on a busy 2-core machine, and then the step's big tensors
# fault in again; 3 s is several steps (0.37 s each for the main job on a quiet 2-core Xeon), and
# what stays free that long (an evaluation's shapes) goes back. MIMALLOC_ALLOW_THP=0: no transparent
# huge pages, each 2 MiB page resident whole however little of it is used, and zeroed whole on the
# first steps' faults (benchmarks/allocator.py).
MIMALLOC_ENV = {"MIMALLOC_PURGE_DELAY": "3000", "MIMALLOC_ALLOW_THP": "0"}
NO_PRELOAD_ENV = "MINIGPT_MALLOC"  # =glibc: stay on glibc's malloc (the allocator benchmark sets it)
OWN_OPTIONS_ENV = "MINIGPT_MALLOC_OPTIONS"  # which of MIMALLOC_ENV the trainer set (the user set the rest)
# A step longer than the purge delay (GPT-2's on a 2-core CPU: about 14 s) gives its big tensors
# back between their uses and faults them in again every step (a GPT-2 forward 6.8 s instead of
# 2.5 here): after the first step the trainer lengthens its own delay to twice that step
# (outlast_step). mi_option_purge_delay's place in mimalloc 3.4's mi_option_t (mimalloc.h); it is
# changed only where mi_option_get there returns the delay the trainer set, so another layout is
# left alone.
MI_OPTION_PURGE_DELAY = 15


def installed_allocators(exists=None) -> dict[str, str]:
    """Each preloadable malloc found on this machine -> its library, in PREFERRED order."""
    import os

    exists = exists or os.path.exists
    found = {**PRELOADS, "mimalloc": mimalloc_library()}
    return {n: found[n] for n in PREFERRED if found[n] and exists(found[n])}


STARTED_ENV = "MINIGPT_STARTED_AT"  # the script's start, carried through the re-exec (time.time())


def preload_command(argv: list[str], env: dict, exists=None) -> tuple[list[str], dict] | None:
    """The (command, environment) that runs this same process under the preferred allocator, or None
    when it should run as it is: not Linux, a GPU's driver present (the choice is for CPU runs), one
    already preloaded, none installed, glibc asked for ($MINIGPT_MALLOC=glibc, or
    --no-keep-freed-memory on the command line or in $MINIGPT_ARGS), or this is the re-executed
    process. `exists` (os.path.exists) is there for tests."""
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
    installed = installed_allocators(exists)
    if not installed:
        return None
    name, lib = next(iter(installed.items()))
    options = MIMALLOC_ENV if name == "mimalloc" else {}
    child_env = {**options, **env, "LD_PRELOAD": lib, NO_PRELOAD_ENV: "preloaded"}  # the user's options win
    child_env[OWN_OPTIONS_ENV] = ",".join(k for k in options if k not in env)
    return [sys.executable, *sys.orig_argv[1:]], child_env


def outlast_step(step_s: float) -> int | None:
    """Under the trainer's own mimalloc purge delay (not one the user set): make it at least twice
    this step, so that the next steps find their freed pages still committed. Returns the new delay
    in ms, or None when nothing was changed (a short step, another malloc, the user's setting)."""
    import os

    if "MIMALLOC_PURGE_DELAY" not in os.environ.get(OWN_OPTIONS_ENV, "").split(","):
        return None
    if preloaded_allocator() != "mimalloc" or not (lib_path := mimalloc_library()):
        return None
    try:
        lib = ctypes.CDLL(lib_path)  # the preloaded library: the same handle and the same options
        lib.mi_option_get.restype, lib.mi_option_get.argtypes = ctypes.c_long, [ctypes.c_int]
        lib.mi_option_set.restype, lib.mi_option_set.argtypes = None, [ctypes.c_int, ctypes.c_long]
        current, wanted = lib.mi_option_get(MI_OPTION_PURGE_DELAY), math.ceil(2000 * step_s)
        if current != int(MIMALLOC_ENV["MIMALLOC_PURGE_DELAY"]) or wanted <= current:
            return None
        lib.mi_option_set(MI_OPTION_PURGE_DELAY, wanted)
    except (OSError, AttributeError):
        return None
    return wanted


def outlast_first_step(step_s: float, log) -> None:
    """After the process's first step: outlast_step, and the log's line when it changed the delay."""
    if ms := outlast_step(step_s):
        log.info(f"CPU allocator: mimalloc keeps freed pages {ms / 1000:.1f} s, twice the first step")


def run_under_preferred_allocator(argv: list[str], started_at: float | None = None) -> None:
    """CPU runs: replace this process (same pid, same arguments) by one with the preferred malloc
    preloaded; a running process cannot swap its malloc. Returns when there is nothing to do.
    `started_at` (time.time() as the script began) goes to the new process in $MINIGPT_STARTED_AT:
    its start-up counts from there, not from its own start (script_started_at)."""
    import os

    if (cmd := preload_command(argv, dict(os.environ))) is not None:
        if started_at is not None:
            cmd[1][STARTED_ENV] = repr(started_at)
        os.execve(cmd[0][0], cmd[0], cmd[1])


def script_started_at(default: float) -> float:
    """When the trainer's script began, for its start-up figure: the clock the first process passed
    through the re-exec under the preferred malloc, else `default` (this process's own import of the
    script). Read once: the variable is removed, so nothing started from here inherits it."""
    import os

    value = os.environ.pop(STARTED_ENV, None)
    try:
        return float(value) if value else default
    except ValueError:
        return default


def preload_hint() -> str | None:
    """What to install when no preferred allocator is there (the trainer then keeps glibc's heap)."""
    if preloaded_allocator() or installed_allocators():
        return None
    return (
        "mimalloc faults the step's big tensors in once, not every step, at ~1.6x the allocator's "
        f"peak (benchmarks/results/cpu-allocator.md); pip install {MIMALLOC_DIST} (requirements.txt) "
        "and the trainer uses it"
    )


def keep_freed_memory() -> str:
    """Apply the setting; return a line for the log saying what was done."""
    import os

    preloaded = preloaded_allocator()
    if preloaded:
        prefix = f"{preloaded.upper()}_"  # its options in the environment: MIMALLOC_PURGE_DELAY=...
        options = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(prefix)]
        named = ", ".join([f"{preloaded} (LD_PRELOAD)", *options])
        return f"CPU allocator: {named}; glibc's settings left alone"
    return bounded_freed_memory(MMAP_THRESHOLD, TRIM_THRESHOLD, give_back_at_evaluations=True)


def never_return_memory(give_back_at_evaluations: bool = False) -> str:
    """glibc never maps a block afresh and never trims its heap's top (minigpt's first setting:
    no page faults in a step, and the heap keeps what an evaluation's shapes split off it); with
    `give_back_at_evaluations`, release_freed_memory() gives its free blocks back there."""
    global _release_at_evaluation
    libc = _glibc()
    if libc is None:
        return "CPU allocator: left as is (not glibc)"
    ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    if not ok:
        return "CPU allocator: mallopt refused the setting; left as is"
    _release_at_evaluation = give_back_at_evaluations
    return (
        "CPU allocator: glibc malloc keeps freed blocks (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=2 GiB"
        + ("; given back around evaluations" if give_back_at_evaluations else "")
        + "): no page faults on each step's big tensors; --no-keep-freed-memory to compare"
    )


# Set by keep_freed_memory(): the kept heap is given back around evaluations (release_freed_memory).
_release_at_evaluation = False
_glibc_setting = "glibc defaults"  # what choose_allocator() set, for allocator_in_use()


def release_freed_memory() -> bool:
    """Under keep_freed_memory()'s glibc setting, give the pages of every free block in glibc's heap
    back to the system (malloc_trim(0)); True when some were. The kept heap serves a training step's
    regular pattern well, but an evaluation's other shapes split its big free blocks for small ones,
    so their big tensors land on fresh pages, and the process's RSS grows to several times the
    allocator's true peak by the first evaluation. mimalloc needs no such call (a no-op there): it
    keeps big blocks apart from small ones, and gives back what stayed free for
    MIMALLOC_PURGE_DELAY (asking it at evaluations, with mi_collect, faults pages in again and
    lowers no peak)."""
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


def choose_allocator(keep_freed: bool) -> str:
    """Set the CPU allocator for the trainer (--keep-freed-memory, the default, or glibc's own
    settings) before its first big allocation, and say what was done."""
    global _glibc_setting
    _glibc_setting = "glibc, freed memory kept" if keep_freed else "glibc defaults"
    note = keep_freed_memory() if keep_freed else "CPU allocator: glibc defaults (--no-keep-freed-memory)"
    return note + (f"\nCPU allocator: {hint}" if (hint := preload_hint()) else "")


def allocator_in_use() -> str:
    """The malloc this process runs on, as choose_allocator() left it: a preloaded one's name, or
    glibc's setting. Timings taken under one do not hold under another (a step's big tensors
    fault in again, or not), so measured rates are kept per allocator."""
    return preloaded_allocator() or _glibc_setting
