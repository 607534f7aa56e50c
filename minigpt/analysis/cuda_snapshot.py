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
import pickletools
import reprlib
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from minigpt.config import STAGE_NAMES
from minigpt.config import STEP_RANGE as _STEP
from minigpt.fileio import read_bounded

MiB = 2**20
# Decompressed bytes: the H200 run's 100,000-entry history with Python frames is 57 MiB.
SNAPSHOT_LIMIT = 512 * MiB
# What the unpickler may build, counted before it builds anything (_objects_problem): bytes alone
# do not bound memory, since one byte of pickle ('}') makes an empty dict of 64 bytes, and a 98 KB
# gzip of 96 million of them took 8.8 GB. Each unit is an object, a reference or a mark, at most
# about 72 bytes in memory (a set, 216, counts 3): 32 million is under 2.5 GB, and 2.5 times the
# 12.9 million of the H200 run's snapshot.
OBJECT_LIMIT = 32_000_000
STEP_RANGE = _STEP  # the trainer's range around a step
BEFORE = "(allocated before the recording)"


class SnapshotError(ValueError):
    """Not a CUDA memory snapshot, or one that names a class (refused: a snapshot is plain data)."""


class _PlainData(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise SnapshotError(f"the pickle names {module}.{name}: a memory snapshot is plain data, not loaded")


# The opcode scan's table: for each opcode byte, how its argument is laid out (a fixed number of
# bytes, or one of the kinds below) and how many units it builds. Opcodes that only fill a container
# already counted, or frame the stream, build none; those that name code end the scan (_PlainData
# refuses them before anything after them is built).
_LINE, _LEN1, _LEN4, _LEN8, _END = -1, -2, -3, -4, -5
_BUILDS_NOTHING = {"STOP", "POP", "POP_MARK", "FRAME", "PROTO", "APPEND", "APPENDS", "SETITEM", "SETITEMS"}
_CODE = {
    "GLOBAL", "STACK_GLOBAL", "INST", "OBJ", "REDUCE", "BUILD", "NEWOBJ", "NEWOBJ_EX", "EXT1", "EXT2",
    "EXT4", "PERSID", "BINPERSID", "NEXT_BUFFER", "READONLY_BUFFER", "STOP",
}  # fmt: skip
_ARG_KIND = {
    pickletools.UP_TO_NEWLINE: _LINE,
    pickletools.TAKEN_FROM_ARGUMENT1: _LEN1,
    pickletools.TAKEN_FROM_ARGUMENT4: _LEN4,
    pickletools.TAKEN_FROM_ARGUMENT4U: _LEN4,
    pickletools.TAKEN_FROM_ARGUMENT8U: _LEN8,
}
_LAYOUT, _UNITS = [_END] * 256, [0] * 256  # an opcode not in the table ends the scan; pickle refuses it
for _op in pickletools.opcodes:
    _code = ord(_op.code)
    _LAYOUT[_code] = _END if _op.name in _CODE else _ARG_KIND.get(_op.arg.n, _op.arg.n) if _op.arg else 0
    _UNITS[_code] = 0 if _op.name in _BUILDS_NOTHING else 3 if "SET" in _op.name else 1
_PUTS = {ord(c) for c in "pqr"}  # PUT, BINPUT, LONG_BINPUT: an index past the memo grows it to twice that


def _memo_index(arg: bytes, op: int) -> int:
    """The memo index of PUT (decimal digits and a newline), BINPUT or LONG_BINPUT (little-endian)."""
    return int(arg) if op == ord("p") else int.from_bytes(arg, "little")


def _objects_problem(raw: bytes, limit: int = OBJECT_LIMIT) -> str | None:
    """What the pickle would build beyond `limit` units (OBJECT_LIMIT), found by walking its
    opcodes without building anything; None when it stays within. Stops at the first opcode that
    names code, or at the end of the bytes: the unpickler refuses those before it gets past them."""
    layout, units = _LAYOUT, _UNITS
    pos, n, end = 0, 0, len(raw)
    try:
        while pos < end:
            op = raw[pos]
            kind = layout[op]
            pos = start = pos + 1
            if kind >= 0:
                pos += kind
            elif kind == _LEN1:
                pos += 1 + raw[pos]
            elif kind == _LEN4:
                pos += 4 + int.from_bytes(raw[pos : pos + 4], "little")
            elif kind == _LEN8:
                pos += 8 + int.from_bytes(raw[pos : pos + 8], "little")
            elif kind == _LINE:
                pos = raw.index(b"\n", pos) + 1
            else:
                return None
            n += units[op]
            if n > limit:
                return (
                    f"it would build more than {limit:,} objects (a 100,000-entry history builds about "
                    "13 million); record fewer with --memory-history-entries"
                )
            if op in _PUTS and _memo_index(raw[start:pos], op) > limit:
                return "it files an object in its memo at an index past any snapshot's objects"
    except (ValueError, IndexError):  # a truncated argument, a PUT that is no number: pickle names it
        return None
    return None


def _decompressed(path: str | Path, raw: bytes, limit: int) -> bytes:
    """The pickle's bytes: gunzipped when they are gzip's, at most `limit` of them."""
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(raw)) as f:
            raw = f.read(limit + 1)
    except (OSError, EOFError, zlib.error) as e:  # truncated, or not gzip after its two bytes
        raise SnapshotError(f"{path}: a damaged or truncated .gz ({type(e).__name__}: {e})") from None
    if len(raw) > limit:
        raise SnapshotError(f"{path}: more than {limit >> 20} MiB once decompressed")
    return raw


