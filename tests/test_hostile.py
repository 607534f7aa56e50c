"""The second hostile round (issue 23): a user who shares checkpoints between runs, hands the tools
FIFOs, /dev/zero and hand-edited JSON, damages checkpoints field by field, and types absurd numbers.
Every case ends in exit 2 (or a RunError / a named problem in the tools) with one line, nothing
lost, and no hang: never a traceback, a MemoryError, the OOM killer or a segmentation fault.

test_count_of_bad_inputs adds up how many bad inputs this file tries."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import test_hostile4
import test_hostile5
import test_nothing_lost
import test_property_cli
import torch
from conftest import FAST, TINY, fails

import train_minimal
from minigpt import config
from minigpt.analysis import compare, report
from minigpt.analysis.runfiles import RunError, load_run
from minigpt.config import UsageError
from minigpt.core import data, distributed, tokens
from minigpt.core.checkpoint import (
    check_extra,
    check_model_fits,
    load_checkpoint,
    optimizer_problem,
    rng_state,
    save_checkpoint,
)
from minigpt.core.guards import lock_checkpoint
from minigpt.fileio import UnreadableFile, read_bounded

ROOT = Path(__file__).resolve().parents[1]


def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text and text
    return text


def tree(root: Path) -> dict[str, str]:
    """Every file under root with a digest of its bytes: 'nothing lost' made checkable."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


def train(*args: str) -> int:
    return train_minimal.cli([*FAST, *args])


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """One tiny run of 2 steps with its checkpoint: the material the damaged checkpoints are made of."""
    out = tmp_path_factory.mktemp("hostile") / "run"
    assert train("--num-steps", "2", "--log-interval", "1", "--out-dir", str(out)) == 0
    return out


def ckpt_of(run: Path) -> Path:
    return run / "checkpoints" / "ckpt.pt"


# ---------------------------------------------------------------------------- 1. lost data


HOLDER = """
import sys, time
from contextlib import ExitStack
from pathlib import Path
from minigpt.core.guards import lock_checkpoint
lock_checkpoint(Path(sys.argv[1]), ExitStack())
print("locked", flush=True)
time.sleep(60)
"""


def test_two_runs_sharing_a_checkpoint_path_second_is_refused(capsys, tmp_path):
    """Run A holds --checkpoint-path shared.pt (a lock beside it); run B with another --out-dir
    but the same checkpoint is refused in one line, and writes nothing."""
    shared = tmp_path / "shared.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(shared)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        msg = fails(
            capsys,
            *FAST,
            "--num-steps",
            "1",
            "--out-dir",
            str(tmp_path / "twoB"),
            "--checkpoint-path",
            str(shared),
        )
        assert f"another trainer writes its checkpoint to {shared}" in msg and "--checkpoint-path" in msg
        assert not (tmp_path / "twoB").exists() and not shared.exists()
    finally:
        holder.kill()
        holder.wait()


def test_checkpoint_lock_is_released_and_leaves_nothing(tmp_path):
    from contextlib import ExitStack

    ckpt = tmp_path / "new" / "sub" / "ckpt.pt"
    with ExitStack() as held:
        lock_checkpoint(ckpt, held)
        assert (ckpt.parent / ".ckpt.pt.lock").is_file()
        with pytest.raises(UsageError) as e, ExitStack() as other:
            lock_checkpoint(ckpt, other)
        assert "writes its checkpoint to" in one_line(e)
    assert not (tmp_path / "new").exists()  # the lock file and the folders made for it are gone again
    with ExitStack() as held:  # and the checkpoint is free for the next run
        lock_checkpoint(ckpt, held)


def test_a_lock_file_its_holder_removed_is_not_held_by_two(tmp_path, monkeypatch):
    """A trainer that opened the lock file just before its holder removed it and let go must not
    hold that removed file while a third holds the new one: it locks what is at the name."""
    from contextlib import ExitStack

    from minigpt.core import guards

    ckpt, opened = tmp_path / "ckpt.pt", []
    real = guards.open_run_file

    def open_then_lose(path, flags):
        fd = real(path, flags)
        if not opened:  # the first open: its file is removed (its holder let go) before the flock
            opened.append(fd)
            os.unlink(path)
        return fd

    monkeypatch.setattr(guards, "open_run_file", open_then_lose)
    with ExitStack() as held:
        lock_checkpoint(ckpt, held)
        monkeypatch.setattr(guards, "open_run_file", real)
        with pytest.raises(UsageError, match="writes its checkpoint"), ExitStack() as other:
            lock_checkpoint(ckpt, other)  # the file at the name is the one held


