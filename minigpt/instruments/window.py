"""The instruments a flag turns on, beside the training step: the profiler window
(--use-profiler), the Nsight capture range (--nsys), CUDA memory history and snapshots
(--record-memory-history), the one-step memory capture (--memory-profiler) and, under --fsdp/--tp,
the profiled step that times the collectives (CommProbe). train_minimal.py loads this module only
when one of them is asked for, and hands its Window to Instruments (instrument.py), which calls it
around every step.

- `make_profiler` builds a torch.profiler window with Megatron's semantics (steps S..E-1).
- `NsysCaptureRange` calls cudaProfilerStart/Stop around the same window for `nsys --capture-range`.
- `MemoryHistory` records CUDA allocations of the training steps and dumps snapshots (read offline
  by `python -m minigpt snapshot`).
"""

from __future__ import annotations

import logging
import os
import pickle
import statistics
import sys
import threading
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, tensorboard_trace_handler

from minigpt import config as paths
from minigpt.analysis.stats import MIN_SAMPLES, ratio_interval
from minigpt.config import BUSY, atomic_write, busy_share, cpu_seconds
from minigpt.core import torchcompat
from minigpt.instruments.figures import process_memory

SNAPSHOT_MARKER = b"\x80"  # how a pickle of protocol 2 or later begins: what a memory snapshot is


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


# torch writes lines to stderr from C++ that look like trouble while a profiler with memory events
# runs (--use-profiler, --memory-profiler): Kineto's USDT markers at every start and stop, which no
# setting turns off; c10's ProfiledCPUMemoryReporter, once per 1000 frees of a block made before
# the recording, whose free is then missing from the trace's memory timeline. Checked on the tiny
# preset: with them the trace is written whole, its operators and times complete, and
# --memory-profiler's measured peak still equals the estimate. StderrWatch sees whether torch wrote
# one (TORCH_LINES); the log explains them, once, after the profilers are done, only if it did.
TORCH_LINES = ("USDT: ", "Memory block of unknown size")
PROFILER_STDERR_NOTE = (
    "Profiler: torch's stderr lines above ('USDT: ... profiler_start/stop', 'Memory block of unknown "
    "size ...') are harmless: the trace is whole"
)


class StderrWatch:
    """File descriptor 2 through a pipe while the profilers run: a thread passes every byte on to
    the real stderr as it comes (an error is held back by no more than the thread's wake-up) and
    notes whether one of `patterns` went by. stop() puts fd 2 back and says whether one did."""

    def __init__(self, patterns: tuple[str, ...] | None = None):
        self.patterns, self.seen = tuple(p.encode() for p in patterns or TORCH_LINES), False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        sys.stderr.flush()
        self._saved, (read, self._write) = os.dup(2), os.pipe()
        os.dup2(self._write, 2)
        self._thread = threading.Thread(target=self._pump, args=(read, self._saved), daemon=True)
        self._thread.start()

    def _pump(self, read: int, saved: int) -> None:
        """Until every writer has closed the pipe: on to `saved` (the real stderr), watched. A child
        process that inherited fd 2 may hold the pipe past stop(): this thread serves it, then closes
        both ends itself."""
        tail = b""
        try:
            while chunk := os.read(read, 65536):
                view = memoryview(chunk)
                try:
                    while view:
                        view = view[os.write(saved, view) :]
                except OSError:  # the real stderr is gone: keep draining, or the writers would block
                    pass
                seen = tail + chunk
                self.seen = self.seen or any(p in seen for p in self.patterns)
                tail = seen[-64:]
        finally:
            os.close(read)
            os.close(saved)

    def stop(self) -> bool:
        if self._thread is not None:
            sys.stderr.flush()
            os.dup2(self._saved, 2)  # open still: the thread closes it only once the pipe is closed
            os.close(self._write)
            self._thread.join(timeout=5)  # all that was written read (or a child still holds the pipe)
            self._thread = None
        return self.seen


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


OPERATOR_NAME = 60  # characters of an operator's name in the log's table (its file holds torch's whole table)


