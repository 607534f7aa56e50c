"""Instrumentation end to end: the stage ranges and their times, the profiler window and its trace
and cost, TensorBoard, MFU, and the refusals. CUDA-only paths carry the `cuda` marker."""

import gzip
import json
import re
import sys
import threading
import time
import urllib.parse
from types import SimpleNamespace

import pytest
import torch
from conftest import FAST, TINY, docs_module

import train_minimal
from minigpt.config import STAGE_NAMES as STAGES
from minigpt.config import parse_args
from minigpt.instruments import instrument, window
from minigpt.instruments.instrument import StageTimer

get_json = docs_module("tbserve").get_json
serve_tensorboard = docs_module("tbserve").serve_tensorboard


def read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def load_trace(out):
    traces = sorted((out / "traces").glob("*.pt.trace.json.gz"))
    assert len(traces) == 1, traces
    with gzip.open(traces[0], "rt") as f:
        return traces[0], json.load(f)


def inside(event, outer):
    return outer["ts"] <= event["ts"] and event["ts"] + event["dur"] <= outer["ts"] + outer["dur"]


@pytest.fixture
def quiet(monkeypatch):
    """A quiet machine for the profiler's cost, which this one (shared) may not be: no other
    process took a share of the cores."""
    monkeypatch.setattr(window, "busy_share", lambda before, after: 0.0)


def profiled_run(tmp_path, *extra):
    out = tmp_path / "run"
    args = [
        *FAST,
        "--num-steps",
        "8",
        "--log-interval",
        "4",
        "--use-profiler",
        "--profile-step-start",
        "3",
        "--profile-step-end",
        "5",
        "--out-dir",
        str(out),
        *extra,
    ]
    assert train_minimal.cli(args) == 0
    return out


def test_profiler_window_writes_one_trace_with_the_steps_and_stages(tmp_path, capsys, quiet):
    out = profiled_run(tmp_path)
    path, trace = load_trace(out)
    assert path.name.startswith("rank0_dp0.")  # the worker name torch-tb-profiler groups by
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = {e["name"]: e for e in events if e["name"].startswith("ProfilerStep#")}
    assert sorted(steps) == ["ProfilerStep#3", "ProfilerStep#4"]  # steps S..E-1, numbered as in the log
    for step in steps.values():
        names = {e["name"] for e in events if e.get("cat") == "user_annotation" and inside(e, step)}
        assert set(STAGES) | {"train_step"} <= names
    ops = (out / "traces" / "rank0_ops.txt").read_text()
    assert "aten::mm" in ops and "Self CPU" in ops
    printed = capsys.readouterr().out
    assert "Profiled steps 3-4" in printed and f"tensorboard --logdir {out}" in printed
    assert "ui.perfetto.dev" in printed
    # priced against steps 5-8: not step 1 (it allocates everything), not step 2 (the profiler's warm-up),
    # as a ratio with its interval, and "no difference within noise" where the interval holds 1.0
    lines = printed.splitlines()
    at = next(i for i, line in enumerate(lines) if "Profiler cost: " in line)
    cost, figures = lines[at], lines[at + 1]
    ratio = r"\d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\)"
    assert re.search(rf"a profiled step takes {ratio} the time of an unprofiled one", cost), cost
    assert cost.endswith(("one", "one: no difference within noise")), cost
    assert "ms/step profiled (median of 2) vs" in figures and figures.endswith("unprofiled (median of 4)")
    assert "process peak memory" in printed
    # the note on torch's stderr lines: once, after the window that made torch print them, short
    log = (out / "train.log").read_text().splitlines()
    notes = [line for line in log if "USDT" in line]  # none where torch printed none in this process
    assert len(notes) <= 1, notes
    if not notes:
        return
    (note,) = notes
    window_done = next(i for i, line in enumerate(log) if "View the trace" in line)
    assert len(note.split("] ", 1)[1]) <= 160 and log.index(note) > window_done


