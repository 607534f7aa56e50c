"""python -m minigpt compare: stage ratios, throughput, memory, operators and kernels matched by
name (new, gone, changed), losses at common steps; each timing ratio with its 95% interval, none
claimed from too few logged intervals; runs of different models or machines refused."""

from __future__ import annotations

import errno
import json
import math
import random
import re

import pytest
from test_report import KERNEL, gpu_trace_events, make_run

from minigpt.analysis.compare import TOO_FEW, compare_runs, format_compare, headline, main
from minigpt.analysis.runfiles import RunError

MIB = 1024 * 1024
STEPS = (10, 20, 30, 40, 50)  # four logged intervals after the first: enough for an interval
TEN = tuple(range(10, 101, 10))


def noisy(folder, sd: float, seed: int):
    """Scale each logged interval's timings by its own random factor (log-normal, `sd`), as a
    loaded machine does: tokens/s down where the step time and the stages go up."""
    rng = random.Random(seed)
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        f = math.exp(rng.gauss(0, sd))
        r["step_time_s"] *= f
        for k in ("tokens_per_s", "tokens_per_s_per_rank", "mfu"):
            r[k] /= f
        for k in ("stage_host_ms", "stage_device_ms"):
            r[k] = {s: v * f for s, v in r[k].items()}
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


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
        steps=STEPS,
        tokens_per_s=1000.0,
        breakdown=breakdown(10),
        trace=gpu_trace_events(
            kernel="ampere_sgemm_128x64_nn", op_ms={"aten::mm": 8.0, "aten::add": 1.0, "aten::gelu": 1.0}
        ),
    )
    b = make_run(
        tmp_path / "amp",
        steps=STEPS,
        tokens_per_s=2000.0,
        stage_scale=0.5,
        breakdown=breakdown(6),
        amp="bf16",
        losses=[4.0, 3.6, 3.2, 2.8, 2.4],
        trace=gpu_trace_events(op_ms={"aten::mm": 4.0, "aten::add": 1.02, "aten::to": 0.5}),
    )
    return a, b


def test_stages_throughput_and_memory_are_b_over_a(pair):
    d = compare_runs(*pair)
    fwd = next(r for r in d["stages"] if r["stage"] == "forward")
    assert fwd["host_ms"] == pytest.approx([10.0, 5.0]) and fwd["host_ratio"] == pytest.approx(0.5)
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
    assert [r["step"] for r in d["losses"]] == list(STEPS)
    assert d["losses"][1]["delta"] == pytest.approx(3.6 - 3.5)
    other = make_run(tmp_path / "other", steps=(5, 15))
    d = compare_runs(pair[0], other)
    assert d["losses"] == [] and any("no common logged steps" in n for n in d["notes"])


def test_text_output(pair):
    text = format_compare(compare_runs(*pair))
    assert "ratios are B / A with their 95% interval" in text
    # Every interval the same: the interval is the ratio itself.
    assert "tokens/s per step, intervals" in text and "2.00x (2.00-2.00)" in text
    assert "forward" in text and "aten::mm" in text and "new" in text and "gone" in text
    assert "losses at the steps both runs logged" in text
    line = headline(compare_runs(*pair))
    assert line.startswith(
        "tokens/s per step 2.00x (2.00-2.00); stages backward 0.50x (0.50-0.50), forward 0.50x (0.50-0.50); "
        "operators aten::mm -4.0 ms"
    )
    # the measured peak, not the sum of parts: (16 + 18) / (16 + 30) MiB = 0.739 (the sum: 0.846)
    assert line.endswith("peak memory 0.74x")


def test_the_ratio_is_the_printed_b_over_the_printed_a(tmp_path):
    """One definition for a row's three figures: with noise that moves the geometric mean and the
    median apart (a skewed stage), B/A is still the B beside it over the A beside it."""
    a = noisy(make_run(tmp_path / "a", steps=TEN, tokens_per_s=1000.0), 0.5, 4)
    b = noisy(make_run(tmp_path / "b", steps=TEN, tokens_per_s=500.0, stage_scale=2.0), 0.5, 5)
    d = compare_runs(a, b)
    rows = [(r["host_ms"], r["host_ratio"]) for r in d["stages"] if r.get("host_interval")]
    rows += [((r["a"], r["b"]), r["ratio"]) for r in d["throughput"] if r.get("interval")]
    assert len(rows) >= 5
    for (fa, fb), r in rows:
        assert r == pytest.approx(fb / fa)
    text = format_compare(d)
    step = next(r for r in d["throughput"] if r["metric"] == "step_time_s")
    line = next(x for x in text.splitlines() if x.startswith("step time ms"))
    assert f"{1000 * step['a']:,.1f}" in line and f"{1000 * step['b']:,.1f}" in line


