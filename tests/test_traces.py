"""python -m minigpt traces: stage times per profiled step, projected on the device by correlation
id from any thread, time waiting on collectives, top kernels with a tensor-core verdict, top host
operators, clean errors; on minigpt's own traces, on torch-tb-profiler's sample traces, and on
hand-made traces for each rule (old and new category names, any accelerator, no ProfilerStep,
malformed events), checked against counts made here by other methods."""

import gzip
import io
import json
import os
import random
import re
from collections import defaultdict
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT, TINY, exit_status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import train_minimal
from minigpt.analysis import traces as traces_mod
from minigpt.analysis.traces import Launches, tensor_cores, union_us
from minigpt.config import STAGE_NAMES

# Real traces written by other projects (torch-tb-profiler's samples, from pytorch/kineto's
# tb_plugin): the folder in MINIGPT_SAMPLE_TRACES, else a `traces` folder beside the clone (where
# the project's CI keeps them). A clone without them skips these tests, saying what they need.
SAMPLE_TRACES_ENV = "MINIGPT_SAMPLE_TRACES"
SHARED_TRACES = Path(
    os.environ.get(SAMPLE_TRACES_ENV, Path(__file__).resolve().parents[1].parent / "shared" / "traces")
)
RESNET = SHARED_TRACES / "tb_plugin_resnet50_worker0.1623143089861.pt.trace.json.gz"
GPU_METRICS = SHARED_TRACES / "tb_plugin_gpu_metrics_input.json"
needs_shared = pytest.mark.skipif(
    not RESNET.exists() or not GPU_METRICS.exists(),
    reason=f"needs torch-tb-profiler's sample traces ({RESNET.name}, {GPU_METRICS.name}, from "
    f"pytorch/kineto's tb_plugin): set {SAMPLE_TRACES_ENV} to the folder that holds them",
)

STAGES = ["data_to_device", "forward", "backward", "optimizer_step"]


def traces(*args: str) -> SimpleNamespace:
    """The tool's main() with the arguments a user types, in this process: its status (sys.exit's
    and argparse's included) and what it printed. The walkthrough runs it as a process."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        status = exit_status(lambda: traces_mod.main([str(a) for a in args]))
    return SimpleNamespace(returncode=status, stdout=out.getvalue(), stderr=err.getvalue())


def ok(*args: str) -> str:
    r = traces(*args)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return r.stdout


def fails(*args: str) -> str:
    """The single stderr line of a refused input, after checking exit status 2."""
    r = traces(*args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    # a bad flag is argparse's line, named by the tool (config.ArgParser); a bad input the tool's own
    assert re.match(r"(python -m minigpt traces: )?error: ", lines[0]) and r.stdout == ""
    return lines[0]


# ---------------------------------------------------------------------------- a real CPU trace


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One profiled training run on the CPU: steps 3 and 4 are recorded (Megatron's semantics)."""
    out = tmp_path_factory.mktemp("traces") / "run"
    assert (
        train_minimal.cli(
            [
                *TINY,
                "--num-steps",
                "6",
                "--use-profiler",
                "--profile-step-start",
                "3",
                "--profile-step-end",
                "5",
                "--out-dir",
                str(out),
            ]
        )
        == 0
    )
    files = sorted((out / "traces").glob("*.pt.trace.json.gz"))
    assert len(files) == 1
    return out, files[0]


def test_cpu_trace_has_the_profiled_steps_and_their_stages(cpu_run):
    _, trace = cpu_run
    s = json.loads(ok(trace, "--json"))
    assert s["cpu_only"] is True and s["kernels"] == []
    assert [r["step"] for r in s["steps"]] == [3, 4]
    for row in s["steps"]:
        assert list(row["stages"]) == STAGES
        assert row["host_ms"] > 0
        for name, stage in row["stages"].items():
            assert 0 < stage["host_ms"] <= row["host_ms"], (row["step"], name)
            assert "device_busy_ms" not in stage  # no device time is invented on a CPU run
            assert stage["comm_device_ms"] == 0.0 and stage["comm_host_ms"] == 0.0  # one rank: no collectives
        assert sum(st["host_ms"] for st in row["stages"].values()) <= row["host_ms"]
    total = s["totals"]
    assert total["steps"] == 2
    assert total["host_ms"] == pytest.approx(sum(r["host_ms"] for r in s["steps"]))
    assert total["stages"]["backward"]["host_ms"] == pytest.approx(
        sum(r["stages"]["backward"]["host_ms"] for r in s["steps"])
    )
    # The host operators are real aten ops, and self time never exceeds total time.
    by_self = s["operators"]["by_self"]
    assert by_self and any(op["name"].startswith("aten::") for op in by_self)
    assert all(0 <= op["self_ms"] <= op["total_ms"] + 1e-6 for op in by_self)
    assert by_self == sorted(by_self, key=lambda op: op["self_ms"], reverse=True)


def test_cpu_trace_text_report(cpu_run):
    _, trace = cpu_run
    text = ok(trace, "--top", "3")
    assert "no device events in this trace (CPU only)" in text
    assert "profiled step(s): 3, 4" in text
    table = [line.split() for line in text.split("\n\n")[1].splitlines()]
    for name in STAGES:
        assert sum(name in cells for cells in table) == 3  # steps 3, 4 and the total
    assert [cells[0] for cells in table if cells[0] in ("3", "4", "total")] == ["3", "4", "total"]
    assert "top 3 host operators by self time" in text and "top 3 host operators by total time" in text


