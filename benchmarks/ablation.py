"""Compare feature flags: tokens/s, MFU, per-stage host and device times, and peak memory.

    python benchmarks/ablation.py                                   # default preset, this machine
    python benchmarks/ablation.py --preset gpt2 --steps 3 --warmup 1 --repeats 1
    python benchmarks/ablation.py --preset gpt2 --seq-len 1024 --batch-size 8 --compile --nproc 2
    python benchmarks/ablation.py --preset nanogpt                  # nanoGPT's shape: the speed comparison
    python benchmarks/ablation.py --render benchmarks/results/cpu-small.json  # table and chart again, no runs

The matrix is {AMP, --no-amp} x {no checkpointing, --use-activation-checkpoint}, plus
`--compile`, a DDP world size, and (CPU) glibc malloc's defaults when asked. On a GPU the rows are
AMP (the baseline), AMP + checkpointing, AMP + torch.compile, AMP at twice the preset's batch and
fp32: the gpt2 preset's at 2 repeats, 5 + 10 steps, fit in about three minutes on one H100/H200.
Each variant runs in a
fresh process, `--repeats` times in interleaved rounds, for `--steps` measured steps after
`--warmup`. Trainer flags not known here (--seq-len, --batch-size, --n-layers, ...) are passed
through to every variant. Its time goes to those runs: each is a fresh process (start-up, the
warm-up steps, one --memory-profiler step, the measured steps). With --predict, every run ends
with its predicted step (the trainer's --predict-time), and on a CPU the benchmark first measures
this machine's kernel rates, one `python -m minigpt estimate --time` pass per set of kernels (30-75 s
each, longer on a busy machine), so the table puts each stage's predicted time beside its
measurement; without it nothing is predicted.

Each round ends with the baseline (fp32) again: the A/A check. Every ratio comes with its 95%
interval over the repeats (benchmarks/common.py, minigpt.analysis.stats); when the baseline's two copies
differ beyond theirs, the machine was too noisy to tell, and the results go to a folder outside the
repository instead of benchmarks/results unless --noisy (the table then says so). The load at the
start and the end is recorded; a busy start refuses benchmarks/results unless --busy. A run whose
measured steps ran busy (metrics.jsonl's `busy` above minigpt.config.BUSY in over that share of
them) is flagged in one line, and no verdict is drawn from it: re-run on a quiet machine.

MFU: every row against one peak, named by the dtype its runs' config.json recorded
(peak_flops_dtype: the device's fastest, whatever the row's own AMP). On CUDA the fp32 row says
whether its matmuls ran in TF32 (--tf32; off by default).

Writes benchmarks/results/<device>-<name>.json, .md (the table, with ratios to the fp32
baseline) and .png (tokens/s, stage times host vs device, peak memory). Each names the device,
the versions, the date and the command. <name> is --name, else the preset and the flags passed
through (small-seq-len-128); results already there are never overwritten without --force.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import (
    PRESETS,
    ROOT,
    STAGES,
    Parser,
    aa_check,
    aa_lines,
    aa_name,
    busy_warning,
    check_out_dir,
    destination,
    device_slug,
    header,
    load_average,
    load_lines,
    machine_line,
    native_bf16,
    output_flags,
    ran_busy,
    ratio,
    ratio_text,
    refuse_if_busy,
    refuse_to_overwrite,
    render,
    results_file,
    results_name_arg,
    run_variant,
    save_json,
    stamp,
    summarise,
)

from minigpt.analysis.compare import compare_runs, headline
from minigpt.config import BUSY
from minigpt.config import STAGES as STAGE_STYLE
from minigpt.fileio import atomic_write
from minigpt.instruments.predict import PREDICTED_STAGES as PREDICTED

MIB = 2**20
NO_VERDICT = "no verdict (busy)"  # a ratio cell whose run, or its base's, ran busy


def stage_color(stage: str) -> str:
    """The stage registry's colour (minigpt.config.STAGES), as the trainer's NVTX ranges use it."""
    return STAGE_STYLE[stage][1]


def results_name(preset: str, trainer_flags: list[str]) -> str:
    """The file name after the device: the preset, and the flags passed through, so results of
    another shape never land on the preset's (committed) file."""
    return re.sub(r"[^a-z0-9.]+", "-", " ".join([preset, *trainer_flags]).lower()).strip("-")[:100]


