"""Two runs side by side: where one is faster, lighter or better than the other, and why.

    python -m minigpt compare runs/fp32 runs/amp                 # text tables
    python -m minigpt compare runs/fp32 runs/amp --json          # one JSON object, for scripts
    python -m minigpt compare runs/fp32 runs/amp --html amp.html # the report, with the second run

What the blog post that minigpt's command line follows did by hand, screenshot by screenshot, for AMP against
fp32: each stage's host and device time in A and in B and their ratio (B / A); the runs' own
tokens/s in steady state (warm-up left out), end to end, their MFU and start-up (metrics.jsonl's
last record, "n/a" where it lacks one), the logged intervals' tokens/s and MFU as the trainer
recorded them (geometric means, the ratio theirs), and peak memory by
category; the top host operators and device kernels of the two traces matched by name, with what
is new in B, gone from A, or changed; and the losses at the steps both runs logged. Runs without
traces compare without the operator tables.

Every timing ratio comes with its 95% interval (minigpt.analysis.stats: Welch's t on the log samples), and
one whose interval holds 1.0 adds "no difference within noise". The samples are the logged
intervals that hold a steady step, each the mean of its steady steps (the warm-up and the steps an
instrument slows are left out of every interval, the first included), and the profiled steps
of the traces: they measure a run's step-to-step noise, not the noise between processes (repeat
in fresh processes for that: the benchmarks do). With fewer than stats.MIN_SAMPLES logged intervals
after warm-up in a run, no ratio is claimed: the output says how many there were and what to
rerun with. The run-wide figures are one per run and get no interval; memory figures are counts.

Runs of different models (shapes) or of different machines (device, device name, versions) are
refused with one line, exit 2: their per-step figures are not like for like. --allow-different
compares them anyway, and the output says so. A run whose steady steps ran busy (other processes
took more than config.BUSY of the cores in more than that share of them) gets one line saying so,
and no timing ratio is claimed from it.

benchmarks/ablation.py uses compare_runs() and headline() to explain its findings.
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path

from minigpt.analysis.html import check_page_path, esc, page, table, write_page
from minigpt.analysis.report import (
    MB,
    figure,
    median,
    nodata,
    peak_memory,
    section,
    stage_medians,
    steady,
    summary_section,
    throughput,
)
from minigpt.analysis.runfiles import Run, RunError, load_run
from minigpt.analysis.stats import MIN_SAMPLES, RatioInterval, needed_samples, ratio_interval
from minigpt.config import BUSY, SPLITS, ArgParser
from minigpt.errors import Fault, UsageError
from minigpt.fileio import check_names

TOP_COMPARE = 15  # operator / kernel rows shown: the largest differences per profiled step
CHANGED = 0.10  # a matched operator whose time moved by more than 10% is "changed", else "same":
# profiled steps of one run differ by a few percent between themselves
# Configuration keys that never explain a difference between two runs.
IGNORED_KEYS = {"out_dir", "checkpoint_path", "memory_snapshot_path", "resume"}
SHAPE_KEYS = ("n_layers", "n_heads", "d_model", "d_ff", "vocab_size", "max_position_embeddings")
# The run-wide figures compared (metrics.jsonl's last record): rows shown even where a run lacks them.
RUN_ROWS = ("run_tokens_per_s", "tokens_per_s_e2e", "run_mfu", "startup_s")
# Interval figures: medians over the steady logged steps; rows only where a run recorded them.
INTERVAL_ROWS = ("tokens_per_s", "tokens_per_s_per_rank", "mfu", "achieved_tflops", "peak_tflops")
# What config.json says of the machine: runs that differ in one of these are not like for like.
MACHINE_KEYS = ("device", "device_name", "versions")
# The samples of each kind of ratio, as RatioInterval.method names them.
FROM_INTERVALS = "Welch t on log samples: logged intervals after warm-up (one run each)"
FROM_PROFILED = "Welch t on log samples: profiled steps (one trace each)"
INTERVAL_UNIT = (
    "logged interval of steady steps (warm-up left out)",
    "logged intervals of steady steps (warm-up left out)",
)
ONE_FIGURE = "one figure per run: no interval"
TOO_FEW = "too few samples"
NOT_QUIET = "no verdict: a run ran busy"


def ratio(a, b) -> float | None:
    return b / a if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else None


def after_warmup(run: Run) -> list[dict]:
    """The logged intervals with a steady step (report.steady): the samples of every interval.
    Unlike the report's page, a run whose intervals are all warm-up has none."""
    return steady(run.metrics, fallback=False)


