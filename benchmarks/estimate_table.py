"""The memory estimator against the measurement: predicted vs measured peak, part by part.

    python benchmarks/estimate_table.py                      # the whole matrix (slow: gpt2 cells)
    python benchmarks/estimate_table.py --presets small      # small only
    python benchmarks/estimate_table.py --render benchmarks/results/cpu-estimate.json

Each cell builds minigpt's GPT in this process, runs one warm-up step and one measured step
shaped as the trainer's (stages named, autocast, loss / accumulation steps, clipping, fused
AdamW, the caller holding the last step's output), measured with minigpt.memory.capture_memory;
beside it minigpt.estimate.estimate_gpt's prediction from the same numbers. The matrix: presets
small and gpt2 x batch 1-2 x seq 256-1024 x fp32/bf16 x activation checkpointing x gradient
accumulation 1/2. Writes benchmarks/results/<device>-estimate.json and .md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from common import RESULTS, device_slug, header, load_results, save_json, stamp
from torch.autograd.profiler import record_function

from minigpt.config import PRESETS
from minigpt.estimate import estimate_gpt
from minigpt.fileio import atomic_write
from minigpt.memory import PEAK_PARTS, MemoryBreakdown, capture_memory
from minigpt.model import GPT, GPTConfig

MIB = 2**20
VOCAB = 50304  # GPT-2's vocabulary padded to a multiple of 64, as the trainer pads it
TOLERANCE = 0.10  # the estimator's promise: the measured peak within 10%
# (preset, batch, seq): the shapes of the matrix; each runs x fp32/bf16 x ckpt x accumulation 1/2.
SHAPES = [("small", 1, 256), ("small", 2, 1024), ("gpt2", 1, 256), ("gpt2", 2, 1024)]


def model_of(shape: dict, **options) -> GPT:
    """minigpt's GPT of an estimator shape (seeded: every variant starts from the same weights)."""
    torch.manual_seed(0)
    keys = ("vocab_size", "max_position_embeddings", "n_layers", "n_heads", "d_model", "d_ff")
    return GPT(GPTConfig(**{k: shape[k] for k in keys}, **options))


def shape_of(preset: str, batch: int, seq: int) -> dict:
    p = PRESETS[preset]
    return dict(
        n_layers=p["n_layers"],
        d_model=p["d_model"],
        n_heads=p["n_heads"],
        d_ff=p["d_ff"],
        seq_len=seq,
        batch_size=batch,
        vocab_size=VOCAB,
        max_position_embeddings=max(seq, p.get("max_position_embeddings", seq)),
    )


