"""python -m minigpt.traces: stage times per profiled step, projected on the device by correlation
id from any thread, top kernels with a tensor-core verdict, top host operators, clean errors."""

import gzip
import json
import os
import subprocess
import sys

import pytest

import train_minimal
from conftest import ROOT, TINY
from minigpt.traces import Launches, tensor_cores, union_us

STAGES = ["data_to_device", "forward", "backward", "optimizer_step"]


def traces(*args: str) -> subprocess.CompletedProcess:
    """Run the tool as a user would, in a fresh process."""
    return subprocess.run([sys.executable, "-m", "minigpt.traces", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=os.environ.copy())


def ok(*args: str) -> str:
    r = traces(*args)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return r.stdout


def fails(*args: str) -> str:
    """The single stderr line of a refused input, after checking exit status 2."""
    r = traces(*args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("error: ") and r.stdout == ""
    return lines[0]


# ---------------------------------------------------------------------------- a real CPU trace

@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One profiled training run on the CPU: steps 3 and 4 are recorded (Megatron's semantics)."""
    out = tmp_path_factory.mktemp("traces") / "run"
    assert train_minimal.cli([*TINY, "--num-steps", "6", "--use-profiler", "--profile-step-start", "3",
                              "--profile-step-end", "5", "--out-dir", str(out)]) == 0
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
        assert sum(st["host_ms"] for st in row["stages"].values()) <= row["host_ms"]
    total = s["totals"]
    assert total["steps"] == 2
    assert total["host_ms"] == pytest.approx(sum(r["host_ms"] for r in s["steps"]))
    assert total["stages"]["backward"]["host_ms"] == pytest.approx(
        sum(r["stages"]["backward"]["host_ms"] for r in s["steps"]))
    # The host operators are real aten ops, and self time never exceeds total time.
    by_self = s["operators"]["by_self"]
    assert by_self and any(op["name"].startswith("aten::") for op in by_self)
    assert all(0 <= op["self_ms"] <= op["total_ms"] + 1e-6 for op in by_self)
    assert by_self == sorted(by_self, key=lambda op: op["self_ms"], reverse=True)


def test_cpu_trace_text_report(cpu_run):
    _, trace = cpu_run
    text = ok(trace, "--top", "3")
    assert "no device kernels in this trace (CPU run)" in text
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
    (folder / "notes.txt").write_text("not a trace")  # ignored: not *.pt.trace.json*
    summaries = json.loads(ok(folder, "--json"))["traces"]
    assert [os.path.basename(s["file"]) for s in summaries] == ["rank0_dp0.1.pt.trace.json.gz",
                                                                "rank1_dp1.2.pt.trace.json.gz"]
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
        return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": t0 + ts, "dur": dur, "args": {}}

    def launch(ts, corr, tid, name="cudaLaunchKernel"):
        return {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": PID, "tid": tid, "ts": t0 + ts,
                "dur": 5, "args": {"correlation": corr0 + corr}}

    def kernel(name, ts, dur, corr, stream=7, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": t0 + ts, "dur": dur,
                "args": {"correlation": corr0 + corr, "stream": stream, "device": 0}}

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
    assert "CPU run" not in text and "dev busy ms" in text
    assert "top 4 kernels of 1.02 ms device time" in text
    line = next(l for l in text.splitlines() if "sm90_xmma_gemm" in l)
    assert "yes" in line and "49.0%" in line


def test_operator_self_time_excludes_nested_operators(gpu_trace):
    ops = {op["name"]: op for op in json.loads(ok(gpu_trace, "--json"))["operators"]["by_self"]}
    assert ops["aten::mm"]["total_ms"] == pytest.approx(0.200)  # two steps
    assert ops["aten::mm"]["self_ms"] == pytest.approx(0.180)
    assert ops["aten::empty"]["self_ms"] == pytest.approx(0.020)


@pytest.mark.parametrize("name, verdict", [
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
])
def test_tensor_core_heuristic(name, verdict):
    assert tensor_cores(name) == verdict


def test_union_counts_overlaps_once():
    assert union_us([(0, 10), (5, 15), (20, 30)]) == 25
    assert union_us([]) == 0
    assert Launches([]).inside(pid=1, start=0, end=10) == []  # a process that launched nothing


# ---------------------------------------------------------------------------- bad inputs

def test_missing_file(tmp_path):
    assert "nope.pt.trace.json.gz does not exist" in fails(tmp_path / "nope.pt.trace.json.gz")


@pytest.mark.parametrize("name, content", [
    ("garbage.pt.trace.json.gz", b"\x00\x01not gzip at all"),
    ("garbage.pt.trace.json", b"{this is not json"),
    ("text.pt.trace.json", b"\xff\xfe\x00binary"),
])
def test_garbage_file(tmp_path, name, content):
    (tmp_path / name).write_bytes(content)
    assert "is not a JSON trace" in fails(tmp_path / name)


def test_json_that_is_not_a_trace(tmp_path):
    (tmp_path / "x.json").write_text('{"loss": 1.0}')
    assert "not a Chrome trace" in fails(tmp_path / "x.json")


def test_trace_without_profiler_steps(tmp_path):
    events = [e for e in gpu_step(3, 0, 0) if not e["name"].startswith("ProfilerStep")]
    (tmp_path / "t.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    assert "no ProfilerStep#N events" in fails(tmp_path / "t.pt.trace.json")


def test_folder_without_traces_and_bad_flag(tmp_path):
    assert "no *.pt.trace.json* files" in fails(tmp_path)
    assert "--top must be positive" in fails(tmp_path, "--top", "0")
    assert "invalid int value" in fails(tmp_path, "--top", "many")
