"""DDP vs FSDP vs TP vs FSDP x TP on CPU ranks (gloo): tokens/s, per-rank memory, exposed communication.

    python benchmarks/parallel.py                         # small and gpt2, 2 and 4 ranks, batch 1 per rank
    python benchmarks/parallel.py --models small --ranks 2 --steps 3
    python benchmarks/parallel.py --render                # the .md from the saved .json

Each variant is a fresh torchrun job running this file with --worker: minigpt's GPT at the preset's
shape, fp32, batch 1 per data-parallel rank, W warm-up steps, N timed steps, then one profiled step
that measures the exposed communication. Results: benchmarks/results/cpu-parallel.{json,md}.

Exposed communication: the time the training thread spends inside communication, i.e. not
computing: the union of the profiler's ranges on that thread whose names are collectives or
FSDP2's gather/reduce ranges (commprobe.stage_comm_ms in minigpt.instruments), plus, under DDP, the
wait at the end
of the backward for the last all-reduce (the time from the last gradient bucket being ready to the
backward's end, from a communication hook). Collectives that run while the thread computes are
hidden, not counted.

Caveat: gloo between processes on one CPU is not NCCL over NVLink. Here the "link" is shared
memory and the collectives run on the same 2 cores as the compute, so communication costs far more
relative to compute than on GPUs, and more ranks than cores slows everything. The figures compare
the schemes' overheads on this machine; docs/parallel.md predicts 8 H100s from a model instead.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common import RESULTS, Parser, available_bytes, header, save_json, spread, stamp, write_md
from common import render as render_results

from minigpt.config import GPT2_VOCAB, PRESETS
from minigpt.core.shape import Shape, shape_of

STEM = RESULTS / "cpu-parallel"
SCHEMES = {  # name: (flags of the worker, needs a world size divisible by 2 for tp)
    "ddp": [],
    "fsdp": ["--fsdp"],
    "tp": ["--tp", "ALL"],  # TP over every rank
    "fsdp x tp": ["--fsdp", "--tp", "2"],
}
# the trainer's presets, GPT-2's vocabulary, one sequence per data-parallel rank
MODELS = {name: shape_of(PRESETS[name], GPT2_VOCAB, batch_size=1) for name in ("small", "gpt2")}
# ---------------------------------------------------------------------------- the worker (one rank)


def worker(args) -> None:
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from minigpt.core import distributed, parallel
    from minigpt.core.model import GPT, GPTConfig

    torch.set_num_threads(1)  # more ranks than cores: one thread each, or they fight over the cores
    shape = MODELS[args.model]
    world = parallel.world_size_from_env()
    tp = world if args.tp == "ALL" else int(args.tp)
    cfg = SimpleNamespace(
        fsdp=args.fsdp,
        tp=tp,
        use_tensor_parallel=False,
        n_heads=shape.n_heads,
        d_ff=shape.d_ff,
        compile=False,
        amp=False,
        amp_dtype="bf16",
    )
    parallel.check_plan(cfg, world)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = parallel.build_mesh(world, tp, "cpu")
    dp_rank, dp, _, _ = parallel.mesh_coords(rank, mesh)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape.model_kwargs()))
    train_model = parallel.parallelize(model, cfg, mesh, "cpu", "fp32")
    params = list(model.parameters())
    groups = [
        {"params": [q for q in params if q.dim() >= 2], "weight_decay": 0.1},
        {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(parallel.split_by_mesh(groups), lr=1e-4, fused=True)
    ready: list[float] = []
    if not (args.fsdp or tp > 1):
        distributed.time_backward_compute(train_model, lambda: ready.append(time.perf_counter()))
    r = Rank(model, train_model, optimizer, shape, torch.Generator().manual_seed(dp_rank), ready)
    record = {
        "rank": rank,
        "worker": parallel.worker_name(rank, mesh),
        "dp": dp,
        "tp": tp,
        **measure_rank(r, args.warmup, args.steps),
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
        "tokens_per_step": dp * shape.seq_len,
    }
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


@dataclass
class Rank:
    """What one rank trains: the model as built, as wrapped for the scheme, its optimizer, the
    shape, this data-parallel rank's batch generator, and (DDP) the moments its gradient buckets
    were ready, which a communication hook appends to."""

    model: object
    train_model: object
    optimizer: object
    shape: Shape
    generator: object
    ready: list[float]


def measure_rank(r: Rank, warmup: int, steps: int) -> dict:
    """Timed steps after `warmup`, the state's bytes, and one profiled step's exposed communication."""
    import torch
    import torch.distributed as dist
    from torch.profiler import profile, record_function

    from minigpt.core import parallel
    from minigpt.instruments import commprobe

    tail_waits: list[float] = []

    def step():
        x = torch.randint(0, r.shape.vocab_size, (1, r.shape.seq_len), generator=r.generator)
        loss = r.train_model(x, x)[1]
        r.ready.clear()
        loss.backward()
        if r.ready:  # DDP: the backward's end waited for the last all-reduce after the last bucket
            tail_waits.append(time.perf_counter() - r.ready[-1])
        parallel.clip_grad_norm(r.model.parameters(), 1.0)
        r.optimizer.step()
        r.optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    state = parallel.local_state_bytes(r.model, r.optimizer)  # grads are gone: count them from a backward
    x = torch.randint(0, r.shape.vocab_size, (1, r.shape.seq_len), generator=r.generator)
    r.train_model(x, x)[1].backward()
    state["grads"] = parallel.local_state_bytes(r.model)["grads"]
    r.optimizer.zero_grad(set_to_none=True)

    dist.barrier()
    tail_waits.clear()
    with profile() as prof:
        with record_function("bench_step"):
            t0 = time.perf_counter()
            step()
            profiled_s = time.perf_counter() - t0
    exposed_s = commprobe.stage_comm_ms(prof.events(), ("bench_step",))["step"] / 1000 + sum(tail_waits)
    return {"step_s": times, "profiled_step_s": profiled_s, "exposed_comm_s": exposed_s, "state_bytes": state}


# ---------------------------------------------------------------------------- the driver

MEMORY_SHARE = 0.5  # a shared machine: a variant may take at most half of the memory available now


def predicted_bytes(model: str, scheme: str, nproc: int) -> int:
    """The estimator's per-rank peak times the ranks, plus ~0.4 GiB per process for torch itself."""
    from minigpt.instruments.estimate import estimate_gpt
    from minigpt.instruments.per_rank import per_rank_estimate

    shape = MODELS[model]
    tp = {"ddp": 1, "fsdp": 1, "tp": nproc, "fsdp x tp": 2}[scheme]
    dp = nproc // tp
    e = per_rank_estimate(estimate_gpt(shape), dp, tp, scheme.startswith("fsdp"), shape)
    ddp_buckets = e["grads"] if scheme == "ddp" else 0  # DDP's gradient buckets: a second copy
    return nproc * (e["peak"] + ddp_buckets + int(0.4 * 2**30))


