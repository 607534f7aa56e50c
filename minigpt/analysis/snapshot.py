"""A CUDA memory snapshot as one offline page: allocated and reserved bytes over the recorded
steps with the stages marked, the peak, and the largest allocations live at the peak with the
frames of the code that made them. pytorch.org/memory_viz needs the network, and torch's own
trace_plot imports its viewer from a CDN; this page is plain HTML and SVG, no script at all.

    python -m minigpt snapshot runs/RUN                      # every snapshot of the run
    python -m minigpt snapshot runs/RUN/snapshots/rank0_snapshot.pickle [--out page.html]

Each page is written beside its pickle (rank0_snapshot.html); the report links them.
"""

from __future__ import annotations

import sys
from pathlib import Path

from minigpt.analysis.cuda_snapshot import (
    MiB,
    Replay,
    SnapshotError,
    allocated_when,
    load_snapshot,
    replay,
    stage_at,
    where,
)
from minigpt.analysis.html import RunError, esc, page, table, write_page
from minigpt.config import STAGE_NAMES, STAGES, ArgParser
from minigpt.errors import Fault, UsageError
from minigpt.fileio import check_names

W, H, LEFT, TOP, BOTTOM = 1240, 420, 70, 30, 40  # the chart's size and margins, in pixels
POINTS = 1500  # the most points a line draws: each keeps its bucket's highest value, the peak exactly
ROWS = 25  # allocations listed at the peak


def _window(r: Replay) -> tuple[int, int]:
    """The events the chart draws: from the first recorded step (start-up before it left out)."""
    return r.first_step_event, len(r.times)


