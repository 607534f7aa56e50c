"""Why a step is left out of the steady figures, in the words the log's last lines (minigpt.core.finish)
and the report use: StepRecord.left_out and run_left_out hold LEFT_OUT's keys, chosen by the trainer
(minigpt.instruments.instrument.Instruments). Standard library only, loaded after the training: the
report reads it without torch."""

from __future__ import annotations

LEFT_OUT = {
    "warm-up": "the first step: allocations and kernel selection",
    "compilation": "torch.compile compiling, and kernel warm-up",
    "profiler": "the profiler window, with its warm-up step",
    "nsys": "the Nsight Systems capture range (every op an NVTX range)",
    "memory profiler": "--memory-profiler's measured step",
}


def step_list(steps: list[int]) -> str:
    """[1] -> "step 1"; [49, 50, 51, 60] -> "steps 49-51, 60"."""
    runs: list[list[int]] = []
    for n in sorted(steps):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    text = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
    return f"step{'s' if len(steps) > 1 else ''} {text}"


def describe_left_out(run_left_out: dict) -> str:
    """The run's left-out steps in words: "step 1, 18.43s: torch.compile compiling, and kernel
    warm-up; steps 49-51, 0.08s: the profiler window, with its warm-up step"."""
    parts = []
    for why, e in run_left_out.items():
        if isinstance(e, dict) and e.get("steps") and isinstance(e.get("s"), (int, float)):
            parts.append(f"{step_list(e['steps'])}, {e['s']:.2f}s: {LEFT_OUT.get(why, why)}")
    return "; ".join(parts)
