"""What the benchmarks share: run a trainer variant in a fresh process, read back its per-step
figures, summarise them as medians with their spread, describe the machine and its load, give each
ratio its interval and check the baseline against itself (A/A), and refuse a user's mistake in one
line before anything is measured.

Each run of a variant is `train_minimal.py <flags> --num-steps W+N+1 --log-interval 1`: W warm-up
steps (not counted), N measured steps, then one more step on which the memory breakdown is
measured (its hooks would slow a measured step). Every step is logged, so every step is a sample.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import NoReturn

from minigpt.analysis.breakdown_log import MEMORY_BREAKDOWN_KEYS
from minigpt.analysis.stats import MIN_SAMPLES
from minigpt.config import BUSY
from minigpt.config import STAGE_NAMES as STAGES

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# Benchmark presets: trainer flags. "nanogpt" is the shape of the nanoGPT speed comparison
# (4 layers, 4 heads, 256 wide, block 256, batch 8, vocabulary 50304, tied embeddings, no
# dropout): the trainer's default `small` preset, named here so anyone can rerun the comparison.
PRESETS = {
    "small": ["--preset", "small"],
    "nanogpt": ["--preset", "small", "--dropout", "0"],
    "gpt2": ["--preset", "gpt2"],
    "tiny": ["--preset", "tiny"],
}


def machine(device: str = "auto") -> dict:
    """The device and the versions, as every result file records them. `device`: the trainer's
    --device the benchmark passes on ("auto": a GPU where one is visible, as the trainer picks)."""
    import torch

    from minigpt.instruments.mfu import cpu_bf16_features

    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "platform": platform.platform(),
    }
    if device != "cpu" and torch.cuda.is_available():
        info.update(device="cuda", device_name=torch.cuda.get_device_name(), gpus=torch.cuda.device_count())
    else:
        info.update(
            device="cpu",
            device_name=cpu_model(),
            cores=os.cpu_count(),
            **cpu_bf16_features(),
        )
    return info


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform module knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def native_bf16(m: dict) -> bool:
    """Whether the machine of a results file runs bf16 natively (a GPU, AVX512-BF16 or AMX)."""
    return m["device"] != "cpu" or bool(m.get("avx512_bf16") or m.get("amx"))


def device_slug(info: dict) -> str:
    """'cpu' or the GPU's name in lower case with dashes (nvidia-h100-80gb-hbm3): the file prefix."""
    if info["device"] == "cpu":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", info["device_name"].lower()).strip("-")


def run_variant(
    flags: list[str], warmup: int, steps: int, nproc: int = 1, timeout: float = 3600, keep: Path | None = None
) -> dict:
    """One fresh process (or a torchrun job of `nproc`) running the trainer; returns the measured
    steps' rows of metrics.jsonl, the memory breakdown, and config.json. `keep`: where to copy the
    run directory (for minigpt.analysis.compare); otherwise it goes with its temporary folder."""
    with tempfile.TemporaryDirectory(prefix="minigpt-bench-") as tmp:
        out = Path(tmp) / "run"
        total = warmup + steps + 1
        fixed = [
            "--num-steps",
            str(total),
            "--log-interval",
            "1",
            "--eval-interval",
            str(10 * total),
            "--eval-iters",
            "1",
            "--warmup-steps",
            "1",
            "--memory-profiler",
            "--memory-profile-step",
            str(total),
            "--no-checkpoint",
            "--no-report",
            "--out-dir",
            str(out),
        ]
        launcher = (
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
            if nproc > 1
            else [sys.executable]
        )
        # $MINIGPT_ARGS (a user's scaled-down flags) go before the benchmark's own, so that the
        # step counts and the memory step the measurement relies on still hold.
        env = dict(os.environ)
        extra = shlex.split(env.pop("MINIGPT_ARGS", ""))
        cmd = [*launcher, str(ROOT / "train_minimal.py"), *flags, *extra, *fixed]
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
        if result.returncode != 0:
            raise RuntimeError(f"variant failed ({shlex.join(flags)}):\n{result.stderr[-3000:]}")
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        config = json.loads((out / "config.json").read_text())
        if keep is not None:
            shutil.copytree(out, keep, dirs_exist_ok=True)
    measured = [r for r in rows if warmup < r["step"] <= warmup + steps]
    breakdown = next((r["memory_breakdown"] for r in rows if r.get("memory_breakdown")), None)
    return {"rows": measured, "breakdown": breakdown, "config": config}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def busy_share(run: dict) -> float | None:
    """The share of a run's measured steps that ran busy (metrics.jsonl's `busy`, the share of the
    cores other processes took, above minigpt.config.BUSY); None where the trainer did not record it."""
    marks = [r["busy"] for r in run["rows"] if r.get("busy") is not None]
    return sum(b > BUSY for b in marks) / len(marks) if marks else None