def test_the_profilers_cost_is_not_priced_on_a_busy_machine(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(window, "busy_share", lambda before, after: 0.6)
    profiled_run(tmp_path)
    printed = capsys.readouterr().out
    assert "Profiler cost: not priced: other processes took 60% of the cores" in printed
    assert " vs " not in printed.split("Profiler cost: ")[1].split("\n")[0]


def test_writing_the_trace_is_in_no_steps_time(tmp_path, monkeypatch):
    """The trace is written as the step after the window begins (the profiler's step()): that second
    is the profiler's, not training's, so neither that step's time nor the steady state holds it."""
    # The write made to last WRITE seconds, far longer than the steady steps' sum even on a loaded
    # machine (xdist's other worker, another machine's steal): that sum holds it or it does not.
    done, write = window.Window._window_done, 6.0
    slow = lambda self, prof: (time.sleep(write), done(self, prof))  # noqa: E731
    monkeypatch.setattr(window.Window, "_window_done", slow)
    out = profiled_run(tmp_path)
    records = read_metrics(out)
    steady = records[-1]["run_step_time_s"]
    assert steady < write, steady  # window 3-4: written before 5
    assert all(r["step_time_s"] < write and all(x["s"] < write for x in r["left_out"]) for r in records)
    assert records[-1]["elapsed_s"] >= write  # end to end holds it: the loop's wall clock


def test_no_profiler_no_note(tmp_path):
    """Without a profiler torch prints none of the lines the note explains: no note."""
    out = tmp_path / "run"
    assert train_minimal.cli([*FAST, "--num-steps", "2", "--out-dir", str(out)]) == 0
    assert "USDT" not in (out / "train.log").read_text()


def test_profiler_cost_is_not_priced_against_fewer_than_three_steps(tmp_path, capsys, quiet):
    out = tmp_path / "run"
    args = [
        *FAST,
        "--num-steps",
        "6",
        "--use-profiler",
        "--profile-step-start",
        "3",
        "--profile-step-end",
        "5",
    ]
    assert train_minimal.cli([*args, "--out-dir", str(out)]) == 0
    assert "Profiler cost: not priced: 2 unprofiled step(s)" in capsys.readouterr().out  # steps 5 and 6 only


def test_profiled_steps_hold_only_the_training_step(tmp_path):
    # Evaluations (with many batches, so they take as long as several steps) and logging after
    # steps 3 and 4, inside the window: each ProfilerStep range must still be the step alone.
    out = tmp_path / "run"
    args = [
        *FAST,
        "--num-steps",
        "6",
        "--log-interval",
        "1",
        "--eval-interval",
        "1",
        "--eval-iters",
        "20",
        "--use-profiler",
        "--profile-step-start",
        "3",
        "--profile-step-end",
        "5",
        "--out-dir",
        str(out),
    ]
    assert train_minimal.cli(args) == 0
    _, trace = load_trace(out)
    steps = {
        int(e["name"].split("#")[1]): e["dur"] / 1000
        for e in trace["traceEvents"]
        if e.get("ph") == "X" and e.get("name", "").startswith("ProfilerStep#")
    }
    logged = {r["step"]: 1000 * r["step_time_s"] for r in map(json.loads, (out / "metrics.jsonl").open())}
    assert sorted(steps) == [3, 4]
    for step, ms in steps.items():
        assert ms == pytest.approx(logged[step], rel=0.10), (step, ms, logged[step])
    # the loss of each evaluation batch: F.cross_entropy's log-softmax
    evals = [e for e in trace["traceEvents"] if e.get("name") == "aten::_log_softmax"]
    assert len(evals) >= 20  # the evaluations were recorded, outside the steps' ranges


def test_profile_with_stack_records_python_frames(tmp_path):
    out = profiled_run(tmp_path, "--profile-with-stack")
    _, trace = load_trace(out)
    assert any(e.get("cat") == "python_function" for e in trace["traceEvents"])


def test_profiler_stops_and_writes_its_trace_when_a_step_raises(tmp_path, monkeypatch):
    calls = {"n": 0}
    real_step = torch.optim.AdamW.step

    def failing_step(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:  # inside the window 3..4
            raise RuntimeError("boom")
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", failing_step)
    with pytest.raises(RuntimeError, match="boom"):
        profiled_run(tmp_path)
    assert not torch.autograd.profiler._is_profiler_enabled  # stopped, so the next run can profile
    _, trace = load_trace(tmp_path / "run")
    assert any(e.get("name") == "ProfilerStep#3" for e in trace["traceEvents"])


def test_resumed_run_profiles_the_same_training_steps(tmp_path):
    out = tmp_path / "run"
    base = [*FAST, "--out-dir", str(out), "--save-interval", "2"]
    assert train_minimal.cli([*base, "--num-steps", "2"]) == 0
    assert (
        train_minimal.cli(
            [
                *base,
                "--num-steps",
                "8",
                "--resume",
                "--use-profiler",
                "--profile-step-start",
                "5",
                "--profile-step-end",
                "7",
            ]
        )
        == 0
    )
    _, trace = load_trace(out)
    names = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert names == {"ProfilerStep#5", "ProfilerStep#6"}


def test_stage_times_add_up_to_the_step_time(tmp_path):
    # A model big enough that a step is tens of milliseconds: the loop's own Python is then small.
    out = tmp_path / "run"
    args = [
        *FAST,
        "--d-model",
        "128",
        "--d-ff",
        "512",
        "--seq-len",
        "64",
        "--num-steps",
        "12",
        "--log-interval",
        "4",
        "--out-dir",
        str(out),
    ]
    assert train_minimal.cli(args) == 0
    for row in read_metrics(out):
        assert set(row["stage_host_ms"]) == set(STAGES)
        assert row["stage_device_ms"] == row["stage_host_ms"]  # on the CPU the device time is the host time
        stages_ms = sum(row["stage_host_ms"].values())
        assert stages_ms == pytest.approx(1000 * row["step_time_s"], rel=0.10)


def test_no_stage_timing_drops_the_times_but_keeps_the_ranges(tmp_path):
    out = profiled_run(tmp_path, "--no-stage-timing")
    assert all(row["stage_host_ms"] == {} for row in read_metrics(out))
    assert "host/device ms" not in (out / "train.log").read_text()
    _, trace = load_trace(out)
    assert {"forward", "backward"} <= {e.get("name") for e in trace["traceEvents"]}


def test_stage_uses_process_wide_nvtx_ranges(monkeypatch):
    seen = []
    monkeypatch.setattr(
        instrument.nvtx,
        "start_range",
        lambda message, color, domain: seen.append(("start", message, color, domain)) or 7,
    )
    monkeypatch.setattr(instrument.nvtx, "end_range", lambda rid: seen.append(("end", rid)))
    timer = StageTimer("cpu")
    with timer.stage("backward"):
        pass
    assert seen == [("start", "backward", "red", "minigpt"), ("end", 7)]


def test_stage_timer_splits_and_per_step_figures():
    from minigpt.instruments.straggler import RankTimer

    timer = RankTimer("cpu", slow_rank="0:20:forward")
    timer.add_split("backward", "backward_compute")
    for _ in range(2):
        with timer.stage("forward"):
            pass
        with timer.stage("backward"):
            time.sleep(0.01)
            timer.split("backward", "backward_compute")
            time.sleep(0.03)
        timer.end_step()
    host, device = timer.read()
    assert len(host) == 2 and device == host  # on the CPU the device time is the host time
    for step in host:
        assert step["forward"] >= 20  # the simulated slow stage sleeps inside the range
        assert 10 <= step["backward_compute"] <= step["backward"] - 30  # sleeps: lower bounds only
    assert timer.read() == ([], [])  # read resets
    with timer.stage("backward"):  # no mark: no communication, all of it is compute
        time.sleep(0.01)
    timer.end_step()
    (step,), _ = timer.read()
    assert step["backward_compute"] == step["backward"]


def test_log_line_and_mfu(tmp_path):
    out = tmp_path / "run"
    assert (
        train_minimal.cli([*TINY, "--num-steps", "4", "--grad-accum-steps", "2", "--out-dir", str(out)]) == 0
    )
    config = json.loads((out / "config.json").read_text())
    assert config["peak_flops_source"].startswith(("measured now", "cache")) and config["peak_flops"] > 1e9
    assert config["peak_flops_dtype"] in ("bf16", "fp32")
    row = read_metrics(out)[-1]
    assert 0 < row["mfu"] and 0 <= row["run_mfu"]  # MFU is read from the record, never recomputed
    assert row["achieved_tflops"] == pytest.approx(config["flops_per_token"] * row["tokens_per_s"] / 1e12)
    assert row["tokens_per_s"] == pytest.approx(8 * 16 * 2 / row["step_time_s"])  # every micro-batch counts
    assert row["mfu"] == pytest.approx(config["flops_per_token"] * row["tokens_per_s"] / config["peak_flops"])
    lines = (out / "train.log").read_text().splitlines()
    at = max(i for i, x in enumerate(lines) if "step 4/4" in x)
    step_line, stage_line = lines[at].split("] ", 1)[1], lines[at + 1].split("] ", 1)[1]
    assert "mfu " in step_line and len(step_line) <= 160  # read at a glance
    # The stages on a line of their own, one number each: on the CPU host and device are one clock.
    assert stage_line.startswith("  stage ms: h2d ") and " bwd " in stage_line and "/" not in stage_line


def test_tensorboard_gets_the_same_figures(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    assert train_minimal.cli([*TINY, "--num-steps", "4", "--log-interval", "2", "--out-dir", str(out)]) == 0
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "train/loss",
        "val/loss",
        "train/lr",
        "perf/tokens_per_s",
        "perf/run_tokens_per_s",
        "perf/mfu_percent",
        "memory/rss_mib",
        "stage_host_ms/forward",
        "stage_device_ms/backward",
    } <= tags
    rows = read_metrics(out)
    assert [e.step for e in events.Scalars("train/loss")] == [r["step"] for r in rows]
    assert events.Scalars("train/loss")[-1].value == pytest.approx(rows[-1]["loss"], rel=1e-6)
    # in the units a chart reads: MFU in percent, memory in MiB
    assert events.Scalars("perf/mfu_percent")[-1].value == pytest.approx(100 * rows[-1]["mfu"], rel=1e-6)
    assert events.Scalars("memory/rss_mib")[-1].value == pytest.approx(
        rows[-1]["memory"]["rss_bytes"] / 2**20
    )


def test_profiler_schedule_has_megatron_semantics():
    from torch.profiler import ProfilerAction as A

    action = window.profiler_schedule(start=3, end=6)
    assert [action(n) for n in range(1, 8)] == [
        A.NONE,
        A.WARMUP,
        A.RECORD,
        A.RECORD,
        A.RECORD_AND_SAVE,
        A.NONE,
        A.NONE,
    ]
    assert window.profiler_schedule(1, 2)(1) == A.RECORD_AND_SAVE  # no warm-up step before step 1


# ---------------------------------------------------------------------------- TensorBoard server


@pytest.mark.slow
def test_tensorboard_with_torch_tb_profiler_serves_the_run(tmp_path):
    out = profiled_run(tmp_path)
    with serve_tensorboard([sys.executable, "-m", "tensorboard.main", "--logdir", str(out)]) as url:
        base = f"{url}/data/plugin/pytorch_profiler"
        assert get_json(f"{base}/runs")["runs"] == ["traces"]
        views = get_json(f"{base}/views?run=traces")
        assert "Overview" in views and "Operator" in views
        assert get_json(f"{base}/workers?run=traces&view=Overview") == ["rank0_dp0"]
        spans = get_json(f"{base}/spans?run=traces&worker=rank0_dp0")
        query = urllib.parse.urlencode({"run": "traces", "worker": "rank0_dp0", "span": spans[0]})
        overview = get_json(f"{base}/overview?{query}")
        assert [row[0] for row in overview["steps"]["rows"]] == ["3", "4"]
        table = get_json(f"{base}/operation/table?{query}&group_by=Operation")
        assert any(row["name"] == "aten::mm" for row in table["data"])


# ---------------------------------------------------------------------------- CUDA only


@pytest.mark.cuda
def test_cuda_stage_times_come_from_events(tmp_path):
    out = tmp_path / "run"
    assert (
        train_minimal.cli(
            [*TINY, "--device", "cuda", "--num-steps", "6", "--log-interval", "3", "--out-dir", str(out)]
        )
        == 0
    )
    row = read_metrics(out)[-1]
    assert set(row["stage_device_ms"]) == set(STAGES) and row["stage_device_ms"] != row["stage_host_ms"]
    assert row["memory"]["peak_allocated_gib"] > 0 and "alloc_retries" in row["memory"]
    log = (out / "train.log").read_text()
    assert "| mem " in log and "(reserved " in log  # the step's peak allocated, and reserved
    assert "stage ms host/device: h2d " in log  # two clocks on a GPU: the host runs ahead


@pytest.mark.cuda
def test_cuda_trace_holds_kernels(tmp_path):
    out = profiled_run(tmp_path, "--device", "cuda")
    _, trace = load_trace(out)
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])