def samples(records: list[dict], key: str, sub: str | None = None) -> list[float]:
    """One figure per record: record[key], or record[key][sub] (a stage); missing ones skipped."""
    out = []
    for r in records:
        v = r.get(key)
        if sub is not None:
            v = v.get(sub) if isinstance(v, dict) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append(float(v))
    return out


def interval_of(a: list[float], b: list[float], method: str) -> tuple[RatioInterval | None, str]:
    """B / A's interval and what to print in its place: the verdict; TOO_FEW below MIN_SAMPLES a
    side; "-" where a side never recorded the figure, or has a zero (a stage that takes no time
    here: a ratio of it means nothing)."""
    if not a and not b or (not a or not b) and max(len(a), len(b)) >= MIN_SAMPLES:
        return None, "-"
    if needed_samples(len(a), len(b)):
        return None, TOO_FEW
    if min(a) <= 0 or min(b) <= 0:
        return None, "-"
    iv = ratio_interval(a, b, method=method)
    return iv, verdict(iv)


def verdict(iv: RatioInterval) -> str:
    """The ratio with its 95% interval, and what a reader may conclude from it when the interval
    holds 1.0: "1.02x (0.98-1.06): no difference within noise", else "1.23x (1.10-1.38)"."""
    return f"{iv.ratio:.2f}x ({iv.low:.2f}-{iv.high:.2f})" + (": no difference within noise" * iv.holds_one)


def _set_interval(
    row: dict, a: list[float], b: list[float], method: str, prefix: str = "", short: bool = False
) -> None:
    """Add `prefix`interval and `prefix`verdict to a row; `short`: the runs have too few logged
    intervals after warm-up, so a figure they hold (from the warm-up alone) gets TOO_FEW.

    One definition for the three figures of a row: where B/A has an interval, A and B become the
    geometric means of the samples it is computed from, and the ratio theirs, so the printed B/A
    is the printed B over the printed A (the ratio of geometric means is what Welch's t on the logs
    estimates; beside medians it read "20.73 -> 573.77, 9.45x"). Without an interval the row keeps
    the medians and their ratio."""
    iv, text = interval_of(a, b, method)
    if short and text == "-" and not (a and b and min(a + b) <= 0):
        text = TOO_FEW
    row[f"{prefix}interval"] = {**iv.to_json(), "verdict": text} if iv else None
    row[f"{prefix}verdict"] = text
    if iv:
        figures, ratio_key = (f"{prefix}ms", f"{prefix}ratio") if prefix else ("", "ratio")
        if figures:
            row[figures] = [geometric_mean(a), geometric_mean(b)]
        else:
            row["a"], row["b"] = geometric_mean(a), geometric_mean(b)
        row[ratio_key] = iv.ratio


def geometric_mean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def different(a: Run, b: Run) -> list[str]:
    """What makes two runs not like for like: a model shape or the machine, one phrase each
    ("d_model 64 vs 128", "device_name x vs y", "torch 2.13.0 vs 2.12.0"); empty when alike."""
    ma, mb = a.config.get("model", {}), b.config.get("model", {})
    out = [f"{k} {ma.get(k)} vs {mb.get(k)}" for k in SHAPE_KEYS if ma.get(k) != mb.get(k)]
    for k in MACHINE_KEYS:
        va, vb = a.config.get(k), b.config.get(k)
        if isinstance(va, dict) or isinstance(vb, dict):
            va, vb = va or {}, vb or {}
            out += [
                f"{n} {va.get(n)} vs {vb.get(n)}" for n in dict.fromkeys([*va, *vb]) if va.get(n) != vb.get(n)
            ]
        elif va != vb:
            out.append(f"{k} {va} vs {vb}")
    return out


