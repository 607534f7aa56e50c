"""What a step measures: its named stages, their host and device times, the steady-state
interval, and the figures made of them (tokens/s, MFU, memory). Knows nothing of GPT.

- `Instruments` is what the loop sees: `with inst.step(n):`, `with inst.stage(name):`, and at a
  log line `inst.interval()`: the steady steps' times and the steps left out of them.
- `StageTimer.stage(name)` opens a `record_function` range (the PyTorch profiler) and an NVTX range
  (Nsight Systems) of the same name and times the stage on the host and on the device. It never
  synchronises: CUDA events are read at the log interval. On the CPU the device time is the host's.
- `Throughput.record()` turns an interval into the step's record (minigpt/step_record.py). MFU is
  over the peak of the device's fastest dtype, as nanoGPT and torchtitan count: --peak-tflops, a
  GPU's data sheet, or this CPU's peak as minigpt/instruments/mfu.py measured and cached it.
- What a flag turns on (the profiler window, Nsight's range, the memory capture) is
  minigpt/instruments/window.py's Window, loaded only then.
"""

from __future__ import annotations

import json
import logging
import math
import os
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
from minigpt.step_record import StepRecord, format_duration

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
    """A log interval: its steady steps' host seconds, their stage times (the left-out steps' when
    all are), the steps left out, each {"step", "s", "why": a LEFT_OUT key}, and what a flag's
    instrument took in it."""

    steady: list[float]
    stages: StageTimes
    left_out: list[dict] = field(default_factory=list)
    comm: tuple[int, dict[str, float]] | None = None  # FSDP/TP: a profiled step's ms in collectives
    memory_breakdown: dict | None = None  # --memory-profiler: its measured step's, once

    @property
    def step_times(self) -> list[float]:
        """The times the interval's means are of: its steady steps', else its left-out steps'."""
        return self.steady or [x["s"] for x in self.left_out]


class StageTimer:
    """Per-stage host and device time of each step, read (and reset) at the log interval. Under
    torchrun the timer is minigpt/instruments/straggler.py's RankTimer, which also times a part of
    a stage (the backward's compute) and can slow a stage on purpose (--simulate-slow-rank)."""

    def __init__(self, device: str, enabled: bool = True):
        self.cuda = device == "cuda"
        self.enabled = enabled
        self.open: dict[str, tuple[float, torch.cuda.Event | None]] = {}  # stage -> (start time, start event)
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
            start = self.event() if timed else None
            self.open[name] = (time.perf_counter(), start)
            try:
                yield
            finally:
                t0, _ = self.open.pop(name)
                if timed:
                    self.done(name, time.perf_counter() - t0, start)
                nvtx.end_range(nvtx_range)

    def event(self) -> torch.cuda.Event | None:
        """A CUDA event recorded now (its time is read at the log interval); None on the CPU."""
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def done(self, name: str, seconds: float, start: torch.cuda.Event | None) -> torch.cuda.Event | None:
        """A stage just ended after `seconds` on the host: its time, into the step in flight."""
        self.step_host[name] += 1000 * seconds
        end = self.event()
        if end is not None:
            self.events.append((len(self.host_steps), name, start, end))
        return end

    def read(self, left_out: set[int] | None = None) -> StageTimes:
        """The steps completed since the last read, but for those at the indices `left_out` (warm-up
        and instrumented steps: see Instruments.step), unless every step is left out: then theirs.
        On CUDA call it only after a synchronize: every event recorded so far must have completed."""
        steps, self.host_steps = self.host_steps, []
        if not self.enabled or not steps:
            self.events.clear()
            return StageTimes()
        device = self.device_steps(len(steps)) if self.cuda else steps  # a CPU runs ops as they are issued
        keep = [i for i in range(len(steps)) if i not in (left_out or ())] or list(range(len(steps)))
        host, device = [steps[i] for i in keep], [device[i] for i in keep]
        # The registry's stages in their order, then any other range (a user's own stage) by name.
        seen = {k for s in host for k in s}
        names = [*(k for k in STAGE_NAMES if k in seen), *sorted(seen - set(STAGE_NAMES))]
        return StageTimes(
            host_ms={k: sum(s.get(k, 0.0) for s in host) / len(host) for k in names},
            device_ms={k: sum(s.get(k, 0.0) for s in device) / len(host) for k in names},
            host_steps=host,
            device_steps=device,
        )

    def device_steps(self, n: int) -> list[dict[str, float]]:
        """Each of the `n` steps' stage times on the GPU, from their CUDA events (the events of a
        later step, if any, are kept for the next read)."""
        steps = [defaultdict(float) for _ in range(n)]
        for i, name, start, end in self.events:
            if i < n:
                steps[i][name] += start.elapsed_time(end)
        self.events = [(i - n, *rest) for i, *rest in self.events if i >= n]
        return [dict(d) for d in steps]