def test_resume_from_another_runs_checkpoint_is_refused_before_anything_is_touched(capsys, tmp_path):
    victim, donor = tmp_path / "victim", tmp_path / "donor"
    assert train("--num-steps", "4", "--log-interval", "1", "--out-dir", str(victim)) == 0
    assert train("--num-steps", "1", "--log-interval", "1", "--seed", "7", "--out-dir", str(donor)) == 0
    capsys.readouterr()
    before = tree(victim)
    msg = fails(
        capsys,
        *FAST,
        "--resume",
        "--num-steps",
        "6",
        "--out-dir",
        str(victim),
        "--checkpoint-path",
        str(ckpt_of(donor)),
    )
    assert "belongs to another run" in msg and str(victim) in msg
    assert tree(victim) == before  # metrics past step 1, config.json and TensorBoard all kept
    assert len((victim / "metrics.jsonl").read_text().splitlines()) == 4
    # Its own checkpoint still resumes, and keeps the run's id.
    run_id = json.loads((victim / "config.json").read_text())["config"]["run_id"]
    assert train("--resume", "--num-steps", "5", "--log-interval", "1", "--out-dir", str(victim)) == 0
    assert json.loads((victim / "config.json").read_text())["config"]["run_id"] == run_id
    assert torch.load(ckpt_of(victim), weights_only=True)["config"]["run_id"] == run_id


def test_a_checkpoint_into_a_fresh_directory_is_allowed(capsys, trained, tmp_path):
    """A run directory with no history has nothing to lose: starting it from another checkpoint is fine."""
    fresh = tmp_path / "fresh"
    ckpt = tmp_path / "copy.pt"
    ckpt.write_bytes(ckpt_of(trained).read_bytes())
    assert train("--resume", "--num-steps", "3", "--out-dir", str(fresh), "--checkpoint-path", str(ckpt)) == 0


# ---------------------------------------------------------------------------- 2, 3, 4. damaged checkpoints


def damaged(trained: Path, tmp_path: Path, damage) -> Path:
    state = torch.load(ckpt_of(trained), weights_only=True)
    damage(state)
    path = tmp_path / "bad.pt"
    save_checkpoint(path, state)
    return path


def first_moment(state: dict) -> dict:
    return state["optimizer"]["state"][0]


def set_in(keys, value):
    def damage(state):
        target = state
        for k in keys[:-1]:
            target = target[k]
        target[keys[-1]] = value

    return damage


