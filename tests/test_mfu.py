"""The MFU denominator: measured from the model's own units, cached per machine, never below what
the model reaches. (No timing is asserted: only which figures are used and how they relate.)"""

import json
import re
import time

import pytest
import torch

from minigpt.core.model import GPT, GPTConfig, flops_per_token
from minigpt.instruments import instrument as X
from minigpt.instruments import mfu as M
from minigpt.instruments.instrument import Interval, StageTimes

# The real probe, kept before the fixture below fakes a quiet machine
REAL_OTHERS, REAL_NOW = M.LoadProbe.others, M.LoadProbe.__dict__["now"]
SHAPE = dict(batch_size=2, seq_len=16, d_model=32, d_ff=128, vocab_size=128, n_heads=2)


@pytest.fixture(autouse=True)
def small_squares(monkeypatch, tmp_path):
    monkeypatch.setattr(M, "SQUARE_SIZES", (64,))  # the 2048^3 reference would take seconds per test
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path / "cache"))
    # A quiet machine unless a test says otherwise: this one may be shared (see the load tests below).
    monkeypatch.setattr(M.LoadProbe, "others", lambda self: 0.0)


def units():
    return M.model_workloads(**SHAPE)


def test_units_add_up_to_the_counted_flops():
    """The denominator's argument rests on this: flops_per_token is the sum of the units' FLOPs
    (every Linear with its bias, the tied head, attention) plus the LayerNorms' parameters."""
    cfg = GPTConfig(
        vocab_size=SHAPE["vocab_size"],
        max_position_embeddings=SHAPE["seq_len"],
        n_layers=3,
        n_heads=SHAPE["n_heads"],
        d_model=SHAPE["d_model"],
        d_ff=SHAPE["d_ff"],
    )
    model = GPT(cfg)
    tokens = SHAPE["batch_size"] * SHAPE["seq_len"]
    *block, head, attention = units()
    per_step = cfg.n_layers * (sum(u.flops for u in block) + attention.flops) + head.flops
    layer_norms = sum(p.numel() for n, p in model.named_parameters() if "ln_" in n)
    assert per_step + 6 * layer_norms * tokens == flops_per_token(model, SHAPE["seq_len"]) * tokens


def test_denominator_is_the_best_unit_and_the_cache_makes_it_hold_still(monkeypatch, tmp_path):
    first = M.peak_flops("cpu", "fp32", units())
    names = [s["name"] for s in first.shapes]
    assert names[0] == "matmul 64x64x64" and {u.name for u in units()} <= set(names)
    assert first.value == max(s["best"] for s in first.shapes) > 0
    assert first.spread[0] <= first.spread[1] == first.value
    assert first.source.startswith("measured now")

    def no_measuring(*a, **k):
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr(M, "measure", no_measuring)
    second = M.peak_flops("cpu", "fp32", units())
    assert second.value == first.value and second.spread == first.spread and second.source.startswith("cache")
    entries = json.loads((tmp_path / "cache" / X.PEAK_CACHE_FILE).read_text())
    assert list(entries) == [X.machine_key("cpu", "fp32")]
    assert f"{torch.get_num_threads()} threads" in list(entries)[0] and torch.__version__ in list(entries)[0]
    assert not list((tmp_path / "cache").glob(".*tmp"))  # written atomically: no leftovers
    with pytest.raises(AssertionError, match="measured again"):  # another dtype is another entry
        M.peak_flops("cpu", "bf16", units())


def test_new_units_are_measured_and_merged_into_the_cache(monkeypatch):
    M.peak_flops("cpu", "fp32", units())
    bigger = M.model_workloads(**{**SHAPE, "d_ff": 256})
    measured = []
    real = M.measure
    monkeypatch.setattr(M, "measure", lambda d, t, u: measured.append(u.name) or real(d, t, u))
    peak = M.peak_flops("cpu", "fp32", bigger)
    assert sorted(measured) == sorted({u.name for u in bigger} - {u.name for u in units()})
    assert "partly cached" in peak.source


def test_uncached_measurement_neither_reads_nor_writes(tmp_path):
    peak = M.peak_flops("cpu", "fp32", units(), cache=False)
    assert "not cached" in peak.source and not (tmp_path / "cache" / X.PEAK_CACHE_FILE).exists()


