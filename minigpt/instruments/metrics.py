"""What a run reports, and the figures behind it: throughput in steady state and end to end, MFU,
memory, the log lines (console and train.log), metrics.jsonl and TensorBoard scalars. Knows
nothing of GPT: figures come in as numbers and the instruments' stage times.

MFU is the model's training FLOPs per second over one denominator per device, the peak of its
fastest dtype (bf16 where the hardware has it natively, as nanoGPT and torchtitan count), so it
ranks runs as tokens/s does, whatever dtype each trains in. The peak comes from, in order:
--peak-tflops; a known GPU's data sheet (PEAK_FLOPS); this CPU's measured peak, read from the cache
that minigpt/instruments/mfu.py writes when it measures (once per machine, loaded only then)."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from minigpt.fileio import DiskFull, disk_full_message, is_disk_full
from minigpt.stages import LABELS
from minigpt.step_record import MEMORY_BREAKDOWN_KEYS, StepRecord, describe_left_out

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Dense peak FLOP/s per GPU from the vendors' data sheets (no 2:4 sparsity), by dtype. fp32 means
# plain fp32 (TF32 off, PyTorch's default for matmuls). MFU divides by the fastest (DEVICE_DTYPE).
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
    """The MFU denominator of one device: FLOP/s, where it comes from, the dtype it is the peak
    of, and for a measured one its winning unit's median and best call, when, and under what load."""

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
        if self.others is not None:
            line += (
                f"\nMFU peak measured under load: other processes used {100 * self.others:.0f}% of the "
                "cores while it was timed, so it may be low and MFU high; it is measured again at the "
                "next start that finds the machine quieter (or now: python -m minigpt estimate --time "
                "--remeasure)"
            )
        return line

    def raise_to(self, achieved: float) -> str | None:
        """A rate the run has `achieved` (FLOP/s per device) above a measured peak proves the peak
        low (taken under load): lift it, here and in the cache, so MFU never passes 100%; the line
        saying so the first time. A --peak-tflops figure and a data sheet are not touched."""
        if achieved <= self.value or not self.source.startswith(("measured", "cache", ACHIEVED)):
            return None
        from minigpt.instruments.mfu import keep_achieved  # the cache's writer

        first = not self.source.startswith(ACHIEVED)
        note = (
            f"MFU peak {self.value / 1e12:.3g} TFLOP/s was below what this run achieved "
            f"({achieved / 1e12:.3g} TFLOP/s): it was measured under load; the peak is now the best "
            f"rate the run achieves, {keep_achieved(self.device, self.dtype, achieved)}"
        )
        if first:
            self.source = f"{ACHIEVED} (the measured peak was lower); was: {self.source}"
        self.value = achieved
        return note if first else None


def fastest_dtype(device: str) -> str:
    """The dtype of the device's peak: bf16 on a GPU (fp16 on one without bf16) and on a CPU with
    native bf16 (AVX512-BF16, AMX); fp32 on other CPUs."""
    from minigpt.core.config import cpu_bf16_features

    if device == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if any(cpu_bf16_features().values()) else "fp32"


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
    """The machine's peak from the cache: the best of its square units and any rate a run achieved,
    each a finite positive figure timed on a quiet machine. None where a square unit is missing,
    or one is damaged or was measured under load: mfu.py measures them then."""
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
    """A cached unit whose best and median FLOP/s are numbers between a MFLOP/s and an exaFLOP/s (a
    hand-edited 1e-300, NaN or "fast" is none), and whose load share, if any, is a number."""
    figures = [u.get("best"), u.get("median"), u.get("others") or 0.0] if isinstance(u, dict) else [None]
    if not all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in figures):
        return False
    return 1e6 < figures[1] <= figures[0] < 1e18


def device_peak(override_tflops: float | None, device: str, info=None) -> PeakFlops:
    """The MFU denominator: --peak-tflops, a known GPU's data sheet, or this CPU's cached peak
    (measured once, by minigpt/instruments/mfu.py, when the cache has none). Under torchrun
    (`info`, a DistInfo), rank 0 measures alone and the others read its cache: measured together
    they would share the cores and cache a low figure."""
    dtype = fastest_dtype(device)
    if override_tflops is not None:
        return PeakFlops(override_tflops * 1e12, "override: --peak-tflops", device=device, dtype=dtype)
    if device == "cuda" and (from_table := table_peak(device, dtype)):
        return PeakFlops(*from_table, device=device, dtype=dtype)
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


def table_peak(device: str, dtype: str) -> tuple[float, str] | None:
    """A known GPU's data-sheet peak in `dtype`, and its source; None for another device."""
    import re

    name = torch.cuda.get_device_name()
    # Whole words, longest names first: "H100 PCIe" before "H100"; "L4" is not "L40S", "A10" not "A10G".
    for gpu in sorted(PEAK_FLOPS, key=len, reverse=True):
        if re.search(rf"\b{re.escape(gpu)}\b", name) and dtype in PEAK_FLOPS[gpu]:
            return PEAK_FLOPS[gpu][dtype], f"table: {gpu} {dtype} dense"
    return None


