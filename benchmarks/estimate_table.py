"""The memory estimator against the measurement: predicted vs measured peak, part by part.

    python benchmarks/estimate_table.py                      # the whole matrix (slow: gpt2 cells)
    python benchmarks/estimate_table.py --presets small      # small only
    python benchmarks/estimate_table.py --render benchmarks/results/cpu-estimate.json

Each cell builds minigpt's GPT in this process, runs one warm-up step and one measured step
shaped as the trainer's (stages named, autocast, loss / accumulation steps, clipping, fused AdamW,
the loop keeping only the loss), measured with minigpt.instruments.breakdown.capture_memory on one
intra-op thread (torch.set_num_threads(1) around the measurement: oneDNN allocates a scratch per
thread in bf16 matrix products, so a peak measured on N threads depends on N); beside it
minigpt.instruments.estimate.estimate_gpt's prediction from the same numbers. The matrix: presets
small and gpt2 x batch 1-8 x seq 256-1024 x fp32/bf16 x activation checkpointing x gradient
accumulation 1/2 x the plain or the chunked loss (--chunked-loss; `--losses chunked` measures only
those cells, `--shapes small:8:256` adds the trainer's default shape). Writes
benchmarks/results/<device>-estimate.json and .md.

--shape-only-matmuls: on a CPU without native bf16 (AVX2 only) a bf16 matrix product is emulated,
many times slower than fp32, and a gpt2 cell would take hours. The memory a step allocates depends on
shapes, not values, so this mode still runs every op through the allocator but gives aten::mm an
output of its exact shape and dtype, zero-filled, instead of its arithmetic (ShapeOnlyMatmuls). Its
rows say so, and --shape-only-matmuls on cells also measured for real shows the two peaks side by
side (the table's "shape-only check").
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from common import (
    Parser,
    available_bytes,
    check_out_dir,
    device_slug,
    header,
    keeping,
    output_flags,
    render,
    save_json,
    stamp,
    write_md,
)
from torch.autograd.profiler import record_function

from minigpt.config import GPT2_VOCAB, PRESETS, STAGE_NAMES
from minigpt.core.model import GPT, GPTConfig
from minigpt.core.shape import Shape
from minigpt.core.shape import shape_of as config_shape
from minigpt.core.torchcompat import dispatch_mode_base
from minigpt.fileio import atomic_write
from minigpt.instruments.breakdown import PEAK_PARTS, MemoryBreakdown, capture_memory
from minigpt.instruments.estimate import estimate_gpt

DATA_TO_DEVICE, FORWARD, BACKWARD, OPTIMIZER_STEP = STAGE_NAMES  # the trainer's ranges, by its names

MIB = 2**20
TOLERANCE = 0.10  # the estimator's promise: the measured peak within 10%
# (preset, batch, seq): the shapes of the matrix; each runs x fp32/bf16 x ckpt x accumulation 1/2.
SHAPES = [("small", 1, 256), ("small", 8, 256), ("small", 2, 1024), ("gpt2", 1, 256), ("gpt2", 2, 1024)]


def model_of(shape: Shape) -> GPT:
    """minigpt's GPT of a step shape (seeded: every variant starts from the same weights)."""
    torch.manual_seed(0)
    return GPT(GPTConfig(**shape.model_kwargs()))


def shape_of(preset: str, batch: int, seq: int, **flags) -> Shape:
    """A cell's shape: the preset's model (positions for seq at least) at this batch and sequence
    length, GPT-2's vocabulary; `flags`: activation_checkpoint, grad_accum_steps, chunked_loss."""
    p = PRESETS[preset]
    positions = max(seq, p.get("max_position_embeddings", seq))
    return config_shape(
        p, GPT2_VOCAB, batch_size=batch, seq_len=seq, max_position_embeddings=positions, **flags
    )