@pytest.mark.cuda
def test_nsys_capture_range_calls_start_and_stop(tmp_path, monkeypatch):
    calls = []

    class FakeCudart:
        def cudaProfilerStart(self):
            calls.append("start")

        def cudaProfilerStop(self):
            calls.append("stop")

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    out = tmp_path / "run"
    assert (
        train_minimal.cli(
            [
                *TINY,
                "--device",
                "cuda",
                "--num-steps",
                "6",
                "--nsys",
                "--profile-step-start",
                "2",
                "--profile-step-end",
                "4",
                "--out-dir",
                str(out),
            ]
        )
        == 0
    )
    assert calls == ["start", "stop"]


@pytest.mark.cuda
def test_memory_history_snapshot_and_its_text(tmp_path):
    """The history covers the training steps only (started at the first), the text beside the
    pickle lists what was live at its peak, and the report leaves its offline page beside it."""
    from minigpt.analysis.cuda_snapshot import load_snapshot, replay

    out = profiled_run(tmp_path, "--device", "cuda", "--record-memory-history")
    snap = out / "snapshots" / "rank0_snapshot.pickle"
    assert snap.exists() and snap.with_suffix(".txt").read_text().startswith("peak allocated ")
    r = replay(load_snapshot(snap))
    assert r.steps and r.first_step_event < 20  # no start-up in the recording
    assert sum(b.size for b in r.live_at_peak) == r.peak
    assert (out / "snapshots" / "rank0_snapshot.html").is_file()


