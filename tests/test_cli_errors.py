"""Every user mistake ends with one line on stderr, exit status 2, no traceback, nothing damaged."""

import hashlib

import pytest
import torch
from conftest import TINY, fails, run_cli

import train_minimal


@pytest.fixture
def text(tmp_path):
    def make(content: str, name: str = "data.txt"):
        path = tmp_path / name
        path.write_text(content)
        return str(path)

    return make


def test_missing_data_file(capsys, tmp_path):
    out = tmp_path / "run"
    msg = fails(capsys, "--train-data", str(tmp_path / "nope.txt"), "--out-dir", str(out))
    assert "nope.txt does not exist" in msg
    assert not out.exists()  # nothing written for a run that never started


def test_missing_blog_data_file_names_the_command_that_writes_it(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a fresh checkout: data/train.txt is not there until prepare.py runs
    msg = fails(capsys, "--train-data", "data/train.txt", "--out-dir", str(tmp_path / "run"))
    assert "data/train.txt does not exist" in msg and "python data/prepare.py" in msg


def test_empty_data_file(capsys, text, tmp_path):
    assert "is empty" in fails(capsys, "--train-data", text(""), "--out-dir", str(tmp_path / "r"))


def test_too_few_tokens_says_how_many(capsys, text, tmp_path):
    msg = fails(
        capsys,
        "--preset",
        "tiny",
        "--train-data",
        text("Hello world " * 20),
        "--out-dir",
        str(tmp_path / "r"),
    )
    assert "the training data: 37 tokens; --seq-len 64 needs 65" in msg


def test_too_few_validation_tokens(capsys, text, tmp_path):
    msg = fails(
        capsys,
        "--preset",
        "tiny",
        "--train-data",
        text("Hello world " * 500),
        "--val-data",
        text("Hello", "val.txt"),
        "--out-dir",
        str(tmp_path / "r"),
    )
    assert "the validation data: 1 tokens" in msg


def test_too_few_held_out_tokens_name_the_held_out_tenth(capsys, text, tmp_path):
    """Without --val-data the last tenth of --train-data validates: too short, it is named as that,
    not as validation data the user never gave."""
    msg = fails(
        capsys,
        "--preset",
        "tiny",
        "--train-data",
        text("Hello world " * 200),
        "--out-dir",
        str(tmp_path / "r"),
    )
    assert "--train-data's last tenth, held out to validate, is 40 tokens; --seq-len 64 needs 65" in msg
    assert msg.endswith("give --val-data, or more --train-data")
    big = text("Hello world " * 2000, "big.txt")
    msg = fails(
        capsys,
        "--preset",
        "tiny",
        "--train-data",
        big,
        "--max-tokens",
        "500",
        "--out-dir",
        str(tmp_path / "r"),
    )
    assert "is 50 tokens" in msg and msg.endswith("give --val-data, or raise --max-tokens")  # the cap's fault


def test_max_tokens_below_one_window_is_one_line(capsys, tmp_path):
    """--max-tokens cuts the built-in corpus too: below seq_len + 1 it is refused, not a traceback."""
    msg = fails(capsys, "--preset", "tiny", "--max-tokens", "10", "--out-dir", str(tmp_path / "r"))
    assert "the training data: 10 tokens; --seq-len 64 needs 65" in msg


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--d-model", "100", "--n-heads", "3"], "--d-model must be divisible by --n-heads"),
        (
            ["--seq-len", "128", "--max-position-embeddings", "64"],
            "--seq-len must be at most --max-position-embeddings",
        ),
        (["--batch-size", "0"], "--batch-size must be positive"),
        (["--num-steps", "-5"], "--num-steps must be positive"),
        (["--n-layers", "0"], "--n-layers must be positive"),
        (["--lr", "0"], "--lr must be positive"),
        (["--dropout", "1.5"], "--dropout must be below 1, got 1.5"),
        (["--lr", "fast"], "invalid float value: 'fast'"),
        (["--preset", "huge"], "invalid choice: 'huge'"),
        (["--amp-dtype", "fp16", "--device", "cpu"], "fp16 needs CUDA"),
        (
            ["--use-toy-data", "--train-data", "x.txt"],
            "--use-toy-data makes its own tokens: drop the data flags",
        ),
    ],
)
def test_bad_flags(capsys, tmp_path, args, expected):
    assert expected in fails(capsys, *args, "--out-dir", str(tmp_path / "r"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_without_a_gpu(capsys, tmp_path):
    assert "no CUDA GPU" in fails(capsys, *TINY, "--device", "cuda", "--out-dir", str(tmp_path / "r"))


def test_resume_without_a_checkpoint(capsys, tmp_path):
    msg = fails(capsys, *TINY, "--resume", "--out-dir", str(tmp_path / "r"))
    assert "no checkpoint at" in msg and "--resume" in msg


@pytest.fixture
def trained(tmp_path):
    out = tmp_path / "run"
    assert train_minimal.cli([*TINY, "--num-steps", "2", "--out-dir", str(out)]) == 0
    return out


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_checkpoint_is_refused_and_left_alone(capsys, trained, damage):
    ckpt = trained / "checkpoints" / "ckpt.pt"
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"not a checkpoint" * 100)
    before, log_before = digest(ckpt), (trained / "train.log").read_text()
    msg = fails(capsys, *TINY, "--num-steps", "4", "--resume", "--out-dir", str(trained))
    assert "corrupt or truncated" in msg
    assert digest(ckpt) == before and (trained / "train.log").read_text() == log_before


def test_checkpoint_of_another_shape(capsys, trained):
    msg = fails(capsys, *TINY, "--d-model", "64", "--num-steps", "4", "--resume", "--out-dir", str(trained))
    assert "different model" in msg and "d_model 32 vs 64" in msg


def test_resume_past_the_end(capsys, trained):
    msg = fails(capsys, *TINY, "--num-steps", "2", "--resume", "--out-dir", str(trained))
    assert "already past --num-steps 2" in msg


def test_existing_run_is_not_overwritten_without_resume(capsys, trained):
    before = digest(trained / "checkpoints" / "ckpt.pt")
    assert "already exists" in fails(capsys, *TINY, "--num-steps", "2", "--out-dir", str(trained))
    assert digest(trained / "checkpoints" / "ckpt.pt") == before


def test_a_real_process_prints_one_line_and_exits_2(tmp_path):
    r = run_cli("--train-data", str(tmp_path / "missing.txt"), "--out-dir", str(tmp_path / "r"))
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: data file") and len(r.stderr.strip().splitlines()) == 1
    assert r.stdout == ""


# ---------------------------------------------------------------------------- instrumentation flags


@pytest.mark.parametrize(
    "window, expected",
    [
        (["--profile-step-start", "0", "--profile-step-end", "2"], "1 <= --profile-step-start"),
        (
            ["--profile-step-start", "3", "--profile-step-end", "3"],
            "--profile-step-start < --profile-step-end",
        ),
        (["--profile-step-start", "2", "--profile-step-end", "9"], "--profile-step-end <= --num-steps"),
    ],
)
def test_bad_profile_window(capsys, tmp_path, window, expected):
    out = tmp_path / "run"
    msg = fails(capsys, *TINY, "--num-steps", "6", "--use-profiler", *window, "--out-dir", str(out))
    assert expected in msg and not out.exists()


def test_profile_ranks_outside_the_world(capsys, tmp_path):
    msg = fails(capsys, *TINY, "--use-profiler", "--profile-ranks", "0,1", "--out-dir", str(tmp_path / "r"))
    assert "outside 0..0" in msg and "world size is 1" in msg


def test_profile_ranks_not_a_list(capsys):
    assert "'all' or a list" in fails(capsys, *TINY, "--profile-ranks", "first")


def test_nsys_and_profiler_exclude_each_other(capsys):
    assert "exclude each other" in fails(capsys, *TINY, "--nsys", "--use-profiler")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
@pytest.mark.parametrize("flag", ["--nsys", "--record-memory-history", "--auto-batch-size", "--tf32"])
def test_cuda_only_features_are_refused_on_the_cpu(capsys, tmp_path, flag):
    out = tmp_path / "run"
    msg = fails(capsys, *TINY, flag, "--out-dir", str(out))
    assert msg == f"error: {flag} needs CUDA; this run is on the CPU" and not out.exists()


def test_memory_history_entries_must_be_positive(capsys):
    assert "--memory-history-entries must be at least 1" in fails(
        capsys, *TINY, "--memory-history-entries", "0"
    )


# ---------------------------------------------------------------------------- distributed flags


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--straggler-threshold", "1.5"], "--straggler-threshold must be at most 1"),
        (["--ddp-timeout", "0"], "--ddp-timeout must be positive"),
        (["--simulate-slow-rank", "1"], "RANK:MS or RANK:MS:STAGE"),
        (["--simulate-slow-rank", "a:b"], "RANK:MS or RANK:MS:STAGE"),
        (["--simulate-slow-rank", "0:-5"], "the delay positive"),
        (["--simulate-slow-rank", "0:5:lunch"], "unknown stage 'lunch'"),
        (["--simulate-slow-rank", "1:50"], "no rank 1 in a world of 1"),
    ],
)
def test_bad_distributed_flags(capsys, tmp_path, flags, expected):
    out = tmp_path / "run"
    assert expected in fails(capsys, *TINY, *flags, "--out-dir", str(out))
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_nccl_backend_on_the_cpu(capsys):
    assert "--ddp-backend needs CUDA" in fails(capsys, *TINY, "--ddp-backend", "nccl")


