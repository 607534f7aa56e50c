"""One offline HTML page for a run: what ran, how fast, where the time and the memory went.

    python -m minigpt report runs/main                  # writes runs/main/report.html
    python -m minigpt report runs/main --out /tmp/r.html

torch-tb-profiler's Overview, Operator and Memory views load Google Charts from the network, so
offline they are a spinner. This page needs nothing from the network: plotly.js is the run
folder's one plotly.min.js (about 4.6 MB, shared with the memory profiler's charts), every chart
is drawn from the run directory's files (config.json, metrics.jsonl, traces/, memory_trace/,
stragglers.jsonl), and opening it makes no request. Sections whose data the run did not record
say so in one line, with the flag that records it.

The trainer calls write_report() at the end of a run (--no-report turns it off).
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

from minigpt.analysis import snapshot
from minigpt.analysis.breakdown_log import (
    CATEGORIES,
    MEMORY_BREAKDOWN_KEYS,
    PEAK_PART_NAMES,
    PEAK_PARTS,
    SUMMARY_DEPTH,
    category_leaves,
    category_rows,
    peak_of_state,
    peak_rows,
    sunburst,
)
from minigpt.analysis.html import (
    SHARED_PLOTLY,
    check_page_path,
    esc,
    page,
    script_tag,
    table,
    write_page,
    write_plotly_js,
)
from minigpt.analysis.record import describe_left_out
from minigpt.analysis.runfiles import Run, RunError, load_run, run_figures, timeline_events
from minigpt.config import BUSY, METRICS_FILE, REPORT_FILE, SPLITS, STAGE_NAMES, STAGES, ArgParser
from minigpt.errors import Fault, UsageError
from minigpt.fileio import ELSEWHERE, check_names

MB = 1024 * 1024
TOP_ROWS = 15  # operators and kernels drawn and listed per trace
MAX_KERNEL_BARS = 4000  # kernels drawn per rank on the timeline: more makes the page slow to draw
KERNEL_COLOR = "purple"

# Sections in page order: (id, title). The browser test checks each one rendered.
SECTIONS = (
    ("summary", "Run summary"),
    ("curves", "Loss and learning rate"),
    ("stages", "Stage times per step"),
    ("timeline", "Profiled window"),
    ("operators", "Top operators and kernels"),
    ("memory", "Memory"),
    ("stragglers", "Stragglers per rank"),
)

# ---------------------------------------------------------------------------- HTML pieces


def nodata(text: str) -> str:
    return f'<p class="nodata">{esc(text)}</p>'


def section(sid: str, title: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{esc(title)}</h2>\n{body}\n</section>'


def figure(fig, div_id: str, height: int = 380) -> str:
    """A plotly figure as a <div> and its script; plotly.js itself is in the page's head."""
    import plotly.io as pio

    fig.update_layout(height=height, margin=dict(t=40, l=60, r=20, b=40), template="plotly_white")
    return pio.to_html(
        fig,
        include_plotlyjs=False,
        full_html=False,
        div_id=div_id,
        config={"displaylogo": False, "responsive": True},
    )


def fmt(x, digits: int = 2) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def tflops(x: float) -> str:
    """TFLOP/s to three significant digits: 989, 1.36, 0.00861 (a fixed 3 decimals would show a
    CPU's 0.009 and a GPU's 989.000)."""
    if not x:
        return "0"
    digits = max(0, 2 - math.floor(math.log10(abs(x))))
    return f"{x:,.{digits}f}"


def fitted_range(values: list) -> list[float] | None:
    """A y range for a series that is one value (one logged step, or a constant learning rate):
    plotly would centre it on a -1..1 axis, where 3e-4 reads as 0. None: let plotly fit it."""
    values = [v for v in values if isinstance(v, (int, float))]
    if not values or min(values) != max(values) or values[0] == 0:
        return None
    v = values[0]
    return [0.0, 2 * v] if v > 0 else [2 * v, 0.0]


def median(values: list) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(values) if values else None


def steady(metrics: list[dict], fallback: bool = True) -> list[dict]:
    """The logged intervals with a steady step: the figures a user compares. A record whose steps
    were all left out (warm-up, compilation, an instrumented step) holds their figures, and is
    dropped. With `fallback`,
    a run with no steady interval keeps what it has (a page draws something); without, it has none
    (compare's samples)."""
    kept = [r for r in metrics if r.get("steady_steps")]
    return kept or (metrics if fallback else [])


# ---------------------------------------------------------------------------- figures of one run


def color(name: str) -> str:
    return STAGES.get(name, ("", "grey"))[1]


def label(name: str) -> str:
    return STAGES.get(name, (name,))[0]


def throughput(run: Run) -> dict:
    """The run's own figures, as metrics.jsonl's last record holds them (record.RUN_KEYS: tokens/s
    in steady state and end to end, MFU over the run, start-up, the share of its steady steps that
    ran busy), the per-interval figures' medians over the steady steps (MFU as each record holds
    it: never recomputed here), and what MFU is measured against (config.json's peak)."""
    m, c = steady(run.metrics), run.config
    return {
        **run_figures(run.metrics),
        "resumed": bool(c.get("config", {}).get("resume")),  # the run's figures count from the resume
        "tokens_per_s": median([r.get("tokens_per_s") for r in m]),
        "tokens_per_s_per_rank": median([r.get("tokens_per_s_per_rank") for r in m]),
        "mfu": median([r.get("mfu") for r in m]),
        "achieved_tflops": median([r.get("achieved_tflops") for r in m]),
        "busy": median([r.get("busy") for r in m if (r.get("busy") or 0) > BUSY]),  # in the busy steps
        "peak_tflops": c["peak_flops"] / 1e12 if isinstance(c.get("peak_flops"), (int, float)) else None,
        "peak_flops_dtype": c.get("peak_flops_dtype"),
        "peak_flops_source": c.get("peak_flops_source"),
    }


