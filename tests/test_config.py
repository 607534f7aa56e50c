"""The command line as a user meets it: --help tells every default and what the presets set, each
flag is defined once (the parser is built from TrainConfig's fields), explicit flags beat the preset,
and every numeric flag is checked before anything runs."""

import argparse
import dataclasses
import os
import subprocess
import sys

import pytest
from conftest import TINY, fails
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minigpt import config
from minigpt.config import PRESETS, TrainConfig, UsageError, build_parser, parse_args


def actions():
    return [a for a in build_parser()._actions if a.dest != "help"]


def refused(*args: str) -> str:
    with pytest.raises(UsageError) as e:
        parse_args(list(args))
    return str(e.value)


# ---------------------------------------------------------------------------- one definition


def test_every_field_has_a_flag_and_every_flag_a_field():
    assert sorted(a.dest for a in actions()) == sorted(f.name for f in dataclasses.fields(TrainConfig))


def test_each_field_carries_help_and_group():
    for f in dataclasses.fields(TrainConfig):
        assert f.metadata["help"] and f.metadata["group"], f.name


def test_help_shows_every_default():
    """--help writes each flag's default into its help (the preset's, where --preset sets it)."""
    switches = (argparse._StoreTrueAction, argparse._StoreFalseAction)
    parser = build_parser()
    parser.format_help()
    for a in (a for a in parser._actions if a.dest != "help"):
        if not isinstance(a, switches):
            assert "(default: " in a.help, a.option_strings


def test_help_shows_real_defaults_and_what_none_means():
    text = build_parser().format_help()
    flat = " ".join(text.split())  # argparse wraps lines
    for expected in [
        "--n-layers N transformer blocks (default: 4)",
        "--lr LR peak learning rate (default: 0.001)",
        "(default: 1337)",
        "(default: 0.1)",
        "--d-ff N MLP width (default: 1024)",
        "--min-lr LR final learning rate (default: --lr / 10)",
        "(default: 10% of the steps, <= 100)",
        "--tp N",
        "(default: 1)",
    ]:
        assert expected in flat, expected


def test_help_lists_what_each_preset_sets_and_mentions_minigpt_args():
    text = build_parser().format_help()
    for name, values in PRESETS.items():
        line = next(line for line in text.splitlines() if line.strip().startswith(name + " "))
        for key, value in values.items():
            assert f"'{key}': {value}" in line, (name, key)
    assert "$MINIGPT_ARGS" in text


def test_help_exits_0(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0 and "--peak-tflops" in capsys.readouterr().out


@pytest.mark.parametrize("abbreviation", [["--num-step", "5"], ["--lr-sched", "linear"], ["--no-check"]])
def test_abbreviations_are_refused(capsys, abbreviation):
    assert "unrecognized arguments" in fails(capsys, *abbreviation)


# ---------------------------------------------------------------------------- precedence


def test_preset_overrides_field_defaults():
    assert parse_args(["--preset", "tiny"]).n_layers == PRESETS["tiny"]["n_layers"]
    assert parse_args([]).d_model == PRESETS[config.DEFAULT_PRESET]["d_model"]
    assert parse_args(["--preset", "gpt2"]).max_position_embeddings == 1024


def test_explicit_flags_override_the_preset_even_when_equal_to_the_field_default():
    default_layers = next(f.default for f in dataclasses.fields(TrainConfig) if f.name == "n_layers")
    assert default_layers != PRESETS["tiny"]["n_layers"]
    cfg = parse_args(["--preset", "tiny", "--n-layers", str(default_layers)])
    assert cfg.n_layers == default_layers
    assert parse_args(["--n-layers", "3", "--preset", "tiny"]).n_layers == 3  # order does not matter


def test_derived_defaults():
    cfg = parse_args(["--preset", "tiny", "--lr", "0.02", "--num-steps", "50", "--seed", "7"])
    assert cfg.min_lr == pytest.approx(0.002) and cfg.warmup_steps == 5 and cfg.data_seed == 7
    assert cfg.max_position_embeddings == cfg.seq_len


def test_minigpt_args_win(monkeypatch):
    monkeypatch.setenv("MINIGPT_ARGS", "--num-steps 3")
    assert parse_args(["--num-steps", "50"]).num_steps == 3


def test_data_files_append():
    cfg = parse_args(["--train-data", "a", "--train-data", "b", "c", "--val-data", "v", "--val-data", "w"])
    assert cfg.train_data == ["a", "b", "c"] and cfg.val_data == ["v", "w"]
    assert parse_args([]).train_data == []


def test_integers_in_scientific_notation():
    assert parse_args(["--max-tokens", "1e6"]).max_tokens == 1_000_000


@pytest.mark.parametrize("value", ["2.5", "1e400", "nan", "four"])
def test_non_integers_are_refused(capsys, value):
    assert f"invalid int value: '{value}'" in fails(capsys, "--n-layers", value)


# ---------------------------------------------------------------------------- new flags


def test_new_flags_parse():
    cfg = parse_args(
        [
            "--peak-tflops",
            "312",
            "--profile-record-shapes",
            "--profile-with-flops",
            "--profile-with-modules",
            "--chunked-loss",
            "--no-report",
            "--fsdp",
            "--tp",
            "2",
        ]
    )
    assert cfg.peak_tflops == 312 and cfg.profile_record_shapes and cfg.profile_with_flops
    assert cfg.profile_with_modules and cfg.chunked_loss and cfg.no_report and cfg.fsdp and cfg.tp == 2
    assert parse_args(["--no-chunked-loss"]).chunked_loss is False
    with pytest.raises(UsageError, match="are alternatives"):  # not the last silently winning
        parse_args(["--chunked-loss", "--no-chunked-loss"])
    defaults = parse_args([])
    assert (defaults.chunked_loss, defaults.no_checkpoint, defaults.tp) == (False, False, 1)
    assert defaults.peak_tflops is None
    assert parse_args(["--save-interval", "0"]).save_interval == 0
    assert parse_args(["--no-checkpoint", "--resume", "--checkpoint-path", "x.pt"]).no_checkpoint
    assert parse_args(["--use-tensor-parallel"]).use_tensor_parallel


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--peak-tflops", "0"], "--peak-tflops must be at least 0.001, got 0.0"),
        (["--peak-tflops", "1e-9"], "--peak-tflops must be at least 0.001"),
        (["--peak-tflops", "1e9"], "--peak-tflops must be at most 1e+06"),
        (["--peak-tflops", "inf"], "--peak-tflops must be a finite number"),
        (["--save-interval", "-1"], "--save-interval must be at least 0"),
        (["--no-checkpoint", "--save-interval", "10"], "--no-checkpoint writes none: drop --save-interval"),
        (
            ["--no-checkpoint", "--checkpoint-path", "x.pt"],
            "--no-checkpoint writes none: drop --checkpoint-path",
        ),
        (["--tp", "0"], "--tp must be positive"),
        (["--compile-mode", "max-autotune"], "--compile-mode: needs --compile"),
        (["--allow-changes"], "--allow-changes: needs --resume"),
    ],
)
def test_new_flag_checks(args, expected):
    assert expected in refused(*args)