def _mismatch(a: Run, b: Run) -> str | None:
    """The one line that refuses runs of different models or machines, or None."""
    ma, mb = a.config.get("model", {}), b.config.get("model", {})
    model = any(ma.get(k) != mb.get(k) for k in SHAPE_KEYS)
    machine = any(a.config.get(k) != b.config.get(k) for k in MACHINE_KEYS)
    if not (model or machine):
        return None
    what = " and ".join(w for w, x in (("different models", model), ("different machines", machine)) if x)
    return f"A and B are {what} ({', '.join(different(a, b))})"


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
        "intervals_after_warmup": len(after_warmup(run)),
    }


def _stage_rows(a: Run, b: Run) -> list[dict]:
    rows = []
    med = {
        k: (stage_medians(a, k), stage_medians(b, k))
        for k in ("stage_host_ms", "stage_device_ms", "stage_comm_ms")
    }
    names = list(dict.fromkeys([*med["stage_host_ms"][0], *med["stage_host_ms"][1]]))
    wa, wb = after_warmup(a), after_warmup(b)
    short = needed_samples(len(wa), len(wb)) is not None
    for n in names:
        row = {"stage": n}
        for key, out in (("stage_host_ms", "host"), ("stage_device_ms", "device"), ("stage_comm_ms", "comm")):
            va, vb = med[key][0].get(n), med[key][1].get(n)
            if va is None and vb is None:
                continue
            row[f"{out}_ms"] = [va, vb]
            row[f"{out}_ratio"] = ratio(va, vb)
            _set_interval(row, samples(wa, key, n), samples(wb, key, n), FROM_INTERVALS, f"{out}_", short)
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
        per_a = [s["stages"][n] for s in ta["steps"] if n in s.get("stages", {})]
        per_b = [s["stages"][n] for s in tb["steps"] if n in s.get("stages", {})]
        _set_interval(row, samples(per_a, "host_ms"), samples(per_b, "host_ms"), FROM_PROFILED, "host_")
        if "device_busy_ms" in sa or "device_busy_ms" in sb:
            row["device_busy_ms"] = [
                sa.get("device_busy_ms", 0) / na if "device_busy_ms" in sa else None,
                sb.get("device_busy_ms", 0) / nb if "device_busy_ms" in sb else None,
            ]
            row["device_ratio"] = ratio(*row["device_busy_ms"])
            _set_interval(
                row,
                samples(per_a, "device_busy_ms"),
                samples(per_b, "device_busy_ms"),
                FROM_PROFILED,
                "device_",
            )
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


