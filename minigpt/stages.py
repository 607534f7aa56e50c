"""The one registry of a training step's stages: their names, short labels, colours, and whether
straggler scoring counts them. Everything that names a stage imports it from here: the loop's
`with stage(...)` blocks, the log line, metrics.jsonl, TensorBoard, straggler scores, the trace
summary (through a test that holds its standard-library copy to this list), the benchmarks and
the charts. Adding a stage is one line in STAGES and one `with stage("name"):` in the loop.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    name: str  # the record_function / NVTX range name, and the key in metrics.jsonl
    label: str  # short name in the log line
    color: str  # NVTX colour (Nsight Systems) and chart colour
    # Counted in straggler scores: the stage's time is the rank's own work, with no collective
    # inside it to wait on (the backward holds DDP's all-reduce: its compute part is scored).
    scored: bool = True
    part_of: str | None = None  # a split (SPLITS): the stage it is timed inside


STAGES: tuple[Stage, ...] = (
    Stage("data_to_device", "h2d", "gold"),
    Stage("forward", "fwd", "green"),
    Stage("backward", "bwd", "red", scored=False),
    Stage("optimizer_step", "opt", "blue"),
)

# Parts of a stage timed inside it (StageTimer.add_split): under data parallelism, the backward's
# own compute, up to the moment its last gradient bucket is ready, without the wait for the
# all-reduce. Scored for stragglers in place of the whole backward.
SPLITS: tuple[Stage, ...] = (Stage("backward_compute", "(bwd compute)", "salmon", part_of="backward"),)

STEP_RANGE = Stage("train_step", "step", "white", scored=False)  # the range around one whole step

STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)
# Name -> short label (the log line) and colour (NVTX, charts), looked up in the step's hot path.
LABELS: dict[str, str] = {s.name: s.label for s in (*STAGES, *SPLITS, STEP_RANGE)}
COLORS: dict[str, str] = {s.name: s.color for s in (*STAGES, *SPLITS, STEP_RANGE)}


def stage(name: str) -> Stage:
    """The registry's entry for `name`; an unknown name (a range a user added without registering
    it) gets a neutral entry so nothing downstream drops or fails on it."""
    for s in (*STAGES, *SPLITS, STEP_RANGE):
        if s.name == name:
            return s
    return Stage(name, name, "grey")


def label(name: str) -> str:
    return stage(name).label


def color(name: str) -> str:
    return stage(name).color


def split_parent(name: str) -> str | None:
    """The stage a split is part of (backward_compute -> backward)."""
    return stage(name).part_of