# (name, damage, what the one line must say). Each is a checkpoint a resume must refuse.
CHECKPOINT_DAMAGE = [
    ("exp_avg shape [5]", lambda s: first_moment(s).update(exp_avg=torch.zeros(5)), "shape [5]"),
    ("exp_avg_sq shape []", lambda s: first_moment(s).update(exp_avg_sq=torch.zeros(())), "shape []"),
    (
        "exp_avg int",
        lambda s: first_moment(s).update(exp_avg=first_moment(s)["exp_avg"].long()),
        "not floating",
    ),
    ("exp_avg a list", lambda s: first_moment(s).update(exp_avg=[1.0]), "expected a tensor"),
    ("step nan", lambda s: first_moment(s).update(step=torch.tensor(float("nan"))), "step holds NaN or inf"),
    ("step -1", lambda s: first_moment(s).update(step=torch.tensor(-1.0)), "step is not a finite"),
    ("step inf", lambda s: first_moment(s).update(step=float("inf")), "step is not a finite"),
    ("state of a stranger", lambda s: s["optimizer"]["state"].update({999: {}}), "no parameter group"),
    ("state not a dict", lambda s: s["optimizer"]["state"].update({0: 5}), "expected a dict"),
    ("a group missing", lambda s: s["optimizer"]["param_groups"].pop(), "parameter groups"),
    ("a param missing", lambda s: s["optimizer"]["param_groups"][0]["params"].pop(), "holds"),
    ("params named twice", lambda s: s["optimizer"]["param_groups"][1]["params"].__setitem__(0, 0), "twice"),
    ("betas a string", set_in(["optimizer", "param_groups", 0, "betas"], "ab"), "'betas'"),
    ("betas nan", set_in(["optimizer", "param_groups", 0, "betas"], (float("nan"), 0.9)), "'betas'"),
    ("eps a string", set_in(["optimizer", "param_groups", 0, "eps"], "x"), "'eps'"),
    ("fused a string", set_in(["optimizer", "param_groups", 0, "fused"], "yes"), "'fused'"),
    ("rng torch too short", set_in(["rng", "torch"], torch.zeros(10, dtype=torch.uint8)), "generator state"),
    ("rng torch 2-D", set_in(["rng", "torch"], torch.zeros(2, 5056, dtype=torch.uint8)), "1-D uint8"),
    ("rng python a string", set_in(["rng", "python"], "abc"), "random.getstate"),
    ("rng python wrong tuple", set_in(["rng", "python"], (3, (1, 2), None)), "random.getstate"),
    ("rng python version 9", set_in(["rng", "python"], (9, tuple(range(625)), None)), "random.getstate"),
    ("rng cuda floats", set_in(["rng", "cuda"], torch.zeros(16)), "'cuda'"),
    ("rng_per_rank entry", lambda s: s["rng_per_rank"].__setitem__(0, {"torch": 1}), "rng_per_rank"),
    ("rng_per_rank a dict", set_in(["rng_per_rank"], {}), "rng_per_rank"),
    ("n_layers 10**7", set_in(["model_config", "n_layers"], 10**7), "describes a model"),
    ("vocab 10**15", set_in(["model_config", "vocab_size"], 10**15), "describes a model"),
    ("d_model 10**9", set_in(["model_config", "d_model"], 10**9), "describes a model"),
]


@pytest.mark.parametrize("name, damage, expected", CHECKPOINT_DAMAGE, ids=[c[0] for c in CHECKPOINT_DAMAGE])
def test_a_damaged_checkpoint_is_refused_by_resume(capsys, trained, tmp_path, name, damage, expected):
    """In-process: a failed check here would be the segmentation fault the issue reports, and
    would take the test run down with it."""
    bad = damaged(trained, tmp_path, damage)
    out = tmp_path / "resumed"
    msg = fails(
        capsys, *FAST, "--resume", "--num-steps", "3", "--out-dir", str(out), "--checkpoint-path", str(bad)
    )
    assert expected in msg and str(bad) in msg, msg
    assert not (out / "metrics.jsonl").exists()


