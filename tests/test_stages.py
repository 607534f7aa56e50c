"""The stage registry (config.STAGES): one place names the stages, their labels and colours; the log
line, the report and the traces summary read it, and a new stage reaches every output with one
line in the registry and one `with` in the loop."""

import importlib.util
import json
import sys

from conftest import ROOT, TINY
from test_report import make_run

from minigpt import config
from minigpt.analysis import traces
from minigpt.analysis.record import StepRecord
from minigpt.analysis.report import stages_section
from minigpt.analysis.runfiles import load_run
from minigpt.core.outputs import log_lines


def test_registry_names_labels_colours_splits_and_the_steps_range():
    assert config.STAGE_NAMES == ("data_to_device", "forward", "backward", "optimizer_step")
    assert [config.STAGES[n][0] for n in config.STAGE_NAMES] == ["h2d", "fwd", "bwd", "opt"]
    assert len({colour for _, colour in config.STAGES.values()}) == len(config.STAGES)
    # DDP's backward_compute is a part of the backward, not a stage of its own
    assert config.SPLITS == {"backward_compute": "backward"}
    assert set(config.SPLITS.values()) <= set(config.STAGES) and not set(config.SPLITS) & set(config.STAGES)
    assert config.STEP_RANGE == "train_step" and config.STEP_RANGE not in config.STAGES


def record(host: dict) -> StepRecord:
    return StepRecord(
        **dict(step=10, num_steps=20, epoch=1, loss=3.0, lr=1e-3, step_time_s=0.1, tokens_per_s=1e4),
        **dict(tokens_per_s_per_rank=1e4, run_tokens=9000, run_steps=9, run_step_time_s=0.9),
        **dict(run_tokens_per_s=1e4, tokens_trained=10_000, tokens_per_s_e2e=9e3, startup_s=1.0),
        **dict(world_size=1, val_loss=None, val_ppl=None, elapsed_s=1.1, eta_s=1.0, amp="bf16"),
        **dict(mfu=0.1, achieved_tflops=0.01, stage_host_ms=host, stage_device_ms=host, steady_steps=9),
    )


def test_the_log_line_the_report_and_the_traces_summary_read_the_registry(tmp_path):
    host = {"data_to_device": 0.1, "forward": 10.0, "backward": 20.0, "optimizer_step": 2.0}
    _, stages = log_lines(record({**host, "my_range": 1.0}))
    # the registry's labels, in its order; a range it does not name is shown by its own name
    assert stages == "  stage ms: h2d 0.1 fwd 10.0 bwd 20.0 opt 2.0 my_range 1.0"
    table = stages_section(load_run(make_run(tmp_path / "r")))
    for name, (label, colour) in config.STAGES.items():
        assert f"<td>{name} ({label})</td>" in table and f'"marker":{{"color":"{colour}"}}' in table
    assert traces.default_stages() == config.STAGE_NAMES


def test_a_new_stage_reaches_the_log_metrics_tensorboard_report_and_trace(tmp_path, monkeypatch):
    # One line in the registry...
    monkeypatch.setitem(config.STAGES, "zero_grad", ("zero", "purple"))
    monkeypatch.setattr(config, "STAGE_NAMES", (*config.STAGE_NAMES, "zero_grad"))
    # ...and one `with` in the loop, in a copy of train_minimal.py.
    source = (ROOT / "train_minimal.py").read_text()
    line = "                        optimizer.zero_grad(set_to_none=True)\n"
    assert source.count(line) == 1
    source = source.replace(line, '                    with inst.stage("zero_grad"):\n' + line)
    path = tmp_path / "train_with_a_stage.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("train_with_a_stage", path)
    trainer = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, trainer)  # dataclasses look their module up there
    spec.loader.exec_module(trainer)

    out = tmp_path / "run"
    flags = ["--num-steps", "4", "--log-interval", "2", "--use-profiler", "--profile-step-start", "2"]
    assert trainer.cli([*TINY, *flags, "--profile-step-end", "4", "--out-dir", str(out)]) == 0

    log = [line for line in (out / "train.log").read_text().splitlines() if "stage ms" in line]
    assert log and all(" zero " in line for line in log)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert all("zero_grad" in r["stage_host_ms"] and "zero_grad" in r["stage_device_ms"] for r in rows)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    assert "stage_host_ms/zero_grad" in events.Tags()["scalars"]
    assert "<td>zero_grad (zero)</td>" in stages_section(load_run(out))
    (trace,) = sorted((out / "traces").glob("*.pt.trace.json.gz"))
    summary = traces.summarize(trace)
    assert all("zero_grad" in step["stages"] for step in summary["steps"])