def test_an_mfu_above_100_percent_is_never_shown(tmp_path):
    """An older run whose denominator was measured under load logged MFU above 100%: compare names
    the cause instead of printing it, or a ratio of it."""
    a = make_run(tmp_path / "a", steps=TEN, tokens_per_s=1000.0)
    b = make_run(tmp_path / "b", steps=TEN, tokens_per_s=2e9)  # mfu 1.46 against the H100's table
    d = compare_runs(a, b)
    mfu_row = next(r for r in d["throughput"] if r["metric"] == "mfu")
    assert mfu_row["a"] is None and mfu_row["b"] is None and mfu_row["ratio"] is None
    line = next(x for x in format_compare(d).splitlines() if x.startswith("MFU %"))
    assert "above 100%" in line and not re.search(r"\d{3}\.\d", line)


def test_traceless_runs_compare(tmp_path):
    d = compare_runs(make_run(tmp_path / "a", steps=STEPS), make_run(tmp_path / "b", steps=STEPS))
    assert d["operators"] == [] and any("no trace in A and B" in n for n in d["notes"])
    assert d["stages"] and d["losses"]


def test_a_real_speed_up_has_its_interval_and_noise_says_so(tmp_path):
    base = noisy(make_run(tmp_path / "a", steps=TEN, tokens_per_s=1000.0), 0.03, 1)
    fast = noisy(make_run(tmp_path / "b", steps=TEN, tokens_per_s=2000.0, stage_scale=0.5), 0.03, 2)
    d = compare_runs(base, fast)
    tok = next(r for r in d["throughput"] if r["metric"] == "tokens_per_s")
    iv = tok["interval"]
    assert (iv["n_a"], iv["n_b"], iv["level"]) == (9, 9, 0.95) and iv["low"] < 2.0 < iv["high"]
    assert (
        1.9 < iv["low"]
        and iv["high"] < 2.1
        and tok["verdict"] == f"{iv['ratio']:.2f}x ({iv['low']:.2f}-{iv['high']:.2f})"
    )
    fwd = next(r for r in d["stages"] if r["stage"] == "forward")
    assert fwd["host_interval"]["high"] < 0.55 and fwd["host_verdict"].startswith("0.5")
    # The same speed, 30% noise per interval: no percentage, the verdict says noise.
    same = noisy(make_run(tmp_path / "c", steps=STEPS, tokens_per_s=1000.0), 0.3, 3)
    d = compare_runs(base, same)
    text = format_compare(d)
    row = next(x for x in text.splitlines() if x.startswith("tokens/s per step"))
    assert row.endswith("no difference within noise") and "x (" not in row
    assert headline(d).startswith("tokens/s per step: no difference within noise")


def test_run_wide_figures_are_one_per_run_and_claim_no_ratio(tmp_path):
    a, b = make_run(tmp_path / "a", steps=STEPS), make_run(tmp_path / "b", steps=STEPS)
    for folder, rate in ((a, 1000.0), (b, 1360.0)):
        rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        rows[-1].update(
            run_tokens_per_s=rate, run_steps=50
        )  # as a trainer that keeps warm-up apart writes it
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    d = compare_runs(a, b)
    row = next(r for r in d["throughput"] if r["metric"] == "run_tokens_per_s")
    assert row["ratio"] == pytest.approx(1.36) and row["interval"] is None
    line = next(x for x in format_compare(d).splitlines() if x.startswith("tokens/s in steady state"))
    assert line.endswith("one figure per run: no interval") and "1.36x" not in line
    assert "1.36x" not in headline(d)


@pytest.mark.parametrize("steps, had", [((10,), 0), ((10, 20), 1), ((10, 20, 30), 2)])
def test_too_few_intervals_claim_no_ratio_and_say_what_is_needed(tmp_path, steps, had):
    a = make_run(tmp_path / "a", steps=steps, tokens_per_s=1000.0)
    b = make_run(tmp_path / "b", steps=steps, tokens_per_s=1360.0)  # "checkpointing gives 1.36x"
    d = compare_runs(a, b)
    need = (
        f"A has {had} logged interval{'' if had == 1 else 's'} of steady steps (warm-up left out), B {had}; "
        "an interval needs at least 3 per run: "
        "rerun with --num-steps 40 or more at --log-interval 10, or a smaller --log-interval"
    )
    assert d["samples"] == {"a": had, "b": had, "needed": 3, "shortfall": need}
    text = format_compare(d)
    assert f"no ratio claimed: {need}" in text.splitlines()
    assert "1.36x" not in text and "1.36x" not in headline(d)
    assert headline(d) == need
    tok = next(r for r in d["throughput"] if r["metric"] == "tokens_per_s")
    assert tok["interval"] is None and tok["verdict"] == TOO_FEW
    assert all(r["host_verdict"] == TOO_FEW for r in d["stages"])


def edit_config(folder, **changes):
    c = json.loads((folder / "config.json").read_text())
    for path, value in changes.items():
        *parents, key = path.split("__")
        node = c
        for p in parents:
            node = node[p]
        node[key] = value
    (folder / "config.json").write_text(json.dumps(c))
    return folder


