"""What a run reports: the log line (console and train.log), metrics.jsonl, TensorBoard scalars,
and MFU. Knows nothing of GPT: figures come in as plain dicts and numbers."""

from __future__ import annotations

import json
import logging
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from minigpt.fileio import DiskFull, disk_full_message, is_disk_full
from minigpt.stages import label

LOG_FORMAT = "[%(asctime)s] %(message)s"
LOG_DATEFMT = "%Y-%m-%d %H:%M:%S"


def setup_logging(log_file: Path | None = None, rank: int = 0) -> logging.Logger:
    """The 'minigpt' logger: on rank 0 the console plus log_file when given; on other ranks only
    warnings and errors, on stderr, marked with the rank."""
    log = logging.getLogger("minigpt")
    log.handlers.clear()
    log.propagate = False
    if rank == 0:
        log.setLevel(logging.INFO)
        handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
        if log_file is not None:
            log_file.parent.mkdir(parents=True, exist_ok=True)
            handlers.append(logging.FileHandler(log_file, encoding="utf-8"))
        fmt = LOG_FORMAT
    else:
        log.setLevel(logging.WARNING)
        handlers, fmt = [logging.StreamHandler(sys.stderr)], f"[%(asctime)s] [rank {rank}] %(message)s"
    for h in handlers:
        h.setFormatter(logging.Formatter(fmt, LOG_DATEFMT))
        log.addHandler(h)
    return log


def format_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.2f}h"


@dataclass
class StepRecord:
    """One logged step: the one definition of what the console line, metrics.jsonl and TensorBoard
    show. metrics.jsonl holds one of these per line, under these keys (README "Run directory").
    Times are the means over the steps since the previous record."""

    step: int  # training steps done (1-based)
    num_steps: int
    epoch: int  # passes over the training tokens, counting from 1
    loss: float  # mean training loss over the interval's steps
    lr: float  # the learning rate of the last step
    step_time_s: float  # mean host time of one training step: the step alone, not evals or logging
    tokens_per_s: float  # per step: the job's tokens per step / step_time_s (all ranks)
    tokens_per_s_per_rank: float
    # End to end: tokens trained since the loop started / wall-clock time since then, evaluations,
    # logging and checkpoints included. What the job really delivers; the ETA follows it.
    tokens_per_s_e2e: float
    world_size: int
    val_loss: float | None  # the latest evaluation (None before the first)
    val_ppl: float | None
    elapsed_s: float  # wall-clock since the loop started
    eta_s: float  # remaining steps at the end-to-end rate
    amp: str  # "bf16", "fp16" or "fp32"
    mfu: float | None  # model FLOPs utilisation per device, against config.json's peak_flops
    achieved_tflops: float | None  # model TFLOP/s per device: needs no peak to be true
    stage_host_ms: dict[str, float] = field(default_factory=dict)  # stage -> mean host ms per step
    stage_device_ms: dict[str, float] = field(default_factory=dict)  # stage -> mean device ms per step
    stage_comm_ms: dict[str, float] = field(default_factory=dict)  # stage -> of it, ms waiting on collectives
    # The step stage_comm_ms was measured in, under FSDP/TP (one profiled step per interval); None
    # under DDP, whose figure is the interval's mean like the stages'.
    comm_step: int | None = None
    # CUDA: peak_allocated_gib, peak_reserved_gib, alloc_retries, ooms (per interval);
    # CPU: rss_bytes and rss_peak_bytes (the process, as the machine sees it)
    memory: dict[str, float] = field(default_factory=dict)
    memory_breakdown: dict | None = None  # on the first line after a --memory-profiler step (bytes)

    def to_json(self) -> dict:
        d = asdict(self)
        if d["memory_breakdown"] is None:
            del d["memory_breakdown"]
        return d


def format_log_line(m: StepRecord) -> str:
    """One line per log interval, in the spirit of the blog's trainer."""
    val = "n/a" if m.val_loss is None else f"{m.val_loss:.4f}"
    ppl = "n/a" if m.val_ppl is None else f"{m.val_ppl:.1f}"
    line = (
        f"epoch {m.epoch} step {m.step}/{m.num_steps} | lr {m.lr:.2e} | step {m.step_time_s * 1000:.0f}ms | "
        f"{m.tokens_per_s:,.0f} tok/s per step, {m.tokens_per_s_e2e:,.0f} end to end | "
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
    resumed run drops a cut line: minigpt.runs.repair_jsonl)."""

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

# Byte figures of record["memory_breakdown"] (and of its "estimate") that TensorBoard plots.
MEMORY_BREAKDOWN_KEYS = (
    "params",
    "grads",
    "optimizer",
    "activations",
    "activations_peak",
    "total",
    "cuda_max_allocated",
    "other",
    "logits",
    "recompute",
    "peak",
)


class TensorBoardLogger:
    """Scalars for `tensorboard --logdir <out-dir>`: the same figures as metrics.jsonl."""

    def __init__(self, log_dir: Path, enabled: bool = True, purge_step: int | None = None):
        """`purge_step`: on resume, the first step trained again; TensorBoard hides what an earlier
        run wrote from there on, so no step is drawn twice."""
        self.writer = None
        if enabled:  # under DDP only rank 0 writes
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when used

            self.writer = SummaryWriter(str(log_dir), purge_step=purge_step)

    def log(self, r: StepRecord) -> None:
        if self.writer is None:
            return
        scalars = {
            "train/loss": r.loss,
            "val/loss": r.val_loss,
            "val/ppl": r.val_ppl,
            "train/lr": r.lr,
            "perf/tokens_per_s": r.tokens_per_s,
            "perf/tokens_per_s_e2e": r.tokens_per_s_e2e,
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
        # The measured memory breakdown (bytes, see minigpt/memory.py), in MiB at the measured step.
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

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def __enter__(self) -> TensorBoardLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
