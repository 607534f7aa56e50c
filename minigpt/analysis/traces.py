"""Read a PyTorch profiler (Kineto) trace and say where the time went, without a trace viewer.

    python -m minigpt traces runs/RUN/traces                    # every trace file in the folder
    python -m minigpt traces runs/RUN/traces/rank0_dp0.123.pt.trace.json.gz
    python -m minigpt traces runs/RUN --top 20                  # a run folder: looks in its traces/
    python -m minigpt traces TRACE --json | jq .totals          # one JSON object, for scripts

It reads any Kineto trace, not only minigpt's: a folder gives every *.json and *.json.gz in it (and
in its traces/), ordered by the rank each trace names (`distributedInfo.rank`), then by file name;
files that are not traces are listed as skipped. For every profiled step (the profiler's
`ProfilerStep#N` ranges) and in total it prints:

1. Each stage's host time: the duration of the stage's `record_function` range. The stages are
   `--stages` (by default the four ranges of one minigpt training step). A trace with no
   `ProfilerStep#N` range is read as one window, from its first event to its last, and says so.
2. Each stage's time in collectives (communication), split from its compute:
     on the host    the time inside the stage's range while a collective was in flight on any
                    thread of the process and no other operator ran on any of its threads (the
                    process waited). Collectives are c10d ops (`c10d::allreduce_`), functional
                    collectives (`_c10d_functional::all_reduce`, `wait_tensor`), backend ranges
                    (`gloo:all_reduce`, `nccl:all_reduce`, ...), `record_param_comms`,
                    `ProcessGroup...` names, `collective_comm` events, and FSDP2's ranges
                    around its all-gather and gradient reduction (`FSDP::all_gather (blocks.0)`,
                    `FSDP::post_backward_reduce (...)`), inside which the thread waits. Under DDP with gloo
                    (torch 2.13) the main thread records `c10d::allreduce_` when a bucket is ready,
                    gloo's own thread records `gloo:all_reduce` for the collective itself, and the
                    main thread waits at the end of `backward`, printed as
                    "backward 213.7 ms, of which waiting on all-reduce: 199.0 ms (compute 14.7 ms)".
     on the device  the union of the NCCL/RCCL kernels (`ncclKernel*`, `ncclDevKernel*`, `rccl*`)
                    launched inside the stage.
3. Each stage's device time, found the way Nsight Systems projects NVTX ranges onto the GPU: device
   work belongs to a stage when the runtime call that launched it (cudaLaunchKernel, hipLaunchKernel,
   an MTIA/XPU/PrivateUse1 runtime call...) happened while the stage's range was open, on ANY thread
   of the process (backward kernels are launched from autograd's device thread). The launch and its
   work share a correlation id (`args.correlation`). Device work with no launch in the trace is
   placed in a step by its own start time. Figures:
     device busy   the union of the [start, end] intervals of kernels, memcpys and memsets over all
                   streams: the time the device was busy. Overlapping work counts once.
     device sum    their plain sum (it exceeds busy when streams overlap; kernel shares use it).
     device span   first start to last end: busy time plus the gaps where the device waited.
   Totals are unions too: a span or busy time is never the sum of per-step figures that overlap.
4. The top kernels by summed device time, their share, and a tensor-core / matrix-core verdict.
5. The top host operators by self time (own duration minus the operators nested directly inside
   it on the same thread) and by total time.

Event categories (Kineto's ActivityType names, and the older names torch-tb-profiler's samples use):
  host ranges    user_annotation, and cpu_op / Operator (old traces put record_function ranges and
                 ProfilerStep#N there); python_function is ignored
  launches       cuda_runtime / Runtime, cuda_driver / Driver, mtia_runtime, xpu_runtime,
                 xpu_driver, privateuse1_runtime, privateuse1_driver, hpu_op (ROCm's HIP calls are
                 recorded as cuda_runtime)
  device work    kernel / Kernel, mtia_ccp_events (kernels; not MTIA's `event_wait`, a wait);
                 gpu_memcpy / Memcpy; gpu_memset / Memset; and any complete event of an unknown
                 category that carries the on-device conventions (`args.stream`, or a "stream N"
                 thread). gpu_user_annotation is the projection of host ranges onto the device
                 timeline, not work, and is not counted.
  The device is never identified by vendor: a trace is "CPU only" when it has no device work and no
  launches. Launches without any device work are a GPU trace whose device side was not recorded
  (the profiler ran without CUPTI, i.e. without ProfilerActivity.CUDA): the report says so and
  shows host times only, rather than calling a GPU run CPU-only.

Tensor-core / matrix-core verdict, by kernel name (a trace has no flag that says so):
  "-"    for every kernel that is not a GEMM or a convolution. GEMM/convolution kernels are names
         containing gemm (not fbgemm: FBGEMM's embedding kernels are not matrix multiplies), gemv,
         matmul, cutlass, nvjet (cuBLASLt, Hopper), conv (not convert), winograd, dgrad/wgrad/fprop,
         scudnn/hcudnn, AMD Tensile/hipBLASLt `Cijk_`, AMD composable-kernel `xdl`, wmma/hmma, and
         flash/fused attention (flash, fmha: two GEMMs fused).
  "no"   SIMT markers: sgemm, dgemm, simt, ffma (fp32 FMA), gemv (matrix-vector).
  "yes"  MMA markers: hmma, imma, wmma, gmma/wgmma, xmma, tensorop, MMA shapes (s16816, s1688,
         h16816, h1688, h884, i8816, i16832), nvjet, flash, fmha, AMD `_MI<m>x<n>x<k>` (MFMA
         instruction shape) and `xdl`; or a 16-bit, tf32, fp8 or int8 type in the name.
  "no"   any other GEMM/convolution: taken as plain fp32 (e.g. volta_scudnn, winograd<float>).
  Triton kernels whose names say nothing get "-": the verdict is a hint, not a measurement.

Malformed events (an entry that is not an object; a complete event whose name is not a string,
whose ts or dur is missing, not a number or negative, whose args is not an object, or whose pid/tid
is not a number or a string) are skipped and counted: "N malformed events skipped". A file that is
not a trace at all gets one line on stderr and exit status 2.

Times in a Chrome trace are microseconds; everything printed is milliseconds.
Standard library and minigpt's torch-free base only, so it runs wherever the trace was copied to.
It knows nothing of GPT.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import sys
from bisect import bisect_left, bisect_right
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from minigpt import config
from minigpt.config import ArgParser
from minigpt.fileio import name_problem


def default_stages() -> tuple[str, ...]:
    """The ranges of one training step, in order: the stage registry's (config.STAGES), read when
    called, so a stage added there is summarised here too."""
    return tuple(config.STAGE_NAMES)


TRACE_SUFFIXES = (".json", ".json.gz")  # torch writes .pt.trace.json(.gz); other tools other names
TRACE_SUBDIR = "traces"  # where a minigpt run folder keeps them
DEFAULT_TOP = 10
# The most trace text a reader takes, decompressed: a gzip's size says nothing of what it holds (a
# few MiB can inflate to gigabytes). Far above a real window: a few profiled steps of a GPU run are
# tens to hundreds of MiB of JSON.
TRACE_LIMIT = 1 << 30
WHOLE_TRACE = "whole trace"  # the window when a trace has no ProfilerStep#N ranges

STEP_NAME = re.compile(r"^ProfilerStep#(\d+)$")
RANGE_CATS = {"user_annotation"}  # record_function ranges on the host
OP_CATS = {"cpu_op", "Operator"}  # aten operators (old traces: ranges too)
LAUNCH_CATS = {
    "cuda_runtime",
    "Runtime",
    "cuda_driver",
    "Driver",
    "mtia_runtime",
    "xpu_runtime",
    "xpu_driver",
    "privateuse1_runtime",
    "privateuse1_driver",
    "hpu_op",
}
KERNEL_CATS = {"kernel", "Kernel", "mtia_ccp_events"}
MEMCPY_CATS = {"gpu_memcpy", "Memcpy"}
MEMSET_CATS = {"gpu_memset", "Memset"}
DEVICE_CATS = KERNEL_CATS | MEMCPY_CATS | MEMSET_CATS  # work on the device
COMM_CATS = {"collective_comm"}
# Known categories that are neither host ranges nor device work: never taken for unknown device work.
OTHER_CATS = {
    "gpu_user_annotation",
    "python_function",
    "Python",
    "Trace",
    "cpu_instant_event",
    "external_correlation",
    "overhead",
    "Overhead",
    "cuda_sync",
    "cuda_event",
    "cuda_profiler_range",
    "glow_runtime",
    "mtia_insight",
    "mtia_counters",
    "xpu_scope_profiler",
    "xpu_sync",
    "async",
    "fwdbwd",
    "ac2g",
}
KNOWN_CATS = RANGE_CATS | OP_CATS | LAUNCH_CATS | DEVICE_CATS | COMM_CATS | OTHER_CATS
EPS_US = 1e-3  # timestamps are floats in microseconds; tolerate rounding at range edges

# Collectives: on the host by operator name, on the device by kernel name (see the docstring).
# FSDP2's ranges around its all-gather (and copy-out) and its gradient reduction count as collectives:
# on the CPU the training thread waits for gloo inside them, and since the reduction runs in an
# autograd node (RegisterPostBackwardFunctionBackward), that wait would otherwise count as compute.
COMM_OP = re.compile(
    r"^(?:c10d::|_?c10d_functional::|gloo:|nccl:|rccl:|xccl:|mpi:|ucc:|hccl:)"
    r"|^FSDP::(?:all_gather|post_backward_reduce|post_backward_rs_wait)"
    r"|record_param_comms|ProcessGroup"
)


def is_collective(name: str) -> bool:
    """A host range or operator that is a collective, or FSDP2's range around one (COMM_OP)."""
    return bool(COMM_OP.search(name))