class ShapeOnlyMatmuls(dispatch_mode_base()):
    """aten::mm's output without its arithmetic: a zero-filled tensor of the same shape and dtype,
    allocated where the op would allocate it (the profiler still names aten::mm around it). What the
    arithmetic itself allocates is skipped with it: a bf16 product's backward on the CPU makes a
    short-lived oneDNN scratch about the weight's size, so a cell whose peak falls inside such a
    backward reads low by that much (tests/test_memory.py holds every other part equal, and the gap
    within one fp32 copy of the weight)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            a, b = args
            return torch.zeros((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
        return func(*args, **(kwargs or {}))


THREADS = 1  # the intra-op threads every peak here is measured on


@contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads set to THREADS for what runs inside, and set back after: oneDNN's
    bf16 matrix products allocate a scratch per thread, so the measured peak depends on how many."""
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure(
    shape: Shape,
    amp_dtype: str = "fp32",
    steps: int = 2,
    grad_clip: float = 1.0,
    shape_only_matmuls: bool = False,
) -> MemoryBreakdown:
    """`steps` training steps as the trainer runs them, on one intra-op thread; the last is measured."""
    with one_thread():
        return _measure(shape, amp_dtype, steps, grad_clip, shape_only_matmuls)


def _measure(shape: Shape, amp_dtype: str, steps: int, grad_clip: float, shape_only_matmuls: bool):
    model = model_of(shape)
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
    b, s, V, accum = shape.batch_size, shape.seq_len, shape.vocab_size, shape.grad_accum_steps
    matmuls = ShapeOnlyMatmuls if shape_only_matmuls else nullcontext
    cap = None
    for step in range(1, steps + 1):
        cap = capture_memory(model, optimizer, step) if step == steps else nullcontext()
        with cap:
            step_loss = torch.zeros(())
            for _ in range(accum):
                with record_function(DATA_TO_DEVICE):
                    x = torch.randint(0, V, (b, s))
                    y = torch.roll(x, -1, 1)
                # the mode inside the stage's range: entered outside, it hides the range from the profiler
                with record_function(FORWARD), autocast, matmuls():
                    loss = model(x, y)[1] / accum  # as the trainer: the logits are not kept
                with record_function(BACKWARD), matmuls():
                    loss.backward()
                step_loss += loss.detach()
            with record_function(OPTIMIZER_STEP):
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    return cap.breakdown


