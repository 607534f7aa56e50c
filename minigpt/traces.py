"""Read a PyTorch profiler trace and say where the time went, without a trace viewer.

    python -m minigpt.traces runs/RUN/traces                    # every trace file in the folder
    python -m minigpt.traces runs/RUN/traces/rank0_dp0.123.pt.trace.json.gz
    python -m minigpt.traces runs/RUN --top 20                  # a run folder: looks in its traces/
    python -m minigpt.traces TRACE --json | jq .totals          # one JSON object, for scripts

For every profiled step (the profiler's `ProfilerStep#N` ranges) and in total it prints:

1. Each stage's host time: the duration of the stage's `record_function` range (a
   "user_annotation" event on the CPU timeline). The stages are `--stages` (by default the four
   ranges of one training step: data_to_device, forward, backward, optimizer_step).
2. Each stage's device time, found the way Nsight Systems projects NVTX ranges onto the GPU: a
   kernel belongs to a stage when the CUDA runtime call that launched it (cudaLaunchKernel,
   cudaMemcpyAsync, ...) happened while the stage's range was open. The launch and its kernel share
   a correlation id (`args.correlation`). The launch may come from ANY thread of the process, not
   only the thread that holds the range: backward kernels are launched from autograd's own device
   thread, while `backward` is opened on the main thread. Two figures per stage:
     device busy  the union of its kernels' [start, end] intervals: the time the GPU was busy on
                  the stage's work. Kernels that overlap (several streams) count once; a plain sum
                  would count them twice.
     device span  first kernel start to last kernel end: busy time plus the gaps in between, where
                  the GPU waited for the host (launch-bound stages have a span >> busy).
   Kernels usually run after the host has left the range (launches are asynchronous), so a stage's
   device time can be larger or smaller than its host time; that difference is the lesson.
3. The top kernels by total device time, their share of all device time, and whether they ran on
   tensor cores (judged from the kernel's name, see `tensor_cores`).
4. The top host operators ("cpu_op" events) by self time (own duration minus the durations of the
   operators nested directly inside it on the same thread) and by total time.

A CPU-only trace has no kernels: the host part stands alone and the output says so.
Times in a Chrome trace are microseconds; everything printed is milliseconds.

Standard library only, so it runs wherever the trace was copied to. It knows nothing of GPT.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
from bisect import bisect_left, bisect_right
from collections import defaultdict
from pathlib import Path

# The ranges of one training step, in order (minigpt/instrument.py names them). Repeated here, not
# imported: importing instrument.py would pull in torch, and this tool needs only the trace.
DEFAULT_STAGES = ("data_to_device", "forward", "backward", "optimizer_step")
TRACE_GLOB = "*.pt.trace.json*"  # what torch's tensorboard_trace_handler writes (.json or .json.gz)
TRACE_SUBDIR = "traces"          # where a minigpt run folder keeps them
DEFAULT_TOP = 10

STEP_NAME = re.compile(r"^ProfilerStep#(\d+)$")
RANGE_CATS = {"user_annotation"}                    # record_function ranges on the host
LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}       # host calls that start device work
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}  # work on the device
OP_CATS = {"cpu_op"}                                # aten operators on the host
EPS_US = 1e-3  # timestamps are floats in microseconds; tolerate rounding at range edges

# Tensor-core heuristic, by kernel name (there is no flag in the trace that says so).
#  - NO_TC first: SIMT kernels, whatever library made them: cuBLAS "sgemm"/"dgemm", CUTLASS "simt",
#    cuBLAS xmma kernels that multiply with "ffma" (plain fp32), and matrix-vector "gemv" kernels.
#  - TC: names of kernels issuing MMA instructions: HMMA/IMMA/WMMA/WGMMA/GMMA/XMMA families, CUTLASS
#    "tensorop", instruction shapes such as s16816/s1688/h1688/h884/i8816, cuBLASLt's Hopper "nvjet"
#    kernels, flash/fused attention ("flash", "fmha"), or a CUTLASS/GEMM name with a 16-bit or tf32
#    input type.
#  - A GEMM name with none of these ("gemm", "matmul") is taken as a plain fp32 GEMM: no.
#  - Anything else (elementwise, reductions, copies, Triton kernels whose name says nothing): "-".
NO_TC = re.compile(r"sgemm|dgemm|simt|ffma|gemv", re.I)
TC = re.compile(r"hmma|imma|wmma|gmma|xmma|tensorop|tensor\d|s16816|s1688|h16816|h1688|884gemm|i8816|i16832|"
                r"nvjet|flash|fmha", re.I)
TC_DTYPE = re.compile(r"bf16|fp16|f16|half|tf32", re.I)
GEMM = re.compile(r"gemm|matmul|cutlass", re.I)


class TraceError(Exception):
    """A trace that cannot be read: the message is the one line the user sees."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line on stderr, exit 2, as for every other mistake
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def tensor_cores(name: str) -> str:
    """'yes' / 'no' for a GEMM-like kernel, judged by its name (see the heuristic above); '-' when
    the kernel is not a matrix multiply at all."""
    if NO_TC.search(name):
        return "no"
    if TC.search(name) or (GEMM.search(name) and TC_DTYPE.search(name)):
        return "yes"
    return "no" if GEMM.search(name) else "-"


