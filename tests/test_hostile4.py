"""The fourth hostile round (issue 39): a results name that is a path, a checkpoint that lost its
checksum, bombs (a snapshot of three times its object bound in dicts, a model_config of 100,000
layers, minutes of sampling), pickles of the wrong shape, names too long for the file system,
numbers the tools did not check, absurd figures in metrics.jsonl, the estimate's batch and memory,
and stragglers named by noise. Each ends in its one line (exit 2), its right figure, or nobody
named; nothing on disk is lost. COUNTS says how many bad inputs this file tries (tests/test_hostile.py
adds them up)."""

import functools
import gzip
import html
import json
import math
import pickle
import re
from pathlib import Path

import pytest
import torch
from conftest import ROOT, bench_module
from test_nothing_lost import FAST, before_checksums, one_line_exit_2, refused_by_resume_and_sample

import sample
import train_minimal
from minigpt.analysis import compare, report, traces
from minigpt.analysis import snapshot as snapshot_page
from minigpt.analysis.cuda_snapshot import SnapshotError, load_snapshot
from minigpt.core import sample as sample_model
from minigpt.core.checkpoint import CHECKSUM_KEY, save_checkpoint
from minigpt.instruments import estimate, per_rank
from minigpt.instruments.straggler import StragglerDetector


def ablation():
    """benchmarks/ablation.py, imported from its file when a test needs it (a broken script fails
    its own tests, not this file's collection)."""
    return bench_module("ablation")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """One tiny run of 2 steps with its checkpoint."""
    out = tmp_path_factory.mktemp("hostile4") / "run"
    assert train_minimal.cli([*FAST, "--num-steps", "2", "--log-interval", "1", "--out-dir", str(out)]) == 0
    return out


def only_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------------------- 1. a results name


BAD_NAMES = [
    "sub/cpu-small",
    "x/y/<script>alert(1)</script>",
    "..",
    ".",
    ".hidden",
    "../up",
    "/abs",
    "a\nb",
    "a\tb",
    "a\x1bb",
    "",
    " ",
    "a b",
    "<b>",
    "a\\b",
    "x" * 101,
    "$(id)",
    "a;b",
    "naïve",
    "a|b",
]


@pytest.mark.parametrize("name", BAD_NAMES, ids=range(len(BAD_NAMES)))
def test_a_results_name_is_a_name(capsys, name):
    with pytest.raises(SystemExit) as e:
        ablation().parser().parse_known_args(["--name", name, "--out-dir", "o2"])
    assert e.value.code == 2
    assert "is not a results name" in only_line(capsys)


def test_the_existence_check_and_the_write_use_the_same_files(tmp_path, capsys):
    """A name with a '.' keeps it (Path.with_suffix would cut lr-0.5 to lr-0.json): what is checked
    is what is written, and another name's files are not taken for its own."""
    p, common = ablation().parser(), bench_module("common")
    stem = tmp_path / "cpu-small-lr-0.5"
    common.save_json(stem, {"x": 1})
    assert (tmp_path / "cpu-small-lr-0.5.json").is_file() and not (tmp_path / "cpu-small-lr-0.json").exists()
    common.refuse_to_overwrite(p, tmp_path / "cpu-small-lr-0.7", force=False)  # not its file
    with pytest.raises(SystemExit):
        common.refuse_to_overwrite(p, stem, force=False)
    assert "cpu-small-lr-0.5.json is already there" in only_line(capsys)


# ---------------------------------------------------------------------------- 2. no checksum


def rename_checksum_flip_a_bit(path: Path) -> None:
    state = torch.load(path, weights_only=True)
    state["checksum_"] = state.pop(CHECKSUM_KEY)
    w = state["model"]["wte.weight"]
    w.view(torch.int32)[0, 0] ^= 1 << 20
    torch.save(state, path)


def delete_checksum_scale_a_weight(path: Path) -> None:
    state = torch.load(path, weights_only=True)
    del state[CHECKSUM_KEY]
    state["model"]["wte.weight"] *= 1000
    torch.save(state, path)