# {AMP, fp32} x {checkpointing or not}; the first is the baseline. Variants asked for on top are
# each compared with its base: "amp", or "fp32" under --fp32-only.
MATRIX = [
    ("fp32", ["--no-amp"], 1),
    ("fp32 + ckpt", ["--no-amp", "--use-activation-checkpoint"], 1),
    ("amp", ["--amp"], 1),
    ("amp + ckpt", ["--amp", "--use-activation-checkpoint"], 1),
]


def gpu_matrix(preset: str) -> list[tuple[str, list[str], int]]:
    """A GPU's rows, baseline first: what a GPU user weighs (bf16 AMP against fp32, checkpointing,
    torch.compile, twice the micro-batch), in about three minutes for the gpt2 preset on one
    H100/H200 at 2 repeats. No fp32 + checkpointing: on a GPU it only repeats fp32's story slower."""
    from minigpt.config import PRESETS as TRAINER_PRESETS

    batch = 2 * (TRAINER_PRESETS.get(preset, {}).get("batch_size") or 8)
    return [
        ("amp", ["--amp"], 1),
        ("amp + ckpt", ["--amp", "--use-activation-checkpoint"], 1),
        ("amp + compile", ["--amp", "--compile"], 1),
        (f"amp, batch {batch}", ["--amp", "--batch-size", str(batch)], 1),
        ("fp32", ["--no-amp"], 1),
    ]


def variants(args) -> list[tuple[str, list[str], int]]:
    """(name, flags, processes) of each variant. Without the AMP rows (--amp-rows), the variants
    asked for on top run in fp32 (a CPU without native bf16 emulates it, many times slower than fp32).
    On a GPU, gpu_matrix(); --compile is in it already."""
    if getattr(args, "gpu", False):
        out = gpu_matrix(args.preset)
        if args.chunked_loss:
            out.append(("amp + chunked loss", ["--amp", "--chunked-loss"], 1))
        return out + ([(f"amp + ddp x{args.nproc}", ["--amp"], args.nproc)] if args.nproc > 1 else [])
    base, flag = ("fp32", "--no-amp") if args.fp32_only else ("amp", "--amp")
    out = [v for v in MATRIX if not (args.fp32_only and "--amp" in v[1])]
    if args.malloc:
        out.append((f"{base}, malloc defaults", [flag, "--no-keep-freed-memory"], 1))
    if args.compile:
        out.append((f"{base} + compile", [flag, "--compile"], 1))
    if args.chunked_loss:  # the LM head + cross-entropy a chunk of rows at a time (core/chunked_loss.py)
        out.append(("fp32 + chunked loss", ["--no-amp", "--chunked-loss"], 1))
        if not args.fp32_only:
            out.append(("amp + chunked loss", ["--amp", "--chunked-loss"], 1))
    if args.nproc > 1:
        out.append((f"{base} + ddp x{args.nproc}", [flag], args.nproc))
    return out


def mfu_cell(mfu: float) -> str:
    """MFU for the table, never above 100%: a results file whose runs measured their denominator
    under load (before the trainer lifted it to what a run achieves) gets the reason instead."""
    return f"{100 * mfu:.1f}%" if mfu <= 1 else "n/a (denominator measured under load)"


def cached_denominator(results: dict) -> bool:
    """Whether a CPU's results ran with the MFU denominator measured once and cached (all rows
    against one figure per dtype), as every result since the measured peak memory: before, each
    process measured its own at its start."""
    return any("peak_flops_spread" in str(r) for r in results.values()) or any(
        (r.get("breakdown_bytes") or {}).get("peak") for r in results.values()
    )


def one_denominator(meta: dict, results: dict) -> tuple[dict[str, float], str | None]:
    """Each row's MFU against one denominator for the device: the largest peak any row was
    measured against, so MFU ranks the rows as tokens/s does. Every row counts the same FLOPs per
    token, so a row's own peak is its tokens/s per device over its MFU. Returns the rows' MFU
    against that peak (none for a row whose MFU passed 100%: a denominator measured under load) and
    the dtype of that peak as its run's config.json recorded it (peak_flops_dtype: the device's
    fastest, whatever the row's own AMP), None where the results predate that record. Not for a
    CPU's results from before the denominator was cached, whose every process measured its own."""
    if meta["machine"]["device"] == "cpu" and not cached_denominator(results):
        return {}, None
    peaks = {
        name: tokens_median(s) / s.get("nproc", 1) / s["mfu"]
        for name, s in results.items()
        if isinstance(s.get("mfu"), (int, float)) and 0 < s["mfu"] <= 1
    }
    if not peaks:
        return {}, None
    top = max(peaks, key=peaks.get)
    mfu = {name: tokens_median(results[name]) / results[name].get("nproc", 1) / peaks[top] for name in peaks}
    return mfu, results[top].get("peak_flops_dtype")