# ---------------------------------------------------------------------------- the loop's instruments


class Instruments:
    """Everything the training loop measures, in one object beside it: `with inst:` around the loop
    (a flag's window closes on any exit), `with inst.step(n):` and `with inst.stage(name):` in it,
    `inst.interval()` at a log line. `cfg`: a TrainConfig; only its instrumentation flags are read."""

    def __init__(
        self, cfg, device: str, rank: int, world_size: int, out_dir: Path, worker: str, comm: bool = False
    ):
        """`worker` names this rank's trace and memory files (rank{R}_dp{d}); `comm`: FSDP or TP,
        whose collectives a profiled step times (minigpt/instruments/window.py)."""
        self.cfg, self.device, self.rank, self.log = cfg, device, rank, logging.getLogger("minigpt")
        self.timer = StageTimer(device, enabled=cfg.stage_timing)  # under torchrun: straggler.RankTimer
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
        """`first_step`: the step the loop runs next (1-based). Under DDP (`ddp_model`) the backward's
        compute is timed apart from its all-reduce: a slow peer does not stretch it."""
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
            compiled = self._compile_count() if self.cfg.compile else 0
            with capture as cap, self.timer.step():
                yield
            why = self.left_out(n, self.cfg.compile and self._compile_count() != compiled)
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
        from minigpt.core.torchcompat import compile_count

        return compile_count()

    def left_out(self, n: int, compiled: bool = False) -> str | None:
        """Why step `n` stays out of the steady figures (a LEFT_OUT key), or None: torch.compile
        compiled in it, it is the process's first, or an instrument slowed it."""
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
        interval = Interval([t for _, t, why in steps if not why], self.timer.read(out), left_out)
        if self.window:
            interval.comm, interval.memory_breakdown = (
                self.window.take_comm(),
                self.window.take_memory_breakdown(),
            )
        return interval

    def profiler_cost(self) -> str | None:
        return self.window.profiler_cost(self.step_times) if self.window else None

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


# ---------------------------------------------------------------------------- MFU's peak

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

PEAK_CACHE_FILE = "peak_flops.json"  # under data.cache_dir(): one entry per machine, dtype, torch
CACHE_LIMIT = 4 * 2**20  # the cache holds a few KiB; a larger file is not ours
# The units whose best rate is a CPU's peak: two square products, machine-wide, whatever model
# trains (mfu.py measures them, and an achieved rate above them lifts the peak: ACHIEVED).
SQUARE_SIZES = (1024, 2048)
SQUARE_UNITS = tuple(f"matmul {n}x{n}x{n}" for n in SQUARE_SIZES)  # mfu.Workload's names
ACHIEVED = "achieved by a run"
LOAD_SHARE = 0.25  # a unit timed while other processes took more of the cores is measured again


# PeakFlops' fields under the keys config.json carries them.
PEAK_KEYS = {
    "value": "peak_flops",
    "dtype": "peak_flops_dtype",
    "source": "peak_flops_source",
    "spread": "peak_flops_spread",
    "measured_at": "peak_flops_measured_at",
    "load": "peak_flops_load",
    "others": "peak_flops_under_load",
}


@dataclass
class PeakFlops:
    """The MFU denominator of one device: FLOP/s, its source and dtype; measured, its winning unit's
    median and best call, when, and under what load."""

    value: float
    source: str
    spread: tuple[float, float] | None = None  # measured: the winning unit's (median call, best call)
    shapes: list[dict] = field(default_factory=list)
    measured_at: str | None = None  # measured: when the winning unit was timed (UTC)
    load: float | None = None  # measured: the 1-minute load average then (os.getloadavg)
    device: str = "cpu"
    dtype: str = "fp32"  # the dtype this is the peak of: the device's fastest
    others: float | None = None  # measured under load: the share of the cores other processes used

    def config(self) -> dict:
        """The keys config.json carries (PEAK_KEYS)."""
        return {key: getattr(self, name) for name, key in PEAK_KEYS.items()}

    def describe(self) -> str:
        """The log's line: the denominator, its dtype and source; a second when measured under load."""
        line = f"MFU peak {self.value / 1e12:.3g} TFLOP/s ({self.dtype}, the device's fastest); {self.source}"
        if self.others is not None:  # measured now, under load (mfu.py, loaded then)
            from minigpt.instruments.mfu import under_load_line

            line += "\n" + under_load_line(self.others)
        return line