COMM_KERNEL = re.compile(r"(?:nccl|msccl)\w*kernel|rccl", re.I)
# A device event that records waiting, not work (MTIA's `event_wait` among its mtia_ccp_events):
# counted as busy time it would fill the device's idle gaps, so it is left out of device work.
DEVICE_WAIT = re.compile(r"(?:^|_)wait(?:$|_)", re.I)
COMM_KINDS = (
    ("all-reduce", re.compile(r"all_?reduce", re.I)),
    ("reduce-scatter", re.compile(r"reduce_?scatter", re.I)),
    ("all-gather", re.compile(r"all_?gather", re.I)),
    ("all-to-all", re.compile(r"all_?to_?all", re.I)),
    ("broadcast", re.compile(r"broadcast", re.I)),
    ("barrier", re.compile(r"barrier", re.I)),
    ("send/recv", re.compile(r"send|recv", re.I)),
    ("reduce", re.compile(r"reduce", re.I)),
)

# Tensor-core / matrix-core verdict (the rules are in the module docstring).
MATMUL = re.compile(
    r"(?<!fb)gemm|gemv|matmul|cutlass|nvjet|conv(?!ert)|winograd|dgrad|wgrad|fprop|"
    r"scudnn|hcudnn|Cijk_|xdl|wmma|hmma|flash|fmha",
    re.I,
)
NO_TC = re.compile(r"sgemm|dgemm|simt|ffma|gemv", re.I)
TC = re.compile(
    r"hmma|imma|wmma|gmma|xmma|tensorop|s16816|s1688|h16816|h1688|h884|884gemm|i8816|i16832|"
    r"nvjet|flash|fmha|_MI\d+x\d+x\d+|xdl",
    re.I,
)
TC_DTYPE = re.compile(r"bf16|fp16|f16|half|tf32|fp8|e4m3|e5m2|int8", re.I)


class TraceError(Exception):
    """A trace that cannot be read: the message is the one line the user sees."""


def tensor_cores(name: str) -> str:
    """'yes' / 'no' for a GEMM or convolution kernel, judged by its name (rules in the module
    docstring); '-' when the kernel is neither."""
    if not MATMUL.search(name):
        return "-"
    if NO_TC.search(name):
        return "no"
    return "yes" if TC.search(name) or TC_DTYPE.search(name) else "no"