def mfu_header(meta: dict, results: dict) -> str:
    """The MFU column's name: the dtype of the peak it divides by, as the runs recorded it."""
    dtype = one_denominator(meta, results)[1]
    return f"MFU against {dtype}'s peak" if dtype else "MFU (the peak's dtype not recorded)"


def amp_cell(meta: dict, s: dict) -> str:
    """The AMP column: the autocast dtype, and for an fp32 row on CUDA whether its matmuls ran in
    TF32 (--tf32, config.json's config.tf32), which sets an fp32 row's speed there."""
    if s["amp"] != "fp32" or meta["machine"]["device"] != "cuda":
        return s["amp"]
    tf32 = s.get("tf32")
    return "fp32 (TF32 not recorded)" if tf32 is None else f"fp32, TF32 {'on' if tf32 else 'off'}"


def busy_names(results: dict) -> list[str]:
    """The variants of which a repeat ran busy (common.ran_busy)."""
    return [name for name, s in results.items() if ran_busy(s)]


def busy_line(results: dict) -> str | None:
    """The one line that flags the busy runs, for the table and the chart; None when none was."""
    names = busy_names(results)
    if not names:
        return None
    return (
        f"Busy runs: {', '.join(names)} (in a repeat, other processes took over {BUSY:.0%} of the cores "
        f"in over {BUSY:.0%} of the measured steps): no verdict is drawn from them; "
        "re-run on a quiet machine."
    )


def versus(results: dict, base: str, name: str) -> str:
    """`name`'s tokens/s against `base`'s, with its interval; no verdict where either ran busy."""
    if ran_busy(results[name]) or ran_busy(results[base]):
        return NO_VERDICT
    return ratio_text(ratio(results[base]["tokens_per_s_repeats"], results[name]["tokens_per_s_repeats"]))


def peak_mib(s: dict) -> float | None:
    """The allocator's measured peak of one step (--memory-profiler: max_memory_allocated on CUDA,
    the profiler's memory events on the CPU); for a results file without it, the breakdown's sum
    (params, grads, optimizer state, saved activations at their peak), which the table then names
    as a sum, not a peak."""
    b = s.get("breakdown_bytes") or {}
    if b.get("peak"):
        return b["peak"] / MIB
    if "peak_allocated_gib" in s:
        return s["peak_allocated_gib"] * 1024
    return b["total"] / MIB if b else None


def tokens_median(s: dict) -> float:
    """The 'tokens/s (median)' column and the tokens/s bar."""
    return s["tokens_per_s"]["median"]


def stage_ms(s: dict, kind: str, stage: str) -> float:
    """A stage's median ms per step, `kind` host or device: one table cell's half, one chart segment."""
    return s[f"stage_{kind}_ms"].get(stage, 0.0)


def measured_peak(results: dict) -> bool:
    """Whether the results carry the allocator's measured peak (or CUDA's max_memory_allocated),
    not only the breakdown's sum."""
    return any(
        (r.get("breakdown_bytes") or {}).get("peak") or "peak_allocated_gib" in r for r in results.values()
    )


def memory_label(results: dict) -> str:
    return "peak memory" if measured_peak(results) else "breakdown sum"


def activations_mib(s: dict) -> float | None:
    b = s.get("breakdown_bytes")
    return b.get("activations_peak", b.get("activations")) / MIB if b else None