def mfu(flops_per_token: float, tokens_per_s_per_device: float, peak: float | PeakFlops) -> float:
    """Model FLOPs utilisation: the training FLOPs the model needs per second over the peak.
    Tokens/s is per device, so under DDP pass the job's figure divided by the world size, and
    count every micro-batch of gradient accumulation in the tokens."""
    value = peak.value if isinstance(peak, PeakFlops) else peak
    return achieved_tflops(flops_per_token, tokens_per_s_per_device) * 1e12 / value


def achieved_tflops(flops_per_token: float, tokens_per_s_per_device: float) -> float:
    """The model's training TFLOP/s per device: needs no denominator, so it is as steady as tokens/s."""
    return flops_per_token * tokens_per_s_per_device / 1e12


def process_memory() -> dict[str, int]:
    """The process as the operating system sees it: resident memory now and its peak since the
    start, both from one read of /proc/self/status (VmRSS, VmHWM), where the kernel takes the peak
    as the larger of its high-water mark and the resident size at that moment: so rss <= peak on
    every record. (getrusage's ru_maxrss beside statm's resident size was read at two moments from
    a high-water mark the kernel updates lazily, and fell below the resident size on 33 of 80 log
    lines.) Elsewhere (not Linux) getrusage alone. Above the allocator's own figures sits what the
    allocator caches and retains (minigpt/core/cpu.py), the interpreter, the libraries' code and
    the data on the host."""
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
        """The remaining steps at the end-to-end pace of the steps after warm-up (their time is the
        loop's so far, less the left-out steps'), or of the left-out ones while there are no others."""
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

    def finished(self, last: StepRecord, step: int) -> str:
        """The run's last line, from its last record: the steps since the start or the resume, and
        the steady step against the predicted one (predicted_ms, config.json's) where there is one."""
        share = None
        if self.predicted_ms and last.run_steps:
            steady_ms = 1000 * last.run_step_time_s / last.run_steps
            share = (
                f"a steady step of {steady_ms:.1f} ms, {steady_ms / self.predicted_ms:.0%} of the "
                f"predicted {self.predicted_ms:.1f}"
            )
        return format_finished(last, step - self.start_step, self.start_step, share)

    def record(
        self, step: int, losses: list[float], lr: float, val: float | None, interval, comm=None
    ) -> StepRecord:
        """The interval's record. `interval`: Instruments.interval()'s steady step times, their
        StageTimes and the steps left out (minigpt/instruments/instrument.py); `comm`: under FSDP/TP,
        (the profiled step, its ms in collectives per stage); under DDP the backward's wait for the
        all-reduce is split off instead."""
        step_times, stages = interval.step_times, interval.stages
        step_time = sum(step_times) / len(step_times)
        per_rank = self.tokens_per_step / step_time
        # An achieved rate above the denominator proves the denominator wrong: said once, corrected.
        if note := self.peak.raise_to(achieved_tflops(self.flops_per_token, per_rank) * 1e12):
            logging.getLogger("minigpt").warning(note)
        self.totals.add(interval.steady, interval.left_out)
        run = self.totals.figures()  # run_tokens, run_tokens_per_s, tokens_per_s_e2e, elapsed_s, ...
        comm_step, comm_ms = comm or (None, {})
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
            mfu=mfu(self.flops_per_token, per_rank, self.peak.value),
            achieved_tflops=achieved_tflops(self.flops_per_token, per_rank),
            stage_host_ms=stages.host_ms,
            stage_device_ms=stages.device_ms,
            stage_comm_ms=comm_ms,
            comm_step=comm_step,
            memory=cuda_memory_report() if self.device == "cuda" else process_memory(),
            left_out=interval.left_out,
            steady_steps=len(interval.steady),
        )


# ---------------------------------------------------------------------------- the log's lines


def format_log_line(m: StepRecord) -> str:
    """The step's line, read at a glance: step, losses, step time, tokens/s, MFU, memory. The
    stage times follow on a line of their own (format_stages); the rest is in metrics.jsonl."""
    val = f" | val {m.val_loss:.4f}" if m.val_loss is not None else ""
    # A step time of left-out steps only (the interval's every step was: warm-up) is theirs, and says so.
    steady = "" if m.steady_steps else f" ({', '.join(x['why'] for x in m.left_out)}, not steady)"
    rate = f"{m.tokens_per_s:,.0f} tok/s" + (f" ({m.world_size} ranks)" if m.world_size > 1 else "")
    mfu_text = f" | mfu {100 * m.mfu:.1f}%" if m.mfu is not None else ""
    mem = m.memory
    if "peak_allocated_gib" in mem:
        memory = f"mem {mem['peak_allocated_gib']:.2f} GiB (reserved {mem['peak_reserved_gib']:.2f})"
    else:  # what the machine sees: the tensors and malloc's cache, the interpreter, the libraries
        memory = f"rss {mem.get('rss_bytes', 0) / 2**30:.2f} GiB"
    return (
        f"step {m.step}/{m.num_steps} | loss {m.loss:.4f}{val} | "
        f"{1000 * m.step_time_s:.0f} ms/step{steady} | {rate}{mfu_text} | {memory}"
    )


