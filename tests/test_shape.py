"""The model's shape from a config (minigpt/config.py) and what is computed from it: the estimator's
bytes, the step-time predictor's op list, the per-rank plans. The pinned figures in
tests/shape_pins.json were written by the code before the shape module existed; every caller of
the shape must reproduce them exactly. Rewrite them on purpose only, when a formula changes:
`python tests/test_shape.py --write`."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from minigpt.config import GPT2_VOCAB, pad_vocab
from minigpt.core.shape import Shape, shape_of

ROOT = Path(__file__).resolve().parents[1]
PINS = Path(__file__).with_name("shape_pins.json")

BASE = dict(
    n_layers=2,
    d_model=64,
    n_heads=4,
    d_ff=256,
    seq_len=32,
    batch_size=4,
    vocab_size=128,
    max_position_embeddings=48,
)
WIDE = {**BASE, "vocab_size": 4096, "seq_len": 192, "max_position_embeddings": 192}
GPT2 = dict(
    n_layers=12,
    d_model=768,
    n_heads=12,
    d_ff=3072,
    seq_len=1024,
    batch_size=8,
    vocab_size=50304,
    max_position_embeddings=1024,
)
# (name, shape, options): the estimator's and the predictor's corners
CASES = [
    ("fp32", BASE, {}),
    ("bf16", BASE, dict(amp_dtype="bf16")),
    ("bf16 ckpt", BASE, dict(amp_dtype="bf16", activation_checkpoint=True)),
    ("fp32 ckpt accum", BASE, dict(activation_checkpoint=True, grad_accum_steps=2)),
    ("bf16 accum", BASE, dict(amp_dtype="bf16", grad_accum_steps=3)),
    ("dropout", BASE, dict(dropout=0.1)),
    ("cuda bf16 dropout", BASE, dict(amp_dtype="bf16", device="cuda", dropout=0.1)),
    ("cuda fp16", BASE, dict(amp_dtype="fp16", device="cuda")),
    ("chunked", WIDE, dict(chunked_loss=True, loss_chunk_elements=256 * 4096)),
    ("chunked bf16 ckpt", WIDE, dict(amp_dtype="bf16", chunked_loss=True, activation_checkpoint=True)),
    ("chunked one chunk", BASE, dict(chunked_loss=True)),
    ("chunked accum", WIDE, dict(chunked_loss=True, grad_accum_steps=2, loss_chunk_elements=100 * 4096)),
    ("gpt2 bf16", GPT2, dict(amp_dtype="bf16")),
    ("gpt2 bf16 ckpt chunked", GPT2, dict(amp_dtype="bf16", activation_checkpoint=True, chunked_loss=True)),
]
SHAPE_KEYS = ("activation_checkpoint", "chunked_loss", "grad_accum_steps", "dropout")  # the rest: the call
PLANS = [(2, 1, False), (2, 1, True), (1, 2, False), (2, 2, True), (4, 1, True)]
TRAINER_FLAGS = [
    ["--preset", "tiny", "--vocab-size", "100"],
    ["--preset", "gpt2", "--batch-size", "4", "--use-activation-checkpoint", "--chunked-loss"],
    ["--preset", "small", "--grad-accum-steps", "2", "--vocab-size", "50257", "--dropout", "0.1"],
]


def ops_digest(ops) -> dict:
    """The op list as a digest of every field of every op, with its totals (readable on a failure)."""
    rows = [asdict(o) for o in ops]
    return {
        "n": len(rows),
        "flops": sum(o.flops * o.count for o in ops),
        "bytes": sum(o.bytes * o.count for o in ops),
        "exps": sum(o.exps * o.count for o in ops),
        "launches": sum(o.launches * o.count for o in ops),
        "sha256": hashlib.sha256(json.dumps(rows).encode()).hexdigest(),
    }


def given_rates(device: str, dtype: str, needed, cache=True, measure=True, remeasure=False):
    """Rates for the prediction, given: the same for every kernel, the bandwidth by working set."""
    from minigpt.instruments import predict

    return predict.Rates(
        device=device,
        dtype=dtype,
        matmul={k: 1e9 * (1 + i) for i, k in enumerate(needed)},
        bandwidth=[(1000, 1e9), (10**6, 4e9), (10**9, 2e9)],
        exps_per_s=5e8,
        overhead_s={"op": 2e-6, "autograd": 5e-6},
        source="given",
    )


def outputs(monkeypatch) -> dict:
    """Everything the pins hold, computed by the code under test."""
    from minigpt.config import param_count as quick_param_count
    from minigpt.config import parse_args
    from minigpt.core.checkpoint import model_bytes
    from minigpt.instruments import estimate, per_rank, predict

    out: dict = {"estimate": {}, "ops": {}, "predict": {}, "per_rank": {}, "comm": {}, "report": {}}
    for name, shape, options in CASES:
        s = Shape(**shape, **{k: v for k, v in options.items() if k in SHAPE_KEYS})
        call = {k: v for k, v in options.items() if k not in SHAPE_KEYS}
        e = estimate.estimate_gpt(s, **call)
        out["estimate"][name] = e.to_record()
        out["ops"][name] = ops_digest(predict.step_ops(s, **call))
        for dp, tp, fsdp in PLANS:
            if shape["n_heads"] % tp == 0:
                key = f"{name} dp{dp} tp{tp}{' fsdp' if fsdp else ''}"
                out["per_rank"][key] = per_rank.per_rank_estimate(e, dp, tp, fsdp, s)
                as_estimate = per_rank.per_rank_memory_estimate(e, dp, tp, fsdp, s)
                rec = as_estimate.to_record()
                out["per_rank"][key]["as_estimate"] = {
                    k: rec[k] for k in ("params", "block", "total", "peak")
                }
    for dp, tp, fsdp in PLANS:
        for amp, bytes_ in ((False, (4, 4, 4)), (True, (2, 4, 2))):
            c = per_rank.comm_model(Shape(**GPT2), dp, tp, fsdp, amp)
            out["comm"][f"dp{dp} tp{tp} fsdp{fsdp} {bytes_}"] = c
    monkeypatch.setattr(predict, "step_rates", given_rates)
    for name, shape, options in CASES[:5]:
        s = Shape(**shape, **{k: v for k, v in options.items() if k in SHAPE_KEYS})
        pred = predict.predict_step(s, options.get("amp_dtype", "fp32"), "cpu")
        record = {k: v for k, v in pred.to_record().items() if k != "config"}  # the CLI's is in "report"
        out["predict"][name] = {"json": json.dumps(record), "text": predict.format_prediction(pred)}
    for flags in TRAINER_FLAGS:
        cfg = parse_args([*flags, "--device-memory-gb", "24"])
        key = " ".join(flags)
        out["report"][key] = {
            "fp32": estimate.estimate_report(cfg, "cpu", "fp32"),
            "bf16": estimate.estimate_report(cfg, "cuda", "bf16", "a note"),
            "time": predict.time_report(estimate.config_shape(cfg), "cpu", "fp32", True),
        }
    out["params"] = {
        name: [
            quick_param_count(*v),
            model_bytes(
                dict(zip(("vocab_size", "max_position_embeddings", "d_model", "d_ff", "n_layers"), v))
            ),
        ]
        for name, v in {"base": (128, 48, 64, 256, 2), "gpt2": (50304, 1024, 768, 3072, 12)}.items()
    }
    for preset, gpus in (("gpt2", "8"), ("small", "4")):
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            per_rank.main(["--preset", preset, "--gpus", gpus])
        out["report"][f"parallel {preset} {gpus}"] = text.getvalue()
    return json.loads(json.dumps(out))  # tuples as lists, as the file holds them


def test_every_estimate_and_prediction_is_as_pinned(monkeypatch):
    pins = json.loads(PINS.read_text())
    got = outputs(monkeypatch)
    assert set(got) == set(pins)
    for section in pins:
        assert set(got[section]) == set(pins[section]), section
        for key in pins[section]:
            assert got[section][key] == pins[section][key], (section, key)


@pytest.mark.parametrize(
    "shape",
    [
        Shape(**BASE),
        Shape(**{**BASE, "n_layers": 3, "d_ff": 96, "vocab_size": 320, "max_position_embeddings": 32}),
    ],
)
def test_the_parameter_count_and_flops_are_the_built_models(shape):
    import torch

    from minigpt.core.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape.model_kwargs()))
    assert shape.params == sum(p.numel() for p in model.parameters()) == model.num_params(non_embedding=False)
    assert sorted(shape.param_sizes()) == sorted(p.numel() for p in model.parameters())
    assert sum(shape.param_sizes()) == shape.params
    # PaLM's 6N + 12 L d T, N without the position table (it costs no FLOPs), of the built model
    flops = 6 * model.num_params(non_embedding=True) + 12 * shape.n_layers * shape.d_model * shape.seq_len
    assert shape.flops_per_token == flops


def test_the_shape_module_loads_no_torch():
    """The estimator's and the size check's arithmetic must not pay torch's import."""
    code = "import sys, minigpt.config; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_vocabulary_is_padded_to_a_multiple_of_64():
    assert [pad_vocab(n) for n in (1, 64, 65, GPT2_VOCAB)] == [64, 64, 128, 50304]


def test_a_preset_and_the_trainers_config_give_the_same_shape():
    from minigpt.config import PRESETS, parse_args

    for name in PRESETS:
        cfg = parse_args(["--preset", name])
        assert shape_of(PRESETS[name], GPT2_VOCAB) == shape_of(cfg, GPT2_VOCAB)
    cfg = parse_args(["--preset", "tiny", "--d-ff", "96", "--use-activation-checkpoint", "--chunked-loss"])
    shape = shape_of(cfg, 100)
    assert (shape.d_ff, shape.vocab_size, shape.max_position_embeddings) == (96, 128, cfg.seq_len)
    assert shape.activation_checkpoint and shape.chunked_loss and shape.tokens == cfg.batch_size * cfg.seq_len
    assert shape_of(PRESETS["small"], GPT2_VOCAB, seq_len=512).max_position_embeddings == 512


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:  # minigpt is installed (pip install -e .)
    with pytest.MonkeyPatch.context() as mp:
        PINS.write_text(json.dumps(outputs(mp), indent=1, sort_keys=True) + "\n")
    print(f"wrote {PINS}")
