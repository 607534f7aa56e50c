"""A run directory read back into plain data, for the report and the comparison of two runs.

    from minigpt.analysis.runfiles import load_run
    run = load_run(Path("runs/main"))      # RunError (one line) if the folder is not a run
    run.config["model"], run.metrics[-1]["loss"], run.traces[0]["totals"], run.memory[0]["summary"]

Every part but config.json is optional: a run without --use-profiler has no traces, one without
--memory-profiler no memory.log, a single process no stragglers.jsonl. What is missing is an empty
list, and a part that is there but cannot be read is named in `problems` instead of failing the
whole report: a half-written trace of a killed run should not hide its loss curve.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

from minigpt.analysis import traces
from minigpt.analysis.breakdown_log import MEMORY_LOG, parse_memory_log
from minigpt.analysis.html import RunError
from minigpt.analysis.record import RUN_KEYS, StepRecord
from minigpt.config import CONFIG_FILE, MEMORY_TRACE_DIR, METRICS_FILE, STRAGGLERS_FILE, TRACE_DIR
from minigpt.fileio import UnreadableFile, file_kind, format_bytes, read_bounded

# The run directory's names are minigpt/config.py's; the memory folders of every rank match this.
MEMORY_TRACE_GLOB = MEMORY_TRACE_DIR.format(worker="rank*_dp*")
TRACES_DIR = TRACE_DIR
# The most a reader takes of a run's files (no reader takes more memory than its input's checked
# size), far above what a run writes: config.json a few KiB; metrics.jsonl about 1.5 KiB a logged
# step (a million steps logged every 10: 150 MiB); memory.log a few hundred KiB.
CONFIG_LIMIT, JSONL_LIMIT, MEMORY_LOG_LIMIT = 1 << 20, 256 << 20, 64 << 20

# Operators and kernels kept per trace: all of them, so that the comparison of two runs can tell
# an operator that is gone from one that merely fell out of a top-10.
ALL_ROWS = 100_000
_RANK = re.compile(r"rank(\d+)")

MAX_DEPTH = 8  # nesting a run's files never exceed (metrics: a record, its memory_breakdown, ...)
# No figure a run writes comes near this (a petabyte of memory, a quadrillion tokens, 30 million
# years in seconds); a hand-edited 1e308 does, and two of them summed or averaged are inf on a page.
ABSURD = 1e15


def run_figures(records: list[dict]) -> dict:
    """The run's figures (RUN_KEYS, and run_left_out) as metrics.jsonl's last record holds them."""
    last = records[-1] if records else {}
    figures = {k: last.get(k) if isinstance(last.get(k), (int, float)) else None for k in RUN_KEYS}
    figures["run_left_out"] = last.get("run_left_out") if isinstance(last.get("run_left_out"), dict) else {}
    return figures


def _value_problem(value, depth: int = 0) -> str | None:
    """JSON as a run writes it: finite numbers within ABSURD, strings, booleans, null, and lists and
    objects nested at most MAX_DEPTH deep. NaN and Infinity parse (json allows them) but no run
    writes them."""
    if depth > MAX_DEPTH:
        return f"is nested deeper than {MAX_DEPTH} levels"
    if isinstance(value, float) and not math.isfinite(value):
        return f"is {value}, not a finite number"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > ABSURD:
        return f"is {value:.3g}, past any figure a run writes"
    if isinstance(value, dict):
        for k, v in value.items():
            if problem := _value_problem(v, depth + 1):
                return f"{k!r} {problem}" if depth else f"field {k!r} {problem}"
    elif isinstance(value, list):
        for v in value:
            if problem := _value_problem(v, depth + 1):
                return problem
    return None


def _type_problem(value, hint) -> str | None:
    """Whether `value` has the type of a dataclass field's annotation (int, float, str, dict,
    their `| None`): a string where a number belongs is named, not met in an f-string later."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    args = typing.get_args(hint) if union else (hint,)
    if value is None:
        return None if type(None) in args else "is null"
    kinds = [a for a in args if a is not type(None)]
    for kind in kinds:
        origin = typing.get_origin(kind) or kind
        if origin is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return None
        if origin is int and isinstance(value, int) and not isinstance(value, bool):
            return None
        if origin in (str, dict, list) and isinstance(value, origin):
            if origin is dict and typing.get_args(kind)[1:] == (float,):
                bad = [k for k, v in value.items() if not isinstance(v, (int, float)) or isinstance(v, bool)]
                if bad:
                    return f"holds a non-number under {bad[0]!r}"
            return None
    names = " or ".join(getattr(typing.get_origin(k) or k, "__name__", str(k)) for k in kinds)
    return f"holds {type(value).__name__}, expected {names}"