@pytest.mark.parametrize(
    "content",
    ["{not json", "", "0", '"x"', "[]", "[" * 100_000 + "]" * 100_000, " " * (M.CACHE_LIMIT + 1)],
    ids=["not json", "empty", "a number", "a string", "a list", "nested too deep", "too large"],
)
def test_unreadable_cache_is_measured_again(tmp_path, content):
    """A hand-edited cache is measured again and rewritten, never a traceback."""
    path = tmp_path / "cache" / X.PEAK_CACHE_FILE
    path.parent.mkdir(parents=True)
    path.write_text(content)
    peak = M.peak_flops("cpu", "fp32", units())
    assert peak.source.startswith("measured now")
    assert X.machine_key("cpu", "fp32") in json.loads(path.read_text())


def test_mfu_of_a_real_step_is_its_achieved_rate_over_the_units_peak():
    """A training step of the model, timed as the loop times it, against the denominator of its
    own units. (That it stays below 1 is a timing, checked on the main job, not here: on a shared
    machine the units can be measured in a slow moment, and CI saw 2.1 while another job ran.)"""
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=SHAPE["vocab_size"],
        max_position_embeddings=SHAPE["seq_len"],
        n_layers=2,
        n_heads=SHAPE["n_heads"],
        d_model=SHAPE["d_model"],
        d_ff=SHAPE["d_ff"],
    )
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, cfg.vocab_size, (SHAPE["batch_size"], SHAPE["seq_len"]))
    peak = M.peak_flops("cpu", "fp32", units())
    for _ in range(4):
        t0 = time.perf_counter()
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens_per_s = x.numel() / (time.perf_counter() - t0)
        achieved = X.achieved_tflops(flops_per_token(model, SHAPE["seq_len"]), tokens_per_s)
        assert X.mfu(flops_per_token(model, SHAPE["seq_len"]), tokens_per_s, peak) > 0
        assert X.mfu(flops_per_token(model, SHAPE["seq_len"]), tokens_per_s, peak.value) == pytest.approx(
            achieved * 1e12 / peak.value
        )


def test_override_and_gpu_table(monkeypatch):
    peak = M.peak_flops("cpu", "fp32", units(), override_tflops=2.5)
    assert peak.value == 2.5e12 and peak.source == "override: --peak-tflops" and peak.spread is None
    assert peak.config() == {
        "peak_flops": 2.5e12,
        "peak_flops_dtype": "fp32",
        "peak_flops_source": "override: --peak-tflops",
        "peak_flops_spread": None,
        "peak_flops_measured_at": None,
        "peak_flops_load": None,
        "peak_flops_under_load": None,
    }
    with pytest.raises(ValueError, match="positive"):
        M.peak_flops("cpu", "fp32", override_tflops=0)
    for name, gpu in (
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
    ):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, n=name: n)
        peak = M.peak_flops("cuda", "bf16", units())
        assert peak.value == M.PEAK_FLOPS[gpu]["bf16"] and peak.source == f"table: {gpu} bf16 dense"


def fake_figure(best: float, load: float = 0.5) -> dict:
    return {
        "best": best,
        "median": best / 2,
        "calls": 9,
        "date": "2026-01-01 00:00 UTC",
        "load": load,
        "cores": 2,
    }


def test_a_lower_figure_never_replaces_a_higher_one(monkeypatch, tmp_path):
    """Two processes measure at once; the one that writes last measured in a busier moment. The
    cache keeps each unit's best, and the run uses it: a figure taken under load replaces nothing."""
    path, key = tmp_path / "cache" / X.PEAK_CACHE_FILE, X.machine_key("cpu", "fp32")

    def measured_while_another_process_wrote(high: float, mine: float):
        def measure(device, dtype, unit):
            entries = M.read_cache(path)
            entries.setdefault(key, {})[unit.name] = {**fake_figure(high, load=0.1), "flops": unit.flops}
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(entries))
            return {**fake_figure(mine, load=7.5), "flops": unit.flops}

        return measure

    monkeypatch.setattr(M, "measure", measured_while_another_process_wrote(high=3e12, mine=1e12))
    peak = M.peak_flops("cpu", "fp32", units())
    assert peak.value == 3e12 and peak.load == 0.1  # the other process's better figure, and its load
    assert {r["best"] for r in json.loads(path.read_text())[key].values()} == {3e12}
    path.unlink()
    monkeypatch.setattr(M, "measure", measured_while_another_process_wrote(high=1e12, mine=2e12))
    peak = M.peak_flops("cpu", "fp32", units())  # now this process's figure is the better one
    assert peak.value == 2e12 and peak.load == 7.5
    assert {r["best"] for r in json.loads(path.read_text())[key].values()} == {2e12}


