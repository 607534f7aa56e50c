"""The stage registry (minigpt/stages.py): one place names the stages, and a new one reaches every
output with one line in the registry and one `with` in the loop."""

import importlib.util
import json
import sys

from conftest import ROOT, TINY

from minigpt import stages
from minigpt.analysis import traces
from minigpt.instruments.straggler import rank_figures, scored_stages


def test_registry_names_labels_colours_and_scoring():
    assert stages.STAGE_NAMES == ("data_to_device", "forward", "backward", "optimizer_step")
    assert [stages.label(n) for n in stages.STAGE_NAMES] == ["h2d", "fwd", "bwd", "opt"]
    assert len({stages.color(n) for n in stages.STAGE_NAMES}) == len(stages.STAGE_NAMES)
    # the backward holds DDP's all-reduce: its compute part is scored in its place
    assert scored_stages() == ("data_to_device", "forward", "optimizer_step", "backward_compute")
    assert stages.stage("my_range").label == "my_range"  # an unregistered range is shown, not dropped


def test_a_new_stage_reaches_the_log_metrics_tensorboard_stragglers_and_trace(tmp_path, monkeypatch):
    # One line in the registry...
    new = stages.Stage("zero_grad", "zero", "purple")
    monkeypatch.setattr(stages, "STAGES", (*stages.STAGES, new))
    monkeypatch.setattr(stages, "STAGE_NAMES", (*stages.STAGE_NAMES, new.name))
    monkeypatch.setitem(stages.LABELS, new.name, new.label)  # what the registry's line gives at import
    monkeypatch.setitem(stages.COLORS, new.name, new.color)
    # ...and one `with` in the loop, in a copy of train_minimal.py.
    source = (ROOT / "train_minimal.py").read_text()
    line = "                    optimizer.zero_grad(set_to_none=True)\n"
    assert source.count(line) == 1
    source = source.replace(line, '                    with inst.stage("zero_grad"):\n    ' + line)
    path = tmp_path / "train_with_a_stage.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("train_with_a_stage", path)
    trainer = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, trainer)  # dataclasses look their module up there
    spec.loader.exec_module(trainer)

    out = tmp_path / "run"
    flags = [
        "--num-steps",
        "4",
        "--log-interval",
        "2",
        "--use-profiler",
        "--profile-step-start",
        "2",
        "--profile-step-end",
        "4",
        "--out-dir",
        str(out),
    ]
    assert trainer.cli([*TINY, *flags]) == 0

    log_lines = [line for line in (out / "train.log").read_text().splitlines() if "stage ms" in line]
    assert log_lines and all(" zero " in line for line in log_lines)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert all("zero_grad" in r["stage_host_ms"] and "zero_grad" in r["stage_device_ms"] for r in rows)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    assert "stage_host_ms/zero_grad" in events.Tags()["scalars"]

    figures = rank_figures(
        0, "host", [10.0, 10.0], [{**{s: 1.0 for s in stages.STAGE_NAMES}, "zero_grad": 5.0}] * 2
    )
    assert figures["stages_ms"]["zero_grad"] == 5.0
    assert (
        figures["scored_ms"] == 1.0 * 3 + 1.0 + 5.0
    )  # h2d, fwd, opt, the backward (no DDP split), the new one

    (trace,) = sorted((out / "traces").glob("*.pt.trace.json.gz"))
    summary = traces.summarize(trace)
    assert all("zero_grad" in step["stages"] for step in summary["steps"])
