"""--chunked-loss against the plain loss: the measured peak and tokens/s, fp32 and bf16.

    python benchmarks/chunked_loss.py                        # small (batch 8 x 256), gpt2 (batch 1 x 256)
    python benchmarks/chunked_loss.py --render benchmarks/results/cpu-chunked-loss.json

One process per (shape, dtype) builds both models from the same seed and alternates their steps
(plain, chunked, plain, ...) after a warm-up step each, so that a shared machine's slow moments
fall on both alike; tokens/s is the median over the measured steps. Then one step of each is
measured with minigpt.instruments.breakdown.capture_memory on one intra-op thread
(estimate_table.py's one_thread): the allocator's peak, where it happened, and its biggest parts
(`benchmarks/ablation.py --chunked-loss` runs the trainer's own --chunked-loss beside its plain
loss). Writes benchmarks/results/cpu-chunked-loss.*.

--shape-only-matmuls measures the peaks only, aten::mm's arithmetic skipped (estimate_table.py's
ShapeOnlyMatmuls: the same allocations, tested): a CPU without native bf16 emulates it many times slower
than fp32, so its bf16 tokens/s say nothing of a bf16 machine and a gpt2 step takes many minutes.
--keep keeps the rows of the results file that this run does not measure again.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

from common import (
    RESULTS,
    ROOT,
    Parser,
    check_out_dir,
    header,
    keeping,
    ratio,
    ratio_text,
    render,
    save_json,
    stamp,
    write_md,
)

from minigpt.fileio import atomic_write

MIB = 2**20
CASES = [("small", 8, 256), ("gpt2", 1, 256)]


def peak_fields(b) -> dict:
    """A measured step's peak, where it happened and its parts (a MemoryBreakdown)."""
    temps = sorted(b.peak_parts["temporaries"].items(), key=lambda kv: -kv[1])[:3]
    return dict(
        peak=b.peak,
        peak_where=b.peak_where,
        parts={p: b.peak_part(p) for p in b.peak_parts},
        top_temporaries=temps,
        activations=b.category_total("activations"),
    )


def child(preset: str, batch: int, seq: int, amp: str, steps: int, shape_only: bool) -> dict:
    import torch

    from minigpt.instruments.breakdown import capture_memory
    from train_minimal import keep_freed_memory

    keep_freed_memory()  # the trainer's default
    from estimate_table import measure, model_of, one_thread, shape_of  # the child runs in benchmarks/

    shape = shape_of(preset, batch, seq)
    if shape_only:  # peaks only: one model at a time, as the estimate table measures its cells
        return {
            name: {"tokens_per_s": [], "loss": None, **peak_fields(b)}
            for name, chunked in (("plain", False), ("chunked", True))
            for b in [measure(replace(shape, chunked_loss=chunked), amp, shape_only_matmuls=True)]
        }
    models = {}
    for name, chunked in (("plain", False), ("chunked", True)):
        model = model_of(replace(shape, chunked_loss=chunked))
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if amp == "bf16" else nullcontext
    x = torch.randint(0, shape.vocab_size, (batch, seq))
    y = torch.roll(x, -1, 1)

    def step(name: str) -> tuple[float, float]:
        model, opt = models[name]
        t0 = time.perf_counter()
        with autocast():
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return batch * seq / (time.perf_counter() - t0), loss.item()

    out: dict = {name: {"tokens_per_s": []} for name in models}
    for i in range(steps + 1):
        for name in models:
            tps, loss = step(name)
            if i:
                out[name]["tokens_per_s"].append(tps)
            out[name]["loss"] = loss
    for name, (model, opt) in models.items():  # on one thread, as estimate_table.measure's peaks
        with one_thread(), capture_memory(model, opt) as cap:
            step(name)
        out[name].update(peak_fields(cap.breakdown))
    return out


def own(v: dict) -> int:
    """The peak less what was held from before the step: the other variant's model lives in the
    same process, and its tensors are no part of this one's step."""
    return v["peak"] - v["parts"].get("held", 0)


