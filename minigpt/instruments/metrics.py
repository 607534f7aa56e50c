"""What a run reports: the log line (console and train.log), metrics.jsonl, TensorBoard scalars,
and MFU. Knows nothing of GPT: figures come in as plain dicts and numbers."""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from minigpt.fileio import DiskFull, disk_full_message, is_disk_full
from minigpt.stages import label
from minigpt.step_record import MEMORY_BREAKDOWN_KEYS, StepRecord, describe_left_out, step_list


def format_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.2f}h"


@dataclass
class RunTotals:
    """The run-wide figures, accumulated over every step since the loop started: the one place
    they are defined. The run's rate is its steady state: the steady steps' tokens over the sum of
    their times (not a mean of interval means, which would weigh a short interval like a long one);
    the steps left out of it (warm-up, compilation, instrumented steps) are kept apart, by why.
    End to end is every step's tokens over the loop's wall-clock time; start-up is the process's
    age when the loop starts, kept apart from both."""

    tokens_per_step: int  # the job's: every data-parallel rank's batch
    t_start: float = 0.0  # perf_counter at the loop's start
    startup_s: float | None = None
    steps: int = 0  # steady steps
    step_time_s: float = 0.0  # their host seconds
    left_out: dict[str, dict] = field(default_factory=dict)  # why -> {"steps": [n, ...], "s": seconds}

    def start(self, started_at: float | None = None) -> None:
        """Call as the loop starts. `started_at`: time.time() as the run's start-up began (the
        script's start, or main()'s call in a running interpreter); None: not measured. Not the
        process's age: `bash -c "pip install ... && python train_minimal.py"` runs python in bash's
        process, and a notebook's kernel is as old as the notebook."""
        self.t_start = time.perf_counter()
        self.startup_s = None if started_at is None else round(max(0.0, time.time() - started_at), 2)

    def add(self, steady: list[float], left_out: list[dict] = ()) -> None:
        """An interval: its steady steps' times (seconds), and its left-out steps ({"step", "s", "why"})."""
        self.steps += len(steady)
        self.step_time_s += sum(steady)
        for x in left_out:
            e = self.left_out.setdefault(x["why"], {"steps": [], "s": 0.0})
            e["steps"].append(x["step"])
            e["s"] += x["s"]

    @property
    def tokens(self) -> int:
        return self.steps * self.tokens_per_step

    @property
    def left_out_s(self) -> float:
        return sum(e["s"] for e in self.left_out.values())

    @property
    def tokens_trained(self) -> int:
        return (self.steps + sum(len(e["steps"]) for e in self.left_out.values())) * self.tokens_per_step

    def figures(self) -> dict:
        """The StepRecord fields of RUN_KEYS, and run_left_out, now."""
        elapsed = time.perf_counter() - self.t_start
        return {
            "run_tokens": self.tokens,
            "run_steps": self.steps,
            "run_step_time_s": self.step_time_s,
            "run_tokens_per_s": self.tokens / self.step_time_s if self.step_time_s > 0 else None,
            "tokens_trained": self.tokens_trained,
            "tokens_per_s_e2e": self.tokens_trained / elapsed if elapsed > 0 else 0.0,
            "elapsed_s": elapsed,
            "startup_s": self.startup_s,
            "run_left_out": {k: {"steps": list(e["steps"]), "s": e["s"]} for k, e in self.left_out.items()},
        }

    def eta_s(self, steps_left: int, elapsed: float) -> float:
        """The remaining steps at the end-to-end pace of the steps after warm-up: the loop's time
        less the left-out steps', over the steady steps (evaluations and logging included); every
        step's pace while none is steady."""
        if self.steps:
            return steps_left * max(0.0, elapsed - self.left_out_s) / self.steps
        done = sum(len(e["steps"]) for e in self.left_out.values())
        return steps_left * elapsed / done if done else 0.0


def format_finished(r: StepRecord, steps: int, resumed_at: int = 0, prediction: str | None = None) -> str:
    """The run's last line: its figures exactly as metrics.jsonl's last record holds them. A run
    resumed at step `resumed_at` counts from there: the steps before were another process's.
    `prediction`: the steady step against the predicted one, when there is a prediction."""
    startup = (
        f"start-up {format_duration(r.startup_s)} before the loop, in neither figure"
        if r.startup_s is not None
        else "start-up not measured"
    )
    val = f"val loss {r.val_loss:.4f}, val ppl {r.val_ppl:.1f}" if r.val_loss is not None else "no evaluation"
    left = describe_left_out(r.run_left_out)
    steady = (
        f"{r.run_tokens_per_s:,.0f} tokens/s in steady state ({r.run_steps} steps in {r.run_step_time_s:.2f}s"
        + (f"; left out: {left})" if left else ")")
        if r.run_tokens_per_s is not None
        else f"no steady-state figure: every step was left out ({left})"
    )
    return (
        f"Training finished: {steps} steps"
        + (f" (since the resume at step {resumed_at})" if resumed_at else "")
        + f", {r.tokens_trained:,} tokens; {val}; {steady}"
        + (f", {prediction}" if prediction else "")
        + f"; {r.tokens_per_s_e2e:,.0f} tokens/s end to end ({r.elapsed_s:.2f}s of loop to the last log "
        "line: left-out steps, evaluations, logging and checkpoints included); "
        f"{startup}"
    )


