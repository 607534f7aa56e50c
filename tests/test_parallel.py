"""FSDP2 and tensor parallelism (minigpt/core/parallel.py) on the CPU with gloo, and sharded checkpoints.

The multi-process tests run tests/parallel_probe.py under torchrun (marker `ddp`; `slow` where the
processes take more than about 20 s on the 2-core machine). Every plan trains the same tiny GPT on
the same global batches, so each must give the single process's losses.
"""

import json
import os
import pickle
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, TINY

from minigpt.config import STAGE_NAMES, UsageError
from minigpt.core.parallel import check_plan, worker_name
from minigpt.core.shape import Shape
from minigpt.instruments.estimate import estimate_gpt, per_rank_estimate

PROBE = ROOT / "tests" / "parallel_probe.py"
SHAPE = ["--shape", "2,4,64,256,128", "--seq", "32", "--batch", "8"]  # layers, heads, d_model, d_ff, vocab


def plan(**kw):
    base = dict(
        fsdp=False,
        tp=1,
        use_tensor_parallel=False,
        n_heads=4,
        d_ff=256,
        compile=False,
        amp=None,
        amp_dtype="bf16",
    )
    return SimpleNamespace(**{**base, **kw})


# ---------------------------------------------------------------------------- refusals, no processes


@pytest.mark.parametrize(
    "kw, world, words",
    [
        (dict(fsdp=True), 1, "launch with torchrun"),
        (dict(tp=2), 1, "launch with torchrun"),
        (dict(tp=3), 4, "not divisible by the tensor-parallel degree 3"),
        (dict(tp=2, n_heads=3), 2, "--n-heads 3"),
        (dict(tp=4, d_ff=6, n_heads=4), 4, "--d-ff 6"),
        (dict(tp=2), 4, "add --fsdp"),
        (dict(fsdp=True, compile=True), 2, "--compile"),
        (dict(fsdp=True, amp_dtype="fp16"), 2, "fp16"),
        (dict(tp=0), 2, "--tp must be positive"),
    ],
)
def test_plans_that_cannot_work_are_refused_in_one_line(kw, world, words):
    with pytest.raises(UsageError) as e:
        check_plan(plan(**kw), world)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_use_tensor_parallel_means_this_nodes_ranks(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    check_plan(plan(use_tensor_parallel=True, fsdp=True), 8)  # 2 nodes x 4: TP 4 inside, FSDP across
    with pytest.raises(UsageError, match="contradicts --tp 2"):
        check_plan(plan(use_tensor_parallel=True, tp=2, fsdp=True), 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(UsageError, match="--n-heads 4"):
        check_plan(plan(use_tensor_parallel=True), 3)


def test_plans_that_work_pass():
    for kw, world in [
        (dict(), 1),
        (dict(fsdp=True), 2),
        (dict(tp=2), 2),
        (dict(fsdp=True, tp=2), 4),
        (dict(fsdp=True, amp=False, amp_dtype="fp16"), 2),
    ]:
        check_plan(plan(**kw), world)


def test_worker_names_keep_the_ddp_form_without_tp():
    assert worker_name(3, None) == "rank3_dp3"

    class Mesh:  # the two DeviceMesh calls worker_name makes
        def __init__(self, coords, sizes):
            self.coords, self.sizes = coords, sizes

        def get_local_rank(self, dim):
            return self.coords[dim]

        def __getitem__(self, dim):
            return SimpleNamespace(size=lambda: self.sizes[dim])

    assert worker_name(3, Mesh({"dp": 1, "tp": 1}, {"dp": 2, "tp": 2})) == "rank3_dp1_tp1"
    assert worker_name(1, Mesh({"dp": 1, "tp": 0}, {"dp": 2, "tp": 1})) == "rank1_dp1"


def test_per_rank_estimate_shards_state_and_splits_tp_activations():
    shape = dict(
        n_layers=2,
        n_heads=4,
        d_model=64,
        d_ff=256,
        seq_len=32,
        batch_size=8,
        vocab_size=128,
        max_position_embeddings=32,
    )
    shape = Shape(**shape)
    e = estimate_gpt(shape)
    ddp, fsdp = per_rank_estimate(e, 2, 1, False), per_rank_estimate(e, 2, 1, True)
    assert ddp["params"] == e.params and fsdp["params"] == e.params // 2
    assert fsdp["optimizer"] < e.optimizer / 2 + 1000
    tp = per_rank_estimate(e, 1, 2, False, shape)
    assert e.params / 2 < tp["params"] < e.params  # the embeddings and LayerNorms stay whole
    assert tp["activations"] < e.activations
    with pytest.raises(ValueError):
        per_rank_estimate(e, 1, 2, False)
    from minigpt.instruments.estimate import per_rank_memory_estimate

    as_estimate = per_rank_memory_estimate(e, 1, 2, False, shape)  # for minigpt.instruments.breakdown's table
    assert (as_estimate.total, as_estimate.params) == (tp["total"], tp["params"])


def test_exposed_communication_is_the_union_of_comm_ranges_inside_each_stage():
    from minigpt.instruments.commprobe import stage_comm_ms

    def ev(name, start, end, thread=1):
        return SimpleNamespace(name=name, thread=thread, time_range=SimpleNamespace(start=start, end=end))

    events = [
        ev("forward", 0, 10_000),
        ev("backward", 10_000, 30_000),
        ev("FSDP::all_gather (blocks.0)", 1_000, 3_000),
        ev("c10d::_allgather_base_", 1_500, 2_500),  # nested in the one above
        ev("aten::mm", 3_000, 9_000),
        ev("FSDP::post_backward_reduce (blocks.0)", 25_000, 32_000),  # runs past the stage's end
        ev("gloo:all_reduce", 11_000, 20_000, thread=2),
    ]  # another thread: overlapped, not exposed
    ms = stage_comm_ms(events, ("forward", "backward"))
    assert ms == {"forward": 2.0, "backward": 5.0, "step": 9.0}


# ---------------------------------------------------------------------------- sharded checkpoints, 1 process


def _tiny():
    from minigpt.core.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(
        GPTConfig(vocab_size=64, max_position_embeddings=8, n_layers=1, n_heads=2, d_model=16, d_ff=32)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 64, (2, 8))
    model(x, x)[1].backward()
    opt.step()
    return model, opt


def test_sharded_checkpoint_round_trip_and_atomic_folder(tmp_path):
    from minigpt.core.checkpoint import load_sharded, save_sharded

    model, opt = _tiny()
    save_sharded(tmp_path / "ck", model, opt, {"step": 7})
    save_sharded(tmp_path / "ck", model, opt, {"step": 8})  # over an existing one: renamed into place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    other, opt2 = _tiny()
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    assert load_sharded(tmp_path / "ck", other, opt2)["step"] == 8
    for (n, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), n
    with pytest.raises(UsageError, match="no sharded checkpoint"):
        load_sharded(tmp_path / "missing", other, opt2)


def test_sharded_checkpoint_with_code_in_its_metadata_is_refused(tmp_path):
    """DCP's reader unpickles .metadata with plain pickle: a crafted file would run code. Ours refuses."""
    from minigpt.core.checkpoint import load_sharded, save_sharded

    model, opt = _tiny()
    save_sharded(tmp_path / "ck", model, opt, {"step": 1})
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(UsageError, match="damaged"):
        load_sharded(tmp_path / "ck", model, opt)
    assert not marker.exists()
    pickle.loads((tmp_path / "ck" / ".metadata").read_bytes())  # what plain pickle would have done
    assert marker.exists()


# ---------------------------------------------------------------------------- torchrun, gloo


def torchrun(nproc, *args, timeout=300):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        str(PROBE),
        *args,
    ]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


_runs: dict = {}


def run_plan(tmp_path_factory, nproc: int, *flags: str) -> dict:
    """Rank 0's record of one probe run (each plan runs once per test session)."""
    key = (nproc, flags)
    if key not in _runs:
        out = tmp_path_factory.mktemp("plan") / "out.json"
        if nproc == 1:
            result = subprocess.run(
                [sys.executable, str(PROBE), str(out), *SHAPE, *flags],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=300,
            )
        else:
            result = torchrun(nproc, str(out), *SHAPE, *flags)
        assert result.returncode == 0, result.stderr[-3000:]
        _runs[key] = json.loads(out.read_text())
        _runs[key]["ranks"] = [json.loads(open(f"{out}.rank{r}.json").read()) for r in range(nproc)]
    return _runs[key]


def rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_estimate_of_one_process_matches_its_measurement(tmp_path_factory):
    single = run_plan(tmp_path_factory, 1)
    check_estimate(single, dp=1, tp=1, fsdp=False)


def check_estimate(record, dp, tp, fsdp):
    shape = dict(
        n_layers=2,
        n_heads=4,
        d_model=64,
        d_ff=256,
        seq_len=32,
        batch_size=8 // dp,
        vocab_size=128,
        max_position_embeddings=32,
    )
    shape = Shape(**shape)
    predicted = per_rank_estimate(estimate_gpt(shape), dp, tp, fsdp, shape)
    for r in record["ranks"]:
        for category, measured in r["state_bytes"].items():
            assert measured == pytest.approx(predicted[category], rel=0.10), (r["worker"], category)


@pytest.mark.ddp
@pytest.mark.slow
def test_tensor_parallel_2_matches_one_process(tmp_path_factory):
    single, tp = run_plan(tmp_path_factory, 1), run_plan(tmp_path_factory, 2, "--tp", "2")
    assert len(tp["losses"]) == 5 and rel(tp["losses"], single["losses"]) < 1e-4
    assert [r["worker"] for r in tp["ranks"]] == ["rank0_dp0_tp0", "rank1_dp0_tp1"]
    check_estimate(tp, dp=1, tp=2, fsdp=False)  # per-rank memory predicted within 10%


@pytest.mark.ddp
@pytest.mark.slow
def test_fsdp_2_matches_ddp_2(tmp_path_factory):
    ddp, fsdp = run_plan(tmp_path_factory, 2), run_plan(tmp_path_factory, 2, "--fsdp")
    assert rel(fsdp["losses"], ddp["losses"]) < 1e-5
    assert fsdp["state_bytes"]["params"] * 2 == pytest.approx(ddp["state_bytes"]["params"], rel=0.01)
    check_estimate(fsdp, dp=2, tp=1, fsdp=True)
    # gradient accumulation (set_requires_gradient_sync) and activation checkpointing compose
    accum = run_plan(tmp_path_factory, 2, "--fsdp", "--grad-accum", "2", "--ac")
    assert rel(accum["losses"], ddp["losses"]) < 1e-5


@pytest.mark.ddp
@pytest.mark.slow
def test_fsdp_memory_breakdown_names_gathered_weights_and_sharded_gradients(tmp_path_factory):
    """minigpt.instruments.breakdown's own capture under FSDP 2: the gradients are the reduce-scattered shards
    (half of DDP's), the weights FSDP gathers for a block are parameters, not activations (so the
    activations are DDP's, the per-rank batch being the same), and the peak's parts add up to it."""
    ddp, fsdp = run_plan(tmp_path_factory, 2), run_plan(tmp_path_factory, 2, "--fsdp")
    for d, f in zip(ddp["ranks"], fsdp["ranks"]):
        assert f["state_bytes"]["grads"] == f["local_grads"] > 0
        assert f["state_bytes"]["grads"] * 2 == pytest.approx(d["state_bytes"]["grads"], rel=0.01)
        assert f["state_bytes"]["activations"] == d["state_bytes"]["activations"]
        parts = {p: sum(names.values()) for p, names in f["peak_parts"].items()}
        assert abs(sum(parts.values()) - f["peak"]) <= 0.02 * f["peak"]
        assert abs(f["peak"] - f["start_bytes"] - f["allocator_peak_delta"]) <= 0.02 * f["peak"]
        gathered = sum(v for k, v in f["peak_parts"]["params"].items() if "gathered by FSDP" in k)
        assert gathered > 0 and parts["params"] == f["state_bytes"]["params"] + gathered
        assert all("FSDP" not in name for name in f["peak_parts"]["temporaries"])  # all of FSDP's named


@pytest.mark.ddp
@pytest.mark.slow
def test_fsdp_x_tp_2_by_2_on_4_processes(tmp_path_factory):
    single, two_d = run_plan(tmp_path_factory, 1), run_plan(tmp_path_factory, 4, "--fsdp", "--tp", "2")
    assert rel(two_d["losses"], single["losses"]) < 1e-4
    assert [r["worker"] for r in two_d["ranks"]] == [
        "rank0_dp0_tp0",
        "rank1_dp0_tp1",
        "rank2_dp1_tp0",
        "rank3_dp1_tp1",
    ]
    check_estimate(two_d, dp=2, tp=2, fsdp=True)


@pytest.mark.ddp
@pytest.mark.slow
def test_sharded_checkpoint_resumes_bit_exact_and_reshards_4_to_2(tmp_path):
    straight, first, second = (tmp_path / n for n in ("straight.json", "first.json", "second.json"))
    ck, ck4 = tmp_path / "ck", tmp_path / "ck4"
    for args in [
        (2, straight, "--steps", "6", "--save", tmp_path / "end"),
        (2, first, "--steps", "3", "--save", ck),
        (2, second, "--steps", "3", "--load", ck, "--save", tmp_path / "end2"),
    ]:
        result = torchrun(args[0], str(args[1]), "--fsdp", *map(str, args[2:]))
        assert result.returncode == 0, result.stderr[-3000:]
    a, b, c = (json.loads(p.read_text()) for p in (straight, first, second))
    assert b["losses"] + c["losses"] == a["losses"]  # bit-exact in fp32 on the CPU
    assert c["params"] == a["params"]

    four = tmp_path / "four.json"
    result = torchrun(4, str(four), "--fsdp", "--steps", "3", "--save", str(ck4))
    assert result.returncode == 0, result.stderr[-3000:]
    result = torchrun(2, str(tmp_path / "after.json"), "--fsdp", "--steps", "3", "--load", str(ck4))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "from 4 ranks to 2" in result.stdout and "not repeat exactly" in result.stdout
    after = json.loads((tmp_path / "after.json").read_text())
    assert rel(after["losses"], a["losses"][3:]) < 1e-4  # resharded: close, not promised exact


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.ddp
@pytest.mark.slow
def test_two_torchrun_agents_as_two_nodes(tmp_path):
    port = free_port()
    out = tmp_path / "out.json"
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc_per_node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "minigpt-test",
                str(PROBE),
                str(out),
                "--fsdp",
                "--steps",
                "3",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [a.communicate(timeout=300) for a in agents]
    finally:
        for a in agents:
            a.kill()
    assert [a.returncode for a in agents] == [0, 0], [o[1][-2000:] for o in outputs]
    records = [json.loads(open(f"{out}.rank{r}.json").read()) for r in range(2)]
    assert [r["worker"] for r in records] == ["rank0_dp0", "rank1_dp1"]
    assert records[0]["losses"] == records[1]["losses"] and len(records[0]["losses"]) == 3


# ---------------------------------------------------------------------------- the trainer


def test_trainer_refuses_fsdp_without_torchrun(capsys):
    from conftest import fails

    assert "launch with torchrun" in fails(capsys, *TRAINER_TINY, "--fsdp")


TRAINER_TINY = ["--use-toy-data", "--preset", "tiny", "--num-steps", "6", "--log-interval", "3"]


@pytest.mark.ddp
@pytest.mark.slow
@pytest.mark.parametrize("flags, worker", [(["--fsdp"], "rank1_dp1"), (["--tp", "2"], "rank1_dp0_tp1")])
def test_trainer_end_to_end_under_fsdp_and_tp(tmp_path, flags, worker):
    out = tmp_path / "run"

    def train(*extra):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(ROOT / "train_minimal.py"),
            *TRAINER_TINY,
            *flags,
            "--out-dir",
            str(out),
            "--memory-profiler",
            "--memory-profile-step",
            "5",
            "--profile-ranks",
            "all",
            *extra,
        ]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)

    result = train()
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 6] and all(r["loss"] == r["loss"] for r in rows)
    assert (out / "checkpoints" / "ckpt" / ".metadata").is_file()  # sharded, through DCP
    assert (out / "memory_trace" / worker).is_dir()
    result = train("--num-steps", "8", "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Resumed from" in (out / "train.log").read_text()


@pytest.mark.ddp
@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--fsdp"], ["--tp", "2"]])
def test_log_line_and_metrics_carry_each_stages_time_in_collectives(tmp_path, flags):
    """Under FSDP and TP the collectives run inside the forward, the backward and the optimizer step
    (clipping's all-reduce): one profiled step per log interval gives each stage its time in them."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(ROOT / "train_minimal.py"), *TINY, "--num-steps", "4", "--log-interval", "1"]
    result = subprocess.run(
        [*cmd, *flags, "--out-dir", str(out), "--no-report", "--no-checkpoint"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "USDT" not in result.stdout + result.stderr  # Kineto's start/stop lines kept out of the log
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["stage_comm_ms"] == {} and rows[0]["comm_step"] is None  # step 1: one-time costs
    log = (out / "train.log").read_text()
    for row in rows[1:]:  # every interval is one step: its own step is profiled
        comm, host = row["stage_comm_ms"], row["stage_host_ms"]
        assert row["comm_step"] == row["step"] and list(comm) == list(STAGE_NAMES)
        assert comm["forward"] > 0 and comm["backward"] > 0 and comm["optimizer_step"] > 0
        for stage, ms in comm.items():  # a part of the stage (the profiler's range holds the clock's)
            assert ms <= host[stage] * 1.01 + 0.05, (stage, ms, host[stage])
        assert f"in collectives (step {row['step']}): h2d 0.0 fwd {comm['forward']:.1f}" in log


def test_one_step_per_interval_is_profiled_for_collectives_and_never_under_another_profiler():
    from minigpt.instruments.commprobe import CommProbe

    cfg = SimpleNamespace(
        use_profiler=True,
        profile_step_start=5,
        profile_step_end=7,
        memory_profiler=True,
        memory_profile_step=8,
    )
    probe, started = CommProbe(cfg), []
    for n in range(1, 13):
        if probe.start(n, first_step=1):
            started.append(n)
            probe.stop(n)
        if n % 3 == 0:  # a log interval of 3 steps
            probe.take()
    # 1: the run's first step; 4-6: the window and its warm-up step; 8: the memory step
    assert started == [2, 7, 10]
    probe.take()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert not probe.start(20, first_step=1)  # a profiler of someone else's: none nested in it


def test_the_raw_kineto_reader_agrees_with_the_profilers_events():
    """CommProbe reads the profiler's raw results (faster); the figure must be prof.events()'s."""
    import time

    from torch.autograd.profiler import record_function

    from minigpt.core.torchcompat import kineto_spans
    from minigpt.instruments.commprobe import comm_by_stage, stage_comm_ms

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with record_function("forward"):
            torch.ones(100) @ torch.ones(100)
            with record_function("c10d::allreduce_"):  # a stand-in collective of about 5 ms
                time.sleep(0.005)
    raw, parsed = comm_by_stage(kineto_spans(prof), STAGE_NAMES), stage_comm_ms(prof.events(), STAGE_NAMES)
    assert raw.keys() == parsed.keys() and 4.5 < raw["forward"] < 50
    assert all(abs(raw[k] - parsed[k]) < 0.01 for k in raw)
