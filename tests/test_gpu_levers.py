"""The GPU speed levers built without a GPU, off by default until one measures them (docs/reference.md, "GPU
speed"): --auto-batch-size (the micro-batch the estimator says fits) and --compile-mode. Their
logic runs anywhere: the estimate is arithmetic on shapes, the device's memory a flag."""

from dataclasses import replace

import pytest
from conftest import TINY, fails

from minigpt.config import parse_args
from minigpt.instruments.estimate import AUTO_BATCH_HEADROOM, GiB, config_shape, estimate_gpt, fit_batch_size


def chosen(gb: float, *flags: str) -> tuple[int, str | None]:
    cfg = parse_args(["--preset", "gpt2", "--auto-batch-size", "--device-memory-gb", str(gb), *flags])
    return fit_batch_size(cfg, "cuda", "bf16")


@pytest.mark.parametrize("gb", [24, 40, 80, 141])
def test_the_auto_batch_is_the_largest_doubling_that_fits_with_room(gb):
    batch, line = chosen(gb)
    cfg = parse_args(["--preset", "gpt2"])
    shape = config_shape(cfg)
    peak = estimate_gpt(replace(shape, batch_size=batch), "bf16", "cuda").peak
    assert batch % cfg.batch_size == 0 and batch >= cfg.batch_size
    assert peak <= AUTO_BATCH_HEADROOM * gb * GiB
    if batch * 1024 * 2 <= 2**19:  # the next doubling would not fit
        twice = replace(shape, batch_size=2 * batch)
        assert estimate_gpt(twice, "bf16", "cuda").peak > AUTO_BATCH_HEADROOM * gb * GiB
    assert f"chose {batch} sequences a micro-batch (from 8)" in line and f"of {gb:.1f} GiB" in line
    assert "the learning rate was set for 8,192" in line


def test_the_auto_batch_keeps_the_flags_batch_when_nothing_fits_and_is_off_by_default():
    batch, line = chosen(4)
    assert batch == 8 and "kept --batch-size 8" in line and "above 80% of 4.0 GiB" in line
    assert fit_batch_size(parse_args(["--preset", "gpt2"]), "cuda", "bf16") == (8, None)


def test_the_gpu_levers_refuse_what_they_cannot_do(capsys, tmp_path):
    out = ["--out-dir", str(tmp_path / "run")]
    assert "--auto-batch-size needs CUDA" in fails(capsys, *TINY, "--auto-batch-size", *out)
    assert "--compile-mode: needs --compile" in fails(
        capsys, *TINY, "--compile-mode", "reduce-overhead", *out
    )
    assert not (tmp_path / "run").exists()
