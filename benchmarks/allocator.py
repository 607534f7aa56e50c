"""The CPU allocator's cost per training step, and its memory: what the trainer's malloc setting buys.

    python benchmarks/allocator.py                       # every variant installed here, 3 rounds
    python benchmarks/allocator.py --steps 6 --eval-interval 3 --repeats 1 --out-dir /tmp/alloc
    python benchmarks/allocator.py --render benchmarks/results/cpu-allocator.json

What it compares: the trainer's own in-process setting of glibc's malloc (train_minimal.py's
keep_freed_memory(), on by default: mallopt M_MMAP_MAX=0 and M_TRIM_THRESHOLD=2 GiB, so a freed big
tensor's pages stay with the process for the next step) against glibc's own defaults
(--no-keep-freed-memory), and beside them, where installed, other mallocs preloaded with LD_PRELOAD
under --no-keep-freed-memory (the trainer's mallopt is glibc's and would not reach them): mimalloc
(the libmimalloc.so of the PyPI package cmeel-mimalloc, which the trainer no longer needs), tcmalloc
and jemalloc (Debian's libtcmalloc-minimal4, libjemalloc2); the table says which were not installed.

Each variant is a fresh process that runs the trainer itself (train_minimal.py, the main job's
`small` preset, its AMP choice unless --amp/--no-amp) for --steps steps with an evaluation every
--eval-interval steps, as the main job does: an evaluation's shapes differ from a step's, and a heap
tuned for the step's pattern can grow there. The first row is the README's first command
(`python train_minimal.py`: the trainer's default setting). Per variant:

- per step (the median over the steps after the first SKIP_STEPS, evaluations' steps included):
  minor page faults and CPU seconds (user + system), read from /proc/PID/stat each time the trainer
  logs a step. A step whose big tensors come back from the kernel faults in each of their pages
  again (412 MB of logits: 100k faults); a kept heap does not. Both are counts of the work done, so
  they hold on a machine that other jobs share, where wall-clock time does not;
- tokens/s of the steps (median, and its spread over the rounds) and end to end;
- the process's peak RSS as the kernel counted it (os.wait4, evaluations included), as a multiple
  of the allocator's true peak in a training step (torch's own figure, the same whatever malloc
  does, measured once with estimate_table.measure).

The variants run in interleaved rounds, each ending with the first variant again (the A/A check;
--noisy as in ablation.py); CPU seconds and tokens/s are set against the first row with their 95%
interval. Writes benchmarks/results/cpu-allocator.json and .md; refuses to write there when the
machine is busy (load average above half the cores at the start) unless --busy, and the table then
says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import common as bench

MIB = 2**20
SKIP_STEPS = 2  # warm-up steps left out of the medians
RSS_BUDGET = 1.6  # the README's first command keeps peak RSS within this multiple of the true peak
TICKS = os.sysconf("SC_CLK_TCK")
README = "README's first command"


@dataclass(frozen=True)
class Variant:
    """`flags`: the trainer's flags that set its malloc; `preload`: a key of preload_paths() (a
    library put in LD_PRELOAD); `env`: the allocator's own options."""

    how: str
    flags: tuple[str, ...] = ()
    preload: str | None = None
    env: dict = field(default_factory=dict)


GLIBC_DEFAULTS = ("--no-keep-freed-memory",)
VARIANTS = {
    README: Variant(
        "`python train_minimal.py`: the trainer's default, glibc told to keep freed memory "
        "(mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=2 GiB)"
    ),
    "glibc defaults": Variant("--no-keep-freed-memory: glibc's malloc as it comes", GLIBC_DEFAULTS),
    "mimalloc": Variant(
        "LD_PRELOAD=libmimalloc.so (cmeel-mimalloc), its defaults; --no-keep-freed-memory",
        GLIBC_DEFAULTS,
        "mimalloc",
    ),
    "tcmalloc": Variant(
        "LD_PRELOAD=libtcmalloc_minimal.so.4; --no-keep-freed-memory", GLIBC_DEFAULTS, "tcmalloc"
    ),
    "jemalloc": Variant("LD_PRELOAD=libjemalloc.so.2; --no-keep-freed-memory", GLIBC_DEFAULTS, "jemalloc"),
}
LIBDIR = "/usr/lib/x86_64-linux-gnu"
PRELOADS = {"jemalloc": f"{LIBDIR}/libjemalloc.so.2", "tcmalloc": f"{LIBDIR}/libtcmalloc_minimal.so.4"}
MIMALLOC_DIST = "cmeel-mimalloc"  # the PyPI package that ships libmimalloc.so (not a requirement)