def measure(
    shape: dict,
    amp_dtype: str = "fp32",
    checkpoint: bool = False,
    accum: int = 1,
    chunked_loss: bool = False,
    steps: int = 2,
    grad_clip: float = 1.0,
) -> MemoryBreakdown:
    """`steps` training steps as the trainer runs them; the last is measured."""
    model = model_of(shape, activation_checkpoint=checkpoint, chunked_loss=chunked_loss)
    model.train()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1e-4,
        betas=(0.9, 0.95),
        fused=True,
    )  # as train_minimal.configure_optimizer
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if amp_dtype == "bf16" else nullcontext()
    b, s, V = shape["batch_size"], shape["seq_len"], shape["vocab_size"]
    cap = None
    for step in range(1, steps + 1):
        cap = capture_memory(model, optimizer, step) if step == steps else nullcontext()
        with cap:
            step_loss = torch.zeros(())
            for _ in range(accum):
                with record_function("data_to_device"):
                    x = torch.randint(0, V, (b, s))
                    y = torch.roll(x, -1, 1)
                with record_function("forward"), autocast:
                    _, loss = model(x, y)  # the caller holds the output until the next forward ends
                    loss = loss / accum
                with record_function("backward"):
                    loss.backward()
                step_loss += loss.detach()
            with record_function("optimizer_step"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    return cap.breakdown


def cell(preset: str, batch: int, seq: int, amp: str, ckpt: bool, accum: int) -> dict:
    shape = shape_of(preset, batch, seq)
    t0 = time.perf_counter()
    b = measure(shape, amp, ckpt, accum)
    e = estimate_gpt(**shape, amp_dtype=amp, activation_checkpoint=ckpt, grad_accum_steps=accum)
    predicted = e.peak_parts()
    measured = {p: b.peak_part(p) for p in PEAK_PARTS}
    return {
        "preset": preset,
        "batch": batch,
        "seq": seq,
        "amp": amp,
        "ckpt": ckpt,
        "accum": accum,
        "measured_peak": b.peak,
        "predicted_peak": e.peak,
        "error": (e.peak - b.peak) / b.peak,
        "measured_stage": b.peak_stage,
        "measured_where": b.peak_where,
        "predicted_stage": e.peak_stage,
        "measured_parts": measured,
        "predicted_parts": predicted,
        "seconds": time.perf_counter() - t0,
    }


def markdown(meta: dict, rows: list[dict]) -> str:
    worst = max(rows, key=lambda r: abs(r["error"]))
    lines = [
        *header("Memory estimate vs the measured peak", meta),
        "Each cell: one warm-up step, then one step measured with `capture_memory` (the allocator's peak "
        "from the profiler's memory events); predicted by `estimate_gpt` from the same numbers. Parts in "
        "MiB as measured / predicted: parameters, gradients, optimizer state, saved activations, "
        "temporaries of the ops (the logits and their gradient among them), and tensors held from before "
        "the step (the caller's last output).",
        "",
        f"Worst cell: {worst['preset']} b{worst['batch']} s{worst['seq']} {worst['amp']}"
        f"{' ckpt' if worst['ckpt'] else ''} accum {worst['accum']}: {100 * worst['error']:+.1f}%; "
        f"{sum(abs(r['error']) <= TOLERANCE for r in rows)} of {len(rows)} cells within "
        f"{100 * TOLERANCE:.0f}%.",
        "",
        "| preset | batch | seq | dtype | ckpt | accum | measured MiB | predicted MiB | error | "
        "peak in (measured / "
        "predicted) | " + " | ".join(PEAK_PARTS) + " |",
        "|---" * (10 + len(PEAK_PARTS)) + "|",
    ]
    for r in rows:
        parts = " | ".join(
            f"{r['measured_parts'][p] / MIB:,.0f} / {r['predicted_parts'][p] / MIB:,.0f}" for p in PEAK_PARTS
        )
        lines.append(
            f"| {r['preset']} | {r['batch']} | {r['seq']} | {r['amp']} | {'yes' if r['ckpt'] else 'no'} | "
            f"{r['accum']} | {r['measured_peak'] / MIB:,.1f} | {r['predicted_peak'] / MIB:,.1f} | "
            f"{100 * r['error']:+.1f}% | {r['measured_stage']} / {r['predicted_stage']} | {parts} |"
        )
    lines += ["", "Where each measured peak happened:", ""]
    for r in rows:
        lines.append(
            f"- {r['preset']} b{r['batch']} s{r['seq']} {r['amp']}{' ckpt' if r['ckpt'] else ''} "
            f"accum {r['accum']}: {r['measured_where']}"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["small", "gpt2"], choices=["small", "gpt2"])
    p.add_argument(
        "--shapes",
        nargs="+",
        metavar="PRESET:BATCH:SEQ",
        help="instead of the matrix's shapes, e.g. small:1:256 gpt2:2:1024",
    )
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep the cells of the results file that this run does not measure again",
    )
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--render", type=Path, metavar="RESULTS_JSON", help="measure nothing: write the .md again")
    args = p.parse_args()
    if args.render:
        data = load_results(p, args.render)
        atomic_write(args.render.with_suffix(".md"), markdown(data["meta"], data["results"]))
        return 0
    meta = {**stamp(sys.argv), "name": "estimate"}
    shapes = (
        [(x.split(":")[0], int(x.split(":")[1]), int(x.split(":")[2])) for x in args.shapes]
        if args.shapes
        else [s for s in SHAPES if s[0] in args.presets]
    )
    rows = []
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"{device_slug(meta['machine'])}-estimate"
    if args.keep and stem.with_suffix(".json").is_file():
        rows = json.loads(stem.with_suffix(".json").read_text())["results"]
    done = {(r["preset"], r["batch"], r["seq"], r["amp"], r["ckpt"], r["accum"]) for r in rows}
    for (preset, batch, seq), amp, ckpt, accum in itertools.product(
        shapes, args.dtypes, [False, True], [1, 2]
    ):
        if (preset, batch, seq, amp, ckpt, accum) in done:
            continue
        rows.append(cell(preset, batch, seq, amp, ckpt, accum))
        r = rows[-1]
        print(
            f"{preset} b{batch} s{seq} {amp} ckpt={ckpt} accum={accum}: "
            f"measured {r['measured_peak'] / MIB:,.1f} MiB ({r['measured_stage']}), "
            f"predicted {r['predicted_peak'] / MIB:,.1f} MiB ({r['predicted_stage']}), "
            f"{100 * r['error']:+.1f}%, {r['seconds']:.0f} s",
            flush=True,
        )
        save_json(stem, {"meta": meta, "results": rows})  # after each cell: a stopped run keeps its cells
        atomic_write(stem.with_suffix(".md"), markdown(meta, rows))
    print(f"wrote {stem}.md, .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