def _line(r: Replay, values: list[int], lo: int, hi: int, x, y) -> str:
    """An SVG polyline of values[lo:hi], at most POINTS points: each keeps its bucket's maximum."""
    n = hi - lo
    step = max(1, -(-n // POINTS))
    pts = []
    for start in range(lo, hi, step):
        i = max(range(start, min(hi, start + step)), key=values.__getitem__)
        pts.append(f"{x(r.times[i]):.1f},{y(values[i]):.1f}")
    return " ".join(pts)


def _bands(r: Replay, t0: int, x) -> list[str]:
    """A band per stage range, a line and a label per step."""
    out, h = [], H - TOP - BOTTOM
    for name, s, e in r.stages:
        if e >= t0:
            left = x(max(s, t0))
            out.append(
                f'<rect x="{left:.1f}" y="{TOP}" width="{max(0.5, x(e) - left):.1f}" height="{h}" '
                f'fill="{STAGES.get(name, ("", "grey"))[1]}" opacity="0.13"><title>{esc(name)}</title></rect>'
            )
    for k, (s, _) in enumerate(r.steps, 1):
        if s >= t0:
            out.append(
                f'<line x1="{x(s):.1f}" x2="{x(s):.1f}" y1="{TOP - 12}" y2="{H - BOTTOM}" stroke="#999"/>'
            )
            out.append(f'<text x="{x(s) + 3:.1f}" y="{TOP - 2}" font-size="11">step {k}</text>')
    return out


def chart(r: Replay) -> str:
    """The SVG: stage bands, step labels, reserved (dashed) and allocated bytes, the peak."""
    lo, hi = _window(r)
    if hi <= lo:
        return "<p>no allocation events in the recording</p>"
    t0 = min(r.steps[0][0], r.times[lo]) if r.steps else r.times[lo]
    t1 = max(r.times[hi - 1], t0 + 1)
    top = max(max(r.reserved[lo:hi]), r.peak) * 1.05 or 1
    x = lambda t: LEFT + (W - LEFT - 10) * (t - t0) / (t1 - t0)  # noqa: E731
    y = lambda b: TOP + (H - TOP - BOTTOM) * (1 - b / top)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" class="snapshot">']
    out += _bands(r, t0, x)
    for frac in (0, 0.25, 0.5, 0.75, 1):
        b, yb = top / 1.05 * frac, y(top / 1.05 * frac)
        tick = f"{b / 2**30:.1f} GiB"
        out.append(f'<text x="{LEFT - 6}" y="{yb + 4:.1f}" font-size="11" text-anchor="end">{tick}</text>')
        out.append(f'<line x1="{LEFT}" x2="{W - 10}" y1="{yb:.1f}" y2="{yb:.1f}" stroke="#eee"/>')
    reserved, allocated = _line(r, r.reserved, lo, hi, x, y), _line(r, r.allocated, lo, hi, x, y)
    out.append(f'<polyline fill="none" stroke="#777" stroke-dasharray="5,3" points="{reserved}"/>')
    out.append(f'<polyline fill="none" stroke="#1f4e9c" stroke-width="1.5" points="{allocated}"/>')
    if r.peak_at >= lo:
        px, py = x(r.times[r.peak_at]), y(r.peak)
        anchor, dx = ("end", -8) if px > W * 0.7 else ("start", 8)
        out.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="5" fill="#c00"/>')
        out.append(
            f'<text x="{px + dx:.1f}" y="{py - 8:.1f}" font-size="12" fill="#c00" text-anchor="{anchor}">'
            f"peak {r.peak / MiB:,.1f} MiB</text>"
        )
    legend = ", ".join(f'<tspan fill="{STAGES[s][1]}">{s}</tspan>' for s in STAGE_NAMES)
    out.append(
        f'<text x="{LEFT}" y="{H - 12}" font-size="11">{(t1 - t0) / 1e6:.3f} s of the recording from '
        f"the first step; blue: allocated, dashed: reserved; bands: {legend}</text></svg>"
    )
    return "\n".join(out)


def summary(r: Replay, name: str) -> str:
    """The paragraph above the chart: the peak, when, and what the recording holds."""
    lo, _ = _window(r)
    if r.peak_at >= 0:
        step, stage = stage_at(r, r.times[r.peak_at])
        when = f"in recorded step {step}, {stage or 'between the stages'}" if step else "outside the steps"
        peak = (
            f"Peak allocated <b>{r.peak / MiB:,.1f} MiB</b> {when}, with {r.reserved[r.peak_at] / MiB:,.1f} "
            f"MiB reserved; {len(r.live_at_peak)} allocations were live then."
        )
    else:
        peak = f"Peak allocated {r.peak / MiB:,.1f} MiB, before the first recorded event."
    events = len(r.times)
    startup = (
        f" The first {lo:,} of them came before the first step (start-up), left out of the chart."
        if lo
        else ""
    )
    steps = f"{len(r.steps)} steps recorded" if r.steps else "no step ranges in the recording"
    return (
        f"<p>{esc(name)}: {events:,} allocator events, {steps}.{startup}</p><p>{peak} At the end: "
        f"{r.end_allocated / MiB:,.1f} MiB allocated, {r.end_reserved / MiB:,.1f} MiB reserved in "
        f"{r.segments_at_end} segments.</p><p>Bytes are what the tensors asked for, as the history "
        "records them; the allocator's max_memory_allocated counts its blocks, each rounded up to 512 B "
        "or handed out whole, so it reads a little higher.</p>"
    )


def live_table(r: Replay) -> str:
    """The allocations live at the peak, those made at the same place and moment of a step (the
    same frames, one per block) in one row, largest first: MiB, how many, when, where."""
    groups: dict[tuple[str, str, int], list[int]] = {}
    for b in r.live_at_peak:
        groups.setdefault((allocated_when(r, b), where(b, depth=4), b.size), []).append(b.size)
    ordered = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    rows = [
        [
            f"{sum(sizes) / MiB:,.2f}",
            f"{len(sizes)} x {size / MiB:,.2f}" if len(sizes) > 1 else "1",
            when,
            text,
        ]
        for (when, text, size), sizes in ordered[:ROWS]
    ]
    rest = [s for _, sizes in ordered[ROWS:] for s in sizes]
    if rest:
        rows.append([f"{sum(rest) / MiB:,.2f}", str(len(rest)), "", "(the other, smaller groups)"])
    headers = ["MiB", "blocks (x MiB)", "allocated", "where (innermost frame, then minigpt's own)"]
    return table(headers, rows, name_col=3)


def render(snapshot: dict, name: str) -> str:
    r = replay(snapshot, STAGE_NAMES)
    body = (
        f"<h1>CUDA memory snapshot: {esc(name)}</h1>\n{summary(r, name)}\n{chart(r)}\n"
        f"<h2>Live at the peak: {len(r.live_at_peak)} allocations, {r.peak / MiB:,.1f} MiB</h2>\n"
        f"{live_table(r)}"
    )
    return page(f"minigpt snapshot {name}", body)  # no chart script: plain HTML and SVG


def page_path(pickle_path: Path) -> Path:
    """rank0_snapshot.pickle(.gz) -> rank0_snapshot.html beside it."""
    base = pickle_path.name.removesuffix(".gz").removesuffix(".pickle")
    return pickle_path.with_name(f"{base}.html")


def write_snapshot_page(
    pickle_path: Path, out: Path | None = None, elsewhere: str = "--out", force: bool = False
) -> Path:
    """Read a snapshot (plain data only) and write its page; raises RunError for a bad snapshot,
    WouldOverwrite for an `out` that is not a page of minigpt's (without `force`)."""
    try:
        snapshot = load_snapshot(pickle_path)
    except (SnapshotError, OSError) as e:
        raise RunError(str(e)) from None
    out = out or page_path(pickle_path)
    write_page(out, render(snapshot, pickle_path.name), elsewhere, force)
    return out


def snapshots_of(path: Path) -> list[Path]:
    """A pickle itself, or every snapshot pickle of a run directory."""
    if path.is_file():
        return [path]
    found = sorted(
        p for p in (path / "snapshots").glob("*snapshot.pickle*") if p.suffix in (".pickle", ".gz")
    )
    if not found:
        raise RunError(f"{path}: no snapshots/*snapshot.pickle (train with --record-memory-history on CUDA)")
    return found


def main(argv: list[str] | None = None) -> int:
    p = ArgParser(prog="python -m minigpt snapshot", description="A CUDA memory snapshot as an offline page.")
    p.add_argument("path", type=Path, help="a run directory or a snapshot pickle (.pickle or .pickle.gz)")
    p.add_argument("--out", type=Path, help="where to write the page (one pickle only; default beside it)")
    p.add_argument(
        "--force", action="store_true", help="replace a file at --out that is not a page of minigpt's"
    )
    args = p.parse_args(argv)
    try:
        check_names((args.path, "path"), (args.out, "--out"))
        pickles = snapshots_of(args.path)
        if args.out is not None and len(pickles) > 1:
            raise RunError(f"--out names one page, but {args.path} holds {len(pickles)} snapshots")
    except (RunError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    status = 0
    for pickle_path in pickles:  # a bad pickle costs its own page only, and says which it is
        try:
            print(f"snapshot page: {write_snapshot_page(pickle_path, args.out, force=args.force)}")
        except (RunError, UsageError) as e:
            print(f"error: {e}", file=sys.stderr)
            status = status or 2
        except Fault as e:  # a full disk (fileio.DiskFull): the pages after it would not fit either
            print(f"error: {e}", file=sys.stderr)
            return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
