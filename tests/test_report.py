"""python -m minigpt report: one offline HTML page per run, every section drawn or saying why not,
a GPU trace's kernels on the timeline, one-line refusals; and, in Chromium, no request outside
file:// and no console error."""

from __future__ import annotations

import errno
import gzip
import html
import json
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
from conftest import TINY, docs_module

from minigpt.analysis.breakdown_log import MEMORY_LOG, PEAK_PARTS, parse_memory_log, peak_of_state, peak_rows
from minigpt.analysis.html import PAGE_HEAD
from minigpt.analysis.record import StepRecord
from minigpt.analysis.report import SECTIONS, fitted_range, main, write_report
from minigpt.analysis.runfiles import RunError, load_run
from minigpt.config import BUSY
from minigpt.instruments.breakdown import MemoryBreakdown, write_memory_trace

KERNEL = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"
ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<4>"
STAGE_MS = {"data_to_device": 0.5, "forward": 10.0, "backward": 20.0, "optimizer_step": 2.0}


# ---------------------------------------------------------------------------- synthetic runs


def gpu_trace_events(steps=(5, 6), kernel=KERNEL, op_ms: dict | None = None) -> list[dict]:
    """A GPU trace as torch writes one, reduced to what the report reads: ProfilerStep#N and stage
    ranges, aten ops, a launch per stage and the kernel it started (same correlation id)."""
    op_ms = op_ms or {"aten::mm": 6.0, "aten::add": 1.0}
    events, corr = [], 0
    for i, step in enumerate(steps):
        t = 100_000.0 * i
        events.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": f"ProfilerStep#{step}",
                "pid": 1,
                "tid": 1,
                "ts": t,
                "dur": 40_000,
            }
        )
        for name, ms in STAGE_MS.items():
            events.append(
                {
                    "ph": "X",
                    "cat": "user_annotation",
                    "name": name,
                    "pid": 1,
                    "tid": 1,
                    "ts": t,
                    "dur": ms * 1000,
                }
            )
            corr += 1
            events.append(
                {
                    "ph": "X",
                    "cat": "cuda_runtime",
                    "name": "cudaLaunchKernel",
                    "pid": 1,
                    "tid": 1,
                    "ts": t + 10,
                    "dur": 5,
                    "args": {"correlation": corr},
                }
            )
            events.append(
                {
                    "ph": "X",
                    "cat": "kernel",
                    "name": kernel if name != "optimizer_step" else ELEMENTWISE,
                    "pid": 0,
                    "tid": 7,
                    "ts": t + 50,
                    "dur": ms * 500,
                    "args": {"correlation": corr, "stream": 7, "device": 0},
                }
            )
            t += ms * 1000
        t = 100_000.0 * i
        for op, ms in op_ms.items():
            events.append(
                {"ph": "X", "cat": "cpu_op", "name": op, "pid": 1, "tid": 1, "ts": t + 1, "dur": ms * 1000}
            )
            t += ms * 1000 + 2
    return events


FLOPS_PER_TOKEN, PEAK = 723456, 989e12
TOKENS_PER_STEP, WARMUP_S = 4 * 64, 0.5  # --batch-size 4 x --seq-len 64; step 1, left out


