"""MFU's denominator (minigpt/instruments/peak.py): --peak-tflops, else a known GPU's data sheet,
else one measured figure of square products per machine, dtype and torch version, cached; a figure
timed on a busy machine measured again; the cache read without blocking and written or warned once;
a run's achieved rate above its peak kept as the machine's figure (core/finish.py's keep_achieved).
No timing is asserted: only which figures are used and how they relate."""

import json
import os
import re
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY

import train_minimal
from minigpt.core.finish import keep_achieved
from minigpt.instruments import peak as P


@pytest.fixture(autouse=True)
def small_products(monkeypatch, tmp_path):
    monkeypatch.setattr(P, "SIZES", (64,))  # the 1024^3 and 2048^3 products would take a second each
    monkeypatch.setattr(P, "CALLS_S", 0.02)
    monkeypatch.setattr(P, "UNWRITABLE", set())  # "said once a process": once per test here
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path / "cache"))
    # A quiet machine unless a test says otherwise: this one may be shared.
    monkeypatch.setattr(P, "busy_share", lambda before, after: 0.0)


def cache_file(tmp_path):
    return tmp_path / "cache" / P.PEAK_CACHE_FILE


# ---------------------------------------------------------------------------- --peak-tflops, data sheets


def test_the_override_is_the_users_word():
    peak = P.device_peak(2.5, "cpu")
    assert peak.value == 2.5e12 and peak.source == "override: --peak-tflops"
    assert peak.config() == {
        "peak_flops": 2.5e12,
        "peak_flops_dtype": P.peak_dtypes("cpu")[0],
        "peak_flops_source": "override: --peak-tflops",
    }


@pytest.mark.parametrize(
    "name, bf16, sheet, index",
    [
        ("NVIDIA H100 80GB HBM3", True, "H100", 0),
        ("NVIDIA H100 PCIe", True, "H100 PCIe", 0),  # the longer name first: not the SXM part's figure
        ("NVIDIA H200", True, "H200", 0),
        ("NVIDIA H200 NVL", True, "H200 NVL", 0),
        ("NVIDIA L4", True, "L4", 0),
        ("NVIDIA L40S", True, "L40S", 0),
        ("NVIDIA A100-SXM4-80GB", True, "A100", 0),
        ("Tesla V100-SXM2-16GB", False, "V100", 0),  # no bf16: fp16's tensor cores
    ],
)
def test_a_known_gpu_reads_its_data_sheet(monkeypatch, name, bf16, sheet, index):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    monkeypatch.setattr(P, "measured", lambda *a: pytest.fail("measured a GPU with a data sheet"))
    peak = P.device_peak(None, "cuda")
    dtype = "bf16" if bf16 else "fp16"
    assert peak.value == P.DATA_SHEETS[sheet][index] * 1e12 and peak.dtype == dtype
    assert peak.source == f"data sheet: {name} {dtype} dense"
    assert P.data_sheet(name, "fp32") == P.DATA_SHEETS[sheet][2] * 1e12


