"""Every line the main job and its tools print is one a terminal holds: at most 160 characters after
the log's timestamp (a summary is several lines, its continuations indented), `estimate`'s table at
most 100 columns with each of its marks explained, and a note about torch's own stderr lines only
when torch printed one (issue 48, item 6)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT, TINY, in_process

import train_minimal
from minigpt.analysis.record import StepRecord
from minigpt.core.finish import finished_lines, predicted_line
from minigpt.core.outputs import log_lines
from minigpt.instruments import window
from minigpt.instruments.breakdown import MemoryBreakdown, format_breakdown

WIDTH = 160  # a line after the log's timestamp
TABLE = 100  # estimate's table
STAMP = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] ")
# What torch itself writes to stderr from C++ while a profiler runs: not the project's lines.
TORCH_OWN = re.compile(r"^(USDT:|\[W\d{4} )")
MiB = 2**20


def too_long(text: str, width: int = WIDTH) -> list[str]:
    """The lines of `text` longer than `width` once a log timestamp is taken off."""
    lines = (STAMP.sub("", x) for x in text.splitlines() if not TORCH_OWN.match(x))
    return [x for x in lines if len(x) > width]


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("MINIGPT_ARGS", None)
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two tiny runs: a plain one, and one with every instrument of the finish and the log (a
    profiler window of six steps inside one log interval, the memory profiler, the predicted step)."""
    root = tmp_path_factory.mktemp("lines")
    steps = ["train_minimal.py", *TINY, "--num-steps", "12"]
    plain = run(*steps, "--log-interval", "4", "--out-dir", str(root / "a"))
    flags = ["--use-profiler", "--profile-step-start", "3", "--profile-step-end", "9", "--memory-profiler"]
    flags += ["--memory-profile-step", "10", "--predict-time", "--eval-interval", "4", "--log-interval", "8"]
    instrumented = run(*steps, *flags, "--out-dir", str(root / "b"))
    for r in (plain, instrumented):
        assert r.returncode == 0, r.stderr[-3000:]
    return root, plain, instrumented


# A run's folder as a user's default run names it: the lines are measured with it in place of the
# test's own folder, whose length depends on pytest's temporary root (longer under xdist's workers).
DEFAULT_RUN_DIR = "runs/20261128-190703"


def test_every_line_of_a_tiny_run_fits(runs):
    root, plain, instrumented = runs
    for r, name in ((plain, "a"), (instrumented, "b")):
        log = (root / name / "train.log").read_text()
        texts = [t.replace(str(root / name), DEFAULT_RUN_DIR) for t in (log, r.stdout, r.stderr)]
        assert [too_long(t) for t in texts] == [[], [], []]
    out = instrumented.stdout
    for said in ("Training finished", "Profiled steps 3-8", "Memory breakdown at step 10", "Profiler cost"):
        assert said in out, said
    # the profiler's steps of an interval are one phrase of its lines, each reason once
    profiled = [x for x in out.splitlines() if "profiler" in x and " | " in x]
    assert any("left out: steps 5-8 " in x for x in profiled), profiled
    assert all(x.count("(profiler)") <= 1 and x.count("profiler,") <= 1 for x in profiled), profiled


def test_the_note_on_torchs_lines_follows_them_and_only_them(runs):
    """The note explains torch's stderr lines once, after the profilers are done; a run whose torch
    printed none of them (here: none of the profilers ran) has no note."""
    root, plain, instrumented = runs
    torch_said = [x for x in instrumented.stderr.splitlines() if TORCH_OWN.match(x)]
    log = (root / "b" / "train.log").read_text().splitlines()
    notes = [i for i, x in enumerate(log) if window.PROFILER_STDERR_NOTE in x]
    if torch_said:
        after = max(i for i, x in enumerate(log) if "memory.log and sunburst charts" in x)
        assert len(notes) == 1 and notes[0] > after
    else:
        assert notes == []
    assert window.PROFILER_STDERR_NOTE not in plain.stdout