def markdown(meta: dict, results: list[dict]) -> str:
    lines = [
        *header("Chunked loss: the measured peak and tokens/s", meta),
        f"{meta['steps']} measured steps of each variant after a warm-up step, alternating in one process "
        "per "
        "row (glibc keeping freed blocks, the trainer's default); the peak: one more step of each measured "
        "with `capture_memory` on one intra-op thread (oneDNN's bf16 products allocate a scratch per "
        "thread). The machine was shared with other jobs (load average well above its 2 "
        "cores): compare tokens/s within a row only.",
        "",
        "| shape | dtype | variant | tokens/s (median) | min-max | peak MiB (this model) | peak in | "
        "biggest temporaries at the "
        "peak (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for name in ("plain", "chunked"):
            v = r[name]
            t = v["tokens_per_s"]
            temps = "; ".join(f"{n} {b / MIB:,.0f}" for n, b in v["top_temporaries"])
            speed = (
                f"{statistics.median(t):,.0f} | {min(t):,.0f}-{max(t):,.0f}"
                if t
                else "not measured | shape-only matmuls"
            )
            lines.append(
                f"| {r['preset']} b{r['batch']} s{r['seq']} | {r['amp']} | {name} | {speed} | "
                f"{own(v) / MIB:,.1f} | {v['peak_where']} | {temps} |"
            )
    lines += ["", "Effect of the chunked loss (chunked against plain, same row):", ""]
    for r in results:
        p, c = r["plain"], r["chunked"]
        text = (
            f"- {r['preset']} b{r['batch']} s{r['seq']} {r['amp']}: peak {own(p) / MIB:,.0f} -> "
            f"{own(c) / MIB:,.0f} MiB ({100 * (own(c) / own(p) - 1):+.0f}%)"
        )
        if p["tokens_per_s"] and c["tokens_per_s"]:
            speed = ratio_text(ratio(p["tokens_per_s"], c["tokens_per_s"], "steps of one process each"))
            text += f", tokens/s {speed} (steps of one process each), loss {p['loss']:.4f} vs {c['loss']:.4f}"
        else:
            text += " (peaks with shape-only matmuls; tokens/s not measured: emulated bf16)"
        lines.append(text)
    return "\n".join(lines) + "\n"


def main() -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument(
        "--shape-only-matmuls",
        action="store_true",
        help="peaks only, aten::mm's arithmetic skipped (emulated bf16 on an AVX2 CPU is many times slower)",
    )
    p.add_argument("--keep", action="store_true", help="keep the rows this run does not measure again")
    p.add_argument("--child", nargs=4, metavar=("PRESET", "BATCH", "SEQ", "AMP"), help=argparse.SUPPRESS)
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--render", type=Path, metavar="RESULTS_JSON")
    args = p.parse_args()
    if args.child:
        import json

        preset, batch, seq, amp = args.child
        print(json.dumps(child(preset, int(batch), int(seq), amp, args.steps, args.shape_only_matmuls)))
        return 0
    if args.render:
        return render(
            p,
            args.render,
            lambda d: write_md(args.render.with_suffix(".md"), markdown(d["meta"], d["results"])),
        )
    if args.steps < 1:
        p.error("--steps must be at least 1")
    check_out_dir(p, args.out_dir)
    import json

    meta = {**stamp(sys.argv), "steps": args.steps}
    stem = args.out_dir / "cpu-chunked-loss"
    results = []
    if args.keep and stem.with_suffix(".json").is_file():
        earlier = json.loads(stem.with_suffix(".json").read_text())
        results = [r for r in earlier["results"] if r["amp"] not in args.dtypes]
        meta = keeping(meta, earlier["meta"])
    for amp in args.dtypes:
        for preset, batch, seq in CASES:
            cmd = [
                sys.executable,
                __file__,
                "--child",
                preset,
                str(batch),
                str(seq),
                amp,
                "--steps",
                str(args.steps),
                *(["--shape-only-matmuls"] if args.shape_only_matmuls else []),
            ]
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=7200)
            if done.returncode != 0:
                raise RuntimeError(done.stderr[-2000:])
            results.append(
                {
                    "preset": preset,
                    "batch": batch,
                    "seq": seq,
                    "amp": amp,
                    **json.loads(done.stdout.strip().splitlines()[-1]),
                }
            )
            print(markdown(meta, results).splitlines()[-1], flush=True)
            save_json(stem, {"meta": meta, "results": results})
            atomic_write(stem.with_suffix(".md"), markdown(meta, results))
    print(markdown(meta, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