def peak_dtypes(device: str) -> tuple[str, ...]:
    """The dtypes whose peak may be the device's fastest, the likeliest first: bf16 on a GPU (fp16 on
    one without bf16) and on a CPU with AMX; fp32 on a CPU without native bf16. AVX512-BF16 alone
    promises no speed (bf16 products ran 1.9x fp32 on an AMD Zen 4, 0.5x on an Intel Xeon): both."""
    from minigpt.core.config import cpu_bf16_features

    if device == "cuda":
        return ("bf16",) if torch.cuda.is_bf16_supported() else ("fp16",)
    features = cpu_bf16_features()
    return ("bf16",) if features["amx"] else ("bf16", "fp32") if features["avx512_bf16"] else ("fp32",)


def machine_key(device: str, dtype: str) -> str:
    """The cache's key: the device (its name; a CPU's model, cores and threads), the dtype, torch."""
    if device == "cuda":
        where = torch.cuda.get_device_name()
    else:
        where = f"{cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"
    return f"{device}: {where} | {dtype} | torch {torch.__version__}"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def cached_peak(path: Path, key: str) -> PeakFlops | None:
    """The machine's peak from the cache: the best of its square units and any rate a run achieved.
    None where a square unit is missing, damaged or timed under load: mfu.py measures them then."""
    try:
        with open(path, "rb") as f:
            entry = json.loads(f.read(CACHE_LIMIT + 1))[key]
        units = {name: entry[name] for name in (*SQUARE_UNITS, ACHIEVED) if name in entry}
    except (OSError, ValueError, RecursionError, KeyError, TypeError):
        return None
    if not set(SQUARE_UNITS) <= units.keys() or not all(good_rate(u) for u in units.values()):
        return None
    name, best = max(units.items(), key=lambda kv: kv[1]["best"])
    where = f"~/{path.relative_to(Path.home())}" if path.is_relative_to(Path.home()) else str(path)
    source = f"cache: {name}, measured {best.get('date')} [{where}]"
    spread = (best["median"], best["best"])
    return PeakFlops(best["best"], source, spread, measured_at=best.get("date"), load=best.get("load"))


def good_rate(u) -> bool:
    """A cached unit that stands: plausible (below), and timed while other processes left the cores
    alone (LOAD_SHARE)."""
    return plausible(u) and (u.get("others") or 0.0) <= LOAD_SHARE


def plausible(u) -> bool:
    """A cached unit whose best and median are FLOP/s between a MFLOP/s and an exaFLOP/s (a
    hand-edited 1e-300, NaN or "fast" is none), its load share a number."""
    figures = [u.get("best"), u.get("median"), u.get("others") or 0.0] if isinstance(u, dict) else [None]
    if not all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in figures):
        return False
    return 1e6 < figures[1] <= figures[0] < 1e18


def device_peak(override_tflops: float | None, device: str, info=None) -> PeakFlops:
    """The MFU denominator: --peak-tflops, a known GPU's data sheet, or this CPU's cached peak
    (mfu.py measures it when the cache has none; under torchrun rank 0 alone, then the others read it):
    of the candidate dtypes (peak_dtypes), the fastest measured."""
    dtypes = peak_dtypes(device)
    if override_tflops is not None:
        return PeakFlops(override_tflops * 1e12, "override: --peak-tflops", device=device, dtype=dtypes[0])
    if device == "cuda":
        from minigpt.instruments.mfu import table_peak  # a known GPU's data sheet

        if from_table := table_peak(dtypes[0]):
            return PeakFlops(*from_table, device=device, dtype=dtypes[0])
    peaks = [measured_peak(device, dtype, info) for dtype in dtypes]  # each measured once, then cached
    peak, first = max(peaks, key=lambda p: p.value), peaks[0]
    if peak is not first:  # a CPU's bf16 slower than its fp32
        peak.source += (
            f"; {first.dtype}'s is {first.value / peak.value:.0%} of it here: --no-amp may train faster"
        )
    return peak