# ---------------------------------------------------------------------------- reading

def load_events(path: Path) -> list[dict]:
    """The complete ('X') events of a Chrome trace file, .json or .json.gz."""
    if not path.exists():
        raise TraceError(f"{path} does not exist")
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, EOFError) as e:
        raise TraceError(f"{path} is not a JSON trace ({type(e).__name__}: {e})") from None
    # The Chrome trace format is either {"traceEvents": [...], ...} or a bare list of events.
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise TraceError(f"{path} is JSON but not a Chrome trace (no traceEvents list)")
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X"
            and isinstance(e.get("ts"), (int, float)) and isinstance(e.get("dur"), (int, float))]


def trace_files(target: Path) -> list[Path]:
    """TRACE itself, or the trace files in a folder (or in a run folder's traces/)."""
    if not target.is_dir():
        return [target]
    for folder in (target, target / TRACE_SUBDIR):
        files = sorted(p for p in folder.glob(TRACE_GLOB) if p.is_file())
        if files:
            return files
    raise TraceError(f"no {TRACE_GLOB} files in {target} (nor in {target / TRACE_SUBDIR})")


# ---------------------------------------------------------------------------- intervals

def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end] intervals: overlapping parts count once."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def device_figures(kernels: list[dict]) -> dict:
    """Busy time (union), span and count of a set of device events, in ms."""
    if not kernels:
        return {"device_busy_ms": 0.0, "device_span_ms": 0.0, "kernels": 0}
    spans = [(k["ts"], k["ts"] + k["dur"]) for k in kernels]
    return {"device_busy_ms": union_us(spans) / 1000,
            "device_span_ms": (max(e for _, e in spans) - min(s for s, _ in spans)) / 1000,
            "kernels": len(kernels)}


class Launches:
    """The device work of each process, indexed by the host time of its launch, so the kernels
    launched inside a host range [ts, ts+dur] are two binary searches away, on every thread."""

    def __init__(self, events: list[dict]):
        by_corr: dict = defaultdict(list)  # correlation id -> device events (a launch may have several)
        for e in events:
            if e.get("cat") in DEVICE_CATS and "correlation" in e.get("args", {}):
                by_corr[e["args"]["correlation"]].append(e)
        per_pid: dict = defaultdict(list)
        for e in events:
            if e.get("cat") in LAUNCH_CATS:
                work = by_corr.get(e.get("args", {}).get("correlation"))
                if work:  # runtime calls that launch nothing (syncs, mallocs) are dropped
                    per_pid[e.get("pid")].append((e["ts"], work))
        self.ts: dict = {}
        self.work: dict = {}
        for pid, rows in per_pid.items():
            rows.sort(key=lambda r: r[0])
            self.ts[pid] = [ts for ts, _ in rows]
            self.work[pid] = [w for _, w in rows]

    def inside(self, pid, start: float, end: float) -> list[dict]:
        """Device events launched from any thread of process `pid` between start and end."""
        ts, work = self.ts.get(pid, []), self.work.get(pid, [])
        lo, hi = bisect_left(ts, start - EPS_US), bisect_right(ts, end + EPS_US)
        return [k for launched in work[lo:hi] for k in launched]


# ---------------------------------------------------------------------------- summary

