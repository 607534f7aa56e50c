"""python -m minigpt.compare: stage ratios, throughput, memory, operators and kernels matched by
name (new, gone, changed), losses at common steps; mismatched inputs flagged or refused."""

from __future__ import annotations

import json

import pytest
from test_report import KERNEL, gpu_trace_events, make_run

from minigpt.compare import compare_runs, format_compare, headline, main

MIB = 1024 * 1024


def breakdown(activations_mib: float) -> dict:
    act = int(activations_mib * MIB)
    return {
        "step": 5,
        "device": "cuda",
        "params": 4 * MIB,
        "grads": 4 * MIB,
        "optimizer": 8 * MIB,
        "activations": act,
        "activations_peak": act,
        "total": 16 * MIB + act,
        "peak": 16 * MIB + 3 * act,  # the allocator's measured peak: the sum plus temporaries
    }


@pytest.fixture
def pair(tmp_path):
    """A: fp32-like (slower, more activation memory); B: AMP-like, twice as fast, its matmul kernel
    swapped for another, an operator gone and one new."""
    a = make_run(
        tmp_path / "fp32",
        tokens_per_s=1000.0,
        breakdown=breakdown(10),
        trace=gpu_trace_events(
            kernel="ampere_sgemm_128x64_nn", op_ms={"aten::mm": 8.0, "aten::add": 1.0, "aten::gelu": 1.0}
        ),
    )
    b = make_run(
        tmp_path / "amp",
        tokens_per_s=2000.0,
        stage_scale=0.5,
        breakdown=breakdown(6),
        amp="bf16",
        losses=[4.0, 3.6, 3.2],
        trace=gpu_trace_events(op_ms={"aten::mm": 4.0, "aten::add": 1.02, "aten::to": 0.5}),
    )
    return a, b


def test_stages_throughput_and_memory_are_b_over_a(pair):
    d = compare_runs(*pair)
    fwd = next(r for r in d["stages"] if r["stage"] == "forward")
    assert fwd["host_ms"] == [10.0, 5.0] and fwd["host_ratio"] == pytest.approx(0.5)
    assert fwd["device_ratio"] == pytest.approx(0.5)
    thr = {r["metric"]: r for r in d["throughput"]}
    assert thr["tokens_per_s"]["ratio"] == pytest.approx(2.0) and thr["mfu"]["ratio"] == pytest.approx(2.0)
    # Not recorded by either run (older trainers): shown as missing, never rebuilt from other keys.
    assert thr["tokens_per_s_e2e"]["a"] is None and thr["tokens_per_s_e2e"]["ratio"] is None
    mem = {r["category"]: r for r in d["memory"]}
    assert mem["activations"]["ratio"] == pytest.approx(0.6)
    assert mem["peak_allocated_bytes"]["a"] == pytest.approx(1024**3)
    assert d["config_diff"]["amp"] == ["fp32 (default)", "bf16 (default)"]


def test_operators_and_kernels_matched_by_name(pair):
    d = compare_runs(*pair)
    ops = {r["name"]: r for r in d["operators"]}
    assert ops["aten::mm"]["status"] == "changed" and ops["aten::mm"]["delta_ms"] == pytest.approx(-4.0)
    assert ops["aten::add"]["status"] == "same"  # 2% apart: within a run's own noise
    assert ops["aten::gelu"]["status"] == "gone" and ops["aten::gelu"]["b_ms"] is None
    assert ops["aten::to"]["status"] == "new" and ops["aten::to"]["a_ms"] is None
    ks = {r["name"]: r for r in d["kernels"]}
    assert ks[KERNEL]["status"] == "new" and ks["ampere_sgemm_128x64_nn"]["status"] == "gone"
    # Per profiled step (the trace has two): the kernel runs half of each of three stages' time.
    assert ks["ampere_sgemm_128x64_nn"]["a_ms"] == pytest.approx(0.25 + 5 + 10)


def test_losses_at_common_steps(pair, tmp_path):
    d = compare_runs(*pair)
    assert [r["step"] for r in d["losses"]] == [10, 20, 30]
    assert d["losses"][1]["delta"] == pytest.approx(3.6 - 3.5)
    other = make_run(tmp_path / "other", steps=(5, 15))
    d = compare_runs(pair[0], other)
    assert d["losses"] == [] and any("no common logged steps" in n for n in d["notes"])


def test_text_output(pair):
    text = format_compare(compare_runs(*pair))
    assert "ratios are B / A" in text
    assert "tokens/s per step, median interval" in text and "2.00x" in text
    assert "forward" in text and "aten::mm" in text and "new" in text and "gone" in text
    assert "losses at the steps both runs logged" in text
    line = headline(compare_runs(*pair))
    assert line.startswith(
        "tokens/s (median interval) 2.00x; stages backward 0.50x, forward 0.50x; operators aten::mm -4.0 ms"
    )
    # the measured peak, not the sum of parts: (16 + 18) / (16 + 30) MiB = 0.739 (the sum: 0.846)
    assert line.endswith("peak memory 0.74x")


def test_shapes_differ_flagged_and_traceless_runs_compare(tmp_path):
    a = make_run(tmp_path / "a", d_model=64)
    b = make_run(tmp_path / "b", d_model=128)
    d = compare_runs(a, b)
    assert any("model shapes differ" in n and "d_model 64 vs 128" in n for n in d["notes"])
    assert d["operators"] == [] and any("no trace in A and B" in n for n in d["notes"])
    assert d["stages"] and d["losses"]


def test_cli_json_html_and_refusals(pair, tmp_path, capsys):
    a, b = pair
    html = tmp_path / "cmp.html"
    assert main([str(a), str(b), "--json", "--html", str(html)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["a"]["path"] == str(a) and d["operators"]
    page = html.read_text()
    assert "compare-stages" in page and "compare-operators" in page and "<script src" not in page
    for bad in (tmp_path / "missing", tmp_path):
        assert main([str(a), str(bad)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ")