def load_snapshot(path: str | Path, limit: int = SNAPSHOT_LIMIT, objects: int = OBJECT_LIMIT) -> dict:
    """The snapshot at `path` (gzipped or not), as plain dicts and lists of the shape replay()
    reads (shape_problem). Raises SnapshotError, in one line: a snapshot too large in bytes or in
    objects is refused before it is built."""
    raw = _decompressed(path, read_bounded(path, limit), limit)
    if problem := _objects_problem(raw, objects):
        raise SnapshotError(f"{path}: refused: {problem}")
    try:
        snapshot = _PlainData(io.BytesIO(raw)).load()
    except SnapshotError:
        raise
    except Exception as e:  # a truncated or foreign file: pickle raises many kinds
        raise SnapshotError(f"{path}: not a memory snapshot ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(snapshot, dict) or "segments" not in snapshot:
        raise SnapshotError(f"{path}: not a memory snapshot (no 'segments')")
    if problem := shape_problem(snapshot):
        raise SnapshotError(f"{path}: not a memory snapshot of torch's layout: {problem}")
    return snapshot


def _is_int(v, top: int = 2**63) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < top


def _is_time(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and not isinstance(v, bool) and abs(v) < 2**63


def _what(v) -> str:
    """A value for a message, its repr cut short before it is made (a list of millions is not)."""
    return f"{type(v).__name__} {reprlib.repr(v)}"


def _frames_problem(frames, where: str) -> str | None:
    if frames is None:
        return None
    if not isinstance(frames, list) or not all(isinstance(f, dict) for f in frames):
        return f"{where}'s frames are {type(frames).__name__}, not a list of dicts"
    return None


def _fields_problem(item, where: str, fields: dict, required: tuple[str, ...] = ()) -> str | None:
    """item is a dict whose `fields` (name -> check) hold what they must, `required` ones present."""
    if not isinstance(item, dict):
        return f"{where} is {_what(item)}, not a dict"
    for key in required:
        if key not in item:
            return f"{where} has no {key!r}"
    for key, ok in fields.items():
        if key in item and not ok(item[key]):
            return f"{where}'s {key!r} is {_what(item[key])}"
    return _frames_problem(item.get("frames"), where)


_SEGMENT = {"device": _is_int, "total_size": _is_int}
_BLOCK = {
    "size": _is_int,
    "requested_size": lambda v: v is None or _is_int(v),  # None or 0: the block's size stands for it
    "address": lambda v: _is_int(v, 2**64),
}
_EVENT = {
    "size": _is_int,
    "addr": _BLOCK["address"],
    "time_us": _is_time,
    "action": lambda v: isinstance(v, str),
}
_ANNOTATION = {"time_us": _is_time}


def shape_problem(snapshot: dict) -> str | None:
    """The first field of a loaded snapshot that replay() could not read (a list where a number
    belongs, a block without its size, an annotation without its time), described; None when it
    has torch's layout. Every field replay() reads is checked here, so no TypeError or KeyError
    comes out of the replay of a hand-made file."""
    segments = snapshot.get("segments")
    if not isinstance(segments, list):
        return f"'segments' is {_what(segments)}, not a list"
    for i, seg in enumerate(segments):
        if problem := _fields_problem(seg, f"segments[{i}]", _SEGMENT):
            return problem
        blocks = seg.get("blocks", [])
        if not isinstance(blocks, list):
            return f"segments[{i}]'s 'blocks' is {_what(blocks)}, not a list"
        for j, b in enumerate(blocks):
            if problem := _fields_problem(b, f"segments[{i}].blocks[{j}]", _BLOCK, ("size", "address")):
                return problem
    traces = snapshot.get("device_traces")
    if traces is not None and not (isinstance(traces, list) and all(isinstance(t, list) for t in traces)):
        return f"'device_traces' is {_what(traces)}, not a list of lists"
    for d, events in enumerate(traces or []):
        for i, e in enumerate(events):
            if problem := _fields_problem(e, f"device_traces[{d}][{i}]", _EVENT):
                return problem
    annotations = snapshot.get("external_annotations")
    if annotations is not None and not isinstance(annotations, list):
        return f"'external_annotations' is {_what(annotations)}, not a list"
    for i, a in enumerate(annotations or []):
        if problem := _fields_problem(a, f"external_annotations[{i}]", _ANNOTATION, ("time_us",)):
            return problem
    return None


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