def compare_loaded(a: Run, b: Run, allow_different: bool = False) -> dict:
    """compare_runs() on runs already loaded."""
    mismatch = _mismatch(a, b)
    if mismatch and not allow_different:
        raise RunError(
            f"{mismatch}: their per-step figures are not like for like; "
            "pass --allow-different to compare them anyway"
        )
    notes = []
    if mismatch:
        notes.append(
            f"{mismatch}, compared anyway (--allow-different): per-step figures are not like for like"
        )
    if a.path.resolve() == b.path.resolve():
        notes.append("A and B are the same run directory")
    ma, mb = a.config.get("model", {}), b.config.get("model", {})
    shape_diff = {k: [ma.get(k), mb.get(k)] for k in SHAPE_KEYS if ma.get(k) != mb.get(k)}
    n_a, n_b = len(after_warmup(a)), len(after_warmup(b))
    shortfall = _shortfall(a, b)
    if a.world_size != b.world_size:
        notes.append(
            f"world sizes differ: {a.world_size} vs {b.world_size} (tokens/s is the job's; "
            "compare tokens/s per rank too)"
        )
    pa, pb = peak_memory(a), peak_memory(b)
    memory = [
        {"category": k, "a": pa.get(k), "b": pb.get(k), "ratio": ratio(pa.get(k), pb.get(k))}
        for k in dict.fromkeys([*pa, *pb])
    ]
    if not memory:
        notes.append("no memory figures in either run (--memory-profiler measures a step)")
    ops, kernels = _matched_traces(a, b, notes)
    losses = _losses(a, b, "loss")
    if not losses:
        notes.append("no common logged steps: losses not compared (log at the same steps: --log-interval)")
    peaks = [x.config.get("peak_flops") for x in (a, b)]
    if None not in peaks and peaks[0] != peaks[1]:
        notes.append("A and B measured MFU against different peaks: their MFU is not like for like")
    d = {
        "a": _describe(a),
        "b": _describe(b),
        "notes": notes + [f"A: {p}" for p in a.problems] + [f"B: {p}" for p in b.problems],
        # The samples every timing interval rests on, and the line that says why none was claimed.
        "samples": {"a": n_a, "b": n_b, "needed": MIN_SAMPLES, "shortfall": shortfall},
        "allowed_different": mismatch,
        "shape_diff": shape_diff,
        "config_diff": _config_diff(a, b),
        "stages": _stage_rows(a, b),
        "trace_stages": _trace_stage_rows(a, b),
        "throughput": _throughput(a, b, bool(shortfall)),
        "memory": memory,
        "operators": ops,
        "kernels": kernels,
        "losses": losses,
        "val_losses": _losses(a, b, "val_loss"),
        "busy": [line for side, run in (("A", a), ("B", b)) if (line := busy_line(side, run))],
    }
    if d["busy"]:
        for row in (*d["stages"], *d["trace_stages"], *d["throughput"]):
            _withhold(row)
    return d


def busy_line(side: str, run: Run) -> str | None:
    """The line for a run whose steady steps ran busy (its last record's run_busy above config.BUSY):
    its timings measure the other processes too. None for a quiet run, or one that did not say."""
    t = throughput(run)
    if (t["run_busy"] or 0) <= BUSY:
        return None
    took = f"{t['busy']:.0%}" if t["busy"] is not None else f"over {BUSY:.0%}"
    return (
        f"run {side} ran busy (others took {took} of the cores in {t['run_busy']:.0%} of its steady "
        "steps): re-run on a quiet machine"
    )


def _withhold(row: dict) -> None:
    """No verdict from a busy run: each interval of the row is dropped, its verdict says why."""
    for key in [k for k in row if k.endswith("interval") and row[k] is not None]:
        row[key], row[key.removesuffix("interval") + "verdict"] = None, NOT_QUIET


def _shortfall(a: Run, b: Run) -> str | None:
    """Why no timing ratio is claimed (too few logged intervals after warm-up), with the flags
    that give enough; None when both runs have MIN_SAMPLES."""
    shortfall = needed_samples(len(after_warmup(a)), len(after_warmup(b)), MIN_SAMPLES, INTERVAL_UNIT, "run")
    if shortfall:
        every = max(int(x.config.get("config", {}).get("log_interval") or 1) for x in (a, b))
        shortfall += (
            f": rerun with --num-steps {(MIN_SAMPLES + 1) * every} or more at --log-interval {every}, "
            "or a smaller --log-interval"
        )
    return shortfall


def _config_diff(a: Run, b: Run) -> dict[str, list]:
    """The flags that differ, {flag: [A's, B's]}, and the precision each run trained in."""
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
    return config_diff