def delete_checksum(path: Path) -> None:
    state = torch.load(path, weights_only=True)
    del state[CHECKSUM_KEY]
    torch.save(state, path)


def delete_checksum_edit_the_config(path: Path) -> None:
    state = torch.load(path, weights_only=True)
    del state[CHECKSUM_KEY]
    state["config"]["lr"] = 1.0
    torch.save(state, path)


def as_before_checksums(path: Path) -> None:
    """An older minigpt's checkpoint: no shim reads it (issue 46); refused as one without its proof."""
    torch.save(before_checksums(torch.load(path, weights_only=True)), path)


NO_CHECKSUM = [
    rename_checksum_flip_a_bit,
    delete_checksum_scale_a_weight,
    delete_checksum,
    delete_checksum_edit_the_config,
    as_before_checksums,
]


@pytest.mark.parametrize("damage", NO_CHECKSUM, ids=[d.__name__ for d in NO_CHECKSUM])
def test_a_checkpoint_without_its_checksum_is_refused(capsys, run, tmp_path, damage):
    refused_by_resume_and_sample(capsys, run, tmp_path, damage, "carries no checksum")


# ---------------------------------------------------------------------------- 3. bombs: sample.py


def edit_model(field: str, value):
    def edit(state: dict) -> None:
        if field in state["model_config"]:
            state["model_config"][field] = value
        elif value is None:
            del state["model"][field]
        else:
            state["model"][field] = value

    return edit


# (what is edited, what the one line names)
SHAPE_EDITS = [
    (edit_model("n_layers", 100_000), "n_layers 100000"),
    (edit_model("n_layers", 1), "n_layers 1"),
    (edit_model("n_layers", 3), "n_layers 3"),
    (edit_model("d_ff", 4096), "mlp.fc.weight"),
    (edit_model("d_model", 64), "wte.weight"),
    (edit_model("vocab_size", 128), "wte.weight"),
    (edit_model("max_position_embeddings", 1024), "wpe.weight"),
    (edit_model("ln_f.bias", None), "ln_f.bias is missing"),
    (edit_model("extra.weight", torch.zeros(2)), "extra.weight is no weight"),
]


@pytest.mark.parametrize("edit, named", SHAPE_EDITS, ids=[n for _, n in SHAPE_EDITS])
def test_the_model_config_is_compared_with_the_weights_before_anything_is_built(
    capsys, run, tmp_path, monkeypatch, edit, named
):
    """A checkpoint re-saved with a valid checksum: only the shape is wrong. Nothing as large as
    the config claims is built: a GPT of 100,000 blocks would take minutes and gigabytes."""
    state = torch.load(run / "checkpoints" / "ckpt.pt", weights_only=True)
    edit(state)
    save_checkpoint(tmp_path / "ckpt.pt", {k: v for k, v in state.items() if k != CHECKSUM_KEY})
    real, built = sample_model.GPT, []
    # What is built here: the one-block model on the meta device that the weights are compared
    # with; a model of the config's size would end this test with ZeroDivisionError.
    monkeypatch.setattr(
        sample_model, "GPT", lambda cfg: built.append(cfg) or (real(cfg) if cfg.n_layers == 1 else 1 / 0)
    )
    status = sample.cli(["--checkpoint", str(tmp_path / "ckpt.pt"), "--max-new-tokens", "2"])
    msg = one_line_exit_2(capsys, status)
    assert named in msg, msg


def test_long_sampling_is_never_silent(capsys, run, monkeypatch):
    """Without a terminal (stderr captured here), a line while each sample is drawn, every
    PULSE_S seconds; 0 here, so every token's."""
    monkeypatch.setattr(sample, "PULSE_S", 0.0)
    ckpt = str(run / "checkpoints" / "ckpt.pt")
    assert sample.cli(["--checkpoint", ckpt, "--max-new-tokens", "5", "--num-samples", "1"]) == 0
    err = capsys.readouterr().err
    assert "sample 1: 3 of 5 tokens" in err and "tokens/s, about" in err, err


# ---------------------------------------------------------------------------- 3. bombs: snapshots


