"""Where the time goes: named stages, the profiler window, the Nsight capture range, CUDA memory
history, and the one object the training loop holds them by. Knows nothing of GPT: it works on
any training step.

- `Instruments` is what the loop sees: `with inst.step(n):` around a training step and
  `with inst.stage(name):` around each stage. It owns the stage timer, the profiler window, the
  Nsight capture range, CUDA memory history and snapshots, and the one-step memory capture, and
  writes their outputs and log lines. Evaluation, logging and checkpoints run between steps, so
  they fall outside the profiler's `ProfilerStep#N` ranges and outside the step clock.
- `StageTimer.stage(name)` opens a `record_function` range (seen by the PyTorch profiler) and an
  NVTX range of the same name (seen by Nsight Systems), and times the stage on the host and on the
  device. It never synchronises: CUDA events are read back at the log interval, when the loop
  syncs anyway. On the CPU the device time is the stage's host time.
- `make_profiler` builds a torch.profiler window with Megatron's semantics (steps S..E-1).
- `CommProbe` (minigpt/instruments/commprobe.py) times the collectives of FSDP and TP, one step per interval.
- `NsysCaptureRange` calls cudaProfilerStart/Stop around the same window for `nsys --capture-range`.
- `MemoryHistory` records CUDA allocations of the training steps and dumps snapshots (read offline
  by `python -m minigpt snapshot`).
"""

from __future__ import annotations

import logging
import pickle
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import nvtx
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerAction, ProfilerActivity, record_function, tensorboard_trace_handler

from minigpt import paths, stages
from minigpt.core import torchcompat
from minigpt.core.config import profile_ranks
from minigpt.core.distributed import time_backward_compute
from minigpt.core.progress import Progress, progress_enabled
from minigpt.core.runs import probe_writable
from minigpt.fileio import atomic_open, atomic_write, check_may_replace
from minigpt.instruments.commprobe import CommProbe
from minigpt.instruments.memory import process_memory
from minigpt.instruments.straggler import parse_slow_rank
from minigpt.memory_snapshot import peak_text
from minigpt.stages import STAGE_NAMES, STEP_RANGE, color

SNAPSHOT_MARKER = b"\x80"  # how a pickle of protocol 2 or later begins: what a memory snapshot is

NVTX_DOMAIN = "minigpt"  # one domain: Nsight can filter the project's ranges from PyTorch's own


@dataclass
class StageTimes:
    """What StageTimer.read() returns: per-stage means over the interval, and every step's figures
    (medians for the straggler detector). Milliseconds."""

    host_ms: dict[str, float] = field(default_factory=dict)
    device_ms: dict[str, float] = field(default_factory=dict)
    host_steps: list[dict[str, float]] = field(default_factory=list)
    device_steps: list[dict[str, float]] = field(default_factory=list)