def comm_kind(names) -> str:
    """'all-reduce', 'all-gather', ... for a set of collective names; 'collectives' when they are of
    several kinds or none says which (record_param_comms, wait_tensor name no kind and are ignored
    beside names that do)."""
    kinds = {next((kind for kind, pattern in COMM_KINDS if pattern.search(name)), None) for name in names}
    kinds.discard(None)
    return kinds.pop() if len(kinds) == 1 else "collectives"


# ---------------------------------------------------------------------------- reading


def _number(x) -> bool:
    """A finite time that float arithmetic can take (no bool, NaN, inf, or a 400-digit integer)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    return abs(x) < 2**63 if isinstance(x, int) else math.isfinite(x)


def _valid(e) -> bool:
    """A complete event with the fields every later step relies on, of the right types."""
    return (
        isinstance(e.get("name"), str)
        and _number(e.get("ts"))
        and _number(e.get("dur"))
        and e["dur"] >= 0
        and isinstance(e.get("args", {}), dict)
        and isinstance(e.get("cat", ""), str)
        and all(isinstance(e.get(k), (int, str, type(None))) for k in ("pid", "tid"))
    )


@dataclass
class Trace:
    """The complete ('X') events of one trace file, checked, and what its header says."""

    path: Path
    events: list[dict]
    malformed: int  # entries skipped: not an object, or a complete event with fields of the wrong type
    rank: int | None  # distributedInfo.rank, when the trace names one


def load_trace(path: Path) -> Trace:
    """Read a Chrome/Kineto trace (.json or .json.gz). Malformed events are skipped and counted;
    a file that is not a trace raises TraceError."""
    if not path.exists():
        raise TraceError(f"{path} does not exist")
    if not path.is_file():
        raise TraceError(f"{path} is not a regular file")
    data = read_trace_json(path)
    # The Chrome trace format is either {"traceEvents": [...], ...} or a bare list of events.
    raw = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(raw, list):
        raise TraceError(f"{path} is JSON but not a Chrome trace (no traceEvents list)")
    events, malformed = [], 0
    for e in raw:
        if not isinstance(e, dict):
            malformed += 1
        elif e.get("ph") == "X":
            if _valid(e):
                if not isinstance(e.get("args"), dict):
                    e["args"] = {}
                if not isinstance(e.get("cat"), str):
                    e["cat"] = ""
                events.append(e)
            else:
                malformed += 1
    if not events:
        what = f"{malformed} malformed" if malformed else "no"
        raise TraceError(f"{path} is not a trace this tool can read: {what} complete ('X') events")
    info = data.get("distributedInfo") if isinstance(data, dict) else None
    rank = info.get("rank") if isinstance(info, dict) else None
    rank = rank if isinstance(rank, int) and not isinstance(rank, bool) else None
    return Trace(path, events, malformed, rank)


def read_trace_json(path: Path, limit: int | None = None):
    """The parsed JSON of a .json or .json.gz file, read through at most `limit` bytes of text
    (default TRACE_LIMIT) however small the file: more is one line (TraceError), not a MemoryError."""
    limit = TRACE_LIMIT if limit is None else limit
    try:
        with (gzip.open if path.name.endswith(".gz") else open)(path, "rb") as f:
            text = f.read(limit + 1)
        if len(text) > limit:
            raise TraceError(
                f"{path} holds more than {limit / 2**20:,.0f} MiB of trace text"
                + (" once decompressed" if path.name.endswith(".gz") else "")
                + ", above what this reader takes: profile fewer steps"
            )
        return json.loads(text.decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, EOFError, RecursionError, ValueError) as e:
        raise TraceError(f"{path} is not a JSON trace ({type(e).__name__}: {e})") from None


def is_trace_file(path: Path) -> bool:
    return path.is_file() and path.name.endswith(TRACE_SUFFIXES)


def trace_files(target: Path) -> list[Path]:
    """TRACE itself, or the *.json / *.json.gz files in a folder and in its traces/ (a run folder)."""
    if not target.is_dir():
        return [target]
    try:
        files = [
            p
            for folder in (target, target / TRACE_SUBDIR)
            if folder.is_dir()
            for p in sorted(folder.iterdir())
            if is_trace_file(p)
        ]
    except OSError as e:
        raise TraceError(f"cannot list {target}: {e.strerror or e}") from None
    if not files:
        raise TraceError(f"no *.json or *.json.gz files in {target} (nor in {target / TRACE_SUBDIR})")
    return files


# ---------------------------------------------------------------------------- classifying


def is_device_work(e: dict) -> bool:
    """Kernels, copies and fills on any accelerator, by category; an unknown category counts when
    it carries Kineto's on-device conventions (a stream in args, or a "stream N" thread)."""
    cat = e["cat"]
    if cat in DEVICE_CATS:
        return not DEVICE_WAIT.search(e["name"])
    if cat in KNOWN_CATS:
        return False
    tid = e.get("tid")
    return "stream" in e["args"] or (isinstance(tid, str) and tid.startswith("stream"))


def is_comm_kernel(e: dict) -> bool:
    return e["cat"] not in MEMCPY_CATS | MEMSET_CATS and bool(COMM_KERNEL.search(e["name"]))


# ---------------------------------------------------------------------------- intervals


def union_us(intervals) -> float:
    """Total length of the union of [start, end] intervals: overlapping parts count once."""
    return sum(end - start for start, end in merged(intervals))


def merged(intervals) -> list[tuple[float, float]]:
    """The union of [start, end] intervals as sorted, disjoint intervals."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def subtract(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merged intervals a minus merged intervals b."""
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cur = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def _spans(work: list[dict]) -> list[tuple[float, float]]:
    return [(k["ts"], k["ts"] + k["dur"]) for k in work]


def device_figures(work: list[dict]) -> dict:
    """Busy time (union over streams), plain sum, span and count of a set of device events, in ms."""
    if not work:
        return {"device_busy_ms": 0.0, "device_sum_ms": 0.0, "device_span_ms": 0.0, "kernels": 0}
    spans = _spans(work)
    return {
        "device_busy_ms": union_us(spans) / 1000,
        "device_sum_ms": sum(e - s for s, e in spans) / 1000,
        "device_span_ms": (max(e for _, e in spans) - min(s for s, _ in spans)) / 1000,
        "kernels": len(work),
    }


