"""Where the time goes: named stages, the profiler window, the Nsight capture range, CUDA memory
history. Knows nothing of GPT: it works on any training step.

- `StageTimer.stage(name)` opens a `record_function` range (seen by the PyTorch profiler) and an
  NVTX range of the same name (seen by Nsight Systems), and times the stage on the host and on the
  device. It never synchronises: CUDA events are read back at the log interval, when the loop
  syncs anyway. On the CPU the device time is the stage's host time.
- `make_profiler` builds a torch.profiler window with Megatron's semantics (steps S..E-1).
- `NsysCaptureRange` calls cudaProfilerStart/Stop around the same window for `nsys --capture-range`.
- `MemoryHistory` records CUDA allocations and dumps snapshots for pytorch.org/memory_viz.
"""

from __future__ import annotations

import pickle
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import nvtx
import torch
from torch.profiler import ProfilerAction, ProfilerActivity, record_function, tensorboard_trace_handler

from minigpt.fileio import atomic_open, atomic_write

STAGES = ("data_to_device", "forward", "backward", "optimizer_step")
STEP_RANGE = "train_step"
NVTX_DOMAIN = "minigpt"  # one domain: Nsight can filter the project's ranges from PyTorch's own
STAGE_COLORS = {"data_to_device": "yellow", "forward": "green", "backward": "red",
                "optimizer_step": "blue", STEP_RANGE: "white"}


@dataclass
class StageTimes:
    """What StageTimer.read() returns: per-stage means over the interval, and every step's figures
    (medians for the straggler detector). Milliseconds."""
    host_ms: dict[str, float] = field(default_factory=dict)
    device_ms: dict[str, float] = field(default_factory=dict)
    host_steps: list[dict[str, float]] = field(default_factory=list)
    device_steps: list[dict[str, float]] = field(default_factory=list)


class StageTimer:
    """Per-stage host and device time of each step, read (and reset) at the log interval.

    `sleep_ms` makes chosen stages slower by sleeping inside them: a teaching and testing aid
    (--simulate-slow-rank), never on by default."""

    def __init__(self, device: str, enabled: bool = True, sleep_ms: dict[str, float] | None = None):
        self.cuda = device == "cuda"
        self.enabled = enabled
        self.sleep_ms = sleep_ms or {}
        self.open: dict[str, tuple[float, torch.cuda.Event | None]] = {}  # stage -> (start time, start event)
        self.split_of: dict[str, str] = {}  # stage -> the name of its split (see add_split)
        self.splits: dict[str, tuple[str, float, torch.cuda.Event | None]] = {}  # split -> (stage, s, event)
        self.step_host: dict[str, float] = defaultdict(float)  # ms of the step in flight
        self.host_steps: list[dict[str, float]] = []
        self.events: list[tuple[int, str, torch.cuda.Event, torch.cuda.Event]] = []  # (step, stage, start, end)

    @contextmanager
    def step(self) -> Iterator[None]:
        """The whole training step: a range (no timer of its own; the loop times the step)."""
        with self.stage(STEP_RANGE, timed=False):
            yield
        if self.enabled:
            self.host_steps.append(dict(self.step_host))
            self.step_host.clear()

    @contextmanager
    def stage(self, name: str, timed: bool = True) -> Iterator[None]:
        # NVTX start/end ranges are process-wide, unlike push/pop ranges, which are per thread:
        # the backward's kernels are launched from autograd's own thread, and Nsight only puts
        # them under the `backward` range if the range is not tied to the launching thread.
        nvtx_range = nvtx.start_range(message=name, color=STAGE_COLORS.get(name), domain=NVTX_DOMAIN)
        timed = timed and self.enabled
        with record_function(name):
            start = None
            if timed and self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            self.open[name] = (t0, start)
            try:
                if name in self.sleep_ms:
                    time.sleep(self.sleep_ms[name] / 1000)
                yield
            finally:
                del self.open[name]
                if timed:
                    elapsed = time.perf_counter() - t0
                    self.step_host[name] += 1000 * elapsed
                    end = None
                    if self.cuda:
                        end = torch.cuda.Event(enable_timing=True)
                        end.record()
                        self.events.append((len(self.host_steps), name, start, end))
                    split = self.split_of.get(name)
                    if split is not None:  # the split's last mark inside this stage, else all of it
                        _, seconds, event = self.splits.pop(split, (name, elapsed, end))
                        self.step_host[split] += 1000 * seconds
                        if self.cuda:
                            self.events.append((len(self.host_steps), split, start, event))
                nvtx.end_range(nvtx_range)

    def add_split(self, stage: str, name: str) -> None:
        """Time `name`, the part of every `stage` up to its last split() mark; a stage run without a
        mark counts whole. (Under DDP: the backward's compute, up to the last gradient bucket ready;
        a micro-step under no_sync has no all-reduce to wait for, so all of it is compute.)"""
        self.split_of[stage] = name

    def split(self, stage: str, name: str) -> None:
        """Mark, now, the end of `name`: the part of the open `stage` done so far. Called several
        times in one stage, the last mark counts. Safe from another thread (autograd's)."""
        if not self.enabled or stage not in self.open:
            return
        t0, _ = self.open[stage]
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.splits[name] = (stage, time.perf_counter() - t0, event)

    def read(self) -> StageTimes:
        """The steps completed since the last read. On CUDA call it only after a synchronize:
        every event recorded so far must have completed."""
        if not self.enabled or not self.host_steps:
            self.host_steps.clear()
            self.events.clear()
            return StageTimes()
        host_steps = self.host_steps
        if self.cuda:
            device_steps = [defaultdict(float) for _ in host_steps]
            for i, name, start, end in self.events:
                if i < len(device_steps):
                    device_steps[i][name] += start.elapsed_time(end)
            device_steps = [dict(d) for d in device_steps]
        else:
            device_steps = host_steps  # the CPU runs each op as the host issues it
        names = [n for n in (*STAGES, *sorted({k for s in host_steps for k in s} - set(STAGES)))
                 if any(n in s for s in host_steps)]
        n = len(host_steps)
        times = StageTimes(
            host_ms={k: sum(s.get(k, 0.0) for s in host_steps) / n for k in names},
            device_ms={k: sum(s.get(k, 0.0) for s in device_steps) / n for k in names},
            host_steps=host_steps, device_steps=device_steps)
        self.host_steps, self.events = [], [e for e in self.events if e[0] >= n]
        self.events = [(i - n, *rest) for i, *rest in self.events]
        return times


