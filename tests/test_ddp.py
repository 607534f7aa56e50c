"""Data parallelism under torchrun: 2 processes on the CPU with gloo (marker `ddp`), and what the
ranks' room decides without processes: a lost rank's line, the straggler detector's verdicts."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, TINY

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
FLAGS = [*TINY, "--no-amp", "--dropout", "0.0"]


def torchrun(script, *args, env=None, timeout=240):
    return subprocess.run(
        [*TORCHRUN, str(script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def probe(tmp_path, *args, env=None):
    """Run the trainer under torchrun through tests/ddp_probe.py; return (result, per-rank probes)."""
    prefix = tmp_path / "probe"
    result = torchrun(ROOT / "tests" / "ddp_probe.py", str(prefix), *args, env=env)
    probes = [
        torch.load(f"{prefix}.rank{r}.pt", weights_only=True)
        for r in range(2)
        if os.path.exists(f"{prefix}.rank{r}.pt")
    ]
    return result, probes


def read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# Steps of tens of milliseconds, medians over 10 steps: the straggler detector has figures to score
# and no rank slowed. Two ranks share this machine's two cores with whatever else runs (the rest of
# the suite, CI): once, the noise alone crossed 0.75, so the threshold here is 0.5, still above the
# 0.32 a 200 ms straggler scored in the walkthrough (chapter 9).
QUIET = ("--d-model", "128", "--d-ff", "512", "--seq-len", "64", "--straggler-threshold", "0.5")


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """One job for the three tests below: 20 steps of 2 micro-batches on 2 ranks, probed."""
    tmp = tmp_path_factory.mktemp("probed")
    out = tmp / "run"
    flags = ("--num-steps", "20", "--grad-accum-steps", "2", "--log-interval", "10", "--out-dir", str(out))
    result, probes = probe(tmp, *FLAGS, *QUIET, *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(probes) == 2
    return out, probes


@pytest.mark.ddp
def test_ranks_stay_identical_and_rank_0_alone_writes(probed):
    out, probes = probed
    for name, p0 in probes[0]["params"].items():
        assert torch.equal(p0, probes[1]["params"][name]), name  # the same weights after 20 steps
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [10, 20]  # one line per step: rank 1 writes nothing
    assert rows[-1]["world_size"] == 2
    assert rows[-1]["tokens_per_s"] == pytest.approx(2 * rows[-1]["tokens_per_s_per_rank"])
    assert "backward_compute" in rows[-1]["stage_host_ms"]
    log = (out / "train.log").read_text()
    assert log.count("Training finished") == 1 and "DDP: 2 ranks, gloo backend" in log
    assert json.loads((out / "config.json").read_text())["world_size"] == 2
    assert list((out / "checkpoints").iterdir()) == [out / "checkpoints" / "ckpt.pt"]


@pytest.mark.ddp
def test_two_ranks_give_the_gradients_of_one_rank_with_twice_the_batch(probed):
    """The first step's gradients after the all-reduce: those of one process given both ranks'
    micro-batches at once (2 ranks x 2 micro-batches of 8: one batch of 32), the same initial weights."""
    import numpy as np

    from minigpt.core.model import GPT, GPTConfig
    from minigpt.core.toy import ToyBatches

    out, probes = probed
    ddp_grads = probes[0]["grads"]
    for name, g in ddp_grads.items():
        assert torch.equal(g, probes[1]["grads"][name]), name

    config = json.loads((out / "config.json").read_text())
    torch.manual_seed(config["config"]["seed"])
    model = GPT(GPTConfig(**config["model"]))
    seed, no_tokens = config["config"]["data_seed"], np.zeros(0, "<u2")
    batch, seq = config["config"]["batch_size"], config["config"]["seq_len"]
    ranks = [ToyBatches(no_tokens, batch, seq, seed, rank=r, vocab_size=64) for r in range(2)]
    x, y = (torch.cat(t) for t in zip(*(next(batches) for batches in ranks for _ in range(2))))
    model(x, y)[1].backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(ddp_grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def stragglers(out):
    path = out / "stragglers.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.ddp
def test_no_rank_is_named_when_none_is_slow(probed):
    out, _ = probed
    assert all("backward_compute" in r["stage_host_ms"] for r in read_metrics(out))  # figures to score
    assert stragglers(out) == []


@pytest.mark.ddp
def test_resume_under_torchrun_repeats_the_uninterrupted_losses(tmp_path):
    flags = [
        *FLAGS,
        "--dropout",
        "0.1",
        "--lr-scheduler",
        "constant",
        "--log-interval",
        "1",
        "--eval-interval",
        "100",
    ]
    full, part = tmp_path / "full", tmp_path / "part"
    assert (
        torchrun(ROOT / "train_minimal.py", *flags, "--num-steps", "6", "--out-dir", str(full)).returncode
        == 0
    )
    assert (
        torchrun(ROOT / "train_minimal.py", *flags, "--num-steps", "3", "--out-dir", str(part)).returncode
        == 0
    )
    result = torchrun(
        ROOT / "train_minimal.py", *flags, "--num-steps", "6", "--out-dir", str(part), "--resume"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    expected = {r["step"]: r["loss"] for r in read_metrics(full)}
    resumed = {r["step"]: r["loss"] for r in read_metrics(part) if r["step"] > 3}
    assert list(resumed) == [4, 5, 6]
    for step, loss in resumed.items():
        assert loss == pytest.approx(expected[step], rel=1e-6), step


@pytest.mark.ddp
def test_sigterm_under_torchrun_stops_every_rank_at_the_same_step(tmp_path):
    out = tmp_path / "run"
    job = subprocess.Popen(
        [
            *TORCHRUN,
            str(ROOT / "train_minimal.py"),
            *FLAGS,
            "--num-steps",
            "100000",
            "--log-interval",
            "50",
            "--eval-interval",
            "50",
            "--out-dir",
            str(out),
        ],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.time() + 120
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
        assert time.time() < deadline and job.poll() is None
        time.sleep(0.5)
    # As a scheduler does (SLURM's scancel, kill -- -PGID): SIGTERM to the launcher and to every rank at
    # once; the launcher then sends each rank a second one. Every rank must still stop at the same step
    # and rank 0 must finish its save.
    os.killpg(job.pid, signal.SIGTERM)
    output, _ = job.communicate(timeout=90)
    assert job.returncode != 0
    log = (out / "train.log").read_text()
    assert "Stopped by SIGTERM" in log
    state = torch.load(out / "checkpoints" / "ckpt.pt", weights_only=True)
    assert state["step"] > 50 and len(state["rng_per_rank"]) == 2
    assert f"Stopped by SIGTERM after step {state['step']}" in log


@pytest.mark.ddp
@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_failing_or_dying_rank_ends_the_job_with_a_message(tmp_path, how):
    out = tmp_path / "run"
    t0 = time.time()
    result, _ = probe(
        tmp_path,
        *FLAGS,
        "--num-steps",
        "50",
        "--ddp-timeout",
        "20",
        "--out-dir",
        str(out),
        env={"PROBE_FAIL": f"1:3:{how}"},
    )
    assert result.returncode != 0
    assert time.time() - t0 < 120  # bounded: never a silent hang
    text = result.stdout + result.stderr
    if how == "raise":
        assert "probe failure on rank 1 at step 3" in text
    else:
        assert "exitcode" in text and "13" in text  # torchrun names the rank and its exit code


# kill: the peer's closed connection fails the collective at once (the timeout is never reached);
# stop: a rank alive but not answering, found when --ddp-timeout runs out (issue 47: within the
# timeout and a few seconds, where it once took 52 s and ended in gloo's raw error).
@pytest.mark.ddp
@pytest.mark.parametrize("how, timeout", [("kill", "120"), ("stop", "10")])
def test_a_lost_rank_is_named_in_one_line_by_the_rank_that_survives(tmp_path, how, timeout):
    """A rank killed mid-run (kill -9, the OOM killer) or stopped: the other rank says which rank
    was lost and how to resume, in one line, not gloo's traceback, and exits 1."""
    out = tmp_path / "run"
    # The stopped rank is killed once the survivor has ended, or at the latest well after its line
    # is due (its timeout, the check-in): torchrun's own SIGTERM would wait on a stopped process for
    # 30 s before its SIGKILL.
    kill_after = float(timeout) + 15
    result, _ = probe(
        tmp_path,
        *FLAGS,
        *("--num-steps", "50", "--save-interval", "2", "--ddp-timeout", timeout, "--out-dir", str(out)),
        env={"PROBE_FAIL": f"1:3:{how}", "PROBE_KILL_AFTER": str(kill_after)},
    )
    assert result.returncode != 0
    text = result.stdout + result.stderr
    lost = [line for line in text.splitlines() if "lost rank" in line]
    assert len(lost) == 1 and lost[0].startswith("error: rank 0: lost rank 1 (it ended or stopped"), text
    checkpoint = out / "checkpoints" / "ckpt.pt"  # saved at step 2, before rank 1 was lost at step 3
    assert lost[0].endswith(f"; continue from {checkpoint} with --resume --out-dir {out}")
    assert "[rank0]" not in text and "Connection closed by peer" not in text  # no traceback from rank 0
    assert json.loads((tmp_path / "probe.rank0.json").read_text())["status"] == 1  # a fault: exit 1
    if how == "stop":  # the line within the timeout and a few seconds of the stop
        stopped_at = float((tmp_path / "probe.rank1.stopped").read_text())
        said_at = json.loads((tmp_path / "probe.rank0.json").read_text())["ended"]
        assert said_at - stopped_at < float(timeout) + 8, said_at - stopped_at