def run(model: str, scheme: str, nproc: int, warmup: int, steps: int) -> dict:
    flags = [f.replace("ALL", str(nproc)) for f in SCHEMES[scheme]]
    with tempfile.TemporaryDirectory(prefix="minigpt-parallel-") as tmp:
        out = Path(tmp) / "r"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            __file__,
            "--worker",
            "--model",
            model,
            "--out",
            str(out),
            "--warmup",
            str(warmup),
            "--steps",
            str(steps),
            *flags,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
        if result.returncode != 0:
            raise RuntimeError(f"{model} {scheme} x{nproc} failed:\n{result.stderr[-3000:]}")
        ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(nproc)]
    step_s = [max(r["step_s"][i] for r in ranks) for i in range(steps)]  # the slowest rank sets the pace
    return {
        "model": model,
        "scheme": scheme,
        "ranks": nproc,
        "tokens_per_s": spread([ranks[0]["tokens_per_step"] / s for s in step_s]),
        "step_ms": spread([1000 * s for s in step_s]),
        "exposed_comm_ms": statistics.median(1000 * r["exposed_comm_s"] for r in ranks),
        "profiled_step_ms": statistics.median(1000 * r["profiled_step_s"] for r in ranks),
        "rss_peak_bytes": max(r["max_rss_bytes"] for r in ranks),
        "state_bytes": ranks[0]["state_bytes"],
        "workers": [r["worker"] for r in ranks],
    }