# ---------------------------------------------------------------------------- profiler window

def profiler_schedule(start: int, end: int) -> Callable[[int], ProfilerAction]:
    """What the profiler does during training step n (1-based, Megatron's semantics): record steps
    start..end-1, after one warm-up step before `start` when there is one (the first profiled
    step would otherwise carry the profiler's own start-up cost), then nothing (repeat=1)."""
    def action(n: int) -> ProfilerAction:
        if n == start - 1:
            return ProfilerAction.WARMUP
        if start <= n < end - 1:
            return ProfilerAction.RECORD
        if n == end - 1:
            return ProfilerAction.RECORD_AND_SAVE
        return ProfilerAction.NONE
    return action


def make_profiler(trace_dir: Path, rank: int, first_step: int, start: int, end: int, device: str,
                  with_stack: bool = False, on_window_end: Callable | None = None) -> torch.profiler.profile:
    """A torch.profiler window over training steps start..end-1, whose trace lands in trace_dir as
    rank{R}_dp{R}.*.pt.trace.json.gz, the naming torch-tb-profiler groups by worker (and its
    Distributed view by rank). `first_step` is the training step the loop runs next (1-based;
    later than 1 after --resume): the trace's ProfilerStep#N markers then carry the training
    step numbers of the log."""
    # gzip: LLM traces reach hundreds of MB and compress about 16x; torch-tb-profiler, Perfetto
    # and chrome://tracing all read .json.gz.
    write_trace = tensorboard_trace_handler(str(trace_dir), worker_name=f"rank{rank}_dp{rank}", use_gzip=True)

    def on_trace_ready(prof: torch.profiler.profile) -> None:
        write_trace(prof)
        if on_window_end is not None:
            on_window_end(prof)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    schedule = profiler_schedule(start, end)
    prof = torch.profiler.profile(
        activities=activities, schedule=schedule, on_trace_ready=on_trace_ready,
        record_shapes=True, profile_memory=True, with_flops=True, with_modules=True,
        with_stack=with_stack,  # opt-in: Python stacks make the trace several times larger and slower
    )
    # The profiler counts its steps from 0; start its count at the training step instead, before
    # it is entered (its action for the current step is derived from the count).
    prof.step_num = first_step
    prof.current_action = schedule(first_step)
    if hasattr(prof, "_prev_schedule_action"):
        prof._prev_schedule_action = prof.current_action
    return prof