def test_directory_input_gives_one_summary_per_file(cpu_run, tmp_path):
    out, trace = cpu_run
    # The run folder itself (the tool looks in its traces/), and a folder holding two files.
    assert json.loads(ok(out, "--json"))["traces"][0]["file"] == str(trace)
    folder = tmp_path / "two"
    folder.mkdir()
    for name in ("rank0_dp0.1.pt.trace.json.gz", "rank1_dp1.2.pt.trace.json.gz"):
        (folder / name).write_bytes(trace.read_bytes())
    (folder / "notes.txt").write_text("not a trace")  # ignored: not *.json(.gz)
    summaries = json.loads(ok(folder, "--json"))["traces"]
    assert [os.path.basename(s["file"]) for s in summaries] == [
        "rank0_dp0.1.pt.trace.json.gz",
        "rank1_dp1.2.pt.trace.json.gz",
    ]
    assert ok(folder).count("profiled step(s): 3, 4") == 2


# ---------------------------------------------------------------------------- a synthetic GPU trace

PID, MAIN, AUTOGRAD = 100, 1, 2  # the process, its main thread, autograd's device thread


def gpu_step(step: int, t0: float, corr0: int) -> list[dict]:
    """One GPU-style profiled step, in microseconds from t0:
    forward [10, 310] launches an fp32 sgemm from the main thread;
    backward [400, 900] is opened on the main thread, but its three kernels are launched from
    autograd's thread (as on a real GPU); two of them overlap on two streams;
    after the stages, a device-to-host copy is launched (counted in the step only)."""

    def rng(name, ts, dur, cat="user_annotation", tid=MAIN, pid=PID):
        return {
            "ph": "X",
            "cat": cat,
            "name": name,
            "pid": pid,
            "tid": tid,
            "ts": t0 + ts,
            "dur": dur,
            "args": {},
        }

    def launch(ts, corr, tid, name="cudaLaunchKernel"):
        return {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": name,
            "pid": PID,
            "tid": tid,
            "ts": t0 + ts,
            "dur": 5,
            "args": {"correlation": corr0 + corr},
        }

    def kernel(name, ts, dur, corr, stream=7, cat="kernel"):
        return {
            "ph": "X",
            "cat": cat,
            "name": name,
            "pid": 0,
            "tid": stream,
            "ts": t0 + ts,
            "dur": dur,
            "args": {"correlation": corr0 + corr, "stream": stream, "device": 0},
        }

    return [
        rng(f"ProfilerStep#{step}", 0, 1000),
        rng("train_step", 5, 990),
        rng("forward", 10, 300),
        rng("backward", 400, 500),
        # What kineto draws of the ranges on the GPU timeline: not host ranges, must be ignored.
        rng("backward", 500, 400, cat="gpu_user_annotation", pid=0, tid=7),
        launch(50, 5, MAIN),
        kernel("ampere_sgemm_128x64_nn", 320, 100, 5),
        launch(450, 7, AUTOGRAD),
        kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 500, 200, 7),
        launch(460, 8, AUTOGRAD),
        kernel("void at::native::vectorized_elementwise_kernel<4>", 600, 150, 8, stream=8),  # overlaps
        launch(470, 9, AUTOGRAD),
        kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 800, 50, 9),
        launch(480, 10, AUTOGRAD, name="cudaStreamSynchronize"),  # launches nothing
        launch(950, 11, MAIN, name="cudaMemcpyAsync"),
        kernel("Memcpy DtoH (Device -> Pageable)", 960, 10, 11, cat="gpu_memcpy"),
        # Host operators: aten::mm (100 us) holds aten::empty (10 us) on the main thread.
        rng("aten::mm", 20, 100, cat="cpu_op"),
        rng("aten::empty", 30, 10, cat="cpu_op"),
    ]


@pytest.fixture
def gpu_trace(tmp_path):
    """Two profiled steps, 3 and 4, gzipped as the profiler writes them."""
    events = gpu_step(3, 1_000_000, 0) + gpu_step(4, 1_010_000, 100)
    path = tmp_path / "rank0_dp0.1.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"schemaVersion": 1, "traceEvents": events}, f)
    return path


def test_backward_device_time_counts_kernels_launched_from_another_thread(gpu_trace):
    s = json.loads(ok(gpu_trace, "--json"))
    assert s["cpu_only"] is False
    for row in s["steps"]:
        bwd = row["stages"]["backward"]
        # Kernels [500, 700] and [600, 750] overlap: busy is their union plus [800, 850] = 300 us,
        # not the 400 us sum; the span runs from 500 to 850.
        assert bwd["kernels"] == 3
        assert bwd["device_busy_ms"] == pytest.approx(0.300)
        assert bwd["device_span_ms"] == pytest.approx(0.350)
        assert bwd["host_ms"] == pytest.approx(0.500)
        fwd = row["stages"]["forward"]
        # The sgemm runs after the host has left forward (320 > 310): it is still forward's.
        assert (fwd["kernels"], fwd["device_busy_ms"]) == (1, pytest.approx(0.100))
        # The whole step also holds the copy launched after the stages.
        assert row["kernels"] == 5 and row["device_busy_ms"] == pytest.approx(0.410)
        assert row["host_ms"] == pytest.approx(1.0)
        assert list(row["stages"]) == ["forward", "backward"]  # only the stages that ran
    total = s["totals"]
    assert total["steps"] == 2 and total["kernels"] == 10
    assert total["stages"]["backward"]["device_busy_ms"] == pytest.approx(0.600)
    assert total["device_busy_ms"] == pytest.approx(0.820)


