"""A run directory read back into plain data, for the report and the comparison of two runs.

    from minigpt.runfiles import load_run
    run = load_run(Path("runs/main"))      # RunError (one line) if the folder is not a run
    run.config["model"], run.metrics[-1]["loss"], run.traces[0]["totals"], run.memory[0]["summary"]

Every part but config.json is optional: a run without --use-profiler has no traces, one without
--memory-profiler no memory.log, a single process no stragglers.jsonl. What is missing is an empty
list, and a part that is there but cannot be read is named in `problems` instead of failing the
whole report: a half-written trace of a killed run should not hide its loss curve.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from minigpt import traces
from minigpt.memory import MEMORY_LOG, parse_memory_log
from minigpt.paths import CONFIG_FILE, MEMORY_TRACE_DIR, METRICS_FILE, STRAGGLERS_FILE, TRACE_DIR

# The run directory's names are minigpt/paths.py's; the memory folders of every rank match this.
MEMORY_TRACE_GLOB = MEMORY_TRACE_DIR.format(worker="rank*_dp*")
TRACES_DIR = TRACE_DIR

# Operators and kernels kept per trace: all of them, so that the comparison of two runs can tell
# an operator that is gone from one that merely fell out of a top-10.
ALL_ROWS = 100_000
_RANK = re.compile(r"rank(\d+)")


class RunError(Exception):
    """The folder is not a run directory: the message is the one line the user sees."""


@dataclass
class Run:
    path: Path
    config: dict
    metrics: list[dict] = field(default_factory=list)  # metrics.jsonl, one dict per logged step
    stragglers: list[dict] = field(default_factory=list)  # stragglers.jsonl (DDP)
    traces: list[dict] = field(default_factory=list)  # traces.summarize() of each file, + "rank"
    memory: list[dict] = field(default_factory=list)  # parse_memory_log()'s last state, + "rank", "folder"
    problems: list[str] = field(default_factory=list)  # parts present but unreadable, one line each

    @property
    def name(self) -> str:
        return self.path.name or str(self.path)

    @property
    def world_size(self) -> int:
        return int(self.config.get("world_size") or 1)

    def breakdown(self) -> dict | None:
        """The measured memory breakdown (metrics.jsonl's memory_breakdown), if a step was measured."""
        for m in self.metrics:
            if isinstance(m.get("memory_breakdown"), dict):
                return m["memory_breakdown"]
        return None


def rank_of(path: Path) -> int:
    """The rank in a worker name such as rank1_dp1.123.pt.trace.json.gz (0 when there is none)."""
    m = _RANK.search(path.name)
    return int(m.group(1)) if m else 0


def _jsonl(path: Path, problems: list[str]) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            # A run killed mid-write leaves a cut last line: keep what precedes it.
            problems.append(f"{path.name} line {n} is not JSON (a run stopped mid-write?); skipped")
            continue
        if isinstance(obj, dict):
            rows.append(obj)
    return rows


def summarize_trace(path: Path) -> dict:
    """traces.summarize() with every operator and kernel kept (when the API takes `top`)."""
    try:
        return traces.summarize(path, top=ALL_ROWS)
    except TypeError:  # a summarize() without the keyword
        return traces.summarize(path)


def load_run(path: Path, with_traces: bool = True) -> Run:
    """Read a run directory. Raises RunError when `path` is not one."""
    path = Path(path)
    if not path.exists():
        raise RunError(f"{path} does not exist")
    if not path.is_dir():
        raise RunError(f"{path} is not a folder; give a run directory (the trainer's --out-dir)")
    config_path = path / CONFIG_FILE
    if not config_path.exists():
        raise RunError(
            f"{path} is not a run directory: it has no {CONFIG_FILE} "
            "(give the folder a training run wrote, e.g. runs/<date-time>)"
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunError(f"{config_path} cannot be read as JSON ({type(e).__name__}: {e})") from None
    if not isinstance(config, dict):
        raise RunError(f"{config_path} is not a JSON object")
    run = Run(path=path, config=config)
    run.metrics = _jsonl(path / METRICS_FILE, run.problems)
    run.stragglers = _jsonl(path / STRAGGLERS_FILE, run.problems)
    if with_traces and (path / TRACES_DIR).is_dir():
        try:
            files = traces.trace_files(path / TRACES_DIR)
        except traces.TraceError:
            files = []
        for f in files:
            try:
                run.traces.append({**summarize_trace(f), "rank": rank_of(f)})
            except traces.TraceError as e:
                run.problems.append(str(e))
        run.traces.sort(key=lambda s: s["rank"])
    for folder in sorted(path.glob(MEMORY_TRACE_GLOB), key=rank_of):
        log = folder / MEMORY_LOG
        if not log.exists():
            continue
        states = parse_memory_log(log.read_text(encoding="utf-8", errors="replace"))
        if states:
            run.memory.append({**states[-1], "rank": rank_of(folder), "folder": folder})
        else:
            run.problems.append(f"{log} holds no 'Memory State:' block")
    return run


# ---------------------------------------------------------------------------- trace timeline

STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def timeline_events(path: Path, stages: tuple[str, ...]) -> dict:
    """The raw intervals a timeline draws, in ms from the first profiled step's start:
    {"steps": [(name, start, dur)], "stages": [(name, start, dur)], "kernels": [(name, start, dur)]}.
    Stages are the main process's record_function ranges; kernels are every device event."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, EOFError) as e:
        raise traces.TraceError(f"{path} is not a JSON trace ({type(e).__name__}: {e})") from None
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    xs = [
        e
        for e in events
        if isinstance(e, dict)
        and e.get("ph") == "X"
        and isinstance(e.get("ts"), (int, float))
        and isinstance(e.get("dur"), (int, float))
    ]
    steps = sorted(
        (e for e in xs if e.get("cat") == "user_annotation" and STEP_RE.match(str(e.get("name")))),
        key=lambda e: e["ts"],
    )
    if not steps:
        return {"steps": [], "stages": [], "kernels": []}
    t0 = steps[0]["ts"]
    lo, hi = t0, max(e["ts"] + e["dur"] for e in steps)

    def rows(sel) -> list[tuple[str, float, float]]:
        return sorted(
            ((str(e.get("name")), (e["ts"] - t0) / 1000, e["dur"] / 1000) for e in sel), key=lambda r: r[1]
        )

    return {
        "steps": rows(steps),
        "stages": rows(
            e
            for e in xs
            if e.get("cat") == "user_annotation" and e.get("name") in stages and lo <= e["ts"] <= hi
        ),
        # Kernels of the window, and a little after it: a step's last kernels finish after its range.
        "kernels": rows(
            e for e in xs if e.get("cat") in DEVICE_CATS and lo <= e["ts"] <= hi + 0.1 * (hi - lo)
        ),
    }
