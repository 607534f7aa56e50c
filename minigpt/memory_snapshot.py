"""A CUDA memory snapshot (torch.cuda.memory._snapshot(), what --record-memory-history dumps)
read back without torch and without trusting it: the allocator's history replayed into allocated
and reserved bytes over time, its peak, what was live then (with the frames of the code that
allocated it), and the steps and stages the trainer's ranges left in it. The trainer writes
peak_text() beside each pickle; minigpt.analysis.snapshot draws the offline page. Standard library
only.

A snapshot is plain data: dicts, lists, strings and numbers. It is loaded with an unpickler that
refuses every class and function, so a pickle that names one is an error, never code run.
"""

from __future__ import annotations

import gzip
import io
import pickle
from dataclasses import dataclass, field
from pathlib import Path

from minigpt.fileio import read_bounded
from minigpt.stages import STAGE_NAMES
from minigpt.stages import STEP_RANGE as _STEP

MiB = 2**20
SNAPSHOT_LIMIT = 4 << 30  # decompressed: 100,000 entries with Python frames are a few hundred MiB
STEP_RANGE = _STEP.name  # the trainer's range around a step
BEFORE = "(allocated before the recording)"


class SnapshotError(ValueError):
    """Not a CUDA memory snapshot, or one that names a class (refused: a snapshot is plain data)."""


