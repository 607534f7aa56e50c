"""What the instrumentation costs: tokens/s with stage timing off, on (the default), and inside a
profiler window with and without Python stacks.

    python benchmarks/overhead.py                      # default preset, this machine
    python benchmarks/overhead.py --preset tiny --steps 20

Same pattern as ablation.py: each variant in a fresh process, `--repeats` times, medians over
the measured steps. The profiler variants profile exactly the measured steps. Prints the overhead
in percent against "timing off" and writes benchmarks/results/overhead-<device>-<preset>.json/.md.
Target: the default stage timing costs at most 2% on the CPU default preset.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PRESETS, RESULTS, device_slug, machine_line, run_variant, stamp, summarise  # noqa: E402

from minigpt.fileio import atomic_write  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Other flags go to train_minimal.py unchanged.")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args, trainer_flags = p.parse_known_args()
    if min(args.steps, args.repeats) < 1 or args.warmup < 1:
        p.error("--steps, --repeats and --warmup must be at least 1")

    window = ["--use-profiler", "--profile-step-start", str(args.warmup + 1),
              "--profile-step-end", str(args.warmup + args.steps + 1)]
    variants = {"timing off": ["--no-stage-timing"], "timing on (default)": [],
                "profiler": window, "profiler + stacks": [*window, "--profile-with-stack"]}
    meta = {**stamp(sys.argv), "name": args.preset, "trainer_flags": trainer_flags,
            "extra_flags": os.environ.get("MINIGPT_ARGS", ""),
            "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats}
    results = {}
    # Interleave the repeats (off, on, prof, stack, off, on, ...) so a drift of the machine
    # (thermal, a neighbour) spreads over every variant instead of biasing one.
    runs: dict[str, list] = {name: [] for name in variants}
    for r in range(args.repeats):
        for name, flags in variants.items():
            print(f"[{name}] repeat {r + 1}/{args.repeats}", flush=True)
            runs[name].append(run_variant([*PRESETS[args.preset], *trainer_flags, *flags], args.warmup, args.steps))
    for name in variants:
        results[name] = summarise(runs[name])
    base = results["timing off"]["tokens_per_s"]["median"]
    lines = [f"# Instrumentation overhead: {args.preset}", "", f"Machine: {machine_line(meta)}", "",
             f"Command: `{meta['command']}`", "",
             f"{args.steps} measured steps after {args.warmup} warm-up steps, {args.repeats} fresh processes per "
             "variant (interleaved); medians over every measured step.", "",
             "| variant | tokens/s (median) | repeats' medians | overhead vs timing off |", "|---|---|---|---|"]
    for name, s in results.items():
        tps = s["tokens_per_s"]["median"]
        s["overhead_pct"] = 100 * (base / tps - 1)
        reps = ", ".join(f"{t:,.0f}" for t in s["tokens_per_s_repeats"])
        lines.append(f"| {name} | {tps:,.0f} | {reps} | {s['overhead_pct']:+.1f}% |")
    lines += ["", "Overhead = time per token against timing off, in percent; a negative figure is noise "
              "(the spread of the repeats says how much)."]
    table = "\n".join(lines) + "\n"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"overhead-{device_slug(meta['machine'])}-{args.preset}"
    atomic_write(stem.with_suffix(".json"), json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    atomic_write(stem.with_suffix(".md"), table)
    print(table)
    print(f"wrote {stem}.json, .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