@pytest.mark.parametrize(
    "change, says",
    [
        ({"model__d_model": 128}, "A and B are different models (d_model 64 vs 128)"),
        ({"model__vocab_size": 50304}, "A and B are different models (vocab_size 64 vs 50304)"),
        (
            {"device_name": "NVIDIA A100-SXM4-40GB"},
            "different machines (device_name NVIDIA H100 80GB HBM3 vs NVIDIA A100",
        ),
        ({"versions__torch": "2.12.0"}, "A and B are different machines (torch 2.13.0 vs 2.12.0)"),
        (
            {"device": "cpu", "model__n_layers": 4},
            "different models and different machines (n_layers 2 vs 4, device cuda vs cpu)",
        ),
    ],
)
def test_different_models_or_machines_refused_unless_allowed(tmp_path, capsys, change, says):
    a = make_run(tmp_path / "a", steps=STEPS)
    b = edit_config(make_run(tmp_path / "b", steps=STEPS), **change)
    html = tmp_path / "cmp.html"
    assert main([str(a), str(b), "--html", str(html)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and not html.exists()
    assert len(err.strip().splitlines()) == 1 and says in err and "--allow-different" in err
    with pytest.raises(RunError, match="not like for like"):
        compare_runs(a, b)
    assert main([str(a), str(b), "--allow-different", "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert "compared anyway (--allow-different)" in out and says in out
    assert "compared anyway (--allow-different)" in html.read_text()


def test_cli_json_html_and_refusals(pair, tmp_path, capsys):
    a, b = pair
    html = tmp_path / "cmp.html"
    assert main([str(a), str(b), "--json", "--html", str(html)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["a"]["path"] == str(a) and d["operators"]
    assert d["samples"]["shortfall"] is None and d["throughput"][3]["interval"]["n_a"] == 4
    page = html.read_text()
    assert "compare-stages" in page and "compare-operators" in page and "<script src" not in page
    assert "B/A (95% interval)" in page and "0.50x (0.50-0.50)" in page
    for bad in (tmp_path / "missing", tmp_path):
        assert main([str(a), str(bad)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ")


def test_html_on_a_full_disk_is_one_line_and_exit_2(pair, tmp_path, monkeypatch, capsys):
    a, b = pair
    html = tmp_path / "cmp.html"
    monkeypatch.setattr(
        "minigpt.fileio.os.fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space"))
    )
    assert main([str(a), str(b), "--html", str(html)]) == 2
    out, err = capsys.readouterr()
    (line,) = err.strip().splitlines()
    assert out == "" and str(html) in line and "no space left" in line and "(--html)" in line
    assert not html.exists()
    assert main([str(a), str(b), "--html", "/proc/cmp.html"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: cannot write /proc/cmp.html") and "(--html)" in line


def test_mfu_of_two_dtypes_is_against_one_denominator(tmp_path):
    """An fp32 run measured against the fp32 peak beside an AMP run against bf16's: compare puts
    both on the device's bf16 peak (the larger recorded), so MFU ranks them as tokens/s does, and
    says which peak; two fp32 runs stay against the fp32 peak, and say so."""
    runs = {}
    for name, tps, peak, dtype in (("fp32", 1000.0, 67e12, "fp32"), ("amp", 2000.0, 989e12, "bf16")):
        runs[name] = make_run(tmp_path / name, steps=STEPS, tokens_per_s=tps)
        cfg = json.loads((runs[name] / "config.json").read_text())
        cfg |= {"peak_flops": peak, "peak_flops_source": f"table: H100 {dtype} dense"}
        (runs[name] / "config.json").write_text(json.dumps(cfg))
        rows = [json.loads(x) for x in (runs[name] / "metrics.jsonl").read_text().splitlines()]
        for r in rows:
            r["mfu"] = r["tokens_per_s"] * 1e9 / peak  # the trainer's: achieved over its own peak
        (runs[name] / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    d = compare_runs(runs["fp32"], runs["amp"], allow_different=True)
    thr = {r["metric"]: r for r in d["throughput"]}
    assert thr["mfu"]["a"] == pytest.approx(1000.0 * 1e9 / 989e12, rel=1e-6)
    assert thr["mfu"]["ratio"] == pytest.approx(thr["tokens_per_s"]["ratio"], rel=1e-6)
    assert thr["peak_tflops"]["a"] == thr["peak_tflops"]["b"] == pytest.approx(989.0)
    text = format_compare(d)
    assert "MFU % against the bf16 peak" in text and "one per device: the bf16 peak" in text
    same = compare_runs(runs["fp32"], runs["fp32"])
    assert "MFU % against the fp32 peak" in format_compare(same)


def test_the_peaks_dtype_is_config_jsons_own_key_where_the_run_wrote_it(tmp_path):
    """A run of this trainer names its denominator's dtype (peak_flops_dtype): a source that names
    none ("cache: matmul 2048x2048x2048, ...") still says which peak MFU is against."""
    run = make_run(tmp_path / "r", steps=STEPS)
    cfg = json.loads((run / "config.json").read_text())
    cfg |= {
        "peak_flops": 2e11,
        "peak_flops_dtype": "bf16",
        "peak_flops_source": "cache: matmul 2048x2048x2048",
    }
    (run / "config.json").write_text(json.dumps(cfg))
    assert "MFU % against the bf16 peak" in format_compare(compare_runs(run, run))
