"""The benchmark scripts on a tiny configuration: they run every variant in a fresh process and
write results that name their machine. Where a script's trainer runs are made elsewhere in CI (the
walkthrough's ablation) or by its own slow test, the default suite fakes them. (Their figures are
not asserted: performance claims live in benchmarks/results/, never in tests.)"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import NANOGPT_DIR, NANOGPT_ENV, ROOT, bench_main, bench_module

# On the CPU, on a GPU machine too: the tests read cpu-* result files (the GPU's are named for it).
TINY = [
    "--preset",
    "tiny",
    "--use-toy-data",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--repeats",
    "1",
    "--device",
    "cpu",
]


def run(script, *args):
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


# Slow: the walkthrough's `python benchmarks/ablation.py --malloc` runs the script end to end in CI
# (tests/test_walkthrough.py) and holds its files to check_ablation; here with the AMP rows forced on.
@pytest.mark.slow
def test_ablation_writes_json_markdown_and_chart(tmp_path):
    result = run("ablation.py", *TINY, "--amp-rows", "on", "--name", "tiny", "--out-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = ["fp32", "fp32 + ckpt", "amp", "amp + ckpt"]
    check_ablation(tmp_path / "cpu-tiny", result.stdout + result.stderr, rows)


def check_ablation(stem: Path, printed: str, rows: list[str]) -> None:
    """What a CPU ablation of 2 measured steps in 1 repeat leaves beside `stem` (.json, .md, .png)
    and prints (`printed`): the rows asked for, each with its stages, memory breakdown, dtype and
    busy share, named for its machine; a table whose rows all render; a chart."""
    data = json.loads(stem.with_suffix(".json").read_text())
    results = data["results"]
    assert list(results) == rows
    meta = data["meta"]
    assert meta["machine"]["torch"] == torch.__version__ and meta["machine"]["device"] == "cpu"
    assert meta["command"].startswith("python benchmarks/ablation.py ") and meta["date"]
    for r in results.values():
        assert r["tokens_per_s"]["n"] == 2 and r["tokens_per_s"]["median"] > 0
        assert set(r["stage_host_ms"]) == {"data_to_device", "forward", "backward", "optimizer_step"}
        assert r["breakdown_bytes"]["params"] > 0
    # checkpointing keeps fewer activations: measured, not assumed
    assert (
        results["fp32 + ckpt"]["breakdown_bytes"]["activations"]
        < results["fp32"]["breakdown_bytes"]["activations"]
    )
    table = stem.with_suffix(".md").read_text()
    tables = "\n".join(line if line.startswith("|") else "" for line in table.splitlines()).split("\n\n")
    for lines in (t.strip().splitlines() for t in tables if t.strip()):
        assert len({line.count("|") for line in lines}) == 1  # every row as wide as its header: it renders
    # no kernel rates measured unless --predict asks (they took most of a CPU ablation's time)
    assert "[rates]" not in printed
    assert [r["amp"] for r in results.values()] == ["bf16" if n.startswith("amp") else "fp32" for n in rows]
    assert "| fp32 | " in table and torch.__version__ in table and "Command:" in table
    assert ("AMP: tokens/s " in table) == ("amp" in rows)  # the AMP verdict, where AMP rows ran
    # MFU names the dtype it divides by, as the runs' config.json recorded it (the device's fastest)
    dtypes = {r["peak_flops_dtype"] for r in results.values()}
    assert len(dtypes) == 1 and dtypes <= {"bf16", "fp32"}
    assert f"| MFU against {dtypes.pop()}'s peak |" in table
    assert all(len(r["busy_repeats"]) == 1 for r in results.values())  # each repeat's busy share, kept
    assert stem.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def faked_ablation(monkeypatch, rows):
    """benchmarks/ablation.py with a quiet load and its trainer's runs faked: `rows(flags, calls)`
    gives a run's rows; returns the module and the list of each run's flags."""
    ablation = bench_module("ablation")
    common = bench_module("common")
    monkeypatch.setattr(common, "load_average", lambda: 0.1)
    monkeypatch.setattr(ablation, "load_average", lambda: 0.1)
    calls = []

    def run_variant(flags, warmup, steps, nproc=1, keep=None):
        calls.append(flags)
        return rows(flags, calls)

    monkeypatch.setattr(ablation, "run_variant", run_variant)
    return ablation, calls


def test_ablation_without_amp_rows_runs_its_variants_in_fp32(monkeypatch, tmp_path):
    """A CPU without native bf16 leaves the AMP rows out (--amp-rows auto); what is asked for on top
    runs in fp32 and is compared with fp32. (The trainer's runs are faked: the test above runs them.)"""
    ablation, calls = faked_ablation(monkeypatch, lambda flags, calls: fake_rows(1000.0))
    flags = ["--amp-rows", "off", "--malloc", "--chunked-loss", "--name", "fp32", "--out-dir", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["ablation.py", *TINY, *flags])
    assert ablation.main() == 0
    data = json.loads((tmp_path / "cpu-fp32.json").read_text())
    names = ["fp32", "fp32 + ckpt", "fp32, malloc defaults", "fp32 + chunked loss"]
    assert list(data["results"]) == names
    assert calls and all("--no-amp" in f and "--amp" not in f for f in calls)  # every run in fp32
    table = (tmp_path / "cpu-fp32.md").read_text()
    assert "No AMP rows" in table and "fp32 + chunked loss: " in table and "AMP: " not in table


def test_overhead_reports_each_variant(tmp_path, monkeypatch, capsys):
    """overhead.py's stage-timing part in this process: each variant's trainer flags, the A/A copy,
    the instrumentation's cost per step, the table and --render. The trainer's runs are faked
    (fake_rows): the slow test below runs them."""
    monkeypatch.setattr(bench_module("common"), "load_average", lambda: 0.1)
    calls = []

    def run_variant(flags, warmup, steps, nproc=1, keep=None):
        calls.append(flags)
        return fake_rows(1000.0)

    monkeypatch.setattr(bench_module("common"), "run_variant", run_variant)
    flags = ["--parts", "stage-timing", "--micro-steps", "100", "--out-dir", str(tmp_path)]
    result = bench_main(monkeypatch, capsys, "overhead.py", *TINY, *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    check_overhead(monkeypatch, capsys, tmp_path)
    base = calls[1]  # "timing on (default)": the preset and the command's flags, none of its own
    assert all(c[: len(base)] == base for c in calls)
    off, on, prof, stacks, copy = (c[len(base) :] for c in calls)  # each variant's own flags
    assert (off, on, copy) == (["--no-stage-timing"], [], ["--no-stage-timing"])
    assert prof[0] == "--use-profiler" and stacks == [*prof, "--profile-with-stack"]


@pytest.mark.slow
def test_overhead_runs_each_variant_through_the_trainer(tmp_path, monkeypatch, capsys):
    flags = ["--parts", "stage-timing", "--micro-steps", "100", "--out-dir", str(tmp_path)]
    result = run("overhead.py", *TINY, *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    data = check_overhead(monkeypatch, capsys, tmp_path)
    assert data["results"]["timing off"]["stage_host_ms"] == {}  # --no-stage-timing reached the trainer
    assert set(data["results"]["timing on (default)"]["stage_host_ms"]) >= {"forward", "backward"}


def check_overhead(monkeypatch, capsys, folder: Path) -> dict:
    """What overhead.py's stage-timing part of a tiny run leaves in `folder`; --render rewrites its table."""
    data = json.loads((folder / "overhead-cpu-tiny.json").read_text())
    assert list(data["results"]) == ["timing off", "timing on (default)", "profiler", "profiler + stacks"]
    table = (folder / "overhead-cpu-tiny.md").read_text()
    assert (
        "overhead vs timing off" in table and "The default instrumentation (ranges and timing) costs" in table
    )
    costs = data["instrumentation_us_per_step"]
    # the ranges cost tens of microseconds, an empty loop about one: ordered whatever the machine does
    assert (
        0
        < costs["bare loop"]
        < min(costs["ranges only (--no-stage-timing)"], costs["ranges + timing (default)"])
    )
    (folder / "overhead-cpu-tiny.md").unlink()
    kept = str(folder / "overhead-cpu-tiny.json")
    rendered = bench_main(monkeypatch, capsys, "overhead.py", "--render", kept)
    assert rendered.returncode == 0, rendered.stderr
    assert (folder / "overhead-cpu-tiny.md").read_text() == table  # the table is a function of the .json
    return data


@pytest.mark.slow
def test_overhead_prices_each_profiler_option_and_picks_the_defaults_from_the_views(tmp_path):
    result = run(
        "overhead.py",
        "--preset",
        "tiny",
        "--parts",
        "options",
        "--repeats",
        "1",
        "--option-steps",
        "1",
        "--option-warmup",
        "0",
        "--out-dir",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "overhead-cpu-tiny.json").read_text())
    options = data["profiler_options"]
    assert list(options) == [
        "no profiler",
        "bare profiler",
        "record_shapes",
        "profile_memory",
        "with_flops",
        "with_modules",
        "with_stack",
        "all options",
    ]
    assert all(o["step_ms"]["median"] > 0 and o["rss_peak_mib"] > 0 for o in options.values())
    assert "views" not in options["no profiler"] and options["bare profiler"]["trace_mb"] > 0
    # what torch-tb-profiler builds from each trace decides the defaults
    assert {"Overview", "Operator", "Trace"} <= set(options["bare profiler"]["views"])
    assert "Memory" not in options["bare profiler"]["views"]
    assert "Memory" in options["profile_memory"]["views"]
    assert options["record_shapes"]["input_shapes"] and not options["bare profiler"]["input_shapes"]
    assert set(options["all options"]["views"]) >= {"Overview", "Operator", "Trace", "Memory"}
    assert data["default_profiler_options"]["options"] == ["profile_memory"]
    table = (tmp_path / "overhead-cpu-tiny.md").read_text()
    assert "What each torch.profiler option costs" in table and "**profile_memory**" in table
    assert "## Stage timing" not in table  # --parts options measured only the options


@pytest.mark.slow
@pytest.mark.skipif(
    NANOGPT_DIR is None, reason=f"${NANOGPT_ENV} does not name a clone of karpathy/nanoGPT (.ci/run sets it)"
)
def test_nanogpt_runs_the_real_train_py_beside_minigpt(tmp_path):
    result = run(
        "nanogpt_shape.py",
        "--nanogpt",
        str(NANOGPT_DIR),
        "--shape",
        "tiny",
        "--repeats",
        "1",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--no-malloc-variant",
        "--out-dir",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "cpu-nanogpt-tiny.json").read_text())
    results = data["results"]
    assert list(results) == [
        "nanoGPT train.py, fp32",
        "minigpt train_minimal.py, fp32",
        "nanoGPT train.py, bf16",
        "minigpt train_minimal.py, bf16",
    ]
    for name, r in results.items():
        rows = r["rounds"][0]["rows"]
        assert len(rows) == 2 and all(row["time_ms"] > 0 and row["loss"] > 0 for row in rows), name
        assert r["tokens_per_s"] > 0
    nano = results["nanoGPT train.py, bf16"]["rounds"][0]
    assert [row["iter"] for row in nano["rows"]] == [1, 2]  # iteration 0 (it evaluates) is warm-up
    assert "--dtype=bfloat16" in nano["command"] and "--bias=True" in nano["command"]
    assert all("mfu_pct" in row for row in nano["rows"])
    assert data["meta"]["patched_line"] > 0
    assert f"line {data['meta']['patched_line']}" in (tmp_path / "cpu-nanogpt-tiny.md").read_text()
    # nanoGPT's files never land in the repository: they ran from a temporary folder
    copies = [ROOT / d / f for d in (".", "benchmarks") for f in ("configurator.py", "train.py")]
    assert not any(p.exists() for p in copies)


def test_nanogpt_without_its_files_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """None given (no --nanogpt, no $MINIGPT_NANOGPT_DIR), or a folder without them, by the flag or
    by the environment: one line, status 2, before anything runs."""
    for flags, env in (([], None), (["--nanogpt", str(tmp_path)], None), ([], str(tmp_path))):
        monkeypatch.delenv(NANOGPT_ENV, raising=False)
        if env:
            monkeypatch.setenv(NANOGPT_ENV, env)
        result = bench_main(monkeypatch, capsys, "nanogpt_shape.py", *flags)
        assert result.returncode == 2 and "nanoGPT" in result.stderr and "--nanogpt" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and NANOGPT_ENV in result.stderr
    assert f"${NANOGPT_ENV} {tmp_path} has no train.py" in result.stderr  # the environment named it


def test_ablation_render_rewrites_table_and_chart_without_running(tmp_path, monkeypatch, capsys):
    for stem, pre_peak in (("cpu-gpt2-b2", True), ("cpu-small", False)):
        copy = tmp_path / f"{stem}.json"
        copy.write_text((ROOT / "benchmarks" / "results" / f"{stem}.json").read_text())
        result = bench_main(monkeypatch, capsys, "ablation.py", "--render", str(copy))
        assert result.returncode == 0, result.stderr[-3000:]
        table = (tmp_path / f"{stem}.md").read_text()
        assert "| amp | bf16 |" in table
        # results that predate the allocator's measured peak: their memory column must not say "peak"
        assert ("breakdown sum MiB (not the peak)" in table) == pre_peak
        assert ("| peak MiB |" in table) != pre_peak
        assert (tmp_path / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ablation_puts_each_prediction_beside_its_measurement(tmp_path, monkeypatch, capsys):
    """A variant whose run stored predicted_step (config.json) gets a row: predicted / measured per
    stage, the error in percent, and what bounds the stage."""
    data = json.loads((ROOT / "benchmarks" / "results" / "cpu-small.json").read_text())
    name, s = next(iter(data["results"].items()))
    measured = s["stage_device_ms"]["forward"]
    s["predicted_step"] = {
        "stage_ms": {"forward": 2 * measured, "backward": None, "optimizer_step": 1.0},
        "bound": {"forward": "compute", "optimizer_step": "memory"},
    }
    copy = tmp_path / "cpu-small.json"
    copy.write_text(json.dumps(data))
    result = bench_main(monkeypatch, capsys, "ablation.py", "--render", str(copy))
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / "cpu-small.md").read_text()
    row = next(
        line for line in table.splitlines() if line.startswith(f"| {name} | ") and "(+100%, compute)" in line
    )
    assert f"{2 * measured:.1f} / {measured:.1f} (+100%, compute)" in row and "| n/a |" in row
    assert len([line for line in table.splitlines() if line.startswith("| variant | forward predicted")]) == 1

    result = bench_main(monkeypatch, capsys, "ablation.py", "--steps", "0")
    assert result.returncode == 2 and "--steps and --repeats must be at least 1" in result.stderr


ABLATION_RESULTS = ["cpu-small-fp32", "cpu-small", "cpu-gpt2-b2"]  # the committed ablation charts


def table_rows(table: str) -> dict[str, list[str]]:
    """The ablation table's cells by variant name, as a reader sees them."""
    lines = table.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("| "))
    block = lines[
        first : next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
    ]
    rows = [line.strip("|").split(" | ") for line in block if line.startswith("| ")]  # the first table
    header, body = rows[0], rows[1:]
    return {
        cells[0].strip(): dict(zip((h.strip() for h in header), (c.strip() for c in cells))) for cells in body
    }


