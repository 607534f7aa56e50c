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
    assert thr["run_mfu"]["ratio"] == pytest.approx(2.0) and thr["run_mfu"]["interval"] is None
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
    assert "B/A is B over A with its 95% interval" in text
    # A header of sentences a terminal holds: each line at most 160 characters, each sentence whole.
    header = text.splitlines()[2:6]
    assert all(len(x) <= 160 and x.endswith((".", ",")) for x in header) and "is (" not in text, header
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


def test_a_figure_a_record_lacks_is_na_never_rebuilt(pair):
    """MFU and the run's rates are read from the records as the trainer wrote them: where A's last
    record lacks one, its cell reads "n/a" and no ratio is given, though tokens/s and FLOPs are there."""
    a, b = pair
    rows = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    for key in ("run_mfu", "tokens_per_s_e2e"):
        del rows[-1][key]
    (a / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    d = compare_runs(a, b)
    thr = {r["metric"]: r for r in d["throughput"]}
    for key in ("run_mfu", "tokens_per_s_e2e"):
        assert thr[key]["a"] is None and thr[key]["ratio"] is None and thr[key]["b"] is not None
    line = next(x for x in format_compare(d).splitlines() if x.startswith("MFU % (run)"))
    assert line.split()[3] == "n/a"


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
    assert (iv["n_a"], iv["n_b"], iv["level"]) == (10, 10, 0.95) and iv["low"] < 2.0 < iv["high"]
    assert (
        1.9 < iv["low"]
        and iv["high"] < 2.1
        and tok["verdict"] == f"{iv['ratio']:.2f}x ({iv['low']:.2f}-{iv['high']:.2f})"
    )
    fwd = next(r for r in d["stages"] if r["stage"] == "forward")
    assert fwd["host_interval"]["high"] < 0.55 and fwd["host_verdict"].startswith("0.5")
    # The same speed, 30% noise per interval: the ratio and its interval beside the verdict that
    # says noise, in the text as in --json.
    same = noisy(make_run(tmp_path / "c", steps=STEPS, tokens_per_s=1000.0), 0.3, 3)
    d = compare_runs(base, same)
    tok = next(r for r in d["throughput"] if r["metric"] == "tokens_per_s")
    iv = tok["interval"]
    said = f"{iv['ratio']:.2f}x ({iv['low']:.2f}-{iv['high']:.2f}): no difference within noise"
    assert iv["low"] < 1.0 < iv["high"] and tok["verdict"] == iv["verdict"] == said
    row = next(x for x in format_compare(d).splitlines() if x.startswith("tokens/s per step"))
    assert row.endswith(said), row
    assert headline(d).startswith(f"tokens/s per step {said}")


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


# (1, 10, 20): the first record holds step 1 alone, the warm-up: no steady step, no sample
@pytest.mark.parametrize("steps, had", [((10,), 1), ((10, 20), 2), ((1, 10, 20), 2)])
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
    said, advice = need.split(": rerun")  # the advice on a line of its own: a terminal holds both
    assert f"no ratio claimed: {said}:\n  rerun{advice}\n" in text
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
    tokens = next(r for r in d["throughput"] if r["metric"] == "tokens_per_s")
    assert d["samples"]["shortfall"] is None and tokens["interval"]["n_a"] == 5
    page = html.read_text()
    assert "compare-stages" in page and "compare-operators" in page and "<script src" not in page
    assert "B/A (95% interval)" in page and "0.50x (0.50-0.50)" in page
    for bad in (tmp_path / "missing", tmp_path):
        assert main([str(a), str(bad)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ")


def test_html_on_a_full_disk_or_where_none_is_written_is_one_line(pair, tmp_path, monkeypatch, capsys):
    """A full disk is a fault (exit 1), a path that takes no file a mistake (exit 2): one line each."""
    a, b = pair
    html = tmp_path / "cmp.html"
    monkeypatch.setattr(
        "minigpt.fileio.os.fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space"))
    )
    assert main([str(a), str(b), "--html", str(html)]) == 1
    out, err = capsys.readouterr()
    (line,) = err.strip().splitlines()
    assert out == "" and str(html) in line and "no space left" in line and "(--html)" in line
    assert not html.exists()
    assert main([str(a), str(b), "--html", "/proc/cmp.html"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: cannot write /proc/cmp.html") and "(--html)" in line


def test_mfu_is_each_runs_own_and_different_peaks_are_named(tmp_path):
    """MFU is the trainer's, against each run's own peak (config.json): compare shows it as recorded,
    names each peak's dtype, and says when the two peaks differ."""
    runs = {}
    for name, tps, peak, dtype in (("fp32", 1000.0, 67e12, "fp32"), ("amp", 2000.0, 989e12, "bf16")):
        runs[name] = edit_config(
            make_run(tmp_path / name, steps=STEPS, tokens_per_s=tps), peak_flops=peak, peak_flops_dtype=dtype
        )
    d = compare_runs(runs["fp32"], runs["amp"])
    thr = {r["metric"]: r for r in d["throughput"]}
    recorded = json.loads((runs["fp32"] / "metrics.jsonl").read_text().splitlines()[-1])
    assert thr["run_mfu"]["a"] == recorded["run_mfu"]  # as recorded: not rescaled to 67 TFLOP/s
    assert thr["peak_tflops"]["verdict"] == "14.76x (fp32 vs bf16)"
    assert "A and B measured MFU against different peaks: their MFU is not like for like" in d["notes"]
    same = compare_runs(runs["amp"], runs["amp"])
    assert not any("different peaks" in n for n in same["notes"])
    assert "1.00x (bf16 vs bf16)" in format_compare(same)


def test_a_busy_run_is_said_in_one_line_and_gives_no_verdict(tmp_path):
    """Other processes took 60% of the cores in every steady step of B: its timings measure them
    too. The comparison says so in one line, and claims no ratio; a quiet pair claims them."""
    a = make_run(tmp_path / "a", steps=TEN, tokens_per_s=1000.0)
    b = make_run(tmp_path / "b", steps=TEN, tokens_per_s=2000.0, stage_scale=0.5, busy=0.6)
    d = compare_runs(a, b)
    line = (
        "run B ran busy (others took 60% of the cores in 100% of its steady steps): re-run on a quiet machine"
    )
    assert d["busy"] == [line] and headline(d).startswith(line)
    assert "2.00x" not in headline(d) and line in format_compare(d).splitlines()
    timings = [*d["stages"], *(r for r in d["throughput"] if r["metric"] != "peak_tflops")]
    verdicts = [v for r in timings for k, v in r.items() if k.endswith("verdict")]
    assert verdicts and not any(re.search(r"\d\.\d\dx \(|within noise", v) for v in verdicts)
    assert all(r.get("interval") is None for r in d["throughput"])
    quiet = compare_runs(a, make_run(tmp_path / "c", steps=TEN, tokens_per_s=2000.0, busy=0.2))
    assert quiet["busy"] == [] and headline(quiet).startswith("tokens/s per step 2.00x")