def test_top_kernels_have_shares_and_a_tensor_core_verdict(gpu_trace):
    s = json.loads(ok(gpu_trace, "--json"))
    kernels = {k["name"]: k for k in s["kernels"]}
    assert s["kernel_total_ms"] == pytest.approx(2 * 0.510)
    top = s["kernels"][0]
    assert top["name"] == "sm90_xmma_gemm_bf16bf16_bf16f32" and top["calls"] == 4
    assert top["total_ms"] == pytest.approx(0.500) and top["share"] == pytest.approx(0.5 / 1.02)
    assert top["tensor_cores"] == "yes"
    assert kernels["ampere_sgemm_128x64_nn"]["tensor_cores"] == "no"
    assert kernels["void at::native::vectorized_elementwise_kernel<4>"]["tensor_cores"] == "-"
    assert sum(k["share"] for k in s["kernels"]) == pytest.approx(1.0)
    assert len(json.loads(ok(gpu_trace, "--json", "--top", "2"))["kernels"]) == 2


def test_gpu_text_report(gpu_trace):
    text = ok(gpu_trace)
    assert "CPU only" not in text and "dev busy ms" in text
    assert "top 4 kernels of 1.02 ms device time summed over streams" in text
    # The header gives the busy time (union over both streams) beside the sum, never the sum alone.
    assert "device time: busy 0.82 ms" in text and "over 2 stream(s)); summed over streams 1.02 ms" in text
    line = next(row for row in text.splitlines() if "sm90_xmma_gemm" in row)
    assert "yes" in line and "49.0%" in line


def test_operator_self_time_excludes_nested_operators(gpu_trace):
    ops = {op["name"]: op for op in json.loads(ok(gpu_trace, "--json"))["operators"]["by_self"]}
    assert ops["aten::mm"]["total_ms"] == pytest.approx(0.200)  # two steps
    assert ops["aten::mm"]["self_ms"] == pytest.approx(0.180)
    assert ops["aten::empty"]["self_ms"] == pytest.approx(0.020)


@pytest.mark.parametrize(
    "name, verdict",
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "yes"),
        ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_nn", "yes"),
        ("cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8", "yes"),
        ("volta_h884gemm_64x64_ldg8_nn", "yes"),  # Volta's HMMA shape
        ("ampere_gemm_fp32_kernel", "no"),  # a GEMM with no tensor-core marker: plain fp32
        ("sm90_gemm_bf16_wgmma_tma", "yes"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "yes"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64>>", "yes"),
        ("ampere_sgemm_128x64_nn", "no"),
        ("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128x8_stage3_warpsize2x2x1_ffma", "no"),
        ("cutlass::Kernel<cutlass_80_simt_sgemm_128x128_8x4_nn_align1>", "no"),
        ("gemv2T_kernel_val<int, int, float, float, float, 128, 16, 4, 4, false>", "no"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<c10::BFloat16>>", "-"),
        ("Memcpy HtoD (Pinned -> Device)", "-"),
    ],
)
def test_tensor_core_heuristic(name, verdict):
    assert tensor_cores(name) == verdict


def test_union_counts_overlaps_once():
    assert union_us([(0, 10), (5, 15), (20, 30)]) == 25
    assert union_us([]) == 0
    assert Launches([]).inside(pid=1, start=0, end=10) == []  # a process that launched nothing


# ---------------------------------------------------------------------------- bad inputs


def test_missing_file(tmp_path):
    assert "nope.pt.trace.json.gz does not exist" in fails(tmp_path / "nope.pt.trace.json.gz")


@pytest.mark.parametrize(
    "name, content",
    [
        ("garbage.pt.trace.json.gz", b"\x00\x01not gzip at all"),
        ("garbage.pt.trace.json", b"{this is not json"),
        ("text.pt.trace.json", b"\xff\xfe\x00binary"),
    ],
)
def test_garbage_file(tmp_path, name, content):
    (tmp_path / name).write_bytes(content)
    assert "is not a JSON trace" in fails(tmp_path / name)


def test_json_that_is_not_a_trace(tmp_path):
    (tmp_path / "x.json").write_text('{"loss": 1.0}')
    assert "not a Chrome trace" in fails(tmp_path / "x.json")


def test_folder_without_traces_and_bad_flag(tmp_path):
    assert "no *.json or *.json.gz files" in fails(tmp_path)
    assert "--top must be positive" in fails(tmp_path, "--top", "0")
    assert "invalid int value" in fails(tmp_path, "--top", "many")


# ---------------------------------------------------------------------------- independent counts


def sweep_busy_us(spans) -> float:
    """The union of intervals by a sweep line (+1 at a start, -1 at an end): a different method from
    the module's sort-and-merge, for cross-checking."""
    points = sorted([(s, 1) for s, e in spans] + [(e, -1) for s, e in spans], key=lambda p: (p[0], -p[1]))
    busy, depth, since = 0.0, 0, None
    for t, step in points:
        if depth == 0 and step == 1:
            since = t
        depth += step
        if depth == 0:
            busy += t - since
    return busy


def write_trace(path: Path, events: list, **header) -> Path:
    text = json.dumps({"schemaVersion": 1, **header, "traceEvents": events})
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def summary(path: Path, *args: str) -> dict:
    return json.loads(ok(path, "--json", *args))


def test_stage_names_match_the_registry():
    """The tool's default stages are the registry's (config.STAGES), in its order."""
    assert traces_mod.default_stages() == STAGE_NAMES == tuple(STAGES)