def measured_peak(device: str, dtype: str, info=None) -> PeakFlops:
    """The device's peak in `dtype`, from the cache or measured (mfu.py)."""
    from minigpt.core.data import cache_dir

    if info is not None and info.enabled:
        from minigpt.instruments.mfu import ranked_peak

        return ranked_peak(device, dtype, info)
    peak = cached_peak(cache_dir() / PEAK_CACHE_FILE, machine_key(device, dtype))
    if peak is None:
        from minigpt.instruments.mfu import peak_flops  # measures, and caches for the next run

        return peak_flops(device, dtype)
    peak.device, peak.dtype = device, dtype
    return peak


def mfu(flops_per_token: float, tokens_per_s_per_device: float, peak: float | PeakFlops) -> float:
    """Model FLOPs utilisation: the model's training FLOPs per second over the peak, per device
    (every micro-batch's tokens counted)."""
    value = peak.value if isinstance(peak, PeakFlops) else peak
    return achieved_tflops(flops_per_token, tokens_per_s_per_device) * 1e12 / value


def achieved_tflops(flops_per_token: float, tokens_per_s_per_device: float) -> float:
    """The model's training TFLOP/s per device: needs no denominator, so it is as steady as tokens/s."""
    return flops_per_token * tokens_per_s_per_device / 1e12


def process_memory() -> dict[str, int]:
    """The process's resident memory now and its peak, from one read of /proc/self/status (VmRSS,
    VmHWM), so rss <= peak on every record (getrusage beside statm, read at two moments, had the
    peak below the resident size on 33 of 80 log lines). Elsewhere (not Linux) getrusage alone."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS:", "VmHWM:")))
        rss, peak = (int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))  # kB
    except (OSError, ValueError, KeyError, IndexError):  # not Linux
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        rss = peak
    return {"rss_bytes": rss, "rss_peak_bytes": max(rss, peak)}


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


# ---------------------------------------------------------------------------- the run's figures


@dataclass
class RunTotals:
    """The run-wide figures, their one definition. The run's rate is its steady state: the steady
    steps' tokens over the sum of their times (a mean of interval means would weigh a short interval
    like a long one), the left-out steps kept apart by why. End to end is every step's tokens over
    the loop's wall clock; start-up, the process's age as the loop starts, is in neither."""

    tokens_per_step: int  # the job's: every data-parallel rank's batch
    t_start: float = 0.0  # perf_counter at the loop's start
    startup_s: float | None = None
    steps: int = 0  # steady steps
    step_time_s: float = 0.0  # their host seconds
    left_out: dict[str, dict] = field(default_factory=dict)  # why -> {"steps": [n, ...], "s": seconds}

    def start(self, started_at: float | None = None) -> None:
        """Call as the loop starts. `started_at`: time.time() as the run's start-up began (the
        script's start, or main()'s call in a running interpreter); None: not measured."""
        self.t_start = time.perf_counter()
        self.startup_s = None if started_at is None else round(max(0.0, time.time() - started_at), 2)

    def add(self, steady: list[float], left_out: list[dict] = ()) -> None:
        """An interval's steady step times (seconds), and its left-out steps {"step", "s", "why"}."""
        self.steps += len(steady)
        self.step_time_s += sum(steady)
        for x in left_out:
            e = self.left_out.setdefault(x["why"], {"steps": [], "s": 0.0})
            e["steps"].append(x["step"])
            e["s"] += x["s"]

    def figures(self) -> dict:
        """The run so far, under StepRecord's run-wide keys."""
        elapsed = time.perf_counter() - self.t_start
        left_steps = sum(len(e["steps"]) for e in self.left_out.values())
        tokens, trained = self.steps * self.tokens_per_step, (self.steps + left_steps) * self.tokens_per_step
        return {
            "run_tokens": tokens,
            "run_steps": self.steps,
            "run_step_time_s": self.step_time_s,
            "run_tokens_per_s": tokens / self.step_time_s if self.step_time_s > 0 else None,
            "tokens_trained": trained,
            "tokens_per_s_e2e": trained / elapsed if elapsed > 0 else 0.0,
            "elapsed_s": elapsed,
            "startup_s": self.startup_s,
            "run_left_out": {k: {"steps": list(e["steps"]), "s": e["s"]} for k, e in self.left_out.items()},
        }

    def eta_s(self, steps_left: int, elapsed: float) -> float:
        """The remaining steps at the end-to-end pace of the steady steps (the loop's time so far less
        the left-out steps'), or of the left-out ones while there are no others."""
        left_s = sum(e["s"] for e in self.left_out.values())
        if self.steps:
            return steps_left * max(0.0, elapsed - left_s) / self.steps
        done = sum(len(e["steps"]) for e in self.left_out.values())
        return steps_left * elapsed / done if done else 0.0