def test_no_note_when_torch_printed_none_of_its_lines(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(window, "TORCH_LINES", ("a line torch never prints",))
    args = [*TINY, "--num-steps", "5", "--use-profiler", "--profile-step-start", "2"]
    args += ["--profile-step-end", "4"]
    assert train_minimal.cli([*args, "--no-report", "--out-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "Profiled steps 2-3" in out and window.PROFILER_STDERR_NOTE not in out


def test_the_stderr_watch_passes_everything_on(capfd):
    for line, seen in ((b"USDT: profiler_start\n", True), (b"a line of someone else's\n", False)):
        watch = window.StderrWatch()
        watch.start()
        os.write(2, line)
        assert watch.stop() is seen
        assert capfd.readouterr().err == line.decode()
    os.write(2, b"after\n")  # fd 2 is the real one again
    assert capfd.readouterr().err == "after\n"


def record(**over) -> StepRecord:
    """A step of a large GPU run: two clocks per stage, collectives, a long profiler window left out,
    the memory profiler's step, others on the machine."""
    base = dict(step=123_456, num_steps=1_000_000, epoch=3, loss=2.345678, lr=6e-4, step_time_s=1.2345)
    base |= dict(tokens_per_s=1_234_567.8, tokens_per_s_per_rank=154_320.9, run_tokens=10**12)
    base |= dict(run_steps=120_000, run_step_time_s=150_000.0, run_tokens_per_s=1_234_567.8)
    base |= dict(tokens_trained=10**12, tokens_per_s_e2e=1_111_111.1, startup_s=1234.5, world_size=64)
    base |= dict(val_loss=2.4567, val_ppl=11.67, elapsed_s=160_000.0, eta_s=1e6, amp="bf16", mfu=0.456)
    stages = {"data_to_device": 0.12, "forward": 123.45, "backward": 246.9, "optimizer_step": 12.34}
    base |= dict(achieved_tflops=451.2, stage_host_ms=stages, busy=0.62, run_busy=0.87, comm_step=123_450)
    base |= dict(stage_device_ms={k: v * 1.01 for k, v in stages.items()}, stage_comm_ms=dict(stages))
    base |= dict(memory={"peak_allocated_gib": 123.45, "peak_reserved_gib": 130.12})
    base |= dict(memory_breakdown={"peak": 123 * 2**30, "step": 123_450})
    why = ["profiler"] * 40 + ["memory profiler", "compilation", "checkpoint", "evaluation"]
    base |= dict(left_out=[{"step": 123_400 + i, "s": 1.5, "why": w} for i, w in enumerate(why)])
    many = {"steps": list(range(1, 400, 3)), "s": 1234.5}
    base |= dict(run_left_out={w: many for w in ("warm-up", "compilation", "profiler", "memory profiler")})
    return StepRecord(**(base | over))


def test_a_large_runs_log_and_finish_lines_fit():
    lines = log_lines(record()) + log_lines(record(steady_steps=3))
    lines += finished_lines(record(), 123_456, 1000, predicted_ms=1234.5)
    prediction = {"step_ms": 1234.5, "stage_ms": dict(record().stage_host_ms), "rates_source": "x" * 120}
    lines += predicted_line(prediction).split("\n")
    assert [x for x in lines if len(x) > WIDTH] == []
    assert sum("left out:" in x for x in finished_lines(record(), 1)) == 4  # a line per reason


def test_a_cuda_memory_breakdown_fits():
    """The breakdown of a measured CUDA step, its peak part by part: names as long as a stack's."""
    where = "backward / blocks.11.mlp.proj / AddmmBackward0: AddmmBackward0 > aten::mm > aten::addmm_impl"
    names = {f"blocks.{i}.attn.qkv.weight.exp_avg_sq" + ".x" * 20: (30 + i) * MiB for i in range(12)}
    temporaries = {f"{where} #{i}": (100 + i) * MiB for i in range(8)}
    b = MemoryBreakdown(
        step=7,
        params=dict(names),
        grads=dict(names),
        optimizer={**names, **{k + ".sq": v for k, v in names.items()}},
        activations={f"blocks.{i}.mlp.gelu": 200 * MiB for i in range(12)},
        activations_peak=2400 * MiB,
        activation_dtypes={"bfloat16": 2000 * MiB, "float32": 400 * MiB},
        device="cuda",
        cuda_max_allocated=8309 * MiB,
        cuda_max_reserved=9748 * MiB,
        peak=8309 * MiB,
        peak_stage="backward",
        peak_where=where,
        peak_parts={
            "params": dict(names),
            "grads": dict(list(names.items())[:6]),
            "optimizer": dict(names),
            "activations": {f"blocks.{i}.mlp.gelu": 190 * MiB for i in range(12)},
            "temporaries": temporaries,
            "held": {"held before the step: float32[1024]": 4 * MiB},
        },
    )
    text = format_breakdown(b)
    assert "CUDA max allocated 8309.00 MiB (reserved 9748.00 MiB) is the measured peak" in text
    assert too_long(text) == [], text


def test_estimates_table_fits_100_columns_and_explains_its_marks(capsys):
    from minigpt.instruments import estimate

    for flags in ([], ["--no-amp"], ["--device", "cuda", "--amp-dtype", "fp16"], ["--preset", "gpt2"]):
        r = in_process(capsys, lambda flags=flags: estimate.main(flags))  # `python -m minigpt estimate`'s
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert [x for x in lines if len(x) > TABLE] == [], flags
        assert not re.search(r"AMP \w+ \(AMP ", r.stdout), r.stdout  # the dtype said once
        assert any(x.lstrip().startswith("*") and "ckpt" in x for x in lines)  # the marked columns
        # each mark explained in a line under the table: the run's own column (*), ckpt
        assert "(* the run's own column; ckpt: with --use-activation-checkpoint)" in r.stdout, r.stdout


def test_compares_text_fits(runs):
    root, *_ = runs
    r = run("-m", "minigpt", "compare", str(root / "a"), str(root / "b"), timeout=120)
    assert r.returncode == 0, r.stderr
    assert too_long(r.stdout) == [], r.stdout


def test_memory_log_says_its_time_in_words(runs):
    from minigpt.analysis.breakdown_log import parse_memory_log

    root, *_ = runs
    text = (root / "b" / "memory_trace" / "rank0_dp0" / "memory.log").read_text()
    (stamp,) = re.findall(r"^time: (.*)$", text, re.M)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", stamp), stamp  # not a raw Unix time
    (state,) = parse_memory_log(text)
    assert abs(state["time"] - (root / "b" / "memory_trace").stat().st_mtime) < 3600


def test_a_cpu_runs_report_draws_each_stage_once(runs):
    """On the CPU a stage's device time is its host time: the report draws no second ("device")
    set of bars that repeats the first."""
    from minigpt.analysis.report import write_report

    root, *_ = runs
    page = write_report(root / "a").read_text()
    assert "device ms" not in page and "one time per stage" in page


def test_estimate_times_prediction_fits():
    """`estimate --time`'s text, as tests/shape_pins.json pins it for each corner of the shapes."""
    import json

    pins = json.loads((ROOT / "tests" / "shape_pins.json").read_text())["predict"]
    assert pins and all(too_long(p["text"]) == [] for p in pins.values())


def test_the_logs_operator_table_fits_on_a_gpu_too():
    """The log's operator table (torch's own, 169 columns on a CPU and wider on a GPU, stays in its
    file): at most 132 columns with the GPU's columns, names cut with '...'."""
    import torch

    with torch.profiler.profile() as prof:
        torch.randn(8, 8) @ torch.randn(8, 8)
    for device, heads in (("cpu", 3), ("cuda", 5)):
        lines = window.operator_lines(prof, device).splitlines()
        assert len(lines) > 1 and all(len(x) <= 132 for x in lines), lines
        assert len(re.findall(r"ms|calls", lines[0])) == heads, lines[0]
