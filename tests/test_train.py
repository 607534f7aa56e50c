"""The trainer end to end, on tiny configurations: what it prints, writes and resumes."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, TINY, in_process, run_cli

import train_minimal
from minigpt.config import parse_args
from minigpt.instruments.mfu import resolve_amp


def read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_toy_run_learns_and_writes_its_run_directory(tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        train_minimal.cli([*TINY, "--num-steps", "100", "--log-interval", "20", "--out-dir", str(out)]) == 0
    )
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert any(f"Run directory: {out}" in line for line in lines)
    assert lines[-1].endswith(f"python sample.py --out-dir {out}")  # every run ends with what to do next
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [20, 40, 60, 80, 100]
    assert rows[0]["loss"] > 3.0  # ln(64) = 4.2 at the start
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"]
    assert rows[-1]["val_loss"] is not None and rows[-1]["val_ppl"] == pytest.approx(
        math.exp(rows[-1]["val_loss"])
    )
    # AMP is on by default only where the CPU runs bf16 natively (this one has AVX512-BF16).
    native_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert all(r["tokens_per_s"] > 0 and r["amp"] == ("bf16" if native_bf16 else "fp32") for r in rows)
    log = (out / "train.log").read_text()
    assert "step 100/100" in log and "val ppl" in log and "Training finished" in log
    config = json.loads((out / "config.json").read_text())
    assert config["config"]["num_steps"] == 100 and config["versions"]["torch"] == torch.__version__
    assert config["device"] == "cpu" and config["model"]["vocab_size"] == 64
    state = torch.load(out / "checkpoints" / "ckpt.pt", weights_only=True)
    assert state["step"] == 100 and state["data_position"] == 100
    assert set(state["model"]) >= {"wte.weight", "blocks.0.attn.qkv.weight"}


def test_bf16_autocast_on_cpu_trains_in_bf16():
    from minigpt.core.model import GPT, GPTConfig

    model = GPT(
        GPTConfig(vocab_size=64, max_position_embeddings=16, n_layers=1, n_heads=2, d_model=32, d_ff=64)
    )
    x = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(x, x)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert model.wte.weight.grad.dtype == torch.float32  # master weights stay fp32


def test_no_amp_trains_in_fp32(tmp_path):
    out = tmp_path / "run"
    assert train_minimal.cli([*TINY, "--num-steps", "2", "--no-amp", "--out-dir", str(out)]) == 0
    assert read_metrics(out)[-1]["amp"] == "fp32"
    assert "AMP off (--no-amp)" in (out / "train.log").read_text()


def test_gradient_accumulation_matches_a_bigger_batch(tmp_path):
    # 2 micro-batches of 4 from positions (0, 1) vs the same 8 rows at once: same first update.
    import numpy as np

    from minigpt.core.model import GPT, GPTConfig
    from minigpt.core.toy import ToyBatches

    batches = ToyBatches(np.zeros(0, "<u2"), 4, 16, seed=0, vocab_size=64)
    micro = [next(batches) for _ in range(2)]
    big = tuple(torch.cat(t) for t in zip(*micro))
    grads = []
    for chunks in (micro, [big]):
        torch.manual_seed(0)
        model = GPT(
            GPTConfig(vocab_size=64, max_position_embeddings=16, n_layers=1, n_heads=2, d_model=32, d_ff=64)
        )
        for x, y in chunks:
            (model(x, y)[1] / len(chunks)).backward()
        grads.append(model.wte.weight.grad)
    torch.testing.assert_close(grads[0], grads[1])


def sigterm_at(stop_step: int):
    """An on_step callback (train_minimal.main's seam) that sends this process SIGTERM as step
    `stop_step` (1-based) starts, as a scheduler would."""

    def on_step(step: int) -> None:
        if step == stop_step:
            os.kill(os.getpid(), signal.SIGTERM)

    return on_step


@pytest.mark.parametrize("extra", [[], ["--grad-accum-steps", "2"]])
def test_resume_repeats_the_uninterrupted_losses(tmp_path, monkeypatch, extra):
    flags = [
        *TINY,
        *extra,
        "--dropout",
        "0.1",
        "--log-interval",
        "1",
        "--eval-interval",
        "3",
        "--num-steps",
        "8",
    ]
    full, part = tmp_path / "full", tmp_path / "part"
    assert train_minimal.cli([*flags, "--out-dir", str(full)]) == 0
    assert train_minimal.cli([*flags, "--out-dir", str(part)], on_step=sigterm_at(4)) == 128 + signal.SIGTERM
    assert train_minimal.cli([*flags, "--out-dir", str(part), "--resume"]) == 0
    expected = {r["step"]: (r["loss"], r["val_loss"]) for r in read_metrics(full)}
    resumed = {r["step"]: (r["loss"], r["val_loss"]) for r in read_metrics(part)[4:]}
    assert list(resumed) == [5, 6, 7, 8]
    for step, (loss, val_loss) in resumed.items():
        assert loss == expected[step][0], step  # bit for bit on the CPU
        if step % 3 == 0 or step == 8:  # evaluated at this step
            assert val_loss == expected[step][1], step
    assert "Resumed from" in (part / "train.log").read_text()


def test_eval_interval_holds_when_it_is_not_a_multiple_of_the_log_interval(tmp_path):
    out = tmp_path / "run"
    flags = ["--log-interval", "10", "--eval-interval", "15", "--num-steps", "30", "--out-dir", str(out)]
    assert train_minimal.cli([*TINY, *flags]) == 0
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [10, 15, 20, 30]
    val = [r["val_loss"] for r in rows]
    assert val[0] is None and val[1] is not None  # first evaluated at step 15
    # step 20 was not evaluated: no val loss there (step 15's is not carried as if new); step 30's is new
    assert val[2] is None and val[3] is not None and val[3] != val[1]
    assert [r["val_ppl"] is None for r in rows] == [True, False, True, False]


def test_sigterm_saves_and_exits_with_a_message(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "train_minimal.py"),
            *TINY,
            "--num-steps",
            "100000",
            "--log-interval",
            "1",
            "--out-dir",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.time() < deadline, (
            proc.stderr.read() if proc.poll() else "timeout"
        )
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "Stopped by SIGTERM" in stdout and "--resume" in stdout
    state = torch.load(out / "checkpoints" / "ckpt.pt", weights_only=True)
    assert 0 < state["step"] < 100000
    assert state["step"] == read_metrics(out)[-1]["step"]


def test_sigterm_during_a_long_evaluation_stops_promptly_and_saves(tmp_path):
    """65,536 validation batches take minutes: a SIGTERM abandons the evaluation, and the run saves
    and stops after the next step as it does when the signal comes during a step."""
    out = tmp_path / "run"
    flags = ["--num-steps", "100", "--log-interval", "1", "--eval-interval", "1", "--eval-iters", "65536"]
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train_minimal.py"), *TINY, *flags, "--out-dir", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while (
        not (out / "train.log").exists() or "evaluation: still running" not in (out / "train.log").read_text()
    ):
        assert proc.poll() is None and time.time() < deadline, (
            proc.stderr.read() if proc.poll() else "timeout"
        )
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)  # the whole evaluation would take minutes
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "Stopped by SIGTERM after step 2" in stdout, stdout
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["val_loss"] is None  # no half evaluation
    assert torch.load(out / "checkpoints" / "ckpt.pt", weights_only=True)["step"] == 2


def write_step_rates(cache, flags: list[str], rounds):
    """A rate cache (minigpt.instruments.predict) holding every rate the run's step needs, each `rounds`;
    returns the run's shape (minigpt.core.shape.shape_of)."""
    from minigpt.config import parse_args
    from minigpt.core.shape import shape_of
    from minigpt.instruments import predict

    cfg = parse_args(flags)
    shape = shape_of(cfg, cfg.vocab_size)
    needed = predict.kernels(predict.step_ops(shape, "fp32"))
    entries = {k: {"rounds": rounds} for k in needed}
    entries["bandwidth"] = {"rounds": {"4096": rounds, "400000000": rounds}}
    entries["exp"] = {"rounds": rounds}
    entries["overhead"] = {"rounds": {"op": [1e-5] * 3, "autograd": [2e-5] * 3}}
    (cache / predict.STEP_RATES_FILE).write_text(json.dumps({predict.rates_key("cpu", "fp32"): entries}))
    return shape


def test_config_json_keeps_the_predicted_step_when_the_rates_are_cached(tmp_path, monkeypatch):
    """--predict-time: at the end, the step predicted from the cached rates, beside the measured one."""
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path))
    flags = [*TINY, "--no-amp", "--num-steps", "2", "--no-report", "--predict-time"]
    from minigpt.instruments.predict import predict_step

    shape = write_step_rates(tmp_path, flags, [1e10] * 3)
    expected = predict_step(shape, "fp32", "cpu", measure=False).to_record()
    assert train_minimal.cli([*flags, "--out-dir", str(tmp_path / "run")]) == 0
    stored = json.loads((tmp_path / "run" / "config.json").read_text())["predicted_step"]
    assert stored["stage_ms"] == pytest.approx(expected["stage_ms"])
    assert set(stored["stage_ms"]) == {"forward", "backward", "optimizer_step"} and stored["tested"] is True
    # the log says the prediction, and the steady step's share of it
    log = (tmp_path / "run" / "train.log").read_text()
    assert f"Predicted step: {stored['step_ms']:.1f} ms (forward " in log
    assert "from this machine's measured rates" in log
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    steady_ms = 1000 * last["run_step_time_s"] / last["run_steps"]
    share = f"a steady step of {steady_ms:.1f} ms, {steady_ms / stored['step_ms']:.0%} of the predicted "
    assert share + f"{stored['step_ms']:.1f}" in log
    # no rates cached, or a damaged cache: no prediction, and the run is not harmed
    write_step_rates(tmp_path, flags, "fast")
    assert train_minimal.cli([*flags, "--out-dir", str(tmp_path / "damaged")]) == 0
    assert "predicted_step" not in json.loads((tmp_path / "damaged" / "config.json").read_text())