def _key(x):
    """Correlation ids and pids as dictionary keys (unhashable values are nobody's)."""
    return x if isinstance(x, (int, str)) else None


class Launches:
    """The device work of each process, indexed by the host time of its launch, so the work
    launched inside a host range [ts, ts+dur] is two binary searches away, on every thread.
    Device work whose launch is not in the trace is kept apart (`orphans`), by its own start."""

    def __init__(self, events: list[dict]):
        by_corr: dict = defaultdict(list)  # correlation id -> device events (a launch may have several)
        work = [e for e in events if is_device_work(e)]
        for e in work:
            corr = _key(e["args"].get("correlation"))
            if corr is not None:
                by_corr[corr].append(e)
        per_pid: dict = defaultdict(list)
        claimed: set = set()
        for e in events:
            if e["cat"] in LAUNCH_CATS:
                corr = _key(e["args"].get("correlation"))
                launched = by_corr.get(corr) if corr is not None else None
                if launched and corr not in claimed:  # calls that launch nothing (syncs) are dropped
                    claimed.add(corr)
                    per_pid[_key(e.get("pid"))].append((e["ts"], launched))
        self.ts: dict = {}
        self.work: dict = {}
        for pid, rows in per_pid.items():
            rows.sort(key=lambda r: r[0])
            self.ts[pid] = [ts for ts, _ in rows]
            self.work[pid] = [w for _, w in rows]
        self.orphans = sorted(
            (e for e in work if _key(e["args"].get("correlation")) not in claimed), key=lambda e: e["ts"]
        )
        self.orphan_ts = [e["ts"] for e in self.orphans]

    def inside(self, pid, start: float, end: float) -> list[dict]:
        """Device events launched from any thread of process `pid` (None: of any process) between
        start and end."""
        out = []
        for p in self.ts if pid is None else [_key(pid)]:
            ts, work = self.ts.get(p, []), self.work.get(p, [])
            lo, hi = bisect_left(ts, start - EPS_US), bisect_right(ts, end + EPS_US)
            out += [k for launched in work[lo:hi] for k in launched]
        return out

    def unlaunched(self, start: float, end: float) -> list[dict]:
        """Device events with no launch in the trace that start between start and end."""
        lo, hi = bisect_left(self.orphan_ts, start - EPS_US), bisect_right(self.orphan_ts, end + EPS_US)
        return self.orphans[lo:hi]


# ---------------------------------------------------------------------------- ranges inside windows
# Every step asks which stage ranges lie inside it. Scanning every range for every step costs
# steps x ranges: a hostile trace of 20,000 overlapping steps and 20,000 forwards ran past 120 s.
# An offline sweep answers all the steps at once in O((steps + ranges) log ranges), however much
# they overlap: steps by their end, ranges added as their end passes, a Fenwick tree over the
# ranges' starts. Times are summed as exact integers (of 2**-1074 us, where every float lands), so
# the tree's differences cost no rounding: a stage with no collective still waits exactly 0.

EXACT = 1 << 1074