def ran_busy(summary: dict) -> bool:
    """Whether any repeat of a variant ran busy: more than BUSY of its measured steps with other
    processes taking more than BUSY of the cores. No verdict is drawn from such a run."""
    return any(b is not None and b > BUSY for b in summary.get("busy_repeats", []))


def summarise(runs: list[dict]) -> dict:
    """Medians over every measured step of every repeat; tokens/s also per repeat (its spread
    across fresh processes is the honest error bar), and each repeat's busy share."""
    rows = [r for run in runs for r in run["rows"]]
    per_repeat = [statistics.median(r["tokens_per_s"] for r in run["rows"]) for run in runs]
    summary = {
        "tokens_per_s": spread([r["tokens_per_s"] for r in rows]),
        "tokens_per_s_repeats": per_repeat,
        "busy_repeats": [busy_share(run) for run in runs],
        "step_ms": spread([1000 * r["step_time_s"] for r in rows]),
        "mfu": statistics.median(r["mfu"] for r in rows),
        "stage_host_ms": {
            s: statistics.median(r["stage_host_ms"].get(s, 0.0) for r in rows)
            for s in STAGES
            if rows and s in rows[0]["stage_host_ms"]
        },
        "stage_device_ms": {
            s: statistics.median(r["stage_device_ms"].get(s, 0.0) for r in rows)
            for s in STAGES
            if rows and s in rows[0]["stage_device_ms"]
        },
    }
    cuda_peaks = [
        r["memory"]["peak_allocated_gib"] for r in rows if r.get("memory", {}).get("peak_allocated_gib")
    ]
    if cuda_peaks:
        summary["peak_allocated_gib"] = max(cuda_peaks)
    breakdown = runs[0]["breakdown"]
    if breakdown:
        # the byte figures the trainer logs, and where the peak fell; "peak" is the allocator's
        # measured peak of the step (--memory-profiler), "total" the sum of the parts beside it
        keys = (*MEMORY_BREAKDOWN_KEYS, "peak_stage")
        summary["breakdown_bytes"] = {k: breakdown[k] for k in keys if k in breakdown}
    return summary


def stamp(command: list[str]) -> dict:
    """When, by which command, on which machine: the device the command's --device names (passed on
    to the trainer), else the one the trainer picks."""
    flags = command[1:]
    device = next((v for f, v in zip(flags, flags[1:]) if f == "--device"), None)
    device = next((f.split("=", 1)[1] for f in flags if f.startswith("--device=")), device)
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(["python", *[os.path.relpath(command[0], ROOT)] + command[1:]]),
        "machine": machine(device or "auto"),
    }


def machine_line(meta: dict) -> str:
    m = meta["machine"]
    bf16 = ", ".join(n for k, n in (("avx512_bf16", "AVX512-BF16"), ("amx", "AMX")) if m.get(k))
    where = (
        f"{m['device_name']} ({m.get('cores')} cores, {bf16 or 'no native bf16'})"
        if m["device"] == "cpu"
        else f"{m['device_name']} (CUDA {m['cuda']})"
    )
    return f"{where}; torch {m['torch']}, Python {m['python']}; {meta['date']}"


def header(title: str, meta: dict) -> list[str]:
    """The opening lines of every results table: what, on which machine, by which command (and
    the earlier runs whose rows a --keep run kept)."""
    lines = [f"# {title}", "", f"Machine: {machine_line(meta)}", "", f"Command: `{meta['command']}`", ""]
    for m in meta.get("earlier", []):
        lines += [f"Rows kept from an earlier run: `{m['command']}` ({machine_line(m)})", ""]
    return lines


def keeping(meta: dict, earlier: dict) -> dict:
    """This run's meta, naming the earlier run (and those it kept) whose rows are kept beside its own."""
    before = [*earlier.get("earlier", []), {k: v for k, v in earlier.items() if k != "earlier"}]
    return {**meta, "earlier": [m for m in before if m.get("command") != meta["command"]]}


# A results name (ablation.py --name) is one file name: it goes after the device in
# <out-dir>/<device>-<name>.{json,md,png}. A slash would move the files elsewhere than the
# existence check looked, and what is not letters, digits, '.', '_', '+' or '-' (a '..', a space,
# a control character, '<script>') has no business in a file name a table links.
RESULTS_NAME = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9._+-]{0,99}")
RESULTS_SUFFIXES = (".json", ".md", ".png")