def test_the_rates_estimate_time_caches_are_the_ones_the_trainer_reads(tmp_path, monkeypatch, capsys):
    """`python -m minigpt estimate --time` then a run with --predict-time gives the run its
    prediction: both read the same cache, under the same key. The estimate runs here, each kernel
    timed briefly (how long it times them is not what this tests); the run in a process of its own."""
    from minigpt.instruments import estimate, predict

    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(predict, "SAMPLE_S", 0.01)
    monkeypatch.setattr(predict, "EVICTED_CALLS", 2)
    flags = [*TINY, "--no-amp", "--num-steps", "2", "--no-report"]
    timed = in_process(capsys, lambda: estimate.main(["--time", *flags]))
    assert timed.returncode == 0, timed.stderr
    trained = subprocess.run(
        [sys.executable, "train_minimal.py", *flags, "--predict-time", "--out-dir", str(tmp_path / "r")],
        cwd=ROOT,
        env={**os.environ, "MINIGPT_CACHE_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert trained.returncode == 0, trained.stderr
    stored = json.loads((tmp_path / "r" / "config.json").read_text())
    from minigpt.instruments.predict import STEP_RATES_FILE, loaded

    path = tmp_path / STEP_RATES_FILE
    rates = json.loads(path.read_text()) if path.exists() else {}  # none where every rate ran busy
    entries = [e for kernels in rates.values() for e in kernels.values() if isinstance(e, dict)]
    if not rates or any(loaded(e) for e in entries):
        assert "predicted_step" not in stored  # rates timed on a busy machine predict nothing
        assert "Predicted step: none (no rates measured here" in trained.stdout  # and the run says so
    else:
        assert set(stored["predicted_step"]["stage_ms"]) == {"forward", "backward", "optimizer_step"}


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    flags = [*TINY, "--num-steps", "10", "--save-interval", "3", "--log-interval", "5", "--out-dir", str(out)]
    calls = {"n": 0}
    forward = train_minimal.GPT.forward

    def poisoned(self, idx, targets=None):
        logits, loss = forward(self, idx, targets)
        calls["n"] += self.training
        if self.training and calls["n"] == 5:  # the forward of step 5
            loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(train_minimal.GPT, "forward", poisoned)
    assert train_minimal.cli(flags) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "at step 5" in err and "left intact" in err
    state = torch.load(out / "checkpoints" / "ckpt.pt", weights_only=True)
    assert state["step"] == 3
    assert all(torch.isfinite(t).all() for t in state["model"].values())


def test_main_job_end_to_end_on_a_short_run(tmp_path):
    """`python train_minimal.py` as in the README, cut to 3 steps: built-in corpus, default model."""
    out = tmp_path / "main"
    r = run_cli("--num-steps", "3", "--log-interval", "1", "--eval-iters", "1", "--out-dir", str(out))
    assert r.returncode == 0, r.stderr
    assert "built-in corpus" in r.stdout and "4 layers" in r.stdout
    rows = read_metrics(out)
    assert rows[0]["loss"] == pytest.approx(math.log(50257), abs=0.6)  # untrained: about ln(vocab)
    assert rows[-1]["val_loss"] is not None
    lines = r.stdout.strip().splitlines()
    assert any(
        line.endswith(f"Run directory: {out} (train.log, metrics.jsonl, config.json)") for line in lines
    )
    assert any(
        line.endswith(
            f"Report: {out / 'report.html'} (one offline page; python -m minigpt report rewrites it)"
        )
        for line in lines
    )
    assert "Next steps:" in r.stdout and lines[-1].endswith(f"python sample.py --out-dir {out}")


@pytest.mark.slow
def test_main_job_default_run_learns(tmp_path):
    """The full default job: loss falls from about ln(vocab) to clearly lower values."""
    out = tmp_path / "main"
    r = run_cli("--out-dir", str(out), timeout=900)
    assert r.returncode == 0, r.stderr
    rows = read_metrics(out)
    assert rows[-1]["loss"] < rows[0]["loss"] - 3 and rows[-1]["val_loss"] < 6.5


# ---------------------------------------------------------------------------- a resume that changes the run


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """Two runs of 10 steps, their checkpoints to resume: toy data, and a text file."""
    root = tmp_path_factory.mktemp("changes")
    (root / "a.txt").write_text("alpha beta gamma delta " * 100)
    (root / "b.txt").write_text("epsilon zeta eta theta " * 100)
    toy = [*TINY, "--peak-tflops", "1", "--no-report", "--log-interval", "5"]
    text = [
        *TINY[1:],
        "--peak-tflops",
        "1",
        "--no-report",
        "--log-interval",
        "5",
        "--train-data",
        str(root / "a.txt"),
    ]
    for name, flags in (("toy", toy), ("text", text)):
        assert train_minimal.cli([*flags, "--num-steps", "10", "--out-dir", str(root / name)]) == 0
    return root, {"toy": toy, "text": text}


def digests(out) -> dict:
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.rglob("*")) if p.is_file()}


