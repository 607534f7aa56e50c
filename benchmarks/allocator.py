"""The CPU allocator's memory cost beside its speed: peak RSS and tokens/s per malloc setting.

    python benchmarks/allocator.py                  # the main job's shape, fp32, 3 rounds
    python benchmarks/allocator.py --render benchmarks/results/cpu-allocator.json

Each variant is a fresh process that runs the trainer itself (train_minimal.py, small preset, fp32:
AMP is emulated, slow and beside the point on an AVX2 CPU) for --steps steps with an evaluation
every --eval-interval steps, as the main job does: an evaluation's shapes differ from a step's, and
a heap tuned for the step's pattern can grow there. Per variant: tokens/s of the steps (median of
the steps after the first two), tokens/s end to end (steps x tokens over the trainer's elapsed
time, evaluations included), and the process's peak RSS as the kernel counted it (os.wait4's
ru_maxrss), beside the trainer's own figure. The variants run in interleaved rounds. The allocator's
true peak (torch's own figure, the same whatever malloc does) is measured once, with
minigpt.memory.capture_memory, so that RSS can be read as a multiple of it.

Variants: glibc's defaults; glibc bounded (big blocks from the heap, mmap above 1 GiB, the heap
trimmed above 256 MiB); the same, its free blocks given back around evaluations (the trainer's
default); glibc never mapping nor trimming (the oldest setting, asked for by name); jemalloc and
tcmalloc through LD_PRELOAD (Debian's libjemalloc2 and libtcmalloc-minimal4).
Writes benchmarks/results/cpu-allocator.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import RESULTS, ROOT, header, load_results, save_json, stamp

from minigpt.fileio import atomic_write

MIB = 2**20
LIBDIR = Path("/usr/lib/x86_64-linux-gnu")
# name -> (malloc setting applied in the child before the trainer starts, LD_PRELOAD library or None).
# "trainer" leaves the choice to the trainer's default (minigpt/cpu.py keep_freed_memory); the
# others run it with --no-keep-freed-memory so that it leaves the child's setting alone.
VARIANTS = {
    "glibc defaults": ("defaults", None),
    "glibc bounded": ("bounded", None),
    "glibc bounded, given back at evaluations": ("trainer", None),
    "jemalloc": ("trainer", LIBDIR / "libjemalloc.so.2"),
    "tcmalloc": ("trainer", LIBDIR / "libtcmalloc_minimal.so.4"),
    "glibc never trims": ("keep", None),
}
DEFAULT_VARIANTS = list(VARIANTS)[:5]
HOW = {
    "defaults": "none",
    "bounded": "mallopt M_MMAP_THRESHOLD=1 GiB, M_TRIM_THRESHOLD=256 MiB",
    "trainer": "the same, and malloc_trim(0) around each evaluation (the default without tcmalloc)",
    "keep": "mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=2 GiB (minigpt's first default)",
}
SPEED_BUDGET = 0.10  # the default may cost at most 10% of tokens/s ...
RSS_BUDGET = 1.5  # ... to keep peak RSS within 1.5x the allocator's true peak
SKIP_STEPS = 2  # warm-up steps left out of the steps' median


def child(setting: str, argv: list[str]) -> None:
    """Runs in the fresh process: the setting first, then the trainer as `python train_minimal.py`."""
    from minigpt import cpu

    if setting == "keep":
        cpu.never_return_memory()
    elif setting == "bounded":
        cpu.bounded_freed_memory()
    if setting != "trainer":
        argv = [*argv, "--no-keep-freed-memory"]
    sys.argv = [str(ROOT / "train_minimal.py"), *argv]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code:
            raise


def true_peak() -> int:
    """The allocator's peak in one training step of the same shape (torch's figure)."""
    from estimate_table import measure, shape_of

    from minigpt.config import PRESETS

    return measure(shape_of("small", PRESETS["small"]["batch_size"], PRESETS["small"]["seq_len"])).peak


def run(name: str, steps: int, eval_interval: int) -> dict:
    """One fresh trainer process under the variant's setting; its figures."""
    setting, preload = VARIANTS[name]
    env = {**os.environ, "MINIGPT_MALLOC": "glibc"}  # the variant's malloc, not the trainer's choice
    if preload is not None:
        env["LD_PRELOAD"] = str(preload)
    with tempfile.TemporaryDirectory(prefix="minigpt-alloc-") as tmp:
        out = Path(tmp) / "run"
        argv = [
            *("--num-steps", str(steps), "--eval-interval", str(eval_interval), "--log-interval", "1"),
            *("--no-checkpoint", "--no-report", "--out-dir", str(out)),
        ]
        with open(Path(tmp) / "stdout", "w+") as log:
            proc = subprocess.Popen(
                [sys.executable, __file__, "--child", setting, "--", *argv],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            if proc.returncode != 0:
                log.seek(0)
                raise RuntimeError(f"{name} failed:\n{log.read()[-2000:]}")
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    tokens_per_step = last["tokens_per_s"] * last["step_time_s"]
    return {
        "tokens_per_s": [r["tokens_per_s"] for r in records[SKIP_STEPS:]],
        "tokens_per_s_e2e": last["step"] * tokens_per_step / last["elapsed_s"],
        "rss_peak_bytes": usage.ru_maxrss * 1024,  # the kernel's count (KiB on Linux)
        # what the kernel charged the process: CPU seconds (user, system: page faults are system time)
        # and page faults. Less moved by other jobs on a shared machine than wall-clock tokens/s.
        "cpu_user_s": usage.ru_utime,
        "cpu_system_s": usage.ru_stime,
        "minor_faults": usage.ru_minflt,
        "trainer_rss_peak_bytes": last["memory"]["rss_peak_bytes"],
        "rss_bytes": last["memory"]["rss_bytes"],
    }


def markdown(meta: dict, results: dict, peak: int) -> str:
    base_name = "glibc defaults" if "glibc defaults" in results else next(iter(results))
    base = results[base_name]
    lines = [
        *header("CPU allocator: peak RSS against tokens/s", meta),
        f"The trainer itself (`train_minimal.py`, small preset: 4 layers, d 256, batch 8 x 256, vocabulary "
        f"50304, fp32), {meta['steps']} steps with an evaluation ({meta.get('eval_iters', 10)} batches) "
        f"every {meta['eval_interval']} steps, {meta['repeats']} fresh processes per variant in interleaved "
        f"rounds. tokens/s: the median of the steps after the first {SKIP_STEPS} (spread: min-max of the "
        "rounds' medians); end to end: steps x tokens over the trainer's elapsed time, evaluations "
        "included (median of the rounds). Peak RSS: the largest over the rounds, as the kernel counted it "
        "(`os.wait4`), beside the trainer's own figure (its last log line). CPU seconds and page faults: "
        "what the kernel charged the whole process (`os.wait4`, median of the rounds); they move less than "
        "tokens/s when other jobs share the machine, and page faults are the cost a kept heap avoids. "
        + ("The machine was shared with other jobs." if meta.get("shared") else ""),
        "",
        f"The allocator's true peak in a training step (torch's own figure, `capture_memory`): "
        f"{peak / MIB:,.0f} MiB. Budget: peak RSS within {RSS_BUDGET}x of it unless that costs more than "
        f"{100 * SPEED_BUDGET:.0f}% of tokens/s.",
        "",
        f"| variant | how | tokens/s (steps) | spread | vs {base_name} | end to end | CPU s user + system | "
        "page faults | peak RSS MiB | x true peak | trainer's peak RSS MiB | RSS at end MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        setting, preload = VARIANTS[name]
        how = f"LD_PRELOAD={Path(preload).name}" if preload else HOW[setting]
        t = r["tokens_per_s"]
        lines.append(
            f"| {name} | {how} | {t['median']:,.0f} | {min(t['repeats']):,.0f}-{max(t['repeats']):,.0f} | "
            f"{t['median'] / base['tokens_per_s']['median']:.2f}x | {r['tokens_per_s_e2e']:,.0f} | "
            f"{r['cpu_user_s']:,.0f} + {r['cpu_system_s']:,.0f} | {r['minor_faults'] / 1e6:,.2f} M | "
            f"{r['rss_peak_bytes'] / MIB:,.0f} | {r['rss_peak_bytes'] / peak:.2f} | "
            f"{r['trainer_rss_peak_bytes'] / MIB:,.0f} | {r['rss_bytes'] / MIB:,.0f} |"
        )
    ok = [n for n, r in results.items() if r["rss_peak_bytes"] <= RSS_BUDGET * peak]
    best = max(results, key=lambda n: results[n]["tokens_per_s"]["median"])
    fast_ok = [
        n
        for n in ok
        if results[n]["tokens_per_s"]["median"]
        >= (1 - SPEED_BUDGET) * results[best]["tokens_per_s"]["median"]
    ]
    lines += [
        "",
        f"Fastest: {best}. Within {RSS_BUDGET}x of the true peak: {', '.join(ok) or 'none'}; of those within "
        f"{100 * SPEED_BUDGET:.0f}% of the fastest: {', '.join(fast_ok) or 'none'}.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":  # --child SETTING -- TRAINER ARGS
        child(sys.argv[2], sys.argv[4:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--eval-interval", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    p.add_argument("--shared", action="store_true", help="say in the table that the machine was shared")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--render", type=Path, metavar="RESULTS_JSON")
    args = p.parse_args()
    if args.render:
        data = load_results(p, args.render)
        atomic_write(
            args.render.with_suffix(".md"), markdown(data["meta"], data["results"], data["true_peak"])
        )
        return 0
    if args.steps <= SKIP_STEPS or not 0 < args.eval_interval <= args.steps:
        p.error(f"--steps must be above {SKIP_STEPS} and --eval-interval within 1..--steps")
    missing = [n for n in args.variants if VARIANTS[n][1] is not None and not VARIANTS[n][1].exists()]
    if missing:
        p.error(f"{', '.join(missing)}: not installed (apt-get install -y libjemalloc2 libtcmalloc-minimal4)")
    meta = {
        **stamp(sys.argv),
        "steps": args.steps,
        "eval_interval": args.eval_interval,
        "repeats": args.repeats,
        "shared": args.shared,
    }
    peak = true_peak()
    raw: dict[str, list[dict]] = {n: [] for n in args.variants}
    for r in range(args.repeats):  # interleaved: each round runs every variant once
        for name in args.variants:
            raw[name].append(run(name, args.steps, args.eval_interval))
            print(
                f"[{name}] round {r + 1}: {statistics.median(raw[name][-1]['tokens_per_s']):,.0f} tokens/s, "
                f"{raw[name][-1]['tokens_per_s_e2e']:,.0f} end to end, "
                f"peak RSS {raw[name][-1]['rss_peak_bytes'] / MIB:,.0f} MiB",
                flush=True,
            )
    results = {}
    for name, runs in raw.items():
        every = [t for run_ in runs for t in run_["tokens_per_s"]]
        results[name] = {
            "tokens_per_s": {
                "median": statistics.median(every),
                "repeats": [statistics.median(r["tokens_per_s"]) for r in runs],
            },
            "tokens_per_s_e2e": statistics.median(r["tokens_per_s_e2e"] for r in runs),
            "rss_peak_bytes": max(r["rss_peak_bytes"] for r in runs),
            **{
                k: statistics.median(r[k] for r in runs)
                for k in ("cpu_user_s", "cpu_system_s", "minor_faults")
            },
            "trainer_rss_peak_bytes": max(r["trainer_rss_peak_bytes"] for r in runs),
            "rss_bytes": max(r["rss_bytes"] for r in runs),
            "runs": runs,
        }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / "cpu-allocator"
    save_json(stem, {"meta": meta, "results": results, "true_peak": peak})
    table = markdown(meta, results, peak)
    atomic_write(stem.with_suffix(".md"), table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