def format_stages(m: StepRecord) -> str:
    """The stages' mean times: one number each where host and device share a clock (the CPU), host/
    device on a GPU, where the host runs ahead and waits later; then what was left out and why."""
    host, device = m.stage_host_ms, m.stage_device_ms
    same = host == device
    times = " ".join(
        f"{LABELS.get(k, k)} {v:.1f}"
        if same
        else f"{LABELS.get(k, k)} {v:.1f}/{device.get(k, float('nan')):.1f}"
        for k, v in host.items()
    )
    line = f"  stage ms{'' if same else ' host/device'}: {times}" if host else "  stages not timed"
    if m.stage_comm_ms:
        comm = " ".join(f"{LABELS.get(k, k)} {v:.1f}" for k, v in m.stage_comm_ms.items())
        line += f" | in collectives{f' (step {m.comm_step})' if m.comm_step else ''}: {comm}"
    for x in m.left_out:
        line += f" | left out: step {x['step']} {x['s']:.2f}s ({x['why']})"
    peak = (m.memory_breakdown or {}).get("peak")
    if peak:
        line += f" | allocator peak {peak / 2**20:,.1f} MiB in step {m.memory_breakdown['step']}"
    return line


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


# ---------------------------------------------------------------------------- the record's places


class Outputs:
    """Where a logged step goes: its two lines in the log, a line of metrics.jsonl, TensorBoard's
    scalars (rank 0 writes the files). A context manager: the files close on any exit."""

    def __init__(self, out_dir: Path, log: logging.Logger, enabled: bool, purge_step: int):
        from minigpt import paths

        self.log = log
        self.metrics = JsonlWriter(out_dir / paths.METRICS_FILE, enabled=enabled)
        self.tensorboard = TensorBoardLogger(
            out_dir / paths.TENSORBOARD_DIR, enabled=enabled, purge_step=purge_step
        )

    def write(self, record: StepRecord) -> None:
        self.log.info(format_log_line(record))
        self.log.info(format_stages(record))
        self.metrics.write(record)
        self.tensorboard.log(record)

    def __enter__(self) -> Outputs:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.metrics.__exit__(*exc)
        finally:
            self.tensorboard.__exit__(*exc)


# ---------------------------------------------------------------------------- metrics.jsonl


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
            if isinstance(record, StepRecord):
                record = {k: v for k, v in asdict(record).items() if v is not None or k != "memory_breakdown"}
            line = json.dumps(record) + "\n"
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


# StepRecord's figures as TensorBoard charts them: the tag, and the factor to the chart's unit.
TB_SCALARS = {
    "loss": ("train/loss", 1),
    "val_loss": ("val/loss", 1),
    "val_ppl": ("val/ppl", 1),
    "lr": ("train/lr", 1),
    "tokens_per_s": ("perf/tokens_per_s", 1),
    "tokens_per_s_e2e": ("perf/tokens_per_s_e2e", 1),
    "run_tokens_per_s": ("perf/run_tokens_per_s", 1),  # the run so far, in steady state
    "tokens_per_s_per_rank": ("perf/tokens_per_s_per_rank", 1),
    "mfu": ("perf/mfu_percent", 100),
    "achieved_tflops": ("perf/achieved_tflops", 1),
    "step_time_s": ("perf/step_time_ms", 1000),
}


class TensorBoardLogger:
    """Scalars for `tensorboard --logdir <out-dir>`: the figures of metrics.jsonl, in the units a
    chart reads (MFU in percent, memory in MiB)."""

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
        for key, (tag, scale) in TB_SCALARS.items():
            if (value := getattr(r, key)) is not None:
                self.writer.add_scalar(tag, value * scale, r.step)
        for kind in ("host", "device", "comm"):
            for stage, ms in getattr(r, f"stage_{kind}_ms").items():
                self.writer.add_scalar(f"stage_{kind}_ms/{stage}", ms, r.step)
        for key, value in r.memory.items():  # bytes in MiB
            mib = key.endswith("_bytes")
            self.writer.add_scalar(
                f"memory/{key.replace('_bytes', '_mib')}", value / 2**20 if mib else value, r.step
            )
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
