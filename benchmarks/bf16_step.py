"""Where one training step's CPU time goes, before and after the default loss (model.CrossEntropy):
figures that hold on a loaded machine.

    python benchmarks/bf16_step.py                        # small preset, bf16 and fp32, 1 thread
    python benchmarks/bf16_step.py --dtypes bf16 --rounds 9 --threads 2
    python benchmarks/bf16_step.py --no-profile           # CPU seconds per step only

Two variants of the `small` preset's step (4 layers, 256 wide, batch 8 x 256, vocabulary 50304,
tied head; forward under autocast for bf16, backward, clipping, fused AdamW, zero_grad), built from
the same seed in one process: "F.cross_entropy" (the loss before: its fp32 copy of the logits and
dense fp32 gradient) and "default" (minigpt.core.model as it is). Three kinds of evidence, none of them
wall-clock time, because a shared machine's load moves that by tens of percent:

- CPU seconds per step (getrusage user + sys) with torch.set_num_threads(THREADS), the variants
  alternating step by step over several rounds: the median and the spread of each;
- the profiler's self CPU time per op within one step, as shares of the step (load scales every op
  alike, so the shares survive it better than the totals);
- counts: aten ops, copies (aten::_to_copy, aten::copy_) and bytes allocated in one step.

Prints a markdown table; writes nothing. Say, with its figures, how loaded the machine was.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # the trainer's malloc (tcmalloc when installed), chosen before torch loads
    from minigpt.core.cpu import run_under_preferred_allocator

    run_under_preferred_allocator(sys.argv[1:])

import argparse
import os
import resource
import statistics
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from minigpt.core import model as model_module
from minigpt.config import GPT2_PADDED, GPT2_VOCAB, PRESETS
from minigpt.core.cpu import keep_freed_memory
from minigpt.core.model import GPT, GPTConfig
from minigpt.core.shape import shape_of

# An op run inside one of these (forward or backward) counts as the loss's, whatever it is.
LOSS_RANGES = ("cross_entropy", "CrossEntropy", "NllLoss", "LogSoftmax")
# What any other op's self time is counted under (first match wins); the rest is "other". The
# logits' upcast for the plain loss is autocast's, made before F.cross_entropy starts: a copy.
CATEGORIES = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "mkldnn"),
    "copies": ("aten::_to_copy", "aten::copy_", "aten::to", "aten::contiguous", "aten::clone"),
    "attention": ("scaled_dot_product", "flash_attention"),
    "optimizer": ("fused_adam", "_foreach", "aten::zero_", "aten::norm", "linalg_vector_norm"),
    "layernorm, gelu": ("layer_norm", "gelu"),
}


class PlainCrossEntropy:
    """The loss before: F.cross_entropy over the whole logits (autocast makes them fp32 first)."""

    @staticmethod
    def apply(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, targets)


# Swapped in for model.CrossEntropy, which model.cross_entropy uses on the CPU.
VARIANTS: dict[str, type] = {"F.cross_entropy": PlainCrossEntropy, "default": model_module.CrossEntropy}


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def make_step(dtype: str, seed: int = 0) -> Callable[[], torch.Tensor]:
    """One trainer step of the `small` preset, as train_minimal.py runs it (no instruments)."""
    p = PRESETS["small"]
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**shape_of(p, GPT2_VOCAB).model_kwargs())).train()
    params = list(model.parameters())
    groups = [
        {"params": [q for q in params if q.dim() >= 2], "weight_decay": 0.1},
        {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), fused=True)
    gen = torch.Generator().manual_seed(seed)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else nullcontext()

    def step() -> torch.Tensor:
        x = torch.randint(0, GPT2_PADDED, (p["batch_size"], p["seq_len"] + 1), generator=gen)
        with autocast:
            _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def run_variant(name: str, step: Callable[[], torch.Tensor]) -> torch.Tensor:
    model_module.CrossEntropy = VARIANTS[name]
    try:
        return step()
    finally:
        model_module.CrossEntropy = VARIANTS["default"]


def profile_step(name: str, step: Callable[[], torch.Tensor]) -> dict:
    """One step under the profiler: self CPU time shares by op and by category, and the counts."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_variant(name, step)
    events = [e for e in prof.events() if e.name != "[memory]"]

    def category(e) -> str:
        a = e
        while a is not None:
            if any(k in a.name for k in LOSS_RANGES):
                return "loss"
            a = a.cpu_parent
        return next((c for c, keys in CATEGORIES.items() if any(k in e.name for k in keys)), "other")

    # Each op's own allocations, net of what it freed before returning (a lower bound of the traffic).
    allocated = sum(max(e.self_cpu_memory_usage, 0) for e in prof.events())
    by_op: dict[str, float] = {}
    by_cat: dict[str, float] = {}
    for e in events:
        by_op[e.name] = by_op.get(e.name, 0.0) + e.self_cpu_time_total
        by_cat[category(e)] = by_cat.get(category(e), 0.0) + e.self_cpu_time_total
    total = sum(by_op.values())
    return {
        "ops": {op: us / total for op, us in sorted(by_op.items(), key=lambda kv: -kv[1])},
        "categories": {c: us / total for c, us in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "aten_ops": sum(1 for e in events if e.name.startswith("aten::")),
        "copies": sum(1 for e in events if e.name in ("aten::_to_copy", "aten::copy_")),
        "allocated_mib": allocated / 2**20,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="bf16,fp32", help="comma-separated: bf16, fp32")
    ap.add_argument("--rounds", type=int, default=7, help="alternating steps per variant, after a warm-up")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1: load-independent)")
    ap.add_argument("--top", type=int, default=12, help="ops listed per profile")
    ap.add_argument("--no-profile", action="store_true", help="CPU seconds only")
    args = ap.parse_args()
    if args.rounds < 3:  # an interval needs three samples a side (minigpt.analysis.stats.MIN_SAMPLES)
        ap.error("--rounds must be at least 3")
    torch.set_num_threads(args.threads)
    print(keep_freed_memory())  # the trainer's malloc setting: no page faults for re-used big blocks
    print(f"torch {torch.__version__}, {args.threads} thread(s), load average {os.getloadavg()[0]:.1f}\n")
    for dtype in args.dtypes.split(","):
        steps = {name: make_step(dtype) for name in VARIANTS}  # same seed: the same weights and batches
        for name, step in steps.items():  # warm-up: first-touch allocations, oneDNN's kernel choice
            run_variant(name, step)
        cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}
        losses: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(args.rounds):
            for name, step in steps.items():
                t = cpu_seconds()
                losses[name].append(run_variant(name, step).item())
                cpu[name].append(cpu_seconds() - t)
        print(f"## {dtype}, `small` preset's step\n")
        print("| variant | CPU s/step (median) | min - max | last loss |")
        print("|---|---|---|---|")
        for name, xs in cpu.items():
            spread = f"{min(xs):.3f} - {max(xs):.3f}"
            print(f"| {name} | {statistics.median(xs):.3f} | {spread} | {losses[name][-1]:.4f} |")
        from minigpt.analysis.stats import ratio_interval, verdict

        iv = ratio_interval(cpu["default"], cpu["F.cross_entropy"], method="alternating steps in one process")
        print(f"\nF.cross_entropy / default, CPU s per step: {verdict(iv)} (95% interval)\n")
        if args.no_profile:
            continue
        profiles = {name: profile_step(name, step) for name, step in steps.items()}
        print("| share of the step's self CPU time | " + " | ".join(profiles) + " |")
        print("|---|" + "---|" * len(profiles))
        cats = list(profiles["F.cross_entropy"]["categories"])
        cats += [c for c in profiles["default"]["categories"] if c not in cats]
        for c in cats:
            print(
                f"| {c} | " + " | ".join(f"{p['categories'].get(c, 0):.0%}" for p in profiles.values()) + " |"
            )
        for key in ("aten_ops", "copies"):
            print(f"| {key} (count) | " + " | ".join(f"{p[key]}" for p in profiles.values()) + " |")
        print(
            "| allocated (MiB) | "
            + " | ".join(f"{p['allocated_mib']:,.0f}" for p in profiles.values())
            + " |"
        )
        for name, p in profiles.items():
            top = list(p["ops"].items())[: args.top]
            print(f"\n{name}, top ops: " + ", ".join(f"{op} {share:.1%}" for op, share in top))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