def test_busy_time_agrees_with_a_sweep_line_on_random_streams(tmp_path):
    """Random kernels on four streams, launched inside two steps: busy is the union, sum the plain sum,
    both within 1% of the test's own count; busy < sum because the streams overlap."""
    rnd = random.Random(7)
    events, expected = [], {}
    for step, t0 in ((1, 0.0), (2, 50_000.0)):
        events.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": f"ProfilerStep#{step}",
                "pid": 1,
                "tid": 1,
                "ts": t0,
                "dur": 40_000.0,
                "args": {},
            }
        )
        spans = []
        for i in range(300):
            corr = step * 1000 + i
            launch = t0 + rnd.uniform(0, 39_000)
            start, dur = launch + rnd.uniform(1, 3000), rnd.uniform(0.5, 400)
            events.append(
                {
                    "ph": "X",
                    "cat": "cuda_runtime",
                    "name": "cudaLaunchKernel",
                    "pid": 1,
                    "tid": 1 + i % 2,
                    "ts": launch,
                    "dur": 3.0,
                    "args": {"correlation": corr},
                }
            )
            events.append(
                {
                    "ph": "X",
                    "cat": "kernel",
                    "name": f"k{i % 5}",
                    "pid": 0,
                    "tid": f"stream {i % 4}",
                    "ts": start,
                    "dur": dur,
                    "args": {"correlation": corr, "stream": i % 4},
                }
            )
            spans.append((start, start + dur))
        expected[step] = spans
    s = summary(write_trace(tmp_path / "random.json", events))
    for row in s["steps"]:
        spans = expected[row["step"]]
        assert row["device_busy_ms"] == pytest.approx(sweep_busy_us(spans) / 1000, rel=0.01)
        assert row["device_sum_ms"] == pytest.approx(sum(e - b for b, e in spans) / 1000, rel=0.01)
        assert row["device_busy_ms"] < row["device_sum_ms"]
    every = expected[1] + expected[2]
    assert s["device_busy_ms"] == pytest.approx(sweep_busy_us(every) / 1000, rel=0.01)
    assert s["totals"]["device_busy_ms"] == pytest.approx(sweep_busy_us(every) / 1000, rel=0.01)
    assert s["device_sum_ms"] == pytest.approx(sum(e - b for b, e in every) / 1000, rel=0.01)
    assert s["device_streams"] == 4


# ---------------------------------------------------------------------------- torch-tb-profiler's samples