def test_entries_of_the_old_format_are_measured_again(tmp_path):
    """A figure cached before the time and load were recorded (first come, first kept) may have been
    taken under load: it is measured once more instead of being trusted."""
    path, key = tmp_path / "cache" / X.PEAK_CACHE_FILE, X.machine_key("cpu", "fp32")
    path.parent.mkdir(parents=True)
    old = {u.name: {"rounds": [1.0, 2.0], "flops": u.flops, "date": "2026-01-01 00:00 UTC"} for u in units()}
    path.write_text(json.dumps({key: old}))
    peak = M.peak_flops("cpu", "fp32", units())
    assert peak.source.startswith("measured now") and peak.value > 2.0
    assert all("best" in r for r in json.loads(path.read_text())[key].values())


def test_the_log_line_says_when_and_under_what_load(monkeypatch):
    monkeypatch.setattr(M.os, "getloadavg", lambda: (3.25, 2.0, 1.0))
    peak = M.peak_flops("cpu", "fp32", units())
    line = peak.describe()
    assert line.startswith(
        f"MFU peak {peak.value / 1e12:.3g} TFLOP/s (fp32, the device's fastest); measured now: "
    )
    assert f"measured {peak.measured_at} at load 3.25 on {M.os.cpu_count()} cores" in line
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", peak.measured_at)
    assert (
        peak.config()["peak_flops_load"] == 3.25
        and peak.config()["peak_flops_measured_at"] == peak.measured_at
    )
    assert "(best of " in line and " calls; median " in line


def test_a_call_is_timed_by_the_smaller_of_wall_clock_and_cpu_time(monkeypatch):
    """Descheduled (wall > CPU time): the CPU time counts, so a busy machine does not lower the
    figure. On two threads (CPU time > wall): the wall clock counts, so the CPU time of threads that
    ran side by side never raises it above the call's real rate."""
    unit = M.Workload("matmul", (8, 8, 8))
    script = [(0.01, 0.01), (0.2, 0.1), (0.1, 0.2), (0.5, 0.25)]  # (wall, cpu): warm-up, 3 timed calls
    walls = iter(v for w, _ in script for v in (0.0, w))  # each call reads its clocks before and after
    cpus = iter(v for _, c in script for v in (0.0, c))
    clock = type("Clock", (), {"perf_counter": lambda: next(walls), "process_time": lambda: next(cpus)})
    monkeypatch.setattr(M, "time", clock)
    monkeypatch.setattr(M, "MIN_CALLS", 3)
    got = M.measure("cpu", "fp32", unit, budget_s=0.15)  # past the budget after one call: 3 even so
    assert got["calls"] == 3
    assert got["best"] == pytest.approx(unit.flops / 0.1)  # both the descheduled call and the 2-thread one
    assert got["median"] == pytest.approx(unit.flops / 0.1)


def test_a_slow_tiny_unit_does_not_skip_the_square_products(monkeypatch):
    """A unit too slow to time (emulated bf16) is skipped, predicted from a timed unit near its size;
    a tiny model's units (overhead, and under load spin-waiting) predict nothing for a 1024^3
    product, which is the machine's reference: skipping it once made the denominator 4000x low."""
    monkeypatch.setattr(M, "SQUARE_SIZES", (1024, 2048))
    measured = []

    def slow(device, dtype, unit):  # 1 MFLOP/s: every prediction says minutes
        measured.append(unit.name)
        return {**fake_figure(1e6), "flops": unit.flops}

    monkeypatch.setattr(M, "measure", slow)
    peak = M.peak_flops("cpu", "bf16", units())
    assert "matmul 1024x1024x1024" in measured  # the nearest timed unit is 2600x smaller: timed
    assert "matmul 2048x2048x2048" not in measured  # predicted from the 1024^3 one, 8x smaller
    assert "skipped: matmul 2048x2048x2048" in peak.source


def test_a_figure_measured_under_load_is_used_once_said_and_measured_again(monkeypatch, tmp_path):
    """A busy first measurement (other processes on 90% of the cores) serves its run, says so, and is
    not the machine's figure: the next start measures again, and a quiet figure settles it."""
    monkeypatch.setattr(M.LoadProbe, "others", lambda self: 0.9)
    busy = M.peak_flops("cpu", "fp32", units())
    assert busy.others == 0.9 and busy.config()["peak_flops_under_load"] == 0.9
    assert "measured under load: other processes used 90% of the cores" in busy.describe()
    assert "--remeasure" in busy.describe()
    measured = []
    real = M.measure
    monkeypatch.setattr(M, "measure", lambda d, t, u: measured.append(u.name) or real(d, t, u))
    still_busy = M.peak_flops(
        "cpu", "fp32", units()
    )  # the next start, as busy: another figure would be no better
    assert measured == [] and still_busy.source.startswith("cache") and still_busy.others == 0.9
    monkeypatch.setattr(M.LoadProbe, "others", lambda self: 0.02)
    quiet = M.peak_flops("cpu", "fp32", units())
    assert sorted(measured) == sorted(s["name"] for s in busy.shapes)  # every unit, again
    assert quiet.others is None and "under load" not in quiet.describe()
    cached = json.loads((tmp_path / "cache" / X.PEAK_CACHE_FILE).read_text())[X.machine_key("cpu", "fp32")]
    assert all(M.settled(r) for r in cached.values())
    measured.clear()
    assert M.peak_flops("cpu", "fp32", units()).source.startswith("cache") and measured == []