def make_run(
    folder: Path,
    *,
    steps=(10, 20, 30),
    losses=None,
    tokens_per_s=1000.0,
    stage_scale=1.0,
    d_model=64,
    trace: list[dict] | None = None,
    breakdown: dict | None = None,
    world_size=1,
    amp="fp32",
    busy=0.0,
) -> Path:
    """A run directory with config.json and metrics.jsonl as the trainer writes them today (each
    record a StepRecord: step 1 its warm-up, left out; the run's figures over the steady steps;
    MFU against config.json's peak; `busy`, the share of the cores others took in every interval),
    plus a trace and a memory breakdown when given."""
    folder.mkdir(parents=True)
    losses = losses or [4.0 - 0.5 * i for i in range(len(steps))]
    (folder / "config.json").write_text(
        json.dumps(
            {
                "config": {
                    "batch_size": 4,
                    "seq_len": 64,
                    "grad_accum_steps": 1,
                    "num_steps": steps[-1],
                    "log_interval": 10,
                    "out_dir": str(folder),
                    "straggler_threshold": 0.75,
                    "use_profiler": trace is not None,
                },
                "model": {
                    "n_layers": 2,
                    "n_heads": 2,
                    "d_model": d_model,
                    "d_ff": 4 * d_model,
                    "vocab_size": 64,
                },
                "device_name": "NVIDIA H100 80GB HBM3",
                "params": 108288,
                "device": "cuda",
                "amp": amp,
                "world_size": world_size,
                "ddp_backend": None,
                "versions": {"torch": "2.13.0", "cuda": "12.8", "python": "3.11.7"},
                "peak_flops": PEAK,
                "peak_flops_dtype": "bf16",
                "peak_flops_source": "table: H100 bf16 dense",
                "flops_per_token": FLOPS_PER_TOKEN,
            }
        )
    )
    lines, prev = [], 0
    step_s = TOKENS_PER_STEP / tokens_per_s
    per_rank = tokens_per_s / world_size
    for step, loss in zip(steps, losses):
        stages = {k: v * stage_scale for k, v in STAGE_MS.items()}
        left_out = [{"step": 1, "s": WARMUP_S, "why": "warm-up"}] if prev == 0 else []
        run_steps = step - 1
        run_s = run_steps * step_s
        trained = step * TOKENS_PER_STEP * world_size
        elapsed = run_s + WARMUP_S + 0.01 * step  # and the logging
        rec = StepRecord(
            step=step,
            num_steps=steps[-1],
            epoch=1,
            loss=loss,
            lr=1e-3 / step,
            step_time_s=step_s,
            tokens_per_s=tokens_per_s,
            tokens_per_s_per_rank=per_rank,
            run_tokens=run_steps * TOKENS_PER_STEP * world_size,
            run_steps=run_steps,
            run_step_time_s=run_s,
            run_tokens_per_s=tokens_per_s,
            tokens_trained=trained,
            tokens_per_s_e2e=trained / elapsed,
            startup_s=2.0,
            world_size=world_size,
            val_loss=loss + 0.1 if step == steps[-1] else None,
            val_ppl=None,
            elapsed_s=elapsed,
            eta_s=(steps[-1] - step) * step_s,
            amp=amp,
            mfu=per_rank * FLOPS_PER_TOKEN / PEAK,
            achieved_tflops=per_rank * FLOPS_PER_TOKEN / 1e12,
            stage_host_ms=stages,
            stage_device_ms=stages,
            memory={"peak_allocated_gib": 1.0, "peak_reserved_gib": 1.5, "alloc_retries": 0, "ooms": 0},
            memory_breakdown=breakdown if breakdown and step == steps[0] else None,
            left_out=left_out,
            steady_steps=step - prev - len(left_out),
            run_left_out={"warm-up": {"steps": [1], "s": WARMUP_S}},
            busy=busy,
            run_busy=1.0 if busy > BUSY else 0.0,
            run_mfu=per_rank * FLOPS_PER_TOKEN / PEAK,
            run_achieved_tflops=per_rank * FLOPS_PER_TOKEN / 1e12,
        )
        lines.append(json.dumps(asdict(rec)))
        prev = step
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if trace is not None:
        (folder / "traces").mkdir()
        with gzip.open(folder / "traces" / "rank0_dp0.123.pt.trace.json.gz", "wt") as f:
            json.dump({"traceEvents": trace}, f)
    return folder


# ---------------------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory) -> Path:
    """A tiny profiled run with a measured memory step: every section of the report has data."""
    import train_minimal

    out = tmp_path_factory.mktemp("run") / "run"
    assert (
        train_minimal.cli(
            [
                *TINY,
                "--num-steps",
                "8",
                "--log-interval",
                "2",
                "--use-profiler",
                "--profile-step-start",
                "3",
                "--profile-step-end",
                "5",
                "--memory-profiler",
                "--out-dir",
                str(out),
            ]
        )
        == 0
    )
    return out


