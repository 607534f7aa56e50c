"""The run's own figures (instruments/figures.py): tokens/s in steady state (warm-up and
instrumented steps left out, and named) and end to end, MFU, start-up, each defined once, written
on every metrics.jsonl record, and read unchanged by the last log line, the report and
minigpt.analysis.compare."""

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, TINY, run_cli
from test_report import make_run
from test_train import sigterm_at

import train_minimal
from minigpt.analysis.compare import compare_runs, format_compare
from minigpt.analysis.record import RUN_KEYS
from minigpt.analysis.report import summary_section
from minigpt.analysis.runfiles import load_run
from minigpt.instruments.window import PROFILER_STDERR_NOTE


def read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """A tiny real run whose log intervals differ in length (4, 4, 2 steps): a mean of interval
    means would differ from every step's tokens over every step's time."""
    out = tmp_path_factory.mktemp("figures") / "run"
    t0 = time.monotonic()
    r = run_cli(*TINY, "--num-steps", "10", "--log-interval", "4", "--out-dir", str(out))
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    return out, r.stdout, wall


def test_run_wide_rates_are_the_steady_steps_tokens_over_their_time(real_run):
    out, _, wall = real_run
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [4, 8, 10]
    tokens_per_step = 8 * 16  # --batch-size 8 x --seq-len 16, one rank
    # Step 1 is the process's warm-up: out of the first interval's means and of the run's rate.
    assert [len(r["left_out"]) for r in rows] == [1, 0, 0]
    assert rows[0]["left_out"][0]["step"] == 1 and rows[0]["left_out"][0]["why"] == "warm-up"
    assert [r["steady_steps"] for r in rows] == [3, 4, 2]
    summed = [sum(r["steady_steps"] * r["step_time_s"] for r in rows[: i + 1]) for i in range(len(rows))]
    for row, step_time in zip(rows, summed):  # cumulative on every record
        assert row["run_steps"] == row["step"] - 1
        assert row["run_tokens"] == row["run_steps"] * tokens_per_step
        assert row["tokens_trained"] == row["step"] * tokens_per_step
        assert row["run_step_time_s"] == pytest.approx(step_time, rel=1e-9)
        assert row["run_tokens_per_s"] == pytest.approx(row["run_tokens"] / step_time, rel=1e-9)
        assert row["tokens_per_s_e2e"] == pytest.approx(row["tokens_trained"] / row["elapsed_s"], rel=1e-9)
        assert row["run_left_out"]["warm-up"]["steps"] == [1]
    last = rows[-1]
    warmup = last["run_left_out"]["warm-up"]["s"]
    assert warmup == pytest.approx(rows[0]["left_out"][0]["s"])
    # The loop holds the steps and more (warm-up, evaluation, logging): end to end is below steady state.
    assert last["tokens_per_s_e2e"] < last["run_tokens_per_s"]
    assert last["elapsed_s"] > last["run_step_time_s"] + warmup
    # Start-up is the process's age at the loop's start: above zero, below the whole process's wall.
    assert 0 < last["startup_s"] < wall - last["elapsed_s"]
    # The per-interval keys keep their meaning: the last interval's own rate.
    assert last["tokens_per_s"] == pytest.approx(tokens_per_step / last["step_time_s"], rel=1e-9)


def test_the_last_line_says_the_last_records_figures(real_run):
    out, stdout, _ = real_run
    last = read_metrics(out)[-1]
    lines = stdout.splitlines()
    at = next(i for i, x in enumerate(lines) if "Training finished:" in x)
    assert f"10 steps, {last['tokens_trained']:,} tokens;" in lines[at]
    warmup = last["run_left_out"]["warm-up"]["s"]
    assert lines[at + 1].endswith(
        f"steady state: {last['run_tokens_per_s']:,.0f} tokens/s, 9 steps in {last['run_step_time_s']:.2f}s"
    )
    left = f"left out: step 1, {warmup:.2f}s: the first step: allocations and kernel selection"
    assert lines[at + 2].endswith(left)
    e2e = f"end to end: {last['tokens_per_s_e2e']:,.0f} tokens/s over {last['elapsed_s']:.2f}s of loop"
    assert e2e in lines[at + 3]
    assert re.search(r"start-up \d+\.\ds before the loop, in neither figure$", lines[at + 3])
    at = next(i for i, x in enumerate(lines) if " step 4/10 " in x)
    assert f"left out: step 1 {rows_first_left(out):.2f}s (warm-up)" in lines[at + 1]  # the stage line


def rows_first_left(out) -> float:
    return read_metrics(out)[0]["left_out"][0]["s"]


def test_report_and_compare_read_the_same_keys(real_run):
    out, _, _ = real_run
    last = read_metrics(out)[-1]
    page = summary_section(load_run(out))
    assert (
        f"{last['run_tokens_per_s']:,.0f} (the run: {last['run_tokens']:,} tokens of 9 steady steps" in page
    )
    assert (
        f"{last['tokens_per_s_e2e']:,.0f} ({last['tokens_trained']:,} tokens / {last['elapsed_s']:.2f}s"
        in page
    )
    assert "step 1, " in page and "the first step: allocations and kernel selection" in page
    thr = {r["metric"]: r for r in compare_runs(out, out)["throughput"]}
    for key in ("run_tokens_per_s", "tokens_per_s_e2e", "run_mfu", "startup_s"):
        assert thr[key]["a"] == last[key] and thr[key]["ratio"] == pytest.approx(1.0)