def cell(preset: str, shape: Shape, amp: str, shape_only: bool) -> dict:
    t0 = time.perf_counter()
    b = measure(shape, amp, shape_only_matmuls=shape_only)
    e = estimate_gpt(shape, amp)
    predicted = e.peak_parts()
    measured = {p: b.peak_part(p) for p in PEAK_PARTS}
    return {
        "preset": preset,
        "batch": shape.batch_size,
        "seq": shape.seq_len,
        "amp": amp,
        "ckpt": shape.activation_checkpoint,
        "accum": shape.grad_accum_steps,
        "loss": "chunked" if shape.chunked_loss else "plain",
        "matmuls": "shape only" if shape_only else "computed",
        "threads": THREADS,
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


SHAPE_ONLY = " (shape-only matmuls)"


def key(r: dict) -> tuple:
    """A cell's identity: its shape, dtype, checkpointing, accumulation, loss and matmul mode."""
    return (
        r["preset"],
        r["batch"],
        r["seq"],
        r["amp"],
        r["ckpt"],
        r["accum"],
        r.get("loss", "plain"),
        r.get("matmuls", "computed"),
    )


def name(r: dict) -> str:
    chunked = " chunked loss" if r.get("loss") == "chunked" else ""
    return (
        f"{r['preset']} b{r['batch']} s{r['seq']} {r['amp']}{' ckpt' if r['ckpt'] else ''} accum {r['accum']}"
        f"{chunked}"
    )


def shape_only_check(rows: list[dict]) -> list[str]:
    """Cells measured both ways: the shape-only peak against the computed one."""
    computed = {key(r)[:-1]: r for r in rows if r.get("matmuls", "computed") == "computed"}
    pairs = [
        (computed[key(r)[:-1]], r)
        for r in rows
        if r.get("matmuls") == "shape only" and key(r)[:-1] in computed
    ]
    if not pairs:
        return []
    lines = [
        "",
        "Shape-only check: cells measured with aten::mm computed and with its arithmetic skipped "
        "(`--shape-only-matmuls`); the allocator's peak should not change.",
        "",
        "| cell | computed MiB | shape only MiB | difference |",
        "|---|---|---|---|",
    ]
    for c, s in pairs:
        lines.append(
            f"| {name(c)} | {c['measured_peak'] / MIB:,.1f} | {s['measured_peak'] / MIB:,.1f} | "
            f"{100 * (s['measured_peak'] - c['measured_peak']) / c['measured_peak']:+.2f}% |"
        )
    return lines


def threads_lines(rows: list[dict]) -> list[str]:
    """The cells not measured on one thread (results from before the peaks were), said, else none."""
    other = [r for r in rows if r.get("threads") != THREADS]
    if not other:
        return []
    return [
        f"{len(other)} of {len(rows)} cells were measured on torch's default intra-op threads, before "
        "the peaks were taken on one: their measured peaks hold a scratch per thread more.",
        "",
    ]


def markdown(meta: dict, rows: list[dict]) -> str:
    worst = max(rows, key=lambda r: abs(r["error"]))
    within = sum(abs(r["error"]) <= TOLERANCE for r in rows)
    lines = [
        *header("Memory estimate vs the measured peak", meta),
        "Each cell: one warm-up step, then one step measured with `capture_memory` (the allocator's peak "
        "from the profiler's memory events), on one intra-op thread (`torch.set_num_threads(1)`: oneDNN's "
        "bf16 matrix products allocate a scratch per thread, so the peak depends on the count); predicted "
        "by `estimate_gpt` from the same numbers. Parts in "
        "MiB as measured / predicted: parameters, gradients, optimizer state, saved activations, "
        "temporaries of the ops (the logits and their gradient among them), and tensors held from before "
        "the step (none: the loop keeps only the loss).",
        "",
        *threads_lines(rows),
        f"Worst cell: {name(worst)}{SHAPE_ONLY if worst.get('matmuls') == 'shape only' else ''}: "
        f"{100 * worst['error']:+.1f}%; {within} of {len(rows)} cells "
        f'within {100 * TOLERANCE:.0f}%. Matmuls "shape only": measured with `--shape-only-matmuls` (the '
        "allocations of every op, aten::mm's arithmetic skipped; see the check below the table).",
        "",
        "| preset | batch | seq | dtype | ckpt | accum | loss | matmuls | measured MiB | predicted MiB "
        "| error | peak in (measured / predicted) | " + " | ".join(PEAK_PARTS) + " |",
        "|---" * (12 + len(PEAK_PARTS)) + "|",
    ]
    for r in rows:
        parts = " | ".join(
            f"{r['measured_parts'][p] / MIB:,.0f} / {r['predicted_parts'][p] / MIB:,.0f}" for p in PEAK_PARTS
        )
        lines.append(
            f"| {r['preset']} | {r['batch']} | {r['seq']} | {r['amp']} | {'yes' if r['ckpt'] else 'no'} | "
            f"{r['accum']} | {r.get('loss', 'plain')} | {r.get('matmuls', 'computed')} | "
            f"{r['measured_peak'] / MIB:,.1f} | "
            f"{r['predicted_peak'] / MIB:,.1f} | {100 * r['error']:+.1f}% | "
            f"{r['measured_stage']} / {r['predicted_stage']} | {parts} |"
        )
    lines += shape_only_check(rows)
    lines += ["", "Where each measured peak happened:", ""]
    for r in rows:
        shape_only = SHAPE_ONLY if r.get("matmuls") == "shape only" else ""
        lines.append(f"- {name(r)}{shape_only}: {r['measured_where']}")
    return "\n".join(lines) + "\n"


def shape_arg(text: str) -> tuple[str, int, int]:
    """--shapes' PRESET:BATCH:SEQ, checked before anything is measured: a cell of batch or sequence 0
    would measure nothing and write a row of it."""
    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in PRESETS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not PRESET:BATCH:SEQ (e.g. small:1:256; presets {', '.join(sorted(PRESETS))})"
        )
    try:
        batch, seq = int(parts[1]), int(parts[2])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: BATCH and SEQ are whole numbers (e.g. small:1:256)"
        ) from None
    if batch < 1 or seq < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: BATCH and SEQ must be at least 1 (e.g. small:1:256)")
    return parts[0], batch, seq


