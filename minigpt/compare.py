"""Two runs side by side: where one is faster, lighter or better than the other, and why.

    python -m minigpt.compare runs/fp32 runs/amp                 # text tables
    python -m minigpt.compare runs/fp32 runs/amp --json          # one JSON object, for scripts
    python -m minigpt.compare runs/fp32 runs/amp --html amp.html # the report, with the second run

What the blog post this project grew from did by hand, screenshot by screenshot, for AMP against
fp32: each stage's host and device time in A and in B and their ratio (B / A); the runs' own
tokens/s over the steps alone and end to end and their start-up (metrics.jsonl's last record; "n/a
(older run)" where a trainer did not write them), the median interval's tokens/s, MFU, and peak
memory by category; the top host
operators and device kernels of the two traces matched by name, with what is new in B, gone from
A, or changed; and the losses at the steps both runs logged. Runs without traces compare without
the operator tables. Model shapes that differ are allowed (that may be the point of the
comparison) and flagged, since per-step figures are then not like for like.

benchmarks/ablation.py uses compare_runs() and format_compare() to explain its findings.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from minigpt.fileio import atomic_write
from minigpt.metrics import OLDER_RUN, RUN_KEYS
from minigpt.report import (
    MB,
    esc,
    figure,
    median,
    nodata,
    page,
    peak_memory,
    section,
    stage_medians,
    steady,
    summary_section,
    table,
    throughput,
)
from minigpt.runfiles import Run, RunError, load_run
from minigpt.stages import split_parent

TOP_COMPARE = 15  # operator / kernel rows shown: the largest differences per profiled step
CHANGED = 0.10  # a matched operator whose time moved by more than 10% is "changed", else "same":
# profiled steps of one run differ by a few percent between themselves
# Configuration keys that never explain a difference between two runs.
IGNORED_KEYS = {"out_dir", "checkpoint_path", "memory_snapshot_path", "resume"}
SHAPE_KEYS = ("n_layers", "n_heads", "d_model", "d_ff", "vocab_size", "max_position_embeddings")
# The run-wide figures compared: rows shown even where a run lacks them (OLDER_RUN says why).
RUN_ROWS = ("run_tokens_per_s", "tokens_per_s_e2e", "startup_s")
# Interval figures: medians over the steady logged steps; rows only where a run recorded them.
INTERVAL_ROWS = ("tokens_per_s", "tokens_per_s_per_rank", "mfu", "achieved_tflops", "peak_tflops")


def ratio(a, b) -> float | None:
    return b / a if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else None


def _describe(run: Run) -> dict:
    c = run.config
    return {
        "path": str(run.path),
        "name": run.name,
        "device": c.get("device"),
        "device_name": c.get("device_name"),
        "amp": c.get("amp"),
        "world_size": run.world_size,
        "model": c.get("model", {}),
        "params": c.get("params"),
        "traces": len(run.traces),
        "logged_steps": len(run.metrics),
    }


def _stage_rows(a: Run, b: Run) -> list[dict]:
    rows = []
    med = {
        k: (stage_medians(a, k), stage_medians(b, k))
        for k in ("stage_host_ms", "stage_device_ms", "stage_comm_ms")
    }
    names = list(dict.fromkeys([*med["stage_host_ms"][0], *med["stage_host_ms"][1]]))
    for n in names:
        row = {"stage": n}
        for key, out in (("stage_host_ms", "host"), ("stage_device_ms", "device"), ("stage_comm_ms", "comm")):
            va, vb = med[key][0].get(n), med[key][1].get(n)
            if va is None and vb is None:
                continue
            row[f"{out}_ms"] = [va, vb]
            row[f"{out}_ratio"] = ratio(va, vb)
        rows.append(row)
    return rows


def _trace_stage_rows(a: Run, b: Run) -> list[dict]:
    """Per profiled step, from rank 0's traces: host ms and (GPU) device busy ms per stage."""
    if not (a.traces and b.traces):
        return []
    ta, tb = a.traces[0], b.traces[0]
    na, nb = max(len(ta["steps"]), 1), max(len(tb["steps"]), 1)
    rows = []
    for n in dict.fromkeys([*ta["totals"]["stages"], *tb["totals"]["stages"]]):
        sa, sb = ta["totals"]["stages"].get(n, {}), tb["totals"]["stages"].get(n, {})
        row = {"stage": n, "host_ms": [sa.get("host_ms", 0) / na, sb.get("host_ms", 0) / nb]}
        row["host_ratio"] = ratio(*row["host_ms"])
        if "device_busy_ms" in sa or "device_busy_ms" in sb:
            row["device_busy_ms"] = [
                sa.get("device_busy_ms", 0) / na if "device_busy_ms" in sa else None,
                sb.get("device_busy_ms", 0) / nb if "device_busy_ms" in sb else None,
            ]
            row["device_ratio"] = ratio(*row["device_busy_ms"])
        rows.append(row)
    return rows


