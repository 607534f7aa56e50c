"""What a log line does, loaded at the first: the losses' check, and the record's places: its two
lines in the log, a line of metrics.jsonl and TensorBoard's scalars (rank 0 writes the files)."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict

import torch

from minigpt import config
from minigpt.analysis.record import LINE, StepRecord, fit, group_left_out
from minigpt.config import open_run_file
from minigpt.errors import NonFiniteLoss

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
    "busy": ("perf/busy_percent", 100),  # the cores other processes took
}


def label(stage: str) -> str:
    """A stage's short name in the log line (h2d, fwd...); a part of a stage's in brackets."""
    if stage in config.SPLITS:
        return f"({config.STAGES[config.SPLITS[stage]][0]} compute)"
    return config.STAGES.get(stage, (stage,))[0]


def check_finite(run, losses: list, step: int, amp: str) -> list[float]:
    """The interval's losses (this syncs); a non-finite one stops every rank together (each sees
    only its own loss), the last good checkpoint kept."""
    values = torch.stack(losses).tolist() if losses else []
    bad = next((i for i, v in enumerate(values) if not abs(v) < float("inf")), None)
    if run.dist_info.enabled:
        from minigpt.core.distributed import check_peers_finite

        check_peers_finite(bad is not None, step, run.dist_info, run.checkpoint)
    if bad is not None:
        from minigpt.core.guards import describe_intact

        kept = describe_intact(run.checkpoint)
        hint = " or use --amp-dtype bf16 (fp16's range is narrow)" if amp == "fp16" else ""
        raise NonFiniteLoss(
            f"loss is {values[bad]} at step {step - len(values) + bad + 1}; {kept}; lower --lr{hint}"
        )
    return values


def quiet_writer_thread() -> None:
    """TensorBoard's writer thread keeps its error (a full disk) for the main thread's next write,
    which ends the run with it in one line, then re-raises it: Python's thread hook would print the
    thread's traceback too. That thread's are left unprinted; any other thread's print as before."""
    previous = threading.excepthook
    if getattr(previous, "minigpt", False):
        return

    def hook(args) -> None:
        if type(args.thread).__name__ != "_AsyncWriterThread":
            previous(args)

    hook.minigpt = True
    threading.excepthook = hook


class Outputs:
    def __init__(self, run):
        self.log, self.metrics, self.tensorboard = run.log, None, None
        if run.dist_info.is_main:  # under torchrun, rank 0
            from torch.utils.tensorboard import SummaryWriter

            quiet_writer_thread()

            self.metrics = open(open_run_file(run.path / config.METRICS_FILE, os.O_WRONLY | os.O_APPEND), "a")
            # purge_step: the first step (re)trained; what an earlier run wrote from there is hidden
            self.tensorboard = SummaryWriter(
                str(run.path / config.TENSORBOARD_DIR), purge_step=run.resumed_at + 1
            )

    def write(self, r: StepRecord) -> None:
        for line in log_lines(r):
            self.log.info(line)
        if self.metrics:  # a line without the breakdown, unless a step measured it
            record = {k: v for k, v in asdict(r).items() if v is not None or k != "memory_breakdown"}
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
            try:
                for tag, value in tensorboard_scalars(r):
                    self.tensorboard.add_scalar(tag, value, r.step)
                self.tensorboard.flush()
            except OSError as e:  # met by TensorBoard's writer thread, raised here: name its folder
                e.filename = e.filename or self.tensorboard.log_dir
                raise

    def close(self) -> None:
        for f in (self.metrics, self.tensorboard):
            try:
                if f:
                    f.close()
            except OSError:  # a full disk: said by the write that met it
                pass


def log_lines(m: StepRecord) -> list[str]:
    """The step's line, read at a glance (losses, step time, tokens/s, MFU, memory, a busy machine),
    then its stages: one number each where host and device share a clock (the CPU), host/device on
    a GPU, where the host runs ahead and waits later; then what was left out and why."""
    val = f" | val {m.val_loss:.4f}" if m.val_loss is not None else ""
    steady = "" if m.steady_steps else f" ({', '.join(group_left_out(m.left_out))}, not steady)"
    gib = m.memory.get("peak_allocated_gib", m.memory.get("rss_bytes", 0) / 2**30)  # CUDA's, or the CPU's RSS
    memory = f"{'mem' if 'peak_allocated_gib' in m.memory else 'rss'} {gib:.2f} GiB"
    if "peak_reserved_gib" in m.memory:  # what the caching allocator holds beyond it: fragmentation
        memory += f" (reserved {m.memory['peak_reserved_gib']:.2f})"
    busy = f" | busy: others took {m.busy:.0%} of the cores" if m.busy is not None and m.busy > 0.25 else ""
    line = f"step {m.step}/{m.num_steps} | loss {m.loss:.4f}{val} | {1000 * m.step_time_s:.0f} ms/step"
    line += f"{steady} | {m.tokens_per_s:,.0f} tok/s | mfu {100 * m.mfu:.1f}% | {memory}{busy}"
    host, device = m.stage_host_ms, m.stage_device_ms
    both = host != device  # a GPU's two clocks (the host runs ahead); a CPU's one
    times = [f"{label(k)} {v:.1f}" + f"/{device.get(k, 0):.1f}" * both for k, v in host.items()]
    stages = f"  stage ms{' host/device' * both}: {' '.join(times)}" if host else "  stages not timed"
    if m.stage_comm_ms:
        comm = " ".join(f"{label(k)} {v:.1f}" for k, v in m.stage_comm_ms.items())
        stages += f" | in collectives{f' (step {m.comm_step})' if m.comm_step else ''}: {comm}"
    stages += "".join(f" | left out: {steps} ({why})" for why, steps in group_left_out(m.left_out).items())
    if peak := (m.memory_breakdown or {}).get("peak"):
        stages += f" | allocator peak {peak / 2**20:,.1f} MiB in step {m.memory_breakdown['step']}"
    return [line, stages] if max(len(line), len(stages)) <= LINE else [*fit(line), *fit(stages)]


def tensorboard_scalars(r: StepRecord):
    """(tag, value) for each figure, in the unit a chart reads (TB_SCALARS; ms, MiB)."""
    for key, (tag, scale) in TB_SCALARS.items():
        if (value := getattr(r, key)) is not None:
            yield tag, value * scale
    for kind in ("host", "device", "comm"):
        yield from ((f"stage_{kind}_ms/{stage}", ms) for stage, ms in getattr(r, f"stage_{kind}_ms").items())
    for key, value in r.memory.items():  # bytes in MiB
        yield f"memory/{key.replace('_bytes', '_mib')}", value / 2**20 if key.endswith("_bytes") else value
    for prefix, figures in (
        ("memory_breakdown", r.memory_breakdown),
        ("memory_estimate", (r.memory_breakdown or {}).get("estimate")),
    ):
        for key, value in (figures or {}).items():
            if isinstance(value, (int, float)) and key != "step":
                yield f"{prefix}/{key}_mib", value / 2**20