def _throughput(a: Run, b: Run, short: bool) -> list[dict]:
    """The throughput rows: the run-wide figures (one per run), the interval medians with their
    intervals, and the median step time."""
    ta, tb = throughput(a), throughput(b)
    wa, wb = after_warmup(a), after_warmup(b)
    thr = []
    for k in (*RUN_ROWS, *INTERVAL_ROWS):
        if k in RUN_ROWS or ta.get(k) is not None or tb.get(k) is not None:
            row = {"metric": k, "a": ta.get(k), "b": tb.get(k), "ratio": ratio(ta.get(k), tb.get(k))}
            if k in RUN_ROWS:
                row["interval"], row["verdict"] = None, ONE_FIGURE if row["ratio"] is not None else "-"
            elif k == "peak_tflops":  # the MFU denominator: a data sheet or a measurement, not a timing
                dtypes = [x.get("peak_flops_dtype") or "dtype not recorded" for x in (ta, tb)]
                row["interval"], row["verdict"] = None, _x(row["ratio"]) + " (" + " vs ".join(dtypes) + ")"
            else:
                _set_interval(row, samples(wa, k), samples(wb, k), FROM_INTERVALS, short=short)
            thr.append(row)
    st = [median([r.get("step_time_s") for r in steady(x.metrics)]) for x in (a, b)]
    if any(v is not None for v in st):
        row = {"metric": "step_time_s", "a": st[0], "b": st[1], "ratio": ratio(*st)}
        _set_interval(
            row, samples(wa, "step_time_s"), samples(wb, "step_time_s"), FROM_INTERVALS, short=short
        )
        thr.append(row)
    return thr


def _matched_traces(a: Run, b: Run, notes: list[str]) -> tuple[list[dict], list[dict]]:
    """The operators and the kernels of rank 0's traces matched by name; a note when a run has none."""
    if not (a.traces and b.traces):
        missing = " and ".join(x for x, r in (("A", a), ("B", b)) if not r.traces)
        notes.append(f"no trace in {missing}: operators and kernels not compared (run with --use-profiler)")
        return [], []
    sa, sb = a.traces[0], b.traces[0]
    na, nb = max(len(sa["steps"]), 1), max(len(sb["steps"]), 1)
    ops = _matched(sa["operators"]["by_self"], sb["operators"]["by_self"], "self_ms", na, nb)
    kernels = _matched(sa.get("kernels") or [], sb.get("kernels") or [], "total_ms", na, nb)
    return ops, kernels


def precision(flag: bool | None, used: str | None) -> str:
    """What a run trained in, and the --amp flag that decided it: "bf16 (default)", "fp32 (--no-amp)"."""
    how = {True: "--amp", False: "--no-amp", None: "default"}.get(flag, f"--amp {flag}")
    return f"{used or 'precision not recorded'} ({how})"


def compare_runs(a: Path, b: Path, allow_different: bool = False) -> dict:
    """Compare two run directories (see the module docstring). Raises RunError for a folder that
    is not a run, and for runs of different models or machines unless `allow_different`. Ratios
    are B / A: each row's "ratio" is the point figure alone; "verdict" is what may be said of it
    (its interval, "no difference within noise", TOO_FEW, ONE_FIGURE) and "interval" the
    RatioInterval's fields, None where there is none."""
    return compare_loaded(load_run(Path(a)), load_run(Path(b)), allow_different)


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
    "run_tokens_per_s": ("tokens/s in steady state (run)", 1, 0),
    "tokens_per_s_e2e": ("tokens/s end to end (run)", 1, 0),
    "startup_s": ("start-up s (run; in neither rate)", 1, 2),
    "tokens_per_s": ("tokens/s per step, intervals", 1, 0),
    "tokens_per_s_per_rank": ("  per rank", 1, 0),
    "run_mfu": ("MFU % (run)", 100, 1),
    "mfu": ("MFU %, intervals", 100, 1),
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
    """A run-wide figure, or "n/a" where the run's last record lacks it."""
    return "n/a" if x is None and metric in RUN_ROWS else _v(x, scale, digits)


def _claim(name: str, row: dict, prefix: str = "") -> str:
    """One ratio for the headline: "forward 0.50x (0.48-0.52)", "forward 1.02x (0.98-1.06): no
    difference within noise", "forward: -" (a colon where there is no ratio)."""
    has_ratio = row.get(f"{prefix}interval") is not None
    return f"{name}{' ' if has_ratio else ': '}{row.get(f'{prefix}verdict', '-')}"