def busy_text(t: dict) -> str:
    """How busy the machine was: the share of the steady steps in which other processes took more
    than config.BUSY of the cores, and how much they took then; "n/a" where the run did not say."""
    if t["run_busy"] is None:
        return "n/a"
    if not t["run_busy"]:
        return f"quiet: other processes took at most {BUSY:.0%} of the cores in every steady step"
    took = f"others took {t['busy']:.0%} of the cores" if t["busy"] is not None else "others took the cores"
    quiet = "; re-run on a quiet machine before comparing" if t["run_busy"] > BUSY else ""
    return f"{took} in {t['run_busy']:.0%} of the steady steps{quiet}"


def mfu_text(mfu: float | None, achieved: float | None) -> str:
    """MFU as the run recorded it; above 100% it says that its denominator was measured low."""
    if mfu is None:
        return "n/a"
    over = "; above 100%: the measured peak was low (the next run's is at least this rate)" if mfu > 1 else ""
    return f"{100 * mfu:.1f}%" + (
        f" ({fmt(achieved, 3)} TFLOP/s achieved per device{over})" if achieved else over
    )


def stage_medians(run: Run, key: str) -> dict[str, float]:
    """Each stage's median ms per step over the steady logged steps (key: stage_host_ms, ...)."""
    rows = [r.get(key) or {} for r in steady(run.metrics)]
    names = [s for s in STAGE_NAMES if any(s in r for r in rows)]
    names += sorted({k for r in rows for k in r} - set(names))
    return {s: median([r.get(s) for r in rows]) for s in names}


def peak_memory(run: Run) -> dict[str, float]:
    """Peak memory figures in bytes: the measured breakdown by category, and the process's peaks."""
    out: dict[str, float] = {}
    b = run.breakdown()
    if b:
        for k in (*MEMORY_BREAKDOWN_KEYS, "cuda_max_reserved"):
            if isinstance(b.get(k), (int, float)):
                out[k] = b[k]
    elif run.memory:  # memory.log without a metrics line (a run stopped right after the measured step)
        s = run.memory[0]["summary"]
        for k, src in (
            ("params", "params_memory"),
            ("grads", "grads_memory"),
            ("optimizer", "os_state_memory"),
            ("activations", "activation_memory"),
            ("activations_peak", "activation_peak_memory"),
            ("total", "total_memory"),
            ("peak", "peak_memory"),
        ):
            if src in s:
                out[k] = s[src]
    mem = [r.get("memory") or {} for r in run.metrics]
    for k in ("rss_peak_bytes",):
        v = max((r[k] for r in mem if isinstance(r.get(k), (int, float))), default=None)
        if v is not None:
            out[k] = v
    for k in ("peak_allocated_gib", "peak_reserved_gib"):
        v = max((r[k] for r in mem if isinstance(r.get(k), (int, float))), default=None)
        if v is not None:
            out[k.replace("_gib", "_bytes")] = v * 1024**3
    return out


def throughput_rows(t: dict) -> list[tuple[str, str]]:
    """The summary's tokens/s and start-up rows: the run's figures (what the trainer's last line
    says: its steady state, the steps left out of it, end to end), then the per-interval median
    for comparison with the log lines."""
    tokens = f"{t['run_tokens']:,} tokens" if t["run_tokens"] is not None else "tokens"
    left = describe_left_out(t["run_left_out"])
    steady = (
        f"{fmt(t['run_tokens_per_s'], 0)} ({'since the resume' if t['resumed'] else 'the run'}: "
        f"{tokens} of {t['run_steps']} steady steps / {t['run_step_time_s']:.2f}s, their times summed" + ")"
        if t["run_tokens_per_s"] is not None
        else "no steady step"
    )
    trained = f"{t['tokens_trained']:,} tokens" if t["tokens_trained"] is not None else "tokens"
    e2e = (
        "n/a"
        if t["tokens_per_s_e2e"] is None
        else fmt(t["tokens_per_s_e2e"], 0)
        + (
            f" ({trained} / {t['elapsed_s']:.2f}s of loop to the last log line: left-out steps, "
            "evaluations, logging and checkpoints included)"
            if t["elapsed_s"] is not None
            else ""
        )
    )
    startup = (
        "not measured"
        if t["startup_s"] is None
        else f"{t['startup_s']:.2f}s from the script's start (or main()'s call) to the loop's "
        "(in neither rate)"
    )
    return [
        ("tokens/s in steady state", steady),
        ("left out of it", left or "no step"),
        ("tokens/s end to end", e2e),
        ("start-up", startup),
        (
            "tokens/s per step, median interval",
            f"{fmt(t['tokens_per_s'], 0)} (median of the logged intervals' steady steps; "
            f"{fmt(t['tokens_per_s_per_rank'], 0)} per rank)",
        ),
    ]