def forward_ms(stages, step_times: list[float], grad_accum_steps: int) -> float | None:
    """One batch's forward time in the interval (ms), what an evaluation batch costs: the forward
    stage per micro-batch (`stages`: the interval's StageTimes), or a third of a step without
    stage timing."""
    if "forward" in stages.host_ms:
        return stages.host_ms["forward"] / grad_accum_steps
    return 1000 * sum(step_times) / len(step_times) / 3 / grad_accum_steps if step_times else None


def evaluation_notice(batches: int, forward_ms: float | None, threshold_s: float = 5.0) -> str | None:
    """A line before an evaluation expected to take `threshold_s` or more (at `forward_ms` per
    batch, the interval's forward time), so a long one is not minutes of silence; None otherwise."""
    if forward_ms is None or batches * forward_ms / 1000 < threshold_s:
        return None
    return f"evaluating ({batches} batches, about {format_duration(batches * forward_ms / 1000)})..."


def format_log_line(m: StepRecord) -> str:
    """One line per log interval, in the spirit of the blog's trainer."""
    val = "n/a" if m.val_loss is None else f"{m.val_loss:.4f}"
    ppl = "n/a" if m.val_ppl is None else f"{m.val_ppl:.1f}"
    line = (
        f"epoch {m.epoch} step {m.step}/{m.num_steps} | lr {m.lr:.2e} | step {m.step_time_s * 1000:.0f}ms | "
        + "".join(f"left out: {step_list([x['step']])} {x['s']:.2f}s ({x['why']}) | " for x in m.left_out)
        + f"{m.tokens_per_s:,.0f} tok/s per step, {m.tokens_per_s_e2e:,.0f} end to end | "
        + (f"{m.tokens_per_s_per_rank:,.0f} tok/s/rank x {m.world_size} | " if m.world_size > 1 else "")
        + (f"mfu {100 * m.mfu:.1f}% ({m.achieved_tflops:.2f} TFLOP/s) | " if m.mfu is not None else "")
        + f"train loss {m.loss:.4f} | val loss {val} | val ppl {ppl} | "
        f"elapsed {format_duration(m.elapsed_s)} | eta {format_duration(m.eta_s)} | amp {m.amp}"
    )
    if m.stage_host_ms:  # host/device ms per stage: on a GPU they differ, the host runs ahead and waits later
        line += " | host/device ms " + " ".join(
            f"{label(k)} {v:.1f}/{m.stage_device_ms.get(k, float('nan')):.1f}"
            for k, v in m.stage_host_ms.items()
        )
    if m.stage_comm_ms:
        line += (
            " | waiting on collectives ms "
            + (f"(step {m.comm_step}) " if m.comm_step else "")
            + " ".join(f"{label(k)} {v:.1f}" for k, v in m.stage_comm_ms.items())
        )
    mem = m.memory
    if "peak_allocated_gib" in mem:
        line += (
            f" | peak mem {mem['peak_allocated_gib']:.2f}/{mem['peak_reserved_gib']:.2f} GiB alloc/reserved"
        )
    elif mem.get("rss_bytes"):
        # What the machine sees. Above the tensors it holds malloc's cached and retained blocks,
        # the interpreter and the libraries: the allocator's own peak is --memory-profiler's figure.
        line += f" | rss {mem['rss_bytes'] / 2**30:.2f} GiB, peak {mem['rss_peak_bytes'] / 2**30:.2f} GiB"
        peak = (m.memory_breakdown or {}).get("peak")
        if peak:
            line += (
                f" (allocator peak {peak / 2**20:,.1f} MiB in step {m.memory_breakdown['step']}; the rest is "
                "malloc's caching and retention, the interpreter, the libraries)"
            )
    return line


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))  # exp overflows a float past ~709