def test_more_ranks_than_gpus_is_one_line_naming_both_and_the_ways_out(monkeypatch):
    """torchrun --nproc_per_node 2 on a one-GPU machine: rank 1 would reach set_device(1) and fail
    inside CUDA or NCCL. Refused before, in one line (a faked device count: no GPU needed)."""
    from minigpt.config import UsageError
    from minigpt.core import distributed

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail("set_device reached"))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    line = setup_refused(UsageError, "cuda", 10.0)
    assert "2 ranks on this machine" in line and "1 visible GPU" in line
    assert "--nproc_per_node 1" in line and "--device cpu" in line
    distributed.check_one_gpu_per_rank(0)  # rank 0 has its GPU


def test_a_rank_that_never_joins_is_one_line_not_a_store_error(monkeypatch):
    """A rank that exits before it joins leaves the others' init_process_group to fail with
    DistStoreError after --ddp-timeout: each says so in one line (LostRank, exit 1)."""
    import torch.distributed as dist

    from minigpt.core.distributed import LostRank

    def never(*a, **k):
        raise dist.DistStoreError("Timed out after 30 seconds waiting for clients. 1/2 clients joined.")

    monkeypatch.setattr(dist, "init_process_group", never)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    line = setup_refused(LostRank, "cpu", 30.0)
    assert "did not all join" in line and "DistStoreError" in line