def operator_lines(prof: torch.profiler.profile, device: str, rows: int = 10) -> str:
    """The log's operator table, at most 132 columns: the `rows` operators with the most self time
    (the device's on a GPU, the host's otherwise), ms over the window, and their calls."""
    cuda = device == "cuda"
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:rows]
    heads = ["self CPU ms", "CPU total ms", *(["self GPU ms", "GPU total ms"] if cuda else []), "calls"]
    lines = [f"  {'operator':{OPERATOR_NAME}s}" + "".join(f"{h:>14s}" for h in heads)]
    for e in events:
        name = e.key if len(e.key) <= OPERATOR_NAME else e.key[: OPERATOR_NAME - 3] + "..."
        ms = [e.self_cpu_time_total, e.cpu_time_total]
        ms += [e.self_device_time_total, e.device_time_total] if cuda else []
        cells = "".join(f"{x / 1e3:14.2f}" for x in ms)
        lines.append(f"  {name:{OPERATOR_NAME}s}{cells}{e.count:14d}")
    return "\n".join(lines)


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
        from minigpt.analysis.cuda_snapshot import peak_text  # the snapshot's reader, loaded to write one

        snapshot = torchcompat.memory_snapshot()
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: pickle.dump(snapshot, f))
        atomic_write(path.with_suffix(".txt"), peak_text(snapshot))
        return path

    def stop(self) -> None:
        torchcompat.stop_memory_history()

    def dump_on_oom(self, path: Path) -> None:
        """Write `path` when the allocator runs out of memory, before the error propagates."""

        def observer(device, alloc, device_alloc, device_free):
            self.dump(path)

        torchcompat.attach_oom_observer(observer)


def snapshot_path(cfg, out_dir: Path, rank: int, world_size: int) -> Path:
    """Where --record-memory-history's snapshot goes: the run's folder, or --memory-snapshot-path
    (one file per rank, never overwritten by another)."""
    snapshot = Path(cfg.memory_snapshot_path or out_dir / paths.SNAPSHOT_FILE.format(rank=rank))
    if cfg.memory_snapshot_path and world_size > 1:
        snapshot = snapshot.with_name(f"rank{rank}_{snapshot.name}")
    return snapshot


# ---------------------------------------------------------------------------- the window


