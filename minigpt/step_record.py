"""metrics.jsonl's record, the file format the trainer writes (minigpt.instruments.metrics) and the report and
minigpt.analysis.compare read: StepRecord's fields are its keys. Standard library only: the analysis tools
import it without torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class StepRecord:
    """One logged step: the one definition of what the console line, metrics.jsonl and TensorBoard
    show. metrics.jsonl holds one of these per line, under these keys (README "Run directory").
    Times are the means over the steps since the previous record, except the run_* keys,
    tokens_per_s_e2e, elapsed_s and startup_s: those are the run so far (RunTotals)."""

    step: int  # training steps done (1-based)
    num_steps: int
    epoch: int  # passes over the training tokens, counting from 1
    loss: float  # mean training loss over the interval's steps
    lr: float  # the learning rate of the last step
    step_time_s: float  # mean host time of one training step: the step alone, not evals or logging
    tokens_per_s: float  # per step: the job's tokens per step / step_time_s (all ranks)
    tokens_per_s_per_rank: float
    # The run so far, cumulative since the loop started: the last record holds the whole run's
    # figures (a resumed run counts from its restart). RunTotals defines them; the last log line,
    # the report and minigpt.analysis.compare read these keys, never recompute them.
    run_tokens: int  # tokens trained (the job's, all ranks)
    run_step_time_s: float  # the sum of every step's host time: the steps alone, no evals, no logging
    run_tokens_per_s: float  # run_tokens / run_step_time_s: the run's rate over the steps alone
    # End to end: run_tokens / elapsed_s, evaluations, logging and checkpoints included (the final
    # checkpoint, saved after the last record, is not). What the job delivers; the ETA follows it.
    tokens_per_s_e2e: float
    # Process start to the loop's start (interpreter, imports, data, model, MFU peak), in no rate
    # above; None where /proc is missing and the trainer gave no import time.
    startup_s: float | None
    world_size: int
    val_loss: float | None  # the latest evaluation (None before the first)
    val_ppl: float | None
    elapsed_s: float  # wall-clock since the loop started: the time end to end is over
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


# The run-wide keys a reader takes from metrics.jsonl's last record; OLDER_RUN stands for one that
# a trainer before them did not write (no figure is rebuilt from other keys: it would differ).
RUN_KEYS = ("run_tokens", "run_step_time_s", "run_tokens_per_s", "tokens_per_s_e2e", "elapsed_s", "startup_s")
OLDER_RUN = "n/a (older run)"


def run_figures(records: list[dict]) -> dict[str, float | None]:
    """The run's figures (RUN_KEYS) as metrics.jsonl's last record holds them; None for a key an
    older trainer did not write: show OLDER_RUN for it."""
    last = records[-1] if records else {}
    return {k: last.get(k) if isinstance(last.get(k), (int, float)) else None for k in RUN_KEYS}


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
