"""Time in collectives per stage under FSDP and TP, from one profiled step per log interval.

Under DDP the all-reduce sits at the end of the backward, and a mark where the last gradient bucket
is ready splits it off (straggler.py's RankTimer). FSDP2's all-gathers, reduce-scatters and waits, and
DTensor's all-reduces, are spread through every block of the forward and the backward, issued from
inside torch; their record_function ranges ("FSDP::all_gather (blocks.0)",
"_c10d_functional::wait_tensor", ...) are the one place they can be seen without patching torch.
`CommProbe` runs a CPU-only torch.profiler (no shapes, memory, stacks or device activity: the
cheapest reader of those ranges) around one step, and `comm_by_stage` takes, per stage, the union
of the collective ranges on the training thread inside it. On a GPU that is the host's time issuing
and waiting for collectives; the device's overlap is in the trace (minigpt.analysis.traces).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity

from minigpt.config import STAGE_NAMES
from minigpt.core import torchcompat

# Profiler ranges that are communication: c10d and functional collectives, their waits, gloo's own
# ranges, and FSDP2's gather / reduce ranges (which include its copy-in and copy-out).
COMM_PATTERN = re.compile(
    r"all_gather|allgather|reduce_scatter|post_backward_reduce|rs_wait|all_reduce|allreduce|"
    r"wait_tensor|broadcast|gloo:",
    re.IGNORECASE,
)


def _union_us(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def stage_comm_ms(events, stages: tuple[str, ...]) -> dict[str, float]:
    """Exposed communication per stage from a torch.profiler's `prof.events()`: on the thread that
    runs the stages' record_function ranges, the union of the communication ranges (COMM_PATTERN)
    that fall inside each stage's range, in ms summed over the profiled steps. Communication that
    overlaps with the thread's compute runs on other threads and is not counted: what is left is
    the time the training thread waited for, or drove, collectives. "step" covers the whole
    profile (communication outside any stage too)."""
    return comm_by_stage([(e.name, e.thread, e.time_range.start, e.time_range.end) for e in events], stages)


def comm_by_stage(spans: list[tuple[str, int, float, float]], stages: tuple[str, ...]) -> dict[str, float]:
    """stage_comm_ms over (name, thread, start us, end us) spans (torchcompat.kineto_spans)."""
    ranges = [sp for sp in spans if sp[0] in stages]
    if not ranges:
        return {}
    thread = ranges[0][1]
    comm = [(a, b) for name, t, a, b in spans if t == thread and COMM_PATTERN.search(name)]
    out = {s: 0.0 for s in stages}
    for name, _, lo, hi in ranges:
        out[name] += _union_us([(max(a, lo), min(b, hi)) for a, b in comm if a < hi and b > lo]) / 1000
    out["step"] = _union_us(comm) / 1000
    return out


@contextmanager
def quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null: Kineto prints "USDT: ... profiler_start" and "profiler_stop"
    from C++ each time a profiler starts and stops (no setting turns it off), which would put two
    lines per rank into the log at every interval. Only around the start and stop."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


class CommProbe:
    """Each stage's time in collectives, from one profiled step per log interval.

    The cost is kept small: one step of each interval (the first eligible one), the profiler started
    and stopped outside that step's clock, its events read after it as raw spans. Eligible: not the
    run's first step (one-time costs: lazy initialisation, first allocations), and no other profiler
    in the step (two cannot record at once): not in --use-profiler's window or its warm-up step, not
    the --memory-profiler step. Every rank profiles the same step, so no rank waits on another's
    profiler. The log line says which step the figure is from."""

    def __init__(self, cfg):
        self.window = (
            range(cfg.profile_step_start - 1, cfg.profile_step_end) if cfg.use_profiler else range(0)
        )
        self.memory_step = cfg.memory_profile_step if cfg.memory_profiler else None
        self.due = True  # no step of this interval profiled yet
        self.figure: tuple[int, dict[str, float]] | None = None
        self.prof: torch.profiler.profile | None = None

    def start(self, n: int, first_step: int) -> bool:
        """Start profiling step `n` if it is the interval's profiled step; say whether it is."""
        busy = n in self.window or n == self.memory_step or torchcompat.profiler_running()
        if not self.due or n == first_step or busy:
            return False
        self.due = False
        self.prof = torch.profiler.profile(activities=[ProfilerActivity.CPU])
        with quiet_stderr():
            self.prof.__enter__()
        return True

    def stop(self, n: int) -> None:
        """Stop the profiler and keep step `n`'s figure."""
        prof, self.prof = self.prof, None
        with quiet_stderr():
            prof.__exit__(None, None, None)
        ms = comm_by_stage(torchcompat.kineto_spans(prof), STAGE_NAMES)
        self.figure = (n, {s: ms[s] for s in STAGE_NAMES if s in ms})

    def abandon(self) -> None:
        """Stop the profiler of a step that did not finish (it raised): no figure, no profiler left on."""
        prof, self.prof = self.prof, None
        if prof is not None:
            with quiet_stderr():
                prof.__exit__(None, None, None)

    def take(self) -> tuple[int, dict[str, float]] | None:
        """The interval's figure, once; the next interval profiles a step of its own."""
        figure, self.figure, self.due = self.figure, None, True
        return figure
