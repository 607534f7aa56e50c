"""The third hostile round (issue 33): output paths that name a run's own files, checkpoints damaged
byte by byte, paths of the wrong type, a trace of overlapping ranges, contradictory flags. Each
case ends with exit 2 and one line (a fault: exit 1 and one line), and nothing written before is
lost or changed.

COUNTS says how many bad inputs this file tries (tests/test_hostile.py adds them up)."""

import hashlib
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import FAST, TINY
from hypothesis import given, settings
from hypothesis import strategies as st

import train_minimal
from minigpt.analysis import compare, html, report, traces
from minigpt.config import INTERRUPTED_LINE, UsageError, parse_args
from minigpt.core.checkpoint import CHECKSUM_KEY, load_checkpoint, save_checkpoint, state_crc
from minigpt.fileio import check_may_replace
from sample import cli as sample_cli

PAGE_EXAMPLES = int(os.environ.get("MINIGPT_PAGE_EXAMPLES", 100))  # ~1 ms each
SWEEP_EXAMPLES = int(os.environ.get("MINIGPT_SWEEP_EXAMPLES", 100))  # ~1 ms each
DAMAGE_EXAMPLES = int(os.environ.get("MINIGPT_DAMAGE_EXAMPLES", 150))  # ~10 ms each: a load


def tree(root: Path) -> dict[str, str]:
    """Every file under root with a digest of its bytes: 'nothing lost' made checkable."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink() and not p.name.startswith(".")
    }


def one_line_exit_2(capsys, status: int) -> str:
    err = capsys.readouterr().err
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """One tiny run of 2 steps with its checkpoint, a user's notes and a link beside them."""
    out = tmp_path_factory.mktemp("lost") / "run"
    assert train_minimal.cli([*FAST, "--num-steps", "2", "--log-interval", "1", "--out-dir", str(out)]) == 0
    (out / "notes.txt").write_text("a user's own file\n")
    (out / "link-to-config.json").symlink_to(out / "config.json")
    os.mkfifo(out / "fifo")
    return out


# ---------------------------------------------------------------------------- 1. output paths

# What a tool's output path may name that it must not replace: the run's own files, a checkpoint,
# a user's file, a link to the config, a FIFO (not a regular file at all).
TARGETS = [
    "config.json",
    "metrics.jsonl",
    "train.log",
    "checkpoints/ckpt.pt",
    "notes.txt",
    "link-to-config.json",
    "fifo",
]


def report_to(run: Path, target: str, *more: str) -> int:
    return report.main([str(run), "--out", str(run / target), *more])


def compare_to(run: Path, target: str, *more: str) -> int:
    return compare.main([str(run), str(run), "--html", str(run / target), *more])


TOOLS = {"report --out": report_to, "compare --html": compare_to}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("tool", TOOLS)
def test_an_output_path_never_replaces_a_file_the_tool_did_not_write(capsys, run, tool, target):
    before = tree(run)
    msg = one_line_exit_2(capsys, TOOLS[tool](run, target))
    assert target in msg, msg
    assert "--force" in msg or "FIFO" in msg, msg
    assert tree(run) == before


def test_a_tools_own_earlier_page_is_replaced_and_force_replaces_a_users_file(capsys, run, tmp_path):
    """The page a tool wrote is its own to rewrite; --force is the user saying so for another file.
    Neither touches the run's files."""
    page, notes = tmp_path / "page.html", tmp_path / "notes.txt"
    notes.write_text("mine\n")
    before = tree(run)
    assert report.main([str(run), "--out", str(page)]) == 0
    first = page.read_bytes()
    assert first.startswith(html.PAGE_HEAD.encode())
    assert compare.main([str(run), str(run), "--html", str(page)]) == 0  # compare's over report's
    assert page.read_bytes() != first
    assert one_line_exit_2(capsys, report.main([str(run), "--out", str(notes)]))
    assert notes.read_text() == "mine\n"
    assert report.main([str(run), "--out", str(notes), "--force"]) == 0
    assert notes.read_bytes().startswith(html.PAGE_HEAD.encode())
    assert tree(run) == before