def render(data: dict) -> str:
    gib = lambda n: f"{n / 2**30:.2f}" if n >= 2**28 else f"{n / 2**20:.0f} Mi"  # noqa: E731
    lines = header("DDP, FSDP, TP and FSDP x TP on CPU ranks (gloo)", data["meta"]) + [
        f"minigpt's GPT, fp32, batch 1 per data-parallel rank, one thread per rank; {data['warmup']} warm-up "
        f"and {data['steps']} timed steps per variant (few: gpt2 takes tens of seconds a step here), "
        f"variants interleaved over {data['repeats']} round(s). The machine was shared with other "
        "jobs: treat differences under ~20% as noise.",
        "",
        *([data["note"], ""] if data.get("note") else []),
        "**Caveat: gloo between processes on one 2-core CPU is not NCCL over NVLink.** The collectives "
        "run on the same cores as the compute and the ranks outnumber the cores at 4, so communication "
        "weighs far more here than on GPUs. docs/parallel.md predicts 8 H100s from a model instead.",
        "",
        "| model | ranks | scheme | tokens/s (median, min-max) | step ms | exposed comm ms (share) "
        "| peak RSS GiB/rank | params / grads / AdamW per rank (GiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data["results"]:
        t, sb = r["tokens_per_s"], r["state_bytes"]
        share = r["exposed_comm_ms"] / r["profiled_step_ms"] if r["profiled_step_ms"] else 0
        lines.append(
            f"| {r['model']} | {r['ranks']} | {r['scheme']} | {t['median']:.0f} ({t['min']:.0f}-"
            f"{t['max']:.0f}) | {r['step_ms']['median']:.0f} | {r['exposed_comm_ms']:.0f} "
            f"({100 * share:.0f}%) | {r['rss_peak_bytes'] / 2**30:.2f} | {gib(sb['params'])} / "
            f"{gib(sb['grads'])} / {gib(sb['optimizer'])} |"
        )
    for k in data.get("skipped", []):
        lines.append(
            f"| {k['model']} | {k['ranks']} | {k['scheme']} | skipped: the estimator predicts "
            f"{k['predicted_bytes'] / 2**30:.1f} GiB for all ranks, over half of the "
            f"{k['available_bytes'] / 2**30:.1f} GiB then available | | | | |"
        )
    lines += [
        "",
        "Exposed communication: the training thread's time inside collectives and FSDP2's "
        "gather/reduce ranges during one profiled step (their union), plus, under DDP, the "
        "backward's wait for its last all-reduce; its share is of that profiled step. Peak RSS "
        "includes the Python interpreter and torch (about 0.3 GiB).",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1, help="rounds over all variants (interleaved)")
    p.add_argument("--render", action="store_true", help="rewrite the .md from the saved .json")
    p.add_argument("--note", help="a sentence on this run for the results (what else loaded the machine)")
    # the worker's own flags (under torchrun)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--fsdp", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tp", default="1", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.render:
        return render_results(
            p, STEM.with_suffix(".json"), lambda d: write_md(STEM.with_suffix(".md"), render(d))
        )
    if min(args.steps, args.repeats, *args.ranks) < 1 or args.warmup < 0:
        p.error("--steps, --repeats and --ranks must be at least 1, --warmup at least 0")
    variants, skipped = [], []
    for m in args.models:
        for n in args.ranks:
            for s in args.schemes:
                need, free = predicted_bytes(m, s, n), available_bytes()
                if free is not None and need > MEMORY_SHARE * free:
                    skipped.append(
                        {
                            "model": m,
                            "scheme": s,
                            "ranks": n,
                            "predicted_bytes": need,
                            "available_bytes": free,
                        }
                    )
                    print(
                        f"skipped {m} {s} x{n}: predicted {need / 2**30:.1f} GiB for all ranks, over "
                        f"{100 * MEMORY_SHARE:.0f}% of the {free / 2**30:.1f} GiB available",
                        flush=True,
                    )
                else:
                    variants.append((m, s, n))
    rounds: dict = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:
            started = time.perf_counter()
            rounds[v].append(run(*v, warmup=args.warmup, steps=args.steps))
            print(
                f"{v}: {rounds[v][-1]['tokens_per_s']['median']:.0f} tok/s, "
                f"{time.perf_counter() - started:.0f} s",
                flush=True,
            )
    results = []
    for rs in rounds.values():  # the median repeat by tokens/s, its spread over all repeats' steps
        rs = sorted(rs, key=lambda r: r["tokens_per_s"]["median"])
        results.append(rs[len(rs) // 2])
    data = {
        "meta": stamp(sys.argv),
        "warmup": args.warmup,
        "steps": args.steps,
        "repeats": args.repeats,
        "results": results,
        "skipped": skipped,
        "note": args.note,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    save_json(STEM, data)
    STEM.with_suffix(".md").write_text(render(data))
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