def test_report_of_a_profiled_cpu_run(cpu_run):
    path = write_report(cpu_run)
    assert path == cpu_run / "report.html"
    page = path.read_text()
    for sid, title in SECTIONS:
        assert f'<section id="{sid}">' in page and title in page
    assert "no trace" not in page and "no memory breakdown" not in page
    assert "ProfilerStep#3" in page and "aten::" in page  # timeline and operators from the trace
    assert "memory-sunburst" in page and "memory-estimate" in page  # memory.log and the breakdown
    assert "CPU-only trace" in page and "no kernels: a CPU-only trace" in page
    assert "one process" in page  # stragglers: not a DDP run
    # Offline: plotly.js is the run folder's one copy, loaded by a relative path; nothing else.
    assert '<script type="text/javascript" src="plotly.min.js"></script>' in page
    assert "window.Plotly" not in page and "cdn" not in page.lower() and len(page) < 1_000_000
    assert (cpu_run / "plotly.min.js").read_text().startswith("/**\n* plotly.js v")


def test_sections_without_data_say_what_records_them(tmp_path):
    run = make_run(tmp_path / "bare")
    page = write_report(run).read_text()
    assert "no trace: run with --use-profiler" in page
    # No measured step, but the CUDA peaks of each interval are plotted under the one-line note.
    assert "no memory breakdown: run with --memory-profiler" in page and "memory-process" in page
    (run / "metrics.jsonl").write_text("")
    page = write_report(run).read_text()
    assert "no memory breakdown: run with --memory-profiler" in page
    assert "the run stopped before its first log step" in page


def test_gpu_trace_puts_kernels_on_the_timeline(tmp_path):
    run = make_run(tmp_path / "gpu", trace=gpu_trace_events())
    page = write_report(run).read_text()
    assert "rank 0 device" in page and "kernels-plot" in page
    assert KERNEL in page and "tensor cores" in page
    r = load_run(run)
    assert r.traces[0]["kernels"][0]["name"] == KERNEL and r.traces[0]["kernels"][0]["tensor_cores"] == "yes"


def test_a_cut_metrics_line_is_named_not_fatal(tmp_path):
    run = make_run(tmp_path / "cut")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 40, "loss": 3.')
    r = load_run(run)
    assert len(r.metrics) == 3 and "line 4 is not JSON" in r.problems[0]
    assert "line 4 is not JSON" in write_report(run).read_text()


@pytest.mark.parametrize("what", ["missing", "file", "empty folder", "bad config"])
def test_not_a_run_is_one_line_and_exit_2(tmp_path, capsys, what):
    target = tmp_path / "x"
    if what == "file":
        target.write_text("hi")
    elif what == "empty folder":
        target.mkdir()
    elif what == "bad config":
        target.mkdir()
        (target / "config.json").write_text("{not json")
    assert main([str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0]
    assert not (target / "report.html").exists() if target.is_dir() else True
    with pytest.raises(RunError):
        write_report(target)


def test_out_flag_and_existing_report_replaced(tmp_path, capsys):
    run = make_run(tmp_path / "r")
    out = tmp_path / "elsewhere.html"
    assert main([str(run), "--out", str(out)]) == 0
    assert out.exists() and not (run / "report.html").exists()
    assert str(out) in capsys.readouterr().out


def test_a_gzip_bomb_in_the_traces_is_named_and_the_report_written(tmp_path, monkeypatch, capsys):
    from test_traces import gzip_bomb

    from minigpt.analysis import traces

    run = make_run(tmp_path / "r", trace=gpu_trace_events())
    gzip_bomb(next((run / "traces").iterdir()))  # the run's own trace file, 6 GiB once inflated
    monkeypatch.setattr(traces, "TRACE_LIMIT", 16 << 20)  # above the file, far below its text
    assert main([str(run)]) == 0
    assert "of trace text once decompressed" in (run / "report.html").read_text()
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("how", ["full disk", "no such folder"])
def test_out_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capsys, how):
    """--out on a full disk (a fault: exit 1) or where no file can be created (exit 2): one line
    naming the page and --out, the previous page intact, no temporary file left."""
    run = make_run(tmp_path / "r")
    out = tmp_path / "page.html"
    previous = PAGE_HEAD + " previous"  # an earlier page of minigpt's: replaced, were there room
    out.write_text(previous)
    if how == "full disk":
        monkeypatch.setattr(
            "minigpt.fileio.os.fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space"))
        )
    else:
        out = Path("/proc/page.html")  # /proc takes no new file, even for root
    assert main([str(run), "--out", str(out)]) == (1 if how == "full disk" else 2)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and str(out) in line and "(--out)" in line
    assert "no space left" in line if how == "full disk" else "cannot write" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.html", "r"]
    assert (tmp_path / "page.html").read_text() == previous


