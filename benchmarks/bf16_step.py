"""What the removed CPU CrossEntropy would buy now: one training step's CPU time with the trainer's
loss (F.cross_entropy) against that candidate, in figures that hold on a loaded machine.

    python benchmarks/bf16_step.py                        # small preset, bf16 and fp32, 1 thread
    python benchmarks/bf16_step.py --dtypes bf16 --rounds 9 --threads 2
    python benchmarks/bf16_step.py --no-profile           # CPU seconds per step only

The trainer's model computes its loss with F.cross_entropy on every device. Under the CPU's
autocast that copies all N x V logits to fp32, saves fp32 log-probabilities, and in backward writes a
dense fp32 gradient and converts it. minigpt's model once had its own CPU loss for that, removed to
keep the reading path short; it lives on here, and only here, as CandidateCrossEntropy: NOT the
trainer's loss, a candidate whose worth this benchmark measures.

Two variants of the preset's step (`small`: 4 layers, 256 wide, batch 8 x 256, vocabulary 50304,
tied head; forward under autocast for bf16, backward, clipping, fused AdamW, zero_grad), built from
the same seed in one process, the model's logits handed to each loss: "F.cross_entropy (the
trainer's)" and "candidate CrossEntropy (not the trainer's)". Three kinds of evidence, none of them
wall-clock time, because a shared machine's load moves that by tens of percent:

- CPU seconds per step (getrusage user + sys) with torch.set_num_threads(THREADS), the variants
  alternating step by step over several rounds: the median and the spread of each, and the ratio
  with its 95% interval (minigpt.analysis.stats): what the candidate would buy, measured;
- the profiler's self CPU time per op within one step, as shares of the step (load scales every op
  alike, so the shares survive it better than the totals);
- counts: aten ops, copies (aten::_to_copy, aten::copy_) and bytes allocated in one step.

The trainer's CPU malloc setting (train_minimal.keep_freed_memory) is applied first, as a run has it.
Prints markdown tables and a closing line per dtype; writes nothing. Say, with its figures, how
loaded the machine was.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from minigpt.config import GPT2_VOCAB, PRESETS
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

# Rows of logits per pass of the candidate: 8 rows of a 50304-token vocabulary are 1.6 MiB in fp32,
# so the passes over them (max, exp, sum, scale) stay in a core's L2 cache.
LOSS_ROWS = 8


class CandidateCrossEntropy(torch.autograd.Function):
    """NOT the trainer's loss: the CPU cross-entropy minigpt's model had before, kept here as the
    candidate this benchmark measures. F.cross_entropy(logits, targets) (mean over targets not -100,
    softmax in fp32) with less memory traffic: LOSS_ROWS rows at a time are made fp32, in cache, and
    the forward computes the loss and its gradient, softmax - one-hot (a loss ends the graph), kept
    in the logits' dtype, rounded once as F.cross_entropy's is."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        valid = targets != -100
        safe = targets.clamp(min=0).unsqueeze(1)
        n_valid = valid.sum().clamp(min=1).float()
        row_scale = (valid / n_valid).unsqueeze(1)  # d(mean loss) / d(row loss)
        lse = torch.empty(logits.size(0), 1, dtype=torch.float32, device=logits.device)
        grad = torch.empty_like(logits) if ctx.needs_input_grad[0] else None
        for i in range(0, logits.size(0), LOSS_ROWS):
            rows = slice(i, i + LOSS_ROWS)
            x = logits[rows].to(torch.float32, copy=True)  # a copy even of fp32 logits: changed in place
            top = x.amax(dim=1, keepdim=True)
            total = x.sub_(top).exp_().sum(dim=1, keepdim=True)  # x = exp(logit - top)
            lse[rows] = total.log() + top
            if grad is not None:
                x.mul_(row_scale[rows] / total)  # the softmax, times the row's share of the mean
                x.scatter_add_(1, safe[rows], -row_scale[rows])  # minus the one-hot target
                grad[rows] = x
        ctx.save_for_backward(grad)
        target_logits = logits.gather(1, safe).float()
        return ((lse - target_logits) * row_scale).sum()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        (grad,) = ctx.saved_tensors
        if grad_loss.item() == 1.0:  # the usual case (no accumulation): spare a pass over N x V
            return grad, None
        return grad * grad_loss, None  # the scalar is applied in fp32