_METRIC_TYPES = typing.get_type_hints(StepRecord)
_METRIC_FIELDS = [f.name for f in fields(StepRecord)]


def metrics_problem(row: dict) -> str | None:
    """What keeps a metrics.jsonl record from being read as a StepRecord, or None. Keys a newer
    trainer adds are let through; the ones StepRecord names must have its types."""
    if "step" not in row:
        return "has no 'step'"
    for name in _METRIC_FIELDS:
        if name in row and (problem := _type_problem(row[name], _METRIC_TYPES[name])):
            return f"field {name!r} {problem}"
    # A count, a time, a rate or bytes: none is negative. A loss is the model's figure, not the
    # machine's, and is left as it is.
    for name in _METRIC_FIELDS:
        if name in ("loss", "val_loss"):
            continue
        value = row.get(name)
        numbers = value.values() if isinstance(value, dict) and name != "memory_breakdown" else [value]
        if any(isinstance(v, (int, float)) and v < 0 for v in numbers):
            return f"field {name!r} is negative"
    return _value_problem(row)


def straggler_problem(row: dict) -> str | None:
    step = row.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return "has no integer 'step'"
    return _value_problem(row)


def _read_text(path: Path, limit: int) -> str:
    return read_bounded(path, limit).decode("utf-8", errors="replace")


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
        return int(self.config.get("world_size") or 1)  # checked by load_run: a positive int

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


def _jsonl(path: Path, problems: list[str], check=metrics_problem) -> list[dict]:
    """The records of a JSON-lines file; a line that is not a well-typed record is named in
    `problems` and skipped (at most a few named, then a count), so one bad line does not hide the rest."""
    if not (path.exists() or path.is_symlink()):
        return []
    try:
        text = _read_text(path, JSONL_LIMIT)
    except UnreadableFile as e:
        problems.append(f"{e}; skipped")
        return []
    rows, skipped = [], 0
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            # A run killed mid-write leaves a cut last line: keep what precedes it.
            problem = "is not JSON (a run stopped mid-write?)"
        else:
            problem = "is not a JSON object" if not isinstance(obj, dict) else check(obj)
        if problem is None:
            rows.append(obj)
            continue
        skipped += 1
        if skipped <= 3:
            problems.append(f"{path.name} line {n} {problem}; skipped")
    if skipped > 3:
        problems.append(f"{path.name}: {skipped - 3} more bad lines skipped")
    return rows


def config_problem(config: dict) -> str | None:
    """The first field of config.json that cannot be what the trainer wrote, as 'field X ...'."""
    expected = {
        "config": dict,
        "model": dict,
        "versions": dict,
        "device": str,
        "device_name": str,
        "amp": str,
        "ddp_backend": (str, type(None)),
        "peak_flops_source": (str, type(None)),
        "peak_flops_dtype": (str, type(None)),
        "params": (int, float),
        "flops_per_token": (int, float),
        "peak_flops": (int, float, type(None)),
    }
    for key, kinds in expected.items():
        if key in config and (
            not isinstance(config[key], kinds) or isinstance(config[key], bool) and kinds is not bool
        ):
            return f"field {key!r} holds {type(config[key]).__name__}"
    ws = config.get("world_size")
    if ws is not None and not (isinstance(ws, int) and not isinstance(ws, bool) and ws >= 1):
        return f"field 'world_size' holds {ws!r}, expected a positive integer"
    for section in ("config", "model"):
        for k, v in config.get(section, {}).items():
            if isinstance(v, (dict, list)) and not (section == "config" and isinstance(v, list)):
                return f"field '{section}.{k}' holds {type(v).__name__}, expected a number, string or null"
    if problem := _value_problem(config):
        return f"field {problem}"
    return None