def bar_containers(ax) -> list:
    from matplotlib.container import BarContainer

    return [c for c in ax.containers if isinstance(c, BarContainer)]


def number(cell: str) -> float:
    return float(cell.split()[0].replace(",", ""))


@pytest.mark.parametrize("stem", ABLATION_RESULTS)
def test_ablation_chart_plots_the_numbers_its_table_prints(stem, monkeypatch):
    """Each bar of the .png, read back from its Axes, equals its cell in the .md: the memory panel
    once plotted the breakdown's sum (770 MiB) beside a table that said the peak (1,888.6)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ablation = bench_module("ablation")

    data = json.loads((ROOT / "benchmarks" / "results" / f"{stem}.json").read_text())
    meta, results = data["meta"], data["results"]
    rows = table_rows(ablation.markdown(meta, results))
    memory_column = next(h for h in next(iter(rows.values())) if "MiB" in h and "activations" not in h)
    fig = ablation.chart_figure(meta, results)
    tokens_ax, stages_ax, memory_ax = fig.axes[:3]
    names = list(results)

    tokens = [p.get_height() for p in bar_containers(tokens_ax)[0].patches]
    assert tokens == pytest.approx([number(rows[n]["tokens/s (median)"]) for n in names], abs=0.5)

    for container in bar_containers(stages_ax):
        kind, stage = container.patches[0].get_gid().split(":")
        heights = [p.get_height() for p in container.patches]
        cells = [rows[n][f"{stage} host / device ms"].split(" / ")[kind == "device"] for n in names]
        assert heights == pytest.approx([float(c) for c in cells], abs=0.05), (kind, stage)

    memory = next(c for c in bar_containers(memory_ax) if c.patches[0].get_gid() == "memory")
    assert [p.get_height() for p in memory.patches] == pytest.approx(
        [number(rows[n][memory_column]) for n in names], abs=0.05
    )
    assert memory.get_label().startswith(ablation.memory_label(results))
    plt.close(fig)


def test_a_busy_machine_is_said_on_the_chart_as_in_the_table():
    """A chart travels without its table: the busy-machine warning of the .md is on the .png too."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ablation = bench_module("ablation")
    data = json.loads((ROOT / "benchmarks" / "results" / f"{ABLATION_RESULTS[0]}.json").read_text())
    meta = {**data["meta"], "cores": 2, "load_start": 8.0, "load_end": 0.0}
    assert "The machine was busy" in ablation.markdown(meta, data["results"])
    for m, busy in ((meta, True), ({**meta, "load_start": 0.0}, False)):
        fig = ablation.chart_figure(m, data["results"])
        assert ("The machine was busy" in fig.get_suptitle()) is busy
        plt.close(fig)