TRAINER = "F.cross_entropy (the trainer's)"
CANDIDATE = "candidate CrossEntropy (not the trainer's)"
VARIANTS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    TRAINER: F.cross_entropy,  # as minigpt/core/model.py computes its loss
    CANDIDATE: CandidateCrossEntropy.apply,
}


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def make_step(loss_fn, dtype: str, preset: str = "small", seed: int = 0) -> Callable[[], torch.Tensor]:
    """One trainer step of the preset, as train_minimal.py runs it (no instruments), its loss
    computed by `loss_fn` from the model's logits."""
    p = PRESETS[preset]
    shape = shape_of(p, GPT2_VOCAB)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**shape.model_kwargs())).train()
    params = list(model.parameters())
    groups = [
        {"params": [q for q in params if q.dim() >= 2], "weight_decay": 0.1},
        {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), fused=True)
    gen = torch.Generator().manual_seed(seed)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else nullcontext()

    def step() -> torch.Tensor:
        x = torch.randint(0, shape.vocab_size, (shape.batch_size, shape.seq_len + 1), generator=gen)
        with autocast:
            logits, _ = model(x[:, :-1])
            loss = loss_fn(logits.flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def profile_step(step: Callable[[], torch.Tensor]) -> dict:
    """One step under the profiler: self CPU time shares by op and by category, and the counts."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
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
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--dtypes", default="bf16,fp32", help="comma-separated: bf16, fp32")
    ap.add_argument("--rounds", type=int, default=7, help="alternating steps per variant, after a warm-up")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1: load-independent)")
    ap.add_argument("--top", type=int, default=12, help="ops listed per profile")
    ap.add_argument("--no-profile", action="store_true", help="CPU seconds only")
    args = ap.parse_args()
    if args.rounds < 3:  # an interval needs three samples a side (minigpt.analysis.stats.MIN_SAMPLES)
        ap.error("--rounds must be at least 3")
    dtypes = args.dtypes.split(",")
    if set(dtypes) - {"bf16", "fp32"}:
        ap.error(f"--dtypes takes bf16 and/or fp32, got {args.dtypes!r}")
    from minigpt.analysis.stats import ratio_interval, verdict
    from train_minimal import keep_freed_memory

    torch.set_num_threads(args.threads)
    print(keep_freed_memory() or "CPU malloc: not glibc's; left as it is")  # as a trainer run has it
    print(f"torch {torch.__version__}, {args.threads} thread(s), load average {os.getloadavg()[0]:.1f}\n")
    closing = []
    for dtype in dtypes:
        # the same seed: the same weights and batches
        steps = {name: make_step(fn, dtype, args.preset) for name, fn in VARIANTS.items()}
        for step in steps.values():  # warm-up: first-touch allocations, oneDNN's kernel choice
            step()
        cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}
        losses: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(args.rounds):
            for name, step in steps.items():
                t = cpu_seconds()
                losses[name].append(step().item())
                cpu[name].append(cpu_seconds() - t)
        print(f"## {dtype}, `{args.preset}` preset's step\n")
        print("| variant | CPU s/step (median) | min - max | last loss |")
        print("|---|---|---|---|")
        for name, xs in cpu.items():
            spread = f"{min(xs):.3f} - {max(xs):.3f}"
            print(f"| {name} | {statistics.median(xs):.3f} | {spread} | {losses[name][-1]:.4f} |")
        iv = ratio_interval(cpu[CANDIDATE], cpu[TRAINER], method="alternating steps in one process")
        closing.append(
            f"{dtype}: the removed CPU CrossEntropy would buy F.cross_entropy / candidate = {verdict(iv)} "
            "in CPU seconds per step (95% interval; above 1: the candidate is faster)"
        )
        print(f"\n{closing[-1]}\n")
        if args.no_profile:
            continue
        profiles = {name: profile_step(step) for name, step in steps.items()}
        print("| share of the step's self CPU time | " + " | ".join(profiles) + " |")
        print("|---|" + "---|" * len(profiles))
        cats = list(profiles[TRAINER]["categories"])
        cats += [c for c in profiles[CANDIDATE]["categories"] if c not in cats]
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
    print("What the removed trick would buy, measured:")
    for line in closing:
        print(f"- {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