def tb_independent_steps(path: Path) -> dict:
    """Per ProfilerStep of an old-format trace, counted here: the Kernel/Memcpy/Memset events whose
    Runtime launch (same correlation id, same process) falls inside the step."""
    with gzip.open(path, "rt") if path.suffix == ".gz" else open(path) as f:
        events = json.load(f)["traceEvents"]
    work = defaultdict(list)
    for e in events:
        if e.get("cat") in ("Kernel", "Memcpy", "Memset"):
            work[e["args"]["correlation"]].append(e)
    launches = [e for e in events if e.get("cat") == "Runtime" and e["args"].get("correlation") in work]
    out = {}
    for step in (e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")):
        start, end = step["ts"], step["ts"] + step["dur"]
        mine = [
            k
            for e in launches
            if e["pid"] == step["pid"] and start <= e["ts"] <= end
            for k in work[e["args"]["correlation"]]
        ]
        out[int(step["name"].split("#")[1])] = mine
    return out, [k for ks in work.values() for k in ks], events


@needs_shared
def test_tb_profiler_resnet_sample_old_category_names():
    s = summary(RESNET, "--top", "40")
    assert s["cpu_only"] is False and s["window"] == "ProfilerStep" and s["malformed_events"] == 0
    assert [r["step"] for r in s["steps"]] == [5, 6, 7, 8, 9, 10]
    per_step, all_work, events = tb_independent_steps(RESNET)
    for row in s["steps"]:
        mine = per_step[row["step"]]
        assert row["kernels"] == len(mine)
        spans = [(k["ts"], k["ts"] + k["dur"]) for k in mine]
        assert row["device_busy_ms"] == pytest.approx(sweep_busy_us(spans) / 1000, rel=0.01)
        assert row["device_sum_ms"] == pytest.approx(sum(k["dur"] for k in mine) / 1000, rel=0.01)
    spans = [(k["ts"], k["ts"] + k["dur"]) for k in all_work]
    assert s["device_busy_ms"] == pytest.approx(sweep_busy_us(spans) / 1000, rel=0.01)
    assert s["kernel_total_ms"] == pytest.approx(sum(k["dur"] for k in all_work) / 1000, rel=0.01)
    # Steps are back to back: the total host time is their union, and equals the sum here.
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    assert s["totals"]["host_ms"] == pytest.approx(
        sweep_busy_us([(e["ts"], e["ts"] + e["dur"]) for e in steps]) / 1000, rel=0.01
    )
    verdicts = {k["name"]: k["tensor_cores"] for k in s["kernels"]}
    assert all(v == "no" for n, v in verdicts.items() if "sgemm" in n or "dgrad_engine" in n)
    assert all(v == "-" for n, v in verdicts.items() if "bn_" in n or "elementwise" in n)
    # ProfilerStep#N ranges are categorised Operator in this format: windows, not operators.
    assert not any(op["name"].startswith("ProfilerStep") for op in s["operators"]["by_total"])


@needs_shared
def test_tb_profiler_samples_as_a_folder():
    out = ok(SHARED_TRACES, "--top", "3")
    assert "has no ProfilerStep" not in out and "CPU only" not in out
    assert "6 profiled step(s): 5, 6, 7, 8, 9, 10" in out and "1 profiled step(s): 2" in out
    folder = json.loads(ok(SHARED_TRACES, "--json"))
    assert sorted(Path(t["file"]).name for t in folder["traces"]) == sorted([RESNET.name, GPU_METRICS.name])
    metrics = next(t for t in folder["traces"] if t["file"].endswith(GPU_METRICS.name))
    per_step, _, _ = tb_independent_steps(GPU_METRICS)
    assert metrics["steps"][0]["kernels"] == len(per_step[2]) > 0


# ---------------------------------------------------------------------------- hand-made traces per rule

OLD_NAMES = {
    "user_annotation": "Operator",
    "cpu_op": "Operator",
    "cuda_runtime": "Runtime",
    "kernel": "Kernel",
    "gpu_memcpy": "Memcpy",
    "gpu_memset": "Memset",
}


def renamed(events: list[dict], names: dict) -> list[dict]:
    return [dict(e, cat=names.get(e["cat"], e["cat"])) for e in events]


def figures(s: dict) -> list:
    return [
        (
            r["step"],
            r["host_ms"],
            r["device_busy_ms"],
            r["kernels"],
            {n: (st["host_ms"], st["device_busy_ms"], st["kernels"]) for n, st in r["stages"].items()},
        )
        for r in s["steps"]
    ]


def test_old_category_names_read_as_the_new_ones(tmp_path):
    events = gpu_step(3, 1_000_000, 0) + gpu_step(4, 1_010_000, 100)
    new = summary(write_trace(tmp_path / "new.json", events))
    old = summary(write_trace(tmp_path / "old.json", renamed(events, OLD_NAMES)))
    assert figures(old) == figures(new) and old["device_busy_ms"] == new["device_busy_ms"]


@pytest.mark.parametrize(
    "launch_cat, work_cat, launch_name",
    [
        ("mtia_runtime", "mtia_ccp_events", "mtiaLaunchKernel"),  # MTIA
        ("xpu_runtime", "kernel", "zeCommandListAppendLaunchKernel"),  # Intel XPU
        ("cuda_runtime", "kernel", "hipLaunchKernel"),  # ROCm: HIP calls are cuda_runtime
        ("privateuse1_runtime", "kernel", "aclrtLaunchKernel"),  # an out-of-tree backend
        ("cuda_driver", "kernel", "cuLaunchKernel"),
    ],
)
def test_device_work_of_any_accelerator(tmp_path, launch_cat, work_cat, launch_name):
    """Device time is found by category, whatever the vendor: such a trace is never 'CPU only'."""
    events = [e for e in gpu_step(3, 0, 0)]
    for e in events:
        if e["cat"] == "cuda_runtime":
            e["cat"], e["name"] = launch_cat, launch_name if e["name"] == "cudaLaunchKernel" else e["name"]
        elif e["cat"] == "kernel":
            e["cat"] = work_cat
    s = summary(write_trace(tmp_path / "t.json", events))
    assert s["cpu_only"] is False
    bwd = s["steps"][0]["stages"]["backward"]
    assert bwd["kernels"] == 3 and bwd["device_busy_ms"] == pytest.approx(0.300)
    assert "CPU only" not in ok(tmp_path / "t.json")


def test_mtia_trace_without_profiler_steps_is_one_window(tmp_path):
    """The trace of issue 13: MTIA device events only, no ProfilerStep. The whole trace is one window
    and the output says so; device time is counted, it is not called a CPU run."""
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 9, "tid": 9, "ts": 0, "dur": 100, "args": {}}
    ]
    for i in range(3):
        events += [
            {
                "ph": "X",
                "cat": "mtia_runtime",
                "name": "runFunction",
                "pid": 9,
                "tid": 9,
                "ts": 10 + i,
                "dur": 1,
                "args": {"correlation": i},
            },
            {
                "ph": "X",
                "cat": "mtia_ccp_events",
                "name": f"fused_op_{i}",
                "pid": 1,
                "tid": 2,
                "ts": 50 + 100 * i,
                "dur": 80,
                "args": {"correlation": i},
            },
        ]
    # MTIA records its waits among its device events: waiting is not busy time (it would fill the
    # gaps between the three kernels and read 0.28 ms of "union of kernel, memcpy and memset")
    wait = {"ph": "X", "cat": "mtia_ccp_events", "name": "event_wait", "pid": 1, "tid": 2, "args": {}}
    events += [{**wait, "ts": 130 + 100 * i, "dur": 20} for i in range(2)]
    path = write_trace(tmp_path / "mtia.json", events)
    s = summary(path)
    assert s["window"] == "whole trace" and s["steps"] == [] and s["cpu_only"] is False
    assert s["totals"]["device_busy_ms"] == pytest.approx(0.240) and s["totals"]["kernels"] == 3
    assert s["totals"]["host_ms"] == pytest.approx(0.330)  # first event (0) to last end (330)
    text = ok(path)
    assert "no ProfilerStep#N ranges: the whole trace is one window" in text and "CPU only" not in text


def test_no_profiler_step_still_gives_the_stages(tmp_path):
    events = [e for e in gpu_step(3, 0, 0) if not e["name"].startswith("ProfilerStep")]
    s = summary(write_trace(tmp_path / "t.pt.trace.json", events))
    assert s["window"] == "whole trace" and s["totals"]["steps"] == 0
    assert s["totals"]["stages"]["backward"]["device_busy_ms"] == pytest.approx(0.300)
    assert s["totals"]["stages"]["forward"]["host_ms"] == pytest.approx(0.300)


def test_unknown_device_category_and_gpu_user_annotation(tmp_path):
    """Work of a category this tool does not know counts when it carries the on-device conventions
    (a stream); gpu_user_annotation (ranges drawn on the device timeline) is not work."""
    events = gpu_step(3, 0, 0)
    for e in events:
        if e["name"].startswith("Memcpy"):
            e["cat"] = "future_device_activity"
    s = summary(write_trace(tmp_path / "t.json", events))
    assert s["steps"][0]["kernels"] == 5 and s["steps"][0]["device_busy_ms"] == pytest.approx(0.410)
    only_annotation = [
        e for e in gpu_step(3, 0, 0) if e["cat"] != "kernel" and not e["name"].startswith("Memcpy")
    ]
    s = summary(write_trace(tmp_path / "a.json", only_annotation))
    assert s["device_busy_ms"] == 0 and s["kernels"] == []
    assert s["device_not_recorded"] is True  # its launches remain: a GPU trace, not a CPU one


