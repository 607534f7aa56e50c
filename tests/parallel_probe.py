"""Train minigpt's GPT (a tiny shape) a few steps under a parallel plan and write what the tests compare.

    torchrun --standalone --nproc_per_node 2 tests/parallel_probe.py OUT.json [--fsdp] [--tp N] ...
    python tests/parallel_probe.py OUT.json                      # the single-process reference

Every plan sees the same global batch per step (8 sequences from a fixed generator), split across
the data-parallel ranks; tensor-parallel ranks of one group see the same slice. The logged loss is
the mean over the data-parallel ranks, i.e. the loss of the global batch, so every plan should
give the single process's losses. Writes OUT.json (rank 0: losses) and OUT.rank{R}.json (each
rank: its coordinates, local parameter/grad/optimizer bytes, peak RSS, per-stage times).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from minigpt.core import parallel
from minigpt.core.checkpoint import load_sharded, save_sharded
from minigpt.core.model import GPT, GPTConfig

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--fsdp", action="store_true")
p.add_argument("--tp", type=int, default=1)
p.add_argument("--use-tensor-parallel", action="store_true")
p.add_argument("--steps", type=int, default=5)
p.add_argument("--first-step", type=int, default=0, help="the data of steps before it is skipped")
p.add_argument("--save", help="save a sharded checkpoint here after the last step")
p.add_argument("--load", help="load a sharded checkpoint before the first step")
p.add_argument("--batch", type=int, default=8, help="global batch")
p.add_argument("--seq", type=int, default=16)
p.add_argument("--shape", default="2,4,32,128,64", help="n_layers,n_heads,d_model,d_ff,vocab")
p.add_argument("--amp", action="store_true")
p.add_argument("--ac", action="store_true", help="activation checkpointing")
p.add_argument("--grad-accum", type=int, default=1)
args = p.parse_args()

world = parallel.world_size_from_env()
L, H, D, F, V = (int(v) for v in args.shape.split(","))
cfg = SimpleNamespace(
    fsdp=args.fsdp,
    tp=args.tp,
    use_tensor_parallel=args.use_tensor_parallel,
    n_heads=H,
    d_ff=F,
    compile=False,
    amp=args.amp,
    amp_dtype="bf16",
)
parallel.check_plan(cfg, world)  # before any process group
if world > 1:
    dist.init_process_group("gloo")
rank = dist.get_rank() if world > 1 else 0
tp = parallel.tp_degree(cfg, world)
mesh = parallel.build_mesh(world, tp, "cpu")
dp_rank, dp_size, tp_rank, _ = parallel.mesh_coords(rank, mesh)

torch.manual_seed(0)
model = GPT(
    GPTConfig(
        vocab_size=V,
        max_position_embeddings=args.seq,
        n_layers=L,
        n_heads=H,
        d_model=D,
        d_ff=F,
        activation_checkpoint=args.ac,
    )
)
train_model = parallel.parallelize(model, cfg, mesh, "cpu", "bf16" if args.amp else "fp32")
params = list(model.parameters())
groups = [
    {"params": [q for q in params if q.dim() >= 2], "weight_decay": 0.1},
    {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0},
]
optimizer = torch.optim.AdamW(parallel.split_by_mesh(groups), lr=1e-2, betas=(0.9, 0.95), fused=True)
first = args.first_step
if args.load:
    first = load_sharded(args.load, model, optimizer)["step"]

local = args.batch // dp_size
losses, times, grad_norms = [], [], []
autocast = torch.autocast("cpu", dtype=torch.bfloat16) if args.amp else torch.autocast("cpu", enabled=False)
dp_group = mesh["dp"].get_group() if mesh is not None else None
for step in range(first, first + args.steps):
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, V, (args.batch, args.seq + 1), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    rows = slice(dp_rank * local, (dp_rank + 1) * local)
    x, y = x[rows].contiguous(), y[rows].contiguous()  # own storages, as a data loader's
    t0 = time.perf_counter()
    micro = local // args.grad_accum
    total = torch.zeros(())
    for m in range(args.grad_accum):
        if args.fsdp:  # as straggler.Ranks.sync_gradients: the last micro-batch's backward reduces
            train_model.set_requires_gradient_sync(m == args.grad_accum - 1)
        elif hasattr(train_model, "require_backward_grad_sync"):  # DDP
            train_model.require_backward_grad_sync = m == args.grad_accum - 1
        with autocast:
            part = slice(m * micro, (m + 1) * micro)
            loss = train_model(x[part], y[part])[1] / args.grad_accum
        loss.backward()
        total += loss.detach().float()
    if world == 1:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    else:
        norm = parallel.clip_grad_norm(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if dp_group is not None and dp_size > 1:
        dist.all_reduce(total, group=dp_group)
        total /= dp_size
    times.append(time.perf_counter() - t0)
    losses.append(total.item())
    grad_norms.append(float(norm))

if args.save:
    save_sharded(args.save, model, optimizer, {"step": first + args.steps})

# One more step, measured (not in the losses) by minigpt.instruments.breakdown's capture: each rank's local
# parameter, gradient and AdamW-state bytes, its saved activations, and its peak, part by part.
# Nothing from the steps above dies in it (x and y live on), so the peak's rise over the start of
# the step is the allocator's own figure.
from minigpt.instruments.breakdown import capture_memory  # noqa: E402

del loss
with capture_memory(model, optimizer) as cap:
    with autocast:
        loss = train_model(x, y)[1]
    loss.backward()
    local_grads = parallel.local_state_bytes(model)["grads"]  # .grad after the backward: a cross-check
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
breakdown = cap.breakdown.to_record()
state_bytes = {c: breakdown[c] for c in ("params", "grads", "optimizer", "activations")}
activation_layout = cap.breakdown.activations
params_out = {}
if world == 1 or args.save:
    from torch.distributed.tensor import DTensor

    params_out = {
        n: (q.full_tensor() if isinstance(q, DTensor) else q).detach().flatten()[:64].tolist()
        for n, q in model.named_parameters()
    }
record = {
    "rank": rank,
    "worker": parallel.worker_name(rank, mesh),
    "dp": dp_rank,
    "dp_size": dp_size,
    "tp_rank": tp_rank,
    "tp": tp,
    "losses": losses,
    "grad_norms": grad_norms,
    "step_s": times,
    "state_bytes": state_bytes,
    "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
    "first_step": first,
    "params": params_out,
    "activation_layout": activation_layout,
    "activation_dtypes": cap.breakdown.activation_dtypes,
    "local_grads": local_grads,
    "peak": breakdown["peak"],
    "peak_parts": cap.breakdown.peak_parts,
    "start_bytes": breakdown["start_bytes"],
    "allocator_peak_delta": cap.breakdown.allocator_peak_delta,
}
with open(f"{args.out}.rank{rank}.json", "w") as f:
    json.dump(record, f)
if rank == 0:
    with open(args.out, "w") as f:
        json.dump(record, f)
if world > 1:
    dist.barrier()
    dist.destroy_process_group()
sys.exit(0)
