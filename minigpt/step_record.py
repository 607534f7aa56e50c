"""metrics.jsonl's record, the file format the trainer writes (minigpt.core.runs) and the report and
minigpt.analysis.compare read: StepRecord's fields are its keys. Standard library only: the analysis tools
import it without torch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepRecord:
    """One logged step: the one definition of what the console line, metrics.jsonl and TensorBoard
    show. metrics.jsonl holds one of these per line, under these keys (docs/reference.md, the run
    directory). Times are the means over the steps since the previous record, except the run_* keys,
    tokens_per_s_e2e, elapsed_s and startup_s: those are the run so far (RunTotals)."""

    step: int  # training steps done (1-based)
    num_steps: int
    epoch: int  # passes over the training tokens, counting from 1
    loss: float  # mean training loss over the interval's steps
    lr: float  # the learning rate of the last step
    # Mean host time of one steady step of the interval (the step alone, not evals or logging): the
    # steps in `left_out` are not in it, nor in any mean below, unless every step of the interval is.
    step_time_s: float
    tokens_per_s: float  # per step: the job's tokens per step / step_time_s (all ranks)
    tokens_per_s_per_rank: float
    # The run so far, cumulative since the loop started: the last record holds the whole run's
    # figures (a resumed run counts from its restart). RunTotals defines them; the last log line,
    # the report and minigpt.analysis.compare read these keys, never recompute them. The run's
    # throughput is its steady state: the steps left out (warm-up, compilation, instrumented steps:
    # run_left_out) are in none of the run_* rates, and are shown as their own figure.
    run_tokens: int  # tokens of the steady steps (the job's, all ranks)
    run_steps: int  # the steady steps
    run_step_time_s: float  # the sum of the steady steps' host times: no evals, no logging
    run_tokens_per_s: float | None  # run_tokens / run_step_time_s; None while no step is steady
    tokens_trained: int  # every step's tokens, the left-out ones' too
    # End to end: tokens_trained / elapsed_s, the left-out steps, evaluations, logging and
    # checkpoints included (the final checkpoint, saved after the last record, is not): what the
    # job delivers.
    tokens_per_s_e2e: float
    # The script's start to the loop's (imports, data, model, MFU peak; from main()'s call where it
    # runs in an interpreter that imported everything before: a notebook), in no rate above.
    startup_s: float | None
    world_size: int
    val_loss: float | None  # the latest evaluation (None before the first)
    val_ppl: float | None
    elapsed_s: float  # wall-clock since the loop started: the time end to end is over
    eta_s: float  # remaining steps at the end-to-end rate of the steps after warm-up
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
    # This interval's steps left out of its means, each {"step", "s" (host seconds), "why" (a
    # minigpt/left_out.py LEFT_OUT key)}; and the run's so far, {why: {"steps": [n, ...], "s": seconds}}.
    left_out: list[dict] = field(default_factory=list)
    steady_steps: int = 0  # the interval's steps in its means (0: all left out, the means are theirs)
    run_left_out: dict[str, dict] = field(default_factory=dict)


def format_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.2f}h"


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