def results_name_arg(text: str) -> str:
    """argparse's type for --name: the name as given, or one line saying what a name may hold."""
    if not RESULTS_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a results name: give 1 to 100 letters, digits, '.', '_', '+' or '-' "
            "(no '/', no leading '.'), such as small-fp32"
        )
    return text


def results_file(stem: Path, suffix: str) -> Path:
    """stem + suffix: not Path.with_suffix, which would cut a name at its last '.' (lr-0.5 and
    lr-0.7 would both become lr-0.json)."""
    return stem.with_name(stem.name + suffix)


def save_json(stem: Path, data: dict) -> None:
    from minigpt.fileio import atomic_write

    atomic_write(results_file(stem, ".json"), json.dumps(data, indent=2) + "\n")


def write_md(path: Path, table: str) -> None:
    """A table, written whole or not at all, and printed for the console."""
    from minigpt.fileio import atomic_write

    atomic_write(path, table)
    print(table)


def write_table(stem: Path, data: dict, table: str) -> None:
    """The results .json and its table (.md) beside it, each written whole or not at all; the
    table is printed too, for the console."""
    from minigpt.fileio import atomic_write

    save_json(stem, data)
    atomic_write(results_file(stem, ".md"), table)
    print(table)
    print(f"wrote {stem}.json, .md")


def output_flags(p: argparse.ArgumentParser, render_help: str, busy: bool = True) -> None:
    """The flags the measuring benchmarks share: where the results go, --render, and (where the
    benchmark times anything) --busy."""
    if busy:
        p.add_argument(
            "--busy",
            action="store_true",
            help="write benchmarks/results even when the load at the start is above half the cores "
            "(the table then says the machine was busy)",
        )
        p.add_argument(
            "--noisy",
            action="store_true",
            help="write benchmarks/results even when the A/A check (the baseline against its own copy) "
            "fails: the machine was too noisy to tell (the table then says so)",
        )
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--render", type=Path, metavar="RESULTS_JSON", help=render_help)


def refuse_to_overwrite(
    parser: argparse.ArgumentParser,
    stem: Path,
    force: bool,
    instead: str = "--out-dir DIR to write elsewhere",
) -> None:
    """Before any run: results already at `stem` (.json, .md, .png) are usually committed figures
    that README cites, and a test run must not replace them (overhead.py once rewrote its .md and
    dropped the section README quotes). One line, exit 2, unless --force."""
    there = [f for f in (results_file(stem, x) for x in RESULTS_SUFFIXES) if f.exists()]
    if there and not force:
        parser.error(f"{there[0]} is already there; pass {instead}, or --force to overwrite")


class Parser(argparse.ArgumentParser):
    """argparse whose error is one line, the mistake and its fix, not a usage block: a benchmark is
    often started from a script or a notebook cell, where six lines of usage bury the one that
    matters."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


# A results .json is a few hundred KiB at most; the bound keeps --render of a wrong path (a log, a
# device) from reading without end.
RESULTS_LIMIT = 64 * 2**20
# What a results file of the wrong kind or of an older layout raises in a table's code: a missing
# key, a value of the wrong type, an empty list.
NOT_RESULTS = (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError, StopIteration)


def load_results(parser: argparse.ArgumentParser, path: Path) -> dict:
    """A results .json for --render, or the parser's one-line error (missing, not a regular file,
    not JSON, not a results file)."""
    from minigpt.fileio import UnreadableFile, read_bounded

    if not path.exists():
        parser.error(f"{path} does not exist; pass a results .json (benchmarks/results/*.json)")
    try:
        data = json.loads(read_bounded(path, RESULTS_LIMIT))
    except UnreadableFile as e:
        parser.error(str(e))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        parser.error(f"{path} is not JSON ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    if not isinstance(data, dict) or not isinstance(data.get("meta"), dict):
        parser.error(f'{path} is not a benchmark results file (no "meta" object); pass one this tool wrote')
    return data


def render(parser: argparse.ArgumentParser, path: Path, write: Callable[[dict], object]) -> int:
    """--render: `write` makes the table (and chart) again from the results file at `path`, beside
    it. A file of another tool or layout, or a folder that cannot be written, is one line."""
    data = load_results(parser, path)
    try:
        write(data)
    except NOT_RESULTS as e:
        parser.error(f"{path} is not a results file of {parser.prog} ({type(e).__name__}: {e})")
    except OSError as e:
        parser.error(f"cannot write beside {path} ({e.strerror or e}); copy the .json to a writable folder")
    return 0


def check_out_dir(parser: argparse.ArgumentParser, out_dir: Path, flag: str = "--out-dir") -> None:
    """Before anything is measured: the results can be written in `out_dir` (made later if missing),
    so that a long run does not end in a traceback with its figures lost. Probed by creating a file,
    which answers for root and read-only file systems alike, where permission bits do not."""
    probe = out_dir
    while not probe.exists() and probe.parent != probe:  # the nearest folder that is there
        probe = probe.parent
    if not probe.is_dir():
        parser.error(f"{flag} {out_dir}: {probe} is a file, not a folder; name a folder for the results")
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=".minigpt-probe-")
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        parser.error(f"{flag} {out_dir}: {probe} is not writable ({e.strerror}); name a folder you can write")


def available_bytes() -> int | None:
    """The memory the kernel says a new process can take now (MemAvailable), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# ----------------------------------------------------------------------------- the machine's load