@pytest.mark.cuda
def test_oom_writes_a_snapshot_before_the_error(tmp_path):
    history = window.MemoryHistory(1000)
    history.start()
    path = tmp_path / "oom.pickle"
    history.dump_on_oom(path)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(1 << 50, device="cuda")  # a petabyte: impossible on any GPU
    finally:
        history.stop()
    assert path.exists() and path.with_suffix(".txt").exists()


def test_a_long_step_says_it_still_runs_and_falls_silent_when_it_ends(monkeypatch, caplog):
    """A step longer than 10 s (a 100,000-token sequence on a CPU takes minutes) logs that it still
    runs, every 10 s, and nothing once it has ended; the next long step counts from its own start.
    The watcher's looks are made here on a clock the test sets: no thread's timing in the result."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(instrument, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    cfg = parse_args([*TINY, "--num-steps", "3"])
    inst = instrument.Instruments(cfg, "cpu", dict(is_main=False), run=None)
    seen, said, lines = None, 0, {}

    def look_at(*times):
        nonlocal seen, said
        for clock.now in times:
            seen, said = inst.look(seen, said)
            lines[clock.now] = [r.message for r in caplog.records]
            caplog.clear()

    with caplog.at_level("INFO", logger="minigpt"):
        with inst.step(1):  # starts at 0
            look_at(1, 9, 10, 11, 19, 20.5, 25)
        clock.now = 26
        with inst.step(2):  # a long one right after, with no look between: its own count
            look_at(30, 36, 45)
        look_at(47, 60)  # ended: silent
        clock.now = 100
        with inst.step(3):  # a short step: silent
            look_at(100.5)
        for n, clock.now in enumerate(range(200, 225)):  # an evaluation: a new progress note a batch
            inst.doing = ("evaluation", 200, f"; {n} of 65536 batches done")
            look_at(clock.now)
    said_at = {t: m for t, m in lines.items() if m}
    assert said_at == {
        10: ["step 1: still running after 10s"],
        20.5: ["step 1: still running after 20s"],
        36: ["step 2: still running after 10s"],
        210: ["evaluation: still running after 10s; 10 of 65536 batches done"],
        220: ["evaluation: still running after 20s; 20 of 65536 batches done"],
    }


def test_the_watcher_looks_while_the_loop_runs_and_stops_with_it(monkeypatch):
    """The thread behind those lines starts with the loop and ends with it."""
    looks = []
    cfg = parse_args([*TINY, "--num-steps", "2"])
    inst = instrument.Instruments(cfg, "cpu", dict(is_main=False), run=None)
    monkeypatch.setattr(inst, "look", lambda seen, said: looks.append(seen) or (seen, said))
    monkeypatch.setattr(inst.stop_watch, "wait", lambda timeout: time.sleep(0.01) or inst.stop_watch.is_set())
    before = set(threading.enumerate())
    with inst:
        watcher = [t for t in threading.enumerate() if t.name == "watch" and t not in before]
        deadline = time.monotonic() + 60
        while not looks and time.monotonic() < deadline:
            time.sleep(0.01)
    assert looks and len(watcher) == 1, "the watcher never looked"
    for t in watcher:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in watcher)