def test_a_slow_rank_without_other_ranks_is_refused_in_one_line(capsys, tmp_path):
    """--simulate-slow-rank in a single process: nothing would wait for the slowed rank."""
    from conftest import fails

    out = tmp_path / "run"
    line = fails(capsys, *TINY, "--simulate-slow-rank", "0:50", "--out-dir", str(out))
    assert "slows one rank among several" in line and "torchrun" in line and not out.exists()


def setup_refused(error: type, device: str, timeout: float) -> str:
    """distributed.setup()'s refusal under the environment the test set: one line of `error`."""
    from minigpt.core import distributed

    with pytest.raises(error) as e:
        distributed.setup(device, None, timeout)
    line = str(e.value)
    assert "\n" not in line
    return line


# ---------------------------------------------------------------------------- a lost rank, no processes

# What a collective raised on the survivor: gloo on a killed peer, on a stopped one once
# --ddp-timeout ran out (in DDP's communication hook), and, on the other buckets in flight through
# the same connection, the message issue 47 met raw: it names no backend.
COLLECTIVE_ERRORS = [
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242",
    "Got the following error when running the callback: RuntimeError: [/pytorch/third_party/gloo/gloo/"
    "transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation to complete",
    "Got the following error when running the callback: RuntimeError: "
    "Application timeout caused pair closure",
    "Application timeout caused pair closure",
]


def ranks_of_a_job(tmp_path, monkeypatch, answering: list[int]):
    """straggler.Ranks as rank 0 of 2 sees it under --fsdp (no DDP wrapper, no process group), with
    the ranks that check in after a failed collective faked (`answering`: all but these are lost)."""
    from minigpt.core import distributed
    from minigpt.instruments.straggler import Ranks

    monkeypatch.setattr(distributed, "lost_ranks", lambda info: [r for r in (0, 1) if r not in answering])
    cfg = SimpleNamespace(straggler_threshold=0.75, simulate_slow_rank=None, checkpoint_path=None)
    info = distributed.DistInfo(rank=0, world_size=2, backend="gloo", is_main=False, enabled=True)
    plan = SimpleNamespace(sharded=False, fsdp=False)
    run = SimpleNamespace(path=tmp_path, checkpoint=tmp_path / "checkpoints" / "ckpt.pt", saves=True)
    ranks = Ranks.__new__(Ranks)  # without __init__'s DDP wrapper, which needs a process group
    ranks.cfg, ranks.device, ranks.info, ranks.plan, ranks.run, ranks.file = cfg, "cpu", info, plan, run, None
    return ranks