def headline(d: dict, top: int = 2) -> str:
    """The comparison in one line, for a benchmark's findings: throughput, the stages that moved
    most, the operators that explain it, and the peak memory. Ratios are B / A, each with its 95%
    interval; with too few logged intervals the line says so instead of a ratio."""
    if d["busy"] or d["samples"]["shortfall"]:
        parts = [*d["busy"], *filter(None, [d["samples"]["shortfall"]])]
    else:
        parts = []
        thr = {r["metric"]: r for r in d["throughput"]}
        # Per step, over the logged intervals' steady steps (no warm-up in them). The run-wide
        # figures are one per run, with no interval: they stay in the throughput table.
        if thr.get("tokens_per_s", {}).get("verdict", "-") != "-":
            parts.append(_claim("tokens/s per step", thr["tokens_per_s"]))
        moved = [r for r in d["stages"] if r.get("host_ratio") is not None and r["stage"] not in SPLITS]
        moved.sort(key=lambda r: abs((r["host_ms"][1] or 0) - (r["host_ms"][0] or 0)), reverse=True)
        if moved:
            parts.append("stages " + ", ".join(_claim(r["stage"], r, "host_") for r in moved[:top]))
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
    if mem.get(key, {}).get("ratio") is not None:  # bytes: a count, no noise to allow for
        parts.append(f"{'peak memory' if key == 'peak' else 'memory (sum of parts)'} {_x(mem[key]['ratio'])}")
    return "; ".join(parts) or "nothing to compare"


def _throughput_rows(d: dict) -> list[list[str]]:
    """label, A, B, verdict per throughput row: what the text table and the page show."""
    rows = []
    for r in d["throughput"]:
        lab, scale, dig = THROUGHPUT_LABELS.get(r["metric"], (r["metric"], 1, 2))
        lab = r.get("label", lab)
        m = r["metric"]
        rows.append([lab, _run_v(m, r["a"], scale, dig), _run_v(m, r["b"], scale, dig), r["verdict"]])
    return rows


def _stage_cells(r: dict) -> list[str]:
    """host A, host B, its verdict, device A, device B, its verdict of one stage row."""
    h, dv = r.get("host_ms", [None, None]), r.get("device_ms", [None, None])
    return [
        _v(h[0]),
        _v(h[1]),
        r.get("host_verdict", "-"),
        _v(dv[0]),
        _v(dv[1]),
        r.get("device_verdict", "-"),
    ]


def _memory_rows(d: dict) -> list[list[str]]:
    return [
        [
            MEMORY_LABELS.get(r["category"], r["category"]),
            _v(r["a"], 1 / MB),
            _v(r["b"], 1 / MB),
            _x(r["ratio"]),
        ]
        for r in d["memory"]
    ]


def _matched_cells(r: dict) -> list[str]:
    """A, B, delta and B/A of one matched operator or kernel."""
    return [_v(r["a_ms"]), _v(r["b_ms"]), f"{r['delta_ms']:+.2f}", _x(r["ratio"])]


MATCHED_TABLES = (
    ("operators", "host operators, self ms per profiled step"),
    ("kernels", "device kernels, ms per profiled step"),
)


# What the text's figures are, in sentences of at most 160 characters a line.
HEADER = (
    "B/A is B over A with its 95% interval: Welch's t over the logged intervals' steady steps (warm-up "
    "left out),",
    "  which measures each run's step-to-step noise, not the noise between processes. An interval that "
    'holds 1.0 adds "no difference within noise".',
    'Rows marked "(run)" hold each run\'s figure from its last metrics record: one figure per run, so no '
    "interval.",
    "The other rows hold the geometric means of the logged intervals' steady steps and B/A their ratio "
    "(the medians' where there is no interval).",
)