def step_table(events: list[dict], stages: tuple[str, ...], gpu: bool) -> list[dict]:
    """Per ProfilerStep: its host time, and each stage's host and device time."""
    ranges = [e for e in events if e.get("cat") in RANGE_CATS]
    steps = sorted((e for e in ranges if STEP_NAME.match(e.get("name", ""))), key=lambda e: e["ts"])
    launches = Launches(events) if gpu else None
    rows = []
    for step in steps:
        start, end = step["ts"], step["ts"] + step["dur"]
        row = {"step": int(STEP_NAME.match(step["name"]).group(1)), "host_ms": step["dur"] / 1000}
        if gpu:
            row.update(device_figures(launches.inside(step.get("pid"), start, end)))
        row["stages"] = {}
        for name in stages:
            # A stage may open several times in a step (gradient accumulation): sum the host times,
            # and take the union of all the device work launched in any of its ranges.
            opened = [r for r in ranges if r.get("name") == name and r.get("pid") == step.get("pid")
                      and start - EPS_US <= r["ts"] and r["ts"] + r["dur"] <= end + EPS_US]
            if not opened:
                continue
            stage = {"host_ms": sum(r["dur"] for r in opened) / 1000, "calls": len(opened)}
            if gpu:
                kernels = [k for r in opened for k in launches.inside(r.get("pid"), r["ts"], r["ts"] + r["dur"])]
                stage.update(device_figures(kernels))
            row["stages"][name] = stage
        rows.append(row)
    return rows


def totals(rows: list[dict], stages: tuple[str, ...], gpu: bool) -> dict:
    """Sums over the profiled steps (device spans are summed per step: steps do not overlap)."""
    keys = ["host_ms"] + (["device_busy_ms", "device_span_ms", "kernels"] if gpu else [])
    total = {"steps": len(rows), **{k: sum(r[k] for r in rows) for k in keys}, "stages": {}}
    for name in stages:
        seen = [r["stages"][name] for r in rows if name in r["stages"]]
        if seen:
            total["stages"][name] = {k: sum(s[k] for s in seen) for k in keys + ["calls"]}
    return total


def top_kernels(events: list[dict], top: int) -> tuple[list[dict], float]:
    """Device events grouped by name, largest total time first, and the total of all of them."""
    groups: dict = defaultdict(lambda: {"calls": 0, "total_us": 0.0})
    for e in events:
        if e.get("cat") in DEVICE_CATS:
            g = groups[e.get("name", "?")]
            g["calls"] += 1
            g["total_us"] += e["dur"]
            g["category"] = e["cat"]
    all_us = sum(g["total_us"] for g in groups.values())
    ranked = sorted(groups.items(), key=lambda kv: kv[1]["total_us"], reverse=True)[:top]
    return [{"name": name, "category": g["category"], "calls": g["calls"], "total_ms": g["total_us"] / 1000,
             "share": g["total_us"] / all_us if all_us else 0.0, "tensor_cores": tensor_cores(name)}
            for name, g in ranked], all_us / 1000


def operator_times(events: list[dict]) -> dict[str, dict]:
    """Self and total host time of every cpu_op name. Self time = own duration minus the durations
    of the operators nested directly inside it on the same thread. Total time counts only the
    outermost call when an operator calls itself, so nothing is counted twice."""
    per_thread: dict = defaultdict(list)
    for e in events:
        if e.get("cat") in OP_CATS:
            per_thread[(e.get("pid"), e.get("tid"))].append(e)
    ops: dict = defaultdict(lambda: {"calls": 0, "self_us": 0.0, "total_us": 0.0})
    for thread_ops in per_thread.values():
        thread_ops.sort(key=lambda e: (e["ts"], -e["dur"]))  # a parent before the children it encloses
        stack: list[list] = []  # open operators: [name, end, self time so far]
        for e in thread_ops:
            name, end = e.get("name", "?"), e["ts"] + e["dur"]
            while stack and e["ts"] >= stack[-1][1] - EPS_US:  # operators that ended before e began
                done = stack.pop()
                ops[done[0]]["self_us"] += max(done[2], 0.0)
            if stack:
                stack[-1][2] -= e["dur"]  # e runs inside the operator on top of the stack
            ops[name]["calls"] += 1
            if all(open_name != name for open_name, _, _ in stack):
                ops[name]["total_us"] += e["dur"]
            stack.append([name, end, e["dur"]])
        for name, _, self_us in stack:
            ops[name]["self_us"] += max(self_us, 0.0)
    return ops


def top_operators(events: list[dict], top: int) -> dict[str, list[dict]]:
    ops = operator_times(events)
    rows = [{"name": name, "calls": o["calls"], "self_ms": o["self_us"] / 1000, "total_ms": o["total_us"] / 1000}
            for name, o in ops.items()]
    return {"by_self": sorted(rows, key=lambda r: r["self_ms"], reverse=True)[:top],
            "by_total": sorted(rows, key=lambda r: r["total_ms"], reverse=True)[:top]}