@pytest.mark.parametrize("stem", ABLATION_RESULTS)
def test_ablation_chart_legends_cover_no_bar_and_axes_say_their_units(stem, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ablation = bench_module("ablation")

    data = json.loads((ROOT / "benchmarks" / "results" / f"{stem}.json").read_text())
    fig = ablation.chart_figure(data["meta"], data["results"])
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    bars = [p.get_window_extent(renderer) for ax in fig.axes for c in bar_containers(ax) for p in c.patches]
    for ax in fig.axes:
        assert ax.get_xlabel() == "variant"
        assert ax.get_ylabel() in ("tokens/s", "ms per step", "MiB")
        legend = ax.get_legend()
        if legend is not None:
            box = legend.get_window_extent(renderer)
            assert not any(box.overlaps(b) for b in bars if b.height > 0), ax.get_title()
    plt.close(fig)


def test_make_figures_renders_the_same_bytes_twice(tmp_path):
    """A re-render leaves a clean checkout clean: fixed colours, no version or date in the PNGs."""
    for out in ("a", "b"):
        result = run("make_figures.py", "--out", str(tmp_path / out))
        assert result.returncode == 0, result.stderr[-3000:]
    names = sorted(p.name for p in (tmp_path / "a").glob("*.png"))
    assert names == ["memory_breakdown.png", "stage_times.png", "tokens_per_s.png"]
    for name in names:
        png = (tmp_path / "a" / name).read_bytes()
        assert png == (tmp_path / "b" / name).read_bytes(), name
        assert b"Matplotlib version" not in png


def test_a_busy_machine_writes_no_committed_results(monkeypatch, tmp_path, capsys):
    """Load above half the cores at the start: nothing goes to benchmarks/results without --busy
    (one line, status 2); elsewhere, or with --busy, the run goes on and its table says so."""
    common = bench_module("common")
    cores = 4
    monkeypatch.setattr(common.os, "cpu_count", lambda: cores)
    monkeypatch.setattr(common, "load_average", lambda: 0.75 * cores)
    with pytest.raises(SystemExit) as stop:
        common.refuse_if_busy(common.RESULTS, busy_ok=False)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--busy" in err and "3.00 on 4 cores" in err
    meta = common.refuse_if_busy(tmp_path, busy_ok=False)
    assert meta == {"load_start": 3.0, "cores": 4, "busy": True}
    assert common.refuse_if_busy(common.RESULTS, busy_ok=True)["busy"]
    busy = " ".join(common.load_lines({**meta, "load_end": 1.0}))
    assert "3.00 at the start, 1.00 at the end, on 4 cores" in busy and "busy" in busy
    monkeypatch.setattr(common, "load_average", lambda: 0.25 * cores)
    quiet = common.refuse_if_busy(common.RESULTS, busy_ok=False)
    assert not quiet["busy"] and "busy" not in " ".join(common.load_lines({**quiet, "load_end": 1.0}))
    assert "not recorded" in common.load_lines({})[0]  # results from before the load was recorded


@pytest.mark.slow
def test_allocator_puts_the_fresh_machine_first_with_counts_and_load(tmp_path):
    """The README's first command's row comes first; every row has its per-step page faults and
    CPU seconds, its peak RSS against the true peak, and the table the load at start and end."""
    env = {**os.environ, "MINIGPT_ARGS": "--preset tiny --use-toy-data"}
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "allocator.py"),
            *("--steps", "5", "--eval-interval", "2", "--repeats", "1", "--out-dir", str(tmp_path)),
            *("--variants", "glibc defaults", "README's first command"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "cpu-allocator.json").read_text())
    assert list(data["results"]) == ["README's first command", "glibc defaults"]
    first = data["results"]["README's first command"]
    assert "CPU malloc: glibc keeps freed memory" in first["allocator_line"]  # the trainer's default
    assert data["results"]["glibc defaults"]["allocator_line"] == ""  # --no-keep-freed-memory: none set
    for r in data["results"].values():
        assert r["faults_per_step"] >= 0 and r["cpu_s_per_step"]["median"] > 0
        assert r["faults_per_eval_step"] >= 0 and r["cpu_s_per_eval_step"] > 0
        assert len(r["cpu_s_per_step"]["repeats"]) == 1 and r["rss_peak_bytes"] > 0
    assert {"load_start", "load_end", "cores"} <= set(data["meta"])
    table = (tmp_path / "cpu-allocator.md").read_text()
    assert "at the start" in table and "page faults per step" in table