# A figure measured while other jobs ran is not a result: each benchmark records the load average
# at its start and end, and refuses to write into benchmarks/results/ when the load at the start is
# above this share of the cores (--busy overrides; the table then says the machine was busy).
BUSY_SHARE = 0.5


def load_average() -> float:
    """The 1-minute load average (runnable processes, on Linux also those waiting on I/O)."""
    return os.getloadavg()[0]


def refuse_if_busy(out_dir: Path, busy_ok: bool) -> dict:
    """The load at the start, as meta keys. Exits with status 2 and one line when it is above
    BUSY_SHARE of the cores, the results would go to the committed folder and --busy was not given."""
    cores = os.cpu_count() or 1
    load = load_average()
    busy = load > BUSY_SHARE * cores
    committed = out_dir.resolve() == RESULTS.resolve()
    if busy and committed and not busy_ok:
        print(
            f"error: load average {load:.2f} on {cores} cores (above {BUSY_SHARE:.0%} of them): figures "
            f"measured now are not results; wait for a quiet machine, write elsewhere (--out-dir), or "
            f"pass --busy to write {os.path.relpath(RESULTS, ROOT)} anyway (the table then says so)",
            file=sys.stderr,
        )
        sys.exit(2)
    return {"load_start": load, "cores": cores, "busy": busy}


def load_lines(meta: dict) -> list[str]:
    """What the load was at the start and end of the run; a warning when it was busy. A results
    file without the load says so: its figures cannot be weighed against the machine's state."""
    if "load_start" not in meta:
        return ["Load: not recorded (measured before benchmarks recorded it; not comparable).", ""]
    cores = meta["cores"]
    line = (
        f"Load average: {meta['load_start']:.2f} at the start, {meta.get('load_end', float('nan')):.2f} at "
        f"the end, on {cores} cores."
    )
    if warning := busy_warning(meta):
        line += f" **{warning}**"
    return [line, ""]


def busy_warning(meta: dict) -> str | None:
    """The warning a table (and its chart) carries when the machine was busy, else None."""
    if "load_start" not in meta:
        return None
    cores = meta["cores"]
    # At the end the benchmark's own threads count too (one runnable per core): only a load above
    # that, and half the cores more, says other work joined in.
    end_busy = meta.get("load_end", 0) > (1 + BUSY_SHARE) * cores
    if meta["load_start"] > BUSY_SHARE * cores or end_busy:
        return (
            "The machine was busy (load above half the cores at the start, or other work beside the "
            "benchmark's own threads at the end): times and tokens/s here are not results; counts "
            "(page faults, bytes) still are."
        )
    return None


# ----------------------------------------------------------------------------- ratios and their noise
# Every ratio a benchmark prints is B / A of per-repeat figures (each repeat a fresh process), with
# its 95% interval from minigpt.analysis.stats; one whose interval holds 1.0 reads "no difference within
# noise". Each run also measures its baseline twice in the same interleaved rounds (the A/A check):
# two copies of one configuration differ only by the machine's noise, so when their interval leaves
# out 1.0, the machine moved more than the intervals allow for and no ratio of the run is a finding.
FRESH = "repeats in fresh processes"
AA = " (A/A)"  # the name of the baseline's second copy


def aa_name(baseline: str) -> str:
    return baseline + AA


def with_aa(names: list[str]) -> list[str]:
    """The variants of one round, the baseline's copy last: as far as a round allows from the
    baseline itself, so a drift within the round shows in the check."""
    return [*names, aa_name(names[0])]


