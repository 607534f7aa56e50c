"""The benchmark scripts end to end on a tiny configuration: they run every variant in a fresh
process and write results that name their machine. (Their figures are not asserted: performance
claims live in benchmarks/results/, never in tests.)"""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

TINY = ["--preset", "tiny", "--use-toy-data", "--steps", "2", "--warmup", "1", "--repeats", "1"]


def run(script, *args):
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_ablation_writes_json_markdown_and_chart(tmp_path):
    result = run("ablation.py", *TINY, "--amp-rows", "on", "--name", "tiny", "--out-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "cpu-tiny.json").read_text())
    assert list(data["results"]) == ["fp32", "fp32 + ckpt", "amp", "amp + ckpt"]
    meta = data["meta"]
    assert meta["machine"]["torch"] == torch.__version__ and meta["machine"]["device"] == "cpu"
    assert meta["command"].startswith("python benchmarks/ablation.py --preset tiny") and meta["date"]
    for r in data["results"].values():
        assert r["tokens_per_s"]["n"] == 2 and r["tokens_per_s"]["median"] > 0
        assert set(r["stage_host_ms"]) == {"data_to_device", "forward", "backward", "optimizer_step"}
        assert r["breakdown_bytes"]["params"] > 0
    # checkpointing keeps fewer activations: measured, not assumed
    results = data["results"]
    assert (
        results["fp32 + ckpt"]["breakdown_bytes"]["activations"]
        < results["fp32"]["breakdown_bytes"]["activations"]
    )
    table = (tmp_path / "cpu-tiny.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert len({line.count("|") for line in rows}) == 1  # every row as wide as the header: it renders
    assert [r["amp"] for r in results.values()] == ["fp32", "fp32", "bf16", "bf16"]
    assert "| fp32 | " in table and "AMP: " in table and torch.__version__ in table and "Command:" in table
    assert (tmp_path / "cpu-tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ablation_without_amp_rows_runs_its_variants_in_fp32(tmp_path):
    """A CPU without native bf16 leaves the AMP rows out (--amp-rows auto); what is asked for on top
    runs in fp32 and is compared with fp32."""
    flags = ("--amp-rows", "off", "--malloc", "--chunked-loss", "--name", "fp32", "--out-dir", str(tmp_path))
    result = run("ablation.py", *TINY, *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "cpu-fp32.json").read_text())
    names = ["fp32", "fp32 + ckpt", "fp32, malloc defaults", "fp32 + chunked loss"]
    assert list(data["results"]) == names
    assert {r["amp"] for r in data["results"].values()} == {"fp32"}
    table = (tmp_path / "cpu-fp32.md").read_text()
    assert "No AMP rows" in table and "fp32 + chunked loss: " in table and "AMP: " not in table


def test_overhead_reports_each_variant(tmp_path):
    result = run(
        "overhead.py", *TINY, "--parts", "stage-timing", "--micro-steps", "500", "--out-dir", str(tmp_path)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "overhead-cpu-tiny.json").read_text())
    assert list(data["results"]) == ["timing off", "timing on (default)", "profiler", "profiler + stacks"]
    assert data["results"]["timing off"]["stage_host_ms"] == {}  # --no-stage-timing reached the trainer
    assert set(data["results"]["timing on (default)"]["stage_host_ms"]) >= {"forward", "backward"}
    table = (tmp_path / "overhead-cpu-tiny.md").read_text()
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
    (tmp_path / "overhead-cpu-tiny.md").unlink()
    assert run("overhead.py", "--render", str(tmp_path / "overhead-cpu-tiny.json")).returncode == 0
    assert (tmp_path / "overhead-cpu-tiny.md").read_text() == table  # the table is a function of the .json


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


NANOGPT_DIRS = (
    ROOT.parent / "shared" / "anchors" / "nanoGPT",  # beside the repo or its worktrees
    ROOT.parents[1] / "shared" / "anchors" / "nanoGPT",
)
NANOGPT = next((d for d in NANOGPT_DIRS if (d / "train.py").is_file()), None)


@pytest.mark.slow
@pytest.mark.skipif(NANOGPT is None, reason="nanoGPT's files are not in shared/anchors/nanoGPT near the repo")
def test_nanogpt_runs_the_real_train_py_beside_minigpt(tmp_path):
    result = run(
        "nanogpt_shape.py",
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


def test_nanogpt_without_its_files_says_so_in_one_line(tmp_path):
    result = run("nanogpt_shape.py", "--nanogpt-dir", str(tmp_path))
    assert result.returncode == 2 and "nanoGPT" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_ablation_render_rewrites_table_and_chart_without_running(tmp_path):
    for stem, pre_peak in (("cpu-gpt2-b2", True), ("cpu-small", False)):
        copy = tmp_path / f"{stem}.json"
        copy.write_text((ROOT / "benchmarks" / "results" / f"{stem}.json").read_text())
        result = run("ablation.py", "--render", str(copy))
        assert result.returncode == 0, result.stderr[-3000:]
        table = (tmp_path / f"{stem}.md").read_text()
        assert "| amp | bf16 |" in table
        # results that predate the allocator's measured peak: their memory column must not say "peak"
        assert ("breakdown sum MiB (not the peak)" in table) == pre_peak
        assert ("| peak MiB |" in table) != pre_peak
        assert (tmp_path / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_benchmark_flags_fail_with_a_message():
    result = run("ablation.py", "--steps", "0")
    assert result.returncode == 2 and "--steps and --repeats must be at least 1" in result.stderr


ABLATION_RESULTS = ["cpu-small-fp32", "cpu-small", "cpu-gpt2-b2"]  # the committed ablation charts


def table_rows(table: str) -> dict[str, list[str]]:
    """The ablation table's cells by variant name, as a reader sees them."""
    rows = [line.strip("|").split(" | ") for line in table.splitlines() if line.startswith("| ")]
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

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import ablation

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


@pytest.mark.parametrize("stem", ABLATION_RESULTS)
def test_ablation_chart_legends_cover_no_bar_and_axes_say_their_units(stem, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import ablation

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


def common_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import common
    finally:
        sys.path.pop(0)
    return common


def test_a_busy_machine_writes_no_committed_results(monkeypatch, tmp_path, capsys):
    """Load above half the cores at the start: nothing goes to benchmarks/results without --busy
    (one line, status 2); elsewhere, or with --busy, the run goes on and its table says so."""
    common = common_module()
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
    assert "CPU allocator:" in first["allocator_line"]
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
    ("estimate_table.py", "--shapes small:1:256 --out-dir {dir}/afile", "a file, not a folder"),
    ("estimate_table.py", "--render {dir}/other.json", "not a results file of estimate_table.py"),
    ("peak_flops.py", "--out-dir {dir}/afile", "a file, not a folder"),
    ("chunked_loss.py", "--render {dir}/bad.json", "not JSON"),
    ("parallel.py", "--steps 0", "--steps, --repeats and --ranks must be at least 1"),
]


@pytest.mark.parametrize("script, args, says", MISTAKES, ids=[f"{s} {a}" for s, a, _ in MISTAKES])
def test_a_mistake_is_one_line_before_any_measuring_and_touches_nothing(tmp_path, script, args, says):
    files = {
        "afile": "a file where a folder belongs\n",
        "bad.json": '{"meta": {"name": ',
        "list.json": "[1, 2]\n",
        "other.json": json.dumps({"meta": {"kind": "another tool's"}, "results": [1, 2]}),
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    result = run(script, *args.format(dir=tmp_path).split())
    err = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(err) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert says in err[0] and err[0].startswith(f"{script}: error: ")
    assert "round" not in result.stdout  # refused before the first variant ran
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)  # nothing written beside them
    assert {name: (tmp_path / name).read_text() for name in files} == files  # nor changed