@settings(max_examples=PAGE_EXAMPLES, deadline=None, derandomize=True)
@given(
    cut=st.integers(0, len(html.PAGE_HEAD)),
    tail=st.binary(max_size=40),
    tool=st.sampled_from(["--out", "--html"]),
)
def test_only_a_page_that_begins_as_minigpts_own_is_replaced(tmp_path_factory, cut, tail, tool):
    """Any file that begins with less than a page of minigpt's head (however nearly) is refused in
    one line and left as it was; one that begins with all of it is the tool's own to rewrite."""
    path = tmp_path_factory.mktemp("page") / "out.html"
    content = html.PAGE_HEAD.encode()[:cut] + tail
    path.write_bytes(content)
    if content.startswith(html.PAGE_HEAD.encode()):
        html.check_page_path(path, tool)
        return
    with pytest.raises(UsageError) as e:
        html.check_page_path(path, tool)
    assert "\n" not in str(e.value) and tool in str(e.value) and "--force" in str(e.value)
    assert path.read_bytes() == content
    html.check_page_path(path, tool, force=True)  # told to: allowed


@pytest.mark.parametrize("target", ["config.json", "metrics.jsonl", "checkpoints/ckpt.pt", "notes.txt"])
def test_a_memory_snapshot_path_never_replaces_what_is_not_a_snapshot(run, target):
    """CUDA only at run time (--record-memory-history), so checked here as the trainer checks it
    at start-up: a run's files are refused, an earlier snapshot (a pickle) is replaced."""
    from minigpt.instruments.window import SNAPSHOT_MARKER

    with pytest.raises(UsageError, match="name another path") as e:
        check_may_replace(
            run / target, SNAPSHOT_MARKER, "--memory-snapshot-path", "minigpt", fix="name another path"
        )
    assert "\n" not in str(e.value)
    earlier = run.parent / "snap.pickle"
    earlier.write_bytes(pickle.dumps({"segments": []}))
    check_may_replace(earlier, SNAPSHOT_MARKER, "--memory-snapshot-path", "minigpt", fix="name another path")


def test_even_force_does_not_write_through_a_fifo(capsys, run):
    before = tree(run)
    assert "FIFO" in one_line_exit_2(capsys, report_to(run, "fifo", "--force"))
    assert (run / "fifo").is_fifo() and tree(run) == before


# ---------------------------------------------------------------------------- 2. damaged checkpoints


def copy_run(run: Path, tmp_path: Path) -> Path:
    """The run's checkpoint, config and metrics in a fresh folder of its own to resume in."""
    out = tmp_path / "run"
    for name in ("config.json", "metrics.jsonl", "train.log", "checkpoints/ckpt.pt"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes((run / name).read_bytes())
    return out


def zero_64_bytes_in_the_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(64)
    path.write_bytes(bytes(data))


def nan_weights(path: Path) -> None:
    state = torch.load(path, weights_only=True)
    next(iter(state["model"].values())).fill_(float("nan"))
    save_checkpoint(path, state)  # a checksum that matches: the NaN is found on its own


def inf_moment(path: Path) -> None:
    state = torch.load(path, weights_only=True)
    state["optimizer"]["state"][0]["exp_avg_sq"][0] = float("inf")
    save_checkpoint(path, state)


def edited_without_checksum_update(path: Path) -> None:
    state = torch.load(path, weights_only=True)
    state["step"] = 1
    torch.save(state, path)


def before_checksums(state: dict) -> dict:
    """A checkpoint as the versions before checksums wrote it: no checksum."""
    return {k: v for k, v in state.items() if k != CHECKSUM_KEY}


def old_without_checksum_nan(path: Path) -> None:
    state = before_checksums(torch.load(path, weights_only=True))
    next(iter(state["model"].values()))[0] = float("nan")
    torch.save(state, path)


def checksum_a_string(path: Path) -> None:
    state = torch.load(path, weights_only=True)
    state[CHECKSUM_KEY] = "ok"
    torch.save(state, path)


def truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])


# (name, damage, what the one line says)
DAMAGE = [
    ("64 zeroed bytes", zero_64_bytes_in_the_middle, "damaged"),
    ("NaN weights", nan_weights, "holds NaN or inf"),
    ("an inf moment", inf_moment, "optimizer.state.0.exp_avg_sq holds NaN or inf"),
    ("edited, old checksum", edited_without_checksum_update, "do not match the checksum"),
    ("old format, NaN", old_without_checksum_nan, "carries no checksum"),
    ("checksum a string", checksum_a_string, "do not match the checksum"),
    ("truncated", truncated, "truncated"),
]