NATIVE_BF16 = resolve_amp(parse_args(["--preset", "tiny"]), "cpu")[0] == "bf16"
# (the run, the flags that change it, what the one line names)
CHANGES = [
    ("toy", ["--batch-size", "4"], "--batch-size 8 -> 4"),
    # the precision as this CPU resolves it: AMP is on by default where bf16 is native
    ("toy", *((["--no-amp"], "bf16 -> fp32") if NATIVE_BF16 else (["--amp"], "fp32 -> bf16"))),
    ("toy", ["--grad-accum-steps", "2"], "--grad-accum-steps 1 -> 2"),
    ("toy", ["--lr", "0.02"], "--lr 0.01 -> 0.02"),
    ("toy", ["--lr-scheduler", "linear"], "--lr-scheduler 'cosine' -> 'linear'"),
    ("toy", ["--seed", "7"], "--seed 1337 -> 7"),
    ("toy", ["--data-seed", "7"], "--data-seed 1337 -> 7"),
    ("toy", ["--dropout", "0.1"], "--dropout 0.0 -> 0.1"),
    ("toy", ["--chunked-loss"], "--chunked-loss False -> True"),
    ("toy", ["--warmup-steps", "3"], "--warmup-steps 1 -> 3"),
    ("text", ["--max-tokens", "300"], "--max-tokens None -> 300"),
    ("text", ["--train-data", "b.txt"], "--train-data"),
]