def findings(results: dict) -> list[str]:
    """The ratios a reader looks for: each variant's tokens/s against its base, and what it did to memory."""

    def tps(name: str, base: str) -> str:
        return versus(results, base, name)

    lines = []
    if "amp" in results and "fp32" in results:
        lines.append(f"AMP: tokens/s {tps('amp', 'fp32')} against fp32")
    for base in ("fp32", "amp"):
        ck = f"{base} + ckpt"
        if ck in results and base in results:
            act0, act1 = activations_mib(results[base]), activations_mib(results[ck])
            pk0, pk1 = peak_mib(results[base]), peak_mib(results[ck])
            text = f"activation checkpointing ({base}): tokens/s {tps(ck, base)}"
            if act0 and act1:
                text += f", {100 * (act1 / act0 - 1):+.0f}% activations"
            if pk0 and pk1:
                text += f", {memory_label(results)} {pk0:,.0f} -> {pk1:,.0f} MiB"
            lines.append(text)
    matrix = {m[0] for m in MATRIX}
    # the variants added to the matrix on request (a GPU's rows: all but its baseline, amp)
    for name in [n for n in results if n not in matrix and n != "amp"]:
        base = "fp32" if name.startswith("fp32") else "amp"  # "fp32 + chunked loss" against fp32
        if base in results:
            text = f"{name}: tokens/s {tps(name, base)} against {base}"
            pk0, pk1 = peak_mib(results[base]), peak_mib(results[name])
            memory = f", {memory_label(results)} {pk0:,.0f} -> {pk1:,.0f} MiB" if pk0 and pk1 else ""
            lines.append(text + memory)
    for name, r in results.items():  # what minigpt.analysis.compare says moved, against the variant's base
        if r.get("compare"):
            lines.append(
                f"{name} against {r['compare']['against']} (python -m minigpt compare, first round): "
                f"{r['compare']['headline']}"
            )
    return lines


def markdown(meta: dict, results: dict) -> str:
    base = next(iter(results))
    mfu = one_denominator(meta, results)[0]
    busy = busy_line(results)
    lines = [
        *header(f"Ablation: {meta['name']}", meta),
        *load_lines(meta),
        *([f"**{busy}**", ""] if busy else []),
        *aa_lines(meta),
        f"{meta['steps']} measured steps after {meta['warmup']} warm-up steps, {meta['repeats']} fresh "
        "process(es) per variant in interleaved rounds; medians over every "
        "measured step, spread as min-max of the "
        "repeats' medians. Ratios: tokens/s against the baseline from the repeats' medians, with "
        "the 95% interval (minigpt.analysis.stats: Welch's t on the logarithms); an interval that holds 1.0 "
        'reads "no difference within noise".'
        + (
            " No AMP rows (`--amp-rows` off, the default on a CPU without native bf16, where bf16 is "
            "emulated and its matmuls run many times slower than fp32)."
            if meta.get("fp32_only")
            else ""
        ),
        "",
        "| variant | AMP | tokens/s (median) | spread | vs baseline | "
        f"{mfu_header(meta, results)} | step ms | "
        + " | ".join(f"{s} host / device ms" for s in STAGES)
        + (
            " | peak MiB | activations MiB (share of peak) |"
            if measured_peak(results)
            else " | breakdown sum MiB (not the peak) | activations MiB (share of the sum) |"
        ),
        "|---" * (9 + len(STAGES)) + "|",
    ]
    for name, s in results.items():
        reps = s["tokens_per_s_repeats"]
        vs = "baseline" if name == base else versus(results, base, name)
        pk, act = peak_mib(s), activations_mib(s)
        lines.append(
            f"| {name} | {amp_cell(meta, s)} | {tokens_median(s):,.0f} | "
            f"{min(reps):,.0f}-{max(reps):,.0f} | "
            f"{vs} | "
            f"{mfu_cell(mfu.get(name, s['mfu']))} | {s['step_ms']['median']:.0f} | "
            + " | ".join(f"{stage_ms(s, 'host', st):.1f} / {stage_ms(s, 'device', st):.1f}" for st in STAGES)
            + f" | {'n/a' if pk is None else f'{pk:,.1f}'} | "
            + ("n/a |" if act is None else f"{act:,.1f} ({100 * act / pk:.0f}%) |" if pk else f"{act:,.1f} |")
        )
    lines += predicted_lines(results)
    lines += ["", "Findings:", ""] + [f"- {f}" for f in findings(results)]
    lines += notes(meta, results)
    return "\n".join(lines) + "\n"


