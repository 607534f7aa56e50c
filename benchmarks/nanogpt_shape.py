"""minigpt's trainer against a bare nanoGPT-shaped loop, same shape, same machine, same hour.

    python benchmarks/nanogpt_shape.py                 # 3 rounds, fp32 and AMP, both allocators
    python benchmarks/nanogpt_shape.py --repeats 1 --steps 4 --warmup 1

The bare loop is the shape of nanoGPT's `train.py` defaults for this comparison: 4 layers, 4
heads, 256 wide, block 256, batch 8, vocabulary 50304, tied embeddings, no dropout, no biases,
exact GELU, AdamW (0.9, 0.95) with weight decay 0.1 on matrices, gradient clipping at 1.0, random
windows from a uint16 array, and bf16 autocast forced on for the AMP rows (nanoGPT's CPU path
ignores its dtype setting). It is written here, not imported: no instrumentation, no logging,
the loss read once per step as nanoGPT does. minigpt runs its `small` preset, which has that shape.

Each run is a fresh process; the rounds interleave every variant, so a drift of the machine
spreads over all of them. The bare loop runs twice: with glibc's default malloc, and with the
setting minigpt applies itself (`minigpt/cpu.py`), here through glibc's environment variables.
Writes benchmarks/results/<device>-nanogpt-shape.json and .md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import PRESETS, RESULTS, device_slug, header, run_variant, save_json, stamp

from minigpt.fileio import atomic_write

# glibc reads these at start-up: the same as minigpt's mallopt(M_MMAP_MAX=0, M_TRIM_THRESHOLD=2 GiB).
KEEP_FREED_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}
LAYERS, HEADS, WIDTH, BLOCK, BATCH, VOCAB = 4, 4, 256, 256, 8, 50304


def bare_loop(amp: bool, steps: int, warmup: int) -> float:
    """Median seconds per step of a nanoGPT-shaped training loop (runs in the child process)."""
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH, bias=False), nn.LayerNorm(WIDTH, bias=False)
            self.qkv, self.attn_proj = nn.Linear(WIDTH, 3 * WIDTH, bias=False), nn.Linear(WIDTH, WIDTH, bias=False)
            self.fc, self.mlp_proj = nn.Linear(WIDTH, 4 * WIDTH, bias=False), nn.Linear(4 * WIDTH, WIDTH, bias=False)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in self.qkv(self.ln_1(x)).split(C, 2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(B, T, C))
            return x + self.mlp_proj(F.gelu(self.fc(self.ln_2(x))))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(BLOCK, WIDTH)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.ln_f = nn.LayerNorm(WIDTH, bias=False)
            self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
            self.wte.weight = self.lm_head.weight

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
            for block in self.blocks:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))

    model = Model()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=6e-4, betas=(0.9, 0.95))
    data = np.random.default_rng(0).integers(0, 50257, 200_000).astype(np.uint16)

    def batch():
        ix = torch.randint(len(data) - BLOCK - 1, (BATCH,)).tolist()
        x = torch.stack([torch.from_numpy(data[i:i + BLOCK].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + BLOCK].astype(np.int64)) for i in ix])
        return x, y

    times = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        x, y = batch()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


def run_bare(amp: bool, keep_freed: bool, steps: int, warmup: int) -> float:
    env = {**os.environ, **(KEEP_FREED_ENV if keep_freed else {})}
    out = subprocess.run([sys.executable, __file__, "--child", "amp" if amp else "fp32", "--steps", str(steps),
                          "--warmup", str(warmup)], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--child", choices=["fp32", "amp"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if min(args.steps, args.repeats, args.warmup) < 1:
        p.error("--steps, --repeats and --warmup must be at least 1")
    if args.child:
        print(bare_loop(args.child == "amp", args.steps, args.warmup))
        return 0

    tokens = BATCH * BLOCK
    variants = {}
    for amp in (False, True):
        name = "amp" if amp else "fp32"
        variants[f"bare loop, {name}, glibc default malloc"] = lambda a=amp: run_bare(a, False, args.steps, args.warmup)
        variants[f"bare loop, {name}, malloc keeps freed blocks"] = lambda a=amp: run_bare(a, True, args.steps, args.warmup)
        flags = [*PRESETS["nanogpt"], "--amp" if amp else "--no-amp"]
        variants[f"minigpt train_minimal.py, {name}"] = lambda f=flags: statistics.median(
            r["step_time_s"] for r in run_variant(f, args.warmup, args.steps)["rows"])
    medians: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.repeats):  # interleaved rounds
        for name, run in variants.items():
            print(f"[{name}] round {r + 1}/{args.repeats}", flush=True)
            medians[name].append(tokens / run())
    meta = {**stamp(sys.argv), "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
            "extra_flags": os.environ.get("MINIGPT_ARGS", "")}
    results = {name: {"tokens_per_s": statistics.median(v), "rounds": v} for name, v in medians.items()}
    lines = [*header("minigpt against a bare nanoGPT-shaped loop", meta),
             f"Shape: {LAYERS} layers, {HEADS} heads, {WIDTH} wide, block {BLOCK}, batch {BATCH}, vocabulary {VOCAB}. "
             f"Each round runs every variant in a fresh process: median of {args.steps} steps after {args.warmup}.",
             "", "| variant | tokens/s (median of rounds) | each round |", "|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {', '.join(f'{t:,.0f}' for t in r['rounds'])} |")
    if meta["extra_flags"]:
        lines += ["", f"Flags from $MINIGPT_ARGS, applied to the minigpt rows only (the bare loop keeps its shape): "
                  f"`{meta['extra_flags']}`"]
    table = "\n".join(lines) + "\n"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"{device_slug(meta['machine'])}-nanogpt-shape"
    save_json(stem, {"meta": meta, "results": results})
    atomic_write(stem.with_suffix(".md"), table)
    print(table)
    print(f"wrote {stem}.json, .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
