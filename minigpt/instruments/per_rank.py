"""One rank's share of a sharded run, predicted: the memory estimate scaled to a rank under DDP, FSDP
and tensor parallelism as minigpt/core/parallel.py splits the model (estimate.py's
per_rank_estimate), and the bytes each GPU sends per step. `python -m minigpt parallel` prints
both for a preset on a number of GPUs (docs/parallel.md reads 8 H100s from it).

    python -m minigpt parallel --preset gpt2 --gpus 8
"""

from __future__ import annotations

from minigpt.config import GPT2_VOCAB, ArgParser
from minigpt.core.shape import Shape, shape_of
from minigpt.instruments.estimate import (
    estimate_gpt,
    per_rank_estimate,
    per_rank_memory_estimate,
    tp_replicated_params,
)

__all__ = ["comm_model", "main", "per_rank_estimate", "per_rank_memory_estimate", "tp_replicated_params"]


# ---------------------------------------------------------------------------- a communication model

H100_NVLINK_BYTES_PER_S = 450e9  # assumed: NVLink 4, 900 GB/s both ways = 450 GB/s per direction per GPU


def comm_model(
    shape: Shape,
    dp: int,
    tp: int,
    fsdp: bool,
    amp: bool = False,
    link_bytes_per_s: float = H100_NVLINK_BYTES_PER_S,
) -> dict:
    """Bytes each GPU sends per optimizer step, per kind of collective, and the seconds they take
    at `link_bytes_per_s` (ring algorithms, bandwidth term only: no latency, no overlap with
    compute, so an upper bound on what is exposed). P = parameters, b s h = tokens x width. Under
    bf16 AMP (`amp`), as parallelize() sets it up, FSDP gathers bf16 parameters and TP's
    activations are bf16; gradients are reduced in fp32 either way.

    DDP:  all-reduce of the gradients, 2 (n-1)/n x P x 4 bytes.
    FSDP: all-gather of the parameters in the forward and again in the backward (each block is
          resharded after its forward), 2 x (n-1)/n x P x param bytes, and a reduce-scatter of the
          gradients, (n-1)/n x P x 4 bytes. With tp, P is each tp rank's share.
    TP:   per block 2 all-reduces of the activations forward (after attn.proj and mlp.proj) and 2
          backward (the gradients of the two column-parallel inputs), each 2 (t-1)/t x b s h x
          activation bytes, for the data-parallel rank's batch."""
    half, reduce_bytes = (2 if amp else 4), 4
    replicated = tp_replicated_params(shape)
    per_tp_rank = replicated + (shape.params - replicated) // tp
    out = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce_grads": 0.0, "all_reduce_tp": 0.0}
    if dp > 1:
        ring = (dp - 1) / dp
        if fsdp:
            out["all_gather"] = 2 * ring * per_tp_rank * half
            out["reduce_scatter"] = ring * per_tp_rank * reduce_bytes
        else:
            out["all_reduce_grads"] = 2 * ring * per_tp_rank * reduce_bytes
    if tp > 1:
        s = shape  # b, s and h one at a time, in this order: tests/shape_pins.json pins the float
        out["all_reduce_tp"] = (
            s.n_layers * 4 * 2 * (tp - 1) / tp * s.batch_size * s.seq_len * s.d_model * half
        )
    total = sum(out.values())
    return {"bytes": out, "total_bytes": total, "seconds": total / link_bytes_per_s}


# Each number flag's bounds, beside the flags and checked by one loop (number_problem): whole
# numbers from `low` to `high`; real ones above `low` (0 would divide by zero: compute time over
# MFU x peak, communication over the link) up to `high`, and finite. No default replaces a value
# out of bounds: --batch-size 0 is refused, not read as "the preset's".
NUMBER_BOUNDS = {
    "gpus": (1, 1 << 20, "a number of GPUs"),
    "batch_size": (1, 1 << 20, "sequences per data-parallel rank"),
    "mfu": (0.0, 1.0, "a fraction of the peak (0.4 is 40%)"),
    "peak_tflops": (0.0, 1e6, "TFLOP/s per GPU"),
    "link_gb_s": (0.0, 1e6, "GB/s per direction"),
}