def summary_section(run: Run) -> str:
    c, cfg = run.config, run.config.get("config", {})
    model = c.get("model", {})
    t = throughput(run)
    last = run.metrics[-1] if run.metrics else {}
    vals = [r.get("val_loss") for r in run.metrics if r.get("val_loss") is not None]
    versions = c.get("versions", {})
    tokens_step = (
        (cfg.get("batch_size") or 0) * (cfg.get("seq_len") or 0) * (cfg.get("grad_accum_steps") or 1)
    )
    source = ", ".join(filter(None, [t["peak_flops_dtype"], t["peak_flops_source"] or "source not recorded"]))
    peak = "n/a" if t["peak_tflops"] is None else f"{tflops(t['peak_tflops'])} TFLOP/s per device ({source})"
    rows = [
        ("run", str(run.path)),
        (
            "model",
            f"{model.get('n_layers')} layers, {model.get('n_heads')} heads, d_model {model.get('d_model')}, "
            f"d_ff {model.get('d_ff')}, vocab {model.get('vocab_size')}, "
            f"{fmt((c.get('params') or 0) / 1e6)}M parameters"
            + (", activation checkpointing" if model.get("activation_checkpoint") else ""),
        ),
        (
            "batch",
            f"{cfg.get('batch_size')} x {cfg.get('seq_len')} tokens x {cfg.get('grad_accum_steps')} "
            f"accumulation = {tokens_step:,} tokens per step per rank; {cfg.get('num_steps')} steps",
        ),
        (
            "data",
            "toy sequences"
            if cfg.get("use_toy_data")
            else (", ".join(cfg.get("train_data") or []) or "built-in corpus"),
        ),
        (
            "device",
            f"{c.get('device')} ({c.get('device_name')}), {run.world_size} process(es)"
            + (f", {c.get('ddp_backend')}" if c.get("ddp_backend") else ""),
        ),
        ("precision", c.get("amp")),
        ("versions", ", ".join(f"{k} {v}" for k, v in versions.items() if v)),
        *throughput_rows(t),
        ("MFU over the run", mfu_text(t["run_mfu"], t["run_achieved_tflops"])),
        ("MFU denominator", peak),
        ("machine load", busy_text(t)),
        ("FLOPs per token", fmt(c.get("flops_per_token"))),
        ("final train loss", fmt(last.get("loss"), 4)),
        ("final val loss", fmt(vals[-1], 4) if vals else "n/a"),
        (
            "steps logged",
            f"{len(run.metrics)} (of {cfg.get('num_steps')}; --log-interval {cfg.get('log_interval')})",
        ),
    ]
    body = table(["", ""], [list(r) for r in rows], cls="kv")
    flags = [
        k for k in ("use_profiler", "memory_profiler", "use_activation_checkpoint", "compile") if cfg.get(k)
    ]
    body += f"<p>Instrumentation: {esc(', '.join(flags) or 'stage timing only')}.</p>"
    if run.problems:
        body += "".join(f'<p class="problem">{esc(p)}</p>' for p in run.problems)
    return body


def curves_section(run: Run) -> str:
    if not run.metrics:
        return nodata("no metrics.jsonl lines: the run stopped before its first log step")
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    steps = [r.get("step") for r in run.metrics]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("loss", "learning rate"))
    fig.add_trace(
        go.Scatter(x=steps, y=[r.get("loss") for r in run.metrics], name="train loss", mode="lines+markers"),
        1,
        1,
    )
    val = evaluated(run)
    if val:
        # One evaluation (a short run, a long --eval-interval) is one point: drawn large and
        # labelled, so it is not lost beside the training curve.
        one = len(val) == 1
        fig.add_trace(
            go.Scatter(
                x=[s for s, _ in val],
                y=[v for _, v in val],
                name="val loss" + (f" (one evaluation, step {val[0][0]})" if one else ""),
                mode="markers+text" if one else "lines+markers",
                marker={"size": 12 if one else 6, "symbol": "diamond" if one else "circle"},
                text=[f"val {val[0][1]:.3f}"] if one else None,
                textposition="top center",
            ),
            1,
            1,
        )
    lrs = [r.get("lr") for r in run.metrics]
    fig.add_trace(go.Scatter(x=steps, y=lrs, name="lr", mode="lines+markers"), 1, 2)
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(exponentformat="e", range=fitted_range(lrs), row=1, col=2)  # 3e-4, not 300µ
    body = ""
    if len(run.metrics) == 1:
        body = (
            f"<p>One logged step (step {esc(steps[0])}): each chart of this page holds one point per "
            "series; --log-interval N logs every N steps.</p>"
        )
    return body + figure(fig, "curves-plot", 340)


def evaluated(run: Run) -> list[tuple[int, float]]:
    """(step, val loss) at the steps that evaluated: a record holds a val loss only there."""
    return [(r["step"], r["val_loss"]) for r in run.metrics if r.get("val_loss") is not None]


def stages_section(run: Run) -> str:
    keys = [
        ("stage_host_ms", "host ms"),
        ("stage_device_ms", "device ms"),
        ("stage_comm_ms", "in collectives ms"),
    ]
    one_clock = all(r.get("stage_device_ms") == r.get("stage_host_ms") for r in run.metrics)  # a CPU's
    if one_clock:  # its device times are its host times: drawn once, as "ms"
        keys = [("stage_host_ms", "ms"), keys[2]]
    keys = [(k, t) for k, t in keys if any(r.get(k) for r in run.metrics)]
    if not keys:
        return nodata("no stage times: the run had --no-stage-timing, or logged no step")
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    drawn = steady(run.metrics)  # an interval of warm-up alone (a compilation) would dwarf the rest
    steps = [r.get("step") for r in drawn]
    fig = make_subplots(rows=1, cols=len(keys), shared_yaxes=True, subplot_titles=[t for _, t in keys])
    names = list(stage_medians(run, "stage_host_ms") or STAGE_NAMES)
    for col, (key, _) in enumerate(keys, 1):
        for name in names:
            if SPLITS.get(name):  # a part of another stage (backward_compute): in the table, not stacked
                continue
            fig.add_trace(
                go.Bar(
                    x=steps,
                    y=[(r.get(key) or {}).get(name, 0.0) for r in drawn],
                    name=name,
                    marker_color=color(name),
                    legendgroup=name,
                    showlegend=col == 1,
                ),
                1,
                col,
            )
    fig.update_layout(barmode="stack")
    # One slot per logged step: on a numeric axis a bar is as wide as the closest two logged steps
    # are apart, so a stop and resume that logs steps 1 apart drew every bar hair-thin.
    fig.update_xaxes(title_text="logged step", type="category")
    fig.update_yaxes(title_text="ms per step (mean over the interval)", row=1, col=1)
    clocks = (
        "On the CPU host and device share one clock: one time per stage."
        if one_clock
        else "On a GPU the host returns early and the device column says where the GPU spent its time."
    )
    note = (
        "<p>Each bar is the mean over its log interval's steady steps (warm-up and instrumented steps "
        f"left out: the summary names them). {clocks}</p>"
    )
    rows = []
    for name in names:
        part = f", part of {SPLITS.get(name)}" if SPLITS.get(name) else ""
        rows.append(
            [f"{name} ({label(name)}{part})"] + [fmt(stage_medians(run, k).get(name)) for k, _ in keys]
        )
    return (
        note
        + figure(fig, "stages-plot", 360)
        + table(["stage, median of the intervals' means (ms)"] + [t for _, t in keys], rows)
        + prediction_table(run)
    )