def top_operators(prof: torch.profiler.profile, device: str, rows: int = 20) -> str:
    """The profiler's operator table, sorted by device time on a GPU and by host time otherwise."""
    sort_by = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort_by, row_limit=rows)


def has_device_kernels(prof: torch.profiler.profile) -> bool:
    """False on a GPU run means CUPTI recorded nothing: a broken set-up that otherwise goes unseen."""
    return any(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())


# ---------------------------------------------------------------------------- Nsight Systems

class NsysCaptureRange:
    """cudaProfilerStart at step `start`, cudaProfilerStop before step `end`, and in between
    emit_nvtx, so every aten op is an NVTX range too. Run under
    `nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop`."""

    def __init__(self, start: int, end: int):
        self.start, self.end = start, end
        self.emit: torch.autograd.profiler.emit_nvtx | None = None

    def before_step(self, step: int) -> None:
        """Call before running training step `step` (1-based)."""
        if step == self.start:
            torch.cuda.cudart().cudaProfilerStart()
            self.emit = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self.emit.__enter__()
        elif step == self.end:
            self.stop()

    def stop(self) -> None:
        if self.emit is not None:
            torch.cuda.synchronize()  # let the window's kernels finish inside the capture
            self.emit.__exit__(None, None, None)
            self.emit = None
            torch.cuda.cudart().cudaProfilerStop()


# ---------------------------------------------------------------------------- CUDA memory

class MemoryHistory:
    """torch.cuda.memory._record_memory_history, bounded, with Python stacks only: C++ frames make
    a dump take minutes. Snapshots open at pytorch.org/memory_viz; beside each pickle a text file
    lists the largest live allocations with their Python frames."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries

    def start(self) -> None:
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                                 max_entries=self.max_entries)

    def dump(self, path: Path) -> Path:
        snapshot = torch.cuda.memory._snapshot()
        with atomic_open(path) as f:
            pickle.dump(snapshot, f)
        atomic_write(path.with_suffix(".txt"), largest_allocations(snapshot))
        return path

    def stop(self) -> None:
        torch.cuda.memory._record_memory_history(enabled=None)

    def dump_on_oom(self, path: Path) -> None:
        """Write `path` when the allocator runs out of memory, before the error propagates."""
        def observer(device, alloc, device_alloc, device_free):
            self.dump(path)
        torch._C._cuda_attach_out_of_memory_observer(observer)


def largest_allocations(snapshot: dict, rows: int = 20) -> str:
    """The live blocks of a memory snapshot, largest first, each with its innermost Python frames."""
    blocks = [b for seg in snapshot.get("segments", []) for b in seg.get("blocks", [])
              if b.get("state") == "active_allocated"]
    blocks.sort(key=lambda b: b.get("size", 0), reverse=True)
    total = sum(b.get("size", 0) for b in blocks)
    lines = [f"{len(blocks)} live allocations, {total / 2**20:.1f} MiB; the largest {min(rows, len(blocks))}:"]
    for b in blocks[:rows]:
        frames = b.get("frames") or []
        where = [f"{fr.get('filename', '?')}:{fr.get('line', '?')} {fr.get('name', '')}" for fr in frames
                 if str(fr.get("filename", "")).endswith(".py")][:4]
        lines.append(f"{b.get('size', 0) / 2**20:10.2f} MiB  " + (" <- ".join(where) or "(no Python frames)"))
    return "\n".join(lines) + "\n"


def cuda_memory_report(reset: bool = True) -> dict[str, float]:
    """Peak allocated and reserved memory since the last report, allocator retries and OOMs, as
    torchtitan reports them. Resets the peaks so each log interval shows its own."""
    stats = torch.cuda.memory_stats()
    report = {
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "alloc_retries": stats.get("num_alloc_retries", 0),
        "ooms": stats.get("num_ooms", 0),
    }
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return report