def _prose(text: str, width: int = 160) -> list[str]:
    """A sentence of the text's head as lines of at most `width` characters, continuations indented."""
    return [x for line in text.split("\n") for x in textwrap.wrap(line, width, subsequent_indent="  ")]


def format_compare(d: dict) -> str:
    """The comparison as text tables (what `python -m minigpt compare A B` prints)."""
    a, b = d["a"], d["b"]
    out = [
        *(
            f"{k}: {r['path']}  ({r['device']}, {r['amp']}, {r['world_size']} rank(s), "
            f"{r['logged_steps']} logged steps)"
            for k, r in (("A", a), ("B", b))
        ),
        *HEADER,
    ]
    if d["samples"]["shortfall"]:  # the advice on a line of its own
        out += _prose(f"no ratio claimed: {d['samples']['shortfall']}".replace(": rerun", ":\n  rerun"))
    for line in [*d["busy"], *(f"note: {n}" for n in d["notes"])]:
        out += _prose(line)
    if d["config_diff"]:
        out += ["", "flags that differ:"] + [f"  {k}: {x} -> {y}" for k, (x, y) in d["config_diff"].items()]
    if d["throughput"]:
        out += [""] + _table(["throughput", "A", "B", "B/A (95% interval)"], _throughput_rows(d), left=(0, 3))
    out += _stage_lines(d)
    if d["memory"]:
        out += ["", "peak memory MiB (counted, not timed: no interval)"] + _table(
            ["category", "A", "B", "B/A"], _memory_rows(d)
        )
    for key, title in MATCHED_TABLES:
        if d[key]:
            rows = [[r["status"], *_matched_cells(r), r["name"][:70]] for r in d[key]]
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


def _stage_lines(d: dict) -> list[str]:
    """The stage tables: per step from metrics.jsonl, and per profiled step from the traces."""
    out = []
    if d["stages"]:
        rows = [
            [
                r["stage"] + (f" (in {SPLITS[r['stage']]})" if r["stage"] in SPLITS else ""),
                *_stage_cells(r),
            ]
            for r in d["stages"]
        ]
        title = "stage ms per step (metrics.jsonl; geometric means of the intervals; B/A theirs, 95% CI)"
        head = ["stage", "host A", "host B", "B/A", "device A", "device B", "B/A"]
        if all(r.get("device_ms") == r.get("host_ms") for r in d["stages"]):  # a CPU's one clock
            head, rows = ["stage", "ms A", "ms B", "B/A"], [row[:4] for row in rows]
        out += ["", title] + _table(head, rows, left=(0, 3, 6))
    if d["trace_stages"]:
        gpu = any("device_busy_ms" in r for r in d["trace_stages"])
        rows = []
        for r in d["trace_stages"]:
            row = [r["stage"], _v(r["host_ms"][0]), _v(r["host_ms"][1]), r.get("host_verdict", "-")]
            if gpu:
                dv = r.get("device_busy_ms", [None, None])
                row += [_v(dv[0]), _v(dv[1]), r.get("device_verdict", "-")]
            rows.append(row)
        head = ["stage", "host A", "host B", "B/A"] + (["busy A", "busy B", "B/A"] if gpu else [])
        out += ["", "stage ms per profiled step (traces, rank 0; B/A over the profiled steps)"] + _table(
            head, rows, left=(0, 3, 6)
        )
    return out


# ---------------------------------------------------------------------------- HTML