def test_load_probe_counts_other_processes_not_this_one(monkeypatch):
    """The share comes from the machine's busy time less this process's: our own threads at work
    are no load; another process's are."""
    monkeypatch.setattr(M.LoadProbe, "others", REAL_OTHERS)
    cores = M.os.cpu_count()
    clocks = iter([(10.0, 1.0, 100.0), (11.0, 1.0 + cores, 100.0 + cores), (11.0, 1.5, 100.0 + cores)])
    monkeypatch.setattr(M.LoadProbe, "now", staticmethod(lambda: next(clocks)))
    probe = M.LoadProbe()
    assert probe.others() == 0.0  # the machine busy for 1 s on every core, all of it ours
    probe.start = (10.0, 1.0, 100.0)
    assert probe.others() == pytest.approx(1 - 0.5 / cores, abs=1e-3)  # ours 0.5 s, the rest others'
    monkeypatch.setattr(M.LoadProbe, "now", REAL_NOW)
    monkeypatch.setattr(M, "machine_busy_s", lambda: None)
    assert M.LoadProbe().others() is None  # no /proc/stat: unknown, not "quiet" nor "busy"


def test_an_achieved_rate_above_the_peak_corrects_it_once_and_in_the_cache(monkeypatch, tmp_path, caplog):
    """A run that reaches more than the denominator proves it low: one line says so, MFU is at most
    100%, and the next run's denominator starts from what was achieved."""
    peak = M.peak_flops("cpu", "fp32", units())
    low = peak.value
    fpt, tokens_per_s = 1e6, 3 * low / 1e6  # a run at 3x the measured peak
    assert X.mfu(fpt, tokens_per_s, peak) == pytest.approx(3.0)  # what the old code printed: 300%
    note = M.raise_peak(peak, fpt * tokens_per_s)
    assert note and "was below what this run achieved" in note and "measured under load" in note
    assert X.mfu(fpt, tokens_per_s, peak) == pytest.approx(1.0)
    assert M.raise_peak(peak, fpt * tokens_per_s) is None  # no higher: nothing to do
    assert (
        M.raise_peak(peak, 2 * fpt * tokens_per_s) is None and peak.value == 2 * fpt * tokens_per_s
    )  # said once
    assert X.mfu(fpt, 2 * tokens_per_s, peak) == pytest.approx(1.0)
    monkeypatch.setattr(M, "measure", lambda *a: pytest.fail("measured again despite the cache"))
    again = M.peak_flops("cpu", "fp32", units())
    assert again.value == pytest.approx(6 * low) and M.ACHIEVED in again.source
    override = M.peak_flops("cpu", "fp32", override_tflops=1e-6)
    assert M.raise_peak(override, 1e12) is None  # the user's figure is their word


def test_throughput_records_never_show_mfu_above_100(monkeypatch, caplog):
    peak = X.PeakFlops(1e6, "measured now: fake", device="cpu", dtype="fp32")
    monkeypatch.setattr(M, "keep_best", lambda *a: ({}, True))
    rate = X.Throughput(64, 1, 1000, peak, "fp32", 0, 10, None, X.RunTotals(64))
    stages = StageTimes()
    with caplog.at_level("WARNING", logger="minigpt"):
        first = rate.record(1, [1.0], 1e-3, None, Interval([0.01], stages))  # 6.4 MFLOP/s achieved
        second = rate.record(2, [1.0], 1e-3, None, Interval([0.02], stages))
    assert first.mfu == pytest.approx(1.0) and second.mfu == pytest.approx(0.5)
    assert [r.message.startswith("MFU peak 1e-06 TFLOP/s was below") for r in caplog.records] == [True]


def test_remeasure_forgets_the_machines_figures(monkeypatch, tmp_path):
    M.peak_flops("cpu", "fp32", units())
    M.raise_peak(X.PeakFlops(1e6, "cache: x", device="cpu", dtype="fp32"), 1e17)  # a wild achieved figure
    assert M.peak_flops("cpu", "fp32", units()).value == 1e17
    fresh = M.peak_flops("cpu", "fp32", units(), remeasure=True)
    assert fresh.value < 1e17 and fresh.source.startswith("measured now")