class Window:
    """The flag-driven instruments of a run, one object the step calls: before each step, around
    it (the memory capture), after it; which steps they slow on purpose (left out of the steady
    figures); and their outputs and log lines. `cfg` is a TrainConfig; only its instrumentation
    flags are read."""

    def __init__(self, run, device: str, amp: str, plan, model, optimizer, first_step: int):
        """`run`: the run's folder (runs.RunDir: its flags, ranks and path). `plan.worker` names this
        rank's trace and memory files (rank{R}_dp{d}); under
        `plan.sharded` (FSDP, TP) the step's collectives are issued by the model itself, not by a DDP
        wrapper whose backward can be split: one step per log interval is profiled for them
        (CommProbe). `model` and `optimizer` are what the step trains (the model unwrapped);
        `first_step` the step the loop runs next (1-based; later after --resume)."""
        cfg, rank, world_size, out_dir = run.cfg, run.dist_info.rank, run.dist_info.world_size, Path(run.path)
        self.cfg, self.device, self.rank, self.out_dir, self.worker = cfg, device, rank, out_dir, plan.worker
        self.model, self.optimizer, self.first_step = model, optimizer, first_step
        self.log = logging.getLogger("minigpt")
        ranks = [0]  # --profile-ranks' default, without loading torch.distributed
        if cfg.profile_ranks.strip() != "0":
            from minigpt.core.distributed import profile_ranks

            ranks = profile_ranks(cfg.profile_ranks, world_size)
        self.profiled = ranks is None or rank in ranks  # takes part in --use-profiler, --nsys, memory history
        self.window = window = range(cfg.profile_step_start, cfg.profile_step_end)
        notes = []  # for the run's first lines
        self.snapshot_path, self._snapshot_dumped = snapshot_path(cfg, out_dir, rank, world_size), False
        self.memory_history = (
            cfg.record_memory_history and self.start_memory_history(cfg, out_dir, rank) or None
        )
        self.profiler = self.nsys = None
        if cfg.use_profiler and self.profiled and first_step <= window.start:
            options = profiler_options(cfg)
            trace_dir = out_dir / paths.TRACE_DIR
            self.profiler = make_profiler(
                trace_dir, self.worker, first_step, window, device, options, self._window_done
            )
        if cfg.nsys and self.profiled and first_step <= window.start:
            self.nsys = NsysCaptureRange(window.start, window.stop)
        if (cfg.use_profiler or cfg.nsys) and first_step > window.start:
            notes.append(
                f"Profiler: nothing profiled: the window starts at step {window.start}, before the "
                f"resume at step {first_step} (pass a later --profile-step-start/-end)"
            )
        self.memory_step: int | None = None
        self.memory_estimate = None
        if cfg.memory_profiler and self.profiled:
            if first_step <= cfg.memory_profile_step:
                from minigpt.instruments.estimate import memory_estimate

                self.memory_step = cfg.memory_profile_step
                self.memory_estimate = memory_estimate(cfg, model.cfg.vocab_size, amp, device, plan)
            else:
                notes.append(
                    f"--memory-profiler: nothing measured: step {cfg.memory_profile_step} came before "
                    f"the resume at step {first_step} (pass a later --memory-profile-step)"
                )
        # torch's stderr watched from the start to the end of the profilers (a line per window and step)
        self._watch = StderrWatch() if self.profiler is not None or self.memory_step is not None else None
        self._done = {"window": self.profiler is None, "memory": self.memory_step is None}
        self.note = "\n".join(notes) or None
        self.memory_breakdown: dict | None = None  # the measured step's record, for the next log line
        self._rss_before_window: int | None = None
        self._cpu_at = {}  # cpu_seconds() at the run's start and the window's start and end
        self.comm = None
        if plan.sharded and cfg.comm_profile and cfg.stage_timing:
            from minigpt.instruments.commprobe import CommProbe

            self.comm = CommProbe(cfg)
        self._exit = ExitStack()
        self._probed = False

    def start_memory_history(self, cfg, out_dir: Path, rank: int):
        """--record-memory-history on a profiled rank: its path refused now if it cannot be written
        (not when the window ends), the OOM observer from now on (an OOM while building still leaves
        the segments), the history itself from the first step (its entries are training steps only)."""
        if not self.profiled:
            return None
        if cfg.memory_snapshot_path:  # a path of the user's
            from minigpt.core.guards import probe_writable
            from minigpt.fileio import check_may_replace

            probe_writable(self.snapshot_path, "--memory-snapshot-path")
            # and never over a file that is not a pickle (a snapshot is one): a run's config, its
            # metrics, a checkpoint (a zip)
            flag, fix = "--memory-snapshot-path", "name another path"
            check_may_replace(self.snapshot_path, SNAPSHOT_MARKER, flag, "minigpt", fix=fix)
        history = MemoryHistory(cfg.memory_history_entries)
        history.dump_on_oom(out_dir / paths.OOM_SNAPSHOT_FILE.format(rank=rank))
        return history

    # -- around each step
    def before_step(self, n: int):
        """Before training step `n` (outside its clock): the profiler's ProfilerStep#n range, Nsight's
        capture range, the memory history's start, the collectives' probe. Returns the context the
        step runs in: the memory capture of the measured step, else nothing."""
        if self.profiler is not None and n > self.first_step:
            self.profiler.step()  # opens ProfilerStep#n here, after the evaluation and logging of n-1
        if n == self.window.start and self.profiler is not None:
            self._rss_before_window = process_memory()["rss_peak_bytes"]
            self._cpu_at["window"] = cpu_seconds()
        if self.nsys:
            self.nsys.before_step(n)
        if self.memory_history and not self.memory_history.started:
            self.memory_history.start()  # the first step's allocations on: the recording is training
        self._probed = self.comm is not None and self.comm.start(n, self.first_step)  # outside the clock
        return self._capture() if n == self.memory_step else nullcontext()

    def after_step(self, n: int, capture) -> None:
        """After the step's clock, outside the ProfilerStep range: the collectives' probe stops;
        writing a trace, snapshot or chart is not training."""
        if self._probed:
            self._probed = False
            self.comm.stop(n)
        if self.profiler is not None:  # ProfilerStep#n closed now: what runs between steps stays outside
            torchcompat.close_profiler_step(self.profiler)
            if n == self.window.stop - 1 and "window" in self._cpu_at:
                self._cpu_at["window"] = busy_share(self._cpu_at["window"], cpu_seconds())
        if self.memory_history and n == self.window.stop - 1:  # the end of the window: a snapshot of it
            self.memory_history.dump(self.snapshot_path)
            self._snapshot_dumped = True
        if n == self.memory_step:
            self._write_memory(capture.breakdown)

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

    # -- the profiler window
    def _window_done(self, prof: torch.profiler.profile) -> None:
        ops_path = self.out_dir / paths.OPS_FILE.format(rank=self.rank)
        ops_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(ops_path, top_operators(prof, self.device))
        w, traces = self.window, self.out_dir / paths.TRACE_DIR
        self.log.info(f"Profiled steps {w.start}-{w.stop - 1}; top operators (torch's table: {ops_path}):")
        self.log.info(operator_lines(prof, self.device))
        if self.device == "cuda" and not has_device_kernels(prof):
            self.log.warning(
                "WARNING: the trace holds no CUDA kernel events: CUPTI recorded nothing "
                "(check that the CUDA profiling libraries match the driver)"
            )
        self.log.info(f"View the trace: python -m minigpt traces {traces}")
        self.log.info(
            f"  or open {traces}/*.json.gz in ui.perfetto.dev, or tensorboard --logdir {self.out_dir}"
        )
        self._profiled("window")

    def _profiled(self, which: str) -> None:
        """`which` profiler ("window", "memory") is done; after the last, torch's stderr is no longer
        watched, and the lines it wrote there are explained if it wrote any."""
        self._done[which] = True
        if self._watch is not None and all(self._done.values()):
            watch, self._watch = self._watch, None
            if watch.stop():
                self.log.info(PROFILER_STDERR_NOTE)

    def profiler_cost(self, step_times: dict[int, float]) -> str | None:
        """The profiled steps' time against the unprofiled ones' (a ratio with its interval, "no
        difference within noise" when it holds 1.0), and the process's peak memory before and after
        the window. Not step 1 (it allocates everything), not the profiler's warm-up step; at least
        three unprofiled steps, and no figure from a machine other processes kept busy."""
        if self.profiler is None:
            return None
        w = self.window
        during = [t for s, t in step_times.items() if s in w]
        before = [t for s, t in step_times.items() if s != 1 and s != w.start - 1 and s not in w]
        if not during:
            return None
        rss = ""
        if self._rss_before_window:
            after = process_memory()["rss_peak_bytes"]
            rss = (
                f"\n  process peak memory {self._rss_before_window / 2**30:.2f} GiB before the window, "
                f"{after / 2**30:.2f} GiB after"
            )
        run = busy_share(self._cpu_at["run"], cpu_seconds()) if "run" in self._cpu_at else None
        window = self._cpu_at.get("window")
        busy = [x for x in (run, window if isinstance(window, float) else None) if x is not None and x > BUSY]
        if busy:
            return (
                f"Profiler cost: not priced: other processes took {max(busy):.0%} of the cores "
                f"(re-run on a quiet machine){rss}"
            )
        if len(before) < MIN_SAMPLES or len(during) < 2:
            return (
                f"Profiler cost: not priced: {len(before)} unprofiled step(s) to compare with, "
                f"{MIN_SAMPLES} needed (not step 1 nor the warm-up before the window; run more steps){rss}"
            )
        d, b = statistics.median(during), statistics.median(before)
        iv = ratio_interval(before, during, minimum=2, method="steps of one run")
        noise = ": no difference within noise" * iv.holds_one
        return (
            f"Profiler cost: a profiled step takes {iv.ratio:.2f}x ({iv.low:.2f}-{iv.high:.2f}) the time of "
            f"an unprofiled one{noise}\n  {1000 * d:.0f} ms/step profiled (median of {len(during)}) vs "
            f"{1000 * b:.0f} ms unprofiled (median of {len(before)}){rss}"
        )

    # -- the one-step memory capture
    def _capture(self):
        from minigpt.instruments.breakdown import capture_memory

        return capture_memory(self.model, self.optimizer, self.memory_step)

    def _write_memory(self, breakdown) -> None:
        from minigpt.instruments.breakdown import format_breakdown, write_memory_trace

        folder = self.out_dir / paths.MEMORY_TRACE_DIR.format(worker=self.worker)
        write_memory_trace(breakdown, folder, self.memory_estimate, run_dir=self.out_dir)
        self.log.info(format_breakdown(breakdown, self.memory_estimate))
        self.log.info(f"  memory.log and sunburst charts: {folder}")
        self.memory_breakdown = breakdown.to_record(self.memory_estimate)
        self._profiled("memory")

    def take_comm(self) -> tuple[int, dict[str, float]] | None:
        """(the profiled step, its ms in collectives per stage) of the interval, once; None when no
        step of it was profiled (or no CommProbe)."""
        return self.comm.take() if self.comm else None

    def take_memory_breakdown(self) -> dict | None:
        """The measured step's figures once, for the first log line after it."""
        record, self.memory_breakdown = self.memory_breakdown, None
        return record

    # -- entering and leaving
    def __enter__(self) -> Window:
        self._cpu_at["run"] = cpu_seconds()
        if self._watch is not None:
            self._watch.start()
        if self.profiler is not None:
            self._exit.enter_context(self.profiler)
        return self

    def __exit__(self, *exc) -> None:
        """On every exit, a failing step's too: the profiler stops and writes its trace, the Nsight
        range closes, the memory history leaves its snapshot, a probe in flight stops."""
        try:
            self._exit.close()
        finally:
            if self._watch is not None:  # a run that ended before its profilers were done
                self._done = dict.fromkeys(self._done, True)
                self._profiled("window")
            if self._probed:
                self._probed = False
                self.comm.abandon()
            if self.nsys:
                self.nsys.stop()
            if self.memory_history:
                if not self._snapshot_dumped:  # the run ended before the window did
                    self.memory_history.dump(self.snapshot_path)
                self.memory_history.stop()
                self.log.info(
                    f"CUDA memory snapshot: {self.snapshot_path} (.txt beside it: what was live at its peak)"
                )
                self.log.info(
                    f"  offline page: python -m minigpt snapshot {self.snapshot_path}; the report links it"
                )