def test_launches_without_kernels_read_as_a_gpu_trace_whose_kernels_were_not_recorded(tmp_path):
    """HTA's cupti_profiler test trace has 1,862 CUDA runtime calls and no kernel: the profiler ran
    without CUPTI. Calling it 'CPU only' sent its reader looking for a CPU run that never was."""
    events = [e for e in gpu_step(3, 0, 0) if e["cat"] != "kernel" and not e["name"].startswith("Memcpy")]
    events.append({**events[-1], "cat": "cuda_driver", "name": "cuLaunchKernel", "args": {"correlation": 99}})
    launches = sum(e["cat"] == "cuda_runtime" for e in events)
    assert launches >= 4
    path = write_trace(tmp_path / "t.json", events)
    s = summary(path)
    assert s["cpu_only"] is False and s["device_not_recorded"] is True
    assert s["launch_calls"] == {"cuda_runtime": launches, "cuda_driver": 1}
    assert s["steps"][0]["host_ms"] > 0 and "device_busy_ms" not in s["steps"][0]["stages"]["forward"]
    text = ok(path)
    assert "CPU only" not in text
    assert (
        f"a GPU trace whose kernels were not recorded: 1 cuda_driver, {launches} cuda_runtime calls" in text
    )
    assert "ProfilerActivity.CUDA" in text and "CUPTI" in text
    assert "dev busy ms" not in text  # no device columns invented


def test_a_trace_without_launches_or_device_work_is_still_cpu_only(tmp_path):
    events = [e for e in gpu_step(3, 0, 0) if e["cat"] == "user_annotation"]
    s = summary(write_trace(tmp_path / "t.json", events))
    assert s["cpu_only"] is True and s["device_not_recorded"] is False and s["launch_calls"] == {}
    assert "no device events in this trace (CPU only)" in ok(tmp_path / "t.json")


def test_overlapping_steps_are_not_counted_twice(tmp_path):
    """Step 4's range overlaps step 3's (an eval inside the window): the total host time and device
    span are unions, not sums of per-step spans."""
    events = gpu_step(3, 0, 0) + gpu_step(4, 500, 100)  # step 4 opens halfway through step 3
    s = summary(write_trace(tmp_path / "t.json", events))
    assert sum(r["host_ms"] for r in s["steps"]) == pytest.approx(2.0)
    assert s["totals"]["host_ms"] == pytest.approx(1.5)
    assert all(r["device_span_ms"] > 0 for r in s["steps"])
    per_step_span = sum(r["device_span_ms"] for r in s["steps"])
    assert s["totals"]["device_span_ms"] < per_step_span
    work = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["cat"] in ("kernel", "gpu_memcpy")]
    assert s["totals"]["device_busy_ms"] == pytest.approx(sweep_busy_us(work) / 1000, rel=0.01)