@dataclass
class Throughput:
    """What turns the loop's clocks into a StepRecord: this run's constants, and the run-wide
    totals (RunTotals) that every record carries."""

    tokens_per_step: int  # per rank: batch x seq_len x accumulation
    world_size: int  # the data-parallel ranks: a tp group's ranks share one batch
    flops_per_token: int  # per device: a tp group's devices split the model
    peak: PeakFlops
    amp: str  # the dtype the model trains in: "bf16", "fp16" or "fp32"
    start_step: int
    num_steps: int
    train_tokens: int | None  # the epoch's length; None for toy data, which has no epochs
    totals: RunTotals
    predicted_ms: float | None = None  # the predicted step (config.json's predicted_step), when there is one

    @property
    def device(self) -> str:
        return self.peak.device

    def config(self) -> dict:
        """The keys config.json carries."""
        return {"flops_per_token": self.flops_per_token, **self.peak.config()}

    def record(
        self, step: int, losses: list[float], lr: float, val: float | None, interval: Interval
    ) -> StepRecord:
        """The interval's StepRecord; its time in collectives: under FSDP/TP a profiled step's
        (`interval.comm`), under DDP the backward's wait for the all-reduce."""
        step_times, stages = interval.step_times, interval.stages
        step_time = sum(step_times) / len(step_times)
        per_rank = self.tokens_per_step / step_time
        achieved = achieved_tflops(self.flops_per_token, per_rank)  # per device
        if achieved * 1e12 > self.peak.value:  # proves the denominator low: said once, corrected
            from minigpt.instruments.mfu import raise_peak

            if note := raise_peak(self.peak, achieved * 1e12):
                logging.getLogger("minigpt").warning(note)
        self.totals.add(interval.steady, interval.left_out)
        run = self.totals.figures()  # run_tokens, run_tokens_per_s, tokens_per_s_e2e, elapsed_s, ...
        comm_step, comm_ms = interval.comm or (None, {})
        if "backward_compute" in stages.host_ms:  # DDP: every step's wait, averaged like the stages
            comm_ms = {"backward": stages.host_ms["backward"] - stages.host_ms["backward_compute"]}
        tokens = step * self.tokens_per_step * self.world_size
        return StepRecord(
            step=step,
            num_steps=self.num_steps,
            loss=sum(losses) / len(losses),
            lr=lr,
            epoch=1 + tokens // self.train_tokens if self.train_tokens else 1,
            step_time_s=step_time,
            tokens_per_s=self.world_size * per_rank,
            tokens_per_s_per_rank=per_rank,
            **run,
            world_size=self.world_size,
            val_loss=val,
            val_ppl=None if val is None else math.exp(min(val, 700.0)),  # exp overflows past ~709
            eta_s=self.totals.eta_s(self.num_steps - step, run["elapsed_s"]),
            amp=self.amp,
            mfu=mfu(self.flops_per_token, per_rank, self.peak),  # over the peak as raise_peak left it
            achieved_tflops=achieved,
            stage_host_ms=stages.host_ms,
            stage_device_ms=stages.device_ms,
            stage_comm_ms=comm_ms,
            comm_step=comm_step,
            memory=cuda_memory_report() if self.device == "cuda" else process_memory(),
            left_out=interval.left_out,
            steady_steps=len(interval.steady),
            memory_breakdown=interval.memory_breakdown,
        )


def evaluation_notice(batches: int, interval, grad_accum_steps: int, threshold_s: float = 5.0) -> str | None:
    """A line before an evaluation expected to take `threshold_s` or more, so a long one is not
    minutes of silence: one batch costs the interval's forward per micro-batch (a third of a step
    without stage timing). None otherwise."""
    forward = interval.stages.host_ms.get("forward")
    if forward is None and interval.step_times:
        forward = 1000 * sum(interval.step_times) / len(interval.step_times) / 3
    seconds = batches * (forward or 0.0) / grad_accum_steps / 1000
    return (
        f"evaluating ({batches} batches, about {format_duration(seconds)})..."
        if seconds >= threshold_s
        else None
    )
