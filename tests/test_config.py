"""The command line as a user meets it: --help tells every default and what the presets set, each
flag is defined once (the parser is built from TrainConfig's fields), explicit flags beat the preset,
and every numeric flag is checked before anything runs."""

import argparse
import dataclasses
import subprocess
import sys

import pytest
from conftest import fails

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
    """--help writes each flag's default into its help (minigpt/core/flaghelp.py, loaded then)."""
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
        "--n-layers N transformer blocks (default: 4, from --preset small)",
        "(default: 0.001, from --preset small)",
        "(default: 1337)",
        "(default: 0.1)",
        "--d-ff N MLP width (default: 1024, from --preset small)",
        "--min-lr LR final learning rate (default: --lr / 10)",
        "(default: 10% of --num-steps, at most 100)",
        "--tp N",
        "(default: 1)",
    ]:
        assert expected in flat, expected


def test_help_lists_what_each_preset_sets_and_mentions_minigpt_args():
    text = build_parser().format_help()
    for name, values in PRESETS.items():
        line = next(line for line in text.splitlines() if line.strip().startswith(name + " "))
        for key, value in values.items():
            assert f"--{key.replace('_', '-')} {value}" in line, (name, key)
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
        (
            ["--peak-tflops", "0"],
            "--peak-tflops must be at least 0.001 (1 GFLOP/s; the figure is in TFLOP/s), got 0.0",
        ),
        (["--peak-tflops", "1e-9"], "--peak-tflops must be at least 0.001"),
        (["--peak-tflops", "1e9"], "--peak-tflops must be at most 1e6"),
        (["--peak-tflops", "inf"], "--peak-tflops must be a finite number"),
        (["--save-interval", "-1"], "--save-interval must not be negative"),
        (["--no-checkpoint", "--save-interval", "10"], "no checkpoint, so --save-interval has nothing to do"),
        (["--no-checkpoint", "--checkpoint-path", "x.pt"], "drop one of them"),
        (["--tp", "0"], "--tp must be positive"),
        (["--tp", "3"], "--tp 3 must divide --n-heads 4"),
        (
            ["--tp", "2", "--n-heads", "2", "--d-model", "64", "--d-ff", "101"],
            "--tp 2 must divide --d-ff 101",
        ),
        (["--use-tensor-parallel", "--tp", "1"], "--use-tensor-parallel takes the tensor-parallel degree"),
        (["--fsdp", "--compile"], "--compile with --fsdp is not supported"),
        (["--tp", "2", "--compile"], "--compile with --tp is not supported"),
        (["--use-tensor-parallel", "--compile"], "--compile with --use-tensor-parallel"),
    ],
)
def test_new_flag_checks(args, expected):
    assert expected in refused(*args)


# ---------------------------------------------------------------------------- numeric checks


@pytest.mark.parametrize(
    "flag", [f for f in dataclasses.fields(TrainConfig) if config.base_type(f) is float], ids=lambda f: f.name
)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_refuses_nan_and_inf(flag, value):
    name = config.flag_name(flag)
    assert refused(f"{name}={value}").startswith(f"{name} must be a finite number")


def test_lr_nan_is_blamed_on_lr():
    assert refused("--lr", "nan").startswith("--lr ")


@pytest.mark.parametrize("flag", ["--seed", "--data-seed"])
@pytest.mark.parametrize("value", ["-1", str(2**32), "1e30"])
def test_seeds_lie_in_32_bits(flag, value):
    assert f"{flag} must be in [0, 2**32)" in refused(flag, value)


def test_largest_seed_is_taken():
    assert parse_args(["--seed", str(2**32 - 1)]).seed == 2**32 - 1


@pytest.mark.parametrize("value", ["1e-12", "0", "-4"])
def test_device_memory_too_small(value):
    assert "--device-memory-gb must be at least 1 MiB" in refused("--device-memory-gb", value)


def test_ddp_timeout_bounded():
    assert "at most a week" in refused("--ddp-timeout", "1e12")
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
    assert msg.startswith("this configuration needs about ") and "more than this machine's" in msg
    assert "iB" in msg.split("(")[0]  # the total, in bytes


def test_size_is_checked_against_this_machines_ram(monkeypatch):
    monkeypatch.setattr(config, "machine_ram_bytes", lambda: 2**30)
    msg = refused("--preset", "gpt2")
    assert "more than this machine's 1.0 GiB of RAM" in msg and "parameters at 16 bytes each" in msg
    assert parse_args(["--preset", "tiny"]).preset == "tiny"  # a small one still fits


def test_chunked_loss_drops_the_logits_from_the_count():
    plain = config.quick_bytes(parse_args(["--preset", "gpt2"]))
    chunked = config.quick_bytes(parse_args(["--preset", "gpt2", "--chunked-loss"]))
    assert plain["of logits"] == 4 * 8 * 1024 * 50304 and chunked["of logits"] == 0


def test_estimate_memory_may_predict_what_this_machine_cannot_hold(monkeypatch):
    monkeypatch.setattr(config, "machine_ram_bytes", lambda: 2**30)
    assert parse_args(["--estimate-memory", "--preset", "gpt2"]).estimate_memory
    assert "1 PiB, the cap of --estimate-memory" in refused("--estimate-memory", "--vocab-size", "1e13")


def test_config_imports_without_torch():
    code = (
        "import sys, minigpt.config as c; c.parse_args(['--preset', 'tiny']); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_what_no_flag_sets_passes_every_check_across_flags():
    """validate() runs a check across flags (checks.ACROSS) only when the user gave one of its
    flags: sound only while the defaults and every preset, which no flag set, pass every row."""
    from minigpt.core.checks import ACROSS
    from minigpt.config import validate

    assert len(ACROSS) >= 12
    for preset in [None, *PRESETS]:
        cfg = parse_args([] if preset is None else ["--preset", preset])
        validate(cfg, given=None)  # None: every row, asked or not


def test_the_flags_that_load_the_checks_across_flags_are_the_rows_own():
    """validate() loads minigpt/core/checks.py when a flag of config.ACROSS_FLAGS is given: every
    field a row asks for must be there, or its row would never run."""
    from minigpt.core.checks import ACROSS
    from minigpt.config import ACROSS_FLAGS

    assert set().union(*(asked_by for asked_by, _, _ in ACROSS)) == ACROSS_FLAGS


def test_a_check_across_flags_runs_when_either_flag_is_given():
    """--n-heads alone or --d-model alone asks for the divisibility row."""
    for argv in (["--n-heads", "3"], ["--preset", "tiny", "--d-model", "65"]):
        with pytest.raises(UsageError, match="divisible by --n-heads"):
            parse_args(argv)