def _matched(rows_a: list[dict], rows_b: list[dict], key: str, steps_a: int, steps_b: int) -> list[dict]:
    """Rows of two traces matched by name, per profiled step, largest differences first."""
    a = {r["name"]: r for r in rows_a}
    b = {r["name"]: r for r in rows_b}
    out = []
    for name in dict.fromkeys([*a, *b]):
        va = a[name][key] / steps_a if name in a else None
        vb = b[name][key] / steps_b if name in b else None
        if va is None:
            status = "new"
        elif vb is None:
            status = "gone"
        else:
            r = ratio(va, vb)
            status = "changed" if r is None or abs(r - 1) > CHANGED else "same"
        out.append(
            {
                "name": name,
                "a_ms": va,
                "b_ms": vb,
                "delta_ms": (vb or 0.0) - (va or 0.0),
                "ratio": ratio(va, vb),
                "status": status,
                "calls": [
                    a[name]["calls"] / steps_a if name in a else None,
                    b[name]["calls"] / steps_b if name in b else None,
                ],
            }
        )
    out.sort(key=lambda r: abs(r["delta_ms"]), reverse=True)
    return out[:TOP_COMPARE]


def _losses(a: Run, b: Run, key: str) -> list[dict]:
    la = {r["step"]: r[key] for r in a.metrics if isinstance(r.get(key), (int, float)) and "step" in r}
    lb = {r["step"]: r[key] for r in b.metrics if isinstance(r.get(key), (int, float)) and "step" in r}
    return [
        {"step": s, "a": la[s], "b": lb[s], "delta": lb[s] - la[s]} for s in sorted(la.keys() & lb.keys())
    ]


