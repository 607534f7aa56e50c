"""metrics.jsonl's record: what the trainer writes at every log line (minigpt/instruments/figures.py
makes it, minigpt/core/outputs.py writes it) and the tools read back, the words for the steps left
out of the steady figures, and how a duration reads. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepRecord:
    """A logged step: its log lines, a line of metrics.jsonl, TensorBoard's scalars. Means over the
    interval's steady steps, but the run_* keys, tokens_trained, tokens_per_s_e2e, elapsed_s and
    startup_s: the run so far (docs/reference.md, "metrics.jsonl", says what each key holds)."""

    step: int
    num_steps: int
    epoch: int
    loss: float
    lr: float
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_rank: float
    run_tokens: int
    run_steps: int
    run_step_time_s: float
    run_tokens_per_s: float | None
    tokens_trained: int
    tokens_per_s_e2e: float
    startup_s: float | None
    world_size: int
    val_loss: float | None
    val_ppl: float | None
    elapsed_s: float
    eta_s: float
    amp: str
    mfu: float
    achieved_tflops: float
    stage_host_ms: dict[str, float] = field(default_factory=dict)
    stage_device_ms: dict[str, float] = field(default_factory=dict)
    stage_comm_ms: dict[str, float] = field(default_factory=dict)
    comm_step: int | None = None
    memory: dict = field(default_factory=dict)
    memory_breakdown: dict | None = None
    left_out: list = field(default_factory=list)
    steady_steps: int = 0
    run_left_out: dict = field(default_factory=dict)
    busy: float | None = None  # the share of the cores other processes took in the interval
    run_busy: float | None = None  # the share of the run's steady steps that ran busy
    run_mfu: float | None = None  # MFU over the run's steady steps, against config.json's peak
    run_achieved_tflops: float | None = None


# The run-wide keys a reader takes from metrics.jsonl's last record (the trainer's RunTotals).
RUN_KEYS = ("run_tokens", "run_steps", "run_step_time_s", "run_tokens_per_s", "tokens_trained")
RUN_KEYS += ("tokens_per_s_e2e", "elapsed_s", "startup_s", "run_busy", "run_mfu", "run_achieved_tflops")
# Why a step is left out of the steady figures (StepRecord.left_out's "why"), in words.
LEFT_OUT = {
    "warm-up": "the first step: allocations and kernel selection",
    "compilation": "torch.compile compiling, and kernel warm-up",
    "profiler": "the profiler window, with its warm-up step",
    "nsys": "the Nsight Systems capture range (every op an NVTX range)",
    "memory profiler": "--memory-profiler's measured step",
}


# A list of steps (torch.compile's recompilations) longer than this many runs is counted, not listed.
STEP_RUNS_SHOWN = 8


def step_list(steps: list[int]) -> str:
    """[1] -> "step 1"; [49, 50, 51, 60] -> "steps 49-51, 60"; past STEP_RUNS_SHOWN runs of steps,
    the rest counted ("and 12 more"), so that the line stays one a terminal holds."""
    runs: list[list[int]] = []
    for n in sorted(steps):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    text = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs[:STEP_RUNS_SHOWN])
    if rest := sum(len(r) for r in runs[STEP_RUNS_SHOWN:]):
        text += f" and {rest} more"
    return f"step{'s' if len(steps) > 1 else ''} {text}"


LINE = 160  # the longest line the log prints after its timestamp: one a terminal holds


def fit(text: str, width: int = LINE, sep: str = " | ", indent: str = "    ") -> list[str]:
    """A log line of `sep`-separated parts as lines of at most `width` characters: the parts in
    order, a line broken only between two of them, each continuation indented."""
    if len(text) <= width:
        return [text]
    lines: list[str] = []
    for part in text.split(sep):
        if lines and len(lines[-1]) + len(sep) + len(part) <= width:
            lines[-1] += sep + part
        else:
            lines.append(indent + part if lines else part)
    return lines


def group_left_out(left_out: list[dict]) -> dict[str, str]:
    """An interval's left-out steps (StepRecord.left_out) by reason, each reason once, in order:
    {"profiler": "steps 4-6 0.03s"}, so that a profiler window is one phrase of the log line."""
    if len({x["why"] for x in left_out}) == len(left_out):  # each reason once (the usual): as they are
        return {x["why"]: f"step {x['step']} {x['s']:.2f}s" for x in left_out}
    groups: dict[str, list[dict]] = {}
    for x in left_out:
        groups.setdefault(x["why"], []).append(x)
    return {
        why: f"{step_list([x['step'] for x in xs])} {sum(x['s'] for x in xs):.2f}s"
        for why, xs in groups.items()
    }


def left_out_parts(run_left_out: dict) -> list[str]:
    """Each reason a step was left out of the steady figures, one phrase each:
    "step 1, 18.43s: torch.compile compiling, and kernel warm-up"."""
    parts = []
    for why, e in run_left_out.items():
        if isinstance(e, dict) and e.get("steps") and isinstance(e.get("s"), (int, float)):
            parts.append(f"{step_list(e['steps'])}, {e['s']:.2f}s: {LEFT_OUT.get(why, why)}")
    return parts


def describe_left_out(run_left_out: dict) -> str:
    """ "step 1, 18.43s: torch.compile compiling, and kernel warm-up; steps 5-6, 0.08s: ..." """
    return "; ".join(left_out_parts(run_left_out))


def format_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    return f"{seconds / 60:.1f}m" if seconds < 3600 else f"{seconds / 3600:.2f}h"