def _number(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def prediction_table(run: Run) -> str:
    """The stage times minigpt.instruments.predict gave for this run's configuration (config.json's
    predicted_step, written as the run started) beside the measured medians, with the error
    (predicted / measured - 1): how far this machine's measured rates explain the step. Measured
    is the device time (on the CPU the host's). "" for a run without a prediction."""
    pred = run.config.get("predicted_step")
    stage_ms = pred.get("stage_ms") if isinstance(pred, dict) else None
    if not isinstance(stage_ms, dict):
        return ""
    measured = stage_medians(run, "stage_device_ms") or stage_medians(run, "stage_host_ms")
    bound = pred.get("bound") if isinstance(pred.get("bound"), dict) else {}
    spans = pred.get("stage_ms_range") if isinstance(pred.get("stage_ms_range"), dict) else {}
    rows = [
        [
            name,
            *_predicted_cells(_number(stage_ms[name]), measured.get(name)),
            _span(spans.get(name)),
            fmt(bound.get(name)),
        ]
        for name in stage_ms
    ]
    tps = median([r.get("tokens_per_s_per_rank") for r in steady(run.metrics)])
    rows.append(["tokens/s per rank", *_predicted_cells(_number(pred.get("tokens_per_s")), tps, 0), "", ""])
    sheet = pred.get("tested") is False  # a GPU's data sheet, not rates measured on this machine
    rates = (
        "the peak FLOP/s and bandwidth of the device's data sheet, and the per-op overhead measured on it"
        if sheet
        else "this machine's measured rates"
    )
    source = f" Rates: {esc(pred['rates_source'])}." if isinstance(pred.get("rates_source"), str) else ""
    untested = (
        " A data sheet's figures are not yet checked against a measured step here: untested." if sheet else ""
    )
    return (
        "<p>Predicted when the run started (<code>python -m minigpt estimate --time</code>: each op's "
        f"FLOPs, bytes and launches at {rates}) beside the measured median, "
        "with the error, predicted / measured - 1."
        + source
        + (
            " Each kernel runs at the geometric mean of its rates on operands in cache and out of "
            "it; the range has every kernel at one or the other."
            if spans
            else ""
        )
        + f"{untested}</p>"
        + table(["stage", "measured ms", "predicted ms", "error", "range ms", "bound by"], rows)
    )


def _span(span) -> str:
    """ "low - high" of a stage's predicted range, "n/a" where the record has none."""
    if isinstance(span, list) and len(span) == 2 and all(_number(x) is not None for x in span):
        return f"{fmt(_number(span[0]), 2)} - {fmt(_number(span[1]), 2)}"
    return "n/a"


def _predicted_cells(predicted: float | None, measured: float | None, digits: int = 2) -> list[str]:
    """measured, predicted and the error in percent, each "n/a" where it cannot be told."""
    error = f"{100 * (predicted / measured - 1):+.1f}%" if predicted is not None and measured else "n/a"
    return [fmt(measured, digits), fmt(predicted, digits), error]


def _bars(lane: str, rows: list[tuple[str, float, float]], **style):
    """One timeline lane's bars: a horizontal bar per (name, start ms, duration ms) row."""
    import plotly.graph_objects as go

    return go.Bar(
        y=[lane] * len(rows),
        x=[d for _, _, d in rows],
        base=[t for _, t, _ in rows],
        orientation="h",
        **style,
    )


def _timeline_figure(run: Run):
    """Each rank's profiled window as lanes of bars: its steps, its stages, and (on a GPU) its
    device work. Returns the figure, its lanes top to bottom, and a note per rank whose device
    events were cut to MAX_KERNEL_BARS."""
    import plotly.graph_objects as go

    fig = go.Figure()
    lanes: list[str] = []
    notes = []
    shown = set()
    for s in run.traces:
        r = s["rank"]
        ev = timeline_events(Path(s["file"]), tuple(s.get("stages") or STAGE_NAMES))
        lane_step, lane_stage, lane_dev = f"rank {r} steps", f"rank {r} stages", f"rank {r} device"
        lanes += [lane_step, lane_stage] + ([lane_dev] if ev["kernels"] else [])
        fig.add_trace(
            _bars(
                lane_step,
                ev["steps"],
                name="ProfilerStep",
                marker_color="lightgrey",
                text=[n for n, _, _ in ev["steps"]],
                legendgroup="step",
                showlegend="step" not in shown,
                hovertemplate="%{text}: %{x:.2f} ms<extra></extra>",
            )
        )
        shown.add("step")
        for name in dict.fromkeys(n for n, _, _ in ev["stages"]):
            fig.add_trace(
                _bars(
                    lane_stage,
                    [e for e in ev["stages"] if e[0] == name],
                    name=name,
                    marker_color=color(name),
                    legendgroup=name,
                    showlegend=name not in shown,
                    hovertemplate=f"{name}: %{{x:.2f}} ms at %{{base:.2f}} ms<extra></extra>",
                )
            )
            shown.add(name)
        kernels = ev["kernels"]
        if len(kernels) > MAX_KERNEL_BARS:
            notes.append(f"rank {r}: the {MAX_KERNEL_BARS} longest of {len(kernels)} device events drawn")
            kernels = sorted(kernels, key=lambda k: -k[2])[:MAX_KERNEL_BARS]
        if kernels:
            fig.add_trace(
                _bars(
                    lane_dev,
                    kernels,
                    name="kernels",
                    marker_color=KERNEL_COLOR,
                    text=[n[:120] for n, _, _ in kernels],
                    textposition="none",
                    legendgroup="kernels",
                    showlegend="kernels" not in shown,
                    hovertemplate="%{text}<br>%{x:.3f} ms<extra></extra>",
                )
            )
            shown.add("kernels")
    fig.update_layout(
        barmode="overlay",
        xaxis_title="ms from the rank's first profiled step",
        yaxis=dict(categoryorder="array", categoryarray=list(reversed(lanes))),
    )
    return fig, lanes, notes


def timeline_section(run: Run) -> str:
    if not run.traces:
        return nodata("no trace: run with --use-profiler")
    fig, lanes, notes = _timeline_figure(run)
    cpu = all(s.get("cpu_only") for s in run.traces)
    unrecorded = any(s.get("device_not_recorded") for s in run.traces)
    if cpu:
        lane = "CPU-only trace: no device lane (the CPU runs each op as the host issues it)."
    elif unrecorded:
        lane = (
            "A GPU trace whose kernels were not recorded (CUDA launches, no kernel events): host "
            "times only; profile with ProfilerActivity.CUDA to record them."
        )
    else:
        lane = "The device lane holds every kernel, memcpy and memset of the window."
    body = (
        f"<p>{len(run.traces)} trace file(s), profiled steps "
        f"{', '.join(str(x['step']) for x in run.traces[0]['steps'])}. {lane}</p>"
    )
    body += figure(fig, "timeline-plot", 120 + 60 * len(lanes))
    body += "".join(nodata(n) for n in notes)
    return body + _window_table(run.traces[0], cpu)


def _window_table(s: dict, cpu: bool) -> str:
    """Per profiled step and stage of one trace summary: host ms, and device busy ms on a GPU."""
    names = list(s.get("stages") or STAGE_NAMES)
    # Time in collectives is shown where the trace has collectives (DDP, FSDP), not as "(comm 0.00)".
    comm = any(
        (st.get("comm_host_ms") or 0) > 0 or (st.get("comm_device_ms") or 0) > 0
        for st in s["totals"]["stages"].values()
    )
    rows = []
    for row in s["steps"]:
        cells = [row["step"]]
        for n in names:
            st = row["stages"].get(n, {})
            cell = fmt(st.get("host_ms")) + ("" if cpu else f" / {fmt(st.get('device_busy_ms'))}")
            if comm and isinstance(st.get("comm_host_ms"), (int, float)):  # collectives inside the stage
                cell += f" (comm {fmt(st['comm_host_ms'])})"
            cells.append(cell)
        cells.append(fmt(row.get("host_ms")) + ("" if cpu else f" / {fmt(row.get('device_busy_ms'))}"))
        rows.append(cells)
    unit = "host ms" if cpu else "host / device busy ms"
    return f"<p>Rank {s['rank']}, from the trace ({unit}):</p>" + table(
        ["step"] + names + ["whole step"], rows
    )


def operators_section(run: Run) -> str:
    if not run.traces:
        return nodata("no trace: run with --use-profiler")
    import plotly.graph_objects as go

    s = run.traces[0]
    steps = max(len(s["steps"]), 1)
    ops = s["operators"]["by_self"][:TOP_ROWS]
    fig = go.Figure(
        go.Bar(
            y=[o["name"][:60] for o in reversed(ops)],
            x=[o["self_ms"] / steps for o in reversed(ops)],
            orientation="h",
            marker_color="steelblue",
            hovertemplate="%{y}: %{x:.2f} ms<extra></extra>",
        )
    )
    fig.update_layout(
        xaxis_title="self ms per profiled step", title=f"rank {s['rank']}: host operators by self time"
    )
    body = figure(fig, "operators-plot", 120 + 24 * len(ops))
    body += table(
        ["operator", "calls", "self ms", "total ms", "self ms / step"],
        [
            [o["name"], o["calls"], fmt(o["self_ms"]), fmt(o["total_ms"]), fmt(o["self_ms"] / steps)]
            for o in ops
        ],
        name_col=0,
    )
    kernels = s.get("kernels") or []
    if not kernels:
        body += nodata("no kernels: a CPU-only trace (host operators only)")
        return body
    ks = kernels[:TOP_ROWS]
    fig = go.Figure(
        go.Bar(
            y=[k["name"][:60] for k in reversed(ks)],
            x=[k["total_ms"] / steps for k in reversed(ks)],
            orientation="h",
            marker_color=KERNEL_COLOR,
            hovertemplate="%{y}: %{x:.3f} ms<extra></extra>",
        )
    )
    fig.update_layout(
        xaxis_title="device ms per profiled step",
        title=f"rank {s['rank']}: kernels by total time ({fmt(s.get('kernel_total_ms'))} ms in all)",
    )
    body += figure(fig, "kernels-plot", 120 + 24 * len(ks))
    body += table(
        ["kernel", "calls", "total ms", "share", "tensor cores"],
        [
            [k["name"], k["calls"], fmt(k["total_ms"]), f"{100 * k['share']:.1f}%", k["tensor_cores"]]
            for k in ks
        ],
        name_col=0,
    )
    return body


def _mib(nbytes: float) -> str:
    return f"{nbytes / MB:,.2f} MiB"


def measured_peaks(run: Run) -> list[dict]:
    """The measured peak of each rank that has one, rank 0 first: {"rank", "step", "peak" (bytes),
    "stage", "where", "parts": {part: {name: bytes}}}, the parts adding up to the peak. memory.log's
    peak_layout names every byte; without memory.log, metrics.jsonl's record gives each part's
    total and the names of the activations, temporaries and held tensors."""
    out = []
    for state in run.memory:
        p = peak_of_state(state)
        if p is not None:
            out.append({**p, "rank": state["rank"], "step": state["step"]})
    b = run.breakdown()
    if out or not b or not isinstance(b.get("peak"), (int, float)):
        return out
    totals = b.get("peak_parts") or {}
    named = {
        "activations": b.get("peak_activations"),
        "temporaries": b.get("temporaries"),
        "held": b.get("held"),
    }
    parts: dict[str, dict[str, int]] = {}
    for part in PEAK_PARTS:
        names = named.get(part) or {}
        if names and sum(names.values()) == totals.get(part):
            parts[part] = dict(names)
        elif totals.get(part):
            parts[part] = {f"{PEAK_PART_NAMES[part]} (not named in {METRICS_FILE})": totals[part]}
    where = {"stage": b.get("peak_stage"), "where": b.get("peak_where")}
    return [{"peak": b["peak"], **where, "parts": parts, "rank": 0, "step": b.get("step")}]


def _sunburst_figure(rows: list[tuple[str, str, str, int]], title: str):
    """memory.py's (id, label, parent, bytes) rows as a plotly sunburst: every parent is a row, and
    a parent's value is its children's sum (branchvalues="total")."""
    import plotly.graph_objects as go

    fig = go.Figure(
        sunburst(
            rows,
            texttemplate="%{label}<br>%{customdata:.1f} MiB",
            hovertemplate="%{label}<br>%{customdata:.2f} MiB, %{percentRoot:.1%} of the chart<extra></extra>",
        )
    )
    fig.update_layout(title=title)
    return fig


def _peak_body(p: dict, est: dict | None, ranks: int) -> str:
    """The measured peak in words, a table of the parts live at that moment (they add up to it),
    and the sunburst of those parts."""
    stage = p["stage"] or "n/a"
    where = (p["where"] or "").removeprefix(f"{stage} / ") or "n/a"
    who = f"rank {p['rank']}, " if ranks > 1 else ""
    body = (
        f'<p class="headline">Measured peak: <b>{esc(_mib(p["peak"]))}</b> ({who}step {esc(p["step"])}), '
        f"during <b>{esc(stage)}</b>, at {esc(where)}.</p>"
    )
    rows = [
        [
            "measured peak",
            f"{_mib(p['peak'])} ({p['peak']:,} bytes): the allocator's highest figure in step "
            f"{p['step']}, replayed from its allocations and frees",
        ],
        ["when (stage)", stage],
        ["where (module / op)", where],
    ]
    if est and isinstance(est.get("peak"), (int, float)):
        rows.append(
            [
                "estimated peak",
                f"{_mib(est['peak'])} ({100 * (est['peak'] - p['peak']) / p['peak']:+.1f}%), "
                f"at {est.get('peak_moment') or 'n/a'} ({est.get('peak_stage') or 'n/a'})",
            ]
        )
    body += table(["", ""], rows, cls="kv")
    total = sum(v for names in p["parts"].values() for v in names.values())
    part_rows = []
    for part in PEAK_PARTS:
        names = sorted(p["parts"].get(part, {}).items(), key=lambda kv: -kv[1])
        nbytes = sum(v for _, v in names)
        top = "; ".join(f"{n} {v / MB:,.2f}" for n, v in names[:3] if v) + ("; ..." if len(names) > 3 else "")
        part_rows.append([PEAK_PART_NAMES[part], fmt(nbytes / MB), f"{100 * nbytes / p['peak']:.1f}%", top])
    same = total == p["peak"]
    part_rows.append(
        [
            ("sum of the parts", "sum"),
            (fmt(total / MB), "sum"),
            (f"{100 * total / p['peak']:.1f}%", "sum"),
            (
                "= the measured peak"
                if same
                else f"differs from the measured peak by {_mib(total - p['peak'])}: memory.log is cut or old",
                "sum" if same else "problem",
            ),
        ]
    )
    body += "<p>Live at the peak, every byte named once:</p>" + table(
        ["part", "MiB", "of the peak", "largest (MiB)"], part_rows, name_col=3
    )
    title = f"{who}step {p['step']}: the measured peak, {_mib(p['peak'])}, by what was live"
    return body + figure(_sunburst_figure(peak_rows(p["parts"]), title), "memory-sunburst", 520)


def _categories_body(b: dict, est: dict | None) -> str:
    """Each category over the whole step, measured and estimated; their sum labelled as one."""
    import plotly.graph_objects as go

    cats = [("peak", "measured peak")] if isinstance(b.get("peak"), (int, float)) else []
    cats += [
        ("params", "parameters"),
        ("grads", "gradients"),
        ("optimizer", "optimizer state"),
        ("activations", "activations (all saved)"),
        ("activations_peak", "activation peak"),
        ("total", SUM_OF_PARTS),
    ]
    fig = go.Figure(
        go.Bar(
            x=[t for _, t in cats],
            y=[(b.get(k) or 0) / MB for k, _ in cats],
            name="measured",
            marker_color="teal",
        )
    )
    if est:
        fig.add_trace(
            go.Bar(
                x=[t for _, t in cats],
                y=[(est.get(k) or 0) / MB for k, _ in cats],
                name="estimate",
                marker_color="orange",
            )
        )
    fig.update_layout(
        barmode="group",
        yaxis_title="MiB",
        title=f"by category over step {b.get('step')}" + (", against the estimate" if est else ""),
    )
    rows = [
        [
            t,
            fmt((b.get(k) or 0) / MB),
            fmt((est or {}).get(k, 0) / MB) if est else "n/a",
            (f"{100 * (est[k] - b[k]) / b[k]:+.1f}%" if est and b.get(k) and k in est else "n/a"),
        ]
        for k, t in cats
    ]
    note = (
        "<p>Each category is measured over the whole step. Gradients and activations are never all "
        f"alive at once and the ops' temporaries are in none of them, so the {esc(SUM_OF_PARTS)} "
        "(parameters + gradients + optimizer state + activation peak) is not a peak: "
        + (
            "the measured peak is."
            if isinstance(b.get("peak"), (int, float))
            else "the step's peak was not measured."
        )
        + "</p>"
    )
    return (
        note
        + figure(fig, "memory-estimate", 360)
        + table(["MiB", "measured", "estimate", "difference"], rows)
    )


SUM_OF_PARTS = "sum of the categories"


def memory_section(run: Run) -> str:

    body = ""
    b = run.breakdown()
    est = dict((b or {}).get("estimate") or {}) or None
    if est and "activations_peak" not in est and "activations" in est:
        est["activations_peak"] = est["activations"]  # the estimate counts every saved tensor live at once
    peaks = measured_peaks(run)
    if peaks:
        body += _peak_body(peaks[0], est, len(run.memory))
        if len(peaks) > 1:
            body += "<p>Every rank's measured peak:</p>" + table(
                ["rank", "step", "MiB", "stage", "where"],
                [[p["rank"], p["step"], fmt(p["peak"] / MB), p["stage"], p["where"]] for p in peaks],
                name_col=4,
            )
    elif run.memory or b:
        state = run.memory[0] if run.memory else {}
        note = state.get("peak_note") or (b or {}).get("peak_note") or "this run's memory.log predates it"
        body += f'<p class="headline">Measured peak: {esc(note)}.</p>'
        if run.memory:  # the categories' trees, labelled as the sum they are
            leaves = category_leaves(state)
            rows = [("total", SUM_OF_PARTS, "", sum(sum(v.values()) for v in leaves.values()))]
            for category in CATEGORIES:
                rows += category_rows(leaves[category], category, max_depth=SUMMARY_DEPTH, parent="total")
            title = (
                f"step {state['step']} by category: {_mib(rows[0][3])}, a sum of parts never all live at once"
            )
            body += figure(_sunburst_figure(rows, title), "memory-sunburst", 520)
    if run.memory:
        folder = run.memory[0]["folder"]
        links = sorted(p.name for p in folder.glob("*_sunburst.html"))
        if links:
            rel = folder.relative_to(run.path)
            body += (
                "<p>Full charts beside this report: "
                + ", ".join(f'<a href="{esc(rel / n)}">{esc(n)}</a>' for n in links)
                + "</p>"
            )
    if b:
        body += _categories_body(b, est)
    body += _process_memory_chart(run)
    pages = sorted((run.path / "snapshots").glob("*snapshot.html"))
    if pages:  # written by write_report (minigpt.analysis.snapshot)
        links = ", ".join(f'<a href="{esc(p.relative_to(run.path))}">{esc(p.name)}</a>' for p in pages)
        body += (
            f"<p>CUDA memory snapshots, offline (bytes over the steps, the peak, what was live): {links}</p>"
        )
    if not body:
        return nodata("no memory breakdown: run with --memory-profiler")
    if not (run.memory or b):
        body = nodata("no memory breakdown: run with --memory-profiler") + body
    return body


def _process_memory_chart(run: Run) -> str:
    """The process's memory per log interval, in MiB, from metrics.jsonl: RSS on the CPU, the
    allocator's peaks on CUDA; "" when no record holds either."""
    import plotly.graph_objects as go

    lines = [
        (k, t, to_mib)
        for k, t, to_mib in (
            ("rss_bytes", "RSS", lambda v: v / MB),
            ("rss_peak_bytes", "peak RSS", lambda v: v / MB),
            ("peak_allocated_gib", "peak allocated", lambda v: v * 1024),
            ("peak_reserved_gib", "peak reserved", lambda v: v * 1024),
        )
        if any(isinstance((r.get("memory") or {}).get(k), (int, float)) for r in run.metrics)
    ]
    if not lines:
        return ""
    fig = go.Figure()
    steps = [r.get("step") for r in run.metrics]
    for k, t, to_mib in lines:
        fig.add_trace(
            go.Scatter(
                x=steps,
                y=[to_mib((r.get("memory") or {}).get(k) or 0) for r in run.metrics],
                name=t,
                mode="lines+markers",
            )
        )
    cuda = any("peak_allocated_gib" in (r.get("memory") or {}) for r in run.metrics)
    title = (
        "the CUDA caching allocator's peaks per log interval (tensors allocated, memory reserved)"
        if cuda
        else "process memory (resident set) per log interval"
    )
    fig.update_layout(yaxis_title="MiB", xaxis_title="logged step", title=title)
    return figure(fig, "memory-process", 320)


def stragglers_section(run: Run) -> str:
    if run.world_size <= 1:
        return nodata("one process: stragglers are scored under DDP (torchrun --nproc_per_node N)")
    threshold = run.config.get("config", {}).get("straggler_threshold")
    if len(run.traces) > 1:
        body = (
            "<p>Under DDP the fast ranks wait for the slow one inside the backward's all-reduce: a slow "
            "rank shows a long stage of its own, the others a long backward.</p>"
        ) + figure(_rank_stages_figure(run), "stragglers-ranks", 360)
    else:
        body = nodata("per-rank stage times need a trace of every rank: --use-profiler --profile-ranks all")
    if not run.stragglers:
        body += f"<p>No straggler reported: every rank scored at or above the threshold {fmt(threshold)}.</p>"
        return body
    body += figure(_scores_figure(run.stragglers, threshold), "stragglers-scores", 320)
    body += table(
        ["step", "rank", "host", "relative", "individual", "stage that grew", "ms", "reference ms"],
        [
            [
                x.get("step"),
                x.get("rank"),
                x.get("host"),
                fmt(x.get("relative_score"), 3),
                fmt(x.get("individual_score"), 3),
                x.get("stage"),
                fmt(x.get("stage_ms"), 1),
                fmt(x.get("reference_stage_ms"), 1),
            ]
            for x in run.stragglers
        ],
    )
    return body


def _rank_stages_figure(run: Run):
    """Each rank's stages, host ms per profiled step from its own trace, stacked side by side."""
    import plotly.graph_objects as go

    fig = go.Figure()
    names = list(run.traces[0].get("stages") or STAGE_NAMES)
    for n in names:
        fig.add_trace(
            go.Bar(
                x=[f"rank {s['rank']}" for s in run.traces],
                y=[
                    s["totals"]["stages"].get(n, {}).get("host_ms", 0.0) / max(len(s["steps"]), 1)
                    for s in run.traces
                ],
                name=n,
                marker_color=color(n),
            )
        )
    fig.update_layout(
        barmode="stack",
        yaxis_title="host ms per profiled step",
        title="each rank's stages in the profiled window (from its trace)",
    )
    return fig


def _scores_figure(stragglers: list[dict], threshold):
    """The scores of every rank reported slow (stragglers.jsonl), against the threshold."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for r in sorted({x["rank"] for x in stragglers}):
        mine = [x for x in stragglers if x["rank"] == r]
        for score, line in (("relative", None), ("individual", dict(dash="dot"))):
            fig.add_trace(
                go.Scatter(
                    x=[x["step"] for x in mine],
                    y=[x.get(f"{score}_score") for x in mine],
                    name=f"rank {r} {score}",
                    mode="lines+markers",
                    line=line,
                )
            )
    if isinstance(threshold, (int, float)):
        fig.add_hline(y=threshold, line_dash="dash", line_color="grey", annotation_text="threshold")
    fig.update_layout(
        yaxis_title="score (1 = as fast as the fastest / its own best)",
        xaxis_title="step",
        title="scores of the ranks reported slow",
    )
    return fig


BUILDERS = {
    "summary": summary_section,
    "curves": curves_section,
    "stages": stages_section,
    "timeline": timeline_section,
    "operators": operators_section,
    "memory": memory_section,
    "stragglers": stragglers_section,
}


def report_body(run: Run) -> str:
    parts = [f"<h1>minigpt run: {esc(run.name)}</h1>"]
    for sid, title in SECTIONS:
        parts.append(section(sid, title, BUILDERS[sid](run)))
    return "\n".join(parts)


def render_report(run: Run) -> str:
    """The report page; where it draws a chart, it loads plotly.min.js from its own folder."""
    return page(f"minigpt run {run.name}", report_body(run), shared_plotly=True)


def _snapshot_pages(run_dir: Path, elsewhere: str) -> None:
    """Each CUDA memory snapshot's offline page beside it, for the report to link. A snapshot that
    cannot be read or a folder that cannot be written costs its page, not the report."""
    for pickle_path in sorted((run_dir / "snapshots").glob("*snapshot.pickle*")):
        if pickle_path.suffix in (".pickle", ".gz"):
            try:
                snapshot.write_snapshot_page(pickle_path, elsewhere=elsewhere)
            except (RunError, UsageError, Fault):  # a bad snapshot; not our page there; a full disk
                pass


def write_report(
    run_dir: Path, out: Path | None = None, elsewhere: str = ELSEWHERE, force: bool = False
) -> Path:
    """Write the run's report (default RUN/report.html) atomically; return its path. Raises RunError
    when run_dir is not a run directory or the page cannot be written, DiskFull when the disk is
    full, WouldOverwrite when `out` holds a file that is not a page of minigpt's (and not `force`)."""
    run = load_run(Path(run_dir))
    _snapshot_pages(run.path, elsewhere)
    out = Path(out) if out is not None else run.path / REPORT_FILE
    check_page_path(out, elsewhere, force)  # before the page is made: a refusal costs nothing
    text = render_report(run)
    if SHARED_PLOTLY in text:  # one copy beside the page: the run folder's, which the charts share
        try:
            js = write_plotly_js(out.parent, elsewhere)
        except Fault as e:  # a full disk (fileio.DiskFull), its message naming the way out
            raise type(e)(f"cannot write {out}: {e}") from None
        except OSError as e:
            why = f"its plotly.min.js beside it: {e.strerror or type(e).__name__}"
            raise RunError(f"cannot write {out} ({why}); write elsewhere ({elsewhere})") from None
        text = text.replace(SHARED_PLOTLY, script_tag(out, js))
    write_page(out, text, elsewhere, force)
    return out


def main(argv: list[str] | None = None) -> int:
    p = ArgParser(prog="python -m minigpt report", description="Write a run's offline HTML report.")
    p.add_argument("run", type=Path, help="a run directory (the trainer's --out-dir)")
    p.add_argument("--out", type=Path, help=f"where to write it (default RUN/{REPORT_FILE})")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace the --out file even if it is not a page of minigpt's (refused by default)",
    )
    args = p.parse_args(argv)
    try:
        check_names((args.run, "run"), (args.out, "--out"))
        if args.out is not None and args.out.is_dir():
            raise RunError(f"--out {args.out} is a folder; give a file name such as {args.out / REPORT_FILE}")
        path = write_report(args.run, args.out, "--out", args.force)
    except (RunError, UsageError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Fault as e:  # a full disk (fileio.DiskFull)
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