def test_minigpt_args_are_appended_and_win(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIGPT_ARGS", "--num-steps 3 --log-interval 3")
    out = tmp_path / "run"
    assert train_minimal.cli([*TINY, "--num-steps", "50", "--out-dir", str(out)]) == 0
    assert "step 3/3" in (out / "train.log").read_text()
    assert "Flags appended from $MINIGPT_ARGS: --num-steps 3" in (out / "train.log").read_text()


# ---------------------------------------------------------------------------- numbers (issue 14, item 5)


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--lr", "inf"], "--lr must be a finite number, got inf"),
        (["--lr", "nan"], "--lr must be a finite number, got nan"),  # not blamed on --min-lr
        (["--min-lr", "nan"], "--min-lr must be a finite number"),
        (["--weight-decay", "nan"], "--weight-decay must be a finite number"),
        (["--grad-clip", "nan"], "--grad-clip must be a finite number"),  # NaN once turned clipping off
        (["--dropout", "nan"], "--dropout must be a finite number"),
        (["--ddp-timeout", "nan"], "--ddp-timeout must be a finite number"),
        (["--ddp-timeout", "1e30"], "--ddp-timeout must be at most 604800"),  # a week
        (["--straggler-threshold", "nan"], "--straggler-threshold must be a finite number"),
        (["--device-memory-gb", "inf"], "--device-memory-gb must be a finite number"),
        (["--device-memory-gb", "1e-12"], "--device-memory-gb must be at least 0.000976562"),  # 1 MiB
        (["--peak-tflops", "nan"], "--peak-tflops must be a finite number"),
        (["--seed", "-1"], "--seed must be at least 0, got -1"),
        (["--seed", "4294967296"], "got 4294967296"),
        (["--data-seed", "123456789012345678901234567890"], "--data-seed must be at most"),
        (["--vocab-size", "10000000000000"], "this configuration needs about"),
        (["--vocab-size", "1e13"], "lower its model or batch"),
        (["--eval-iters", str(2**64)], "--eval-iters must be at most 65536"),
        (["--num-step", "5"], "unrecognized arguments: --num-step 5"),
    ],
)
def test_bad_numbers_are_refused_before_anything_is_written(capsys, tmp_path, monkeypatch, flags, expected):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    assert expected in fails(capsys, *TINY, *flags, "--out-dir", str(out))
    assert list(tmp_path.iterdir()) == []  # no run directory, nothing else