MALFORMED = [
    {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 100, "tid": 1, "ts": 1, "dur": 1, "args": None},
    {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 100, "tid": 1, "ts": "12", "dur": 1, "args": {}},
    {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 100, "tid": 1, "ts": 12},
    {"ph": "X", "cat": "cpu_op", "name": 42, "pid": 100, "tid": 1, "ts": 12, "dur": 1},
    {"ph": "X", "cat": "kernel", "name": "k", "pid": [0], "tid": 7, "ts": 12, "dur": 1, "args": {}},
    {"ph": "X", "cat": {"a": 1}, "name": "k", "pid": 0, "tid": 7, "ts": 12, "dur": 1},
    {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 12, "dur": -5, "args": {}},
    {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": True, "dur": 1, "args": {}},
    "not an event",
    None,
]


def test_malformed_events_are_skipped_and_counted(tmp_path):
    events = gpu_step(3, 0, 0)
    events[7]["args"] = {"correlation": [1, 2]}  # an unhashable correlation id: the work is just unlaunched
    path = write_trace(tmp_path / "odd.json", events + MALFORMED)
    s = summary(path)
    assert s["malformed_events"] == len(MALFORMED)
    assert [r["step"] for r in s["steps"]] == [3]
    assert f"{len(MALFORMED)} malformed events skipped" in ok(path)


@pytest.mark.parametrize(
    "content",
    [
        '{"traceEvents": []}',
        '{"traceEvents": {"a": 1}}',
        "42",
        '"a string"',
        json.dumps({"traceEvents": MALFORMED}),
        '{"traceEvents": [{"ph": "M", "name": "process_name"}]}',
    ],
)
def test_a_file_that_is_not_a_trace_gets_one_line(tmp_path, content):
    (tmp_path / "x.json").write_text(content)
    assert "x.json" in fails(tmp_path / "x.json")


def test_odd_header_types_do_not_crash(tmp_path):
    path = write_trace(
        tmp_path / "t.json", gpu_step(3, 0, 0), distributedInfo={"rank": "zero"}, deviceProperties=None
    )
    assert summary(path)["rank"] is None
    write_trace(tmp_path / "u.json", gpu_step(3, 0, 0), distributedInfo=[1, 2])
    assert summary(tmp_path / "u.json")["rank"] is None


def test_folder_takes_any_json_ordered_by_rank(tmp_path):
    """Any *.json / *.json.gz, ordered by distributedInfo.rank (not by name); files that are not
    traces are listed as skipped; a folder with no trace at all is refused in one line."""
    write_trace(tmp_path / "a_worker.json", gpu_step(3, 0, 0), distributedInfo={"rank": 1})
    write_trace(tmp_path / "b_worker.json.gz", gpu_step(3, 0, 0), distributedInfo={"rank": 0})
    (tmp_path / "config.json").write_text('{"lr": 0.1}')
    folder = json.loads(ok(tmp_path, "--json"))
    assert [(Path(t["file"]).name, t["rank"]) for t in folder["traces"]] == [
        ("b_worker.json.gz", 0),
        ("a_worker.json", 1),
    ]
    assert [Path(d["file"]).name for d in folder["skipped"]] == ["config.json"]
    text = ok(tmp_path)
    assert text.index("(rank 0)") < text.index("(rank 1)")
    assert "skipped 1 .json file(s) that are not traces: config.json" in text
    empty = tmp_path / "none"
    empty.mkdir()
    (empty / "config.json").write_text('{"lr": 0.1}')
    assert "none of the 1 .json/.json.gz files" in fails(empty)


@pytest.mark.parametrize(
    "name, verdict",
    [
        ("void fbgemm_gpu::split_embedding_codegen_forward_unweighted_kernel<c10::Half, float, 8>", "-"),
        ("void fbgemm_gpu::batched_embedding_backward_kernel<c10::Half, c10::BFloat16>", "-"),
        ("Cijk_Ailk_Bljk_HHS_BH_MT128x128x32_MI16x16x1_SN_1LDSB0_APM1_ABV0", "yes"),  # Tensile, MFMA
        ("Cijk_Alik_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT256x256x64_MI32x32x8_SN_LDSB1", "yes"),  # hipBLASLt
        ("Cijk_Ailk_Bljk_SB_MT64x64x8_SE_K1", "no"),  # Tensile without an MFMA shape: VALU
        ("void ck::kernel_gemm_xdl_cshuffle_v3<ck::half_t>", "yes"),
        ("sm80_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize128x128x32", "yes"),
        ("void cudnn::cnn::conv2d_grouped_direct_kernel<float, float, float>", "no"),
        ("volta_scudnn_128x64_relu_interior_nn_v1", "no"),
        ("void cudnn::detail::dgrad_engine<float, 512, 6, 5, 3, 3, 3, false>", "no"),
        ("void at::native::unrolled_elementwise_kernel<convert_to_half>", "-"),  # convert is not conv
        ("void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, 512, true, 1>", "-"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "-"),
    ],
)
def test_tensor_core_verdict_only_for_gemm_and_convolution(name, verdict):
    assert tensor_cores(name) == verdict


def test_help_documents_the_rules():
    text = ok("--help")
    for rule in (
        "fbgemm",
        "Cijk_",
        "mtia_ccp_events",
        "malformed",
        "gpu_user_annotation",
        "waiting on all-reduce",
    ):
        assert rule in text


# ---------------------------------------------------------------------------- communication


def comm_step(kind: str) -> list[dict]:
    """One step whose backward [400, 900] holds a collective. gloo: c10d::allreduce_ on the main
    thread at 600, gloo:all_reduce on gloo's thread from 610 to 880, an aten op on the main thread
    from 700 to 720 (not waiting). nccl: an NCCL kernel launched at 600 runs 650-850 on its stream."""
    events = gpu_step(3, 0, 0)
    if kind == "gloo":
        events = [e for e in events if e["cat"] not in ("kernel", "gpu_memcpy", "cuda_runtime")]
        events += [
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": "c10d::allreduce_",
                "pid": PID,
                "tid": MAIN,
                "ts": 600,
                "dur": 5,
                "args": {},
            },
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": "gloo:all_reduce",
                "pid": PID,
                "tid": 77,
                "ts": 610,
                "dur": 270,
                "args": {},
            },
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": "aten::copy_",
                "pid": PID,
                "tid": 77,
                "ts": 620,
                "dur": 10,
                "args": {},
            },  # inside the collective on its own thread: part of it
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": "aten::add_",
                "pid": PID,
                "tid": MAIN,
                "ts": 700,
                "dur": 20,
                "args": {},
            },
        ]
    else:
        events += [
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": "record_param_comms",
                "pid": PID,
                "tid": AUTOGRAD,
                "ts": 598,
                "dur": 8,
                "args": {},
            },
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernel",
                "pid": PID,
                "tid": AUTOGRAD,
                "ts": 600,
                "dur": 4,
                "args": {"correlation": 50},
            },
            {
                "ph": "X",
                "cat": "kernel",
                "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
                "pid": 0,
                "tid": 20,
                "ts": 650,
                "dur": 200,
                "args": {"correlation": 50, "stream": 20},
            },
        ]
    return events


def test_gloo_wait_is_named_in_the_backward(tmp_path):
    path = write_trace(tmp_path / "gloo.json", comm_step("gloo"))
    bwd = summary(path)["steps"][0]["stages"]["backward"]
    # In flight 600-605 and 610-880 (275 us), of which 700-720 the main thread ran aten::add_: 255 us.
    assert bwd["comm_host_ms"] == pytest.approx(0.255) and bwd["comm_kind"] == "all-reduce"
    assert summary(path)["steps"][0]["stages"]["forward"]["comm_host_ms"] == 0
    assert "backward 0.5 ms, of which waiting on all-reduce: 0.3 ms (compute 0.2 ms)" in ok(path)


def test_fsdp_waits_inside_an_autograd_node_are_communication(tmp_path):
    """FSDP2 on gloo: the gradient reduction runs inside an autograd node on the main thread, which
    waits there while gloo's thread reduces. Its FSDP:: range makes the wait communication, not the
    node's compute."""
    events = [e for e in gpu_step(3, 0, 0) if e["cat"] not in ("kernel", "gpu_memcpy", "cuda_runtime")]

    def op(name, tid, ts, dur, cat="cpu_op"):
        return {"ph": "X", "cat": cat, "name": name, "pid": PID, "tid": tid, "ts": ts, "dur": dur, "args": {}}

    events += [
        op("RegisterPostBackwardFunctionBackward", MAIN, 590, 300),
        op("FSDP::post_backward_reduce (blocks.0)", MAIN, 600, 285, "user_annotation"),
        op("c10d::_reduce_scatter_base_", MAIN, 602, 5),
        op("gloo:all_reduce", 77, 610, 270, "user_annotation"),
    ]
    path = write_trace(tmp_path / "fsdp.json", events)
    bwd = summary(path)["steps"][0]["stages"]["backward"]
    assert bwd["comm_host_ms"] == pytest.approx(0.285)  # the FSDP range, all of it waiting on gloo


