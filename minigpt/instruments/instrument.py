"""What a step measures, knowing nothing of GPT.

- `with inst.stage(name):` opens a record_function range (the PyTorch profiler) and an NVTX range
  (Nsight Systems) of one name, and times the stage on the host and, by CUDA events, on the device.
  It never synchronises: the events are read at the log line. On the CPU the device's time is the
  host's.
- `with inst.step(n):` the step's range and its host clock. A step is left out of the steady
  figures when it is the process's first (warm-up), when torch.compile compiled in it, or when a
  flag's instrument slowed it on purpose (window.py's Window, made when a flag asks for one).
- `inst.record(...)` at a log line: the interval's figures (figures.py, loaded at the first).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import nvtx
import torch
from torch.profiler import record_function

from minigpt.config import STAGES, STEP_RANGE, cpu_seconds


class StageTimer:
    """Each stage's host and device time per step, read at the log line (under torchrun,
    straggler.py's RankTimer, which also times part of a stage)."""

    def __init__(self, device: str, enabled: bool = True):
        self.cuda, self.enabled = device == "cuda", enabled
        self.host: dict[str, float] = defaultdict(float)  # ms of the step in flight
        self.steps: list[dict[str, float]] = []  # each step's host ms
        self.events: list[tuple] = []  # (step index, stage, start event, end event)

    @contextmanager
    def stage(self, name: str, timed: bool = True):
        # NVTX start/end ranges are process-wide: the backward's kernels come from autograd's own
        # thread, and Nsight puts them under `backward` only if the range is not the caller's thread's.
        nvtx_range = nvtx.start_range(name, color=STAGES.get(name, ("", "grey"))[1], domain="minigpt")
        with record_function(name):
            timed, t0 = timed and self.enabled, time.perf_counter()
            start = self.event() if timed else None
            try:
                yield
            finally:
                if timed:
                    self.done(name, time.perf_counter() - t0, start)
                nvtx.end_range(nvtx_range)

    def event(self):
        """A CUDA event recorded now, read at the log line; None on the CPU."""
        if self.cuda:
            (event := torch.cuda.Event(enable_timing=True)).record()
            return event
        return None

    def done(self, name: str, seconds: float, start):
        self.host[name] += 1000 * seconds
        if (end := self.event()) is not None:
            self.events.append((len(self.steps), name, start, end))
        return end

    def end_step(self) -> None:
        if self.enabled:
            self.steps.append(dict(self.host))
        self.host.clear()

    def read(self) -> tuple[list[dict], list[dict]]:
        """Each step's host and device ms per stage since the last read. On CUDA only after a
        synchronize: every event recorded must have completed."""
        host, self.steps = self.steps, []
        device = [defaultdict(float) for _ in host] if self.cuda else host  # a CPU runs ops as issued
        for i, name, start, end in self.events:
            device[i][name] += start.elapsed_time(end)
        self.events = []
        return host, [dict(d) for d in device]


class Instruments:
    """What the loop measures, beside it: `with inst:` around the loop, `with inst.step(n):` and
    `with inst.stage(name):` in it, `inst.record(...)` at a log line."""

    def __init__(self, cfg, device: str, rate: dict, run, window=None, first_step: int = 1, started_at=None):
        """`rate`: what turns times into figures (tokens per step, FLOPs per token, the ranks...);
        `run`: the RunDir whose config.json keeps the MFU peak; `window`: window.py's, when a flag
        asks; `started_at`: time.time() when the start-up began."""
        self.cfg, self.device, self.rate, self.run, self.window = cfg, device, rate, run, window
        self.first_step, self.started_at, self.log = first_step, started_at, logging.getLogger("minigpt")
        self.timer = StageTimer(device, cfg.stage_timing)  # under torchrun: straggler.RankTimer
        self.step_times: dict[int, float] = {}  # every step's host seconds (the profiler's cost)
        self.interval: list[tuple[int, float, str | None]] = []  # (step, seconds, why left out)
        self.doing, self.figures, self.progress, self.stop_watch = None, None, None, threading.Event()

    def stage(self, name: str):
        return self.timer.stage(name)

    @contextmanager
    def step(self, n: int, sync: bool = False):
        """Step `n`: its range and host clock, and what a flag's window adds. `sync` (CUDA): wait for
        the step's queued work before the clock stops, on the steps whose times are logged."""
        compiled, window = self.compile_count() if self.cfg.compile else 0, self.window
        capture = window.before_step(n) if window else nullcontext()  # a trace written here: no step's
        self.doing = (f"step {n}", t0 := time.perf_counter())
        with capture as cap, self.timer.stage(STEP_RANGE, False):
            yield
        self.timer.end_step()
        why = "compilation" if self.cfg.compile and self.compile_count() != compiled else None
        why = why or ("warm-up" if n == self.first_step else window and window.instrumented(n))
        if self.device == "cuda" and (sync or why or window and window.instrumented(n + 1)):
            torch.cuda.synchronize()  # its queued work in this step's time, none in the next's
        self.step_times[n], self.doing = time.perf_counter() - t0, None
        self.interval.append((n, self.step_times[n], why))
        if self.progress:
            self.progress.update()
        if window:
            window.after_step(n, cap)

    def compile_count(self) -> int:
        from minigpt.core.torchcompat import compile_count  # under --compile: a step that moved it compiled

        return compile_count()

    def record(self, step: int, losses: list[float], lr: float, val: float | None):
        """The steps since the last record as a StepRecord (figures.py, loaded at the first one)."""
        if self.figures is None:
            from minigpt.instruments.figures import Figures

            self.figures = Figures(self)
        interval, self.interval = self.interval, []
        return self.figures.record(step, losses, lr, val, interval, *self.timer.read())

    def watch(self) -> None:
        """While a step or an evaluation runs past 10 s, a line every 10 s: no long silence."""
        seen, said = None, 0
        while not self.stop_watch.wait(1.0):
            seen, said = self.look(seen, said)

    def look(self, seen, said: int):
        """One look at what runs: a line each 10 s it has run; `said` lines so far about `seen`."""
        doing, now = self.doing, time.perf_counter()
        said = said if doing and seen and doing[:2] == seen[:2] else 0  # a new one: its own count
        if doing and now - doing[1] >= 10 * (said + 1):
            said += 1
            self.log.info(f"{doing[0]}: still running after {now - doing[1]:.0f}s{''.join(doing[2:])}")
        return doing, said

    def __enter__(self) -> Instruments:
        self.t_start, self.cpu_at_start = time.perf_counter(), cpu_seconds()  # the loop starts here
        if self.rate["is_main"] and os.isatty(1) and os.isatty(2):  # a bar between log lines, on a terminal
            from minigpt.core.progress import Progress, progress_enabled

            self.progress = Progress(self.cfg.log_interval, progress_enabled(), desc="steps to the log line")
            self.progress.attach(self.log)
        threading.Thread(target=self.watch, daemon=True, name="watch").start()
        if self.window:
            self.window.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_watch.set()
        if self.progress:
            self.progress.close()
        if self.window:
            self.window.__exit__(*exc)