@pytest.mark.parametrize(
    "args",
    [
        ["--tp", "3"],
        ["--tp", "2", "--n-heads", "2", "--d-model", "64", "--d-ff", "101"],
        ["--use-tensor-parallel", "--tp", "1"],
        ["--fsdp", "--compile"],
        ["--tp", "2", "--compile"],
        ["--use-tensor-parallel", "--compile"],
    ],
)
def test_sharding_flags_in_one_process_are_one_line(capsys, tmp_path, args):
    """What --tp and --fsdp need of the model and the launch is checked as the process group is
    joined (core/distributed.py, tests/test_parallel.py): one process is refused there first."""
    out = tmp_path / "run"
    assert "torchrun" in fails(capsys, *TINY, *args, "--out-dir", str(out))
    assert not out.exists()


# ---------------------------------------------------------------------------- numeric checks


@pytest.mark.parametrize("flag", [n for n, kind in config.KINDS.items() if kind is float])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_refuses_nan_and_inf(flag, value):
    name = config.flag_name(flag)
    assert refused(f"{name}={value}").startswith(f"{name} must be a finite number")


def test_lr_nan_is_blamed_on_lr():
    assert refused("--lr", "nan").startswith("--lr ")


@pytest.mark.parametrize("flag", ["--seed", "--data-seed"])
@pytest.mark.parametrize(
    "value, bound", [("-1", "at least 0"), (str(2**32), "at most "), ("1e30", "at most ")]
)
def test_seeds_lie_in_32_bits(flag, value, bound):
    msg = refused(flag, value)
    assert msg.startswith(f"{flag} must be {bound}") and msg.endswith(f"got {config.parse_int(value)}"), msg


def test_largest_seed_is_taken():
    assert parse_args(["--seed", str(2**32 - 1)]).seed == 2**32 - 1


@pytest.mark.parametrize("value", ["1e-12", "0", "-4"])
def test_device_memory_too_small(value):
    assert "--device-memory-gb must be at least 0.000976562" in refused("--device-memory-gb", value)  # 1 MiB


def test_ddp_timeout_bounded():
    assert "--ddp-timeout must be at most 604800" in refused("--ddp-timeout", "1e12")  # a week
    assert parse_args(["--ddp-timeout", "3600"]).ddp_timeout == 3600


def test_ints_beyond_64_bits_are_refused():
    assert "out of range" in refused("--log-interval", str(2**70))