def mimalloc_library() -> str | None:
    """The libmimalloc.so that pip installed with cmeel-mimalloc, found through the package's own
    file list (any venv or prefix); None where the package is not installed."""
    from importlib import metadata

    try:
        files = metadata.distribution(MIMALLOC_DIST).files or []
    except metadata.PackageNotFoundError:
        return None
    lib = next((f for f in files if f.name == "libmimalloc.so"), None)
    return None if lib is None else str(lib.locate())


def preload_paths() -> dict[str, str | None]:
    """Each preloadable allocator's library on this machine, None where not installed."""
    paths = {name: (p if os.path.exists(p) else None) for name, p in PRELOADS.items()}
    return {**paths, "mimalloc": mimalloc_library()}


def true_peak(amp_dtype: str) -> int:
    """The allocator's peak in one training step of the main job's shape (torch's figure)."""
    from estimate_table import measure, shape_of

    from minigpt.config import PRESETS

    small = PRESETS["small"]
    return measure(shape_of("small", small["batch_size"], small["seq_len"]), amp_dtype=amp_dtype).peak


def proc_counts(pid: int) -> tuple[int, float] | None:
    """(minor page faults, CPU seconds user + system) of a live process, from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # after the name: state(0) ppid pgrp session tty tpgid flags minflt(7) cminflt majflt cmajflt
    # utime(11) stime(12)
    return int(fields[7]), (int(fields[11]) + int(fields[12])) / TICKS


def run(name: str, paths: dict, steps: int, eval_interval: int, amp: list[str]) -> dict:
    """One fresh trainer process under the variant; its figures."""
    v = VARIANTS[name]
    env = {k: val for k, val in os.environ.items() if k != "LD_PRELOAD"}
    if v.preload:
        env.update(LD_PRELOAD=paths[v.preload], **v.env)
    with tempfile.TemporaryDirectory(prefix="minigpt-alloc-") as tmp:
        out = Path(tmp) / "run"
        argv = [
            *("--num-steps", str(steps), "--eval-interval", str(eval_interval), "--log-interval", "1"),
            *("--no-checkpoint", "--no-report", "--out-dir", str(out), *amp, *v.flags),
        ]
        cmd = [sys.executable, str(bench.ROOT / "train_minimal.py"), *argv]
        with open(Path(tmp) / "stdout", "w+") as log:
            proc = subprocess.Popen(cmd, cwd=bench.ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            marks = watch(proc.pid, out / "metrics.jsonl")
            _, status, usage = os.wait4(proc.pid, 0)
            log.seek(0)
            text = log.read()
            if os.waitstatus_to_exitcode(status) != 0:
                raise RuntimeError(f"{name} failed:\n{text[-2000:]}")
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # the trainer's own line when it set glibc's malloc ("CPU malloc: ..."); none under --no-keep-freed-memory
    chose = next((line.split("] ", 1)[-1] for line in text.splitlines() if "CPU malloc:" in line), "")
    # per step: the counts' increase between two log lines (every step is logged); a step that ends
    # on an evaluation (step % eval_interval == 0) is counted apart, with its evaluation
    pairs = [(a, b) for a, b in zip(sorted(marks), sorted(marks)[1:]) if a >= SKIP_STEPS]
    evals = [(a, b) for a, b in pairs if b % eval_interval == 0 or b == steps]  # and one at the end
    plain = [pair for pair in pairs if pair not in evals]
    last = records[-1]
    tokens_per_step = last["tokens_per_s"] * last["step_time_s"]
    return {
        "allocator_line": chose,
        "amp": last["amp"],
        "tokens_per_s": [r["tokens_per_s"] for r in records[SKIP_STEPS:]],
        "tokens_per_s_e2e": last["step"] * tokens_per_step / last["elapsed_s"],
        "faults_per_step": [marks[b][0] - marks[a][0] for a, b in plain],
        "cpu_s_per_step": [marks[b][1] - marks[a][1] for a, b in plain],
        "faults_per_eval_step": [marks[b][0] - marks[a][0] for a, b in evals],
        "cpu_s_per_eval_step": [marks[b][1] - marks[a][1] for a, b in evals],
        "rss_peak_bytes": usage.ru_maxrss * 1024,  # the kernel's count (KiB on Linux)
        "cpu_user_s": usage.ru_utime,
        "cpu_system_s": usage.ru_stime,
        "minor_faults": usage.ru_minflt,
        "rss_bytes": last["memory"]["rss_bytes"],
    }


def watch(pid: int, metrics: Path) -> dict[int, tuple[int, float]]:
    """Until the process ends: its counts each time metrics.jsonl gains a line (a step logged)."""
    marks: dict[int, tuple[int, float]] = {}
    seen = 0
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        try:
            lines = metrics.read_text().splitlines() if metrics.exists() else []
        except OSError:
            lines = []
        complete = [line for line in lines if line.endswith("}")]
        if len(complete) > seen and (counts := proc_counts(pid)) is not None:
            seen = len(complete)
            marks[json.loads(complete[-1])["step"]] = counts
        time.sleep(0.01)
    return marks


def summarise(runs: list[dict]) -> dict:
    every = [t for r in runs for t in r["tokens_per_s"]]
    return {
        "allocator_line": runs[0]["allocator_line"],
        "amp": runs[0]["amp"],
        "tokens_per_s": {
            "median": statistics.median(every),
            "repeats": [statistics.median(r["tokens_per_s"]) for r in runs],
        },
        "tokens_per_s_e2e": statistics.median(r["tokens_per_s_e2e"] for r in runs),
        "faults_per_step": statistics.median(f for r in runs for f in r["faults_per_step"]),
        "cpu_s_per_step": {
            "median": statistics.median(c for r in runs for c in r["cpu_s_per_step"]),
            "repeats": [statistics.median(r["cpu_s_per_step"]) for r in runs],
        },
        "faults_per_eval_step": statistics.median(f for r in runs for f in r["faults_per_eval_step"]),
        "cpu_s_per_eval_step": statistics.median(c for r in runs for c in r["cpu_s_per_eval_step"]),
        "rss_peak_bytes": max(r["rss_peak_bytes"] for r in runs),
        **{k: statistics.median(r[k] for r in runs) for k in ("cpu_user_s", "cpu_system_s", "minor_faults")},
        "rss_bytes": max(r["rss_bytes"] for r in runs),
        "runs": runs,
    }


def markdown(meta: dict, results: dict, peak: int) -> str:
    amp = next(iter(results.values()))["amp"]
    lines = [
        *bench.header("CPU allocator: page faults, CPU time and peak RSS per malloc", meta),
        *bench.load_lines(meta),
        *bench.aa_lines(meta),
        f"The trainer itself (`train_minimal.py`, small preset: 4 layers, d 256, batch 8 x 256, vocabulary "
        f"50304, {amp}), {meta['steps']} steps with an evaluation ({meta.get('eval_iters', 10)} batches) "
        f"every {meta['eval_interval']} steps, {meta['repeats']} fresh processes per variant in interleaved "
        f"rounds. Per step: the median over the steps after the first {SKIP_STEPS} of every round, of the "
        "minor page faults and the CPU seconds (user + system) the kernel charged the process between "
        "two logged steps (`/proc/PID/stat`): counts of the work done, which other jobs on the machine "
        "move far less than wall-clock time; a step followed by an evaluation is counted apart, with it. "
        "tokens/s: the median of the steps after the warm-up (spread: the rounds' medians); end to end: "
        "steps x tokens over the trainer's elapsed time, evaluations included. "
        "Peak RSS: the largest over the rounds, as the kernel counted it (`os.wait4`), evaluations "
        "included.",
        "",
        f"The allocator's true peak in a training step (torch's own figure, `estimate_table.measure`, "
        f"{amp}): {peak / MIB:,.0f} MiB. Budget: peak RSS within {RSS_BUDGET}x of it.",
        "",
        "| variant | how | page faults per step | CPU s per step | spread (rounds) | vs first row | "
        "page faults, step + evaluation | CPU s, step + evaluation | tokens/s (steps) | spread (rounds) | "
        "vs first row | end to end | peak RSS MiB | x true peak | RSS at end MiB |",
        "|---" * 15 + "|",
    ]
    first = next(iter(results.values()))
    for name, r in results.items():
        how = r.get("how", "")  # as the run that measured it said (results of older variants too)
        if name == README and r["allocator_line"]:
            how = f"{how}: {r['allocator_line']}"
        t, c = r["tokens_per_s"], r["cpu_s_per_step"]
        vs_c, vs_t = (
            ("first row", "first row")
            if r is first
            else (
                bench.ratio_text(bench.ratio(first["cpu_s_per_step"]["repeats"], c["repeats"])),
                bench.ratio_text(bench.ratio(first["tokens_per_s"]["repeats"], t["repeats"])),
            )
        )
        lines.append(
            f"| {name} | {how} | {r['faults_per_step']:,.0f} | {c['median']:.2f} | "
            f"{min(c['repeats']):.2f}-{max(c['repeats']):.2f} | {vs_c} | {r['faults_per_eval_step']:,.0f} | "
            f"{r['cpu_s_per_eval_step']:.2f} | {t['median']:,.0f} | "
            f"{min(t['repeats']):,.0f}-{max(t['repeats']):,.0f} | {vs_t} | {r['tokens_per_s_e2e']:,.0f} | "
            f"{r['rss_peak_bytes'] / MIB:,.0f} | {r['rss_peak_bytes'] / peak:.2f} | "
            f"{r['rss_bytes'] / MIB:,.0f} |"
        )
    if meta.get("absent"):
        lines += ["", f"Not installed here, so not measured: {', '.join(meta['absent'])}."]
    ok = [n for n, r in results.items() if r["rss_peak_bytes"] <= RSS_BUDGET * peak]
    fewest = min(results, key=lambda n: results[n]["cpu_s_per_step"]["median"])
    lines += [
        "",
        f"Fewest CPU seconds per step: {fewest}. Within {RSS_BUDGET}x of the true peak: "
        f"{', '.join(ok) or 'none'}.",
    ]
    return "\n".join(lines) + "\n"


def render_table(data: dict, md: Path) -> None:
    """--render: the .md again from a results .json; a file without the per-step counts cannot
    fill the table (KeyError: render() says which file)."""
    if "faults_per_step" not in next(iter(data["results"].values())):
        raise KeyError("faults_per_step: a results file without the per-step counts; measure again")
    bench.write_md(md, markdown(data["meta"], data["results"], data["true_peak"]))


def main() -> int:
    p = bench.Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--eval-interval", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="default: every one installed here")
    p.add_argument(
        "--amp", action=argparse.BooleanOptionalAction, help="default: the trainer's choice on this CPU"
    )
    bench.output_flags(p, "measure nothing: rewrite the .md")
    args = p.parse_args()
    if args.render:
        return bench.render(p, args.render, lambda d: render_table(d, args.render.with_suffix(".md")))
    bench.check_out_dir(p, args.out_dir)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.steps < SKIP_STEPS + 3 or not 2 <= args.eval_interval < args.steps:
        # a step with an evaluation and one without, after the warm-up
        p.error(f"--steps must be at least {SKIP_STEPS + 3} and --eval-interval within 2..--steps - 1")
    paths = preload_paths()
    absent = [n for n, v in VARIANTS.items() if v.preload and paths[v.preload] is None]
    if args.variants and (missing := [n for n in args.variants if n in absent]):
        p.error(f"{', '.join(missing)}: not installed here")
    names = args.variants or [n for n in VARIANTS if n not in absent]
    names = sorted(names, key=lambda n: n != README)  # the fresh machine's row first
    meta = {
        **bench.stamp(sys.argv),
        **bench.refuse_if_busy(args.out_dir, args.busy),
        "steps": args.steps,
        "eval_interval": args.eval_interval,
        "repeats": args.repeats,
        "absent": sorted({VARIANTS[n].preload for n in absent}),
        "noisy": args.noisy,
    }
    amp = [] if args.amp is None else ["--amp" if args.amp else "--no-amp"]
    raw = measure(names, paths, args, amp)
    meta["load_end"] = bench.load_average()
    results = {
        name: {"how": VARIANTS[name].how, **summarise(runs)}
        for name, runs in raw.items()
        if not name.endswith(bench.AA)
    }
    copy = summarise(raw[bench.aa_name(names[0])])
    first, what = results[names[0]], {"cpu_s_per_step": "CPU s per step", "tokens_per_s": "tokens/s"}
    meta["aa"] = [
        bench.aa_check(names[0], first[k]["repeats"], copy[k]["repeats"], f"{w} of each round")
        for k, w in what.items()
    ]
    amp_dtype = next(iter(results.values()))["amp"]
    peak = true_peak("bf16" if amp_dtype == "bf16" else "fp32")
    data = {"meta": meta, "results": results, "true_peak": peak}
    table = markdown(meta, results, peak)
    return bench.publish(args.out_dir, "cpu-allocator", meta, data, table, "allocator.py")


def measure(names: list[str], paths: dict, args, amp: list[str]) -> dict[str, list[dict]]:
    """Interleaved rounds: each runs every variant once, then the first one's copy (A/A check)."""
    raw: dict[str, list[dict]] = {n: [] for n in bench.with_aa(names)}
    for r in range(args.repeats):
        for name in raw:
            raw[name].append(run(name.removesuffix(bench.AA), paths, args.steps, args.eval_interval, amp))
            last = raw[name][-1]
            print(
                f"[{name}] round {r + 1}: {statistics.median(last['faults_per_step']):,.0f} faults/step, "
                f"{statistics.median(last['cpu_s_per_step']):.2f} CPU s/step, "
                f"peak RSS {last['rss_peak_bytes'] / MIB:,.0f} MiB",
                flush=True,
            )
    return raw


if __name__ == "__main__":
    sys.exit(main())