def test_the_predicted_step_stands_beside_the_measured_stages_with_its_error(tmp_path):
    """config.json's predicted_step (instruments/predict.py's record, written as the run started) is shown
    beside the measured medians: forward measured 10 ms, predicted 12 ms, is +20.0%."""
    run = make_run(tmp_path / "r")
    config = json.loads((run / "config.json").read_text())
    config["predicted_step"] = {
        "stage_ms": {"forward": 12.0, "backward": 15.0, "optimizer_step": 2.0},
        "bound": {"forward": "compute", "backward": "compute", "optimizer_step": "memory"},
        "tokens_per_s": 1100.0,
        "tested": True,
        "stage_ms_range": {"forward": [11.0, 13.5], "backward": [14.0, 16.25], "optimizer_step": ["x", 2]},
    }
    (run / "config.json").write_text(json.dumps(config))
    page = write_report(run).read_text()
    stages = page[page.index('<section id="stages">') : page.index('<section id="timeline">')]
    rows = re.findall(
        r"<tr><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td></tr>",
        stages,
    )
    assert ("forward", "10.00", "12.00", "+20.0%", "11.00 - 13.50", "compute") in rows
    assert ("backward", "20.00", "15.00", "-25.0%", "14.00 - 16.25", "compute") in rows
    assert ("optimizer_step", "2.00", "2.00", "+0.0%", "n/a", "memory") in rows  # a damaged range
    assert ("tokens/s per rank", "1,000", "1,100", "+10.0%", "", "") in rows
    assert "predicted / measured - 1" in stages and "untested" not in stages
    assert "predicted ms" not in write_report(make_run(tmp_path / "no prediction")).read_text()


def memory_html(page: str) -> str:
    return page[page.index('<section id="memory">') : page.index('<section id="stragglers">')]


def test_memory_section_leads_with_the_measured_peak(cpu_run):
    """The first figure of the memory section is the allocator's peak, with its stage and op, and
    the parts live then, which add up to it; the figures are memory.log's and metrics.jsonl's."""
    mem = memory_html(write_report(cpu_run).read_text())
    state = parse_memory_log((cpu_run / "memory_trace" / "rank0_dp0" / MEMORY_LOG).read_text())[-1]
    p = peak_of_state(state)
    record = load_run(cpu_run).breakdown()
    assert p["peak"] == record["peak"] and p["stage"] == record["peak_stage"] in ("forward", "backward")
    parts = {part: sum(p["parts"].get(part, {}).values()) for part in PEAK_PARTS}
    assert sum(parts.values()) == p["peak"] and parts == record["peak_parts"]  # the parts add up to it
    head = mem.index("Measured peak:")
    assert head < mem.index("memory-sunburst") < mem.index("memory-estimate")
    assert f"<b>{p['peak'] / 2**20:,.2f} MiB</b>" in mem[head : head + 200]
    assert f"during <b>{p['stage']}</b>" in mem
    assert html.escape(p["where"].removeprefix(f"{p['stage']} / ")) in mem
    assert f"{p['peak']:,} bytes" in mem
    for part, nbytes in parts.items():
        assert f"<td>{nbytes / 2**20:,.2f}</td>" in mem, part
    assert f'<td class="sum">{p["peak"] / 2**20:,.2f}</td>' in mem and "= the measured peak" in mem
    # A sum of the categories is labelled as one, never as a "total" beside the peak.
    assert "<td>total</td>" not in mem and "<td>sum of the categories</td>" in mem
    assert "is not a peak" in mem


def test_the_peak_without_memory_log_comes_from_metrics(tmp_path):
    """A run whose memory.log is gone still leads with its peak: metrics.jsonl's record."""
    record = {
        "step": 3,
        "params": 400,
        "grads": 400,
        "optimizer": 800,
        "activations": 1000,
        "activations_peak": 1000,
        "total": 2600,
        "peak": 3 * 2**20,
        "peak_stage": "backward",
        "peak_where": "backward / lm_head / MmBackward0: aten::mm",
        "peak_parts": {
            "params": 400,
            "grads": 0,
            "optimizer": 800,
            "activations": 1000,
            "temporaries": 3 * 2**20 - 2200,
            "held": 0,
        },
        "peak_activations": {"lm_head": 1000},
        "temporaries": {"backward / lm_head / MmBackward0: aten::mm": 3 * 2**20 - 2200},
        "held": {},
    }
    mem = memory_html(write_report(make_run(tmp_path / "r", breakdown=record)).read_text())
    assert (
        "Measured peak: <b>3.00 MiB</b>" in mem and "during <b>backward</b>, at lm_head / MmBackward0" in mem
    )
    assert "= the measured peak" in mem and "memory-sunburst" in mem