@pytest.mark.parametrize("best", ["fast", float("nan"), 1e-300, 1e30, -1.0, True, None])
def test_a_hand_edited_cache_is_measured_again_not_believed(tmp_path, best):
    """A peak cache edited by hand (a best of "fast", NaN, 1e-300...): the trainer's reader and the
    measuring side both refuse the entry and measure again; MFU never reads 100% of a tiny peak."""
    key = X.machine_key("cpu", "fp32")
    unit = {"best": best, "median": 1e12, "calls": 5, "date": "x", "load": 0.1, "cores": 2, "others": 0.0}
    entry = {name: dict(unit) for name in (*X.SQUARE_UNITS, X.ACHIEVED)}
    path = tmp_path / "cache" / X.PEAK_CACHE_FILE
    path.parent.mkdir()
    path.write_text(json.dumps({key: entry}))
    assert X.cached_peak(path, key) is None
    peak = X.device_peak(None, "cpu")  # fp32 or bf16, by this CPU: measured either way
    assert 1e6 < peak.value < 1e18 and peak.source.startswith("measured now")
    assert M.peak_flops("cpu", "fp32").value != best


@pytest.mark.parametrize(
    "features, rates, peak_dtype, asked",
    [
        ({"avx512_bf16": True, "amx": False}, {"bf16": 0.17, "fp32": 0.33}, "fp32", ["bf16", "fp32"]),
        ({"avx512_bf16": True, "amx": False}, {"bf16": 0.60, "fp32": 0.33}, "bf16", ["bf16", "fp32"]),
        ({"avx512_bf16": True, "amx": True}, {"bf16": 2.0, "fp32": 0.33}, "bf16", ["bf16"]),
        ({"avx512_bf16": False, "amx": False}, {"bf16": 0.1, "fp32": 0.33}, "fp32", ["fp32"]),
    ],
)
def test_a_cpu_with_avx512_bf16_alone_takes_the_faster_measured_peak(
    monkeypatch, features, rates, peak_dtype, asked
):
    """AVX512-BF16 without AMX promises no speed: an Intel Xeon ran bf16 matmuls at half its fp32
    rate (0.168 against 0.329 TFLOP/s), an AMD Zen 4 at nearly twice. There both peaks are read
    (measured once, then cached) and MFU divides by the faster, saying so when it is fp32; with AMX
    bf16 is the peak, and without bf16 fp32, each read alone."""
    from minigpt import config

    monkeypatch.setattr(config, "cpu_bf16_features", lambda: dict(features))
    read = []

    def measured(device, dtype, info=None):
        read.append(dtype)
        return X.PeakFlops(rates[dtype] * 1e12, f"cache: {dtype}", device=device, dtype=dtype)

    monkeypatch.setattr(X, "measured_peak", measured)
    peak = X.device_peak(None, "cpu")
    assert (peak.dtype, peak.value, read) == (peak_dtype, rates[peak_dtype] * 1e12, asked)
    slower = "bf16's is 52% of it here: --no-amp may train faster"
    assert (slower in peak.source) == (asked == ["bf16", "fp32"] and peak_dtype == "fp32"), peak.source
    assert (slower in peak.describe()) == (slower in peak.source)  # the log's peak line says it


def test_a_run_against_a_poisoned_cache_never_logs_mfu_above_100(tmp_path, monkeypatch):
    """The trainer end to end: a denominator far below what the run reaches (a busy first
    measurement) is said once, lifted, and no log line, metrics record or TensorBoard scalar
    shows MFU above 100%; the next run starts from the achieved rate."""
    from conftest import TINY

    import train_minimal

    monkeypatch.setattr(
        M, "peak_flops", lambda d, t, *a, **k: X.PeakFlops(1.0, "measured now: fake", device=d, dtype=t)
    )
    out = tmp_path / "run"
    flags = ["--num-steps", "6", "--log-interval", "2", "--no-report", "--no-checkpoint"]
    assert train_minimal.cli([*TINY, *flags, "--out-dir", str(out)]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(0 < r["mfu"] <= 1.0 for r in rows), [r["mfu"] for r in rows]
    log = (out / "train.log").read_text()
    assert log.count("was below what this run achieved") == 1
    shown = [float(x) for x in re.findall(r"mfu ([\d.]+)%", log)]
    assert len(shown) == 3 and max(shown) <= 100.0
    cached = json.loads((tmp_path / "cache" / X.PEAK_CACHE_FILE).read_text())
    assert any(M.ACHIEVED in units and units[M.ACHIEVED]["best"] > 1.0 for units in cached.values())
