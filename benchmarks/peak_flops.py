"""How still the MFU denominator holds: minigpt.instruments.peak's measurement in N fresh processes,
without the cache (each process measures) and with it (the first fills it, the rest read it).

    python benchmarks/peak_flops.py --dtype bf16       # the trainer's denominator (bf16 where native)
    python benchmarks/peak_flops.py --preset tiny --processes 2

Uncached, each process measures; how far their figures spread under the machine's load is what
this checks (the cached ones read the first's figure, or a better one a later process measured). Two
uncached measurements on a quiet machine should agree within --tolerance (checked here, never in a
test: tests assert no timings). Writes benchmarks/results/peak-flops-<device>-<preset>.json/.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import RESULTS, Parser, check_out_dir, device_slug, header, save_json, stamp

from minigpt.config import PRESETS as MODEL_PRESETS
from minigpt.fileio import atomic_write
from minigpt.instruments.peak import CALLS_S, SIZES


def child(preset: str, dtype: str, cache: bool) -> None:
    """The trainer's denominator in `dtype`: the machine's square products, as
    minigpt.instruments.peak.measured times them where its cache has no figure (uncached: measured
    whatever the cache holds; cached: measured() itself), whatever the preset."""
    from minigpt.instruments import peak

    if cache:
        found = peak.measured("cpu", dtype)
        value, source, others = found.value, found.source, found.others
        winner = source.split(": ", 1)[1].split(", the best", 1)[0] if ": " in source else source
    else:
        entry = max((peak.measure("cpu", dtype, n) for n in peak.SIZES), key=lambda e: e["best"])
        value, source, others, winner = entry["best"], "measured now", entry["others"], entry["what"]
    print(
        json.dumps(
            {
                "value": value,
                "source": source,
                "winner": winner,
                "others": others,  # the share of the cores other processes took (None: read from the cache)
                "load": os.getloadavg()[0],
            }
        )
    )


def measure(processes: int, preset: str, dtype: str) -> dict[str, list[dict]]:
    """`processes` rounds, each an uncached and a cached process; the cached ones share one fresh
    cache folder, so the first fills it and the rest read it."""
    runs: dict[str, list[dict]] = {"uncached": [], "cached": []}
    with tempfile.TemporaryDirectory(prefix="minigpt-peak-") as cache:
        env = {**os.environ, "MINIGPT_CACHE_DIR": cache}
        for i in range(processes):  # interleaved: uncached, cached, uncached, ...
            for mode in runs:
                print(f"[{mode}] process {i + 1}/{processes}", flush=True)
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        mode,
                        "--preset",
                        preset,
                        "--dtype",
                        dtype,
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    return runs


def summarise(rs: list[dict]) -> dict:
    """One mode's figures over its processes: how far apart the highest and the lowest are."""
    values = [r["value"] for r in rs]
    return {
        "values": values,
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "max_over_min": max(values) / min(values),
        "winners": [r["winner"] for r in rs],
        "sources": [r["source"] for r in rs],
        "loads": [r["load"] for r in rs],
        "others": [r.get("others") for r in rs],
    }


def main() -> int:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small", choices=sorted(MODEL_PRESETS))
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--processes", type=int, default=5)
    ap.add_argument(
        "--tolerance",
        type=float,
        default=0.25,
        help="uncached figures of two processes may differ by this fraction (default 0.25)",
    )
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--child", choices=["cached", "uncached"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.preset, args.dtype, args.child == "cached")
        return 0
    if args.processes < 2:
        ap.error("--processes must be at least 2")
    check_out_dir(ap, args.out_dir)
    runs = measure(args.processes, args.preset, args.dtype)
    meta = {**stamp(sys.argv), "preset": args.preset, "dtype": args.dtype, "processes": args.processes}
    results = {mode: summarise(rs) for mode, rs in runs.items()}
    ratio = results["uncached"]["max_over_min"]
    lines = [
        *header(f"MFU denominator over {args.processes} fresh processes: {args.preset}, {args.dtype}", meta),
        "Each process measures as minigpt.instruments.peak does when its cache has no figure: the "
        f"{' and '.join(f'{n}^3' for n in SIZES)} products in the dtype, each the best of many short calls "
        f"in {CALLS_S} s after a warm-up, timed by the smaller of wall clock and CPU time. "
        "Uncached and cached processes interleave; the cached ones share one fresh cache folder. "
        "The machine's load is in the last columns: the load average, and the share of the cores other "
        "processes took while the figure was timed (none for a figure read from the cache).",
        "",
        "| mode | TFLOP/s per process | median | max/min | winning unit | 1-min load when measured "
        "| others' share of the cores |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, r in results.items():
        lines.append(
            f"| {mode} | {', '.join(f'{v / 1e12:.4f}' for v in r['values'])} | {r['median'] / 1e12:.4f} "
            f"| {r['max_over_min']:.3f} | {', '.join(sorted(set(r['winners'])))} "
            f"| {', '.join('n/a' if v is None else f'{v:.2f}' for v in r['loads'])} "
            f"| {', '.join('-' if v is None else f'{v:.0%}' for v in r['others'])} |"
        )
    verdict = "within" if ratio - 1 <= args.tolerance else "NOT within"
    lines += [
        "",
        f"Uncached processes: the highest is {100 * (ratio - 1):.1f}% above the lowest, {verdict} the "
        f"{100 * args.tolerance:.0f}% tolerance. "
        f"Cached: {100 * (results['cached']['max_over_min'] - 1):.1f}%.",
    ]
    table = "\n".join(lines) + "\n"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"peak-flops-{device_slug(meta['machine'])}-{args.preset}"
    save_json(stem, {"meta": meta, "results": results})
    atomic_write(stem.with_suffix(".md"), table)
    print(table)
    return 0 if verdict == "within" else 1


if __name__ == "__main__":
    sys.exit(main())
