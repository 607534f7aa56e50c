"""The run's own figures (metrics.RunTotals): tokens/s in steady state (warm-up and instrumented
steps left out, and named) and end to end, start-up, each defined once, written on every
metrics.jsonl record, and read unchanged by the last log line, the report and
minigpt.analysis.compare; an older run's steady figure is rebuilt from its intervals after the
first, and says so."""

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
from minigpt.analysis.compare import compare_runs, format_compare, headline
from minigpt.analysis.report import summary_section
from minigpt.analysis.runfiles import OLDER_RUN, REBUILT, RUN_KEYS, load_run
from minigpt.instruments.instrument import Interval, RunTotals, StageTimes, evaluation_notice
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
    line = next(x for x in stdout.splitlines() if "Training finished:" in x)
    assert f"10 steps, {last['tokens_trained']:,} tokens;" in line
    warmup = last["run_left_out"]["warm-up"]["s"]
    assert (
        f"{last['run_tokens_per_s']:,.0f} tokens/s in steady state "
        f"(9 steps in {last['run_step_time_s']:.2f}s; "
        f"left out: step 1, {warmup:.2f}s: the first step: allocations and kernel selection)" in line
    )
    assert f"{last['tokens_per_s_e2e']:,.0f} tokens/s end to end ({last['elapsed_s']:.2f}s of loop" in line
    assert re.search(r"start-up \d+\.\ds before the loop, in neither figure$", line)
    lines = stdout.splitlines()
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
    for key in ("run_tokens_per_s", "tokens_per_s_e2e", "startup_s"):
        assert thr[key]["a"] == last[key] and thr[key]["ratio"] == pytest.approx(1.0)


def test_the_reports_mfu_is_the_runs_not_an_intervals(real_run, tmp_path):
    """The MFU row is the run's: its tokens/s over the steps alone against the same denominator as
    the last interval's MFU (so it is that MFU scaled by the two rates), not the median interval's."""
    out, _, _ = real_run
    last = read_metrics(out)[-1]
    expected = last["mfu"] * last["run_tokens_per_s"] / last["tokens_per_s"]
    page = summary_section(load_run(out))
    row = re.search(r"MFU over the run</t[hd]>\s*<td>([^<]*)", page)
    assert row and row[1].startswith(f"{100 * expected:.1f}% (")
    # An older run whose denominator was measured under load: no MFU above 100%, the reason instead.
    figures = dict(run_tokens=7680, run_step_time_s=1.5e-6, run_tokens_per_s=5e9, tokens_per_s_e2e=4e9)
    figures |= dict(elapsed_s=1.9e-6, startup_s=1.0)
    poisoned = with_run_figures(make_run(tmp_path / "old", tokens_per_s=5e9), **figures)
    page = summary_section(load_run(poisoned))
    assert "is below what the run achieved" in page and not re.search(
        r"MFU over the run</t[hd]>\s*<td>\d", page
    )


def with_run_figures(folder, **figures):
    """Add the run-wide keys to a made-up run's records, as the trainer now writes them."""
    rows = [{**r, **figures} for r in read_metrics(folder)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_an_older_runs_steady_figure_is_rebuilt_and_says_so(tmp_path):
    steps = (10, 20, 30, 40, 50)  # enough logged intervals for compare to give an interval
    old = make_run(tmp_path / "old", tokens_per_s=1000.0, steps=steps)  # a trainer before the run-wide keys
    new = with_run_figures(
        make_run(tmp_path / "new", tokens_per_s=2000.0, amp="bf16", steps=steps),
        run_tokens=7680,
        run_steps=60,
        run_step_time_s=4.0,
        run_tokens_per_s=1920.0,
        tokens_trained=7808,
        tokens_per_s_e2e=1500.0,
        elapsed_s=5.12,
        startup_s=4.7,
        steady_steps=10,
        run_left_out={"warm-up": {"steps": [1], "s": 0.5}},
    )
    text = format_compare(compare_runs(old, new))
    steady = next(x for x in text.splitlines() if x.startswith("tokens/s in steady state"))
    assert "1,000" in steady and "1,920" in steady  # the older run's: its intervals after the first
    startup = next(x for x in text.splitlines() if x.startswith("start-up s"))
    assert OLDER_RUN in startup and "4.70" in startup
    assert "tokens/s per step 2.00x (2.00-2.00)" in headline(compare_runs(old, new))  # named for what it is
    page = summary_section(load_run(old))
    assert page.count(OLDER_RUN) == 2  # end to end, start-up
    assert REBUILT in page
    new_page = summary_section(load_run(new))
    assert "1,920 (the run: 7,680 tokens of 60 steady steps / 4.00s" in new_page
    assert "step 1, 0.50s: the first step" in new_page and REBUILT not in new_page


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


def test_run_totals_weigh_every_step_alike():
    totals = RunTotals(tokens_per_step=100)
    totals.start()
    totals.add([1.0, 1.0, 1.0])  # an interval of 3 one-second steps
    totals.add([4.0])  # and one of a single slow step
    f = totals.figures()
    assert set(f) == {*RUN_KEYS, "run_left_out"}
    assert f["run_tokens"] == 400 and f["run_step_time_s"] == pytest.approx(7.0)
    assert f["run_tokens_per_s"] == pytest.approx(400 / 7)  # the mean of the intervals' rates is 62.5


def test_start_up_counts_from_the_scripts_start_not_the_processs_age(tmp_path):
    """`bash -c "sleep 2 && exec python train_minimal.py"`: python runs in bash's process, whose age
    holds the sleep (a pip install, in the audit); start-up counts from the script, through the
    re-exec under the preferred malloc. A notebook's second run counts from its own main() call."""
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


def test_a_long_evaluation_is_announced_and_a_short_one_is_not():
    """An evaluation batch costs the interval's forward per micro-batch, or a third of a step
    without stage timing."""
    slow = Interval([3.0], StageTimes(host_ms={"forward": 1500.0}))
    assert evaluation_notice(20, slow, 1) == "evaluating (20 batches, about 30.0s)..."
    assert evaluation_notice(20, slow, 10) is None  # 150 ms per micro-batch
    assert evaluation_notice(20, Interval([0.03], StageTimes()), 1) is None  # fast, untimed stages
    assert evaluation_notice(20, Interval([9.0], StageTimes()), 1) == "evaluating (20 batches, about 1.0m)..."
    assert evaluation_notice(20, Interval([], StageTimes()), 1) is None  # nothing measured: nothing to say


def test_a_profiled_run_explains_torchs_stderr_lines_before_they_appear(tmp_path):
    """torch writes 'USDT: ... profiler_start' and a CPUAllocator warning to stderr from C++ in
    every profiled run: the log says what they are, once, before the profiler starts, and the run's
    stderr holds nothing else unexplained."""
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
    first_step = next(i for i, x in enumerate(lines) if " step 2/4 " in x)
    assert len(notes) == 1 and notes[0] < first_step
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