@pytest.mark.parametrize("message", COLLECTIVE_ERRORS)
def test_a_collectives_failure_with_a_rank_gone_is_the_lost_rank_line(tmp_path, monkeypatch, message):
    from minigpt.core.distributed import LostRank

    ranks = ranks_of_a_job(tmp_path, monkeypatch, answering=[0])
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "ckpt.pt").write_bytes(b"saved")
    with pytest.raises(LostRank) as e, ranks:
        raise RuntimeError(message)
    line = str(e.value)
    assert "\n" not in line and line.startswith("rank 0: lost rank 1 (it ended or stopped answering")
    checkpoint = tmp_path / "checkpoints" / "ckpt.pt"
    assert line.endswith(f"; continue from {checkpoint} with --resume --out-dir {tmp_path}")
    with pytest.raises(LostRank, match="no checkpoint was saved yet"), ranks:  # none to resume from
        (tmp_path / "checkpoints" / "ckpt.pt").unlink()
        raise RuntimeError(message)


def test_an_error_of_the_rank_itself_or_with_every_rank_answering_is_left_as_it_is(tmp_path, monkeypatch):
    ranks = ranks_of_a_job(tmp_path, monkeypatch, answering=[0])
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes"), ranks:  # no collective's words
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x32 and 64x32)")
    ranks = ranks_of_a_job(tmp_path, monkeypatch, answering=[0, 1])
    with pytest.raises(RuntimeError, match="pair closure"), ranks:  # every rank still answers
        raise RuntimeError(COLLECTIVE_ERRORS[2])


# ---------------------------------------------------------------------------- stragglers, no processes


def simulated_job(seed: int, slow_ms=0.0, slow_from: int = 2, load_from: int = 0, scale: float = 1.0):
    """Two ranks' stage ms for steps 2..20 (step 1 is warm-up, left out), as on two gloo ranks
    sharing a quiet 2-core CPU (--preset tiny: a scored time of about 6 ms): each stage wanders by
    15% and, in one step in ten, a rank loses its core for 5-30 ms (a scheduler's hiccup). Rank 1
    sleeps `slow_ms` in its forward from step `slow_from`; from `load_from` every rank runs 1.8x
    slower (the machine's load). The backward holds the wait for the slower rank."""
    rng, steps = random.Random(seed), []
    for n in range(2, 21):
        load = 1.8 if load_from and n >= load_from else 1.0
        ranks = []
        for r in (0, 1):
            step = {"data_to_device": 0.1, "forward": 3.8, "backward_compute": 1.6, "optimizer_step": 0.5}
            step = {k: v * scale * load * rng.lognormvariate(0, 0.15) for k, v in step.items()}
            if rng.random() < 0.1:
                step[rng.choice(list(step))] += rng.uniform(5, 30)
            step["forward"] += slow_ms * (r == 1 and n >= slow_from)
            ranks.append(step)
        done = [sum(s.values()) for s in ranks]
        for r, step in enumerate(ranks):
            step["backward"] = step["backward_compute"] + max(done) - done[r] + 0.5
        steps.append(ranks)
    return steps


def named_ranks(job, log_interval: int = 2, **detector) -> dict[int, list[int]]:
    """Each rank named by the detector -> the log lines (steps) at which it was named."""
    from minigpt.instruments.straggler import StragglerDetector, rank_figures

    found, det = {}, StragglerDetector(0.75, **detector)
    for end in range(log_interval, 21, log_interval):
        steps = job[max(0, end - log_interval - 1) : end - 1]  # job[0] is step 2
        figures = [rank_figures(r, "vm", [s[r] for s in steps]) for r in (0, 1)]
        for report in det.update(end, figures):
            found.setdefault(report["rank"], []).append(end)
    return found


def test_no_rank_is_named_by_the_noise_of_two_unslowed_ranks():
    """Issue 48: 5 of 8 unslowed two-rank runs (--preset tiny --num-steps 20 --log-interval 2)
    named a straggler when each interval was scored alone. Over a window of 8 steps, none of 100."""
    assert [named_ranks(simulated_job(seed)) for seed in range(100)] == [{}] * 100
    per_interval = [named_ranks(simulated_job(seed), window_steps=1) for seed in range(100)]
    assert sum(bool(x) for x in per_interval) > 50  # what the window is for


def test_a_rank_slowed_60_ms_is_named_alone_once_the_window_holds_its_steps():
    for seed in range(100):
        assert named_ranks(simulated_job(seed, slow_ms=60)) == {1: [10, 12, 14, 16, 18, 20]}, seed
        late = named_ranks(simulated_job(seed, slow_ms=60, slow_from=10))  # slowed from step 10 on
        assert list(late) == [1] and 14 <= late[1][0] <= 16 and late[1][-1] == 20, (seed, late)


def test_a_slowdown_every_rank_shares_names_no_rank():
    """The machine's load from step 10 slows both ranks 1.8x (steps of about 60 ms: the delay
    matters): each is slower than it was, neither than the other: no straggler."""
    assert [named_ranks(simulated_job(seed, load_from=10, scale=10)) for seed in range(50)] == [{}] * 50