def ratio(a: list[float], b: list[float], method: str = FRESH) -> dict:
    """B / A as a results file keeps it: minigpt.analysis.stats' interval and verdict, or with fewer than
    MIN_SAMPLES repeats a side, the ratio of geometric means and the line that says what an
    interval needs (`short`). `method`: what the samples are, when not repeats in fresh processes."""
    from minigpt.analysis.stats import StatsError, ratio_interval

    try:
        return ratio_interval(a, b, method=method).to_json()
    except StatsError as e:
        a, b = [x for x in a if x and x > 0], [x for x in b if x and x > 0]
        point = (
            math.exp(statistics.fmean(map(math.log, b)) - statistics.fmean(map(math.log, a)))
            if a and b
            else None
        )
        return {"ratio": point, "n_a": len(a), "n_b": len(b), "verdict": None, "short": str(e)}


def ratio_text(r: dict | None) -> str:
    """A ratio for a table cell or a finding: the verdict ("1.23x (1.10-1.38)", or "no difference
    within noise"), or with too few repeats the bare ratio marked as such."""
    if not r:
        return "-"
    if r.get("verdict"):
        return r["verdict"]
    n = min(r["n_a"], r["n_b"])
    why = f"{n} repeat{'' if n == 1 else 's'}, an interval needs {MIN_SAMPLES}"
    return f"n/a ({why})" if r.get("ratio") is None else f"{r['ratio']:.2f}x (no interval: {why})"


def aa_check(baseline: str, a: list[float], b: list[float], what: str) -> dict:
    """The A/A check of one run: the baseline's figures `a` against its copy's `b` (`what` they
    are). `passed` is True when the interval holds 1.0, False when it leaves 1.0 out (the machine
    too noisy to tell), None with too few repeats for an interval."""
    r = ratio(a, b)
    passed = None if not r.get("verdict") else r["low"] <= 1.0 <= r["high"]
    return {"baseline": baseline, "what": what, "a": a, "b": b, **r, "passed": passed}


def aa_failed(meta: dict) -> bool:
    return any(c.get("passed") is False for c in meta.get("aa", []))


def aa_lines(meta: dict) -> list[str]:
    """What the A/A check found, for the table's head: each check's ratio and interval, and when one
    failed, that the ratios of the run are not findings (naming --noisy where it let them into the
    committed results)."""
    checks = meta.get("aa")
    if checks is None:
        return ["A/A check: not recorded (the run did not measure its baseline twice).", ""]
    lines = []
    for c in checks:
        line = f"A/A check: {c['baseline']} against a second copy of itself in the same rounds, {c['what']}: "
        line += ratio_text(c)
        if c["passed"] is None:
            line += ". Too few repeats to weigh the machine's noise: the ratios here are not findings."
        elif c["passed"]:
            line += " (the copies agree: the intervals here hold this run's noise)."
        else:
            line += (
                ". **The baseline differs from itself: the machine was too noisy to tell, and the ratios "
                "here are not findings.**"
            )
        lines += [line, ""]
    if aa_failed(meta) and meta.get("noisy"):
        lines += [
            f"Written to `{os.path.relpath(RESULTS, ROOT)}` with `--noisy` despite the failed A/A check.",
            "",
        ]
    return lines


def publish(out_dir: Path, name: str, meta: dict, data: dict, text: str, script: str) -> int:
    """Write the results (`name`.json and .md) where destination() says, and the exit status: 1, with
    its one line on stderr, when a failed A/A check sent them elsewhere; else 0."""
    where, noisy = destination(out_dir, meta, meta.get("noisy"))
    where.mkdir(parents=True, exist_ok=True)
    write_table(where / name, data, text)
    if noisy:
        print(f"{script}: {noisy}", file=sys.stderr)
    return 1 if noisy else 0


def destination(out_dir: Path, meta: dict, noisy_ok: bool) -> tuple[Path, str | None]:
    """Where a run's results go: `out_dir`, unless the A/A check failed, `out_dir` is the committed
    folder and --noisy was not given; then a fresh folder outside the repository (nothing measured
    is lost), and the one line that says so."""
    if not aa_failed(meta) or noisy_ok or out_dir.resolve() != RESULTS.resolve():
        return out_dir, None
    elsewhere = Path(tempfile.mkdtemp(prefix="minigpt-noisy-"))
    check = next(c for c in meta["aa"] if c["passed"] is False)
    return elsewhere, (
        f"A/A check failed ({check['baseline']} against itself: {ratio_text(check)}): the machine was too "
        f"noisy to tell; results written to {elsewhere}, not {os.path.relpath(RESULTS, ROOT)}: measure "
        "again on a quiet machine, or pass --noisy to write there (the table then says so)"
    )