def unmeasured_run(folder: Path) -> Path:
    """A run whose measured step ran inside the trace window: no peak, a note saying why."""
    b = MemoryBreakdown(
        step=5,
        params={"wte.weight": 4096, "blocks.0.mlp.fc.weight": 2048},
        grads={"wte.weight": 4096, "blocks.0.mlp.fc.weight": 2048},
        optimizer={"wte.weight.exp_avg": 4096, "wte.weight.exp_avg_sq": 4096},
        activations={"blocks.0.mlp": 1024, "blocks.0.mlp.fc": 512},
        activations_peak=1536,
        activation_dtypes={"float32": 1536},
        peak_note="not measured: another profiler was running during this step",
    )
    run = make_run(folder, breakdown=b.to_record())
    write_memory_trace(b, run / "memory_trace" / "rank0_dp0")
    return run


def test_an_unmeasured_peak_says_why_and_draws_the_sum_as_a_sum(tmp_path):
    mem = memory_html(write_report(unmeasured_run(tmp_path / "r")).read_text())
    assert "Measured peak: not measured: another profiler was running during this step." in mem
    assert "a sum of parts never all live at once" in mem and "memory-sunburst" in mem
    assert "is not a peak: the step's peak was not measured." in mem


def test_one_logged_step_and_a_constant_lr_read_right(tmp_path):
    run = make_run(tmp_path / "one", steps=(10,))
    page = write_report(run).read_text()
    assert "One logged step (step 10)" in page
    assert fitted_range([3e-4]) == [0.0, 6e-4] and fitted_range([1e-3, 1e-3, 1e-3]) == [0.0, 2e-3]
    assert fitted_range([1e-3, 5e-4]) is None and fitted_range([0.0]) is None  # plotly fits those itself
    assert '"range":[0.0,0.0002]' in page  # the lr of step 10, 1e-4, mid-axis
    assert "One logged step" not in write_report(make_run(tmp_path / "three")).read_text()


def test_the_summary_reads_mfu_and_its_peak_from_the_run(tmp_path):
    """MFU over the run is the last record's run_mfu against config.json's peak, with its dtype and
    source; a record without it reads "n/a", never a figure rebuilt from tokens/s and FLOPs."""
    run = make_run(tmp_path / "r")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows[-1] |= {"run_mfu": 0.4321, "run_achieved_tflops": 427.3}  # not what the tokens/s would give
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = write_report(run).read_text()
    assert "<td>MFU over the run</td><td>43.2% (427.300 TFLOP/s achieved per device)</td>" in page
    assert "989 TFLOP/s per device (bf16, table: H100 bf16 dense)" in page
    del rows[-1]["run_mfu"], rows[-1]["run_achieved_tflops"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "<td>MFU over the run</td><td>n/a</td>" in write_report(run).read_text()


def test_the_summary_says_how_busy_the_machine_was(tmp_path):
    quiet = write_report(make_run(tmp_path / "quiet")).read_text()
    assert "quiet: other processes took at most 25% of the cores in every steady step" in quiet
    busy = write_report(make_run(tmp_path / "busy", busy=0.6)).read_text()
    assert "others took 60% of the cores in 100% of the steady steps; re-run on a quiet machine" in busy


def test_comm_time_only_where_the_trace_has_collectives(tmp_path):
    plain = write_report(make_run(tmp_path / "one", trace=gpu_trace_events())).read_text()
    assert "(comm " not in plain
    events = gpu_trace_events()
    backward = next(e for e in events if e["name"] == "backward")
    events.append(
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "c10d::allreduce_",
            "pid": 1,
            "tid": 1,
            "ts": backward["ts"] + 100,
            "dur": 3000,
        }
    )
    ddp = write_report(make_run(tmp_path / "ddp", trace=events, world_size=2)).read_text()
    assert "(comm 3.00)" in ddp and "(comm 0.00)" in ddp  # a stage without collectives, beside one with


# ---------------------------------------------------------------------------- in a browser