def number_problem(args) -> str | None:
    """The first number flag out of its NUMBER_BOUNDS, as one line naming it and its range."""
    for dest, (low, high, what) in NUMBER_BOUNDS.items():
        v = getattr(args, dest)
        if v is None:
            continue
        whole = isinstance(low, int)
        if not (low <= v <= high if whole else low < v <= high):
            span = f"from {low:,} to {high:,}" if whole else f"above {low:g}, at most {high:g}"
            return f"--{dest.replace('_', '-')} {v}: give {what}, {span}"
    return None


def main(argv: list[str] | None = None) -> int:
    """python -m minigpt parallel [--preset gpt2] [--gpus 8]: the per-GPU memory (the estimator,
    scaled per rank) and the communication model for DDP, FSDP, TP and FSDP x TP."""
    from minigpt.config import PRESETS

    p = ArgParser(prog="python -m minigpt parallel", description=main.__doc__)
    p.add_argument("--preset", default="gpt2", choices=sorted(PRESETS))
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation (compute time)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="per GPU (H100 SXM dense bf16)")
    p.add_argument("--batch-size", type=int, help="per data-parallel rank (default: the preset's)")
    p.add_argument("--link-gb-s", type=float, default=H100_NVLINK_BYTES_PER_S / 1e9)
    a = p.parse_args(argv)
    if problem := number_problem(a):
        p.error(problem)
    pre = PRESETS[a.preset]
    shape = shape_of(pre, GPT2_VOCAB, batch_size=pre["batch_size"] if a.batch_size is None else a.batch_size)
    n = a.gpus
    plans = [("DDP", n, 1, False), ("FSDP", n, 1, True), (f"TP {n}", 1, n, False)]
    plans += [(f"FSDP {n // t} x TP {t}", n // t, t, True) for t in (2, 4) if n % t == 0 and n > t]
    shown = (
        "n_layers",
        "n_heads",
        "d_model",
        "d_ff",
        "seq_len",
        "batch_size",
        "vocab_size",
        "max_position_embeddings",
    )
    print(
        f"{a.preset}: { {k: getattr(shape, k) for k in shown} }; {n} GPUs; bf16 AMP (fp32 master weights, "
        f"AdamW), link {a.link_gb_s:.0f} GB/s per direction"
    )
    print(
        f"compute per GPU at {100 * a.mfu:.0f}% of {a.peak_tflops:.0f} TFLOP/s; communication time "
        "is the bandwidth term alone, none of it overlapped (an upper bound on what is exposed)"
    )
    print(
        f"{'plan':18s} {'params+grads+AdamW':>19s} {'activations':>12s} {'peak':>9s} "
        f"{'comm/step':>10s} {'comm time':>10s} {'compute':>9s}"
    )
    for name, dp, tp, fsdp in plans:
        if shape.n_heads % tp or shape.d_ff % tp:
            print(f"{name:18s} not possible: {shape.n_heads} heads do not split {tp} ways")
            continue
        print(f"{name:18s} " + _plan_row(shape, dp, tp, fsdp, a))
    return 0


def _plan_row(shape: Shape, dp: int, tp: int, fsdp: bool, a) -> str:
    """One plan's line of _main's table: per-GPU memory, communication and compute time."""
    e = per_rank_estimate(estimate_gpt(shape, "bf16", "cuda"), dp, tp, fsdp, shape)
    c = comm_model(shape, dp, tp, fsdp, amp=True, link_bytes_per_s=a.link_gb_s * 1e9)
    gib = 2**30
    compute = shape.flops_per_token * shape.tokens / tp / (a.peak_tflops * 1e12 * a.mfu)
    return (
        f"{(e['params'] + e['grads'] + e['optimizer']) / gib:16.2f} GiB "
        f"{e['activations'] / gib:8.2f} GiB {e['peak'] / gib:5.2f} GiB "
        f"{c['total_bytes'] / 1e9:6.2f} GB "
        f"{1000 * c['seconds']:7.2f} ms {1000 * compute:6.1f} ms"
    )
