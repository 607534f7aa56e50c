"""What the instrumentation costs: tokens/s with stage timing off, on (the default), and inside a
profiler window with and without Python stacks.

    python benchmarks/overhead.py                      # default preset, this machine
    python benchmarks/overhead.py --preset tiny --steps 20

Same pattern as ablation.py: each variant in a fresh process, `--repeats` times, medians over
the measured steps. The profiler variants profile exactly the measured steps. Prints the overhead
in percent against "timing off" and writes benchmarks/results/overhead-<device>-<preset>.json/.md.
Target: the default stage timing costs at most 2% on the CPU default preset.

End to end, tokens/s of fresh processes on a shared 2-core machine spread by several percent, more
than the timing can cost. So the script also times the instrumentation alone: empty steps with the
four stages, without ranges, with ranges only (--no-stage-timing) and with ranges and timing (the
default), thousands of times in one process, best of 5 rounds. The differences are the cost per
step, down to about a microsecond of noise, and are set against the measured step time.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from common import (PRESETS, RESULTS, STAGES, device_slug, header, load_results, run_variant, save_json,
                    stamp, summarise)

from minigpt.fileio import atomic_write
from minigpt.instrument import StageTimer


def instrumentation_us_per_step(device: str, steps: int = 20_000) -> dict[str, float]:
    """Host microseconds per step of the instrumentation alone: a step of four empty stages, with no
    ranges (the bare loop), with the ranges only (--no-stage-timing), and with ranges and timing."""
    import time
    from contextlib import nullcontext

    def bare_step():
        for _ in STAGES:
            with nullcontext():
                pass

    def timed_step(timer):
        with timer.step():
            for st in STAGES:
                with timer.stage(st):
                    pass

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
        if len(on.host_steps) > 1000:  # read at the "log interval", as the loop does
            on.read()

    return {"bare loop": per_step(bare_step), "ranges only (--no-stage-timing)": per_step(lambda: timed_step(off)),
            "ranges + timing (default)": per_step(timed_on)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Other flags go to train_minimal.py unchanged.")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--micro-steps", type=int, default=20_000,
                   help="empty steps per round of the in-process instrumentation timing (default 20000)")
    p.add_argument("--render", type=Path, metavar="RESULTS_JSON",
                   help="measure nothing: write the .md again from a results .json")
    args, trainer_flags = p.parse_known_args()
    if min(args.steps, args.repeats) < 1 or args.warmup < 1:
        p.error("--steps, --repeats and --warmup must be at least 1")
    if args.render:
        data = load_results(p, args.render)
        table = markdown(data["meta"], data["results"], data["instrumentation_us_per_step"])
        atomic_write(args.render.with_suffix(".md"), table)
        print(table)
        return 0

    window = ["--use-profiler", "--profile-step-start", str(args.warmup + 1),
              "--profile-step-end", str(args.warmup + args.steps + 1)]
    variants = {"timing off": ["--no-stage-timing"], "timing on (default)": [],
                "profiler": window, "profiler + stacks": [*window, "--profile-with-stack"]}
    meta = {**stamp(sys.argv), "name": args.preset, "trainer_flags": trainer_flags,
            "extra_flags": os.environ.get("MINIGPT_ARGS", ""),
            "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "micro_steps": args.micro_steps}
    # Interleave the repeats (off, on, prof, stack, off, on, ...) so a drift of the machine
    # (thermal, a neighbour) spreads over every variant instead of biasing one.
    runs: dict[str, list] = {name: [] for name in variants}
    for r in range(args.repeats):
        for name, flags in variants.items():
            print(f"[{name}] repeat {r + 1}/{args.repeats}", flush=True)
            runs[name].append(run_variant([*PRESETS[args.preset], *trainer_flags, *flags], args.warmup, args.steps))
    results = {name: summarise(runs[name]) for name in variants}
    base = results["timing off"]["tokens_per_s"]["median"]
    for s in results.values():
        s["overhead_pct"] = 100 * (base / s["tokens_per_s"]["median"] - 1)
    costs = instrumentation_us_per_step(meta["machine"]["device"], args.micro_steps)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"overhead-{device_slug(meta['machine'])}-{args.preset}"
    data = {"meta": meta, "results": results, "instrumentation_us_per_step": costs}
    save_json(stem, data)
    table = markdown(meta, results, costs)
    atomic_write(stem.with_suffix(".md"), table)
    print(table)
    print(f"wrote {stem}.json, .md")
    return 0


def markdown(meta: dict, results: dict, costs: dict) -> str:
    lines = [*header(f"Instrumentation overhead: {meta['name']}", meta),
             f"{meta['steps']} measured steps after {meta['warmup']} warm-up steps, {meta['repeats']} fresh processes "
             "per variant (interleaved); medians over every measured step.", "",
             "| variant | tokens/s (median) | repeats' medians | overhead vs timing off |", "|---|---|---|---|"]
    for name, s in results.items():
        reps = ", ".join(f"{t:,.0f}" for t in s["tokens_per_s_repeats"])
        lines.append(f"| {name} | {s['tokens_per_s']['median']:,.0f} | {reps} | {s['overhead_pct']:+.1f}% |")
    lines += ["", "Overhead = time per token against timing off, in percent; a negative figure is noise "
              "(the spread of the repeats says how much)."]
    # The instrumentation alone, against the step time it rides on.
    step_us = 1000 * results["timing on (default)"]["step_ms"]["median"]
    total_us = costs["ranges + timing (default)"] - costs["bare loop"]
    timing_us = costs["ranges + timing (default)"] - costs["ranges only (--no-stage-timing)"]
    lines += ["", f"The instrumentation alone (empty stages, best of 5 rounds of {meta.get('micro_steps', 20_000):,} "
              "steps, host microseconds per step):", "", "| step of four empty stages | us per step |", "|---|---|"]
    lines += [f"| {name} | {us:.1f} |" for name, us in costs.items()]
    lines += ["", f"The default instrumentation (ranges and timing) costs {total_us:.1f} us per step, against a "
              f"measured step of {step_us / 1000:,.0f} ms: {100 * total_us / step_us:.4f}% (target: at most 2% "
              f"for the timing). The timing's own share, {timing_us:+.1f} us, is "
              + ("below the resolution of this measurement (the rows differ by less than their noise)."
                 if timing_us < 1 else f"{100 * timing_us / step_us:.4f}% of the step.")]
    if meta.get("extra_flags"):
        lines += ["", f"Flags from $MINIGPT_ARGS, applied to every variant: `{meta['extra_flags']}`"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