def test_nccl_kernels_are_the_device_side_of_communication(tmp_path):
    path = write_trace(tmp_path / "nccl.json", comm_step("nccl"))
    bwd = summary(path)["steps"][0]["stages"]["backward"]
    assert bwd["comm_device_ms"] == pytest.approx(0.200) and bwd["comm_kind"] == "all-reduce"
    assert bwd["kernels"] == 4
    assert bwd["comm_host_ms"] == pytest.approx(0.008)  # record_param_comms: nothing else ran then
    assert "all-reduce kernels on the device: 0.2 ms" in ok(path)


@pytest.mark.ddp
def test_the_waiting_rank_shows_its_wait_in_the_backward(tmp_path):
    """A real 2-rank gloo run where rank 1's forward sleeps 200 ms, every rank profiled: each writes
    its trace; rank 0 waits for rank 1 in the backward's all-reduce, and the trace says so; rank 1's
    backward does not wait."""
    from test_ddp import torchrun

    out = tmp_path / "run"
    flags = [
        "--num-steps",
        "8",
        "--use-profiler",
        "--profile-ranks",
        "all",
        "--simulate-slow-rank",
        "1:200:forward",
    ]
    result = torchrun(ROOT / "train_minimal.py", *TINY, *flags, "--out-dir", str(out), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):  # --profile-ranks all: every rank writes its trace, named for its rank
        files = list((out / "traces").glob(f"rank{rank}_dp{rank}.*.pt.trace.json.gz"))
        assert len(files) == 1
        with gzip.open(files[0], "rt") as f:
            info = json.load(f)["distributedInfo"]
        assert info["rank"] == rank and info["world_size"] == 2 and info["backend"] == "gloo"
        assert (out / "traces" / f"rank{rank}_ops.txt").exists()
    folder = json.loads(ok(out, "--json"))
    assert [t["rank"] for t in folder["traces"]] == [0, 1]
    assert [Path(d["file"]).name for d in folder["skipped"]] == ["config.json"]
    rank0, rank1 = (t["totals"]["stages"]["backward"] for t in folder["traces"])
    assert rank0["comm_kind"] == "all-reduce"
    assert rank0["comm_host_ms"] > 0.5 * rank0["host_ms"]
    assert rank0["comm_host_ms"] > 100 * len(folder["traces"][0]["steps"])  # most of the 200 ms each step
    assert rank1["comm_host_ms"] < rank0["comm_host_ms"] / 3
    assert "backward" in ok(out) and "of which waiting on all-reduce" in ok(out)


# ---------------------------------------------------------------------------- odd field types (issue 14)

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=5,
)
FIELDS = ["ph", "cat", "name", "pid", "tid", "ts", "dur", "args", "correlation", "stream"]


# 150 cases keep the suite fast; TRACES_FUZZ_EXAMPLES=3000 hunts longer.
@settings(
    max_examples=int(os.environ.get("TRACES_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    changes=st.lists(st.tuples(st.integers(0, 60), st.sampled_from(FIELDS), JSON_VALUES), max_size=6),
    header=JSON_VALUES,
)
def test_odd_field_types_never_crash(tmp_path, changes, header):
    """Any field of any event, or the header's distributedInfo, replaced by any JSON value: the
    summary is made (the odd events counted as malformed) or the file is refused with a TraceError,
    never another exception, in the JSON and the text output alike."""
    events = comm_step("nccl") + comm_step("gloo")
    for index, field, value in changes:
        event = events[index % len(events)]
        if field in ("correlation", "stream"):
            if isinstance(event.get("args"), dict):
                event["args"][field] = value
        else:
            event[field] = value
    path = tmp_path / "fuzz.json"
    path.write_text(json.dumps({"traceEvents": events, "distributedInfo": header}))
    try:
        s = traces_mod.summarize(path)
    except traces_mod.TraceError:
        return
    assert s["malformed_events"] >= 0
    json.dumps(s)
    traces_mod.render(s)


# ---------------------------------------------------------------------------- bounded reading


def gzip_bomb(path: Path, gib: int = 6) -> Path:
    """A .json.gz of a few MiB that inflates to `gib` GiB: one 64 MiB gzip member of spaces,
    repeated (a gzip file may hold several members, read back to back)."""
    member = gzip.compress(b" " * (64 << 20), compresslevel=9)
    with open(path, "wb") as f:
        for _ in range(16 * gib):
            f.write(member)
    return path


def test_a_gzip_bomb_is_one_line_not_a_memory_error(tmp_path, monkeypatch, capsys):
    """A 6 GiB trace in a 6 MiB gzip: refused once its text passes TRACE_LIMIT (16 MiB here, so
    that the test reads no more than that), though the file itself is below the limit."""
    bomb = gzip_bomb(tmp_path / "rank0_dp0.1.pt.trace.json.gz")
    assert bomb.stat().st_size < 8 << 20
    monkeypatch.setattr(traces_mod, "TRACE_LIMIT", 16 << 20)
    assert traces_mod.main([str(bomb)]) == 2
    out, err = capsys.readouterr()
    (line,) = err.strip().splitlines()
    assert out == "" and str(bomb) in line and "more than 16 MiB of trace text once decompressed" in line