def predicted_lines(results: dict) -> list[str]:
    """Each stage's predicted time (`python -m minigpt estimate --time`, stored by the trainer as
    config.json's predicted_step) beside the measured median, with the error: what the step-time
    model gets right and where it is off, per flag. Empty when no variant carries a prediction."""
    rows = [(name, s["predicted_step"], s) for name, s in results.items() if s.get("predicted_step")]
    if not rows:
        return []
    lines = [
        "",
        "Predicted against measured (ms per step; the prediction from this machine's measured rates, "
        "`python -m minigpt estimate --time`; error = predicted / measured - 1; bound: what limits "
        "the stage in the model, compute, memory bandwidth or per-op overhead):",
        "",
        "| variant | " + " | ".join(f"{st} predicted / measured (error, bound)" for st in PREDICTED) + " |",
        "|---" * (1 + len(PREDICTED)) + "|",
    ]
    for name, pred, s in rows:
        cells = []
        for st in PREDICTED:
            p, m = pred["stage_ms"].get(st), stage_ms(s, "device", st)
            bound = pred.get("bound", {}).get(st, "?")
            cells.append(
                "n/a" if p is None or not m else f"{p:.1f} / {m:.1f} ({100 * (p / m - 1):+.0f}%, {bound})"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def notes(meta: dict, results: dict) -> list[str]:
    """What the table's figures mean on this device, for these rows: under the findings."""
    lines: list[str] = []
    mfu, mfu_dtype = one_denominator(meta, results)
    if meta["machine"]["device"] == "cpu":
        lines += [
            "",
            "On the CPU a stage's device time is its host time: the CPU runs each op as the host issues it.",
        ]
        if cached_denominator(results):
            lines += [
                "",
                "MFU on the CPU is against this machine's peak, measured once and cached (each run's "
                "config.json says how: peak_flops_source).",
            ]
        else:
            lines += [
                "",
                "MFU on the CPU is against the peak each process measured at its start (a 2048^3 matmul "
                "in its dtype), which moved by 10-25% between processes on a shared machine: compare MFU "
                "across rows only over several repeats, and compare speed by tokens/s.",
            ]
    if mfu:
        dtype = (
            f"{mfu_dtype}'s peak (config.json's peak_flops_dtype: the device's fastest dtype, whatever "
            "the row's own AMP)"
            if mfu_dtype
            else "a peak whose dtype these results did not record"
        )
        lines += [
            "",
            f"MFU: every row against one denominator, {dtype}, the largest any row was measured against "
            "(a row's own MFU times its own peak over this one), so MFU ranks the rows as tokens/s does.",
        ]
    if any(r["nproc"] > 1 for r in results.values()):
        lines += [
            "",
            "The DDP row runs torchrun's default of 1 thread per process (OMP_NUM_THREADS=1); the other "
            "rows use every core in one process.",
        ]
    if meta.get("extra_flags"):
        lines += ["", f"Flags from $MINIGPT_ARGS, applied to every variant: `{meta['extra_flags']}`"]
    lines += [
        "",
        "Peak memory: "
        + (
            "the allocator's measured peak of one step (`--memory-profiler`: "
            "`max_memory_allocated` on CUDA, the profiler's memory events on the CPU)."
            if any((r.get("breakdown_bytes") or {}).get("peak") for r in results.values())
            else "`torch.cuda.max_memory_allocated()` over the measured steps."
            if meta["machine"]["device"] == "cuda"
            else "the measured breakdown's sum (parameters + gradients + optimizer state + saved "
            "activations at their peak); these results predate the allocator's measured peak."
        ),
    ]
    return lines


MEMORY_PARTS = (
    ("params", "parameters", "#4c72b0"),
    ("grads", "gradients", "#55a868"),
    ("optimizer", "optimizer state", "#8172b2"),
    ("activations_peak", "saved activations", "#ccb974"),
)

# PNG metadata: matplotlib writes its version under "Software" by default; without it the same
# results render to the same bytes on any install, so a re-render leaves a clean checkout clean.
PNG_METADATA = {"Software": None}


def legend_outside(ax) -> None:
    """The legend right of the axes, where it cannot cover a bar whatever the bars' heights."""
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def plot_tokens(ax, results: dict) -> None:
    """tokens/s per variant: the table's 'tokens/s (median)' column, with its 'spread' as error bars."""
    names = list(results)
    tps = [tokens_median(results[n]) for n in names]
    lo = [t - min(results[n]["tokens_per_s_repeats"]) for t, n in zip(tps, names)]
    hi = [max(results[n]["tokens_per_s_repeats"]) - t for t, n in zip(tps, names)]
    ax.bar(names, tps, yerr=[lo, hi], capsize=4, color="#4c72b0", label="tokens/s (median)")
    for i, (t, h) in enumerate(zip(tps, hi)):
        ax.annotate(  # above the error bar, not across it
            f"{t:,.0f}",
            (i, t + h),
            ha="center",
            va="bottom",
            fontsize=8,
            xytext=(0, 3),
            textcoords="offset points",
        )
    ax.margins(y=0.12)  # room for the numbers above the error bars
    ax.set_xlabel("variant")
    ax.set_ylabel("tokens/s")
    ax.set_title("tokens/s (median; bars: min-max of repeats)")


def plot_stages(ax, results: dict) -> None:
    """Stacked stage ms per step, host (plain) beside device (hatched), per variant: the table's
    'host / device ms' columns, one segment each."""
    names = list(results)
    x = range(len(names))
    for offset, kind, hatch in ((-0.2, "host", ""), (0.2, "device", "//")):
        bottom = [0.0] * len(names)
        for st in STAGES:
            vals = [stage_ms(results[n], kind, st) for n in names]
            ax.bar(
                [i + offset for i in x],
                vals,
                0.38,
                bottom=bottom,
                color=stage_color(st),
                hatch=hatch,
                edgecolor="black",
                linewidth=0.3,
                label=st if kind == "host" else None,
                gid=f"{kind}:{st}",
            )
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(list(x), names)
    ax.set_xlabel("variant")
    ax.set_ylabel("ms per step")
    ax.set_title("stage times: host (plain) vs device (hatched)")
    legend_outside(ax)


def plot_memory(ax, results: dict) -> None:
    """Per variant, the table's memory column as an outlined bar (the allocator's measured peak, or
    for results without it the breakdown's sum), and inside it the breakdown's parts stacked. Where the
    peak was measured, the space above the parts is what the breakdown does not hold (temporaries
    of the backward, the allocator's cached blocks)."""
    names = list(results)
    bottom = [0.0] * len(names)
    for key, label, color in MEMORY_PARTS:
        vals = [(results[n].get("breakdown_bytes") or {}).get(key, 0) / MIB for n in names]
        if any(vals):
            ax.bar(names, vals, 0.6, bottom=bottom, color=color, label=label, gid=f"part:{key}")
        bottom = [b + v for b, v in zip(bottom, vals)]
    peaks = [peak_mib(results[n]) or 0.0 for n in names]
    label = memory_label(results)
    ax.bar(
        names,
        peaks,
        0.8,
        fill=False,
        edgecolor="black",
        linewidth=1.5,
        label=label + (" (measured)" if measured_peak(results) else " (no measured peak)"),
        gid="memory",
    )
    for i, pk in enumerate(peaks):
        ax.annotate(
            f"{pk:,.1f}",
            (i, pk),
            ha="center",
            va="bottom",
            fontsize=8,
            xytext=(0, 3),
            textcoords="offset points",
        )
    ax.margins(y=0.12)
    ax.set_xlabel("variant")
    ax.set_ylabel("MiB")
    ax.set_title(f"{label} per step, and the breakdown's parts")
    legend_outside(ax)


def chart(meta: dict, results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = chart_figure(meta, results)
    fig.savefig(path, dpi=110, metadata=PNG_METADATA)
    plt.close(fig)


def chart_figure(meta: dict, results: dict):
    """The three panels of the .png: tokens/s, stage times, memory (the test reads its bars back)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5.2), layout="constrained")
    plot_tokens(axes[0], results)
    plot_stages(axes[1], results)
    plot_memory(axes[2], results)
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    title = f"{meta['name']} on {machine_line(meta)}\n{meta['command']}"
    if warning := busy_warning(meta):  # as the table says it: a chart seen alone must say it too
        title += "\n" + warning.replace(": times", ":\ntimes", 1)
    if busy := busy_line(results):
        title += "\n" + busy.replace(": no verdict", ":\nno verdict", 1)
    fig.suptitle(title, fontsize=9, color="#b00020" if warning or busy else "black")
    return fig


def parser() -> Parser:
    p = Parser(description=__doc__.split("\n\n")[0], epilog="Other flags go to train_minimal.py unchanged.")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=10, help="measured steps per run (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="steps before the measured ones (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per variant (default 3)")
    p.add_argument(
        "--amp-rows",
        choices=["auto", "on", "off"],
        default="auto",
        help="the AMP rows; off: none, and the variants on top run in fp32 (auto: off on a CPU without "
        "native bf16, where bf16 is emulated and its matmuls run many times slower)",
    )
    p.add_argument("--compile", action="store_true", help="add an AMP + torch.compile variant")
    p.add_argument(
        "--malloc",
        action="store_true",
        help="CPU: add a variant with glibc malloc's defaults (--no-keep-freed-memory)",
    )
    p.add_argument(
        "--chunked-loss",
        action="store_true",
        help="add fp32 and AMP variants with --chunked-loss (peak and tokens/s against the plain loss)",
    )
    p.add_argument("--nproc", type=int, default=1, help="add an AMP + DDP variant with this many processes")
    p.add_argument(
        "--predict",
        action="store_true",
        help="each run predicts its step (--predict-time), on a CPU from this machine's kernel rates "
        "measured first (python -m minigpt estimate --time, about 30-75 s a pass): the table puts each "
        "stage's predicted time beside its measurement",
    )
    p.add_argument(
        "--name",
        type=results_name_arg,
        help="results file name after the device (default: the preset and the flags passed through)",
    )
    p.add_argument("--force", action="store_true", help="overwrite results that are already there")
    output_flags(p, "measure nothing: write the .md and .png again from a results .json")
    return p


def main() -> int:
    p = parser()
    args, trainer_flags = p.parse_known_args()
    if min(args.steps, args.repeats) < 1 or args.warmup < 0:
        p.error("--steps and --repeats must be at least 1, --warmup at least 0")
    if args.nproc < 1:
        p.error(f"--nproc {args.nproc}: the DDP variant needs at least 1 process (1 leaves it out)")
    if args.render:
        return render(
            p, args.render, lambda d: write_results(d["meta"], d["results"], args.render.with_suffix(""))
        )
    check_out_dir(p, args.out_dir)

    meta = stamp(sys.argv)
    args.gpu = meta["machine"]["device"] == "cuda"  # a GPU's own rows (gpu_matrix)
    args.fp32_only = args.amp_rows == "off" or (args.amp_rows == "auto" and not native_bf16(meta["machine"]))
    if args.fp32_only and args.amp_rows == "auto":  # emulated bf16: hours, and no bf16 machine's figure
        print("ablation.py: this CPU has no native bf16 (AVX512-BF16/AMX): AMP rows left out", flush=True)
    meta = {
        **meta,
        "fp32_only": args.fp32_only,
        "name": args.name or results_name(args.preset, trainer_flags),
        "preset_flags": PRESETS[args.preset],
        "extra_flags": os.environ.get("MINIGPT_ARGS", ""),
        "trainer_flags": trainer_flags,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
    }
    name = f"{device_slug(meta['machine'])}-{meta['name']}"  # the one file name checked and written
    refuse_to_overwrite(p, args.out_dir / name, args.force, "--name NAME to write new results")
    meta.update(refuse_if_busy(args.out_dir, args.busy), noisy=args.noisy)
    results, meta["aa"] = measure(p, args, trainer_flags)
    meta["load_end"] = load_average()
    out_dir, noisy = destination(args.out_dir, meta, args.noisy)
    stem = out_dir / name
    out_dir.mkdir(parents=True, exist_ok=True)
    save_json(stem, {"meta": meta, "results": results})
    write_results(meta, results, stem)
    if noisy:
        print(f"ablation.py: {noisy}", file=sys.stderr)
        return 1
    return 0


def measure(p: Parser, args, trainer_flags: list[str]) -> tuple[dict, list[dict]]:
    """Every variant `--repeats` times, in interleaved rounds, each run a fresh process: run back to
    back, the first variant alone would meet the machine as the previous job left it (caches,
    clocks, a neighbour's burst), and its figures would carry that. Each round ends with the
    baseline's copy, for the A/A check (returned beside the results). A failing variant ends the
    benchmark with the trainer's own last line (p.error)."""
    listed = variants(args)
    if args.predict and not args.gpu:  # a GPU's prediction is its data sheet: no rates to measure
        cache_step_rates(
            rate_passes([[*PRESETS[args.preset], *trainer_flags, *flags] for _, flags, _ in listed])
        )
    if args.predict:  # each run predicts its step from the cached rates at its end (config.json)
        listed = [(name, [*flags, "--predict-time"], nproc) for name, flags, nproc in listed]
    rounds = [*listed, (aa_name(listed[0][0]), *listed[0][1:])]
    runs: dict[str, list] = {name: [] for name, _, _ in rounds}
    kept = Path(tempfile.mkdtemp(prefix="minigpt-ablation-"))  # the first round's run directories
    for r in range(args.repeats):
        for i, (name, flags, nproc) in enumerate(rounds):
            print(f"[{name}] round {r + 1}/{args.repeats}", flush=True)
            try:
                runs[name].append(
                    run_variant(
                        [*PRESETS[args.preset], *trainer_flags, *flags],
                        args.warmup,
                        args.steps,
                        nproc,
                        keep=kept / str(i) if r == 0 and i < len(listed) else None,
                    )
                )
            except (RuntimeError, subprocess.TimeoutExpired) as e:  # the trainer's last line says why
                lines = [line for line in str(e).splitlines() if line.strip()]
                p.error(f"{lines[0]} {lines[-1] if len(lines) > 1 else ''}".strip())
    results = {}
    for name, flags, nproc in listed:
        config = runs[name][0]["config"]
        results[name] = {
            "flags": flags,
            "nproc": nproc,
            "amp": config["amp"],
            "tf32": config.get("config", {}).get("tf32"),
            "peak_flops": config.get("peak_flops"),
            "peak_flops_dtype": config.get("peak_flops_dtype"),
            "predicted_step": config.get("predicted_step"),
            **summarise(runs[name]),
        }
        print(f"[{name}] {results[name]['tokens_per_s']['median']:,.0f} tokens/s", flush=True)
    explain(results, kept)
    base = listed[0][0]
    copy = [statistics.median(x["tokens_per_s"] for x in run["rows"]) for run in runs[aa_name(base)]]
    check = aa_check(base, results[base]["tokens_per_s_repeats"], copy, "tokens/s of each repeat")
    print(f"[A/A] {base} against itself: {ratio_text(check)}", flush=True)
    return results, [check]


# Flags that change no kernel the step-time model prices: a checkpointed step recomputes the same
# forward kernels at the same shapes, so its rates are the plain variant's.
SAME_KERNELS = ("--use-activation-checkpoint",)


def rate_passes(flag_sets: list[list[str]]) -> list[list[str]]:
    """The flag sets whose kernels differ, in order: one `estimate --time` pass each (a pass times
    what the cache lacks, and, on a busy machine, everything it holds as measured under load)."""
    seen, out = set(), []
    for flags in flag_sets:
        key = tuple(f for f in flags if f not in SAME_KERNELS)
        if key not in seen:
            seen.add(key)
            out.append(flags)
    return out


def cache_step_rates(flag_sets: list[list[str]]) -> None:
    """This machine's step rates for every variant's ops, measured once before the rounds
    (`python -m minigpt estimate --time` caches them), so that each run's config.json carries its
    predicted step: the trainer predicts only from rates already cached, never measuring."""
    for flags in flag_sets:
        print(f"[rates] python -m minigpt estimate --time {shlex.join(flags)}", flush=True)
        cmd = [sys.executable, "-m", "minigpt", "estimate", "--time", *flags]
        # Its stderr comes through: a "[rates] i/n kernel" line as each rate starts, not a silent minute.
        subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, text=True, timeout=1800)


def explain(results: dict, kept: Path) -> None:
    """minigpt.analysis.compare on the first round's run directories: each variant against its base (fp32 for
    the fp32 variants, amp for the others, fp32 for amp), in one line for the findings."""
    names = list(results)
    try:
        for i, name in enumerate(names):
            base = "fp32" if name == "amp" or name.startswith("fp32") else "amp"
            if name in ("fp32",) or base not in results or not (kept / str(i)).is_dir():
                continue
            d = compare_runs(kept / str(names.index(base)), kept / str(i))
            results[name]["compare"] = {"against": base, "headline": headline(d)}
    finally:
        shutil.rmtree(kept, ignore_errors=True)


def write_results(meta: dict, results: dict, stem: Path) -> None:
    """The table (.md) and the chart (.png) of a results .json, beside it."""
    table = markdown(meta, results)
    atomic_write(results_file(stem, ".md"), table)
    chart(meta, results, results_file(stem, ".png"))
    print(table)
    print(f"wrote {stem}.md, .png")


if __name__ == "__main__":
    sys.exit(main())