def test_the_reports_mfu_is_the_runs_not_an_intervals(real_run):
    """The MFU row is the run's, as the trainer recorded it (run_mfu: the steady steps' tokens/s
    against config.json's peak, the last interval's MFU scaled by the two rates), not the median
    interval's, nor a figure the report works out for itself."""
    out, _, _ = real_run
    last = read_metrics(out)[-1]
    assert last["run_mfu"] == pytest.approx(last["mfu"] * last["run_tokens_per_s"] / last["tokens_per_s"])
    assert set(RUN_KEYS) <= set(last)
    page = summary_section(load_run(out))
    row = re.search(r"MFU over the run</t[hd]>\s*<td>([^<]*)", page)
    assert row and row[1].startswith(f"{100 * last['run_mfu']:.1f}% (")


def test_compare_says_what_precision_each_run_used_and_names_the_rss_peak(tmp_path):
    a = make_run(tmp_path / "a", amp="fp32")
    b = make_run(tmp_path / "b", amp="bf16")
    config = json.loads((a / "config.json").read_text())
    config["config"]["amp"] = False  # --no-amp
    (a / "config.json").write_text(json.dumps(config))
    rows = read_metrics(b)
    for r in rows:
        r["memory"] = {"rss_bytes": 3 * 2**30, "rss_peak_bytes": 4327.5 * 2**20}
    (b / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = format_compare(compare_runs(a, b))
    assert "  amp: fp32 (--no-amp) -> bf16 (default)" in text.splitlines()
    assert "None" not in text and "amp (resolved)" not in text
    memory = text.split("peak memory MiB")[1]
    rss = next(x for x in memory.splitlines() if x.startswith("process peak RSS"))
    assert rss.split()[-2] == "4,327.50"  # MiB, as the heading says
    assert "bytes" not in memory


def test_start_up_counts_from_the_scripts_start_not_the_processs_age(tmp_path):
    """`bash -c "sleep 2 && exec python train_minimal.py"`: python runs in bash's process, whose age
    holds the sleep (a pip install, say); start-up counts from the script. A notebook's second run
    counts from its own main() call."""
    out = tmp_path / "run"
    flags = " ".join([*TINY, "--num-steps", "2", "--no-checkpoint", "--no-report", "--out-dir", str(out)])
    script = f"sleep 5 && exec {sys.executable} {ROOT / 'train_minimal.py'} {flags}"
    t0 = time.monotonic()
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    last = read_metrics(out)[-1]
    # the process's age at the loop's start was over 5 s + start-up; what is left after the sleep
    # and the loop is the start-up and the last lines
    assert 0 < last["startup_s"] < wall - 5 - last["elapsed_s"] and "MINIGPT_STARTED_AT" not in os.environ
    t1 = time.time()
    assert (
        train_minimal.cli([*TINY, "--num-steps", "1", "--no-report", "--out-dir", str(tmp_path / "b")]) == 0
    )
    inside = read_metrics(tmp_path / "b")[-1]["startup_s"]
    assert 0 <= inside <= time.time() - t1  # from the call, not from this interpreter's imports


def test_a_profiled_run_explains_torchs_stderr_lines_after_they_appear(tmp_path):
    """torch writes 'USDT: ... profiler_start' and a CPUAllocator warning to stderr from C++ in a
    profiled run: the log says what they are, once, after the profiler's window that printed them
    (and only if torch printed one), and the run's stderr holds nothing else unexplained."""
    out = tmp_path / "run"
    r = run_cli(
        *TINY,
        "--num-steps",
        "4",
        "--log-interval",
        "2",
        "--use-profiler",
        "--profile-step-start",
        "2",
        "--profile-step-end",
        "3",
        "--out-dir",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    notes = [i for i, x in enumerate(lines) if PROFILER_STDERR_NOTE in x]
    window_done = next(i for i, x in enumerate(lines) if "View the trace" in x)
    assert "USDT" in r.stderr and len(notes) == 1 and notes[0] > window_done
    explained = ("profiler_start", "profiler_stop", "Memory block of unknown size")
    unexplained = [x for x in r.stderr.splitlines() if x.strip() and not any(e in x for e in explained)]
    assert unexplained == []
    (trace,) = (out / "traces").glob("rank0_dp0.*.pt.trace.json.gz")  # written whole, and readable
    with gzip.open(trace, "rt") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert "ProfilerStep#2" in names and "[memory]" in names  # the step and its memory events


def test_a_resumed_run_counts_from_its_resume(tmp_path, capsys):
    """The steps before a resume were another process's: the resumed run's figures, its last line
    and its report count from the checkpoint's step and say so."""
    out = tmp_path / "run"
    flags = [*TINY, "--num-steps", "6", "--log-interval", "2", "--out-dir", str(out)]
    assert train_minimal.cli(flags, on_step=sigterm_at(4)) == 128 + signal.SIGTERM
    assert train_minimal.cli([*flags, "--resume"]) == 0
    last = read_metrics(out)[-1]
    # steps 5 and 6 trained; step 5, the resumed process's first, is its warm-up
    assert last["step"] == 6 and last["tokens_trained"] == 2 * 8 * 16 and last["run_tokens"] == 8 * 16
    assert last["run_left_out"]["warm-up"]["steps"] == [5]
    finished = next(x for x in capsys.readouterr().out.splitlines() if "Training finished:" in x)
    assert "2 steps (since the resume at step 4), 256 tokens;" in finished
    assert "(since the resume: 128 tokens of 1 steady steps /" in summary_section(load_run(out))
