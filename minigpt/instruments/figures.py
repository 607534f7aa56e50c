"""The figures of a log line, made from the clocks of instrument.py, at the first log line and every
one after: the interval's means over its steady steps, the run's figures so far (its one
definition: the steady steps' tokens over the sum of their times, the left-out steps apart), MFU
computed here and nowhere else, against the peak the run began with, the memory, and the share of
the cores other processes took. The report and compare read them back; they never recompute them."""

from __future__ import annotations

import math
import time

import torch

from minigpt.analysis.record import StepRecord
from minigpt.config import BUSY, STAGE_NAMES, busy_share, cpu_seconds, pad_vocab


class Figures:
    def __init__(self, inst):
        """At the first log line: the peak MFU divides by, said in the log and kept in config.json
        with the FLOPs of a token (PaLM's 6N + 12 L d T, as nanoGPT counts; a tp device's share)."""
        from minigpt.core.shape import Shape
        from minigpt.instruments.peak import device_peak

        self.inst, c, self.rate = inst, inst.cfg, inst.rate
        self.steps, self.seconds, self.busy_steps, self.left_out = 0, 0.0, 0, {}  # the run's, so far
        self.peak = device_peak(c.peak_tflops, inst.device, self.rate["dist"])
        for line in self.peak.describe().split("\n"):
            inst.log.info(line)
        shape = (c.n_layers, c.d_model, c.n_heads, c.d_ff, c.seq_len, c.batch_size)
        shape = Shape(*shape, pad_vocab(self.rate["vocab_size"]), c.max_position_embeddings)
        self.flops = shape.flops_per_token // self.rate["tp"]
        inst.run.keep({**self.peak.config(), "flops_per_token": self.flops})

    def record(self, step, losses, lr, val, interval, host_steps, device_steps) -> StepRecord:
        """`interval`: (step, seconds, why left out) of the steps since the last record; their
        stages' host and device ms, each step's."""
        inst, r, flops, peak = self.inst, self.rate, self.flops, self.peak.value
        # the steady steps' stage times, else every step's; none under --no-stage-timing
        kept = [i for i, x in enumerate(interval) if not x[2] and host_steps] or range(len(host_steps))
        inst.host_steps, inst.device_steps = [host_steps[i] for i in kept], [device_steps[i] for i in kept]
        steady = [t for _, t, why in interval if not why]
        left_out = [{"step": n, "s": t, "why": why} for n, t, why in interval if why]
        busy, inst.cpu_at_start = busy_share(inst.cpu_at_start, now := cpu_seconds()), now
        self.steps, self.seconds = self.steps + len(steady), self.seconds + sum(steady)
        self.busy_steps += len(steady) * (busy is not None and busy > BUSY)
        for x in left_out:
            e = self.left_out.setdefault(x["why"], {"steps": [], "s": 0.0})
            e["steps"], e["s"] = [*e["steps"], x["step"]], e["s"] + x["s"]
        times, tokens, dp = steady or [x["s"] for x in left_out], r["tokens_per_step"], r["dp"]
        step_time, elapsed = sum(times) / len(times), time.perf_counter() - inst.t_start
        # The run so far: the steady steps' tokens over their summed time (a rank's); end to end, every
        # step's tokens over the loop's wall clock; the start-up before the loop, in neither.
        per_rank, run_rate = tokens / step_time, self.steps * tokens / self.seconds if self.steps else None
        trained = (self.steps + sum(len(e["steps"]) for e in self.left_out.values())) * tokens * dp
        steady_s = max(0.0, elapsed - sum(e["s"] for e in self.left_out.values()))  # the loop, less left-out
        host, device = mean(inst.host_steps), mean(inst.device_steps)
        window = inst.window
        comm_step, comm_ms = (window and window.take_comm()) or (None, {})
        if "backward_compute" in host:  # DDP: the backward's wait for its all-reduce
            comm_ms = {"backward": host["backward"] - host["backward_compute"]}
        return StepRecord(
            step=step, num_steps=inst.cfg.num_steps, loss=sum(losses) / len(losses), lr=lr, amp=r["amp"],
            epoch=1 + step * tokens * dp // r["train_tokens"] if r["train_tokens"] else 1,
            val_loss=val, val_ppl=None if val is None else math.exp(min(val, 700.0)),  # no overflow
            step_time_s=step_time, tokens_per_s=dp * per_rank, tokens_per_s_per_rank=per_rank, world_size=dp,
            mfu=flops * per_rank / peak, achieved_tflops=flops * per_rank / 1e12, busy=busy,
            memory=memory_report(inst.device), memory_breakdown=window and window.take_memory_breakdown(),
            stage_host_ms=host, stage_device_ms=device, stage_comm_ms=comm_ms, comm_step=comm_step,
            left_out=left_out, steady_steps=len(steady),
            run_tokens=self.steps * tokens * dp, run_steps=self.steps, run_step_time_s=self.seconds,
            run_tokens_per_s=run_rate and dp * run_rate, run_mfu=run_rate and flops * run_rate / peak,
            run_achieved_tflops=run_rate and flops * run_rate / 1e12, run_left_out=self.left_out_copy(),
            run_busy=self.busy_steps / self.steps if self.steps else None,
            tokens_trained=trained, tokens_per_s_e2e=trained / elapsed,
            elapsed_s=elapsed, eta_s=(inst.cfg.num_steps - step) * steady_s / max(1, self.steps),
            startup_s=inst.started_at and round(time.time() - elapsed - inst.started_at, 2),
        )  # fmt: skip

    def left_out_copy(self) -> dict:
        return {k: dict(e) for k, e in self.left_out.items()}


def mean(steps: list[dict]) -> dict[str, float]:
    """Each stage's mean over the steps: the registry's stages in order, then any other range."""
    names = [k for k in STAGE_NAMES if any(k in s for s in steps)]
    names += sorted({k for s in steps for k in s} - set(names))
    return {k: sum(s.get(k, 0.0) for s in steps) / len(steps) for k in names}


def memory_report(device: str) -> dict:
    """CUDA: the interval's allocated and reserved peaks (reset after), allocator retries and OOMs,
    as torchtitan reports them. CPU: the resident memory and its peak."""
    if device == "cuda":
        stats, peaks = (
            torch.cuda.memory_stats(),
            (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()),
        )
        torch.cuda.reset_peak_memory_stats()
        return {"peak_allocated_gib": peaks[0] / 2**30, "peak_reserved_gib": peaks[1] / 2**30} | {
            "alloc_retries": stats.get("num_alloc_retries", 0),
            "ooms": stats.get("num_ooms", 0),
        }
    return process_memory()


def process_memory() -> dict[str, int]:
    """The resident bytes now and their peak, from one read of /proc/self/status (VmRSS, VmHWM),
    so the peak is never below the resident size; getrusage's peak where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            kb = {
                k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "VmHWM")
            }
        return {"rss_bytes": kb["VmRSS"] * 1024, "rss_peak_bytes": max(kb["VmRSS"], kb["VmHWM"]) * 1024}
    except (OSError, KeyError, ValueError):
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return {"rss_bytes": peak, "rss_peak_bytes": peak}