def test_several_training_files_are_all_used(capsys, text, tmp_path):
    a, b = text("alpha beta gamma " * 60, "a.txt"), text("delta epsilon " * 60, "b.txt")
    out = tmp_path / "run"
    assert (
        train_minimal.cli(
            [*TINY[1:], "--train-data", a, "--train-data", b, "--num-steps", "1", "--out-dir", str(out)]
        )
        == 0
    )
    log = (out / "train.log").read_text()
    assert a in log and b in log


@pytest.mark.parametrize("flag", ["--out-dir", "--checkpoint-path", "--train-data", "--val-data"])
@pytest.mark.parametrize("shape", ["name", "path"])
def test_a_path_too_long_for_the_file_system_is_one_line_naming_its_flag(capsys, tmp_path, flag, shape):
    """A name past 255 bytes (or a path past 4,096) fails deep inside open() as '[Errno 36]': it is
    refused as the flags are read, naming the flag, and nothing is written."""
    long = tmp_path / ("a" * 256) if shape == "name" else tmp_path / "/".join(["b" * 200] * 21)
    value = str(long / "ckpt.pt") if flag == "--checkpoint-path" else str(long)
    base = TINY if flag in ("--out-dir", "--checkpoint-path") else TINY[1:]  # data files: no toy data
    out = [] if flag == "--out-dir" else ["--out-dir", str(tmp_path / "r")]
    line = fails(capsys, *base, flag, value, *out)
    if shape == "name":
        assert line.startswith(f"error: {flag} has a name longer than 255 bytes"), line
    else:
        assert line.startswith(f"error: {flag}") and "4,096" in line and "choose a shorter one" in line, line
    assert list(tmp_path.iterdir()) == []