class _PlainData(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise SnapshotError(f"the pickle names {module}.{name}: a memory snapshot is plain data, not loaded")


def load_snapshot(path: str | Path, limit: int = SNAPSHOT_LIMIT) -> dict:
    """The snapshot at `path` (gzipped or not), as plain dicts and lists. Raises SnapshotError."""
    raw = read_bounded(path, limit)
    if raw[:2] == b"\x1f\x8b":
        with gzip.GzipFile(fileobj=io.BytesIO(raw)) as f:
            raw = f.read(limit + 1)
        if len(raw) > limit:
            raise SnapshotError(f"{path}: more than {limit >> 20} MiB once decompressed")
    try:
        snapshot = _PlainData(io.BytesIO(raw)).load()
    except SnapshotError:
        raise
    except Exception as e:  # a truncated or foreign file: pickle raises many kinds
        raise SnapshotError(f"{path}: not a memory snapshot ({type(e).__name__}: {e})") from None
    if not isinstance(snapshot, dict) or "segments" not in snapshot:
        raise SnapshotError(f"{path}: not a memory snapshot (no 'segments')")
    return snapshot


@dataclass
class Block:
    addr: int
    size: int
    frames: list  # innermost first, as the snapshot lists them; [] before the recording
    time_us: int | None  # when it was allocated; None: before the recording


@dataclass
class Replay:
    """The history of one device, replayed: allocated and reserved bytes after each event."""

    times: list[int]  # time_us of each event
    allocated: list[int]
    reserved: list[int]
    peak_at: int  # index of the event after which allocated bytes were highest (-1: before all)
    peak: int
    live_at_peak: list[Block]  # largest first
    steps: list[tuple[int, int]]  # (start, end) time_us of each step range in the recording
    stages: list[tuple[str, int, int]]  # (stage, start, end) inside those steps
    first_step_event: int  # index of the first event of the first step (0 when no step range)
    end_allocated: int = 0
    end_reserved: int = 0
    segments_at_end: int = 0
    notes: list[str] = field(default_factory=list)


def _end_state(snapshot: dict, device: int) -> tuple[dict[int, Block], int, int]:
    """Live blocks and reserved bytes when the snapshot was taken. A block's bytes are those its
    tensor asked for (the history records those; the allocator rounds each block up to 512 B and
    may hand out a larger free block whole), so the replay's peak sits a little under
    max_memory_allocated."""
    live, reserved, n = {}, 0, 0
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        reserved += seg.get("total_size", 0)
        n += 1
        for b in seg.get("blocks", []):
            if b.get("state") == "active_allocated":  # the bytes asked for, as the history counts them
                size = b.get("requested_size") or b["size"]
                live[b["address"]] = Block(b["address"], size, b.get("frames") or [], None)
    return live, reserved, n


def _ranges(snapshot: dict, names: tuple[str, ...]) -> list[tuple[str, int, int]]:
    """(name, start, end) of the annotated ranges named in `names` (record_function ranges the
    history saw open and close), in start order."""
    open_at: dict[str, list[int]] = {}
    out = []
    for a in snapshot.get("external_annotations", []) or []:
        name = a.get("name")
        if name not in names:
            continue
        if a.get("stage") == "START":
            open_at.setdefault(name, []).append(a["time_us"])
        elif open_at.get(name):
            out.append((name, open_at[name].pop(), a["time_us"]))
    return sorted(out, key=lambda r: r[1])


def replay(snapshot: dict, stage_names: tuple[str, ...] = STAGE_NAMES, device: int = 0) -> Replay:
    """Walk the device's history back from what the snapshot holds at its end (the bytes before
    the first event), then forward: allocated and reserved bytes after every event, the peak, and
    every block live at the peak."""
    traces = snapshot.get("device_traces") or [[]]
    events = traces[device] if device < len(traces) else []
    live_end, reserved_end, n_segments = _end_state(snapshot, device)
    allocated, reserved = sum(b.size for b in live_end.values()), reserved_end
    start_live = dict(live_end)
    for e in reversed(events):  # undo each event: the state before the recording
        action, addr, size = e.get("action"), e.get("addr"), e.get("size", 0)
        if action == "alloc":
            allocated -= size
            start_live.pop(addr, None)
        elif action == "free_completed":
            allocated += size
            start_live[addr] = Block(addr, size, [], None)
        elif action in ("segment_alloc", "segment_map"):
            reserved -= size
        elif action in ("segment_free", "segment_unmap"):
            reserved += size
    for b in start_live.values():  # alive since before the recording: its frames, if any, are not its own
        if b.addr not in live_end or not live_end[b.addr].frames:
            b.frames = []
    r = _forward(events, start_live, allocated, reserved, live_end)
    r.steps = [(s, e) for _, s, e in _ranges(snapshot, (STEP_RANGE,))]
    r.stages = [x for x in _ranges(snapshot, stage_names) if r.steps and x[1] >= r.steps[0][0]]
    r.first_step_event = next((i for i, t in enumerate(r.times) if r.steps and t >= r.steps[0][0]), 0)
    r.segments_at_end = n_segments
    return r


def _forward(events: list[dict], start: dict[int, Block], allocated: int, reserved: int, live_end) -> Replay:
    """Replay the events from the state before them: bytes after each, the peak, live at the peak."""
    times, alloc_after, reserved_after = [], [], []
    peak, peak_at = allocated, -1
    for i, e in enumerate(events):
        action, size = e.get("action"), e.get("size", 0)
        if action == "alloc":
            allocated += size
        elif action == "free_completed":
            allocated -= size
        elif action in ("segment_alloc", "segment_map"):
            reserved += size
        elif action in ("segment_free", "segment_unmap"):
            reserved -= size
        times.append(e.get("time_us", 0))
        alloc_after.append(allocated)
        reserved_after.append(reserved)
        if allocated > peak:
            peak, peak_at = allocated, i
    at_peak = _live_after(events, peak_at, live_end) if peak_at >= 0 else start
    return Replay(
        times,
        alloc_after,
        reserved_after,
        peak_at,
        peak,
        sorted(at_peak.values(), key=lambda b: -b.size),
        [],
        [],
        0,
        end_allocated=sum(b.size for b in live_end.values()),
        end_reserved=reserved_after[-1] if reserved_after else reserved,
    )


def _live_after(events: list[dict], index: int, live_end: dict[int, Block]) -> dict[int, Block]:
    """The blocks live right after events[index]: walk back from the end, undoing the later events."""
    live = {a: Block(b.addr, b.size, b.frames, b.time_us) for a, b in live_end.items()}
    for e in reversed(events[index + 1 :]):
        action, addr = e.get("action"), e.get("addr")
        if action == "alloc":
            live.pop(addr, None)
        elif action == "free_completed":  # live at the peak, freed later: its frames are its alloc's
            live[addr] = Block(addr, e.get("size", 0), [], None)
    # frames and times of the blocks allocated in the recording, from their alloc event
    made = {}
    for e in events[: index + 1]:
        if e.get("action") == "alloc":
            made[e.get("addr")] = e
        elif e.get("action") == "free_completed":
            made.pop(e.get("addr"), None)
    for addr, b in live.items():  # the rest predate the recorded events: the segment's frames, if any
        if addr in made:
            b.frames, b.time_us = made[addr].get("frames") or [], made[addr].get("time_us")
    return live


def ours(frames: list) -> list[dict]:
    """The frames of the trainer's own code (not torch's, not the interpreter's), innermost first."""
    return [
        f
        for f in frames
        if str(f.get("filename", "")).endswith(".py")
        and not str(f.get("filename", "")).startswith(("torch/", "/"))
        and "site-packages" not in str(f.get("filename", ""))
    ]


def where(block: Block, depth: int = 3) -> str:
    """Where a block was allocated: the innermost frame, then the trainer's own frames."""
    frames = block.frames or []
    if not frames:
        if block.time_us is None:
            return BEFORE
        return "(no Python frames: made in C++, as autograd's backward thread and cuBLAS allocate)"
    text = [f"{f.get('filename')}:{f.get('line')} {f.get('name')}" for f in frames[:1]]
    text += [
        f"{f.get('filename')}:{f.get('line')} {f.get('name')}"
        for f in ours(frames)[:depth]
        if f is not frames[0]
    ]
    return " <- ".join(text)


def allocated_when(r: Replay, block: Block) -> str:
    """'step 2 backward', 'before the recording', or 'outside the steps'."""
    if block.time_us is None:
        return "before the recording"
    step, stage = stage_at(r, block.time_us)
    return f"step {step} {stage or ''}".strip() if step else "outside the steps"


def stage_at(r: Replay, time_us: int) -> tuple[int | None, str | None]:
    """(the recorded step, 1-based, and the stage) running at `time_us`."""
    step = next((i + 1 for i, (s, e) in enumerate(r.steps) if s <= time_us <= e), None)
    stage = next((name for name, s, e in r.stages if s <= time_us <= e), None)
    return step, stage


def peak_text(snapshot: dict, stage_names: tuple[str, ...] = STAGE_NAMES, rows: int = 20) -> str:
    """What the .txt beside a snapshot says: the peak of the recording, when, and the largest
    allocations live then with where they were made."""
    r = replay(snapshot, stage_names)
    t = r.times[r.peak_at] if r.peak_at >= 0 else None
    step, stage = stage_at(r, t) if t is not None else (None, None)
    when = f"recorded step {step}, {stage or 'between stages'}" if step else "outside the recorded steps"
    lines = [
        f"peak allocated {r.peak / MiB:.1f} MiB ({when}); reserved then {r.reserved[r.peak_at] / MiB:.1f} MiB"
        if r.peak_at >= 0
        else f"peak allocated {r.peak / MiB:.1f} MiB, before the recording began",
        f"{len(r.live_at_peak)} allocations live at the peak; the largest {min(rows, len(r.live_at_peak))}:",
    ]
    for b in r.live_at_peak[:rows]:
        lines.append(f"{b.size / MiB:10.2f} MiB  {allocated_when(r, b):22s}  {where(b)}")
    lines.append(
        f"at the end of the recording: {r.end_allocated / MiB:.1f} MiB allocated, "
        f"{r.end_reserved / MiB:.1f} MiB reserved in {r.segments_at_end} segments"
    )
    return "\n".join(lines) + "\n"