def _chromium_or_skip():
    import os

    if shutil.which("chromium") is None and shutil.which("chromium-browser") is None:
        if os.environ.get("CI"):
            pytest.fail("Chromium is not installed: .ci/run installs Debian's chromium before the tests")
        pytest.skip("needs Debian's chromium (apt-get install chromium)")
    return docs_module("report_screenshots")


@pytest.mark.slow
@pytest.mark.ci
def test_report_opens_offline_in_chromium(cpu_run, tmp_path):
    shots = _chromium_or_skip()
    gpu = make_run(tmp_path / "gpu", trace=gpu_trace_events(), world_size=2)
    from minigpt.analysis.compare import main as compare

    assert compare([str(cpu_run), str(gpu), "--allow-different", "--html", str(tmp_path / "cmp.html")]) == 0
    with shots.chromium() as browser:  # one browser, a page of its own for each
        states = [shots.check_page(write_report(run), browser=browser) for run in (cpu_run, gpu)]
        compared = shots.check_page(tmp_path / "cmp.html", browser=browser)
    for state in states:
        assert state["errors"] == [], state["errors"]
        assert state["outside"] == [], state["outside"]
        for s in state["sections"]:
            assert s["present"], s
            # Every chart drew (an svg or a canvas), and a section with no chart says why in a line.
            assert s["drawn"] == s["plots"], s
            assert s["plots"] or s["tables"] or s["nodata"], s
        drawn = {s["id"]: s for s in state["sections"]}
        assert all(drawn[k]["drawn"] for k in ("curves", "stages", "timeline", "operators"))
    assert drawn["memory"]["drawn"]  # the GPU run's CUDA peaks
    # The comparison's page: the same pieces, the same rules.
    assert compared["errors"] == [] and compared["outside"] == []
    present = [s for s in compared["sections"] if s["present"]]
    assert len(present) == 5 and all(s["drawn"] == s["plots"] for s in present)


@pytest.mark.slow
@pytest.mark.ci
def test_memory_charts_draw_every_slice_without_a_console_warning(cpu_run, tmp_path):
    """The sunburst of the report and each chart beside memory.log draw one sector per row, with no
    console error, warning or trace (plotly's "Failed to build sunburst hierarchy" is a trace)."""
    shots = _chromium_or_skip()
    run = load_run(cpu_run)
    rows = peak_rows(peak_of_state(run.memory[0])["parts"])
    with shots.chromium() as browser:  # one browser, a page of its own for each
        state = shots.check_page(write_report(cpu_run), browser=browser)
        assert state["errors"] == [], state["errors"]
        memory = {s["id"]: s for s in state["sections"]}["memory"]
        assert memory["slices"] == len(rows) > 1 + len(PEAK_PARTS), memory
        state = shots.check_page(write_report(unmeasured_run(tmp_path / "u")), browser=browser)
        assert state["errors"] == [] and {s["id"]: s for s in state["sections"]}["memory"]["slices"] >= 8
        for chart in sorted(run.memory[0]["folder"].glob("*_sunburst.html")):
            state = shots.check_page(chart, browser=browser)
            assert state["errors"] == [] and state["slices"] > 1, (chart.name, state["errors"])


def test_stage_bars_keep_their_width_when_logged_steps_are_close(tmp_path):
    """A stopped and resumed run logs steps 1 apart (13, 14) among steps 10 apart: each logged step
    is one slot of the stage chart's axis, so no bar is drawn hair-thin."""
    from minigpt.analysis.report import stages_section

    run = load_run(make_run(tmp_path / "r", steps=(10, 13, 14, 20, 30)))
    page = stages_section(run)
    axes = re.findall(
        r'"xaxis\d?":\{"anchor":"y\d?","domain":\[[^]]*\],"title":\{"text":"logged step"\},"type":"(\w+)"',
        page,
    )
    assert axes and set(axes) == {"category"}, "a numeric step axis"


def test_the_loss_curve_draws_a_val_point_only_where_the_run_evaluated(tmp_path):
    from minigpt.analysis.report import evaluated

    folder = make_run(tmp_path / "r", steps=(10, 20, 30, 40))
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    for r, v in zip(rows, (None, 4.57, None, 4.26)):
        r["val_loss"] = v
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert evaluated(load_run(folder)) == [(20, 4.57), (40, 4.26)]