@pytest.mark.parametrize(
    "args",
    [
        ["--vocab-size", "1e13"],
        ["--n-layers", "100000"],
        ["--d-model", "1000000", "--n-heads", "1"],
        ["--batch-size", "100000", "--seq-len", "100000", "--max-position-embeddings", "100000"],
    ],
)
def test_absurd_sizes_are_refused_with_the_bytes_they_need(args):
    msg = refused(*args)
    assert msg.startswith("this configuration needs about ") and "lower its model or batch" in msg
    assert "GiB, more than" in msg  # the total and the machine's RAM, in bytes


def ram(monkeypatch, nbytes: int) -> None:
    """This machine's RAM as check_size reads it (pages of 4 KiB)."""
    real = os.sysconf
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": nbytes // 4096}
    monkeypatch.setattr(config.os, "sysconf", lambda name: pages.get(name) or real(name))


def test_size_is_checked_against_this_machines_ram(monkeypatch):
    ram(monkeypatch, 2**30)
    msg = refused("--preset", "gpt2")
    assert "more than 1.0 GiB" in msg
    assert parse_args(["--preset", "tiny"]).preset == "tiny"  # a small one still fits


def test_chunked_loss_drops_the_logits_from_the_count(monkeypatch):
    """GPT-2's fp32 logits at batch 8 are 4 x 8 x 1024 x 50304 bytes (1.5 GiB): a machine with a
    GiB less than the plain count holds the chunked one."""
    ram(monkeypatch, 2**50)
    cfg = parse_args(["--preset", "gpt2"])
    logits = 4 * 8 * 1024 * 50304
    need = 16 * config.param_count(50304, 1024, 768, 3072, 12) + logits + 68 * 8 * 1024 * 768 * 12
    assert cfg.batch_size == 8 and need > 2**30
    ram(monkeypatch, need - 2**30)
    assert "this configuration needs about" in refused("--preset", "gpt2")
    assert parse_args(["--preset", "gpt2", "--chunked-loss"]).chunked_loss


def test_estimate_memory_may_predict_what_this_machine_cannot_hold(monkeypatch):
    ram(monkeypatch, 2**30)
    assert parse_args(["--estimate-memory", "--preset", "gpt2"]).estimate_memory
    assert "this configuration needs about" in refused("--estimate-memory", "--vocab-size", "1e13")  # > 1 PiB


def test_config_imports_without_torch():
    code = (
        "import sys, minigpt.config as c; c.parse_args(['--preset', 'tiny']); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ---------------------------------------------------------------------------- checks across flags


def test_what_no_flag_sets_passes_every_check_across_flags():
    """parse_args runs the checks across flags (checks.ACROSS) only when the user gave a flag
    outside config.QUIET: sound only while the defaults and every preset pass every row."""
    from minigpt.core.checks import ACROSS, check_across

    assert len(ACROSS) >= 12
    for preset in [None, *PRESETS]:
        cfg = parse_args([] if preset is None else ["--preset", preset])
        check_across(cfg, set(config.FIELDS))  # every row, asked or not


def quiet_values(name: str):
    """A valid value for a QUIET flag, as a user types it."""
    if name == "preset":
        return st.sampled_from(sorted(PRESETS))
    if name == "device":
        return st.sampled_from(["auto", "cpu", "cuda"])
    if name == "out_dir":
        return st.text(
            st.characters(whitelist_categories=("L", "N"), whitelist_characters="-_./"), min_size=1
        )
    if name == "seed":
        return st.integers(0, 2**32 - 1).map(str)
    if name == "eval_iters":
        return st.integers(1, config.INNER).map(str)
    return st.integers(1, 10**9).map(str)  # steps, intervals


# too_slow: drawing paths is slow where many tests share the cores (the fixed examples are the same)
@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data_=st.data())
def test_no_check_across_flags_can_fail_on_quiet_flags_alone(data_):
    """What makes QUIET safe: given only QUIET flags (any valid values), parse_args skips the checks
    across flags, and no row of checks.ACROSS would have refused them."""
    from minigpt.core.checks import check_across

    chosen = data_.draw(st.lists(st.sampled_from(sorted(config.QUIET)), min_size=1, unique=True))
    argv = [a for name in chosen for a in (config.flag_name(name), data_.draw(quiet_values(name)))]
    cfg = parse_args(argv)
    assert cfg.given <= config.QUIET
    check_across(cfg, set(config.FIELDS))  # every row, asked or not


def test_quiet_flags_alone_do_not_load_the_checks():
    code = (
        "import sys, minigpt.config as c; c.parse_args(['--preset', 'tiny', '--num-steps', '3']); "
        "print('minigpt.core.checks' in sys.modules); c.parse_args(['--lr', '0.1']); "
        "print('minigpt.core.checks' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]


def test_a_check_across_flags_runs_when_either_flag_is_given():
    """--n-heads alone or --d-model alone asks for the divisibility row."""
    for argv in (["--n-heads", "3"], ["--preset", "tiny", "--d-model", "65"]):
        with pytest.raises(UsageError, match="divisible by --n-heads"):
            parse_args(argv)