def compare_loaded(a: Run, b: Run) -> dict:
    notes = []
    if a.path.resolve() == b.path.resolve():
        notes.append("A and B are the same run directory")
    ma, mb = a.config.get("model", {}), b.config.get("model", {})
    shape_diff = {k: [ma.get(k), mb.get(k)] for k in SHAPE_KEYS if ma.get(k) != mb.get(k)}
    if shape_diff:
        notes.append(
            "model shapes differ ("
            + ", ".join(f"{k} {x} vs {y}" for k, (x, y) in shape_diff.items())
            + "): per-step times, memory and losses are not like for like"
        )
    if a.config.get("device") != b.config.get("device"):
        notes.append(f"devices differ: {a.config.get('device')} vs {b.config.get('device')}")
    if a.world_size != b.world_size:
        notes.append(
            f"world sizes differ: {a.world_size} vs {b.world_size} (tokens/s is the job's; "
            "compare tokens/s per rank too)"
        )
    ca, cb = a.config.get("config", {}), b.config.get("config", {})
    config_diff = {
        k: [ca.get(k), cb.get(k)]
        for k in dict.fromkeys([*ca, *cb])
        if k not in IGNORED_KEYS and ca.get(k) != cb.get(k)
    }
    if "amp" in config_diff or a.config.get("amp") != b.config.get("amp"):
        config_diff["amp"] = [
            precision(ca.get("amp"), a.config.get("amp")),
            precision(cb.get("amp"), b.config.get("amp")),
        ]
    ta, tb = throughput(a), throughput(b)
    thr = []
    for k in (*RUN_ROWS, *INTERVAL_ROWS):
        if k in RUN_ROWS or ta.get(k) is not None or tb.get(k) is not None:
            thr.append({"metric": k, "a": ta.get(k), "b": tb.get(k), "ratio": ratio(ta.get(k), tb.get(k))})
    st = [median([r.get("step_time_s") for r in steady(x.metrics)]) for x in (a, b)]
    if any(v is not None for v in st):
        thr.append({"metric": "step_time_s", "a": st[0], "b": st[1], "ratio": ratio(*st)})
    pa, pb = peak_memory(a), peak_memory(b)
    memory = [
        {"category": k, "a": pa.get(k), "b": pb.get(k), "ratio": ratio(pa.get(k), pb.get(k))}
        for k in dict.fromkeys([*pa, *pb])
    ]
    if not memory:
        notes.append("no memory figures in either run (--memory-profiler measures a step)")
    ops = kernels = []
    if a.traces and b.traces:
        sa, sb = a.traces[0], b.traces[0]
        na, nb = max(len(sa["steps"]), 1), max(len(sb["steps"]), 1)
        ops = _matched(sa["operators"]["by_self"], sb["operators"]["by_self"], "self_ms", na, nb)
        kernels = _matched(sa.get("kernels") or [], sb.get("kernels") or [], "total_ms", na, nb)
    else:
        missing = " and ".join(x for x, r in (("A", a), ("B", b)) if not r.traces)
        notes.append(f"no trace in {missing}: operators and kernels not compared (run with --use-profiler)")
    losses = _losses(a, b, "loss")
    if not losses:
        notes.append("no common logged steps: losses not compared (log at the same steps: --log-interval)")
    return {
        "a": _describe(a),
        "b": _describe(b),
        "notes": notes + [f"A: {p}" for p in a.problems] + [f"B: {p}" for p in b.problems],
        "shape_diff": shape_diff,
        "config_diff": config_diff,
        "stages": _stage_rows(a, b),
        "trace_stages": _trace_stage_rows(a, b),
        "throughput": thr,
        "memory": memory,
        "operators": ops,
        "kernels": kernels,
        "losses": losses,
        "val_losses": _losses(a, b, "val_loss"),
    }


def precision(flag: bool | None, used: str | None) -> str:
    """What a run trained in, and the --amp flag that decided it: "bf16 (default)", "fp32 (--no-amp)"."""
    how = {True: "--amp", False: "--no-amp", None: "default"}.get(flag, f"--amp {flag}")
    return f"{used or 'precision not recorded'} ({how})"


def compare_runs(a: Path, b: Path) -> dict:
    """Compare two run directories (see the module docstring). Raises RunError for a folder that
    is not a run. Ratios are B / A."""
    return compare_loaded(load_run(Path(a)), load_run(Path(b)))


# ---------------------------------------------------------------------------- text