@pytest.mark.parametrize("name, damage, expected", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_a_damaged_checkpoint_is_refused_by_resume_and_sample(capsys, run, tmp_path, name, damage, expected):
    refused_by_resume_and_sample(capsys, run, tmp_path, damage, expected)


def refused_by_resume_and_sample(capsys, run: Path, tmp_path: Path, damage, expected: str) -> None:
    """The run's checkpoint damaged: --resume and sample.py each refuse it in one line naming
    `expected`, and the run directory is as it was (no fresh checksum saved over the damage)."""
    out = copy_run(run, tmp_path)
    ckpt = out / "checkpoints" / "ckpt.pt"
    damage(ckpt)
    before = tree(out)
    status = train_minimal.cli([*FAST, "--resume", "--num-steps", "4", "--out-dir", str(out)])
    msg = one_line_exit_2(capsys, status)
    assert expected in msg and str(ckpt) in msg and "permissions" not in msg and "lower --lr" not in msg, msg
    assert tree(out) == before
    msg = one_line_exit_2(capsys, sample_cli(["--out-dir", str(out), "--max-new-tokens", "2"]))
    assert expected in msg, msg


def test_an_old_checkpoint_without_a_checksum_is_refused_in_one_line(run, tmp_path):
    """No shim for what earlier versions wrote: a checkpoint without its checksum is not loaded."""
    state = before_checksums(torch.load(run / "checkpoints" / "ckpt.pt", weights_only=True))
    torch.save(state, tmp_path / "old.pt")
    with pytest.raises(UsageError) as e:
        load_checkpoint(tmp_path / "old.pt")
    assert "carries no checksum" in str(e.value) and "\n" not in str(e.value)


def test_a_malicious_protocol_4_pickle_is_one_line_without_torchs_warning(capsys, tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    bad = tmp_path / "ckpt.pt"
    bad.write_bytes(pickle.dumps({"model": Evil()}, protocol=4))
    with warnings.catch_warnings(record=True) as caught:  # pytest would hide them from stderr
        warnings.simplefilter("always")
        msg = one_line_exit_2(capsys, sample_cli(["--checkpoint", str(bad), "--max-new-tokens", "2"]))
    assert not caught and "not a checkpoint" in msg, (msg, [str(w.message) for w in caught])
    assert not (tmp_path / "ran").exists()


@settings(max_examples=DAMAGE_EXAMPLES, deadline=None, derandomize=True)
@given(where=st.floats(0, 1, exclude_max=True), length=st.integers(1, 64), byte=st.integers(0, 255))
def test_any_overwritten_bytes_are_refused_or_change_nothing(run, where, length, byte):
    """Bytes overwritten anywhere in the file: the load refuses in one line, or what it loads is
    exactly what was saved (the bytes were padding, a timestamp, or already that value)."""
    original = (run / "checkpoints" / "ckpt.pt").read_bytes()
    data = bytearray(original)
    at = int(where * len(data))
    data[at : at + length] = bytes([byte]) * len(data[at : at + length])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt.pt"
        path.write_bytes(bytes(data))
        try:
            state = load_checkpoint(path)
        except UsageError as e:
            assert "\n" not in str(e) and str(path) in str(e), str(e)
            return
    saved = torch.load(run / "checkpoints" / "ckpt.pt", weights_only=True)
    assert state_crc(state) == saved[CHECKSUM_KEY]["crc32"]  # load_checkpoint drops the proven checksum


@pytest.mark.parametrize("damage", ["NaN in a shard", "64 zeroed bytes in the extra file"])
def test_a_damaged_sharded_checkpoint_is_refused(tmp_path, damage):
    """DCP's shards carry no checksum (they may be resharded): what is loaded must be finite. Each
    rank's extra file carries one, as a one-file checkpoint does."""
    from test_parallel import _tiny

    from minigpt.core.checkpoint import load_sharded, save_sharded

    model, opt = _tiny()
    if damage == "NaN in a shard":
        with torch.no_grad():
            next(model.parameters())[0] = float("nan")
    save_sharded(tmp_path / "ck", model, opt, {"step": 1, "rng": torch.arange(200, dtype=torch.uint8)})
    if damage != "NaN in a shard":
        zero_64_bytes_in_the_middle(tmp_path / "ck" / "extra_rank0.pt")
    other, opt2 = _tiny()
    with pytest.raises(UsageError, match="is damaged") as e:
        load_sharded(tmp_path / "ck", other, opt2)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------- 3. paths of the wrong type


def make_dir(name: str):
    return lambda out: (out / name).mkdir()


def make_file(name: str):
    return lambda out: (out / name).write_text("not a folder\n")


def make_fifo(name: str):
    return lambda out: os.mkfifo(out / name)


# (what is put in the resumed run's directory, the path the one line names)
WRONG_KIND = [
    ("tb a file", make_file("tb"), "tb"),
    ("traces a file", make_file("traces"), "traces"),
    ("snapshots a file", make_file("snapshots"), "snapshots"),
    ("memory_trace a file", make_file("memory_trace"), "memory_trace"),
    ("metrics.jsonl a folder", make_dir("metrics.jsonl"), "metrics.jsonl"),
    ("train.log a folder", make_dir("train.log"), "train.log"),
    ("config.json a folder", make_dir("config.json"), "config.json"),
    ("stragglers.jsonl a folder", make_dir("stragglers.jsonl"), "stragglers.jsonl"),
    ("report.html a folder", make_dir("report.html"), "report.html"),
    ("train.log a FIFO", make_fifo("train.log"), "train.log"),
]


@pytest.mark.parametrize("name, put, named", WRONG_KIND, ids=[w[0] for w in WRONG_KIND])
def test_a_path_of_the_wrong_kind_in_a_resumed_run_is_one_line(capsys, run, tmp_path, name, put, named):
    out = copy_run(run, tmp_path)
    for existing in ("config.json", "train.log", "metrics.jsonl"):  # replaced by the wrong kind
        if name.startswith(existing):
            (out / existing).unlink()
    put(out)
    before = tree(out)
    status = train_minimal.cli([*FAST, "--resume", "--num-steps", "4", "--out-dir", str(out)])
    msg = one_line_exit_2(capsys, status)
    assert named in msg and "--out-dir" in msg, msg
    assert tree(out) == before


@pytest.mark.parametrize("where", ["a file", "under /proc"])
def test_a_cache_that_cannot_be_written_costs_a_warning_not_the_rates(capsys, tmp_path, monkeypatch, where):
    """The CPU's measured peak is used and printed; the cache that cannot take it is named in one
    line."""
    from minigpt.instruments import peak as mfu

    cache = tmp_path / "cache"
    if where == "a file":
        cache.write_text("a file where the cache folder should be\n")
    else:
        cache = Path("/proc/minigpt-cache")
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(cache))

    def measure(device, dtype, n):
        return {"best": 1e9, "calls": 3, "date": "now", "what": f"matmul {n}", "others": 0}

    monkeypatch.setattr(mfu, "measure", measure)
    peak = mfu.measured("cpu", "fp32")
    assert peak.value == 1e9 and peak.source.startswith("measured now")
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("note: the MFU peak is not cached") and str(cache) in line, line
    if where == "a file":
        assert cache.read_text() == "a file where the cache folder should be\n"


def test_estimate_times_rates_survive_a_cache_that_cannot_be_written(capsys, tmp_path, monkeypatch):
    """estimate --time's rates (a minute of measuring at GPT-2's size) are used though the cache
    folder is a file: one warning line, the rates returned, the file untouched."""
    from minigpt.instruments import predict

    cache = tmp_path / "cache"
    cache.write_text("not a folder\n")
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(cache))
    monkeypatch.setattr(predict, "measure_bandwidth", lambda device: {"1024": [1e9, 1e9]})
    monkeypatch.setattr(predict, "measure_exp", lambda device: [1e8, 1e8])
    monkeypatch.setattr(predict, "measure_overhead", lambda device: {"forward": [1e-6, 1e-6]})
    monkeypatch.setattr(predict, "measure_kernel", lambda *a, **k: {"rounds": [1e10, 1e10], "cold": [5e9]})
    monkeypatch.setattr(predict, "busy_share", lambda *a: 0.0)  # a quiet machine: rates that are kept
    rates = predict.step_rates("cpu", "fp32", ["mm 8x8x8"])
    assert rates.matmul["mm 8x8x8"] > 0 and rates.exps_per_s == 1e8 and "not cached" in rates.source
    err = capsys.readouterr().err.strip().splitlines()
    (line,) = [x for x in err if not x.startswith("[rates] ")]  # the progress lines aside
    assert line.startswith("note: the step's rates are not cached") and str(cache) in line, line
    assert cache.read_text() == "not a folder\n"