@dataclass
class Interval:
    """What Instruments.interval() returns at a log line: the host seconds of the interval's steady
    steps, their stage times (the left-out steps' when every step is left out), and the steps left
    out of both, each {"step": n, "s": seconds, "why": a LEFT_OUT key}."""

    steady: list[float]
    stages: StageTimes
    left_out: list[dict] = field(default_factory=list)

    @property
    def step_times(self) -> list[float]:
        """The times the interval's means are of: its steady steps', else its left-out steps'."""
        return self.steady or [x["s"] for x in self.left_out]


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
        self.events: list[
            tuple[int, str, torch.cuda.Event, torch.cuda.Event]
        ] = []  # (step, stage, start, end)

    @contextmanager
    def step(self) -> Iterator[None]:
        """The whole training step: a range (no timer of its own; the loop times the step)."""
        with self.stage(STEP_RANGE.name, timed=False):
            yield
        if self.enabled:
            self.host_steps.append(dict(self.step_host))
            self.step_host.clear()

    @contextmanager
    def stage(self, name: str, timed: bool = True) -> Iterator[None]:
        # NVTX start/end ranges are process-wide, unlike push/pop ranges, which are per thread:
        # the backward's kernels are launched from autograd's own thread, and Nsight only puts
        # them under the `backward` range if the range is not tied to the launching thread.
        nvtx_range = nvtx.start_range(message=name, color=color(name), domain=NVTX_DOMAIN)
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

    def read(self, left_out: set[int] | None = None) -> StageTimes:
        """The steps completed since the last read, but for those at the indices `left_out` (warm-up
        and instrumented steps: see Instruments.step), unless every step is left out: then theirs.
        On CUDA call it only after a synchronize: every event recorded so far must have completed."""
        if not self.enabled or not self.host_steps:
            self.host_steps.clear()
            self.events.clear()
            return StageTimes()
        n = len(self.host_steps)
        host_steps = self.host_steps
        if self.cuda:
            device_steps = [defaultdict(float) for _ in host_steps]
            for i, name, start, end in self.events:
                if i < len(device_steps):
                    device_steps[i][name] += start.elapsed_time(end)
            device_steps = [dict(d) for d in device_steps]
        else:
            device_steps = host_steps  # the CPU runs each op as the host issues it
        keep = [i for i in range(n) if i not in (left_out or ())] or list(range(n))
        host_steps, device_steps = [host_steps[i] for i in keep], [device_steps[i] for i in keep]
        # The registry's stages in their order, then any other range (a user's own stage) by name.
        registered = stages.STAGE_NAMES
        names = [
            n
            for n in (*registered, *sorted({k for s in host_steps for k in s} - set(registered)))
            if any(n in s for s in host_steps)
        ]
        kept = len(host_steps)
        times = StageTimes(
            host_ms={k: sum(s.get(k, 0.0) for s in host_steps) / kept for k in names},
            device_ms={k: sum(s.get(k, 0.0) for s in device_steps) / kept for k in names},
            host_steps=host_steps,
            device_steps=device_steps,
        )
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


# Said once before a profiler with memory events starts (--use-profiler, --memory-profiler): torch
# writes these lines to stderr from C++ (Kineto's USDT markers at every start and stop; c10's
# ProfiledCPUMemoryReporter, once per 1000 frees of a block it never saw allocated), and they look
# like trouble. Checked on the tiny preset: with them the trace is written whole, its operators and
# times complete, and --memory-profiler's measured peak still equals the estimate; what is missing
# is the free of a block allocated before the recording, in the trace's memory timeline. Silencing
# them would mean closing fd 2 around the steps, which would hide a real error as well.
PROFILER_STDERR_NOTE = (
    "Profiler: torch prints to stderr, from C++, 'USDT: ... profiler_start' and '... profiler_stop' "
    "(Kineto marking where a recording starts and stops; no setting turns them off) and "
    "'CPUAllocator.cpp ... Memory block of unknown size was allocated before the profiling started' "
    "(a tensor made before the recording was freed during it: that one free is missing from the "
    "trace's memory timeline). Both are harmless: the trace, its operators and its times are complete."
)


def profiler_options(cfg) -> dict[str, bool]:
    """torch.profiler's recording options from the flags. Memory events are always on: TensorBoard's
    Memory view and the report's memory timeline need them. The others are opt-in, each priced in
    benchmarks/results/overhead-cpu-small.md: shapes, FLOPs and module names grow the trace and
    slow the profiled steps; Python stacks most of all."""
    return {
        "profile_memory": True,
        "record_shapes": cfg.profile_record_shapes,
        "with_flops": cfg.profile_with_flops,
        "with_modules": cfg.profile_with_modules,
        "with_stack": cfg.profile_with_stack,
    }