def test_sample_refuses_a_model_too_big_to_build(capsys, trained, tmp_path):
    import sample

    bad = damaged(trained, tmp_path, set_in(["model_config", "n_layers"], 10**7))
    assert sample.cli(["--checkpoint", str(bad), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "describes a model" in err and "n_layers 10000000" in err


def test_model_size_check_counts_from_the_config_alone(trained):
    cfg = torch.load(ckpt_of(trained), weights_only=True)["model_config"]
    check_model_fits(cfg, "x")  # the real one fits
    with pytest.raises(UsageError) as e:
        check_model_fits({**cfg, "n_layers": 10**12}, "x")
    assert "cannot be built here" in one_line(e)


def test_optimizer_check_passes_the_real_state(trained):
    state = load_checkpoint(ckpt_of(trained))
    model = train_minimal.GPT(train_minimal.GPTConfig(**state["model_config"]))
    opt = train_minimal.configure_optimizer(model, train_minimal.parse_args([*TINY]), sharded=False)
    assert optimizer_problem(state["optimizer"], opt) is None


EXTRA_DAMAGE = [
    ("not a dict", lambda e: [1]),
    ("no step", lambda e: {k: v for k, v in e.items() if k != "step"}),
    ("no rng", lambda e: {k: v for k, v in e.items() if k != "rng"}),
    ("step a string", lambda e: {**e, "step": "3"}),
    ("data_position negative", lambda e: {**e, "data_position": -1}),
    ("rng malformed", lambda e: {**e, "rng": {"torch": torch.zeros(3, dtype=torch.uint8), "python": ()}}),
    ("scaler a list", lambda e: {**e, "scaler": []}),
    ("model_config empty", lambda e: {**e, "model_config": {}}),
    ("config a string", lambda e: {**e, "config": "x"}),
]


@pytest.mark.parametrize("name, damage", EXTRA_DAMAGE, ids=[c[0] for c in EXTRA_DAMAGE])
def test_fsdp_extra_file_is_validated(trained, name, damage):
    state = torch.load(ckpt_of(trained), weights_only=True)
    extra = {k: state[k] for k in ("scaler", "step", "data_position", "rng", "config", "model_config")}
    check_extra(extra, "extra_rank0.pt")  # the real one passes
    with pytest.raises(UsageError) as e:
        check_extra(damage(extra), "extra_rank0.pt")
    assert "extra_rank0.pt" in one_line(e)


def test_rng_state_round_trip_still_validates():
    state = rng_state()
    from minigpt.core.checkpoint import rng_problem

    assert rng_problem(state) is None


# ---------------------------------------------------------------------------- data files


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv(data.CACHE_ENV, str(folder))
    return folder


def tokens_of(text: Path):
    return np.asarray(tokens.load_files([str(text)], "--train-data", "gpt2", say=False))


def cached_file(text: Path) -> tuple[Path, bytes]:
    """The text's token file in the cache, and the key its header holds."""
    tokens_of(text)
    (entry,) = (data.cache_dir() / "tokens").iterdir()
    return entry, data.HEADER.unpack(entry.read_bytes()[: data.HEADER.size])[2]


def test_a_self_consistent_cache_with_an_id_beyond_the_vocabulary_is_redone(tmp_path, cache, capsys):
    text = tmp_path / "t.txt"
    text.write_text("one two three four")
    (entry, key), good = cached_file(text), list(tokens_of(text))
    ids = np.array([1, 2, 65535], dtype="<u2")  # header, key and size agree
    entry.write_bytes(data.HEADER.pack(data.MAGIC, 3, key).ljust(data.HEADER_SIZE, b"\0") + ids.tobytes())
    assert list(tokens_of(text)) == good
    assert "tokenised again" in capsys.readouterr().err


def test_a_fifo_in_the_token_cache_does_not_hang(tmp_path, cache, capsys):
    text = tmp_path / "t.txt"
    text.write_text("one two three four")
    (entry, key), good = cached_file(text), list(tokens_of(text))
    entry.unlink()
    os.mkfifo(entry)
    assert data.read_tokens(entry, key, config.GPT2_VOCAB) is None
    assert list(tokens_of(text)) == good  # tokenised again, the FIFO replaced by a file
    assert entry.is_file()


# ---------------------------------------------------------------------------- 4. numeric flags

BAD_FLAGS = [
    (["--simulate-slow-rank", "0:1e99"], "at most 3600000 ms"),
    (["--simulate-slow-rank", "99999999999:5"], "below 2**31"),
    (["--device-memory-gb", "1e300"], "--device-memory-gb must be at most"),
    (["--device-memory-gb", "2e6"], "--device-memory-gb must be at most"),
    (["--grad-accum-steps", "1e18"], "--grad-accum-steps must be at most 65536"),
    (["--grad-accum-steps", "65537"], "--grad-accum-steps must be at most 65536"),
    (["--eval-iters", "1e9"], "--eval-iters must be at most 65536"),
    (["--memory-history-entries", "1e18"], "--memory-history-entries must be at most"),
    (["--out-dir", ""], "--out-dir is empty"),
    (["--out-dir", "  "], "--out-dir is empty"),
    (["--checkpoint-path", ""], "--checkpoint-path is empty"),
    (["--memory-snapshot-path", ""], "--memory-snapshot-path is empty"),
    (["--out-dir", "a\0b"], "NUL byte"),
    (["--checkpoint-path", "x\0.pt"], "NUL byte"),
    (["--tokenizer-name", "gp\0t2"], "NUL byte"),
]


@pytest.mark.parametrize("flags, expected", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_absurd_numbers_and_empty_paths_are_refused(capsys, tmp_path, monkeypatch, flags, expected):
    monkeypatch.chdir(tmp_path)
    args = [*FAST, "--num-steps", "1", "--out-dir", str(tmp_path / "r"), *flags]
    assert expected in fails(capsys, *args)
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------- 7. torchrun ranks


@pytest.mark.parametrize(
    "flag, value",
    [("d_model", 64), ("num_steps", 9), ("log_interval", 3), ("fsdp", True), ("grad_accum_steps", 2)],
)
def test_ranks_with_different_flags_are_refused_naming_the_flag(monkeypatch, flag, value):
    mine = config.parse_args([*TINY])
    other = config.parse_args([*TINY])
    setattr(other, flag, value)
    monkeypatch.setattr(distributed, "gather", lambda obj, info: [mine.to_dict(), other.to_dict()])
    with pytest.raises(UsageError) as e:
        distributed.check_same_config(mine, distributed.DistInfo(rank=0, world_size=2, enabled=True))
    msg = one_line(e)
    assert config.flag_name(flag) in msg
    assert "rank 1" in msg


def test_ranks_with_the_same_flags_share_rank_0s_run_id(monkeypatch):
    first, second = config.parse_args([*TINY]), config.parse_args([*TINY])
    assert first.run_id != second.run_id  # each process draws its own
    monkeypatch.setattr(distributed, "gather", lambda obj, info: [first.to_dict(), second.to_dict()])
    distributed.check_same_config(
        second, distributed.DistInfo(rank=1, world_size=2, is_main=False, enabled=True)
    )
    assert second.run_id == first.run_id


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.ddp
@pytest.mark.slow  # two processes that each import torch and join a gloo group
def test_two_real_ranks_with_different_flags_exit_2_with_one_line(tmp_path):
    """Two ranks started by hand, as torchrun would start them, one with --grad-accum-steps 2:
    accepted silently before; now both exit 2 naming the flag, before any run directory exists."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    base = [sys.executable, str(ROOT / "train_minimal.py"), *FAST, "--num-steps", "2", "--ddp-timeout", "60"]
    procs = [
        subprocess.Popen(
            [*base, "--out-dir", str(tmp_path / "run"), *extra],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stderr=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for r, extra in enumerate([[], ["--grad-accum-steps", "2"]])
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "--grad-accum-steps is 2 on rank 1 but 1 on rank 0" in lines[0], err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------- 2, 6. run files


def run_dir(tmp_path: Path, trained: Path, name: str = "r") -> Path:
    """A copy of the trained run's config and metrics, to damage."""
    run = tmp_path / name
    run.mkdir()
    for f in ("config.json", "metrics.jsonl"):
        (run / f).write_bytes((trained / f).read_bytes())
    return run


def edit_config(change):
    def damage(run: Path):
        cfg = json.loads((run / "config.json").read_text())
        change(cfg)
        (run / "config.json").write_text(json.dumps(cfg))

    return damage


def replace_file(name: str, make):
    def damage(run: Path):
        (run / name).unlink(missing_ok=True)
        make(run / name)

    return damage


def deep(n: int) -> str:
    return "[" * n + "]" * n


# Damage that makes config.json unusable: the tools end in RunError (one line naming file and field).
CONFIG_DAMAGE = [
    ("world_size NaN", edit_config(lambda c: c.update(world_size=float("nan"))), "world_size"),
    ("world_size a string", edit_config(lambda c: c.update(world_size="2")), "world_size"),
    ("world_size 0", edit_config(lambda c: c.update(world_size=0)), "world_size"),
    ("world_size true", edit_config(lambda c: c.update(world_size=True)), "world_size"),
    ("model a string", edit_config(lambda c: c.update(model="x")), "'model'"),
    ("config a list", edit_config(lambda c: c.update(config=[1])), "'config'"),
    ("params a string", edit_config(lambda c: c.update(params="many")), "'params'"),
    ("versions a number", edit_config(lambda c: c.update(versions=3)), "'versions'"),
    ("batch_size an object", edit_config(lambda c: c["config"].update(batch_size={"a": 1})), "batch_size"),
    ("n_layers a list", edit_config(lambda c: c["model"].update(n_layers=[1])), "n_layers"),
    ("peak_flops inf", edit_config(lambda c: c.update(peak_flops=float("inf"))), "inf"),
    ("deep nesting", lambda r: (r / "config.json").write_text('{"x": ' + deep(100_000) + "}"), "nested"),
    ("moderate nesting", lambda r: (r / "config.json").write_text('{"x": ' + deep(50) + "}"), "nested"),
    ("a JSON list", lambda r: (r / "config.json").write_text("[1, 2]"), "not a JSON object"),
    ("a FIFO", replace_file("config.json", os.mkfifo), "a FIFO"),
    (
        "a link to /dev/zero",
        replace_file("config.json", lambda p: p.symlink_to("/dev/zero")),
        "character device",
    ),
    ("a directory", replace_file("config.json", lambda p: p.mkdir()), "a directory"),
    (
        "a dangling link",
        replace_file("config.json", lambda p: p.symlink_to(p.parent / "nowhere")),
        "cannot be read",
    ),
    ("not UTF-8", lambda r: (r / "config.json").write_bytes(b"\xff\xfe{"), "JSON"),
    ("too big", lambda r: (r / "config.json").write_text(" " * (2 << 20) + "{}"), "above"),
]


@pytest.mark.parametrize("name, damage, expected", CONFIG_DAMAGE, ids=[c[0] for c in CONFIG_DAMAGE])
def test_a_damaged_config_json_is_a_run_error(trained, tmp_path, capsys, name, damage, expected):
    run = run_dir(tmp_path, trained)
    damage(run)
    with pytest.raises(RunError) as e:
        load_run(run)
    assert expected in one_line(e) and "config.json" in str(e.value)
    # and the tools say it in one line, exit 2
    for tool, argv in ((report, [str(run)]), (compare, [str(run), str(trained)])):
        status = tool.main(argv)
        err = capsys.readouterr().err.strip()
        assert status == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, (tool, err)


def test_a_real_run_loads_without_problems(trained):
    run = load_run(trained)
    assert run.problems == [] and len(run.metrics) == 2 and run.config["run_id"]
    assert "run_id" not in run.config["config"]  # the run's identity, not a setting compare would diff


def metrics_line(change) -> callable:
    def damage(run: Path):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        change(rows[0])
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    return damage


# Damage to the optional parts: the tools still work, and name the part skipped.
PART_DAMAGE = [
    ("a line without step", metrics_line(lambda r: r.pop("step")), "has no 'step'"),
    ("step a string", metrics_line(lambda r: r.update(step="1")), "'step'"),
    ("step negative", metrics_line(lambda r: r.update(step=-3)), "negative"),
    ("loss a string", metrics_line(lambda r: r.update(loss="low")), "'loss'"),
    ("loss NaN", metrics_line(lambda r: r.update(loss=float("nan"))), "nan"),
    ("loss Infinity", metrics_line(lambda r: r.update(loss=float("inf"))), "inf"),
    ("memory a list", metrics_line(lambda r: r.update(memory=[1])), "'memory'"),
    ("stage ms a string", metrics_line(lambda r: r["stage_host_ms"].update(forward="x")), "stage_host_ms"),
    ("world_size null", metrics_line(lambda r: r.update(world_size=None)), "world_size"),
    (
        "deep nesting",
        lambda r: (r / "metrics.jsonl").write_text('{"step": 1, "x": ' + deep(100_000) + "}\n"),
        "not JSON",
    ),
    ("a line that is a list", lambda r: (r / "metrics.jsonl").write_text("[1]\n"), "not a JSON object"),
    ("metrics a FIFO", replace_file("metrics.jsonl", os.mkfifo), "a FIFO"),
    (
        "metrics a link to /dev/zero",
        replace_file("metrics.jsonl", lambda p: p.symlink_to("/dev/zero")),
        "character device",
    ),
    ("stragglers a FIFO", replace_file("stragglers.jsonl", os.mkfifo), "a FIFO"),
    (
        "stragglers without step",
        lambda r: (r / "stragglers.jsonl").write_text('{"rank": 1}\n'),
        "integer 'step'",
    ),
]


def memory_log(run: Path, text: str) -> None:
    folder = run / "memory_trace" / "rank0_dp0"
    folder.mkdir(parents=True, exist_ok=True)
    if text == "FIFO":
        os.mkfifo(folder / "memory.log")
    elif text == "ZERO":
        (folder / "memory.log").symlink_to("/dev/zero")
    else:
        (folder / "memory.log").write_text(text)


STATE = "Memory State:\nstep: 5\ntime: 1.0\n---summary---\n"
PART_DAMAGE += [
    ("memory.log total=nan", lambda r: memory_log(r, STATE + "bytes: total=nan\n"), "memory.log"),
    ("memory.log step a word", lambda r: memory_log(r, STATE.replace("5", "five")), "memory.log"),
    ("memory.log a FIFO", lambda r: memory_log(r, "FIFO"), "a FIFO"),
    ("memory.log /dev/zero", lambda r: memory_log(r, "ZERO"), "character device"),
    (
        "a trace that is a FIFO",
        lambda r: (r / "traces").mkdir() or os.mkfifo(r / "traces" / "rank0_dp0.1.pt.trace.json"),
        None,
    ),
]


@pytest.mark.parametrize("name, damage, expected", PART_DAMAGE, ids=[c[0] for c in PART_DAMAGE])
def test_a_damaged_part_is_named_and_skipped(trained, tmp_path, capsys, name, damage, expected):
    run = run_dir(tmp_path, trained)
    damage(run)
    loaded = load_run(run)  # returns: no hang on a FIFO, no MemoryError on /dev/zero
    assert expected is None or any(expected in p for p in loaded.problems), loaded.problems
    for tool, argv in ((report, [str(run)]), (compare, [str(run), str(trained)])):
        status = tool.main(argv)
        err = capsys.readouterr().err
        assert status in (0, 2) and "Traceback" not in err, (tool, err)


def test_read_bounded_refuses_before_reading(tmp_path):
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(10 << 30)
    with pytest.raises(UnreadableFile) as e:
        read_bounded(big, 1 << 20)
    assert "10.0 GiB" in one_line(e)
    (tmp_path / "ok").write_bytes(b"abc")
    assert read_bounded(tmp_path / "ok", 3) == b"abc"


# ---------------------------------------------------------------------------- the count


def test_count_of_bad_inputs():
    """How many bad inputs this file tries: the hand-written cases, and the hypothesis examples."""
    hand = {
        "checkpoints": len(CHECKPOINT_DAMAGE) + 2,  # + sample.py's, the model-size unit case
        "fsdp extra files": len(EXTRA_DAMAGE),
        "shared checkpoint / another run's checkpoint": 3,
        "data files and token cache": 3,
        "numeric and path flags": len(BAD_FLAGS),
        "torchrun ranks": 6,
        "config.json": len(CONFIG_DAMAGE),
        "metrics, stragglers, memory.log, traces": len(PART_DAMAGE),
        "bounded reads": 1,
    }
    generated = {
        "every trainer flag, parsed (test_property_cli)": test_property_cli.PARSE_EXAMPLES,
        "the tools' and sample.py's flags (test_property_cli)": test_property_cli.TOOL_EXAMPLES,
        "trainer runs with generated flags (test_property_cli)": test_property_cli.RUN_EXAMPLES,
    }
    for module in (test_nothing_lost, test_hostile4, test_hostile5):  # each file's COUNTS, named by its file
        name = module.__name__
        hand.update({f"{k} ({name})": v for k, v in module.COUNTS.items() if "generated" not in k})
        generated.update({f"{k} ({name})": v for k, v in module.COUNTS.items() if "generated" in k})
    total = sum(hand.values()) + sum(generated.values())
    for what, n in {**hand, **generated}.items():
        print(f"{n:5d}  {what}")
    print(
        f"bad inputs tried: {total} ({sum(hand.values())} hand-written, {sum(generated.values())} generated)"
    )
    assert total >= 1450 and sum(hand.values()) >= 290  # issue 47: 1,244 before it
