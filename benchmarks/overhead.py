"""What the instrumentation costs: tokens/s with stage timing off, on (the default), and inside a
profiler window with and without Python stacks; and what each torch.profiler option costs.

    python benchmarks/overhead.py                      # default preset, this machine
    python benchmarks/overhead.py --preset tiny --steps 20
    python benchmarks/overhead.py --parts options      # only the profiler options

Same pattern as ablation.py: each variant in a fresh process, `--repeats` times, medians over
the measured steps, every ratio with its 95% interval, and each part's baseline ("timing off", "no
profiler") run twice for the A/A check (--noisy, --busy as in ablation.py). The profiler variants
profile exactly the measured steps. Prints the overhead against "timing off" and writes
benchmarks/results/overhead-<device>-<preset>.json/.md.
Target: the default stage timing costs at most 2% on the CPU default preset.

End to end, tokens/s of fresh processes on a shared 2-core machine spread by several percent, more
than the timing can cost. So the script also times the instrumentation alone: empty steps with the
four stages, without ranges, with ranges only (--no-stage-timing) and with ranges and timing (the
default), thousands of times in one process, best of 5 rounds. The differences are the cost per
step, down to about a microsecond of noise, and are set against the measured step time.

The profiler options (--parts options): minigpt's model and AdamW, in-process, the preset's shape,
fp32, --option-warmup unprofiled steps, then --option-steps steps inside a CPU-activity
torch.profiler with one option switched on (record_shapes, profile_memory, with_flops,
with_modules, with_stack), with none ("bare"), with all of them, and without a profiler. Each
variant runs in a fresh process so its peak RSS is its own; --repeats rounds interleave the
variants. Per variant: the median step time (with the spread of the rounds' medians), the peak
RSS, the seconds stop() and the export take, the trace's size, and which views torch-tb-profiler
(0.4.3, the venv's) builds from the trace and whether its Operator view can group by input shape.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import common as bench

from minigpt.config import STEP_RANGE
from minigpt.instruments.instrument import StageTimer


def instrumentation_us_per_step(device: str, steps: int = 20_000) -> dict[str, float]:
    """Host microseconds per step of the instrumentation alone: a step of four empty stages, with no
    ranges (the bare loop), with the ranges only (--no-stage-timing), and with ranges and timing."""
    import time
    from contextlib import nullcontext

    def bare_step():
        for _ in bench.STAGES:
            with nullcontext():
                pass

    def timed_step(timer):  # as Instruments.step runs a step: its range, untimed, around the stages
        with timer.stage(STEP_RANGE, False):
            for st in bench.STAGES:
                with timer.stage(st):
                    pass
        timer.end_step()

    def per_step(fn) -> float:
        best = float("inf")
        for _ in range(5):  # the best of 5 rounds: the cost itself, without the machine's hiccups
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            best = min(best, (time.perf_counter() - t0) / steps * 1e6)
        return best

    off, on = StageTimer(device, enabled=False), StageTimer(device, enabled=True)

    def timed_on():
        timed_step(on)
        if len(on.steps) > 1000:  # read at the "log interval", as the loop does
            on.read()

    return {
        "bare loop": per_step(bare_step),
        "ranges only (--no-stage-timing)": per_step(lambda: timed_step(off)),
        "ranges + timing (default)": per_step(timed_on),
    }


# Each option on top of a bare CPU-activity profiler; "no profiler" is the baseline.
PROFILER_OPTIONS = ("record_shapes", "profile_memory", "with_flops", "with_modules", "with_stack")
OPTION_VARIANTS: dict[str, dict | None] = {
    "no profiler": None,
    "bare profiler": {},
    **{name: {name: True} for name in PROFILER_OPTIONS},
    "all options": dict.fromkeys(PROFILER_OPTIONS, True),
}
REQUIRED_VIEWS = ("Overview", "Operator", "Trace", "Memory")  # what the default options must keep


def option_child(variant: str, preset: str, steps: int, warmup: int, check_views: bool) -> dict:
    """One variant in this (fresh) process: step times, peak RSS, and the trace's views."""
    import json
    import resource
    import statistics
    import tempfile
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    from minigpt.config import GPT2_VOCAB
    from minigpt.config import PRESETS as MODEL_PRESETS
    from minigpt.core.model import GPT, GPTConfig
    from minigpt.core.shape import shape_of

    p = MODEL_PRESETS[preset]
    torch.manual_seed(0)
    shape = shape_of(p, GPT2_VOCAB, max_position_embeddings=p["seq_len"], dropout=0.0)
    model = GPT(GPTConfig(**shape.model_kwargs()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, GPT2_VOCAB, (p["batch_size"], p["seq_len"] + 1))

    def step() -> None:
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()

    def peak_rss() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    for _ in range(warmup):
        step()
    rss_before, times, result = peak_rss(), [], {}
    options = OPTION_VARIANTS[variant]
    prof = None if options is None else profile(activities=[ProfilerActivity.CPU], **options)
    if prof:
        prof.start()
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        if prof:
            prof.step()
        times.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory(prefix="minigpt-prof-") as tmp:
        if prof:
            t0 = time.perf_counter()
            prof.stop()
            result["stop_s"] = time.perf_counter() - t0
            trace = Path(tmp) / "trace.json"
            t0 = time.perf_counter()
            prof.export_chrome_trace(str(trace))
            result["export_s"] = time.perf_counter() - t0
            result["trace_mb"] = trace.stat().st_size / 1e6
        result.update(step_s=statistics.median(times), rss_peak_bytes=peak_rss(), rss_before_bytes=rss_before)
        if prof and check_views:  # after the RSS is read: the parser's own memory is not the profiler's
            result.update(tensorboard_views(json.loads(trace.read_text())))
    return result


def tensorboard_views(trace: dict) -> dict:
    """What torch-tb-profiler makes of a trace: the views it offers, and whether the Operator
    view's "group by input shape" has shapes to group by."""
    import logging

    logging.getLogger("torch_tb_profiler").setLevel(logging.ERROR)
    from torch_tb_profiler.profiler.data import RunProfileData
    from torch_tb_profiler.profiler.run_generator import RunGenerator

    data = RunProfileData.from_json("worker0", 0, trace)
    run = RunGenerator("worker0", 0, data).generate_run_profile()
    shapes = [op.input_shape for op in data.op_list_groupby_name_input or []]
    return {
        "views": [v.display_name for v in run.views],
        "input_shapes": any(s not in ("", "[]", "None") for s in shapes),
    }


def measure_options(preset: str, steps: int, warmup: int, repeats: int, meta: dict) -> dict:
    """Every option variant in a fresh process per round, the rounds interleaved, each round ending
    with the bare step's copy for the A/A check (added to meta["aa"])."""
    import json
    import statistics
    import subprocess

    rounds: dict[str, list[dict]] = {name: [] for name in bench.with_aa(list(OPTION_VARIANTS))}
    for r in range(repeats):
        for name in rounds:
            print(f"[profiler option: {name}] round {r + 1}/{repeats}", flush=True)
            cmd = [
                sys.executable,
                __file__,
                "--option-child",
                name.removesuffix(bench.AA),
                "--preset",
                preset,
                "--option-steps",
                str(steps),
                "--option-warmup",
                str(warmup),
            ] + (["--check-views"] if r == 0 else [])
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
            if out.returncode != 0:
                raise RuntimeError(f"profiler option variant {name!r} failed:\n{out.stderr[-3000:]}")
            # the last JSON line: Kineto may write its own lines to stdout
            rounds[name].append(json.loads([x for x in out.stdout.splitlines() if x.startswith("{")][-1]))
    results = {}
    for name, rs in rounds.items():
        if name.endswith(bench.AA):
            continue
        step_ms = [1000 * x["step_s"] for x in rs]
        results[name] = {
            "step_ms": {
                "median": statistics.median(step_ms),
                "min": min(step_ms),
                "max": max(step_ms),
                "rounds": step_ms,
            },
            "rss_peak_mib": statistics.median(x["rss_peak_bytes"] for x in rs) / 2**20,
            **{
                k: statistics.median(x[k] for x in rs)
                for k in ("stop_s", "export_s", "trace_mb")
                if k in rs[0]
            },
            **{k: rs[0][k] for k in ("views", "input_shapes") if k in rs[0]},
        }
    base = results["no profiler"]
    copy = [1000 * x["step_s"] for x in rounds[bench.aa_name("no profiler")]]
    meta.setdefault("aa", []).append(
        bench.aa_check("no profiler", base["step_ms"]["rounds"], copy, "step ms of each round")
    )
    for s in results.values():
        s["step_overhead_pct"] = 100 * (s["step_ms"]["median"] / base["step_ms"]["median"] - 1)
        s["rss_added_mib"] = s["rss_peak_mib"] - base["rss_peak_mib"]
    return results


def default_options(results: dict) -> tuple[list[str], str]:
    """The cheapest set of options whose trace still gives TensorBoard's REQUIRED_VIEWS: every
    option a required view needs (seen in its single-option trace), none that it does not."""
    bare = set(results["bare profiler"].get("views", []))
    needed = [o for o in PROFILER_OPTIONS if set(results[o].get("views", [])) - bare & set(REQUIRED_VIEWS)]
    missing = set(REQUIRED_VIEWS) - bare - {v for o in needed for v in results[o]["views"]}
    why = (
        f"the bare profiler's trace gives {', '.join(v for v in REQUIRED_VIEWS if v in bare)}; "
        + "; ".join(
            f"{o} adds {', '.join(sorted(set(results[o]['views']) - bare & set(REQUIRED_VIEWS)))}"
            for o in needed
        )
        + (f"; still missing: {', '.join(sorted(missing))}" if missing else "")
    )
    return needed, why


def parser() -> argparse.ArgumentParser:
    p = bench.Parser(
        description=__doc__.split("\n\n")[0], epilog="Other flags go to train_minimal.py unchanged."
    )
    p.add_argument("--preset", default="small", choices=sorted(bench.PRESETS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--parts",
        choices=["all", "stage-timing", "options"],
        default="all",
        help="the trainer's stage timing and profiler window, the profiler options, or both (default)",
    )
    p.add_argument(
        "--micro-steps",
        type=int,
        default=20_000,
        help="empty steps per round of the in-process instrumentation timing (default 20000)",
    )
    p.add_argument(
        "--option-steps", type=int, default=3, help="profiled steps per option variant (default 3)"
    )
    p.add_argument("--option-warmup", type=int, default=2, help="unprofiled steps before them (default 2)")
    bench.output_flags(p, "measure nothing: write the .md again from a results .json")
    p.add_argument("--force", action="store_true", help="overwrite results that are already there")
    p.add_argument("--option-child", choices=list(OPTION_VARIANTS), help=argparse.SUPPRESS)
    p.add_argument("--check-views", action="store_true", help=argparse.SUPPRESS)
    return p


def main() -> int:
    p = parser()
    args, trainer_flags = p.parse_known_args()
    if args.option_child:
        print(
            json.dumps(
                option_child(
                    args.option_child, args.preset, args.option_steps, args.option_warmup, args.check_views
                )
            )
        )
        return 0
    if min(args.steps, args.repeats, args.warmup, args.option_steps, args.micro_steps) < 1:
        p.error("--steps, --repeats, --warmup, --option-steps and --micro-steps must be at least 1")
    if args.option_warmup < 0:
        p.error("--option-warmup must be at least 0")
    if args.render:
        return bench.render(
            p, args.render, lambda d: bench.write_md(args.render.with_suffix(".md"), markdown(d))
        )
    bench.check_out_dir(p, args.out_dir)
    # Before any run. (--parts options keeps the earlier file's stage timing, but rewrites the file.)
    name = f"overhead-{bench.device_slug(bench.machine())}-{args.preset}"
    bench.refuse_to_overwrite(p, args.out_dir / name, args.force)

    meta = {
        **bench.stamp(sys.argv),
        "name": args.preset,
        "trainer_flags": trainer_flags,
        "extra_flags": os.environ.get("MINIGPT_ARGS", ""),
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "micro_steps": args.micro_steps,
        "option_steps": args.option_steps,
        "option_warmup": args.option_warmup,
        **bench.refuse_if_busy(args.out_dir, args.busy),
        "noisy": args.noisy,
    }
    data = measure(args, trainer_flags, meta)
    meta["load_end"] = bench.load_average()
    if args.parts == "options":
        data.update(kept_stage_timing(args.out_dir / name))
    return bench.publish(args.out_dir, name, meta, data, markdown(data), "overhead.py")


def measure(args, trainer_flags: list[str], meta: dict) -> dict:
    """The parts asked for; each adds its A/A check to meta["aa"]."""
    data: dict = {"meta": meta}
    if args.parts in ("all", "stage-timing"):
        data.update(stage_timing(args, trainer_flags, meta))
    if args.parts in ("all", "options"):
        data["profiler_options"] = measure_options(
            args.preset, args.option_steps, args.option_warmup, args.repeats, meta
        )
        chosen, why = default_options(data["profiler_options"])
        data["default_profiler_options"] = {"options": chosen, "why": why}
    return data


def kept_stage_timing(stem: Path) -> dict:
    """--parts options: the stage-timing part of the earlier results file stays, with its own date,
    machine, command and A/A check; nothing when there is none (or it cannot be read)."""
    try:
        old = json.loads(stem.with_suffix(".json").read_text())
        return {
            "results": old["results"],
            "stage_timing_meta": old.get("stage_timing_meta", old["meta"]),
            "instrumentation_us_per_step": old["instrumentation_us_per_step"],
        }
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def stage_timing(args, trainer_flags: list[str], meta: dict) -> dict:
    """The trainer with stage timing off and on, and inside its profiler window, interleaved."""
    window = [
        "--use-profiler",
        "--profile-step-start",
        str(args.warmup + 1),
        "--profile-step-end",
        str(args.warmup + args.steps + 1),
    ]
    variants = {
        "timing off": ["--no-stage-timing"],
        "timing on (default)": [],
        "profiler": window,
        "profiler + stacks": [*window, "--profile-with-stack"],
    }
    # Interleave the repeats (off, on, prof, stack, off (A/A), off, on, ...) so a drift of the
    # machine (thermal, a neighbour) spreads over every variant instead of biasing one.
    runs: dict[str, list] = {name: [] for name in bench.with_aa(list(variants))}
    for r in range(args.repeats):
        for name in runs:
            print(f"[{name}] repeat {r + 1}/{args.repeats}", flush=True)
            flags = variants[name.removesuffix(bench.AA)]
            runs[name].append(
                bench.run_variant(
                    [*bench.PRESETS[args.preset], *trainer_flags, *flags], args.warmup, args.steps
                )
            )
    results = {name: bench.summarise(runs[name]) for name in variants}
    base = results["timing off"]["tokens_per_s"]["median"]
    for s in results.values():
        s["overhead_pct"] = 100 * (base / s["tokens_per_s"]["median"] - 1)
    copy = bench.summarise(runs[bench.aa_name("timing off")])["tokens_per_s_repeats"]
    meta.setdefault("aa", []).append(
        bench.aa_check(
            "timing off", results["timing off"]["tokens_per_s_repeats"], copy, "tokens/s of each repeat"
        )
    )
    costs = instrumentation_us_per_step(meta["machine"]["device"], args.micro_steps)
    return {"results": results, "instrumentation_us_per_step": costs}


def markdown(data: dict) -> str:
    meta = data["meta"]
    lines = [
        *bench.header(f"Instrumentation overhead: {meta['name']}", meta),
        *bench.load_lines(meta),
        *bench.aa_lines(meta),
    ]
    if "results" in data:
        timing_meta = data.get("stage_timing_meta", meta)
        lines += stage_timing_lines(timing_meta, data["results"], data["instrumentation_us_per_step"])
        if "stage_timing_meta" in data:
            lines += [
                "",
                f"(This section was measured earlier and kept: {bench.machine_line(timing_meta)}; "
                f"command `{timing_meta['command']}`.)",
                "",
                *bench.aa_lines(timing_meta),
            ]
    if "profiler_options" in data:
        lines += options_lines(meta, data["profiler_options"], data["default_profiler_options"])
    lines += [
        "",
        "The machine was shared with other jobs: read the spreads, not only the medians.",
    ]
    if meta.get("extra_flags"):
        lines += ["", f"Flags from $MINIGPT_ARGS, applied to every trainer variant: `{meta['extra_flags']}`"]
    return "\n".join(lines) + "\n"


def stage_timing_lines(meta: dict, results: dict, costs: dict) -> list[str]:
    lines = [
        "## Stage timing and the trainer's profiler window",
        "",
        f"{meta['steps']} measured steps after {meta['warmup']} warm-up steps, {meta['repeats']} fresh "
        "processes per variant (interleaved); medians over every measured step.",
        "",
        "| variant | tokens/s (median) | repeats' medians | overhead vs timing off |",
        "|---|---|---|---|",
    ]
    base = results["timing off"]["tokens_per_s_repeats"]
    for name, s in results.items():
        reps = ", ".join(f"{t:,.0f}" for t in s["tokens_per_s_repeats"])
        vs = (
            "baseline"
            if name == "timing off"
            else bench.ratio_text(bench.ratio(s["tokens_per_s_repeats"], base))
        )
        lines.append(f"| {name} | {s['tokens_per_s']['median']:,.0f} | {reps} | {vs} |")
    lines += [
        "",
        "Overhead = time per token against timing off, from the repeats' medians, with its 95% interval "
        "(minigpt.analysis.stats); 1.05x is 5% slower, and an interval that holds 1.0 reads "
        '"no difference within '
        'noise".',
    ]
    # The instrumentation alone, against the step time it rides on.
    step_us = 1000 * results["timing on (default)"]["step_ms"]["median"]
    total_us = costs["ranges + timing (default)"] - costs["bare loop"]
    timing_us = costs["ranges + timing (default)"] - costs["ranges only (--no-stage-timing)"]
    lines += [
        "",
        f"The instrumentation alone (empty stages, best of 5 rounds of {meta.get('micro_steps', 20_000):,} "
        "steps, host microseconds per step):",
        "",
        "| step of four empty stages | us per step |",
        "|---|---|",
    ]
    lines += [f"| {name} | {us:.1f} |" for name, us in costs.items()]
    lines += [
        "",
        f"The default instrumentation (ranges and timing) costs {total_us:.1f} us per step, against a "
        f"measured step of {step_us / 1000:,.0f} ms: {100 * total_us / step_us:.4f}% (target: at most 2% "
        f"for the timing). The timing's own share, {timing_us:+.1f} us, is "
        + (
            "below the resolution of this measurement (the rows differ by less than their noise)."
            if timing_us < 1
            else f"{100 * timing_us / step_us:.4f}% of the step."
        ),
    ]
    return lines


def options_lines(meta: dict, results: dict, default: dict) -> list[str]:
    lines = [
        "",
        "## What each torch.profiler option costs",
        "",
        f"minigpt's model and AdamW in-process, fp32, {meta['option_warmup']} unprofiled steps, then "
        f"{meta['option_steps']} steps in a CPU-activity profiler with the variant's options; each variant a "
        f"fresh process, {meta['repeats']} interleaved rounds. Step: the median of each round's median "
        "(lowest-highest round). RSS: peak of the process (ru_maxrss), median of rounds. Views: what "
        "torch-tb-profiler 0.4.3 builds from the variant's trace.",
        "",
        "| variant | step ms | rounds' range | vs no profiler | peak RSS MiB | RSS added | stop + export s "
        "| trace MB | TensorBoard views | shapes to group by |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = results["no profiler"]["step_ms"]["rounds"]
    for name, s in results.items():
        st = s["step_ms"]
        vs = "baseline" if name == "no profiler" else bench.ratio_text(bench.ratio(base, st["rounds"]))
        export = f"{s['stop_s'] + s['export_s']:.1f}" if "stop_s" in s else "-"
        views = ", ".join(s.get("views", [])) or "-"
        shapes = "-" if "input_shapes" not in s else ("yes" if s["input_shapes"] else "no")
        lines.append(
            f"| {name} | {st['median']:,.0f} | {st['min']:,.0f}-{st['max']:,.0f} | "
            f"{vs} | {s['rss_peak_mib']:,.0f} | {s['rss_added_mib']:+,.0f} | "
            f"{export} | {s.get('trace_mb', 0):.1f} | {views} | {shapes} |"
        )
    chosen = ", ".join(default["options"]) or "none"
    lines += [
        "",
        f"Default options (the cheapest set that keeps {', '.join(REQUIRED_VIEWS)}): **{chosen}**; "
        f"{default['why']}. The rest are opt-in.",
    ]
    return lines


if __name__ == "__main__":
    sys.exit(main())
