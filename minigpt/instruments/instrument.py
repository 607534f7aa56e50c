"""Where the time goes: the step's named stages, their host and device times, and the steady-state
interval. Knows nothing of GPT: it works on any training step.

- `Instruments` is what the loop sees: `with inst.step(n):` around a training step and
  `with inst.stage(name):` around each stage; `inst.interval()` at a log line gives the steady
  steps' times and the steps left out of them (warm-up, compilation, instrumented steps).
  Evaluation, logging and checkpoints run between steps, outside the step clock.
- `StageTimer.stage(name)` opens a `record_function` range (seen by the PyTorch profiler) and an
  NVTX range of the same name (seen by Nsight Systems), and times the stage on the host and on the
  device. It never synchronises: CUDA events are read back at the log interval, when the loop
  syncs anyway. On the CPU the device time is the stage's host time.
- What a flag turns on (the profiler window, Nsight's range, memory history, the memory capture)
  is minigpt/instruments/window.py's Window, loaded only then.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import nvtx
import torch
from torch.profiler import record_function

from minigpt.stages import COLORS, STAGE_NAMES, STEP_RANGE

# A step still running after this long says so in the log, and again every as long: a big step
# (a long sequence, a large batch, a slow machine) is not minutes of silence.
HEARTBEAT_S = 30.0
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
        nvtx_range = nvtx.start_range(message=name, color=COLORS.get(name, "grey"), domain=NVTX_DOMAIN)
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
        registered = STAGE_NAMES
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


# ---------------------------------------------------------------------------- the loop's instruments


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
        """`worker` names this rank's trace and memory files (rank{R}_dp{d}); `comm`: FSDP or TP,
        whose collectives a profiled step times (minigpt/instruments/window.py)."""
        self.cfg, self.device, self.rank, self.log = cfg, device, rank, logging.getLogger("minigpt")
        sleep_ms = None
        if cfg.simulate_slow_rank:  # --simulate-slow-rank R:MS:STAGE on rank R: the sleep StageTimer adds
            from minigpt.core.distributed import parse_slow_rank

            slow = parse_slow_rank(cfg.simulate_slow_rank, STAGE_NAMES)
            sleep_ms = {slow.stage: slow.ms} if slow.rank == rank else None
        self.timer = StageTimer(device, enabled=cfg.stage_timing, sleep_ms=sleep_ms)
        self.step_times: dict[int, float] = {}  # host seconds of every step, to price the profiler
        self._interval: list[tuple[int, float, str | None]] = []  # (step, seconds, why left out)
        self.window = None  # the instruments a flag turns on
        if cfg.use_profiler or cfg.nsys or cfg.record_memory_history or cfg.memory_profiler or comm:
            from minigpt.instruments.window import Window

            self.window = Window(cfg, device, rank, world_size, out_dir, worker, comm)
        self.progress = None  # the bar between log lines, on a terminal: made when the loop starts
        self._running: tuple[int, float] | None = None  # (step, its start) while a step runs
        self._stop_watch = threading.Event()

    def attach(self, model, optimizer, first_step: int, memory_estimate=None, ddp_model=None) -> None:
        """The model and optimizer the step trains; `first_step` is the step the loop runs next
        (1-based; later after --resume). Under DDP (`ddp_model`, the wrapper), the backward's compute
        is timed apart from its all-reduce (backward_compute): the straggler scores use the compute,
        which a slow peer does not stretch."""
        self.first_step = first_step
        if ddp_model is not model and ddp_model is not None and self.cfg.stage_timing:
            from functools import partial

            from minigpt.core.distributed import time_backward_compute

            self.timer.add_split("backward", "backward_compute")
            time_backward_compute(ddp_model, partial(self.timer.split, "backward", "backward_compute"))
        if self.window:
            self.window.attach(model, optimizer, first_step, memory_estimate)

    # -- the loop's view
    def stage(self, name: str):
        """`with inst.stage("forward"):` a record_function range, an NVTX range and its timing."""
        return self.timer.stage(name)

    @contextmanager
    def step(self, n: int, sync: bool = False) -> Iterator[None]:
        """Training step `n` (1-based): its ranges and its host clock (and what a flag adds: the
        profiler's step, the memory capture). `sync` (CUDA) waits for the step's queued work before
        the clock stops: pass it on the steps whose times are logged."""
        capture = self.window.before_step(n) if self.window else nullcontext()
        t0 = time.perf_counter()
        self._running = (n, t0)  # the heartbeat's watcher reads it
        try:
            compiled = self._compile_count()
            with capture as cap, self.timer.step():
                yield
            why = self.left_out(n, self._compile_count() != compiled)
            # A step left out of the steady figures, and the one before it, end with their own work
            # done: a GPU's queued kernels would otherwise be timed in the next step.
            if self.device == "cuda" and (sync or why or self.instrumented(n + 1)):
                torch.cuda.synchronize()  # the step's time must include the work still queued
            self.step_times[n] = time.perf_counter() - t0
        finally:
            self._running = None
            if self.window:
                self.window.end_probe(n)
        self._interval.append((n, self.step_times[n], why))
        if self.progress:
            self.progress.update()
        if self.window:
            self.window.after_step(n, cap)

    def _watch(self, stop: threading.Event) -> None:
        """The heartbeat: while a step runs past HEARTBEAT_S, a line every HEARTBEAT_S saying so.
        One thread for the run, woken a few times a period; a step costs it two assignments."""
        beats: dict[int, int] = {}  # step -> the lines said for it
        while not stop.wait(min(1.0, HEARTBEAT_S / 4)):
            running = self._running
            if running is not None:
                n, t0 = running
                seconds = time.perf_counter() - t0
                if seconds >= HEARTBEAT_S * (beats.get(n, 0) + 1):
                    beats[n] = beats.get(n, 0) + 1
                    self.log.info(f"step {n} still running after {seconds:.0f}s")

    def _compile_count(self) -> int:
        """Under --compile, the graphs torch.compile has compiled so far: a step that moved it
        compiled (minigpt/core/torchcompat.py)."""
        if not self.cfg.compile:
            return 0
        from minigpt.core.torchcompat import compile_count

        return compile_count()

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
        return self.window.instrumented(n) if self.window else None

    def interval(self) -> Interval:
        """The steps since the last call: the steady ones' times (seconds) and stage times, and the
        steps left out of them (warm-up, instrumented)."""
        steps, self._interval = self._interval, []
        if self.progress:
            self.progress.reset(self.cfg.log_interval)
        out = {i for i, (_, _, why) in enumerate(steps) if why}
        left_out = [{"step": n, "s": t, "why": why} for n, t, why in steps if why]
        return Interval([t for _, t, why in steps if not why], self.timer.read(out), left_out)

    def profiler_cost(self) -> str | None:
        return self.window.profiler_cost(self.step_times) if self.window else None

    def take_comm(self) -> tuple[int, dict[str, float]] | None:
        return self.window.take_comm() if self.window else None

    def take_memory_breakdown(self) -> dict | None:
        return self.window.take_memory_breakdown() if self.window else None

    # -- entering and leaving
    def __enter__(self) -> Instruments:
        # A progress bar over the steps between log lines, on a terminal only (not in pipes, CI, or
        # on ranks other than 0): a log interval of a big model can be minutes of silence.
        if self.rank == 0 and sys.stdout.isatty() and sys.stderr.isatty():
            from minigpt.core.progress import Progress, progress_enabled

            if progress_enabled(self.rank):
                self.progress = Progress(self.cfg.log_interval, True, desc="steps to the next log line")
                self.progress.attach(self.log)
        threading.Thread(target=self._watch, args=(self._stop_watch,), daemon=True, name="heartbeat").start()
        if self.window:
            self.window.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        """On every exit, a failing step's too: the progress bar closes, and the window's
        instruments write what they hold (minigpt/instruments/window.py)."""
        self._stop_watch.set()
        try:
            if self.progress:
                self.progress.__exit__(*exc)
        finally:
            if self.window:
                self.window.__exit__(*exc)