# ---------------------------------------------------------------------------- 4. overlapping ranges


def overlapping_trace(path: Path, n: int, cat: str = "user_annotation", seed: int = 0) -> Path:
    """n ProfilerStep#N ranges and n forward ranges, at random, overlapping, in random order: the
    4.5 MB trace (n = 20,000) that ran past 120 s when each step scanned every range."""
    rng = random.Random(seed)
    events = []
    for i in range(n):
        for name, longest in ((f"ProfilerStep#{i}", 2e5), ("forward", 2e4)):
            ts = round(rng.uniform(0, 1e6), 3)
            events.append(
                {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": round(rng.uniform(0, longest), 3)}
            )
            events[-1].update(pid=1, tid=1)
    rng.shuffle(events)
    path.write_text(json.dumps({"traceEvents": events}))
    return path


@pytest.mark.parametrize("cat", ["user_annotation", "cpu_op"])
def test_a_trace_of_20000_overlapping_steps_reads_in_seconds(capsys, tmp_path, cat):
    """Loose bound (the machine may be busy): the time grows with the events, not their overlaps."""
    trace = overlapping_trace(tmp_path / "t.json", 20_000, cat)
    began = time.monotonic()
    assert traces.main([str(trace)]) == 0
    assert time.monotonic() - began < 20
    assert "20000 profiled step(s)" in capsys.readouterr().out


def test_a_trace_of_20000_processes_and_collectives_reads_in_seconds(capsys, tmp_path):
    """Each step on a process of its own, stage ranges on random ones, 20,000 collectives under
    20,000 overlapping forwards: each range's wait is two binary searches, not a scan."""
    rng = random.Random(1)
    events = []
    for i in range(20_000):
        for name, cat, longest, pid in (
            (f"ProfilerStep#{i}", "user_annotation", 2e5, i),
            ("backward", "user_annotation", 2e4, rng.randrange(20_000)),
            ("c10d::allreduce_", "cpu_op", 50, 0),
            ("forward", "user_annotation", 2e4, 0),
        ):
            ts, dur = round(rng.uniform(0, 1e6), 3), round(rng.uniform(0, longest), 3)
            events.append({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": 1})
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    began = time.monotonic()
    assert traces.main([str(trace)]) == 0
    assert time.monotonic() - began < 30
    assert "20000 profiled step(s)" in capsys.readouterr().out


def brute_force(ranges, windows):
    """What contained_sums answers, one range and one window at a time."""
    out = []
    for start, end in windows:
        inside = [r for r in ranges if start - traces.EPS_US <= r[0] and r[1] <= end + traces.EPS_US]
        out.append((len(inside), sum(r[2] for r in inside), sum(r[3] for r in inside)))
    return out


TIMES = st.integers(0, 40).map(lambda t: t / 4)  # a coarse grid: ties and shared edges are common


@settings(max_examples=SWEEP_EXAMPLES, deadline=None, derandomize=True)
@given(
    ranges=st.lists(st.tuples(TIMES, TIMES, st.floats(0, 1e3, allow_nan=False)), max_size=30),
    windows=st.lists(st.tuples(TIMES, TIMES), max_size=15),
)
def test_the_sweep_finds_what_a_scan_finds(ranges, windows):
    ranges = [(ts, ts + d, traces.exact(d), traces.exact(w)) for ts, d, w in ranges]
    windows = [(s, s + d) for s, d in windows]
    assert traces.contained_sums(ranges, windows) == brute_force(ranges, windows)


def test_overlapping_steps_on_two_processes_count_each_stage_once_per_step(tmp_path):
    """A small case by hand: steps 1 and 2 overlap; forwards on two processes; a collective."""

    def x(name, ts, dur, pid=1, cat="user_annotation"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": 1}

    events = [
        x("ProfilerStep#1", 0, 100),
        x("ProfilerStep#2", 50, 100),
        x("ProfilerStep#3", 0, 200, pid=2),
        x("forward", 10, 30),  # in step 1 only
        x("forward", 60, 30),  # in steps 1 and 2
        x("forward", 120, 20),  # in step 2 only
        x("forward", 0, 150),  # in no step of process 1 (longer than each)
        x("forward", 5, 10, pid=2),  # process 2's step only
        x("backward", 100, 40),  # in step 2
        x("c10d::allreduce_", 110, 10, cat="cpu_op"),  # backward waits 10 us on it
    ]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    steps = {r["step"]: r["stages"] for r in traces.summarize(trace)["steps"]}
    assert {n: (s["calls"], s["host_ms"]) for n, s in steps[1].items()} == {"forward": (2, 0.06)}
    assert steps[2]["forward"]["calls"] == 2 and steps[2]["forward"]["host_ms"] == pytest.approx(0.05)
    assert steps[2]["forward"]["comm_host_ms"] == 0 and steps[2]["backward"]["comm_host_ms"] == pytest.approx(
        0.01
    )
    assert steps[2]["backward"]["comm_kind"] == "all-reduce"
    assert {n: (s["calls"], s["host_ms"]) for n, s in steps[3].items()} == {"forward": (1, 0.01)}


# ---------------------------------------------------------------------------- 5. Ctrl-C during start-up

ROOT = Path(__file__).resolve().parents[1]
# Ctrl-C during an import (torch's: seconds), made certain: a real SIGINT as the import starts.
INTERRUPT_AT_IMPORT = """
import builtins, os, runpy, signal, sys, time
real = builtins.__import__
how, target, at, *args = sys.argv[1:]
def imp(name, *a, **k):
    if name == at:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the handler runs here, as it would inside the import
    return real(name, *a, **k)
builtins.__import__ = imp
sys.argv = ["-m" if how == "module" else target, *args]
if how == "module":
    import minigpt  # as python -m imports the package first, argv[0] still "-m"
    sys.argv[0] = target
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    runpy.run_path(target, run_name="__main__")
"""


@pytest.mark.parametrize(
    "how, target, at",
    [
        ("path", "train_minimal.py", "torch"),
        ("path", "sample.py", "torch"),
        ("module", "minigpt", "minigpt.analysis.runfiles"),  # python -m minigpt report: no torch
    ],
)
def test_ctrl_c_during_an_import_is_one_line_and_status_130(tmp_path, how, target, at):
    env = {**os.environ, "MINIGPT_MALLOC": "glibc", "PYTHONPATH": str(ROOT)}
    args = ["report", str(tmp_path)] if how == "module" else ["--help"]
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPT_AT_IMPORT, how, target, at, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 130 and len(lines) == 1 and "interrupted (Ctrl-C)" in lines[0], done.stderr


def test_ctrl_c_while_the_trainer_starts_is_one_line_and_status_130(tmp_path):
    """A real SIGINT a second in: importing torch, building, or (on a fast machine) training,
    where the signal stops the run at a step. Each ends with status 130, never a traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [*FAST, "--num-steps", "100000", "--out-dir", str(tmp_path / "run")]
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train_minimal.py"), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err


# A child that installs the start's handling, then meets a SIGINT inside a block that swallows
# every exception, as torch's import does with numpy's (its C code clears the error and goes on).
SWALLOWED = """
import os, signal, sys, time
from minigpt.config import exit_on_ctrl_c, imports_done
if sys.argv[1] == "ignored":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as under nohup: left ignored
exit_on_ctrl_c("prog")
if sys.argv[1] == "done":
    imports_done()
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)
except BaseException as e:
    print("swallowed", type(e).__name__)
print("went on")
"""


@pytest.mark.parametrize(
    "when, status, out",
    [("importing", 130, ""), ("done", 0, "swallowed KeyboardInterrupt\nwent on"), ("ignored", 0, "went on")],
)
def test_a_ctrl_c_an_import_would_swallow_still_ends_the_start(when, status, out):
    """A real start interrupted ~0.35 s in trained on with the signal lost, or died later in a
    RecursionError: the KeyboardInterrupt was raised inside numpy's import, which torch's import
    clears and goes on from. Until the imports are done, a Ctrl-C exits from the signal handler,
    which no except clause meets; after imports_done() it is a KeyboardInterrupt again, for the
    trainer's own handling; an ignored SIGINT stays ignored."""
    done = subprocess.run(
        [sys.executable, "-c", SWALLOWED, when],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert (done.returncode, done.stdout.strip()) == (status, out), done.stderr
    if status == 130:
        assert done.stderr == f"prog: {INTERRUPTED_LINE}\n"


# ---------------------------------------------------------------------------- 6. flags that contradict


# (flags, what the one line names)
CONTRADICTIONS = [
    (["--amp", "--no-amp"], "--amp and --no-amp"),
    (["--no-amp", "--num-steps", "3", "--amp"], "--amp and --no-amp"),
    (["--chunked-loss", "--no-chunked-loss"], "--chunked-loss and --no-chunked-loss"),
    (["--memory-snapshot-path", "snap.pickle"], "--record-memory-history"),
    (["--tokenizer-name", "gpt2"], "--tokenizer-name"),  # TINY has --use-toy-data
    (["--tokenizer-name", "cl100k_base"], "--tokenizer-name"),
    (["--max-tokens", "1000"], "--max-tokens"),
]


@pytest.mark.parametrize("flags, named", CONTRADICTIONS, ids=[" ".join(f) for f, _ in CONTRADICTIONS])
def test_flags_that_contradict_or_do_nothing_are_refused(capsys, tmp_path, flags, named):
    out = tmp_path / "run"
    msg = one_line_exit_2(capsys, train_minimal.cli([*FAST, *flags, "--out-dir", str(out)]))
    assert named in msg, msg
    assert not out.exists()


def test_minigpt_args_may_still_override_the_command_lines_amp(monkeypatch):
    """$MINIGPT_ARGS is appended to win over the command line: --amp there, --no-amp here, is no
    contradiction."""
    monkeypatch.setenv("MINIGPT_ARGS", "--no-amp")
    assert parse_args([*TINY, "--amp"]).amp is False
    monkeypatch.setenv("MINIGPT_ARGS", "--no-amp --amp")
    with pytest.raises(UsageError, match="--amp and --no-amp are alternatives, both given together"):
        parse_args(TINY)


# ---------------------------------------------------------------------------- 7. words


@pytest.mark.parametrize("world, named", [(2, "the world size 2"), (4, "--n-heads 2 is not divisible")])
def test_a_tp_that_does_not_fit_names_the_world_size(world, named):
    """--tp 3 on 2 ranks: the world size is the first thing wrong, and named; --tp 4 on 4 ranks
    with --n-heads 2: the heads are. Checked before any process group (parallel.check_plan)."""
    from minigpt.core.parallel import check_plan

    tp = "3" if world == 2 else "4"
    with pytest.raises(UsageError) as e:
        check_plan(parse_args([*TINY, "--tp", tp, "--fsdp"]), world)
    assert named in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_resumed_run_logs_its_validation_loss_as_the_run_that_never_stopped(tmp_path):
    """The step after a resume logs what an uninterrupted run logs there: no val loss where none was
    evaluated (a val loss is reported only at the step it was evaluated, never carried as new), and
    one where both evaluated."""
    out, whole = tmp_path / "run", tmp_path / "whole"
    common = [*FAST, "--log-interval", "1", "--eval-interval", "2"]
    assert train_minimal.cli([*common, "--num-steps", "2", "--out-dir", str(out)]) == 0
    assert train_minimal.cli([*common, "--num-steps", "4", "--resume", "--out-dir", str(out)]) == 0
    assert train_minimal.cli([*common, "--num-steps", "4", "--out-dir", str(whole)]) == 0

    def val(folder):
        return {
            r["step"]: r["val_loss"]
            for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
        }

    resumed, uninterrupted = val(out), val(whole)
    assert resumed[3] is None and uninterrupted[3] is None and resumed[2] is not None
    assert resumed[4] is not None and uninterrupted[4] is not None


COUNTS = {
    "output paths over a run's files (report, compare, --memory-snapshot-path)": len(TARGETS) * len(TOOLS)
    + 6,
    "files at an output path, nearly a page of minigpt's (generated)": PAGE_EXAMPLES,
    "damaged checkpoints, resume and sample.py": 2 * len(DAMAGE) + 1,
    "damaged sharded checkpoints": 2,
    "paths of the wrong kind in a run, the cache folder": len(WRONG_KIND) + 3,
    "a trace of overlapping ranges": 3 + 1,
    "ranges inside windows, swept and scanned (generated)": SWEEP_EXAMPLES,
    "Ctrl-C during start-up": 4,
    "flags that contradict or do nothing": len(CONTRADICTIONS) + 1,
    "words: --tp and the world size, the last val loss after a resume": 3,
    "checkpoint bytes overwritten anywhere (generated)": DAMAGE_EXAMPLES,
}