def _x(r) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def _v(x, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if x is None else f"{x * scale:,.{digits}f}"


def _table(head: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,)) -> list[str]:
    """Columns padded to their widest cell: the `left` ones left-aligned (names), numbers right."""
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]

    def fmt_row(r: list) -> str:
        cells = (str(c).ljust(w) if i in left else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        return "  ".join(cells).rstrip()

    return [fmt_row(head)] + [fmt_row(r) for r in rows]


THROUGHPUT_LABELS = {
    "run_tokens_per_s": ("tokens/s over the steps alone (run)", 1, 0),
    "tokens_per_s_e2e": ("tokens/s end to end (run)", 1, 0),
    "startup_s": ("start-up s (in neither rate)", 1, 2),
    "tokens_per_s": ("tokens/s per step, median interval", 1, 0),
    "tokens_per_s_per_rank": ("  per rank", 1, 0),
    "mfu": ("MFU %", 100, 1),
    "achieved_tflops": ("achieved TFLOP/s", 1, 3),
    "peak_tflops": ("MFU peak TFLOP/s", 1, 3),
    "step_time_s": ("step time ms", 1000, 1),
}


# peak_memory()'s categories (bytes) under names that do not contradict the MiB column they sit in.
MEMORY_LABELS = {
    "peak": "allocator peak (measured)",
    "total": "sum of the parts",
    "rss_peak_bytes": "process peak RSS",
    "peak_allocated_bytes": "CUDA peak allocated",
    "peak_reserved_bytes": "CUDA peak reserved",
    "cuda_max_allocated": "CUDA max allocated (measured step)",
    "cuda_max_reserved": "CUDA max reserved (measured step)",
}


def _run_v(metric: str, x, scale: float, digits: int) -> str:
    """A run-wide figure, or OLDER_RUN where a trainer before these keys did not write it."""
    return OLDER_RUN if x is None and metric in RUN_KEYS else _v(x, scale, digits)


def headline(d: dict, top: int = 2) -> str:
    """The comparison in one line, for a benchmark's findings: throughput, the stages that moved
    most, the operators that explain it, and the peak memory. Ratios are B / A."""
    parts = []
    thr = {r["metric"]: r for r in d["throughput"]}
    # Per step, the median interval after the first: a benchmark's convention (no warm-up in it),
    # named as such; the run-wide figures, warm-up included, are in the throughput table.
    for key, name in (
        ("tokens_per_s", "tokens/s (median interval)"),
        ("tokens_per_s_e2e", "tokens/s end to end"),
    ):
        if thr.get(key, {}).get("ratio") is not None:
            parts.append(f"{name} {_x(thr[key]['ratio'])}")
    moved = [r for r in d["stages"] if r.get("host_ratio") is not None and not split_parent(r["stage"])]
    moved.sort(key=lambda r: abs((r["host_ms"][1] or 0) - (r["host_ms"][0] or 0)), reverse=True)
    if moved:
        parts.append("stages " + ", ".join(f"{r['stage']} {_x(r['host_ratio'])}" for r in moved[:top]))
    ops = d["operators"][:top]
    if ops:
        parts.append(
            "operators "
            + ", ".join(
                f"{r['name']} {r['delta_ms']:+.1f} ms"
                + ("" if r["status"] in ("changed", "same") else f" ({r['status']})")
                for r in ops
            )
        )
    mem = {r["category"]: r for r in d["memory"]}
    key = "peak" if mem.get("peak", {}).get("ratio") is not None else "total"  # measured, else the sum
    if mem.get(key, {}).get("ratio") is not None:
        parts.append(f"{'peak memory' if key == 'peak' else 'memory (sum of parts)'} {_x(mem[key]['ratio'])}")
    return "; ".join(parts) or "nothing to compare"


def format_compare(d: dict) -> str:
    """The comparison as text tables (what `python -m minigpt.compare A B` prints)."""
    a, b = d["a"], d["b"]
    out = [
        *(
            f"{k}: {r['path']}  ({r['device']}, {r['amp']}, {r['world_size']} rank(s), "
            f"{r['logged_steps']} logged steps)"
            for k, r in (("A", a), ("B", b))
        ),
        "ratios are B / A; the run's figures from its last metrics record, the others medians over "
        "the logged steps after the first",
    ]
    out += [f"note: {n}" for n in d["notes"]]
    if d["config_diff"]:
        out += ["", "flags that differ:"] + [f"  {k}: {x} -> {y}" for k, (x, y) in d["config_diff"].items()]
    if d["throughput"]:
        rows = []
        for r in d["throughput"]:
            lab, scale, dig = THROUGHPUT_LABELS.get(r["metric"], (r["metric"], 1, 2))
            m = r["metric"]
            rows.append([lab, _run_v(m, r["a"], scale, dig), _run_v(m, r["b"], scale, dig), _x(r["ratio"])])
        out += [""] + _table(["throughput", "A", "B", "B/A"], rows)
    if d["stages"]:
        rows = []
        for r in d["stages"]:
            h, dv = r.get("host_ms", [None, None]), r.get("device_ms", [None, None])
            name = r["stage"] + (f" (in {split_parent(r['stage'])})" if split_parent(r["stage"]) else "")
            rows.append(
                [
                    name,
                    _v(h[0]),
                    _v(h[1]),
                    _x(r.get("host_ratio")),
                    _v(dv[0]),
                    _v(dv[1]),
                    _x(r.get("device_ratio")),
                ]
            )
        out += ["", "stage ms per step (metrics.jsonl)"] + _table(
            ["stage", "host A", "host B", "B/A", "device A", "device B", "B/A"], rows
        )
    if d["trace_stages"]:
        gpu = any("device_busy_ms" in r for r in d["trace_stages"])
        rows = []
        for r in d["trace_stages"]:
            row = [r["stage"], _v(r["host_ms"][0]), _v(r["host_ms"][1]), _x(r["host_ratio"])]
            if gpu:
                dv = r.get("device_busy_ms", [None, None])
                row += [_v(dv[0]), _v(dv[1]), _x(r.get("device_ratio"))]
            rows.append(row)
        head = ["stage", "host A", "host B", "B/A"] + (["busy A", "busy B", "B/A"] if gpu else [])
        out += ["", "stage ms per profiled step (traces, rank 0)"] + _table(head, rows)
    if d["memory"]:
        rows = [
            [
                MEMORY_LABELS.get(r["category"], r["category"]),
                _v(r["a"], 1 / MB),
                _v(r["b"], 1 / MB),
                _x(r["ratio"]),
            ]
            for r in d["memory"]
        ]
        out += ["", "peak memory MiB"] + _table(["category", "A", "B", "B/A"], rows)
    for key, title in (
        ("operators", "host operators, self ms per profiled step"),
        ("kernels", "device kernels, ms per profiled step"),
    ):
        if d[key]:
            rows = [
                [
                    r["status"],
                    _v(r["a_ms"]),
                    _v(r["b_ms"]),
                    f"{r['delta_ms']:+.2f}",
                    _x(r["ratio"]),
                    r["name"][:70],
                ]
                for r in d[key]
            ]
            out += ["", f"{title}: the {len(rows)} largest differences"] + _table(
                ["", "A", "B", "delta", "B/A", "name"], rows, left=(0, 5)
            )
    if d["losses"]:
        rows = [[str(r["step"]), f"{r['a']:.4f}", f"{r['b']:.4f}", f"{r['delta']:+.4f}"] for r in d["losses"]]
        vl = {r["step"]: r for r in d["val_losses"]}
        for row, r in zip(rows, d["losses"]):
            v = vl.get(r["step"])
            row += [f"{v['a']:.4f}", f"{v['b']:.4f}"] if v else ["", ""]
        out += ["", "losses at the steps both runs logged"] + _table(
            ["step", "train A", "train B", "B-A", "val A", "val B"], rows
        )
    return "\n".join(out)


# ---------------------------------------------------------------------------- HTML


def compare_html(d: dict, a: Run, b: Run) -> str:
    """The report of run A with run B beside it: both summaries, and each comparison as a chart."""
    import plotly.graph_objects as go

    parts = [f"<h1>minigpt: {esc(a.name)} (A) against {esc(b.name)} (B)</h1>"]
    parts += [f'<p class="problem">{esc(n)}</p>' for n in d["notes"]]
    parts.append(
        section(
            "summary",
            "Runs",
            '<div class="grid"><div><h3>A</h3>'
            + summary_section(a)
            + "</div><div><h3>B</h3>"
            + summary_section(b)
            + "</div></div>"
            + (
                table(["flag", "A", "B"], [[k, x, y] for k, (x, y) in d["config_diff"].items()])
                if d["config_diff"]
                else "<p>Same flags.</p>"
            ),
        )
    )
    body = ""
    if d["throughput"]:
        body += table(
            ["", "A", "B", "B/A"],
            [
                [
                    THROUGHPUT_LABELS.get(r["metric"], (r["metric"],))[0],
                    _run_v(r["metric"], r["a"], *THROUGHPUT_LABELS.get(r["metric"], ("", 1, 2))[1:]),
                    _run_v(r["metric"], r["b"], *THROUGHPUT_LABELS.get(r["metric"], ("", 1, 2))[1:]),
                    _x(r["ratio"]),
                ]
                for r in d["throughput"]
            ],
        )
    if d["stages"]:
        fig = go.Figure()
        for side, i in (("A", 0), ("B", 1)):
            rows = [r for r in d["stages"] if not split_parent(r["stage"])]
            fig.add_trace(
                go.Bar(
                    x=[f"{r['stage']} host" for r in rows] + [f"{r['stage']} device" for r in rows],
                    y=[r.get("host_ms", [0, 0])[i] for r in rows]
                    + [r.get("device_ms", [0, 0])[i] for r in rows],
                    name=side,
                )
            )
        fig.update_layout(barmode="group", yaxis_title="ms per step (median)")
        body += figure(fig, "compare-stages", 360)
    parts.append(
        section("stages", "Throughput and stage times", body or nodata("no logged steps in either run"))
    )
    if d["losses"]:
        fig = go.Figure()
        for side, run in (("A", a), ("B", b)):
            fig.add_trace(
                go.Scatter(
                    x=[r["step"] for r in run.metrics],
                    y=[r.get("loss") for r in run.metrics],
                    name=f"{side} train",
                    mode="lines+markers",
                )
            )
            val = [r for r in run.metrics if r.get("val_loss") is not None]
            fig.add_trace(
                go.Scatter(
                    x=[r["step"] for r in val],
                    y=[r["val_loss"] for r in val],
                    name=f"{side} val",
                    mode="lines+markers",
                    line=dict(dash="dot"),
                )
            )
        fig.update_layout(xaxis_title="step", yaxis_title="loss")
        body = figure(fig, "compare-losses", 340)
    else:
        body = nodata("no common logged steps: losses not compared")
    parts.append(section("curves", "Losses", body))
    body = ""
    for key, title in (
        ("operators", "host operators, self ms per profiled step"),
        ("kernels", "device kernels, ms per profiled step"),
    ):
        rows = d[key]
        if not rows:
            continue
        fig = go.Figure(
            go.Bar(
                y=[r["name"][:60] for r in reversed(rows)],
                x=[r["delta_ms"] for r in reversed(rows)],
                orientation="h",
                marker_color=["firebrick" if r["delta_ms"] > 0 else "seagreen" for r in reversed(rows)],
            )
        )
        fig.update_layout(title=f"{title}: B - A", xaxis_title="ms per profiled step")
        body += figure(fig, f"compare-{key}", 120 + 24 * len(rows))
        body += table(
            ["", "A", "B", "delta", "B/A", "name"],
            [
                [
                    (r["status"], r["status"]),
                    _v(r["a_ms"]),
                    _v(r["b_ms"]),
                    f"{r['delta_ms']:+.2f}",
                    _x(r["ratio"]),
                    r["name"],
                ]
                for r in rows
            ],
            name_col=5,
        )
    parts.append(
        section(
            "operators",
            "Operators and kernels",
            body or nodata("no trace in one of the runs: run both with --use-profiler"),
        )
    )
    if d["memory"]:
        fig = go.Figure()
        for side, key in (("A", "a"), ("B", "b")):
            fig.add_trace(
                go.Bar(
                    x=[MEMORY_LABELS.get(r["category"], r["category"]) for r in d["memory"]],
                    y=[(r[key] or 0) / MB for r in d["memory"]],
                    name=side,
                )
            )
        fig.update_layout(barmode="group", yaxis_title="MiB")
        body = figure(fig, "compare-memory", 340) + table(
            ["MiB", "A", "B", "B/A"],
            [
                [
                    MEMORY_LABELS.get(r["category"], r["category"]),
                    _v(r["a"], 1 / MB),
                    _v(r["b"], 1 / MB),
                    _x(r["ratio"]),
                ]
                for r in d["memory"]
            ],
        )
    else:
        body = nodata("no memory breakdown: run with --memory-profiler")
    parts.append(section("memory", "Peak memory", body))
    return page(f"minigpt: {a.name} vs {b.name}", "\n".join(parts))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line on stderr, exit 2, as for every other mistake
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="python -m minigpt.compare", description="Compare two training runs.")
    p.add_argument("run_a", type=Path, help="run directory A (the baseline)")
    p.add_argument("run_b", type=Path, help="run directory B (ratios are B / A)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument(
        "--html", type=Path, metavar="FILE", help="also write the comparison as an offline HTML page"
    )
    args = p.parse_args(argv)
    try:
        if args.html is not None and args.html.is_dir():
            raise RunError(
                f"--html {args.html} is a folder; give a file name such as {args.html / 'compare.html'}"
            )
        a, b = load_run(args.run_a), load_run(args.run_b)
        d = compare_loaded(a, b)
        if args.html is not None:
            atomic_write(args.html, compare_html(d, a, b))
    except (RunError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        print(json.dumps(d, indent=1) if args.json else format_compare(d))
        if args.html is not None and not args.json:
            print(f"\nhtml: {args.html}")
        sys.stdout.flush()
    except BrokenPipeError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
