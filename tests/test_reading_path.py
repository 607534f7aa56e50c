"""The reading path (design: a reader follows one training step in an afternoon): what a default run
has loaded of the project by its first step, and what it has not. Everything beside the step (the
profiler window, the memory breakdown, the estimator and predictor, FSDP/TP and stragglers, the
checkpoint's reader, the report and the other tools) loads only when its flag or its command asks."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
from conftest import ROOT

import train_minimal

# What a default run (tiny preset) may have loaded before its first step, and the lines they hold
# together: the design's budget, 3,000 lines. STEP_LINES holds what runs today through set-up and the
# first two steps (in the files of STEP_PATH), so that a change cannot quietly add to it; the lines
# are counted as the design counts them: a def's line and the lines run in its body, module bodies not.
READING_PATH = {
    "train_minimal.py",
    "minigpt/__init__.py",
    "minigpt/core/__init__.py",
    "minigpt/instruments/__init__.py",
    "minigpt/core/config.py",
    "minigpt/core/model.py",
    "minigpt/core/data.py",
    "minigpt/core/runs.py",
    "minigpt/instruments/instrument.py",
    "minigpt/step_record.py",
    "minigpt/stages.py",
    "minigpt/errors.py",
    "minigpt/ranks.py",
    "minigpt/paths.py",
}
LOADED_LINES = 3000
STEP_PATH = {
    "train_minimal.py",
    "minigpt/core/config.py",
    "minigpt/core/model.py",
    "minigpt/core/data.py",
    "minigpt/core/runs.py",
    "minigpt/instruments/instrument.py",
}
STEP_LINES = 859  # measured on a CPU with AVX512-BF16 and no AMX, where MFU reads two peaks
BESIDE = (
    "minigpt.instruments.window",
    "minigpt.instruments.breakdown",
    "minigpt.instruments.estimate",
    "minigpt.instruments.predict",
    "minigpt.instruments.straggler",
    "minigpt.core.distributed",
    "minigpt.core.parallel",
    "minigpt.core.checkpoint",
    "minigpt.analysis.report",
    "minigpt.analysis.traces",
    "minigpt.core.checks",
    "minigpt.core.flaghelp",
    "minigpt.core.tokens",
    "minigpt.core.chunked_loss",
    "minigpt.core.shape",
)


@pytest.fixture(autouse=True)
def _modules_as_they_were():
    """The other tests hold the project's modules they imported (and patch them): give those back."""
    before = {k: v for k, v in sys.modules.items() if k.startswith("minigpt")}
    yield
    for name in [k for k in sys.modules if k.startswith("minigpt") and k not in before]:
        del sys.modules[name]
    for name, module in before.items():
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent in before:
            setattr(before[parent], child, module)


def forget_beside() -> None:
    """This interpreter forgets the project's modules beyond the reading path (an earlier run or test
    loaded them), as a fresh process would not have them."""
    for name, module in list(sys.modules.items()):
        f = Path(getattr(module, "__file__", None) or "").resolve()
        rel = f.relative_to(ROOT).as_posix() if f.is_relative_to(ROOT) else None
        if name.startswith("minigpt.") and rel not in READING_PATH:
            del sys.modules[name]


def loaded_by_step_1(tmp_path, *flags: str) -> dict[str, int]:
    """The project's modules a run in this interpreter has loaded as step 1 begins, with their lines."""
    seen: dict[str, int] = {}

    def on_step(n: int) -> None:
        if n == 1:
            for module in list(sys.modules.values()):
                f = Path(getattr(module, "__file__", None) or "")
                mine = f.is_absolute() and f.is_file() and f.resolve().is_relative_to(ROOT)
                rel = f.resolve().relative_to(ROOT).as_posix() if mine else ""
                if rel == "train_minimal.py" or rel.startswith("minigpt/"):  # the project's, not its tests'
                    seen[rel] = len(f.read_text().splitlines())

    out = str(tmp_path / "run")
    assert train_minimal.cli(["--preset", "tiny", "--num-steps", "2", "--out-dir", out, *flags], on_step) == 0
    return seen


def test_a_default_run_loads_the_reading_path_and_nothing_beside_it(tmp_path, monkeypatch):
    """The second run on a machine: the first measured its MFU peak (minigpt/instruments/mfu.py),
    once, into the cache the others read (on a quiet machine: a figure taken under load is taken
    again at a later start)."""
    from minigpt.instruments import mfu

    monkeypatch.setattr(mfu.LoadProbe, "others", lambda self: 0.0)
    loaded_by_step_1(tmp_path / "first")
    forget_beside()
    seen = loaded_by_step_1(tmp_path)
    assert set(seen) <= READING_PATH, sorted(set(seen) - READING_PATH)
    assert sum(seen.values()) <= LOADED_LINES, seen


def test_a_flag_loads_its_room(tmp_path):
    forget_beside()
    seen = loaded_by_step_1(
        tmp_path, "--use-profiler", "--profile-step-start", "1", "--profile-step-end", "2"
    )
    assert "minigpt/instruments/window.py" in seen and "minigpt/analysis/report.py" not in seen


def test_set_up_and_two_steps_run_in_the_step_paths_files(tmp_path, monkeypatch):
    """What a reader follows: the distinct lines of the project that run from main() to the start of
    step 3 (a log line at step 2 included), in six files."""
    from minigpt.instruments import mfu

    monkeypatch.setattr(mfu.LoadProbe, "others", lambda self: 0.0)
    loaded_by_step_1(tmp_path / "first")  # the MFU peak measured once, as on a machine's first run
    root = str(ROOT) + "/"
    lines: dict[str, set[int]] = {}
    phase = ["steps 1-2"]

    def tracer(frame, event, arg):
        f = frame.f_code.co_filename
        skip = ("/tests/", "/.venv/", "/site-packages/")
        if not f.startswith(root) or any(s in f for s in skip) or frame.f_code.co_name == "<module>":
            return None
        if phase[0] != "steps 1-2":
            return None
        lines.setdefault(f, set()).add(frame.f_code.co_firstlineno)

        def local(frame, event, arg):
            if event == "line" and phase[0] == "steps 1-2":
                lines[frame.f_code.co_filename].add(frame.f_lineno)
            return local

        return local

    def on_step(n: int) -> None:
        if n == 3:
            phase[0] = "the rest"

    flags = [
        "--preset",
        "tiny",
        "--num-steps",
        "4",
        "--log-interval",
        "2",
        "--out-dir",
        str(tmp_path / "run"),
    ]
    sys.settrace(tracer)
    threading.settrace(tracer)
    try:
        assert train_minimal.main(flags, on_step) == 0
    finally:
        sys.settrace(None)
        threading.settrace(None)
    files = {Path(f).relative_to(ROOT).as_posix(): len(n) for f, n in lines.items() if n}
    assert set(files) <= STEP_PATH, sorted(set(files) - STEP_PATH)
    assert sum(files.values()) <= STEP_LINES, files