class JsonlWriter:
    """Appends one JSON object per line and flushes, so a crash loses at most the current line (a
    resumed run drops a cut line: minigpt.core.runs.repair_jsonl)."""

    def __init__(self, path: Path, enabled: bool = True):
        self.f, self.path = None, path
        if enabled:  # under DDP only rank 0 writes
            path.parent.mkdir(parents=True, exist_ok=True)
            self.f = open(path, "a", encoding="utf-8")

    def write(self, record: dict | StepRecord) -> None:
        if self.f:
            line = json.dumps(record.to_json() if isinstance(record, StepRecord) else record) + "\n"
            try:
                self.f.write(line)
                self.f.flush()
            except OSError as e:
                if is_disk_full(e):
                    raise DiskFull(disk_full_message(self.path, len(line), True)) from None
                raise

    def close(self) -> None:
        if self.f:
            try:
                self.f.close()
            except OSError:  # a full disk was already reported by write(); closing adds nothing
                pass

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------- TensorBoard


class TensorBoardLogger:
    """Scalars for `tensorboard --logdir <out-dir>`: the same figures as metrics.jsonl."""

    def __init__(self, log_dir: Path, enabled: bool = True, purge_step: int | None = None):
        """`purge_step`: on resume, the first step trained again; TensorBoard hides what an earlier
        run wrote from there on, so no step is drawn twice."""
        self.writer, self.log_dir = None, log_dir
        if enabled:  # under DDP only rank 0 writes
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when used

            if threading.excepthook is not _quiet_full_disk:
                _quiet_full_disk.previous = threading.excepthook
                threading.excepthook = _quiet_full_disk
            self.writer = SummaryWriter(str(log_dir), purge_step=purge_step)

    def log(self, r: StepRecord) -> None:
        """Write the record's scalars and flush them. A full disk ends as one line (DiskFull):
        TensorBoard's writer thread fails first, and its error is raised here."""
        if self.writer is None:
            return
        try:
            self._log(r)
        except (OSError, RuntimeError) as e:
            if is_disk_full(e):
                raise DiskFull(disk_full_message(self.log_dir, None, True)) from None
            raise

    def _log(self, r: StepRecord) -> None:
        scalars = {
            "train/loss": r.loss,
            "val/loss": r.val_loss,
            "val/ppl": r.val_ppl,
            "train/lr": r.lr,
            "perf/tokens_per_s": r.tokens_per_s,
            "perf/tokens_per_s_e2e": r.tokens_per_s_e2e,
            "perf/run_tokens_per_s": r.run_tokens_per_s,  # the run so far, in steady state
            "perf/tokens_per_s_per_rank": r.tokens_per_s_per_rank,
            "perf/mfu": r.mfu,
            "perf/achieved_tflops": r.achieved_tflops,
            "perf/step_time_ms": 1000 * r.step_time_s,
        }
        for kind, figures in (
            ("host", r.stage_host_ms),
            ("device", r.stage_device_ms),
            ("comm", r.stage_comm_ms),
        ):
            for stage, ms in figures.items():
                scalars[f"stage_{kind}_ms/{stage}"] = ms
        for key, value in r.memory.items():
            scalars[f"memory/{key}"] = value
        for tag, value in scalars.items():
            if value is not None:
                self.writer.add_scalar(tag, value, r.step)
        # The measured memory breakdown (bytes, see instruments/memory.py), in MiB at the measured step.
        breakdown = r.memory_breakdown or {}
        for prefix, figures in (
            ("memory_breakdown", breakdown),
            ("memory_estimate", breakdown.get("estimate") or {}),
        ):
            for key in MEMORY_BREAKDOWN_KEYS:
                if figures.get(key) is not None:
                    self.writer.add_scalar(
                        f"{prefix}/{key}_mib", figures[key] / 2**20, breakdown.get("step", r.step)
                    )
        self.writer.flush()

    def close(self, error_in_flight: bool = False) -> None:
        """A full disk met while closing is one line, unless the run is already ending on an error
        (log() reported it, or another one): then it adds nothing."""
        if self.writer is None:
            return
        try:
            self.writer.close()
        except (OSError, RuntimeError) as e:
            if not is_disk_full(e):
                raise
            if not error_in_flight:
                raise DiskFull(disk_full_message(self.log_dir, None, True)) from None
        finally:
            self.writer = None

    def __enter__(self) -> TensorBoardLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close(error_in_flight=exc[0] is not None)


def _quiet_full_disk(args) -> None:
    """threading.excepthook: TensorBoard's writer thread dies on a full disk and prints its
    traceback; TensorBoardLogger.log raises the same error in the loop as one line, so the
    thread's copy is dropped. Every other thread's error goes to the hook that was there before."""
    if type(args.thread).__module__.startswith("tensorboard.") and is_disk_full(args.exc_value):
        return
    _quiet_full_disk.previous(args)


_quiet_full_disk.previous = threading.excepthook