# ---------------------------------------------------------------------------- a user's mistakes
# Each refused in one line with status 2 before anything is measured, and nothing on disk touched.
# {dir}: the test's own folder, holding `afile` (a file), `bad.json` (not JSON), `list.json` (JSON,
# not a results file) and `other.json` (a results file of another layout).
MISTAKES = [
    ("ablation.py", "--out-dir {dir}/afile", "a file, not a folder"),
    ("ablation.py", "--out-dir {dir}/afile/sub", "a file, not a folder"),
    ("ablation.py", "--out-dir /proc/minigpt-results", "not writable"),
    ("ablation.py", "--nproc 0 --out-dir {dir}", "--nproc 0"),
    ("ablation.py", "--render {dir}/bad.json", "not JSON"),
    ("ablation.py", "--render {dir}/list.json", "not a benchmark results file"),
    ("ablation.py", "--render {dir}/other.json", "not a results file of ablation.py"),
    ("ablation.py", "--render /dev/zero", "not a regular file"),
    ("ablation.py", "--render {dir}/missing.json", "does not exist"),
    ("overhead.py", "--micro-steps 0 --out-dir {dir}", "--micro-steps must be at least 1"),
    ("overhead.py", "--out-dir {dir}/afile", "a file, not a folder"),
    ("overhead.py", "--render {dir}/bad.json", "not JSON"),
    ("overhead.py", "--render {dir}/other.json", "not a results file of overhead.py"),
    ("overhead.py", "--parts everything", "invalid choice"),
    ("nanogpt_shape.py", "--render {dir}/bad.json", "not JSON"),
    ("nanogpt_shape.py", "--render {dir}/other.json", "not a results file of nanogpt_shape.py"),
    ("nanogpt_shape.py", "--steps x", "invalid int value"),
    ("allocator.py", "--out-dir {dir}/afile", "a file, not a folder"),
    ("allocator.py", "--render {dir}/other.json", "not a results file of allocator.py"),
    ("make_figures.py", "--results {dir}/bad.json --out {dir}/img", "not JSON"),
    ("make_figures.py", "--results {dir}/other.json --out {dir}/img", "not an ablation results file"),
    ("make_figures.py", "--results {dir}/missing.json --out {dir}/img", "does not exist"),
    ("make_figures.py", "--out {dir}/afile", "a file, not a folder"),
    ("make_figures.py", "--out /proc/minigpt-img", "not writable"),
    ("estimate_table.py", "--shapes bad --out-dir {dir}", "is not PRESET:BATCH:SEQ"),
    ("estimate_table.py", "--shapes small:1:x --out-dir {dir}", "whole numbers"),
    ("estimate_table.py", "--shapes small:0:256 --out-dir {dir}", "must be at least 1"),
    ("estimate_table.py", "--shapes small:100000:1024 --out-dir {dir}", "GiB available"),  # 64 TiB
    ("estimate_table.py", "--shapes small:1:256 --out-dir {dir}/afile", "a file, not a folder"),
    ("estimate_table.py", "--render {dir}/other.json", "not a results file of estimate_table.py"),
    ("peak_flops.py", "--out-dir {dir}/afile", "a file, not a folder"),
    ("chunked_loss.py", "--render {dir}/bad.json", "not JSON"),
    ("parallel.py", "--steps 0", "--steps, --repeats and --ranks must be at least 1"),
]


def mistake_files(folder: Path) -> dict[str, str]:
    """`afile` (a file), `bad.json` (not JSON), `list.json` (JSON, not a results file) and
    `other.json` (a results file of another layout), written in `folder`."""
    files = {
        "afile": "a file where a folder belongs\n",
        "bad.json": '{"meta": {"name": ',
        "list.json": "[1, 2]\n",
        "other.json": json.dumps({"meta": {"kind": "another tool's"}, "results": [1, 2]}),
    }
    for name, text in files.items():
        (folder / name).write_text(text)
    return files


def refused_in_one_line(result, script: str, says: str, folder: Path, files: dict[str, str]) -> None:
    err = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(err) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert says in err[0] and err[0].startswith(f"{script}: error: ")
    assert "round" not in result.stdout  # refused before the first variant ran
    assert sorted(p.name for p in folder.iterdir()) == sorted(files)  # nothing written beside them
    assert {name: (folder / name).read_text() for name in files} == files  # nor changed


@pytest.mark.parametrize("script, args, says", MISTAKES, ids=[f"{s} {a}" for s, a, _ in MISTAKES])
def test_a_mistake_is_one_line_before_any_measuring_and_touches_nothing(
    tmp_path, monkeypatch, capsys, script, args, says
):
    files = mistake_files(tmp_path)
    result = bench_main(monkeypatch, capsys, script, *args.format(dir=tmp_path).split())
    refused_in_one_line(result, script, says, tmp_path, files)


def test_a_mistake_in_the_scripts_own_process_is_the_same_line_and_exit_2(tmp_path):
    """The one case above run as a user runs it: the process's status and stderr, not main()'s."""
    files = mistake_files(tmp_path)
    result = run("ablation.py", "--render", str(tmp_path / "other.json"))
    refused_in_one_line(result, "ablation.py", "not a results file of ablation.py", tmp_path, files)


