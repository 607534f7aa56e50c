"""The benchmark scripts end to end on a tiny configuration: they run every variant in a fresh
process and write results that name their machine. (Their figures are not asserted: performance
claims live in benchmarks/results/, never in tests.)"""

import json
import subprocess
import sys

import torch

from conftest import ROOT

TINY = ["--preset", "tiny", "--use-toy-data", "--steps", "2", "--warmup", "1", "--repeats", "1"]


def run(script, *args):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_ablation_writes_json_markdown_and_chart(tmp_path):
    result = run("ablation.py", *TINY, "--name", "tiny", "--out-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "cpu-tiny.json").read_text())
    assert list(data["results"]) == ["fp32", "fp32 + ckpt", "amp", "amp + ckpt"]
    meta = data["meta"]
    assert meta["machine"]["torch"] == torch.__version__ and meta["machine"]["device"] == "cpu"
    assert meta["command"].startswith("python benchmarks/ablation.py --preset tiny") and meta["date"]
    for name, r in data["results"].items():
        assert r["tokens_per_s"]["n"] == 2 and r["tokens_per_s"]["median"] > 0
        assert set(r["stage_host_ms"]) == {"data_to_device", "forward", "backward", "optimizer_step"}
        assert r["breakdown_bytes"]["params"] > 0
    # checkpointing keeps fewer activations: measured, not assumed
    results = data["results"]
    assert results["fp32 + ckpt"]["breakdown_bytes"]["activations"] < results["fp32"]["breakdown_bytes"]["activations"]
    table = (tmp_path / "cpu-tiny.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert len({line.count("|") for line in rows}) == 1  # every row as wide as the header: it renders
    assert [r["amp"] for r in results.values()] == ["fp32", "fp32", "bf16", "bf16"]
    assert "| fp32 | " in table and "AMP: " in table and torch.__version__ in table and "Command:" in table
    assert (tmp_path / "cpu-tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_overhead_reports_each_variant(tmp_path):
    result = run("overhead.py", *TINY, "--micro-steps", "500", "--out-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "overhead-cpu-tiny.json").read_text())
    assert list(data["results"]) == ["timing off", "timing on (default)", "profiler", "profiler + stacks"]
    assert data["results"]["timing off"]["stage_host_ms"] == {}  # --no-stage-timing reached the trainer
    assert set(data["results"]["timing on (default)"]["stage_host_ms"]) >= {"forward", "backward"}
    table = (tmp_path / "overhead-cpu-tiny.md").read_text()
    assert "overhead vs timing off" in table and "The default instrumentation (ranges and timing) costs" in table
    costs = data["instrumentation_us_per_step"]
    # the ranges cost tens of microseconds, an empty loop about one: ordered whatever the machine does
    assert 0 < costs["bare loop"] < min(costs["ranges only (--no-stage-timing)"], costs["ranges + timing (default)"])
    (tmp_path / "overhead-cpu-tiny.md").unlink()
    assert run("overhead.py", "--render", str(tmp_path / "overhead-cpu-tiny.json")).returncode == 0
    assert (tmp_path / "overhead-cpu-tiny.md").read_text() == table  # the table is a function of the .json


def test_ablation_render_rewrites_table_and_chart_without_running(tmp_path):
    results = ROOT / "benchmarks" / "results" / "cpu-small.json"
    copy = tmp_path / "cpu-small.json"
    copy.write_text(results.read_text())
    result = run("ablation.py", "--render", str(copy))
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / "cpu-small.md").read_text()
    assert "| amp | bf16 |" in table and "share of peak" in table
    assert (tmp_path / "cpu-small.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_benchmark_flags_fail_with_a_message():
    result = run("ablation.py", "--steps", "0")
    assert result.returncode == 2 and "--steps and --repeats must be at least 1" in result.stderr
