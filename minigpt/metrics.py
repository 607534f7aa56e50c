"""What a run reports: the log line (console and train.log), metrics.jsonl, TensorBoard scalars,
and MFU. Knows nothing of GPT: figures come in as plain dicts and numbers."""

from __future__ import annotations

import json
import logging
import math
import re
import sys
import time
from pathlib import Path

import torch

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


def format_log_line(m: dict) -> str:
    """One line per log interval, in the spirit of the blog's trainer."""
    val = "n/a" if m.get("val_loss") is None else f"{m['val_loss']:.4f}"
    ppl = "n/a" if m.get("val_loss") is None else f"{m['val_ppl']:.1f}"
    line = (f"epoch {m['epoch']} step {m['step']}/{m['num_steps']} | lr {m['lr']:.2e} | "
            f"step {m['step_time_s'] * 1000:.0f}ms | {m['tokens_per_s']:,.0f} tok/s | "
            + (f"{m['tokens_per_s_per_rank']:,.0f} tok/s/rank x {m['world_size']} | "
               if m.get("world_size", 1) > 1 else "")
            + (f"mfu {100 * m['mfu']:.1f}% | " if m.get("mfu") is not None else "")
            + f"train loss {m['loss']:.4f} | val loss {val} | val ppl {ppl} | "
            f"elapsed {format_duration(m['elapsed_s'])} | eta {format_duration(m['eta_s'])} | "
            f"amp {m['amp']}")
    host, device = m.get("stage_host_ms"), m.get("stage_device_ms")
    if host:  # host/device ms per stage: on a GPU they differ, the host runs ahead and waits later
        line += " | host/device ms " + " ".join(
            f"{STAGE_ABBREV.get(k, k)} {v:.1f}/{device.get(k, float('nan')):.1f}" for k, v in host.items())
    mem = m.get("memory") or {}
    if "peak_allocated_gib" in mem:
        line += f" | peak mem {mem['peak_allocated_gib']:.2f}/{mem['peak_reserved_gib']:.2f} GiB alloc/reserved"
    return line


STAGE_ABBREV = {"data_to_device": "h2d", "forward": "fwd", "backward": "bwd", "optimizer_step": "opt",
                "backward_compute": "(bwd compute)"}


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))  # exp overflows a float past ~709


class JsonlWriter:
    """Appends one JSON object per line and flushes, so a crash loses at most the current line."""

    def __init__(self, path: Path, enabled: bool = True):
        self.f = None
        if enabled:  # under DDP only rank 0 writes
            path.parent.mkdir(parents=True, exist_ok=True)
            self.f = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self.f:
            self.f.write(json.dumps(record) + "\n")
            self.f.flush()

    def close(self) -> None:
        if self.f:
            self.f.close()

    def __enter__(self) -> "JsonlWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------- MFU

# Dense peak FLOP/s per GPU from the vendors' data sheets (no 2:4 sparsity), by AMP dtype.
# fp32 means plain fp32 (TF32 off, PyTorch's default for matmuls).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},  # SXM
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
}


def peak_flops(device: str, dtype: str) -> tuple[float, str]:
    """(peak FLOP/s of one device in `dtype`, where the figure comes from). Known GPUs come from
    the table; anything else (every CPU) gets a matrix product timed now, so its MFU is relative
    to what this machine's GEMM reaches rather than to a data-sheet number."""
    if device == "cuda":
        name = torch.cuda.get_device_name()
        # Whole words, longest names first: "H100 PCIe" before "H100"; "L4" is not "L40S", "A10" not "A10G".
        for gpu in sorted(PEAK_FLOPS, key=len, reverse=True):
            if re.search(rf"\b{re.escape(gpu)}\b", name) and dtype in PEAK_FLOPS[gpu]:
                return PEAK_FLOPS[gpu][dtype], f"table: {gpu} {dtype} dense"
    value = measure_matmul_flops(device, dtype)
    return value, f"measured: 2048^3 {dtype} matmul on {device}"


def measure_matmul_flops(device: str, dtype: str, n: int = 2048, repeats: int = 5) -> float:
    """Best FLOP/s of an n x n x n matrix product in `dtype` over a few repeats."""
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    gen = torch.Generator(device).manual_seed(0)  # its own generator: the training RNG stays untouched
    a = torch.randn(n, n, device=device, dtype=torch_dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=torch_dtype, generator=gen)
    best = float("inf")
    for i in range(repeats + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        if i:  # the first product pays for warm-up
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def mfu(flops_per_token: float, tokens_per_s_per_device: float, peak: float) -> float:
    """Model FLOPs utilisation: the training FLOPs the model needs per second over the peak.
    Tokens/s is per device, so under DDP pass the job's figure divided by the world size, and
    count every micro-batch of gradient accumulation in the tokens."""
    return flops_per_token * tokens_per_s_per_device / peak


# ---------------------------------------------------------------------------- TensorBoard

# Byte figures of record["memory_breakdown"] (and of its "estimate") that TensorBoard plots.
MEMORY_BREAKDOWN_KEYS = ("params", "grads", "optimizer", "activations", "activations_peak", "total",
                         "cuda_max_allocated", "other", "logits", "recompute", "peak")


class TensorBoardLogger:
    """Scalars for `tensorboard --logdir <out-dir>`: the same figures as metrics.jsonl."""

    def __init__(self, log_dir: Path, enabled: bool = True):
        self.writer = None
        if enabled:  # under DDP only rank 0 writes
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when used

            self.writer = SummaryWriter(str(log_dir))

    def log(self, record: dict) -> None:
        if self.writer is None:
            return
        step = record["step"]
        scalars = {"train/loss": record.get("loss"), "val/loss": record.get("val_loss"),
                   "val/ppl": record.get("val_ppl"), "train/lr": record.get("lr"),
                   "perf/tokens_per_s": record.get("tokens_per_s"), "perf/mfu": record.get("mfu"),
                   "perf/tokens_per_s_per_rank": record.get("tokens_per_s_per_rank"),
                   "perf/step_time_ms": 1000 * record["step_time_s"] if "step_time_s" in record else None}
        for kind in ("host", "device"):
            for stage, ms in (record.get(f"stage_{kind}_ms") or {}).items():
                scalars[f"stage_{kind}_ms/{stage}"] = ms
        for key, value in (record.get("memory") or {}).items():
            scalars[f"memory/{key}"] = value
        for tag, value in scalars.items():
            if value is not None:
                self.writer.add_scalar(tag, value, step)
        # The measured memory breakdown (bytes, see minigpt/memory.py), in MiB at the measured step.
        breakdown = record.get("memory_breakdown") or {}
        for prefix, figures in (("memory_breakdown", breakdown), ("memory_estimate", breakdown.get("estimate") or {})):
            for key in MEMORY_BREAKDOWN_KEYS:
                if figures.get(key) is not None:
                    self.writer.add_scalar(f"{prefix}/{key}_mib", figures[key] / 2**20, breakdown.get("step", step))
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def __enter__(self) -> "TensorBoardLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