# ---------------------------------------------------------------------------- ratios, noise, A/A
# The rendering and the refusal logic on figures made up here: nothing is timed.


@pytest.mark.parametrize("script", ["overhead.py", "ablation.py"])
def test_results_already_there_are_not_overwritten_without_force(tmp_path, monkeypatch, capsys, script):
    """A committed table that README cites is not replaced by a test run: one line before any run
    (in this process: test_a_mistake_in_the_scripts_own_process_... runs a refusal as a user does)."""
    common = bench_module("common")
    stem = f"overhead-{common.device_slug(common.machine())}-tiny" if script == "overhead.py" else None
    stem = stem or f"{common.device_slug(common.machine())}-tiny"
    (tmp_path / f"{stem}.md").write_text("## a section README cites\n")
    extra = ["--name", "tiny"] if script == "ablation.py" else []
    result = bench_main(monkeypatch, capsys, script, *TINY, *extra, "--out-dir", str(tmp_path))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr[-2000:]
    assert f"{stem}.md is already there" in result.stderr and "--force" in result.stderr
    assert (tmp_path / f"{stem}.md").read_text() == "## a section README cites\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{stem}.md"]


def test_the_ablation_table_shows_no_mfu_above_100_percent(monkeypatch):
    ablation = bench_module("ablation")
    assert ablation.mfu_cell(0.238) == "23.8%" and ablation.mfu_cell(1.0) == "100.0%"
    assert ablation.mfu_cell(1.505) == "n/a (denominator measured under load)"


QUIET, FAR = [100.0, 101.0, 99.0], [130.0, 131.0, 129.0]  # three repeats each: tight, and 1.3x apart


def test_a_ratio_reads_its_interval_or_says_why_it_has_none(monkeypatch):
    common = bench_module("common")
    assert common.ratio_text(common.ratio(QUIET, FAR)).startswith("1.30x (1.2")
    assert common.ratio_text(common.ratio(QUIET, [80.0, 125.0, 100.0])) == "no difference within noise"
    one = common.ratio_text(common.ratio([100.0], [164.0]))  # --repeats 1: the ratio, marked as no finding
    assert one == "1.64x (no interval: 1 repeat, an interval needs 3)"
    assert "%" not in common.ratio_text(common.ratio(QUIET, [98.0, 103.0, 100.0]))


@pytest.mark.parametrize(
    "copy, passed, says",
    [
        ([100.5, 99.5, 100.0], True, "the copies agree"),
        (FAR, False, "too noisy to tell"),
        ([100.0], None, "Too few repeats"),
    ],
)
def test_the_aa_check_says_whether_the_machine_could_tell(monkeypatch, copy, passed, says):
    common = bench_module("common")
    check = common.aa_check("fp32", QUIET[: len(copy)], copy, "tokens/s of each repeat")
    assert check["passed"] is passed
    text = " ".join(common.aa_lines({"aa": [check]}))
    assert "fp32 against a second copy of itself" in text and says in text
    assert "A/A check: not recorded" in common.aa_lines({})[0]  # a results file from before the check


def test_a_noisy_run_is_not_written_as_committed_results_without_the_flag(monkeypatch, tmp_path):
    common = bench_module("common")
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    failed = {"aa": [common.aa_check("fp32", QUIET, FAR, "tokens/s")]}
    elsewhere, line = common.destination(tmp_path / "results", failed, noisy_ok=False)
    assert elsewhere != tmp_path / "results" and elsewhere.is_dir() and str(elsewhere) in line
    assert "too noisy" in line and "--noisy" in line and "\n" not in line
    elsewhere.rmdir()
    assert common.destination(tmp_path / "results", failed, noisy_ok=True) == (tmp_path / "results", None)
    assert common.destination(tmp_path / "mine", failed, noisy_ok=False) == (tmp_path / "mine", None)
    passed = {"aa": [common.aa_check("fp32", QUIET, QUIET, "tokens/s")]}
    assert common.destination(tmp_path / "results", passed, noisy_ok=False) == (tmp_path / "results", None)
    named = " ".join(common.aa_lines({**failed, "noisy": True}))
    assert "with `--noisy`" in named  # the file names the flag that let it in


def fake_rows(tokens_per_s: float) -> dict:
    """What common.run_variant returns for one run: its measured steps' rows, as the trainer logs them."""
    row = {
        "tokens_per_s": tokens_per_s,
        "step_time_s": 2048 / tokens_per_s,
        "mfu": 0.1,
        "stage_host_ms": {"forward": 1.0, "backward": 2.0},
        "stage_device_ms": {"forward": 1.0, "backward": 2.0},
    }
    return {"rows": [{**row, "step": s} for s in (2, 3)], "breakdown": None, "config": {"amp": "fp32"}}