@pytest.mark.parametrize("name, change, named", CHANGES, ids=[" ".join(c) for _, c, _ in CHANGES])
def test_a_resume_that_changes_the_run_is_refused_in_one_line(capsys, stopped, name, change, named):
    root, flags = stopped
    out = root / name
    if change[0] == "--train-data":  # another file beside the first: another run
        flags = {**flags, name: flags[name][:-2]}  # without its own --train-data a.txt, the last two
        change = ["--train-data", str(root / change[1])]
    before = digests(out)
    capsys.readouterr()
    status = train_minimal.cli(
        [*flags[name], *change, "--resume", "--num-steps", "12", "--out-dir", str(out)]
    )
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1, err
    assert "this --resume changes the run" in err and named in err and "--allow-changes" in err, err
    assert digests(out) == before  # refused before anything was touched


def test_allow_changes_continues_and_keeps_the_changes(stopped, tmp_path):
    """--allow-changes: the run goes on changed; config.json's changed_on_resume and the log's first
    lines say what changed and at which step, and a later resume with the changed flags is no change."""
    import shutil

    root, flags = stopped
    out = tmp_path / "run"
    shutil.copytree(root / "toy", out)
    changed = [*flags["toy"], "--lr", "0.02"]
    assert (
        train_minimal.cli(
            [*changed, "--resume", "--num-steps", "12", "--allow-changes", "--out-dir", str(out)]
        )
        == 0
    )
    config = json.loads((out / "config.json").read_text())["config"]
    assert config["changed_on_resume"] == ["at step 10: --lr 0.01 -> 0.02"] and config["lr"] == 0.02
    log = (out / "train.log").read_text()
    assert "Resumed from" in log and "at step 10, changed (--allow-changes): --lr 0.01 -> 0.02" in log
    # the checkpoint now holds the changed flags: resuming with them again is no change, and the
    # record of the earlier one is kept
    assert train_minimal.cli([*changed, "--resume", "--num-steps", "14", "--out-dir", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())["config"]
    assert config["changed_on_resume"] == ["at step 10: --lr 0.01 -> 0.02"]


def test_more_steps_is_no_change_of_the_run(stopped, tmp_path):
    """--num-steps (and the warm-up it derives, 10% of the steps) may grow on a resume: that is
    continuing the run (a --warmup-steps given is compared: CHANGES)."""
    import shutil

    root, flags = stopped
    out = tmp_path / "run"
    shutil.copytree(root / "toy", out)
    assert train_minimal.cli([*flags["toy"], "--resume", "--num-steps", "30", "--out-dir", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["config"]["changed_on_resume"] == []