def make_profiler(
    trace_dir: Path,
    worker: str,
    first_step: int,
    window: range,
    device: str,
    options: dict[str, bool] | None = None,
    on_window_end: Callable | None = None,
) -> torch.profiler.profile:
    """A torch.profiler window over training steps `window` (start..end-1), whose trace lands in trace_dir as
    {worker}.*.pt.trace.json.gz (worker: rank{R}_dp{d}), the naming torch-tb-profiler groups by
    worker (and its Distributed view by rank). `first_step` is the training step the loop runs
    next (1-based; later than 1 after --resume): the trace's ProfilerStep#N markers then carry the
    training step numbers of the log."""
    # gzip: LLM traces reach hundreds of MB of repetitive JSON; torch-tb-profiler, Perfetto
    # and chrome://tracing all read .json.gz.
    write_trace = tensorboard_trace_handler(str(trace_dir), worker_name=worker, use_gzip=True)

    def on_trace_ready(prof: torch.profiler.profile) -> None:
        write_trace(prof)
        if on_window_end is not None:
            on_window_end(prof)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    schedule = profiler_schedule(window.start, window.stop)
    prof = torch.profiler.profile(
        activities=activities,
        schedule=schedule,
        on_trace_ready=on_trace_ready,
        **(options or {"profile_memory": True}),
    )
    # The profiler counts its steps from 0; start its count at the training step instead, before
    # it is entered (its action for the current step is derived from the count).
    torchcompat.start_profiler_count(prof, first_step, schedule(first_step))
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
    """CUDA memory history (torchcompat.start_memory_history), bounded, with Python stacks only: C++
    frames make a dump take minutes. Recorded from the first training step. Beside each pickle a
    text file lists what was live at the recording's peak, with the frames that allocated it;
    `python -m minigpt snapshot` draws the offline page (pytorch.org/memory_viz reads it too)."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self.started = False

    def start(self) -> None:
        torchcompat.start_memory_history(self.max_entries)
        self.started = True

    def dump(self, path: Path) -> Path:
        snapshot = torchcompat.memory_snapshot()
        with atomic_open(path) as f:
            pickle.dump(snapshot, f)
        atomic_write(path.with_suffix(".txt"), peak_text(snapshot))
        return path

    def stop(self) -> None:
        torchcompat.stop_memory_history()

    def dump_on_oom(self, path: Path) -> None:
        """Write `path` when the allocator runs out of memory, before the error propagates."""

        def observer(device, alloc, device_alloc, device_free):
            self.dump(path)

        torchcompat.attach_oom_observer(observer)


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


# ---------------------------------------------------------------------------- the loop's instruments


def slow_stage(cfg, rank: int) -> dict[str, float] | None:
    """--simulate-slow-rank R:MS:STAGE on rank R: {STAGE: MS}, the sleep StageTimer adds; else None."""
    slow = parse_slow_rank(cfg.simulate_slow_rank, STAGE_NAMES) if cfg.simulate_slow_rank else None
    return {slow.stage: slow.ms} if slow and slow.rank == rank else None


class Instruments:
    """Everything the training loop measures, held in one object beside the loop.

        inst = Instruments(cfg, device=..., rank=..., ...)    # before the model: memory history sees it
        inst.attach(model, optimizer, first_step=1)
        with inst:                                            # the profiler window, closed on any exit
            while step < num_steps:
                with inst.step(step + 1, sync=log_now):       # the step's clock and ranges
                    with inst.stage("forward"): ...
                step += 1
                figures = inst.interval()                     # at the log interval: stage and step times

    `cfg` is a TrainConfig (minigpt/core/config.py); only its instrumentation flags are read."""

    def __init__(
        self, cfg, device: str, rank: int, world_size: int, out_dir: Path, worker: str, comm: bool = False
    ):
        """`worker` names this rank's trace and memory files (rank{R}_dp{d}). `comm`: the step's
        collectives are issued by the model itself (FSDP, TP), not by a DDP wrapper whose backward
        can be split: profile one step per log interval for them (CommProbe)."""
        self.cfg, self.device, self.rank, self.world_size = cfg, device, rank, world_size
        self.out_dir, self.worker, self.log = out_dir, worker, logging.getLogger("minigpt")
        ranks = profile_ranks(cfg.profile_ranks, world_size)
        self.profiled = ranks is None or rank in ranks  # takes part in --use-profiler, --nsys, memory history
        self.window = range(cfg.profile_step_start, cfg.profile_step_end)
        self.timer = StageTimer(device, enabled=cfg.stage_timing, sleep_ms=slow_stage(cfg, rank))
        self.step_times: dict[int, float] = {}  # host seconds of every step, to price the profiler
        self._interval: list[tuple[int, float, str | None]] = []  # (step, seconds, why left out)
        snapshot = Path(cfg.memory_snapshot_path or out_dir / paths.SNAPSHOT_FILE.format(rank=rank))
        if cfg.memory_snapshot_path and world_size > 1:  # one file per rank, never overwritten by another
            snapshot = snapshot.with_name(f"rank{rank}_{snapshot.name}")
        self.snapshot_path, self._snapshot_dumped = snapshot, False
        self.memory_history = None
        if cfg.record_memory_history and self.profiled:
            if cfg.memory_snapshot_path:  # a path of the user's: refused now, not when the window ends
                probe_writable(snapshot, "--memory-snapshot-path")
                # and never over a file that is not a pickle (a snapshot is one): a run's config,
                # its metrics, a checkpoint (a zip)
                check_may_replace(
                    snapshot, SNAPSHOT_MARKER, "--memory-snapshot-path", "minigpt", fix="name another path"
                )
            # The OOM observer from now on (an OOM while building still leaves the segments); the
            # history itself from the first step (step()): the entries are training steps only.
            self.memory_history = MemoryHistory(cfg.memory_history_entries)
            self.memory_history.dump_on_oom(out_dir / paths.OOM_SNAPSHOT_FILE.format(rank=rank))
        self.profiler = self.nsys = None
        self.memory_step: int | None = None
        self.memory_breakdown: dict | None = None  # the measured step's record, for the next log line
        self._rss_before_window: int | None = None
        self.comm = CommProbe(cfg) if comm and cfg.comm_profile and cfg.stage_timing else None
        self.progress = Progress(None, False)  # the bar between log lines: made when the loop starts
        self._exit = ExitStack()

    def attach(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        first_step: int,
        memory_estimate=None,
        ddp_model: torch.nn.Module | None = None,
    ) -> None:
        """The model and optimizer the step trains; `first_step` is the step the loop runs next
        (1-based; later after --resume). Sets up the profiler window and the memory capture. Under
        DDP (`ddp_model`, the wrapper), the backward's compute is timed apart from its all-reduce
        (backward_compute): the straggler scores use the compute, which a slow peer does not stretch."""
        cfg, window = self.cfg, self.window
        self.model, self.optimizer, self.first_step = model, optimizer, first_step
        self.memory_estimate = memory_estimate
        if isinstance(ddp_model, DistributedDataParallel) and cfg.stage_timing:
            self.timer.add_split("backward", "backward_compute")
            time_backward_compute(ddp_model, partial(self.timer.split, "backward", "backward_compute"))
        if cfg.use_profiler and self.profiled and first_step <= window.start:
            self.profiler = make_profiler(
                self.out_dir / paths.TRACE_DIR,
                self.worker,
                first_step,
                window,
                self.device,
                profiler_options(cfg),
                self._window_done,
            )
        if cfg.nsys and self.profiled and first_step <= window.start:
            self.nsys = NsysCaptureRange(window.start, window.stop)
        if (cfg.use_profiler or cfg.nsys) and first_step > window.start:
            self.log.warning(
                f"the profile window starts at step {window.start}, but this run resumes at step "
                f"{first_step}: nothing is profiled (pass a later --profile-step-start/-end)"
            )
        if cfg.memory_profiler and self.profiled:
            if first_step <= cfg.memory_profile_step:
                self.memory_step = cfg.memory_profile_step
            else:
                self.log.warning(
                    f"--memory-profiler: step {cfg.memory_profile_step} was done before the resume "
                    f"at step {first_step}; nothing is measured (pass a later --memory-profile-step)"
                )
        if self.profiler is not None or self.memory_step is not None:
            self.log.info(PROFILER_STDERR_NOTE)

    # -- the loop's view
    def stage(self, name: str):
        """`with inst.stage("forward"):` a record_function range, an NVTX range and its timing."""
        return self.timer.stage(name)

    @contextmanager
    def step(self, n: int, sync: bool = False) -> Iterator[None]:
        """Training step `n` (1-based): its ProfilerStep#n range, Nsight's capture range, the memory
        capture of the measured step, and its host clock. `sync` (CUDA) waits for the step's queued
        work before the clock stops: pass it on the steps whose times are logged."""
        if self.profiler is not None and n > self.first_step:
            self.profiler.step()  # opens ProfilerStep#n here, after the evaluation and logging of n-1
        if n == self.window.start and self.profiler is not None:
            self._rss_before_window = process_memory()["rss_peak_bytes"]
        if self.nsys:
            self.nsys.before_step(n)
        if self.memory_history and not self.memory_history.started:
            self.memory_history.start()  # the first step's allocations on: the recording is training
        measured = n == self.memory_step
        capture = self._capture() if measured else nullcontext()
        probed = self.comm is not None and self.comm.start(n, self.first_step)  # outside the step's clock
        try:
            compiled = torchcompat.compile_count() if self.cfg.compile else 0
            t0 = time.perf_counter()
            with capture as cap, self.timer.step():
                yield
            compiled = self.cfg.compile and torchcompat.compile_count() != compiled
            why = self.left_out(n, compiled)
            # A step left out of the steady figures, and the one before it, end with their own work
            # done: a GPU's queued kernels would otherwise be timed in the next step.
            if self.device == "cuda" and (sync or why or self.instrumented(n + 1)):
                torch.cuda.synchronize()  # the step's time must include the work still queued
            self.step_times[n] = time.perf_counter() - t0
        finally:
            if probed:
                self.comm.stop(n)
        self._interval.append((n, self.step_times[n], why))
        self.progress.update()
        # After the clock, outside the ProfilerStep range: writing a trace, snapshot or chart is not training.
        self._end_profiler_step()
        if self.memory_history and n == self.window.stop - 1:  # the end of the window: a snapshot of it
            self.memory_history.dump(self.snapshot_path)
            self._snapshot_dumped = True
        if measured:
            self._write_memory(cap.breakdown)

    def left_out(self, n: int, compiled: bool = False) -> str | None:
        """Why step `n`, just run, stays out of the steady figures (a LEFT_OUT key), or None: a step
        during which torch.compile compiled (`compiled`; an evaluation's recompilation falls between
        steps), the process's first step, and the instrumented ones."""
        if compiled:
            return "compilation"
        if n == self.first_step:
            return "warm-up"
        return self.instrumented(n)

    def instrumented(self, n: int) -> str | None:
        """The instrument that slows step `n` on purpose, known before it runs, or None."""
        if n == self.memory_step:
            return "memory profiler"
        w = self.window
        if self.profiler is not None and (n in w or n == w.start - 1 >= self.first_step):
            return "profiler"
        if self.nsys is not None and n in w:
            return "nsys"
        return None

    def interval(self) -> Interval:
        """The steps since the last call: the steady ones' times (seconds) and stage times, and the
        steps left out of them (warm-up, instrumented)."""
        steps, self._interval = self._interval, []
        self.progress.reset(self.cfg.log_interval)
        out = {i for i, (_, _, why) in enumerate(steps) if why}
        left_out = [{"step": n, "s": t, "why": why} for n, t, why in steps if why]
        return Interval([t for _, t, why in steps if not why], self.timer.read(out), left_out)

    # -- the profiler window
    def _end_profiler_step(self) -> None:
        """Close ProfilerStep#n as soon as the training step ends, so that what runs between steps
        (evaluation, logging, checkpoints) stays outside every step's range: the profiler itself
        would keep the range open until its next step() call."""
        if self.profiler is not None:
            torchcompat.close_profiler_step(self.profiler)

    def _window_done(self, prof: torch.profiler.profile) -> None:
        ops = top_operators(prof, self.device)
        ops_path = self.out_dir / paths.OPS_FILE.format(rank=self.rank)
        atomic_write(ops_path, ops)
        w = self.window
        self.log.info(f"Profiled steps {w.start}-{w.stop - 1}; top operators (also in {ops_path}):\n{ops}")
        if self.device == "cuda" and not has_device_kernels(prof):
            self.log.warning(
                "WARNING: the trace holds no CUDA kernel events: CUPTI recorded nothing "
                "(check that the CUDA profiling libraries match the driver)"
            )
        self.log.info(
            f"View the trace: python -m minigpt traces {self.out_dir / paths.TRACE_DIR}, or open "
            f"{self.out_dir / paths.TRACE_DIR}/*.json.gz in ui.perfetto.dev, or tensorboard --logdir "
            f"{self.out_dir}"
        )

    def profiler_cost(self) -> str | None:
        """The profiled steps' median time against the median of the unprofiled ones, and the process's
        peak memory before and after the window. Not step 1 (it allocates everything), not the
        profiler's warm-up step; at least three unprofiled steps, or the line says it is not priced."""
        if self.profiler is None:
            return None
        w = self.window
        during = [t for s, t in self.step_times.items() if s in w]
        before = [t for s, t in self.step_times.items() if s != 1 and s != w.start - 1 and s not in w]
        if not during:
            return None
        rss = ""
        if self._rss_before_window:
            after = process_memory()["rss_peak_bytes"]
            rss = (
                f"; process peak memory {self._rss_before_window / 2**30:.2f} GiB before the window, "
                f"{after / 2**30:.2f} GiB after"
            )
        if len(before) < 3:
            return (
                f"Profiler cost: not priced: {len(before)} unprofiled step(s) to compare with, 3 needed "
                f"(step 1 and the warm-up step before the window do not count; run more steps){rss}"
            )
        d, b = statistics.median(during), statistics.median(before)
        return (
            f"Profiler cost: {1000 * d:.0f} ms/step profiled (median of {len(during)}) vs {1000 * b:.0f} "
            f"ms/step unprofiled (median of {len(before)}): {d / b:.2f}x{rss}"
        )

    # -- the one-step memory capture
    def _capture(self):
        from minigpt.instruments.memory import (
            capture_memory,  # imported when used: the trainer's start stays light
        )

        return capture_memory(self.model, self.optimizer, self.memory_step)

    def _write_memory(self, breakdown) -> None:
        from minigpt.instruments.memory import format_breakdown, write_memory_trace

        folder = self.out_dir / paths.MEMORY_TRACE_DIR.format(worker=self.worker)
        write_memory_trace(breakdown, folder, self.memory_estimate, run_dir=self.out_dir)
        self.log.info(
            f"{format_breakdown(breakdown, self.memory_estimate)}\n  memory.log and sunburst charts: {folder}"
        )
        self.memory_breakdown = breakdown.to_record(self.memory_estimate)

    def take_comm(self) -> tuple[int, dict[str, float]] | None:
        """(the profiled step, its ms in collectives per stage) of the interval, once; None when no
        step of it was profiled (or no CommProbe)."""
        return self.comm.take() if self.comm else None

    def take_memory_breakdown(self) -> dict | None:
        """The measured step's figures once, for the first log line after it."""
        record, self.memory_breakdown = self.memory_breakdown, None
        return record

    # -- entering and leaving
    def __enter__(self) -> Instruments:
        # A progress bar over the steps between log lines, on a terminal only (not in pipes, CI, or
        # on ranks other than 0): a log interval of a big model can be minutes of silence.
        self.progress = Progress(
            self.cfg.log_interval, progress_enabled(self.rank), desc="steps to the next log line"
        )
        self._exit.enter_context(self.progress.attach(self.log))
        if self.profiler is not None:
            self._exit.enter_context(self.profiler)
        return self

    def __exit__(self, *exc) -> None:
        """On every exit, a failing step's too: the profiler stops and writes its trace, the Nsight
        range closes, the memory history leaves its snapshot."""
        try:
            self._exit.close()
        finally:
            if self.nsys:
                self.nsys.stop()
            if self.memory_history:
                if not self._snapshot_dumped:  # the run ended before the window did
                    self.memory_history.dump(self.snapshot_path)
                self.memory_history.stop()
                self.log.info(
                    f"CUDA memory snapshot: {self.snapshot_path} (offline page: python -m minigpt "
                    f"snapshot {self.snapshot_path}; the report links it; .txt: what was live at its peak)"
                )