def load_run(path: Path, with_traces: bool = True) -> Run:
    """Read a run directory. Raises RunError when `path` is not one."""
    path = Path(path)
    if not path.exists():
        raise RunError(f"{path} does not exist")
    if not path.is_dir():
        raise RunError(f"{path} is not a folder; give a run directory (the trainer's --out-dir)")
    config_path = path / CONFIG_FILE
    if not (config_path.exists() or config_path.is_symlink()):
        raise RunError(
            f"{path} is not a run directory: it has no {CONFIG_FILE} "
            "(give the folder a training run wrote, e.g. runs/<date-time>)"
        )
    try:
        config = json.loads(read_bounded(config_path, CONFIG_LIMIT).decode("utf-8"))
    except UnreadableFile as e:
        raise RunError(str(e)) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunError(f"{config_path} cannot be read as JSON ({type(e).__name__}: {e})") from None
    except RecursionError:
        raise RunError(f"{config_path} is nested too deeply to be a run's config") from None
    if not isinstance(config, dict):
        raise RunError(f"{config_path} is not a JSON object")
    if problem := config_problem(config):
        raise RunError(f"{config_path} is not a config the trainer wrote: {problem}")
    if isinstance(config.get("config"), dict):  # the run's identity, not a setting to compare
        config["run_id"] = config["config"].pop("run_id", None)
    run = Run(path=path, config=config)
    run.metrics = _jsonl(path / METRICS_FILE, run.problems)
    run.stragglers = _jsonl(path / STRAGGLERS_FILE, run.problems, check=straggler_problem)
    if with_traces and (path / TRACES_DIR).is_dir():
        try:
            files = traces.trace_files(path / TRACES_DIR)
        except traces.TraceError:
            files = []
        for f in files:
            if problem := _file_problem(f, traces.TRACE_LIMIT):
                run.problems.append(f"{problem}; skipped")
                continue
            try:
                run.traces.append({**traces.summarize(f, top=ALL_ROWS), "rank": rank_of(f)})
            except traces.TraceError as e:
                run.problems.append(str(e))
            except (ValueError, TypeError, KeyError, RecursionError, MemoryError) as e:
                run.problems.append(f"{f} is not a trace the profiler wrote ({type(e).__name__}); skipped")
        run.traces.sort(key=lambda s: s["rank"])
    for folder in sorted(path.glob(MEMORY_TRACE_GLOB), key=rank_of):
        log = folder / MEMORY_LOG
        if not (log.exists() or log.is_symlink()):
            continue
        try:
            states = parse_memory_log(_read_text(log, MEMORY_LOG_LIMIT))
        except UnreadableFile as e:
            run.problems.append(f"{e}; skipped")
            continue
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            run.problems.append(f"{log} is not a memory.log the trainer wrote ({type(e).__name__}); skipped")
            continue
        if not states:
            run.problems.append(f"{log} holds no 'Memory State:' block")
        elif problem := _value_problem(states[-1]):
            run.problems.append(f"{log}: the last state's {problem}; skipped")
        else:
            run.memory.append({**states[-1], "rank": rank_of(folder), "folder": folder})
    return run


def _file_problem(path: Path, limit: int) -> str | None:
    """Why a file must not be handed to a reader (not a regular file, or over `limit`), or None."""
    try:
        st = os.stat(path)
    except OSError as e:
        return f"{path} cannot be read ({e.strerror or type(e).__name__})"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is {file_kind(st.st_mode)}, not a regular file"
    if st.st_size > limit:
        return f"{path} is {format_bytes(st.st_size)}, above the {format_bytes(limit)} this reader takes"
    return None


# ---------------------------------------------------------------------------- trace timeline

STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def timeline_events(path: Path, stages: tuple[str, ...]) -> dict:
    """The raw intervals a timeline draws, in ms from the first profiled step's start:
    {"steps": [(name, start, dur)], "stages": [(name, start, dur)], "kernels": [(name, start, dur)]}.
    Stages are the main process's record_function ranges; kernels are every device event."""
    if problem := _file_problem(path, traces.TRACE_LIMIT):
        raise traces.TraceError(problem)
    data = traces.read_trace_json(path)
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