def refuse_too_big(p: argparse.ArgumentParser, shapes: list[tuple[str, int, int]]) -> None:
    """Before any cell runs: a shape whose step the estimator puts above the memory available now
    would take the machine with it (the kernel's OOM killer picks among every process)."""
    free = available_bytes()
    for preset, batch, seq in shapes:
        need = estimate_gpt(shape_of(preset, batch, seq)).peak
        if free is not None and need > free:
            p.error(
                f"--shapes {preset}:{batch}:{seq}: one step needs about {need / 2**30:,.1f} GiB by the "
                f"estimate, above the {free / 2**30:,.1f} GiB available; pick a smaller batch or sequence"
            )


def main() -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["small", "gpt2"], choices=["small", "gpt2"])
    p.add_argument(
        "--shapes",
        nargs="+",
        metavar="PRESET:BATCH:SEQ",
        type=shape_arg,
        help="instead of the matrix's shapes, e.g. small:1:256 gpt2:2:1024",
    )
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument(
        "--losses",
        nargs="+",
        default=["plain", "chunked"],
        choices=["plain", "chunked"],
        help="the plain cross-entropy, the chunked one (--chunked-loss), or both (default)",
    )
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep the cells of the results file that this run does not measure again",
    )
    p.add_argument(
        "--shape-only-matmuls",
        action="store_true",
        help="skip aten::mm's arithmetic, keep its allocation (emulated bf16 on an AVX2 CPU is many "
        "times slower)",
    )
    output_flags(p, "measure nothing: write the .md again", busy=False)
    args = p.parse_args()
    if args.render:
        return render(
            p,
            args.render,
            lambda d: write_md(args.render.with_suffix(".md"), markdown(d["meta"], d["results"])),
        )
    check_out_dir(p, args.out_dir)
    meta = {**stamp(sys.argv), "name": "estimate"}
    shapes = args.shapes or [s for s in SHAPES if s[0] in args.presets]
    refuse_too_big(p, shapes)
    rows = []
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"{device_slug(meta['machine'])}-estimate"
    if args.keep and stem.with_suffix(".json").is_file():
        earlier = json.loads(stem.with_suffix(".json").read_text())
        rows, meta = earlier["results"], keeping(meta, earlier["meta"])
    done = {key(r) for r in rows}
    mode = "shape only" if args.shape_only_matmuls else "computed"
    for (preset, batch, seq), loss, amp, ckpt, accum in itertools.product(
        shapes, args.losses, args.dtypes, [False, True], [1, 2]
    ):
        if (preset, batch, seq, amp, ckpt, accum, loss, mode) in done:
            continue
        flags = dict(activation_checkpoint=ckpt, grad_accum_steps=accum, chunked_loss=loss == "chunked")
        rows.append(cell(preset, shape_of(preset, batch, seq, **flags), amp, args.shape_only_matmuls))
        r = rows[-1]
        print(
            f"{preset} b{batch} s{seq} {amp} ckpt={ckpt} accum={accum} {loss} loss: "
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