def summarize(path: Path, stages: tuple[str, ...] = DEFAULT_STAGES, top: int = DEFAULT_TOP) -> dict:
    """Everything the report shows, for one trace file, as plain data (the --json output)."""
    events = load_events(path)
    gpu = any(e.get("cat") in DEVICE_CATS for e in events)
    rows = step_table(events, stages, gpu)
    if not rows:
        raise TraceError(f"{path} has no ProfilerStep#N events: record it with a torch.profiler "
                         "schedule and call prof.step() every step (minigpt: --use-profiler)")
    kernels, kernel_ms = top_kernels(events, top) if gpu else ([], 0.0)
    return {
        "file": str(path),
        "cpu_only": not gpu,
        "stages": list(stages),
        "device_time": "busy = union of kernel intervals; span = first kernel start to last kernel end",
        "steps": rows,
        "totals": totals(rows, stages, gpu),
        "kernel_total_ms": kernel_ms,
        "kernels": kernels,
        "operators": top_operators(events, top),
    }


# ---------------------------------------------------------------------------- printing

def short(name: str, width: int = 90) -> str:
    """Kernel and operator names can be pages of C++ templates; keep the start."""
    return name if len(name) <= width else name[:width - 3] + "..."


def render(s: dict) -> str:
    gpu = not s["cpu_only"]
    steps = [r["step"] for r in s["steps"]]
    out = [f"trace: {s['file']}",
           f"{len(steps)} profiled step(s): {', '.join(map(str, steps))}"]
    if gpu:
        out.append("device busy = union of the intervals of the kernels launched inside the range (from any "
                   "thread); span = first kernel start to last kernel end")
    else:
        out.append("no device kernels in this trace (CPU run): host times only")

    head = f"{'step':>6}  {'stage':<16}{'host ms':>10}"
    if gpu:
        head += f"{'dev busy ms':>13}{'dev span ms':>13}{'kernels':>9}"
    out += ["", head]

    def line(label: str, name: str, r: dict) -> str:
        text = f"{label:>6}  {name:<16}{r['host_ms']:>10.2f}"
        if gpu:
            text += f"{r['device_busy_ms']:>13.2f}{r['device_span_ms']:>13.2f}{r['kernels']:>9}"
        return text

    for row in s["steps"] + [dict(s["totals"], step="total")]:
        label = str(row["step"])
        for name, stage in row["stages"].items():
            out.append(line(label, name, stage))
            label = ""
        out.append(line(label, "(whole step)", row))

    if gpu:
        out += ["", f"top {len(s['kernels'])} kernels of {s['kernel_total_ms']:.2f} ms device time "
                "(tensor cores: judged by kernel name; '-' = not a matrix multiply)",
                f"{'total ms':>10}{'share':>8}{'calls':>7}{'avg us':>9}  {'TC':<4}name"]
        for k in s["kernels"]:
            out.append(f"{k['total_ms']:>10.2f}{100 * k['share']:>7.1f}%{k['calls']:>7}"
                       f"{1000 * k['total_ms'] / k['calls']:>9.1f}  {k['tensor_cores']:<4}{short(k['name'])}")

    for key, title in (("by_self", "self"), ("by_total", "total")):
        rows = s["operators"][key]
        out += ["", f"top {len(rows)} host operators by {title} time",
                f"{'self ms':>10}{'total ms':>10}{'calls':>7}  name"]
        out += [f"{r['self_ms']:>10.2f}{r['total_ms']:>10.2f}{r['calls']:>7}  {short(r['name'])}" for r in rows]
    return "\n".join(out)


# ---------------------------------------------------------------------------- command line

def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m minigpt.traces",
                                     description="Stage, kernel and operator times of a PyTorch profiler trace.")
    parser.add_argument("trace", help="a .pt.trace.json(.gz) file, or a folder of them (or a run folder)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--top", type=int, default=DEFAULT_TOP, help="rows in the kernel and operator tables")
    parser.add_argument("--stages", default=",".join(DEFAULT_STAGES),
                        help="comma-separated record_function ranges to report per step")
    args = parser.parse_args(argv)
    stages = tuple(s for s in args.stages.split(",") if s)
    try:
        if args.top < 1:
            raise TraceError("--top must be positive")
        summaries = [summarize(p, stages, args.top) for p in trace_files(Path(args.trace))]
    except TraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        # One object either way: a file gives its summary, a folder {"traces": [summary, ...]}.
        obj = {"traces": summaries} if Path(args.trace).is_dir() else summaries[0]
        text = json.dumps(obj, indent=1)
    else:
        text = "\n\n".join(render(s) for s in summaries)
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `... | head` closed the pipe early: not an error worth a traceback
        sys.stdout = open(os.devnull, "w")
    return 0


if __name__ == "__main__":
    sys.exit(main())