def bomb_of_dicts(n: int) -> bytes:
    """{'segments': [n empty dicts]}, one byte a dict: the gzip of 96 million is about 190 KB."""
    chunk = b"(" + b"}" * 1000 + b"e"
    return gzip.compress(b"\x80\x04}\x8c\x08segments]" + chunk * (n // 1000) + b"s.", 9)


def test_a_snapshot_of_three_times_the_bound_in_dicts_is_refused_before_it_is_built(
    tmp_path, capsys, monkeypatch
):
    """The page's own path to the bound, at a bound of a million (the walk to the real one, 32
    million, takes seconds: test_a_real_snapshot_is_within_the_bound reads it at its scale)."""
    monkeypatch.setattr(snapshot_page, "load_snapshot", functools.partial(load_snapshot, objects=10**6))
    path = tmp_path / "rank0_snapshot.pickle.gz"
    path.write_bytes(bomb_of_dicts(3_000_000))
    assert snapshot_page.main([str(path)]) == 2
    assert "would build more than 1,000,000 objects" in only_line(capsys)
    assert not (tmp_path / "rank0_snapshot.html").exists()


# (name, the raw pickle, what the refusal names); the object bound is 1,000 here
BOMBS = [
    ("dicts", b"\x80\x04}\x8c\x08segments](" + b"}" * 2000 + b"es.", "more than 1,000 objects"),
    ("marks", b"\x80\x04}\x8c\x08segments]" + b"(" * 2000 + b"s.", "more than 1,000 objects"),
    ("sets", b"\x80\x04}\x8c\x08segments](" + b"\x8f" * 400 + b"es.", "more than 1,000 objects"),
    ("references", b"\x80\x04}\x94\x8c\x08segments](" + b"h\x00" * 2000 + b"es.", "more than 1,000 objects"),
    ("memo index", b"\x80\x02}r\xff\xff\xff\x7f.", "memo at an index"),
    ("text memo index", b"(dp99999999\n.", "memo at an index"),
]


@pytest.mark.parametrize("name, raw, named", BOMBS, ids=[b[0] for b in BOMBS])
def test_what_a_snapshot_would_build_is_counted_first(tmp_path, name, raw, named):
    path = tmp_path / "s.pickle"
    path.write_bytes(raw)
    with pytest.raises(SnapshotError, match=named):
        load_snapshot(path, objects=1000)


def test_a_real_snapshot_is_within_the_bound():
    """The H200 run's snapshot (100,000 entries with Python frames): 12.9 million units, under the
    32 million bound with room to spare."""
    path = ROOT / "docs" / "gpu-runs" / "h200-gpt2-bf16-memory" / "snapshots" / "rank0_snapshot.pickle.gz"
    with pytest.raises(SnapshotError, match="more than 12,000,000 objects"):
        load_snapshot(path, objects=12_000_000)
    assert load_snapshot(path, objects=14_000_000)["segments"]


# ---------------------------------------------------------------------------- 4. snapshots of the wrong shape


def good() -> dict:
    block = {"address": 1, "size": 1024, "state": "active_allocated", "frames": []}
    event = {"action": "alloc", "addr": 1, "size": 1024, "time_us": 11, "frames": []}
    return {
        "segments": [{"device": 0, "total_size": 4096, "blocks": [block]}],
        "device_traces": [[event]],
        "external_annotations": [{"stage": "START", "name": "train_step", "time_us": 10}],
    }


def edited(path: str, value) -> dict:
    """good() with the field at `path` (keys and indexes, dotted) replaced; value DELETE drops it."""
    snap = good()
    *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
    holder = snap
    for k in parents:
        holder = holder[k]
    if value is DELETE:
        del holder[last]
    else:
        holder[last] = value
    return snap


DELETE = object()
WRONG_SHAPES = [
    ("segments 5", {"segments": 5}),
    ("segments of junk", {"segments": [1, "x", None]}),
    ("segments a dict", {"segments": {"a": 1}}),
    ("a block without size", edited("segments.0.blocks.0.size", DELETE)),
    ("a block without address", edited("segments.0.blocks.0.address", DELETE)),
    ("an address that is a list", edited("segments.0.blocks.0.address", [1, 2])),
    ("size big", edited("segments.0.blocks.0.size", "big")),
    ("size negative", edited("segments.0.blocks.0.size", -5)),
    ("size inf", edited("segments.0.blocks.0.size", math.inf)),
    ("size 10**400", edited("segments.0.blocks.0.size", 10**400)),
    ("requested_size a string", edited("segments.0.blocks.0.requested_size", "x")),
    ("blocks a string", edited("segments.0.blocks", "abc")),
    ("block frames a string", edited("segments.0.blocks.0.frames", "abc")),
    ("block frames of ints", edited("segments.0.blocks.0.frames", [1, 2])),
    ("total_size a list", edited("segments.0.total_size", [])),
    ("device a string", edited("segments.0.device", "cuda:0")),
    ("device_traces abc", edited("device_traces", "abc")),
    ("device_traces of ints", edited("device_traces", [1])),
    ("an event that is a string", edited("device_traces.0.0", "alloc")),
    ("time_us t", edited("device_traces.0.0.time_us", "t")),
    ("time_us nan", edited("device_traces.0.0.time_us", math.nan)),
    ("time_us None", edited("device_traces.0.0.time_us", None)),
    ("event size None", edited("device_traces.0.0.size", None)),
    ("block size None", edited("segments.0.blocks.0.size", None)),
    ("event addr a list", edited("device_traces.0.0.addr", [1])),
    ("event size big", edited("device_traces.0.0.size", "big")),
    ("event action a number", edited("device_traces.0.0.action", 3)),
    ("event frames a dict", edited("device_traces.0.0.frames", {"a": 1})),
    ("an annotation without time_us", edited("external_annotations.0.time_us", DELETE)),
    ("annotation time_us a list", edited("external_annotations.0.time_us", [1])),
    ("annotations a number", edited("external_annotations", 5)),
    ("an annotation a string", edited("external_annotations.0", "START")),
    ("a list, not a dict", [1, "x", None]),
]


@pytest.mark.parametrize("name, snap", WRONG_SHAPES, ids=[w[0] for w in WRONG_SHAPES])
def test_a_snapshot_of_the_wrong_shape_is_one_line(tmp_path, capsys, name, snap):
    path = tmp_path / "rank0_snapshot.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert snapshot_page.main([str(path)]) == 2
    assert "not a memory snapshot" in only_line(capsys)


def test_the_good_snapshot_of_these_tests_makes_a_page(tmp_path):
    """What WRONG_SHAPES edit is a snapshot the page is drawn for: each refusal is its edit's."""
    path = tmp_path / "rank0_snapshot.pickle"
    path.write_bytes(pickle.dumps(good()))
    assert snapshot_page.main([str(path)]) == 0 and (tmp_path / "rank0_snapshot.html").is_file()


def gz_of_good() -> bytes:
    return gzip.compress(pickle.dumps(good()))


DAMAGED_GZ = [
    ("truncated .pickle.gz", lambda: gz_of_good()[:-12]),
    ("half a .pickle.gz", lambda: gz_of_good()[: len(gz_of_good()) // 2]),
    ("gzip magic, then junk", lambda: b"\x1f\x8b" + b"junk" * 10),
    ("a truncated pickle", lambda: pickle.dumps(good())[:-20]),
]


@pytest.mark.parametrize("name, make", DAMAGED_GZ, ids=[d[0] for d in DAMAGED_GZ])
def test_a_damaged_pickle_is_one_line(tmp_path, capsys, name, make):
    path = tmp_path / "rank0_snapshot.pickle.gz"
    path.write_bytes(make())
    assert snapshot_page.main([str(path)]) == 2
    assert str(path) in only_line(capsys)


def test_a_bad_pickle_in_a_folder_costs_its_own_page_only(tmp_path, capsys):
    snaps = tmp_path / "snapshots"
    snaps.mkdir()
    (snaps / "rank0_snapshot.pickle").write_bytes(pickle.dumps({"segments": 5}))
    (snaps / "rank1_snapshot.pickle").write_bytes(pickle.dumps(good()))
    assert snapshot_page.main([str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert "rank1_snapshot.html" in out and (snaps / "rank1_snapshot.html").is_file()
    assert err.count("\n") == 1 and "rank0_snapshot.pickle" in err and "Traceback" not in err


# ---------------------------------------------------------------------------- 4. names too long

LONG = "a" * 256


def long_path(tmp_path: Path, *more: str) -> str:
    return str(tmp_path.joinpath(LONG, *more))


NAME_TOO_LONG = [
    ("sample.py --checkpoint", lambda t, r: sample.cli(["--checkpoint", long_path(t, "ckpt.pt")])),
    ("sample.py --out-dir", lambda t, r: sample.cli(["--out-dir", long_path(t)])),
    ("snapshot PATH", lambda t, r: snapshot_page.main([long_path(t, "s.pickle")])),
    ("snapshot --out", lambda t, r: snapshot_page.main([str(t / "s.pickle"), "--out", long_path(t)])),
    ("traces PATH", lambda t, r: traces.main([long_path(t, "x.pt.trace.json")])),
    ("report RUN", lambda t, r: report.main([long_path(t)])),
    ("report --out", lambda t, r: report.main([str(r), "--out", long_path(t, "r.html")])),
    ("compare RUN_A", lambda t, r: compare.main([long_path(t), str(r)])),
    ("compare RUN_B", lambda t, r: compare.main([str(r), long_path(t)])),
    ("compare --html", lambda t, r: compare.main([str(r), str(r), "--html", str(t / LONG)])),
    ("a whole path past 4096 bytes", lambda t, r: report.main(["/".join(["b" * 200] * 21)])),
]


@pytest.mark.parametrize("name, call", NAME_TOO_LONG, ids=[n[0] for n in NAME_TOO_LONG])
def test_a_name_too_long_for_the_file_system_is_one_clear_line(tmp_path, capsys, run, name, call):
    assert call(tmp_path, run) == 2
    msg = only_line(capsys)
    assert "past the" in msg and "Errno" not in msg, msg


# ---------------------------------------------------------------------------- 4. parallel's numbers

BAD_PARALLEL = [
    ["--gpus", "0"],
    ["--gpus", "-8"],
    ["--gpus", "1048577"],
    ["--mfu", "0"],
    ["--mfu", "nan"],
    ["--mfu", "2"],
    ["--mfu", "-0.1"],
    ["--mfu", "inf"],
    ["--link-gb-s", "0"],
    ["--link-gb-s", "-1"],
    ["--link-gb-s", "nan"],
    ["--peak-tflops", "-1"],
    ["--peak-tflops", "0"],
    ["--peak-tflops", "inf"],
    ["--batch-size", "0"],
    ["--batch-size", "-4"],
]


@pytest.mark.parametrize("flags", BAD_PARALLEL, ids=[" ".join(f) for f in BAD_PARALLEL])
def test_every_number_of_parallel_is_checked(capsys, flags):
    with pytest.raises(SystemExit) as e:
        per_rank.main(flags)
    assert e.value.code == 2
    line = only_line(capsys)
    assert line.startswith("python -m minigpt parallel: error: ") and f"error: {flags[0]} " in line, line


def test_parallel_still_answers_for_numbers_in_bounds(capsys):
    assert per_rank.main(["--gpus", "4", "--mfu", "1", "--batch-size", "1"]) == 0
    assert "at 100% of 989 TFLOP/s" in capsys.readouterr().out


# ---------------------------------------------------------------------------- 5. absurd figures

# (the field, its value) appended twice to a run's metrics.jsonl, as a copy of its last line
ABSURD = [
    ("tokens_per_s", 1e308),
    ("tokens_per_s", math.inf),
    ("tokens_per_s", math.nan),
    ("tokens_per_s", -1.0),
    ("tokens_per_s", 1e16),
    ("run_tokens_per_s", 1e308),
    ("tokens_per_s_e2e", 1e300),
    ("step_time_s", -0.5),
    ("step_time_s", 1e308),
    ("run_step_time_s", 1e308),
    ("loss", -1e308),
    ("mfu", 1e300),
    ("achieved_tflops", -3.0),
    ("elapsed_s", 1e308),
    ("stage_host_ms", {"forward": 1e308}),
    ("stage_device_ms", {"forward": -1.0}),
    ("memory", {"rss_bytes": 1e308}),
    ("run_tokens", 10**20),
]


def with_absurd_lines(run: Path, tmp_path: Path, field: str, value) -> Path:
    out = tmp_path / "run"
    for name in ("config.json", "metrics.jsonl"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes((run / name).read_bytes())
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    with open(out / "metrics.jsonl", "a") as f:
        for k in (1, 2):
            f.write(json.dumps({**last, "step": last["step"] + k, field: value}) + "\n")
    return out


@pytest.mark.parametrize("field, value", ABSURD, ids=[f"{f}={v}" for f, v in ABSURD])
@pytest.mark.parametrize("tool", ["report", "compare"])
def test_an_absurd_figure_is_a_damaged_line_not_an_inf_on_the_page(capsys, run, tmp_path, tool, field, value):
    out = with_absurd_lines(run, tmp_path, field, value)
    if tool == "report":
        assert report.main([str(out)]) == 0
        text = html.unescape((out / "report.html").read_text())
    else:
        assert compare.main([str(run), str(out), "--json"]) == 0
        text = "".join(capsys.readouterr())
    shown = re.sub(r"<script.*?</script>", "", text, flags=re.S)  # plotly's own code says Infinity
    shown = re.sub(r"[^<>\n]*skipped[^<>\n]*", "", shown)  # the note naming the line and its value
    assert not re.search(r"\b(inf|nan|Infinity|NaN|1e\+?30\d)\b", shown, flags=re.I), field
    assert f"field {field!r}" in text and "skipped" in text


def test_estimate_honours_auto_batch_size_against_the_memory_given(capsys):
    assert estimate.main(["--device", "cuda", "--auto-batch-size", "--device-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    chosen = re.search(r"--auto-batch-size chose (\d+) sequences", out)
    assert chosen and int(chosen.group(1)) > 8, out  # the preset's 8, multiplied to fill 80 GiB
    assert f"batch {chosen.group(1)} x seq" in out  # the table is the chosen batch's


def test_estimate_judges_a_huge_batch_against_the_memory_given_not_this_machines_ram(capsys):
    flags = ["--batch-size", "1000000", "--device", "cuda", "--device-memory-gb", "80"]
    assert estimate.main(flags) == 0
    out = capsys.readouterr().out
    assert "Device memory: 80.0 GiB (--device-memory-gb)" in out and "does NOT fit" in out
    assert "RAM" not in out


def test_estimate_still_refuses_a_size_past_its_cap(capsys):
    assert estimate.main(["--batch-size", "100000000", "--device", "cuda", "--device-memory-gb", "80"]) == 2
    assert "more than 1,048,576.0 GiB" in only_line(capsys)  # 1 PiB


# ---------------------------------------------------------------------------- 6. stragglers


def figures(scored: dict[int, float], step_ms: float) -> list[dict]:
    """Each rank's interval: a window's worth of steps, each `scored` ms of its own work (its
    forward, the backward's own compute none) in a step of `step_ms` (the rest: waiting in the
    backward's all-reduce)."""
    from minigpt.instruments.straggler import WINDOW_STEPS

    def step(ms: float) -> dict:
        return {"forward": ms, "backward_compute": 0.0, "backward": step_ms - ms}

    return [{"rank": r, "host": "h", "steps": [step(ms)] * WINDOW_STEPS} for r, ms in scored.items()]


# (what happens, each interval's {rank: scored ms} and step ms, the ranks that must be named)
STRAGGLER_CASES = [
    (  # issue 39: rank 0's forward 3.77 then 5.44 ms (individual 0.69) while rank 1 sleeps 60 ms
        "a waiting rank's few ms",
        [({0: 3.77, 1: 63.8}, 70.0), ({0: 5.44, 1: 64.1}, 71.0)],
        {1},
    ),
    (  # issue 39: no rank slowed; 5.6 ms against 3.8 (relative 0.68)
        "noise of two quiet ranks",
        [({0: 3.9, 1: 3.8}, 12.0), ({0: 5.6, 1: 3.8}, 12.0)],
        set(),
    ),
    ("35 ms in a 400 ms step", [({0: 105.0, 1: 70.0}, 400.0)], set()),
    ("a delay past both floors", [({0: 28.0, 1: 40.0}, 100.0)], {1}),
    ("a large delay above the threshold", [({0: 170.0, 1: 200.0}, 220.0)], set()),
    (
        "60 ms on rank 1, rank 0 noisy, every interval",
        [({0: 3.8 + (k % 3), 1: 63.8 + (k % 2)}, 70.0) for k in range(6)],
        {1},
    ),
]


@pytest.mark.parametrize("what, intervals, named", STRAGGLER_CASES, ids=[c[0] for c in STRAGGLER_CASES])
def test_a_rank_is_named_only_when_its_delay_matters(what, intervals, named):
    detector = StragglerDetector(0.75)
    for step, (scored, step_ms) in enumerate(intervals, 1):
        reports = detector.update(step, figures(scored, step_ms))
        assert {r["rank"] for r in reports} == named, (step, reports)


@pytest.mark.ddp
def test_a_rank_slowed_60_ms_is_named_alone_at_every_log_line_once_its_window_is_full(tmp_path):
    """Log lines every 4 steps; the first step (warm-up) is not steady: the window holds
    WINDOW_STEPS (8) steady steps first at step 12, and from then on the slow rank is named at
    each log line, and no other rank ever: by rank 0 alone, in the stage it sleeps in. The waiting
    rank's wait shows in its backward (the all-reduce), not in its compute."""
    from test_ddp import FLAGS, read_metrics, stragglers, torchrun

    out = tmp_path / "run"
    result = torchrun(
        ROOT / "train_minimal.py",
        *FLAGS,
        *("--num-steps", "16", "--log-interval", "4", "--simulate-slow-rank", "1:60"),
        *("--out-dir", str(out)),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reports = stragglers(out)
    assert {r["rank"] for r in reports} == {1}
    assert sorted(r["step"] for r in reports) == [12, 16]
    assert all(r["stage"] == "forward" and r["relative_score"] < 0.75 for r in reports)
    assert "STRAGGLER rank 1" in (out / "train.log").read_text()
    # Each report printed once: by rank 0, not again by every rank that scored the same figures.
    printed = [x for x in (result.stdout + result.stderr).splitlines() if "STRAGGLER" in x]
    assert len(printed) == len(reports) and all("[rank " not in x for x in printed)
    # Rank 0 waited for rank 1 inside its backward's all-reduce: its backward grew, its compute did not.
    row = read_metrics(out)[-1]
    assert row["stage_host_ms"]["backward"] > 40 > row["stage_host_ms"]["backward_compute"]


# ---------------------------------------------------------------------------- the count


COUNTS = {
    "results names that are paths or junk (ablation.py --name)": len(BAD_NAMES) + 1,
    "checkpoints without their checksum, resume and sample.py": 2 * len(NO_CHECKSUM),
    "model_config against the weights, before building (sample.py)": len(SHAPE_EDITS),
    "sampling 100,000 tokens without a terminal": 1,
    "snapshot bombs (objects counted before they are built)": 1 + len(BOMBS),
    "snapshots of the wrong shape, damaged pickles, a folder with a bad one": len(WRONG_SHAPES)
    + len(DAMAGED_GZ)
    + 1,
    "names too long for the file system (sample.py and the tools)": len(NAME_TOO_LONG),
    "python -m minigpt parallel's numbers": len(BAD_PARALLEL),
    "absurd figures in metrics.jsonl (report, compare)": 2 * len(ABSURD),
    "estimate: --auto-batch-size, a batch against the memory given": 3,
    "stragglers named by noise": len(STRAGGLER_CASES) + 1,
}


def test_the_counts_add_up_to_what_this_file_tries():
    assert all(n > 0 for n in COUNTS.values())
    assert sum(COUNTS.values()) >= 114  # issue 39: from 1,086 to at least 1,200 in all