def compare_html(d: dict, a: Run, b: Run) -> str:
    """The report of run A with run B beside it: both summaries, and each comparison as a chart."""
    parts = [f"<h1>minigpt: {esc(a.name)} (A) against {esc(b.name)} (B)</h1>"]
    if d["samples"]["shortfall"]:
        parts.append(f'<p class="problem">No ratio claimed: {esc(d["samples"]["shortfall"])}.</p>')
    parts += [f'<p class="problem">{esc(line)}.</p>' for line in d["busy"]]
    parts += [f'<p class="problem">{esc(n)}</p>' for n in d["notes"]]
    parts.append(
        "<p>Ratios are B / A with their 95% interval over the logged intervals' steady steps (warm-up "
        "left out; Welch t on the log samples: each run's step-to-step noise, not the noise between "
        "processes); an interval that holds 1.0 adds &ldquo;no difference within noise&rdquo;.</p>"
    )
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
    parts.append(
        section(
            "stages", "Throughput and stage times", _stages_html(d) or nodata("no logged steps in either run")
        )
    )
    parts.append(
        section(
            "curves",
            "Losses",
            _losses_html(a, b) if d["losses"] else nodata("no common logged steps: losses not compared"),
        )
    )
    parts.append(
        section(
            "operators",
            "Operators and kernels",
            _matched_html(d) or nodata("no trace in one of the runs: run both with --use-profiler"),
        )
    )
    parts.append(section("memory", "Peak memory", _memory_html(d)))
    return page(f"minigpt: {a.name} vs {b.name}", "\n".join(parts))


def _stages_html(d: dict) -> str:
    """The throughput table, and each stage's median host and device ms in A and B, drawn and listed."""
    import plotly.graph_objects as go

    body = ""
    if d["throughput"]:
        body += table(["", "A", "B", "B/A (95% interval)"], _throughput_rows(d))
    if d["stages"]:
        fig = go.Figure()
        for side, i in (("A", 0), ("B", 1)):
            rows = [r for r in d["stages"] if r["stage"] not in SPLITS]
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
        body += table(
            ["stage ms per step", "host A", "host B", "B/A (95% interval)", "device A", "device B", "B/A"],
            [[r["stage"], *_stage_cells(r)] for r in d["stages"]],
        )
    return body


def _losses_html(a: Run, b: Run) -> str:
    """Both runs' train and validation losses on one chart."""
    import plotly.graph_objects as go

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
    return figure(fig, "compare-losses", 340)


def _matched_html(d: dict) -> str:
    """The operators and kernels that moved most, B - A per profiled step, drawn and listed."""
    import plotly.graph_objects as go

    body = ""
    for key, title in MATCHED_TABLES:
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
            [[(r["status"], r["status"]), *_matched_cells(r), r["name"]] for r in rows],
            name_col=5,
        )
    return body


def _memory_html(d: dict) -> str:
    """Each memory figure of A and B, in MiB, drawn and listed."""
    import plotly.graph_objects as go

    if not d["memory"]:
        return nodata("no memory breakdown: run with --memory-profiler")
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
    return figure(fig, "compare-memory", 340) + table(["MiB", "A", "B", "B/A"], _memory_rows(d))


def main(argv: list[str] | None = None) -> int:
    p = ArgParser(prog="python -m minigpt compare", description="Compare two training runs.")
    p.add_argument("run_a", type=Path, help="run directory A (the baseline)")
    p.add_argument("run_b", type=Path, help="run directory B (ratios are B / A)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument(
        "--html", type=Path, metavar="FILE", help="also write the comparison as an offline HTML page"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace the --html file even if it is not a page of minigpt's (refused by default)",
    )
    p.add_argument(
        "--allow-different",
        action="store_true",
        help="compare runs of different models or machines (refused by default: not like for like)",
    )
    args = p.parse_args(argv)
    try:
        check_names((args.run_a, "run_a"), (args.run_b, "run_b"), (args.html, "--html"))
        if args.html is not None and args.html.is_dir():
            raise RunError(
                f"--html {args.html} is a folder; give a file name such as {args.html / 'compare.html'}"
            )
        if args.html is not None:  # before the runs are read: a refusal costs nothing
            check_page_path(args.html, "--html", args.force)
        a, b = load_run(args.run_a), load_run(args.run_b)
        d = compare_loaded(a, b, args.allow_different)
        if args.html is not None:
            write_page(args.html, compare_html(d, a, b), "--html", args.force)
    except (RunError, UsageError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Fault as e:  # a full disk (fileio.DiskFull)
        print(f"error: {e}", file=sys.stderr)
        return 1
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