def test_an_unknown_gpu_is_measured(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA Mystery 9000")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    asked = []
    monkeypatch.setattr(
        P, "measured", lambda device, dtype: asked.append((device, dtype)) or P.Peak(1e14, dtype, "x")
    )
    assert P.device_peak(None, "cuda").value == 1e14 and asked == [("cuda", "bf16")]


# ---------------------------------------------------------------------------- the measured figure


def test_one_measured_figure_per_machine_dtype_and_torch_then_the_cache(monkeypatch, tmp_path):
    first = P.measured("cpu", "fp32")
    assert first.value > 0 and first.source.startswith("measured now: matmul 64x64x64 in fp32, the best of ")
    real = P.measure
    monkeypatch.setattr(P, "measure", lambda *a: pytest.fail("measured again despite the cache"))
    second = P.measured("cpu", "fp32")
    assert second.value == first.value and second.source.startswith(f"cache [{cache_file(tmp_path)}]: ")
    (key,) = json.loads(cache_file(tmp_path).read_text())
    assert key == P.machine_key("cpu", "fp32")
    assert f"{torch.get_num_threads()} threads" in key and torch.__version__ in key and "| fp32 |" in key
    assert not list(cache_file(tmp_path).parent.glob(".*tmp"))  # written atomically: no leftovers
    monkeypatch.setattr(P, "measure", real)
    P.measured("cpu", "bf16")  # another dtype: another entry
    assert len(json.loads(cache_file(tmp_path).read_text())) == 2


def test_a_figure_timed_on_a_busy_machine_is_said_and_measured_again(monkeypatch, tmp_path):
    """Others took 90% of the cores: the figure serves its run, whose log says so, and the next
    start measures again; a quiet figure then settles it, read from the cache from then on."""
    monkeypatch.setattr(P, "busy_share", lambda before, after: 0.9)
    busy = P.measured("cpu", "fp32")
    assert busy.others == 0.9
    assert "\nMFU peak timed while others took 90% of the cores: it may be low" in busy.describe()
    calls = []
    real = P.measure
    monkeypatch.setattr(P, "measure", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(P, "busy_share", lambda before, after: 0.02)
    quiet = P.measured("cpu", "fp32")
    assert calls and quiet.source.startswith("measured now") and "it may be low" not in quiet.describe()
    calls.clear()
    again = P.measured("cpu", "fp32")
    assert calls == [] and again.source.startswith("cache") and again.others is None
    entry = json.loads(cache_file(tmp_path).read_text())[P.machine_key("cpu", "fp32")]
    assert entry["others"] == 0.02


def test_a_call_is_timed_by_the_smaller_of_wall_clock_and_cpu_time(monkeypatch):
    """Descheduled (wall > CPU time): the CPU time counts, so a busy machine does not lower the
    figure. On two threads (CPU time > wall): the wall clock counts, so the CPU time of threads
    that ran side by side never raises it above the call's real rate."""
    script = [(0.2, 0.1), (0.1, 0.2), (0.5, 0.25)]  # (wall, cpu) of each timed call
    walls = iter(v for w, _ in script for v in (0.0, w))  # each call reads its clocks before and after
    cpus = iter(v for _, c in script for v in (0.0, c))
    clock = SimpleNamespace(
        perf_counter=lambda: next(walls),
        process_time=lambda: next(cpus),
        strftime=time.strftime,
        gmtime=time.gmtime,
    )
    monkeypatch.setattr(P, "time", clock)
    monkeypatch.setattr(P, "CALLS_S", 0.15)  # past it after one call; then up to 5 calls within 4x it
    got = P.measure("cpu", "fp32", 8)
    assert got["calls"] == 3 and got["what"] == "matmul 8x8x8 in fp32"
    assert got["best"] == pytest.approx(2 * 8**3 / 0.1)  # the descheduled call and the 2-thread one
    assert got["others"] == 0.0 and re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", got["date"])


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
    """AVX512-BF16 without AMX promises no speed: an Intel Xeon ran bf16 products at half its fp32
    rate, an AMD Zen 4 at nearly twice. There both are measured and MFU divides by the faster,
    saying so when it is fp32; with AMX bf16 is the peak, and without bf16 fp32, each alone."""
    monkeypatch.setattr(P, "cpu_bf16_features", lambda: dict(features))
    read = []

    def measured(device, dtype):
        read.append(dtype)
        return P.Peak(rates[dtype] * 1e12, dtype, f"cache: {dtype}")

    monkeypatch.setattr(P, "measured", measured)
    peak = P.device_peak(None, "cpu")
    assert (peak.dtype, peak.value, read) == (peak_dtype, rates[peak_dtype] * 1e12, asked)
    slower = "bf16's is 52% of it: --no-amp may train faster"
    assert (slower in peak.source) == (asked == ["bf16", "fp32"] and peak_dtype == "fp32"), peak.source
    assert (slower in peak.describe()) == (slower in peak.source)  # the log's peak line says it


# ---------------------------------------------------------------------------- the cache file


@pytest.mark.parametrize(
    "content",
    ["{not json", "", "0", '"x"', "[]", "[" * 100_000 + "]" * 100_000, " " * (1 << 22) + "{}"],
    ids=["not json", "empty", "a number", "a string", "a list", "nested too deep", "too large"],
)
def test_an_unreadable_cache_is_measured_again_and_rewritten(tmp_path, content):
    path = cache_file(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    assert P.read_cache(path) == {}
    assert P.measured("cpu", "fp32").source.startswith("measured now")
    assert P.machine_key("cpu", "fp32") in json.loads(path.read_text())


@pytest.mark.parametrize("best", ["fast", float("nan"), 1e-300, 1e30, -1.0, True, None])
def test_a_hand_edited_figure_is_measured_again_not_believed(tmp_path, best):
    """A best of "fast", NaN, 1e-300...: never read as the denominator (MFU would read 100% of a
    tiny peak, or 0% of a huge one); measured again."""
    path, key = cache_file(tmp_path), P.machine_key("cpu", "fp32")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({key: dict(best=best, calls=5, date="x", what="y")}))
    assert key not in P.read_cache(path)
    peak = P.measured("cpu", "fp32")
    assert 1e6 < peak.value < 1e18 and peak.source.startswith("measured now")


def test_a_fifo_at_the_caches_path_is_refused_without_blocking(tmp_path):
    """A named pipe where the cache should be (nothing writes into it): opening it to read would
    wait for a writer for ever; it is opened without blocking, seen not to be a file, and measured."""
    path = cache_file(tmp_path)
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    got = []
    reader = threading.Thread(target=lambda: got.append(P.read_cache(path)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert got == [{}], "read_cache blocked on a FIFO"
    assert P.measured("cpu", "fp32").source.startswith("measured now")


def test_a_cache_that_cannot_be_written_is_warned_once_a_process(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(blocker / "cache"))  # its folder cannot be made
    first = P.measured("cpu", "fp32")
    second = P.measured("cpu", "fp32")  # nothing cached: measured again, not said again
    assert first.source.startswith("measured now") and second.source.startswith("measured now")
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and err[0].startswith("note: the MFU peak is not cached: ")
        and "cannot be written" in err[0]
    )


# ---------------------------------------------------------------------------- a run above its peak


def test_a_rate_achieved_above_the_measured_peak_becomes_the_machines_figure(tmp_path):
    """A run that reaches more than its measured denominator proves it low: the end of the run says
    so once and caches what was achieved, so the next run's MFU stays at or below 100%."""
    measured = P.measured("cpu", "fp32")
    assert keep_achieved("cpu", measured, 0.5 * measured.value) is None  # below: nothing to do
    line = keep_achieved("cpu", measured, 3 * measured.value)
    assert line.startswith("MFU passed 100%: the run achieved ") and str(cache_file(tmp_path)) in line
    again = P.measured("cpu", "fp32")
    assert again.value == pytest.approx(3 * measured.value) and "a run's rate" in again.source
    # the user's figure and a data sheet are their word: never replaced by a run's rate
    assert keep_achieved("cpu", P.device_peak(1e-6, "cpu"), 1e12) is None
    assert keep_achieved("cuda", P.Peak(1e12, "bf16", "data sheet: NVIDIA H100 bf16 dense"), 1e15) is None


def test_a_run_divides_by_the_peak_it_began_with_and_keeps_it_in_config_json(tmp_path):
    out = tmp_path / "run"
    flags = [
        "--num-steps",
        "4",
        "--log-interval",
        "2",
        "--no-report",
        "--no-checkpoint",
        "--peak-tflops",
        "0.5",
    ]
    assert train_minimal.cli([*TINY, *flags, "--out-dir", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["peak_flops"] == 0.5e12 and config["peak_flops_source"] == "override: --peak-tflops"
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["mfu"] == pytest.approx(config["flops_per_token"] * r["tokens_per_s_per_rank"] / 0.5e12)
    log = (out / "train.log").read_text()
    assert log.count("MFU peak 0.5 TFLOP/s") == 1 and "override: --peak-tflops" in log