@pytest.mark.parametrize("copy_factor, noisy, status", [(1.0, False, 0), (1.3, False, 1), (1.3, True, 0)])
def test_ablation_checks_its_baseline_against_itself(
    monkeypatch, tmp_path, capsys, copy_factor, noisy, status
):
    """Each round ends with the baseline's copy; when it differs from the baseline beyond the interval,
    the results do not go into the committed folder unless --noisy, and the table says so. The load at
    the start and the end is in the results."""
    ablation = bench_module("ablation")
    common = bench_module("common")
    committed = tmp_path / "results"
    monkeypatch.setattr(common, "RESULTS", committed)
    monkeypatch.setattr(common, "load_average", lambda: 0.25)
    monkeypatch.setattr(ablation, "load_average", lambda: 0.5)
    calls = []

    def run_variant(flags, warmup, steps, nproc=1, keep=None):
        calls.append(flags)
        jitter = (1.0, 1.01, 0.99)[(len(calls) - 1) // 3 % 3]  # 3 calls a round: fp32, fp32 + ckpt, copy
        factor = (
            copy_factor if len(calls) % 3 == 0 else 0.8 if "--use-activation-checkpoint" in flags else 1.0
        )
        return fake_rows(1000 * factor * jitter)

    monkeypatch.setattr(ablation, "run_variant", run_variant)
    argv = ["ablation.py", "--amp-rows", "off", "--name", "t", "--out-dir", str(committed), "--device", "cpu"]
    monkeypatch.setattr(sys, "argv", argv + (["--noisy"] if noisy else []))
    assert ablation.main() == status
    assert len(calls) == 9 and calls[2] == calls[0]  # 3 rounds (the default) of fp32, fp32 + ckpt, fp32 again
    err = capsys.readouterr().err.strip().splitlines()
    written = list(committed.glob("cpu-t.*"))
    if status == 1:
        assert not written and len(err) == 1 and "too noisy" in err[0]
        stem = Path(err[0].split("results written to ")[1].split(",")[0]) / "cpu-t"
    else:
        assert sorted(p.suffix for p in written) == [".json", ".md", ".png"] and not err
        stem = committed / "cpu-t"
    data = json.loads(stem.with_suffix(".json").read_text())
    assert list(data["results"]) == ["fp32", "fp32 + ckpt"]  # the copy is a check, not a row
    meta = data["meta"]
    assert (meta["load_start"], meta["load_end"]) == (0.25, 0.5)
    assert meta["aa"][0]["passed"] is (copy_factor == 1.0)
    table = stem.with_suffix(".md").read_text()
    assert "0.25 at the start, 0.50 at the end" in table and "A/A check: fp32 against" in table
    assert ("too noisy to tell" in table) == (copy_factor != 1.0)
    assert ("with `--noisy`" in table) == noisy
    assert "activation checkpointing (fp32): tokens/s 0.80x (0.7" in table
    if status == 1:
        shutil.rmtree(stem.parent)


def test_ratio_cells_of_every_benchmark_carry_their_interval(monkeypatch):
    """The committed results rendered again: each ratio cell is a verdict with its interval, "no
    difference within noise", "no verdict (busy)" (the variant's rounds ran while other processes
    took the cores), or says it has too few repeats; never a bare percentage."""
    ablation = bench_module("ablation")
    overhead = bench_module("overhead")
    nanogpt = bench_module("nanogpt_shape")
    allocator = bench_module("allocator")
    results = ROOT / "benchmarks" / "results"

    def load(name):
        return json.loads((results / name).read_text())

    small = load("cpu-small.json")
    small["results"]["fp32 + ckpt"]["tokens_per_s_repeats"] = [1500.0, 2900.0, 2200.0]  # noise, made up
    tables = {
        "ablation": ablation.markdown(small["meta"], small["results"]),
        "overhead": overhead.markdown(load("overhead-cpu-small.json")).split("## What each")[0],
        "profiler options": overhead.markdown(load("overhead-cpu-small.json")).split("## What each")[1],
        "nanogpt": nanogpt.markdown(load("cpu-nanogpt.json")),
        "allocator": allocator.markdown(
            *(lambda d: (d["meta"], d["results"], d["true_peak"]))(load("cpu-allocator.json"))
        ),
    }
    columns = {
        "ablation": "vs baseline",
        "overhead": "overhead vs timing off",
        "profiler options": "vs no profiler",
        "nanogpt": "vs nanoGPT, same dtype",
        "allocator": "vs first row",
    }
    verdict = re.compile(
        r"^(\d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\)|no difference within noise|no verdict \(busy\)|"
        r"baseline|first row|"
        r"\d+\.\d\dx \(no interval: \d repeats?, an interval needs 3\))$"
    )
    for tool, table in tables.items():
        cells = [
            c for row in table_rows(table).values() for h, c in row.items() if h.startswith(columns[tool])
        ]
        assert cells and all(verdict.match(c) for c in cells), (tool, cells)
        assert "A/A check" in table or tool == "profiler options"
    assert table_rows(tables["ablation"])["fp32 + ckpt"]["vs baseline"] == "no difference within noise"
    assert "activation checkpointing (fp32): tokens/s no difference within noise" in tables["ablation"]


def test_overhead_and_allocator_check_their_baseline_too(monkeypatch, tmp_path, capsys):
    """The same A/A check and load record in the other two trainer benchmarks, on made-up figures:
    a copy 1.3x off its baseline keeps the results out of the committed folder."""
    common = bench_module("common")
    overhead = bench_module("overhead")
    allocator = bench_module("allocator")
    committed = tmp_path / "results"
    monkeypatch.setattr(common, "RESULTS", committed)
    calls = []

    def run_variant(flags, warmup, steps, nproc=1, keep=None):
        calls.append(flags)
        return fake_rows(1300.0 if len(calls) % 5 == 0 else (1000.0, 1010.0, 990.0)[(len(calls) - 1) // 5])

    monkeypatch.setattr(common, "run_variant", run_variant)
    loads = iter([0.25, 0.5, 0.25, 0.5])  # each run's load at its start (refuse_if_busy) and end
    monkeypatch.setattr(common, "load_average", lambda: next(loads))
    monkeypatch.setattr(
        overhead,
        "instrumentation_us_per_step",
        lambda device, steps: dict.fromkeys(
            ("bare loop", "ranges only (--no-stage-timing)", "ranges + timing (default)"), 1.0
        ),
    )
    monkeypatch.setattr(sys, "argv", ["overhead.py", "--parts", "stage-timing", "--out-dir", str(committed)])
    assert (
        overhead.main() == 1
        and len(calls) == 15
        and calls[4] == calls[0] == ["--preset", "small", "--no-stage-timing"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "timing off against itself" in err[0] and not committed.exists()
    shutil.rmtree(err[0].split("results written to ")[1].split(",")[0])

    def run(name, paths, steps, eval_interval, amp):
        calls.append(name)
        cpu_s = 1.3 if len(calls) % 3 == 0 else (1.0, 1.01, 0.99)[(len(calls) - 1) // 3 % 3]
        return {
            "allocator_line": "CPU allocator: made up",
            "amp": "fp32",
            "tokens_per_s": [2048 / cpu_s] * 4,
            "tokens_per_s_e2e": 2048 / cpu_s,
            "faults_per_step": [0],
            "cpu_s_per_step": [cpu_s] * 4,
            "faults_per_eval_step": [0],
            "cpu_s_per_eval_step": [cpu_s],
            "rss_peak_bytes": 2**30,
            "cpu_user_s": 1.0,
            "cpu_system_s": 0.1,
            "minor_faults": 10,
            "rss_bytes": 2**29,
        }

    calls.clear()
    monkeypatch.setattr(allocator, "run", run)
    monkeypatch.setattr(allocator, "true_peak", lambda amp: 2**29)
    variants = ["--variants", "glibc defaults", allocator.README]
    monkeypatch.setattr(sys, "argv", ["allocator.py", *variants, "--out-dir", str(committed), "--noisy"])
    assert allocator.main() == 0 and calls[:3] == [allocator.README, "glibc defaults", allocator.README]
    data = json.loads((committed / "cpu-allocator.json").read_text())
    assert list(data["results"]) == [allocator.README, "glibc defaults"]
    assert [c["passed"] for c in data["meta"]["aa"]] == [False, False]
    assert (data["meta"]["load_start"], data["meta"]["load_end"]) == (0.25, 0.5)
    table = (committed / "cpu-allocator.md").read_text()
    assert "too noisy to tell" in table and "with `--noisy`" in table


def test_the_ablation_measures_kernel_rates_only_when_asked_one_pass_per_kernel_set(monkeypatch, tmp_path):
    """--predict: one `estimate --time` pass per set of kernels (a checkpointed variant's are the
    plain one's), before the rounds, and every run asked for its predicted step (--predict-time);
    without it, none of either."""
    ablation = bench_module("ablation")
    common = bench_module("common")
    monkeypatch.setattr(common, "load_average", lambda: 0.1)
    monkeypatch.setattr(ablation, "load_average", lambda: 0.1)
    cpu = {"torch": "2.13.0+cpu", "python": "3.11.7", "platform": "Linux", "device": "cpu"}
    cpu.update(device_name="Intel(R) Xeon(R) Processor", cores=2, native_bf16=True)
    monkeypatch.setattr(common, "machine", lambda device="auto": cpu)
    monkeypatch.setattr(ablation, "native_bf16", lambda m: True)
    runs = []
    monkeypatch.setattr(
        ablation,
        "run_variant",
        lambda flags, warmup, steps, nproc=1, keep=None: runs.append(flags) or fake_rows(1e3),
    )
    passes = []
    monkeypatch.setattr(ablation, "cache_step_rates", passes.append)
    for i, predict in enumerate(([], ["--predict"])):
        runs.clear()
        argv = ["ablation.py", "--malloc", "--repeats", "1", "--name", f"r{i}", "--out-dir", str(tmp_path)]
        monkeypatch.setattr(sys, "argv", argv + predict)
        assert ablation.main() == 0
        assert runs and all(("--predict-time" in f) == bool(predict) for f in runs)
    assert len(passes) == 1  # the run without --predict measured nothing
    kinds = [("--no-amp" in f, "--no-keep-freed-memory" in f) for f in passes[0]]
    assert kinds == [(True, False), (False, False), (False, True)]  # fp32, amp, amp under glibc
    assert not any("--use-activation-checkpoint" in f for f in passes[0])


def test_the_gpu_ablation_runs_its_own_rows_without_measuring_rates(monkeypatch, tmp_path, capsys):
    """On a GPU (a faked machine: no GPU needed) the ablation's rows are what a GPU user weighs, AMP
    first, with torch.compile and twice the batch, each with its steady tokens/s, MFU, stage times
    and peak; no "[rates]" processes (a GPU's prediction is its data sheet), so the gpt2 preset's
    ablation fits in about three minutes on one H100/H200."""
    ablation = bench_module("ablation")
    common = bench_module("common")
    monkeypatch.setattr(common, "load_average", lambda: 0.1)
    monkeypatch.setattr(ablation, "load_average", lambda: 0.1)
    gpu = {"torch": "2.11.0+cu130", "python": "3.12.3", "cuda": "13.0", "platform": "Linux"}
    gpu.update(device="cuda", device_name="NVIDIA H200", gpus=1)
    monkeypatch.setattr(common, "machine", lambda device="auto": gpu)
    monkeypatch.setattr(ablation, "cache_step_rates", lambda flags: pytest.fail("rates measured on a GPU"))
    calls = []

    def run_variant(flags, warmup, steps, nproc=1, keep=None):
        calls.append(flags)
        return fake_rows(1000.0 * (1.3 if "--compile" in flags else 1.0))

    monkeypatch.setattr(ablation, "run_variant", run_variant)
    argv = ["ablation.py", "--preset", "gpt2", "--repeats", "2", "--name", "g", "--out-dir", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    assert ablation.main() == 0
    data = json.loads((tmp_path / "nvidia-h200-g.json").read_text())
    assert list(data["results"]) == ["amp", "amp + ckpt", "amp + compile", "amp, batch 16", "fp32"]
    assert len(calls) == 2 * 6 and calls[5] == calls[0]  # 2 rounds of 5 rows and the A/A copy of amp
    assert ["--batch-size", "16"] == calls[3][-2:] and "--compile" in calls[2]
    table = (tmp_path / "nvidia-h200-g.md").read_text()
    assert "amp + compile: tokens/s 1.30x" in table and "NVIDIA H200" in table


def test_nanogpt_beside_minigpt_on_a_gpu_runs_both_eager_and_compiled(monkeypatch, tmp_path):
    """benchmarks/nanogpt_shape.py on CUDA (the calls only: no GPU needed): nanoGPT's own train.py
    unchanged (it autocasts on a GPU) and minigpt, eager and compiled, at the gpt2 shape; no malloc
    row (a CPU allocator's question); each row against nanoGPT in the same dtype, compiled or not."""
    nanogpt = bench_module("nanogpt_shape")
    argv = [
        "--shape",
        "gpt2",
        "--dtypes",
        "bf16",
        "--device",
        "cuda",
        "--compile",
        "--steps",
        "3",
        "--warmup",
        "2",
    ]
    args = nanogpt.parser().parse_args(argv)
    calls = []
    monkeypatch.setattr(
        nanogpt, "run_nanogpt", lambda work, d, run, keep: calls.append(("nanoGPT", d, run, keep))
    )
    monkeypatch.setattr(nanogpt, "run_minigpt", lambda d, run: calls.append(("minigpt", d, run)))
    found = nanogpt.variants(tmp_path, args, ["bf16"])
    assert list(found) == [
        "nanoGPT train.py, bf16",
        "minigpt train_minimal.py, bf16",
        "nanoGPT train.py, bf16, compiled",
        "minigpt train_minimal.py, bf16, compiled",
    ]
    for call in found.values():
        call()
    assert [(c[0], c[2].device, c[2].compile) for c in calls] == [
        ("nanoGPT", "cuda", False),
        ("minigpt", "cuda", False),
        ("nanoGPT", "cuda", True),
        ("minigpt", "cuda", True),
    ]
    results = {name: {"tokens_per_s_rounds": [100.0, 101.0]} for name in found}
    assert nanogpt.against("minigpt train_minimal.py, bf16, compiled", results) != "-"
    assert nanogpt.against("nanoGPT train.py, bf16, compiled", results) == "baseline"


def test_the_ablation_puts_every_rows_mfu_against_one_denominator():
    """fp32 and AMP rows of one machine against one peak, the largest, so MFU ranks the rows as
    tokens/s does; the column names that peak's dtype as the runs' config.json recorded it, never a
    row's own AMP: fp32 rows of a machine whose peak is bf16's are divided by bf16's (issue 48's
    "against the fp32 peak" while dividing by bf16's). Results without the record say so."""
    ablation = bench_module("ablation")
    data = json.loads((ROOT / "benchmarks" / "results" / "cpu-small.json").read_text())
    meta, recorded_now = data["meta"], data["results"]
    assert ablation.one_denominator(meta, recorded_now)[1] in ("bf16", "fp32")  # the committed runs record it
    results = {n: {k: v for k, v in s.items() if k != "peak_flops_dtype"} for n, s in recorded_now.items()}
    mfu, dtype = ablation.one_denominator(meta, results)
    assert dtype is None and "| MFU (the peak's dtype not recorded) |" in ablation.markdown(meta, results)
    recorded = {name: {**s, "peak_flops_dtype": "bf16"} for name, s in results.items()}
    mfu, dtype = ablation.one_denominator(meta, recorded)
    assert dtype == "bf16" and mfu["amp"] == pytest.approx(results["amp"]["mfu"], rel=1e-9)
    by_tokens = sorted(results, key=lambda n: ablation.tokens_median(results[n]))
    assert sorted(mfu, key=mfu.get) == by_tokens
    assert "| MFU against bf16's peak |" in ablation.markdown(meta, recorded)
    fp32 = {n: s for n, s in recorded.items() if s["amp"] == "fp32"}
    table = ablation.markdown(meta, fp32)
    assert "| MFU against bf16's peak |" in table and "fp32's peak" not in table and "fp32 peak" not in table
    only_fp32 = {n: {**s, "peak_flops_dtype": "fp32"} for n, s in fp32.items()}  # a CPU without native bf16
    assert "| MFU against fp32's peak |" in ablation.markdown(meta, only_fp32)


def test_busy_runs_are_flagged_in_one_line_and_give_no_verdict(monkeypatch, tmp_path):
    """A variant whose measured steps ran busy (metrics.jsonl's `busy` above minigpt.config.BUSY in
    over that share of them) is named in one line of the table and on the chart, and no ratio is
    drawn from it or against it: "re-run on a quiet machine". The quiet rows keep their verdicts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minigpt.config import BUSY

    def rows(flags, calls):
        busy = 2 * BUSY if "--use-activation-checkpoint" in flags else 0.0  # others took half the cores
        made = fake_rows(1000.0 * (1.0, 1.01, 0.99)[(len(calls) - 1) // 3 % 3])
        return {**made, "rows": [{**r, "busy": busy} for r in made["rows"]]}

    ablation, _ = faked_ablation(monkeypatch, rows)
    argv = ["ablation.py", "--amp-rows", "off", "--name", "b", "--out-dir", str(tmp_path), "--device", "cpu"]
    monkeypatch.setattr(sys, "argv", argv)
    assert ablation.main() == 0
    data = json.loads((tmp_path / "cpu-b.json").read_text())
    assert data["results"]["fp32 + ckpt"]["busy_repeats"] == [1.0, 1.0, 1.0]
    assert data["results"]["fp32"]["busy_repeats"] == [0.0, 0.0, 0.0]
    table = (tmp_path / "cpu-b.md").read_text()
    flagged = [line for line in table.splitlines() if "Busy runs:" in line]
    assert len(flagged) == 1 and "fp32 + ckpt" in flagged[0] and "re-run on a quiet machine" in flagged[0]
    assert table_rows(table)["fp32 + ckpt"]["vs baseline"] == "no verdict (busy)"
    assert "activation checkpointing (fp32): tokens/s no verdict (busy)" in table
    assert "A/A check: fp32 against a second copy of itself" in table  # the quiet baseline's check stands
    fig = ablation.chart_figure(data["meta"], data["results"])
    assert "Busy runs: fp32 + ckpt" in fig.get_suptitle()
    plt.close(fig)


def test_the_gpu_ablation_says_whether_its_fp32_row_ran_in_tf32():
    """On CUDA an fp32 row's speed depends on TF32 (--tf32, off by default): its AMP cell says which,
    from config.json's config.tf32; the AMP rows and a CPU's fp32 rows stay as they are."""
    ablation = bench_module("ablation")
    data = json.loads((ROOT / "benchmarks" / "results" / "nvidia-h200-gpt2.json").read_text())
    meta, results = data["meta"], data["results"]
    assert table_rows(ablation.markdown(meta, results))["fp32"]["AMP"] == "fp32 (TF32 not recorded)"
    for tf32, says in ((False, "fp32, TF32 off"), (True, "fp32, TF32 on")):
        rows = {**results, "fp32": {**results["fp32"], "tf32": tf32}}
        cells = table_rows(ablation.markdown(meta, rows))
        assert cells["fp32"]["AMP"] == says and cells["amp"]["AMP"] == "bf16"
    cpu = {**meta, "machine": {**meta["machine"], "device": "cpu"}}
    assert table_rows(ablation.markdown(cpu, results))["fp32"]["AMP"] == "fp32"


def test_the_estimate_table_measures_its_peaks_on_one_thread(monkeypatch):
    """oneDNN's bf16 products allocate a scratch per intra-op thread, so a peak depends on the thread
    count: each cell is measured on one (and torch's count set back after), and the table says so,
    naming the cells of older results that were not."""
    estimate_table = bench_module("estimate_table")
    seen, real = [], estimate_table._measure
    monkeypatch.setattr(
        estimate_table, "_measure", lambda *a: seen.append(torch.get_num_threads()) or real(*a)
    )
    before = torch.get_num_threads()
    row = estimate_table.cell("tiny", estimate_table.shape_of("tiny", 1, 16), "bf16", False)
    assert seen == [1] and torch.get_num_threads() == before and row["threads"] == 1
    old = json.loads((ROOT / "benchmarks" / "results" / "cpu-estimate.json").read_text())
    table = estimate_table.markdown(old["meta"], [row])
    assert "on one intra-op thread (`torch.set_num_threads(1)`" in table and "default intra-op" not in table
    older = estimate_table.markdown(old["meta"], [*old["results"], row])
    n = len(old["results"])
    assert f"{n} of {n + 1} cells were measured on torch's default" in older


def test_bf16_step_measures_the_removed_cpu_loss_as_a_candidate_beside_the_trainers():
    """The candidate (model.py's CPU CrossEntropy before it was removed; not the trainer's) computes
    F.cross_entropy's loss and gradient, ignored targets and a scaled loss included, so what the
    benchmark measures is what the trick would buy; its closing lines say it per dtype."""
    import torch.nn.functional as F

    bf16_step = bench_module("bf16_step")
    assert bf16_step.VARIANTS[bf16_step.TRAINER] is F.cross_entropy
    gen = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        logits = torch.randn(21, 50, generator=gen).to(dtype)
        targets = torch.randint(0, 50, (21,), generator=gen)
        targets[3] = -100
        grads = []
        for fn in (F.cross_entropy, bf16_step.CandidateCrossEntropy.apply):
            x = logits.clone().requires_grad_()
            loss = fn(x, targets)
            (0.5 * loss).backward()  # a scale other than 1: the candidate's other backward path
            grads.append((loss.detach().float(), x.grad.float()))
        (want, want_grad), (got, got_grad) = grads
        assert got.item() == pytest.approx(want.item(), rel=tol, abs=tol)
        assert torch.allclose(got_grad, want_grad, rtol=tol, atol=tol)
    result = run("bf16_step.py", "--preset", "tiny", "--dtypes", "fp32", "--rounds", "3", "--no-profile")
    assert result.returncode == 0, result.stderr[-3000:]
    closing = result.stdout.split("What the removed trick would buy, measured:")[1].strip().splitlines()
    assert len(closing) == 1 and closing[0].startswith("- fp32: the removed CPU CrossEntropy would buy")
    assert "| candidate CrossEntropy (not the trainer's) |" in result.stdout