def exact(x: float) -> int:
    """`x` as an exact integer count of 2**-1074 (every finite float is one)."""
    num, den = float(x).as_integer_ratio()
    return num * (EXACT // den)


class _Fenwick:
    """Prefix sums of ints over positions 0..n-1, each update and query O(log n)."""

    def __init__(self, n: int):
        self.tree = [0] * (n + 1)

    def add(self, i: int, value: int) -> None:
        i += 1
        while i < len(self.tree):
            self.tree[i] += value
            i += i & -i

    def below(self, i: int) -> int:
        """The sum over positions < i."""
        total = 0
        while i > 0:
            total += self.tree[i]
            i -= i & -i
        return total


def contained_sums(ranges: list[tuple], windows: list[tuple[float, float]]) -> list[tuple[int, int, int]]:
    """For each window (start, end): (count, summed duration, summed collective wait) of the ranges
    (ts, end, exact duration, exact wait) inside it (start - EPS <= ts, end <= window end + EPS)."""
    starts = sorted(r[0] for r in ranges)
    by_end = sorted(ranges, key=lambda r: r[1])
    trees = [_Fenwick(len(starts)) for _ in range(3)]
    added = [0, 0, 0]
    out: list = [None] * len(windows)
    j = 0
    for w in sorted(range(len(windows)), key=lambda i: windows[i][1]):
        start, end = windows[w]
        while j < len(by_end) and by_end[j][1] <= end + EPS_US:
            ts, _, dur, wait = by_end[j]
            at = bisect_left(starts, ts)
            for k, (tree, value) in enumerate(zip(trees, (1, dur, wait))):
                tree.add(at, value)
                added[k] += value
            j += 1
        lo = bisect_left(starts, start - EPS_US)
        out[w] = tuple(added[k] - trees[k].below(lo) for k in range(3))
    return out


# ---------------------------------------------------------------------------- summary


class _Index:
    """What every window needs, computed once per trace."""

    def __init__(self, events: list[dict], stages: tuple[str, ...]):
        self.stages = stages
        wanted = set(stages)
        self.ranges: dict = defaultdict(list)  # stage name -> its host ranges
        self.steps = []
        self.comm: dict = defaultdict(list)  # pid -> [(start, end, name)] of host collectives
        thread_ops: dict = defaultdict(list)  # (pid, tid) -> intervals of its other operators
        thread_comm: dict = defaultdict(list)  # (pid, tid) -> intervals of its collectives
        for e in events:
            cat, name = e["cat"], e["name"]
            if cat in RANGE_CATS or cat in OP_CATS:
                if name in wanted:
                    self.ranges[name].append(e)
                elif STEP_NAME.match(name):
                    self.steps.append(e)
            pid, thread, span = (
                _key(e.get("pid")),
                (_key(e.get("pid")), _key(e.get("tid"))),
                (e["ts"], e["ts"] + e["dur"]),
            )
            if (cat in RANGE_CATS or cat in OP_CATS or cat in COMM_CATS) and is_collective(name):
                self.comm[pid].append((*span, name))
                thread_comm[thread].append(span)
            elif cat in OP_CATS and not STEP_NAME.match(name) and name not in wanted:
                thread_ops[thread].append(span)
        # A process is busy on the host while any of its threads runs an operator that is not a
        # collective (operators nested inside a collective on its own thread are the collective's).
        busy: dict = defaultdict(list)
        for thread, spans in thread_ops.items():
            busy[thread[0]] += subtract(merged(spans), merged(thread_comm.get(thread, [])))
        self.busy = {pid: merged(spans) for pid, spans in busy.items()}
        self.steps.sort(key=lambda e: e["ts"])
        self.launches = Launches(events)
        self._wait_cache: dict = {}
        for rows in self.ranges.values():
            rows.sort(key=lambda r: r["ts"])
        # (stage, pid) -> its ranges' indices and starts, in start order; pid None: every process's
        self.range_index: dict = {}
        for name, rows in self.ranges.items():
            self.range_index[(name, None)] = (list(range(len(rows))), [r["ts"] for r in rows])
            for i, r in enumerate(rows):
                index, ts = self.range_index.setdefault((name, r.get("pid")), ([], []))
                index.append(i)
                ts.append(r["ts"])
        # Each range's wait on collectives, once (not once per window that holds it)
        self.waits = {
            name: [
                self.comm_in(r.get("pid"), r["ts"], r["ts"] + r["dur"]) if self.comm else (0, set())
                for r in rows
            ]
            for name, rows in self.ranges.items()
        }
        self.named_waits = {name for name, waits in self.waits.items() if any(names for _, names in waits)}
        self.step_sums = self.sums([(s.get("pid"), s["ts"], s["ts"] + s["dur"]) for s in self.steps])

    def sums(self, windows: list[tuple]) -> list[dict]:
        """For each window (pid, start, end): each stage's (calls, exact host time, exact wait on
        collectives) over its ranges inside the window, on that process (pid None: any)."""
        out: list[dict] = [{} for _ in windows]
        by_pid: dict = defaultdict(list)  # pid -> the windows on it: one pass, however many pids
        for i, w in enumerate(windows):
            by_pid[w[0]].append(i)
        for name, rows in self.ranges.items():
            ranges: dict = defaultdict(list)  # pid -> its ranges, as contained_sums takes them
            for r, (wait, _) in zip(rows, self.waits[name]):
                ranges[r.get("pid")].append((r["ts"], r["ts"] + r["dur"], exact(r["dur"]), wait))
            every = [r for rs in ranges.values() for r in rs]
            for pid, mine in by_pid.items():
                theirs = every if pid is None else ranges.get(pid, [])
                for i, got in zip(mine, contained_sums(theirs, [windows[i][1:] for i in mine])):
                    out[i][name] = got
        return out

    def opened(self, name: str, pid, start: float, end: float) -> list[int]:
        """The indices of the stage's ranges inside [start, end] on process `pid` (None: any)."""
        rows = self.ranges.get(name, [])
        index, ts = self.range_index.get((name, pid), ([], []))
        lo, hi = bisect_left(ts, start - EPS_US), bisect_right(ts, end + EPS_US)
        return [i for i in index[lo:hi] if rows[i]["ts"] + rows[i]["dur"] <= end + EPS_US]

    def comm_in(self, pid, start: float, end: float) -> tuple[int, set]:
        """Host time inside [start, end] spent waiting on collectives (exact, in 2**-1074 us): while
        a collective was in flight on any thread of the process and no other operator ran on any of
        its threads; and the names of the collectives in flight then. The waiting intervals do not
        depend on the range: made once per process, each range's share is two binary searches."""
        waiting, by_name = self._waiting(None if pid is None else _key(pid))
        starts, ends, prefix = waiting
        a, b = bisect_right(ends, start), bisect_left(starts, end)  # the intervals that overlap
        total = 0
        if a < b:
            total = prefix[b] - prefix[a]
            total -= max(0, exact(start) - exact(starts[a]))  # the parts outside the range
            total -= max(0, exact(ends[b - 1]) - exact(end))
        names = set()
        for name, (n_starts, n_ends) in by_name.items():
            k = bisect_right(n_ends, start)
            if k < len(n_starts) and n_starts[k] < end:
                names.add(name)
        return total, names

    def _waiting(self, pid):
        """For a process (None: all of them): the intervals when a collective was in flight and no
        other operator ran (starts, ends, exact prefix sums of their lengths), and each
        collective name's merged intervals (starts, ends)."""
        if pid in self._wait_cache:
            return self._wait_cache[pid]
        pids = list(self.comm) if pid is None else [pid] if pid in self.comm else []
        rows = [r for p in pids for r in self.comm[p]]
        busy = merged(
            [iv for p in (list(self.busy) if pid is None else [pid]) for iv in self.busy.get(p, [])]
        )
        waiting = subtract(merged([(s, e) for s, e, _ in rows]), busy)
        prefix = [0]
        for s, e in waiting:
            prefix.append(prefix[-1] + exact(e) - exact(s))
        spans: dict = defaultdict(list)
        for s, e, name in rows:
            spans[name].append((s, e))
        by_name = {
            n: ([s for s, _ in m], [e for _, e in m]) for n, m in ((n, merged(v)) for n, v in spans.items())
        }
        self._wait_cache[pid] = ([s for s, _ in waiting], [e for _, e in waiting], prefix), by_name
        return self._wait_cache[pid]

    def window(
        self, pid, start: float, end: float, gpu: bool, sums: dict | None = None
    ) -> tuple[dict, list[dict], dict]:
        """One window's figures, plus the device work in it and each stage's (for the totals).
        `sums`: the window's entry of self.sums(), when computed for many windows at once."""
        work = self.launches.inside(pid, start, end) + self.launches.unlaunched(start, end)
        row = {"host_ms": (end - start) / 1000}
        if gpu:
            row.update(device_figures(work))
        row["stages"], stage_work = {}, {}
        sums = sums if sums is not None else self.sums([(pid, start, end)])[0]
        for name in self.stages:
            # A stage may open several times in a window (gradient accumulation): sum the host times,
            # and take the union of all the device work launched in any of its ranges.
            calls, host, wait = sums.get(name, (0, 0, 0))
            if not calls:
                continue
            stage = {"host_ms": host / EXACT / 1000, "calls": calls, "comm_host_ms": wait / EXACT / 1000}
            stage["comm_device_ms"] = 0.0  # no NCCL/RCCL kernels without device work
            # Which ranges, not only how many: for their kernels, and the collectives they waited on.
            # (Under overlapping steps this part grows with the overlaps; device traces have none.)
            inside = self.opened(name, pid, start, end) if gpu or name in self.named_waits else []
            opened = [self.ranges[name][i] for i in inside]
            comm_names = set().union(*(self.waits[name][i][1] for i in inside))
            if gpu:
                kernels = [
                    k for r in opened for k in self.launches.inside(r.get("pid"), r["ts"], r["ts"] + r["dur"])
                ]
                stage.update(device_figures(kernels))
                comm_kernels = [k for k in kernels if is_comm_kernel(k)]
                stage["comm_device_ms"] = union_us(_spans(comm_kernels)) / 1000
                comm_names |= {k["name"] for k in comm_kernels}
                stage_work[name] = kernels
            stage["comm_kind"] = comm_kind(comm_names) if comm_names else None
            row["stages"][name] = stage
        return row, work, stage_work


def _steps(index: _Index, gpu: bool):
    rows, works, stage_works, spans = [], [], [], []
    for step, sums in zip(index.steps, index.step_sums):
        start, end = step["ts"], step["ts"] + step["dur"]
        row, work, stage_work = index.window(step.get("pid"), start, end, gpu, sums)
        rows.append({"step": int(STEP_NAME.match(step["name"]).group(1)), **row})
        works.append(work)
        stage_works.append(stage_work)
        spans.append((start, end))
    return rows, works, stage_works, spans


def totals(
    rows: list[dict], stages: tuple[str, ...], gpu: bool, works=None, stage_works=None, spans=None
) -> dict:
    """Figures over all profiled steps. Host time, device busy time and device span are unions over
    the steps (with the steps' intervals given), so steps whose ranges overlap are not counted twice;
    sums (device sum, kernels, calls, stage host and communication times) are plain sums."""

    def union_of(key, intervals):
        return union_us(intervals) / 1000 if intervals is not None else sum(r[key] for r in rows)

    total = {"steps": len(rows), "host_ms": union_of("host_ms", spans)}
    if gpu:
        flat = [k for w in works for k in w] if works is not None else None
        span_iv = None
        if works is not None:
            span_iv = [(min(s for s, _ in _spans(w)), max(e for _, e in _spans(w))) for w in works if w]
        busy_iv = _spans(flat) if flat is not None else None
        total.update(
            {
                "device_busy_ms": union_of("device_busy_ms", busy_iv),
                "device_sum_ms": sum(r["device_sum_ms"] for r in rows),
                "device_span_ms": union_of("device_span_ms", span_iv),
                "kernels": sum(r["kernels"] for r in rows),
            }
        )
    total["stages"] = {}
    for name in stages:
        seen = [r["stages"][name] for r in rows if name in r["stages"]]
        if not seen:
            continue
        stage = {k: sum(s[k] for s in seen) for k in ("host_ms", "calls", "comm_host_ms", "comm_device_ms")}
        if gpu:
            kernels = [k for sw in (stage_works or []) for k in sw.get(name, [])]
            stage.update(
                device_figures(kernels)
                if stage_works is not None
                else {
                    k: sum(s[k] for s in seen)
                    for k in ("device_busy_ms", "device_sum_ms", "device_span_ms", "kernels")
                }
            )
            if stage_works is not None:
                stage["device_span_ms"] = (
                    union_us(
                        [
                            (min(s for s, _ in _spans(w)), max(e for _, e in _spans(w)))
                            for sw in stage_works
                            if (w := sw.get(name))
                        ]
                    )
                    / 1000
                )
        kinds = {s["comm_kind"] for s in seen if s["comm_kind"]}
        stage["comm_kind"] = (kinds.pop() if len(kinds) == 1 else "collectives") if kinds else None
        total["stages"][name] = stage
    return total


def top_kernels(events: list[dict], top: int) -> tuple[list[dict], float]:
    """Device events grouped by name, largest summed time first, and the sum of all of them."""
    groups: dict = defaultdict(lambda: {"calls": 0, "total_us": 0.0})
    for e in events:
        if is_device_work(e):
            g = groups[e["name"]]
            g["calls"] += 1
            g["total_us"] += e["dur"]
            g["category"] = e["cat"]
    all_us = sum(g["total_us"] for g in groups.values())
    ranked = sorted(groups.items(), key=lambda kv: kv[1]["total_us"], reverse=True)[:top]
    return [
        {
            "name": name,
            "category": g["category"],
            "calls": g["calls"],
            "total_ms": g["total_us"] / 1000,
            "share": g["total_us"] / all_us if all_us else 0.0,
            "tensor_cores": tensor_cores(name),
        }
        for name, g in ranked
    ], all_us / 1000


def operator_times(events: list[dict]) -> dict[str, dict]:
    """Self and total host time of every operator name. Self time = own duration minus the durations
    of the operators nested directly inside it on the same thread. Total time counts only the
    outermost call when an operator calls itself, so nothing is counted twice. ProfilerStep#N
    ranges (operators in old traces) are windows, not operators, and are left out."""
    per_thread: dict = defaultdict(list)
    for e in events:
        if e["cat"] in OP_CATS and not STEP_NAME.match(e["name"]):
            per_thread[(_key(e.get("pid")), _key(e.get("tid")))].append(e)
    ops: dict = defaultdict(lambda: {"calls": 0, "self_us": 0.0, "total_us": 0.0})
    for thread_ops in per_thread.values():
        thread_ops.sort(key=lambda e: (e["ts"], -e["dur"]))  # a parent before the children it encloses
        stack: list[list] = []  # open operators: [name, end, self time so far]
        open_names: Counter = Counter()  # the names on the stack: a lookup, not a scan of a deep stack
        for e in thread_ops:
            name, end = e["name"], e["ts"] + e["dur"]
            while stack and e["ts"] >= stack[-1][1] - EPS_US:  # operators that ended before e began
                done = stack.pop()
                open_names[done[0]] -= 1
                ops[done[0]]["self_us"] += max(done[2], 0.0)
            if stack:
                stack[-1][2] -= e["dur"]  # e runs inside the operator on top of the stack
            ops[name]["calls"] += 1
            if not open_names[name]:
                ops[name]["total_us"] += e["dur"]
            stack.append([name, end, e["dur"]])
            open_names[name] += 1
        for name, _, self_us in stack:
            ops[name]["self_us"] += max(self_us, 0.0)
    return ops


def top_operators(events: list[dict], top: int) -> dict[str, list[dict]]:
    ops = operator_times(events)
    rows = [
        {"name": name, "calls": o["calls"], "self_ms": o["self_us"] / 1000, "total_ms": o["total_us"] / 1000}
        for name, o in ops.items()
    ]
    return {
        "by_self": sorted(rows, key=lambda r: r["self_ms"], reverse=True)[:top],
        "by_total": sorted(rows, key=lambda r: r["total_ms"], reverse=True)[:top],
    }


def summarize(path: Path, stages: tuple[str, ...] | None = None, top: int = DEFAULT_TOP) -> dict:
    """Everything the report shows, for one trace file, as plain data (the --json output).
    `stages`: the ranges to report per step (default: the stage registry's)."""
    stages = tuple(stages) if stages else default_stages()
    trace = load_trace(Path(path))
    events = trace.events
    work = [e for e in events if is_device_work(e)]
    gpu = bool(work)
    index = _Index(events, stages)
    rows, works, stage_works, spans = _steps(index, gpu)
    if rows:
        total = totals(rows, stages, gpu, works, stage_works, spans)
        window = "ProfilerStep"
    else:  # no ProfilerStep#N: the whole trace is one window, over every process in it
        start = min(e["ts"] for e in events)
        end = max(e["ts"] + e["dur"] for e in events)
        row, window_work, stage_work = index.window(None, start, end, gpu)
        total = totals([row], stages, gpu, [window_work], [stage_work], [(start, end)])
        total["steps"] = 0
        window = WHOLE_TRACE
    kernels, kernel_ms = top_kernels(events, top) if gpu else ([], 0.0)
    launch_calls = Counter(e["cat"] for e in events if e["cat"] in LAUNCH_CATS)
    streams = {(_key(e.get("pid")), _key(e.get("tid"))) for e in work}
    return {
        "file": str(path),
        "rank": trace.rank,
        "window": window,
        "cpu_only": not gpu and not launch_calls,
        # runtime/driver calls by category: with no device work, the kernels were not recorded
        "launch_calls": dict(launch_calls),
        "device_not_recorded": not gpu and bool(launch_calls),
        "malformed_events": trace.malformed,
        "stages": list(stages),
        "device_time": "busy = union of kernel, memcpy and memset intervals over all streams; "
        "sum = their plain sum; span = first start to last end",
        "device_busy_ms": union_us(_spans(work)) / 1000,
        "device_sum_ms": sum(e["dur"] for e in work) / 1000,
        "device_streams": len(streams),
        "steps": rows,
        "totals": total,
        "kernel_total_ms": kernel_ms,
        "kernels": kernels,
        "operators": top_operators(events, top),
    }


# ---------------------------------------------------------------------------- printing


def short(name: str, width: int = 90) -> str:
    """Kernel and operator names can be pages of C++ templates; keep the start."""
    return name if len(name) <= width else name[: width - 3] + "..."


def comm_lines(s: dict) -> list[str]:
    """'backward 213.7 ms, of which waiting on all-reduce: 199.0 ms' for every stage that holds
    collectives, per step and in total."""
    out = []
    rows = [(str(r["step"]), r) for r in s["steps"]] + [("total" if s["steps"] else WHOLE_TRACE, s["totals"])]
    for label, row in rows:
        for name, st in row["stages"].items():
            dev = st.get("comm_device_ms", 0.0)
            if st["comm_host_ms"] <= 0 and dev <= 0:
                continue
            text = (
                f"{label:>6}  {name} {st['host_ms']:.1f} ms, of which waiting on {st['comm_kind']}: "
                f"{st['comm_host_ms']:.1f} ms (compute {st['host_ms'] - st['comm_host_ms']:.1f} ms)"
            )
            if dev > 0:
                text += f"; {st['comm_kind']} kernels on the device: {dev:.1f} ms"
            out.append(text)
    return out


def render(s: dict) -> str:
    """One trace summary as the tables the command line prints."""
    gpu = not s["cpu_only"] and not s.get("device_not_recorded")
    out = _heading(s, gpu) + ["", *_step_table(s, gpu)]
    comm = comm_lines(s)
    if comm:
        out += ["", "communication (host: a collective in flight on any thread, no other operator running)"]
        out += comm
    if gpu:
        out += ["", *_kernel_table(s)]
    for key, title in (("by_self", "self"), ("by_total", "total")):
        rows = s["operators"][key]
        out += [
            "",
            f"top {len(rows)} host operators by {title} time",
            f"{'self ms':>10}{'total ms':>10}{'calls':>7}  name",
        ]
        out += [
            f"{r['self_ms']:>10.2f}{r['total_ms']:>10.2f}{r['calls']:>7}  {short(r['name'])}" for r in rows
        ]
    return "\n".join(out)


def _heading(s: dict, gpu: bool) -> list[str]:
    """The file, its rank and steps, and what the device side of the trace holds."""
    steps = [r["step"] for r in s["steps"]]
    rank = f" (rank {s['rank']})" if s.get("rank") is not None else ""
    out = [f"trace: {s['file']}{rank}"]
    if steps:
        out.append(f"{len(steps)} profiled step(s): {', '.join(map(str, steps))}")
    else:
        out.append(
            f"no ProfilerStep#N ranges: the whole trace is one window ({s['totals']['host_ms']:.2f} ms)"
        )
    if s.get("malformed_events"):
        out.append(f"{s['malformed_events']} malformed events skipped")
    if gpu:
        out.append(
            f"device time: busy {s['device_busy_ms']:.2f} ms (union of kernel, memcpy and memset "
            f"intervals over {s['device_streams']} stream(s)); summed over streams "
            f"{s['device_sum_ms']:.2f} ms"
        )
        out.append(
            "per range: device work launched inside it (from any thread); busy = union, "
            "span = first start to last end"
        )
    elif s.get("device_not_recorded"):
        calls = ", ".join(f"{n:,} {cat}" for cat, n in sorted(s["launch_calls"].items()))
        out.append(
            f"a GPU trace whose kernels were not recorded: {calls} calls but no kernel, memcpy or "
            "memset events, so host times only. Kernels are recorded through CUPTI: profile with "
            "torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) "
            "(train_minimal.py --use-profiler does on a GPU)"
        )
    else:
        out.append("no device events in this trace (CPU only): host times only")
    return out


def _step_table(s: dict, gpu: bool) -> list[str]:
    """Each step's stages and the whole step, then the totals: host ms, the collectives' ms where
    the trace has any, and on a GPU the device's busy and span ms and kernel count."""
    steps = [r["step"] for r in s["steps"]]
    has_comm = any(
        st["comm_host_ms"] > 0 or st.get("comm_device_ms", 0) > 0 for st in s["totals"]["stages"].values()
    )
    head = f"{'step':>6}  {'stage':<16}{'host ms':>10}"
    if has_comm:
        head += f"{'comm ms':>10}"
    if gpu:
        head += f"{'dev busy ms':>13}{'dev span ms':>13}{'kernels':>9}"
    out = [head]

    def line(label: str, name: str, r: dict, stage: bool) -> str:
        text = f"{label:>6}  {name:<16}{r['host_ms']:>10.2f}"
        if has_comm:
            text += f"{r['comm_host_ms']:>10.2f}" if stage else f"{'':>10}"
        if gpu:
            text += f"{r['device_busy_ms']:>13.2f}{r['device_span_ms']:>13.2f}{r['kernels']:>9}"
        return text

    total_label = "total" if steps else "trace"
    for row in s["steps"] + [dict(s["totals"], step=total_label)]:
        label = str(row["step"])
        for name, stage in row["stages"].items():
            out.append(line(label, name, stage, True))
            label = ""
        out.append(line(label, "(whole step)" if steps else "(whole trace)", row, False))
    return out


def _kernel_table(s: dict) -> list[str]:
    out = [
        f"top {len(s['kernels'])} kernels of {s['kernel_total_ms']:.2f} ms device time summed "
        "over streams (TC: tensor/matrix cores, judged by name; '-' = not a GEMM or convolution)",
        f"{'total ms':>10}{'share':>8}{'calls':>7}{'avg us':>9}  {'TC':<4}name",
    ]
    for k in s["kernels"]:
        out.append(
            f"{k['total_ms']:>10.2f}{100 * k['share']:>7.1f}%{k['calls']:>7}"
            f"{1000 * k['total_ms'] / k['calls']:>9.1f}  {k['tensor_cores']:<4}{short(k['name'])}"
        )
    return out


# ---------------------------------------------------------------------------- command line


def summarize_all(target: Path, stages: tuple[str, ...], top: int) -> tuple[list[dict], list[dict]]:
    """Summaries of TRACE, or of every trace in a folder ordered by rank then name, and the files
    of a folder that are not traces (with why). A single file that is not a trace raises."""
    files = trace_files(target)
    if not target.is_dir():
        return [summarize(files[0], stages, top)], []
    summaries, skipped = [], []
    for p in files:
        try:
            summaries.append(summarize(p, stages, top))
        except TraceError as e:
            skipped.append({"file": str(p), "reason": str(e)})
    if not summaries:
        raise TraceError(
            f"none of the {len(files)} .json/.json.gz files in {target} is a trace "
            f"(first: {skipped[0]['reason']})"
        )
    summaries.sort(key=lambda s: (s["rank"] is None, s["rank"] if s["rank"] is not None else 0, s["file"]))
    return summaries, skipped


def main(argv: list[str] | None = None) -> int:
    parser = ArgParser(
        prog="python -m minigpt traces",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("trace", help="a .json(.gz) trace file, or a folder of them (or a run folder)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--top", type=int, default=DEFAULT_TOP, help="rows in the kernel and operator tables")
    parser.add_argument(
        "--stages",
        default=None,
        help="comma-separated record_function ranges to report per step "
        f"(default: {','.join(default_stages())})",
    )
    args = parser.parse_args(argv)
    stages = tuple(s for s in args.stages.split(",") if s) if args.stages else default_stages()
    target = Path(args.trace)
    try:
        if args.top < 1:
            raise TraceError("--top must be positive")
        if problem := name_problem(target):
            raise TraceError(f"trace: the path {problem}; choose a shorter one")
        summaries, skipped = summarize_all(target, stages, args.top)
    except TraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        # One object either way: a file gives its summary, a folder {"traces": [...], "skipped": [...]}.
        obj = {"traces": summaries, "skipped": skipped} if target.is_dir() else summaries[0]
        text = json.dumps(obj, indent=1)
    else:
        text = "\n\n".join(render(s) for s in summaries)
        if skipped:
            names = ", ".join(Path(d["file"]).name for d in skipped)
            text += f"\n\nskipped {len(skipped)} .json file(s) that are not traces: {names}"
    try:
        if hasattr(sys.stdout, "reconfigure"):  # a name with a lone surrogate must not end in a traceback
            sys.stdout.reconfigure(errors="backslashreplace")
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `... | head` closed the pipe early: not an error worth a traceback
        sys.stdout = open(os.devnull, "w")
    return 0


if __name__ == "__main__":
    sys.exit(main())
