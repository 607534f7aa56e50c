"""The CPU allocator's memory cost beside its speed: peak RSS and tokens/s per malloc setting.

    python benchmarks/allocator.py                  # small preset, fp32, 3 rounds
    python benchmarks/allocator.py --render benchmarks/results/cpu-allocator.json

Each variant is a fresh process that trains the small preset in fp32 (AMP is emulated, slow and
beside the point on an AVX2 CPU) for --warmup + --steps steps, and reports tokens/s over the
measured steps, its peak RSS (getrusage) and its RSS at the end. The variants run in interleaved
rounds. The allocator's true peak (torch's own figure, the same whatever malloc does) is measured
once, with minigpt.memory.capture_memory, so that RSS can be read as a multiple of it.

Variants: glibc keeping freed blocks (minigpt/cpu.py's keep-freed setting), glibc's defaults, glibc
bounded (big blocks from the heap, mmap above 1 GiB, the heap trimmed above 256 MiB), and jemalloc
and tcmalloc through LD_PRELOAD (Debian's libjemalloc2 and libtcmalloc-minimal4).
Writes benchmarks/results/cpu-allocator.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import RESULTS, ROOT, header, load_results, save_json, stamp

from minigpt.fileio import atomic_write

MIB = 2**20
LIBDIR = Path("/usr/lib/x86_64-linux-gnu")
# name -> (malloc setting applied in the child, LD_PRELOAD library or None)
VARIANTS = {
    "glibc keep-freed": ("keep", None),
    "glibc defaults": ("defaults", None),
    "glibc bounded": ("bounded", None),
    "jemalloc": ("defaults", LIBDIR / "libjemalloc.so.2"),
    "tcmalloc": ("defaults", LIBDIR / "libtcmalloc_minimal.so.4"),
}
SPEED_BUDGET = 0.10  # the default may cost at most 10% of tokens/s ...
RSS_BUDGET = 1.5  # ... to keep peak RSS within 1.5x the allocator's true peak


def child(setting: str, warmup: int, steps: int, measure_peak: bool) -> dict:
    """Runs in the fresh process: the setting first, then the training steps."""
    from minigpt import cpu

    if setting == "keep":
        cpu.never_return_memory()
    elif setting == "bounded":
        cpu.bounded_freed_memory()
    import torch

    from minigpt.config import PRESETS
    from minigpt.memory import capture_memory, process_memory
    from minigpt.model import GPT, GPTConfig

    p = PRESETS["small"]
    b, s, V = p["batch_size"], p["seq_len"], 50304
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab_size=V,
            max_position_embeddings=s,
            n_layers=p["n_layers"],
            n_heads=p["n_heads"],
            d_model=p["d_model"],
            d_ff=p["d_ff"],
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=True)
    times = []
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        x = torch.randint(0, V, (b, s))
        _, loss = model(x, torch.roll(x, -1, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    out = {"tokens_per_s": [b * s / t for t in times], **process_memory()}
    if measure_peak:
        with capture_memory(model, optimizer) as cap:
            _, loss = model(x, torch.roll(x, -1, 1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        out["true_peak"] = cap.breakdown.peak
    return out


def run(name: str, warmup: int, steps: int, measure_peak: bool = False) -> dict:
    setting, preload = VARIANTS[name]
    env = dict(os.environ)
    if preload is not None:
        env["LD_PRELOAD"] = str(preload)
    cmd = [sys.executable, __file__, "--child", setting, "--warmup", str(warmup), "--steps", str(steps)]
    if measure_peak:
        cmd.append("--measure-peak")
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def markdown(meta: dict, results: dict, peak: int) -> str:
    base = results["glibc keep-freed"]["tokens_per_s"]["median"]
    lines = [
        *header("CPU allocator: peak RSS against tokens/s", meta),
        f"small preset (4 layers, d 256, batch 8 x 256, vocabulary 50304), fp32, {meta['steps']} measured "
        f"steps after {meta['warmup']} warm-up step(s), {meta['repeats']} fresh processes per variant in "
        "interleaved rounds; tokens/s: median over every measured step (spread: min-max of the rounds' "
        "medians); RSS: the largest over the rounds. The machine was shared with other jobs.",
        "",
        f"The allocator's true peak in a step (torch's own figure, `capture_memory`): {peak / MIB:,.0f} MiB. "
        f"Budget: peak RSS within {RSS_BUDGET}x of it unless that costs more than "
        f"{100 * SPEED_BUDGET:.0f}% of tokens/s.",
        "",
        "| variant | how | tokens/s | spread | vs keep-freed | peak RSS MiB | x true peak | RSS at end MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        setting, preload = VARIANTS[name]
        how = (
            f"LD_PRELOAD={Path(preload).name}"
            if preload
            else {
                "keep": "mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=2 GiB",
                "defaults": "none",
                "bounded": "mallopt M_MMAP_THRESHOLD=1 GiB, M_TRIM_THRESHOLD=256 MiB",
            }[setting]
        )
        t = r["tokens_per_s"]
        how += {"keep": " (minigpt's default until now)", "bounded": " (minigpt's default now)"}.get(
            setting, ""
        )
        lines.append(
            f"| {name} | {how} | {t['median']:,.0f} | {min(t['repeats']):,.0f}-{max(t['repeats']):,.0f} | "
            f"{t['median'] / base:.2f}x | {r['rss_peak_bytes'] / MIB:,.0f} | "
            f"{r['rss_peak_bytes'] / peak:.2f} | {r['rss_bytes'] / MIB:,.0f} |"
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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--child", choices=["keep", "defaults", "bounded"], help=argparse.SUPPRESS)
    p.add_argument("--measure-peak", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--render", type=Path, metavar="RESULTS_JSON")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.warmup, args.steps, args.measure_peak)))
        return 0
    if args.render:
        data = load_results(p, args.render)
        atomic_write(
            args.render.with_suffix(".md"), markdown(data["meta"], data["results"], data["true_peak"])
        )
        return 0
    missing = [n for n in args.variants if VARIANTS[n][1] is not None and not VARIANTS[n][1].exists()]
    if missing:
        p.error(f"{', '.join(missing)}: not installed (apt-get install -y libjemalloc2 libtcmalloc-minimal4)")
    meta = {**stamp(sys.argv), "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats}
    true_peak = run("glibc defaults", 1, 1, measure_peak=True)["true_peak"]
    raw: dict[str, list[dict]] = {n: [] for n in args.variants}
    for r in range(args.repeats):  # interleaved: each round runs every variant once
        for name in args.variants:
            raw[name].append(run(name, args.warmup, args.steps))
            print(
                f"[{name}] round {r + 1}: {statistics.median(raw[name][-1]['tokens_per_s']):,.0f} tokens/s, "
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
            "rss_peak_bytes": max(r["rss_peak_bytes"] for r in runs),
            "rss_bytes": max(r["rss_bytes"] for r in runs),
            "runs": runs,
        }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / "cpu-allocator"
    save_json(stem, {"meta": meta, "results": results, "true_peak": true_peak})
    table = markdown(meta, results, true_peak)
    atomic_write(stem.with_suffix(".md"), table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
